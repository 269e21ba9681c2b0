"""The shapes a compiled step runs with, so that rows joining and leaving never compile a new graph: batch buckets
(rows padded up to one of a few sizes) and, on the CPU, attention windows (positions padded up to one of a few
widths)."""

from __future__ import annotations

BUCKETS = (1, 2, 4, 8, 16, 24, 32)
WINDOW_MIN = 256  # the smallest attention window of a compiled step; the windows double up to the capacity


def windows(capacity: int) -> tuple[int, ...]:
    """The attention windows a compiled step runs with: 256, 512, ... below ``capacity``, then ``capacity``."""
    out, size = [], WINDOW_MIN
    while size < capacity:
        out.append(size)
        size *= 2
    return (*out, capacity)


def window(longest: int, capacity: int) -> int:
    """The smallest window that holds ``longest`` positions. A compiled step attends over its window rather than
    the whole context (8,192 positions for SmolLM2): on the CPU a 512-position window made the embedded
    model's step 13.6-14.1 ms against 18-20 eager, where the whole capacity made it 220 ms."""
    size = WINDOW_MIN
    while size < longest:
        size *= 2
    return min(size, capacity)


def bucket(rows: int) -> int:
    """Batch sizes a compiled step is captured for: 1, 2, 4, 8, 16, 24, 32, then multiples of 8."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return -(-rows // 8) * 8
