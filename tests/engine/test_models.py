"""Loading paths: the embedded SmolLM2 default, PEFT adapters (single, merged, named) against peft's own
forward, and the CUDA-only paths (device maps, bf16, bitsandbytes) that skip without a GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import make_settings, make_worker

TOL = 1e-4


def post(client, **body):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def app_for(settings, worker):
    from app import create_app

    return create_app(settings, worker=worker).test_client()


@pytest.mark.slow
def test_embedded_smollm2_says_paris(saker_cache):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import default_model_dir

    settings = make_settings(cache_dir=str(saker_cache))
    client = app_for(settings, make_worker(settings))
    assert (default_model_dir(LoadConfig.of(settings)) / "model.safetensors").is_file()
    body = post(client, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in body["choices"][0]["text"]
    assert body["model"] == "SmolLM2-135M-Instruct"
    models = client.get("/v1/models").get_json()["data"]
    assert models[0]["id"] == "SmolLM2-135M-Instruct" and models[0]["max_model_len"] == 8192
    assert models[0]["precision"].startswith("int4 weights")  # the embedded default on the CPU: as its GGUF ships


@pytest.mark.slow
def test_a_damaged_default_model_cache_is_converted_again(saker_cache, tmp_path, monkeypatch, caplog):
    """16 MB of garbage inside the converted weights (header intact), or a truncated file: the checksums written
    at conversion no longer match, so the folder is converted again (one warning line) instead of served."""
    import shutil

    from app.engine.model import loader
    from app.engine.model.load_config import LoadConfig

    source = loader.ensure_default_model(LoadConfig(cache_dir=str(saker_cache)))
    config = LoadConfig(cache_dir=str(tmp_path))
    target = loader.default_model_dir(config)
    shutil.copytree(source, target)
    assert loader.damage(target) is None
    converted = []
    monkeypatch.setattr(loader, "_convert_default_model", lambda folder: converted.append(folder) or folder)
    assert loader.ensure_default_model(config) == target and not converted
    weights = target / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(64 * 1024 * 1024)
        f.write(b"\x7f" * (16 * 1024 * 1024))
    assert "model.safetensors does not match its checksum" in loader.damage(target)
    with caplog.at_level("WARNING", logger="saker.loader"):
        loader.ensure_default_model(config)
    assert converted == [target]
    assert any("damaged" in r.message and "converting it again" in r.message for r in caplog.records)
    with open(weights, "r+b") as f:
        f.truncate(1000)
    assert "does not match" in loader.damage(target)
    (target / loader.CHECKSUMS).unlink()
    assert "no readable" in loader.damage(target)


def test_an_unwritable_cache_folder_is_one_line(tmp_path):
    """The cache folder cannot be made (here its parent is a file; a full or read-only disk reads the same):
    a ConfigError naming the folder and what to do, not a traceback."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import ensure_default_model
    from app.errors import ConfigError

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as caught:
        ensure_default_model(LoadConfig(cache_dir=str(blocker)))
    message = str(caught.value)
    assert "\n" not in message and str(blocker) in message and "SAKER_CACHE_DIR" in message


# -- PEFT ------------------------------------------------------------------------------------------------
def make_lora(base_dir, out_dir, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # clearly non-zero: the adapter must change the output
    peft_model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def loras(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return make_lora(llama_dir, root / "a", 1), make_lora(llama_dir, root / "b", 2)


def peft_reference_logprobs(llama_dir, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval() if adapter_dir else base.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def echo_logprobs(client, model, ids):
    body = post(client, model=model, prompt=ids, echo=True, max_tokens=0, logprobs=0)
    return body["choices"][0]["logprobs"]["token_logprobs"][1:]


def expected(lp, ids):
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_named_adapters_are_models_and_match_peft(llama_dir, loras):
    a, b = loras
    settings = make_settings(model=str(llama_dir), served_model_name="base", peft_weights=f"alpha={a} beta={b}")
    client = app_for(settings, make_worker(settings))
    assert [m["id"] for m in client.get("/v1/models").get_json()["data"]] == ["base", "alpha", "beta"]
    ids = [1, 40, 41, 42, 43, 44, 45]
    got_a, got_b, got_base = (echo_logprobs(client, m, ids) for m in ("alpha", "beta", "base"))
    assert got_a == pytest.approx(expected(peft_reference_logprobs(llama_dir, a, ids), ids), abs=TOL)
    assert got_b == pytest.approx(expected(peft_reference_logprobs(llama_dir, b, ids), ids), abs=TOL)
    assert got_base == pytest.approx(expected(peft_reference_logprobs(llama_dir, None, ids), ids), abs=TOL)
    assert max(abs(x - y) for x, y in zip(got_a, got_base)) > 1e-2, "the adapter must change the output"
    # switching back and forth keeps each model's numbers
    assert echo_logprobs(client, "alpha", ids) == pytest.approx(got_a, abs=TOL)
    generated = post(client, model="beta", prompt="Hello", max_tokens=4, temperature=0)
    assert generated["model"] == "beta"


def test_lora_adapters_and_the_base_share_one_decode_batch(llama_dir, loras):
    """Requests for two LoRA adapters and the base model decode in the same steps (peft's ``adapter_names``);
    each one's tokens and logprobs equal peft's own forward for its adapter, and its run alone."""
    from app.engine.events import TokenEvent
    from app.engine.core.sequence import RequestGroup
    from app.engine.core.solo import SoloRun
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.output.decoder import collect
    from app.engine.params import SamplingParams
    from app.engine.core.worker import Worker

    a, b = loras
    settings = make_settings(model=str(llama_dir), served_model_name="base", peft_weights=f"alpha={a} beta={b}")
    worker = Worker.from_loaded(("base",), load_model(LoadConfig.of(settings)), max_batch_rows=8)
    assert worker.runner.mixes_adapters
    prompts = {"alpha": [1, 40, 41, 42], "beta": [1, 50, 51, 52, 53, 54], None: [1, 60, 61]}
    runs = [
        (name, ids, SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True, adapter=name))
        for name, ids in list(prompts.items()) * 2
    ]
    groups = [
        RequestGroup(worker.runner, ids, params, max_length=128, tag=i) for i, (_, ids, params) in enumerate(runs)
    ]
    steps_before = worker.engine.steps
    per = {i: [] for i in range(len(runs))}
    for tag, event in worker.engine.submit(groups):
        per[tag].append(event)
    assert worker.engine.max_rows_seen == len(runs)  # all six rows in one step
    assert worker.engine.steps - steps_before == 5  # 6 tokens: 1 from each prefill + 5 shared steps
    for i, (name, ids, params) in enumerate(runs):
        got = collect(per[i], params).choices[0]
        alone = collect(iter(SoloRun(worker.runner, ids, params, max_length=128)), params).choices[0]
        assert got.text == alone.text
        assert got.logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=TOL)
        generated = [e.token_id for e in per[i] if isinstance(e, TokenEvent)]
        assert len(generated) == 6
        lp = peft_reference_logprobs(llama_dir, {"alpha": a, "beta": b}.get(name), ids + generated)
        assert got.logprobs.token_logprobs == pytest.approx(expected(lp, ids + generated)[len(ids) - 1 :], abs=TOL)


def test_prefix_cache_keeps_adapters_apart(llama_dir, loras):
    """A prompt kept under one adapter is not reused for another (their keys and values differ), and is
    reused for the same one; both agree with peft's own forward."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.params import SamplingParams
    from app.engine.core.worker import Worker

    a, b = loras
    settings = make_settings(model=str(llama_dir), served_model_name="base", peft_weights=f"alpha={a} beta={b}")
    worker = Worker.from_loaded(("base",), load_model(LoadConfig.of(settings)), prefix_cache_tokens=4096)
    cache = worker.prefix_cache
    prompt = [1] + list(range(40, 60))  # one full block of 16 can be reused
    for name, adapter_dir, reused in (("alpha", a, False), ("beta", b, False), ("beta", b, True), (None, None, False)):
        ids = prompt + [70 + len(name or "")]
        params = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True, adapter=name)
        hits = cache.hits
        [output], _ = worker.complete([ids], params, 128)
        assert cache.hits == hits + reused, name
        choice = output.choices[0]
        lp = peft_reference_logprobs(llama_dir, adapter_dir, ids + choice.token_ids)
        assert choice.logprobs.token_logprobs == pytest.approx(
            expected(lp, ids + choice.token_ids)[len(ids) - 1 :], abs=TOL
        )


@pytest.mark.parametrize("merge", [False, True])
def test_single_adapter_applied_and_merged(llama_dir, loras, merge):
    a, _ = loras
    settings = make_settings(model=str(llama_dir), served_model_name="tuned", peft_weights=str(a), peft_merge=merge)
    client = app_for(settings, make_worker(settings))
    assert [m["id"] for m in client.get("/v1/models").get_json()["data"]] == ["tuned"]
    ids = [1, 50, 60, 70, 80]
    assert echo_logprobs(client, "tuned", ids) == pytest.approx(
        expected(peft_reference_logprobs(llama_dir, a, ids), ids), abs=TOL
    )


# -- CUDA-only paths ------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
def test_gpu_memory_device_map_and_bf16(llama_dir):
    settings = make_settings(model=str(llama_dir), gpu_memory="0:1", cpu_memory=1, dtype="bfloat16")
    worker = make_worker(settings)
    model = worker.runner.model
    assert model.dtype == torch.bfloat16
    assert worker.runner.input_device.type == "cuda"
    client = app_for(settings, worker)
    body = post(client, prompt="Hello", max_tokens=4, temperature=0, logprobs=1)
    assert body["usage"]["completion_tokens"] == 4


@gpu
@pytest.mark.gpu
def test_gpu_fp32_logprobs_match_cpu_reference(llama_dir, reference):
    settings = make_settings(model=str(llama_dir), device="cuda", dtype="float32")
    client = app_for(settings, make_worker(settings))
    model, tok = reference(llama_dir)
    ids = tok("Hello world").input_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert echo_logprobs(client, settings.model_names[0], ids) == pytest.approx(expected(lp, ids), abs=1e-3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bitsandbytes-8bit", "bitsandbytes-4bit"])
def test_bitsandbytes_quantization(llama_dir, mode):
    pytest.importorskip("bitsandbytes")
    settings = make_settings(model=str(llama_dir), quantize=mode)
    client = app_for(settings, make_worker(settings))
    body = post(client, prompt="Hello", max_tokens=3, temperature=0)
    assert body["usage"]["completion_tokens"] == 3


def test_quantize_without_gpu_is_a_clear_startup_error(llama_dir):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        load_model(LoadConfig(model=str(llama_dir), quantize="bitsandbytes-8bit"))
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        load_model(LoadConfig(model=str(llama_dir), gpu_memory_map={0: 24.0}))


def test_device_map_fills_the_primary_gpu_first(llama_dir):
    """gpu_id 5 with "-g 2:X 5:X": GPU 5 gets the embeddings and first layers, GPU 2 the overflow (planned on
    the meta device, so no GPU is needed; accelerate alone would sort the ids and start on GPU 2)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import gpu_order, plan_device_map
    from app.settings import Settings

    config = AutoConfig.from_pretrained(str(llama_dir))
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config)
    layer_bytes = sum(p.numel() * 4 for p in meta.model.layers[0].parameters())
    embed_bytes = sum(p.numel() * 4 for p in meta.model.embed_tokens.parameters())
    gib = (embed_bytes + layer_bytes * 1.5) / 2**30  # room for the embeddings and one layer
    settings = Settings(gpu_id=5, gpu_memory=f"2:{gib:.9f} 5:{gib:.9f}", cpu_memory=1)
    max_memory = gpu_order(LoadConfig.of(settings))
    assert list(max_memory) == [5, 2, "cpu"]
    plan = plan_device_map(meta, max_memory, torch.float32)
    # the primary GPU is filled first (inputs go to the embeddings' device), the overflow goes to GPU 2
    assert plan["model.embed_tokens"] == 5, plan
    assert 2 in plan.values(), plan
    assert set(plan.values()) <= {5, 2, "cpu"}, plan


@gpu
@pytest.mark.gpu
def test_compiled_decoding_matches_the_reference(llama_dir, reference):
    """SAKER_COMPILE on CUDA: the decode-only step replayed as CUDA graphs gives transformers' own answer (fp32),
    alone and with n > 1 (several rows of one bucket); so do the steps with prompt chunks, through the flat step's
    graphs (a long prompt's chunks beside decoding rows). Oracle: the model loaded by transformers on the CPU, apart
    from the engine: every chosen token is the argmax of a plain forward over the prompt and the answer so far, its
    logprob and top logprob that forward's log-softmax (``check_reference``; 1e-3: CUDA's float32 against the
    CPU's), the text the tokenizer's decode, and greedy decoding as ``model.generate()`` makes it."""
    from app.engine.params import SamplingParams
    from app.engine.core.worker import Worker
    from references import check_reference, check_served, continuation, ref_greedy, ref_logprobs
    from references import serve_alone_and_beside

    from torch._dynamo.utils import counters

    counters.clear()
    settings = make_settings(model=str(llama_dir), dtype="float32", compile=True, max_batch_rows=4)
    compiled = Worker.from_settings(settings)
    compiled.load()
    assert compiled.runner.compiled_step is not None
    # every bucket is replayed as a CUDA graph: none skipped (the KV pool's in-place writes are allowed because
    # its tensors are static addresses)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    model, tok = reference(llama_dir)
    for prompt, n in (("Hello", 1), ("Once upon a time there was", 3)):
        ids = tok(prompt).input_ids
        params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True, n=n)
        (got,), _ = compiled.complete([ids], params, 256)
        assert len(got.choices) == n
        check_reference(got, model, tok, ids, params, tol=1e-3)
        want = ref_greedy(model, tok, ids, 20)[len(ids) :]
        for choice in got.choices:
            made = choice.token_ids
            assert len(made) == 20 and choice.text == continuation(tok, ids, ids + made)
            # generate() makes the same tokens (up to its EOS: ignore_eos lets the engine go on), unless two logits
            # tie within float32 rounding where the answers part: the engine's token must then be as likely
            same = next((k for k, (a, b) in enumerate(zip(made, want)) if a != b), len(want))
            if same < len(want):
                lp = ref_logprobs(model, ids + want[:same])[-1]
                assert lp[want[same]] - lp[made[same]] <= 1e-3, (same, made, want)
    # the steps with prompt chunks (alone, and riding beside decoding rows) replay the flat step's CUDA graphs,
    # one per token bucket captured at start-up (``FlatSizes``), none skipped
    runner, replays = compiled.runner, []
    assert runner.compiled_flat is not None and runner.flat_sizes is not None
    graph = runner.compiled_flat
    runner.compiled_flat = lambda *args: replays.append(args[0].shape[0]) or graph(*args)
    check_served(serve_alone_and_beside(compiled), model, tok, tol=1e-3)
    assert replays and set(replays) <= set(runner.flat_sizes.buckets), replays
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_a_model_folder_under_home_loads(gpt2_dir, tmp_path, monkeypatch):
    """SAKER_MODEL=~/models/x: the folder is used (not taken for a hub id), tokenizer included."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x").symlink_to(gpt2_dir)
    monkeypatch.setenv("HOME", str(tmp_path))
    loaded = load_model(LoadConfig(model="~/models/x"))
    assert loaded.tokenizer("Hello").input_ids and loaded.model.config.model_type == "gpt2"
