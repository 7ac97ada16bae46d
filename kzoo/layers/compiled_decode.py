"""PyTorch: a GPT or T5 model's whole decode step as one `torch.compile`d function.

The torch decode loop (`kzoo.generation`) runs each step in eager torch calls
(`kzoo.layers.fast_decode`): at a few rows a step, the matrix products stream the weights and
the rest of the step is some hundred small kernels, each launched from Python. Compiled by
Inductor, the element-wise work of a block (norms, bias, GELU, residuals, the cache writes,
the mask) becomes a few fused C++ loops and the step one call. Measured on the 2-core CPU at
`benchmarks/peers.py`'s size (GPT, 4 prompts, 128 new tokens; see docs/PERFORMANCE.md): a lean eager
step 4.6 ms, the same compiled 2.8 ms.

`model_step(model, state, constants)` returns `step(last_tokens, index) -> float32 logits`
(the interface of the loop's `model_step`) for a `GPTCausalLM` or `T5Seq2SeqLM` whose step
it can express, or None. GPT: learned positions with `position_offset` or rotary positions
(either pairing, linear or llama3 scaling; rotated at the cache slot, as the eager loop does),
full softmax self-attention (grouped query heads too) or sliding-window attention on its
rolling cache, LayerNorm or RMSNorm before or after each sub-layer, a plain or gated (GLU:
SwiGLU, GEGLU, ...) feed-forward with a plain activation or a mixture of experts (top-k
routing, with or without a capacity factor, as the layer's own call routes a step's rows),
plain float32 `Dense` kernels, a tied or untied head without a soft cap: every GPT preset
(`gpt_mini`, `gpt_modern_mini`, `gpt_long_mini`, `gpt_moe_mini`, GPT-2). T5: the same blocks
with cross-attention over the precomputed encoder keys and values, the decoder's relative
position bias (one table per loop, the causal mask folded in), the tied head of v1.0 or the
untied `lm_head` and gated-GELU feed-forward of v1.1. Anything else (the other efficient
attention types, LoRA or quantised kernels, half precision) decodes eagerly as before.

At `benchmarks/peers.py`'s decode shape (4 prompts of 32, 128 new tokens, width 256, 4
layers), interleaved with the eager loop in one process, same tokens (new tokens/s): a
Llama-style GPT (rotary, SwiGLU 704, RMSNorm, 2 key/value heads) 531 -> 2,147; the same with
a sliding window of 64, 244 -> 2,064; with 8 SwiGLU experts, top 2, 184 -> 611 (its step
reads every expert's kernels: 4 rows x 2 choices); a T5 v1.1 768 -> 1,656.

The compiled function reads the weights as arguments (made once per `generate` call, as the
eager path's transposed copies are), so training between calls needs no recompilation; a new
batch size or cache length compiles once more (PyTorch caches a few of them). Compilation
takes 4-15 s on the 2-core CPU the first time a shape is seen (less when PyTorch's compile
cache has it from an earlier process), so by default (`policy()`: "auto") a model's loop
compiles from its second `generate` call with the same batch size and cache length: one-off
calls never wait. It needs a C++ compiler: where compiling fails, a warning, and the loop
decodes eagerly. `KZOO_COMPILED_DECODE=1` compiles from the first call, `0` never.
"""

import os
import weakref
from typing import NamedTuple, Optional

import keras

ENV = "KZOO_COMPILED_DECODE"

_TANH_GELUS = ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh")
_ACTIVATIONS = ("relu", "gelu", "silu", "swish", "linear") + _TANH_GELUS

_COMPILED = {}
# model -> the (batch, cache length) of its decode loops so far (the "auto" policy)
_SEEN = weakref.WeakKeyDictionary()


def policy():
    """`KZOO_COMPILED_DECODE`: "auto" (default: a model's loop compiles its step from the
    second `generate` call at the same batch size and cache length in this process, so a
    one-off call never waits for the compiler), "1" (from the first call) or "0" (never)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{ENV} must be 'auto', '1' or '0'; got {ENV}={value!r}.")
    return value


def _wanted(model, caches):
    mode = policy()
    if mode != "auto":
        return mode == "1"
    shape = (tuple(caches[0][0].shape), len(caches))
    seen = _SEEN.setdefault(model, set())
    if shape in seen:
        return True
    seen.add(shape)
    return False


def _activate(name, h):
    import torch
    import torch.nn.functional as F

    from kzoo.layers.feedforward import _K1, _K2

    if name in _TANH_GELUS:  # `x * sigmoid(x (k1 + k2 x^2))`, as `feedforward`'s forward
        return h * torch.sigmoid(h * (_K1 + _K2 * h * h))
    if name == "gelu":
        return F.gelu(h)
    if name == "relu":
        return F.relu(h)
    if name in ("silu", "swish"):
        return F.silu(h)
    return h


def _plain(dense):
    from kzoo.layers import fast_decode

    return (fast_decode._plain_dense(dense) and dense.compute_dtype == "float32"
            and dense.kernel.dtype == "float32")


def _norm_spec(layer):
    """("layer" | "rms", epsilon, weight, bias) of a norm the step can run, else None."""
    from kzoo.layers import fast_decode
    from kzoo.layers.norm import RMSNorm

    if layer.compute_dtype != "float32":
        return None
    if isinstance(layer, keras.layers.LayerNormalization):
        if layer.rms_scaling or layer.axis not in (-1, [-1], (-1,), 2, [2], (2,)):
            return None
        return ("layer", float(layer.epsilon),
                None if layer.gamma is None else fast_decode._value(layer.gamma),
                None if layer.beta is None else fast_decode._value(layer.beta))
    if isinstance(layer, RMSNorm):
        return ("rms", float(layer.epsilon),
                None if layer.scale is None else fast_decode._value(layer.scale), None)
    return None


class _Block(NamedTuple):
    """A block's static configuration (hashable: a key of the compiled steps)."""
    norm_first: bool
    norm1: tuple  # (kind, epsilon) of `_norm_spec`
    norm2: tuple
    activation: str
    gated: bool  # `activation(x W_gate) * (x W_up)`, the gate and up products joined
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    q_units: int
    kv_units: int
    rotary: Optional[tuple] = None  # (max_wavelength, scaling settings, interleaved)
    window: Optional[int] = None  # sliding-window attention on a rolling cache
    # a mixture of experts: (num_experts, top_k, normalize_top_k, capacity_factor)
    moe: Optional[tuple] = None
    cross_norm: Optional[tuple] = None  # T5's cross-attention sub-layer
    cross_heads: int = 0
    cross_head_dim: int = 0
    cross_scale: float = 1.0


def _rotary_spec(attention):
    """(max_wavelength, scaling settings (`RotaryEmbedding.scaling`), interleaved, the
    factor of cos and sin (`RotaryEmbedding.rotation_scale`)) of a self-attention's rotary
    positions, None without them."""
    rotary = attention.rotary
    if rotary is None:
        return None
    return (float(rotary.max_wavelength), rotary.scaling(), bool(rotary.interleaved),
            rotary.rotation_scale())


def _inverse_frequencies(attention):
    """RoPE's inverse frequencies of a self-attention's rotary positions, scaling included,
    a float32 torch tensor (`RotaryEmbedding.inverse_frequencies`, i.e.
    `kzoo.layers.position.rope_inverse_frequencies`)."""
    import torch

    return torch.from_numpy(attention.rotary.inverse_frequencies(attention._head_dim))


def rope_tables(angles, interleaved, scale=1.0):
    """torch: the `(cos, sin)` that `rope_apply` multiplies by, from float32 `angles (...,
    head_dim / 2)`: for the "rotate half" pairing (`interleaved=False`) `[cos, cos]` and
    `[-sin, sin]` over the whole head, as `RotaryEmbedding.call` makes them; for
    interleaved pairs the half-width `cos` and `sin`; both multiplied by `scale` (YaRN's
    attention factor) unless it is 1. Shared by the compiled step and the eager loop
    (`fast_decode._rotate`, which keeps a step's tables for all its layers)."""
    import torch

    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    if interleaved:
        return cos, sin
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rope_apply(y, cos, sin, interleaved):
    """torch: float32 `y (..., head_dim)` rotated by `rope_tables`' `(cos, sin)`, in
    `RotaryEmbedding.call`'s operations and order: `y * [cos, cos] + [y2, y1] * [-sin, sin]`
    for the "rotate half" pairing, `(y1 cos - y2 sin, y2 cos + y1 sin)` interleaved."""
    import torch

    if not interleaved:
        half = y.shape[-1] // 2
        return y * cos + torch.cat([y[..., half:], y[..., :half]], dim=-1) * sin
    y1, y2 = y[..., 0::2], y[..., 1::2]
    return torch.stack([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1).reshape(y.shape)


class _Experts(NamedTuple):
    """What `_experts` and `_gated_or_plain` read of a block's configuration (the eager decode
    path, `fast_decode._experts`, runs them on a mixture of experts alone)."""
    moe: tuple
    activation: str
    gated: bool


def _moe_spec(layer):
    """((config, activation, gated), weights) of a `MixtureOfExperts` the step can run (plain
    float32 router and expert kernels, no LoRA), else None. The expert kernels stay stacked,
    `(experts, in, out)`; a gated expert's gate and up kernels are joined on their output
    axis (the gate's units first)."""
    import torch

    from kzoo.layers import fast_decode
    from kzoo.layers.moe import MixtureOfExperts

    if not isinstance(layer, MixtureOfExperts) or not _plain(layer.router):
        return None
    value = fast_decode._value
    gated = layer.expert_type == "gated"
    if gated:
        first = [layer.gate_kernel, layer.up_kernel]
        first_bias = [layer.gate_bias, layer.up_bias]
    else:
        first, first_bias = [layer.intermediate_kernel], [layer.intermediate_bias]
    kernels = first + [layer.output_kernel]
    if any(v.dtype != "float32" for v in kernels) or layer.compute_dtype != "float32":
        return None
    weights = {
        "router": value(layer.router.kernel).t().contiguous(),
        "experts_in": torch.cat([value(v) for v in first], dim=2).contiguous(),
        "experts_in_bias": None if first_bias[0] is None else torch.cat(
            [value(v) for v in first_bias], dim=1),
        "experts_out": value(layer.output_kernel).contiguous(),
        "experts_out_bias": None if layer.output_bias is None else value(layer.output_bias),
    }
    config = (layer.num_experts, layer.top_k, bool(layer.normalize_top_k),
              None if layer.capacity_factor is None else float(layer.capacity_factor))
    return (config, layer._activation_name, gated), weights


def _block_spec(block, cross=False):
    """(static `_Block`, weights) of a `TransformerBlock` the step can run, else None;
    `cross`: a decoder block with cross-attention (T5), whose keys and values come
    precomputed."""
    import torch

    from kzoo.layers import fast_decode

    attention = block.self_attention
    if (block.cross_attention != cross or not block.causal
            or block.attention not in ("full", "sliding_window")
            or attention.attention != block.attention):
        return None
    ff = block.feedforward_layer
    if block.feedforward == "moe":
        moe = _moe_spec(ff)
        if moe is None:
            return None
        (moe_config, activation, gated), ff_weights = moe
    elif block.feedforward in ("plain", "gated"):
        moe_config, activation, gated = None, block.activation, block.feedforward == "gated"
        ins = [ff.gate_dense, ff.up_dense] if gated else [ff.intermediate_dense]
        if (not all(_plain(d) for d in ins + [ff.output_dense])
                or len({d.bias is None for d in ins}) != 1
                or getattr(ff, "_activation_fn", None) is None):
            return None
    else:
        return None
    if activation not in _ACTIVATIONS:
        return None
    denses = [attention.query_dense, attention.key_dense, attention.value_dense,
              attention.output_dense]
    if not all(_plain(d) for d in denses) or len({d.bias is None for d in denses[:3]}) != 1:
        return None
    norms = [_norm_spec(block.self_attention_norm), _norm_spec(block.feedforward_norm)]
    if None in norms:
        return None
    value = fast_decode._value

    def t(dense):  # the kernel as a row-major (out, in) copy
        return value(dense.kernel).t().contiguous()

    def joined(layers):  # the kernels of `layers` as one row-major product, and its bias
        bias = (None if layers[0].bias is None
                else torch.cat([value(d.bias) for d in layers]))
        return torch.cat([t(d) for d in layers]), bias

    q, k, v = denses[:3]
    qkv, qkv_bias = joined([q, k, v])
    rotary = _rotary_spec(attention)
    weights = {
        "qkv": qkv, "qkv_bias": qkv_bias,
        "out": t(attention.output_dense),
        "out_bias": None if attention.output_dense.bias is None else value(
            attention.output_dense.bias),
        "norm1": norms[0][2:], "norm2": norms[1][2:],
        "inverse_frequencies": None if rotary is None else _inverse_frequencies(attention),
    }
    if moe_config is None:
        up, up_bias = joined(ins)
        weights.update(up=up, up_bias=up_bias, down=t(ff.output_dense),
                       down_bias=None if ff.output_dense.bias is None else value(
                           ff.output_dense.bias))
    else:
        weights.update(ff_weights)
    window = (int(block.attention_options["window"]) if block.attention == "sliding_window"
              else None)
    config = dict(norm_first=block.norm_first, norm1=norms[0][:2], norm2=norms[1][:2],
                  activation=activation, gated=gated, heads=attention.num_heads,
                  kv_heads=attention._kv_heads, head_dim=attention._head_dim,
                  scale=_scale(attention), q_units=q.kernel.shape[1],
                  kv_units=k.kernel.shape[1], rotary=rotary, window=window, moe=moe_config)
    if cross:
        layer = block.cross_attention_layer
        norm = _norm_spec(block.cross_attention_norm)
        pair = (layer.query_dense, layer.output_dense)
        if (norm is None or not all(_plain(d) for d in pair) or layer.rotary is not None
                or layer.attention != "full"):
            return None
        weights.update(cross_query=t(pair[0]), cross_query_bias=None if pair[0].bias is None
                       else value(pair[0].bias), cross_out=t(pair[1]),
                       cross_out_bias=None if pair[1].bias is None else value(pair[1].bias),
                       norm_cross=norm[2:])
        config.update(cross_norm=norm[:2], cross_heads=layer.num_heads,
                      cross_head_dim=layer._head_dim, cross_scale=_scale(layer))
    return _Block(**config), weights


def _scale(attention):
    return float(attention.scale if attention.scale is not None
                 else attention._head_dim ** -0.5)


def _plan(model):
    """(static config, weights) of `model`'s decode step, or None where it does not apply."""
    from kzoo.layers import fast_decode
    from kzoo.models.gpt import GPTCausalLM

    if not isinstance(model, GPTCausalLM) or keras.backend.backend() != "torch":
        return None
    backbone = model.backbone
    embedding = backbone.token_embedding
    if (backbone.attention not in ("full", "sliding_window")
            or backbone.position not in ("learned", "rotary")
            or embedding.logit_soft_cap is not None or embedding.compute_dtype != "float32"):
        return None
    blocks = [_block_spec(block) for block in backbone.transformer_layers]
    final = _norm_spec(backbone.final_norm)
    if None in blocks or final is None:
        return None
    value = fast_decode._value
    table = value(embedding.embeddings)
    head = table if embedding.tie_weights else value(embedding.reverse_embeddings).t().contiguous()
    if table.dtype != head.dtype or str(table.dtype) != "torch.float32":
        return None
    positions = (None if backbone.position_embedding is None
                 else value(backbone.position_embedding.embeddings))
    config = (tuple(c for c, _ in blocks), final[:2])
    weights = {"table": table, "head": head, "positions": positions,
               "blocks": [w for _, w in blocks], "final": final[2:]}
    return config, weights


def _t5_plan(model):
    """(static config, weights) of a `T5Seq2SeqLM`'s decoder step, or None."""
    import torch

    from kzoo.layers import fast_decode
    from kzoo.models.t5 import T5Seq2SeqLM

    if not isinstance(model, T5Seq2SeqLM) or keras.backend.backend() != "torch":
        return None
    backbone = model.backbone
    embedding = backbone.token_embedding
    if embedding.logit_soft_cap is not None or embedding.compute_dtype != "float32":
        return None
    blocks = [_block_spec(block, cross=True) for block in backbone.decoder_layers]
    final = _norm_spec(backbone.decoder_output_norm)
    if None in blocks or final is None or (model.lm_head is not None
                                           and not _plain(model.lm_head)):
        return None
    value = fast_decode._value
    table = value(embedding.embeddings)
    if model.lm_head is None:  # the tied table, the hidden states scaled by d^-1/2 first
        head, head_scale = table, float(backbone.hidden_dim ** -0.5)
    else:
        head, head_scale = value(model.lm_head.kernel).t().contiguous(), 1.0
    if table.dtype != torch.float32 or head.dtype != torch.float32:
        return None
    config = (tuple(c for c, _ in blocks), final[:2], head_scale)
    weights = {"table": table, "head": head, "blocks": [w for _, w in blocks],
               "final": final[2:], "bias": backbone.decoder_relative_attention_bias}
    return config, weights


def _t5_bias(layer, length):
    """`(heads, length, length)`: `T5Backbone`'s causal relative-bias table."""
    from kzoo.models.t5 import causal_bias_table

    return causal_bias_table(layer, length)[0].contiguous()


def _norm(spec, params, x):
    import torch.nn.functional as F

    kind, eps = spec
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), params[0], params[1], eps)
    return F.rms_norm(x, (x.shape[-1],), params[0], eps)


def _product(x, weight, bias):
    """`x @ weight.T + bias` for a row-major `weight (out, in)`; 2 to 4 rows as `(weight @
    x^T)^T`, MKL's fast path for them (see `fast_decode._few_rows`)."""
    import torch
    import torch.nn.functional as F

    if 2 <= x.shape[0] <= 4 and x.device.type == "cpu":
        out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight,
                                                                         x.t())
        return out.t()
    return F.linear(x, weight, bias)


def _step(config, weights, tokens, slot, offsets, padding_mask, caches):
    """One decode step: `tokens (batch,)` at cache slot `slot` (0-d), `offsets (batch,)` the
    rows' left padding, `padding_mask (batch, length)`; writes each layer's keys and values
    into `caches` (a list of `(keys, values)`, each `(batch, kv_heads, length, head_dim)`) at
    `slot`; returns the float32 logits `(batch, vocab)`."""
    import torch
    import torch.nn.functional as F

    block_configs, final_spec = config
    x = weights["table"].index_select(0, tokens)
    if weights["positions"] is not None:
        table = weights["positions"]
        position = torch.clamp(slot - offsets, 0, table.shape[0] - 1)
        x = x + table.index_select(0, position)
    visible = None
    for config, w, cache in zip(block_configs, weights["blocks"], caches):
        if config.window is not None:
            mask = _window_mask(config.window, cache[0].shape[2], slot, padding_mask)
        else:
            if visible is None:  # (a full cache: every slot written so far, less the padding)
                length = cache[0].shape[2]
                visible = ((torch.arange(length, device=x.device) <= slot)[None, :]
                           & (padding_mask[:, :length] != 0))[:, None, None, :]
            mask = visible
        x = _self_attention(config, w, x, cache, slot, mask)
        x = _feedforward(config, w, x)
    x = _norm(final_spec, weights["final"], x)
    return _product(x, weights["head"], None).float()


def _window_mask(window, slots, position, padding_mask, device=None):
    """`(batch, 1, 1, slots)`: the slots of a rolling cache (`slots` of them, position `p` in
    slot `p % slots`) that the token at `position` (an int or 0-d tensor) sees: the last
    `window` positions, none before the first, none of the padding (as
    `MultiHeadAttention._rolling_decode`). `padding_mask (batch, length)` over positions
    (nonzero = a token), or None (no padding: `(1, 1, 1, slots)`, on `device`)."""
    import torch

    device = device if padding_mask is None else padding_mask.device
    held = position - (position - torch.arange(slots, device=device)) % slots
    valid = ((held >= 0) & (position - held < window))[None, :]
    if padding_mask is not None:
        valid = valid & (padding_mask.index_select(1, held.clamp(min=0)) != 0)
    return valid[:, None, None, :]


def _sublayer(norm_first, norm, params, x, fn):
    """`x + fn(norm(x))` (pre-LN) or `norm(x + fn(x))` (post-LN)."""
    if norm_first:
        return x + fn(_norm(norm, params, x))
    return _norm(norm, params, x + fn(x))


def _attend(q, keys, values, mask, scale, heads, out, out_bias):
    import torch.nn.functional as F

    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=heads != keys.shape[1])
    return _product(attended.reshape(q.shape[0], -1), out, out_bias)


def _rotate(spec, inverse_frequencies, x, slot):
    """`x (batch, heads, 1, head_dim)` (float32) rotated to position `slot`, as
    `RotaryEmbedding` rotates it (float32 angles `slot * theta_i`, the scaling in the
    inverse frequencies `theta_i`)."""
    import torch

    interleaved = spec[2]
    position = slot.to(torch.float32)
    cos, sin = rope_tables(position * inverse_frequencies, interleaved, spec[3])
    return rope_apply(x, cos, sin, interleaved)


def _self_attention(config, w, x, cache, slot, mask):
    """A block's self-attention sub-layer for one new token per row, its keys and values
    written into `cache` at `slot`; `mask`: boolean or additive, over the cache slots."""
    batch, (keys, values) = x.shape[0], cache
    heads, kv_heads, head_dim = config.heads, config.kv_heads, config.head_dim
    q_units, kv_units = config.q_units, config.kv_units

    def attend(h):
        qkv = _product(h, w["qkv"], w["qkv_bias"])
        q = qkv[:, :q_units].reshape(batch, heads, 1, head_dim)
        k = qkv[:, q_units:q_units + kv_units].reshape(batch, kv_heads, 1, head_dim)
        v = qkv[:, q_units + kv_units:].reshape(batch, kv_heads, 1, head_dim)
        if config.rotary is not None:
            k = _rotate(config.rotary, w["inverse_frequencies"], k, slot)
            q = _rotate(config.rotary, w["inverse_frequencies"], q, slot)
        at = slot if config.window is None else slot % keys.shape[2]  # (a rolling cache)
        keys.index_copy_(2, at.reshape(1), k)
        values.index_copy_(2, at.reshape(1), v)
        return _attend(q, keys, values, mask, config.scale, heads, w["out"], w["out_bias"])

    return _sublayer(config.norm_first, config.norm1, w["norm1"], x, attend)


def _feedforward(config, w, x):
    def ff(h):
        if config.moe is not None:
            return _experts(config, w, h)
        h = _gated_or_plain(config, _product(h, w["up"], w["up_bias"]))
        return _product(h, w["down"], w["down_bias"])

    return _sublayer(config.norm_first, config.norm2, w["norm2"], x, ff)


def _experts(config, w, x):
    """A mixture of experts on the rows `x (rows, dim)`, as `MixtureOfExperts`' inference call
    routes them: float32 router, `top_k` experts a row (renormalised when asked), and with a
    `capacity_factor` each expert keeps its first `capacity` assignments in choice-major,
    then row, order (the others add nothing). Where the rows' assignments are fewer than the
    experts, the chosen experts' kernels are gathered; else every expert runs on every row
    (its kernels read once, as they would be) and the chosen outputs are picked."""
    import math

    import torch

    experts, top_k, normalize, capacity_factor = config.moe
    rows = x.shape[0]
    probabilities = torch.softmax(_product(x, w["router"], None).float(), dim=-1)
    # (equal probabilities: the lowest expert ids, as `MixtureOfExperts` picks them on every
    # backend; `torch.topk` breaks ties in no set order)
    ids = torch.arange(experts, device=x.device)
    masked, chosen = probabilities, []
    for _ in range(top_k):
        best = masked.amax(dim=-1, keepdim=True)
        pick = torch.where(masked == best, ids, experts).amin(dim=-1).clamp(max=experts - 1)
        chosen.append(pick)
        masked = masked.masked_fill(ids == pick[:, None], -1.0)
    top_index = torch.stack(chosen, dim=-1)
    top_p = probabilities.gather(-1, top_index)
    if normalize:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    index, weight = top_index.t().reshape(-1), top_p.t().reshape(-1)  # choice-major
    if capacity_factor is not None:
        capacity = min(rows, max(1, math.ceil(capacity_factor * rows * top_k / experts)))
        taken = torch.nn.functional.one_hot(index, experts).cumsum(0)
        position = taken.gather(1, index[:, None])[:, 0] - 1
        weight = torch.where(position < capacity, weight, torch.zeros_like(weight))
    first, first_bias = w["experts_in"], w["experts_in_bias"]
    second, second_bias = w["experts_out"], w["experts_out_bias"]
    if rows * top_k < experts:  # each assignment with its expert's kernels
        h = torch.bmm(x.repeat(top_k, 1)[:, None, :], first.index_select(0, index))[:, 0]
        if first_bias is not None:
            h = h + first_bias.index_select(0, index)
        h = _gated_or_plain(config, h)
        y = torch.bmm(h[:, None, :], second.index_select(0, index))[:, 0]
        if second_bias is not None:
            y = y + second_bias.index_select(0, index)
    else:  # every expert on every row, then each assignment's row of its expert
        h = torch.matmul(x[None], first)  # (experts, rows, units)
        if first_bias is not None:
            h = h + first_bias[:, None, :]
        y = torch.bmm(_gated_or_plain(config, h), second)  # (experts, rows, dim)
        if second_bias is not None:
            y = y + second_bias[:, None, :]
        y = y[index, torch.arange(rows, device=x.device).repeat(top_k)]
    y = (y * weight[:, None].to(y.dtype)).reshape(top_k, rows, -1)
    out = y[0]
    for j in range(1, top_k):  # (the choices summed in order, as the layer sums them)
        out = out + y[j]
    return out


def _gated_or_plain(config, h):
    """`activation(gate) * up` of joined units `[gate | up]` (as `_block_spec` and
    `_moe_spec` join the kernels), or `activation(h)` for a plain feed-forward."""
    if config.gated:
        gate, h = h.chunk(2, dim=-1)
        return _activate(config.activation, gate) * h
    return _activate(config.activation, h)


def _t5_step(config, weights, tokens, slot, encoder_mask, bias, caches, cross_caches):
    """One T5 decoder step: `tokens (batch,)` at position `slot` (0-d); `encoder_mask (batch,
    enc_len)`, `bias (heads, length, length)` (see `_t5_bias`), `caches` as `_step`'s and
    `cross_caches` the cross-attention's precomputed `(keys, values)`; returns the float32
    logits."""
    block_configs, final_spec, head_scale = config
    x = weights["table"].index_select(0, tokens)
    self_bias = bias.index_select(1, slot.reshape(1))[None]  # (1, heads, 1, length)
    cross_mask = (encoder_mask != 0)[:, None, None, :]
    for config, w, cache, (keys, values) in zip(block_configs, weights["blocks"], caches,
                                                cross_caches):
        x = _self_attention(config, w, x, cache, slot, self_bias)

        def cross(h, config=config, w=w, keys=keys, values=values):
            q = _product(h, w["cross_query"], w["cross_query_bias"]).reshape(
                h.shape[0], config.cross_heads, 1, config.cross_head_dim)
            return _attend(q, keys, values, cross_mask, config.cross_scale,
                           config.cross_heads, w["cross_out"], w["cross_out_bias"])

        x = _sublayer(config.norm_first, config.cross_norm, w["norm_cross"], x, cross)
        x = _feedforward(config, w, x)
    x = _norm(final_spec, weights["final"], x)
    if head_scale != 1.0:
        x = x * head_scale
    return _product(x, weights["head"], None).float()


def _compiled(config, fn=None):
    """The compiled `fn` (default `_step`) for one static `config` (cached: one per model
    shape)."""
    import functools

    import torch

    fn = _step if fn is None else fn
    if (fn, config) not in _COMPILED:
        _COMPILED[fn, config] = torch.compile(functools.partial(fn, config))
    return _COMPILED[fn, config]


def model_step(model, state, constants):
    """`step(last_tokens, index) -> float32 logits (batch, vocab)`: the decode step of a GPT
    or T5 `model`, compiled, reading and writing `state`'s caches in place (CPU tensors); or
    None where it does not apply (see the module docstring). Where the first call cannot
    compile (no C++ compiler, say), it warns and returns None, having changed nothing: the
    loop then steps eagerly."""
    import warnings

    import torch

    if keras.backend.backend() != "torch":
        return None
    caches = state.get("cache") if isinstance(state, dict) else None
    if not caches or not isinstance(caches, list):
        return None
    pairs = []
    for cache in caches:  # (keys, values), or `(batch, 2, kv_heads, slots, head_dim)`
        if isinstance(cache, (tuple, list)) and len(cache) == 2:
            pairs.append(tuple(cache))
        elif isinstance(cache, torch.Tensor) and cache.dim() == 5 and cache.shape[1] == 2:
            pairs.append((cache[:, 0], cache[:, 1]))  # (views: written in place)
        else:
            return None
    if not all(c[0].device.type == "cpu" for c in pairs):
        return None
    caches = pairs
    if "cross_cache" in constants:  # T5
        plan = _t5_plan(model)
        cross = constants["cross_cache"]
        if plan is None or not isinstance(cross, list) or not _wanted(model, caches):
            return None
        config, weights = plan
        run = _compiled(config, _t5_step)
        bias = _t5_bias(weights.pop("bias"), caches[0][0].shape[2])
        args = (constants["encoder_padding_mask"], bias, caches, [tuple(c) for c in cross])
        first = 1  # (the start token sits at position 0: step `index` feeds `index + 1`)
    else:
        plan = _plan(model)
        if plan is None or not _wanted(model, caches):
            return None
        config, weights = plan
        run = _compiled(config)
        first = constants["prompt_length"][0].to(torch.long)
        args = (constants["position_offset"].to(torch.long), constants["padding_mask"], caches)
    compiled = []

    def step(last_tokens, index):
        tokens = last_tokens.reshape(-1).to(torch.long)
        slot = torch.as_tensor(first + index, dtype=torch.long)
        if compiled:
            return run(weights, tokens, slot, *args)
        try:
            logits = run(weights, tokens, slot, *args)
        except Exception as error:  # compilation: nothing was written yet
            warnings.warn(f"kzoo decode: no compiled step for {type(model).__name__} "
                          f"({type(error).__name__}: {error}); decoding eagerly (set "
                          f"{ENV}=0 to skip the attempt).", stacklevel=3)
            return None
        compiled.append(True)
        return logits

    return step
