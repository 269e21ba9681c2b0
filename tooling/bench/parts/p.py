"""P: speculative decoding on the embedded SmolLM2 as served (int4): two servers started side by side, one with
``SAKER_SPECULATIVE=off`` and one with ``ngram`` (prompt lookup), the requests alternating between them (never
overlapping). At 1 client, greedy chat requests of up to 256 tokens: an input-grounded task (a JSON record rewritten
with the same fields and values: the answer repeats much of the prompt; once more in JSON mode, where structured
outputs hold the answer to JSON and the guesses to what the grammar allows) and a free-form one (a story). Reported per
task: each server's output tokens/s (completion tokens / the request's wall time, median of the repetitions), their
ratio, the acceptance (guessed tokens kept / guessed) and whether both servers answered the same text. Then 32
closed-loop clients of the free-form task on each server in turn: output tokens/s and their ratio. Goals: >= 2x
on the grounded task, >= 0.97x on the free-form one, >= 1.0x at 32 clients.

A third server speculates with a draft model (``SAKER_SPECULATIVE=draft``) at 1 client, without a goal. The only
draft with SmolLM2's tokenizer that can be built offline is a cut of SmolLM2 itself: its first ``DRAFT_LAYERS``
layers, with its embeddings, final norm and head, built once into the bench's cache. Such a draft keeps almost none
of its guesses: its row shows the draft path end to end and what a poor draft costs, not what a trained draft would
give. Not with ``--url``."""

from __future__ import annotations

import json
import statistics
from typing import TYPE_CHECKING

from tooling.bench.client import Client, closed_loop
from tooling.bench.parts.s import SMOL_NAME, smol_path
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.server import batch_env

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

RECORD = {
    "id": 4821,
    "name": "Margaret Hamilton",
    "role": "Director of Software Engineering",
    "organization": "MIT Instrumentation Laboratory",
    "project": "Apollo Guidance Computer",
    "languages": ["assembly", "MAC"],
    "years": [1961, 1972],
    "notes": "Led the team that wrote the on-board flight software for the Apollo missions, including the "
    "priority scheduling that kept Apollo 11's landing on course.",
}
TASKS = {
    "grounded": "Rewrite this record as pretty-printed JSON with the same fields and values, keys in the same "
    "order:\n" + json.dumps(RECORD),
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
TASKS["grounded, JSON mode"] = TASKS["grounded"]  # the same, its answer held to JSON (structured outputs)
EXTRA = {"grounded, JSON mode": {"response_format": {"type": "json_object"}}}
CHAT = "/v1/chat/completions"


DRAFT_LAYERS = 4  # the draft: SmolLM2's first layers, its embeddings, final norm and head


def run(bench: Bench) -> dict:
    plan = bench.plan
    path = smol_path(bench)
    servers = {}
    try:
        for mode in modes(bench):
            extra = {**batch_env(plan.p_clients), "SAKER_SPECULATIVE": mode}
            if mode == "draft":
                extra["SAKER_SPECULATIVE_MODEL"] = str(draft_path(bench, path))
            if "SAKER_QUANTIZE" not in bench.server_env():
                extra["SAKER_QUANTIZE"] = "int4"
            servers[mode] = bench.start_server(path, f"{SMOL_NAME}-P-{mode}", extra_env=extra)
        return measure(bench, {mode: (server.url, f"{SMOL_NAME}-P-{mode}") for mode, server in servers.items()})
    finally:
        for server in servers.values():
            bench.stop_server(server)


def modes(bench: Bench) -> list[str]:
    """The servers to start: off and ngram always, draft unless ``--speculative-modes`` leaves it out."""
    chosen = {m.strip() for m in bench.args.speculative_modes.split(",")}
    return ["off", "ngram"] + (["draft"] if "draft" in chosen else [])


def draft_path(bench: Bench, source):
    """A draft with SmolLM2's tokenizer, built once into the bench's cache: its first ``DRAFT_LAYERS`` layers."""
    out = bench.cache_dir / f"smollm2-draft-{DRAFT_LAYERS}-layers"
    if not (out / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        model.model.layers = model.model.layers[:DRAFT_LAYERS]
        model.config.num_hidden_layers = DRAFT_LAYERS
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def body(name: str, task: str, tokens: int) -> dict:
    return {
        "model": name,
        "messages": [{"role": "user", "content": TASKS[task]}],
        "max_tokens": tokens,
        "temperature": 0,
        **EXTRA.get(task, {}),
    }


def measure(bench: Bench, servers: dict[str, tuple[str, str]]) -> dict:
    plan = bench.plan
    clients = {mode: Client(url) for mode, (url, _) in servers.items()}
    result: dict = {"tokens": plan.p_tokens, "tasks": {}}
    try:
        for task in TASKS:
            for mode, (_, name) in servers.items():  # warm-up
                clients[mode].complete(body(name, task, plan.p_tokens), CHAT)
            per_mode: dict[str, list] = {mode: [] for mode in servers}

            def one(rep: int, task=task, per_mode=per_mode) -> None:
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for mode in order:
                    reply = clients[mode].complete(body(servers[mode][1], task, plan.p_tokens), CHAT)
                    per_mode[mode].append(reply)
                    bench.settle()

            bench.repeat(one, plan.p_reps, 0, 0.0)
            result["tasks"][task] = summarize(per_mode)
        result["32 clients"] = wide(bench, {mode: servers[mode] for mode in ("off", "ngram")})
    finally:
        for client in clients.values():
            client.close()
    grounded, free = result["tasks"]["grounded"]["ratio"], result["tasks"]["free"]["ratio"]
    result["goals"] = {
        "grounded": {"value": grounded, "goal": GOALS["P grounded"][1], "met": check_goal("P grounded", grounded)},
        "free": {"value": free, "goal": GOALS["P free"][1], "met": check_goal("P free", free)},
        "32 clients": {
            "value": result["32 clients"]["ratio"],
            "goal": GOALS["P 32 clients"][1],
            "met": check_goal("P 32 clients", result["32 clients"]["ratio"]),
        },
    }
    return result


def summarize(per_mode: dict[str, list]) -> dict:
    """Each server's tokens/s (median), the ratio, the acceptance, and whether the answers agree."""
    out: dict = {}
    for mode, replies in per_mode.items():
        rates = [r.tokens / r.e2e_s for r in replies if r.e2e_s > 0]
        timing = [r.timing or {} for r in replies]
        drafted = sum(t.get("speculative_draft_tokens", 0) for t in timing)
        kept = sum(t.get("speculative_accepted_tokens", 0) for t in timing)
        out[mode] = {
            "tokens_per_s": round(statistics.median(rates), 2),
            "completion_tokens": replies[-1].tokens,
            "draft_tokens": drafted,
            "accepted_tokens": kept,
            "acceptance": round(kept / drafted, 3) if drafted else None,
        }
    out["ratio"] = round(out["ngram"]["tokens_per_s"] / out["off"]["tokens_per_s"], 3)
    if "draft" in out:
        out["draft_ratio"] = round(out["draft"]["tokens_per_s"] / out["off"]["tokens_per_s"], 3)
    out["same_text"] = len({r.text for replies in per_mode.values() for r in replies}) == 1
    return out


def wide(bench: Bench, servers: dict[str, tuple[str, str]]) -> dict:
    """32 closed-loop clients of the free-form task, one request each, on each server in turn (the order alternating
    by round): output tokens/s, the median of the rounds, and the median of the rounds' ratios."""
    plan = bench.plan
    rates: dict[str, list[float]] = {mode: [] for mode in servers}
    for round_ in range(plan.p_wide_rounds):
        for mode in list(servers) if round_ % 2 == 0 else list(reversed(servers)):
            url, name = servers[mode]
            replies, wall = closed_loop(
                Client(url),
                lambda i, j, name=name: body(name, "free", plan.p_wide_tokens),
                plan.p_clients,
                1,
                path=CHAT,
            )
            rates[mode].append(sum(r.tokens for r in replies) / wall)
            bench.settle()
    out: dict = {mode: {"tokens_per_s": round(statistics.median(r), 2), "rounds": r} for mode, r in rates.items()}
    out["ratio"] = round(statistics.median(b / a for a, b in zip(rates["off"], rates["ngram"])), 3)
    return out


def rows(result: dict) -> list[Row]:
    def judged(key: str) -> str:
        goal = result["goals"][key]
        return f">= {goal['goal']:g}: {met(goal['met'])}"

    out: list[Row] = []
    for task, numbers in result["tasks"].items():
        for mode in [m for m in ("off", "ngram", "draft") if m in numbers]:
            rate = f"{numbers[mode]['tokens_per_s']:g}"
            out.append(("P", f"{task}, 1 client: tokens/s, speculative {mode}", rate, "", ""))
        note = f"acceptance {numbers['ngram']['acceptance']}, same text: {numbers['same_text']}"
        goal = judged(task) if task in result["goals"] else ""
        out.append(("P", f"{task}, 1 client: ngram / off ({note})", f"{numbers['ratio']:g}", "", goal))
        if "draft_ratio" in numbers:
            note = f"acceptance {numbers['draft']['acceptance']}, a {DRAFT_LAYERS}-layer cut of SmolLM2"
            out.append(("P", f"{task}, 1 client: draft / off ({note})", f"{numbers['draft_ratio']:g}", "", ""))
    wide = result["32 clients"]
    for mode in ("off", "ngram"):
        out.append(("P", f"free, 32 clients: tokens/s, speculative {mode}", f"{wide[mode]['tokens_per_s']:g}", "", ""))
    out.append(("P", "free, 32 clients: ngram / off", f"{wide['ratio']:g}", "", judged("32 clients")))
    return out
