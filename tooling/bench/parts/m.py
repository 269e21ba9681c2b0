"""M: mixed arrivals on the embedded SmolLM2 as served (int4 from its GGUF's codes, float32 activations): 16
streams decode 256 greedy tokens each (``ignore_eos``) while a 2,048-token prompt of random token ids arrives
every 4 s (one at a time: the first 1 s after the streams start, the next 4 s after the previous one's first
token). Reported: the streams'
inter-token latency (the gaps between two frames that carry a token, the first token left out) p50, p99 and
their ratio, and the long prompts' time to first token. Goal: ITL p99 <= 3x ITL p50 (a decoding stream does not
wait for a whole prompt's prefill). With ``--url`` the requests go to that server (its model's vocabulary must
hold the random ids: they are drawn below 32,000)."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING

from tooling.bench.client import Client
from tooling.bench.parts.s import SMOL_NAME, smol_path
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.server import batch_env
from tooling.bench.stats import latency_summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

MAX_ID = 32_000  # the long prompts' random ids are drawn below this (the bench's vocabularies hold them)
STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she guides. Chapter one:"


def run(bench: Bench) -> dict:
    plan = bench.plan
    server = None
    if bench.external:
        url, name = bench.main_client.url, bench.main_name
    else:
        env = bench.server_env()
        extra = batch_env(plan.m_clients + 2)
        if "SAKER_QUANTIZE" not in env:  # the embedded model's default precision: int4 from its GGUF's own codes
            extra["SAKER_QUANTIZE"] = "int4"
        server = bench.start_server(smol_path(bench), f"{SMOL_NAME}-M", extra_env=extra)
        url, name = server.url, f"{SMOL_NAME}-M"
    try:
        return measure(bench, url, name)
    finally:
        if server is not None:
            bench.stop_server(server)


def measure(bench: Bench, url: str, name: str) -> dict:
    """The streams and the long prompts, side by side; every stream's gaps and every long prompt's TTFT."""
    plan = bench.plan
    warm = Client(url)
    warm.complete({"model": name, "prompt": STREAM_PROMPT, "max_tokens": 2, "temperature": 0})
    warm.close()
    stream_body = {
        "model": name,
        "prompt": STREAM_PROMPT,
        "max_tokens": plan.m_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    replies, errors, ttfts = [], [], []
    done = threading.Event()

    def stream() -> None:
        client = Client(url)
        try:
            replies.append(client.complete(stream_body))
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    def long_prompts() -> None:
        rng = random.Random(7)
        client = Client(url)
        try:
            wait = min(1.0, plan.m_every / 2)  # the first one once the streams are decoding
            while not done.wait(wait):
                ids = [rng.randrange(100, MAX_ID) for _ in range(plan.m_long)]
                body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
                reply = client.complete(body)  # sent while the streams decode: its TTFT counts
                if reply.ttft_s is not None:
                    ttfts.append(reply.ttft_s)
                wait = plan.m_every
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    streams = [threading.Thread(target=stream, name=f"bench-m-{i}") for i in range(plan.m_clients)]
    arrivals = threading.Thread(target=long_prompts, name="bench-m-long")
    start = time.perf_counter()
    for thread in streams:
        thread.start()
    arrivals.start()
    for thread in streams:
        thread.join()
    done.set()
    arrivals.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    gaps = [(b - a) * 1000 for r in replies for a, b in zip(r.frame_times or [], (r.frame_times or [])[1:])]
    itl = latency_summary(gaps)
    ratio = round(itl["p99"] / itl["p50"], 2) if gaps and itl["p50"] else None
    return {
        "streams": plan.m_clients,
        "stream_tokens": plan.m_tokens,
        "long_prompt_tokens": plan.m_long,
        "long_every_s": plan.m_every,
        "long_prompts": len(ttfts),
        "wall_s": round(wall, 1),
        "itl_ms": itl,
        "itl_p99_over_p50": ratio,
        "long_ttft_s": latency_summary(ttfts),
        "goal": {"op": GOALS["M"][0], "value": GOALS["M"][1]},
        "met": check_goal("M", ratio),
    }


def rows(result: dict) -> list[Row]:
    itl, ttft = result["itl_ms"], result["long_ttft_s"]
    op, value = result["goal"]["op"], result["goal"]["value"]
    ratio = result["itl_p99_over_p50"]
    return [
        (
            "M",
            f"ITL p99 / p50 of {result['streams']} streams while {result['long_prompt_tokens']}-token prompts arrive",
            "-" if ratio is None else f"{ratio:g}",
            f"p50 {itl.get('p50', '-')} ms, p99 {itl.get('p99', '-')} ms, n={itl.get('n', 0)}",
            f"{op} {value:g}: {met(result['met'])}",
        ),
        (
            "M",
            "long prompts' time to first token s",
            f"{ttft['p50']:g}" if ttft.get("n") else "-",
            f"p99 {ttft.get('p99', '-')} s, n={ttft.get('n', 0)}",
            "",
        ),
    ]
