"""S: structured outputs on the embedded SmolLM2-135M-Instruct (49k vocabulary, converted once into the cache):
delivered tokens/s of chat requests constrained by a JSON schema (``response_format`` json_schema: strings with
maxLength, a bounded integer, an enum, a small array, a nested object; temperature 0.7, a seed each, max_tokens
96; a constrained answer ends when its JSON is complete) divided by the very same requests unconstrained with
``ignore_eos`` (they run to max_tokens), closed loops of 1 and of 8 clients, the two sides alternating within each
round; the median of 3 rounds. Goal >= 0.9 at 1 and at 8 clients. Beside it, the free request cut to the
constrained answer's length (same seed): the grammar's own cost. Then, in-process with SmolLM2's tokenizer
(``s_grammar.py``): llguidance's tokenizer build, a 2 kB schema compiled first and cached, and the per-step cost of
a constrained row. With ``--url`` the requests go to that server's chat endpoint; the compile times are ours."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tooling.bench.client import Client, closed_loop
from tooling.bench.parts.s_grammar import compile_costs
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.stats import latency_summary, med, spread, summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

# S: the embedded SmolLM2 (a real 49k vocabulary), asked for a customer record; the constrained side gets this
# schema as response_format, the free side the same request with ignore_eos
SMOL_NAME = "SmolLM2-135M-Instruct"
S_MESSAGES = [
    {
        "role": "user",
        "content": "Invent a customer of a small online shop and give the record as JSON: "
        "name, city, age, plan, interests and address (street and zip).",
    }
]
_S_TEXT = {"type": "string", "minLength": 1, "maxLength": 24}
S_SCHEMA = {
    "type": "object",
    "properties": {
        "name": _S_TEXT,
        "city": _S_TEXT,
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "plan": {"enum": ["free", "basic", "premium"]},
        "interests": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "minLength": 1, "maxLength": 32},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "city", "age", "plan", "interests", "address"],
}


def smol_path(bench: Bench) -> Path:
    """The embedded SmolLM2, converted once into the bench's cache (as the server does into its own)."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import ensure_default_model

    path = ensure_default_model(LoadConfig(cache_dir=str(bench.cache_dir)))
    if "smol" not in bench.models:
        config = json.loads((path / "config.json").read_text())
        bench.models["smol"] = {
            "name": SMOL_NAME,
            "kind": config.get("model_type"),
            "layers": config.get("num_hidden_layers"),
            "width": config.get("hidden_size"),
            "heads": config.get("num_attention_heads"),
            "vocab": config.get("vocab_size"),
            "dir": str(path),
            "dtype": config.get("dtype") or config.get("torch_dtype"),
            "weights_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
        }
    return path


def run(bench: Bench) -> dict:
    """Constrained JSON-schema decoding against the very same chat request unconstrained (``ignore_eos``, the
    same ``max_tokens``), side by side: delivered tokens/s of a closed loop of 1 and of 8 clients, the two
    sides alternating within each round. A third side, after the constrained one, sends the free request
    with ``max_tokens`` = the length of the constrained answer of the same seed: the same lengths, so the
    same pattern of prefills and of rows leaving the batch, and what is left of the difference is the
    grammar's. Then, in-process with SmolLM2's tokenizer, what a new schema costs (llguidance's tokenizer, a
    2 kB schema compiled fresh and cached, the first mask) and what each step costs a constrained row (the
    matcher's mask on the answers' tokens, the sampler's unpacking)."""
    plan = bench.plan
    path = smol_path(bench)
    server = None
    if bench.external:
        client, name = bench.main_client, bench.main_name
    else:
        server = bench.start_server(path, SMOL_NAME)
        client, name = Client(server.url), SMOL_NAME
    fmt = {"type": "json_schema", "json_schema": {"name": "customer", "schema": S_SCHEMA}}

    lengths: dict[tuple[int, int], int] = {}  # the constrained answers' lengths, by (client, request)

    def make_body(side: str, rep: int, tokens: int = plan.s_tokens) -> Callable[[int, int], dict]:
        def body(i: int, j: int) -> dict:
            out = {
                "model": name,
                "messages": S_MESSAGES,
                "max_tokens": tokens,
                "temperature": 0.7,
                "seed": 100_000 * (rep + 2) + 1000 * i + j,
            }  # the same seeds on every side
            if side == "same":
                out["max_tokens"] = max(1, lengths[(i, j)])
            if side == "json":
                out["response_format"] = fmt
            elif not bench.args.no_ignore_eos:
                out["ignore_eos"] = True
            return out

        return body

    levels = ((1, plan.s_single_requests), (plan.s_clients, plan.s_per_client))
    chat = "/v1/chat/completions"
    texts: list[str] = []
    same = () if bench.args.no_ignore_eos else ("same",)  # without ignore_eos lengths cannot be matched

    def one(clients: int, per_client: int, rep: int) -> dict:
        out: dict[str, Any] = {}
        for side in ("json", *same, "free") if rep % 2 == 0 else ("free", "json", *same):
            replies, wall = closed_loop(client, make_body(side, rep), clients, per_client, path=chat)
            if side == "json":
                lengths.clear()
                lengths.update({r.index: r.tokens for r in replies if r.index is not None})
            out[side] = {
                "rate": sum(r.tokens for r in replies) / wall,
                "tokens": [r.tokens for r in replies],
                "finish": [r.finish_reason for r in replies],
                "valid": sum(_is_json_object(r.text) for r in replies),
                "decode": [
                    r.timing["decode_ms"] / (r.tokens - 1)
                    for r in replies
                    if r.timing and "decode_ms" in r.timing and r.tokens > 1
                ],
                "prefill": [r.timing["prefill_ms"] for r in replies if r.timing and "prefill_ms" in r.timing],
                "lat": [r.e2e_s * 1000 for r in replies],
            }
            if side == "json":
                texts.extend(r.text for r in replies)
            bench.settle()
        return out

    result: dict[str, Any] = {
        "model": SMOL_NAME if not bench.external else name,
        "max_tokens": plan.s_tokens,
        "temperature": 0.7,
        "schema": S_SCHEMA,
        "schema_bytes": len(json.dumps(S_SCHEMA)),
        "messages": S_MESSAGES,
        "levels": [],
    }
    try:
        for side in ("json", "free"):  # warm-up: the batch path, and the schema compiled once
            closed_loop(client, make_body(side, -1, 16), plan.s_clients, 1, path=chat)
        # each level has its own rounds (a round disturbed by other processes is replaced within the budget)
        for clients, per_client in levels:
            used, selection = bench.select(
                bench.repeat(
                    lambda rep, c=clients, k=per_client: one(c, k, rep), plan.s_rounds, plan.s_rounds, plan.s_budget
                )
            )
            result["levels"].append(_level(bench, clients, per_client, used, selection))
    finally:
        client.close()
        if server is not None:
            bench.stop_server(server)
    result.update(compile_costs(bench, path, texts, S_SCHEMA))
    return result


def _level(bench: Bench, clients: int, per_client: int, used: list[dict], selection: dict) -> dict:
    level: dict[str, Any] = {
        "clients": clients,
        "requests_per_side_per_round": clients * per_client,
        "selection": selection,
    }
    for side in ("json", "free", "same"):
        if side not in used[0]:
            continue
        runs = [u[side] for u in used]
        tokens = [t for run in runs for t in run["tokens"]]
        finish: dict[str, int] = {}
        for reason in (f for run in runs for f in run["finish"]):
            finish[str(reason)] = finish.get(str(reason), 0) + 1
        level[side] = {
            "tokens_per_s": summary([run["rate"] for run in runs], 2),
            "mean_completion_tokens": round(statistics.mean(tokens), 1) if tokens else 0,
            "requests": len(tokens),
            "finish_reasons": finish,
            "valid_json": sum(run["valid"] for run in runs),
            "decode_ms_per_token": summary([d for run in runs for d in run["decode"]]),
            "decode_ms_per_token_by_round": [
                round(statistics.median(run["decode"]), 3) if run["decode"] else None for run in runs
            ],
            "prefill_ms": summary([p for run in runs for p in run["prefill"]]),
            "latency_ms": latency_summary([x for run in runs for x in run["lat"]]),
        }
    paired = [u["json"]["rate"] / u["free"]["rate"] for u in used]
    ratio = statistics.median(paired)  # as in B: sides measured back to back, then the median
    key = f"S {clients} client" + ("s" if clients > 1 else "")
    level.update(
        {
            "ratio": round(ratio, 3),
            "paired_ratio": summary(paired),
            "goal": GOALS.get(key, (None, None))[1],
            "met": check_goal(key, ratio),
        }
    )
    if "same" in level:  # the grammar's own share: the same lengths, free
        same = [u["json"]["rate"] / u["same"]["rate"] for u in used]
        level["ratio_same_lengths"] = round(statistics.median(same), 3)
        level["paired_ratio_same_lengths"] = summary(same)
    free_step = level["free"]["decode_ms_per_token"].get("median")
    json_step = level["json"]["decode_ms_per_token"].get("median")
    if free_step and json_step:  # the server's own per-step time: no prefill, no queue
        level["decode_step_ratio"] = round(free_step / json_step, 3)
    bench.log(
        f"  S {clients} client(s): constrained {level['json']['tokens_per_s']['median']:g} tok/s "
        f"({level['json']['mean_completion_tokens']:g} tokens per answer), free "
        f"{level['free']['tokens_per_s']['median']:g} tok/s: ratio {ratio:.3f}"
        + (f"; free with the same lengths: {level['ratio_same_lengths']:.3f}" if "same" in level else "")
    )
    return level


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    sp = result
    for level in sp["levels"]:
        clients = f"{level['clients']} client" + ("s" if level["clients"] > 1 else "")
        for side, label in (("json", "constrained (JSON schema)"), ("free", "free (ignore_eos)")):
            m = level[side]
            rows.append(
                (
                    "S",
                    f"{clients}: {label} tokens/s",
                    med(m["tokens_per_s"]),
                    spread(m["tokens_per_s"]) + f"; {m['mean_completion_tokens']:g} tokens per answer, decode "
                    f"{med(m['decode_ms_per_token'])} ms/token",
                    "",
                )
            )
        goal = f">= {level['goal']:g}: {met(level['met'])}" if level.get("met") is not None else ""
        step = f"; server decode steps {level['decode_step_ratio']:g}" if "decode_step_ratio" in level else ""
        rows.append(
            (
                "S",
                f"{clients}: ratio constrained / free (median of rounds)",
                f"{level['ratio']:g}",
                spread(level["paired_ratio"]) + step,
                goal,
            )
        )
        if "same" in level:
            rows.append(
                (
                    "S",
                    f"{clients}: ratio constrained / free with the same lengths",
                    f"{level['ratio_same_lengths']:g}",
                    spread(level["paired_ratio_same_lengths"]) + f"; {med(level['same']['tokens_per_s'])} tok/s",
                    "",
                )
            )
    if "compile" in sp:
        c = sp["compile"]
        rows.append(
            (
                "S",
                "llguidance tokenizer build ms (once per model)",
                med(c["tokenizer_build_ms"]),
                spread(c["tokenizer_build_ms"]) + f"; vocabulary {c['vocab']}",
                "",
            )
        )
        rows.append(
            (
                "S",
                f"compile ms, {c['schema_bytes']}-byte schema: first",
                med(c["first_ms"]),
                spread(c["first_ms"]) + f"; its first mask {med(c['first_mask_ms'])} ms; a new schema "
                f"on a warm tokenizer {med(c.get('new_schema_warm_ms'))} ms",
                "",
            )
        )
        rows.append(
            (
                "S",
                "compile ms, the same schema again (cached)",
                med(c["cached_ms"]),
                spread(c["cached_ms"]) + f"; a row's matcher copy {med(c['row_matcher_ms'])} ms",
                "",
            )
        )
    if "per_step" in sp:
        ps = sp["per_step"]
        unpack = ", ".join(
            f"{k} row{'s' if k != '1' else ''} {v['median']:g} ms" for k, v in ps["sampler_mask_ms"].items()
        )
        rows.append(
            (
                "S",
                "per step: a row's next mask us (grammar thread)",
                med(ps["mask_us"]),
                spread(ps["mask_us"]) + f"; sampler's unpacking: {unpack}",
                "",
            )
        )
    return rows


def draw(ax, r: dict) -> None:
    levels = r["S"]["levels"]
    xs = list(range(len(levels)))
    sides = [
        s
        for s in (
            ("json", "constrained (JSON schema)", "tab:blue"),
            ("free", "free (ignore_eos)", "tab:orange"),
            ("same", "free, the constrained lengths", "tab:grey"),
        )
        if s[0] in levels[0]
    ]
    width = 0.8 / len(sides)
    for k, (side, label, color) in enumerate(sides):
        series = [lv[side]["tokens_per_s"] for lv in levels]
        meds = [sr["median"] for sr in series]
        errs = [[sr["median"] - sr["min"] for sr in series], [sr["max"] - sr["median"] for sr in series]]
        ax.bar(
            [x + (k - (len(sides) - 1) / 2) * width for x in xs],
            meds,
            width=width,
            yerr=errs,
            capsize=4,
            color=color,
            label=label,
        )
    ax.set_xticks(xs, [f"{lv['clients']} client{'s' if lv['clients'] > 1 else ''}: {lv['ratio']:g}" for lv in levels])
    ax.set_ylabel("generated tokens / s (median, min-max)")
    ax.set_title(f"S: constrained / free (goal >= {GOALS['S 1 client'][1]:g})", fontsize=9)
    ax.legend(fontsize=7)


PANELS = (draw,)
