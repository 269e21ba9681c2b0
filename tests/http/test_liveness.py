"""The liveness probe and failed steps over HTTP: ``/livez`` turns 503 (``engine_stalled``) while requests are in an
engine that makes no step for SAKER_LIVENESS_TIMEOUT seconds, and 200 again once it moves; a failed step is a JSON
500 naming the request id, and the next request is answered."""

from __future__ import annotations

import threading

import pytest

from conftest import make_settings


@pytest.fixture(scope="module")
def stalling_app(gpt2_dir):
    from app import create_app
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    settings = make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", liveness_timeout=0.2)
    worker = Worker.from_loaded(tuple(settings.model_names), load_model(LoadConfig.of(settings)))
    app = create_app(settings, worker=worker)
    app.config["TESTING"] = True
    yield app, worker
    worker.runner.fault = None


def poll(condition, what: str) -> None:
    tick = threading.Event()
    for _ in range(2400):  # a generous overall deadline; no elapsed time is asserted
        if condition():
            return
        tick.wait(0.05)
    raise AssertionError(f"never: {what}")


def test_livez_fails_while_the_engine_makes_no_step_and_recovers_when_it_moves(stalling_app):
    app, worker = stalling_app
    client = app.test_client()
    assert client.get("/livez").status_code == 200
    held, entered = threading.Event(), threading.Event()

    def hold(point: str) -> None:
        entered.set()
        held.wait(120)

    worker.runner.fault = hold
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(
            app.test_client().post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        )
    )
    thread.start()
    try:
        assert entered.wait(60)
        poll(lambda: client.get("/livez").status_code == 503, "/livez 503 while the engine is held")
        body = client.get("/livez").get_json()["error"]
        assert body["code"] == "engine_stalled" and "SAKER_LIVENESS_TIMEOUT=0.2" in body["message"]
        assert client.get("/health").status_code == 200  # ready: it is liveness that fails, not readiness
    finally:
        worker.runner.fault = None
        held.set()
    thread.join(120)
    assert answers and answers[0].status_code == 200
    poll(lambda: client.get("/livez").status_code == 200, "/livez 200 once the engine moves")


def test_a_failed_step_is_a_json_500_naming_the_request_and_the_next_one_answers(stalling_app):
    app, worker = stalling_app
    client = app.test_client()

    def fail(point: str) -> None:
        if point == "sample":
            raise RuntimeError("injected fault")

    worker.runner.fault = fail
    try:
        failed = client.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 3, "n": 128, "temperature": 1},
            headers={"X-Request-ID": "req-fault-1"},
        )
    finally:
        worker.runner.fault = None
    assert failed.status_code == 500
    error = failed.get_json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and error["param"] is None
    assert "req-fault-1" in error["message"] and "serves on" in error["message"]
    wide = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "n": 128, "temperature": 1})
    assert wide.status_code == 200 and len(wide.get_json()["choices"]) == 128, wide.get_data(as_text=True)
    worker.engine.wait_idle(60)
    assert worker.engine.batch.blocks.held_blocks == 0 and worker.engine.inconsistency() is None


def test_a_stream_whose_step_fails_ends_with_an_error_frame_naming_the_request(stalling_app):
    """After the first chunk is out: a ``data: {"error": ...}`` frame naming the request id, then ``[DONE]``."""
    import json

    app, worker = stalling_app
    scheduler = worker.engine

    def fail(point: str) -> None:
        if point == "sample":
            raise RuntimeError("injected fault")

    body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    answer = app.test_client().post(
        "/v1/completions", json=body, headers={"X-Request-ID": "req-stream-9"}, buffered=False
    )
    assert answer.status_code == 200
    text = ""
    try:
        for piece in answer.response:
            text += piece.decode() if isinstance(piece, bytes) else piece
            if '"choices"' in text:
                worker.runner.fault = fail  # the stream has started: its next step fails
    finally:
        worker.runner.fault = None
        answer.close()
    frames = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "internal_error" and "req-stream-9" in error["message"], error
    assert "choices" in json.loads(frames[0])  # a token came before the failure
    scheduler.wait_idle(60)
    assert scheduler.batch.blocks.held_blocks == 0
