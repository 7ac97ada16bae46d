"""`TransformerBlock`: the encoder/decoder layer every kzoo family is assembled from."""

import keras

from kzoo.layers.attention import MultiHeadAttention
from kzoo.layers.kernels import KERNELS
from kzoo.layers.utils import (
    check_choice,
    check_positive_float,
    check_positive_int,
    check_rate,
    serialize_initializer,
)

NORMS = ("layernorm", "rmsnorm")
FEEDFORWARDS = ("plain", "gated", "moe")


@keras.saving.register_keras_serializable(package="kzoo")
class TransformerBlock(keras.layers.Layer):
    """One transformer layer: self-attention, optional cross-attention, feed-forward.

    Post-LN (`norm_first=False`, BERT, the original Transformer):
    `x = norm(x + drop(attn(x)))`, then `x = norm(x + drop(ffn(x)))`.
    Pre-LN (`norm_first=True`, GPT-2, T5, ViT): `x = x + drop(attn(norm(x)))`, then
    `x = x + drop(ffn(norm(x)))`. A cross-attention sub-layer (`cross_attention=True`) sits
    between the two, attending to `encoder_outputs`.

    Args:
        num_heads, head_dim, num_kv_heads: attention heads (see `MultiHeadAttention`).
        intermediate_dim: width of the feed-forward (per expert for MoE).
        causal: causal self-attention (decoder).
        cross_attention: add an encoder-decoder attention sub-layer.
        norm_first: pre-LN (True) or post-LN (False).
        norm: "layernorm" or "rmsnorm" (T5/LLaMA; no mean subtraction, no bias).
        layer_norm_epsilon: epsilon of every norm.
        feedforward: "plain" (`FeedForward`), "gated" (`GatedFeedForward`, GLU variants) or
            "moe" (`MixtureOfExperts`).
        activation: feed-forward activation name (see `kzoo.layers.get_activation`).
        use_bias: biases in attention and feed-forward projections.
        dropout: residual dropout after each sub-layer; also inside the feed-forward.
        attention_dropout: dropout on attention probabilities.
        attention_scale: score scale (None = head_dim^-0.5; T5 uses 1.0).
        rope_max_wavelength, rope_scaling_factor: rotary embeddings in self-attention.
        num_experts, top_k, capacity_factor, expert_type: mixture-of-experts options.
        kernel: attention kernel.
        kernel_initializer, output_kernel_initializer: initialisers (the latter for the
            attention output and the last feed-forward projection).

    Call args:
        inputs: `(batch, seq, dim)`.
        padding_mask: `(batch, seq)`, True/1 for real tokens (self-attention keys; during
            cached decoding, `(batch, max_len)` over the cache).
        attention_mask: extra boolean mask for self-attention, merged with the above.
        attention_bias: additive self-attention bias `(batch|1, heads, q, k)`.
        encoder_outputs, encoder_padding_mask, cross_attention_bias: cross-attention inputs.
        cache, cache_index: self-attention key/value cache (see `MultiHeadAttention`).
        cross_cache: precomputed cross-attention keys/values.

    Returns:
        The block output; with a cache, `(output, cache)`; with a cross cache too,
        `(output, cache, cross_cache)`.

    Example:
    >>> block = TransformerBlock(num_heads=4, intermediate_dim=256, causal=True)
    >>> block(keras.random.normal((2, 10, 64))).shape
    (2, 10, 64)
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
        dropout=0.0,
        attention_dropout=0.0,
        attention_scale=None,
        rope_max_wavelength=None,
        rope_scaling_factor=1.0,
        num_experts=None,
        top_k=2,
        capacity_factor=None,
        expert_type="gated",
        kernel="auto",
        kernel_initializer="glorot_uniform",
        output_kernel_initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_positive_int("intermediate_dim", intermediate_dim)
        check_choice("norm", norm, NORMS)
        check_choice("feedforward", feedforward, FEEDFORWARDS)
        check_positive_float("layer_norm_epsilon", layer_norm_epsilon)
        check_rate("dropout", dropout)
        check_rate("attention_dropout", attention_dropout)
        check_choice("kernel", kernel, KERNELS)
        if feedforward == "moe":
            check_positive_int("num_experts", num_experts)
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
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.attention_scale = attention_scale
        self.rope_max_wavelength = rope_max_wavelength
        self.rope_scaling_factor = rope_scaling_factor
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.expert_type = expert_type
        self.kernel = kernel
        self.kernel_initializer = serialize_initializer(kernel_initializer)
        self.output_kernel_initializer = (
            None if output_kernel_initializer is None
            else serialize_initializer(output_kernel_initializer)
        )

        self.self_attention = self._attention("self_attention", rope=True)
        self.self_attention_norm = self._norm("self_attention_norm")
        self.self_attention_dropout = keras.layers.Dropout(dropout, dtype=self.dtype_policy)
        if cross_attention:
            self.cross_attention_layer = self._attention("cross_attention", rope=False)
            self.cross_attention_norm = self._norm("cross_attention_norm")
            self.cross_attention_dropout = keras.layers.Dropout(dropout, dtype=self.dtype_policy)
        self.feedforward_layer = self._feedforward()
        self.feedforward_norm = self._norm("feedforward_norm")
        self.feedforward_dropout = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    # === Sub-layers ===

    def _attention(self, name, rope):
        return MultiHeadAttention(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.num_kv_heads,
            use_bias=self.use_bias,
            dropout=self.attention_dropout,
            scale=self.attention_scale,
            rope_max_wavelength=self.rope_max_wavelength if rope else None,
            rope_scaling_factor=self.rope_scaling_factor,
            kernel=self.kernel,
            kernel_initializer=self.kernel_initializer,
            output_kernel_initializer=self.output_kernel_initializer,
            dtype=self.dtype_policy,
            name=name,
        )

    def _norm(self, name):
        if self.norm == "rmsnorm":
            from kzoo.layers.norm import RMSNorm

            return RMSNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)
        return keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
        )

    def _feedforward(self):
        common = dict(
            intermediate_dim=self.intermediate_dim,
            activation=self.activation,
            use_bias=self.use_bias,
            dtype=self.dtype_policy,
            name="feedforward",
        )
        if self.feedforward == "moe":
            from kzoo.layers.moe import MixtureOfExperts

            return MixtureOfExperts(
                num_experts=self.num_experts,
                top_k=self.top_k,
                capacity_factor=self.capacity_factor,
                expert_type=self.expert_type,
                dropout=self.dropout,
                **common,
            )
        initializers = dict(kernel_initializer=self.kernel_initializer)
        if self.feedforward == "gated":
            from kzoo.layers.feedforward import GatedFeedForward

            return GatedFeedForward(dropout=self.dropout, **initializers, **common)
        from kzoo.layers.feedforward import FeedForward

        return FeedForward(dropout=self.dropout, **initializers, **common)

    def build(self, inputs_shape, encoder_outputs_shape=None):
        input_shape, encoder_shape = inputs_shape, encoder_outputs_shape
        self.self_attention.build(input_shape)
        self.self_attention_norm.build(input_shape)
        if self.cross_attention:
            enc = encoder_shape or input_shape
            self.cross_attention_layer.build(input_shape, enc)
            self.cross_attention_norm.build(input_shape)
        self.feedforward_layer.build(input_shape)
        self.feedforward_norm.build(input_shape)
        self.built = True

    # === Forward ===

    def _residual(self, x, norm, dropout, fn, training):
        if self.norm_first:
            out = fn(norm(x))
            result = out[0] if isinstance(out, tuple) else out
            y = x + dropout(result, training=training)
        else:
            out = fn(x)
            result = out[0] if isinstance(out, tuple) else out
            y = norm(x + dropout(result, training=training))
        extra = out[1:] if isinstance(out, tuple) else ()
        return y, extra

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
        training=None,
    ):
        from kzoo.layers.masks import merge_masks

        self_mask = merge_masks(padding_mask, attention_mask)

        def self_attn(h):
            return self.self_attention(
                h,
                attention_mask=self_mask,
                attention_bias=attention_bias,
                use_causal_mask=self.causal,
                cache=cache,
                cache_index=cache_index,
                training=training,
            )

        x, extra = self._residual(
            inputs, self.self_attention_norm, self.self_attention_dropout, self_attn, training
        )
        new_cache = extra[0] if extra else None

        new_cross_cache = None
        if self.cross_attention:
            if encoder_outputs is None and cross_cache is None:
                raise ValueError(
                    "This TransformerBlock has cross_attention=True: pass `encoder_outputs` "
                    "(or a precomputed `cross_cache`)."
                )

            def cross_attn(h):
                return self.cross_attention_layer(
                    h,
                    value=encoder_outputs if encoder_outputs is not None else h,
                    attention_mask=encoder_padding_mask,
                    attention_bias=cross_attention_bias,
                    cache=cross_cache,
                    training=training,
                )

            x, extra = self._residual(
                x, self.cross_attention_norm, self.cross_attention_dropout, cross_attn, training
            )
            new_cross_cache = extra[0] if extra else None

        def ffn(h):
            if self.feedforward == "moe":
                return self.feedforward_layer(h, padding_mask=padding_mask
                                              if cache is None else None, training=training)
            return self.feedforward_layer(h, training=training)

        x, _ = self._residual(x, self.feedforward_norm, self.feedforward_dropout, ffn, training)
        if cache is None and cross_cache is None:
            return x
        if cross_cache is None:
            return x, new_cache
        return x, new_cache, new_cross_cache

    def compute_output_shape(self, input_shape, *args, **kwargs):
        return input_shape

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
                "dropout": self.dropout,
                "attention_dropout": self.attention_dropout,
                "attention_scale": self.attention_scale,
                "rope_max_wavelength": self.rope_max_wavelength,
                "rope_scaling_factor": self.rope_scaling_factor,
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "capacity_factor": self.capacity_factor,
                "expert_type": self.expert_type,
                "kernel": self.kernel,
                "kernel_initializer": self.kernel_initializer,
                "output_kernel_initializer": self.output_kernel_initializer,
            }
        )
        return config
