"""Smoke test of the benchmark suite: ``python -m app bench --quick`` on the tiny model runs every CPU part
against a real gunicorn and writes the JSON it promises; part S (structured outputs) runs on the embedded SmolLM2.
Timings are never asserted (tests do not judge wall-clock time); docs/performance.md holds the measured figures.
The report's table and the parts' options are checked without running anything in tests/unit/test_bench.py."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys

import pytest

from tooling.bench.parts.s_grammar import compile_schema
from servers import ROOT


HANG_S = 1800  # a bench subprocess still running after this is taken for hung


@pytest.mark.slow
@pytest.mark.timeout(HANG_S + 120)
def test_quick_bench_on_tiny_model_writes_report(tmp_path):
    """The quick run of the CPU parts on the tiny model; the assertions are on the report's shape. The time limit
    only catches a hang (51 s on a quiet machine; a loaded shared one makes every server start and step slower)."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "bench",
            "--quick",
            "--size",
            "tiny",
            "--only",
            "A,B,C,T,L,R,E",
            "--out-dir",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
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
    assert a["same_text_as_generate"] is True  # the server's greedy text is generate()'s
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
    assert r["off_cached_prompt_tokens"]["max"] == 0  # the main server runs with the cache off
    assert r["on_cached_prompt_tokens"]["min"] >= r["context_tokens"]  # every measured request reused the context
    assert isinstance(r["ratio"], float)
    assert r["sides"] == {"on": "prefix cache on", "off": "prefix cache off"}

    assert "| A | ratio server / generate() (median of pairs)" in report["table_markdown"]
    assert "ratio 8 / 1" in proc.stdout  # the printed table
    assert "bench took " in proc.stdout.splitlines()[-1]  # and how long the run took
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(HANG_S + 120)
def test_quick_bench_structured_outputs(tmp_path, saker_cache):
    """Part S on SmolLM2 (the converted folder the other SmolLM2 tests use, linked into the bench's cache). The
    assertions are on the report's shape; the time limit only catches a hang (a loaded machine once took the quick
    run past 540 s)."""
    from app.engine.model.loader import ensure_default_model
    from app.settings import Settings

    smol = ensure_default_model(Settings(cache_dir=str(saker_cache)))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smol.name).symlink_to(smol, target_is_directory=True)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "bench",
            "--quick",
            "--only",
            "S",
            "--out-dir",
            str(out),
            "--cache-dir",
            str(cache),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the bench stops its gunicorn on Ctrl-C (not on a kill)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"bench --quick --only S ran past {HANG_S} s (hung?):\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["parts"] == ["S"] and report["errors"] == {} and set(report["results"]) == {"S"}
    s = report["results"]["S"]
    assert s["max_tokens"] == 96 and s["schema_bytes"] == len(json.dumps(s["schema"]))
    assert [lv["clients"] for lv in s["levels"]] == [1, 8]
    stops = 0
    for lv in s["levels"]:
        free, constrained, same = lv["free"], lv["json"], lv["same"]
        assert free["requests"] == constrained["requests"] == lv["requests_per_side_per_round"] == lv["clients"]
        assert free["mean_completion_tokens"] == 96 and free["finish_reasons"] == {"length": free["requests"]}
        assert 0 < constrained["mean_completion_tokens"] <= 96
        # the free side cut to the constrained answers' lengths generates exactly as many tokens
        assert same["mean_completion_tokens"] == constrained["mean_completion_tokens"]
        assert same["finish_reasons"] == {"length": same["requests"]} and isinstance(lv["ratio_same_lengths"], float)
        assert set(constrained["finish_reasons"]) <= {"stop", "length"}
        # an answer the grammar ended is a complete JSON object
        assert constrained["valid_json"] == constrained["finish_reasons"].get("stop", 0)
        stops += constrained["valid_json"]
        for side in (free, constrained, same):
            assert side["tokens_per_s"]["n"] == 1 and side["tokens_per_s"]["median"] > 0
        assert isinstance(lv["ratio"], float) and isinstance(lv["met"], bool) and lv["goal"] == 0.9
    assert stops >= 1
    compile_ = s["compile"]
    assert compile_["schema_bytes"] == len(json.dumps(compile_schema())) and compile_["vocab"] == 49152
    for key in ("tokenizer_build_ms", "first_ms", "cached_ms", "first_mask_ms", "new_schema_warm_ms"):
        assert compile_[key]["n"] == 3
    assert s["per_step"]["steps"] > 0 and set(s["per_step"]["sampler_mask_ms"]) == {"1", "8"}
    assert "| S | 8 clients: ratio constrained / free (median of rounds)" in report["table_markdown"]
    assert "S 1 client" in report["goals"] and "S 8 clients" in report["goals"]
