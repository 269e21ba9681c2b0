"""A: the server's ms per generated token (one HTTP round trip / its tokens) on the GPT-2-small-shaped model (12
layers, 768 wide, 32k byte-level BPE trained offline, random weights), 64-token prompt, 32 greedy tokens
(ignore_eos), fp32 on CPU, divided by the in-process ``model.generate()`` ms per token on the same model, same
prompt, same tokens. The two sides alternate (server, generate, server, ...) and never overlap; the ratio is the
median of the per-pair ratios. Goal <= 0.7 (issue 36). The server's text must be generate()'s
(``same_text_as_generate``). With ``--url`` only the server side runs."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, bars, met
from tooling.bench.stats import med, spread, summary, timing_summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench


def run(bench: Bench) -> dict:
    import torch

    plan, client = bench.plan, bench.main_client
    tokens = plan.a_tokens
    body = bench.body(tokens)
    model = tok = ids = None
    if not bench.external:
        model, tok = bench.reference("main", bench.main_path)
        ids = torch.tensor([bench.main_prompt()])

    def generate() -> tuple[float, list[int]]:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
            elapsed = time.perf_counter() - start
        return elapsed, out[0, ids.shape[1] :].tolist()

    for _ in range(plan.warmup):
        client.complete(body)
        if model is not None:
            bench.settle()
            generate()
            bench.settle()
    texts: list[str] = []
    gen_ids: list[int] = []

    def one(rep: int) -> dict:
        nonlocal gen_ids
        # alternate which side goes first, so a slow drift in the machine does not favour one side
        order = ("server", "generate") if rep % 2 == 0 else ("generate", "server")
        this: dict[str, Any] = {}
        for side in order:
            if side == "server":
                reply = client.complete(body)
                if reply.tokens != tokens:
                    raise RuntimeError(
                        f"the server generated {reply.tokens} tokens, not {tokens} "
                        f"(is ignore_eos supported? try --no-ignore-eos)"
                    )
                this["server"] = reply.e2e_s * 1000 / tokens
                this["timing"] = reply.timing or {}
                texts.append(reply.text)
            elif model is not None:
                elapsed, gen_ids = generate()
                this["generate"] = elapsed * 1000 / len(gen_ids)
            bench.settle()
        return this

    used, selection = bench.select(bench.repeat(one, plan.a_reps, plan.a_reps, plan.a_budget))
    server_ms = [u["server"] for u in used]
    gen_ms = [u["generate"] for u in used if "generate" in u]
    paired = [u["server"] / u["generate"] for u in used if "generate" in u]
    timings = [u["timing"] for u in used]
    result: dict[str, Any] = {
        "prompt_tokens": plan.prompt_tokens,
        "generated_tokens": tokens,
        "selection": selection,
        "server_ms_per_token": summary(server_ms),
    }
    result["server_timing_ms"] = timing_summary(timings, tokens)
    if gen_ms:
        # the headline: the median over repetitions of server/generate() measured back to back (a drift in
        # the machine's speed cancels within a pair); the ratio of the two medians is reported beside it
        ratio = statistics.median(paired)
        expected = tok.decode(gen_ids, skip_special_tokens=True)
        result.update(
            {
                "generate_ms_per_token": summary(gen_ms),
                "ratio": round(ratio, 3),
                "ratio_of_medians": round(statistics.median(server_ms) / statistics.median(gen_ms), 3),
                "paired_ratio": summary(paired),
                "goal": GOALS["A"][1],
                "met": check_goal("A", ratio),
                "same_text_as_generate": all(t == expected for t in texts),
            }
        )
    return result


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    a = result
    rows.append(
        (
            "A",
            f"server ms/token (HTTP, {a['generated_tokens']} tokens)",
            med(a["server_ms_per_token"]),
            spread(a["server_ms_per_token"]),
            "",
        )
    )
    if "ratio" in a:
        rows.append(
            (
                "A",
                "generate() ms/token (in-process)",
                med(a["generate_ms_per_token"]),
                spread(a["generate_ms_per_token"]),
                "",
            )
        )
        rows.append(
            (
                "A",
                "ratio server / generate() (median of pairs)",
                f"{a['ratio']:g}",
                spread(a["paired_ratio"]) + f"; ratio of medians {a['ratio_of_medians']:g}",
                f"<= {a['goal']:g}: {met(a['met'])}",
            )
        )
    return rows


def draw(ax, r: dict) -> None:
    a = r["A"]
    names = ["server (HTTP)"]
    series = [a["server_ms_per_token"]]
    if "generate_ms_per_token" in a:
        names.append("generate()")
        series.append(a["generate_ms_per_token"])
    bars(ax, names, series, ["tab:blue", "tab:orange"])
    ax.set_ylabel("ms per generated token (median, min-max)")
    ax.set_title(f"A: ratio {a.get('ratio', '-')} (goal <= {GOALS['A'][1]})")


PANELS = (draw,)
