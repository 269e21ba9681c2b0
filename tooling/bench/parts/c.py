"""C: HTTP overhead on the tests' tiny model (2 layers, 64 wide): ``max_tokens: 1``, the median HTTP round trip
minus the median in-process forward of the same prompt, in rounds of 30 of each. Goal <= 5 ms. With ``--url``
only the round trip is measured (no forward to subtract)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from tooling.bench.client import Client
from tooling.bench.models import GPT2_TINY, TINY_PROMPT, ensure_model
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, bars, met
from tooling.bench.stats import med, spread, summary, timing_summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench


def run(bench: Bench) -> dict:
    import torch

    plan = bench.plan
    server = bench.tiny_server
    path = None
    if bench.external:
        client, name = bench.main_client, bench.main_name
        prompt = bench.args.prompt or TINY_PROMPT
    else:
        path = ensure_model(GPT2_TINY, bench.cache_dir, bench.log)
        bench.record_model("tiny", GPT2_TINY, path)
        if server is None:
            server = bench.start_server(path, GPT2_TINY.name)
        client, name, prompt = Client(server.url), GPT2_TINY.name, TINY_PROMPT
    body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        model = ids = None
        if path is not None:
            model, tok = bench.reference("tiny", path)
            ids = torch.tensor([tok(prompt)["input_ids"]])

        def forward() -> float:
            with torch.inference_mode():
                start = time.perf_counter()
                model(input_ids=ids)
                return (time.perf_counter() - start) * 1000

        for _ in range(5):
            client.complete(body)
            if model is not None:
                forward()

        def one(rep: int) -> dict:
            this: dict[str, list] = {"rtt": [], "timings": [], "fwd": []}
            for _ in range(plan.c_per_round):
                reply = client.complete(body)
                this["rtt"].append(reply.e2e_s * 1000)
                this["timings"].append(reply.timing or {})
            bench.settle()
            if model is not None:
                this["fwd"] = [forward() for _ in range(plan.c_per_round)]
                bench.settle()
            return this

        used, selection = bench.select(bench.repeat(one, plan.c_rounds, plan.c_rounds, plan.c_budget))
        rtt = [x for u in used for x in u["rtt"]]
        fwd = [x for u in used for x in u["fwd"]]
        timings = [x for u in used for x in u["timings"]]
        if bench.args.profile and server is not None:
            bench.profile(server, client, body, 300, "C")
        result: dict[str, Any] = {"prompt": prompt, "selection": selection, "round_trip_ms": summary(rtt)}
        result["server_timing_ms"] = timing_summary(timings, None)
        if fwd:
            overhead = statistics.median(rtt) - statistics.median(fwd)
            result.update(
                {
                    "prompt_tokens": int(ids.shape[1]),
                    "forward_ms": summary(fwd),
                    "overhead_ms": round(overhead, 3),
                    "goal": GOALS["C"][1],
                    "met": check_goal("C", overhead),
                }
            )
        return result
    finally:
        client.close()
        if server is not None:
            bench.stop_server(server)
            bench.tiny_server = None


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    c = result
    rows.append(("C", "round trip ms (max_tokens 1)", med(c["round_trip_ms"]), spread(c["round_trip_ms"]), ""))
    if "overhead_ms" in c:
        rows.append(("C", "in-process forward ms", med(c["forward_ms"]), spread(c["forward_ms"]), ""))
        rows.append(
            (
                "C",
                "overhead ms (round trip - forward)",
                f"{c['overhead_ms']:g}",
                "",
                f"<= {c['goal']:g}: {met(c['met'])}",
            )
        )
    return rows


def draw(ax, r: dict) -> None:
    c = r["C"]
    names, series = ["HTTP round trip"], [c["round_trip_ms"]]
    if "forward_ms" in c:
        names.append("in-process forward")
        series.append(c["forward_ms"])
    bars(ax, names, series, ["tab:blue", "tab:orange"], low="p25", high="p75")
    ax.set_ylabel("ms (median, IQR)")
    title = "C: tiny model, max_tokens 1"
    if "overhead_ms" in c:
        title += f": overhead {c['overhead_ms']:g} ms (goal <= {GOALS['C'][1]:g})"
    ax.set_title(title, fontsize=9)


PANELS = (draw,)
