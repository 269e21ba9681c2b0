"""saker's own forward of a Llama-shaped decoder over a flat step, on the CPU: the same modules' weights and the
same arithmetic as transformers' forward, in about a dozen calls per layer instead of some seventy.

On a 1-row step the eager transformers forward ran about 2,000 PyTorch operations, most of them on a few hundred
floats (RMSNorm's six, the rotary embedding's twelve per layer, views, casts, the pool's writes), each paying its
dispatch: about half of the step on the 2-core machine (docs/performance.md, "Fused decoder layers"). Here each
layer is

    add_rms_norm -> q, k, v products -> rotary_write (rotation and the pool's writes) -> attention -> o product
    -> add_rms_norm -> gate, up products -> silu(gate) * up -> down product

with the norms and the rotation in saker's kernels (``kernels/decoder_ops.cpp``: transformers' arithmetic to the
bit, a norm's mean of squares PyTorch's own), the products the layer's own linears (saker's int4 kernel called
directly), attention the fixed-order kernel over the block pool. transformers' model is left as it is:
``model(...)`` is still its plain forward, the oracle the tests compare this one with.

Used for a model whose flat step attends by the CPU's float32 kernel (an int4/int8 model, ``_saker_exact``) when
its layers are what this forward knows (``supports``): Llama, Mistral and Qwen2 decoder layers with SiLU MLPs and no
sliding window, and no PEFT adapters.

GPT-2 in float32 on the CPU has a forward of its own here too (``GPT2Plan``): its layers are PyTorch's own
operations already (layer norm, ``addmm`` for its Conv1D products, GELU), so it is transformers' operations in
transformers' order, called straight instead of through some thirty module calls a step, with the step's attention
the engine's (``attention.flat_attention``: the decode rows through the float32 kernel over the pool in place).
Any other model runs transformers' forward."""

from __future__ import annotations

import torch

from app.engine.model import attention, cpu_kernels

# decoder layers of exactly this shape (no q/k norms, no scaled embeddings), each tested with a tiny model
# (tests/engine/test_fused_forward.py); Qwen2's q, k and v have biases, which their modules add
MODEL_TYPES = ("llama", "mistral", "qwen2")


def supports(model: torch.nn.Module, kv_dtype: torch.dtype | None, adapters: tuple = ()) -> bool:
    """Whether ``forward`` computes ``model``'s forward: a Llama-shaped decoder (``MODEL_TYPES``) on the CPU whose
    attention is the float32 kernel's (``_saker_exact`` and a float32 pool), its layers' modules the usual ones,
    full attention in every layer, SiLU, and no adapters; or a float32 GPT-2 on the CPU (``_supports_gpt2``)."""
    config = getattr(model, "config", None)
    if not adapters and getattr(config, "model_type", None) == "gpt2":
        return _supports_gpt2(model, kv_dtype)
    inner = getattr(model, "model", None)
    if adapters or config is None or inner is None or getattr(config, "model_type", None) not in MODEL_TYPES:
        return False
    if not getattr(model, "_saker_exact", False) or kv_dtype != torch.float32:
        return False
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "sliding_window", None) is not None:
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    embed = model.get_input_embeddings()
    if embed is None or embed.weight.device.type != "cpu" or embed.weight.dtype != torch.float32:
        return False
    layers = getattr(inner, "layers", None)
    if not layers or not all(_known_layer(layer) for layer in layers):
        return False
    head_dim = layers[0].self_attn.head_dim
    return cpu_kernels.supports(head_dim) and all(
        hasattr(getattr(inner, name, None), attr) for name, attr in (("norm", "weight"), ("rotary_emb", "forward"))
    )


def _known_layer(layer: torch.nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = {
        attn: ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"),
        mlp: ("gate_proj", "up_proj", "down_proj"),
        layer: ("input_layernorm", "post_attention_layernorm"),
    }
    return (
        attn is not None
        and mlp is not None
        and all(hasattr(module, name) for module, wanted in names.items() for name in wanted)
        and not hasattr(attn, "q_norm")
        and all(_norm_eps(getattr(layer, n)) is not None for n in ("input_layernorm", "post_attention_layernorm"))
    )


def _norm_eps(norm: torch.nn.Module) -> float | None:
    """An RMSNorm's epsilon (transformers names it ``variance_epsilon``; ``eps`` elsewhere), None for another norm."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    return eps if isinstance(eps, float) and weight is not None and getattr(norm, "bias", None) is None else None


def _supports_gpt2(model: torch.nn.Module, kv_dtype: torch.dtype | None) -> bool:
    """A GPT-2 LM whose every weight is a float32 CPU tensor and whose products are transformers' Conv1D modules or
    their oneDNN-packed replacements (``optimize.PackedLinear``), not quantized ones (an int4/int8 GPT-2 rounds its
    activations, ``_saker_exact``); self-attention only; the pool float32."""
    from transformers.pytorch_utils import Conv1D

    from app.engine.model.optimize import PackedLinear

    config, inner, head = model.config, getattr(model, "transformer", None), getattr(model, "lm_head", None)
    if inner is None or head is None or getattr(model, "_saker_exact", False) or kv_dtype not in (None, torch.float32):
        return False
    if getattr(config, "add_cross_attention", False) or not hasattr(inner, "wpe"):
        return False
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return False
    layers = getattr(inner, "h", None)
    return bool(layers) and all(
        type(module) in (Conv1D, PackedLinear)
        for layer in layers
        for module in (layer.attn.c_attn, layer.attn.c_proj, layer.mlp.c_fc, layer.mlp.c_proj)
    )


class GPT2Plan:
    """What ``forward`` reads of a float32 GPT-2, gathered once: the embeddings, and per layer its norms'
    ``(weight, bias, eps)``, its attention module (the engine's attention reads its layer index and scaling), its
    products (a Conv1D as ``(bias, weight)`` for ``torch.addmm``, what ``Conv1D.forward`` calls; a packed one as
    its module) and its activation."""

    def __init__(self, model: torch.nn.Module):
        inner = model.transformer
        self.embed, self.positions, self.head = inner.wte, inner.wpe, model.lm_head
        self.width = inner.embed_dim

        def norm(module):
            return (module.weight, module.bias, module.eps)

        def conv(module):
            return (module.bias, module.weight) if hasattr(module, "weight") else module

        self.norm = norm(inner.ln_f)
        self.layers = [
            (
                norm(layer.ln_1),
                layer.attn,
                conv(layer.attn.c_attn),
                conv(layer.attn.c_proj),
                norm(layer.ln_2),
                conv(layer.mlp.c_fc),
                layer.mlp.act,
                conv(layer.mlp.c_proj),
            )
            for layer in inner.h
        ]


def plan(model: torch.nn.Module) -> "Plan | GPT2Plan":
    """The plan of a model ``supports``."""
    return GPT2Plan(model) if model.config.model_type == "gpt2" else Plan(model)


class Plan:
    """What ``forward`` reads of a model it supports, gathered once (``supports`` first): per layer its norms'
    weights and epsilons, its products (an int4 linear of saker's layout with no bias as its kernel's tensors,
    ``(packed, scales, mins)``; any other linear as its module), its head dim and attention scale. A step then runs
    on these locals instead of some 40 module attribute lookups per layer."""

    def __init__(self, model: torch.nn.Module):
        inner = model.model
        self.embed, self.rotary, self.head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self.norm = (inner.norm.weight, _norm_eps(inner.norm))
        self.in_order = cpu_kernels.sums_in_order()  # asked here, not in a step (a compiled one cannot ask)
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            first, second = layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append(
                (
                    (first.weight, _norm_eps(first)),
                    tuple(_product(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                    attn.head_dim,
                    attn.scaling,
                    (second.weight, _norm_eps(second)),
                    tuple(_product(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")),
                )
            )
        self.layers_call = self._layers_call()

    def _layers_call(self):
        """Every layer in one call into the kernels (``kernels/decoder_layers.cpp``: the same functions in the same
        order as ``forward``'s loop) where every product is an int4 one of saker's layout; else None."""
        ext = cpu_kernels.kernel()
        if ext is None or not all(type(p) is tuple for layer in self.layers for p in (*layer[1], *layer[5])):
            return None
        weights, eps = [], []
        for first, attn, _, _, second, mlp in self.layers:
            weights += [first[0], *(t for p in attn for t in p), second[0], *(t for p in mlp for t in p)]
            eps += [first[1], second[1]]
        head_dims = [layer[2] for layer in self.layers]
        scales = [layer[3] for layer in self.layers]
        return ext.Layers(weights, eps, head_dims, scales, self.in_order, cpu_kernels.wide())


def _product(module: torch.nn.Module):
    """An int4 linear of saker's layout with no bias as its kernel's tensors (its module's reshapes and casts are
    no-ops on a flat step's (T, K) input); any other linear as itself."""
    if getattr(module, "layout", None) == "saker" and module.bias is None:
        return (module.packed, module.scales, module.mins)
    return module


def forward(
    plan: Plan | GPT2Plan,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    flat,
    logits_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's forward over one flat step's ``tokens`` (T,) at ``positions`` (T,) (``attention.FlatStep``:
    each token's key and value written at its pool slot, each token attending over its own sequence's positions):
    float32 logits of the tokens at ``logits_at`` (every token's when None), (K, V). Straight into the kernels'
    extension, or through their ``torch.library`` ops while compiling or profiling (``cpu_kernels._through_op``).
    A GPT-2's plan runs its own forward (``_gpt2_forward``)."""
    if type(plan) is GPT2Plan:
        return _gpt2_forward(plan, tokens, positions, flat, logits_at)
    in_order = plan.in_order
    if cpu_kernels._through_op():
        ops, rotary, attend, int4 = cpu_kernels, cpu_kernels.rotary_write, cpu_kernels.call, cpu_kernels.int4_linear
    else:
        ops, wide = cpu_kernels.kernel(), cpu_kernels.wide()
        rotary, attend = ops.rotary_write, ops.paged_attention

        def int4(x, weight, scales, mins):
            return ops.int4_linear(x, weight, scales, mins, wide)

    def norm(x, weight, eps):
        return ops.rms_norm(x, weight, eps, in_order)

    def add_norm(x, residual, weight, eps):
        return ops.add_rms_norm(x, residual, weight, eps, in_order)

    def product(spec, x):
        return int4(x, *spec) if type(spec) is tuple else spec(x)

    count = tokens.shape[0]
    hidden = plan.embed(tokens.view(-1))
    cos, sin = plan.rotary(hidden.unsqueeze(0), positions.view(1, -1))
    cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
    tables, which, lo, hi = flat.spans(None)
    write, residual = flat.write, None
    if plan.layers_call is not None and not cpu_kernels._through_op():  # the same calls, in one
        hidden, residual = plan.layers_call.forward(
            hidden, cos, sin, tables, which, lo, hi, write, flat.keys, flat.values
        )
    else:
        for index, (first, (q_proj, k_proj, v_proj, o_proj), head_dim, scale, second, mlp) in enumerate(plan.layers):
            if residual is None:
                x, residual = norm(hidden, *first), hidden
            else:
                x, residual = add_norm(hidden, residual, *first)
            q = product(q_proj, x).view(count, -1, head_dim)
            k = product(k_proj, x).view(count, -1, head_dim)
            v = product(v_proj, x).view(count, -1, head_dim)
            keys, values = flat.keys[index], flat.values[index]
            q = rotary(q, k, v, cos, sin, keys, values, write)
            hidden = product(o_proj, attend(q, keys, values, tables, which, lo, hi, scale).view(count, -1))
            x, residual = add_norm(hidden, residual, *second)
            gate, up, down = mlp
            hidden = product(down, torch.nn.functional.silu(product(gate, x)).mul_(product(up, x)))
    x, _ = add_norm(hidden, residual, *plan.norm)
    if logits_at is not None:
        x = x[logits_at]
    return plan.head(x).float()


def _gpt2_forward(plan: GPT2Plan, tokens, positions, flat, logits_at):
    """GPT-2's forward (``GPT2LMHeadModel``, eval) over a flat step: transformers' operations in its order."""
    layer_norm, addmm = torch.nn.functional.layer_norm, torch.addmm

    def product(spec, x):
        return addmm(spec[0], x, spec[1]) if type(spec) is tuple else spec(x)

    count, width = tokens.shape[0], plan.width
    shape = (width,)
    hidden = plan.embed(tokens.view(-1)) + plan.positions(positions.view(-1))
    for first, attn, qkv, out, second, up, act, down in plan.layers:
        x = layer_norm(hidden, shape, *first)
        q, k, v = product(qkv, x).split(width, dim=1)
        heads = (1, count, -1, attn.head_dim)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # (1, heads, T, head dim)
        attended, _ = attention.flat_attention(attn, q, k, v, flat, attn.scaling)
        hidden = product(out, attended.reshape(count, width)) + hidden
        x = layer_norm(hidden, shape, *second)
        hidden = product(down, act(product(up, x))) + hidden
    x = layer_norm(hidden, shape, *plan.norm)
    if logits_at is not None:
        x = x[logits_at]
    return plan.head(x).float()
