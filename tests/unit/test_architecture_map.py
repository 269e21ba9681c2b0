"""docs/architecture.md follows the tree: its file map names every module under app/ and tooling/ in a row of its
own (or in the row of its package's folder), every app/ and tooling/ path the page names exists, and the code names
it cites (a class's method or attribute, a module's function, a constant) are defined in app/ or tooling/. And the
server does not import the tooling: only app/__main__.py's forwards do, inside their functions."""

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("app", "tooling")


def file_map_first_cells() -> str:
    """The first cells of the table under "Where each behaviour lives", joined."""
    section = DOC.read_text().split("## Where each behaviour lives", 1)[1].split("\n## ", 1)[0]
    return " ".join(row.split(" | ")[0] for row in section.splitlines() if row.startswith("| `"))


def test_the_file_map_names_every_module_and_only_modules_that_exist():
    doc = DOC.read_text()
    named = set(re.findall(r"`((?:app|tooling)/[\w/.]+)`", doc))
    named |= set(re.findall(r"^\w[\w ]*?\s+((?:app|tooling)/[\w/.]+)", doc, re.M))
    gone = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"
    # a module counts as mapped only where the file map's first column names it or its folder (a mention of
    # `app/engine/` in the prose does not map every engine module)
    rows = set(re.findall(r"`([\w/.]+)`", file_map_first_cells()))
    folders = {p for p in rows if p.endswith("/")}
    unnamed = []
    tops = ("app/__init__.py", "app/__main__.py", "tooling/__init__.py")
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") and rel not in tops:
            continue
        if rel not in rows and not any(rel.startswith(folder) for folder in folders):
            unnamed.append(rel)
    assert not unnamed, f"modules missing from docs/architecture.md's file map (a row each): {unnamed}"


def _stores(tree: ast.AST) -> set[str]:
    """Every name a piece of code defines: functions, classes, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@cache
def code_names() -> tuple[dict[str, set[str]], dict[str, list[set[str]]], set[str]]:
    """(class -> its members, its bases' included; module stem -> the names each module of that stem defines;
    every name defined anywhere in app/ and tooling/)."""
    classes: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    modules: dict[str, list[set[str]]] = {}
    everything: set[str] = set()
    for path in (p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        defined = _stores(tree)
        everything |= defined
        if not path.name.startswith("__"):
            modules.setdefault(path.stem, []).append(defined)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).update(_stores(node))
                bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))

    def members(name: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(classes.get(name, ()))
        for base in bases.get(name, ()):
            if base in classes and base not in seen:
                out |= members(base, seen | {name})
        return out

    return {name: members(name) for name in classes}, modules, everything


def test_the_code_names_the_page_cites_exist():
    """`Class.member`, `module.function` and `CONSTANT` in docs/architecture.md name things app/ defines (the page
    once said `StoppingCriteria.ends` and `JSON_OPTIONS` long after both were renamed)."""
    classes, modules, everything = code_names()
    doc = DOC.read_text()
    wrong = []
    for cls, member in re.findall(r"`([A-Z]\w+)\.(\w+)(?:\(\))?`", doc):
        if cls in classes and member not in classes[cls]:
            wrong.append(f"{cls}.{member}")
    for module, name in re.findall(r"`([a-z_]+)\.([A-Za-z_]\w*)(?:\(\))?`", doc):
        if module in modules and name != "py" and not any(name in defined for defined in modules[module]):
            wrong.append(f"{module}.{name}")
    for constant in re.findall(r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)`", doc):
        if not constant.startswith("SAKER_") and constant not in everything:
            wrong.append(constant)
    assert not wrong, f"docs/architecture.md cites names app/ and tooling/ do not define: {sorted(set(wrong))}"


# -- the server does not import the tooling ---------------------------------------------------------------------------
def tooling_imports(source: str, forwards_allowed: bool = False) -> list[str]:
    """Where a module imports ``tooling`` (``import tooling.x``, ``from tooling... import``, ``from tooling import``,
    ``importlib.import_module("tooling...")``), as "line: module". With ``forwards_allowed`` (app/__main__.py), an
    import inside a function body is the forward and allowed; one at module level is not."""
    tree = ast.parse(source)
    inside = set()
    if forwards_allowed:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside |= {id(child) for child in ast.walk(node) if child is not node}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            if (name == "tooling" or name.startswith("tooling.")) and id(node) not in inside:
                found.append(f"{node.lineno}: {name}")
    return found


def test_the_server_does_not_import_the_tooling():
    """app/ imports tooling/ nowhere but in app/__main__.py's forwards (chat, bench, reliability), inside their
    functions: the server, wsgi.py and gunicorn.conf.py run without the tooling (the Docker image leaves it out)."""
    wrong = []
    for path in sorted([*(ROOT / "app").rglob("*.py"), ROOT / "wsgi.py", ROOT / "gunicorn.conf.py"]):
        rel = path.relative_to(ROOT).as_posix()
        hits = tooling_imports(path.read_text(), forwards_allowed=rel == "app/__main__.py")
        wrong += [f"{rel}:{hit}" for hit in hits]
    assert not wrong, "the server imports the tooling:\n" + "\n".join(wrong)
    forwards = tooling_imports((ROOT / "app" / "__main__.py").read_text())
    assert len(forwards) == 3, forwards  # chat, bench, reliability: the check sees them


def test_the_tooling_import_check_can_fail():
    """Each way of importing the tooling is caught, at module level and (outside app/__main__.py) in functions."""
    cases = [
        "import tooling.bench\n",
        "from tooling.sse import iter_json\n",
        "from tooling import processes\n",
        "import importlib\nimportlib.import_module('tooling.bench.cli')\n",
        "def f():\n    from tooling.tiny_models import build_gpt2\n",
    ]
    for source in cases:
        assert tooling_imports(source), source
    assert tooling_imports("from tooling import sse\n", forwards_allowed=True)  # module level: not a forward
    assert not tooling_imports("def bench():\n    from tooling.bench import cli\n", forwards_allowed=True)
    assert not tooling_imports("import toolingx\nfrom app.engine import tooling\n")
