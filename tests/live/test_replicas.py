"""Two saker replicas behind a real nginx running deploy/nginx/saker-replicas.conf (only the addresses changed), all
on 127.0.0.1: requests spread over both; a replica killed mid-load loses only what it held and the router moves
on; a draining replica (SIGTERM, SAKER_DRAIN_SECONDS) gets nothing new once it refuses connections; requests of one
X-Session-ID land on one replica, whose prefix cache then hits.

How nginx learns that a replica is gone: open-source nginx has no active health checks (``health_check`` is nginx
Plus), so it never asks ``/readyz``. It relies on passive failure instead: a connection the replica refuses (or a
connect timeout) is an ``error`` in ``proxy_next_upstream``, so the request is passed to the next replica (it never
reached the first, so even a POST may be retried) and the replica is left out for ``fail_timeout`` after
``max_fails`` such failures. That is why saker's drain ends by closing its listening socket: from then on every
connection is refused at once. During the drain itself the replica still serves whatever nginx sends it (only a
router that reads ``/readyz``, such as Kubernetes' endpoints or the Gateway API Inference Extension, stops sooner).

Which replica answered is read from each replica's own access log (SAKER_ACCESS_LOG, one per replica), joined on the
X-Request-ID the client sent, and from nginx's access log (``$upstream_addr``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tooling.bench.nginx import REPLICAS_CONF, Router, nginx_binary, render_replicas_conf
from servers import Gunicorn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        nginx_binary() is None,
        reason="nginx is not installed (apt-get install nginx; .ci/run installs it when it runs as root)",
    ),
]

MODEL = "tiny-gpt2"
DRAIN_SECONDS = 10.0  # long beside the few requests the drain test waits for (no check reads a clock)


class Pool:
    """Replicas of the tiny GPT-2 (one gunicorn each, its own access log) and the router in front of them. The
    replicas run tests/gated_wsgi.py: while the file ``gate`` exists their decode steps wait (a test can hold requests
    in flight); without it they serve as ``wsgi:app`` does."""

    def __init__(self, model_dir: Path, root: Path):
        self.model_dir, self.root = model_dir, root
        self.gate = root / "decode-gate"
        self.replicas: list[Gunicorn] = []
        self.router: Router | None = None
        self._count = 0

    def _start(self, n: int) -> list[Gunicorn]:
        started = []
        for _ in range(n):
            self._count += 1
            log = self.root / f"replica-{self._count}.jsonl"
            replica = Gunicorn(
                {
                    "SAKER_MODEL": str(self.model_dir),
                    "SAKER_SERVED_MODEL_NAME": MODEL,
                    "SAKER_ACCESS_LOG": str(log),
                    "SAKER_DRAIN_SECONDS": str(DRAIN_SECONDS),
                    "SAKER_PROXY_HOPS": "1",
                    "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1",
                    "TEST_DECODE_GATE": str(self.gate),
                },
                args=("--pythonpath", "tests"),
                app="gated_wsgi:app",
            )
            replica.access_log = log
            self.replicas.append(replica)
            started.append(replica)
        for replica in started:
            replica.wait_ready()
            for _ in range(2):  # the first forwards are slow: warm up before anything is measured
                requests.post(
                    replica.url + "/v1/completions",
                    timeout=60,
                    json={"model": MODEL, "prompt": "Warm up", "max_tokens": 4},
                ).raise_for_status()
        return started

    def alive(self) -> list[Gunicorn]:
        return [r for r in self.replicas if r.proc.poll() is None]

    def ensure(self, n: int) -> list[Gunicorn]:
        """At least ``n`` replicas running and the router pointing at exactly those (reloaded when it changed)."""
        missing = n - len(self.alive())
        if missing > 0:
            self._start(missing)
        addresses = [f"127.0.0.1:{r.port}" for r in self.alive()]
        if self.router is None:
            self.router = Router(self.root / "nginx", addresses)
            self.router.wait_ready()
        elif addresses != self.router.replicas:
            self.router.reload(addresses)
        return self.alive()

    def served_by(self, ids=(), timeout: float = 10) -> dict[str, int]:
        """request id -> port of the replica that logged it; waits until every one of ``ids`` is there (a line is
        written just after the answer is sent)."""
        deadline = time.time() + timeout
        while True:
            out = {}
            for replica in self.replicas:
                if replica.access_log.exists():
                    for line in replica.access_log.read_text().splitlines():
                        if line.endswith("}"):
                            out[json.loads(line)["request_id"]] = replica.port
            if all(i in out for i in ids) or time.time() > deadline:
                return out
            time.sleep(0.05)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        # SIGINT to the master alone (it stops its worker with one SIGQUIT): a signal to the whole process group
        # reaches the worker twice, and gunicorn's gthread quit handler can deadlock on the second one
        for replica in self.alive():
            replica.proc.send_signal(signal.SIGINT)
        for replica in self.replicas:
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.proc.wait(15)
            replica.stop()


@pytest.fixture(scope="module")
def pool(gpt2_dir, tmp_path_factory):
    pool = Pool(gpt2_dir, tmp_path_factory.mktemp("replicas"))
    try:
        pool.ensure(2)
        yield pool
    finally:
        pool.stop()


def completion(
    url: str, prompt: str, session: str | None = None, http: requests.Session | None = None, max_tokens: int = 6
) -> tuple[str, requests.Response]:
    request_id = uuid.uuid4().hex
    headers = {"X-Request-ID": request_id}
    if session is not None:
        headers["X-Session-ID"] = session
    resp = (http or requests).post(
        url + "/v1/completions",
        headers=headers,
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    return request_id, resp


class Load:
    """``clients`` closed loops of completions through the router (no session id) until ``stop()``; every request's
    id, start and end time and status (None: no HTTP answer at all)."""

    def __init__(self, url: str, clients: int = 8):
        self.url, self.records, self._stop = url, [], threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        http = requests.Session()
        n = 0
        while not self._stop.is_set():
            n += 1
            start = time.time()
            try:
                request_id, resp = completion(self.url, f"Load {i}.{n}: once upon a time", http=http)
                status, code = resp.status_code, (resp.json().get("error") or {}).get("code")
            except requests.RequestException as exc:  # no HTTP answer at all: the connection broke
                request_id, status, code = None, None, repr(exc)
                http = requests.Session()
            with self._lock:
                self.records.append(
                    {"id": request_id, "start": start, "end": time.time(), "status": status, "code": code}
                )

    @property
    def clients(self) -> int:
        return len(self._threads)

    def since(self, moment: float) -> list[dict]:
        """The requests that started after ``moment`` (``time.time()``) and have ended."""
        with self._lock:
            return [r for r in self.records if r["start"] > moment]

    def stop(self) -> list[dict]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.records


def refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def wait_for(condition, what: str, limit: float = 60) -> None:
    """Poll ``condition`` until it holds; ``limit`` seconds is a safety net only, never a bound checked."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit} s"
        time.sleep(0.05)


def prefix_hits(replica: Gunicorn) -> dict[str, float]:
    text = requests.get(replica.url + "/metrics", timeout=10).text
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name", MODEL) == MODEL
    }
    return {
        name: values.get(name, 0.0)
        for name in ("saker_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    }


# -- the config -----------------------------------------------------------------------------------------------------
def test_rendered_config_passes_nginx_t(pool):
    result = pool.router.check_config()
    assert result.returncode == 0, result.stderr
    conf = (pool.router.root / "saker.conf").read_text()
    for replica in pool.alive():  # both upstream blocks list every replica
        assert conf.count(f"server 127.0.0.1:{replica.port} max_fails=1 fail_timeout=10s;") == 2


def test_shipped_config_shape():
    conf = "\n".join(line.split("#")[0] for line in REPLICAS_CONF.read_text().splitlines())  # no comments
    assert "least_conn;" in conf and "hash $http_x_session_id consistent;" in conf
    assert "proxy_next_upstream error timeout;" in conf and "non_idempotent" not in conf  # POSTs sent: no retry
    assert "proxy_next_upstream_tries" in conf and "keepalive 32;" in conf
    assert "proxy_buffering off;" in conf and "proxy_read_timeout 3600s;" in conf
    assert conf.count("proxy_pass http://$saker_pool;") == 3
    rendered = render_replicas_conf(conf, ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"], "8080")
    assert rendered.count("server 10.0.0.") == 6 and "listen 8080;" in rendered and "8001" not in rendered


# -- (a) spread -----------------------------------------------------------------------------------------------------
def in_flight(replica: Gunicorn) -> int:
    """HTTP requests the replica is answering now, this scrape left out."""
    text = requests.get(replica.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "saker_requests_in_flight":
                return int(s.value) - 1
    return 0


def test_requests_spread_over_both_replicas(pool):
    """16 concurrent requests, no session id, held in flight at their first decode step (the replicas' decode gate):
    least_conn sends each to the replica with fewer open requests, so each replica gets 8. Held, the counts do not
    depend on how fast either replica answers (a timing-dependent version of this test failed under load)."""
    a, b = pool.ensure(2)
    url = pool.router.url
    pool.gate.touch()
    try:
        with ThreadPoolExecutor(16) as ex:
            futures = [
                ex.submit(completion, url, f"Spread {i}: the quick brown fox", None, None, 16) for i in range(16)
            ]
            deadline = time.time() + 60
            while in_flight(a) + in_flight(b) < 16 and time.time() < deadline:
                time.sleep(0.05)
            held = {a.port: in_flight(a), b.port: in_flight(b)}
            pool.gate.unlink()
            results = [(rid, resp.status_code) for rid, resp in (f.result() for f in futures)]
    finally:
        pool.gate.unlink(missing_ok=True)
    assert held == {a.port: 8, b.port: 8}, held
    assert all(status == 200 for _, status in results), results
    served = pool.served_by([rid for rid, _ in results])
    counts = {a.port: 0, b.port: 0}
    for rid, _ in results:
        counts[served[rid]] += 1
    assert counts == {a.port: 8, b.port: 8}, counts
    routed = {line["request_id"]: line for line in pool.router.access([rid for rid, _ in results])}
    assert all(routed[rid]["upstream"] == f"127.0.0.1:{served[rid]}" for rid, _ in results)  # no retries


def test_a_stream_through_the_router_is_unbuffered(pool):
    pool.ensure(2)
    with requests.post(
        pool.router.url + "/v1/completions",
        stream=True,
        timeout=60,
        headers={"X-Session-ID": "stream-1"},
        json={
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as resp:
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert "Content-Length" not in resp.headers and resp.headers.get("Transfer-Encoding") == "chunked"
        frames = [line for line in resp.iter_lines(decode_unicode=True) if line]
    assert frames[-1] == "data: [DONE]" and len(frames) > 3


# -- (d) session affinity -------------------------------------------------------------------------------------------
def test_session_affinity_keeps_a_conversation_on_one_replica_and_its_prefix_cache_hits(pool):
    """8 conversations of 3 turns, each with its own X-Session-ID and a history that grows: every turn of a
    conversation lands on one replica (hash $http_x_session_id consistent), and turns 2 and 3 reuse the history's
    KV from that replica's prefix cache."""
    replicas = pool.ensure(2)
    before = {r.port: prefix_hits(r) for r in replicas}
    turns = ["Question: where is the garden?", "Answer: north of the bedroom.", "Question: and the office?"]

    def conversation(k: int) -> tuple[str, list[str]]:
        session = f"conversation-{k}-{uuid.uuid4().hex[:8]}"
        # a distinct beginning per conversation: no two share the 16 tokens the prefix cache needs
        history = f"Session {k} with user {k * 7919}. The capital of France is Paris. The capital of Italy is Rome."
        ids = []
        http = requests.Session()
        for turn in turns:
            history += " " + turn
            rid, resp = completion(pool.router.url, history, session=session, http=http, max_tokens=4)
            assert resp.status_code == 200, resp.text
            ids.append(rid)
        return session, ids

    with ThreadPoolExecutor(8) as ex:
        sessions = list(ex.map(conversation, range(8)))
    served = pool.served_by([rid for _, ids in sessions for rid in ids])
    per_replica = {r.port: 0 for r in replicas}
    for session, ids in sessions:
        ports = {served[rid] for rid in ids}
        assert len(ports) == 1, (session, ports)  # the whole conversation on one replica
        per_replica[ports.pop()] += 1
    routed = {line["request_id"]: line for line in pool.router.access([rid for _, ids in sessions for rid in ids])}
    assert all(routed[rid]["session"] == s for s, ids in sessions for rid in ids)
    for replica in replicas:
        after = prefix_hits(replica)
        got = {name: after[name] - before[replica.port][name] for name in after}
        held = per_replica[replica.port]
        # every turn after a conversation's first finds the history its previous turn left in that replica
        assert got["saker_prefix_cache_hits_total"] == 2 * held, (replica.port, held, got)
        if held:
            assert got["vllm:prefix_cache_hits_total"] >= 2 * held * 16, got  # reused prompt tokens
        else:
            assert got["vllm:prefix_cache_hits_total"] == 0, got


# -- (c) drain ------------------------------------------------------------------------------------------------------
def test_a_draining_replica_serves_until_it_refuses_and_the_other_then_takes_everything(pool):
    """SIGTERM to one replica's master under load (SAKER_DRAIN_SECONDS). Open-source nginx has no active health
    checks (that is nginx Plus), so it never sees the 503 of /readyz: it keeps sending the replica work during the
    drain, which the replica serves, and moves on at the first refused connection once the drain is over (a
    passive failure: the request goes to the other replica, and this one is left out for fail_timeout). Events in
    order, no clock bound: the load runs, /readyz says 503, a request sent after that is served by the draining
    replica, its connections are refused, it exits 0, and the load goes on on the other replica; no client sees
    an error at any point."""
    keep, drain = pool.ensure(2)[:2]
    load = Load(pool.router.url)
    try:
        wait_for(lambda: len(load.since(0)) >= 8, "the load answered")
        drain.proc.send_signal(signal.SIGTERM)  # as Kubernetes or `docker stop` would
        wait_for(lambda: requests.get(drain.url + "/readyz", timeout=10).status_code == 503, "/readyz 503")
        ready = requests.get(drain.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
        draining_at = time.time()

        def served_while_draining() -> bool:
            served = pool.served_by()
            return any(served.get(r["id"]) == drain.port for r in load.since(draining_at))

        # nginx does not read /readyz: the draining replica is still sent work, and serves it
        wait_for(served_while_draining, "a request sent during the drain served by the draining replica")
        wait_for(lambda: refuses(drain.port), "the draining replica refusing connections", DRAIN_SECONDS + 60)
        assert drain.proc.wait(60) == 0  # its requests in flight done, it exits
        exited_at = time.time()
        wait_for(lambda: len(load.since(exited_at)) >= 8, "the load going on after the exit")
    finally:
        records = load.stop()
    # nobody noticed: every request was answered, during the drain and after
    assert records and all(r["status"] == 200 for r in records), [r for r in records if r["status"] != 200]
    served = pool.served_by([r["id"] for r in records])
    assert all(r["id"] in served for r in records)
    assert any(served[r["id"]] == drain.port for r in records if r["start"] > draining_at)
    # from its exit on, the other replica took everything (nginx passed on the refused connections)
    after = [r for r in records if r["start"] > exited_at]
    assert len(after) >= 8 and all(served[r["id"]] == keep.port for r in after)


# -- (b) kill -------------------------------------------------------------------------------------------------------
def test_a_killed_replica_loses_only_its_in_flight_requests(pool):
    """SIGKILL to one replica (master and worker) under load: nginx cannot resend the POSTs it held (they were
    sent; no `non_idempotent`), so those fail; every later request is refused by the dead replica's port at most
    once, retried on the survivor, and succeeds."""
    survivor, victim = pool.ensure(2)[-2:]
    url = pool.router.url
    # a conversation that hashes to the victim, to see it move

    def lands_on(session: str | None) -> int | None:
        rid, _ = completion(url, "Hello there", session=session)
        return pool.served_by([rid]).get(rid)

    session = next(s for s in (f"s-{i}" for i in range(64)) if lands_on(s) == victim.port)
    # the load has no session id, so it goes through the least_conn upstream, which keeps failure marks of its own:
    # a replica restarted on a port that an earlier test saw refuse stays out of it for fail_timeout (10 s). Wait
    # until it takes work again, else the victim would die with nothing in hand
    wait_for(lambda: lands_on(None) == victim.port, "nginx's least_conn upstream sending the victim work")
    pool.gate.touch()  # decode steps wait: each client's request is held in flight, on one replica or the other
    load = Load(url)
    try:
        wait_for(lambda: in_flight(victim) + in_flight(survivor) == load.clients, "every client's request held")
        held = in_flight(victim)
        assert held >= 1  # it dies with work in hand
        killed_at = time.time()
        os.killpg(victim.proc.pid, signal.SIGKILL)  # master and worker: the whole process group
        victim.proc.wait(10)
        wait_for(lambda: refuses(victim.port), "the dead replica's port refusing")
        dead_at = time.time()
        pool.gate.unlink()
        wait_for(lambda: len(load.since(dead_at)) >= 8, "the load going on after the death")
    finally:
        pool.gate.unlink(missing_ok=True)
        records = load.stop()
    failed = [r for r in records if r["status"] != 200]
    # only requests in flight while it died failed, at most one per client: the router's JSON 503, or (when the
    # replica died while its answer was on the way, after nginx had passed its head on) a broken connection
    assert all(r["start"] < dead_at and r["end"] > killed_at for r in failed), failed
    assert len(failed) == held  # exactly the requests it held
    routed = {line["request_id"]: line for line in pool.router.access([r["id"] for r in failed if r["id"]])}
    assert all(routed[r["id"]]["upstream"] == f"127.0.0.1:{victim.port}" for r in failed if r["id"]), failed
    assert all((r["status"], r["code"]) == (503, "service_unavailable") or r["status"] is None for r in failed), failed
    # everything after went to the survivor and succeeded
    later = [r for r in records if r["start"] > dead_at]
    assert len(later) >= 8 and all(r["status"] == 200 for r in later)
    served = pool.served_by([r["id"] for r in later])
    assert all(served[r["id"]] == survivor.port for r in later)
    # the victim's conversations move to the survivor (consistent hashing skips the failed replica)
    rid, resp = completion(url, "Hello there", session=session)
    assert resp.status_code == 200 and pool.served_by([rid])[rid] == survivor.port
