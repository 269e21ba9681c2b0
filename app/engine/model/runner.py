"""The model's forward passes over the block pool (a decode-only step, a flat step), and the PEFT adapter in use."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from app.engine.model.attention import use_engine_attention
from app.engine.model.kv_cache import BLOCK
from app.engine.model.kv_cache import default_kv_budget, kv_bytes_per_token
from app.engine.output.token_text import is_byte_level

MIXED = object()  # a decode batch whose rows use different adapters (LoRA only): peft's ``adapter_names``


@dataclass
class ModelRunner:
    model: torch.nn.Module
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    adapters: tuple[str, ...] = ()  # named PEFT adapters (the model is a PeftModel when any)
    input_device: torch.device = field(default=None)  # type: ignore[assignment]
    byte_level: bool = False
    compiled_step: object = None  # SAKER_COMPILE: the decode-only step compiled (CUDA graphs on CUDA), or None
    mixes_adapters: bool = False  # every named adapter is LoRA: one batch may mix them (and the base)
    kv_dtype: torch.dtype | None = None  # the block pool's dtype (None: the model's keys' own)
    # tests only: called before each forward and each sampling with what it is ("rows", "flat", "sample"); raising
    # there is a step failing at that point (tests/engine/test_fault_isolation.py)
    fault: object = field(default=None, repr=False)
    _active_adapter: object = field(default="", repr=False)  # "": not chosen yet

    def __post_init__(self):
        from app.engine.errors import ConfigError

        if self.input_device is None:
            self.input_device = self.model.get_input_embeddings().weight.device
        problem = block_cache_problem(self.model)
        if problem is None and not use_engine_attention(self.model):  # path-independent numbers on the CPU too
            problem = "its attention does not go through transformers' AttentionInterface (sdpa or eager)"
        if problem is not None:
            raise ConfigError(
                f"this model cannot be served: {problem}; saker keeps every sequence's keys and values in "
                "blocks of its KV pool, which needs plain (or sliding-window) attention layers"
            )
        if getattr(self.model, "_saker_exact", False):  # fixed-order attention: the float32 kernel's pool, or float64
            from app.engine.model import cpu_kernels

            head_dim = self.probe_cache().layers[0].keys.shape[-1]
            self.kv_dtype = torch.float32 if cpu_kernels.supports(head_dim) else torch.float64
        self.byte_level = is_byte_level(self.tokenizer)
        configs = getattr(self.model, "peft_config", {})
        self.mixes_adapters = bool(self.adapters) and all(
            str(getattr(configs.get(name), "peft_type", "")).endswith("LORA") for name in self.adapters
        )

    def inject(self, point: str) -> None:
        """The test-only fault hook (``fault``) at ``point``; nothing when none is set."""
        if self.fault is not None:
            self.fault(point)

    def can_join(self, running: set, adapter: str | None) -> bool:
        """Whether a request for ``adapter`` may share a decode batch with requests for the ``running`` ones."""
        return self.mixes_adapters or running <= {adapter}

    @property
    def context_length(self) -> int:
        """The most positions a sequence may hold: the config's, else the tokenizer's, else 2048."""
        config = self.model.config
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(config, attr, None) or getattr(getattr(config, "text_config", None), attr, None)
            if isinstance(value, int) and value > 0:
                return value
        value = getattr(self.tokenizer, "model_max_length", None)
        return value if isinstance(value, int) and 0 < value < 10**9 else 2048

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return getattr(head, "out_features", None) or head.weight.shape[0]

    @contextlib.contextmanager
    def adapter(self, name: str | None):
        """Run with the named adapter active, with adapters disabled (the base model) for None, or with them
        enabled for ``MIXED`` (each row's adapter is then named in ``decode``).

        The scheduler enters this every step: the model's modules are only touched when the choice changes."""
        if self.adapters and name is not self._active_adapter and name != self._active_adapter:
            if name is None:
                self.model.base_model.disable_adapter_layers()
            else:
                if self._active_adapter is None:
                    self.model.base_model.enable_adapter_layers()
                if name is not MIXED:
                    self.model.set_adapter(name)
            self._active_adapter = name
        yield

    def prefix_salt(self, adapter: object) -> object:
        """Kept prompt blocks are per PEFT adapter (None: the base model); without adapters there is one salt."""
        return adapter if self.adapters else ""

    def probe_cache(self):
        """The cache of a one-token forward: what one position of this model's keys and values looks like
        (layers, heads, dtype, device)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.input_device),
                past_key_values=cache,
                use_cache=True,
            )
        return cache

    def kv_bytes_per_token(self) -> int:
        """Bytes one position takes in the block pool (all layers, keys and values, in the pool's dtype)."""
        return kv_bytes_per_token(self.probe_cache(), self.kv_dtype)

    def default_kv_budget(self) -> int:
        """The KV budget in token positions when none is set (see ``kv_cache.default_kv_budget``), from the bytes
        one position takes in the block pool."""
        return default_kv_budget(self.kv_bytes_per_token(), self.input_device)

    def rows_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write: torch.Tensor,
        gather: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        adapter_names: list[str] | None = None,
        scratch=None,
    ) -> torch.Tensor:
        """A decode-only step: ``tokens`` (n,) of n sequences at ``positions`` (n,), written at pool slots ``write``
        (n,), each attending over its blocks ``gather`` (n, W / BLOCK) up to its own position. A function of tensors
        only, so
        that it compiles as one graph (no break, no recompile while rows join and leave) and, on CUDA, replays as a
        CUDA graph per batch bucket. Float32 logits (n, V). ``adapter_names`` (eager only, under
        ``adapter(MIXED)``): each row's LoRA adapter, ``"__base__"`` for the base model. ``scratch`` (eager only):
        ``attention.Scratch`` buffers to read the rows' blocks into."""
        from app.engine.model.attention import FlatStep

        n, width = gather.shape[0], gather.shape[1] * BLOCK
        mask = (torch.arange(width, device=positions.device).view(1, -1) <= positions.view(-1, 1)).view(n, 1, 1, width)
        flat = FlatStep(keys, values, write, n, gather, mask, positions, batched=True, scratch=scratch)
        extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
        out = self.model(
            input_ids=tokens.view(n, 1),
            position_ids=positions.view(n, 1),
            attention_mask=mask,  # 4D: transformers passes it on as it is, and builds no mask of its own
            use_cache=False,
            flat=flat,
            **extra,
        )
        return out.logits[:, -1, :].float()

    def flat_step(self, tokens: torch.Tensor, positions: torch.Tensor, flat, logits_at: torch.Tensor) -> torch.Tensor:
        """One forward of a step's tokens as one flat sequence (``attention.FlatStep``: decode rows and prompts'
        chunks, each token written into and attending over its own sequence's blocks); float32 logits of the tokens
        at ``logits_at`` only (T_out, V), so a chunk whose positions need no logits costs no LM head."""
        out = self.model(
            input_ids=tokens.view(1, -1).to(self.input_device),
            position_ids=positions.view(1, -1).to(self.input_device),
            # a 4D placeholder: transformers builds no (T, T) mask (the attention function masks by ``flat``)
            attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.input_device),
            use_cache=False,
            logits_to_keep=logits_at,
            flat=flat,
        )
        return out.logits[0].float()

    def compile_step(self) -> None:
        """SAKER_COMPILE: the decode-only step through torch.compile (one graph; CUDA graphs on CUDA)."""
        mode = "reduce-overhead" if self.input_device.type == "cuda" else None
        self.compiled_step = torch.compile(self.rows_step, fullgraph=True, mode=mode)


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


# the cache layers whose keys and values can live in the block pool: plain ones, and sliding windows (the window
# is the attention function's mask; the pool keeps every position)
BLOCK_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def block_cache_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s KV cache cannot be kept in blocks, in words (recurrent or linear-attention state, static or
    quantized layers, ...); None when every layer is plain or a sliding window."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=getattr(model, "config", None))
    except Exception as exc:  # a config transformers cannot make a cache for
        return f"no KV cache can be made for its config ({type(exc).__name__}: {exc})"
    kinds = sorted({type(layer).__name__ for layer in cache.layers} - set(BLOCK_LAYERS))
    return f"its cache has {', '.join(kinds)} layers" if kinds else None
