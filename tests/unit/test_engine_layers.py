"""The engine's rooms and the one way its imports run (docs/architecture.md, "The engine's rooms").

app/engine/ holds a base (errors, params, events) and four rooms. Each layer imports only itself and the layers
below it, at module level and inside functions alike:

    base  <-  output  <-  model  <-  sampling  <-  core

and the engine imports nothing of the server (Flask, app.service, app.protocol, ...) nor of the tooling."""

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "app" / "engine"
ORDER = ["base", "output", "model", "sampling", "core"]
BASE = {"errors", "params", "events", "__init__"}


def layer_of(module: str) -> str | None:
    """The layer of an ``app.engine...`` module name (None for one outside the engine)."""
    parts = module.split(".")
    if parts[:2] != ["app", "engine"]:
        return None
    if len(parts) == 2 or parts[2] in BASE:
        return "base"
    return parts[2]


def imports(path: Path) -> list[str]:
    """Every module a file imports (``from app.engine.model import runner`` counts as app.engine.model.runner)."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def engine_files() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def test_every_engine_module_lives_in_the_base_or_a_room():
    stray = [
        p.relative_to(ROOT).as_posix()
        for p in engine_files()
        if p.parent == ENGINE and p.stem not in BASE or p.parent != ENGINE and p.parent.parent != ENGINE
    ]
    assert not stray, f"engine modules outside the base and the rooms: {stray}"
    assert {p.name for p in ENGINE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ORDER[1:])


def test_imports_run_one_way():
    wrong = []
    for path in engine_files():
        own = layer_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for module in imports(path):
            target = layer_of(module)
            if target is not None and ORDER.index(target) > ORDER.index(own):
                wrong.append(f"{path.relative_to(ROOT)} ({own}) imports {module} ({target})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


SERVER = ("flask", "werkzeug", "gunicorn", "app.service", "app.protocol", "app.responses", "app.api", "app.ui")
SERVER += ("app.settings", "app.log_config", "app.metrics", "app.errors", "app.batch")
SERVER += ("tooling",)


def outside(module: str) -> bool:
    """Whether an imported name belongs to the server or the tooling (``app.settings.Settings`` does)."""
    return module == "app" or any(module == s or module.startswith(s + ".") for s in SERVER)


def test_the_engine_imports_nothing_of_the_server_or_the_tooling():
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in engine_files()
        for module in imports(path)
        if outside(module)
    ]
    assert not wrong, wrong


def test_the_layering_check_sees_an_import_against_it(tmp_path):
    """The check can fail: a model file importing the core is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from app.engine.core.blocks import BlockManager\n")
    assert "app.engine.core.blocks.BlockManager" in imports(bad)
    assert ORDER.index(layer_of("app.engine.core.blocks.BlockManager")) > ORDER.index("model")
    assert outside("app.settings.Settings") and outside("flask.Flask") and not outside("app.engine.params")
