"""Session fixtures: tiny models built offline in seconds, apps and clients over them.

- ``gpt2_dir``: GPT-2 (2 layers) with a byte-level BPE trained by ``tokenizers``.
- ``llama_dir``: Llama (2 layers) with a sentencepiece BPE (byte_fallback) so CJK/emoji span tokens.
- ``smollm2_dir``: the embedded default model, converted once into a session cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def _corpus_lines() -> list[str]:
    return CORPUS * 20 + [RARE]


def build_gpt2(path: Path) -> Path:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus_lines(), vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    path.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(path))
    tok = GPT2TokenizerFast.from_pretrained(
        str(path), bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>", add_bos_token=False
    )
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.2,
    )
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    return path


def build_llama(path: Path) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    text_file = path / "corpus.txt"
    text_file.write_text("\n".join(_corpus_lines()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text_file),
        model_prefix=str(path / "tokenizer"),
        vocab_size=420,
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
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 256,
                "legacy": False,
                "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
            }
        )
    )
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def gpt2_dir(models_root) -> Path:
    return build_gpt2(models_root / "tiny-gpt2")


@pytest.fixture(scope="session")
def llama_dir(models_root) -> Path:
    return build_llama(models_root / "tiny-llama")


@pytest.fixture(scope="session")
def saker_cache() -> Path:
    """Where the embedded SmolLM2 is converted: kept across runs in the repo's ignored .cache/."""
    path = Path(__file__).resolve().parent.parent / ".cache" / "saker"
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_settings(**values):
    from app.settings import Settings

    return Settings(**values)


def make_worker(settings):
    from app.engine.loader import load_model
    from app.engine.worker import Worker

    return Worker.from_loaded(tuple(settings.model_names), load_model(settings))


@pytest.fixture(scope="session")
def gpt2_worker(gpt2_dir):
    return make_worker(make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2"))


@pytest.fixture(scope="session")
def llama_worker(llama_dir):
    return make_worker(make_settings(model=str(llama_dir), served_model_name="tiny-llama"))


def _app(settings, worker):
    from app import create_app

    app = create_app(settings, engine=worker)
    app.config["TESTING"] = True
    return app


@pytest.fixture(scope="session")
def gpt2_app(gpt2_dir, gpt2_worker):
    return _app(make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2,gpt2-alias"), gpt2_worker)


@pytest.fixture(scope="session")
def llama_app(llama_dir, llama_worker):
    return _app(make_settings(model=str(llama_dir), served_model_name="tiny-llama"), llama_worker)


@pytest.fixture()
def gpt2_client(gpt2_app):
    return gpt2_app.test_client()


@pytest.fixture()
def llama_client(llama_app):
    return llama_app.test_client()


@pytest.fixture(params=["gpt2", "llama"])
def tiny(request):
    """Parametrize a test over both tiny models: (client, model dir, served name)."""
    kind = request.param
    app = request.getfixturevalue(f"{kind}_app")
    path = request.getfixturevalue(f"{kind}_dir")
    return app.test_client(), path, {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}[kind]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny forwards are dominated by intra-op thread hand-offs on a busy 2-core box; one thread is faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference():
    """Independent references: the model loaded by transformers itself, in float32."""
    cache: dict = {}

    def get(path):
        key = str(path)
        if key not in cache:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(key)
            model = AutoModelForCausalLM.from_pretrained(key, dtype="float32").eval()
            cache[key] = (model, tok)
        return cache[key]

    return get
