"""Probes and the router-facing metrics: /livez and /readyz open without a key (503 while loading or draining, in
the OpenAI error shape), and vLLM's metric names with their model_name label."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_settings


@pytest.fixture()
def keyed(gpt2_dir, gpt2_worker):
    from app import create_app

    return create_app(
        make_settings(
            model=str(gpt2_dir), served_model_name="tiny-gpt2", api_keys="probe-key", prefix_cache_tokens=2048
        ),
        worker=gpt2_worker,
    ).test_client()


def samples(client) -> dict:
    text = client.get("/metrics").get_data(as_text=True)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_probes_are_open_and_follow_readiness(keyed):
    from app import lifecycle

    assert keyed.get("/livez").get_json() == {"status": "alive"}
    assert keyed.get("/readyz").get_json() == {"status": "ready"}
    lifecycle.draining.set()
    try:
        resp = keyed.get("/readyz")
        assert resp.status_code == 503 and resp.get_json()["error"]["code"] == "draining"
        assert resp.headers["Retry-After"] == "1"
        assert keyed.get("/livez").status_code == 200
    finally:
        lifecycle.draining.clear()


def test_readyz_is_503_while_the_model_loads(gpt2_dir):
    from app import create_app
    from app.engine.core.worker import Worker

    settings = make_settings(model=str(gpt2_dir))
    loading = Worker.from_settings(settings)  # never loaded
    client = create_app(settings, worker=loading).test_client()
    assert client.get("/readyz").status_code == 503 and client.get("/livez").status_code == 200


def test_vllm_metric_names(keyed):
    keyed.post(
        "/v1/completions",
        json={
            "model": "tiny-gpt2",
            "prompt": "Hello world, this is a longer prompt that the prefix cache can keep for later",
            "max_tokens": 1,
        },
        headers={"Authorization": "Bearer probe-key"},
    )
    values = samples(keyed)
    label = (("model_name", "tiny-gpt2"),)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        assert (name, label) in values, name
    assert values[("saker_preemptions_total", ())] == values[("vllm:num_preemptions_total", label)]
    assert values[("vllm:prefix_cache_queries_total", label)] > 0
    assert ("vllm:prefix_cache_hits_total", label) in values
    assert any(name == "vllm:lora_requests_info" for name, _ in values)


def test_vllm_metric_names_can_be_switched_off(gpt2_dir, gpt2_worker):
    from app import create_app

    client = create_app(make_settings(model=str(gpt2_dir), vllm_metrics=False), worker=gpt2_worker).test_client()
    assert not any(name.startswith("vllm:") for name, _ in samples(client))


DRAIN = 15  # seconds: long beside the few local requests made during a drain (no check here reads a clock)


def until(condition, what: str, limit: float = 60) -> None:
    """Poll ``condition`` until it holds; ``limit`` seconds is a safety net only, never a bound checked."""
    import time

    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit} s"
        time.sleep(0.05)


def refuses(url: str) -> bool:
    """Whether a new connection to the server is refused (its listeners closed)."""
    import socket

    host, port = url.split("//")[1].split(":")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


def delivered(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has no ``signum`` pending any more (the kernel handed it to the process; its Python
    handler runs before the main thread's next bytecode, so before it accepts another connection)."""
    from pathlib import Path

    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    bit = 1 << (signum - 1)
    return not (int(fields["SigPnd"], 16) & bit or int(fields["ShdPnd"], 16) & bit)


@pytest.mark.slow
def test_sigterm_drains_then_refuses(gpt2_dir):
    """Under gunicorn with SAKER_DRAIN_SECONDS: after SIGTERM /readyz says 503 while requests are still served;
    after the drain new connections are refused, and gunicorn exits 0. Events in order, no clock: 503, then a
    request served, then refusals, then the exit."""
    import signal

    import requests

    from servers import Gunicorn

    srv = Gunicorn(
        {"SAKER_MODEL": str(gpt2_dir), "SAKER_SERVED_MODEL_NAME": "tiny-gpt2", "SAKER_DRAIN_SECONDS": str(DRAIN)}
    )
    try:
        srv.wait_ready()
        assert requests.get(srv.url + "/readyz", timeout=10).status_code == 200
        srv.proc.send_signal(signal.SIGTERM)
        # not ready at once (a refused connection before the 503 would fail here: the drain must come first)
        until(lambda: requests.get(srv.url + "/readyz", timeout=10).status_code == 503, "/readyz 503")
        ready = requests.get(srv.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
        assert f"draining: not ready, stopping in {DRAIN:g} s" in srv.output()
        # a request sent while draining is still served
        served = requests.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert served.status_code == 200
        until(lambda: refuses(srv.url), "new connections refused after the drain", limit=DRAIN + 60)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def children(pid: int) -> list[int]:
    """The gunicorn master's worker processes."""
    from pathlib import Path

    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            out.append(int(status.parent.name))
    return out


@pytest.mark.slow
def test_signals_to_the_whole_process_group(gpt2_dir):
    """systemd's default stop (and Ctrl-C in a terminal) signals the whole process group, so each worker hears the
    signal twice (directly and relayed by the master): a second SIGTERM does not cut the drain short, and a double
    SIGINT stops at once instead of deadlocking the worker until the master kills it (after the graceful timeout:
    the exit comes well before it). Events in order, no clock."""
    import os
    import signal

    import requests

    from servers import Gunicorn

    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_DRAIN_SECONDS": str(DRAIN),
            "SAKER_GRACEFUL_TIMEOUT": "120",
        }
    )
    try:
        srv.wait_ready()
        workers = children(srv.proc.pid)
        os.killpg(srv.proc.pid, signal.SIGTERM)
        # the first one handled: draining (not ready, still serving)
        until(lambda: requests.get(srv.url + "/readyz", timeout=10).status_code == 503, "/readyz 503")
        for pid in workers:  # a second one, surely apart from the first (which was handled: two at once may merge)
            os.kill(pid, signal.SIGTERM)
        until(lambda: all(delivered(pid, signal.SIGTERM) for pid in workers), "the second SIGTERM delivered")
        # had the second signal stopped the worker, it would have closed its listeners by the second of these
        for _ in range(3):
            assert requests.get(srv.url + "/readyz", timeout=10).status_code == 503  # draining, not gone
        assert srv.output().count("draining: not ready") == len(workers)  # the drain began once
        until(lambda: refuses(srv.url), "new connections refused after the drain", limit=DRAIN + 60)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    srv = Gunicorn(
        {"SAKER_MODEL": str(gpt2_dir), "SAKER_SERVED_MODEL_NAME": "tiny-gpt2", "SAKER_GRACEFUL_TIMEOUT": "600"}
    )
    try:
        srv.wait_ready()
        workers = children(srv.proc.pid)
        os.killpg(srv.proc.pid, signal.SIGINT)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        # a hung worker would be killed by the master only after the graceful timeout (600 s): the wait's safety
        # net (120 s) ends first and fails
        srv.proc.wait(120)
    finally:
        srv.stop()
