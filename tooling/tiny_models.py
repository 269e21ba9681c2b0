"""Tiny models with real tokenizers, built offline in seconds (no hub): the tests' fixtures and the bench build
their models here. Deterministic: the tokenizers are trained on fixed text, the weights drawn after
``torch.manual_seed(seed)``.

- ``build_gpt2(path)``: GPT-2 (2 layers, 64 wide) with a byte-level BPE of 400 tokens trained by ``tokenizers``.
- ``build_llama(path)``: Llama (2 layers, 64 wide) with a sentencepiece BPE (byte fallback, so CJK and emoji span
  tokens) and a small chat template.
- The pieces, for other shapes: ``train_byte_level_bpe``, ``train_sentencepiece``, ``gpt2_model`` /
  ``llama_model`` (random weights for a tokenizer, not saved: a caller may edit them), ``save_gpt2`` /
  ``save_llama``, ``copy_tokenizer``.

Imports torch, transformers, tokenizers and sentencepiece when called, never at import time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small model that liked to count: one two three four five.",
    "Hello world! Hello there, general Kenobi. The quick brown fox jumps over the lazy dog.",
    "Passage: The bedroom is north of the garden. Question: How do you go from the bathroom to the office?",
    "Answer: east east\n\nAnswer: north north\n\nAnswer: south west\n",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 and symbols ! ? , . ; : ' \" ( ) [ ] { } - + * / = < >",
    "Café naïve résumé façade — “quotes” and ‘apostrophes’ … ellipsis",
]
# Rare characters: they stay out of the sentencepiece vocabulary and fall back to bytes.
RARE = "東京は日本の首都です。 🙂🚀 Ελληνικά ქართული"
END = "<|endoftext|>"
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def corpus_lines() -> list[str]:
    """The text the tiny tokenizers are trained on."""
    return CORPUS * 20 + [RARE]


def train_byte_level_bpe(path: Path, texts: Sequence[str], vocab_size: int = 400):
    """A GPT-2 style tokenizer (byte-level BPE, ``<|endoftext|>`` as BOS, EOS and UNK, no BOS added) trained on
    ``texts`` and saved in ``path``; returns it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        list(texts), vocab_size=vocab_size, min_frequency=2, special_tokens=[END], show_progress=False
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(path))
    tok = GPT2TokenizerFast.from_pretrained(str(path), bos_token=END, eos_token=END, unk_token=END, add_bos_token=False)
    tok.save_pretrained(path)
    return tok


def train_sentencepiece(
    path: Path, texts: Sequence[str], vocab_size: int = 420, chat_template: str | None = LLAMA_CHAT_TEMPLATE
):
    """A Llama tokenizer (sentencepiece BPE with byte fallback; ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2; BOS added)
    trained on ``texts`` and saved in ``path``; returns it."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text_file = path / "corpus.txt"
    text_file.write_text("\n".join(texts), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text_file),
        model_prefix=str(path / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.99,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        add_dummy_prefix=True,
        minloglevel=2,
    )
    text_file.unlink()
    (path / "tokenizer.vocab").unlink()
    config: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 256,
        "legacy": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.save_pretrained(path)
    return tok


def copy_tokenizer(source: Path, target: Path) -> None:
    """The tokenizer files of a model folder into another (created when missing)."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, target / name)


def gpt2_model(
    tok,
    *,
    positions: int = 256,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    initializer_range: float = 0.2,
    seed: int = 0,
    **config: Any,
):
    """A GPT-2 with random weights (drawn after ``torch.manual_seed(seed)``) for ``tok``: its vocabulary, its EOS
    as BOS and EOS. ``config``: more GPT2Config fields."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    gpt2_config = GPT2Config(
        vocab_size=len(tok),
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=initializer_range,
        **config,
    )
    return GPT2LMHeadModel(gpt2_config).eval()


def llama_model(
    tok,
    *,
    width: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    positions: int = 256,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    kind: str = "llama",
    device: str = "cpu",
    **config: Any,
):
    """A Llama (or, with ``kind="mistral"`` or ``"qwen2"``, a Mistral or a Qwen2) with random weights (drawn after
    ``torch.manual_seed(seed)``, on ``device``) for ``tok``: its vocabulary, BOS and EOS. ``config``: more
    config fields (``rope_theta``, ``sliding_window``, ``dtype``, ...)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    config.setdefault("bos_token_id", tok.bos_token_id)
    config.setdefault("eos_token_id", tok.eos_token_id)
    torch.manual_seed(seed)
    model_config = config_class(
        vocab_size=len(tok),
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        **config,
    )
    with torch.device(device):
        return model_class(model_config).eval()


def save_gpt2(path: Path, tok, **shape: Any) -> Path:
    """``gpt2_model(tok, **shape)`` and ``tok`` saved in ``path``."""
    path = Path(path)
    tok.save_pretrained(path)
    gpt2_model(tok, **shape).save_pretrained(path)
    return path


def save_llama(path: Path, tok, **shape: Any) -> Path:
    """``llama_model(tok, **shape)`` and ``tok`` saved in ``path``."""
    path = Path(path)
    tok.save_pretrained(path)
    llama_model(tok, **shape).save_pretrained(path)
    return path


def build_gpt2(path: Path) -> Path:
    """The tests' tiny GPT-2: 2 layers, 64 wide, 256 positions, a 400-token byte-level BPE."""
    tok = train_byte_level_bpe(path, corpus_lines(), 400)
    model = gpt2_model(tok)
    model.save_pretrained(path)
    return Path(path)


def build_llama(path: Path) -> Path:
    """The tests' tiny Llama: 2 layers, 64 wide (2 KV heads), 256 positions, a 420-token sentencepiece BPE."""
    tok = train_sentencepiece(path, corpus_lines(), 420)
    model = llama_model(tok)
    model.save_pretrained(path)
    return Path(path)
