"""Part S, in-process: what a new schema costs with SmolLM2's tokenizer (llguidance's tokenizer build, a 2 kB schema
compiled fresh and cached, a row's matcher and its first mask) and what each step costs a constrained row (its next
mask on the answers' tokens, the sampler's unpacking of 1 and 8 rows' masks)."""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tooling.bench.stats import summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench


def compile_schema() -> dict:
    """S's 2 kB schema for the compile time (2,137 bytes as ``json.dumps`` writes it): an order record with 30
    properties (16 at the top, the rest in nested objects and array items) of varied kinds: patterns, formats,
    enums, bounded integers and numbers, booleans, arrays, a nullable string, an anyOf."""
    text = {"type": "string", "minLength": 1, "maxLength": 40}
    return {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
            "created": {"type": "string", "format": "date-time"},
            "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled", "refunded"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "customer": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999999},
                    "name": text,
                    "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,20}\\.[a-z]{2,4}$"},
                    "phone": {"type": "string", "pattern": "^\\+[0-9]{7,14}$"},
                    "vip": {"type": "boolean"},
                },
                "required": ["id", "name", "email"],
            },
            "shipping": {
                "type": "object",
                "properties": {
                    "street": text,
                    "city": text,
                    "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                    "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                    "method": {"enum": ["standard", "express", "overnight", "pickup"]},
                },
                "required": ["street", "city", "zip", "country"],
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 10,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                        "unit_price": {"type": "number", "minimum": 0, "maximum": 10000},
                        "category": {"enum": ["books", "electronics", "garden", "toys", "food"]},
                    },
                    "required": ["sku", "quantity", "unit_price"],
                },
            },
            "subtotal": {"type": "number", "minimum": 0},
            "tax_rate": {"type": "number", "minimum": 0, "maximum": 0.5},
            "currency": {"enum": ["EUR", "USD", "GBP", "JPY", "CHF"]},
            "coupon": {"type": ["string", "null"], "pattern": "^[A-Z0-9]{6,10}$"},
            "gift": {"type": "boolean"},
            "notes": {"type": "string", "maxLength": 200},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
            "rating": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "null"}]},
            "delivery_date": {"type": "string", "format": "date"},
        },
        "required": ["order_id", "created", "status", "customer", "items", "currency"],
    }


def compile_costs(bench: Bench, path: Path, texts: list[str], answer_schema: dict) -> dict:
    """In-process, SmolLM2's tokenizer: llguidance's tokenizer build, the 2 kB schema's compile with no cache
    (a fresh ``Grammars`` each repetition, as a new server sees it) and cached (the same again), a row's
    matcher copy and its first mask; then the per-step cost of a constrained row on the answers' tokens."""
    import torch
    from transformers import AutoTokenizer

    from app.engine.sampling.grammar import Grammars, allowed_tokens
    from app.protocol import json_constraint

    tok = AutoTokenizer.from_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    vocab = int(config["vocab_size"])
    eos = tuple(sorted({i for i in (config.get("eos_token_id"), tok.eos_token_id) if isinstance(i, int)}))
    schema = compile_schema()
    constraint = json_constraint(schema)
    lltok, first, cached, row_ms, first_mask, other, other_mask = [], [], [], [], [], [], []

    def ms(start: float) -> float:
        return (time.perf_counter() - start) * 1000

    for rep in range(bench.plan.s_compile_reps):
        grammars = Grammars(tok, vocab, eos)
        start = time.perf_counter()
        built = grammars.lltok  # built on first use
        lltok.append(ms(start))
        del built  # one tokenizer alive at a time, as in a server (else compiles are slower)
        start = time.perf_counter()
        grammars.compile(constraint)
        first.append(ms(start))
        start = time.perf_counter()
        grammars.compile(constraint)
        cached.append(ms(start))
        start = time.perf_counter()
        row = grammars.row(constraint)
        row_ms.append(ms(start))
        start = time.perf_counter()
        row.current_mask()
        first_mask.append(ms(start))
        # a schema this server has not seen, once its tokenizer is warm: the same with one bound changed
        variant = compile_schema()
        variant["properties"]["notes"]["maxLength"] = 300 + rep
        variant_constraint = json_constraint(variant)
        start = time.perf_counter()
        grammars.compile(variant_constraint)
        other.append(ms(start))
        row = grammars.row(variant_constraint)
        start = time.perf_counter()
        row.current_mask()
        other_mask.append(ms(start))
        del row  # dropped here, not inside the next repetition's timing (its tokenizer)
        if rep < bench.plan.s_compile_reps - 1:
            del grammars
            gc.collect()
    out: dict[str, Any] = {
        "compile": {
            "schema_bytes": len(json.dumps(schema)),
            "vocab": vocab,
            "reps": bench.plan.s_compile_reps,
            "tokenizer_build_ms": summary(lltok),
            "first_ms": summary(first),
            "cached_ms": summary(cached, 4),
            "row_matcher_ms": summary(row_ms, 4),
            "first_mask_ms": summary(first_mask),
            "new_schema_warm_ms": summary(other),
            "new_schema_warm_first_mask_ms": summary(other_mask),
        }
    }
    bench.log(
        f"  S compile of a {len(json.dumps(schema))}-byte schema: tokenizer "
        f"{statistics.median(lltok):.0f} ms (once per model), first {statistics.median(first):.2f} ms, "
        f"cached {statistics.median(cached) * 1000:.1f} us"
    )
    # per step: the matcher's mask for the next token (the grammar thread's work, overlapping the forward)
    # and the sampler's unpacking of 1 and 8 rows' masks into the scores (on the model thread)
    request = grammars
    s_constraint = json_constraint(answer_schema)
    mask_us, advance_us, steps = [], [], 0
    for text in texts[:16]:
        row = request.row(s_constraint)
        for token in tok(text, add_special_tokens=False)["input_ids"]:
            start = time.perf_counter()
            row.current_mask()
            mask_us.append(ms(start) * 1000)
            start = time.perf_counter()
            ended = row.advance(token)
            advance_us.append(ms(start) * 1000)
            steps += 1
            if ended:
                break
    unpack = {}
    mask = request.row(s_constraint).current_mask()
    for rows in sorted({1, bench.plan.s_clients}):
        scores = torch.zeros(rows, vocab)
        times = []
        for _ in range(53):
            start = time.perf_counter()
            scores.masked_fill(~allowed_tokens([mask] * rows, vocab, scores.device), float("-inf"))
            times.append(ms(start))
        unpack[str(rows)] = summary(times[3:], 4)
    out["per_step"] = {
        "answers": min(len(texts), 16),
        "steps": steps,
        "mask_us": summary(mask_us, 1),
        "advance_us": summary(advance_us, 1),
        "sampler_mask_ms": unpack,
    }
    return out
