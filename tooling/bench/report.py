"""The report: the printed table (and its markdown copy in bench.json), the JSON file and the plot. Each part
writes its own rows (``rows`` in its module) and panels (``PANELS``); this module lays them out."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tooling.bench import parts

Row = tuple[str, str, str, str, str]  # part, measure, median, spread, goal/result
# the plot's panels, latency first (the table follows the order of the parts)
PLOT_ORDER = ("L", "A", "T", "C", "S", "D")


def met(value: bool | None) -> str:
    return {True: "met", False: "NOT met", None: ""}[value]


def table_rows(report: dict) -> list[Row]:
    """(part, measure, median, spread, goal/result) rows: the parts that ran, the profiles, the failures."""
    from tooling.bench import profile

    results = report["results"]
    rows: list[Row] = []
    for letter in parts.ALL_PARTS:
        if letter in results:
            rows += parts.module(letter).rows(results[letter])
    rows += profile.rows(results)
    for part, message in report["errors"].items():
        rows.append((part, "FAILED", "-", message[:100], ""))
    return rows


def format_table(report: dict) -> str:
    header = ("part", "measure", "median", "spread", "goal")
    rows = [header] + table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    lines = ["| part | measure | median | spread | goal |", "|---|---|---|---|---|"]
    for row in table_rows(report):
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    return "\n".join(lines)


def bars(ax, names: list[str], series: list[dict], colors: list[str], low: str = "min", high: str = "max") -> None:
    """Medians as bars, with error bars from ``low`` to ``high`` of each summary (for the parts' panels)."""
    meds = [s["median"] for s in series]
    errs = [[s["median"] - s[low] for s in series], [s[high] - s["median"] for s in series]]
    ax.bar(names, meds, yerr=errs, capsize=6, color=colors[: len(names)])


def plot(report: dict, path: Path) -> bool:
    """One panel or two per part that ran and draws (latency and throughput vs clients, A's two sides, TTFT vs
    prefill, ...); False when matplotlib is missing or nothing draws."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    r = report["results"]
    panels = [draw for letter in PLOT_ORDER if letter in r for draw in getattr(parts.module(letter), "PANELS", ())]
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(5.0 * cols, 7.0), 4.2 * rows + 0.6), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    for ax, draw in zip(flat, panels, strict=False):
        draw(ax, r)
    machine = report["machine"]
    fig.suptitle(
        f"saker bench {report['started']}"
        + (" (quick)" if report["quick"] else "")
        + f"\n{machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(report: dict, out_dir: Path, stem: str) -> tuple[Path, Path | None]:
    """``<stem>.json`` (with the table as markdown) and ``<stem>.png`` when it could be drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    png_path = out_dir / f"{stem}.png"
    report["table_markdown"] = markdown_table(report)
    json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return json_path, png_path if plot(report, png_path) else None


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def elapsed(report: dict) -> str:
    """How long the run took, and each part (what a run costs on this machine: the bench states no estimate)."""
    per_part = [
        f"{name} {_duration(result['seconds'])}"
        for name, result in report["results"].items()
        if isinstance(result, dict) and "seconds" in result
    ]
    line = f"bench took {_duration(report['duration_s'])}" + (" (--quick)" if report.get("quick") else "")
    return line + (f": {', '.join(per_part)}" if per_part else "")
