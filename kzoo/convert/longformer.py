"""Hugging Face Longformer checkpoints (`model_type="longformer"`) <-> kzoo BERT models.

Longformer (Beltagy et al. 2020, arXiv:2004.05150) is RoBERTa-style BERT whose
self-attention is a sliding window plus global tokens. kzoo reads it as a `BertBackbone`
with `attention="longformer"` and the options

- `window = attention_window // 2 + 1`: Hugging Face's `attention_window` (even) lets each
  token see `attention_window / 2` tokens on each side, kzoo's `window` counts the token
  itself (query `i` sees key `j` when `|i - j| < window`);
- `global_tokens = 0`: global attention comes only from the model input
  `"global_attention_mask"` (Hugging Face's `global_attention_mask`, 1 = global), which
  the backbone takes as an optional input;
- `global_projections = True`: the rows of global tokens use their own projections
  (`query_global`, `key_global`, `value_global` -> `query_global_dense`, ...) over every
  key, the other rows the normal ones over their window and the global keys.

Architectures: `LongformerModel` -> `backbone` (with its pooler), `LongformerForMaskedLM`
-> `masked_lm` (its `lm_head` is BERT's masked-LM head: dense, exact GELU, layer norm, the
tied decoder and a bias). Different windows per layer (`attention_window` a list of
different values) are not supported (kzoo's layers share one set of attention options)
and raise `ValueError`, as do the task heads other than these two.

Positions: RoBERTa's position ids start at `pad_token_id + 1` (`create_position_ids_from_
input_ids`), so kzoo's table is rows `pad_token_id + 1 ...` of Hugging Face's and
`max_sequence_length = max_position_embeddings - pad_token_id - 1`. Hugging Face counts
positions over the tokens whose id is not `pad_token_id` (whatever the attention mask
says) and gives those tokens its table's row `pad_token_id`, zeros: the backbone's
`position_padding_id=pad_token_id` does the same (`NonPaddingPositions`), so left-padded
rows, and real tokens that happen to have the padding id, give transformers' outputs.
Hugging Face pads a sequence to a multiple of `attention_window` inside its forward pass;
the padding is masked, so real positions are unaffected and kzoo needs no such padding.

`to_hf` writes such a model back (`pad_token_id` its `position_padding_id`, or 1 without
one, and the position rows up to the first real position zeros); it takes `attention="longformer"` models with
`global_projections=True` and `global_tokens=0`.

Example:
>>> model = kzoo.presets.load("/path/to/longformer-base-4096")     # LongformerForMaskedLM
>>> logits = model({"token_ids": ids, "segment_ids": zeros, "padding_mask": mask,
...                 "global_attention_mask": global_mask})
"""

import warnings

import numpy as np

from kzoo import registry
from kzoo.checkpoints import assign
from kzoo.convert import bert as bert_convert
from kzoo.models.bert import BertConfig

FAMILY = "bert"
MODEL_TYPES = ("longformer",)
assert set(MODEL_TYPES) <= set(registry.family(FAMILY).converters)

# Tensors of a checkpoint that are not weights, or tied to ones that are (checked).
IGNORED_WEIGHTS = (
    "embeddings.position_ids",
    "lm_head.decoder.weight",
    "lm_head.decoder.bias",
)

ARCHITECTURES = {
    "LongformerModel": "backbone",
    "LongformerForMaskedLM": "masked_lm",
}
TASK_ARCHITECTURE = {task: arch for arch, task in ARCHITECTURES.items()}

_DEFAULTS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "attention_window": 512,
    "pad_token_id": 1,
}

# kzoo field -> its config.json key (named in the errors of `BertConfig`).
_HF_NAMES = {
    "vocabulary_size": "vocab_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "hidden_dim": "hidden_size",
    "intermediate_dim": "intermediate_size",
    "max_sequence_length": "max_position_embeddings",
    "num_segments": "type_vocab_size",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "layer_norm_epsilon": "layer_norm_eps",
    "activation": "hidden_act",
    "initializer_range": "initializer_range",
    "position_padding_id": "pad_token_id",
}


def _get(hf_config, key):
    value = hf_config.get(key)
    return _DEFAULTS[key] if value is None else value


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def attention_window(hf_config):
    """The one `attention_window` of a Hugging Face config (an even int > 0, or a list of
    them, one a layer, all equal); `ValueError` naming the field otherwise."""
    value = _get(hf_config, "attention_window")
    layers = _get(hf_config, "num_hidden_layers")
    windows = list(value) if isinstance(value, (list, tuple)) else [value]
    if not windows or not all(_is_int(w) and w > 0 and w % 2 == 0 for w in windows):
        raise ValueError(
            "`attention_window` must be a positive even int (attention_window / 2 tokens on "
            f"each side) or a list of them, one a layer; got attention_window={value!r}."
        )
    if isinstance(value, (list, tuple)) and len(windows) != layers:
        raise ValueError(
            f"`attention_window` as a list needs one window a layer (num_hidden_layers="
            f"{layers}); got attention_window={value!r}."
        )
    if len(set(windows)) > 1:
        raise ValueError(
            "Different windows per layer are not supported: kzoo's BERT layers share one "
            f"`window`; got attention_window={value!r}."
        )
    return int(windows[0])


def config_from_hf(hf_config, source="config.json"):
    """`(family, backbone_config, task, task_config)` for a Hugging Face Longformer config.

    Raises `ValueError` naming any field kzoo cannot honour: an odd or non-positive
    `attention_window`, different windows per layer, `pad_token_id` leaving no position,
    an architecture other than `LongformerModel` / `LongformerForMaskedLM`, untied word
    embeddings, an unknown `hidden_act` (or, for the masked LM, one other than "gelu": its
    head always uses GELU while kzoo's uses the backbone's activation).

    Example:
    >>> config_from_hf({"model_type": "longformer", "attention_window": 4, ...})[1]["attention_options"]
    {'window': 3, 'global_tokens': 0, 'global_projections': True}
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"Expected model_type in {list(MODEL_TYPES)}; got model_type={model_type!r}.")
    window = attention_window(hf_config)
    pad = _get(hf_config, "pad_token_id")
    positions = _get(hf_config, "max_position_embeddings")
    if not _is_int(pad) or pad < 0 or not _is_int(positions) or positions - pad - 1 < 1:
        raise ValueError(
            "Longformer positions start at pad_token_id + 1, so `max_position_embeddings` "
            "must exceed `pad_token_id` + 1 (both ints >= 0); got "
            f"max_position_embeddings={positions!r} and pad_token_id={pad!r} (in {source})."
        )
    if hf_config.get("tie_word_embeddings", True) is False:
        raise ValueError(
            "tie_word_embeddings=False is not supported: kzoo's BertMaskedLM ties the decoder "
            "to the word embeddings (as Longformer does)."
        )
    act = _get(hf_config, "hidden_act")
    if act not in bert_convert.HF_ACTIVATIONS:
        raise ValueError(
            f"hidden_act={act!r} is not supported; allowed: "
            f"{sorted(bert_convert.HF_ACTIVATIONS)}."
        )
    architectures = hf_config.get("architectures") or ["LongformerModel"]
    arch = architectures[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"architectures={architectures!r} is not supported; allowed: "
            f"{sorted(ARCHITECTURES)}."
        )
    task = ARCHITECTURES[arch]
    activation = bert_convert.HF_ACTIVATIONS[act]
    if task == "masked_lm" and activation != "gelu":
        raise ValueError(
            f"hidden_act={act!r} is not supported for LongformerForMaskedLM: its lm_head "
            "always applies exact GELU and kzoo's masked-LM head the backbone's activation; "
            "allowed: 'gelu'."
        )
    config = {kzoo: _get(hf_config, hf) for kzoo, hf in _HF_NAMES.items()
              if kzoo not in ("activation", "max_sequence_length")}
    config["activation"] = activation
    config["max_sequence_length"] = positions - pad - 1
    config["position_padding_id"] = pad
    config["attention"] = "longformer"
    config["attention_options"] = {"window": window // 2 + 1, "global_tokens": 0,
                                   "global_projections": True}
    checked = BertConfig.from_dict(config, source=source, names=_HF_NAMES)
    config = {key: getattr(checked, key) for key in config}
    config["attention_options"] = dict(config["attention_options"])
    return FAMILY, config, task, {}


# === Weights ===


def handles(model):
    """True for the BERT models this module converts: attention="longformer" with
    `global_projections` (what `config_from_hf` builds)."""
    backbone, _ = _split(model)
    options = backbone.attention_options or {}
    return backbone.attention == "longformer" and bool(options.get("global_projections"))


def _split(model):
    task = getattr(model, "task_name", None)
    return (model.backbone if task else model), (task or "backbone")


def _dense(reader, layer, name):
    assign(layer.kernel, reader.take(name + ".weight", transpose=True), name + ".weight")
    assign(layer.bias, reader.take(name + ".bias"), name + ".bias")


def _norm(reader, layer, name):
    assign(layer.gamma, reader.take(name + ".weight"), name + ".weight")
    assign(layer.beta, reader.take(name + ".bias"), name + ".bias")


def load_weights(model, weights):
    """Assign the tensors of a Hugging Face Longformer checkpoint (a `WeightReader`).

    The position table is cut to the rows of real positions: the last
    `max_sequence_length` rows, which start at `pad_token_id + 1` when the model was built
    by `config_from_hf` (leave `max_sequence_length` as it sets it). A `LongformerModel`
    checkpoint has a pooler; a `LongformerForMaskedLM` one does not, and its masked-LM
    model's pooler stays randomly initialised (unused by the head).
    """
    if not handles(model):
        raise ValueError(
            "A Longformer checkpoint needs a BERT model with attention='longformer' and "
            "attention_options global_projections=True (what kzoo.presets.load of the "
            "checkpoint builds)."
        )
    backbone, task = _split(model)
    p = "longformer." if weights.has("longformer.embeddings.word_embeddings.weight") else ""
    e = p + "embeddings."
    words = e + "word_embeddings.weight"
    assign(backbone.token_embedding.embeddings, weights.take(words), words)
    table = weights.take(e + "position_embeddings.weight")
    if table is not None:
        rows = backbone.max_sequence_length
        if table.shape[0] <= rows:
            raise ValueError(
                f"{e + 'position_embeddings.weight'!r} has {table.shape[0]} rows; a Longformer "
                f"table holds pad_token_id + 1 rows before the max_sequence_length={rows} "
                "positions."
            )
        assign(backbone.position_embedding.embeddings, table[table.shape[0] - rows:],
               e + "position_embeddings.weight")
        padding_row = np.asarray(table[table.shape[0] - rows - 1])
        if backbone.config.position_padding_id is not None and np.any(padding_row != 0):
            warnings.warn(
                f"{e + 'position_embeddings.weight'!r}: the row of pad_token_id is not zero "
                f"(max |value| {float(np.abs(padding_row).max()):.3g}); kzoo gives tokens with "
                "the padding id no position embedding (zeros, as a RoBERTa-style table built "
                "with `padding_idx` keeps it), so those tokens' outputs differ from "
                "transformers'.", stacklevel=2)
    assign(backbone.segment_embedding.embeddings,
           weights.take(e + "token_type_embeddings.weight"), e + "token_type_embeddings.weight")
    _norm(weights, backbone.embeddings_layer_norm, e + "LayerNorm")
    for i, block in enumerate(backbone.transformer_layers):
        n = f"{p}encoder.layer.{i}."
        att = block.self_attention
        for ours, theirs in (("query", "query"), ("key", "key"), ("value", "value"),
                             ("query_global", "query_global"), ("key_global", "key_global"),
                             ("value_global", "value_global")):
            _dense(weights, getattr(att, ours + "_dense"), n + "attention.self." + theirs)
        _dense(weights, att.output_dense, n + "attention.output.dense")
        _norm(weights, block.self_attention_norm, n + "attention.output.LayerNorm")
        _dense(weights, block.feedforward_layer.intermediate_dense, n + "intermediate.dense")
        _dense(weights, block.feedforward_layer.output_dense, n + "output.dense")
        _norm(weights, block.feedforward_norm, n + "output.LayerNorm")
    if weights.has(p + "pooler.dense.weight") or task == "backbone":
        _dense(weights, backbone.pooler_dense, p + "pooler.dense")
    if task == "masked_lm":
        _dense(weights, model.transform.dense, "lm_head.dense")
        _norm(weights, model.transform.layer_norm, "lm_head.layer_norm")
        assign(model.output_bias.bias, weights.take("lm_head.bias"), "lm_head.bias")
        _check_tied(weights, "lm_head.decoder.weight", words)
        _check_tied(weights, "lm_head.decoder.bias", "lm_head.bias")


def _check_tied(weights, name, tied_to):
    """A stored decoder tensor must equal the tensor it is tied to."""
    if weights.has(name) and weights.has(tied_to):
        a, b = np.asarray(weights.state[name]), np.asarray(weights.state[tied_to])
        if a.shape != b.shape or not np.array_equal(a, b):
            raise ValueError(
                f"{name!r} differs from {tied_to!r}: kzoo ties the masked-LM decoder to the "
                "word embeddings and its bias (tie_word_embeddings=True), but this "
                "checkpoint's are untied."
            )


# === Export ===


def _np(variable):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(variable), dtype=np.float32)


PAD_TOKEN_ID = 1  # what `to_hf` writes (RoBERTa's)


def to_hf(model):
    """`(hf_config, state)` of the transformers Longformer matching `model` (a backbone or
    masked LM with attention="longformer", global_projections=True, global_tokens=0)."""
    backbone, task = _split(model)
    options = backbone.attention_options or {}
    if not handles(model) or options.get("global_tokens") != 0:
        raise ValueError(
            "to_hf as Longformer needs attention='longformer' with attention_options "
            "global_projections=True and global_tokens=0 (Hugging Face takes global tokens "
            f"from global_attention_mask); got attention={backbone.attention!r}, "
            f"attention_options={dict(options)!r}."
        )
    if task not in TASK_ARCHITECTURE:
        raise ValueError(
            f"Hugging Face Longformer has no head for task={task!r}; allowed: "
            f"{sorted(TASK_ARCHITECTURE)}."
        )
    if options["window"] < 2:
        raise ValueError(
            "Hugging Face's attention_window = 2 * (window - 1) must be > 0; got "
            f"window={options['window']}."
        )
    if task == "masked_lm" and backbone.activation != "gelu":
        raise ValueError(
            "LongformerForMaskedLM's head always applies exact GELU; got a masked LM with "
            f"activation={backbone.activation!r} (allowed: 'gelu')."
        )
    hidden_act = bert_convert.KZOO_TO_HF_ACTIVATIONS.get(backbone.activation)
    if hidden_act is None:
        raise ValueError(
            f"activation={backbone.activation!r} has no Hugging Face `hidden_act` equivalent; "
            f"allowed: {sorted(bert_convert.KZOO_TO_HF_ACTIVATIONS)}."
        )
    pad = PAD_TOKEN_ID if backbone.config.position_padding_id is None else (
        backbone.config.position_padding_id)
    hf_config = {
        "architectures": [TASK_ARCHITECTURE[task]],
        "model_type": "longformer",
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_heads,
        "intermediate_size": backbone.intermediate_dim,
        "hidden_act": hidden_act,
        "hidden_dropout_prob": backbone.dropout,
        "attention_probs_dropout_prob": (backbone.dropout if backbone.attention_dropout is None
                                         else backbone.attention_dropout),
        "max_position_embeddings": backbone.max_sequence_length + pad + 1,
        "type_vocab_size": backbone.num_segments,
        "initializer_range": backbone.initializer_range,
        "layer_norm_eps": backbone.layer_norm_epsilon,
        "attention_window": [2 * (options["window"] - 1)] * backbone.num_layers,
        "pad_token_id": pad,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "sep_token_id": 2,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    p = "" if task == "backbone" else "longformer."
    state = {}

    def dense(layer, name):
        state[name + ".weight"] = _np(layer.kernel).T
        state[name + ".bias"] = _np(layer.bias)

    def norm(layer, name):
        state[name + ".weight"] = _np(layer.gamma)
        state[name + ".bias"] = _np(layer.beta)

    e = p + "embeddings."
    state[e + "word_embeddings.weight"] = _np(backbone.token_embedding.embeddings)
    table = _np(backbone.position_embedding.embeddings)
    state[e + "position_embeddings.weight"] = np.concatenate(
        [np.zeros((pad + 1, table.shape[1]), np.float32), table])
    state[e + "token_type_embeddings.weight"] = _np(backbone.segment_embedding.embeddings)
    norm(backbone.embeddings_layer_norm, e + "LayerNorm")
    for i, block in enumerate(backbone.transformer_layers):
        n = f"{p}encoder.layer.{i}."
        att = block.self_attention
        for name in ("query", "key", "value", "query_global", "key_global", "value_global"):
            dense(getattr(att, name + "_dense"), n + "attention.self." + name)
        dense(att.output_dense, n + "attention.output.dense")
        norm(block.self_attention_norm, n + "attention.output.LayerNorm")
        dense(block.feedforward_layer.intermediate_dense, n + "intermediate.dense")
        dense(block.feedforward_layer.output_dense, n + "output.dense")
        norm(block.feedforward_norm, n + "output.LayerNorm")
    if task == "backbone":
        dense(backbone.pooler_dense, "pooler.dense")
    else:
        dense(model.transform.dense, "lm_head.dense")
        norm(model.transform.layer_norm, "lm_head.layer_norm")
        state["lm_head.bias"] = _np(model.output_bias.bias)
    return hf_config, state
