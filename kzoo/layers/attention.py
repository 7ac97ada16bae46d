"""Multi-head attention: self/cross, grouped-query, rotary, additive bias and a KV cache."""

import keras
import numpy as np
from keras import ops

from kzoo.layers.kernels import (
    KERNELS,
    _grouped_output,
    dot_product_attention,
    reference_attention,
    uniform_empty_rows as _uniform_empty_rows,
)
from kzoo.layers import efficient_attention as efficient
from kzoo.layers import fast_decode
from kzoo.layers.masks import causal_mask, merge_masks, normalize_mask
from kzoo.layers.taps import active_tap
from kzoo.layers.position import ROPE_SCALING_FIELDS, check_rope_scaling
from kzoo.layers.utils import (
    FieldError,
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    check_rate,
    project,
    serialize_initializer,
)


def _optional_initializer(initializer, name):
    """None (use the layer's default) or the serialised initialiser (`name`: the argument)."""
    return None if initializer is None else serialize_initializer(initializer, name)


def _check_float_mask(mask):
    """A float `attention_mask` holds 0 / 1 only (checked when its values are concrete): it
    is cast to bool, so an additive mask (0 = attend, -1e9 / -inf = not) was read the other
    way round, in silence."""
    dtype = getattr(mask, "dtype", None)
    if dtype is None or "float" not in keras.backend.standardize_dtype(dtype):
        return
    from kzoo.inputs import is_symbolic, to_host

    if is_symbolic(mask):
        return
    values = np.asarray(to_host(mask))
    bad = values[(values != 0) & (values != 1)]
    if bad.size:
        raise ValueError(
            "`attention_mask` must be boolean (True = may attend) or hold only 0 / 1; got "
            f"{bad.reshape(-1)[0].item()!r} (dtype {values.dtype}). An additive mask (0 to "
            "attend, -inf or a large negative number not to) goes in `attention_bias`."
        )


_ROPE_SCALING_KEYS = ("scaling_type",) + ROPE_SCALING_FIELDS


def check_rope_scaling_options(rope_scaling, rope_scaling_factor=1.0):
    """A `rope_scaling` argument (of `MultiHeadAttention` / `TransformerBlock`) checked with
    `rope_scaling_factor`: None, or a dict with keys among `scaling_type` and
    `kzoo.layers.position.ROPE_SCALING_FIELDS` (`RotaryEmbedding`'s arguments, see
    `kzoo.layers.position.check_rope_scaling`); returned as a plain dict (None for none or
    `{}`)."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise FieldError(
            "`rope_scaling` must be None or a dict with keys among "
            f"{list(_ROPE_SCALING_KEYS)}; got rope_scaling={rope_scaling!r}.", "rope_scaling")
    unknown = [key for key in rope_scaling if key not in _ROPE_SCALING_KEYS]
    if unknown:
        raise FieldError(
            f"`rope_scaling` has unknown key(s) {unknown}; allowed: {list(_ROPE_SCALING_KEYS)}"
            f" (the factor is `rope_scaling_factor`). Got rope_scaling={rope_scaling!r}.",
            "rope_scaling")
    check_rope_scaling(
        scaling_factor=rope_scaling_factor,
        names={key: f"rope_scaling['{key}']" for key in _ROPE_SCALING_KEYS}
        | {"scaling_factor": "rope_scaling_factor"},
        **rope_scaling)
    return dict(rope_scaling) or None


@keras.saving.register_keras_serializable(package="kzoo")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (Vaswani et al. 2017) with the options modern models need.

    Queries come from `query`; keys and values from `value` (cross-attention) or from `query`
    itself (self-attention). Heads are projected with one dense layer each (`query_dense`,
    `key_dense`, `value_dense`, kernel `(hidden, heads * head_dim)`) and recombined by
    `output_dense`. The attention itself always runs through
    `kzoo.layers.dot_product_attention`, so it uses the fastest kernel of the backend.

    Args:
        num_heads: number of query heads.
        head_dim: size of each head; defaults to `hidden_dim // num_heads` (which must divide).
        num_kv_heads: number of key/value heads (grouped-query attention, Ainslie et al.
            2023; 1 = multi-query attention). Must divide `num_heads`. Defaults to `num_heads`.
        output_dim: width of the output projection; defaults to the query's last dimension.
        use_bias: whether the output projection has a bias (and, unless `qkv_bias` says
            otherwise, the query/key/value projections).
        qkv_bias: whether the query/key/value projections have biases; None follows
            `use_bias` (ViT's `qkv_bias=False` keeps the output bias).
        dropout: dropout rate on the attention probabilities (training only).
        scale: score scale; None means `head_dim ** -0.5` (T5 uses 1.0).
        rope_max_wavelength: if set, rotary position embeddings (Su et al. 2021) with this
            base are applied to queries and keys (after projection, before attention).
        rope_scaling_factor: the rotary embedding's scaling factor (linear position
            interpolation by default; 1.0 = none).
        rope_scaling: None or a dict of the rotary embedding's other scaling arguments
            (`RotaryEmbedding`'s `scaling_type`, `low_freq_factor`, `high_freq_factor`,
            `original_max_position_embeddings`, and YaRN's `beta_fast`, `beta_slow`,
            `attention_factor`, `truncate`), e.g. Llama 3.1's `{"scaling_type": "llama3",
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}` with `rope_scaling_factor=8.0`.
        kernel: attention kernel ("auto", "reference", "fused", "chunked").
        attention: the attention type of self-attention: "full" (softmax over every key, on
            `kernel`) or an efficient variant, "sliding_window", "strided", "longformer",
            "block_sparse", "bigbird", "linear" or "performer" (see
            `kzoo.layers.efficient_attention` for each one's pattern, cost and options).
        attention_options: the options of `attention` as a dict (e.g. `{"window": 256}`).
            "longformer" with `global_projections=True` (Hugging Face's Longformer) gives the
            layer three more projections, `query_global_dense`, `key_global_dense` and
            `value_global_dense`: the rows of the global tokens attend to every key with
            them (computed densely in O(G * n)); every other row attends its window and
            the global keys with the normal projections.
        kernel_initializer, bias_initializer: initialisers of the projections.
        query_initializer: initialiser of the query kernel (None: `kernel_initializer`;
            T5 draws it with std `(hidden * head_dim)^-1/2`).
        key_value_initializer: initialiser of the key and value kernels (None:
            `kernel_initializer`).
        output_kernel_initializer: initialiser of the output projection (defaults to
            `kernel_initializer`; GPT-2 and T5 scale it down with depth).

    Every initialiser is stored serialised and deserialised once per kernel, so an unseeded
    initialiser gives each kernel (and each layer) its own draw.

    Call args:
        query: `(batch, q_len, dim)`.
        value: `(batch, k_len, dim_kv)` for cross-attention; None for self-attention.
        attention_mask: boolean, True = may attend: `(batch, k_len)` padding,
            `(batch, q_len, k_len)` or 4-D `(batch, 1|heads, q_len, k_len)`.
        attention_bias: additive bias broadcastable to `(batch, heads, q_len, k_len)`
            (ALiBi, T5 relative bias, Graphormer spatial/edge bias).
        use_causal_mask: causal self-attention.
        cache: key/value cache `(batch, 2, num_kv_heads, max_len, head_dim)` (heads before
            positions: the layout the score and output products read without a transpose;
            `key_value_cache(k, v)` builds one from projected keys/values), or the same in
            pair form `(keys, values)`, each `(batch, num_kv_heads, max_len, head_dim)`
            (`key_value_pair(k, v)`; returned updated in the form given). With
            `cache_index` (self-attention decoding) the new keys/values are written at
            `cache_index` and the queries attend to the whole cache, query i sitting at
            position `cache_index + i`. Without `cache_index` the cache holds precomputed
            keys/values (cross-attention) and `value` is ignored. Efficient types decode on
            their own caches (see `init_cache`): "sliding_window" on a rolling cache of
            `window` slots (slot `position % window`), "linear"/"performer" on the recurrent
            state `(S, z)`; both take a prompt of several tokens only at `cache_index=0`.
        cache_index: int or scalar tensor, position of the first query.
        position_index: first position for the rotary embedding (defaults to `cache_index`
            or 0); int or `(batch,)`. When decoding with "longformer", "block_sparse" or
            "bigbird", also where their global tokens and blocks lie: row `b`'s cache slot
            `s` holds position `s - (cache_index - position_index[b])`.
        return_attention_weights: also return `(batch, heads, q_len, k_len)` probabilities
            (efficient types: computed by the explicit quadratic formula of their pattern).
            With a decoding cache, the keys are the cache's slots: `max_len` of them, slot
            `s` = position `s`, except on "sliding_window"'s rolling cache (`slots =
            min(window, max_len)`): its one-token steps give the weights in slot order,
            slot `s` holding position `t - ((t - s) mod slots)` for the query at position
            `t = cache_index` (a slot whose position would be negative, not written yet,
            weighs 0), not in position order; its prompt (`cache_index=0`) gives
            `(batch, heads, q_len, q_len)` over the prompt's positions. A `Tap` active
            while decoding sees the same weights.
        global_attention_mask: "longformer" only: `(batch, seq)`, True/1 for global tokens
            (replaces the `global_tokens` option; Hugging Face's `global_attention_mask`).
            Under `jax.jit` / `tf.function` its count of global tokens is not known, so the
            kernel reserves a slot for every position (see `efficient_attention`).
        uniform_empty_rows: a query row whose every key is masked attends uniformly to
            all the keys (the mean of the values), as transformers' encoders and
            cross-attentions compute it (`kzoo.layers.kernels.uniform_empty_rows`); False
            (default): such a row gives zeros. The efficient types count a key as masked
            when their pattern or the padding mask hides it (a padding query whose window
            is all padding; see `efficient_attention.visible_rows`). Refused with
            `use_causal_mask=True` (a ValueError).

    Returns:
        `output`, followed by the weights if asked, followed by the updated cache if a
        cache was given.

    Example:
    >>> mha = MultiHeadAttention(num_heads=8, num_kv_heads=2, rope_max_wavelength=10000)
    >>> x = keras.random.normal((2, 16, 64))
    >>> mha(x, use_causal_mask=True).shape
    (2, 16, 64)
    """

    def __init__(
        self,
        num_heads,
        head_dim=None,
        num_kv_heads=None,
        output_dim=None,
        use_bias=True,
        qkv_bias=None,
        dropout=0.0,
        scale=None,
        rope_max_wavelength=None,
        rope_scaling_factor=1.0,
        rope_scaling=None,
        kernel="auto",
        attention="full",
        attention_options=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        query_initializer=None,
        key_value_initializer=None,
        output_kernel_initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_positive_int("head_dim", head_dim, allow_none=True)
        check_positive_int("num_kv_heads", num_kv_heads, allow_none=True)
        check_positive_int("output_dim", output_dim, allow_none=True)
        if num_kv_heads is not None and num_heads % num_kv_heads != 0:
            raise ValueError(
                f"`num_kv_heads` must divide `num_heads`; got num_kv_heads={num_kv_heads} "
                f"and num_heads={num_heads} (num_heads % num_kv_heads = "
                f"{num_heads % num_kv_heads})."
            )
        check_bool("use_bias", use_bias)
        check_bool("qkv_bias", qkv_bias, allow_none=True)
        check_rate("dropout", dropout)
        if scale is not None:
            check_positive_float("scale", scale)
        if rope_max_wavelength is not None:
            check_positive_float("rope_max_wavelength", rope_max_wavelength)
        check_positive_float("rope_scaling_factor", rope_scaling_factor)
        rope_scaling = check_rope_scaling_options(rope_scaling, rope_scaling_factor)
        check_choice("kernel", kernel, KERNELS)
        self.attention, self.attention_options = efficient.check_attention(
            attention, attention_options, num_heads=num_heads)
        self._global_projections = bool(self.attention_options.get("global_projections"))
        if self._global_projections and rope_max_wavelength is not None:
            raise ValueError(
                "attention_options global_projections=True (Hugging Face Longformer) takes no "
                f"rotary embedding; got rope_max_wavelength={rope_max_wavelength}."
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.output_dim = output_dim
        self.use_bias = use_bias
        self.qkv_bias = qkv_bias
        self.dropout = dropout
        self.scale = scale
        self.rope_max_wavelength = rope_max_wavelength
        self.rope_scaling_factor = rope_scaling_factor
        self.rope_scaling = rope_scaling
        self.kernel = kernel
        self.kernel_initializer = serialize_initializer(kernel_initializer,
                                                        "kernel_initializer")
        self.bias_initializer = serialize_initializer(bias_initializer, "bias_initializer")
        self.query_initializer = _optional_initializer(query_initializer, "query_initializer")
        self.key_value_initializer = _optional_initializer(key_value_initializer,
                                                           "key_value_initializer")
        self.output_kernel_initializer = _optional_initializer(output_kernel_initializer,
                                                               "output_kernel_initializer")
        self._kv_heads = num_kv_heads or num_heads
        self.seed_generator = keras.random.SeedGenerator()
        self.rotary = None
        if rope_max_wavelength is not None:
            from kzoo.layers.position import RotaryEmbedding

            self.rotary = RotaryEmbedding(
                max_wavelength=rope_max_wavelength,
                scaling_factor=rope_scaling_factor,
                **(rope_scaling or {}),
                dtype=self.dtype_policy,
                name="rotary_embedding",
            )

    def _dense(self, units, name, use_bias, initializer):
        return keras.layers.Dense(
            units,
            use_bias=use_bias,
            kernel_initializer=keras.initializers.get(initializer or self.kernel_initializer),
            bias_initializer=keras.initializers.get(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, query_shape, value_shape=None):
        hidden = query_shape[-1]
        if self.head_dim is None:
            if hidden % self.num_heads != 0:
                raise ValueError(
                    f"`num_heads`={self.num_heads} must divide the hidden size {hidden} when "
                    "`head_dim` is not given."
                )
            self._head_dim = hidden // self.num_heads
        else:
            self._head_dim = self.head_dim
        if self.rotary is not None and self._head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head_dim; got head_dim={self._head_dim}."
            )
        value_shape = value_shape or query_shape
        out_dim = self.output_dim or hidden
        qkv_bias = self.use_bias if self.qkv_bias is None else self.qkv_bias
        q_units = self.num_heads * self._head_dim
        kv_units = self._kv_heads * self._head_dim
        self.query_dense = self._dense(q_units, "query_dense", qkv_bias,
                                       self.query_initializer)
        self.key_dense = self._dense(kv_units, "key_dense", qkv_bias,
                                     self.key_value_initializer)
        self.value_dense = self._dense(kv_units, "value_dense", qkv_bias,
                                       self.key_value_initializer)
        self.output_dense = self._dense(out_dim, "output_dense", self.use_bias,
                                        self.output_kernel_initializer)
        self.query_dense.build(query_shape)
        self.key_dense.build(value_shape)
        self.value_dense.build(value_shape)
        self.output_dense.build(tuple(query_shape[:-1]) + (self.num_heads * self._head_dim,))
        if self._global_projections:
            # Hugging Face Longformer's query_global / key_global / value_global.
            self.query_global_dense = self._dense(q_units, "query_global_dense", qkv_bias,
                                                  self.query_initializer)
            self.key_global_dense = self._dense(kv_units, "key_global_dense", qkv_bias,
                                                self.key_value_initializer)
            self.value_global_dense = self._dense(kv_units, "value_global_dense", qkv_bias,
                                                  self.key_value_initializer)
            self.query_global_dense.build(query_shape)
            self.key_global_dense.build(query_shape)
            self.value_global_dense.build(query_shape)
        self._projection = None
        if self.attention in efficient.LINEAR_TYPES:
            self._projection = efficient.projection(self.attention, self.attention_options,
                                                    self._head_dim)
        self.built = True

    def _split(self, x, heads):
        return ops.reshape(x, (-1, ops.shape(x)[1], heads, self._head_dim))

    def project_key_value(self, value):
        """Keys and values `(batch, k_len, kv_heads, head_dim)` for `value` (e.g. a
        cross-attention cache computed once from the encoder output)."""
        k = self._split(project(self.key_dense, value), self._kv_heads)
        v = self._split(project(self.value_dense, value), self._kv_heads)
        return k, v

    @staticmethod
    def key_value_cache(key, value):
        """A cache `(batch, 2, kv_heads, k_len, head_dim)` holding `key` and `value`
        `(batch, k_len, kv_heads, head_dim)` (e.g. `project_key_value`'s, for cross-attention).

        Example:
        >>> cross_cache = MultiHeadAttention.key_value_cache(*mha.project_key_value(enc))
        """
        return ops.transpose(ops.stack([key, value], axis=1), (0, 1, 3, 2, 4))

    @staticmethod
    def key_value_pair(key, value):
        """A cache in pair form, `(keys, values)` each `(batch, kv_heads, k_len, head_dim)`,
        holding `key` and `value` `(batch, k_len, kv_heads, head_dim)`. The keys and the
        values are then separate contiguous arrays, which a compiled step reads in place:
        slicing keys or values out of the stacked form copies them on every step under
        XLA (a fifth of JAX's GPT decode time, measured).

        Example:
        >>> cross_cache = MultiHeadAttention.key_value_pair(*mha.project_key_value(enc))
        """
        return (ops.transpose(key, (0, 2, 1, 3)), ops.transpose(value, (0, 2, 1, 3)))

    @staticmethod
    def cached_key_value(cache):
        """`(keys, values)` `(batch, len, kv_heads, head_dim)` of a cache, stacked or in pair
        form (see `call`)."""
        if isinstance(cache, (tuple, list)):
            keys, values = cache
            return ops.transpose(keys, (0, 2, 1, 3)), ops.transpose(values, (0, 2, 1, 3))
        return (ops.transpose(cache[:, 0], (0, 2, 1, 3)),
                ops.transpose(cache[:, 1], (0, 2, 1, 3)))

    @classmethod
    def write_key_value(cls, cache, key, value, index):
        """`cache` (stacked or pair form) with `key` and `value` `(batch, q_len, kv_heads,
        head_dim)` written at slots `index, index + 1, ...`, in the same form."""
        index = ops.convert_to_tensor(index, "int32")
        zero = ops.zeros((), "int32")
        if isinstance(cache, (tuple, list)):
            keys, values = cache
            new_keys, new_values = cls.key_value_pair(key, value)
            starts = [zero, zero, index, zero]
            return (ops.slice_update(keys, starts, ops.cast(new_keys, keys.dtype)),
                    ops.slice_update(values, starts, ops.cast(new_values, values.dtype)))
        return ops.slice_update(cache, [zero, zero, zero, index, zero],
                                ops.cast(cls.key_value_cache(key, value), cache.dtype))

    def call(
        self,
        query,
        value=None,
        attention_mask=None,
        attention_bias=None,
        use_causal_mask=False,
        cache=None,
        cache_index=None,
        position_index=None,
        return_attention_weights=False,
        global_attention_mask=None,
        uniform_empty_rows=False,
        training=None,
    ):
        cross = value is not None
        if uniform_empty_rows and use_causal_mask:
            # The empty rows were found from `attention_mask` alone and given the mean of
            # every value: a causal query read the positions after it.
            raise ValueError(
                "`uniform_empty_rows=True` is for non-causal attention (transformers' encoders "
                "and cross-attentions); got it with use_causal_mask=True, where a query row "
                "without an allowed key would read the mean of every value, later positions "
                "included. With a causal mask leave uniform_empty_rows=False (such rows give "
                "zeros).")
        if len(query.shape) != 3:
            raise ValueError(
                f"`query` must have rank 3 (batch, seq, dim); got shape {tuple(query.shape)}."
            )
        _check_float_mask(attention_mask)
        joined = None
        if cache is not None and cache_index is not None and not cross and self.attention == "full":
            joined = fast_decode.hoisted_qkv(self, query)  # (a compiled decode loop)
        q = self._split(joined[0] if joined is not None else project(self.query_dense, query),
                        self.num_heads)
        q_len = query.shape[1] if query.shape[1] is not None else ops.shape(query)[1]
        if position_index is not None:
            start = position_index
        else:
            start = cache_index if cache_index is not None else 0

        if self.attention != "full" and not cross:
            return self._efficient_call(
                q, query, q_len, start, attention_mask, attention_bias, use_causal_mask, cache,
                cache_index, return_attention_weights, global_attention_mask, training,
                shifted=position_index is not None, uniform_empty_rows=uniform_empty_rows)
        if global_attention_mask is not None:
            raise ValueError(
                "`global_attention_mask` is for attention='longformer' self-attention; this "
                f"layer has attention={self.attention!r}"
                + (" and is called as cross-attention." if cross else "."))
        if cache is not None and cache_index is None:
            # Precomputed keys/values (cross-attention decoding).
            k, v = self.cached_key_value(cache)
            new_cache = cache
        else:
            if joined is not None:
                k = self._split(joined[1], self._kv_heads)
                v = self._split(joined[2], self._kv_heads)
            else:
                k, v = self.project_key_value(value if cross else query)
            if self.rotary is not None and not cross:
                k = self.rotary(k, start_index=start)
            new_cache = None
            if cache is not None:
                new_cache = self.write_key_value(cache, k, v, cache_index)
                k, v = self.cached_key_value(new_cache)
        if self.rotary is not None and not cross:
            q = self.rotary(q, start_index=start)

        mask = normalize_mask(attention_mask, "attention_mask")
        is_causal = False
        if use_causal_mask:
            if cache is not None and cache_index is not None:
                mask = merge_masks(mask, causal_mask(q_len, k.shape[1], offset=cache_index))
            else:
                is_causal = True
        tap = active_tap()
        if tap is not None:
            result = self._tapped_attention(tap, q, k, v, mask, attention_bias, is_causal,
                                            training)
            if not return_attention_weights:
                result = result[0]
        else:
            result = dot_product_attention(
                q, k, v,
                mask=mask,
                bias=attention_bias,
                is_causal=is_causal,
                scale=self.scale,
                kernel=self.kernel,
                return_weights=return_attention_weights,
                dropout_rate=self.dropout,
                training=training,
                seed_generator=self.seed_generator,
            )
        if return_attention_weights:
            out, weights = result
        else:
            out, weights = result, None
        if uniform_empty_rows and mask is not None:
            # (transformers' encoders and cross-attentions: see `uniform_empty_rows`)
            out = _uniform_empty_rows(out, mask, v)
            if weights is not None:
                empty = ops.logical_not(ops.any(mask, axis=-1, keepdims=True))
                uniform = ops.cast(1.0 / ops.cast(ops.shape(k)[1], "float32"), weights.dtype)
                weights = ops.where(empty, uniform, weights)
        return self._finish(out, weights, q_len, return_attention_weights, cache, new_cache)

    def _finish(self, out, weights, q_len, return_attention_weights, cache, new_cache):
        out = ops.reshape(out, (-1, q_len, self.num_heads * self._head_dim))
        out = project(self.output_dense, out)
        outputs = (out,)
        if return_attention_weights:
            outputs += (weights,)
        if cache is not None:
            outputs += (new_cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    # === Efficient attention types ===

    def _efficient_call(self, q, query, q_len, start, attention_mask, attention_bias,
                        use_causal_mask, cache, cache_index, return_weights, global_mask,
                        training, shifted=False, uniform_empty_rows=False):
        kind = self.attention
        if attention_bias is not None:
            raise ValueError(
                f"attention={kind!r} takes no `attention_bias` (ALiBi, relative or graph "
                "biases need attention='full')."
            )
        if global_mask is not None and kind != "longformer":
            raise ValueError(
                f"`global_attention_mask` is for attention='longformer'; this layer has "
                f"attention={kind!r}."
            )
        if global_mask is not None:
            global_mask = self._check_global_mask(global_mask, query)
        k, v = self.project_key_value(query)
        if self.rotary is not None:
            q = self.rotary(q, start_index=start)
            k = self.rotary(k, start_index=start)
        mask = normalize_mask(attention_mask, "attention_mask")
        if mask is not None and (mask.shape[1] != 1 or mask.shape[2] != 1):
            raise ValueError(
                f"attention={kind!r} takes a key padding mask only ((batch, seq) or (batch, 1, "
                f"1, seq)); got attention_mask of shape {tuple(attention_mask.shape)}."
            )
        tap = active_tap()
        need_weights = return_weights or tap is not None
        new_cache = None
        if cache is not None and self._global_projections:
            raise ValueError(
                "attention_options global_projections=True (Hugging Face Longformer, an "
                "encoder) has no decoding cache; call the layer on the whole sequence."
            )
        if cache is not None:
            if cache_index is None or not use_causal_mask:
                raise ValueError(
                    f"attention={kind!r} caches are for causal self-attention decoding: pass "
                    "`cache_index` and use_causal_mask=True."
                )
            if global_mask is not None:
                # (a cache keeps no record of which cached keys a call's mask made global:
                # the mask was ignored, and the outputs were those of `global_tokens`)
                raise ValueError(
                    "`global_attention_mask` cannot be used with a decoding `cache`: decoding "
                    "lays the global tokens of the attention option `global_tokens` (a count "
                    "or a list of positions); set them there, or call the layer on the whole "
                    "sequence without a cache; got global_attention_mask of shape "
                    f"{tuple(global_mask.shape)} with a cache."
                )
            # (a `position_index` other than `cache_index`: per-row positions, e.g. a
            # left-padded prompt, on which the global tokens and blocks are laid)
            shift = (ops.cast(cache_index, "int32") - ops.cast(start, "int32")
                     if shifted else None)
            out, weights, values, new_cache = self._efficient_decode(
                q, k, v, mask, cache, cache_index, q_len, need_weights, shift=shift)
        elif need_weights:
            global_rows = None
            values = v
            if global_mask is not None:
                # The global tokens the kernel keeps: compiled, only the first `max_global`
                # flags of a row (the pattern of every flag gave other weights and outputs).
                global_mask = self._global_slots(query, global_mask)[0]
            if self._global_projections:
                flags = self._global_slots(query, global_mask, use_causal_mask)[0]
                kg, vg = self._project_global_key_value(query)
                qg = self._split(project(self.query_global_dense, query), self.num_heads)
                global_rows = (qg, kg, flags)
                values = (v, vg, flags)
            weights = self._explicit_weights(q, k, mask, use_causal_mask, global_mask,
                                             global_rows=global_rows)
            if uniform_empty_rows and mask is not None:
                # (rows that see no key weigh every key alike, as the kernel path below)
                seen = efficient.visible_rows(kind, self.attention_options, q_len, mask,
                                              global_mask=global_mask)
                uniform = ops.cast(1.0 / k.shape[1], weights.dtype)
                weights = ops.where(ops.expand_dims(seen, -1), weights, uniform)
            if self._global_projections and mask is not None:
                weights = ops.where(ops.transpose(mask, (0, 1, 3, 2)), weights,
                                    ops.zeros((), weights.dtype))
            out = self._weighted_values(weights, values, q.dtype)
        else:
            weights = None
            out = efficient.efficient_attention(
                q, k, v, kind, self.attention_options, causal=use_causal_mask, mask=mask,
                scale=self.scale, global_mask=global_mask, projection_matrix=self._projection,
                uniform_empty_rows=uniform_empty_rows)
            if self._global_projections:
                out = self._global_projection_rows(query, out, mask, use_causal_mask,
                                                   global_mask)
                out = self._padding_rows_zeroed(out, mask)
        if tap is not None:
            out, weights = self._tap_weights(tap, weights, values, training)
        return self._finish(out, weights, q_len, return_weights, cache, new_cache)

    @staticmethod
    def _padding_rows_zeroed(out, mask):
        """`out (batch, seq, heads, head_dim)` with the padding queries' rows zero, as
        Hugging Face's Longformer gives them (it zeroes their attention probabilities): their
        outputs reach the model's outputs only where a padding position is read (the pooler's
        first position under left padding: 6.5e-3 apart before)."""
        if mask is None:
            return out
        rows = ops.reshape(mask, (ops.shape(mask)[0], -1, 1, 1))  # (batch, seq, 1, 1)
        return ops.where(rows, out, ops.zeros((), out.dtype))

    def _check_global_mask(self, global_mask, query):
        global_mask = ops.convert_to_tensor(global_mask)
        shape = tuple(global_mask.shape)
        want = tuple(query.shape[:2])
        if len(shape) != 2 or any(a is not None and b is not None and a != b
                                  for a, b in zip(shape, want)):
            raise ValueError(
                "`global_attention_mask` must have shape (batch, seq) = "
                f"{want}, the query's; got global_attention_mask of shape {shape}."
            )
        return global_mask

    def _global_slots(self, query, global_mask, causal=False):
        return efficient.longformer_slots(self.attention_options, query.shape[1],
                                          query.shape[0], global_mask, causal=causal)

    def _project_global_key_value(self, query):
        return (self._split(project(self.key_global_dense, query), self._kv_heads),
                self._split(project(self.value_global_dense, query), self._kv_heads))

    def _global_projection_rows(self, query, out, mask, causal, global_mask):
        """`out` with the global tokens' rows recomputed under the global projections
        (O(G * n): only the G global queries are projected and scored)."""
        slots = self._global_slots(query, global_mask, causal)
        if slots[1].shape[1] == 0:  # no global token
            return out
        onehot = ops.cast(slots[1], query.dtype)
        if onehot.shape[0] == 1:
            hidden = ops.einsum("gn,bnc->bgc", onehot[0], query)
        else:
            hidden = ops.einsum("bgn,bnc->bgc", onehot, query)
        qg = self._split(project(self.query_global_dense, hidden), self.num_heads)
        kg, vg = self._project_global_key_value(query)
        return efficient.longformer_global_rows(qg, kg, vg, slots, out, mask=mask,
                                                causal=causal, scale=self.scale)

    @staticmethod
    def _weighted_values(weights, values, dtype):
        """`weights @ values`; `values` may be `(v, v_global, flags)` (global projections):
        the rows `flags` marks apply their weights to `v_global`."""
        if not isinstance(values, tuple):
            return _grouped_output(weights, values, dtype)
        v, vg, flags = values
        return ops.where(ops.cast(flags, "bool")[:, :, None, None],
                         _grouped_output(weights, vg, dtype), _grouped_output(weights, v, dtype))

    def _tap_weights(self, tap, weights, v, training):
        """(output, weights) after the tap saw/replaced the weights and scaled heads, with
        attention dropout (training only) after the tap, as in the fused kernels."""
        weights = tap._on_attention(self, weights)
        head_scale = tap._head_scale(self)
        if head_scale is not None:
            head_scale = ops.reshape(ops.cast(head_scale, weights.dtype), (1, -1, 1, 1))
            weights = weights * head_scale
        if training and self.dropout > 0:
            weights = keras.random.dropout(weights, self.dropout, seed=self.seed_generator)
        dtype = v[0].dtype if isinstance(v, tuple) else v.dtype
        return self._weighted_values(weights, v, dtype), weights

    def _explicit_weights(self, q, k, mask, causal, global_mask, offset=0, global_rows=None):
        """`(batch, heads, q, k)` weights of this layer's type by the explicit quadratic
        formula (sparse: softmax under the pattern as a dense mask; linear: the normalised
        feature products). `global_rows=(q_global, k_global, flags)` (global projections):
        the rows `flags` marks are the softmax of `q_global k_global^T` over every key."""
        kind = self.attention
        n, k_len = q.shape[1], k.shape[1]
        if kind not in efficient.LINEAR_TYPES:
            pattern = efficient.dense_pattern(kind, self.attention_options, n, causal=causal,
                                              global_mask=global_mask, offset=offset,
                                              k_len=k_len)
            _, weights = reference_attention(q, k, k, mask=merge_masks(mask, pattern),
                                             scale=self.scale, return_weights=True)
            if global_rows is not None:
                qg, kg, flags = global_rows
                _, global_weights = reference_attention(
                    qg, kg, kg, mask=mask, is_causal=causal, scale=self.scale,
                    return_weights=True)
                weights = ops.where(ops.cast(flags, "bool")[:, None, :, None],
                                    global_weights, weights)
            return weights
        from kzoo.layers.linear_attention import feature_map_features

        fmap = "favor" if kind == "performer" else self.attention_options["feature_map"]
        proj = None if self._projection is None else ops.convert_to_tensor(self._projection)
        fq = feature_map_features(q, fmap, proj, self.scale, is_query=None)
        fk = feature_map_features(k, fmap, proj, self.scale, is_query=None)
        fk = ops.repeat(fk, self.num_heads // self._kv_heads, axis=2)
        scores = ops.einsum("bqhm,bkhm->bhqk", fq, fk)
        allowed = None if mask is None else mask
        if causal:
            allowed = merge_masks(allowed, causal_mask(n, k_len, offset=offset))
        if allowed is not None:
            scores = ops.where(allowed, scores, 0.0)
        total = ops.sum(scores, axis=-1, keepdims=True)
        weights = ops.where(total > 0, scores / ops.where(total > 0, total, 1.0), 0.0)
        return ops.cast(weights, q.dtype)

    def init_cache(self, batch_size, max_length, dtype=None):
        """A fresh decoding cache of this layer for `max_length` positions: full attention
        and the sparse types, `(batch, 2, kv_heads, max_length, head_dim)` zeros;
        "sliding_window", `(batch, 2, kv_heads, min(window, max_length), head_dim)` (a
        rolling cache); "linear"/"performer", the recurrent state `(S, z)`.

        Example:
        >>> cache = layer.init_cache(2, 64)
        """
        dtype = dtype or self.compute_dtype
        head_dim = self._head_dim if self.built else self.head_dim
        if head_dim is None:
            raise ValueError("init_cache needs a built layer or an explicit head_dim.")
        if self.attention in efficient.LINEAR_TYPES:
            from kzoo.layers.linear_attention import linear_attention_state

            features = efficient.feature_count(self.attention, self.attention_options,
                                               head_dim)
            return linear_attention_state(batch_size, self._kv_heads, features, head_dim)
        slots = max_length
        if self.attention == "sliding_window":
            slots = efficient.rolling_cache_length(self.attention_options, max_length)
        return ops.zeros((batch_size, 2, self._kv_heads, slots, head_dim), dtype=dtype)

    def _efficient_decode(self, q, k, v, mask, cache, cache_index, q_len, need_weights,
                          shift=None):
        """(output, weights or None, the values the weights apply to, new cache) of a
        decoding call on this type's cache. `shift` `(batch,)`: the slot of each row's
        position 0 (see `efficient.dense_pattern`)."""
        kind = self.attention
        padding = None if mask is None else mask[:, 0, 0, :]  # (batch, max_length)
        multi = not (isinstance(q_len, int) and q_len == 1)
        if multi and not (isinstance(cache_index, int) and cache_index == 0):
            raise ValueError(
                f"attention={kind!r} decodes a prompt of several tokens only at cache_index=0, "
                f"then one token a call; got {q_len} tokens at cache_index={cache_index!r}."
            )
        index = ops.convert_to_tensor(cache_index, "int32")
        if kind in efficient.LINEAR_TYPES:
            return self._linear_decode(q, k, v, padding, cache, index, q_len, need_weights)
        if kind == "sliding_window":
            return self._rolling_decode(q, k, v, padding, cache, index, q_len, multi,
                                        need_weights)
        # Other sparse types: a full cache, the pattern as a dense mask over the cache.
        new_cache = self.write_key_value(cache, k, v, index)
        keys, values = self.cached_key_value(new_cache)
        pattern = efficient.dense_pattern(kind, self.attention_options, q_len, causal=True,
                                          offset=index, k_len=keys.shape[1], shift=shift)
        full_mask = merge_masks(None if padding is None else padding[:, None, None, :],
                                pattern)
        out, weights = reference_attention(q, keys, values, mask=full_mask, scale=self.scale,
                                           return_weights=True)
        return out, weights, values, new_cache

    def _rolling_decode(self, q, k, v, padding, cache, index, q_len, multi, need_weights):
        """(output, weights or None, values, new cache) of "sliding_window" decoding on a
        rolling cache (position `p` in slot `p % slots`). The weights of a prompt are over
        its positions, `(batch, heads, q_len, q_len)`; those of a one-token step are over
        the cache's slots in slot order, `(batch, heads, 1, slots)`, slot `s` holding
        position `index - ((index - s) mod slots)` (weight 0 where that is negative):
        what `return_attention_weights` returns and a tap sees (see the class docstring)."""
        window = self.attention_options["window"]
        slots = cache.shape[3]
        if multi:
            # The prompt: banded attention over it, then its last `slots` keys/values
            # into the slots `position % slots`.
            prompt_mask = None if padding is None else padding[:, :q_len]
            if need_weights:
                weights = self._explicit_weights(q, k, None if prompt_mask is None
                                                 else prompt_mask[:, None, None, :],
                                                 True, None)
                out = _grouped_output(weights, v, q.dtype)
            else:
                weights = None
                out = efficient.efficient_attention(
                    q, k, v, "sliding_window", self.attention_options, causal=True,
                    mask=prompt_mask, scale=self.scale)
            update = self.key_value_cache(k, v)  # (b, 2, kv, q_len, d)
            if q_len >= slots:
                update = ops.roll(update[:, :, :, q_len - slots:], q_len % slots, axis=3)
            else:
                update = ops.pad(update, [[0, 0], [0, 0], [0, 0], [0, slots - q_len],
                                          [0, 0]])
            return out, weights, v, ops.cast(update, cache.dtype)
        zero = ops.zeros((), "int32")
        slot = index % slots
        new_cache = ops.slice_update(cache, [zero, zero, zero, slot, zero],
                                     ops.cast(self.key_value_cache(k, v), cache.dtype))
        keys, values = self.cached_key_value(new_cache)
        # Slot s holds position index - ((index - s) mod slots): the last `slots` positions.
        held = index - (index - ops.arange(slots, dtype="int32")) % slots
        valid = ops.logical_and(held >= 0, index - held < window)[None, :]
        if padding is not None:
            seen = ops.take(ops.cast(padding, "bool"), ops.maximum(held, 0), axis=1)
            valid = ops.logical_and(valid, seen)
        valid = valid[:, None, None, :]
        if need_weights:
            out, weights = reference_attention(q, keys, values, mask=valid, scale=self.scale,
                                               return_weights=True)
            return out, weights, values, new_cache
        out = dot_product_attention(q, keys, values, mask=valid, scale=self.scale,
                                    kernel=self.kernel)
        return out, None, values, new_cache

    def _linear_decode(self, q, k, v, padding, cache, index, q_len, need_weights):
        from kzoo.layers.linear_attention import linear_attention

        if padding is not None:
            padding = ops.slice(padding, [0, index], [ops.shape(padding)[0], q_len])
        fmap = "favor" if self.attention == "performer" else self.attention_options[
            "feature_map"]
        out, state = linear_attention(
            q, k, v, feature_map=fmap, causal=True, mask=padding, projection=self._projection,
            scale=self.scale, initial_state=tuple(cache), return_state=True)
        if need_weights:
            raise ValueError(
                f"attention={self.attention!r} keeps no keys while decoding (an O(1) state), "
                "so it has no attention weights to return or tap there; run the whole "
                "sequence without a cache instead."
            )
        return out, None, v, state

    def _tapped_attention(self, tap, q, k, v, mask, bias, is_causal, training):
        """The exact formula with the probabilities handed to `tap` (see `kzoo.layers.taps`):
        the tap may record or replace them and scale heads; dropout (training only) comes
        after the tap, as in the fused kernels."""
        _, weights = reference_attention(q, k, v, mask=mask, bias=bias, is_causal=is_causal,
                                         scale=self.scale, return_weights=True)
        out, weights = self._tap_weights(tap, weights, v, training)
        return ops.cast(out, q.dtype), weights

    def compute_output_shape(self, query_shape, value_shape=None):
        return tuple(query_shape[:-1]) + (self.output_dim or query_shape[-1],)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "head_dim": self.head_dim,
                "num_kv_heads": self.num_kv_heads,
                "output_dim": self.output_dim,
                "use_bias": self.use_bias,
                "qkv_bias": self.qkv_bias,
                "dropout": self.dropout,
                "scale": self.scale,
                "rope_max_wavelength": self.rope_max_wavelength,
                "rope_scaling_factor": self.rope_scaling_factor,
                "rope_scaling": self.rope_scaling,
                "kernel": self.kernel,
                "attention": self.attention,
                "attention_options": self.attention_options,
                "kernel_initializer": self.kernel_initializer,
                "bias_initializer": self.bias_initializer,
                "query_initializer": self.query_initializer,
                "key_value_initializer": self.key_value_initializer,
                "output_kernel_initializer": self.output_kernel_initializer,
            }
        )
        return config
