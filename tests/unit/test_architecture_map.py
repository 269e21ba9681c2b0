"""docs/architecture.md's file map matches the tree: every module under app/ is named (itself, or its package's
folder), and every app/ path the page names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_file_map_names_every_module_and_only_modules_that_exist():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(app/[\w/.]+)`", doc)) | set(re.findall(r"^\w[\w ]*?\s+(app/[\w/.]+)", doc, re.M))
    gone = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"
    folders = {p for p in named if p.endswith("/")}
    unnamed = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") and rel != "app/__init__.py":
            continue
        if rel not in named and not any(rel.startswith(folder) for folder in folders):
            unnamed.append(rel)
    assert not unnamed, f"modules missing from docs/architecture.md's file map: {unnamed}"
