"""A converted model folder's integrity: the checksums of its files, written at conversion and checked at load
(the embedded model's folder, the int4 cache's folders)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHECKSUMS = "saker-checksums.json"


def folder_checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file of a converted folder (the manifest itself aside)."""
    sums = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != CHECKSUMS:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
            sums[path.name] = digest.hexdigest()
    return sums


def damage(folder: Path) -> str | None:
    """What is wrong with a converted folder (None: every file matches the checksums written at conversion)."""
    try:
        want = json.loads((folder / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return f"it has no readable {CHECKSUMS}"
    have = folder_checksums(folder)
    bad = sorted(name for name in want if have.get(name) != want[name])
    return f"{', '.join(bad)} does not match its checksum" if bad else None
