"""Section slow: connections that send their request head one line every 2 s (reconnecting when answered 408)
while a normal client sends a completion and a /health every 0.5 s."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import Counter

from tooling.reliability.base import RunBase, percentile, rounded
from tooling.reliability.wire import build, exchange, is_error_object, parse_answer, post_json, receive


class SlowSection(RunBase):
    """``section_slow``: slow connections in threads beside one normal client."""

    def section_slow(self) -> dict:
        n, seconds, interval = self.plan.slow_clients, self.plan.slow_seconds, self.plan.slow_interval
        lock = threading.Lock()
        state = Counter()
        answers: Counter = Counter()
        not_json: list[str] = []
        stop_at = time.monotonic() + seconds
        normal_body = {"model": self.name, "prompt": "Hello", "max_tokens": 4}

        def normal_latencies(count: int) -> list[float]:
            out = []
            for _ in range(count):
                answer, _ = post_json(self.port, "/v1/completions", normal_body, timeout=120)
                out.append(answer.seconds if answer.status == 200 else float("inf"))
            return out

        baseline = normal_latencies(3)

        def slow(i: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                except OSError:
                    with lock:
                        state["connect_errors"] += 1
                    time.sleep(0.5)
                    continue
                with lock:
                    state["opened"] += 1
                    state["open"] += 1
                    state["max_open"] = max(state["max_open"], state["open"])
                try:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    line = 0
                    while time.monotonic() < stop_at:
                        readable, _, _ = select.select(
                            [sock], [], [], max(0.0, min(interval, stop_at - time.monotonic()))
                        )
                        if readable:
                            sock.settimeout(5)
                            raw, _ = receive(sock)
                            answer = parse_answer(raw)
                            with lock:
                                answers[str(answer.status)] += 1
                                if answer.status is not None and not is_error_object(answer.json()):
                                    not_json.append(raw[:200].decode("latin-1"))
                            break
                        if time.monotonic() >= stop_at:
                            break
                        line += 1
                        sock.sendall(b"X-Slow-%d: 1\r\n" % line)
                except OSError:
                    with lock:
                        state["resets"] += 1
                finally:
                    sock.close()
                    with lock:
                        state["open"] -= 1
                        state["closed"] += 1

        threads = [threading.Thread(target=slow, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(min(2.0, seconds / 4))
        normal: list[tuple[int | None, float]] = []
        kinds: list[str] = []
        # completions answered while every slow connection was held and none was cut or closed: such an answer
        # did not wait for a slow client to let go of anything (the no-clock form of "not starved")
        while_held = 0
        while time.monotonic() < stop_at - 1:
            with lock:
                held_before, closed_before = state["open"], state["closed"]
            answer, _ = post_json(self.port, "/v1/completions", normal_body, timeout=60)
            with lock:
                if answer.status == 200 and held_before >= n and state["closed"] == closed_before:
                    while_held += 1
            normal.append((answer.status, answer.seconds))
            health = exchange(self.port, build("GET", "/health"), timeout=60)
            normal.append((health.status, health.seconds))
            kinds += ["completion", "health"]
            time.sleep(0.5)
        for t in threads:
            t.join(seconds + 30)
        ok = [s for status, s in normal if status == 200]
        completions = [s for (status, s), kind in zip(normal, kinds) if status == 200 and kind == "completion"]
        healths = [s for (status, s), kind in zip(normal, kinds) if status == 200 and kind == "health"]
        result = {
            "slow_clients": n,
            "seconds": seconds,
            "line_every_s": interval,
            "connections_opened": state["opened"],
            "held_at_once": state["max_open"],
            "connect_errors": state["connect_errors"],
            "resets": state["resets"],
            "answers_to_slow_clients": dict(answers),
            "slow_answers_not_json": len(not_json),
            "normal_sent": len(normal),
            "normal_answered": len(ok),
            "normal_answered_while_all_held": while_held,
            "normal_latency_max_s": rounded(max(ok) if ok else None),
            "completion_latency_p50_s": rounded(percentile(completions, 0.5)),
            "completion_latency_max_s": rounded(max(completions) if completions else None),
            "health_latency_max_s": rounded(max(healths) if healths else None),
            "completion_latency_alone_p50_s": rounded(percentile(baseline, 0.5)),
        }
        self.goal(
            "slow",
            f"{n} slow connections held while normal requests are answered",
            state["max_open"] >= n and len(ok) == len(normal) and len(normal) > 0 and not not_json,
            f"held {state['max_open']}/{n}, answered {len(ok)}/{len(normal)}, max {result['normal_latency_max_s']} s",
            True,
        )
        return result
