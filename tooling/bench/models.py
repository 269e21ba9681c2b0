"""The models the bench runs, built offline once into ``--cache-dir``: a GPT-2-small-shaped model (A, B, T, L, R),
the tests' tiny GPT-2 (C, E) and a 1B-class Llama (D), all with random weights (seed 0: cost does not depend on the
weights) and byte-level BPEs trained here in seconds; and the in-process side of the comparisons (the same folder
loaded with transformers)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MODEL_VERSION = 1  # bump when the generated models change shape, so cached ones are rebuilt

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
    """A byte-level BPE (``tooling.tiny_models``) that also knows the bench's prompts."""
    from tooling.tiny_models import train_byte_level_bpe

    return train_byte_level_bpe(path, texts + [PROMPT_TEXT, TINY_PROMPT], vocab)


def ensure_model(spec: ModelSpec, cache_dir: Path, log: Callable[[str], None], device: str = "cpu") -> Path:
    """Build ``spec`` once (tokenizer trained in seconds, random weights, seed 0, by ``tooling.tiny_models``); later
    runs reuse the folder."""
    target = cache_dir / spec.dir_name
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import shutil

    import torch

    from tooling.tiny_models import gpt2_model, llama_model

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
        if spec.kind == "gpt2":
            model = gpt2_model(
                tok,
                positions=spec.positions,
                width=spec.width,
                layers=spec.layers,
                heads=spec.heads,
                initializer_range=0.2 if spec.width <= 64 else 0.02,
            )
        else:
            model = llama_model(
                tok,
                width=spec.width,
                intermediate=spec.intermediate,
                layers=spec.layers,
                heads=spec.heads,
                kv_heads=spec.kv_heads,
                positions=spec.positions,
                initializer_range=0.02,
                tie_word_embeddings=True,
                device=device if device.startswith("cuda") else "cpu",
                rope_theta=500000.0,
                bos_token_id=tok.eos_token_id,
                eos_token_id=tok.eos_token_id,
                dtype="bfloat16",
            ).to(torch.bfloat16)
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


def model_meta(spec: ModelSpec, path: Path) -> dict:
    """What bench.json records of a generated model."""
    import json

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


def model_or_1b(model: str | None, device: str) -> Path:
    """The GPU scripts' model (scripts/gpu): the folder ``model`` names, or else the bench's 1B Llama shape (built once
    into .cache/bench, as part D builds it)."""
    if model is not None:
        return Path(model)
    return ensure_model(LLAMA_1B, Path(".cache/bench"), print, device=device)
