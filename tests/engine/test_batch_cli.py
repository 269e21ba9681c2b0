"""``python -m app batch``: JSONL requests answered offline through the same service as the server.

In process through ``app.batch.main(argv, service=...)`` on the session's tiny models (no reload), compared with
the Flask test client of the same worker; one real ``python -m app batch`` subprocess for the exit code, the
progress bar and the summary line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app import batch
from app.errors import InvalidRequestError
from app.service import CompletionService
from tests.conftest import make_settings

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_FIELDS = [
    "status",
    "run_id",
    "request_count",
    "response_count",
    "error_count",
    "run_time_sec",
    "prompt_tokens",
    "total_tokens_generated",
    "tokens_per_sec",
    "seed",
]
VOLATILE = ("id", "created", "timing", "request_time")

# The seed's example request (FM inference data format), verbatim.
SEED_PROMPT = (
    "Passage: The bedroom is north of the garden.\nThe bathroom is west of the garden.\nThe office is east of the "
    "garden.\nThe hallway is west of the bathroom.\nThe bathroom is south of the kitchen.\nQuestion: How do you go "
    "from the bathroom to the office?\nAnswer: east east\n\nPassage: The office is north of the hallway.\nThe "
    "bathroom is east of the bedroom.\nThe hallway is north of the bedroom.\nThe office is east of the kitchen.\n"
    "The bedroom is north of the garden.\nQuestion: How do you go from the bedroom to the office?\nAnswer: north "
    "north\n\nPassage: The garden is south of the bedroom.\nThe bathroom is east of the kitchen.\nThe office is "
    "north of the bathroom.\nThe bathroom is north of the hallway.\nThe bedroom is west of the office.\nQuestion: "
    "How do you go from the bathroom to the bedroom?\nAnswer: north west\n\nPassage: The garden is west of the "
    "office.\nThe bedroom is west of the garden.\nThe bathroom is south of the office.\nThe office is west of the "
    "hallway.\nThe kitchen is north of the office.\nQuestion: How do you go from the kitchen to the garden?\n"
    "Answer: south west\n\nPassage: The bedroom is west of the office.\nThe garden is south of the bedroom.\nThe "
    "bathroom is south of the kitchen.\nThe hallway is north of the bedroom.\nThe bedroom is east of the bathroom."
    "\nQuestion: How do you go from the bathroom to the hallway?\nAnswer: east north\n\nPassage: The bedroom is "
    "north of the bathroom.\nThe bedroom is east of the office.\nThe kitchen is east of the bedroom.\nThe garden is "
    "west of the bathroom.\nThe hallway is south of the bathroom.\nQuestion: How do you go from the bathroom to the "
    "office?\nAnswer:"
)
SEED_REQUEST = {
    "best_of": 1,
    "echo": False,
    "engine": "gpt-j-6b",
    "logprobs": 1,
    "max_tokens": 2,
    "n": 1,
    "prompt": SEED_PROMPT,
    "stop": ["\n"],
    "temperature": 0.0,
    "top_p": 1,
}

# Mixed sampling settings; every line is reproducible (greedy or seeded), each prompt unique to its line.
MIXED = [
    {"model": "tiny-gpt2", "prompt": "line 1: The capital of France is", "max_tokens": 5, "temperature": 0},
    {"prompt": "line 2: Hello world", "echo": True, "logprobs": 3, "max_tokens": 0},
    {"prompt": "line 3: Once upon a time", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
    {"prompt": "line 4: one two three", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7},
    {"prompt": "line 5: The quick brown fox", "max_tokens": 4, "best_of": 3, "n": 2, "seed": 11, "logprobs": 2},
    {"prompt": [[76, 77, 78], [80, 81]], "max_tokens": 3, "temperature": 0, "logprobs": 0},
    {
        "prompt": "line 7: def add(a, b):",
        "max_tokens": 12,
        "temperature": 0.8,
        "top_k": 20,
        "seed": 3,
        "stop": [" ", "\n"],
    },
    {
        "prompt": "line 8: Numbers 0 1 2",
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 5,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "logprobs": 1,
        "stream": True,
    },
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, split at its newlines only: ``str.splitlines`` also splits at U+0085, U+2028
    and U+2029, which JSON leaves unescaped inside strings (a random model's text holds them)."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "output must end with a whole line"
    return [json.loads(line) for line in text.split("\n")[:-1]]


def stable(result: dict) -> dict:
    """A result without what differs from run to run (ids, times)."""
    return {k: v for k, v in result.items() if k not in VOLATILE}


def assert_same(a, b, where="result"):
    """Equal JSON, except that floats (logprobs) may differ by 1e-4: what running alone or in a batch of other
    requests gives (float32 sums over left-padded rows), the engine's fidelity bound."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert a == pytest.approx(b, abs=1e-4), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def summary_of(capsys) -> dict:
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines, "no summary line on stdout"
    return json.loads(lines[-1])


class CountingService:
    """The real service, counting what reaches the engine; ``on_call(n)`` runs before call n (1-based)."""

    def __init__(self, service, on_call=None):
        self.service = service
        self.on_call = on_call
        self.calls: list = []

    def __getattr__(self, name):
        return getattr(self.service, name)

    def complete(self, request, prepared=None):
        self.calls.append(request)
        if self.on_call is not None:
            self.on_call(len(self.calls))
        return self.service.complete(request, prepared)


@pytest.fixture(scope="module")
def gpt2_service(gpt2_dir, gpt2_worker):
    return CompletionService(make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2,gpt2-alias"), gpt2_worker)


@pytest.fixture(scope="module")
def long_gpt2(gpt2_dir, tmp_path_factory):
    """The tiny GPT-2's tokenizer with a 1024-token context: the seed's prompt is ~700 tiny-BPE tokens."""
    from transformers import AutoTokenizer

    from app import create_app
    from tooling.tiny_models import copy_tokenizer, gpt2_model
    from tests.conftest import make_worker

    path = tmp_path_factory.mktemp("long-gpt2")
    copy_tokenizer(gpt2_dir, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    gpt2_model(tok, positions=1024, width=32, layers=1, heads=2, seed=1).save_pretrained(path)
    settings = make_settings(model=str(path), served_model_name="tiny-gpt2-1k")
    worker = make_worker(settings)
    app = create_app(settings, worker=worker)
    app.config["TESTING"] = True
    return CompletionService(settings, worker), app.test_client()


@pytest.fixture(scope="module")
def llama_service(llama_dir, llama_worker):
    return CompletionService(make_settings(model=str(llama_dir), served_model_name="tiny-llama"), llama_worker)


def run_batch(service, *args) -> tuple[int, CountingService]:
    counting = service if isinstance(service, CountingService) else CountingService(service)
    code = batch.main(["--no-progress", *map(str, args)], service=counting)
    return code, counting


def over_http(client, body: dict, path="/v1/completions") -> dict:
    body = {k: v for k, v in body.items() if k not in ("engine", "model", "stream")}
    response = client.post(path, json=body)
    assert response.status_code == 200, response.get_json()
    return response.get_json()


# -- formats --------------------------------------------------------------------------------------------------
def test_seed_example_answered_in_seed_output_shape(tmp_path, long_gpt2, capsys):
    service, client = long_gpt2
    src = write_jsonl(tmp_path / "request_0.jsonl", [SEED_REQUEST])
    code, _ = run_batch(service, src)
    assert code == 0
    [line] = read_jsonl(tmp_path / "output_request_0.jsonl")
    assert list(line) == ["line", "request", "result"]
    assert line["line"] == 1 and line["request"] == SEED_REQUEST  # the request as read, engine included
    result = line["result"]
    assert result["object"] == "text_completion" and result["model"] == "tiny-gpt2-1k"  # the loaded model answers
    [choice] = result["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"} and choice["index"] == 0
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == choice["text"] and "\n" not in choice["text"]
    assert 1 <= len(lp["tokens"]) <= 2 and choice["finish_reason"] in ("stop", "length")
    for logprob, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 1 and max(top.values()) == pytest.approx(logprob)  # greedy: the chosen is the top one
    assert set(result["request_time"]) == {"batch_time", "batch_size"}
    assert result["request_time"]["batch_size"] == 1 and result["request_time"]["batch_time"] > 0
    assert result["usage"]["prompt_tokens"] > 256 and result["usage"]["completion_tokens"] == len(lp["tokens"])
    assert_same(stable(result), stable(over_http(client, SEED_REQUEST)))
    summary = summary_of(capsys)
    assert summary["status"] == "SUCCESS" and summary["request_count"] == summary["response_count"] == 1


def test_mixed_requests_equal_http_whatever_the_batch_budget(tmp_path, gpt2_service, gpt2_client, monkeypatch):
    src = write_jsonl(tmp_path / "mixed.jsonl", MIXED)
    expected = [stable(over_http(gpt2_client, body)) for body in MIXED]
    prepared = []
    real_prepare = gpt2_service.prepare
    monkeypatch.setattr(gpt2_service, "prepare", lambda request: prepared.append(request) or real_prepare(request))
    sizes, rows_seen = {}, {}
    engine = getattr(gpt2_service.worker, "engine", None)
    for budget in (1, 64, 10**6):
        out = tmp_path / f"out_{budget}.jsonl"
        if engine is not None:
            engine.max_rows_seen = 0
        code, counting = run_batch(gpt2_service, src, "-o", out, "--max-batch-tokens", budget)
        assert code == 0 and len(counting.calls) == len(MIXED)
        assert len(prepared) == len(MIXED)  # each line is prepared (tokenized, checked) once, not twice
        prepared.clear()
        lines = read_jsonl(out)
        assert [line["line"] for line in lines] == list(range(1, len(MIXED) + 1))
        assert [line["request"] for line in lines] == MIXED
        assert_same([stable(line["result"]) for line in lines], expected, f"budget {budget}")
        sizes[budget] = [line["result"]["request_time"]["batch_size"] for line in lines]
        rows_seen[budget] = engine.max_rows_seen if engine is not None else None
    assert sizes[1] == [1] * len(MIXED)  # every request over the budget goes alone
    assert sizes[10**6] == [len(MIXED)] * len(MIXED)  # one batch
    # costs (prompt + max_tokens) x sequences: 17, 10, 15, 57 (n=3), 57 (best_of=3), 11 (2 prompts), 28, 22
    assert sizes[64] == [3, 3, 3, 1, 1, 3, 3, 3]
    if engine is not None:  # the engine decoded a batch's requests together (best_of=3 alone: 3 rows)
        assert rows_seen[1] <= 3 < rows_seen[10**6]
    n4 = read_jsonl(tmp_path / "out_1.jsonl")[3]["result"]
    assert [c["index"] for c in n4["choices"]] == [0, 1, 2]
    multi = read_jsonl(tmp_path / "out_1.jsonl")[5]["result"]
    assert [c["index"] for c in multi["choices"]] == [0, 1] and multi["usage"]["prompt_tokens"] == 5


def test_chat_lines_answered_as_chat_completions(tmp_path, llama_service, llama_client):
    rows = [
        {
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
        {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, _ = run_batch(llama_service, src)
    assert code == 0
    chat, plain = read_jsonl(tmp_path / "output_chat.jsonl")
    assert chat["result"]["object"] == "chat.completion" and chat["result"]["model"] == "tiny-llama"
    assert_same(stable(chat["result"]), stable(over_http(llama_client, rows[0], "/v1/chat/completions")))
    assert plain["result"]["object"] == "text_completion"
    assert_same(stable(plain["result"]), stable(over_http(llama_client, rows[1])))


# -- errors ---------------------------------------------------------------------------------------------------
def test_malformed_lines_and_invalid_requests_become_error_lines(tmp_path, gpt2_service, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(
        b"\n".join(
            [
                b'{"prompt": "ok one", "max_tokens": 2, "temperature": 0}',
                b'{"prompt": "truncated", "max_tok',
                b"",  # blank: skipped, no output line
                b'["a list"]',
                b'{"prompt": "too hot", "temperature": 5}',
                b'{"prompt": "\xff\xfe not utf-8"}',
                b'{"prompt": "long", "max_tokens": 100000}',
                b'{"prompt": "nan", "temperature": NaN}',
                b'{"model": "some-other-model", "prompt": "ok two", "max_tokens": 2, "temperature": 0}',
            ]
        )
        + b"\n"
    )
    code, counting = run_batch(gpt2_service, src)
    assert code == 1
    lines = read_jsonl(tmp_path / "output_bad.jsonl")
    assert [line["line"] for line in lines] == [1, 2, 4, 5, 6, 7, 8, 9]
    by_line = {line["line"]: line for line in lines}
    assert "result" in by_line[1] and "result" in by_line[9] and len(counting.calls) == 2
    assert by_line[9]["result"]["model"] == "tiny-gpt2"  # model is informational in a batch
    for number in (2, 4, 5, 6, 7, 8):
        error = by_line[number]["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert "result" not in by_line[number]
    assert by_line[2]["request"] is None and by_line[2]["raw"] == '{"prompt": "truncated", "max_tok'
    assert by_line[5]["error"]["param"] == "temperature" and by_line[5]["request"]["temperature"] == 5
    assert by_line[7]["error"]["code"] == "context_length_exceeded"
    assert by_line[8]["request"] is None  # NaN is not JSON
    summary = summary_of(capsys)
    assert (summary["status"], summary["request_count"], summary["response_count"], summary["error_count"]) == (
        "COMPLETED_WITH_ERRORS",
        8,
        2,
        6,
    )
    # a rerun does not retry request errors (they would only repeat) and still exits 1
    code, counting = run_batch(gpt2_service, src)
    assert code == 1 and counting.calls == [] and len(read_jsonl(tmp_path / "output_bad.jsonl")) == 8


def test_usage_errors_exit_2_and_run_nothing(tmp_path, gpt2_service, capsys):
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "max_tokens": 1}])
    two = write_jsonl(tmp_path / "two.jsonl", [{"prompt": "b", "max_tokens": 1}])
    cases = [
        [],  # no INPUT
        [tmp_path / "missing.jsonl"],
        [tmp_path / "nothing-*.jsonl"],  # a glob that matches nothing
        [one, two, "-o", tmp_path / "x.jsonl"],  # -o takes one input
        [one, "-o", tmp_path / "x.jsonl", "--output-dir", tmp_path],
        [one, "--max-batch-tokens", "0"],
        [one, "--dtype", "float8"],  # a bad setting
        [one, "-o", one],  # the output would overwrite the input
    ]
    for args in cases:
        code, counting = run_batch(gpt2_service, *args)
        captured = capsys.readouterr()
        assert code == 2, args
        assert counting.calls == [] and captured.out == "", args
        assert captured.err.strip(), args
    assert not (tmp_path / "output_one.jsonl").exists()
    # an output that belongs to another input is refused, not mixed
    assert run_batch(gpt2_service, one)[0] == 0
    write_jsonl(one, [{"prompt": "changed", "max_tokens": 1}])
    capsys.readouterr()
    code, counting = run_batch(gpt2_service, one)
    assert code == 2 and counting.calls == [] and "changed" in capsys.readouterr().err


# -- resume and interruption ------------------------------------------------------------------------------------
def test_resume_recomputes_only_missing_lines(tmp_path, gpt2_service):
    rows = [{"prompt": f"line {i}: Hello world", "max_tokens": 3, "temperature": 0, "logprobs": 1} for i in range(1, 9)]
    src = write_jsonl(tmp_path / "resume.jsonl", rows)
    out = tmp_path / "output_resume.jsonl"
    assert run_batch(gpt2_service, src)[0] == 0
    full = read_jsonl(out)
    text = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(text[:5]), encoding="utf-8")  # delete the last three lines
    code, counting = run_batch(gpt2_service, src, "--max-batch-tokens", 40)
    assert code == 0
    assert [c.prompt for c in counting.calls] == [f"line {i}: Hello world" for i in (6, 7, 8)]
    resumed = read_jsonl(out)
    assert [line["line"] for line in resumed] == list(range(1, 9))
    assert resumed[:5] == full[:5]  # kept as written
    assert_same([stable(a["result"]) for a in resumed], [stable(b["result"]) for b in full])
    # a torn last line (power cut mid-write) is cut off and that line alone is answered again
    out.write_text("".join(text[:7]) + text[7][:25], encoding="utf-8")
    code, counting = run_batch(gpt2_service, src)
    assert code == 0 and [c.prompt for c in counting.calls] == ["line 8: Hello world"]
    assert [line["line"] for line in read_jsonl(out)] == list(range(1, 9))
    # nothing left: a rerun runs nothing; a line number written twice (files concatenated by hand) is kept once
    before = out.read_text(encoding="utf-8")
    out.write_text(before + before.splitlines(keepends=True)[0], encoding="utf-8")
    assert run_batch(gpt2_service, src)[1].calls == []
    assert out.read_text(encoding="utf-8") == before


@pytest.mark.parametrize("budget", [1, 10**6])
def test_sigterm_leaves_whole_lines_and_resume_finishes(tmp_path, gpt2_service, capsys, budget):
    rows = [{"prompt": f"line {i}: one two three", "max_tokens": 4, "temperature": 0} for i in range(1, 7)]
    src = write_jsonl(tmp_path / "stop.jsonl", rows)
    out = tmp_path / "output_stop.jsonl"

    def terminate(call: int) -> None:
        if call == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    counting = CountingService(gpt2_service, on_call=terminate)
    # budget 1: one request per batch, a write after each; a million: one batch of six, answered together
    code, _ = run_batch(counting, src, "--max-batch-tokens", budget)
    assert code == 128 + signal.SIGTERM
    assert summary_of(capsys)["status"] == "INTERRUPTED"
    lines = read_jsonl(out)  # every line parses: whole lines only
    assert [line["line"] for line in lines] == ([1, 2, 3] if budget == 1 else [])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    code, counting = run_batch(gpt2_service, src)
    assert code == 0
    assert sorted(c.prompt for c in counting.calls) == [f"line {i}: one two three" for i in range(len(lines) + 1, 7)]
    assert [line["line"] for line in read_jsonl(out)] == list(range(1, 7))


def test_internal_errors_are_retried_by_a_rerun(tmp_path, gpt2_service, capsys):
    rows = [{"prompt": f"line {i}: Hello", "max_tokens": 2, "temperature": 0} for i in range(1, 5)]
    src = write_jsonl(tmp_path / "flaky.jsonl", rows)
    out = tmp_path / "output_flaky.jsonl"

    def fail_second(call: int) -> None:
        if call == 2:
            raise RuntimeError("CUDA out of memory (simulated)")

    code, _ = run_batch(CountingService(gpt2_service, on_call=fail_second), src)
    assert code == 1 and summary_of(capsys)["error_count"] == 1
    error = read_jsonl(out)[1]["error"]
    assert error["type"] == "server_error" and "out of memory" in error["message"]
    code, counting = run_batch(gpt2_service, src)
    assert code == 0 and [c.prompt for c in counting.calls] == ["line 2: Hello"]
    summary = summary_of(capsys)
    assert (summary["status"], summary["response_count"], summary["error_count"]) == ("SUCCESS", 4, 0)
    assert [line["line"] for line in read_jsonl(out)] == [1, 3, 4, 2]  # a retried line comes last


def test_a_second_run_on_the_same_output_leaves_it_alone(tmp_path, gpt2_service, capsys):
    import fcntl

    src = write_jsonl(tmp_path / "busy.jsonl", [{"prompt": "a", "max_tokens": 1}])
    with open(tmp_path / "output_busy.jsonl", "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another run is writing it
        code, counting = run_batch(gpt2_service, src)
    assert code == 1 and counting.calls == []
    assert summary_of(capsys)["status"] == "INCOMPLETE"
    assert run_batch(gpt2_service, src)[0] == 0


def test_a_signal_during_a_write_waits_for_the_write(tmp_path):
    guard = batch.SignalGuard()
    guard.install()
    try:
        path = tmp_path / "out.jsonl"
        with open(path, "ab") as handle, pytest.raises(batch.Interrupted):
            with guard.writing_lines():
                handle.write(b'{"line": 1')
                os.kill(os.getpid(), signal.SIGINT)  # arrives mid-line: deferred
                handle.write(b"}\n")
                handle.flush()
        assert path.read_bytes() == b'{"line": 1}\n'
    finally:
        guard.restore()


# -- inputs, grouping, summary ------------------------------------------------------------------------------------
def test_globs_output_dir_and_outputs_not_taken_as_inputs(tmp_path, gpt2_service, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i in (0, 1, 10):
        write_jsonl(data / f"request_{i}.jsonl", [{"prompt": f"file {i}", "max_tokens": 2, "temperature": 0}])
    code, _ = run_batch(gpt2_service, str(data / "request_*.jsonl"), "--output-dir", tmp_path / "outs")
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "outs").iterdir()) == [
        "output_request_0.jsonl",
        "output_request_1.jsonl",
        "output_request_10.jsonl",
    ]
    # outputs beside the inputs, then a rerun over data/*.jsonl: the outputs are not read as requests
    assert run_batch(gpt2_service, str(data / "*.jsonl"))[0] == 0
    code, counting = run_batch(gpt2_service, str(data / "*.jsonl"))
    assert code == 0 and counting.calls == []
    assert not list(data.glob("output_output_*"))
    capsys.readouterr()


def test_group_items_by_token_budget():
    items = [batch.Item(i, {}, cost=c) for i, c in enumerate([30, 30, 50, 10, 200, 5], start=1)]
    items.insert(2, batch.Item(99, {}, error=InvalidRequestError("bad")))
    groups = [[i.line for i in g] for g in batch.group_items(iter(items), 64)]
    assert groups == [[1, 2, 99], [3, 4], [5], [6]]


def test_summary_line_fields_and_seed(tmp_path, gpt2_service, capsys):
    rows = [{"prompt": f"line {i}: Once upon", "max_tokens": 5, "temperature": 1.0} for i in range(1, 4)]
    src = write_jsonl(tmp_path / "sum.jsonl", rows)
    code, _ = run_batch(gpt2_service, src, "--seed", 42, "-o", tmp_path / "a.jsonl")
    assert code == 0
    summary = summary_of(capsys)
    assert list(summary) == SUMMARY_FIELDS
    lines = read_jsonl(tmp_path / "a.jsonl")
    usage = [line["result"]["usage"] for line in lines]
    assert summary["status"] == "SUCCESS" and summary["seed"] == 42
    assert summary["request_count"] == summary["response_count"] == 3 and summary["error_count"] == 0
    assert summary["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert summary["total_tokens_generated"] == sum(u["completion_tokens"] for u in usage) == 15
    assert summary["tokens_per_sec"] == pytest.approx(15 / summary["run_time_sec"], rel=0.05)
    assert len(summary["run_id"]) == 16 and summary["run_id"].endswith("Z")
    # --seed makes unseeded sampled lines reproducible (per line: the lines differ from each other)
    assert run_batch(gpt2_service, src, "--seed", 42, "-o", tmp_path / "b.jsonl")[0] == 0
    again = read_jsonl(tmp_path / "b.jsonl")
    assert_same([stable(a["result"]) for a in lines], [stable(b["result"]) for b in again])
    assert lines[0]["request"] == rows[0]  # the request as read, no seed added


def test_python_m_app_batch_subprocess(tmp_path, gpt2_dir):
    rows = [
        {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
        {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 1},
    ]
    write_jsonl(tmp_path / "request_0.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKER_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "batch",
            "--model",
            str(gpt2_dir),
            "--served-model-name",
            "tiny-gpt2",
            "--device",
            "cpu",
            str(tmp_path / "request_*.jsonl"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1  # stdout holds the summary alone
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(summary) == SUMMARY_FIELDS and summary["status"] == "SUCCESS"
    assert summary["request_count"] == summary["response_count"] == 2 and summary["total_tokens_generated"] == 5
    assert "req/s" in proc.stderr and "tok/s" in proc.stderr  # the progress bar
    lines = read_jsonl(tmp_path / "output_request_0.jsonl")
    assert [line["line"] for line in lines] == [1, 2]
    assert lines[1]["result"]["choices"][0]["logprobs"]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_command_line_run_exits_with_its_signal_code(gpt2_dir, tmp_path, signame, code):
    """``python -m app batch`` as a real process, interrupted while requests are in flight: the summary says
    INTERRUPTED, the output holds whole lines, and the exit code is 128 + the signal (not an abort, 134)."""
    import time

    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"prompt": f"Hello {i}", "max_tokens": 150, "ignore_eos": True}) + "\n" for i in range(400))
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "batch", str(source), "-o", str(out), "--no-progress"],
        env={**os.environ, "SAKER_MODEL": str(gpt2_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.stat().st_size < 2000):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signame))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]
    assert "terminate called" not in stderr
    assert json.loads(stdout.strip().splitlines()[-1])["status"] == "INTERRUPTED"
    assert all(read_jsonl(out))  # whole lines, each a record
