"""Engine v3's GPU figures from one server (issue 24, item 5 and its GPU measurements), in one device call:

1. the decode step at 1 row against 32 rows: one greedy request alone, then 32 at once (``ignore_eos``), each
   request's ``timing.decode_ms`` over its tokens after the first (goal: a 32-row step <= 2x a 1-row step);
2. part M on the GPU: ``tooling.bench.parts.m.measure`` against this server, with longer streams so that several long
   prompts arrive while they decode (a 1B model on a GPU decodes 256 tokens before the second one would come).

    python3 scripts/gpu/serve_checks.py [--device cuda] [--model PATH] [--quick] [--out FILE]

The model is the bench's 1B Llama shape (built by ``ensure_model``, as part D builds it) unless ``--model`` names a
folder; ``--device cpu --quick --model .cache/bench/gpt2-tiny-v1`` is the smoke run of this script on the CPU."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from tooling.bench.client import Client
from tooling.bench.models import model_or_1b
from tooling.bench.parts import m as part_m
from tooling.bench.plan import Plan
from tooling.bench.server import Server, batch_env

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--model", default=None)
parser.add_argument("--quick", action="store_true", help="short runs (the CPU smoke test)")
parser.add_argument("--out", default=None, help="write the JSON here too")
parser.add_argument("--only-m", action="store_true", help="part M alone")
parser.add_argument("--no-m", action="store_true", help="the 1-row vs 32-row steps alone")
parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
args = parser.parse_args()
cuda = args.device.startswith("cuda")
path = model_or_1b(args.model, args.device)
rows, tokens = (4, 16) if args.quick else (32, 128)
env = {
    "SAKER_DEVICE": args.device,
    "SAKER_DTYPE": "bfloat16" if cuda else "float32",
    "SAKER_PREFIX_CACHE_TOKENS": "0",
    "SAKER_MAX_QUEUE": "64",
    "SAKER_THREADS": "48",
    **batch_env(rows),
    **dict(item.split("=", 1) for item in args.env),
}
start = time.perf_counter()
server = Server(path, "m", env, Path("/tmp/serve-checks-logs"))
result: dict = {"model": str(path), "env": env}
try:
    server.wait_ready(timeout=400)
    result["ready_s"] = round(time.perf_counter() - start, 1)
    print(f"ready in {result['ready_s']} s", flush=True)

    def per_token_ms(prompt: list[int]) -> float:
        client = Client(server.url)
        try:
            body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            reply = client.complete(body)
        finally:
            client.close()
        return reply.timing["decode_ms"] / (reply.tokens - 1)

    def at_once(n: int, rep: int) -> list[float]:
        out: list[float] = []
        threads = [
            threading.Thread(target=lambda i=i: out.append(per_token_ms([100 + 7 * i + rep] * 32 + [5, 6, 7])))
            for i in range(n)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    for n in () if args.only_m else (1, rows):
        at_once(n, 0)  # warm-up
        samples = [ms for rep in range(1, 4) for ms in at_once(n, rep)]
        result[f"decode_ms_per_token_{n}_rows"] = {
            "median": round(statistics.median(samples), 3),
            "min": round(min(samples), 3),
            "max": round(max(samples), 3),
            "n": len(samples),
        }
        print(f"{n} rows at once: {result[f'decode_ms_per_token_{n}_rows']}", flush=True)
    if not args.only_m:
        one, many = (result[f"decode_ms_per_token_{n}_rows"]["median"] for n in (1, rows))
        result["step_ratio"] = round(many / one, 2)
        print(f"{rows}-row step / 1-row step: {result['step_ratio']} (goal <= 2)", flush=True)

    if not args.no_m:
        plan = Plan()
        part_m.MAX_ID = 27_000  # the 1B shape's trained tokenizer holds 27,731 ids
        if args.model:  # another model: stay inside its vocabulary
            part_m.MAX_ID = min(27_000, json.loads((Path(path) / "config.json").read_text())["vocab_size"])
        if args.quick:
            plan = replace(plan, m_clients=4, m_tokens=48, m_long=200, m_every=0.5)
        else:  # 16 streams of 1,024 tokens; a 1,536-token prompt (the 1B shape holds 2,048 positions) every second
            plan = replace(plan, m_clients=16, m_tokens=1024, m_long=1536, m_every=1.0)
        result["M"] = part_m.measure(SimpleNamespace(plan=plan), server.url, "m")
        print(f"M: {json.dumps(result['M'])}", flush=True)
finally:
    server.stop()
    print(server.tail()[-3000:] if "ready_s" not in result else "", file=sys.stderr)
print(json.dumps(result, indent=1))
if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1))
