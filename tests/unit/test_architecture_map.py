"""docs/architecture.md follows the tree: its file map names every module under app/ in a row of its own (or in
the row of its package's folder), every app/ path the page names exists, and the code names it cites (a class's
method or attribute, a module's function, a constant) are defined in app/."""

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def file_map_first_cells() -> str:
    """The first cells of the table under "Where each behaviour lives", joined."""
    section = DOC.read_text().split("## Where each behaviour lives", 1)[1].split("\n## ", 1)[0]
    return " ".join(row.split(" | ")[0] for row in section.splitlines() if row.startswith("| `"))


def test_the_file_map_names_every_module_and_only_modules_that_exist():
    doc = DOC.read_text()
    named = set(re.findall(r"`(app/[\w/.]+)`", doc)) | set(re.findall(r"^\w[\w ]*?\s+(app/[\w/.]+)", doc, re.M))
    gone = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"
    # a module counts as mapped only where the file map's first column names it or its folder (a mention of
    # `app/engine/` in the prose does not map every engine module)
    rows = set(re.findall(r"`([\w/.]+)`", file_map_first_cells()))
    folders = {p for p in rows if p.endswith("/")}
    unnamed = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") and rel not in ("app/__init__.py", "app/__main__.py"):
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
    every name defined anywhere in app/)."""
    classes: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    modules: dict[str, list[set[str]]] = {}
    everything: set[str] = set()
    for path in (ROOT / "app").rglob("*.py"):
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
    assert not wrong, f"docs/architecture.md cites names app/ does not define: {sorted(set(wrong))}"
