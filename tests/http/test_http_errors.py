"""HTTP-level errors: every one is JSON of exactly OpenAI's shape {"error": {"message", "type", "param", "code"}}.

Malformed bodies, content types, routes, methods, body size, internal errors, readiness and request ids.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from conftest import make_settings

URL = "/v1/completions"
GOOD = {"model": "tiny-gpt2", "prompt": "Hello world", "max_tokens": 1, "temperature": 0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_error(
    resp, status: int, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> str:
    assert resp.status_code == status, (resp.status_code, resp.get_data(as_text=True))
    assert resp.mimetype == "application/json", resp.headers
    body = json.loads(resp.get_data(as_text=True))
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == type_ and err["code"] == code and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"].strip()
    assert "Traceback" not in err["message"] and 'File "' not in err["message"]
    assert "<html" not in resp.get_data(as_text=True).lower()
    return err["message"]


def assert_still_serving(client) -> None:
    resp = client.post(URL, json=GOOD)
    assert resp.status_code == 200, resp.get_data(as_text=True)


# -- bodies -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [
        b'{"prompt": "hi", ',  # truncated
        b"{'prompt': 'hi'}",  # single quotes
        b'{"prompt": "hi",}',  # trailing comma
        b"prompt=hi",
        b'{"prompt": "hi"} {"prompt": "again"}',
        b'\xff\xfe{"prompt": "hi"}',  # not UTF-8
    ],
    ids=["truncated", "single-quotes", "trailing-comma", "form", "two-objects", "bad-utf8"],
)
def test_malformed_json(gpt2_client, data):
    message = assert_error(gpt2_client.post(URL, data=data, content_type="application/json"), 400)
    assert "json" in message.lower()
    assert_still_serving(gpt2_client)


@pytest.mark.parametrize("depth", [129, 1000, 100_000])
def test_deeply_nested_json_is_a_400(gpt2_client, depth):
    """JSON nested deeper than a request can be (128 levels) is a clear 400, not a 500 with a traceback. The depth
    is counted before parsing, so the answer does not depend on how deep the stack already is (inside the full
    suite a depth of 1,000 once escaped as a RecursionError from the parsed body's walk)."""
    body = b'{"model": "tiny-gpt2", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    message = assert_error(gpt2_client.post(URL, data=body, content_type="application/json"), 400)
    assert "nested too deeply" in message
    assert_still_serving(gpt2_client)


def test_nesting_is_counted_outside_strings(gpt2_client):
    """Brackets inside strings are text: a prompt full of them is no deeper than its object, and 128 levels of
    arrays are still read (they fail as a prompt, not as nesting)."""
    body = json.dumps({"model": "tiny-gpt2", "prompt": "[" * 150 + '\\"{' * 10, "max_tokens": 1})
    assert gpt2_client.post(URL, data=body, content_type="application/json").status_code == 200
    deep = b'{"model": "tiny-gpt2", "prompt": ' + b"[" * 127 + b"]" * 127 + b"}"
    message = assert_error(gpt2_client.post(URL, data=deep, content_type="application/json"), 400, param="prompt")
    assert "nested too deeply" not in message


@pytest.mark.parametrize(
    "data",
    [b"[1, 2]", b'[{"prompt": "hi"}]', b"5", b'"prompt"', b"null", b"true"],
    ids=["list", "list-of-objects", "number", "string", "null", "bool"],
)
def test_json_that_is_not_an_object(gpt2_client, data):
    message = assert_error(gpt2_client.post(URL, data=data, content_type="application/json"), 400)
    assert "object" in message
    assert_still_serving(gpt2_client)


@pytest.mark.parametrize("data", [b"", b"   ", b"\n"], ids=["empty", "spaces", "newline"])
def test_empty_body(gpt2_client, data):
    message = assert_error(gpt2_client.post(URL, data=data, content_type="application/json"), 400)
    assert "empty" in message
    assert_still_serving(gpt2_client)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/xml"]
)
def test_wrong_content_type_is_415(gpt2_client, content_type):
    resp = gpt2_client.post(URL, data=json.dumps(GOOD), content_type=content_type)
    message = assert_error(resp, 415, code="unsupported_media_type")
    assert "application/json" in message
    assert_still_serving(gpt2_client)


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"]
)
def test_json_content_types_accepted(gpt2_client, content_type):
    resp = gpt2_client.post(URL, data=json.dumps(GOOD), content_type=content_type)
    assert resp.status_code == 200, resp.get_data(as_text=True)


# -- routes and methods -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/nope"),
        ("POST", "/v1/complete"),
        ("GET", "/v1"),
        ("POST", "/v2/completions"),
        ("GET", "/v1/completions/x"),
    ],
)
def test_unknown_route_is_404_json(gpt2_client, method, path):
    message = assert_error(gpt2_client.open(path, method=method), 404, code="not_found")
    assert path in message


@pytest.mark.parametrize(
    "method,path,allowed",
    [
        ("GET", URL, "POST"),
        ("PUT", URL, "POST"),
        ("DELETE", URL, "POST"),
        ("POST", "/health", "GET"),
        ("POST", "/v1/models", "GET"),
    ],
)
def test_wrong_method_is_405_json(gpt2_client, method, path, allowed):
    resp = gpt2_client.open(path, method=method)
    message = assert_error(resp, 405, code="method_not_allowed")
    assert method in message and allowed in message
    assert allowed in resp.headers.get("Allow", "")
    assert_still_serving(gpt2_client)


# -- body size ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_app(gpt2_dir, gpt2_worker):
    from app import create_app

    app = create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", max_request_bytes=1000), worker=gpt2_worker
    )
    app.config["TESTING"] = True
    return app


def test_oversized_body_is_413(small_app):
    client = small_app.test_client()
    body = dict(GOOD, prompt="x" * 2000)
    message = assert_error(client.post(URL, json=body), 413, code="request_too_large")
    assert "1000" in message
    assert_still_serving(client)


def test_body_just_under_the_limit_is_served(small_app):
    client = small_app.test_client()
    body = dict(GOOD, user="u")
    raw = json.dumps(body)
    body["user"] = "u" * (1000 - len(raw) + 1)
    data = json.dumps(body).encode()
    assert len(data) == 1000
    resp = client.post(URL, data=data, content_type="application/json")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    resp = client.post(URL, data=data + b" ", content_type="application/json")
    assert_error(resp, 413, code="request_too_large")


# -- internal errors --------------------------------------------------------------------------------------
def test_internal_error_is_500_with_request_id(gpt2_app, monkeypatch):
    service = gpt2_app.extensions["saker.service"]

    def boom(*args, **kwargs):
        raise RuntimeError("secret detail: CUDA exploded at 0xdeadbeef")

    monkeypatch.setattr(service, "complete", boom)
    client = gpt2_app.test_client()
    resp = client.post(URL, json=GOOD, headers={"X-Request-ID": "req-500-check"})
    message = assert_error(resp, 500, type_="server_error", code="internal_error")
    assert "req-500-check" in message
    assert "secret detail" not in message and "RuntimeError" not in message
    assert resp.headers["X-Request-ID"] == "req-500-check"
    # a generated request id is reported the same way
    resp = client.post(URL, json=GOOD)
    message = assert_error(resp, 500, type_="server_error", code="internal_error")
    assert resp.headers["X-Request-ID"] in message
    monkeypatch.undo()
    assert_still_serving(client)


# -- health and readiness ---------------------------------------------------------------------------------
def test_health_ready(gpt2_client):
    resp = gpt2_client.get("/health")
    assert resp.status_code == 200
    assert resp.get_json() == {"status": "ok"}


def _wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_health_503_while_loading_then_200(gpt2_dir):
    from app import create_app
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    settings = make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2")
    release = threading.Event()
    started = threading.Event()

    def loader():
        started.set()
        assert release.wait(30)
        return load_model(LoadConfig.of(settings))

    worker = Worker(("tiny-gpt2",), loader)
    app = create_app(settings, worker=worker)
    worker.load_in_background()
    client = app.test_client()
    try:
        assert started.wait(10)
        for path, method in [("/health", "GET"), ("/v1/models", "GET"), (URL, "POST")]:
            resp = client.open(path, method=method, json=GOOD if method == "POST" else None)
            assert_error(resp, 503, type_="service_unavailable", code="model_not_ready")
    finally:
        release.set()
    assert _wait_until(lambda: worker.ready)
    assert client.get("/health").status_code == 200
    assert client.post(URL, json=GOOD).status_code == 200


def test_health_503_after_a_failed_load(gpt2_dir):
    from app import create_app
    from app.engine.core.worker import Worker

    def loader():
        raise RuntimeError("weights are corrupt")

    worker = Worker(("tiny-gpt2",), loader)
    app = create_app(make_settings(model=str(gpt2_dir)), worker=worker)
    thread = worker.load_in_background()
    thread.join(10)
    resp = app.test_client().get("/health")
    message = assert_error(resp, 503, type_="service_unavailable", code="model_not_ready")
    assert "weights are corrupt" in message


# -- request ids ----------------------------------------------------------------------------------------
def test_request_id_echoed(gpt2_client):
    resp = gpt2_client.post(URL, json=GOOD, headers={"X-Request-ID": "abc-123"})
    assert resp.status_code == 200
    assert resp.headers["X-Request-ID"] == "abc-123"
    assert resp.get_json()["id"].startswith("cmpl-") and resp.get_json()["id"] != "cmpl-abc-123"
    # errors carry it too
    resp = gpt2_client.post(URL, json={}, headers={"X-Request-ID": "abc-124"})
    assert resp.status_code == 400 and resp.headers["X-Request-ID"] == "abc-124"
    resp = gpt2_client.get("/nope", headers={"X-Request-ID": "abc-125"})
    assert resp.status_code == 404 and resp.headers["X-Request-ID"] == "abc-125"


@pytest.mark.parametrize("given", [None, "", "has space", "bad\u00e9", "x" * 200, "<script>"])
def test_request_id_generated(gpt2_client, given):
    headers = {} if given is None else {"X-Request-ID": given}
    ids = set()
    for _ in range(2):
        resp = gpt2_client.post(URL, json=GOOD, headers=headers)
        assert resp.status_code == 200
        rid = resp.headers["X-Request-ID"]
        assert re.fullmatch(r"[A-Za-z0-9._:\-]{8,128}", rid), rid
        assert rid != given
        assert resp.get_json()["id"].startswith("cmpl-")
        ids.add(rid)
    assert len(ids) == 2  # a fresh one per request
