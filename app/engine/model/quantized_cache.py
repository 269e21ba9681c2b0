"""Quantized weights cached on disk, like the converted default model: the first start quantizes (or reads a GGUF
file's 4-bit codes) and writes the packed modules; later starts load them.

A cache folder is ``<cache root>/quantized/<key>``: ``weights.safetensors`` (the quantized modules' tensors, in
the packed layout of this PyTorch's kernels for the device served on), ``manifest.json`` (the modules and the
precision in words) and the checksums of both, checked at load as the converted default model's are. The key
covers what the packed tensors depend on: the quantization mode, the device type (CPU and CUDA pack int4
differently), the PyTorch version (the int4 packing is its own), and the source weights (each weight file's name,
size and modification time; a hub id with its revision where there is no folder). A damaged or unreadable folder
is quantized again; a cache that cannot be written costs one warning line and a quantization at each start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from app.engine.model.model_files import CHECKSUMS, damage, folder_checksums
from app.engine.model.quantize import int4_layout, quantize_model, quantized_state, restore_quantized

log = logging.getLogger("saker.quantize")

FORMAT = 2  # bump when the folder's layout changes (2: scales and zeros in bfloat16)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def source_identity(model_path: str, revision: str | None, gguf: str | None) -> list:
    """What the weights were loaded from, in a form that changes when they do."""
    facts: list = []
    folder = Path(model_path)
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and (path.suffix in WEIGHT_SUFFIXES or path.name == "config.json"):
                stat = path.stat()
                facts.append([path.name, stat.st_size, stat.st_mtime_ns])
    else:
        facts.append([model_path, revision])
    if gguf:
        stat = Path(gguf).stat()
        facts.append([str(Path(gguf).resolve()), stat.st_size, stat.st_mtime_ns])
    return facts


def cache_key(mode: str, source: list, device: torch.device | str = "cpu") -> str:
    kind = torch.device(device).type
    # the CPU's key is as it was before CUDA packing and saker's int4 kernel existed, so CPU caches already written
    # for PyTorch's layout stay valid; saker's int4 layout has a key of its own (its tiles of 8 outputs another)
    extra = ([] if kind == "cpu" else [kind]) + (
        ["saker-int4", "tiles-8"] if mode == "int4" and int4_layout(device) == "saker" else []
    )
    text = json.dumps([FORMAT, mode, torch.__version__, source] + extra, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load_or_quantize(
    model: torch.nn.Module,
    mode: str,
    root: Path,
    source: list,
    gguf: str | None = None,
    device: torch.device | str = "cpu",
) -> str:
    """Quantize ``model`` in place for ``device`` (from the cache when it holds this model, mode and device); the
    precision in words."""

    folder = root / "quantized" / cache_key(mode, source, device)
    if (folder / "manifest.json").is_file():
        problem = damage(folder)
        cached = None
        if problem is None:
            try:
                from safetensors.torch import load_file

                manifest = json.loads((folder / "manifest.json").read_text())
                cached = load_file(folder / "weights.safetensors"), manifest
            except Exception as exc:  # unreadable: quantized again (nothing of the model was touched yet)
                problem = f"{type(exc).__name__}: {exc}"
        if cached is not None:
            tensors, manifest = cached
            restore_quantized(model, tensors, manifest["modules"], device)
            log.info("quantized weights loaded from %s", folder)
            return manifest["precision"]
        log.warning("the quantized weights in %s are damaged (%s); quantizing again", folder, problem)
    precision = quantize_model(model, mode, gguf=gguf, device=device)
    _write(folder, model, precision)
    return precision


def _write(folder: Path, model: torch.nn.Module, precision: str) -> None:
    from safetensors.torch import save_file

    tensors, modules = quantized_state(model)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, tmp / "weights.safetensors")
        (tmp / "manifest.json").write_text(json.dumps({"precision": precision, "modules": modules}, indent=1))
        (tmp / CHECKSUMS).write_text(json.dumps(folder_checksums(tmp), indent=1))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        log.info("quantized weights written to %s", folder)
    except OSError as exc:
        log.warning(
            "cannot write the quantized weights into %s (%s); quantizing at each start (set SAKER_CACHE_DIR to "
            "a writable folder)",
            folder,
            exc.strerror or exc,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
