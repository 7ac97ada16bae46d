"""BERT (Devlin et al., 2019, "BERT: Pre-training of Deep Bidirectional Transformers for
Language Understanding", https://arxiv.org/abs/1810.04805).

- `BertBackbone`: token + learned position + segment embeddings, summed, layer-normalised
  and dropped out; `num_layers` post-LN transformer encoder blocks; a tanh pooler on the
  first (`[CLS]`) token. Outputs `{"sequence_output", "pooled_output"}`.
- `BertMaskedLM`: the masked-language-model head (Dense + activation + LayerNorm, then the
  decoder tied to the token embeddings plus an output bias) over every position.
- `BertClassifier`: dropout + Dense on the pooled output.

Inputs follow keras-hub: `{"token_ids", "segment_ids", "padding_mask"}`, each
`(batch, seq)` int32 (`padding_mask` 1/True for real tokens; `segment_ids` and
`padding_mask` may be left out, meaning all zeros and all ones). Models with
`attention="longformer"` take one more, optional, input: `"global_attention_mask"` (Hugging
Face's name; 1 for global tokens), which may be left out of the dict. Models with
`packed_inputs=True` take `"document_ids"` too (several documents a row, see `BertBackbone`).
The backbone's optional `"output_positions"` computes `sequence_output` at those rows only
(the last block runs at them and the `[CLS]` row alone): `BertMaskedLM` passes its
`mask_positions` there, `BertClassifier` no rows (its pooled `[CLS]` is all it reads).

Example:
>>> backbone = BertBackbone(vocabulary_size=1000, num_layers=2, num_heads=2,
...                         hidden_dim=64, intermediate_dim=256)
>>> model = BertClassifier(backbone, num_classes=3)
"""

import dataclasses
from typing import Optional

import keras
import numpy as np
from keras import ops

from kzoo.inputs import DocumentIdInput, PositionInput
from kzoo.layers.blocks import TransformerBlock
from kzoo.layers.embedding import TokenEmbedding
from kzoo.layers.feedforward import ACTIVATION_NAMES
from kzoo.layers.masks import check_packed_attention, document_mask, document_positions
from kzoo.layers.norm import LayerNorm
from kzoo.layers.position import PositionEmbedding
from kzoo.layers.utils import (
    check_bool,
    check_choice,
    check_divides,
    check_instance,
    check_non_negative_int,
    FieldError,
    check_positive_float,
    check_positive_int,
    check_rate,
)
from kzoo.models.base import (
    Backbone,
    FamilyConfig,
    FilledInputs,
    HeadTransform,
    IdInput,
    TaskModel,
    class_loss,
)

FAMILY = "bert"
# The optional input of attention="longformer" models: which tokens are global, per example.
GLOBAL_MASK_INPUT = "global_attention_mask"
# The optional input of `BertMaskedLM`: the positions whose logits to compute.
MASK_POSITIONS_INPUT = "mask_positions"
# The optional input of `BertBackbone`: the rows of `sequence_output` to compute.
OUTPUT_POSITIONS_INPUT = "output_positions"


def bert_kernel_initializer(stddev=0.02):
    """BERT's initialiser: normal(0, stddev) for every kernel and embedding."""
    return keras.initializers.RandomNormal(stddev=stddev)


def _dtype_policy(dtype):
    return keras.dtype_policies.get(dtype) if dtype is not None else None


# === Layers ===


@keras.saving.register_keras_serializable(package="kzoo")
class BertMaskedLMTransform(HeadTransform):
    """The transform of BERT's masked-LM head: `LayerNorm(act(Dense(x)))`.

    Args:
        activation: activation name (see `kzoo.layers.get_activation`).
        layer_norm_epsilon: epsilon of the layer norm.
        kernel_initializer: initialiser of the dense kernel.

    Call args:
        inputs: `(batch, seq, hidden_dim)`.

    Returns:
        `(batch, seq, hidden_dim)`.

    Example:
    >>> transform = BertMaskedLMTransform(activation="gelu")
    >>> transform(keras.random.normal((2, 5, 32))).shape
    (2, 5, 32)
    """

    def __init__(self, activation="gelu", layer_norm_epsilon=1e-12,
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(activation, layer_norm_epsilon, kernel_initializer, **kwargs)


@keras.saving.register_keras_serializable(package="kzoo")
class OutputBias(keras.layers.Layer):
    """Adds a learned bias (initialised to zeros) over the last axis, e.g. to logits.

    `call(hidden, embedding=token_embedding)` (a `TokenEmbedding`) computes the tied logits
    and the bias together, `embedding.reverse_logits(hidden, bias)`: one product with the
    bias on torch instead of a second vocabulary-sized tensor. `units` (the bias' size,
    default: the input's last axis) is needed then, the input being the hidden states.

    Example:
    >>> OutputBias()(keras.ops.zeros((2, 5, 100))).shape
    (2, 5, 100)
    """

    def __init__(self, units=None, **kwargs):
        super().__init__(**kwargs)
        self.units = None if units is None else check_positive_int("units", units)

    def build(self, input_shape):
        size = self.units if self.units is not None else input_shape[-1]
        self.bias = self.add_weight(name="bias", shape=(size,), initializer="zeros")
        self.built = True

    def call(self, inputs, embedding=None):
        if embedding is None:
            return inputs + ops.cast(self.bias, inputs.dtype)
        return embedding.reverse_logits(inputs, bias=self.bias)

    def compute_output_spec(self, inputs, embedding=None):
        if embedding is None:
            return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        return embedding.compute_output_spec(inputs, reverse=True)

    def get_config(self):
        config = super().get_config()
        if self.units is not None:
            config["units"] = self.units
        return config


@keras.saving.register_keras_serializable(package="kzoo")
class LeadingRow(keras.layers.Layer):
    """`output_positions` `(batch, n)` with position 0 put first, `(batch, 1 + n)`: the
    rows a `BertBackbone`'s last block computes (the `[CLS]` row for the pooler, then the
    rows asked for); None stays None."""

    def call(self, positions=None):
        if positions is None:
            return None
        positions = ops.cast(positions, "int32")
        first = ops.zeros((ops.shape(positions)[0], 1), "int32")
        return ops.concatenate([first, positions], axis=1)

    def compute_output_shape(self, positions_shape):
        rows = None if positions_shape[1] is None else positions_shape[1] + 1
        return (positions_shape[0], rows)


@keras.saving.register_keras_serializable(package="kzoo")
class SplitLeadingRow(keras.layers.Layer):
    """`(sequence, first)` of a `BertBackbone`'s last hidden states: with
    `output_positions`, the rows after the leading `[CLS]` row (see `LeadingRow`) and that
    row; without, the whole sequence and its row 0."""

    def call(self, inputs, positions=None):
        first = inputs[:, 0, :]
        return (inputs if positions is None else inputs[:, 1:, :]), first

    def compute_output_shape(self, inputs_shape, positions_shape=None):
        rows = inputs_shape[1] if positions_shape is None else positions_shape[1]
        return (inputs_shape[0], rows, inputs_shape[2]), (inputs_shape[0], inputs_shape[2])


@keras.saving.register_keras_serializable(package="kzoo")
class NoRows(keras.layers.Layer):
    """`(batch, 0)` int32 positions for a `(batch, seq)` input: `output_positions` that
    ask a `BertBackbone` for its pooled output alone."""

    def call(self, inputs):
        return ops.zeros((ops.shape(inputs)[0], 0), "int32")

    def compute_output_shape(self, inputs_shape):
        return (inputs_shape[0], 0)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor((inputs.shape[0], 0), dtype="int32")


@keras.saving.register_keras_serializable(package="kzoo")
class NonPaddingPositions(keras.layers.Layer):
    """RoBERTa's positions (Hugging Face's `create_position_ids_from_input_ids`, which
    RoBERTa and Longformer use): a token's position is the number of tokens before it whose
    id is not `padding_id`, whatever the padding mask says, and a token with that id gets no
    position embedding (the zero row its table keeps for it).

    Call args:
        token_ids: `(batch, seq)` int.
        rows: None, or the position embeddings `(batch, seq, dim)` of the positions this
            layer returned: then returns them with the rows of `padding_id` tokens zeroed.

    Returns:
        `(batch, seq)` int32 positions (0 for the `padding_id` tokens), or the zeroed rows.
    """

    def __init__(self, padding_id, **kwargs):
        super().__init__(**kwargs)
        self.padding_id = check_non_negative_int("padding_id", padding_id)

    def call(self, token_ids, rows=None):
        keep = ops.cast(ops.not_equal(ops.cast(token_ids, "int32"), self.padding_id), "int32")
        if rows is not None:
            return rows * ops.cast(keep, rows.dtype)[..., None]
        return ops.maximum(ops.cumsum(keep, axis=1) * keep - 1, 0)

    def compute_output_spec(self, token_ids, rows=None):
        if rows is not None:
            return keras.KerasTensor(rows.shape, dtype=rows.dtype)
        return keras.KerasTensor(token_ids.shape, dtype="int32")

    def get_config(self):
        return {**super().get_config(), "padding_id": self.padding_id}


# What a left-out input of BERT holds for every token (`FilledInputs`; transformers'
# defaults): segment 0, every token real.
_INPUT_FILLS = {"segment_ids": ("token_ids", 0), "padding_mask": ("token_ids", 1)}


# === Config ===


@dataclasses.dataclass(frozen=True)
class BertConfig(FamilyConfig):
    """The configuration of a `BertBackbone`, validated once on construction.

    Its fields are `BertBackbone`'s arguments (see there for their meaning), with the same
    defaults (BERT-Base). `num_heads` must divide `hidden_dim`.

    Example:
    >>> config = BertConfig(vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=64,
    ...                     intermediate_dim=256)
    >>> backbone = config.build()             # the same as BertBackbone(**config.to_dict())
    """

    vocabulary_size: int = 30522
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    max_sequence_length: int = 512
    num_segments: int = 2
    dropout: float = 0.1
    attention_dropout: Optional[float] = None
    layer_norm_epsilon: float = 1e-12
    activation: str = "gelu"
    initializer_range: float = 0.02
    attention: str = "full"
    attention_options: Optional[dict] = None
    packed_inputs: bool = False
    remat: bool = False
    layerdrop: float = 0.0
    position_padding_id: Optional[int] = None

    def __post_init__(self):
        check = self._check
        check("remat", check_bool)
        check("layerdrop", check_rate)
        check("vocabulary_size", check_positive_int)
        check("num_layers", check_positive_int)
        check("num_heads", check_positive_int)
        check("hidden_dim", check_positive_int)
        check("num_heads", check_divides, "hidden_dim", self.hidden_dim)
        check("intermediate_dim", check_positive_int)
        check("max_sequence_length", check_positive_int)
        check("num_segments", check_positive_int)
        check("dropout", check_rate)
        check("attention_dropout", check_rate, allow_none=True)
        check("layer_norm_epsilon", check_positive_float)
        check("activation", check_choice, ACTIVATION_NAMES)
        check("initializer_range", check_positive_float)
        self._check_attention_fields()
        check("packed_inputs", check_bool)
        check_packed_attention(self.packed_inputs, self.attention)
        if self.position_padding_id is not None:
            check("position_padding_id", check_non_negative_int)
            if self.packed_inputs:
                raise FieldError(
                    "`position_padding_id` numbers positions over the tokens that are not "
                    "padding, `packed_inputs` within each document; set one of them; got "
                    f"position_padding_id={self.position_padding_id!r} with "
                    "packed_inputs=True.", "position_padding_id")


# === Backbone ===


@keras.saving.register_keras_serializable(package="kzoo")
class BertBackbone(FilledInputs, Backbone):
    """The BERT encoder (Devlin et al., 2019, arXiv:1810.04805).

    `embeddings = LayerNorm(token + position + segment)` then dropout; `num_layers` post-LN
    transformer blocks (`x = LN(x + drop(attn(x)))`, `x = LN(x + drop(ffn(x)))`) with
    exact-erf GELU by default; a pooler `tanh(Dense(sequence_output[:, 0]))`. Every kernel
    and embedding table is initialised normal(0, `initializer_range`), biases zeros, layer
    norms ones/zeros, as in BERT.

    Args:
        vocabulary_size: number of token ids.
        num_layers: number of transformer blocks.
        num_heads: attention heads (must divide `hidden_dim`).
        hidden_dim: width of the hidden states.
        intermediate_dim: width of the feed-forward hidden layer (4 * hidden_dim in BERT).
        max_sequence_length: number of learned positions (the longest input).
        num_segments: number of segment (token type) ids.
        dropout: dropout rate on the embeddings and after every sub-layer.
        attention_dropout: dropout on the attention probabilities (None: same as `dropout`).
        layer_norm_epsilon: epsilon of every layer norm.
        activation: feed-forward activation ("gelu" = exact erf, "gelu_new", "relu", ...; see
            `kzoo.layers.get_activation`).
        initializer_range: standard deviation of the normal initialiser.
        attention: the self-attention type: "full", or an efficient variant
            ("sliding_window", "strided", "longformer", "block_sparse", "bigbird", "linear",
            "performer"; see `kzoo.layers.efficient_attention`).
        attention_options: the options of `attention` (e.g. `{"window": 128}`).
        packed_inputs: take one more input, `"document_ids"`, for packed rows (several
            documents a row, see below; needs attention="full").
        remat: recompute each block's activations in the backward pass instead of
            keeping them (gradient checkpointing per block: less memory, one more forward
            pass of compute; the gradients are the same).
        layerdrop: LayerDrop rate (Fan et al. 2019): in training, each block is skipped
            (is the identity) with this probability, one draw per block and batch; in
            inference every block runs.
        position_padding_id: None (positions 0, 1, 2, ... along each row), or a token id
            whose tokens do not count as positions: RoBERTa's and Longformer's numbering
            (`NonPaddingPositions`: a token's position is the number of tokens before it
            with another id, and tokens with this id get no position embedding), which
            their Hugging Face checkpoints need for left padding, or a real token with the
            padding id, to give transformers' outputs.
        dtype: dtype policy of every layer (e.g. "float32", "mixed_bfloat16").

    The arguments (all but `dtype` and Keras' own) are the fields of `BertConfig`, which
    validates them: `BertBackbone(**fields)` and `BertConfig(**fields).build()` are the same
    model, and `backbone.config` is that `BertConfig`.

    Inputs (a dict, each `(batch, seq)` int32):
        token_ids; segment_ids; padding_mask (1 for real tokens, 0 for padding) (either
        of the last two may be left out of the dict, as in Hugging Face's BERT: every token
        in segment 0, every token real);
        with attention="longformer" only, global_attention_mask (1 for tokens with global
        attention, replacing the `global_tokens` option per example; Hugging Face's
        `global_attention_mask`): an optional input that may be left out of the dict (or
        given as None), the `global_tokens` option then applies;
        with `packed_inputs=True`, document_ids: the document of each token of a packed
        row, numbered 1, 2, 3, ... within the row, 0 for padding (`kzoo.data.pack`; not
        `segment_ids`, which stay BERT's sentence A/B ids). A token then attends only to
        tokens of its own document (`kzoo.layers.document_mask`, merged with the padding
        mask) and its learned position restarts at 0 at each document
        (`kzoo.layers.document_positions`), so each document (its own `[CLS] ... [SEP]`)
        gives the hidden states it would give alone. `pooled_output` is the first
        document's `[CLS]`; `BertClassifier` refuses a packed backbone.
        output_positions (optional, may be left out): `(batch, n)` positions in
        `[0, seq)`: `sequence_output` is then `(batch, n, hidden_dim)`, the hidden states
        at those rows, and the last block computes only them and the `[CLS]` row (keys
        and values still from every token; `TransformerBlock(output_positions=...)`), the
        same values as gathering the whole output. A masked LM's last layer then costs
        its masked positions only: 8 x 256 tokens, 38 masked a row, 4 layers of width 256
        (2-core CPU, one process, interleaved), training 4,988 -> 5,936 (JAX), 5,494 ->
        6,572 (torch), 5,190 -> 6,133 (TensorFlow) tokens/s.

    Outputs (a dict):
        sequence_output: `(batch, seq, hidden_dim)` (`(batch, n, hidden_dim)` with
            `output_positions`);
        pooled_output: `(batch, hidden_dim)`.

    Example:
    >>> backbone = BertBackbone(vocabulary_size=1000, num_layers=2, num_heads=2,
    ...                         hidden_dim=64, intermediate_dim=256)
    >>> out = backbone({"token_ids": np.ones((2, 8), "int32"),
    ...                 "segment_ids": np.zeros((2, 8), "int32"),
    ...                 "padding_mask": np.ones((2, 8), "int32")})
    >>> out["sequence_output"].shape, out["pooled_output"].shape
    ((2, 8, 64), (2, 64))
    """

    _input_fills = _INPUT_FILLS

    family = FAMILY
    config_class = BertConfig

    def __init__(
        self,
        vocabulary_size=30522,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
        max_sequence_length=512,
        num_segments=2,
        dropout=0.1,
        attention_dropout=None,
        layer_norm_epsilon=1e-12,
        activation="gelu",
        initializer_range=0.02,
        attention="full",
        attention_options=None,
        packed_inputs=False,
        remat=False,
        layerdrop=0.0,
        position_padding_id=None,
        dtype=None,
        **kwargs,
    ):
        # === Config ===
        config = BertConfig(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            max_sequence_length=max_sequence_length,
            num_segments=num_segments,
            dropout=dropout,
            attention_dropout=attention_dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            activation=activation,
            initializer_range=initializer_range,
            attention=attention,
            attention_options=attention_options,
            packed_inputs=packed_inputs,
            remat=remat,
            layerdrop=layerdrop,
            position_padding_id=position_padding_id,
        )
        policy = _dtype_policy(dtype)
        init = bert_kernel_initializer(initializer_range)

        # === Layers ===
        self.token_embedding = TokenEmbedding(
            vocabulary_size, hidden_dim, tie_weights=True,
            embeddings_initializer=init, dtype=policy, name="token_embedding",
        )
        self.position_embedding = PositionEmbedding(
            max_sequence_length, initializer=init, dtype=policy, name="position_embedding"
        )
        self.segment_embedding = keras.layers.Embedding(
            num_segments, hidden_dim, embeddings_initializer=init, dtype=policy,
            name="segment_embedding",
        )
        self.embeddings_add = keras.layers.Add(dtype=policy, name="embeddings_add")
        self.embeddings_layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="embeddings_layer_norm"
        )
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="embeddings_dropout"
        )
        # BERT drops out the output of each sub-layer (before the residual sum) and the
        # attention probabilities, never the feed-forward's hidden activations.
        self.transformer_layers = [
            TransformerBlock(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                norm_first=False,
                layer_norm_epsilon=layer_norm_epsilon,
                activation=activation,
                dropout=dropout,
                attention_dropout=dropout if attention_dropout is None else attention_dropout,
                activation_dropout=0.0,
                attention=config.attention,
                attention_options=config.attention_options,
                kernel_initializer=init,
                dtype=policy,
                remat=config.remat,
                layerdrop=config.layerdrop,
                name=f"transformer_layer_{i}",
            )
            for i in range(num_layers)
        ]
        self.pooler_dense = keras.layers.Dense(
            hidden_dim, activation="tanh", kernel_initializer=init, dtype=policy,
            name="pooler_dense",
        )
        self.leading_row = LeadingRow(dtype=policy, name="output_rows")
        self.split_leading_row = SplitLeadingRow(dtype=policy, name="split_cls_row")

        # === Functional Model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        segment_ids = keras.Input(shape=(None,), dtype="int32", name="segment_ids")
        padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        inputs = {"token_ids": token_ids, "segment_ids": segment_ids,
                  "padding_mask": padding_mask}
        global_mask = None
        if config.attention == "longformer":
            global_mask = keras.Input(shape=(None,), dtype="int32", name=GLOBAL_MASK_INPUT,
                                      optional=True)
            inputs[GLOBAL_MASK_INPUT] = global_mask
        extra = {} if global_mask is None else {"global_attention_mask": global_mask}
        positions = 0
        if packed_inputs:
            document_ids = keras.Input(shape=(None,), dtype="int32", name="document_ids")
            inputs["document_ids"] = document_ids
            positions = document_positions(document_ids)
            extra["attention_mask"] = document_mask(document_ids)
        tokens = self.token_embedding(token_ids)
        if config.position_padding_id is not None:
            self.non_padding_positions = NonPaddingPositions(
                config.position_padding_id, name="non_padding_positions")
            positions = self.non_padding_positions(token_ids)
        position_rows = self.position_embedding(tokens, start_index=positions)
        if config.position_padding_id is not None:
            position_rows = self.non_padding_positions(token_ids, position_rows)
        x = self.embeddings_add(
            [tokens, position_rows, self.segment_embedding(segment_ids)]
        )
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x)
        # `output_positions` (optional): the last block computes only the [CLS] row and
        # those rows (`TransformerBlock(output_positions=...)`), e.g. a masked LM's
        # masked positions; the blocks before it need every row.
        rows = keras.Input(shape=(None,), dtype="int32", name=OUTPUT_POSITIONS_INPUT,
                           optional=True)
        inputs[OUTPUT_POSITIONS_INPUT] = rows
        for i, block in enumerate(self.transformer_layers):
            last = i == len(self.transformer_layers) - 1
            x = block(x, padding_mask=padding_mask,
                      **(dict(extra, output_positions=self.leading_row(rows)) if last
                         else extra))
        x, first = self.split_leading_row(x, rows)
        pooled = self.pooler_dense(first)
        super().__init__(
            inputs=inputs,
            outputs={"sequence_output": x, "pooled_output": pooled},
            **kwargs,
        )
        if policy is not None:
            self.dtype_policy = policy

        self._store_config(config)

    def id_inputs(self):
        """`token_ids` in `[0, vocabulary_size)` and `segment_ids` in `[0, num_segments)`
        where `padding_mask` marks a token, checked at every entry point (`kzoo.inputs`)."""
        return (
            IdInput("token_ids", self.config.vocabulary_size, "vocabulary_size",
                    mask="padding_mask",
                    max_length=(None if self.config.packed_inputs  # (positions restart)
                                else self.config.max_sequence_length)),
            IdInput("segment_ids", self.config.num_segments, "num_segments",
                    mask="padding_mask"),
            PositionInput(OUTPUT_POSITIONS_INPUT, like="token_ids"),
        ) + ((DocumentIdInput("document_ids", like="token_ids", mask="padding_mask"),)
             if self.config.packed_inputs else ())


# === Task models ===


class _BertTask(FilledInputs, TaskModel):
    """Shared plumbing of the BERT task models."""

    _input_fills = _INPUT_FILLS

    family = FAMILY


def _check_backbone(backbone):
    check_instance("backbone", backbone, BertBackbone)


def _task_inputs(backbone):
    """The backbone's inputs a task model takes as its own (all but `output_positions`,
    which the task sets itself or leaves out)."""
    return {k: v for k, v in backbone.input.items() if k != OUTPUT_POSITIONS_INPUT}


@keras.saving.register_keras_serializable(package="kzoo")
class BertMaskedLM(_BertTask):
    """BERT with its masked-language-model head: vocabulary logits at every position, or at
    the positions given as `mask_positions`.

    `logits = LayerNorm(act(Dense(h))) @ E^T + b`, with `E` the backbone's token embedding
    matrix (tied) and `b` an output bias, exactly Hugging Face's `BertForMaskedLM` layout
    (the pooler of the backbone is unused, and counts as non-trainable in this model: `fit`
    leaves it as it is). Train with a sparse categorical cross-entropy
    on the masked positions: either targets at every position weighted by `sample_weight`,
    or (cheaper: the head and the loss run on those positions only, as in keras-hub)
    `mask_positions` `(batch, num_masked)` in the inputs and targets `(batch, num_masked)`.

    Args:
        backbone: a `BertBackbone`.
        dtype: dtype policy of the head (defaults to the backbone's).

    Inputs: the backbone's dict, plus optionally `"mask_positions"`: `(batch, num_masked)`
    integers in `[0, seq)` (repeat a position, with a zero sample weight, to pad rows with
    fewer masked tokens). Output: logits `(batch, seq, vocabulary_size)`, or
    `(batch, num_masked, vocabulary_size)` with `mask_positions`.

    Example:
    >>> backbone = BertBackbone(vocabulary_size=1000, num_layers=2, num_heads=2,
    ...                         hidden_dim=64, intermediate_dim=256)
    >>> mlm = BertMaskedLM(backbone)
    >>> mlm.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """

    task_name = "masked_lm"

    def default_loss(self):
        """`compile`'s loss when given none: `kzoo.losses.TokenCrossentropy()`."""
        from kzoo.losses import TokenCrossentropy

        return TokenCrossentropy()

    def __init__(self, backbone, dtype=None, **kwargs):
        _check_backbone(backbone)
        policy = _dtype_policy(dtype) or backbone.dtype_policy
        # === Layers ===
        self.backbone = backbone
        self.transform = BertMaskedLMTransform(
            activation=backbone.activation,
            layer_norm_epsilon=backbone.layer_norm_epsilon,
            kernel_initializer=bert_kernel_initializer(backbone.initializer_range),
            dtype=policy,
            name="mlm_transform",
        )
        self.output_bias = OutputBias(units=backbone.vocabulary_size, dtype=policy,
                                      name="mlm_output_bias")
        # === Functional Model ===
        inputs = _task_inputs(backbone)
        positions = keras.Input(shape=(None,), dtype="int32", name=MASK_POSITIONS_INPUT,
                                optional=True)
        inputs[MASK_POSITIONS_INPUT] = positions
        # The backbone's last block runs at the masked positions only (`output_positions`):
        # its other rows would feed nothing but logits that are not asked for.
        backbone_inputs = {k: v for k, v in inputs.items() if k != MASK_POSITIONS_INPUT}
        sequence = backbone({**backbone_inputs, OUTPUT_POSITIONS_INPUT: positions})[
            "sequence_output"]
        hidden = self.transform(sequence)
        # The tied decoder and the bias in one call (one product with its bias on torch).
        logits = self.output_bias(hidden, embedding=backbone.token_embedding)
        super().__init__(inputs=inputs, outputs=logits, **kwargs)
        self.dtype_policy = policy

    def id_inputs(self):
        """The backbone's id inputs, and `mask_positions` in `[0, seq)` when given."""
        return super().id_inputs() + (PositionInput(MASK_POSITIONS_INPUT, like="token_ids"),)

    def _unused_layers(self):
        # The head reads the sequence output only: the pooler's weights are not trained
        # here (no "Gradients do not exist" warning; see `TaskModel._unused_layers`).
        backbone = getattr(self, "backbone", None)
        return () if backbone is None else (backbone.pooler_dense,)


@keras.saving.register_keras_serializable(package="kzoo")
class BertClassifier(_BertTask):
    """BERT for sequence classification: `Dense(dropout(pooled_output))` logits.

    Args:
        backbone: a `BertBackbone`.
        num_classes: number of classes (logits per example).
        dropout: dropout rate on the pooled output (None: the backbone's `dropout`, as
            transformers' `classifier_dropout=None` follows `hidden_dropout_prob`; so
            `kzoo.presets.load(..., task="classifier", dropout=0.0)` turns both off).
        dtype: dtype policy of the head (defaults to the backbone's).

    Inputs: the backbone's dict. Output: logits `(batch, num_classes)`.

    Example:
    >>> backbone = BertBackbone(vocabulary_size=1000, num_layers=2, num_heads=2,
    ...                         hidden_dim=64, intermediate_dim=256)
    >>> clf = BertClassifier(backbone, num_classes=3)
    >>> clf.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """

    task_name = "classifier"

    def default_loss(self):
        """`compile`'s loss when given none: `kzoo.models.base.class_loss` (sparse
        categorical cross-entropy on the logits; mean squared error with one output)."""
        return class_loss(self.num_classes)

    def __init__(self, backbone, num_classes=2, dropout=None, dtype=None, **kwargs):
        _check_backbone(backbone)
        if backbone.packed_inputs:
            raise ValueError(
                "BertClassifier gives one label a row, but `backbone` has packed_inputs=True "
                "(several documents a row; the pooled [CLS] would be the first document's "
                "only). Build the classifier on a backbone with packed_inputs=False; the "
                "weights are the same, e.g. `BertBackbone.from_config({**backbone."
                "get_config(), 'packed_inputs': False})` then `set_weights(backbone."
                "get_weights())`."
            )
        num_classes = check_positive_int("num_classes", num_classes)
        # (was 0.1 whatever the backbone's: `load(..., dropout=0.0)` left the head's on)
        dropout = check_rate("dropout", backbone.config.dropout if dropout is None else dropout)
        policy = _dtype_policy(dtype) or backbone.dtype_policy
        # === Layers ===
        self.backbone = backbone
        self.classifier_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="classifier_dropout"
        )
        self.classifier_dense = keras.layers.Dense(
            num_classes,
            kernel_initializer=bert_kernel_initializer(backbone.initializer_range),
            dtype=policy,
            name="logits",
        )
        # === Functional Model ===
        inputs = _task_inputs(backbone)
        # The pooled [CLS] row is all a classifier reads: the last block computes that row
        # only (no `output_positions` rows besides the leading [CLS] one).
        no_rows = NoRows(name="no_output_rows")(inputs["token_ids"])
        pooled = backbone({**inputs, OUTPUT_POSITIONS_INPUT: no_rows})["pooled_output"]
        logits = self.classifier_dense(self.classifier_dropout(pooled))
        super().__init__(inputs=inputs, outputs=logits, **kwargs)
        self.dtype_policy = policy
        # === Config ===
        self.num_classes = num_classes
        self.dropout = dropout

    def _task_config(self):
        return {"num_classes": self.num_classes, "dropout": self.dropout}


BertConfig.backbone_class = BertBackbone

