"""The benchmark suite's parts, plan, report table and options (app/bench/), checked without running a bench:
part S's schemas, the table's rows, --help and the parts read from one definition, --quick's plan, R against a
stub server, part K's plan and goal check. The quick bench run for real is in tests/live/test_bench_run.py."""

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

from app.bench import cli, parts, plan
from app.bench import report as bench_report
from app.bench.parts import s as part_s
from app.bench.parts.s_grammar import compile_schema
from servers import ROOT


def parts_of(only=None, gpu=False):
    return cli.parse_parts(argparse.Namespace(only=only, gpu=gpu))


def test_parts_include_s():
    assert "S" in parts_of() and parts_of()[-2:] == ("S", "M")
    assert parts_of(gpu=True)[-3:] == ("S", "M", "D")
    assert parts_of("s, a") == ("A", "S")
    with pytest.raises(SystemExit):
        parts_of("S,X")


def test_part_m_reads_its_goal_from_the_gaps():
    from app.bench.parts import m

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


def test_plan_s_full_and_quick():
    full, quick = plan.Plan(), plan.Plan.quick()
    assert (full.s_rounds, full.s_clients, full.s_tokens) == (3, 8, 96)
    assert (quick.s_rounds, quick.s_clients, quick.s_tokens) == (1, 8, 96)
    assert plan.GOALS["S 1 client"] == plan.GOALS["S 8 clients"] == (">=", 0.9)


def test_s_schemas_are_valid_and_compile():
    from app.engine.grammar import grammar_text
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
    import app.bench

    proc = subprocess.run(
        [sys.executable, "-m", "app", "bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    help_text = " ".join(proc.stdout.split())  # argparse wraps lines
    default = ",".join(parts.DEFAULT_PARTS)
    assert parts.DEFAULT_PARTS == parts.ALL_PARTS[:-1] and parts.GPU_PARTS == ("D",)
    assert f"default {default}" in help_text and f"default {default}" in app.bench.__doc__
    assert parts.overview() in app.bench.__doc__
    for part in parts.PARTS:
        assert f" {part.letter} {part.title}" in help_text and f"  {part.letter}  {part.title}" in app.bench.__doc__
    assert parts_of() == parts.DEFAULT_PARTS and parts_of(gpu=True) == parts.ALL_PARTS


def test_every_part_has_its_module():
    for part in parts.PARTS:
        module = parts.module(part.letter)
        assert module.__name__ == f"app.bench.parts.{part.letter.lower()}"
        assert module.__doc__.startswith(part.letter) and callable(module.run) and callable(module.rows)


# -- issue 13: --quick promises no time and spends none replacing repetitions ----------------------------------------
def test_quick_plan_has_no_budgets_and_does_less():
    full, quick = plan.Plan(), plan.Plan.quick()
    assert set(quick.budgets()) == {"a_budget", "t_budget", "b_budget", "c_budget", "l_budget", "s_budget", "k_budget"}
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
    from app.bench.runner import Bench

    fake = SimpleNamespace(cpu=_BusyCpu(), log=lambda message: None)
    assert len(Bench.repeat(fake, lambda i: i, reps=3, extra=3, budget=0.0)) == 3
    assert len(Bench.repeat(fake, lambda i: i, reps=3, extra=3, budget=60.0)) == 6


def test_elapsed_line():
    run = {"duration_s": 185.4, "quick": True, "results": {"A": {"seconds": 20.2}, "C": {"seconds": 4}}}
    assert bench_report.elapsed(run) == "bench took 3 min 05 s (--quick): A 20 s, C 4 s"
    assert bench_report.elapsed({"duration_s": 9.0, "results": {}}) == "bench took 9 s"


# -- issue 13: R against a server the bench did not start says what it measured -------------------------------------
def test_r_sides_are_labelled_with_what_is_known():
    from app.bench.parts import r

    def bench(env=None, external=False):
        return SimpleNamespace(external=external, main_name="m", server_info={"m": {"env": env or {}}})

    assert r.main_side(bench(external=True)) == ("served", "as served (cache not set by the bench)")
    assert r.main_side(bench({"SAKER_PREFIX_CACHE_TOKENS": "0"})) == ("off", "prefix cache off")
    key, label = r.main_side(bench({"SAKER_PREFIX_CACHE_TOKENS": "4096"}))  # --server-env turned it on
    assert key == "main" and "off" not in label and "SAKER_PREFIX_CACHE_TOKENS=4096" in label


def test_prefix_counters_from_metrics_text():
    from app.bench.parts import r

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
    from app.bench.parts import k

    line = "part K skipped: build llama.cpp's server with scripts/build-llama-server.sh"
    binary = tmp_path / "bin" / "llama-server"
    assert k.skip_line(binary) == line  # missing
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    assert k.skip_line(binary) == line  # not executable
    binary.chmod(0o755)
    assert k.skip_line(binary) is None

    monkeypatch.setenv("SAKER_LLAMA_DIR", str(tmp_path / "nothing-built"))
    logged: list[str] = []
    bench = SimpleNamespace(plan=plan.Plan.quick(), log=logged.append)
    result = k.run(bench)  # starts nothing
    assert result["skipped"] == line and logged == [line]
    report = {"results": {"K": result}, "errors": {}}
    assert bench_report.table_rows(report) == [("K", "saker vs llama.cpp's server", "-", line, "")]


def _k_level(clients, tokens_per_s, ms_per_token):
    return {"clients": clients, "tokens_per_s": _summary(tokens_per_s), "ms_per_token": _summary(ms_per_token)}


def test_k_goal_check_and_rows():
    from app.bench.parts import k

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
