"""The model's forward passes over the block pool (a decode-only step, a flat step), and the PEFT adapter in use."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from app.engine.model import fused_forward
from app.engine.model.attention import use_engine_attention
from app.engine.model.kv_cache import BLOCK
from app.engine.model.kv_cache import default_kv_budget, kv_bytes_per_token
from app.engine.model.shapes import bucket
from app.engine.output.token_text import is_byte_level

MIXED = object()  # a decode batch whose rows use different adapters (LoRA only): peft's ``adapter_names``
# SAKER_COMPILE unset on the CPU: whether a model whose flat step compiles (``ModelRunner.flat_compiles``) gets it
# compiled at start-up. It pays per step (docs/performance.md, "The compiled flat step on the CPU": 10-26 % less at
# 1 row, 5-16 % at 32), but every start pays 33-54 s more (2.5-5 minutes cold), and that start cost has not yet been
# run through the whole test suite and bench (every server start with the embedded model): off until it has.
COMPILE_FLAT_BY_DEFAULT = False


@dataclass
class ModelRunner:
    model: torch.nn.Module
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    adapters: tuple[str, ...] = ()  # named PEFT adapters (the model is a PeftModel when any)
    input_device: torch.device = field(default=None)  # type: ignore[assignment]
    byte_level: bool = False
    compiled_step: object = None  # SAKER_COMPILE: the decode-only step compiled (CUDA graphs on CUDA), or None
    compiled_flat: object = None  # the flat step's forward compiled (``compile_flat``), or None
    # CUDA: the sizes the compiled flat step is padded to (one CUDA graph per token bucket); None on the CPU, whose
    # compiled flat step is one graph dynamic in its sizes and also runs the decode-only steps
    flat_sizes: "FlatSizes | None" = None
    mixes_adapters: bool = False  # every named adapter is LoRA: one batch may mix them (and the base)
    kv_dtype: torch.dtype | None = None  # the block pool's dtype (None: the model's keys' own)
    # steps run saker's own forward of the model's layers (``fused_forward``) where it has one, not transformers'
    fused: fused_forward.Plan | fused_forward.GPT2Plan | None = None
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
        if self.input_device.type == "cpu":
            from app.engine.model import cpu_kernels

            kernel_attends = cpu_kernels.supports(self.probe_cache().layers[0].keys.shape[-1])
            for module in self.model.modules():  # read by ``attention.flat_attention``: a constant to a compiled step
                module._saker_kernel_attends = kernel_attends
            if getattr(self.model, "_saker_exact", False):  # fixed-order attention: the kernel's pool, or float64
                self.kv_dtype = torch.float32 if kernel_attends else torch.float64
        if fused_forward.supports(self.model, self.kv_dtype, self.adapters):
            self.fused = fused_forward.plan(self.model)
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

        if self.compiled_flat is not None and self.flat_sizes is None and adapter_names is None:  # the CPU's one graph
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            every = rows.clone()  # every row's logits: a tensor of its own (inputs that alias are another graph)
            return self.run_compiled_flat(tokens, positions, write, gather, rows, positions + 1, every, keys, values)
        if self.fused is not None and adapter_names is None:
            flat = FlatStep(keys, values, write, tokens.shape[0], gather, row_positions=positions)
            return fused_forward.forward(self.fused, tokens, positions, flat)
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
        at ``logits_at`` only (T_out, V), so a chunk whose positions need no logits costs no LM head. Compiled
        (``compile_flat``), the step's tensors go through the one compiled graph (``flat_forward``)."""
        tokens, positions = tokens.to(self.input_device), positions.to(self.input_device)
        if self.compiled_flat is not None:
            tables, which, _, hi = flat.spans()
            at = logits_at.to(self.input_device)
            return self.run_compiled_flat(tokens, positions, flat.write, tables, which, hi, at, flat.keys, flat.values)
        return self._flat_logits(tokens, positions, flat, logits_at)

    def _flat_logits(
        self, tokens: torch.Tensor, positions: torch.Tensor, flat, logits_at: torch.Tensor
    ) -> torch.Tensor:
        """The model's forward over one flat sequence of tokens (``attention.FlatStep``), float32 logits at
        ``logits_at``: what ``flat_step`` runs eagerly and ``flat_forward`` compiles; saker's own forward of the
        model's layers where it has one (``fused_forward``), else transformers'."""
        if self.fused is not None:
            return fused_forward.forward(self.fused, tokens, positions, flat, logits_at)
        out = self.model(
            input_ids=tokens.view(1, -1),
            position_ids=positions.view(1, -1),
            # a 4D placeholder: transformers builds no (T, T) mask (the attention function masks by ``flat``)
            attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=tokens.device),
            use_cache=False,
            logits_to_keep=logits_at,
            flat=flat,
        )
        return out.logits[0].float()

    # -- the compiled flat step -----------------------------------------------------------------------------------
    def flat_compiles(self) -> bool:
        """Whether this model's flat step can be one compiled graph whose inputs are tensors only (every query, a
        prompt chunk's too, through one attention kernel over the pool; no PEFT adapters): on the CPU with the
        fixed-order float32 kernel over a float32 pool (``cpu_kernels``: the int4/int8 models), on CUDA with the
        Triton kernel (``cuda_kernels``). Other models (float32 and bfloat16 ones on the CPU attend by SDPA over
        each chunk's blocks, a loop over the step's chunks) run their flat steps eagerly."""
        if self.adapters:
            return False
        if self.input_device.type == "cpu":
            return self.kv_dtype == torch.float32
        from app.engine.model import cuda_kernels

        return cuda_kernels.available(self.input_device)

    def flat_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write: torch.Tensor,
        tables: torch.Tensor,
        which: torch.Tensor,
        hi: torch.Tensor,
        logits_at: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """The flat step as a function of tensors only (what ``compile_flat`` compiles): ``tokens``, ``positions``
        and pool slots ``write`` (T,), the step's block tables (R, B), each token's table row ``which`` (T,) and
        the end of the positions it attends over ``hi`` (T,) (``FlatStep.spans``), the tokens whose logits are
        wanted ``logits_at`` (K,), the pool's per-layer tensors. Float32 logits (K, V). Decode rows, prompt chunks
        and rows checking guesses differ only in these tensors' values, so every step is one graph."""
        from app.engine.model.attention import FlatStep

        zeros = torch.zeros_like(hi)
        spans = {w: (tables, which, (hi - w).clamp_min(0) if w else zeros, hi) for w in self.windows}
        flat = FlatStep(keys, values, write, 0, kernel=True, _spans=spans)
        return self._flat_logits(tokens, positions, flat, logits_at)

    @functools.cached_property
    def windows(self) -> tuple[int | None, ...]:
        """The attention windows the model's layers ask for (None: every earlier position; an int: a sliding
        window), each one's ``[lo, hi)`` made in ``flat_forward``."""
        found = {getattr(m, "sliding_window", None) for m in self.model.modules() if hasattr(m, "layer_idx")}
        return (None, *sorted(w for w in found if isinstance(w, int) and w > 0))

    def run_compiled_flat(self, tokens, positions, write, tables, which, hi, logits_at, keys, values) -> torch.Tensor:
        """``flat_forward``'s compiled graph on a step's tensors (``padded``); on CUDA a step larger than the
        captured sizes (``FlatSizes.fits``) runs ``flat_forward`` eagerly."""
        count, sizes = logits_at.shape[0], self.flat_sizes
        if sizes is not None and not sizes.fits(tokens.shape[0], tables.shape[1], count):
            return self.flat_forward(tokens, positions, write, tables, which, hi, logits_at, keys, values)
        if sizes is not None:  # a step of its own to CUDA graphs (the decode step's graphs run between these)
            torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled_flat(*padded(tokens, positions, write, tables, which, hi, logits_at, keys, values, sizes))
        return out[:count] if out.shape[0] > count else out

    def compile_step(self) -> None:
        """SAKER_COMPILE: the decode-only step through torch.compile (one graph; CUDA graphs on CUDA)."""
        mode = "reduce-overhead" if self.input_device.type == "cuda" else None
        self.compiled_step = torch.compile(self.rows_step, fullgraph=True, mode=mode)

    def compile_flat(self, keys: list, values: list, sizes: FlatSizes | None = None) -> bool:
        """Compile ``flat_forward`` (inductor, one graph, the token dimension dynamic) and run it now on ``keys`` and
        ``values`` (the pool's), so that no request pays the compile. On the CPU every flat step and decode-only
        step then goes through it, and it must give the eager forward's numbers to the bit (the int4/int8 kernels
        round their inputs, to int16 per group or to bfloat16, where a float32 ulp can become a visible change;
        ``eager_numbers``). On CUDA (``sizes``) it replays as one CUDA graph per token bucket, each captured here,
        and runs the steps with prompt chunks (the decode-only steps keep ``compile_step``'s graphs); its logits
        must be the eager forward's within ``CUDA_DRIFT`` of their largest (inductor fuses and rounds otherwise). The
        warm-up steps are checked against ``flat_forward`` run eagerly, and where they differ the graph is dropped
        with a warning and the steps stay eager. Returns whether it is in use."""
        import logging

        log = logging.getLogger("saker.worker")
        if not self.flat_compiles() or not keys or keys[0].shape[0] < (WARM_BLOCK + 1) * BLOCK:
            return False
        if sizes is None:  # the bits of the eager forward: the CPU's (CUDA's are checked within ``CUDA_DRIFT``)
            eager_numbers()
        assert self.windows  # found now, not while tracing
        self.flat_sizes = sizes
        if sizes is not None:
            from torch._inductor import config as inductor

            for tensor in (*keys, *values):  # CUDA graphs read the pool where it is, never a copy
                torch._dynamo.mark_static_address(tensor)
            # a graph per token bucket is the design (inductor warns past 8 sizes, taking them for unpadded ones)
            inductor.triton.cudagraph_dynamic_shape_warn_limit = None
        self.compiled_flat = torch.compile(self.flat_forward, fullgraph=True, mode="reduce-overhead" if sizes else None)
        problem = None
        try:
            with torch.inference_mode():
                # the first step with every varying size distinct (dynamo gives equal sizes one symbol: tokens 12,
                # tables 5 x 3, logits 4; with ``sizes`` where 12 tokens are captured), then a lone row
                checks = [warm_step(self, (3, 4, 5)), warm_step(self, (1,))]
                for step in [s for s in checks if sizes is None or sizes.fits(s[0].shape[0], 3, 4)]:
                    step = padded(*step, keys, values, sizes)  # both sides on the same tensors
                    for _ in range(3 if sizes else 1):  # CUDA graphs: run eagerly, recorded, then replayed
                        torch.compiler.cudagraph_mark_step_begin()
                        compiled = self.compiled_flat(*step).clone()
                    eager = self.flat_forward(*step)
                    problem = drift(compiled, eager, CUDA_DRIFT if sizes else 0.0)
                    if problem:
                        break
                for tokens in sizes.buckets if sizes and not problem else ():  # every other bucket captured now
                    step = padded(*warm_step(self, (1,)), keys, values, sizes, tokens)
                    for _ in range(3):
                        torch.compiler.cudagraph_mark_step_begin()
                        self.compiled_flat(*step)
        except Exception as exc:  # inductor could not build it here: the steps stay as they were
            problem = f"it could not be compiled ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        finally:
            for tensor in (*keys, *values):  # the warm-up's keys and values gone: the block as it was handed out
                tensor[WARM_BLOCK * BLOCK : (WARM_BLOCK + 1) * BLOCK].zero_()
        if problem is not None:
            log.warning("the compiled flat step is not used: %s; steps run eagerly", problem)
            self.compiled_flat, self.flat_sizes = None, None
        return self.compiled_flat is not None


CUDA_DRIFT = 0.02  # how far (of the largest logit) CUDA's compiled flat step may be from its eager forward


def drift(compiled: torch.Tensor, eager: torch.Tensor, allowed: float) -> str | None:
    """Why the compiled graph's logits are not the eager forward's: different bits (``allowed`` 0), or further than
    ``allowed`` times the largest eager logit; None when they agree."""
    finite = bool(torch.isfinite(compiled).all())
    if compiled.shape != eager.shape or not finite:
        return f"its logits are not the eager forward's (shape {tuple(compiled.shape)}, all finite: {finite})"
    gap = (compiled.float() - eager.float()).abs().max()
    if gap <= allowed * eager.float().abs().max():  # allowed 0: the same bits
        return None
    return f"its logits differ from the eager forward's (up to {gap:.3g})"


@dataclass(frozen=True)
class FlatSizes:
    """What CUDA's compiled flat step is padded to, so that each step replays a CUDA graph captured at start-up:
    its tokens up to a bucket (``tokens``), its block tables to as many rows as the bucket and ``width`` blocks
    each (the context's), its logits to the bucket's or ``logits`` rows, the fewer. A step beyond them (more tokens
    than ``top``'s bucket, more logits, a wider table) runs eagerly."""

    top: int
    width: int
    logits: int

    @staticmethod
    def tokens(count: int) -> int:
        """The batch buckets (``shapes.bucket``: 2, 4, 8, 16, 24, 32, then multiples of 8) up to 256 tokens, then
        multiples of 64 (vLLM's capture sizes are as coarse above 256): at most a quarter of a large step is
        padding, and a 1,024-token budget is 46 graphs."""
        return bucket(max(2, count)) if count <= 256 else -(-count // 64) * 64

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({self.tokens(n) for n in range(2, self.top + 1)}))

    def logits_rows(self, tokens: int) -> int:
        return max(2, min(tokens, self.logits))  # at least 2: dynamo specializes a size of 1

    def fits(self, tokens: int, width: int, logits: int) -> bool:
        padded_tokens = self.tokens(tokens)
        fitting = padded_tokens <= self.tokens(self.top) and width <= self.width
        return fitting and logits <= self.logits_rows(padded_tokens)


def padded(
    tokens, positions, write, tables, which, hi, logits_at, keys, values, sizes: FlatSizes | None = None, to: int = 0
) -> tuple:
    """A step's tensors for the compiled graph: each dimension that varies from step to step marked dynamic and
    padded to at least 2 (padding tokens written at slot 0, in the null block, attending over nothing; null table
    rows or columns; a repeated logit), because dynamo specializes sizes 0 and 1: one graph serves every step, a
    lone row's included. With ``sizes`` (CUDA) the tokens are padded to their bucket (``to``: to that many), the
    tables and logits as ``FlatSizes`` says. The padding changes no other token's numbers where every operation is
    row-wise (the kernel path's)."""
    count, rows, width, logits = tokens.shape[0], max(2, tables.shape[0]), max(2, tables.shape[1]), 2
    if sizes is not None:
        count = to or sizes.tokens(count)
        rows, width, logits = count, sizes.width, sizes.logits_rows(count)
    if tokens.shape[0] < max(2, count):
        pad = torch.zeros(max(2, count) - tokens.shape[0], dtype=torch.long, device=tokens.device)
        tokens, positions, write, which, hi = (torch.cat([t, pad]) for t in (tokens, positions, write, which, hi))
    if tables.shape[0] < rows or tables.shape[1] < width:
        grow = (0, max(0, width - tables.shape[1]), 0, max(0, rows - tables.shape[0]))
        tables = torch.nn.functional.pad(tables, grow)
    tables = tables.contiguous()  # the batch's are a view of wider arrays: other strides would be another graph
    if logits_at.shape[0] < logits:
        logits_at = torch.cat([logits_at, logits_at.new_zeros(logits - logits_at.shape[0])])
    for tensor in (tokens, positions, write, which, hi, logits_at):
        torch._dynamo.mark_dynamic(tensor, 0)
    torch._dynamo.mark_dynamic(tables, (0, 1))
    for tensor in (*keys, *values) if sizes is None else ():  # a pool of another size (a solo run's) is the same graph
        torch._dynamo.mark_dynamic(tensor, 0)
    return tokens, positions, write, tables, which, hi, logits_at, keys, values


# aten operations inductor would compute in another order than ATen's CPU kernels: a reduction's summation order
# (RMSNorm's mean), Sleef's cos/sin on the elements ATen gives to the C library (the rotary embedding). A float32
# ulp there moves a value across a bfloat16 rounding boundary before an int4/int8 kernel, and over 30 layers the
# embedded model's logprobs moved by up to 4.5 (random tokens, 32 rows: docs/performance.md). Compiled, they are
# ATen's own calls.
EAGER_OPS = ("mean", "cos", "sin")
WARM_BLOCK = 1  # the block the warm-up steps write and read (zeroed after; the pool hands it out later)
_eager_done: list[bool] = []


def eager_numbers() -> None:
    """Make inductor call ATen for ``EAGER_OPS`` instead of generating their code (once per process)."""
    if _eager_done:
        return
    from torch._inductor import lowering

    for name in EAGER_OPS:
        lowering.make_fallback(getattr(torch.ops.aten, name), warn=False, override_decomp=True)
    _eager_done.append(True)


def warm_step(runner: ModelRunner, spans: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """A flat step's tensors over block 1 of the pool (``WARM_BLOCK``: every token written at its own slot there,
    every table pointing there), for compiling and checking ``flat_forward`` before the pool holds anything:
    ``spans[0]`` decode rows, then a chunk of each further size (the last chunk ends its prompt: its last token's
    logits are wanted). Block 0 stays the padding's (``run_compiled_flat`` writes a lone row's padding token there)."""
    device = runner.input_device
    rows, chunks = spans[0], spans[1:]
    count = rows + sum(chunks)  # at most BLOCK tokens: one slot each
    tokens = torch.arange(count, device=device) % max(1, runner.vocab_size)
    positions = torch.cat([torch.arange(rows) + 5, *(torch.arange(c) for c in chunks)]).long().to(device)
    write = torch.arange(count, device=device) + WARM_BLOCK * BLOCK
    which = torch.cat([torch.arange(rows), *(torch.full((c,), rows + j) for j, c in enumerate(chunks))]).long()
    tables = torch.full((rows + len(chunks), 3), WARM_BLOCK, dtype=torch.long, device=device)
    logits_at = torch.cat([torch.arange(rows), torch.tensor([count - 1] if chunks else [])]).long().to(device)
    return tokens, positions, write, tables, which.to(device), positions + 1, logits_at


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
