"""A GGUF file's 4-bit tensors as int4 codes, so that a quantized model is served as shipped instead of being
re-quantized from its de-quantized weights.

GGUF's Q4_0, Q4_1 and Q4_K blocks are groups of 32 weights along a row (the input dimension) with one 4-bit code
per weight and per group a scale and an offset; each maps exactly onto the int4 layout of
``quantize.Int4Linear`` (``w = (q - 8) * scale + zero``, q in 0..15):

- Q4_0 (18 bytes: fp16 ``d``, 16 bytes of codes): ``w = (q - 8) * d``: scale ``d``, zero 0;
- Q4_1 (20 bytes: fp16 ``d`` and ``m``, codes): ``w = q * d + m``: scale ``d``, zero ``m + 8 d``;
- Q4_K (144 bytes per 256 weights: fp16 ``d`` and ``dmin``, 8 six-bit scales and mins, codes):
  ``w = q * (d * sc) - dmin * mn`` per group of 32: scale ``d * sc``, zero ``8 * d * sc - dmin * mn``.

Within a 32-weight group the 16 code bytes hold weights 0-15 in their low nibbles and 16-31 in their high ones
(Q4_K: each 32-byte run holds two groups, the first in the low nibbles).

Which module a tensor belongs to is found by content, not by name: transformers de-quantizes the same file at
load (and reorders the rows of some tensors, e.g. Llama's query and key projections), so each row of a linear's
loaded weight equals, float for float, the de-quantization of exactly one GGUF row. A linear whose every row is
found takes those rows' codes, scales and zeros, in its own row order; any other stays for the re-quantizing
path. No server imports here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("saker.quantize")

GROUP = 32
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


@dataclass
class Int4Rows:
    """One GGUF tensor's rows as int4: codes (N, K) int32 in 0..15, scales and zeros (N, K / 32) float32."""

    name: str
    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """(q - 8) * scale + zero, in float32: what the int4 kernel computes with."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        return ((q - 8.0) * self.scales[..., None] + self.zeros[..., None]).view(n, k)


def _nibbles(qs: np.ndarray, runs: int) -> np.ndarray:
    """(blocks, runs * 16 or 32 bytes) of packed codes -> (blocks, runs * 2 groups, 32)-style code order:
    each run of ``width`` bytes gives ``width`` codes from the low nibbles, then ``width`` from the high ones."""
    blocks = qs.shape[0]
    width = qs.shape[1] // runs
    pairs = qs.reshape(blocks, runs, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (pairs & np.uint8(0x0F)).reshape(blocks, -1)


def decode_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes (rows, cols) uint8, scales and zeros (rows, cols / 32) float32 from a tensor's raw blocks."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if kind == "Q4_0":
        blocks = raw.reshape(-1, 18)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        codes = _nibbles(blocks[:, 2:], 1)
        scales, zeros = d, np.zeros_like(d)
    elif kind == "Q4_1":
        blocks = raw.reshape(-1, 20)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        codes = _nibbles(blocks[:, 4:], 1)
        scales, zeros = d, m + np.float32(8.0) * d
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        codes = _nibbles(blocks[:, 16:], 4)  # 4 runs of 32 bytes: 8 groups of 32
        group_scale = d * sc.astype(np.float32)  # (blocks, 8)
        group_min = dmin * mn.astype(np.float32)
        scales = group_scale.reshape(-1)
        zeros = (np.float32(8.0) * group_scale - group_min).reshape(-1)
    else:
        raise ValueError(f"not a 4-bit GGUF type: {kind}")
    return codes.reshape(rows, cols), scales.reshape(rows, cols // GROUP), zeros.reshape(rows, cols // GROUP)


def read_int4_tensors(path: str | Path) -> tuple[list[Int4Rows], "RowIndex"]:
    """Every Q4_0 / Q4_1 / Q4_K matrix of a GGUF file as int4 rows (others are left to the de-quantized path),
    and the index of their rows as gguf's own ``dequantize`` (what transformers loads) makes them."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors, index = [], RowIndex()
    for tensor in GGUFReader(str(path)).tensors:
        kind = tensor.tensor_type.name
        if kind not in FOUR_BIT or len(tensor.shape) != 2:
            continue
        cols, rows = (int(x) for x in tensor.shape)  # GGUF lists the fastest dimension first
        codes, scales, zeros = decode_blocks(kind, tensor.data, rows, cols)
        tensors.append(
            Int4Rows(
                tensor.name,
                kind,
                torch.from_numpy(codes.astype(np.int32)),
                torch.from_numpy(np.ascontiguousarray(scales)),
                torch.from_numpy(np.ascontiguousarray(zeros)),
            )
        )
        reference = dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols)
        index.add(tensors[-1], reference)
    return tensors, index


_MIX = np.random.default_rng(20261124).integers(1, 2**62, size=1 << 16, dtype=np.int64) | 1


def _row_keys(array: np.ndarray) -> list[int]:
    """A 64-bit fingerprint of each row's float32 bits (integer arithmetic, wrapping: exact and the same for
    equal rows whatever the matrix around them); a match is checked against the weights afterwards."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.int32).astype(np.int64)
    with np.errstate(over="ignore"):
        return (bits * _MIX[: bits.shape[1]]).sum(axis=1).tolist()


class RowIndex:
    """Where each de-quantized GGUF row lives: a row's fingerprint -> (tensor, row)."""

    def __init__(self):
        self.tensors: list[Int4Rows] = []
        self._where: dict[int, tuple[int, int]] = {}

    def add(self, tensor: Int4Rows, reference: np.ndarray) -> None:
        t = len(self.tensors)
        self.tensors.append(tensor)
        for r, key in enumerate(_row_keys(reference)):
            self._where.setdefault(key, (t, r))

    def lookup(self, weight: torch.Tensor) -> Int4Rows | None:
        """The int4 rows whose de-quantization is ``weight`` row for row, in its row order (None: some row is
        not a row of one GGUF 4-bit tensor)."""
        found = [self._where.get(key) for key in _row_keys(weight.detach().float().numpy())]
        if not found or any(f is None for f in found) or len({t for t, _ in found}) != 1:
            return None
        source = self.tensors[found[0][0]]
        order = np.fromiter((r for _, r in found), dtype=np.int64, count=len(found))
        if np.array_equal(order, np.arange(len(order))):
            return source

        def take(t: torch.Tensor) -> torch.Tensor:  # numpy's gather: torch's is ~100x slower on these int32 rows
            return torch.from_numpy(t.numpy()[order])

        return Int4Rows(source.name, source.kind, take(source.codes), take(source.scales), take(source.zeros))
