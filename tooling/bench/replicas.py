"""``python -m tooling.bench.replicas`` (``make bench-replicas``): saker replicas behind nginx
(``deploy/nginx/saker-replicas.conf``), measured.

1. Throughput: generated tokens/s of ``--clients`` (16) closed-loop clients through nginx in front of 1 replica,
   then in front of 2 (the same replica settings; each replica gets ``--torch-threads`` threads, by default half
   the machine's cores, so that two replicas together use what one GPU each would be: their own cores), and
   the ratio. Goal >= 1.7 where every replica has cores (or a GPU) of its own and the load generator and nginx
   have more; on a machine that has only the two replicas' cores it cannot be.
   For comparison it also measures one replica given every core (``--no-whole-machine`` skips it).
2. Router latency: p50 (and p90) round trip of a tiny request straight to a replica and through nginx,
   interleaved (direct, nginx, direct, ...) over kept-alive connections; the difference is what the router
   adds. Goal <= 2 ms. Two tiny requests: ``GET /livez`` (no model work) and a 1-token completion.

The model is the bench's GPT-2-small-shaped one (``tooling/bench/models.py``: 12 layers, 768 wide, random weights,
built once into ``.cache/bench``) or, with ``--model tiny``, the tests' size. The replicas are real gunicorns on
127.0.0.1 and nginx runs in the foreground as the current user with every path under ``--work-dir``
(``tooling/bench/nginx.py``); everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from tooling.bench.nginx import Router, nginx_binary
from tooling.processes import ROOT, GunicornServer


class Replica(GunicornServer):
    """One saker replica: ``gunicorn -c gunicorn.conf.py wsgi:app`` on 127.0.0.1 (one worker), its own process
    group, ready when ``/readyz`` answers; the caller's SAKER_* settings are not inherited (but the cache dir)."""

    def __init__(self, model_dir: Path, name: str, env: dict[str, str], log_dir: Path):
        super().__init__(
            {
                "SAKER_MODEL": str(model_dir),
                "SAKER_SERVED_MODEL_NAME": name,
                "SAKER_WORKERS": "1",
                "SAKER_LOG_LEVEL": "warning",
                "SAKER_ACCESS_LOG": "off",
                **env,
            },
            log_dir=log_dir,
            name="replica",
            ready_path="/readyz",
            inherit=lambda key: not key.startswith("SAKER_") or key == "SAKER_CACHE_DIR",
        )

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30, *, group: bool = False) -> int | None:
        """``sig`` to the master alone (SIGINT: it stops its worker with one SIGQUIT; a signal to the whole process
        group would reach the worker twice), then SIGKILL to the group after ``timeout``."""
        return super().stop(sig, timeout, group=group)


# ---------------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------------
PROMPT = (
    "The report describes how the service was deployed across the two data centres, which parts were moved "
    "first, and what the operators learned from the migration about capacity, latency and cost."
)


def _post(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    payload = json.dumps(body).encode()
    conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, (json.loads(data) if data else {})


class CpuWatch:
    """CPU time over a window (Linux /proc): what the machine spent in all, what this run's processes (this one,
    the replicas, nginx, and their children) spent, and so what other processes took meanwhile, in cores."""

    def __init__(self, roots: Sequence[int]):
        self.roots = list(roots)
        self.hz = os.sysconf("SC_CLK_TCK")
        self.begin = self._snapshot()

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(values) - values[3] - values[4]

    def _ours(self) -> int:
        total, todo, seen = 0, list(self.roots), set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime of all its threads
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except (OSError, ValueError, IndexError):
                pass
        return total

    def _snapshot(self) -> tuple[float, int, int]:
        return time.perf_counter(), self._busy(), self._ours()

    def stop(self) -> dict:
        wall, busy, ours = self._snapshot()
        elapsed = wall - self.begin[0]
        busy_s, ours_s = (busy - self.begin[1]) / self.hz, (ours - self.begin[2]) / self.hz
        return {
            "our_cpu_cores": round(ours_s / elapsed, 2),
            "other_processes_cpu_cores": round(max(busy_s - ours_s, 0.0) / elapsed, 2),
        }


def throughput(
    url: str, model: str, clients: int, seconds: float, warmup: float, max_tokens: int, watch: Sequence[int] = ()
) -> dict:
    """Generated tokens/s of ``clients`` closed loops (one kept-alive connection each) counted over ``seconds``
    after ``warmup``: the tokens of the requests that ended inside the window, divided by the window."""
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    window = (start + warmup, start + warmup + seconds)
    done: list[tuple[float, int]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def loop(i: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        n = 0
        try:
            while time.perf_counter() < window[1]:
                # a distinct start per request: no two prompts share 16 tokens, so the prefix cache plays no part
                body = {
                    "model": model,
                    "prompt": f"Client {i} request {n}. {PROMPT}",
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                n += 1
                try:
                    status, answer = _post(conn, "/v1/completions", body)
                except (OSError, http.client.HTTPException) as exc:
                    conn.close()
                    conn = http.client.HTTPConnection(host, int(port), timeout=300)
                    with lock:
                        errors.append(repr(exc))
                    continue
                now = time.perf_counter()
                if status != 200:
                    with lock:
                        errors.append(f"{status} {answer.get('error', {}).get('code')}")
                    time.sleep(0.2)
                    continue
                with lock:
                    done.append((now, answer["usage"]["completion_tokens"]))
        finally:
            conn.close()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(window[0] - time.perf_counter(), 0))
    cpu = CpuWatch([os.getpid(), *watch])
    time.sleep(max(window[1] - time.perf_counter(), 0))
    cpu_use = cpu.stop()
    for t in threads:
        t.join()
    inside = [tokens for at, tokens in done if window[0] <= at <= window[1]]
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": len(inside),
        "tokens": sum(inside),
        "tokens_per_s": round(sum(inside) / seconds, 1),
        "requests_all": len(done),
        "elapsed_s": round(time.perf_counter() - start, 1),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        **cpu_use,
    }


def router_latency(direct: str, routed: str, model: str, reps: int) -> dict:
    """p50/p90 round trips (ms) of ``GET /livez`` and of a 1-token completion, straight to a replica and through
    nginx, interleaved over one kept-alive connection each."""

    def connect(url: str) -> http.client.HTTPConnection:
        host, port = url.removeprefix("http://").split(":")
        return http.client.HTTPConnection(host, int(port), timeout=60)

    out = {}
    for name, method, path, body in (
        ("livez", "GET", "/livez", None),
        (
            "completion_1_token",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
        ),
    ):
        conns = {"direct": connect(direct), "nginx": connect(routed)}
        times: dict[str, list[float]] = {"direct": [], "nginx": []}
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for i in range(reps + 10):
            for side in ("direct", "nginx") if i % 2 == 0 else ("nginx", "direct"):
                conn = conns[side]
                t0 = time.perf_counter()
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                resp.read()
                elapsed = (time.perf_counter() - t0) * 1000
                if resp.status != 200:
                    raise RuntimeError(f"{side} {path}: {resp.status}")
                if i >= 10:  # the first ones open connections (nginx's to the replica too)
                    times[side].append(elapsed)
        for conn in conns.values():
            conn.close()
        row = {}
        for side, values in times.items():
            values.sort()
            row[side] = {
                "p50_ms": round(statistics.median(values), 3),
                "p90_ms": round(values[int(0.9 * (len(values) - 1))], 3),
            }
        row["added_p50_ms"] = round(row["nginx"]["p50_ms"] - row["direct"]["p50_ms"], 3)
        out[name] = row
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.bench.replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=("small", "tiny"),
        default="small",
        help="the bench's GPT-2-small-shaped model (default) or the tests' tiny one",
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per configuration")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads per replica (default: half the cores)",
    )
    parser.add_argument("--latency-reps", type=int, default=300)
    parser.add_argument(
        "--no-whole-machine",
        dest="whole_machine",
        action="store_false",
        help="skip the comparison with one replica given every core",
    )
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "replica-bench")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[replica-bench] {message}", file=sys.stderr, flush=True)

    if nginx_binary() is None:
        log("nginx is not installed (apt-get install nginx)")
        return 2
    from tooling.bench.models import GPT2_SMALL, GPT2_TINY, ensure_model
    from tooling.bench.plan import DEFAULT_CACHE

    spec = GPT2_SMALL if args.model == "small" else GPT2_TINY
    model_dir = ensure_model(spec, DEFAULT_CACHE, log)
    name = spec.name
    threads = str(args.torch_threads)
    env = {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        # every client must get in (8 generate together by default, the others wait): no 429s
        "SAKER_MAX_QUEUE": str(args.clients),
        "SAKER_THREADS": str(2 * args.clients + 8),
    }
    shutil.rmtree(args.work_dir, ignore_errors=True)
    replicas: list[Replica] = []
    routers: list[Router] = []
    try:
        log(f"starting 2 replicas of {name} ({', '.join(f'{k}={v}' for k, v in env.items())})")
        replicas = [Replica(model_dir, name, env, args.work_dir) for _ in range(2)]
        for r in replicas:
            r.wait_ready()
        one = Router(args.work_dir / "nginx-1", [replicas[0].address])
        routers.append(one)
        two = Router(args.work_dir / "nginx-2", [r.address for r in replicas])
        routers.append(two)
        for router in routers:
            router.wait_ready()
        figures: dict = {
            "model": name,
            "cpu_count": os.cpu_count(),
            "torch_threads_per_replica": args.torch_threads,
            "clients": args.clients,
            "max_tokens": args.max_tokens,
        }
        log(f"throughput, 1 replica behind nginx, {args.clients} clients, {args.seconds:g} s")
        watch = [r.proc.pid for r in replicas] + [router.proc.pid for router in routers]
        figures["one_replica"] = throughput(
            one.url, name, args.clients, args.seconds, args.warmup, args.max_tokens, watch
        )
        log(f"  {figures['one_replica']}")
        log(f"throughput, 2 replicas behind nginx, {args.clients} clients, {args.seconds:g} s")
        figures["two_replicas"] = throughput(
            two.url, name, args.clients, args.seconds, args.warmup, args.max_tokens, watch
        )
        log(f"  {figures['two_replicas']}")
        figures["ratio"] = round(
            figures["two_replicas"]["tokens_per_s"] / max(figures["one_replica"]["tokens_per_s"], 1e-9), 2
        )
        cores = os.cpu_count() or 1
        if args.whole_machine and cores > args.torch_threads:
            # for comparison: one replica given every core (what a CPU-only host would run instead of two)
            log(f"throughput, 1 replica with {cores} torch threads behind nginx (the other two idle)")
            whole = Replica(
                model_dir, name, {**env, "OMP_NUM_THREADS": str(cores), "MKL_NUM_THREADS": str(cores)}, args.work_dir
            )
            replicas.append(whole)
            whole.wait_ready()
            router = Router(args.work_dir / "nginx-whole", [whole.address])
            routers.append(router)
            router.wait_ready()
            figures["one_replica_all_cores"] = {
                "torch_threads": cores,
                **throughput(
                    router.url,
                    name,
                    args.clients,
                    args.seconds,
                    args.warmup,
                    args.max_tokens,
                    watch + [whole.proc.pid, router.proc.pid],
                ),
            }
            log(f"  {figures['one_replica_all_cores']}")
            whole.stop()
        log(f"router latency, {args.latency_reps} interleaved round trips per side")
        figures["router_latency"] = router_latency(replicas[0].url, one.url, name, args.latency_reps)
        try:
            figures["load_average"] = os.getloadavg()
        except OSError:
            pass
    finally:
        for router in routers:
            router.stop()
        for r in replicas:
            r.stop()
    print(json.dumps(figures, indent=2))
    lat = figures["router_latency"]

    def row(label: str, f: dict) -> str:
        return (
            f"{label}: {f['tokens_per_s']} tok/s ({f['requests']} requests in {f['seconds']:g} s; this run's "
            f"processes used {f['our_cpu_cores']} cores, other processes {f['other_processes_cpu_cores']})"
        )

    print()
    print(row("1 replica", figures["one_replica"]))
    print(row("2 replicas", figures["two_replicas"]))
    print(f"ratio {figures['ratio']} (goal >= 1.7)")
    if "one_replica_all_cores" in figures:
        print(
            row(
                f"1 replica, {figures['one_replica_all_cores']['torch_threads']} torch threads",
                figures["one_replica_all_cores"],
            )
        )
    for key, row in lat.items():
        print(
            f"{key}: direct p50 {row['direct']['p50_ms']} ms, through nginx p50 {row['nginx']['p50_ms']} ms, "
            f"added {row['added_p50_ms']} ms (goal <= 2 ms)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
