"""E: engine efficiency at high concurrency on the tests' tiny model (2 layers, 64 wide: its batch-32 decode step
is about as long as a GPU step of a 1B model): delivered tokens/s of 32 (and 64) closed-loop clients, 3 requests
each, 48-token prompts, 128 tokens (ignore_eos), greedy and sampled (temperature 0.8, top_p 0.9, logprobs 5, a
seed each), divided by clients / the in-process forward of a batch of that many rows (measured with no server
running, before and after). Goals at 32 clients (issue 36): >= 0.7 greedy, >= 0.6 sampled. Not with ``--url``."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from tooling.bench.client import Client, closed_loop
from tooling.bench.models import GPT2_TINY, ensure_model, prompt_ids
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.server import batch_env
from tooling.bench.stats import latency_summary, summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

# E: the request settings of its two modes (sampled rows also get a seed of their own)
E_MODES = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.9, "logprobs": 5}}


def batch_forward_ms(model, rows: int, context: int, reps: int = 30) -> dict:
    """In-process decode forward of ``rows`` sequences (one token each) over a KV cache of ``context`` tokens:
    the model's own time for one step of such a batch (the cache is cut back after each step)."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (rows, context))
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = torch.randint(0, model.config.vocab_size, (rows, 1))
        times = []
        for _ in range(reps + 3):
            start = time.perf_counter()
            model(input_ids=step, past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - start) * 1000)
            cache.crop(-1)
    return summary(times[3:], 4)


def run(bench: Bench) -> dict:
    """Delivered tokens/s of ``clients`` closed-loop clients on the tests' tiny model, divided by what the
    model alone could deliver: ``clients`` rows / the in-process forward of a batch of that many rows (one
    token each, over a KV cache of the mean length a row has while decoding). The tiny model's forward is
    about as long as a GPU step of a 1B model, so E is the share of a step that is the model, not the engine."""
    plan = bench.plan
    path = ensure_model(GPT2_TINY, bench.cache_dir, bench.log)
    bench.record_model("tiny", GPT2_TINY, path)
    top = max(plan.e_levels)
    model, tok = bench.reference("tiny", path)
    base = prompt_ids(tok, plan.e_prompt_tokens)
    context = plan.e_prompt_tokens + plan.e_tokens // 2
    # the model's own step time, with no server running (its threads would disturb it); again at the end
    bench.settle()
    forwards = {clients: batch_forward_ms(model, clients, context, reps=100) for clients in plan.e_levels}
    server = bench.start_server(
        path,
        GPT2_TINY.name,
        extra_env={
            **batch_env(top),
            "SAKER_THREADS": str(2 * top + 8),
            "SAKER_MAX_QUEUE": str(4 * top),
        },
    )
    client = Client(server.url)

    def prompt(i: int) -> list[int]:  # distinct prompts of one length (no shared prefixes)
        shift = i % len(base)
        return base[shift:] + base[:shift]

    def make_body(mode: str) -> Callable[[int, int], dict]:
        def body(i: int, j: int) -> dict:
            out = {
                "model": GPT2_TINY.name,
                "prompt": prompt(i),
                "max_tokens": plan.e_tokens,
                "ignore_eos": True,
                **E_MODES[mode],
            }
            if mode == "sampled":
                out["seed"] = 1000 * i + j
            return out

        return body

    levels = []
    try:
        for clients in plan.e_levels:
            level: dict[str, Any] = {"clients": clients}
            for mode in E_MODES:
                closed_loop(client, make_body(mode), clients, 1)  # warm-up
                rates, shares, latencies, requests = [], [], [], 0
                for _ in range(plan.e_rounds):
                    snap = bench.cpu.snapshot() if bench.cpu else None
                    replies, wall = closed_loop(client, make_body(mode), clients, plan.e_per_client)
                    shares.append(bench.cpu.since(snap).get("foreign_cpu_share") if snap is not None else None)
                    tokens = sum(r.tokens for r in replies)
                    if tokens != len(replies) * plan.e_tokens:
                        raise RuntimeError(f"E {mode}: {tokens} tokens for {len(replies)} requests of {plan.e_tokens}")
                    rates.append(tokens / wall)
                    latencies += [r.e2e_s * 1000 for r in replies]
                    requests += len(replies)
                level[mode] = {
                    "tokens_per_s": round(statistics.median(rates), 1),
                    "rounds_tokens_per_s": [round(r, 1) for r in rates],
                    "requests": requests,
                    "foreign_cpu_share": shares,
                    "latency_ms": latency_summary(latencies),
                }
            levels.append(level)
    finally:
        client.close()
        bench.stop_server(server)
    bench.settle()
    for level in levels:
        clients = level["clients"]
        after = batch_forward_ms(model, clients, context, reps=100)
        forward = (forwards[clients]["median"] + after["median"]) / 2
        ideal = clients / (forward / 1000)
        level.update(
            {
                "forward_ms": {"median": round(forward, 4), "before": forwards[clients], "after": after},
                "ideal_tokens_per_s": round(ideal, 1),
            }
        )
        for mode in E_MODES:
            rate = level[mode]["tokens_per_s"]
            level[mode]["e"] = round(rate / ideal, 3)
            bench.log(
                f"  E {clients} clients {mode}: {rate:.0f} tok/s of {ideal:.0f} "
                f"(forward {forward:.3f} ms: {forwards[clients]['median']:g} before, "
                f"{after['median']:g} after): E = {rate / ideal:.3f}"
            )
    result: dict[str, Any] = {
        "prompt_tokens": plan.e_prompt_tokens,
        "generated_tokens": plan.e_tokens,
        "per_client": plan.e_per_client,
        "forward_context": context,
        "modes": E_MODES,
        "levels": levels,
    }
    goal_level = next((lv for lv in levels if lv["clients"] == 32), None)
    if goal_level is not None:
        for mode in E_MODES:
            key = f"E {mode}"
            result[f"goal_{mode}"] = GOALS[key][1]
            result[f"met_{mode}"] = check_goal(key, goal_level[mode]["e"])
    return result


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    e = result
    for level in e["levels"]:
        for mode in E_MODES:
            m = level[mode]
            goal = ""
            if level["clients"] == 32 and e.get(f"met_{mode}") is not None:
                goal = f">= {e[f'goal_{mode}']:g}: {met(e[f'met_{mode}'])}"
            rows.append(
                (
                    "E",
                    f"{level['clients']:2d} clients {mode}: tokens/s / ideal",
                    f"{m['e']:g}",
                    f"{m['tokens_per_s']:g} of {level['ideal_tokens_per_s']:g} tok/s "
                    f"(batch forward {level['forward_ms']['median']:g} ms)",
                    goal,
                )
            )
    return rows
