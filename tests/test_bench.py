"""Smoke test of the benchmark suite: ``python -m app bench --quick`` on the tiny model runs every CPU part
against a real gunicorn and writes the JSON it promises. Timings are never asserted (tests do not judge
wall-clock time); docs/performance.md holds the measured figures."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from servers import ROOT

pytestmark = pytest.mark.slow


def test_quick_bench_on_tiny_model_writes_report(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "app", "bench", "--quick", "--size", "tiny", "--only", "A,B,C,T,L,R,E",
         "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "bench.json").read_text())

    assert report["schema"] == 1 and report["quick"] is True and report["errors"] == {}
    assert report["parts"] == ["A", "B", "C", "T", "L", "R", "E"]
    for key in ("cpu_model", "cores", "torch", "torch_threads"):
        assert key in report["machine"]
    results = report["results"]
    assert set(results) == {"A", "B", "C", "T", "L", "R", "E"}

    def stats(s):
        assert s["n"] == len(s["values"]) > 0
        assert s["min"] <= s["median"] <= s["max"]

    a = results["A"]
    for key in ("server_ms_per_token", "generate_ms_per_token", "paired_ratio"):
        stats(a[key])
    assert isinstance(a["ratio"], float) and isinstance(a["met"], bool)
    assert a["same_text_as_generate"] is True           # the server's greedy text is generate()'s
    assert "prefill_ms" in a["server_timing_ms"] and "decode_ms" in a["server_timing_ms"]

    b = results["B"]
    stats(b["single_tokens_per_s"])
    stats(b["multi_tokens_per_s"])
    assert b["clients"] == 8 and isinstance(b["ratio"], float) and isinstance(b["met"], bool)

    c = results["C"]
    stats(c["round_trip_ms"])
    stats(c["forward_ms"])
    assert isinstance(c["overhead_ms"], float) and isinstance(c["met"], bool)

    t = results["T"]
    for key in ("ttft_ms", "server_prefill_ms", "ttft_minus_prefill_ms", "in_process_forward_ms"):
        stats(t[key])

    e = results["E"]
    (level,) = e["levels"]
    assert level["clients"] == 32 and level["ideal_tokens_per_s"] > 0
    for mode in ("greedy", "sampled"):
        assert level[mode]["requests"] == 32 and level[mode]["e"] > 0 and len(level[mode]["rounds_tokens_per_s"]) == 1
        assert isinstance(e[f"met_{mode}"], bool)
    levels = results["L"]["levels"]
    assert [lv["clients"] for lv in levels] == [1, 2, 4, 8, 16]
    for lv in levels:
        assert lv["requests"] >= lv["clients"]
        assert lv["latency_ms"]["p50"] <= lv["latency_ms"]["p90"] <= lv["latency_ms"]["p99"]
        assert lv["ttft_ms"]["n"] == lv["requests"]

    r = results["R"]
    for key in ("on_request_ms", "off_request_ms", "on_prefill_ms", "off_prefill_ms", "paired_ratio"):
        stats(r[key])
    assert r["off_cached_prompt_tokens"]["max"] == 0                 # the main server runs with the cache off
    assert r["on_cached_prompt_tokens"]["min"] >= r["context_tokens"]  # every measured request reused the context
    assert isinstance(r["ratio"], float)

    assert "| A | ratio server / generate() (median of pairs)" in report["table_markdown"]
    assert "ratio 8 / 1" in proc.stdout                  # the printed table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0
