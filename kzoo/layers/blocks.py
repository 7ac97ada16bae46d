"""`TransformerBlock`: the one encoder/decoder layer every kzoo family is built from.

Every family constructs `TransformerBlock(...)` directly; families differ only in arguments:

- BERT: post-LN LayerNorm; all biases; residual and attention-probability dropout, no
  dropout inside the feed-forward (`activation_dropout=0`); every kernel N(0, 0.02).
- GPT-2: pre-LN, causal; no feed-forward dropout; kernels N(0, 0.02) except the two
  residual output projections (`attention_output_initializer`,
  `feedforward_output_initializer`), N(0, 0.02 / sqrt(2 * num_layers)).
- LLaMA / Mixtral-style decoders: the GPT-2 block with `norm="rmsnorm"`, rotary
  (`rope_max_wavelength`), `num_kv_heads`, `feedforward="gated"` or `"moe"`, no biases.
- T5: pre-LN RMSNorm, no biases, unscaled scores, relative bias via `attention_bias`,
  feed-forward dropout = `dropout`, `clamp_float16`; query N(0, (d * d_kv)^-1/2), key/value
  and feed-forward input N(0, d^-1/2), attention output N(0, (h * d_kv)^-1/2), feed-forward
  output N(0, d_ff^-1/2).
- ViT: pre-LN LayerNorm, `qkv_bias` on or off with the other biases kept, Xavier-uniform.
- Graphormer: pre- or post-LN, attention biases switched by `use_bias` while the
  feed-forward keeps its own (`feedforward_bias=True`), its own `activation_dropout`, and
  separate query/key/value, attention output and feed-forward initialisers.

ALiBi, T5's relative position bias and Graphormer's spatial/edge bias all reach the
attention through `attention_bias` (computed once per stack, e.g. with
`kzoo.layers.ALiBiBias` or `kzoo.layers.RelativePositionBias`).
"""

import re

import keras
import numpy as np
from keras import ops

from kzoo.layers import fast_decode
from kzoo.layers.attention import MultiHeadAttention, check_rope_scaling_options
from kzoo.layers.efficient_attention import check_attention
from kzoo.layers.feedforward import FeedForward, GatedFeedForward
from kzoo.layers.kernels import KERNELS
from kzoo.layers.masks import merge_masks
from kzoo.layers.moe import MixtureOfExperts
from kzoo.layers.norm import LayerNorm
from kzoo.layers.norm import RMSNorm
from kzoo.layers.taps import active_tap
from kzoo.layers.utils import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    check_rate,
    gather_rows,
    gradient_boundary,
    serialize_initializer,
)

NORMS = ("layernorm", "rmsnorm")
FEEDFORWARDS = ("plain", "gated", "moe")
EXPERT_TYPES = ("plain", "gated")

# Keras addresses a layer held in a list (a functional model's `layers`) by its snake-cased
# class name. Until every family built `TransformerBlock` directly, their blocks were
# subclasses with these names, so files saved then (`.keras`, `.weights.h5`) hold e.g.
# "layers/gpt_block_1/..." where this class reads "layers/transformer_block_1/...".
LEGACY_CLASS_PATHS = (
    "gpt_block", "bert_encoder_block", "vi_t_encoder_layer", "graphormer_encoder_layer"
)

# The initialiser arguments that default to `kernel_initializer`.
_INITIALIZERS = (
    "query_initializer",
    "key_value_initializer",
    "attention_output_initializer",
    "feedforward_initializer",
    "feedforward_output_initializer",
    "router_initializer",
)


@keras.saving.register_keras_serializable(package="kzoo")
class TransformerBlock(keras.layers.Layer):
    """One transformer layer: self-attention, optional cross-attention, feed-forward.

    Post-LN (`norm_first=False`, BERT, the original Transformer):
    `x = norm(x + drop(attn(x)))`, then `x = norm(x + drop(ffn(x)))`.
    Pre-LN (`norm_first=True`, GPT-2, T5, ViT): `x = x + drop(attn(norm(x)))`, then
    `x = x + drop(ffn(norm(x)))`. A cross-attention sub-layer (`cross_attention=True`) sits
    between the two, attending to `encoder_outputs`.

    Sub-layers (their names are the weight paths converters and saved files use):
    `self_attention` (+ `self_attention_norm`), `cross_attention` (attribute
    `cross_attention_layer`, + `cross_attention_norm`), `feedforward` (attribute
    `feedforward_layer`, + `feedforward_norm`).

    Args:
        num_heads, head_dim, num_kv_heads: attention heads (see `MultiHeadAttention`;
            `num_kv_heads < num_heads` is grouped-query attention).
        intermediate_dim: width of the feed-forward (per expert for MoE).
        causal: causal self-attention (decoder).
        cross_attention: add an encoder-decoder attention sub-layer.
        norm_first: pre-LN (True) or post-LN (False).
        norm: "layernorm" or "rmsnorm" (T5/LLaMA; no mean subtraction, no bias).
        layer_norm_epsilon: epsilon of every norm.
        feedforward: "plain" (`FeedForward`), "gated" (`GatedFeedForward`, GLU variants) or
            "moe" (`MixtureOfExperts`).
        activation: feed-forward activation name (see `kzoo.layers.get_activation`).
        use_bias: biases in the attention output projection and, unless `qkv_bias` /
            `feedforward_bias` say otherwise, everywhere else.
        qkv_bias: biases in the query/key/value projections (None: `use_bias`; ViT's
            `qkv_bias=False` keeps the other biases).
        feedforward_bias: biases in the feed-forward projections (None: `use_bias`;
            Graphormer's feed-forward is always biased).
        dropout: residual dropout, on the output of every sub-layer before the sum.
        attention_dropout: dropout on the attention probabilities.
        activation_dropout: dropout on the feed-forward's hidden activations (None: the same
            rate as `dropout`; BERT and GPT-2 use 0, Graphormer its own rate).
        attention_scale: score scale (None = head_dim^-0.5; T5 uses 1.0).
        rope_max_wavelength, rope_scaling_factor, rope_scaling: rotary embeddings in
            self-attention (see `MultiHeadAttention`).
        num_experts, top_k, capacity_factor, expert_type: mixture-of-experts options.
        kernel: attention kernel.
        attention, attention_options: the self-attention type ("full" or an efficient
            variant) and its options (see `kzoo.layers.efficient_attention`); cross-attention
            is always full.
        kernel_initializer: initialiser of every kernel whose own argument below is None.
        query_initializer: query kernels (self and cross-attention).
        key_value_initializer: key and value kernels.
        attention_output_initializer: attention output projections.
        feedforward_initializer: feed-forward input kernels (plain: `intermediate_dense`;
            gated: `gate_dense`, `up_dense`; MoE: every expert's input kernels).
        feedforward_output_initializer: feed-forward output kernel (MoE: every expert's).
        router_initializer: MoE router kernel.
        remat: rematerialise the block (gradient checkpointing): the backward pass runs
            the block again instead of keeping its activations (`keras.remat`:
            `jax.checkpoint`, `torch.utils.checkpoint`, `tf.recompute_grad`); the same
            gradients (the recomputation replays the dropout masks), less memory, about a
            third more compute. Cached decoding and calls under a `Tap` run plainly.
        layerdrop: LayerDrop rate (Fan et al. 2019, "Reducing Transformer Depth on Demand
            with Structured Dropout"): in training, the whole block is the identity with
            this probability, one draw per call (the whole batch); in inference the block
            always runs, unscaled. A traced `keras.ops.cond`, so it works inside a compiled
            `fit` and a skipped block costs no compute; its weights get zero gradients.
        clamp_float16: T5's guard against float16 overflow (transformers' `T5Block`): when
            the block computes in float16, the output of each sub-layer (the residual sum;
            post-LN: after the norm) is clipped to +-(65504 - 1000) if any of its values is
            infinite, else to +-65504 (a no-op on finite values): an overflowed
            feed-forward gives the largest finite values instead of inf (which the next
            norm turns into NaN); see `clamp_float16_overflow`. Nothing is added in float32
            or bfloat16.

    Call args:
        inputs: `(batch, seq, dim)`.
        padding_mask: `(batch, seq)`, True/1 for real tokens (self-attention keys; during
            cached decoding, `(batch, max_len)` over the cache).
        attention_mask: extra boolean mask for self-attention, merged with the above.
        attention_bias: additive self-attention bias `(batch|1, heads, q, k)` (ALiBi, T5
            relative bias, Graphormer's spatial/edge bias).
        encoder_outputs, encoder_padding_mask, cross_attention_bias: cross-attention inputs.
        cache, cache_index: self-attention key/value cache (see `MultiHeadAttention`).
        cross_cache: precomputed cross-attention keys/values.
        global_attention_mask: `(batch, seq)` global tokens of attention="longformer".
        position_index: first rotary position (int, or `(batch,)` one a row; default
            `cache_index` or 0), see `MultiHeadAttention`.
        output_positions: `(batch, num_positions)` integers in `[0, seq)`: the block's
            output at these rows only, `(batch, num_positions, dim)`, equal to
            `gather(block(inputs), output_positions)`. Keys and values still come from every
            row; only these rows' queries, attention, feed-forward and norms are computed
            where the block allows it (full self-attention without rotary embeddings, no
            `attention_bias` or `global_attention_mask`, no mixture of experts, no active
            `Tap`): a masked-LM's last layer at its masked positions. Otherwise the whole
            block runs and its rows are gathered. Not with a cache.

    Returns:
        The block output; with a cache, `(output, cache)`; with a cross cache too,
        `(output, cache, cross_cache)`.

    Example:
    >>> block = TransformerBlock(num_heads=4, intermediate_dim=256, causal=True)
    >>> block(keras.random.normal((2, 10, 64))).shape
    (2, 10, 64)
    >>> vit_layer = TransformerBlock(num_heads=4, intermediate_dim=256, qkv_bias=False)
    >>> deep = TransformerBlock(num_heads=4, intermediate_dim=256, remat=True, layerdrop=0.1)
    """

    def __init__(
        self,
        num_heads,
        intermediate_dim,
        head_dim=None,
        num_kv_heads=None,
        causal=False,
        cross_attention=False,
        norm_first=True,
        norm="layernorm",
        layer_norm_epsilon=1e-5,
        feedforward="plain",
        activation="gelu",
        use_bias=True,
        qkv_bias=None,
        feedforward_bias=None,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=None,
        attention_scale=None,
        rope_max_wavelength=None,
        rope_scaling_factor=1.0,
        rope_scaling=None,
        num_experts=None,
        top_k=2,
        capacity_factor=None,
        expert_type="gated",
        kernel="auto",
        attention="full",
        attention_options=None,
        kernel_initializer="glorot_uniform",
        query_initializer=None,
        key_value_initializer=None,
        attention_output_initializer=None,
        feedforward_initializer=None,
        feedforward_output_initializer=None,
        router_initializer=None,
        remat=False,
        layerdrop=0.0,
        clamp_float16=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_positive_int("intermediate_dim", intermediate_dim)
        check_bool("causal", causal)
        check_bool("cross_attention", cross_attention)
        check_bool("norm_first", norm_first)
        check_choice("norm", norm, NORMS)
        check_positive_float("layer_norm_epsilon", layer_norm_epsilon)
        check_choice("feedforward", feedforward, FEEDFORWARDS)
        check_bool("use_bias", use_bias)
        check_bool("qkv_bias", qkv_bias, allow_none=True)
        check_bool("feedforward_bias", feedforward_bias, allow_none=True)
        check_rate("dropout", dropout)
        check_rate("attention_dropout", attention_dropout)
        if activation_dropout is not None:
            check_rate("activation_dropout", activation_dropout)
        check_choice("expert_type", expert_type, EXPERT_TYPES)
        check_choice("kernel", kernel, KERNELS)
        if feedforward == "moe":
            check_positive_int("num_experts", num_experts)
        self.remat = check_bool("remat", remat)
        self.layerdrop = check_rate("layerdrop", layerdrop)
        self.clamp_float16 = check_bool("clamp_float16", clamp_float16)
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.causal = causal
        self.cross_attention = cross_attention
        self.norm_first = norm_first
        self.norm = norm
        self.layer_norm_epsilon = layer_norm_epsilon
        self.feedforward = feedforward
        self.activation = activation
        self.use_bias = use_bias
        self.qkv_bias = qkv_bias
        self.feedforward_bias = feedforward_bias
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.attention_scale = attention_scale
        self.rope_max_wavelength = rope_max_wavelength
        self.rope_scaling_factor = rope_scaling_factor
        self.rope_scaling = check_rope_scaling_options(rope_scaling, rope_scaling_factor)
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.expert_type = expert_type
        self.kernel = kernel
        self.attention, self.attention_options = check_attention(attention, attention_options,
                                                                 num_heads=num_heads)
        self.kernel_initializer = serialize_initializer(kernel_initializer,
                                                        "kernel_initializer")
        self.query_initializer = _optional(query_initializer, "query_initializer")
        self.key_value_initializer = _optional(key_value_initializer, "key_value_initializer")
        self.attention_output_initializer = _optional(attention_output_initializer,
                                                      "attention_output_initializer")
        self.feedforward_initializer = _optional(feedforward_initializer,
                                                 "feedforward_initializer")
        self.feedforward_output_initializer = _optional(feedforward_output_initializer,
                                                        "feedforward_output_initializer")
        self.router_initializer = _optional(router_initializer, "router_initializer")

        # === Layers ===
        self.self_attention = self._attention("self_attention", is_self=True)
        self.self_attention_norm = self._norm("self_attention_norm")
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        if cross_attention:
            self.cross_attention_layer = self._attention("cross_attention", is_self=False)
            self.cross_attention_norm = self._norm("cross_attention_norm")
            self.cross_attention_dropout = self._dropout("cross_attention_dropout")
        self.feedforward_layer = self._feedforward()
        self.feedforward_norm = self._norm("feedforward_norm")
        self.feedforward_dropout = self._dropout("feedforward_dropout")
        # LayerDrop's per-call draw (only when used: a block without LayerDrop has exactly
        # the variables it always had).
        self.layerdrop_seed = (
            keras.random.SeedGenerator(name="layerdrop_seed") if self.layerdrop else None
        )

    # === Sub-layers ===

    def _initializer(self, name):
        """The serialised initialiser argument `name`, or `kernel_initializer` if None.

        Each sub-layer deserialises it afresh, so every kernel gets its own random draw."""
        return getattr(self, name) or self.kernel_initializer

    def _attention(self, name, is_self):
        return MultiHeadAttention(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.num_kv_heads,
            use_bias=self.use_bias,
            qkv_bias=self.qkv_bias,
            dropout=self.attention_dropout,
            scale=self.attention_scale,
            rope_max_wavelength=self.rope_max_wavelength if is_self else None,
            rope_scaling_factor=self.rope_scaling_factor,
            rope_scaling=self.rope_scaling,
            kernel=self.kernel,
            attention=self.attention if is_self else "full",
            attention_options=self.attention_options if is_self else None,
            kernel_initializer=self.kernel_initializer,
            query_initializer=self._initializer("query_initializer"),
            key_value_initializer=self._initializer("key_value_initializer"),
            output_kernel_initializer=self._initializer("attention_output_initializer"),
            dtype=self.dtype_policy,
            name=name,
        )

    def _norm(self, name):
        if self.norm == "rmsnorm":
            return RMSNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)
        return LayerNorm(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
        )

    def _dropout(self, name):
        return keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name=name)

    def _feedforward(self):
        bias = self.use_bias if self.feedforward_bias is None else self.feedforward_bias
        inner_dropout = (
            self.dropout if self.activation_dropout is None else self.activation_dropout
        )
        common = dict(
            intermediate_dim=self.intermediate_dim,
            activation=self.activation,
            use_bias=bias,
            dropout=inner_dropout,
            kernel_initializer=self._initializer("feedforward_initializer"),
            output_kernel_initializer=self._initializer("feedforward_output_initializer"),
            dtype=self.dtype_policy,
            name="feedforward",
        )
        if self.feedforward == "moe":
            return MixtureOfExperts(
                num_experts=self.num_experts,
                top_k=self.top_k,
                capacity_factor=self.capacity_factor,
                expert_type=self.expert_type,
                router_initializer=self._initializer("router_initializer"),
                **common,
            )
        if self.feedforward == "gated":
            return GatedFeedForward(**common)
        return FeedForward(**common)

    def build(self, inputs_shape, encoder_outputs_shape=None):
        self.self_attention.build(inputs_shape)
        self.self_attention_norm.build(inputs_shape)
        if self.cross_attention:
            self.cross_attention_layer.build(inputs_shape, encoder_outputs_shape or inputs_shape)
            self.cross_attention_norm.build(inputs_shape)
        self.feedforward_layer.build(inputs_shape)
        self.feedforward_norm.build(inputs_shape)
        self.built = True

    # === Forward ===

    def __call__(self, inputs, *args, **kwargs):
        # torch inference inside a model call (predict, evaluate, no_grad): the block in torch
        # calls, without a Keras call per sub-layer (`fast_decode.block_forward`).
        if fast_decode.forward_applies(self, inputs, args, kwargs):
            return fast_decode.block_forward(self, inputs, **kwargs)
        return super().__call__(inputs, *args, **kwargs)

    def call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        attention_bias=None,
        encoder_outputs=None,
        encoder_padding_mask=None,
        cross_attention_bias=None,
        cache=None,
        cache_index=None,
        cross_cache=None,
        global_attention_mask=None,
        position_index=None,
        output_positions=None,
        training=None,
    ):
        if self.cross_attention and encoder_outputs is None and cross_cache is None:
            raise ValueError(
                "This TransformerBlock has cross_attention=True: pass `encoder_outputs` "
                "(or a precomputed `cross_cache`)."
            )
        if output_positions is not None and (cache is not None or cross_cache is not None):
            raise ValueError(
                "`output_positions` selects rows of a whole-sequence call; it takes no "
                "`cache` or `cross_cache`."
            )
        tap = active_tap()
        rows_only = output_positions is not None and self._rows_only(
            attention_bias, cross_attention_bias, global_attention_mask, tap)
        tensors = {
            "inputs": inputs,
            "padding_mask": padding_mask,
            "attention_mask": attention_mask,
            "attention_bias": attention_bias,
            "encoder_outputs": encoder_outputs,
            "encoder_padding_mask": encoder_padding_mask,
            "cross_attention_bias": cross_attention_bias,
            "global_attention_mask": global_attention_mask,
            "output_positions": output_positions if rows_only else None,
        }
        if cache is not None or cross_cache is not None:
            # Cached decoding (inference): the plain forward pass, always the whole block.
            x, cache, cross_cache = self._forward(
                **tensors, cache=cache, cache_index=cache_index, cross_cache=cross_cache,
                position_index=position_index, training=training,
            )
        elif tap is not None:
            # A tap records tensors of this very trace: no recomputation, no branch; a
            # dropped block (LayerDrop) is still computed and its output replaced.
            x = self._forward(**tensors, position_index=position_index, training=training)[0]
            if self.layerdrop and training:
                x = ops.where(self._layerdrop_keep(), x, inputs)
        else:
            x = self._checkpointed(tensors, position_index, training)

        if tap is not None:
            x = tap._on_block(self, x)
        if output_positions is not None and not rows_only:
            x = gather_rows(x, output_positions)

        if cache is None and cross_cache is None:
            return x
        if cross_cache is None:
            return x, cache
        return x, cache, cross_cache

    def _rows_only(self, attention_bias, cross_attention_bias, global_attention_mask, tap):
        """Whether `output_positions` may restrict the block to those rows (see `call`):
        nothing in it depends on a query's position or on the number of rows."""
        attention = self.self_attention
        return (tap is None and attention.attention == "full" and attention.rotary is None
                and attention_bias is None and cross_attention_bias is None
                and global_attention_mask is None and self.feedforward != "moe")

    def _layerdrop_keep(self):
        """A scalar boolean, False with probability `layerdrop`: one draw per call (the
        whole batch keeps or skips the block, as in Fan et al.)."""
        draw = keras.random.uniform((), seed=self.layerdrop_seed)
        return ops.greater_equal(draw, self.layerdrop)

    def _checkpointed(self, tensors, position_index, training):
        """The block's output with rematerialisation (`remat`) and LayerDrop (`layerdrop`,
        training only) applied.

        Rematerialisation wraps the forward pass in `keras.remat` (`jax.checkpoint`,
        `torch.utils.checkpoint` (non-reentrant), `tf.recompute_grad`): only the block's
        inputs are kept for the backward pass, which runs the block again. LayerDrop is a
        traced branch, `keras.ops.cond` (JAX's `lax.cond` and TF's `tf.cond` run one
        branch, torch decides in Python), so a skipped block costs nothing and its
        gradients are zeros; the branch sits inside the rematerialised function because
        TensorFlow can't differentiate `tf.recompute_grad` inside a `tf.cond`.

        A traced function that assigns a variable leaks the new value out of its trace on
        JAX, and a recomputation that drew dropout masks from advanced seed states would
        draw different ones. So the seed states of the block's dropout layers are bound
        to copies of their values while the block runs (`_StateOverlay`), their advanced
        values come out as results and are assigned afterwards: the recomputation replays
        exactly the masks of the forward pass. Only float tensors are arguments of the
        rematerialised function (TensorFlow watches and differentiates every argument);
        masks, seeds and the LayerDrop draw are captured.
        """
        drop = bool(self.layerdrop) and bool(training)
        if not (self.remat or drop):
            return self._forward(**tensors, position_index=position_index,
                                 training=training)[0]
        keep = self._layerdrop_keep() if drop else None
        states = [
            generator.state
            for layer in self._flatten_layers()
            for generator in getattr(layer, "_seed_generators", ())
            if generator is not self.layerdrop_seed
        ]
        # Copies: torch would find an input saved for the backward pass changed by the
        # in-place assignment below.
        seeds = [ops.copy(v.value) for v in states]
        floats = [
            key for key, value in tensors.items()
            if value is not None and keras.backend.is_float_dtype(
                keras.backend.standardize_dtype(value.dtype))
        ]

        def block(*values):
            named = {**tensors, **dict(zip(floats, values))}

            def run():
                with _StateOverlay(zip(states, seeds)) as scope:
                    x = self._forward(**named, position_index=position_index,
                                      training=training)[0]
                return (x, *[scope.get_current_value(v) for v in states])

            if keep is None:
                return run()
            skipped = named["inputs"]
            if named["output_positions"] is not None:
                skipped = gather_rows(skipped, named["output_positions"])
            return ops.cond(keep, run, lambda: (self._skipped(skipped), *seeds))

        if self.remat:
            block = keras.remat(block)
        outputs = block(*[tensors[key] for key in floats])
        for variable, value in zip(states, outputs[1:]):
            variable.assign(value)
        return outputs[0]

    def _skipped(self, inputs):
        """The output of a block LayerDrop skips: its input. On torch, joined to the block's
        weights with a zero factor so that they get zero gradients, as on JAX and
        TensorFlow (torch would leave them None: the optimizer would skip them, moments and
        weight decay included, and warn)."""
        if keras.backend.backend() != "torch":
            return inputs
        zero = sum(ops.sum(ops.cast(v.value, inputs.dtype)) for v in self.trainable_variables)
        return inputs + ops.multiply(zero, 0)

    def _forward(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        attention_bias=None,
        encoder_outputs=None,
        encoder_padding_mask=None,
        cross_attention_bias=None,
        global_attention_mask=None,
        cache=None,
        cache_index=None,
        cross_cache=None,
        position_index=None,
        output_positions=None,
        training=None,
    ):
        """The block itself: `(output, cache, cross_cache)` (the caches None unless
        given); with `output_positions`, at those rows only (`call` checked that the block
        allows it)."""
        # On JAX on CPU the residual stream's gradient is materialised at each sub-layer
        # boundary instead of being recomputed by every fusion that reads it (see
        # `gradient_boundary`); elsewhere the tensor itself.
        x = gradient_boundary(inputs)

        # Self-attention (writing this step's keys/values into `cache` when decoding).
        residual = x
        if self.norm_first:
            x = self.self_attention_norm(x)
        mask = merge_masks(padding_mask, attention_mask)
        causal = self.causal
        keys = None
        if output_positions is not None:
            # The selected rows ask; every row still gives its key and value.
            keys = x
            x = gather_rows(x, output_positions)
            residual = gather_rows(residual, output_positions)
            mask = _mask_rows(mask, output_positions, ops.shape(keys)[1], causal)
            causal = False
        x = self.self_attention(
            x,
            value=keys,
            attention_mask=mask,
            attention_bias=attention_bias,
            use_causal_mask=causal,
            cache=cache,
            cache_index=cache_index,
            global_attention_mask=global_attention_mask,
            position_index=position_index,
            # (a non-causal block's fully masked rows: transformers' uniform attention)
            uniform_empty_rows=not self.causal,
            training=training,
        )
        if cache is not None:
            x, cache = x
        x = residual + self.self_attention_dropout(x, training=training)
        if not self.norm_first:
            x = self.self_attention_norm(x)
        x = gradient_boundary(self._clamped(x))

        # Cross-attention (keys/values precomputed in `cross_cache` when decoding).
        if self.cross_attention:
            residual = x
            if self.norm_first:
                x = self.cross_attention_norm(x)
            x = self.cross_attention_layer(
                x,
                value=x if encoder_outputs is None else encoder_outputs,
                attention_mask=encoder_padding_mask,
                attention_bias=cross_attention_bias,
                cache=cross_cache,
                uniform_empty_rows=True,
                training=training,
            )
            if cross_cache is not None:
                x, cross_cache = x
            x = residual + self.cross_attention_dropout(x, training=training)
            if not self.norm_first:
                x = self.cross_attention_norm(x)
            x = self._clamped(x)

        # Feed-forward. A mixture of experts routes only real tokens (while decoding the
        # padding mask covers the cache, not these tokens, so every token is routed).
        residual = x
        if self.norm_first:
            x = self.feedforward_norm(x)
        if self.feedforward == "moe":
            routed = padding_mask if cache is None else None
            x = self.feedforward_layer(x, padding_mask=routed, training=training)
        else:
            x = self.feedforward_layer(x, training=training)
        x = residual + self.feedforward_dropout(x, training=training)
        if not self.norm_first:
            x = self.feedforward_norm(x)
        x = self._clamped(x)

        return x, cache, cross_cache

    def compute_output_shape(self, inputs_shape, output_positions_shape=None):
        if output_positions_shape is None:
            return tuple(inputs_shape)
        return (inputs_shape[0], output_positions_shape[1], inputs_shape[-1])

    # === Saving ===

    def load_own_variables(self, store):
        # Called on this block before its sub-layers are read: point them at the block's
        # path in files saved while the families had their own block classes.
        _redirect_legacy_path(store)
        super().load_own_variables(store)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "head_dim": self.head_dim,
                "num_kv_heads": self.num_kv_heads,
                "causal": self.causal,
                "cross_attention": self.cross_attention,
                "norm_first": self.norm_first,
                "norm": self.norm,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "feedforward": self.feedforward,
                "activation": self.activation,
                "use_bias": self.use_bias,
                "qkv_bias": self.qkv_bias,
                "feedforward_bias": self.feedforward_bias,
                "dropout": self.dropout,
                "attention_dropout": self.attention_dropout,
                "activation_dropout": self.activation_dropout,
                "attention_scale": self.attention_scale,
                "rope_max_wavelength": self.rope_max_wavelength,
                "rope_scaling_factor": self.rope_scaling_factor,
                "rope_scaling": self.rope_scaling,
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "capacity_factor": self.capacity_factor,
                "expert_type": self.expert_type,
                "kernel": self.kernel,
                "attention": self.attention,
                "attention_options": self.attention_options,
                "kernel_initializer": self.kernel_initializer,
                **{name: getattr(self, name) for name in _INITIALIZERS},
                "remat": self.remat,
                "layerdrop": self.layerdrop,
                "clamp_float16": self.clamp_float16,
            }
        )
        return config

    def _clamped(self, x):
        """`x` through `clamp_float16_overflow` when `clamp_float16` is on and the block
        computes in float16, else `x` itself."""
        if self.clamp_float16 and self.compute_dtype == "float16":
            return clamp_float16_overflow(x)
        return x


def clamp_float16_overflow(x):
    """A float16 tensor clipped to +-(65504 - 1000) if any of its values is infinite, else
    to +-65504, the largest float16 (a no-op on finite values; NaN stays NaN): transformers'
    T5 clamp (`T5Block`), so that an overflow gives finite values. The reduction runs over
    the whole tensor (every row of the batch), as transformers' does."""
    top = float(np.finfo(np.float16).max)
    limit = ops.cast(ops.where(ops.any(ops.isinf(x)), top - 1000.0, top), x.dtype)
    return ops.minimum(ops.maximum(x, -limit), limit)


def _mask_rows(mask, positions, key_length, causal):
    """The attention mask `(batch|1, heads|1, seq|1, keys)` (or None) of the query rows at
    `positions` `(batch, rows)`: its rows gathered, and with `causal` the keys up to each
    row's own position (`j <= positions[b, i]`) -> `(batch|1, heads|1, rows|1, keys)`."""
    if mask is not None and mask.shape[2] != 1:
        batch, rows = ops.shape(positions)[0], ops.shape(positions)[1]
        shape = (batch, mask.shape[1], rows, ops.shape(mask)[3])
        index = ops.broadcast_to(ops.cast(positions, "int32")[:, None, :, None], shape)
        full = ops.broadcast_to(mask, (batch, mask.shape[1], ops.shape(mask)[2], shape[3]))
        mask = ops.take_along_axis(full, index, axis=2)
    if causal:
        keys = ops.arange(key_length, dtype="int32")
        visible = keys[None, None, None, :] <= ops.cast(positions, "int32")[:, None, :, None]
        mask = visible if mask is None else ops.logical_and(mask, visible)
    return mask


class _StateOverlay(keras.StatelessScope):
    """A `StatelessScope` that binds the given variables and reads every other one from the
    scope around it (Keras' JAX trainer keeps the weights in one), or from the variable."""

    def __init__(self, state_mapping):
        super().__init__(state_mapping=list(state_mapping), initialize_variables=False)

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is None and self.original_scope is not None:
            value = self.original_scope.get_current_value(variable)
        return value


def _optional(initializer, name):
    """None (fall back to `kernel_initializer`) or the serialised initialiser (`name`: the
    argument)."""
    return None if initializer is None else serialize_initializer(initializer, name)


def _redirect_legacy_path(store):
    """Make `store` (a Keras weights store positioned at this block) read the block's
    sub-layers from its legacy path (see `LEGACY_CLASS_PATHS`) when the file has no group
    at the block's own path but has one at the legacy path with the same index."""
    path = getattr(store, "_h5_entry_path", None)
    has_path = getattr(store, "has_path", None)
    if not path or has_path is None or has_path(path):
        return
    parent, _, leaf = path.rpartition("/")
    match = re.fullmatch(r"transformer_block(_\d+)?", leaf)
    if match is None:
        return
    for legacy in LEGACY_CLASS_PATHS:
        old = "/".join(filter(None, [parent, legacy + (match.group(1) or "")]))
        if has_path(old):
            _path_redirects(store)[path] = old
            return


def _path_redirects(store):
    """The `{new path prefix: old path prefix}` table of `store`, installed on first use
    by wrapping the store's `get`."""
    redirects = store.__dict__.get("_kzoo_path_redirects")
    if redirects is None:
        redirects = {}
        get = store.get

        def redirected_get(path):
            for new, old in redirects.items():
                if path == new or path.startswith(new + "/"):
                    return get(old + path[len(new):])
            return get(path)

        store._kzoo_path_redirects = redirects
        store.get = redirected_get
    return redirects
