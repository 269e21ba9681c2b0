"""The fixed-order float32 attention kernel (``paged_attention.cpp``): built with PyTorch's C++ extension loader at
its first use (about 20 s; then cached, keyed by the source), and None where it cannot be (no C++ compiler or ninja,
no AVX2 and FMA): ``attention.py`` then computes in float64.

``attend`` is also a ``torch.library`` custom op (``saker::paged_attention``), so that a compiled step keeps it as
one opaque call."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("saker.worker")

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def kernel():
    """The built extension (``attend``, ``supports``), or None when it cannot be built here (said once in the log)."""
    if "kernel" in _state:
        return _state["kernel"]
    with _lock:
        if "kernel" not in _state:
            _state["kernel"] = _build()
    return _state["kernel"]


def _build():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("exact attention in float64: this CPU lacks AVX2 (the float32 kernel needs it)")
        return None
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path  # requirements.txt's ninja
    try:
        return load(
            name=f"saker_paged_attention_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build
        log.warning(
            "exact attention in float64: the float32 kernel could not be built (%s: %s)", type(exc).__name__, exc
        )
        return None
    finally:
        os.environ["PATH"] = path


def supports(head_dim: int) -> bool:
    """Whether the kernel is built and handles this head dim (16, 32, 64 or 128)."""
    ext = kernel()
    return ext is not None and bool(ext.supports(head_dim))


@torch.library.custom_op("saker::paged_attention", mutates_args=())
def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    which: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q (T, Hq, D) float32; keys, values (slots, Hkv, D): the pool's layer, slots in blocks of ``BLOCK``; tables
    (R, B) block ids; which (T,) each query's table row; lo, hi (T,): the positions each query attends over,
    ``[lo, hi)``. Returns (T, Hq, D) float32; a query with no position gets zeros."""
    return kernel().attend(q, keys, values, tables, which, lo, hi, scale)


@attend.register_fake
def _(q, keys, values, tables, which, lo, hi, scale):
    return torch.empty_like(q)


def call(q, keys, values, tables, which, lo, hi, scale: float) -> torch.Tensor:
    """``attend``: through the custom op while compiling, straight into the extension otherwise (the op's dispatch
    costs more than a small call)."""
    if torch.compiler.is_compiling():
        return attend(q, keys, values, tables, which, lo, hi, scale)
    return kernel().attend(q, keys, values, tables, which, lo, hi, scale)
