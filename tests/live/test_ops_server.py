"""A real gunicorn on 127.0.0.1 with a tiny model: load with a small queue (200 or clean 429/503, none lost),
body limits without reading the body (Content-Length and chunked), API keys kept out of the logs, /metrics,
and graceful SIGTERM with requests in flight."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tooling.sse import read_stream
from servers import Gunicorn, read_response

pytestmark = pytest.mark.slow

KEY = "ops-test-secret-key-9f3b"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
CLIENTS, ROUNDS = 16, 4


@pytest.fixture(scope="module")
def server(gpt2_dir, tmp_path_factory):
    access_log = tmp_path_factory.mktemp("ops") / "access.log"
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "24",
            "SAKER_MAX_BATCH_ROWS": "2",
            "SAKER_MAX_RUNNING_REQUESTS": "2",
            "SAKER_MAX_QUEUE": "2",
            "SAKER_QUEUE_TIMEOUT": "60",
            "SAKER_MAX_REQUEST_BYTES": str(LIMIT),
            "SAKER_API_KEYS": f"{KEY},second-key",
            "SAKER_ACCESS_LOG": str(access_log),
        }
    )
    srv.access_log = access_log
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def metrics(server) -> dict:
    text = requests.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def is_error_object(body) -> bool:
    return (
        isinstance(body, dict)
        and list(body) == ["error"]
        and set(body["error"]) == {"message", "type", "param", "code"}
    )


# -- load ---------------------------------------------------------------------------------------------------
def test_load_every_request_answered_200_or_clean_429_503(server):
    before = metrics(server)
    start = threading.Barrier(CLIENTS)
    body = {"model": "tiny-gpt2", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    def client(i: int) -> list[tuple[int, str]]:
        outcomes = []
        with requests.Session() as session:
            session.headers.update(AUTH)
            for r in range(ROUNDS):
                start.wait(60)  # bursts: every client sends at once
                stream = (i + r) % 3 == 0
                try:
                    resp = session.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=120)
                except requests.RequestException as exc:  # a lost request
                    outcomes.append((-1, repr(exc)))
                    continue
                if resp.status_code == 200 and stream:
                    frames = read_stream(resp.content)
                    ok = frames.done and not frames.errors
                    outcomes.append((200 if ok else -2, resp.text[-300:]))
                elif resp.status_code == 200:
                    ok = resp.json()["usage"]["completion_tokens"] == 48
                    outcomes.append((200 if ok else -2, resp.text[:300]))
                else:
                    clean = (
                        resp.status_code in (429, 503)
                        and is_error_object(resp.json())
                        and int(resp.headers["Retry-After"]) >= 1
                    )
                    outcomes.append((resp.status_code if clean else -3, resp.text[:300]))
        return outcomes

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [o for outcomes in pool.map(client, range(CLIENTS)) for o in outcomes]
    counts = Counter(status for status, _ in results)
    print(f"load: {CLIENTS} clients x {ROUNDS} requests -> {dict(counts)}")
    assert len(results) == CLIENTS * ROUNDS
    assert set(counts) <= {200, 429, 503}, [r for r in results if r[0] not in (200, 429, 503)][:3]
    assert counts[200] >= CLIENTS // 4 and counts[429] >= 1, counts

    # healthy afterwards, and the metrics saw exactly that
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    after = metrics(server)
    assert sample(after, "saker_queue_depth") == 0 and sample(after, "saker_requests_running") == 0
    for status in (200, 429, 503):
        seen = sample(
            after, "saker_requests_total", route="/v1/completions", method="POST", status=str(status)
        ) - sample(before, "saker_requests_total", route="/v1/completions", method="POST", status=str(status))
        assert seen == counts[status], (status, seen, counts)
    assert (
        sample(after, "saker_requests_rejected_total") - sample(before, "saker_requests_rejected_total") == counts[429]
    )
    resp = requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200
    out = server.output()
    assert "Traceback" not in out and out.count("Booting worker") == 1


# -- body limits ------------------------------------------------------------------------------------------
def raw_request(server, head: bytes, body_parts: list[bytes], *, shut: bool = False) -> bytes:
    """Send a request by hand and read what comes back (up to the end of the first response's body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        return read_response(sock)


def parse(raw: bytes) -> tuple[int, dict]:
    header, _, body = raw.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1])
    return status, json.loads(body)


def head(path: str, extra: str, auth: bool = True) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if auth:
        lines.append(f"Authorization: Bearer {KEY}")
    return ("\r\n".join(lines + [extra]) + "\r\n\r\n").encode()


def test_413_from_content_length_before_the_body_is_read(server):
    # the client announces 100 MB and sends 100 bytes: the answer comes without waiting for the rest
    raw = raw_request(server, head("/v1/completions", "Content-Length: 100000000"), [b'{"prompt": "' + b"x" * 88])
    status, body = parse(raw)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(LIMIT) in body["error"]["message"] and "SAKER_MAX_REQUEST_BYTES" in body["error"]["message"]


def test_413_for_a_chunked_body_stops_reading_at_the_limit(server):
    chunk = b"x" * 4096
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (LIMIT // len(chunk) + 4)  # over the limit, never ended
    raw = raw_request(server, head("/v1/completions", "Transfer-Encoding: chunked"), parts)
    status, body = parse(raw)
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_small_chunked_body_is_served(server):
    payload = json.dumps({"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 2}).encode()
    parts = [
        b"%x\r\n%s\r\n" % (len(payload[:10]), payload[:10]),
        b"%x\r\n%s\r\n" % (len(payload[10:]), payload[10:]),
        b"0\r\n\r\n",
    ]
    raw = raw_request(server, head("/v1/completions", "Transfer-Encoding: chunked\r\nConnection: close"), parts)
    status, body = parse(raw)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "parts",
    [
        [b"ZZ\r\nabc\r\n0\r\n\r\n"],  # not a hex size
        [b"-1\r\nabc\r\n0\r\n\r\n"],  # a negative size
        [b"10\r\nabc\r\n0\r\n\r\n"],  # a chunk shorter than its size
    ],
    ids=["ZZ", "minus-one", "short-chunk"],
)
def test_malformed_chunked_bodies_are_400(server, parts):
    raw = raw_request(server, head("/v1/completions", "Transfer-Encoding: chunked"), parts, shut=True)
    status, body = parse(raw)
    assert status == 400 and is_error_object(body)


def test_content_encoding(server):
    """gzip and deflate bodies are decoded (their decoded size counts against the body limit); others are 415."""
    import gzip
    import zlib

    payload = json.dumps({"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 2}).encode()

    def post(body: bytes, encoding: str):
        return requests.post(
            server.url + "/v1/completions",
            data=body,
            timeout=60,
            headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": encoding},
        )

    assert post(gzip.compress(payload), "gzip").json()["usage"]["completion_tokens"] == 2
    assert post(zlib.compress(payload), "deflate").status_code == 200
    bomb = post(gzip.compress(b" " * (LIMIT * 4) + payload), "gzip")  # 256 KB of spaces in ~300 bytes
    assert bomb.status_code == 413 and bomb.json()["error"]["code"] == "request_too_large"
    assert post(b"\x1f\x8b not gzip", "gzip").status_code == 400
    assert post(gzip.compress(payload)[:-12], "gzip").status_code == 400  # truncated stream
    br = post(payload, "br")
    assert br.status_code == 415 and is_error_object(br.json()) and "br" in br.json()["error"]["message"]


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /health\r\n\r\n", 400),  # HTTP/0.9
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\n",
            400,
        ),
        (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
    ],
    ids=["http-0.9", "bad-content-length", "two-content-lengths", "cl-and-te", "long-request-line", "too-many-headers"],
)
def test_protocol_errors_are_json(server, request_bytes, status):
    """What gunicorn answers itself, before the app: the OpenAI error shape too (app/gunicorn_errors.py)."""
    raw = raw_request(server, request_bytes, [], shut=True)
    got, body = parse(raw)
    assert got == status and is_error_object(body), raw[:300]
    assert b"Content-Type: application/json" in raw.split(b"\r\n\r\n")[0]


def test_401_comes_before_the_body_is_read(server):
    raw = raw_request(server, head("/v1/completions", "Content-Length: 100000000", auth=False), [b"{"])
    status, body = parse(raw)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


# -- keys and logs ------------------------------------------------------------------------------------------
def test_keys_and_prompts_never_reach_the_logs(server):
    prompt = "a private prompt 5d1c"
    ok = requests.post(
        server.url + "/v1/completions",
        headers={"Authorization": "Bearer second-key"},
        json={"model": "tiny-gpt2", "prompt": prompt, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200
    wrong = requests.post(
        server.url + "/v1/completions",
        headers={"Authorization": "Bearer wrong-key-77aa"},
        json={"model": "tiny-gpt2", "prompt": "x"},
        timeout=60,
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    health = requests.get(server.url + "/health", timeout=10)
    assert health.status_code == 200  # open
    models = requests.get(server.url + "/v1/models", timeout=10)
    assert models.status_code == 401
    ids = {r.headers["X-Request-ID"] for r in (ok, wrong, health, models)}

    def logged() -> set[str]:
        return {json.loads(x)["request_id"] for x in server.access_log.read_text().splitlines()} & ids

    deadline = time.monotonic() + 60  # a safety net only: the lines are written as the answers go out
    while logged() != ids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged() == ids  # every request above has its access-log line
    logs = server.output() + server.access_log.read_text()
    for secret in (KEY, "second-key", "wrong-key-77aa", prompt):
        assert secret not in logs
    lines = [json.loads(x) for x in server.access_log.read_text().splitlines()]
    assert any(x["status"] == 401 and x["error_code"] == "invalid_api_key" for x in lines)
    assert all(set(x) >= {"request_id", "method", "route", "status", "client", "duration_ms"} for x in lines)


# -- graceful shutdown ----------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead and waiting to be reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_sigterm_lets_in_flight_requests_finish(gpt2_dir, tmp_path, engine_process):
    """Requests are held mid-generation by a gate (tests/gated_wsgi.py; with SAKER_ENGINE_PROCESS the engine
    process's steps wait), SIGTERM is sent to the master: new connections are refused at once (not left hanging),
    the gate opens, every request in flight completes whole, and gunicorn then exits 0 leaving no process behind
    (the engine process ends with its worker)."""
    gate = tmp_path / "gate"
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "8",
            "SAKER_GRACEFUL_TIMEOUT": "60",
            "SAKER_ENGINE_PROCESS": "1" if engine_process else "0",
            "TEST_DECODE_GATE": str(gate),
        },
        args=("--pythonpath", "tests"),
        app="gated_wsgi:app",
    )
    try:
        srv.wait_ready()
        gate.touch()  # decode steps wait from now on
        body = {
            "model": "tiny-gpt2",
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
        }

        def plain():
            return requests.post(srv.url + "/v1/completions", json=body, timeout=120)

        def stream():
            with requests.post(
                srv.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120
            ) as resp:
                return resp.status_code, read_stream(resp.iter_content(None))

        with ThreadPoolExecutor(5) as pool:
            plains = [pool.submit(plain) for _ in range(3)]
            streams = [pool.submit(stream) for _ in range(2)]
            deadline = time.time() + 60  # all five are in the server, generating
            while sample(metrics(srv), "saker_requests_in_flight") < 6 and time.time() < deadline:
                time.sleep(0.05)
            assert sample(metrics(srv), "saker_requests_in_flight") == 6  # 5 + this scrape
            processes = srv.worker_pids()  # the worker (and its engine process)
            # the worker; with the engine process also it and multiprocessing's resource tracker
            assert len(processes) == (3 if engine_process else 1)
            srv.proc.send_signal(signal.SIGTERM)  # what docker stop / kubelet / scancel send
            while "Handling signal: term" not in srv.output() and time.time() < deadline:
                time.sleep(0.05)
            assert "Handling signal: term" in srv.output()
            assert srv.proc.poll() is None, "gunicorn exited with requests in flight"
            # a new connection is refused (the listeners are closed), not taken into a backlog that nobody accepts
            # from: connect until refused, while the requests in flight are still held at the gate
            host, port = srv.url.split("//")[1].split(":")
            deadline = time.monotonic() + 60  # a safety net only
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=10).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, "new connections were still taken 60 s into the drain"
                time.sleep(0.05)
            assert all(not f.done() for f in plains + streams)  # refused while they were still in flight
            gate.unlink()  # let them finish
            answers = [f.result() for f in plains]
            streamed = [f.result() for f in streams]
        for resp in answers:
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 40
        for status, frames in streamed:
            assert status == 200 and frames.done and frames.chunks and not frames.errors
        assert srv.proc.wait(90) == 0
        assert "Traceback" not in srv.output()
        left = [pid for pid in processes if alive(pid)]
        assert not left, f"still running after gunicorn exited: {left}"
    finally:
        if gate.exists():
            gate.unlink()
        srv.stop()


def test_a_plain_request_whose_client_left_stops_generating(gpt2_dir, tmp_path):
    """A non-streamed request's client closes its connection while the answer is generated: the server notices
    while it waits (the socket reads as closed), cancels the request (its rows leave at the next step, far
    before max_tokens) and logs status 499; the next request is served as usual."""
    gate, count, access_log = tmp_path / "gate", tmp_path / "steps", tmp_path / "access.log"
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "8",
            "TEST_DECODE_GATE": str(gate),
            "TEST_DECODE_COUNT": str(count),
            "SAKER_ACCESS_LOG": str(access_log),
        },
        args=("--pythonpath", "tests"),
        app="gated_wsgi:app",
    )
    try:
        srv.wait_ready()
        gate.touch()  # decode steps wait from now on
        count.write_text("")
        body = json.dumps(
            {
                "model": "tiny-gpt2",
                "prompt": "Once upon a time",
                "max_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        host, port = srv.url.split("//")[1].split(":")
        client = socket.create_connection((host, int(port)), timeout=10)
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.time() + 30
        while sample(metrics(srv), "saker_requests_in_flight") < 2 and time.time() < deadline:
            time.sleep(0.05)  # it is in the server, its first step held at the gate
        client.close()  # the client goes away

        def completions_lines() -> list[str]:
            text = access_log.read_text() if access_log.exists() else ""
            return [x for x in text.splitlines() if '"/v1/completions"' in x]

        deadline = time.time() + 30  # a safety net only: the request thread sees the close while the step is held
        while not completions_lines() and time.time() < deadline:
            time.sleep(0.05)
        line = json.loads(completions_lines()[0])
        assert line["status"] == 499 and line["error_code"] == "client_closed_request"
        gate.unlink()  # the request was cancelled before any step after the held one
        after = requests.post(  # served once the scheduler has dropped the cancelled rows
            srv.url + "/v1/completions",
            json={"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
            timeout=30,
        )
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
        steps = count.read_text().count("step")
        # far from 200 tokens: the held step (if its first decode step had begun), the next at most, and the
        # second request's two decode steps (its first token comes from its prefill)
        assert steps <= 5, steps
        assert line["completion_tokens"] <= 2  # what it generated before it stopped
        assert re.search(r"ended early after \d+ generated tokens: its client closed", srv.output())
    finally:
        if gate.exists():
            gate.unlink()
        srv.stop()
    assert "Traceback" not in srv.output()


# -- a client that leaves while its prompt is computed -----------------------------------------------------------------
PROMPT = "Once upon a time there was a little"  # a few tokens: one step computes it (no chunks)


def wait_for(condition, what: str, limit: float = 60) -> None:
    """Poll ``condition`` until it holds; ``limit`` seconds is a safety net only, never a bound checked."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit} s"
        time.sleep(0.02)


def held(gate: Path) -> bool:
    """Whether an engine step waits at ``gate`` now (tests/decode_gate.py)."""
    return Path(f"{gate}.held").exists()


def send_raw(srv, body: dict) -> socket.socket:
    """A completion request sent on a socket of its own, its answer not read (the test closes it)."""
    data = json.dumps({"model": "tiny-gpt2", **body}).encode()
    host, port = srv.url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def access_lines(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text.splitlines() if '"/v1/completions"' in x]


def check_greedy(answer: dict, reference, gpt2_dir, prompt: str, tokens: int) -> None:
    """A greedy answer against the references: ``model.generate()``'s tokens (its text, the tokenizer's decode)
    and a plain forward's log-softmax for each token's logprob."""
    from references import ref_greedy, ref_logprobs

    model, tok = reference(gpt2_dir)
    ids = tok(prompt).input_ids
    want = ref_greedy(model, tok, ids, tokens)
    lp = ref_logprobs(model, want)
    choice = answer["choices"][0]
    assert choice["text"] == tok.decode(want[len(ids) :])
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(want[len(ids) :])], abs=1e-4
    )


def idle(srv) -> bool:
    return sample(metrics(srv), "saker_requests_running") == 0


@pytest.mark.parametrize("n", [1, 3], ids=["one-row", "three-candidates"])
def test_a_client_that_leaves_during_its_prefill_frees_everything(gpt2_dir, tmp_path, reference, n):
    """A non-streamed request's client closes its connection while the engine computes its prompt (one step, not
    chunked; with ``n=3`` its candidates share that prompt's blocks), held there by the prefill gate: the request
    ends (499), no decode step runs for it, every block it held is free once nothing runs (KV usage 0),
    and the next request, the same prompt (whose blocks the prefix cache may now offer), answers as the references
    (``model.generate()``, a plain forward's log-softmax)."""
    gate, steps, prompts, access_log = (tmp_path / name for name in ("prefill", "steps", "prompts", "access.log"))
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "8",
            "TEST_PREFILL_GATE": str(gate),
            "TEST_DECODE_COUNT": str(steps),
            "TEST_PREFILL_COUNT": str(prompts),
            "SAKER_ACCESS_LOG": str(access_log),
        },
        args=("--pythonpath", "tests"),
        app="gated_wsgi:app",
    )
    try:
        srv.wait_ready()
        gate.touch()  # steps that compute prompt tokens wait from now on
        steps.write_text("")
        prompts.write_text("")
        body = {"prompt": PROMPT, "max_tokens": 50, "n": n, "temperature": 0.8, "seed": 1, "ignore_eos": True}
        client = send_raw(srv, body)
        wait_for(lambda: held(gate), "the prompt's step held at the gate")
        client.close()  # the client goes away while its prompt is computed
        wait_for(lambda: access_lines(access_log), "the request's access-log line")
        [line] = access_lines(access_log)
        assert line["status"] == 499 and line["error_code"] == "client_closed_request"
        gate.unlink()  # the held step ends; the cancelled request leaves at the next
        wait_for(lambda: idle(srv), "nothing running")
        assert sample(metrics(srv), "saker_kv_cache_usage") == 0  # its blocks are free
        # none of its 49 decode steps ran: a prompt whose client left while it was computed does not join the batch
        assert steps.read_text().count("step") == 0
        assert prompts.read_text().split() == [str(len(reference(gpt2_dir)[1](PROMPT).input_ids))]  # one step
        after = requests.post(
            srv.url + "/v1/completions",
            json={"model": "tiny-gpt2", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1},
            timeout=60,
        )
        assert after.status_code == 200, after.text
        check_greedy(after.json(), reference, gpt2_dir, PROMPT, 8)
        wait_for(lambda: idle(srv), "nothing running")
        assert sample(metrics(srv), "saker_kv_cache_usage") == 0
    finally:
        gate.unlink(missing_ok=True)
        srv.stop()
    assert "Traceback" not in srv.output()


def test_a_client_that_leaves_a_shared_prefill_step_leaves_the_others_right(gpt2_dir, tmp_path, reference):
    """Three requests: A decoding (held at its first decode step), then B and C arriving, so that B's and C's
    prompts are computed in one step together with A's row (held there by the prefill gate; the step's token count
    shows it). C's client leaves: C ends (499), A and B answer as the references (``model.generate()``, a plain
    forward's log-softmax), and every block is free once nothing runs."""
    decode, prefill, counts, access_log = (tmp_path / name for name in ("decode", "prefill", "prompts", "access.log"))
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "8",
            "TEST_DECODE_GATE": str(decode),
            "TEST_PREFILL_GATE": str(prefill),
            "TEST_PREFILL_COUNT": str(counts),
            "SAKER_ACCESS_LOG": str(access_log),
        },
        args=("--pythonpath", "tests"),
        app="gated_wsgi:app",
    )
    _, tok = reference(gpt2_dir)
    texts = {"A": "The capital of France is", "B": PROMPT, "C": "Hello world, this is"}
    greedy = {"max_tokens": 8, "temperature": 0, "logprobs": 1}
    try:
        srv.wait_ready()
        decode.touch()
        with ThreadPoolExecutor(2) as pool:

            def post(name: str):
                return requests.post(
                    srv.url + "/v1/completions",
                    json={"model": "tiny-gpt2", "prompt": texts[name], **greedy},
                    timeout=120,
                )

            a = pool.submit(post, "A")
            wait_for(lambda: held(decode), "A decoding, held at its first decode step")
            prefill.touch()
            counts.write_text("")
            b = pool.submit(post, "B")
            c = send_raw(srv, {"prompt": texts["C"], "max_tokens": 50, "temperature": 0, "ignore_eos": True})
            wait_for(lambda: sample(metrics(srv), "saker_requests_running") == 3, "B and C in the engine's queue")
            decode.unlink()  # A's step ends; the next one takes B's and C's prompts with A's row
            wait_for(lambda: held(prefill), "the shared prompt step held at the gate")
            shared = 1 + len(tok(texts["B"]).input_ids) + len(tok(texts["C"]).input_ids)
            c.close()  # C's client goes away while its prompt is computed beside B's
            wait_for(lambda: access_lines(access_log), "C's access-log line")
            [line] = access_lines(access_log)
            assert line["status"] == 499 and line["error_code"] == "client_closed_request"
            prefill.unlink()
            answers = {"A": a.result(), "B": b.result()}
        assert counts.read_text().split()[0] == str(shared)  # A's row and both prompts in the held step
        for name, answer in answers.items():
            assert answer.status_code == 200, answer.text
            check_greedy(answer.json(), reference, gpt2_dir, texts[name], 8)
        wait_for(lambda: idle(srv), "nothing running")
        assert sample(metrics(srv), "saker_kv_cache_usage") == 0  # C's blocks are free too
        after = requests.post(
            srv.url + "/v1/completions", json={"model": "tiny-gpt2", "prompt": texts["C"], **greedy}, timeout=60
        )
        assert after.status_code == 200, after.text
        check_greedy(after.json(), reference, gpt2_dir, texts["C"], 8)
    finally:
        decode.unlink(missing_ok=True)
        prefill.unlink(missing_ok=True)
        srv.stop()
    assert "Traceback" not in srv.output()
