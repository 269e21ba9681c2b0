"""Operations through the Flask test client: overload (429/503), out-of-memory (503, server goes on), API keys,
/metrics, the JSON access log, ProxyFix, /openapi.json and the 413 message."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families

from app.engine.core.admission import Admission
from tooling.sse import read_stream
from conftest import make_settings

URL = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny-gpt2", "prompt": "Hello world", "max_tokens": 3, "temperature": 0}


def error_of(resp, status: int, code: str | None, type_: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.get_data(as_text=True))
    assert resp.mimetype == "application/json"
    body = resp.get_json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    if type_:
        assert body["error"]["type"] == type_
    return body["error"]


def sse(resp) -> list:
    assert resp.status_code == 200, resp.get_data(as_text=True)
    stream = read_stream(resp.get_data())
    assert stream.done
    return stream.chunks


def make_app(worker, **values):
    from app import create_app

    values.setdefault("model", "unused")
    values.setdefault("served_model_name", "tiny-gpt2")
    app = create_app(make_settings(**values), worker=worker)
    app.config["TESTING"] = True
    return app


# -- overload -------------------------------------------------------------------------------------------
class HeldSlot:
    """The scheduler's waiting queue replaced by ``Admission(capacity=1, **kwargs)`` whose one slot a request that
    is not there holds, as a long generation would; ``release()`` ends it (its slot goes to the longest waiter)."""

    def __init__(self, engine, monkeypatch, **kwargs):
        self.engine = engine
        self.admission = Admission(capacity=1, **kwargs)
        assert self.admission.arrive(-1, time.perf_counter())
        monkeypatch.setattr(engine.scheduler, "admission", self.admission)

    def release(self) -> None:
        with self.engine._cond:
            self.admission.leave(-1, time.perf_counter())
            self.engine._cond.notify()


@pytest.fixture()
def held(gpt2_app, monkeypatch):
    """``hold(**kwargs)``: the worker's one running slot taken (``HeldSlot``); returns (client, held slot)."""
    worker = gpt2_app.extensions["saker.service"].worker

    def hold(**kwargs):
        return gpt2_app.test_client(), HeldSlot(worker.engine, monkeypatch, **kwargs)

    return hold


@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_is_429_model_overloaded(held, stream):
    client, slot = held(max_queue=0, timeout=30)
    resp = client.post(URL, json={**GOOD, "stream": stream})
    err = error_of(resp, 429, "model_overloaded", "server_overloaded")
    assert "model is overloaded" in err["message"] and "SAKER_MAX_QUEUE=0" in err["message"]
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    chat = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "stream": stream})
    assert chat.status_code in (400, 429)  # tiny-gpt2 has no chat template: 400 comes first
    slot.release()
    answered = client.post(URL, json={**GOOD, "stream": stream})
    assert answered.status_code == 200 and answered.get_data()  # to its end: its slot given back
    assert slot.admission.snapshot() == {"active": 0, "waiting": 0, "rejected": 1, "timed_out": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_waiting_past_the_queue_timeout_is_503(held, stream):
    client, slot = held(max_queue=4, timeout=0.05)
    resp = client.post(URL, json={**GOOD, "stream": stream})
    err = error_of(resp, 503, "queue_timeout", "service_unavailable")
    assert "SAKER_QUEUE_TIMEOUT=0.05" in err["message"]
    assert int(resp.headers["Retry-After"]) >= 1
    assert slot.admission.snapshot() == {"active": 1, "waiting": 0, "rejected": 0, "timed_out": 1}
    slot.release()
    assert client.post(URL, json={**GOOD, "stream": stream}).status_code == 200


# -- out of memory ----------------------------------------------------------------------------------------
def inject_oom(monkeypatch, runner, method: str, on_call: int):
    real = getattr(runner, method)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == on_call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, method, failing)
    return calls


@pytest.fixture()
def cuda_cache(monkeypatch):
    """Pretend CUDA is there and record empty_cache() calls (the OOM path must free the cache)."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    return emptied


def test_out_of_memory_is_503_and_the_server_goes_on(llama_app, monkeypatch, cuda_cache):
    client = llama_app.test_client()
    worker = llama_app.extensions["saker.service"].worker
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    expected = client.post(URL, json=body).get_json()["choices"][0]["text"]
    calls = inject_oom(monkeypatch, worker.runner, "rows_step", on_call=1)
    resp = client.post(URL, json=body)
    err = error_of(resp, 503, "out_of_memory", "service_unavailable")
    assert "memory" in err["message"] and "20.00 GiB" not in err["message"]
    assert resp.headers["Retry-After"] == "1"
    assert calls["n"] >= 1 and cuda_cache, "the CUDA cache was not emptied"
    monkeypatch.undo()
    again = client.post(URL, json=body)
    assert again.status_code == 200 and again.get_json()["choices"][0]["text"] == expected
    assert client.get("/health").status_code == 200


def test_out_of_memory_mid_stream_is_an_error_frame_then_done(llama_app, monkeypatch, cuda_cache):
    client = llama_app.test_client()
    worker = llama_app.extensions["saker.service"].worker
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    inject_oom(monkeypatch, worker.runner, "rows_step", on_call=3)
    frames = sse(client.post(URL, json={**body, "stream": True}))
    assert frames[-1] == {"error": frames[-1]["error"]}
    assert frames[-1]["error"]["code"] == "out_of_memory" and frames[-1]["error"]["type"] == "service_unavailable"
    assert any(f.get("choices") for f in frames[:-1])  # text was streamed before the fault
    assert cuda_cache
    monkeypatch.undo()
    assert client.post(URL, json=body).status_code == 200
    assert len(sse(client.post(URL, json={**body, "stream": True}))) > 1


def test_out_of_memory_before_the_first_token_of_a_stream_is_a_plain_503(llama_app, monkeypatch, cuda_cache):
    client = llama_app.test_client()
    worker = llama_app.extensions["saker.service"].worker
    inject_oom(monkeypatch, worker.runner, "flat_step", on_call=1)  # the prompt's forward
    resp = client.post(URL, json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4, "stream": True})
    error_of(resp, 503, "out_of_memory")
    monkeypatch.undo()
    assert client.post(URL, json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4}).status_code == 200


def test_out_of_memory_guard_drops_the_failed_request_s_tensors():
    """The failed generation's frames (its KV cache) are dropped before the cache is emptied."""
    import gc
    import weakref

    from app.engine.errors import EngineOutOfMemory
    from app.engine.model.oom import out_of_memory_guard

    refs = []

    def generate():
        kv_cache = torch.zeros(64)  # stands for the request's KV cache
        refs.append(weakref.ref(kv_cache))
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(EngineOutOfMemory) as info:
        with out_of_memory_guard():
            generate()
    assert info.value.__cause__ is None and info.value.__suppress_context__
    gc.collect()
    assert refs[0]() is None


# -- API keys -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(gpt2_worker, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    key_file = folder / "keys.txt"
    key_file.write_text("# operators\nfile-key-1\n\n  file-key-2  \n")
    log_file = folder / "access.log"
    app = make_app(gpt2_worker, api_keys="env-key-1, env-key-2", api_key_file=str(key_file), access_log=str(log_file))
    return app, log_file


@pytest.mark.parametrize("key", ["env-key-1", "env-key-2", "file-key-1", "file-key-2"])
def test_every_configured_key_is_accepted(keyed, key):
    client = keyed[0].test_client()
    assert client.post(URL, json=GOOD, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic env-key-1",
        "Bearer env-key-1x",
        "Bearer env-key",
        "Bearer # operators",
        "Token env-key-1",
    ],
)
def test_missing_or_wrong_key_is_401(keyed, header):
    client = keyed[0].test_client()
    headers = {} if header is None else {"Authorization": header}
    for method, path, body in [
        ("POST", URL, GOOD),
        ("POST", CHAT, {"messages": []}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny-gpt2", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
        ("GET", "/v1/nope", None),
    ]:
        resp = client.open(path, method=method, json=body, headers=headers)
        err = error_of(resp, 401, "invalid_api_key", "invalid_request_error")
        assert "key" in err["message"].lower()
        assert "env-key" not in err["message"] and "file-key" not in err["message"]
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")


def test_health_metrics_and_openapi_stay_open(keyed):
    client = keyed[0].test_client()
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/openapi.json").status_code == 200


def test_metrics_can_require_the_key(gpt2_worker):
    client = make_app(gpt2_worker, api_keys="k", metrics_require_key=True, access_log="off").test_client()
    error_of(client.get("/metrics"), 401, "invalid_api_key")
    assert client.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_no_keys_no_check(gpt2_client):
    assert gpt2_client.post(URL, json=GOOD, headers={"Authorization": "Bearer anything"}).status_code == 200
    assert gpt2_client.post(URL, json=GOOD).status_code == 200


def test_keys_never_reach_the_logs(keyed, capfd, caplog):
    app, log_file = keyed
    client = app.test_client()
    client.post(URL, json=GOOD, headers={"Authorization": "Bearer env-key-1"})
    client.post(URL, json=GOOD, headers={"Authorization": "Bearer wrong-secret-key"})
    out, err = capfd.readouterr()
    text = log_file.read_text() + out + err + caplog.text
    for secret in ("env-key-1", "env-key-2", "file-key-1", "file-key-2", "wrong-secret-key"):
        assert secret not in text
    assert "env-key-1" not in repr(make_settings(api_keys="env-key-1"))


def test_key_settings_fail_clearly(tmp_path):
    from app.errors import ConfigError
    from app.settings import load_settings

    with pytest.raises(ConfigError, match="not a file"):
        load_settings(api_key_file=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no keys"):
        load_settings(api_key_file=str(empty))
    with pytest.raises(ConfigError, match="holds no keys"):
        load_settings(api_keys=" , ")


# -- metrics ------------------------------------------------------------------------------------------------
def metric_samples(client, headers=None) -> dict:
    text = client.get("/metrics", headers=headers or {}).get_data(as_text=True)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_tokens_and_timings(gpt2_worker):
    app = make_app(gpt2_worker, access_log="off")
    client = app.test_client()
    before = metric_samples(client)
    assert value(before, "saker_model_ready") == 1.0
    assert value(before, "saker_model_load_seconds") > 0
    assert value(before, "saker_queue_depth") == 0 and value(before, "saker_requests_running") == 0
    plain = client.post(URL, json={**GOOD, "max_tokens": 5, "ignore_eos": True}).get_json()
    streamed = sse(
        client.post(
            URL,
            json={
                **GOOD,
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    client.post(URL, json={**GOOD, "temperature": 9})
    client.get("/nope")
    after = metric_samples(client)
    ok = dict(route="/v1/completions", method="POST", status="200")
    assert value(after, "saker_requests_total", **ok) == 2
    assert value(after, "saker_requests_total", route="/v1/completions", method="POST", status="400") == 1
    assert value(after, "saker_requests_total", route="unmatched", method="GET", status="404") == 1
    assert value(after, "saker_requests_total", route="/metrics", method="GET", status="200") == 1
    assert value(after, "saker_request_errors_total", route="unmatched", code="not_found") == 1
    prompt_tokens = plain["usage"]["prompt_tokens"] + streamed[-1]["usage"]["prompt_tokens"]
    assert value(after, "saker_prompt_tokens_total") == prompt_tokens
    assert value(after, "saker_generation_tokens_total") == 5 + 4
    assert value(after, "saker_request_generation_tokens_count") == 2
    assert value(after, "saker_request_generation_tokens_sum") == 9
    for name in (
        "saker_queue_wait_seconds_count",
        "saker_time_to_first_token_seconds_count",
        "saker_time_per_output_token_seconds_count",
    ):
        assert value(after, name) == 2, name
    assert value(after, "saker_request_duration_seconds_count", route="/v1/completions") == 3
    assert value(after, "saker_requests_in_flight") == 1  # this scrape
    cache = gpt2_worker.prefix_cache
    assert value(after, "saker_prefix_cache_hits_total") == cache.hits
    assert value(after, "saker_prefix_cache_reused_tokens_total") == cache.reused_tokens
    assert value(after, "saker_prefix_cache_tokens") == cache.cached_tokens
    assert value(after, "process_resident_memory_bytes") > 0
    assert value(after, "saker_kv_cache_budget_tokens") == gpt2_worker.kv_cache_tokens > 0
    assert value(after, "saker_kv_cache_usage") == 0.0  # nothing running


def test_made_up_methods_do_not_grow_the_metrics(gpt2_worker):
    """The method label takes the standard methods and "other": 300 made-up ones add one series, not 300."""
    client = make_app(gpt2_worker, access_log="off").test_client()
    for i in range(300):
        client.open("/health", method=f"X{i}")
    samples = metric_samples(client)
    methods = {dict(labels).get("method") for (name, labels) in samples if name == "saker_requests_total"}
    assert "other" in methods and not any(m and m.startswith("X") for m in methods)
    assert value(samples, "saker_requests_total", route="unmatched", method="other", status="405") == 300


def test_kv_cache_usage_while_a_request_decodes(gpt2_worker):
    """The gauge reads the running batch: a request's rows hold their prompt + tokens so far."""
    from app.engine.core.sequence import RequestGroup
    from app.engine.params import SamplingParams

    client = make_app(gpt2_worker, access_log="off").test_client()
    group = RequestGroup(
        gpt2_worker.runner,
        [1, 2, 3, 4],
        SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
        max_length=256,
    )
    ticket = gpt2_worker.engine.submit([group])
    events = iter(ticket)
    for _ in range(3):
        next(events)
    usage = value(metric_samples(client), "saker_kv_cache_usage")
    ticket.cancel()
    for _ in events:
        pass
    assert 4 / gpt2_worker.kv_cache_tokens < usage <= 210 / gpt2_worker.kv_cache_tokens


def test_metrics_see_queue_depth_and_rejections(gpt2_worker, monkeypatch):
    app = make_app(gpt2_worker, access_log="off")
    client = app.test_client()
    slot = HeldSlot(gpt2_worker.engine, monkeypatch, max_queue=0)
    error_of(client.post(URL, json=GOOD), 429, "model_overloaded")
    samples = metric_samples(client)
    assert value(samples, "saker_requests_running") == 1
    assert value(samples, "saker_requests_rejected_total") == 1
    assert value(samples, "saker_requests_total", route="/v1/completions", method="POST", status="429") == 1
    assert value(samples, "saker_request_errors_total", route="/v1/completions", code="model_overloaded") == 1
    slot.release()


# -- access log ---------------------------------------------------------------------------------------------
def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_access_log_one_json_line_per_request(gpt2_worker, tmp_path):
    log_file = tmp_path / "access.log"
    client = make_app(gpt2_worker, access_log=str(log_file)).test_client()
    resp = client.post(URL, json={**GOOD, "prompt": "secret prompt text"}, headers={"X-Request-ID": "rid-1"})
    sse(
        client.post(
            URL, json={**GOOD, "prompt": "secret stream prompt", "stream": True}, headers={"X-Request-ID": "rid-2"}
        )
    )
    client.post(URL, json={**GOOD, "n": 0}, headers={"X-Request-ID": "rid-3"})
    client.get("/health")
    lines = log_lines(log_file)
    assert [line["request_id"] for line in lines] == ["rid-1", "rid-2", "rid-3", lines[3]["request_id"]]
    first, stream, bad, health = lines
    assert first["method"] == "POST" and first["route"] == "/v1/completions" and first["status"] == 200
    assert first["client"] == "127.0.0.1" and first["stream"] is False and first["model"] == "tiny-gpt2"
    assert first["prompt_tokens"] == resp.get_json()["usage"]["prompt_tokens"]
    assert first["completion_tokens"] == resp.get_json()["usage"]["completion_tokens"]
    for key in ("duration_ms", "queue_ms", "prefill_ms", "decode_ms", "ttft_ms"):
        assert first[key] >= 0, key
    assert stream["stream"] is True and stream["status"] == 200 and stream["completion_tokens"] == 3
    assert stream["ttft_ms"] >= 0 and stream["error_code"] is None
    assert bad["status"] == 400 and bad["error_code"] == "invalid_request_error"  # no code: the type
    assert health["route"] == "/health" and health["prompt_tokens"] is None
    raw = log_file.read_text()
    assert "secret prompt text" not in raw and "secret stream prompt" not in raw
    assert "prompt" not in first and "output" not in first


def test_access_log_with_prompts(gpt2_worker, tmp_path):
    log_file = tmp_path / "access.log"
    client = make_app(gpt2_worker, access_log=str(log_file), log_prompts=True).test_client()
    plain = client.post(URL, json={**GOOD, "prompt": "logged prompt"}).get_json()
    frames = sse(client.post(URL, json={**GOOD, "prompt": "logged stream", "stream": True, "n": 2}))
    first, stream = log_lines(log_file)
    assert first["prompt"] == "logged prompt" and first["output"] == [plain["choices"][0]["text"]]
    assert stream["prompt"] == "logged stream"
    texts = {}
    for f in frames:
        for c in f["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert stream["output"] == [texts[0], texts[1]]


def test_access_log_records_a_stream_error_code(llama_worker, tmp_path, monkeypatch):
    log_file = tmp_path / "access.log"
    client = make_app(llama_worker, access_log=str(log_file), served_model_name="tiny-llama").test_client()
    inject_oom(monkeypatch, llama_worker.runner, "rows_step", on_call=3)
    sse(
        client.post(
            URL,
            json={"prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True, "temperature": 0, "stream": True},
        )
    )
    monkeypatch.undo()
    (line,) = log_lines(log_file)
    assert line["status"] == 200 and line["stream"] is True and line["error_code"] == "out_of_memory"


def test_access_log_off_and_stderr(gpt2_worker, capfd):
    make_app(gpt2_worker, access_log="off").test_client().get("/health")
    assert '"route"' not in capfd.readouterr().err
    make_app(gpt2_worker, access_log="-").test_client().get("/health", headers={"X-Request-ID": "to-stderr"})
    err = capfd.readouterr().err
    (line,) = [json.loads(x) for x in err.splitlines() if '"request_id":"to-stderr"' in x]
    assert line["route"] == "/health" and line["status"] == 200


@pytest.mark.parametrize("hops,expected", [(0, "127.0.0.1"), (1, "203.0.113.9"), (2, "198.51.100.1")])
def test_proxy_hops_decide_the_client_address(gpt2_worker, tmp_path, hops, expected):
    log_file = tmp_path / "access.log"
    client = make_app(gpt2_worker, access_log=str(log_file), proxy_hops=hops).test_client()
    client.get("/health", headers={"X-Forwarded-For": "198.51.100.1, 203.0.113.9"})
    (line,) = log_lines(log_file)
    assert line["client"] == expected


# -- OpenAPI ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def openapi(gpt2_app):
    return gpt2_app.test_client().get("/openapi.json").get_json()


def schema_validator(doc: dict, ref: dict) -> Draft202012Validator:
    return Draft202012Validator({**ref, "components": doc["components"]})


def test_openapi_covers_every_route(gpt2_app, openapi):
    from app.openapi import openapi_path

    assert openapi["openapi"].startswith("3.1")
    routes = set()
    for rule in gpt2_app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.startswith("ui."):  # the web page (app/ui/), not the API
            continue
        path, _ = openapi_path(rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            routes.add((path, method.lower()))
    documented = {(path, method) for path, ops in openapi["paths"].items() for method in ops}
    assert routes == documented
    for schema in openapi["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            assert op["responses"]["200"], (path, method)


SAMPLES = {
    ("/v1/completions", "post"): [
        GOOD,
        {"prompt": [[1, 2, 3]], "max_tokens": 0, "echo": True, "logprobs": 2},
        {
            "prompt": ["a", "b"],
            "n": 2,
            "best_of": 3,
            "stop": ["\n"],
            "seed": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ],
    ("/v1/chat/completions", "post"): [
        {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 4,
        }
    ],
    ("/tokenize", "post"): [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "x"}]}],
    ("/detokenize", "post"): [{"tokens": [1, 2]}],
}


def test_openapi_request_schemas_accept_sample_bodies_and_refuse_bad_ones(openapi):
    for (path, method), bodies in SAMPLES.items():
        ref = openapi["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        validator = schema_validator(openapi, ref)
        for body in bodies:
            validator.validate(body)
    completion = openapi["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = schema_validator(openapi, completion)
    assert not validator.is_valid({"max_tokens": 3})  # prompt is required
    assert not validator.is_valid({"prompt": "x", "temperature": 3})
    assert not validator.is_valid({"prompt": "x", "n": "2"})


def test_openapi_response_schemas_match_real_answers(llama_client, openapi):
    def check(path, method, resp, status="200"):
        spec = openapi["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
        schema_validator(openapi, spec).validate(resp.get_json())

    check(
        "/v1/completions",
        "post",
        llama_client.post(URL, json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "echo": True}),
    )
    check(
        "/v1/chat/completions",
        "post",
        llama_client.post(
            CHAT,
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 1,
            },
        ),
    )
    check("/v1/models", "get", llama_client.get("/v1/models"))
    check("/v1/models/{model_id}", "get", llama_client.get("/v1/models/tiny-llama"))
    check("/tokenize", "post", llama_client.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}))
    check("/detokenize", "post", llama_client.post("/detokenize", json={"tokens": [5, 6]}))
    check("/tokenizer_info", "get", llama_client.get("/tokenizer_info"))
    check("/health", "get", llama_client.get("/health"))
    check("/v1/completions", "post", llama_client.post(URL, json={"prompt": "x", "n": 0}), "400")
    check("/v1/models/{model_id}", "get", llama_client.get("/v1/models/nope"), "404")
    assert "text/event-stream" in openapi["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert "Retry-After" in openapi["paths"]["/v1/completions"]["post"]["responses"]["429"]["headers"]
    assert openapi["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in openapi["paths"]["/health"]["get"]


# -- limits are named in their messages -------------------------------------------------------------------
def test_413_names_the_limit(gpt2_worker):
    client = make_app(gpt2_worker, max_request_bytes=500, access_log="off").test_client()
    err = error_of(client.post(URL, json={**GOOD, "prompt": "x" * 600}), 413, "request_too_large")
    assert "500" in err["message"] and "SAKER_MAX_REQUEST_BYTES" in err["message"]


@pytest.mark.parametrize(
    "field,value,limit",
    [("n", 129, "128"), ("best_of", 129, "128"), ("logprobs", 21, "20"), ("stop", ["a", "b", "c", "d", "e"], "4")],
)
def test_request_limits_name_the_limit(gpt2_client, field, value, limit):
    body = {**GOOD, field: value}
    if field == "best_of":
        body["n"] = 1
    err = error_of(gpt2_client.post(URL, json=body), 400, None, "invalid_request_error")
    assert err["param"] == field and limit in err["message"]


def test_context_limits_name_the_limit(gpt2_worker):
    client = make_app(gpt2_worker, max_input_tokens=4, max_total_tokens=8, access_log="off").test_client()
    err = error_of(client.post(URL, json={**GOOD, "prompt": [[1, 2, 3, 4, 5]]}), 400, "context_length_exceeded")
    assert "4" in err["message"]
    err = error_of(client.post(URL, json={**GOOD, "prompt": [[1, 2]], "max_tokens": 7}), 400, "context_length_exceeded")
    assert "8" in err["message"]
