"""saker's CPU kernels (``kernels/``): the fixed-order float32 attention over the block pool
(``kernels/paged_attention.cpp``), an int8 linear with float32 outputs (``kernels/int8_linear.cpp``, the LM head
of the int4/int8 models), the int4 linear by integer dot products (``kernels/int4_linear.cpp``, every other linear
of an int4 model), the raw logprobs' log-softmax (``kernels/log_softmax.cpp``) and the sampler's choice of each row's
token (``kernels/sampler.cpp``). Built with PyTorch's C++
extension loader at the first use (about 40 s; then cached, keyed by the sources and flags), and None where they
cannot be (no C++ compiler or ninja, or PyTorch's CPU capability below AVX2, e.g. ``ATEN_CPU_CAPABILITY=default``):
attention then computes in float64 (``attention.py``), the head keeps PyTorch's bfloat16 kernel, the int4 linears
PyTorch's (bfloat16 inputs), the log-softmax is PyTorch's in float64 (``logprobs.py``) and the sampler PyTorch's
operations (``sampler.py``).

One answer on every instruction set: every kernel is built with ``-mavx2 -mfma`` (``FLAGS``), never for the build
machine (no ``-march=native``). The int4 and int8 linears also carry AVX-512 paths (GCC target regions in the same
sources), taken at run time where the CPU has AVX-512 VNNI and PyTorch runs AVX512 (``wide``): they compute each
output by the AVX2 path's operations lane by lane, in more lanes, so they give the same bits
(tests/unit/test_cpu_kernels.py compares the two paths). What changes with the CPU is PyTorch's own kernels (its
dispatch picks AVX-512 or AVX2 at run time; ``ATEN_CPU_CAPABILITY`` lowers it, and saker's wide paths with it):
tests/unit/test_instruction_sets.py runs the width and accuracy checks under each capability the CPU has.

They are also ``torch.library`` custom ops (``saker::paged_attention``, ``saker::int8_linear``,
``saker::int4_linear``), so that a compiled step keeps each as one opaque call."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("saker.worker")

SOURCES = [
    Path(__file__).parent / "kernels" / f
    for f in (
        "paged_attention.cpp",
        "int8_linear.cpp",
        "int4_linear.cpp",
        "log_softmax.cpp",
        "sampler.cpp",
        "decoder_ops.cpp",
        "decoder_layers.cpp",
        "bindings.cpp",
    )
]
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def kernel():
    """The built extension, or None when it cannot be built here (said once in the log)."""
    if "kernel" in _state:
        return _state["kernel"]
    with _lock:
        if "kernel" not in _state:
            _state["kernel"] = _build()
    return _state["kernel"]


def _build():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        log.warning(
            "no CPU kernels: PyTorch's CPU capability is %s, not AVX2 (attention and the logprobs' log-softmax in "
            "float64, the LM head in bfloat16)",
            capability,
        )
        return None
    from torch.utils.cpp_extension import get_default_build_root, load

    headers = sorted(SOURCES[0].parent.glob("*.h"))
    # keyed by the sources, the flags and where the sources are: two checkouts of the same code (a CI clone beside a
    # working tree) built under one name would rebuild each other's extension at every load (torch's build.ninja
    # names the sources' paths)
    sources = b"".join(p.read_bytes() for p in [*SOURCES, *headers])
    digest = hashlib.sha256(sources + " ".join(FLAGS).encode() + str(SOURCES[0].parent.resolve()).encode())
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path  # requirements.txt's ninja
    name = f"saker_cpu_kernels_{digest.hexdigest()[:12]}"
    try:
        build = Path(get_default_build_root()) / name
        build.mkdir(parents=True, exist_ok=True)
        # one build at a time across processes, under a lock the kernel releases when its holder dies: inside it,
        # a baton file torch's loader left (``lock``: a process killed while it built) is stale, and would make
        # every later load wait for it forever
        with open(build / "saker-build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            return load(
                name=name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a failed build
        log.warning(
            "no CPU kernels: they could not be built (%s: %s); attention and the logprobs' log-softmax in float64, "
            "the LM head in bfloat16",
            type(exc).__name__,
            exc,
        )
        return None
    finally:
        os.environ["PATH"] = path


def supports(head_dim: int) -> bool:
    """Whether the attention kernel is built and handles this head dim (16, 32, 64 or 128)."""
    ext = kernel()
    return ext is not None and bool(ext.attention_supports(head_dim))


def _through_op() -> bool:
    """Whether a kernel is called through its ``torch.library`` op rather than straight into the extension (which
    costs less for a small call): while compiling (the op is one opaque node), and while torch.profiler records
    (so that its table names the kernel instead of leaving its time out)."""
    return torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled()


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
    return kernel().paged_attention(q, keys, values, tables, which, lo, hi, scale)


@attend.register_fake
def _(q, keys, values, tables, which, lo, hi, scale):
    return torch.empty_like(q)


def call(q, keys, values, tables, which, lo, hi, scale: float) -> torch.Tensor:
    """``attend``: through the custom op while compiling or profiling (``_through_op``), straight into the extension
    otherwise (the op's dispatch costs more than a small call)."""
    if _through_op():
        return attend(q, keys, values, tables, which, lo, hi, scale)
    return kernel().paged_attention(q, keys, values, tables, which, lo, hi, scale)


def wide() -> bool:
    """Whether the int4 and int8 linears take their AVX-512 paths: where the CPU has AVX-512 VNNI and PyTorch runs
    AVX512 (so ``ATEN_CPU_CAPABILITY=avx2`` lowers saker's kernels with PyTorch's). Their outputs are the AVX2
    paths' bits (tests/unit/test_cpu_kernels.py)."""
    if "wide" not in _state:
        ext = kernel()
        _state["wide"] = bool(
            ext is not None and ext.wide_supported() and torch.backends.cpu.get_cpu_capability() == "AVX512"
        )
    return _state["wide"]


@torch.library.custom_op("saker::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return kernel().int8_linear(x, weight, scales, wide())


@_int8_linear_op.register_fake
def _(x, weight, scales):
    return x.new_empty(x.shape[0], weight.shape[0])


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 @ (weight (N, K) int8 x scales (N,)).T -> (M, N) float32, each output in a fixed order
    (the same bits whatever M is); through the custom op ``saker::int8_linear`` while compiling."""
    if _through_op():
        return _int8_linear_op(x, weight, scales)
    return kernel().int8_linear(x, weight, scales, wide())


@torch.library.custom_op("saker::int4_linear", mutates_args=())
def _int4_linear_op(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    return kernel().int4_linear(x, weight, scales, mins, wide())


@_int4_linear_op.register_fake
def _(x, weight, scales, mins):
    return x.new_empty(x.shape[0], weight.shape[0])


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 @ W.T -> (M, N) float32 for int4 codes in groups of 32 (``w = q * scale + min``; weight
    (N, K / 2) uint8, scales, mins (N, K / 32) float32, in ``quantize.pack_int4_cpu``'s tiles): each row of x
    quantized to int16 per group and multiplied in integers (``kernels/int4_linear.cpp``), the groups summed in a
    fixed order (the same bits whatever M is); through the custom op ``saker::int4_linear`` while compiling."""
    if _through_op():
        return _int4_linear_op(x, weight, scales, mins)
    return kernel().int4_linear(x, weight, scales, mins, wide())


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x (M, V) float32 -> (M, V) float32, each row's log-softmax: its normaliser summed in float64 in one fixed
    order (``kernels/log_softmax.cpp`` says why PyTorch's float32 one is not used), the same bits whatever M is
    and on every CPU that runs the kernels."""
    return kernel().log_softmax(x)


def sample_tokens(scores, greedy, temperature, top_k, top_p, log_min_p, seeds, steps) -> torch.Tensor:
    """Each row's token from its scores (B, V) float32 (masks, biases and penalties applied): the first argmax for a
    ``greedy`` row; for a sampled one temperature, top-k, top-p, min-p and the counter-based draw of its ``seeds``
    and ``steps`` (``kernels/sampler.cpp``; per-row columns (B,)). (B,) int64."""
    return kernel().sample_tokens(scores, greedy, temperature, top_k, top_p, log_min_p, seeds, steps)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first argmax of scores (B, V) float32, as ``torch.argmax`` answers (the first NaN where there is
    one), the rows shared by the threads and each row read in 8 lanes (``kernels/sampler.cpp``'s ``first_max``):
    PyTorch's took 1.4 ms for 32 rows of 49,152. (B,) int64."""
    return kernel().argmax_rows(scores)


# -- a decoder layer's small operations (``kernels/decoder_ops.cpp``, used by ``fused_forward``) --------------------
def sums_in_order() -> bool:
    """Whether the norms reproduce PyTorch's float32 sum of a row (the order the kernel knows: ATen's cascade over
    8-lane vectors) rather than calling it (``x.pow(2).mean(-1)`` from the kernel: the same bits, about 12 us more a
    call). Under both AVX2 and AVX512: ATen registers no AVX-512 variant of its sum kernel, so the AVX2 one serves
    AVX512 too (tests/unit/test_instruction_sets.py checks the bits under each capability the CPU has)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@torch.library.custom_op("saker::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, in_order: bool) -> torch.Tensor:
    return kernel().rms_norm(x, weight, eps, in_order)


@_rms_norm_op.register_fake
def _(x, weight, eps, in_order):
    return torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, in_order: bool) -> torch.Tensor:
    """x (T, D), weight (D,) float32 -> transformers' RMSNorm of each row, to the bit (its mean of squares
    PyTorch's, reproduced when ``in_order``: ``sums_in_order()``, asked once outside any compiled code)."""
    if _through_op():
        return _rms_norm_op(x, weight, eps, in_order)
    return kernel().rms_norm(x, weight, eps, in_order)


@torch.library.custom_op("saker::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_order: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel().add_rms_norm(x, residual, weight, eps, in_order)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, in_order):
    return torch.empty_like(x), torch.empty_like(x)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_order: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream between two sublayers: ``(rms_norm(residual + x), residual + x)``."""
    if _through_op():
        return _add_rms_norm_op(x, residual, weight, eps, in_order)
    return kernel().add_rms_norm(x, residual, weight, eps, in_order)


@torch.library.custom_op("saker::rotary_write", mutates_args=("keys", "values"))
def _rotary_write_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    write: torch.Tensor,
) -> torch.Tensor:
    return kernel().rotary_write(q, k, v, cos, sin, keys, values, write)


@_rotary_write_op.register_fake
def _(q, k, v, cos, sin, keys, values, write):
    return torch.empty_like(q)


def rotary_write(q, k, v, cos, sin, keys, values, write) -> torch.Tensor:
    """q (T, Hq, D), k and v (T, Hkv, D), cos and sin (T, D), one layer's pool ``keys`` and ``values`` (slots, Hkv,
    D), ``write`` (T,) pool slots: q and k rotated as transformers' ``apply_rotary_pos_emb`` does, the rotated k
    and v written at their slots (in place); returns the rotated q."""
    if _through_op():
        return _rotary_write_op(q, k, v, cos, sin, keys, values, write)
    return kernel().rotary_write(q, k, v, cos, sin, keys, values, write)
