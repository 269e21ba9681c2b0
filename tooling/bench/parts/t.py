"""T: streamed time to first token (the first SSE frame that carries a token) against the server's own prefill
time (``timing.prefill_ms``, sent in the usage chunk) and the in-process forward of the same 64-token prompt: what
the stream adds before the first token. No goal."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tooling.bench.report import Row, bars
from tooling.bench.stats import med, spread, summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench


def run(bench: Bench) -> dict:
    import torch

    plan, client = bench.plan, bench.main_client
    body = bench.body(plan.t_tokens, stream=True)
    for _ in range(plan.warmup):
        client.complete(body)
    model = None
    if not bench.external:
        model, _ = bench.reference("main", bench.main_path)
        ids = torch.tensor([bench.main_prompt()])
        with torch.inference_mode():
            model(ids)

    def one(rep: int) -> dict:
        this: dict[str, float] = {}
        reply = client.complete(body)
        if reply.ttft_s is None:
            raise RuntimeError("the stream carried no token")
        this["ttft"] = reply.ttft_s * 1000
        server_prefill = (reply.timing or {}).get("prefill_ms")
        if server_prefill is not None:
            this["prefill"] = server_prefill
        bench.settle()
        if model is not None:
            with torch.inference_mode():
                start = time.perf_counter()
                model(ids)
                this["forward"] = (time.perf_counter() - start) * 1000
            bench.settle()
        return this

    used, selection = bench.select(bench.repeat(one, plan.t_reps, plan.t_reps, plan.t_budget))
    ttft = [u["ttft"] for u in used]
    prefill = [u["prefill"] for u in used if "prefill" in u]
    overhead = [u["ttft"] - u["prefill"] for u in used if "prefill" in u]
    forward = [u["forward"] for u in used if "forward" in u]
    result = {
        "prompt_tokens": plan.prompt_tokens,
        "max_tokens": plan.t_tokens,
        "selection": selection,
        "ttft_ms": summary(ttft),
    }
    if prefill:
        result["server_prefill_ms"] = summary(prefill)
        result["ttft_minus_prefill_ms"] = summary(overhead)
    if forward:
        result["in_process_forward_ms"] = summary(forward)
    return result


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    t = result
    rows.append(("T", "time to first token ms (stream)", med(t["ttft_ms"]), spread(t["ttft_ms"]), ""))
    if "server_prefill_ms" in t:
        rows.append(("T", "server prefill_ms", med(t["server_prefill_ms"]), spread(t["server_prefill_ms"]), ""))
        rows.append(("T", "TTFT - prefill ms", med(t["ttft_minus_prefill_ms"]), spread(t["ttft_minus_prefill_ms"]), ""))
    if "in_process_forward_ms" in t:
        rows.append(
            (
                "T",
                "in-process prompt forward ms",
                med(t["in_process_forward_ms"]),
                spread(t["in_process_forward_ms"]),
                "",
            )
        )
    return rows


def draw(ax, r: dict) -> None:
    t = r["T"]
    names, series = ["TTFT (stream)"], [t["ttft_ms"]]
    if "server_prefill_ms" in t:
        names.append("server prefill")
        series.append(t["server_prefill_ms"])
    if "in_process_forward_ms" in t:
        names.append("in-process forward")
        series.append(t["in_process_forward_ms"])
    bars(ax, names, series, ["tab:green", "tab:purple", "tab:orange"])
    ax.set_ylabel("ms (median, min-max)")
    ax.set_title(f"T: first token vs prefill ({t['prompt_tokens']}-token prompt)")
    ax.tick_params(axis="x", labelsize=8)


PANELS = (draw,)
