"""Section memory: the worker's RSS before, during and after the worst legal request and one that fits, against
the RSS at ready + the KV budget + a transient allowance; in full mode also on a second server with a small
KV budget."""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time

from tooling.reliability.base import RunBase
from tooling.reliability.server import Server
from tooling.reliability.wire import metrics, post_json, sample
from app.settings import Settings


SCORED_PROMPT = 3500  # the "scoring" variant's prompt tokens (the context allowing)
SCORING_GROWTH = 2**30  # its bound: prompt scoring's memory follows a chunk's logits, not the prompt's


class MemorySection(RunBase):
    """``section_memory``: the variants on the run's server (and in full mode a small-budget one)."""

    def kv_bytes_per_token(self) -> tuple[int, int]:
        c = self.config
        layers = c.get("num_hidden_layers") or c.get("n_layer")
        heads = c.get("num_attention_heads") or c.get("n_head")
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or (c.get("hidden_size") or c.get("n_embd")) // heads
        dtype = self.server_env.get("SAKER_DTYPE") or os.environ.get("SAKER_DTYPE") or "auto"
        if dtype == "auto":
            dtype = "float32"  # the CPU default (on CUDA auto is the checkpoint's dtype)
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available():
                    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
        size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
        quantize = self.server_env.get("SAKER_QUANTIZE") or os.environ.get("SAKER_QUANTIZE")
        if dtype == "float32" and quantize in ("int4", "int8"):
            # int4/int8 kernels on the CPU: float64 attention, whose block pool holds float64 (the server is given
            # the model's folder, which is served as loaded, float32, unless SAKER_QUANTIZE says otherwise)
            size = 8
        return 2 * layers * kv_heads * head_dim * size, size

    def section_memory(self) -> dict:
        assert self.server is not None
        words = self.hello_words(self.context - 92)
        prompt = "hello " * words
        scored = "hello " * self.hello_words(min(SCORED_PROMPT, self.context - 92))
        variants = {
            "worst": {"prompt": prompt, "n": 20, "best_of": 20, "logprobs": 20, "echo": True, "max_tokens": None},
            "fits": {"prompt": prompt, "n": 2, "best_of": 2, "logprobs": 20, "echo": True, "max_tokens": 16},
            # prompt scoring: every prompt position's top 20, and 8 candidates that share the prompt's blocks
            "scoring": {"prompt": scored, "n": 8, "best_of": 8, "logprobs": 20, "echo": True, "max_tokens": 16},
        }
        out = self.memory_on(
            self.server, self.rss_at_ready, [(n, variants[n]) for n in self.plan.memory_variants], f"'hello ' x {words}"
        )
        budget = self.args.memory_budget_tokens
        if self.args.quick or not budget:
            return out
        # The sequence: a long prompt, then a request of many short rows, on a server with a small KV budget (so
        # that a store that outgrows its budget shows in GiB, not tens of GiB, on a shared machine).
        long_words = self.hello_words(min(self.context - 92, budget // 2))
        env = {**os.environ, **self.server_env}
        rows = 2 * int(env.get("SAKER_MAX_BATCH_ROWS") or 8)
        sequence = [
            ("long", {"prompt": "hello " * long_words, "n": 1, "max_tokens": 16}),
            ("rows-after-long", {"prompt": "hello", "n": rows, "best_of": rows, "max_tokens": 16}),
        ]
        assert self.model_dir is not None
        small = Server(
            self.model_dir,
            self.name,
            {**self.server_env, "SAKER_KV_CACHE_TOKENS": str(budget)},
            self.server.log_path.parent,
        )
        try:
            small.wait_ready()
            out["small_budget"] = self.memory_on(small, small.rss_bytes(), sequence, f"'hello ' x {long_words}")
            out["small_budget"]["server_env"] = {"SAKER_KV_CACHE_TOKENS": budget}
        finally:
            small.stop()
        return out

    def memory_on(self, server: Server, rss_at_ready: int, variants: list[tuple[str, dict]], prompt_label: str) -> dict:
        """Each variant in turn on ``server``: the worker's RSS every 50 ms from 1 s before to 3 s after."""
        assert self.model_dir is not None
        per_token, dtype_bytes = self.kv_bytes_per_token()
        budget_tokens = int(sample(metrics(server.port), "saker_kv_cache_budget_tokens"))
        chunk = int(
            self.server_env.get("SAKER_PREFILL_CHUNK_TOKENS")
            or os.environ.get("SAKER_PREFILL_CHUNK_TOKENS")
            or Settings.model_fields["prefill_chunk_tokens"].default
        )
        weights = sum(
            p.stat().st_size for p in self.model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()
        )
        transient = 2 * max(1, min(chunk, self.context)) * max(self.vocab, 1) * 4
        budget_bytes = budget_tokens * per_token
        # the prefix cache keeps recent prompts' KV under its own budget (SAKER_PREFIX_CACHE_TOKENS), apart from
        # the running batch's

        prefix_tokens = int(
            self.server_env.get("SAKER_PREFIX_CACHE_TOKENS")
            or os.environ.get("SAKER_PREFIX_CACHE_TOKENS")
            or Settings.model_fields["prefix_cache_tokens"].default
        )
        prefix_bytes = prefix_tokens * per_token
        bound = rss_at_ready + budget_bytes + prefix_bytes + transient
        out = {
            "kv_bytes_per_token": per_token,
            "dtype_bytes": dtype_bytes,
            "kv_budget_tokens": budget_tokens,
            "kv_budget_bytes": budget_bytes,
            "weights_bytes_on_disk": weights,
            "rss_at_ready": rss_at_ready,
            "transient_allowance_bytes": transient,
            "prefix_cache_budget_bytes": prefix_bytes,
            "bound_bytes": bound,
            "variants": {},
        }
        label = "" if server is self.server else f" (KV budget {budget_tokens})"
        for name, fields in variants:
            body = {"model": self.name, **fields}
            _, tok = post_json(server.port, "/tokenize", {"prompt": body["prompt"]})
            prompt_tokens = int(tok.get("count") or 0)
            rows = body.get("best_of") or body.get("n") or 1
            reach = prompt_tokens + (
                body["max_tokens"] if body["max_tokens"] is not None else self.context - prompt_tokens
            )
            samples: list[tuple[float, int]] = []
            stop = threading.Event()
            thread = threading.Thread(target=_sample_rss, args=(server, samples, stop), daemon=True)
            thread.start()
            time.sleep(1.0)
            sent = time.monotonic()
            answer, obj = post_json(server.port, "/v1/completions", body, timeout=3600)
            answered = time.monotonic()
            time.sleep(3.0)
            stop.set()
            thread.join()
            before = [r for t, r in samples if t < sent]
            during = [r for t, r in samples if sent <= t <= answered] or [r for t, r in samples if t >= sent][:1]
            after = [r for t, r in samples if t > answered]
            baseline = int(statistics.median(before)) if before else 0
            peak = max(during + after[:5]) if during else 0
            shown = {k: (prompt_label if k == "prompt" and len(v) > 40 else v) for k, v in body.items()}
            variant = {
                "request": shown,
                "status": answer.status,
                "seconds": round(answer.seconds, 2),
                "prompt_tokens": prompt_tokens,
                "rows": rows,
                "reach_tokens": reach,
                "request_kv_bytes": rows * reach * per_token,
                "baseline_rss": baseline,
                "peak_rss": peak,
                "after_rss": after[-1] if after else None,
                "peak_minus_baseline": peak - baseline,
                "after_minus_baseline": (after[-1] - baseline) if after else None,
                "peak_minus_ready": peak - rss_at_ready,
                "within_bound": peak <= bound,
            }
            if answer.status != 200:
                variant["answer"] = (obj.get("error") or {}).get("message") or answer.body[:300].decode(
                    "utf-8", "replace"
                )
            else:
                variant["usage"] = obj.get("usage")
                variant["timing"] = obj.get("timing")
            out["variants"][name] = variant
            self.log(
                f"memory {name}{label}: {answer.status} in {answer.seconds:.1f} s, RSS {baseline / 2**20:.0f} "
                f"-> {peak / 2**20:.0f} MiB peak -> {(after[-1] if after else 0) / 2**20:.0f} MiB after "
                f"(bound {bound / 2**20:.0f} MiB)"
            )
            self.goal(
                "memory",
                f"{name}{label}: a correct answer (200, or 400 when it cannot fit the KV budget)",
                answer.status == 200 or (answer.status == 400 and "KV" in str(variant.get("answer"))),
                f"{answer.status}",
                True,
            )
            if name == "scoring":
                self.goal(
                    "memory",
                    f"{name}{label}: the worker grows by at most {SCORING_GROWTH / 2**30:.0f} GiB (peak - baseline)",
                    peak - baseline <= SCORING_GROWTH,
                    f"{(peak - baseline) / 2**20:.0f} MiB",
                    False,
                )
            self.goal(
                "memory",
                f"{name}{label}: peak RSS <= RSS at ready + KV budget + prefix-cache budget + transient",
                peak <= bound,
                f"{peak / 2**20:.0f} MiB vs {bound / 2**20:.0f} MiB",
                False,
            )
        return out


def _sample_rss(server: Server, samples: list[tuple[float, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), server.rss_bytes()))
        time.sleep(0.05)
