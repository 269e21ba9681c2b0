"""No request can wedge a real server (issue 35's wedge, over HTTP against gunicorn on 127.0.0.1).

The request that took the server down (``n = 128``, ``max_tokens = 1``: every candidate ends on its first token)
answers through /v1/completions and /v1/chat/completions, and the server answers the next request. With faults
injected into its steps (tests/decode_gate.py's ``TEST_FAULT_FILE``): a failed step is a JSON 500 naming the
request id and the same worker serves the next request; a failure the engine cannot recover from fails the request,
the worker exits and gunicorn's fresh worker serves the next one. In process and with SAKER_ENGINE_PROCESS."""

from __future__ import annotations

import pytest
import requests

from servers import Gunicorn


def completion(srv, **body):
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0, **body}
    return requests.post(srv.url + "/v1/completions", json=body, headers={"X-Request-ID": "wedge-test-1"}, timeout=120)


def wait_for(condition, what: str, deadline_s: float = 120) -> None:
    """Poll ``condition`` until it holds (a generous overall deadline only; no elapsed time is asserted)."""
    import threading

    tick = threading.Event()
    for _ in range(int(deadline_s / 0.05)):
        if condition():
            return
        tick.wait(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_the_widest_request_and_failed_steps_leave_the_server_serving(llama_dir, tmp_path, engine_process):
    fault = tmp_path / "fault"
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(llama_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-llama",
            "SAKER_ENGINE_PROCESS": "1" if engine_process else "0",
            "TEST_FAULT_FILE": str(fault),
        },
        args=("--pythonpath", "tests"),
        app="gated_wsgi:app",
    )
    with srv:
        srv.wait_ready()
        expected = completion(srv, max_tokens=8).json()["choices"][0]["text"]

        # the wedge: n = best_of = 128, max_tokens 1, then through chat, then the next request answers
        wide = completion(srv, n=128, best_of=128, max_tokens=1, temperature=1)
        assert wide.status_code == 200, wide.text
        assert sorted(c["index"] for c in wide.json()["choices"]) == list(range(128))
        chat = requests.post(
            srv.url + "/v1/chat/completions",
            json={"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "n": 128, "max_tokens": 1},
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
        assert len(chat.json()["choices"]) == 128
        assert completion(srv, max_tokens=8).json()["choices"][0]["text"] == expected

        # a failed step: a JSON 500 naming the request id; the same worker answers the next request
        workers = srv.worker_pids()
        fault.write_text("fail")
        failed = completion(srv)
        fault.unlink()
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "wedge-test-1" in error["message"] and "a step of the engine failed" in error["message"]
        assert "injected" not in error["message"]  # what failed inside is logged, not sent
        assert completion(srv, max_tokens=8).json()["choices"][0]["text"] == expected
        assert requests.get(srv.url + "/livez", timeout=10).status_code == 200
        assert srv.worker_pids() == workers

        # a failure the engine cannot recover from: the request fails, the worker is replaced, the server serves on
        fault.write_text("fatal")
        fatal = completion(srv)
        fault.unlink()
        assert fatal.status_code == 500
        assert "being replaced" in fatal.json()["error"]["message"]
        wait_for(lambda: srv.worker_pids() and not set(srv.worker_pids()) & set(workers), "a fresh worker")
        srv.wait_ready()
        assert completion(srv, max_tokens=8).json()["choices"][0]["text"] == expected
