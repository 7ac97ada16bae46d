"""T5 (Raffel et al., 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer", https://arxiv.org/abs/1910.10683), versions 1.0 and 1.1.

- `T5Backbone`: an encoder-decoder transformer. One token embedding shared by both stacks;
  pre-LN blocks with T5's RMS layer norm (no mean subtraction, no bias); no biases
  anywhere; unscaled attention scores (the 1/sqrt(d) is folded into the initialisation);
  a learned relative position bias computed once per stack (bidirectional buckets in the
  encoder, causal buckets in the decoder) and shared by all its layers; a final RMS norm on
  each stack. v1.0 uses a ReLU feed-forward and ties the output projection to the
  embeddings; v1.1 uses a gated-GELU feed-forward (tanh GELU) and an untied `lm_head`.
  Outputs `{"encoder_sequence_output", "decoder_sequence_output"}`.
- `T5Seq2SeqLM`: vocabulary logits from the decoder, plus `generate` (the encoder runs
  once; the decoder runs one token per step on a key/value cache; the cross-attention
  keys/values are computed once from the encoder output; greedy, sampling or beam search
  in the one decode loop of `kzoo.generation`).

Inputs follow keras-hub: `{"encoder_token_ids", "encoder_padding_mask",
"decoder_token_ids", "decoder_padding_mask"}`, each `(batch, seq)` int32 (masks 1/True for
real tokens; a mask left out means every token of its sequence is real, as in Hugging Face's
T5).

Example:
>>> backbone = T5Backbone(vocabulary_size=1000, num_layers=2, num_heads=4, hidden_dim=64,
...                       key_value_dim=16, intermediate_dim=128)
>>> model = T5Seq2SeqLM(backbone)
>>> model.generate({"encoder_token_ids": np.array([[5, 6, 7, 1]])}, max_new_tokens=5)
"""

import dataclasses
from collections.abc import Mapping
from typing import Optional

import keras
import numpy as np
from keras import ops

from kzoo.layers.attention import MultiHeadAttention
from kzoo.layers.blocks import TransformerBlock
from kzoo.layers import fast_decode
from kzoo.layers.fast_decode import decode_block
from kzoo.layers.embedding import TokenEmbedding
from kzoo.layers.norm import RMSNorm
from kzoo.layers.kernels import KERNELS
from kzoo.layers.position import RelativePositionBias
from kzoo.layers.utils import (
    check_bool,
    check_choice,
    check_instance,
    check_int_at_least,
    check_positive_float,
    check_positive_int,
    check_rate,
    RowDense,
)
from kzoo.models.base import (
    AUTO,
    Backbone,
    FamilyConfig,
    FilledInputs,
    IdInput,
    TaskModel,
    check_stop_token_ids,
    check_token_id,
    is_auto,
)

FAMILY = "t5"

# feed-forward name (Hugging Face's `feed_forward_proj`) -> (TransformerBlock feedforward,
# activation). HF's "gated-gelu" is the tanh approximation ("gelu_new"); plain "gelu" is the
# exact erf GELU.
FEEDFORWARDS = {
    "relu": ("plain", "relu"),
    "gelu": ("plain", "gelu"),
    "gelu_new": ("plain", "gelu_tanh"),
    "silu": ("plain", "silu"),
    "gated-relu": ("gated", "relu"),
    "gated-gelu": ("gated", "gelu_tanh"),
    "gated-gelu_new": ("gated", "gelu_tanh"),
    "gated-silu": ("gated", "silu"),
}


def _dtype_policy(dtype):
    return keras.dtype_policies.get(dtype) if dtype is not None else None


def _normal(stddev):
    return keras.initializers.RandomNormal(mean=0.0, stddev=float(stddev))


# === Config ===


@dataclasses.dataclass(frozen=True)
class T5Config(FamilyConfig):
    """The configuration of a `T5Backbone`, validated once on construction.

    Its fields are `T5Backbone`'s arguments (see there for their meaning), with the same
    defaults (T5-Small, v1.0). `relative_attention_num_buckets` must be at least 4 and
    `relative_attention_max_distance` larger than half of it (the exact buckets).

    Example:
    >>> config = T5Config(vocabulary_size=1000, num_layers=2, num_heads=4, hidden_dim=64,
    ...                   key_value_dim=16, intermediate_dim=128, feedforward="gated-gelu",
    ...                   tie_embeddings=False)           # a small v1.1
    >>> backbone = config.build()             # the same as T5Backbone(**config.to_dict())
    """

    vocabulary_size: int = 32128
    num_layers: int = 6
    num_decoder_layers: Optional[int] = None
    num_heads: int = 8
    hidden_dim: int = 512
    key_value_dim: int = 64
    intermediate_dim: int = 2048
    dropout: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feedforward: str = "relu"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    tie_embeddings: bool = True
    kernel: str = "auto"
    remat: bool = False
    layerdrop: float = 0.0

    def __post_init__(self):
        check = self._check
        check("remat", check_bool)
        check("layerdrop", check_rate)
        check("vocabulary_size", check_positive_int)
        check("num_layers", check_positive_int)
        check("num_decoder_layers", check_positive_int, allow_none=True)
        check("num_heads", check_positive_int)
        check("hidden_dim", check_positive_int)
        check("key_value_dim", check_positive_int)
        check("intermediate_dim", check_positive_int)
        check("dropout", check_rate)
        check("layer_norm_epsilon", check_positive_float)
        check("feedforward", check_choice, tuple(FEEDFORWARDS))
        check("relative_attention_num_buckets", check_int_at_least, 4)
        exact = self.relative_attention_num_buckets // 2
        check("relative_attention_max_distance", check_int_at_least, exact + 1,
              f" (more than relative_attention_num_buckets // 2 = {exact})")
        check("tie_embeddings", check_bool)
        check("kernel", check_choice, KERNELS)


# === Backbone ===


# What a left-out padding mask holds (`FilledInputs`; transformers' default): every token
# real.
_INPUT_FILLS = {"encoder_padding_mask": ("encoder_token_ids", 1),
                "decoder_padding_mask": ("decoder_token_ids", 1)}


@keras.saving.register_keras_serializable(package="kzoo")
class T5Backbone(FilledInputs, Backbone):
    """The T5 encoder-decoder transformer (Raffel et al., 2020, arXiv:1910.10683).

    Encoder: `x = dropout(E[ids])`; `num_layers` pre-LN blocks
    `x = x + drop(SelfAttn(RMSNorm(x), bias=b_enc))`, `x = x + drop(FFN(RMSNorm(x)))`;
    `dropout(RMSNorm(x))`. Decoder: the same with causal self-attention (bias `b_dec`) and a
    cross-attention sub-layer on the encoder output (no position bias) between the two,
    `num_decoder_layers` blocks. `b_enc` / `b_dec` are the relative position biases of the
    first layer of each stack (tables `(relative_attention_num_buckets, num_heads)`), shared
    by every layer of that stack. Attention scores are not scaled (`scale=1.0`); each
    attention is `num_heads` heads of `key_value_dim` (independent of `hidden_dim`).

    Initialisation as Mesh TensorFlow / Hugging Face `T5PreTrainedModel` (factor 1.0):
    embeddings N(0, 1); query N(0, (hidden_dim * key_value_dim)^-1/2); key and value
    N(0, hidden_dim^-1/2); attention output N(0, (num_heads * key_value_dim)^-1/2); feed-forward
    input(s) N(0, hidden_dim^-1/2), output N(0, intermediate_dim^-1/2); relative bias tables
    N(0, hidden_dim^-1/2); norms ones.

    Args:
        vocabulary_size: number of token ids (32128 for the released checkpoints).
        num_layers: encoder blocks.
        num_decoder_layers: decoder blocks (None: same as `num_layers`).
        num_heads: attention heads.
        hidden_dim: width of the residual stream (`d_model`).
        key_value_dim: width of each attention head (`d_kv`).
        intermediate_dim: width of the feed-forward hidden layer (`d_ff`).
        dropout: dropout rate on the embeddings, attention probabilities, feed-forward hidden
            layer, every residual branch and the stack outputs.
        layer_norm_epsilon: epsilon of every RMS norm.
        feedforward: one of `FEEDFORWARDS`: "relu" (v1.0), "gated-gelu" (v1.1, tanh GELU),
            "gated-silu", "gated-relu", "gelu" (exact), "gelu_new", "silu".
        relative_attention_num_buckets: buckets of the relative position bias.
        relative_attention_max_distance: distances from here on share the last bucket.
        tie_embeddings: whether `T5Seq2SeqLM` reuses the embeddings as its output projection
            (v1.0, with the decoder output scaled by `hidden_dim ** -0.5`) or has its own
            `lm_head` (v1.1). The backbone itself is the same either way.
        kernel: attention kernel ("auto", "reference", "fused", "chunked").
        remat: recompute each block's activations in the backward pass instead of
            keeping them (gradient checkpointing per block: less memory, one more forward
            pass of compute; the gradients are the same).
        layerdrop: LayerDrop rate (Fan et al. 2019): in training, each block is skipped
            (is the identity) with this probability, one draw per block and batch; in
            inference every block runs.
        dtype: dtype policy of every layer (e.g. "float32", "mixed_bfloat16"). Computing
            in float16 ("float16", "mixed_float16"), every block clamps its hidden states
            after each sub-layer as transformers' T5 does, so that an overflow gives finite
            values (`TransformerBlock(clamp_float16=True)`).

    The arguments (all but `dtype` and Keras' own) are the fields of `T5Config`, which
    validates them: `T5Backbone(**fields)` and `T5Config(**fields).build()` are the same
    model, and `backbone.config` is that `T5Config`.

    Inputs (a dict, each `(batch, seq)` int32):
        encoder_token_ids, encoder_padding_mask, decoder_token_ids, decoder_padding_mask.

    Outputs (a dict):
        encoder_sequence_output `(batch, enc_len, hidden_dim)`;
        decoder_sequence_output `(batch, dec_len, hidden_dim)`.

    Methods for fast decoding: `encode`, `init_cache`, `decode_step`.

    Example:
    >>> backbone = T5Backbone(vocabulary_size=1000, num_layers=2, num_heads=4,
    ...                       hidden_dim=64, key_value_dim=16, intermediate_dim=128)
    >>> ones = np.ones((2, 8), "int32")
    >>> out = backbone({"encoder_token_ids": ones, "encoder_padding_mask": ones,
    ...                 "decoder_token_ids": ones, "decoder_padding_mask": ones})
    >>> out["decoder_sequence_output"].shape
    (2, 8, 64)
    """

    _input_fills = _INPUT_FILLS

    family = FAMILY
    config_class = T5Config

    def __init__(
        self,
        vocabulary_size=32128,
        num_layers=6,
        num_decoder_layers=None,
        num_heads=8,
        hidden_dim=512,
        key_value_dim=64,
        intermediate_dim=2048,
        dropout=0.1,
        layer_norm_epsilon=1e-6,
        feedforward="relu",
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        tie_embeddings=True,
        kernel="auto",
        remat=False,
        layerdrop=0.0,
        dtype=None,
        **kwargs,
    ):
        # === Config ===
        config = T5Config(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_decoder_layers=num_decoder_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            key_value_dim=key_value_dim,
            intermediate_dim=intermediate_dim,
            dropout=dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            feedforward=feedforward,
            relative_attention_num_buckets=relative_attention_num_buckets,
            relative_attention_max_distance=relative_attention_max_distance,
            tie_embeddings=tie_embeddings,
            kernel=kernel,
            remat=remat,
            layerdrop=layerdrop,
        )
        policy = _dtype_policy(dtype)
        decoder_depth = num_layers if num_decoder_layers is None else num_decoder_layers
        ffn_type, activation = FEEDFORWARDS[feedforward]

        # === Layers ===
        self.token_embedding = TokenEmbedding(
            vocabulary_size, hidden_dim, tie_weights=True,
            embeddings_initializer=_normal(1.0), dtype=policy, name="token_embedding",
        )
        self.encoder_embedding_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="encoder_embedding_dropout"
        )
        self.decoder_embedding_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="decoder_embedding_dropout"
        )
        bias_args = dict(
            num_heads=num_heads,
            num_buckets=relative_attention_num_buckets,
            max_distance=relative_attention_max_distance,
            embeddings_initializer=_normal(hidden_dim ** -0.5),
            dtype=policy,
        )
        self.encoder_relative_attention_bias = RelativePositionBias(
            bidirectional=True, name="encoder_relative_attention_bias", **bias_args
        )
        self.decoder_relative_attention_bias = RelativePositionBias(
            bidirectional=False, name="decoder_relative_attention_bias", **bias_args
        )

        # T5's initialisation (Mesh TensorFlow / HF `T5PreTrainedModel`, factor 1.0) folds
        # the attention's 1/sqrt(d_kv) into the query kernel (`attention_scale=1.0`).
        def block(i, decoder):
            return TransformerBlock(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                head_dim=key_value_dim,
                causal=decoder,
                cross_attention=decoder,
                norm_first=True,
                norm="rmsnorm",
                layer_norm_epsilon=layer_norm_epsilon,
                feedforward=ffn_type,
                activation=activation,
                use_bias=False,
                dropout=dropout,
                attention_dropout=dropout,
                activation_dropout=dropout,
                attention_scale=1.0,
                kernel=kernel,
                kernel_initializer=_normal(hidden_dim ** -0.5),
                query_initializer=_normal((hidden_dim * key_value_dim) ** -0.5),
                attention_output_initializer=_normal((num_heads * key_value_dim) ** -0.5),
                feedforward_output_initializer=_normal(intermediate_dim ** -0.5),
                dtype=policy,
                remat=config.remat,
                layerdrop=config.layerdrop,
                clamp_float16=True,
                name=f"{'decoder' if decoder else 'encoder'}_layer_{i}",
            )

        self.encoder_layers = [block(i, False) for i in range(num_layers)]
        self.decoder_layers = [block(i, True) for i in range(decoder_depth)]
        self.encoder_output_norm = RMSNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="encoder_output_norm"
        )
        self.decoder_output_norm = RMSNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="decoder_output_norm"
        )
        self.encoder_output_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="encoder_output_dropout"
        )
        self.decoder_output_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="decoder_output_dropout"
        )

        # === Functional Model ===
        encoder_token_ids = keras.Input(shape=(None,), dtype="int32", name="encoder_token_ids")
        encoder_padding_mask = keras.Input(
            shape=(None,), dtype="int32", name="encoder_padding_mask"
        )
        decoder_token_ids = keras.Input(shape=(None,), dtype="int32", name="decoder_token_ids")
        decoder_padding_mask = keras.Input(
            shape=(None,), dtype="int32", name="decoder_padding_mask"
        )
        encoder_output = self._encoder_stack(encoder_token_ids, encoder_padding_mask)
        decoder_output = self._decoder_stack(
            decoder_token_ids, decoder_padding_mask, encoder_output, encoder_padding_mask
        )
        super().__init__(
            inputs={
                "encoder_token_ids": encoder_token_ids,
                "encoder_padding_mask": encoder_padding_mask,
                "decoder_token_ids": decoder_token_ids,
                "decoder_padding_mask": decoder_padding_mask,
            },
            outputs={
                "encoder_sequence_output": encoder_output,
                "decoder_sequence_output": decoder_output,
            },
            dtype=policy,
            **kwargs,
        )

        self._store_config(config, dtype)

    def id_inputs(self):
        """`encoder_token_ids` / `decoder_token_ids` in `[0, vocabulary_size)` where their
        padding masks mark a token, checked at every entry point (`kzoo.inputs`)."""
        size = self.config.vocabulary_size
        return (
            IdInput("encoder_token_ids", size, "vocabulary_size", mask="encoder_padding_mask"),
            IdInput("decoder_token_ids", size, "vocabulary_size", mask="decoder_padding_mask"),
        )

    # === Stacks (shared by the functional graph and the decoding methods) ===

    def _encoder_stack(self, token_ids, padding_mask, training=None):
        x = self.token_embedding(token_ids)
        x = self.encoder_embedding_dropout(x, training=training)
        bias = self.encoder_relative_attention_bias(x)
        for block in self.encoder_layers:
            x = block(x, padding_mask=padding_mask, attention_bias=bias, training=training)
        x = self.encoder_output_norm(x)
        return self.encoder_output_dropout(x, training=training)

    def _decoder_stack(self, token_ids, padding_mask, encoder_output, encoder_padding_mask,
                       training=None):
        x = self.token_embedding(token_ids)
        x = self.decoder_embedding_dropout(x, training=training)
        bias = self.decoder_relative_attention_bias(x)
        for block in self.decoder_layers:
            x = block(
                x,
                padding_mask=padding_mask,
                attention_bias=bias,
                encoder_outputs=encoder_output,
                encoder_padding_mask=encoder_padding_mask,
                training=training,
            )
        x = self.decoder_output_norm(x)
        return self.decoder_output_dropout(x, training=training)

    # === Fast decoding ===

    def encode(self, encoder_token_ids, encoder_padding_mask=None, training=False):
        """Run the encoder alone: `(batch, enc_len, hidden_dim)`.

        `encoder_padding_mask` defaults to all ones.

        Example:
        >>> enc = backbone.encode(np.array([[5, 6, 1]]), np.array([[1, 1, 1]]))
        """
        token_ids = ops.convert_to_tensor(encoder_token_ids, "int32")
        if encoder_padding_mask is None:
            encoder_padding_mask = ops.ones_like(token_ids)
        padding_mask = ops.convert_to_tensor(encoder_padding_mask)
        return self._encoder_stack(token_ids, padding_mask, training=training)

    def init_cache(self, batch_size, max_length, encoder_outputs, per_layer=False):
        """Empty self-attention caches and the cross-attention keys/values.

        Args:
            batch_size: rows.
            max_length: decoder positions the self-attention cache holds.
            encoder_outputs: `(batch, enc_len, hidden_dim)` from `encode`.
            per_layer: return lists of per-layer caches in pair form `(keys, values)`,
                each `(batch, num_heads, length, key_value_dim)` (see `MultiHeadAttention`),
                instead of stacked tensors: what the decode loop of `kzoo.generation`
                carries, so that each layer's keys/values are written in place and read
                without a copy, never re-stacked or sliced.

        Returns:
            `(self_cache, cross_cache)`: zeros `(batch, num_decoder_layers, 2, num_heads,
            max_length, key_value_dim)` and `(batch, num_decoder_layers, 2, num_heads,
            enc_len, key_value_dim)`, the keys/values of every decoder layer's
            cross-attention, projected once from `encoder_outputs`.

        Example:
        >>> self_cache, cross_cache = backbone.init_cache(1, 20, enc)
        """
        dtype = self.compute_dtype
        half = (batch_size, self.num_heads, max_length, self.key_value_dim)
        self_caches = [(ops.zeros(half, dtype), ops.zeros(half, dtype))
                       for _ in self.decoder_layers]
        cross_caches = []
        for block in self.decoder_layers:
            k, v = block.cross_attention_layer.project_key_value(encoder_outputs)
            cross_caches.append(tuple(ops.cast(part, dtype)
                                      for part in MultiHeadAttention.key_value_pair(k, v)))
        if per_layer:
            return self_caches, cross_caches

        def stacked(pairs):  # (batch, layers, 2, heads, length, key_value_dim)
            return ops.stack([ops.stack(pair, axis=1) for pair in pairs], axis=1)

        return stacked(self_caches), stacked(cross_caches)

    def decode_step(
        self,
        decoder_token_ids,
        encoder_padding_mask,
        self_cache,
        cross_cache,
        cache_index,
        decoder_padding_mask=None,
        training=False,
    ):
        """Run the decoder on new tokens at positions `cache_index, cache_index + 1, ...`.

        Keys/values of the new tokens are written into `self_cache` at `cache_index`; the
        queries attend causally to everything in the cache up to themselves, with the
        decoder's relative bias over the whole cache length
        (`RelativePositionBias(query, cache, start_index=cache_index)`), and to the
        encoder through the precomputed `cross_cache`.

        Args:
            decoder_token_ids: `(batch, step_len)` int ids.
            encoder_padding_mask: `(batch, enc_len)` (1 = real token).
            self_cache, cross_cache: from `init_cache` (or the previous step): stacked
                tensors or lists of per-layer caches (the updated cache comes back the same
                way).
            cache_index: int or scalar int tensor, position of the first new token.
            decoder_padding_mask: optional `(batch, max_length)` mask over the cache.

        Returns:
            `(hidden, self_cache)`: the decoder output `(batch, step_len, hidden_dim)`
            (after the final norm) and the updated cache.

        Example:
        >>> hidden, self_cache = backbone.decode_step(np.zeros((1, 1), "int32"), mask,
        ...                                           self_cache, cross_cache, 0)
        """
        token_ids = ops.convert_to_tensor(decoder_token_ids, "int32")
        per_layer = isinstance(self_cache, (list, tuple))
        fast = fast_decode.enabled(training)  # (dropout is the identity there)
        x = fast_decode.embed(self.token_embedding, token_ids)
        if not fast:
            x = self.decoder_embedding_dropout(x, training=training)
        causal_bias = fast and decoder_padding_mask is None
        if causal_bias:
            bias = self._causal_bias_rows(self_cache[0] if per_layer else self_cache[:, 0],
                                          cache_index, x.shape[1])
        else:
            # Keys of the first layer `(batch, max_length, heads, head_dim)`: only their
            # length is read (the bias spans the whole cache).
            keys = MultiHeadAttention.cached_key_value(self_cache[0] if per_layer
                                                       else self_cache[:, 0])[0]
            bias = self.decoder_relative_attention_bias(x, keys, start_index=cache_index)
        encoder_padding_mask = ops.convert_to_tensor(encoder_padding_mask)
        caches = []
        for i, block in enumerate(self.decoder_layers):
            x, layer_cache, _ = decode_block(
                block,
                x,
                padding_mask=decoder_padding_mask,
                attention_bias=bias,
                encoder_padding_mask=encoder_padding_mask,
                cache=self_cache[i] if per_layer else self_cache[:, i],
                cache_index=cache_index,
                cross_cache=cross_cache[i] if per_layer else cross_cache[:, i],
                training=training,
                causal_bias=causal_bias,
            )
            caches.append(layer_cache)
        x = fast_decode.norm(self.decoder_output_norm, x)
        if not fast:
            x = self.decoder_output_dropout(x, training=training)
        return x, caches if per_layer else ops.stack(caches, axis=1)

    def _causal_bias_rows(self, cache, cache_index, q_len):
        """The torch fast path's decoder self-attention bias for queries at `cache_index ..
        cache_index + q_len - 1` over a cache (stacked `(batch, 2, heads, length, head_dim)`
        or in pair form, see `MultiHeadAttention`): rows of
        one `(1, heads, length, length)` table of the relative position bias with the keys
        after each query set to the dtype's minimum (the causal mask folded in), made once
        per decode loop (`fast_decode.memo`) instead of bucketed again at every step."""
        import torch

        layer = self.decoder_relative_attention_bias
        keys = cache[0] if isinstance(cache, (tuple, list)) else cache[:, 0]
        length = keys.shape[2]
        table = fast_decode.memo(("t5_causal_bias", id(layer), length),
                                 [fast_decode._value(layer.embeddings)],
                                 lambda: causal_bias_table(layer, length))
        if type(cache_index) is int:  # only the keys written so far (see `block_step`)
            return table[:, :, cache_index:cache_index + q_len, :cache_index + q_len]
        # (`index_select`, not `narrow`: a tensor start would be read on the host, a device
        # sync, which a CUDA graph of the step cannot capture)
        start = torch.as_tensor(cache_index, dtype=torch.long, device=table.device).view(1)
        rows = start if q_len == 1 else start + torch.arange(q_len, device=table.device)
        return table.index_select(2, rows)

    # === Config ===


def causal_bias_table(layer, length):
    """torch: the decoder self-attention's relative position bias `(1, heads, length,
    length)` of `layer` (a `RelativePositionBias`) with the keys after each query set to the
    dtype's minimum (the causal mask folded in): what a decode loop's steps read rows of."""
    import torch

    positions = ops.zeros((1, length, 1), layer.compute_dtype)
    table = layer(positions, positions)
    future = torch.ones((length, length), dtype=torch.bool, device=table.device).triu(1)
    return table.masked_fill(future, torch.finfo(table.dtype).min)


# === Task model ===


def _to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def _right_pad(rows, pad_token_id):
    """Rows of token ids of different lengths -> (ids, mask) int32 arrays, right-padded."""
    length = max(1, max(len(row) for row in rows))
    ids = np.full((len(rows), length), pad_token_id, "int32")
    mask = np.zeros((len(rows), length), "int32")
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def _check_no_empty_row(mask):
    """`generate`'s encoder inputs: every row needs a real token (as GPT's prompts do; an
    encoder row of padding only would be answered from nothing)."""
    empty = np.flatnonzero(~np.asarray(mask).astype(bool).any(axis=1))
    if empty.size:
        raise ValueError(
            f"Input {int(empty[0])} is empty (no real token under its padding mask): every "
            "encoder input needs at least one token (e.g. `</s>`)."
        )


@keras.saving.register_keras_serializable(package="kzoo")
class T5Seq2SeqLM(FilledInputs, TaskModel):
    """T5 with its language-model head: vocabulary logits at every decoder position.

    With `backbone.tie_embeddings` (v1.0) the logits are
    `(decoder_output * hidden_dim^-1/2) @ E^T` with `E` the shared token embeddings; without
    (v1.1) they come from a separate `lm_head` (Dense without bias, initialised N(0, 1)).
    Train with teacher forcing: `decoder_token_ids` are the targets shifted right behind
    `decoder_start_token_id` (0), and the loss is a sparse categorical cross-entropy
    weighted by `decoder_padding_mask`.

    Args:
        backbone: a `T5Backbone`.
        stop_token_ids: None, or the token ids (an int or a list) that end a row in
            `generate` when it is given `stop_token_ids="auto"` (its default); T5's `</s>`
            is 1.
        decoder_start_token_id: the first decoder input of `generate` (T5: 0, the pad
            token) when it is given "auto" (its default).
        pad_token_id: the padding id of `generate`'s raw token-id inputs when it is given
            "auto" (its default).
        dtype: dtype policy of the head (defaults to the backbone's).

    The three generation defaults are saved with the model; `kzoo.presets.load` of a
    Hugging Face checkpoint sets them from its `eos_token_id`, `decoder_start_token_id` and
    `pad_token_id` (`generation_config.json` first, as transformers does), and exporting
    writes them back.

    Inputs: the backbone's dict. Output: logits `(batch, dec_len, vocabulary_size)`.

    `generate(...)` decodes greedily, by sampling or by beam search (see its docstring,
    and `kzoo.generation`). When the model has
    a `tokenizer` attribute (a `tokenizers.Tokenizer`, set by `kzoo.presets.load` on a
    Hugging Face directory with a `tokenizer.json`), it also takes and returns strings.

    Example:
    >>> backbone = T5Backbone(vocabulary_size=1000, num_layers=2, num_heads=4,
    ...                       hidden_dim=64, key_value_dim=16, intermediate_dim=128)
    >>> model = T5Seq2SeqLM(backbone)
    >>> model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> [len(row) for row in model.generate(np.array([[5, 6, 7, 1]]), max_new_tokens=5)]
    [5]
    """

    _input_fills = _INPUT_FILLS

    family = FAMILY
    task_name = "seq2seq_lm"

    def default_loss(self):
        """`compile`'s loss when given none: `kzoo.losses.TokenCrossentropy()`."""
        from kzoo.losses import TokenCrossentropy

        return TokenCrossentropy()

    def __init__(self, backbone, stop_token_ids=(1,), decoder_start_token_id=0, pad_token_id=0,
                 dtype=None, **kwargs):
        check_instance("backbone", backbone, T5Backbone)
        vocabulary_size = backbone.vocabulary_size
        self.stop_token_ids = check_stop_token_ids(stop_token_ids, vocabulary_size)
        self.decoder_start_token_id = check_token_id(
            "decoder_start_token_id", decoder_start_token_id, vocabulary_size)
        self.pad_token_id = check_token_id("pad_token_id", pad_token_id, vocabulary_size)
        policy = _dtype_policy(dtype) or backbone.dtype_policy
        # === Layers ===
        self.backbone = backbone
        self.lm_head = None
        if not backbone.tie_embeddings:
            self.lm_head = RowDense(  # (a Dense; on JAX over flattened rows)
                backbone.vocabulary_size,
                use_bias=False,
                kernel_initializer=_normal(1.0),
                dtype=policy,
                name="lm_head",
            )
        # === Functional Model ===
        inputs = backbone.input
        hidden = backbone(inputs)["decoder_sequence_output"]
        logits = self._logits(hidden)
        super().__init__(inputs=inputs, outputs=logits, dtype=policy, **kwargs)

    def _task_config(self):
        stops = self.stop_token_ids
        return {"stop_token_ids": None if stops is None else list(stops),
                "decoder_start_token_id": self.decoder_start_token_id,
                "pad_token_id": self.pad_token_id}

    def _logits(self, hidden):
        if self.lm_head is not None:
            return self.lm_head(hidden)
        scaled = hidden * (self.backbone.hidden_dim ** -0.5)
        return self.backbone.token_embedding(scaled, reverse=True)

    # === Generation ===

    def generation_prefill(self, inputs, max_new_tokens):
        """Encode, project the cross-attention keys/values once and feed the decoder start
        token (the decoding interface of `kzoo.generation`).

        Args:
            inputs: `{"encoder_token_ids", "encoder_padding_mask"}` `(batch, enc_len)` and
                `"decoder_start_token_ids"` `(batch, 1)`.
            max_new_tokens: the steps that follow (the self-attention cache holds that many
                positions: the start token and every new token but the last).

        Returns:
            `(logits, state, constants)`: the float32 logits `(batch, vocab)` of the first
            new token, `{"cache"}` (self-attention, a list of per-layer caches) and
            `{"encoder_padding_mask", "cross_cache"}` (a list too).
        """
        token_ids = ops.convert_to_tensor(inputs["encoder_token_ids"], "int32")
        mask = ops.convert_to_tensor(inputs["encoder_padding_mask"], "int32")
        encoded = self.backbone.encode(token_ids, mask)
        self_cache, cross_cache = self.backbone.init_cache(
            token_ids.shape[0], max_new_tokens, encoded, per_layer=True
        )
        constants = {"encoder_padding_mask": mask, "cross_cache": cross_cache}
        logits, state = self.generation_step(
            inputs["decoder_start_token_ids"], {"cache": self_cache}, constants, -1
        )
        return logits, state, constants

    def generation_step(self, token_ids, state, constants, index):
        """Feed `token_ids (batch, 1)`, the tokens of step `index` (decoder position
        `index + 1`; -1 = the start token): the float32 logits `(batch, vocab)` of the next
        token and the new `{"cache"}`."""
        hidden, cache = self.backbone.decode_step(
            token_ids, constants["encoder_padding_mask"], state["cache"],
            constants["cross_cache"],
            # (a Python int in PyTorch's loop: see `fast_decode.block_step`)
            index + 1 if type(index) is int else ops.cast(index, "int32") + 1,
        )
        hidden = hidden[:, -1:, :]
        if self.lm_head is not None:
            logits = fast_decode.dense(self.lm_head, hidden)
        else:
            logits = fast_decode.unembed(self.backbone.token_embedding,
                                         hidden * (self.backbone.hidden_dim ** -0.5))
        return ops.cast(logits[:, -1, :], "float32"), {"cache": cache}

    def _prepare_inputs(self, prompts, padding_mask, pad_token_id):
        """(token ids, padding mask, how to return) from strings, a dict or an array; the
        ids are checked once here (integers in [0, vocabulary_size))."""
        from kzoo import generation

        vocabulary_size = self.backbone.vocabulary_size
        strings = None
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(s, str) for s in prompts)
        ):
            tokenizer = getattr(self, "tokenizer", None)
            if tokenizer is None:
                raise ValueError(
                    "`prompts` are strings but this model has no `tokenizer`; set "
                    "`model.tokenizer` to a `tokenizers.Tokenizer` or pass token ids."
                )
            strings = "single" if isinstance(prompts, str) else "batch"
            texts = [prompts] if strings == "single" else list(prompts)
            encoded = [e.ids for e in tokenizer.encode_batch(texts)]
            generation.check_token_ids(encoded, vocabulary_size)
            ids, mask = _right_pad(encoded, pad_token_id)
            return ids, mask, strings
        if isinstance(prompts, (list, tuple)) and not prompts:
            raise ValueError("`prompts` is empty: give at least one prompt.")
        if isinstance(prompts, Mapping):
            ids, mask = generation.prompt_dict(
                prompts, "encoder_token_ids", "encoder_padding_mask", padding_mask,
                hint=(" (generate makes the decoder's inputs itself: it starts from "
                      "`decoder_start_token_id`)"
                      if any(str(key).startswith("decoder_") for key in prompts) else ""))
        elif (rows := generation.prompt_rows(prompts, "prompts")) is not None:
            # Rows of token ids of different lengths: right-pad them.
            if padding_mask is not None:
                raise ValueError(
                    "`padding_mask` is only used with an array of prompts; lists of token "
                    "id lists carry their own lengths."
                )
            generation.check_token_ids(rows, vocabulary_size)
            ids, mask = _right_pad(rows, pad_token_id)
            _check_no_empty_row(mask)
            return ids, mask, strings
        else:
            ids = generation.integer_array(prompts, "prompts")
            mask = padding_mask
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(
                "`prompts` token ids must have shape (batch, length); got shape "
                f"{ids.shape}."
            )
        if ids.shape[0] == 0:
            raise ValueError("`prompts` is empty: give at least one prompt.")
        if mask is None:
            mask = (ids != pad_token_id).astype("int32")
        else:
            mask = _to_numpy(mask)
            generation.check_mask_values(mask, "padding_mask", "generate's argument")
            mask = mask.astype("int32")
            if mask.shape != ids.shape:
                raise ValueError(
                    f"`padding_mask` must have the shape of the token ids {ids.shape}; got "
                    f"{mask.shape}."
                )
        generation.check_token_ids(ids, vocabulary_size, mask.astype(bool))
        _check_no_empty_row(mask)
        return ids.astype("int32"), mask, strings

    def generate(
        self,
        prompts,
        max_new_tokens=20,
        strategy="greedy",
        temperature=1.0,
        top_k=None,
        top_p=None,
        num_beams=None,
        length_penalty=1.0,
        early_stopping=False,
        stop_token_ids=AUTO,
        seed=None,
        padding_mask=None,
        compile=True,
        decoder_start_token_id=AUTO,
        pad_token_id=AUTO,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        num_return_sequences=1,
        return_scores=False,
    ):
        """Generate decoder tokens for each input sequence.

        The encoder runs once; the cross-attention keys/values of every decoder layer are
        projected once from its output; the decoder then runs one token per step on a
        self-attention key/value cache of `max_new_tokens` positions, starting from
        `decoder_start_token_id`, in the one loop of `kzoo.generation` (compiled whole on JAX
        and TensorFlow). A row ends at its first stop token; decoding stops when every row
        has ended. The arguments shared with `GPTCausalLM.generate` are the same and so is the
        return type; "auto" (the default of `stop_token_ids`, `decoder_start_token_id` and
        `pad_token_id`) takes the model's own value (T5's: stop at `</s>` = 1, start from
        0, pad 0; a Hugging Face checkpoint's when loaded from one).

        Args:
            prompts: encoder token ids `(batch, enc_len)` (the padding mask is `padding_mask`,
                or `ids != pad_token_id`), a list of id rows of any lengths (right-padded),
                a dict with "encoder_token_ids" and optionally "encoder_padding_mask" (no
                other key: `generate` makes the decoder's inputs), or (with a `tokenizer`
                attribute) a string or a list of strings. Ids must lie in
                `[0, vocabulary_size)`; float arrays are refused.
            max_new_tokens: most tokens generated per row.
            strategy: "greedy", "sample" or "beam" (see `kzoo.generation`).
            temperature, top_k, top_p: sampling options (`strategy="sample"`); a `top_k` at or
                above the vocabulary size keeps every token (as transformers, which clamps
                it to the vocabulary).
            num_beams: beams of beam search (None: 4 with `strategy="beam"`, else 1;
                `num_beams > 1` with "greedy" means beam search); more beams than tokens in
                the vocabulary are allowed, but `num_beams * vocabulary_size` must stay
                below 2**31 and the cache and logits of `num_beams` rows a prompt must fit
                in memory.
            length_penalty: beam search score = sum of log-probabilities / length **
                length_penalty.
            early_stopping: beam search end rule: False, True or "never" (as transformers).
            repetition_penalty: a finite number > 0 (1.0: off): the score of every token
                already in the decoder's row (`decoder_start_token_id` and the new tokens, as
                transformers' decoder input ids; not the encoder input) is divided by it where
                positive, multiplied where negative (transformers'
                `RepetitionPenaltyLogitsProcessor`); every strategy (beam search: on the
                log-probabilities, as transformers).
            no_repeat_ngram_size: an int >= 0 (0: off): no n-gram of that size occurs twice
                in the decoder's row (the start token and the new tokens; transformers'
                `NoRepeatNGramLogitsProcessor`).
            min_new_tokens: an int >= 0 (0: off): no stop token before that many new tokens
                (transformers' `MinNewTokensLengthLogitsProcessor`; above `max_new_tokens`:
                no stop at all).
            stop_token_ids: ids ending a row; None or () for none; "auto": the model's
                `stop_token_ids` (T5's `</s>`, 1, unless set otherwise).
            seed: int, `keras.random.SeedGenerator` or None, for sampling.
            padding_mask: with an array of encoder ids, which entries are real tokens.
            compile: compile the whole loop (True) or run it eagerly, step by step (False).
            num_return_sequences: outputs per prompt (transformers' name and meaning; 1 by
                default): with strategy="sample", that many independent draws of each
                prompt (the same seed gives the same draws); with beam search, the
                `num_return_sequences` best finished hypotheses, best first (at most
                `num_beams`); greedy decoding takes only 1. The outputs are grouped prompt
                by prompt: `len(prompts) * num_return_sequences` of them.
            return_scores: False (default) or True: also return the outputs' scores, as
                `GPTCausalLM.generate` (greedy / sampling: each new token's log-probability;
                beam search: each output's final score).
            decoder_start_token_id: the first decoder input ("auto": the model's, T5's 0).
            pad_token_id: the padding id of raw token-id inputs (and what ended rows emit
                inside the loop; never part of a result; "auto": the model's, T5's 0).

        Returns:
            A list (one per input, or `num_return_sequences` per input) of the generated
            token ids (without the start token), ending with the stop token if one was
            produced (beam search: the best finished hypothesis, or the best ones); or
            decoded strings (special tokens skipped) when strings were given: a string for
            one string and one output, else a list. With `return_scores=True`: `(that,
            scores)`, `scores` shaped as the outputs (see `GPTCausalLM.generate`).

        Example:
        >>> model.generate(np.array([[5, 6, 7, 1]]), max_new_tokens=5)
        >>> model.generate(ids, strategy="sample", top_p=0.9, temperature=0.7, seed=0)
        >>> model.generate(ids, strategy="beam", num_beams=4, length_penalty=0.6)
        >>> model.generate(ids, repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5)
        >>> model.generate(ids, strategy="sample", num_return_sequences=3, seed=0)
        >>> ids, log_probs = model.generate(ids, return_scores=True)
        """
        # `kzoo.generation` sits above the model families (it imports none of them).
        from kzoo import generation

        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        generation.check_return_scores(return_scores)
        sampler = generation.make_sampler(strategy, temperature, top_k, top_p, num_beams,
                                          length_penalty, early_stopping, repetition_penalty,
                                          no_repeat_ngram_size, min_new_tokens,
                                          num_return_sequences)
        # (ids the vocabulary cannot produce are refused, as by the constructor: a row
        # would never stop)
        stops = generation.stop_ids(
            self.stop_token_ids if is_auto(stop_token_ids)
            else check_stop_token_ids(stop_token_ids, self.backbone.vocabulary_size))
        vocabulary_size = self.backbone.vocabulary_size
        decoder_start_token_id, pad_token_id = (
            check_token_id(name, getattr(self, name) if is_auto(value) else value,
                           vocabulary_size)
            for name, value in (("decoder_start_token_id", decoder_start_token_id),
                                ("pad_token_id", pad_token_id)))
        ids, mask, strings = self._prepare_inputs(prompts, padding_mask, pad_token_id)
        backbone = self.backbone
        generation.check_cache_size(
            max_new_tokens, max_new_tokens,
            len(backbone.decoder_layers) * 2 * ids.shape[0] * sampler.rows_per_prompt
            * backbone.num_heads * backbone.key_value_dim
            * np.dtype(backbone.compute_dtype).itemsize,
            prompts=ids.shape[0], num_beams=sampler.num_beams,
            vocabulary_size=vocabulary_size, num_return_sequences=sampler.num_return_sequences)
        start = np.full((ids.shape[0], 1), decoder_start_token_id, "int32")
        outputs = generation.decode(
            self,
            {"encoder_token_ids": ids, "encoder_padding_mask": mask,
             "decoder_start_token_ids": start},
            sampler=sampler, max_new_tokens=max_new_tokens, stop_token_ids=stops,
            pad_token_id=pad_token_id, seed=seed, compile=compile,
            return_scores=return_scores,
            history=generation.history_rows(start),
        )
        scores = None
        if return_scores:
            outputs, scores = outputs
        if strings is None:
            return outputs if scores is None else (outputs, scores)
        texts = self.tokenizer.decode_batch(outputs, skip_special_tokens=True)
        if strings == "single" and len(texts) == 1:
            texts, scores = texts[0], None if scores is None else scores[0]
        return texts if scores is None else (texts, scores)


T5Config.backbone_class = T5Backbone

