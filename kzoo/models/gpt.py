"""GPT: decoder-only language models.

- GPT-2 (Radford et al., 2019, "Language Models are Unsupervised Multitask Learners"): token +
  learned position embeddings, `num_layers` pre-LN causal transformer blocks with tanh-GELU
  feed-forwards, a final layer norm, the output projection tied to the token embedding.
- A modern decoder as a configuration of the same backbone (LLaMA-style, Touvron et al.
  2023): RMSNorm (`norm="rmsnorm"`), rotary positions (`position="rotary"`), SwiGLU
  (`feedforward="gated", activation="silu"`), grouped-query attention (`num_kv_heads`), no
  biases (`use_bias=False`), optionally a sparse mixture-of-experts feed-forward
  (`feedforward="moe"`, Mixtral-style).

Classes:

- `GPTBackbone`: inputs `{"token_ids", "padding_mask"}` `(batch, seq)` int32 (the mask may
  be left out: every token real; and `"document_ids"` for packed rows,
  `packed_inputs=True`), output the final hidden states
  `(batch, seq, hidden_dim)`; `call_with_cache` runs it incrementally on a key/value cache.
- `GPTCausalLM`: next-token logits `(batch, seq, vocabulary_size)`, and `generate(...)`
  (greedy / temperature / top-k / top-p / beam search decoding on the key/value cache, in
  the one decode loop of `kzoo.generation`).

Example:
>>> backbone = GPTBackbone(vocabulary_size=260, num_layers=2, num_heads=4, hidden_dim=64,
...                        intermediate_dim=256, max_sequence_length=128)
>>> lm = GPTCausalLM(backbone)
>>> lm.generate([[72, 101], [87]], max_new_tokens=5)       # two prompts, five tokens each
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Optional

import keras
import numpy as np
from keras import ops

from kzoo.inputs import DocumentIdInput
from kzoo.layers import fast_decode
from kzoo.layers.fast_decode import decode_block
from kzoo.layers.blocks import TransformerBlock
from kzoo.layers.embedding import TokenEmbedding
from kzoo.layers.feedforward import ACTIVATION_NAMES
from kzoo.layers.masks import check_packed_attention, document_mask, document_positions
from kzoo.layers.norm import LayerNorm
from kzoo.layers.position import (
    ROPE_FIELDS_OF_TYPE,
    ROPE_SCALING_FIELDS,
    PositionEmbedding,
    ROPE_SCALING_TYPES,
    check_rope_scaling,
)
from kzoo.layers.utils import (
    check_at_most,
    check_bool,
    check_choice,
    clip,
    FieldError,
    check_divides,
    check_instance,
    check_positive_float,
    check_positive_int,
    check_rate,
)
from kzoo.models.base import (
    AUTO,
    Backbone,
    FamilyConfig,
    FilledInputs,
    IdInput,
    TaskModel,
    check_stop_token_ids,
    is_auto,
)

FAMILY = "gpt"

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
FEEDFORWARDS = ("plain", "gated", "moe")
EXPERT_TYPES = ("plain", "gated")


def _dtype_policy(dtype):
    return keras.dtype_policies.get(dtype) if dtype is not None else None


def gpt_initializer(stddev=0.02):
    """GPT-2's initialiser: normal(0, stddev) for every kernel and embedding table."""
    return keras.initializers.RandomNormal(stddev=stddev)


# === Config ===


@dataclasses.dataclass(frozen=True)
class GPTConfig(FamilyConfig):
    """The configuration of a `GPTBackbone`, validated once on construction.

    Its fields are `GPTBackbone`'s arguments (see there for their meaning), with the same
    defaults (GPT-2 small). Rules between fields: `num_heads` divides `hidden_dim` unless
    `head_dim` is given, `num_kv_heads` divides `num_heads`, rotary positions need an even
    head size, RoPE scaling (`rope_scaling_type` and its settings) needs rotary positions,
    `feedforward="moe"` needs `num_experts` (and `top_k <= num_experts`), `num_experts` is
    only for `feedforward="moe"`.

    Example:
    >>> config = GPTConfig(vocabulary_size=260, num_layers=2, num_heads=4, hidden_dim=64,
    ...                    intermediate_dim=256, max_sequence_length=128)
    >>> backbone = config.build()              # the same as GPTBackbone(**config.to_dict())
    >>> GPTConfig(num_kv_heads=5)
    ValueError: `num_kv_heads` must divide num_heads=12; got num_kv_heads=5 ...
    """

    vocabulary_size: int = 50257
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    max_sequence_length: int = 1024
    dropout: float = 0.1
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_tanh"
    norm: str = "layernorm"
    position: str = "learned"
    feedforward: str = "plain"
    num_kv_heads: Optional[int] = None
    use_bias: bool = True
    rope_max_wavelength: float = 10000
    num_experts: Optional[int] = None
    top_k: int = 2
    capacity_factor: Optional[float] = None
    expert_type: str = "gated"
    tie_embeddings: bool = True
    attention_scale: Optional[float] = None
    initializer_range: float = 0.02
    attention: str = "full"
    attention_options: Optional[dict] = None
    packed_inputs: bool = False
    remat: bool = False
    layerdrop: float = 0.0
    head_dim: Optional[int] = None
    rope_scaling_type: Optional[str] = None
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: Optional[float] = None
    rope_high_freq_factor: Optional[float] = None
    rope_original_max_position_embeddings: Optional[int] = None
    rope_beta_fast: Optional[float] = None
    rope_beta_slow: Optional[float] = None
    rope_attention_factor: Optional[float] = None
    rope_truncate: Optional[bool] = None
    attention_scale_by_inverse_layer: bool = False

    def __post_init__(self):
        check = self._check
        check("remat", check_bool)
        check("layerdrop", check_rate)
        check("vocabulary_size", check_positive_int)
        check("num_layers", check_positive_int)
        check("num_heads", check_positive_int)
        check("hidden_dim", check_positive_int)
        check("head_dim", check_positive_int, allow_none=True)
        if self.head_dim is None:
            check("num_heads", check_divides, "hidden_dim", self.hidden_dim)
        check("intermediate_dim", check_positive_int)
        check("max_sequence_length", check_positive_int)
        check("dropout", check_rate)
        check("layer_norm_epsilon", check_positive_float)
        check("activation", check_choice, ACTIVATION_NAMES)
        check("norm", check_choice, NORMS)
        check("position", check_choice, POSITIONS)
        check("feedforward", check_choice, FEEDFORWARDS)
        check("num_kv_heads", check_positive_int, allow_none=True)
        if self.num_kv_heads is not None:
            check("num_kv_heads", check_divides, "num_heads", self.num_heads)
        check("use_bias", check_bool)
        check("rope_max_wavelength", check_positive_float)
        if self.position == "rotary" and self.head_dim is not None and self.head_dim % 2:
            raise FieldError(
                "`head_dim` must be even with position='rotary' (RoPE rotates pairs of "
                f"features); got head_dim={self.head_dim}.",
                "head_dim",
            )
        head_size = self.hidden_dim // self.num_heads
        if self.position == "rotary" and self.head_dim is None and head_size % 2:
            raise FieldError(
                "`position`='rotary' needs an even head size hidden_dim / num_heads; got "
                f"hidden_dim={self.hidden_dim}, num_heads={self.num_heads} (head size "
                f"{head_size}).",
                "position",
            )
        self._check_rope_scaling()
        check("top_k", check_positive_int)
        check("capacity_factor", check_positive_float, allow_none=True)
        check("expert_type", check_choice, EXPERT_TYPES)
        if self.feedforward == "moe":
            if self.num_experts is None:
                raise FieldError(
                    "`num_experts` must be a positive integer when feedforward='moe'; got "
                    "num_experts=None.",
                    "num_experts",
                )
            check("num_experts", check_positive_int)
            check("top_k", check_at_most, "num_experts", self.num_experts)
        elif self.num_experts is not None:
            raise FieldError(
                f"`num_experts` is only used with feedforward='moe'; got "
                f"num_experts={self.num_experts!r} with feedforward={self.feedforward!r}.",
                "num_experts",
            )
        check("tie_embeddings", check_bool)
        check("attention_scale", check_positive_float, allow_none=True)
        check("attention_scale_by_inverse_layer", check_bool)
        check("initializer_range", check_positive_float)
        self._check_attention_fields()
        check("packed_inputs", check_bool)
        check_packed_attention(self.packed_inputs, self.attention)

    def _check_rope_scaling(self):
        """`rope_scaling_type` None (no scaling: factor 1.0, no settings), "linear", "llama3"
        (with its three settings) or "yarn" (its original length; None for its other
        settings' defaults), rotary positions only."""
        kind = self.rope_scaling_type
        names = {"scaling_type": "rope_scaling_type", "scaling_factor": "rope_scaling_factor",
                 **_ROPE_FIELDS}
        if isinstance(kind, np.generic):  # (a NumPy string: stored as a plain one)
            kind = kind.item()
            object.__setattr__(self, "rope_scaling_type", kind)
        if kind is not None:
            if not isinstance(kind, str) or kind not in ROPE_SCALING_TYPES:
                raise FieldError(
                    "`rope_scaling_type` must be None (no scaling) or one of "
                    f"{list(ROPE_SCALING_TYPES)}; got rope_scaling_type={kind!r}.",
                    "rope_scaling_type",
                )
            if self.position != "rotary":
                raise FieldError(
                    f"`rope_scaling_type`={kind!r} needs position='rotary'; got "
                    f"position={self.position!r} (leave rope_scaling_type None).",
                    "rope_scaling_type",
                )
        else:
            for key, field in _ROPE_FIELDS.items():
                if getattr(self, field) is not None:
                    users = " or ".join(repr(kind) for kind, fields in
                                        ROPE_FIELDS_OF_TYPE.items() if key in fields)
                    raise FieldError(
                        f"`{field}` is only used with rope_scaling_type {users}; got "
                        f"{field}={getattr(self, field)!r} with rope_scaling_type=None.",
                        field,
                    )
        _, factor, *settings = check_rope_scaling(
            kind or "linear", self.rope_scaling_factor,
            *(getattr(self, field) for field in _ROPE_FIELDS.values()), names=names)
        if kind is None and factor != 1.0:
            raise FieldError(
                "`rope_scaling_factor` is only used with a rope_scaling_type ("
                f"{', '.join(map(repr, ROPE_SCALING_TYPES))}); got rope_scaling_factor="
                f"{self.rope_scaling_factor!r} with rope_scaling_type=None (set "
                "rope_scaling_type='linear' to scale positions).",
                "rope_scaling_factor",
            )
        for field, value in zip(("rope_scaling_factor",) + tuple(_ROPE_FIELDS.values()),
                                [factor] + settings):
            object.__setattr__(self, field, value)

    @property
    def rope_scaling(self):
        """The rotary embedding's scaling arguments other than the factor, as
        `TransformerBlock(rope_scaling=...)` takes them (None: linear or no scaling)."""
        if self.rope_scaling_type not in ("llama3", "yarn"):
            return None
        return {"scaling_type": self.rope_scaling_type,
                **{key: getattr(self, field) for key, field in _ROPE_FIELDS.items()
                   if getattr(self, field) is not None}}

    def layer_attention_scale(self, index):
        """The attention score scale of block `index` (counted from 0): `attention_scale`,
        divided by `index + 1` with `attention_scale_by_inverse_layer` (None, the
        attention's default `head_dim ** -0.5`, made explicit there)."""
        if not self.attention_scale_by_inverse_layer:
            return self.attention_scale
        scale = self.attention_scale
        if scale is None:
            scale = 1.0 / math.sqrt(self.head_dim or self.hidden_dim // self.num_heads)
        return scale / (index + 1)


# RotaryEmbedding's scaling argument -> its GPTConfig field.
_ROPE_FIELDS = {key: f"rope_{key}" for key in ROPE_SCALING_FIELDS}


# === Backbone ===


# What a left-out `padding_mask` holds (`FilledInputs`; transformers' default): every token
# real.
_INPUT_FILLS = {"padding_mask": ("token_ids", 1)}


@keras.saving.register_keras_serializable(package="kzoo")
class GPTBackbone(FilledInputs, Backbone):
    """The GPT decoder stack: GPT-2 by default, a LLaMA-style decoder by configuration.

    `x = token_embedding(ids) [+ position_embedding]`, dropout, `num_layers` pre-norm causal
    blocks `x = x + drop(attn(norm(x)))`, `x = x + drop(ffn(norm(x)))`, a final norm.
    Initialisation follows GPT-2: every kernel and embedding normal(0, `initializer_range`),
    biases zeros, norms ones, and the residual output projections (attention output, last
    feed-forward layer) normal(0, `initializer_range / sqrt(2 * num_layers)`).

    Args:
        vocabulary_size: number of token ids.
        num_layers: number of decoder blocks.
        num_heads: query heads (must divide `hidden_dim` unless `head_dim` is given).
        hidden_dim: width of the hidden states.
        intermediate_dim: width of the feed-forward (per expert for MoE).
        max_sequence_length: number of learned positions (the longest sequence, prompt and
            new tokens, that `generate` accepts); for rotary models, which have no position
            table, a nominal length (Hugging Face's `max_position_embeddings`) that neither
            the forward pass nor `generate` is bounded by.
        dropout: dropout on the embeddings, after every sub-layer and on the attention
            probabilities.
        layer_norm_epsilon: epsilon of every norm.
        activation: feed-forward activation ("gelu_tanh" = GPT-2's "gelu_new"; "silu" for
            SwiGLU; any `kzoo.layers.feedforward.get_activation` name).
        norm: "layernorm" (GPT-2) or "rmsnorm".
        position: "learned" (a position table added to the token embeddings) or "rotary"
            (RoPE inside the attention, no table).
        feedforward: "plain" (GPT-2 MLP), "gated" (GLU variants: SwiGLU with "silu") or
            "moe" (sparse mixture of experts).
        num_kv_heads: key/value heads for grouped-query attention (None = `num_heads`).
        use_bias: biases in the attention and feed-forward projections.
        rope_max_wavelength: RoPE base (used when `position="rotary"`).
        num_experts: number of experts (`feedforward="moe"` only; required there).
        top_k: experts per token.
        capacity_factor: MoE expert capacity (None = never drop a token).
        expert_type: "gated" (SwiGLU experts, Mixtral) or "plain" experts.
        tie_embeddings: the language-model head reuses the token embedding matrix; False adds
            a separate `(hidden_dim, vocabulary_size)` matrix
            (`token_embedding.reverse_embeddings`).
        attention_scale: attention score scale (None = `head_dim ** -0.5`).
        initializer_range: standard deviation of the normal initialiser.
        attention: the self-attention type: "full", or an efficient variant
            ("sliding_window", "strided", "longformer", "block_sparse", "bigbird", "linear",
            "performer"; see `kzoo.layers.efficient_attention`). Decoding keeps a rolling
            cache of `window` slots for "sliding_window" and an O(1) recurrent state for
            "linear"/"performer".
        attention_options: the options of `attention` (e.g. `{"window": 256}`).
        packed_inputs: take a third input, `"document_ids"`, for packed rows (several
            documents a row, see below; needs attention="full").
        remat: recompute each block's activations in the backward pass instead of
            keeping them (gradient checkpointing per block: less memory, one more forward
            pass of compute; the gradients are the same).
        layerdrop: LayerDrop rate (Fan et al. 2019): in training, each block is skipped
            (is the identity) with this probability, one draw per block and batch; in
            inference every block runs.
        head_dim: the size of each attention head (None = `hidden_dim // num_heads`): the
            query projection has `num_heads * head_dim` units, the key and value ones
            `num_kv_heads * head_dim`, and the output projection maps them back to
            `hidden_dim` (Mistral-Nemo: width 5120, 32 heads of 128). Even with rotary
            positions. `backbone.head_size` is the size in use.
        rope_scaling_type: RoPE scaling (rotary positions only): None (none), "linear"
            (position interpolation: every frequency divided by `rope_scaling_factor`),
            "llama3" (Llama 3.1's frequency-dependent rescaling) or "yarn" (YaRN, Peng et
            al. 2023; see `kzoo.layers.position.rope_inverse_frequencies`).
        rope_scaling_factor: the scaling factor (1.0 with rope_scaling_type None).
        rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position_embeddings:
            the "llama3" settings (required by it, None otherwise; Llama 3.1: 1.0, 4.0,
            8192); "yarn" requires `rope_original_max_position_embeddings` too (the
            context length before scaling).
        rope_beta_fast, rope_beta_slow, rope_attention_factor, rope_truncate: the other
            "yarn" settings (None otherwise; with "yarn" None means the defaults 32.0, 1.0,
            `0.1 ln(rope_scaling_factor) + 1` and True).
        attention_scale_by_inverse_layer: block i (counted from 0) divides its attention
            scores by `i + 1` as well: its score scale is `attention_scale / (i + 1)`
            (`head_dim ** -0.5 / (i + 1)` with attention_scale None). GPT-2's
            `scale_attn_by_inverse_layer_idx` (Stanford CRFM's "Mistral" GPT-2 runs).
        dtype: dtype policy of every layer.

    The arguments (all but `dtype` and Keras' own) are the fields of `GPTConfig`, which
    validates them: `GPTBackbone(**fields)` and `GPTConfig(**fields).build()` are the same
    model, and `backbone.config` is that `GPTConfig`.

    Inputs (a dict, each `(batch, seq)` int32): `token_ids`; `padding_mask` (1 = real token;
    left out, every token is real, as in Hugging Face's GPT-2);
    with `packed_inputs=True` also `document_ids`: the document of each token of a packed
    row, numbered 1, 2, 3, ... within the row, 0 for padding (`kzoo.data.pack` builds
    them). A token then attends only to earlier tokens of its own document
    (`kzoo.layers.document_mask`, merged with the causal and padding masks) and its
    position, learned or rotary, restarts at 0 at each document
    (`kzoo.layers.document_positions`): each document gives the hidden states it would
    give alone. `generate` / `call_with_cache` do not use it (one prompt a row).
    Output: `(batch, seq, hidden_dim)` hidden states after the final norm.

    Example:
    >>> gpt2 = GPTBackbone()                                         # GPT-2 small, 124M
    >>> modern = GPTBackbone(vocabulary_size=32000, num_layers=4, num_heads=8, hidden_dim=512,
    ...                      intermediate_dim=1376, norm="rmsnorm", position="rotary",
    ...                      feedforward="gated", activation="silu", num_kv_heads=2,
    ...                      use_bias=False, dropout=0.0, tie_embeddings=False)
    >>> modern({"token_ids": np.ones((2, 8), "int32"),
    ...         "padding_mask": np.ones((2, 8), "int32")}).shape
    (2, 8, 512)
    """

    _input_fills = _INPUT_FILLS

    family = FAMILY
    config_class = GPTConfig

    def __init__(
        self,
        vocabulary_size=50257,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
        max_sequence_length=1024,
        dropout=0.1,
        layer_norm_epsilon=1e-5,
        activation="gelu_tanh",
        norm="layernorm",
        position="learned",
        feedforward="plain",
        num_kv_heads=None,
        use_bias=True,
        rope_max_wavelength=10000,
        num_experts=None,
        top_k=2,
        capacity_factor=None,
        expert_type="gated",
        tie_embeddings=True,
        attention_scale=None,
        initializer_range=0.02,
        attention="full",
        attention_options=None,
        packed_inputs=False,
        remat=False,
        layerdrop=0.0,
        head_dim=None,
        rope_scaling_type=None,
        rope_scaling_factor=1.0,
        rope_low_freq_factor=None,
        rope_high_freq_factor=None,
        rope_original_max_position_embeddings=None,
        rope_beta_fast=None,
        rope_beta_slow=None,
        rope_attention_factor=None,
        rope_truncate=None,
        attention_scale_by_inverse_layer=False,
        dtype=None,
        **kwargs,
    ):
        # === Config ===
        config = GPTConfig(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            max_sequence_length=max_sequence_length,
            dropout=dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            activation=activation,
            norm=norm,
            position=position,
            feedforward=feedforward,
            num_kv_heads=num_kv_heads,
            use_bias=use_bias,
            rope_max_wavelength=rope_max_wavelength,
            num_experts=num_experts,
            top_k=top_k,
            capacity_factor=capacity_factor,
            expert_type=expert_type,
            tie_embeddings=tie_embeddings,
            attention_scale=attention_scale,
            initializer_range=initializer_range,
            attention=attention,
            attention_options=attention_options,
            packed_inputs=packed_inputs,
            remat=remat,
            layerdrop=layerdrop,
            head_dim=head_dim,
            rope_scaling_type=rope_scaling_type,
            rope_scaling_factor=rope_scaling_factor,
            rope_low_freq_factor=rope_low_freq_factor,
            rope_high_freq_factor=rope_high_freq_factor,
            rope_original_max_position_embeddings=rope_original_max_position_embeddings,
            rope_beta_fast=rope_beta_fast,
            rope_beta_slow=rope_beta_slow,
            rope_attention_factor=rope_attention_factor,
            rope_truncate=rope_truncate,
            attention_scale_by_inverse_layer=attention_scale_by_inverse_layer,
        )
        policy = _dtype_policy(dtype)
        init = gpt_initializer(initializer_range)
        residual_init = gpt_initializer(initializer_range / math.sqrt(2 * num_layers))

        # === Layers ===
        self.token_embedding = TokenEmbedding(
            vocabulary_size,
            hidden_dim,
            tie_weights=tie_embeddings,
            embeddings_initializer=init,
            dtype=policy,
            name="token_embedding",
        )
        self.position_embedding = None
        if position == "learned":
            self.position_embedding = PositionEmbedding(
                max_sequence_length, initializer=init, dtype=policy, name="position_embedding"
            )
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="embeddings_dropout"
        )
        # GPT-2 drops out only the sub-layer outputs (and attention probabilities), never
        # the feed-forward's hidden activations.
        self.transformer_layers = [
            TransformerBlock(
                num_heads=num_heads,
                head_dim=config.head_dim,
                intermediate_dim=intermediate_dim,
                num_kv_heads=num_kv_heads,
                causal=True,
                norm_first=True,
                norm=norm,
                layer_norm_epsilon=layer_norm_epsilon,
                feedforward=feedforward,
                activation=activation,
                use_bias=use_bias,
                dropout=dropout,
                attention_dropout=dropout,
                activation_dropout=0.0,
                attention_scale=config.layer_attention_scale(i),
                rope_max_wavelength=rope_max_wavelength if position == "rotary" else None,
                rope_scaling_factor=config.rope_scaling_factor,
                rope_scaling=config.rope_scaling,
                num_experts=num_experts,
                top_k=top_k,
                capacity_factor=capacity_factor,
                expert_type=expert_type,
                attention=config.attention,
                attention_options=config.attention_options,
                kernel_initializer=init,
                attention_output_initializer=residual_init,
                feedforward_output_initializer=residual_init,
                dtype=policy,
                remat=config.remat,
                layerdrop=config.layerdrop,
                name=f"transformer_layer_{i}",
            )
            for i in range(num_layers)
        ]
        if norm == "rmsnorm":
            from kzoo.layers.norm import RMSNorm

            self.final_norm = RMSNorm(epsilon=layer_norm_epsilon, dtype=policy,
                                      name="final_norm")
        else:
            self.final_norm = LayerNorm(
                epsilon=layer_norm_epsilon, dtype=policy, name="final_norm"
            )

        # === Functional Model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
        packed = {}  # per-document attention mask and positions of packed rows
        positions = 0
        if packed_inputs:
            document_ids = keras.Input(shape=(None,), dtype="int32", name="document_ids")
            inputs["document_ids"] = document_ids
            positions = document_positions(document_ids)
            packed["attention_mask"] = document_mask(document_ids)
            if position == "rotary":
                packed["position_index"] = positions
        x = self.token_embedding(token_ids)
        if self.position_embedding is not None:
            x = x + self.position_embedding(x, start_index=positions)
        x = self.embeddings_dropout(x)
        for block in self.transformer_layers:
            x = block(x, padding_mask=padding_mask, **packed)
        x = self.final_norm(x)
        super().__init__(
            inputs=inputs,
            outputs=x,
            dtype=policy,
            **kwargs,
        )

        self._store_config(config, dtype)

    def id_inputs(self):
        """`token_ids` in `[0, vocabulary_size)` where `padding_mask` marks a token, checked
        at every entry point (`kzoo.inputs`)."""
        ids = (IdInput("token_ids", self.config.vocabulary_size, "vocabulary_size",
                       mask="padding_mask",
                       # (packed rows restart positions at each document: any length)
                       max_length=(self.config.max_sequence_length
                                   if self.position_embedding is not None
                                   and not self.config.packed_inputs else None)),)
        if self.config.packed_inputs:
            ids += (DocumentIdInput("document_ids", like="token_ids", mask="padding_mask"),)
        return ids

    # === Cached decoding ===

    @property
    def head_size(self):
        """The size of each attention head in use: `head_dim`, or `hidden_dim // num_heads`
        where it is None (`head_dim` is the config field, None by default, as `get_config`
        round-trips it)."""
        return self.config.head_dim or self.hidden_dim // self.num_heads

    def init_cache(self, batch_size, max_length, per_layer=False):
        """An all-zero key/value cache `(batch, num_layers, 2, kv_heads, max_length, head_dim)`.

        With `per_layer=True`, a list of `num_layers` caches in pair form `(keys, values)`,
        each `(batch, kv_heads, max_length, head_dim)` (see `MultiHeadAttention`): what the
        decode loop of `kzoo.generation` carries, so that each layer's keys and values are
        written in place and read without a copy, never re-stacked or sliced.

        Efficient attention types keep their own caches (`MultiHeadAttention.init_cache`):
        "sliding_window" `min(window, max_length)` rolling slots instead of `max_length`;
        "linear"/"performer" the recurrent state `(S, z)` (stacked: `(S, z)` with a layer
        axis after the batch).

        Example:
        >>> cache = backbone.init_cache(2, 32)
        """
        if self.attention != "full":
            caches = [block.self_attention.init_cache(batch_size, max_length,
                                                      dtype=self.compute_dtype)
                      for block in self.transformer_layers]
            if per_layer:
                return caches
            return keras.tree.map_structure(lambda *xs: ops.stack(xs, axis=1), *caches)
        shape = (batch_size, 2, self.num_kv_heads or self.num_heads, max_length,
                 self.head_size)
        if per_layer:
            half = shape[:1] + shape[2:]
            return [(ops.zeros(half, dtype=self.compute_dtype),
                     ops.zeros(half, dtype=self.compute_dtype))
                    for _ in range(self.num_layers)]
        return ops.zeros(shape[:1] + (self.num_layers,) + shape[1:], dtype=self.compute_dtype)

    def call_with_cache(
        self, token_ids, cache, cache_index, padding_mask=None, position_offset=None,
        training=False,
    ):
        """Run the decoder on `token_ids` placed at `cache_index` of a key/value cache.

        Token `i` of `token_ids` sits at cache slot `cache_index + i`; its keys and values are
        written there and it attends to every cache slot up to its own (causal) that
        `padding_mask` allows. Use it for the prompt (prefill, `cache_index=0`) and then one
        token at a time.

        Args:
            token_ids: int `(batch, q_len)`.
            cache: `(batch, num_layers, 2, kv_heads, max_length, head_dim)`, or a list of
                per-layer caches (see `init_cache`, also for the efficient attention types'
                caches); returned updated in the same form.
            cache_index: int or scalar int tensor, the cache slot of the first token.
            padding_mask: `(batch, max_length)` over the cache slots, 1 = may be attended
                (prompt padding 0; slots not yet written may be 1: the causal mask hides
                them). None = every slot.
            position_offset: optional int `(batch,)`: the position of the token in slot `s`
                of row `b` is `s - position_offset[b]` (left padding: the number of pad
                slots in front of the row), so a left-padded row sees the same learned
                positions as it would alone. Softmax attention with rotary positions depends
                only on relative positions, which a common shift leaves unchanged; linear
                attention types get the per-row rotary positions too.
            training: dropout.

        Returns:
            `(hidden_states (batch, q_len, hidden_dim), updated cache)`.

        Example:
        >>> cache = backbone.init_cache(1, 16)
        >>> h, cache = backbone.call_with_cache(np.array([[5, 6, 7]]), cache, 0)
        >>> h, cache = backbone.call_with_cache(np.array([[8]]), cache, 3)
        """
        token_ids = ops.convert_to_tensor(token_ids, "int32")
        x = fast_decode.embed(self.token_embedding, token_ids)
        if self.position_embedding is not None:
            if position_offset is None:
                x = x + self.position_embedding(x, start_index=cache_index)
            else:
                q_len = ops.shape(token_ids)[1]
                slots = ops.arange(q_len, dtype="int32") + ops.cast(cache_index, "int32")
                positions = slots[None, :] - ops.cast(position_offset, "int32")[:, None]
                positions = clip(positions, 0, self.max_sequence_length - 1)
                table = ops.cast(self.position_embedding.embeddings, x.dtype)
                x = x + ops.take(table, positions, axis=0)
        if not fast_decode.enabled(training):  # (dropout is the identity there)
            x = self.embeddings_dropout(x, training=training)
        per_layer = isinstance(cache, list)
        new_caches = []
        extra = {}
        if position_offset is not None and (
                self.attention in ("longformer", "block_sparse", "bigbird")
                or self.position == "rotary" and self.attention in ("linear", "performer")):
            # Rotated feature maps are not functions of relative positions alone, nor are
            # global tokens and blocks: keep each left-padded row's positions where they
            # would be without its padding. (Pad slots get negative positions; they are
            # never attended.)
            extra["position_index"] = (ops.cast(cache_index, "int32")
                                       - ops.cast(position_offset, "int32"))
        for i, block in enumerate(self.transformer_layers):
            x, layer_cache = decode_block(
                block,
                x,
                padding_mask=padding_mask,
                **extra,
                cache=cache[i] if per_layer else keras.tree.map_structure(
                    lambda c: c[:, i], cache),
                cache_index=cache_index,
                training=training,
            )
            new_caches.append(layer_cache)
        x = fast_decode.norm(self.final_norm, x)
        if per_layer:
            return x, new_caches
        return x, keras.tree.map_structure(lambda *xs: ops.stack(xs, axis=1), *new_caches)


# === Task model ===


def _encode(tokenizer, text):
    encoded = tokenizer.encode(text)
    return list(getattr(encoded, "ids", encoded))


@keras.saving.register_keras_serializable(package="kzoo")
class GPTCausalLM(FilledInputs, TaskModel):
    """A GPT backbone with its language-model head: next-token logits at every position.

    `logits = hidden @ E^T` with `E` the token embedding matrix (tied, GPT-2), or
    `hidden @ W` with the backbone's separate head matrix when `tie_embeddings=False`.
    Train with `SparseCategoricalCrossentropy(from_logits=True)` on the inputs shifted by one
    (`GPTCausalLM.lm_batch` builds `(x, y, sample_weight)`), decode with `generate`.

    Args:
        backbone: a `GPTBackbone`.
        stop_token_ids: None, or the token ids (an int or a list) that end a row in
            `generate` when it is given `stop_token_ids="auto"` (its default). Saved with
            the model; `kzoo.presets.load` of a Hugging Face checkpoint sets the
            checkpoint's `eos_token_id` (`generation_config.json` first, as transformers
            does), and exporting writes it back.
        dtype: dtype policy (defaults to the backbone's).

    Inputs: `{"token_ids", "padding_mask"}` `(batch, seq)` (the mask may be left out: every
    token real), and `"document_ids"` when the
    backbone has `packed_inputs=True` (train on `kzoo.data.pack` rows with
    `kzoo.data.next_token_targets`). Output: logits `(batch, seq, vocabulary_size)`.

    If the model has a `tokenizer` attribute (a `tokenizers.Tokenizer`, set by
    `kzoo.presets.load` for Hugging Face checkpoints that ship one), `generate` also takes
    strings.

    Example:
    >>> lm = GPTCausalLM(GPTBackbone(vocabulary_size=260, num_layers=2, num_heads=2,
    ...                              hidden_dim=32, intermediate_dim=64,
    ...                              max_sequence_length=64))
    >>> lm.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> x, y, w = GPTCausalLM.lm_batch(np.random.randint(0, 256, (8, 33)))
    >>> lm.fit(x, y, sample_weight=w, epochs=1)
    >>> lm.generate([[72, 105], [79]], max_new_tokens=8, strategy="sample", top_p=0.9, seed=0)
    """

    _input_fills = _INPUT_FILLS

    family = FAMILY
    task_name = "causal_lm"

    def default_loss(self):
        """`compile`'s loss when given none: `kzoo.losses.TokenCrossentropy()`."""
        from kzoo.losses import TokenCrossentropy

        return TokenCrossentropy()

    def __init__(self, backbone, stop_token_ids=None, dtype=None, **kwargs):
        check_instance("backbone", backbone, GPTBackbone)
        stop_token_ids = check_stop_token_ids(stop_token_ids, backbone.vocabulary_size)
        policy = _dtype_policy(dtype) or backbone.dtype_policy
        # === Functional Model ===
        inputs = backbone.input
        hidden = backbone(inputs)
        logits = backbone.token_embedding(hidden, reverse=True)
        super().__init__(inputs=inputs, outputs=logits, dtype=policy, **kwargs)
        self.backbone = backbone
        self.stop_token_ids = stop_token_ids

    def _task_config(self):
        stops = self.stop_token_ids
        return {"stop_token_ids": None if stops is None else list(stops)}

    # === Training helpers ===

    @staticmethod
    def lm_batch(token_ids, padding_mask=None):
        """`(x, y, sample_weight)` for next-token training from `(batch, seq + 1)` ids.

        `x` is the dict of the first `seq` tokens, `y` the last `seq` (the next token at every
        position), `sample_weight` 1 where the target is a real token.

        Example:
        >>> x, y, w = GPTCausalLM.lm_batch(np.array([[1, 2, 3, 4]]))
        """
        token_ids = np.asarray(token_ids, dtype="int32")
        if padding_mask is None:
            padding_mask = np.ones_like(token_ids)
        padding_mask = np.asarray(padding_mask).astype("int32")
        x = {"token_ids": token_ids[:, :-1], "padding_mask": padding_mask[:, :-1]}
        return x, token_ids[:, 1:], padding_mask[:, 1:].astype("float32")

    # === Generation ===

    def generation_prefill(self, inputs, max_new_tokens):
        """Run the prompts on a fresh key/value cache (the decoding interface of
        `kzoo.generation`).

        Args:
            inputs: `{"token_ids": (batch, prompt_len)` left-padded prompts,
                `"padding_mask": (batch, prompt_len)` (0 on the left padding),
                `"position_offset": (batch,)` (the pad slots in front of each row)`}`.
            max_new_tokens: the steps that follow (the cache holds `prompt_len +
                max_new_tokens` slots).

        Returns:
            `(logits, state, constants)`: the float32 logits `(batch, vocab)` of the first
            new token, `{"cache"}` (a list of per-layer caches), and `{"padding_mask"}` over
            the whole cache,
            `"position_offset"`, `"prompt_length"` (batch,) (the slot of step 0's token).
        """
        token_ids = ops.convert_to_tensor(inputs["token_ids"], "int32")
        batch, prompt_len = token_ids.shape
        mask = ops.cast(inputs["padding_mask"], "int32")
        constants = {
            "padding_mask": ops.concatenate(
                [mask, ops.ones((batch, max_new_tokens), "int32")], axis=1
            ),
            "position_offset": ops.cast(inputs["position_offset"], "int32"),
            "prompt_length": ops.full((batch,), prompt_len, "int32"),
        }
        cache = self.backbone.init_cache(batch, prompt_len + max_new_tokens, per_layer=True)
        logits, cache = self._logits_with_cache(token_ids, cache, 0, constants)
        return logits, {"cache": cache}, constants

    def generation_step(self, token_ids, state, constants, index):
        """Feed `token_ids (batch, 1)`, the tokens of step `index` (slot `prompt_length +
        index`): the float32 logits `(batch, vocab)` of the next token and `{"cache"}`."""
        cache_index = constants["prompt_length"][0] + ops.cast(index, "int32")
        logits, cache = self._logits_with_cache(token_ids, state["cache"], cache_index,
                                                constants)
        return logits, {"cache": cache}

    def _logits_with_cache(self, token_ids, cache, cache_index, constants):
        hidden, cache = self.backbone.call_with_cache(
            token_ids, cache, cache_index, padding_mask=constants["padding_mask"],
            position_offset=constants["position_offset"],
        )
        logits = fast_decode.unembed(self.backbone.token_embedding, hidden[:, -1, :])
        return ops.cast(logits, "float32"), cache

    def _prepare_prompts(self, prompts, padding_mask):
        """Prompts -> (list of id lists, string flag, single flag); ids checked once here."""
        from kzoo import generation

        tokenizer = getattr(self, "tokenizer", None)
        if isinstance(prompts, str):
            prompts, strings, single = [prompts], True, True
        elif isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(p, str) for p in prompts
        ):
            strings, single = True, False
        else:
            strings, single = False, False
        if strings:
            if tokenizer is None:
                raise ValueError(
                    "`generate` got text prompts but the model has no `tokenizer` attribute; "
                    "pass token ids or set `model.tokenizer` (a tokenizers.Tokenizer)."
                )
            rows = [_encode(tokenizer, p) for p in prompts]
            generation.check_token_ids(rows, self.backbone.vocabulary_size)
            return rows, True, single
        ids = None
        if isinstance(prompts, Mapping):  # the model's own input names (keras-hub's)
            ids, padding_mask = generation.prompt_dict(prompts, "token_ids", "padding_mask",
                                                       padding_mask)
            rows = None
        else:
            rows = generation.prompt_rows(prompts, "prompts")
        if rows is not None:
            if padding_mask is not None:
                raise ValueError(
                    "`padding_mask` is only used with an array of prompts; lists of token "
                    "id lists carry their own lengths."
                )
            generation.check_token_ids(rows, self.backbone.vocabulary_size)
        else:
            if ids is None:
                ids = generation.integer_array(prompts, "prompts")
            if ids.ndim == 1:
                ids = ids[None, :]
            if ids.ndim != 2:
                raise ValueError(
                    "`prompts` must be a string, a list of strings, a list of token id lists "
                    f"or an integer array (batch, seq); got an array of shape {ids.shape} and "
                    f"dtype {ids.dtype}."
                )
            mask = (np.ones_like(ids, dtype=bool) if padding_mask is None
                    else np.asarray(keras.ops.convert_to_numpy(padding_mask)))
            generation.check_mask_values(mask, "padding_mask", "generate's argument")
            mask = mask.astype(bool)
            if mask.shape != ids.shape:
                raise ValueError(
                    f"`padding_mask` must have the shape of the prompts {ids.shape}; got "
                    f"{mask.shape}."
                )
            generation.check_token_ids(ids, self.backbone.vocabulary_size, mask)
            rows = [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]
        if not rows:
            raise ValueError("`prompts` is empty: give at least one prompt.")
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(
                    f"Prompt {i} is empty: every prompt needs at least one token (e.g. a "
                    "beginning-of-text token)."
                )
        return rows, False, single

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
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        num_return_sequences=1,
        return_scores=False,
    ):
        """Continue each prompt with up to `max_new_tokens` tokens on a key/value cache.

        The prompts are left-padded to a common length (a multiple of 8) and run through the
        model in one pass (prefill), then one token is decoded per step for the whole batch
        by the one loop of `kzoo.generation`, compiled whole (`jax.jit` + `lax.while_loop`,
        `tf.function` + `tf.while_loop`; PyTorch runs the same loop eagerly under
        `no_grad`). Each row keeps its own positions (a left-padded row sees positions 0,
        1, ... as it would alone) and never attends to padding, so a prompt continues the
        same way alone or in a batch. A row ends with one of `stop_token_ids`; the loop ends
        when every row has ended.

        Args:
            prompts: a list of token id lists (any lengths); an integer array `(batch, seq)`
                (with `padding_mask`, 1 = real token, padding on either side), also as a
                dict `{"token_ids", "padding_mask"}` (the mask optional, no other key); or,
                when the model has a `tokenizer`, a string or a list of strings. Ids must lie in
                `[0, vocabulary_size)`; float arrays are refused.
            max_new_tokens: the most tokens to add to each prompt.
            strategy: "greedy", "sample" or "beam" (see `kzoo.generation`).
            temperature, top_k, top_p: sampling controls (`strategy="sample"`); a `top_k` at or
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
                already in the row (its prompt and the new tokens) is divided by it where
                positive, multiplied where negative (transformers'
                `RepetitionPenaltyLogitsProcessor`); every strategy (beam search: on the
                log-probabilities, as transformers).
            no_repeat_ngram_size: an int >= 0 (0: off): no n-gram of that size occurs twice
                in a row's prompt + new tokens (transformers' `NoRepeatNGramLogitsProcessor`).
            min_new_tokens: an int >= 0 (0: off): no stop token before that many new tokens
                (transformers' `MinNewTokensLengthLogitsProcessor`; above `max_new_tokens`:
                no stop at all). The two options above count a prompt's real tokens only:
                transformers also counts the pad token of a left-padded row, kzoo does not,
                so that a prompt continues the same way alone or in a batch.
            stop_token_ids: None, an int or a list of ints ending a row; "auto" (the
                default): the model's `stop_token_ids` (None unless it was given one, or
                loaded from a checkpoint with an `eos_token_id`).
            seed: int, `keras.random.SeedGenerator` or None (sampling only).
            padding_mask: with an array of prompts, which entries are real tokens.
            compile: compile the whole loop (True) or run it eagerly, step by step (False).
            num_return_sequences: outputs per prompt (transformers' name and meaning; 1 by
                default): with strategy="sample", that many independent draws of each
                prompt (the same seed gives the same draws); with beam search, the
                `num_return_sequences` best finished hypotheses, best first (at most
                `num_beams`); greedy decoding takes only 1. The outputs are grouped prompt
                by prompt: `len(prompts) * num_return_sequences` of them.
            return_scores: False (default) or True: also return the outputs' scores
                (transformers' `output_scores=True`), see Returns.

        Returns:
            For token ids: a list (one per prompt, or `num_return_sequences` per prompt) of
            the new token ids, ending with the stop token if one was produced (beam search:
            the best finished hypothesis, or the best ones). For strings: the decoded
            prompt + continuation (a string for a single string prompt and one output, else
            a list of strings). With `return_scores=True`: `(that, scores)`, `scores` shaped
            as the outputs: greedy and sampling, a list of floats per output, one per new
            token, the log-probability of the chosen token under the distribution it was
            chosen from (log-softmax of the logits after the repetition penalty, n-gram ban,
            `min_new_tokens` and, sampling, temperature / top-k / top-p: transformers'
            `compute_transition_scores(out.sequences, out.scores, normalize_logits=True)`);
            beam search, one float per output, its final score (sum of log-probabilities /
            length ** length_penalty: transformers' `sequences_scores`).

        Example:
        >>> lm.generate([[464, 2068], [464]], max_new_tokens=10, stop_token_ids=[50256])
        >>> lm.generate([[464, 2068]], strategy="beam", num_beams=4, length_penalty=0.8)
        >>> lm.generate("The quick brown", max_new_tokens=10, strategy="sample", top_p=0.9)
        >>> lm.generate([[464, 2068]], repetition_penalty=1.3, no_repeat_ngram_size=3,
        ...             min_new_tokens=5)
        >>> lm.generate([[464, 2068]], strategy="beam", num_beams=4, num_return_sequences=2)
        >>> ids, log_probs = lm.generate([[464, 2068]], return_scores=True)
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
        rows, strings, single = self._prepare_prompts(prompts, padding_mask)
        lengths = np.array([len(r) for r in rows])
        prompt_len = int(lengths.max())
        limit = self.backbone.max_sequence_length
        # (learned positions only: a rotary model has no position table and continues past
        # max_sequence_length, as transformers' LLaMA / Mistral / Mixtral `generate` do)
        if self.backbone.position_embedding is not None and prompt_len + max_new_tokens > limit:
            raise ValueError(
                f"The longest prompt ({prompt_len} tokens) plus max_new_tokens="
                f"{max_new_tokens} exceeds max_sequence_length={limit} of the model."
            )
        if self.backbone.attention == "block_sparse":
            options = self.backbone.attention_options
            blocks, block = len(options["layout"][0]), options["block_size"]
            if prompt_len + max_new_tokens > blocks * block:
                raise ValueError(
                    f"The longest prompt ({prompt_len} tokens) plus max_new_tokens="
                    f"{max_new_tokens} exceeds the {blocks * block} tokens that the "
                    f"attention option `layout` covers ({blocks} blocks of "
                    f"block_size={block})."
                )
        # Left padding up to a multiple of 8: prompts of similar lengths share one compiled
        # loop (the pads never count as positions, see `position_offset`).
        prompt_len = -(-prompt_len // 8) * 8
        ids = np.zeros((len(rows), prompt_len), "int32")
        mask = np.ones((len(rows), prompt_len), "int32")
        offset = (prompt_len - lengths).astype("int32")
        for b, row in enumerate(rows):
            ids[b, offset[b]:] = row
            mask[b, : offset[b]] = 0
        backbone = self.backbone
        generation.check_cache_size(
            max_new_tokens, prompt_len + max_new_tokens,
            # (the other attention types' caches have a fixed size)
            backbone.num_layers * 2 * len(rows) * sampler.rows_per_prompt
            * (backbone.num_kv_heads or backbone.num_heads) * backbone.head_size
            * np.dtype(backbone.compute_dtype).itemsize if backbone.attention == "full"
            else 0,
            prompts=len(rows), num_beams=sampler.num_beams,
            vocabulary_size=backbone.vocabulary_size,
            num_return_sequences=sampler.num_return_sequences)
        outputs = generation.decode(
            self, {"token_ids": ids, "padding_mask": mask, "position_offset": offset},
            sampler=sampler, max_new_tokens=max_new_tokens, stop_token_ids=stops,
            pad_token_id=0, seed=seed, compile=compile,
            return_scores=return_scores,
            history=generation.history_rows(ids, mask),
        )
        scores = None
        if return_scores:
            outputs, scores = outputs
        if not strings:
            return outputs if scores is None else (outputs, scores)
        n = sampler.num_return_sequences
        texts = [self.tokenizer.decode(rows[i // n] + out) for i, out in enumerate(outputs)]
        if single and n == 1:
            texts, scores = texts[0], None if scores is None else scores[0]
        return texts if scores is None else (texts, scores)


GPTConfig.backbone_class = GPTBackbone

__all__ = [
    "FAMILY",
    "GPTConfig",
    "GPTBackbone",
    "GPTCausalLM",
    "gpt_initializer",
]
