"""``python -m app bench``: the performance suite (issue 6). A benchmark, not a test: it measures, prints a table,
and writes ``bench.json`` and ``bench.png`` into ``docs/performance/`` (``--out-dir``).

Parts (``--only A,B,...``; default A,B,C,T,L,R,E,S, plus D with ``--gpu``):

- A  server ms per generated token (HTTP round trip / tokens) on a GPT-2-small-shaped model (12 layers, 768 wide,
     32k byte-level BPE trained offline, random weights), 64-token prompt, 32 greedy tokens (ignore_eos), fp32 on
     CPU, divided by in-process ``model.generate()`` ms per token on the same model, same prompt, same tokens.
     The two sides alternate (server, generate, server, ...) and never overlap. Goal <= 0.90.
- B  aggregate generated tokens/s with 8 concurrent clients divided by one client's (same model). Goal >= 2.2.
- C  tiny model (the tests' size), ``max_tokens: 1``: median HTTP round trip minus the median in-process forward
     of the same prompt. Goal <= 5 ms.
- T  streaming time to first token vs the server's own prefill time (``timing.prefill_ms``).
- L  latency percentiles (p50/p90/p99 of the whole request and of the first token) at 1/2/4/8/16/32/64 clients.
- E  engine efficiency at high concurrency on the tiny model (the tests' 2-layer GPT-2: its batch-32 decode step
     is about as long as a GPU step of a 1B model): delivered tokens/s of 32 (and 64) closed-loop clients, 3
     requests each, 48-token prompts, 128 tokens (ignore_eos), greedy and sampled (temperature 0.8, top_p 0.9,
     logprobs 5, a seed each), divided by clients / the in-process forward of a batch of that many rows (measured
     with no server running, before and after). Goals at 32 clients: >= 0.6 greedy, >= 0.5 sampled.
- S  structured outputs on the embedded SmolLM2-135M-Instruct (49k vocabulary, converted once into the cache):
     delivered tokens/s of chat requests constrained by a JSON schema (``response_format`` json_schema: strings
     with maxLength, a bounded integer, an enum, a small array, a nested object; temperature 0.7, a seed each,
     max_tokens 96; a constrained answer ends when its JSON is complete) divided by the very same requests
     unconstrained with ``ignore_eos`` (they run to max_tokens), closed loops of 1 and of 8 clients, the two sides
     alternating within each round; the median of 3 rounds. Goal >= 0.9 at 1 and at 8 clients. Beside it, the
     free request cut to the constrained answer's length (same seed): the grammar's own cost. Then, in-process
     with SmolLM2's tokenizer: llguidance's tokenizer build, a 2 kB schema (``compile_schema``) compiled first
     (a fresh ``Grammars``) and cached, and the per-step cost of a constrained row (its next mask, the sampler's
     unpacking of 1 and 8 rows' masks).
- D  (GPU) a 1B-class Llama-shaped model in bf16: server decode ms/token divided by the bandwidth floor
     (weight bytes / device-to-device copy bandwidth). Goal <= 1.3. ``--only D --device cuda``.

The bench starts its own gunicorn (``SAKER_MODEL`` = the generated model) unless ``--url`` points at a running
OpenAI-compatible server; then only the HTTP-side measurements run (no in-process references, no ratios that need
them; S measures that server's chat endpoint). Models are built once into ``--cache-dir`` (default ``.cache/bench``).

Torch threads: the bench process and the server use the same number (``--threads``, default: torch's default
here); the server gets it as OMP_NUM_THREADS/MKL_NUM_THREADS, the bench calls ``torch.set_num_threads``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import http.client
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from app.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "performance"
DEFAULT_CACHE = ROOT / ".cache" / "bench"
ALL_PARTS = ("A", "B", "C", "T", "L", "R", "E", "S", "D")
DEFAULT_PARTS = ("A", "B", "C", "T", "L", "R", "E", "S")
SCHEMA = 1
MODEL_VERSION = 1  # bump when the generated models change shape, so cached ones are rebuilt

GOALS = {
    "A": ("<=", 0.90),
    "B": (">=", 2.2),
    "C": ("<=", 5.0),
    "D": ("<=", 1.3),
    "E greedy": (">=", 0.6),
    "E sampled": (">=", 0.5),
    "S 1 client": (">=", 0.9),
    "S 8 clients": (">=", 0.9),
}
# E: the request settings of its two modes (sampled rows also get a seed of their own)
E_MODES = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.9, "logprobs": 5}}
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


# A repetition during which other processes used more than this share of the CPU does not count (shared machines);
# it is still recorded in the JSON, with its share.
CLEAN_SHARE = 0.10

# About 64 GPT-2 tokens of plain English: the prompt sent to servers whose tokenizer we do not know (--url).
PROMPT_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lamp and a "
    "notebook in which he recorded the weather, the ships that passed, and the small events of the island. "
    "Over forty years the notebooks filled a whole shelf, and nobody but him had ever read a single page of them."
)
TINY_PROMPT = "The capital of France is Paris. The capital of Italy is"
TINY_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small model that liked to count: one two three four five.",
    "Hello world! Hello there, general Kenobi. The quick brown fox jumps over the lazy dog.",
    "Passage: The bedroom is north of the garden. Question: How do you go from the bathroom to the office?",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 and symbols ! ? , . ; : ' \" ( ) [ ] { } - + * / = < >",
]


# ---------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """How much of everything one run does (full or --quick)."""

    prompt_tokens: int = 64
    a_tokens: int = 32
    a_reps: int = 9
    warmup: int = 2
    b_tokens: int = 32
    b_rounds: int = 3
    b_single_requests: int = 4  # requests of the 1-client run, per round
    b_clients: int = 8
    b_per_client: int = 2  # requests per client in the 8-client run, per round
    c_rounds: int = 10
    c_per_round: int = 30
    t_tokens: int = 16
    t_reps: int = 9
    l_levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    l_tokens: int = 16
    l_requests: int = 24  # requests per level (at least 2 per client)
    l_level_seconds: float = 30.0  # no new requests after this long at one level
    d_tokens: int = 128
    d_reps: int = 5
    r_context: int = 448  # R: the shared context's tokens
    r_questions: int = 8  # R: requests per round, each the context + its own question
    r_tokens: int = 8
    r_rounds: int = 3  # R: measured rounds (after one warm-up round)
    e_levels: tuple[int, ...] = (32, 64)  # E: concurrent clients (the goal is read at 32)
    e_per_client: int = 3  # E: requests per client
    e_rounds: int = 3  # E: measured rounds per level and mode (the median counts)
    e_prompt_tokens: int = 48
    e_tokens: int = 128
    s_tokens: int = 96  # S: max_tokens of both sides (the constrained side may end sooner)
    s_rounds: int = 3  # S: measured rounds (the median counts)
    s_single_requests: int = 3  # S: requests of the 1-client loop per side and round
    s_clients: int = 8
    s_per_client: int = 2  # S: requests per client in the 8-client loop per side and round
    s_compile_reps: int = 9  # S: fresh compiles of the 2 kB schema
    # seconds after which a part stops adding repetitions to replace ones disturbed by other processes
    a_budget: float = 90.0
    t_budget: float = 40.0
    b_budget: float = 150.0
    c_budget: float = 40.0
    l_budget: float = 200.0  # a level disturbed by other processes is run again while within this
    s_budget: float = 240.0  # S: per level

    @classmethod
    def quick(cls) -> "Plan":
        return cls(
            l_levels=(1, 2, 4, 8, 16),
            a_tokens=16,
            a_reps=3,
            warmup=1,
            b_tokens=16,
            b_rounds=1,
            b_single_requests=2,
            b_per_client=1,
            c_rounds=3,
            c_per_round=10,
            t_tokens=8,
            t_reps=3,
            l_tokens=8,
            l_requests=4,
            l_level_seconds=8.0,
            d_tokens=16,
            d_reps=2,
            r_context=96,
            r_questions=3,
            r_tokens=4,
            r_rounds=1,
            e_levels=(32,),
            e_per_client=1,
            e_rounds=1,
            e_tokens=32,
            s_tokens=96,
            s_rounds=1,
            s_single_requests=1,
            s_per_client=1,
            s_compile_reps=3,
            a_budget=10.0,
            t_budget=5.0,
            b_budget=10.0,
            c_budget=5.0,
            l_budget=0.0,
            s_budget=0.0,
        )


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # gpt2 | llama
    layers: int
    width: int
    heads: int
    vocab: int  # BPE vocabulary asked of the trainer (32000 gives 26,723 on the stdlib corpus)
    positions: int
    intermediate: int = 0  # llama only
    kv_heads: int = 0  # llama only

    @property
    def dir_name(self) -> str:
        return f"{self.name}-v{MODEL_VERSION}"


GPT2_SMALL = ModelSpec("gpt2-small", "gpt2", layers=12, width=768, heads=12, vocab=32000, positions=1024)
GPT2_TINY = ModelSpec("gpt2-tiny", "gpt2", layers=2, width=64, heads=4, vocab=400, positions=256)
LLAMA_1B = ModelSpec(
    "llama-1b", "llama", layers=16, width=2048, heads=32, vocab=32000, positions=2048, intermediate=8192, kv_heads=8
)
LLAMA_SMALL = ModelSpec(
    "llama-small", "llama", layers=4, width=512, heads=8, vocab=32000, positions=2048, intermediate=1024, kv_heads=4
)


# ---------------------------------------------------------------------------------------------------------------
# models, built offline into the cache
# ---------------------------------------------------------------------------------------------------------------
def _stdlib_corpus(limit_chars: int = 6_000_000) -> list[str]:
    """Text to train a 32k byte-level BPE on, offline and the same on every run: the Python standard library's
    sources (tests left out), in sorted order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "tests" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        size += len(text)
        if size >= limit_chars:
            break
    return texts


def _train_tokenizer(path: Path, vocab: int, texts: list[str]):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts + [PROMPT_TEXT, TINY_PROMPT],
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    path.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(path))
    tok = GPT2TokenizerFast.from_pretrained(
        str(path), bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>", add_bos_token=False
    )
    tok.save_pretrained(path)
    return tok


def ensure_model(spec: ModelSpec, cache_dir: Path, log: Callable[[str], None], device: str = "cpu") -> Path:
    """Build ``spec`` once (tokenizer trained in seconds, random weights, seed 0); later runs reuse the folder."""
    target = cache_dir / spec.dir_name
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import shutil

    import torch

    start = time.perf_counter()
    log(f"building {spec.name} into {target} (once)")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok_source = cache_dir / f"tokenizer-{spec.vocab}-v{MODEL_VERSION}"
        if spec.vocab == 400:
            tok = _train_tokenizer(tmp, spec.vocab, TINY_CORPUS * 20)
        else:
            if not (tok_source / "tokenizer.json").is_file():
                _train_tokenizer(tok_source, spec.vocab, _stdlib_corpus())
            from transformers import GPT2TokenizerFast

            tok = GPT2TokenizerFast.from_pretrained(str(tok_source))
            tok.save_pretrained(tmp)
        torch.manual_seed(0)
        eos = tok.eos_token_id
        if spec.kind == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            config = GPT2Config(
                vocab_size=len(tok),
                n_positions=spec.positions,
                n_embd=spec.width,
                n_layer=spec.layers,
                n_head=spec.heads,
                bos_token_id=eos,
                eos_token_id=eos,
                initializer_range=0.2 if spec.width <= 64 else 0.02,
            )
            model = GPT2LMHeadModel(config).eval()
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(
                vocab_size=len(tok),
                hidden_size=spec.width,
                intermediate_size=spec.intermediate,
                num_hidden_layers=spec.layers,
                num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.positions,
                rope_theta=500000.0,
                tie_word_embeddings=True,
                bos_token_id=eos,
                eos_token_id=eos,
                dtype="bfloat16",
            )
            build_device = device if device.startswith("cuda") else "cpu"
            with torch.device(build_device):
                model = LlamaForCausalLM(config)
            model = model.to(torch.bfloat16).eval()
        model.save_pretrained(tmp)
        del model
        if not target.exists():
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built {spec.name} in {time.perf_counter() - start:.1f} s")
    return target


def load_reference(path: Path, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
    return model, tok


def prompt_ids(tok, count: int) -> list[int]:
    """Exactly ``count`` ids of the English prompt (repeated when the tokenizer packs it tighter)."""
    ids = list(tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"])
    while len(ids) < count:
        ids += ids
    return ids[:count]


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------------
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


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], digits: int = 3) -> dict:
    if not values:
        return {"n": 0}
    out = {
        "median": round(statistics.median(values), digits),
        "p25": round(percentile(values, 25), digits),
        "p75": round(percentile(values, 75), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }
    if len(values) <= 60:  # every repetition, in order (long series only summarized)
        out["values"] = [round(v, digits) for v in values]
    return out


def latency_summary(values: list[float], digits: int = 2) -> dict:
    if not values:
        return {"n": 0}
    return {
        "p50": round(percentile(values, 50), digits),
        "p90": round(percentile(values, 90), digits),
        "p99": round(percentile(values, 99), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }


def check_goal(part: str, value: float | None) -> bool | None:
    if value is None or part not in GOALS or (isinstance(value, float) and math.isnan(value)):
        return None
    op, goal = GOALS[part]
    return value <= goal if op == "<=" else value >= goal


# ---------------------------------------------------------------------------------------------------------------
# HTTP client: http.client over keep-alive connections, one per thread (no client library in the measurement)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    e2e_s: float
    tokens: int
    text: str
    ttft_s: float | None = None  # streaming: first frame that carries a token
    timing: dict | None = None  # the server's timing (saker: body/usage chunk or X-Saker-* headers)
    prompt_tokens: int | None = None
    start: float = 0.0
    end: float = 0.0
    rejected: int = 0  # 429/503 answers retried before this one (closed_loop)
    finish_reason: str | None = None  # the first choice's (non-streamed answers)
    index: tuple[int, int] | None = None  # closed_loop: (client, request of that client)


class HTTPError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        prefix = parts.path.rstrip("/")
        self.prefix = prefix[:-3] if prefix.endswith("/v1") else prefix
        self.url = f"{parts.scheme}://{parts.netloc}{self.prefix}"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=self.timeout)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def get_json(self, path: str) -> dict:
        conn = self._connection()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
            conn = self._connection(fresh=True)
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise HTTPError(f"GET {path}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)

    def _send(self, path: str, payload: bytes) -> tuple[http.client.HTTPResponse, float]:
        """Send on the kept-alive connection; a connection the server closed while idle is reopened once (the
        clock starts again with the attempt that counts)."""
        for attempt in (0, 1):
            conn = self._connection(fresh=attempt == 1)
            start = time.perf_counter()
            try:
                conn.request("POST", self.prefix + path, body=payload, headers=self.headers)
                return conn.getresponse(), start
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def complete(self, body: dict, path: str = "/v1/completions") -> Reply:
        """One /v1/completions request (or ``path``: /v1/chat/completions); streamed when ``body['stream']``."""
        resp, start = self._send(path, json.dumps(body).encode())
        if resp.status != 200:
            data = resp.read()
            retry = resp.getheader("Retry-After")
            raise HTTPError(
                f"POST {path}: HTTP {resp.status}: {data[:500]!r}",
                resp.status,
                float(retry) if retry and retry.replace(".", "", 1).isdigit() else None,
            )
        if body.get("stream"):
            return self._read_stream(resp, start)
        data = resp.read()
        end = time.perf_counter()
        obj = json.loads(data)
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or []
        text = "".join(c.get("text") or (c.get("message") or {}).get("content") or "" for c in choices)
        timing = obj.get("timing") or _header_timing(resp)
        return Reply(
            end - start,
            int(usage.get("completion_tokens", 0)),
            text,
            timing=timing,
            prompt_tokens=usage.get("prompt_tokens"),
            start=start,
            end=end,
            finish_reason=choices[0].get("finish_reason") if choices else None,
        )

    @staticmethod
    def _read_stream(resp, start: float) -> Reply:
        ttft = None
        frames = 0
        text = []
        usage = timing = None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                raise HTTPError(f"stream error frame: {obj['error']}")
            for choice in obj.get("choices") or []:
                lp = choice.get("logprobs") or {}
                if choice.get("text") or choice.get("finish_reason") or lp.get("tokens"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    frames += 1
                    text.append(choice.get("text") or "")
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("timing"):
                timing = obj["timing"]
        resp.read()  # the chunked terminator, so the connection can be reused
        end = time.perf_counter()
        tokens = int(usage["completion_tokens"]) if usage else frames
        return Reply(
            end - start,
            tokens,
            "".join(text),
            ttft_s=ttft,
            timing=timing,
            prompt_tokens=usage.get("prompt_tokens") if usage else None,
            start=start,
            end=end,
        )


def _header_timing(resp) -> dict | None:
    names = {"queue_ms": "X-Saker-Queue-Ms", "prefill_ms": "X-Saker-Prefill-Ms", "decode_ms": "X-Saker-Decode-Ms"}
    out = {}
    for key, header in names.items():
        value = resp.getheader(header)
        if value is not None:
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out or None


def closed_loop(
    client: Client,
    make_body: Callable[[int, int], dict],
    clients: int,
    per_client: int,
    seconds: float | None = None,
    path: str = "/v1/completions",
) -> tuple[list[Reply], float]:
    """``clients`` threads, each sending requests back to back (``per_client`` of them, fewer if ``seconds`` run
    out) to ``path``; returns the replies and the wall time from the first send to the last answer."""
    replies: list[Reply] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)
    deadline = [math.inf]

    def run(i: int) -> None:
        try:
            client._connection()  # connect before the clock starts
            barrier.wait()
            if i == 0:
                deadline[0] = time.perf_counter() + (seconds or math.inf)
            for j in range(per_client):
                if j and time.perf_counter() > deadline[0]:
                    break
                rejected = 0
                while True:
                    try:
                        reply = client.complete(make_body(i, j), path)
                        break
                    except HTTPError as exc:  # overloaded: count it, wait as told (at most 1 s), try again
                        if exc.status not in (429, 503) or rejected >= 20:
                            raise
                        rejected += 1
                        time.sleep(min(exc.retry_after or 0.2, 1.0))
                reply.rejected = rejected
                reply.index = (i, j)
                with lock:
                    replies.append(reply)
        except BaseException as exc:
            errors.append(exc)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,), name=f"bench-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(r.end for r in replies) - min(r.start for r in replies)
    return replies, wall


# ---------------------------------------------------------------------------------------------------------------
# our server under gunicorn
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_fields() -> set[str]:
    from app.settings import Settings

    return set(Settings.model_fields)


class Server:
    """gunicorn -c gunicorn.conf.py wsgi:app on 127.0.0.1, in its own process group (stopped with it)."""

    def __init__(self, model_dir: Path, name: str, env: dict[str, str], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.env = {
            "SAKER_MODEL": str(model_dir),
            "SAKER_SERVED_MODEL_NAME": name,
            "SAKER_LOG_LEVEL": "warning",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        }
        gunicorn = str(Path(sys.executable).parent / "gunicorn")
        # the bench's private server on 127.0.0.1 needs no API keys (the bench would not know them)
        inherited = {k: v for k, v in os.environ.items() if k.upper() not in ("SAKER_API_KEYS", "SAKER_API_KEY_FILE")}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"gunicorn-{name}-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            [gunicorn, "-c", "gunicorn.conf.py", "-b", f"127.0.0.1:{self.port}", "wsgi:app"],
            cwd=ROOT,
            env={**inherited, **self.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if sock.recv(64).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gunicorn not ready after {timeout:.0f} s:\n{self.output()[-3000:]}")

    def worker_pids(self) -> list[int]:
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            return [int(c) for c in children]
        except OSError:
            return []

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout)
        if not self.log.closed:
            self.log.close()


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.plan = Plan.quick() if args.quick else Plan()
        self.parts = parse_parts(args)
        self.external = args.url is not None
        self.cache_dir = Path(args.cache_dir).expanduser().resolve()
        self.out_dir = Path(args.out_dir).expanduser().resolve()
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.servers: list[Server] = []
        self.server_info: dict[str, Any] = {}
        self.models: dict[str, Any] = {}
        self.threads = args.threads
        self._refs: dict[str, Any] = {}
        self.log_lines: list[str] = []
        monitor = CpuMonitor()
        # with --url the server is not ours: its CPU would read as other processes', so nothing is set aside
        self.cpu = monitor if monitor.available() and not self.external else None

    # -- helpers ------------------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        line = f"[bench {time.strftime('%H:%M:%S')}] {message}"
        self.log_lines.append(line)
        print(line, file=sys.stderr, flush=True)

    @staticmethod
    def settle() -> None:
        """Between the server's turn and the in-process turn: let the other side's OpenMP threads go idle."""
        time.sleep(0.05)

    def main_spec(self) -> ModelSpec:
        return GPT2_TINY if self.args.size == "tiny" else GPT2_SMALL

    def server_env(self, device: str = "cpu", dtype: str = "float32") -> dict[str, str]:
        fields = settings_fields()
        env = {
            "SAKER_DEVICE": device,
            "SAKER_DTYPE": dtype,
            "SAKER_THREADS": str(3 * max(max(self.plan.l_levels), self.plan.b_clients) + 4),
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
        }
        if "max_queue" in fields:  # 16 clients must queue, not be turned away with 429
            env["SAKER_MAX_QUEUE"] = str(2 * max(max(self.plan.l_levels), self.plan.b_clients))
        if "prefix_cache_tokens" in fields:  # every part repeats one prompt: measure its prefill, not a cache
            env["SAKER_PREFIX_CACHE_TOKENS"] = "0"
        if self.args.max_batch_size is not None:
            if "max_batch_size" in fields:
                env["SAKER_MAX_BATCH_SIZE"] = str(self.args.max_batch_size)
            else:
                self.log("--max-batch-size ignored: this server has no max_batch_size setting")
        for item in self.args.server_env or []:
            key, _, value = item.partition("=")
            env[key] = value
        return env

    def start_server(
        self,
        model_dir: Path,
        name: str,
        device: str = "cpu",
        dtype: str = "float32",
        extra_env: dict[str, str] | None = None,
    ) -> Server:
        env = {**self.server_env(device, dtype), **(extra_env or {})}
        self.log(f"starting gunicorn for {name} ({', '.join(f'{k}={v}' for k, v in env.items())})")
        start = time.perf_counter()
        server = Server(model_dir, name, env, self.cache_dir / "logs")
        self.servers.append(server)
        server.wait_ready()
        self.log(f"gunicorn ready in {time.perf_counter() - start:.1f} s on {server.url}")
        fields = settings_fields()
        info = {
            "url": server.url,
            "model": name,
            "env": env,
            "ready_s": round(time.perf_counter() - start, 1),
            "max_batch_size_setting": "max_batch_size" in fields,
        }
        if "max_batch_size" in fields:
            from app.settings import Settings

            default = Settings.model_fields["max_batch_size"].default
            info["max_batch_size"] = int(
                env.get("SAKER_MAX_BATCH_SIZE", os.environ.get("SAKER_MAX_BATCH_SIZE", default))
            )
        self.server_info[name] = info
        return server

    def repeat(self, fn: Callable[[int], Any], reps: int, extra: int, budget: float) -> list[tuple[Any, float | None]]:
        """Run ``fn(i)`` ``reps`` times; repetitions disturbed by other processes (over CLEAN_SHARE of the CPU)
        are replaced by up to ``extra`` more while the part has run less than ``budget`` seconds. Returns
        (value, foreign CPU share) per repetition."""
        out: list[tuple[Any, float | None]] = []
        clean = 0
        start = time.perf_counter()
        while len(out) < reps or (len(out) < reps + extra and time.perf_counter() - start < budget):
            snap = self.cpu.snapshot() if self.cpu else None
            value = fn(len(out))
            share = self.cpu.since(snap).get("foreign_cpu_share") if snap is not None else None
            out.append((value, share))
            clean += share is None or share <= CLEAN_SHARE
            if clean >= reps:
                break
            if share is not None and share > CLEAN_SHARE:
                self.log(f"  repetition {len(out)}: other processes used {share:.0%} of the CPU; not counted")
        return out

    @staticmethod
    def select(runs: list[tuple[Any, float | None]]) -> tuple[list[Any], dict]:
        """The quiet repetitions when there are at least 3 of them, else all; and what was chosen."""
        clean = [v for v, share in runs if share is None or share <= CLEAN_SHARE]
        used = clean if len(clean) >= 3 or len(clean) == len(runs) else [v for v, _ in runs]
        info = {
            "repetitions": len(runs),
            "used": len(used),
            "quiet": len(clean),
            "threshold": CLEAN_SHARE,
            "foreign_cpu_share": [share for _, share in runs],
        }
        return used, info

    def wait_idle(self, limit: float) -> float:
        """Wait (up to ``limit`` s) until other processes use under 10 % of the CPU over 5 s."""
        start = time.perf_counter()
        while True:
            snap = self.cpu.snapshot()
            time.sleep(5.0)
            share = self.cpu.since(snap).get("foreign_cpu_share", 0)
            waited = time.perf_counter() - start
            if share < 0.1:
                return round(waited, 1)
            if waited >= limit:
                self.log(f"still busy after {waited:.0f} s ({share:.0%} of the CPU used by others); going on")
                return round(waited, 1)
            self.log(f"waiting for a quiet machine: others use {share:.0%} of the CPU")

    def stop_server(self, server: Server) -> None:
        server.stop()
        if server in self.servers:
            self.servers.remove(server)

    def reference(self, key: str, path: Path, dtype: str = "float32", device: str = "cpu"):
        if key not in self._refs:
            self._refs[key] = load_reference(path, dtype, device)
        return self._refs[key]

    def run_part(self, part: str, fn: Callable[[], dict | None]) -> None:
        self.log(f"part {part} ...")
        start = time.perf_counter()
        snap = self.cpu.snapshot() if self.cpu else None
        try:
            result = fn()
            if result is not None:
                result["seconds"] = round(time.perf_counter() - start, 1)
                if snap is not None:
                    result["cpu"] = self.cpu.since(snap)
                    share = result["cpu"].get("foreign_cpu_share", 0)
                    if share > 0.05:
                        self.log(f"warning: other processes used {share:.0%} of the CPU during part {part}")
                self.results[part] = result
        except Exception as exc:
            import traceback

            self.errors[part] = f"{type(exc).__name__}: {exc}"
            self.log(f"part {part} failed: {self.errors[part]}")
            traceback.print_exc(file=sys.stderr)
        self.log(f"part {part} done in {time.perf_counter() - start:.1f} s")

    # -- orchestration ---------------------------------------------------------------------------------------
    def run(self) -> dict:
        import torch

        started = time.time()
        torch.set_num_threads(self.threads)
        machine = machine_info(self.threads)
        self.log(
            f"machine: {machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
            f"{self.threads} torch threads, load average {machine['load_average_start']}"
        )
        if self.args.wait_idle and self.cpu:
            machine["waited_for_idle_s"] = self.wait_idle(self.args.wait_idle)
        if self.cpu:
            snap = self.cpu.snapshot()
            time.sleep(1.0)
            machine["foreign_cpu_share_before"] = self.cpu.since(snap).get("foreign_cpu_share")
            if machine["foreign_cpu_share_before"] > 0.1:
                self.log(
                    f"warning: other processes use {machine['foreign_cpu_share_before']:.0%} of the CPU; "
                    f"timings will be noisy (--wait-idle SECONDS waits for a quiet machine)"
                )
        run_snap = self.cpu.snapshot() if self.cpu else None
        try:
            main_parts = [p for p in ("A", "T", "B", "L", "R") if p in self.parts]
            if self.external:
                self._run_external(main_parts)
            else:
                self._run_ours(main_parts)
            if "D" in self.parts:
                if self.external:
                    self.errors["D"] = "D needs our own server and the model in-process (not with --url)"
                else:
                    self.run_part("D", self.part_d)
        finally:
            for server in list(self.servers):
                self.stop_server(server)
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        if run_snap is not None:
            machine["foreign_cpu_share_during_run"] = self.cpu.since(run_snap).get("foreign_cpu_share")
        report = {
            "schema": SCHEMA,
            "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - started, 1),
            "quick": bool(self.args.quick),
            "target": self.args.url or "saker (started by the bench)",
            "parts": list(self.parts),
            "machine": machine,
            "plan": asdict(self.plan),
            "models": self.models,
            "servers": self.server_info,
            "goals": {k: {"op": op, "value": v} for k, (op, v) in GOALS.items()},
            "results": self.results,
            "errors": self.errors,
        }
        return report

    def _run_ours(self, main_parts: list[str]) -> None:
        spec = self.main_spec()
        if main_parts or ("C" in self.parts and spec is GPT2_TINY):
            path = ensure_model(spec, self.cache_dir, self.log)
            self.models["main"] = self._model_meta(spec, path)
        if main_parts:
            server = self.start_server(path, spec.name)
            try:
                client = Client(server.url)
                self.main_client, self.main_name, self.main_path = client, spec.name, path
                for part in main_parts:
                    self.run_part(part, getattr(self, f"part_{part.lower()}"))
                if self.args.profile and "A" in self.parts:
                    self.run_part(
                        "profile_A",
                        lambda: self.profile(
                            server, client, self.body(self.plan.a_tokens), max(3, self.plan.a_reps // 2), "A"
                        ),
                    )
            finally:
                if "C" in self.parts and spec is GPT2_TINY:
                    self._tiny_server = server  # reused by C
                else:
                    self.stop_server(server)
        if "C" in self.parts:
            self.run_part("C", self.part_c)
        if "E" in self.parts:
            self.run_part("E", self.part_e)
        if "S" in self.parts:
            self.run_part("S", self.part_s)

    def _run_external(self, main_parts: list[str]) -> None:
        client = Client(self.args.url, self.args.api_key)
        name = self.args.model
        if not name:
            models = client.get_json("/v1/models")
            name = models["data"][0]["id"]
        self.server_info[name] = {"url": client.url, "model": name, "started_by_bench": False}
        self.main_client, self.main_name, self.main_path = client, name, None
        for part in main_parts:
            self.run_part(part, getattr(self, f"part_{part.lower()}"))
        if "C" in self.parts:
            self.run_part("C", self.part_c)
        if "E" in self.parts:
            self.errors["E"] = "E needs our own server and the model in-process (not with --url)"
        if "S" in self.parts:  # the given server's chat endpoint; the compile times are ours
            self.run_part("S", self.part_s)

    def _model_meta(self, spec: ModelSpec, path: Path) -> dict:
        config = json.loads((path / "config.json").read_text())
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return {
            "name": spec.name,
            "kind": spec.kind,
            "layers": spec.layers,
            "width": spec.width,
            "heads": spec.heads,
            "vocab": config.get("vocab_size"),
            "dir": str(path),
            "weights_bytes": weights,
            "dtype": config.get("dtype") or config.get("torch_dtype"),
        }

    # -- request bodies ---------------------------------------------------------------------------------------
    def body(self, max_tokens: int, stream: bool = False, prompt: Any = None) -> dict:
        body: dict[str, Any] = {"model": self.main_name, "max_tokens": max_tokens, "temperature": 0}
        if prompt is None:
            prompt = self._main_prompt()
        body["prompt"] = prompt
        if not self.args.no_ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _main_prompt(self) -> Any:
        if self.external:
            return self.args.prompt or PROMPT_TEXT
        if not hasattr(self, "_prompt_ids"):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.main_path))
            self._prompt_ids = prompt_ids(tok, self.plan.prompt_tokens)
        return self._prompt_ids

    # -- A: server vs generate() --------------------------------------------------------------------------------
    def part_a(self) -> dict:
        import torch

        plan, client = self.plan, self.main_client
        tokens = plan.a_tokens
        body = self.body(tokens)
        model = tok = ids = None
        if not self.external:
            model, tok = self.reference("main", self.main_path)
            ids = torch.tensor([self._main_prompt()])

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
                self.settle()
                generate()
                self.settle()
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
                self.settle()
            return this

        used, selection = self.select(self.repeat(one, plan.a_reps, plan.a_reps, plan.a_budget))
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
        result["server_timing_ms"] = _timing_summary(timings, tokens)
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

    # -- T: time to first token vs prefill ------------------------------------------------------------------------
    def part_t(self) -> dict:
        import torch

        plan, client = self.plan, self.main_client
        body = self.body(plan.t_tokens, stream=True)
        for _ in range(plan.warmup):
            client.complete(body)
        model = None
        if not self.external:
            model, _ = self.reference("main", self.main_path)
            ids = torch.tensor([self._main_prompt()])
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
            self.settle()
            if model is not None:
                with torch.inference_mode():
                    start = time.perf_counter()
                    model(ids)
                    this["forward"] = (time.perf_counter() - start) * 1000
                self.settle()
            return this

        used, selection = self.select(self.repeat(one, plan.t_reps, plan.t_reps, plan.t_budget))
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

    # -- B: 8 clients vs 1 --------------------------------------------------------------------------------------
    def part_b(self) -> dict:
        plan, client = self.plan, self.main_client
        body = self.body(plan.b_tokens)
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

        used, selection = self.select(self.repeat(one, plan.b_rounds, plan.b_rounds, plan.b_budget))
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

    # -- R: prompts sharing a long prefix (reuse), prefix cache on vs off ----------------------------------------
    def part_r(self) -> dict:
        """Requests that share a long context and differ in a short question, one after another: request time
        on our server with the prefix cache on, against the main server (cache off) side by side. With --url
        only that server is measured (whatever caching it does)."""
        plan = self.plan
        if self.external:
            context = (PROMPT_TEXT + " ") * max(1, plan.r_context // 48)
            prompts = [f"{context}\nQuestion {i}: what comes after part {i}?\nAnswer:" for i in range(plan.r_questions)]
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.main_path))
            context = prompt_ids(tok, plan.r_context)
            prompts = [
                context
                + list(
                    tok(f"\nQuestion {i}: what comes after part {i}?\nAnswer:", add_special_tokens=False)["input_ids"]
                )
                for i in range(plan.r_questions)
            ]
        sides = {"off": self.main_client}
        if not self.external:
            server = self.start_server(
                self.main_path,
                f"{self.main_name}-prefix-cache",
                extra_env={
                    "SAKER_PREFIX_CACHE_TOKENS": str(4 * (plan.r_context + 64)),
                    "SAKER_SERVED_MODEL_NAME": self.main_name,
                },
            )
            sides = {"on": Client(server.url), "off": self.main_client}
        try:

            def one(rep: int) -> dict:
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                out: dict[str, list] = {}
                for side in order:
                    replies = [sides[side].complete(self.body(plan.r_tokens, prompt=p)) for p in prompts]
                    out[side] = [r.e2e_s * 1000 for r in replies]
                    out[side + "_prefill"] = [(r.timing or {}).get("prefill_ms") for r in replies]
                    out[side + "_cached"] = [(r.timing or {}).get("cached_prompt_tokens") for r in replies]
                    self.settle()
                return out

            one(-1)  # warm-up: the cache learns the context
            used, selection = self.select(self.repeat(one, plan.r_rounds, plan.r_rounds, plan.l_budget))
        finally:
            if not self.external:
                self.stop_server(server)
        result: dict[str, Any] = {
            "context_tokens": plan.r_context,
            "questions": plan.r_questions,
            "generated_tokens": plan.r_tokens,
            "selection": selection,
        }
        for side in sides:
            result[f"{side}_request_ms"] = summary([x for u in used for x in u[side]])
            prefill = [x for u in used for x in u[side + "_prefill"] if x is not None]
            cached = [x for u in used for x in u[side + "_cached"] if x is not None]
            if prefill:
                result[f"{side}_prefill_ms"] = summary(prefill)
            if cached:
                result[f"{side}_cached_prompt_tokens"] = summary(cached, 1)
        if "on" in sides:
            paired = [statistics.median(u["on"]) / statistics.median(u["off"]) for u in used]
            result["ratio"] = round(statistics.median(paired), 3)
            result["paired_ratio"] = summary(paired)
        return result

    # -- L: latency percentiles vs clients ----------------------------------------------------------------------
    def part_l(self) -> dict:
        plan, client = self.plan, self.main_client
        body = self.body(plan.l_tokens, stream=True)
        levels = []
        part_start = time.perf_counter()

        def level(clients: int, per_client: int) -> dict:
            closed_loop(client, lambda i, j: body, clients, 1)  # warm-up at this level
            snap = self.cpu.snapshot() if self.cpu else None
            replies, wall = closed_loop(client, lambda i, j: body, clients, per_client, plan.l_level_seconds)
            share = self.cpu.since(snap).get("foreign_cpu_share") if snap is not None else None
            queue = [r.timing["queue_ms"] for r in replies if r.timing and "queue_ms" in r.timing]
            return {
                "clients": clients,
                "requests": len(replies),
                "latency_ms": latency_summary([r.e2e_s * 1000 for r in replies]),
                "ttft_ms": latency_summary([r.ttft_s * 1000 for r in replies if r.ttft_s is not None]),
                "queue_ms": latency_summary(queue) if queue else None,
                "tokens_per_s": round(sum(r.tokens for r in replies) / wall, 2),
                "rejected": sum(r.rejected for r in replies),
                "foreign_cpu_share": share,
            }

        for clients in plan.l_levels:
            per_client = max(2 if not self.args.quick else 1, math.ceil(plan.l_requests / clients))
            result = level(clients, per_client)
            attempts = [result["foreign_cpu_share"]]
            # a level that other processes disturbed is run once more while the part is within its budget
            if (result["foreign_cpu_share"] or 0) > CLEAN_SHARE and time.perf_counter() - part_start < plan.l_budget:
                self.log(
                    f"  {clients:2d} clients: other processes used {result['foreign_cpu_share']:.0%} of the "
                    f"CPU; running the level again"
                )
                again = level(clients, per_client)
                attempts.append(again["foreign_cpu_share"])
                if (again["foreign_cpu_share"] or 0) < (result["foreign_cpu_share"] or 0):
                    result = again
            result["attempts_foreign_cpu_share"] = attempts
            levels.append(result)
            lat = result["latency_ms"]
            self.log(
                f"  {clients:2d} clients: p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms, "
                f"{result['tokens_per_s']:.1f} tok/s over {result['requests']} requests"
            )
        return {
            "prompt_tokens": plan.prompt_tokens,
            "generated_tokens": plan.l_tokens,
            "stream": True,
            "levels": levels,
        }

    # -- C: HTTP overhead on the tiny model ---------------------------------------------------------------------
    def part_c(self) -> dict:
        import torch

        plan = self.plan
        server = getattr(self, "_tiny_server", None)
        path = None
        if self.external:
            client, name = self.main_client, self.main_name
            prompt = self.args.prompt or TINY_PROMPT
        else:
            path = ensure_model(GPT2_TINY, self.cache_dir, self.log)
            self.models["tiny"] = self._model_meta(GPT2_TINY, path)
            if server is None:
                server = self.start_server(path, GPT2_TINY.name)
            client, name, prompt = Client(server.url), GPT2_TINY.name, TINY_PROMPT
        body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        try:
            model = ids = None
            if path is not None:
                model, tok = self.reference("tiny", path)
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
                self.settle()
                if model is not None:
                    this["fwd"] = [forward() for _ in range(plan.c_per_round)]
                    self.settle()
                return this

            used, selection = self.select(self.repeat(one, plan.c_rounds, plan.c_rounds, plan.c_budget))
            rtt = [x for u in used for x in u["rtt"]]
            fwd = [x for u in used for x in u["fwd"]]
            timings = [x for u in used for x in u["timings"]]
            if self.args.profile and server is not None:
                self.run_part("profile_C", lambda: self.profile(server, client, body, 300, "C"))
            result: dict[str, Any] = {"prompt": prompt, "selection": selection, "round_trip_ms": summary(rtt)}
            result["server_timing_ms"] = _timing_summary(timings, None)
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
                self.stop_server(server)
                self._tiny_server = None

    # -- E: engine efficiency at high concurrency (tiny model) ------------------------------------------------
    def part_e(self) -> dict:
        """Delivered tokens/s of ``clients`` closed-loop clients on the tests' tiny model, divided by what the
        model alone could deliver: ``clients`` rows / the in-process forward of a batch of that many rows (one
        token each, over a KV cache of the mean length a row has while decoding). The tiny model's forward is
        about as long as a GPU step of a 1B model, so E is the share of a step that is the model, not the engine."""
        plan = self.plan
        path = ensure_model(GPT2_TINY, self.cache_dir, self.log)
        self.models["tiny"] = self._model_meta(GPT2_TINY, path)
        top = max(plan.e_levels)
        model, tok = self.reference("tiny", path)
        base = prompt_ids(tok, plan.e_prompt_tokens)
        context = plan.e_prompt_tokens + plan.e_tokens // 2
        # the model's own step time, with no server running (its threads would disturb it); again at the end
        self.settle()
        forwards = {clients: batch_forward_ms(model, clients, context, reps=100) for clients in plan.e_levels}
        server = self.start_server(
            path,
            GPT2_TINY.name,
            extra_env={
                "SAKER_MAX_BATCH_SIZE": str(top),
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
                        snap = self.cpu.snapshot() if self.cpu else None
                        replies, wall = closed_loop(client, make_body(mode), clients, plan.e_per_client)
                        shares.append(self.cpu.since(snap).get("foreign_cpu_share") if snap is not None else None)
                        tokens = sum(r.tokens for r in replies)
                        if tokens != len(replies) * plan.e_tokens:
                            raise RuntimeError(
                                f"E {mode}: {tokens} tokens for {len(replies)} requests of {plan.e_tokens}"
                            )
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
            self.stop_server(server)
        self.settle()
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
                self.log(
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

    # -- S: structured outputs: constrained vs free decoding, grammar compile time -----------------------------
    def smol_path(self) -> Path:
        """The embedded SmolLM2, converted once into the bench's cache (as the server does into its own)."""
        from app.engine.loader import ensure_default_model
        from app.settings import Settings

        path = ensure_default_model(Settings(cache_dir=str(self.cache_dir)))
        if "smol" not in self.models:
            config = json.loads((path / "config.json").read_text())
            self.models["smol"] = {
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

    def part_s(self) -> dict:
        """Constrained JSON-schema decoding against the very same chat request unconstrained (``ignore_eos``, the
        same ``max_tokens``), side by side: delivered tokens/s of a closed loop of 1 and of 8 clients, the two
        sides alternating within each round. A third side, after the constrained one, sends the free request
        with ``max_tokens`` = the length of the constrained answer of the same seed: the same lengths, so the
        same pattern of prefills and of rows leaving the batch, and what is left of the difference is the
        grammar's. Then, in-process with SmolLM2's tokenizer, what a new schema costs (llguidance's tokenizer, a
        2 kB schema compiled fresh and cached, the first mask) and what each step costs a constrained row (the
        matcher's mask on the answers' tokens, the sampler's unpacking)."""
        plan = self.plan
        path = self.smol_path()
        server = None
        if self.external:
            client, name = self.main_client, self.main_name
        else:
            server = self.start_server(path, SMOL_NAME)
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
                elif not self.args.no_ignore_eos:
                    out["ignore_eos"] = True
                return out

            return body

        levels = ((1, plan.s_single_requests), (plan.s_clients, plan.s_per_client))
        chat = "/v1/chat/completions"
        texts: list[str] = []
        same = () if self.args.no_ignore_eos else ("same",)  # without ignore_eos lengths cannot be matched

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
                self.settle()
            return out

        result: dict[str, Any] = {
            "model": SMOL_NAME if not self.external else name,
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
                used, selection = self.select(
                    self.repeat(
                        lambda rep, c=clients, k=per_client: one(c, k, rep), plan.s_rounds, plan.s_rounds, plan.s_budget
                    )
                )
                result["levels"].append(self._s_level(clients, per_client, used, selection))
        finally:
            client.close()
            if server is not None:
                self.stop_server(server)
        result.update(self.s_compile(path, texts))
        return result

    def _s_level(self, clients: int, per_client: int, used: list[dict], selection: dict) -> dict:
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
        self.log(
            f"  S {clients} client(s): constrained {level['json']['tokens_per_s']['median']:g} tok/s "
            f"({level['json']['mean_completion_tokens']:g} tokens per answer), free "
            f"{level['free']['tokens_per_s']['median']:g} tok/s: ratio {ratio:.3f}"
            + (f"; free with the same lengths: {level['ratio_same_lengths']:.3f}" if "same" in level else "")
        )
        return level

    def s_compile(self, path: Path, texts: list[str]) -> dict:
        """In-process, SmolLM2's tokenizer: llguidance's tokenizer build, the 2 kB schema's compile with no cache
        (a fresh ``Grammars`` each repetition, as a new server sees it) and cached (the same again), a row's
        matcher copy and its first mask; then the per-step cost of a constrained row on the answers' tokens."""
        import torch
        from transformers import AutoTokenizer

        from app.engine.grammar import Grammars, allowed_tokens
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

        for rep in range(self.plan.s_compile_reps):
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
            if rep < self.plan.s_compile_reps - 1:
                del grammars
                gc.collect()
        out: dict[str, Any] = {
            "compile": {
                "schema_bytes": len(json.dumps(schema)),
                "vocab": vocab,
                "reps": self.plan.s_compile_reps,
                "tokenizer_build_ms": summary(lltok),
                "first_ms": summary(first),
                "cached_ms": summary(cached, 4),
                "row_matcher_ms": summary(row_ms, 4),
                "first_mask_ms": summary(first_mask),
                "new_schema_warm_ms": summary(other),
                "new_schema_warm_first_mask_ms": summary(other_mask),
            }
        }
        self.log(
            f"  S compile of a {len(json.dumps(schema))}-byte schema: tokenizer "
            f"{statistics.median(lltok):.0f} ms (once per model), first {statistics.median(first):.2f} ms, "
            f"cached {statistics.median(cached) * 1000:.1f} us"
        )
        # per step: the matcher's mask for the next token (the grammar thread's work, overlapping the forward)
        # and the sampler's unpacking of 1 and 8 rows' masks into the scores (on the model thread)
        request = grammars
        s_constraint = json_constraint(S_SCHEMA)
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
        for rows in sorted({1, self.plan.s_clients}):
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

    # -- D: GPU decode vs the bandwidth floor ---------------------------------------------------------------
    def part_d(self) -> dict:
        import torch

        plan = self.plan
        device = self.args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"--device {device} but no CUDA GPU is visible")
        spec = LLAMA_SMALL if self.args.quick else LLAMA_1B
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        path = ensure_model(spec, self.cache_dir, self.log, device=device)
        self.models["gpu"] = self._model_meta(spec, path)
        model, tok = self.reference("gpu", path, dtype, device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bandwidth = copy_bandwidth(device, (256 if self.args.quick else 1024) * 2**20)
        floor_ms = weight_bytes / bandwidth * 1000
        ids = prompt_ids(tok, plan.prompt_tokens)
        server = self.start_server(path, spec.name, device=device, dtype=dtype)
        client = Client(server.url)
        body = {"model": spec.name, "prompt": ids, "max_tokens": plan.d_tokens, "temperature": 0, "ignore_eos": True}
        try:
            for _ in range(plan.warmup):
                client.complete(body)
            decode, e2e, gen = [], [], []
            t_ids = torch.tensor([ids], device=device)
            for _ in range(plan.d_reps):
                reply = client.complete(body)
                timing = reply.timing or {}
                if "decode_ms" in timing and reply.tokens > 1:
                    decode.append(timing["decode_ms"] / (reply.tokens - 1))  # the first token comes from prefill
                e2e.append(reply.e2e_s * 1000 / reply.tokens)
                self.settle()
                with torch.inference_mode():
                    _sync(device)
                    start = time.perf_counter()
                    model.generate(
                        t_ids,
                        attention_mask=torch.ones_like(t_ids),
                        max_new_tokens=plan.d_tokens,
                        min_new_tokens=plan.d_tokens,
                        do_sample=False,
                        pad_token_id=tok.eos_token_id,
                    )
                    _sync(device)
                    gen.append((time.perf_counter() - start) * 1000 / plan.d_tokens)
                self.settle()
        finally:
            client.close()
            self.stop_server(server)
        result = {
            "device": device_name(device),
            "dtype": dtype,
            "parameters": parameter_count(model),
            "weight_bytes": weight_bytes,
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "floor_ms_per_token": round(floor_ms, 3),
            "generated_tokens": plan.d_tokens,
            "server_e2e_ms_per_token": summary(e2e),
            "generate_ms_per_token": summary(gen),
        }
        if decode:
            ratio = statistics.median(decode) / floor_ms
            result.update(
                {
                    "server_decode_ms_per_token": summary(decode),
                    "ratio": round(ratio, 3),
                    "goal": GOALS["D"][1],
                    "met": check_goal("D", ratio),
                }
            )
        self._refs.pop("gpu", None)
        return result

    # -- where the server's time goes (py-spy) ----------------------------------------------------------------
    def profile(self, server: Server, client: Client, body: dict, reps: int, label: str) -> dict:
        """py-spy on the gunicorn worker while ``reps`` requests run (after the measurements, never during)."""
        import shutil

        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(py_spy).exists():
            raise RuntimeError("py-spy is not installed (pip install -r requirements-bench.txt)")
        pids = server.worker_pids()
        if not pids:
            raise RuntimeError("no gunicorn worker found")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f"profile-{label}.txt"
        proc = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pids[0]),
                "--rate",
                "250",
                "--format",
                "raw",
                "--output",
                str(raw),
                "--nonblocking",
                "--threads",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)
        try:
            for _ in range(reps):
                client.complete(body)
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        if not raw.is_file():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
        result = summarize_profile(raw)
        result["requests"] = reps
        cats = ", ".join(f"{k} {v:.0%}" for k, v in result["categories"].items())
        self.log(f"profile {label}: {cats}")
        return result


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _timing_summary(timings: list[dict], tokens: int | None) -> dict:
    out = {}
    for key in ("queue_ms", "prefill_ms", "decode_ms"):
        values = [t[key] for t in timings if key in t]
        if values:
            out[key] = summary(values)
    if tokens and "decode_ms" in out:
        out["decode_ms_per_token"] = round(out["decode_ms"]["median"] / max(tokens - 1, 1), 3)
    return out


def summarize_profile(raw: Path, top: int = 20) -> dict:
    """py-spy's collapsed stacks (``--threads``) -> where the worker's time goes: shares per thread and per
    category (model forward in torch modules / engine Python around it / HTTP and JSON / other), and the busiest
    lines of the thread that runs the model. Line shares inside the forward are indicative only: a sampled Python
    line stands for whatever native work it started (the torch profiler splits the forward by operator)."""
    threads: dict[str, int] = {}
    categories = {
        "model forward (torch modules)": 0,
        "engine Python (sampling, detokenize, stops, cache)": 0,
        "HTTP, Flask, JSON, protocol": 0,
        "other": 0,
    }
    stacks: list[tuple[str, list[str], int]] = []
    forward_by_thread: dict[str, int] = {}
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread (") else "?"
        body = frames[1:] if frames[0].startswith("thread (") else frames
        threads[thread] = threads.get(thread, 0) + n
        samples += n
        stacks.append((thread, body, n))
        if any("Module._call_impl" in f for f in body):
            categories["model forward (torch modules)"] += n
            forward_by_thread[thread] = forward_by_thread.get(thread, 0) + n
        elif any("app/engine/" in f for f in body):
            categories["engine Python (sampling, detokenize, stops, cache)"] += n
        elif any(
            k in f
            for f in body
            for k in ("flask/", "werkzeug/", "gunicorn/", "app/api.py", "app/service.py", "app/protocol.py", "json/")
        ):
            categories["HTTP, Flask, JSON, protocol"] += n
        else:
            categories["other"] += n
    model_thread = max(forward_by_thread, key=forward_by_thread.get) if forward_by_thread else None
    inclusive: dict[str, int] = {}
    self_time: dict[str, int] = {}
    model_samples = 0
    for thread, body, n in stacks:
        if thread != model_thread or not body:
            continue
        model_samples += n
        for frame in set(body):
            inclusive[frame] = inclusive.get(frame, 0) + n
        self_time[body[-1]] = self_time.get(body[-1], 0) + n

    def ranked(table: dict[str, int], total: int) -> list[dict]:
        return (
            [{"frame": f, "share": round(c / total, 3)} for f, c in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
            if total
            else []
        )

    return {
        "raw": raw.name,
        "samples": samples,
        "model_thread": model_thread,
        "threads": {k: round(v / samples, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])}
        if samples
        else {},
        "categories": {k: round(v / samples, 3) for k, v in categories.items()} if samples else {},
        "model_thread_inclusive": ranked(inclusive, model_samples),
        "model_thread_self": ranked(self_time, model_samples),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, nbytes: int, reps: int = 20) -> float:
    """Bytes per second moved by a device-to-device copy (each copy reads and writes ``nbytes``)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class CpuMonitor:
    """How much of the machine's CPU went to processes other than the bench and its servers: the honest noise
    figure of a run on a shared machine. Ours = this process and its descendants (reaped children count through
    their parents' cutime/cstime); busy = /proc/stat's non-idle time. Steal is the hypervisor's share."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.cores = os.cpu_count() or 1

    @staticmethod
    def _system() -> tuple[int, int]:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return user + nice + system + irq + softirq, steal

    def _ours(self) -> int:
        stats: dict[int, tuple[int, int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "stat").read_text()
            except OSError:
                continue
            rest = raw[raw.rindex(")") + 2 :].split()
            # fields after the name: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based from pid
            stats[int(entry.name)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        total, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in stats:
                total += stats[pid][1]
            todo.extend(children.get(pid, []))
        return total

    def snapshot(self) -> tuple[float, int, int, int]:
        busy, steal = self._system()
        return time.perf_counter(), busy, steal, self._ours()

    def since(self, snap: tuple[float, int, int, int]) -> dict:
        now = self.snapshot()
        capacity = (now[0] - snap[0]) * self.cores * self.tick
        if capacity <= 0:
            return {}
        foreign = max(0, (now[1] - snap[1]) - (now[3] - snap[3]))
        # clock ticks are coarse (1/CLK_TCK s): in a short window one stray tick reads as a large share
        share = foreign / capacity if foreign >= 3 else 0.0
        return {
            "foreign_cpu_share": round(min(1.0, share), 3),
            "steal_share": round((now[2] - snap[2]) / capacity, 3),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }

    def available(self) -> bool:
        try:
            self.snapshot()
            return True
        except (OSError, ValueError, IndexError):
            return False


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    info = {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(OSError, ValueError):
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# ---------------------------------------------------------------------------------------------------------------
# report: table, JSON, plot
# ---------------------------------------------------------------------------------------------------------------
def _spread(s: dict | None) -> str:
    if not s or not s.get("n"):
        return ""
    return f"IQR {s['p25']:g}-{s['p75']:g}, range {s['min']:g}-{s['max']:g}, n={s['n']}"


def _met(value: bool | None) -> str:
    return {True: "met", False: "NOT met", None: ""}[value]


def table_rows(report: dict) -> list[tuple[str, str, str, str, str]]:
    """(part, measure, median, spread, goal/result) rows."""
    r = report["results"]
    rows: list[tuple[str, str, str, str, str]] = []

    def med(s: dict | None) -> str:
        return f"{s['median']:g}" if s and s.get("n") else "-"

    if "A" in r:
        a = r["A"]
        rows.append(
            (
                "A",
                f"server ms/token (HTTP, {a['generated_tokens']} tokens)",
                med(a["server_ms_per_token"]),
                _spread(a["server_ms_per_token"]),
                "",
            )
        )
        if "ratio" in a:
            rows.append(
                (
                    "A",
                    "generate() ms/token (in-process)",
                    med(a["generate_ms_per_token"]),
                    _spread(a["generate_ms_per_token"]),
                    "",
                )
            )
            rows.append(
                (
                    "A",
                    "ratio server / generate() (median of pairs)",
                    f"{a['ratio']:g}",
                    _spread(a["paired_ratio"]) + f"; ratio of medians {a['ratio_of_medians']:g}",
                    f"<= {a['goal']:g}: {_met(a['met'])}",
                )
            )
    if "B" in r:
        b = r["B"]
        rows.append(("B", "1 client tokens/s", med(b["single_tokens_per_s"]), _spread(b["single_tokens_per_s"]), ""))
        rows.append(
            (
                "B",
                f"{b['clients']} clients tokens/s",
                med(b["multi_tokens_per_s"]),
                _spread(b["multi_tokens_per_s"]),
                "",
            )
        )
        rows.append(
            (
                "B",
                f"ratio {b['clients']} / 1 (median of rounds)",
                f"{b['ratio']:g}",
                _spread(b["paired_ratio"]) + f"; ratio of medians {b['ratio_of_medians']:g}",
                f">= {b['goal']:g}: {_met(b['met'])}",
            )
        )
    if "C" in r:
        c = r["C"]
        rows.append(("C", "round trip ms (max_tokens 1)", med(c["round_trip_ms"]), _spread(c["round_trip_ms"]), ""))
        if "overhead_ms" in c:
            rows.append(("C", "in-process forward ms", med(c["forward_ms"]), _spread(c["forward_ms"]), ""))
            rows.append(
                (
                    "C",
                    "overhead ms (round trip - forward)",
                    f"{c['overhead_ms']:g}",
                    "",
                    f"<= {c['goal']:g}: {_met(c['met'])}",
                )
            )
    if "T" in r:
        t = r["T"]
        rows.append(("T", "time to first token ms (stream)", med(t["ttft_ms"]), _spread(t["ttft_ms"]), ""))
        if "server_prefill_ms" in t:
            rows.append(("T", "server prefill_ms", med(t["server_prefill_ms"]), _spread(t["server_prefill_ms"]), ""))
            rows.append(
                ("T", "TTFT - prefill ms", med(t["ttft_minus_prefill_ms"]), _spread(t["ttft_minus_prefill_ms"]), "")
            )
        if "in_process_forward_ms" in t:
            rows.append(
                (
                    "T",
                    "in-process prompt forward ms",
                    med(t["in_process_forward_ms"]),
                    _spread(t["in_process_forward_ms"]),
                    "",
                )
            )
    if "L" in r:
        for level in r["L"]["levels"]:
            lat, ttft = level["latency_ms"], level["ttft_ms"]
            rows.append(
                (
                    "L",
                    f"{level['clients']:2d} clients latency p50/p90/p99 ms",
                    f"{lat['p50']:g}/{lat['p90']:g}/{lat['p99']:g}",
                    f"TTFT p50/p99 {ttft['p50']:g}/{ttft['p99']:g}, {level['tokens_per_s']:g} tok/s, "
                    f"n={level['requests']}"
                    + (f", {level['rejected']} rejected (429/503)" if level.get("rejected") else ""),
                    "",
                )
            )
    if "E" in r:
        e = r["E"]
        for level in e["levels"]:
            for mode in E_MODES:
                m = level[mode]
                goal = ""
                if level["clients"] == 32 and e.get(f"met_{mode}") is not None:
                    goal = f">= {e[f'goal_{mode}']:g}: {_met(e[f'met_{mode}'])}"
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
    if "S" in r:
        sp = r["S"]
        for level in sp["levels"]:
            clients = f"{level['clients']} client" + ("s" if level["clients"] > 1 else "")
            for side, label in (("json", "constrained (JSON schema)"), ("free", "free (ignore_eos)")):
                m = level[side]
                rows.append(
                    (
                        "S",
                        f"{clients}: {label} tokens/s",
                        med(m["tokens_per_s"]),
                        _spread(m["tokens_per_s"]) + f"; {m['mean_completion_tokens']:g} tokens per answer, decode "
                        f"{med(m['decode_ms_per_token'])} ms/token",
                        "",
                    )
                )
            goal = f">= {level['goal']:g}: {_met(level['met'])}" if level.get("met") is not None else ""
            step = f"; server decode steps {level['decode_step_ratio']:g}" if "decode_step_ratio" in level else ""
            rows.append(
                (
                    "S",
                    f"{clients}: ratio constrained / free (median of rounds)",
                    f"{level['ratio']:g}",
                    _spread(level["paired_ratio"]) + step,
                    goal,
                )
            )
            if "same" in level:
                rows.append(
                    (
                        "S",
                        f"{clients}: ratio constrained / free with the same lengths",
                        f"{level['ratio_same_lengths']:g}",
                        _spread(level["paired_ratio_same_lengths"]) + f"; {med(level['same']['tokens_per_s'])} tok/s",
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
                    _spread(c["tokenizer_build_ms"]) + f"; vocabulary {c['vocab']}",
                    "",
                )
            )
            rows.append(
                (
                    "S",
                    f"compile ms, {c['schema_bytes']}-byte schema: first",
                    med(c["first_ms"]),
                    _spread(c["first_ms"]) + f"; its first mask {med(c['first_mask_ms'])} ms; a new schema "
                    f"on a warm tokenizer {med(c.get('new_schema_warm_ms'))} ms",
                    "",
                )
            )
            rows.append(
                (
                    "S",
                    "compile ms, the same schema again (cached)",
                    med(c["cached_ms"]),
                    _spread(c["cached_ms"]) + f"; a row's matcher copy {med(c['row_matcher_ms'])} ms",
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
                    _spread(ps["mask_us"]) + f"; sampler's unpacking: {unpack}",
                    "",
                )
            )
    if "R" in r:
        p = r["R"]
        for side, label in (("on", "prefix cache on"), ("off", "prefix cache off")):
            if f"{side}_request_ms" in p:
                cached = p.get(f"{side}_cached_prompt_tokens", {}).get("median")
                rows.append(
                    (
                        "R",
                        f"{label}: request ms ({p['context_tokens']}-token shared context)",
                        med(p[f"{side}_request_ms"]),
                        _spread(p[f"{side}_request_ms"])
                        + (f"; prefill {p[f'{side}_prefill_ms']['median']:g} ms" if f"{side}_prefill_ms" in p else "")
                        + (f", {cached:g} cached prompt tokens" if cached is not None else ""),
                        "",
                    )
                )
        if "ratio" in p:
            rows.append(("R", "ratio on / off (median of rounds)", f"{p['ratio']:g}", _spread(p["paired_ratio"]), ""))
    if "D" in r:
        d = r["D"]
        rows.append(
            (
                "D",
                f"bandwidth floor ms/token ({d['device']})",
                f"{d['floor_ms_per_token']:g}",
                f"{d['weight_bytes'] / 1e9:.2f} GB at {d['copy_bandwidth_gb_s']:g} GB/s",
                "",
            )
        )
        if "ratio" in d:
            rows.append(
                (
                    "D",
                    "server decode ms/token",
                    med(d["server_decode_ms_per_token"]),
                    _spread(d["server_decode_ms_per_token"]),
                    "",
                )
            )
            rows.append(("D", "ratio decode / floor", f"{d['ratio']:g}", "", f"<= {d['goal']:g}: {_met(d['met'])}"))
        rows.append(
            (
                "D",
                "generate() ms/token (in-process)",
                med(d["generate_ms_per_token"]),
                _spread(d["generate_ms_per_token"]),
                "",
            )
        )
    for label in ("A", "C"):
        prof = r.get(f"profile_{label}")
        if prof and prof.get("categories"):
            cats = prof["categories"]
            rows.append(
                (
                    f"P{label}",
                    f"where the worker's time goes in {label} (py-spy)",
                    f"forward {cats['model forward (torch modules)']:.0%}",
                    f"engine Python {cats['engine Python (sampling, detokenize, stops, cache)']:.0%}, "
                    f"HTTP/JSON {cats['HTTP, Flask, JSON, protocol']:.0%}, other {cats['other']:.0%}, "
                    f"{prof['samples']} samples",
                    "",
                )
            )
    for part, message in report["errors"].items():
        rows.append((part, "FAILED", "-", message[:100], ""))
    return rows


def format_table(report: dict) -> str:
    header = ("part", "measure", "median", "spread", "goal")
    rows = [header] + table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    lines = ["| part | measure | median | spread | goal |", "|---|---|---|---|---|"]
    for row in table_rows(report):
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    return "\n".join(lines)


def _bars(ax, names: list[str], series: list[dict], colors: list[str], low: str = "min", high: str = "max") -> None:
    """Medians as bars, with error bars from ``low`` to ``high`` of each summary."""
    meds = [s["median"] for s in series]
    errs = [[s["median"] - s[low] for s in series], [s[high] - s["median"] for s in series]]
    ax.bar(names, meds, yerr=errs, capsize=6, color=colors[: len(names)])


def plot(report: dict, path: Path) -> bool:
    """Latency percentiles vs clients, tokens/s vs clients, A's two sides, TTFT vs prefill (what ran)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    r = report["results"]
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    panels = [p for p in ("L", "Lt", "A", "T", "C", "S", "D") if (p[0] in r)]
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(5.0 * cols, 7.0), 4.2 * rows + 0.6), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(flat, panels, strict=False):
        if panel == "L":
            levels = r["L"]["levels"]
            xs = [lv["clients"] for lv in levels]
            for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                ax.plot(xs, [lv["latency_ms"][key] for lv in levels], style, label=f"request {key}")
            ax.plot(xs, [lv["ttft_ms"]["p50"] for lv in levels], "x-", color="grey", label="first token p50")
            ax.plot(xs, [lv["ttft_ms"]["p99"] for lv in levels], "x:", color="grey", label="first token p99")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("ms")
            ax.set_title(f"L: latency ({r['L']['generated_tokens']} tokens, streamed)")
            ax.legend(fontsize=7)
        elif panel == "Lt":
            levels = r["L"]["levels"]
            xs = [lv["clients"] for lv in levels]
            ax.plot(xs, [lv["tokens_per_s"] for lv in levels], "o-", label="aggregate tokens/s")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("generated tokens / s")
            title = "throughput vs clients"
            if "B" in r:
                title += f" (B: 8/1 = {r['B']['ratio']:g})"
            ax.set_title(title)
        elif panel == "A":
            a = r["A"]
            names = ["server (HTTP)"]
            series = [a["server_ms_per_token"]]
            if "generate_ms_per_token" in a:
                names.append("generate()")
                series.append(a["generate_ms_per_token"])
            _bars(ax, names, series, ["tab:blue", "tab:orange"])
            ax.set_ylabel("ms per generated token (median, min-max)")
            ax.set_title(f"A: ratio {a.get('ratio', '-')} (goal <= {GOALS['A'][1]})")
        elif panel == "T":
            t = r["T"]
            names, series = ["TTFT (stream)"], [t["ttft_ms"]]
            if "server_prefill_ms" in t:
                names.append("server prefill")
                series.append(t["server_prefill_ms"])
            if "in_process_forward_ms" in t:
                names.append("in-process forward")
                series.append(t["in_process_forward_ms"])
            _bars(ax, names, series, ["tab:green", "tab:purple", "tab:orange"])
            ax.set_ylabel("ms (median, min-max)")
            ax.set_title(f"T: first token vs prefill ({t['prompt_tokens']}-token prompt)")
            ax.tick_params(axis="x", labelsize=8)
        elif panel == "C":
            c = r["C"]
            names, series = ["HTTP round trip"], [c["round_trip_ms"]]
            if "forward_ms" in c:
                names.append("in-process forward")
                series.append(c["forward_ms"])
            _bars(ax, names, series, ["tab:blue", "tab:orange"], low="p25", high="p75")
            ax.set_ylabel("ms (median, IQR)")
            title = "C: tiny model, max_tokens 1"
            if "overhead_ms" in c:
                title += f": overhead {c['overhead_ms']:g} ms (goal <= {GOALS['C'][1]:g})"
            ax.set_title(title, fontsize=9)
        elif panel == "S":
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
            ax.set_xticks(
                xs, [f"{lv['clients']} client{'s' if lv['clients'] > 1 else ''}: {lv['ratio']:g}" for lv in levels]
            )
            ax.set_ylabel("generated tokens / s (median, min-max)")
            ax.set_title(f"S: constrained / free (goal >= {GOALS['S 1 client'][1]:g})", fontsize=9)
            ax.legend(fontsize=7)
        elif panel == "D":
            d = r["D"]
            floor = d["floor_ms_per_token"]
            names, series = ["bandwidth floor"], [{"median": floor, "min": floor, "max": floor}]
            for label, key in (
                ("server decode", "server_decode_ms_per_token"),
                ("generate()", "generate_ms_per_token"),
            ):
                if d.get(key, {}).get("n"):
                    names.append(label)
                    series.append(d[key])
            _bars(ax, names, series, ["grey", "tab:blue", "tab:orange"])
            ax.set_ylabel("ms per token")
            ax.set_title(f"D: {d['device']}, ratio {d.get('ratio', '-')} (goal <= {GOALS['D'][1]})", fontsize=9)
    machine = report["machine"]
    fig.suptitle(
        f"saker bench {report['started']}"
        + (" (quick)" if report["quick"] else "")
        + f"\n{machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def parse_parts(args: argparse.Namespace) -> tuple[str, ...]:
    if args.only:
        parts = [p.strip().upper() for p in args.only.split(",") if p.strip()]
        unknown = [p for p in parts if p not in ALL_PARTS]
        if unknown:
            raise SystemExit(f"saker bench: unknown part(s) {', '.join(unknown)}; choose from {', '.join(ALL_PARTS)}")
        return tuple(p for p in ALL_PARTS if p in parts)
    return DEFAULT_PARTS + (("D",) if args.gpu else ())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only",
        metavar="PARTS",
        help="comma-separated parts to run: A,B,C,T,L,R,E,S,D (default A,B,C,T,L,R,E,S; D with --gpu)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of about a minute: fewer repetitions, "
        "fewer tokens (numbers are not comparable with a full run)",
    )
    parser.add_argument(
        "--size",
        choices=("small", "tiny"),
        default="small",
        help="model for A/B/T/L: small = GPT-2-small shape (the suite's definition), tiny = the "
        "tests' 2-layer model (smoke runs)",
    )
    parser.add_argument(
        "--url",
        help="benchmark this running OpenAI-compatible server instead of starting ours "
        "(base URL, with or without /v1); only HTTP-side measurements run",
    )
    parser.add_argument("--model", help="with --url: the model name to request (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="with --url: sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--prompt", help="with --url: the prompt text (default: a ~64-token English paragraph)")
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject the vLLM extension; generations may then end early)",
    )
    parser.add_argument("--gpu", action="store_true", help="also run D (needs a CUDA GPU)")
    parser.add_argument("--device", default="cuda", help="device for part D (default cuda); A-C run on the CPU")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in the bench process and the "
        "server (OMP_NUM_THREADS); default: torch's default on this machine",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="passed to our server as SAKER_MAX_BATCH_SIZE (when that setting exists)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment for our server, e.g. SAKER_COMPILE=1 (repeatable)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after A and C, record the server with py-spy "
        "for some more requests and summarize where its time goes (profile-A.txt, profile-C.txt)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="first wait up to this "
        "long for other processes to leave the CPU alone (a shared machine makes timings noisy)",
    )
    parser.add_argument(
        "--out-dir", default=str(DEFAULT_OUT), help="where bench.json and bench.png go (default docs/performance)"
    )
    parser.add_argument("--name", default=None, help="file name stem (default: bench, or external with --url)")
    parser.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help="where generated models are kept (default .cache/bench)"
    )


def main(args: argparse.Namespace) -> int:
    import torch

    if args.threads is None:
        args.threads = torch.get_num_threads()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bench = Bench(args)
    interrupted = False
    try:
        report = bench.run()
    except KeyboardInterrupt:
        interrupted = True
        for server in list(bench.servers):
            bench.stop_server(server)
        raise
    finally:
        if interrupted:
            print("saker bench: interrupted", file=sys.stderr)
    stem = args.name or ("external" if args.url else "bench")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    png_path = out_dir / f"{stem}.png"
    report["table_markdown"] = markdown_table(report)
    json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    drew = plot(report, png_path)
    print(format_table(report))
    print(f"\nwrote {json_path}" + (f" and {png_path}" if drew else " (no plot: pip install matplotlib)"))
    return 1 if report["errors"] else 0
