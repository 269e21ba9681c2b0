"""Section close: how long the server works on after its client leaves, from the close to
``saker_requests_running`` back to 0 and to the server's "ended early" log line, against one decode step
or one prefill chunk."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import statistics
import time
from typing import Any

from tooling.reliability.base import RunBase, rounded
from tooling.reliability.wire import build, complete, hard_close, metrics, post_json, sample
from app.settings import Settings


LONG_PROMPT = 6000  # the "-long-prefill" cases' prompt: many chunks, many steps


class CloseSection(RunBase):
    """``section_close``: step times first, then each close case on an idle server."""

    def step_times(self) -> dict:
        rng = random.Random(7)
        chunk = int(
            self.server_env.get("SAKER_PREFILL_CHUNK_TOKENS")
            or os.environ.get("SAKER_PREFILL_CHUNK_TOKENS")
            or Settings.model_fields["prefill_chunk_tokens"].default
        )
        chunk = max(16, min(chunk, self.context - 8))
        decode, prefill = [], []
        max_tokens = max(8, min(64, self.context - 32))
        for _ in range(3):
            answer, obj = post_json(
                self.port,
                "/v1/completions",
                {
                    "model": self.name,
                    "prompt": self.random_ids(16, rng),
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            tokens = int((obj.get("usage") or {}).get("completion_tokens") or 0)
            if answer.status == 200 and tokens > 1:
                decode.append(float(answer.headers.get("x-saker-decode-ms", 0)) / (tokens - 1))
            answer, obj = post_json(
                self.port,
                "/v1/completions",
                {"model": self.name, "prompt": self.random_ids(chunk, rng), "max_tokens": 1, "temperature": 0},
            )
            if answer.status == 200:
                prefill.append(float(answer.headers.get("x-saker-prefill-ms", 0)))
        return {
            "decode_step_ms": rounded(statistics.median(decode) if decode else None, 2),
            "prefill_chunk_tokens": chunk,
            "prefill_chunk_ms": rounded(statistics.median(prefill) if prefill else None, 2),
        }

    def section_close(self) -> dict:
        steps = self.step_times()
        self.log(
            f"close: one decode step {steps['decode_step_ms']} ms, one prefill chunk of "
            f"{steps['prefill_chunk_tokens']} tokens {steps['prefill_chunk_ms']} ms"
        )
        cases = {}
        for name in self.plan.close_cases:
            self.settle()
            cases[name] = self.close_case(name, steps)
            c = cases[name]
            self.log(
                f"close {name}: {c.get('phase')} -> running 0 after {c.get('stop_s_metrics')} s, log line after "
                f"{c.get('stop_s_log')} s"
            )
            reference = steps["prefill_chunk_ms"] if c.get("phase") == "prefill" else steps["decode_step_ms"]
            stop_ms = None if c.get("stop_s_metrics") is None else c["stop_s_metrics"] * 1000
            if c.get("finished_before_close"):
                stop_ms = None  # nothing to measure: it ended before the close
            met = None if stop_ms is None or reference is None else stop_ms <= reference
            if c.get("finished_before_noticed"):
                met = False  # closed mid-generation, and run to its end
            unit = "prefill chunk" if c.get("phase") == "prefill" else "decode step"
            self.goal(
                "close",
                f"{name}: work stopped within one {unit}",
                met,
                f"{stop_ms if stop_ms is None else round(stop_ms)} ms vs {reference} ms",
                False,
            )
            self.goal(
                "close",
                f"{name}: the request's slot released after the close",
                c.get("released", False),
                f"running 0 after {c.get('stop_s_metrics')} s",
                True,
            )
        return {**steps, "cases": cases}

    def close_case(self, name: str, steps: dict) -> dict:
        rng = random.Random(sum(name.encode()))
        stream = name.startswith("stream")
        decode_ms = steps["decode_step_ms"] or 10.0
        chunk_ms = steps["prefill_chunk_ms"] or 100.0
        if name.endswith("prefill"):
            # "-long-": a 6,000-token prompt (the context allowing), closed 1 s into its prefill
            long = LONG_PROMPT if "-long-" in name else 8 * steps["prefill_chunk_tokens"]
            prompt_len = max(16, min(self.context - 64, long))
            max_tokens = 16
            estimated = prompt_len / steps["prefill_chunk_tokens"] * chunk_ms / 1000
        else:
            prompt_len = 16
            max_tokens = max(8, min(4000, self.context - prompt_len - 1))
            if "-stop-" in name:  # it may run to its end unnoticed: keep that to ~30 s
                max_tokens = max(min(64, max_tokens), min(max_tokens, int(30000 / decode_ms)))
            estimated = max_tokens * decode_ms / 1000
        # decode cases: past the prefill and a few steps into decoding (but well before the end)
        wanted = self.plan.close_after + (0 if name.endswith("prefill") else 4 * decode_ms / 1000)
        close_after = min(wanted, 0.5 * estimated)
        body = {
            "model": self.name,
            "prompt": self.random_ids(prompt_len, rng),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        if "-stop-" in name:
            body["stop"] = ["@@@@@@@@"]  # never met; a stop string makes a plain request's events eager
        log_start = len(self.server.output())
        access_start = len(self.server.access_lines())
        result: dict[str, Any] = {
            "prompt_tokens": prompt_len,
            "max_tokens": max_tokens,
            "close_after_s": round(close_after, 3),
        }
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        sent = time.monotonic()
        sock.sendall(build("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}))
        received = b""
        finished = False
        sock.settimeout(0.02)
        while time.monotonic() - sent < close_after:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                finished = True
                break
            received += chunk
            if b"data: [DONE]" in received or (not stream and complete(received)):
                finished = True
                break
        sock.setblocking(False)  # what already arrived counts as received
        with contextlib.suppress(OSError):
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        frames = received.count(b"data: {")
        result["frames_received"] = frames
        result["phase"] = "decode" if frames else "prefill"  # a plain request's phase: from its token count
        hard_close(sock)
        closed = time.monotonic()
        if finished:
            result.update(finished_before_close=True, released=True)
            return result
        stop_metrics = stop_log = stop_access = None
        generated = None
        deadline = closed + 120
        grace = None
        while time.monotonic() < deadline and (stop_metrics is None or stop_log is None):
            if stop_metrics is not None and stop_access is not None:  # over: its log line, if any, is written
                grace = grace or time.monotonic() + 0.5
                if time.monotonic() > grace:
                    break
            if stop_metrics is None:
                with contextlib.suppress(Exception):
                    if sample(metrics(self.port, timeout=5), "saker_requests_running") == 0:
                        stop_metrics = time.monotonic() - closed
            if stop_log is None:
                match = re.search(r"ended early after (\d+) generated tokens", self.server.output()[log_start:])
                if match:
                    stop_log = time.monotonic() - closed
                    generated = int(match.group(1))
            if stop_access is None:
                for line in self.server.access_lines()[access_start:]:
                    if line.get("route") == "/v1/completions":
                        stop_access = time.monotonic() - closed
                        result["access_status"] = line.get("status")
                        result["access_completion_tokens"] = line.get("completion_tokens")
            time.sleep(0.02)
        result.update(
            released=stop_metrics is not None,
            stop_s_metrics=rounded(stop_metrics, 3),
            stop_s_log=rounded(stop_log, 3),
            stop_s_access_log=rounded(stop_access, 3),
            generated_tokens_server=generated,
            seconds_open=round(closed - sent, 3),
        )
        if generated is not None and stream:
            result["tokens_after_close"] = max(0, generated - frames)
        if not stream:
            made = generated if generated is not None else result.get("access_completion_tokens")
            result["phase"] = "decode" if made else "prefill"
        if stop_log is None and result.get("access_status") == 200:
            result["finished_before_noticed"] = True  # it ran to its end before the server saw the close
            result["ran_on_after_close_s"] = rounded(stop_access, 3)
        return result
