"""Hugging Face BERT checkpoints (`model_type="bert"`) <-> kzoo BERT models.

Architectures: `BertForMaskedLM` -> `masked_lm`, `BertForSequenceClassification` ->
`classifier` (`num_labels` classes), `BertModel` -> `backbone`; `BertForPreTraining` (the
original Google checkpoints) -> `masked_lm`, its next-sentence head being ignored.

Hugging Face's `BertForMaskedLM` has no pooler (`add_pooling_layer=False`): kzoo's backbone
always has one, so a masked-LM checkpoint leaves it at its random initialisation (unused by
the masked-LM head, exactly as transformers does when such a checkpoint is loaded into
`BertForSequenceClassification`), and `to_hf` of a masked-LM model writes no pooler weights.
A checkpoint that has a pooler (e.g. `google-bert/bert-base-uncased`) gets it loaded.

`to_hf` refuses (`ValueError`) a model whose `attention` is not "full" (BertModel's
attention is full softmax attention; Longformer models go through
`kzoo.convert.longformer`).

Example:
>>> model = kzoo.presets.load("/path/to/bert-base-uncased")        # BertForMaskedLM
>>> kzoo.presets.save(model, "/tmp/bert_out", format="hf")           # transformers reads it
"""

import warnings

import numpy as np

from kzoo import registry
from kzoo.convert import assign
from kzoo.models.bert import BertConfig

FAMILY = "bert"
MODEL_TYPES = registry.family(FAMILY).model_types

# Tensors of a checkpoint that kzoo does not need: the position-id buffer of old
# checkpoints, the decoder tied to the word embeddings (checked against them when present)
# and the next-sentence-prediction head of `BertForPreTraining`.
IGNORED_WEIGHTS = (
    "embeddings.position_ids",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
    "cls.seq_relationship.weight",
    "cls.seq_relationship.bias",
)

ARCHITECTURES = {
    "BertForMaskedLM": "masked_lm",
    "BertForPreTraining": "masked_lm",
    "BertForSequenceClassification": "classifier",
    "BertModel": "backbone",
}
TASK_ARCHITECTURE = {"masked_lm": "BertForMaskedLM",
                     "classifier": "BertForSequenceClassification",
                     "backbone": "BertModel"}

# Hugging Face `hidden_act` -> kzoo activation (same function; aliases only).
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_new",
    "gelu_accurate": "gelu_new",  # (transformers' AccurateGELU: the same formula)
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "gelu_python_tanh": "gelu_pytorch_tanh",  # (the same formula, written in Python)
    "relu": "relu",
    "silu": "silu",
    "swish": "swish",
    "quick_gelu": "quick_gelu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}
# kzoo activation -> Hugging Face `hidden_act` (names transformers' ACT2FN knows).
KZOO_TO_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_tanh": "gelu_pytorch_tanh",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "swish",
    "quick_gelu": "quick_gelu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}

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
    "position_embedding_type": "absolute",
    "classifier_dropout": None,
}


def _get(hf_config, key):
    value = hf_config.get(key)
    return _DEFAULTS[key] if value is None and key != "classifier_dropout" else value


def _num_labels(hf_config):
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return int(hf_config.get("num_labels", 2))


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
}


def config_from_hf(hf_config, source="config.json"):
    """`(family, backbone_config, task, task_config)` for a Hugging Face BERT config dict.

    Raises `ValueError` naming any field kzoo cannot honour (a relative
    `position_embedding_type`, `is_decoder`, cross-attention, untied decoder, pruned heads,
    an unknown `hidden_act` or architecture); the kzoo fields are checked by `BertConfig`,
    whose errors name the kzoo field, the config.json key and `source`.
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"Expected model_type in {list(MODEL_TYPES)}; got model_type={model_type!r}.")
    position = _get(hf_config, "position_embedding_type")
    if position != "absolute":
        raise ValueError(
            f"position_embedding_type={position!r} is not supported by kzoo's BERT: only "
            "'absolute' (learned absolute positions) is; 'relative_key' and "
            "'relative_key_query' are not implemented."
        )
    if hf_config.get("is_decoder", False):
        raise ValueError("is_decoder=True (causal BERT) is not supported; only the "
                         "bidirectional encoder (is_decoder=False) is.")
    if hf_config.get("add_cross_attention", False):
        raise ValueError("add_cross_attention=True is not supported by kzoo's BERT.")
    if hf_config.get("pruned_heads"):
        raise ValueError(
            f"pruned_heads={hf_config['pruned_heads']!r} is not supported: every layer must "
            "have num_attention_heads heads."
        )
    if hf_config.get("tie_word_embeddings", True) is False:
        raise ValueError(
            "tie_word_embeddings=False is not supported: kzoo's BertMaskedLM ties the decoder "
            "to the word embeddings (as BERT does)."
        )
    act = _get(hf_config, "hidden_act")
    if act not in HF_ACTIVATIONS:
        raise ValueError(
            f"hidden_act={act!r} is not supported; allowed: {sorted(HF_ACTIVATIONS)}."
        )
    architectures = hf_config.get("architectures") or ["BertModel"]
    arch = architectures[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"architectures={architectures!r} is not supported; allowed: "
            f"{sorted(ARCHITECTURES)}."
        )
    task = ARCHITECTURES[arch]
    config = {
        kzoo: _get(hf_config, hf) for kzoo, hf in _HF_NAMES.items() if kzoo != "activation"
    }
    config["activation"] = HF_ACTIVATIONS[act]
    checked = BertConfig.from_dict(config, source=source, names=_HF_NAMES)
    config = {key: getattr(checked, key) for key in config}
    hidden_dropout = config["dropout"]
    task_config = {}
    if task == "classifier":
        classifier_dropout = hf_config.get("classifier_dropout")
        task_config = {
            "num_classes": _num_labels(hf_config),
            "dropout": hidden_dropout if classifier_dropout is None else float(classifier_dropout),
        }
    return FAMILY, config, task, task_config


# === Weights ===


def _rename_legacy(state):
    """TF-era names (`LayerNorm.gamma`/`beta`) -> the current ones (`weight`/`bias`)."""
    for key in list(state):
        for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
            if "LayerNorm" in key and key.endswith(old):
                state[key[: -len(old)] + new] = state.pop(key)


def _prefix(reader):
    return "bert." if reader.has("bert.embeddings.word_embeddings.weight") else ""


def _dense(reader, layer, name):
    assign(layer.kernel, reader.take(name + ".weight", transpose=True), name + ".weight")
    assign(layer.bias, reader.take(name + ".bias"), name + ".bias")


def _norm(reader, layer, name):
    assign(layer.gamma, reader.take(name + ".weight"), name + ".weight")
    assign(layer.beta, reader.take(name + ".bias"), name + ".bias")


def _split(model):
    task = getattr(model, "task_name", None)
    return (model.backbone if task else model), (task or "backbone")


def load_weights(model, weights):
    """Assign the tensors of a Hugging Face BERT checkpoint (a `WeightReader`) to `model`.

    The pooler is loaded when the checkpoint has it; for a backbone or classifier that
    lacks it a warning says it stays randomly initialised (masked-LM models do not use it).
    """
    _rename_legacy(weights.state)
    backbone, task = _split(model)
    p = _prefix(weights)
    e = p + "embeddings."
    assign(backbone.token_embedding.embeddings, weights.take(e + "word_embeddings.weight"),
           e + "word_embeddings.weight")
    assign(backbone.position_embedding.embeddings,
           weights.take(e + "position_embeddings.weight"), e + "position_embeddings.weight")
    assign(backbone.segment_embedding.embeddings,
           weights.take(e + "token_type_embeddings.weight"), e + "token_type_embeddings.weight")
    _norm(weights, backbone.embeddings_layer_norm, e + "LayerNorm")
    for i, block in enumerate(backbone.transformer_layers):
        n = f"{p}encoder.layer.{i}."
        att = block.self_attention
        _dense(weights, att.query_dense, n + "attention.self.query")
        _dense(weights, att.key_dense, n + "attention.self.key")
        _dense(weights, att.value_dense, n + "attention.self.value")
        _dense(weights, att.output_dense, n + "attention.output.dense")
        _norm(weights, block.self_attention_norm, n + "attention.output.LayerNorm")
        _dense(weights, block.feedforward_layer.intermediate_dense, n + "intermediate.dense")
        _dense(weights, block.feedforward_layer.output_dense, n + "output.dense")
        _norm(weights, block.feedforward_norm, n + "output.LayerNorm")
    pooler = p + "pooler.dense"
    if weights.has(pooler + ".weight") or task == "classifier":
        _dense(weights, backbone.pooler_dense, pooler)
    elif task == "backbone":
        warnings.warn(
            "The checkpoint has no pooler weights (e.g. a BertForMaskedLM checkpoint): the "
            "backbone's pooler (pooled_output) stays randomly initialised.",
            stacklevel=2,
        )
    if task == "masked_lm":
        _dense(weights, model.transform.dense, "cls.predictions.transform.dense")
        _norm(weights, model.transform.layer_norm, "cls.predictions.transform.LayerNorm")
        assign(model.output_bias.bias, weights.take("cls.predictions.bias"),
               "cls.predictions.bias")
        _check_tied(weights, "cls.predictions.decoder.weight", e + "word_embeddings.weight")
        _check_tied(weights, "cls.predictions.decoder.bias", "cls.predictions.bias")
    elif task == "classifier":
        _dense(weights, model.classifier_dense, "classifier")


def _check_tied(weights, name, tied_to):
    """A decoder tensor stored beside the one it is tied to must equal it."""
    if weights.has(name) and weights.has(tied_to):
        a, b = np.asarray(weights.state[name]), np.asarray(weights.state[tied_to])
        if a.shape != b.shape or not np.array_equal(a, b):
            raise ValueError(
                f"{name!r} differs from {tied_to!r}: kzoo ties the masked-LM decoder to the "
                "word embeddings (tie_word_embeddings=True), but this checkpoint's are untied."
            )


# === Export ===


def _np(variable):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(variable), dtype=np.float32)


def to_hf(model):
    """`(hf_config, state)` of the transformers model matching `model` (see module doc)."""
    backbone, task = _split(model)
    if backbone.attention != "full":
        # (BertModel's attention is full softmax attention: a sliding window, sparse or
        # linear attention written as BERT would load and compute something else in silence)
        raise ValueError(
            f"attention={backbone.attention!r} has no Hugging Face BERT equivalent: "
            "BertModel's self-attention is full (allowed: attention='full'; "
            "attention='longformer' with global_projections=True is written as Longformer)."
        )
    if backbone.activation not in KZOO_TO_HF_ACTIVATIONS:
        raise ValueError(
            f"activation={backbone.activation!r} has no Hugging Face `hidden_act` equivalent; "
            f"allowed: {sorted(KZOO_TO_HF_ACTIVATIONS)}."
        )
    if backbone.config.position_padding_id is not None:
        raise ValueError(
            f"position_padding_id={backbone.config.position_padding_id!r} has no Hugging Face "
            "BERT equivalent: BertModel numbers positions 0, 1, 2, ... along each row "
            "(allowed: position_padding_id=None; RoBERTa-style numbering is written as "
            "Longformer, with attention='longformer')."
        )
    hf_config = {
        "architectures": [TASK_ARCHITECTURE[task]],
        "model_type": "bert",
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_heads,
        "intermediate_size": backbone.intermediate_dim,
        "hidden_act": KZOO_TO_HF_ACTIVATIONS[backbone.activation],
        "hidden_dropout_prob": backbone.dropout,
        "attention_probs_dropout_prob": (backbone.dropout if backbone.attention_dropout is None
                                         else backbone.attention_dropout),
        "max_position_embeddings": backbone.max_sequence_length,
        "type_vocab_size": backbone.num_segments,
        "initializer_range": backbone.initializer_range,
        "layer_norm_eps": backbone.layer_norm_epsilon,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "classifier_dropout": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    p = "" if task == "backbone" else "bert."
    state = {}

    def dense(layer, name):
        state[name + ".weight"] = _np(layer.kernel).T
        state[name + ".bias"] = _np(layer.bias)

    def norm(layer, name):
        state[name + ".weight"] = _np(layer.gamma)
        state[name + ".bias"] = _np(layer.beta)

    e = p + "embeddings."
    state[e + "word_embeddings.weight"] = _np(backbone.token_embedding.embeddings)
    state[e + "position_embeddings.weight"] = _np(backbone.position_embedding.embeddings)
    state[e + "token_type_embeddings.weight"] = _np(backbone.segment_embedding.embeddings)
    norm(backbone.embeddings_layer_norm, e + "LayerNorm")
    for i, block in enumerate(backbone.transformer_layers):
        n = f"{p}encoder.layer.{i}."
        att = block.self_attention
        dense(att.query_dense, n + "attention.self.query")
        dense(att.key_dense, n + "attention.self.key")
        dense(att.value_dense, n + "attention.self.value")
        dense(att.output_dense, n + "attention.output.dense")
        norm(block.self_attention_norm, n + "attention.output.LayerNorm")
        dense(block.feedforward_layer.intermediate_dense, n + "intermediate.dense")
        dense(block.feedforward_layer.output_dense, n + "output.dense")
        norm(block.feedforward_norm, n + "output.LayerNorm")
    if task != "masked_lm":
        dense(backbone.pooler_dense, p + "pooler.dense")
    if task == "masked_lm":
        dense(model.transform.dense, "cls.predictions.transform.dense")
        norm(model.transform.layer_norm, "cls.predictions.transform.LayerNorm")
        state["cls.predictions.bias"] = _np(model.output_bias.bias)
    elif task == "classifier":
        dense(model.classifier_dense, "classifier")
        hf_config["num_labels"] = model.num_classes
        hf_config["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_classes)}
        hf_config["label2id"] = {f"LABEL_{i}": i for i in range(model.num_classes)}
        hf_config["classifier_dropout"] = model.dropout
    return hf_config, state
