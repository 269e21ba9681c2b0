"""R: prefix cache reuse. Requests that share a long context (448 tokens: few-shot examples, a document, a chat
history) and differ in a short question, one after another, 8 greedy tokens each: request time on a second server
of the same model with the prefix cache on (``SAKER_PREFIX_CACHE_TOKENS``), against the main server, whose cache
the bench turns off (the other parts repeat one prompt); the two sides alternate, one warm-up round, then the
measured rounds, and the ratio on / off is the median over rounds. No goal.

Each side is labelled with what is known of its cache, never more: ``on``, ``off`` (the main server started with
``SAKER_PREFIX_CACHE_TOKENS=0``), or, when ``--server-env`` set the main server's cache, ``main`` with that
setting. With ``--url`` the server is not the bench's: it cannot switch that server's cache, so the one side is
``served`` ("as served") and the figures say what the server itself reports: cached prompt tokens per request
(``usage.prompt_tokens_details.cached_tokens``, or saker's ``timing.cached_prompt_tokens``) and its /metrics
prefix-cache counters (``vllm:prefix_cache_queries_total``/``vllm:prefix_cache_hits_total``, in tokens) over the
measured rounds."""

from __future__ import annotations

import contextlib
import statistics
from typing import TYPE_CHECKING, Any

from tooling.bench.client import Client, HTTPError
from tooling.bench.models import PROMPT_TEXT, prompt_ids
from tooling.bench.report import Row
from tooling.bench.stats import med, spread, summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

# the prefix-cache counters of /metrics (vLLM's names, which saker serves too): prompt tokens looked up, found
QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
LABELS = {"on": "prefix cache on", "off": "prefix cache off", "served": "as served (cache not set by the bench)"}


def main_side(bench: Bench) -> tuple[str, str]:
    """The main server's side: its key in the result and its label. Only a server the bench started with
    ``SAKER_PREFIX_CACHE_TOKENS=0`` is "off"."""
    if bench.external:
        return "served", LABELS["served"]
    env = bench.server_info.get(bench.main_name, {}).get("env", {})
    tokens = env.get("SAKER_PREFIX_CACHE_TOKENS")
    if tokens is not None and tokens.strip() == "0":
        return "off", LABELS["off"]
    setting = f"SAKER_PREFIX_CACHE_TOKENS={tokens}" if tokens is not None else "its default prefix cache"
    return "main", f"main server ({setting})"


def prefix_counters(text: str) -> dict[str, float]:
    """The prefix-cache counters in a Prometheus text exposition (summed over label sets); {} when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for name in (QUERIES, HITS):
                    if sample.name == name + "_total":
                        out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def read_counters(client: Client) -> dict[str, float]:
    """The server's prefix-cache counters now ({} when it has no /metrics or no such counters)."""
    try:
        return prefix_counters(client.get("/metrics").decode(errors="replace"))
    except (HTTPError, OSError, ValueError):
        return {}


def run(bench: Bench) -> dict:
    plan = bench.plan
    if bench.external:
        context = (PROMPT_TEXT + " ") * max(1, plan.r_context // 48)
        prompts = [f"{context}\nQuestion {i}: what comes after part {i}?\nAnswer:" for i in range(plan.r_questions)]
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(bench.main_path))
        context = prompt_ids(tok, plan.r_context)
        prompts = [
            context
            + list(tok(f"\nQuestion {i}: what comes after part {i}?\nAnswer:", add_special_tokens=False)["input_ids"])
            for i in range(plan.r_questions)
        ]
    main_key, main_label = main_side(bench)
    sides = {main_key: bench.main_client}
    labels = {main_key: main_label}
    server = None
    if not bench.external:
        server = bench.start_server(
            bench.main_path,
            f"{bench.main_name}-prefix-cache",
            extra_env={
                "SAKER_PREFIX_CACHE_TOKENS": str(4 * (plan.r_context + 64)),
                "SAKER_SERVED_MODEL_NAME": bench.main_name,
            },
        )
        sides = {"on": Client(server.url), **sides}
        labels["on"] = LABELS["on"]
    counters: dict[str, dict[str, float]] = {}
    try:

        def one(rep: int) -> dict:
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            out: dict[str, list] = {}
            for side in order:
                replies = [sides[side].complete(bench.body(plan.r_tokens, prompt=p)) for p in prompts]
                out[side] = [r.e2e_s * 1000 for r in replies]
                out[side + "_prefill"] = [(r.timing or {}).get("prefill_ms") for r in replies]
                out[side + "_cached"] = [r.cached_tokens for r in replies]
                bench.settle()
            return out

        one(-1)  # warm-up: the cache learns the context
        if bench.external:
            counters["before"] = read_counters(bench.main_client)
        used, selection = bench.select(bench.repeat(one, plan.r_rounds, plan.r_rounds, plan.l_budget))
        if bench.external:
            counters["after"] = read_counters(bench.main_client)
    finally:
        if server is not None:
            sides["on"].close()
            bench.stop_server(server)
    result: dict[str, Any] = {
        "context_tokens": plan.r_context,
        "questions": plan.r_questions,
        "generated_tokens": plan.r_tokens,
        "selection": selection,
        "sides": labels,
    }
    for side in sides:
        result[f"{side}_request_ms"] = summary([x for u in used for x in u[side]])
        prefill = [x for u in used for x in u[side + "_prefill"] if x is not None]
        cached = [x for u in used for x in u[side + "_cached"] if x is not None]
        if prefill:
            result[f"{side}_prefill_ms"] = summary(prefill)
        if cached:
            result[f"{side}_cached_prompt_tokens"] = summary(cached, 1)
    if counters:
        result["served_metrics"] = metrics_delta(counters.get("before", {}), counters.get("after", {}))
    if "on" in sides and "off" in sides:
        paired = [statistics.median(u["on"]) / statistics.median(u["off"]) for u in used]
        result["ratio"] = round(statistics.median(paired), 3)
        result["paired_ratio"] = summary(paired)
    return result


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the server's counters say of the measured rounds (its other traffic, if any, counts too)."""
    if QUERIES not in before or QUERIES not in after:
        return {"available": False}
    queried = after[QUERIES] - before[QUERIES]
    hits = after.get(HITS, 0.0) - before.get(HITS, 0.0)
    return {
        "available": True,
        "queried_tokens": queried,
        "hit_tokens": hits,
        "hit_share": round(hits / queried, 3) if queried > 0 else None,
    }


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    labels = result.get("sides") or {"on": LABELS["on"], "off": LABELS["off"]}  # bench.json before the labels
    for side, label in labels.items():
        if f"{side}_request_ms" not in result:
            continue
        cached = result.get(f"{side}_cached_prompt_tokens", {}).get("median")
        notes = spread(result[f"{side}_request_ms"])
        if f"{side}_prefill_ms" in result:
            notes += f"; prefill {result[f'{side}_prefill_ms']['median']:g} ms"
        if cached is not None:
            notes += (", " if f"{side}_prefill_ms" in result else "; ") + f"{cached:g} cached prompt tokens"
            notes += " (as the server reports)" if side == "served" else ""
        if side == "served":
            metrics = result.get("served_metrics") or {}
            if metrics.get("hit_share") is not None:
                notes += f"; /metrics: {metrics['hit_share']:.0%} of prompt tokens from its prefix cache"
            elif cached is None:
                notes += "; the server reports no prefix-cache figures"
        rows.append(
            (
                "R",
                f"{label}: request ms ({result['context_tokens']}-token shared context)",
                med(result[f"{side}_request_ms"]),
                notes,
                "",
            )
        )
    if "ratio" in result:
        rows.append(
            ("R", "ratio on / off (median of rounds)", f"{result['ratio']:g}", spread(result["paired_ratio"]), "")
        )
    return rows
