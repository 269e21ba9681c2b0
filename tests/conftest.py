"""Session fixtures: tiny models built offline in seconds (``tooling/tiny_models.py``), apps and clients over them.

The tests are in tiers, one folder each (pytest.ini says how to run one): ``unit/`` (no model), ``engine/``
(the engine on tiny models), ``http/`` (the Flask test client over a tiny engine), ``live/`` (real gunicorn,
nginx, the openai client; every test there is marked ``slow`` here). Helper modules stay beside this file
(``servers``, ``references``, ``gated_wsgi``), imported by name (``pythonpath = . tests``).

- ``gpt2_dir``: GPT-2 (2 layers) with a byte-level BPE trained by ``tokenizers``.
- ``llama_dir``: Llama (2 layers) with a sentencepiece BPE (byte_fallback) so CJK/emoji span tokens.
- ``smollm2_dir``: the embedded default model, converted once into a session cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports Triton: its kernels run in its interpreter, on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests/unit/test_cuda_kernels.py)

from tooling.tiny_models import build_gpt2, build_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


LIVE = Path(__file__).resolve().parent / "live"


def pytest_collection_modifyitems(config, items):
    """Every test under tests/live/ starts real servers: ``slow``, whether its module says so or not."""
    for item in items:
        if LIVE in item.path.parents:
            item.add_marker(pytest.mark.slow)


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
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    return Worker.from_loaded(tuple(settings.model_names), load_model(LoadConfig.of(settings)))


@pytest.fixture(scope="session")
def gpt2_worker(gpt2_dir):
    return make_worker(make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2"))


@pytest.fixture(scope="session")
def llama_worker(llama_dir):
    return make_worker(make_settings(model=str(llama_dir), served_model_name="tiny-llama"))


def _app(settings, worker):
    from app import create_app

    app = create_app(settings, worker=worker)
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
