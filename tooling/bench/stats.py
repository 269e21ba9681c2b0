"""Statistics of the figures: medians with their spread, latency percentiles, the server's own timings."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], digits: int = 3) -> dict:
    if not values:
        return {"n": 0}
    out = {
        "median": round(statistics.median(values), digits),
        "p25": round(percentile(values, 25), digits),
        "p75": round(percentile(values, 75), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }
    if len(values) <= 60:  # every repetition, in order (long series only summarized)
        out["values"] = [round(v, digits) for v in values]
    return out


def latency_summary(values: list[float], digits: int = 2) -> dict:
    if not values:
        return {"n": 0}
    return {
        "p50": round(percentile(values, 50), digits),
        "p90": round(percentile(values, 90), digits),
        "p99": round(percentile(values, 99), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }


def timing_summary(timings: list[dict], tokens: int | None) -> dict:
    out = {}
    for key in ("queue_ms", "prefill_ms", "decode_ms"):
        values = [t[key] for t in timings if key in t]
        if values:
            out[key] = summary(values)
    if tokens and "decode_ms" in out:
        out["decode_ms_per_token"] = round(out["decode_ms"]["median"] / max(tokens - 1, 1), 3)
    return out


def med(s: dict | None) -> str:
    """A summary's median for the table ('-' when it has no values)."""
    return f"{s['median']:g}" if s and s.get("n") else "-"


def spread(s: dict | None) -> str:
    """A summary's spread for the table: interquartile range, range, count."""
    if not s or not s.get("n"):
        return ""
    return f"IQR {s['p25']:g}-{s['p75']:g}, range {s['min']:g}-{s['max']:g}, n={s['n']}"
