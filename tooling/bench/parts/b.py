"""B: aggregate generated tokens/s with 8 concurrent clients (closed loops) divided by one client's, on the
GPT-2-small-shaped model: what batching buys. A round is the 1-client run then the 8-client run, back to back; the
ratio is the median over rounds. Goal >= 2.2."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from tooling.bench.client import closed_loop
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.stats import latency_summary, med, spread, summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench


def run(bench: Bench) -> dict:
    plan, client = bench.plan, bench.main_client
    body = bench.body(plan.b_tokens)
    closed_loop(client, lambda i, j: body, plan.b_clients, 1)  # warm the threads and the batch path

    def one(rep: int) -> dict:
        one_replies, one_wall = closed_loop(client, lambda i, j: body, 1, plan.b_single_requests)
        many_replies, many_wall = closed_loop(client, lambda i, j: body, plan.b_clients, plan.b_per_client)
        return {
            "single": sum(r.tokens for r in one_replies) / one_wall,
            "multi": sum(r.tokens for r in many_replies) / many_wall,
            "single_lat": [r.e2e_s * 1000 for r in one_replies],
            "multi_lat": [r.e2e_s * 1000 for r in many_replies],
            "rejected": sum(r.rejected for r in one_replies + many_replies),
        }

    used, selection = bench.select(bench.repeat(one, plan.b_rounds, plan.b_rounds, plan.b_budget))
    single = [u["single"] for u in used]
    multi = [u["multi"] for u in used]
    single_lat = [x for u in used for x in u["single_lat"]]
    multi_lat = [x for u in used for x in u["multi_lat"]]
    paired = [m / s for m, s in zip(multi, single, strict=True)]
    ratio = statistics.median(paired)  # as in A: rounds measured back to back, then the median
    return {
        "clients": plan.b_clients,
        "prompt_tokens": plan.prompt_tokens,
        "generated_tokens": plan.b_tokens,
        "selection": selection,
        "rejected": sum(u["rejected"] for u in used),
        "single_tokens_per_s": summary(single, 2),
        "multi_tokens_per_s": summary(multi, 2),
        "single_latency_ms": latency_summary(single_lat),
        "multi_latency_ms": latency_summary(multi_lat),
        "ratio": round(ratio, 3),
        "paired_ratio": summary(paired),
        "ratio_of_medians": round(statistics.median(multi) / statistics.median(single), 3),
        "goal": GOALS["B"][1],
        "met": check_goal("B", ratio),
    }


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    b = result
    rows.append(("B", "1 client tokens/s", med(b["single_tokens_per_s"]), spread(b["single_tokens_per_s"]), ""))
    rows.append(
        (
            "B",
            f"{b['clients']} clients tokens/s",
            med(b["multi_tokens_per_s"]),
            spread(b["multi_tokens_per_s"]),
            "",
        )
    )
    rows.append(
        (
            "B",
            f"ratio {b['clients']} / 1 (median of rounds)",
            f"{b['ratio']:g}",
            spread(b["paired_ratio"]) + f"; ratio of medians {b['ratio_of_medians']:g}",
            f">= {b['goal']:g}: {met(b['met'])}",
        )
    )
    return rows
