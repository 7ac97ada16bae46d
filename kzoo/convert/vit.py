"""Hugging Face ViT (`model_type="vit"`) checkpoints <-> kzoo `ViTBackbone` / `ViTClassifier`.

`ViTForImageClassification` becomes a `ViTClassifier` (classes from `id2label` /
`num_labels`), `ViTModel` a `ViTBackbone`. Hugging Face feeds images as NCHW
`pixel_values`; kzoo takes the same pixels as NHWC (`pixel_values.transpose(0, 2, 3, 1)`).

Config fields:
- honoured: `image_size`, `patch_size`, `num_channels`, `hidden_size`, `num_hidden_layers`,
  `num_attention_heads`, `intermediate_size`, `hidden_act`, `layer_norm_eps`, `qkv_bias`,
  `hidden_dropout_prob` and `attention_probs_dropout_prob` (training only), `id2label` /
  `num_labels`.
- ignored on purpose: `encoder_stride` (only used by `ViTForMaskedImageModeling`'s decoder),
  `pooler_output_size` / `pooler_act` and the pooler's weights (`ViTModel`'s dense + tanh
  pooler; kzoo's backbone has none and returns the final sequence: take `[:, 0]` and add
  your own head), `embeddings.mask_token` (only used with `bool_masked_pos`),
  `initializer_range` (initialisation only).
- refused (`ValueError`): an unknown `hidden_act`, non-empty `pruned_heads`, an
  architecture other than `ViTModel` / `ViTForImageClassification`.

Exporting refuses (`ValueError`) a model whose `attention` is not "full" (ViTModel's
attention is full softmax attention). Exporting a backbone writes a `ViTModel` checkpoint
without pooler weights: transformers initialises the pooler randomly and warns;
`last_hidden_state` is exact.

Example:
>>> model = kzoo.presets.load("/path/to/google-vit-base-patch16-224")
>>> kzoo.presets.save(model, "/tmp/vit_hf", format="hf")
"""

import numpy as np

from kzoo import registry
from kzoo.convert import assign
from kzoo.models.vit import ViTConfig

FAMILY = "vit"
MODEL_TYPES = registry.family(FAMILY).model_types
# ViTModel's pooler (kzoo's backbone has none) and the unused mask token.
IGNORED_WEIGHTS = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.mask_token")

# Hugging Face `hidden_act` -> kzoo activation (the same function).
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_new",  # (the tanh form with sqrt(2 / pi) as 0.7978845608)
    "gelu_accurate": "gelu_new",  # (transformers' AccurateGELU: the same formula)
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "swish",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}
# kzoo activation -> Hugging Face `hidden_act`.
_TO_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "swish",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}
_ARCHITECTURES = {"ViTModel": "backbone", "ViTForImageClassification": "classifier"}


def _size(value):
    return list(value) if isinstance(value, (list, tuple)) else value


# kzoo field -> its config.json key (named in the errors of `ViTConfig`).
_HF_NAMES = {
    "image_size": "image_size",
    "patch_size": "patch_size",
    "num_channels": "num_channels",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "hidden_dim": "hidden_size",
    "intermediate_dim": "intermediate_size",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "layer_norm_epsilon": "layer_norm_eps",
    "activation": "hidden_act",
    "qkv_bias": "qkv_bias",
}


def config_from_hf(hf_config, source="config.json"):
    """`(family, backbone_config, task, task_config)` for a ViT `config.json` dict.

    The kzoo fields are checked by `ViTConfig`: a bad value raises a `ValueError` naming
    the kzoo field, the config.json key and `source` (the file it came from).
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"`model_type` must be one of {list(MODEL_TYPES)}; got {model_type!r}.")
    architectures = hf_config.get("architectures") or ["ViTModel"]
    unknown = [a for a in architectures if a not in _ARCHITECTURES]
    if unknown:
        raise ValueError(
            f"Unsupported ViT `architectures`={architectures!r}: kzoo reads "
            f"{sorted(_ARCHITECTURES)}."
        )
    task = _ARCHITECTURES[architectures[0]]
    act = hf_config.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"Unsupported `hidden_act`={act!r}; kzoo supports {sorted(_ACTIVATIONS)}."
        )
    if hf_config.get("pruned_heads"):
        raise ValueError(
            f"`pruned_heads`={hf_config['pruned_heads']!r} is not supported (kzoo's attention "
            "has the same number of heads in every layer)."
        )
    config = {
        "image_size": _size(hf_config.get("image_size", 224)),
        "patch_size": _size(hf_config.get("patch_size", 16)),
        "num_channels": hf_config.get("num_channels", 3),
        "num_layers": hf_config.get("num_hidden_layers", 12),
        "num_heads": hf_config.get("num_attention_heads", 12),
        "hidden_dim": hf_config.get("hidden_size", 768),
        "intermediate_dim": hf_config.get("intermediate_size", 3072),
        "dropout": hf_config.get("hidden_dropout_prob", 0.0),
        "attention_dropout": hf_config.get("attention_probs_dropout_prob", 0.0),
        "layer_norm_epsilon": hf_config.get("layer_norm_eps", 1e-12),
        "activation": _ACTIVATIONS[act],
        "use_class_token": True,
        "qkv_bias": hf_config.get("qkv_bias", True),
    }
    checked = ViTConfig.from_dict(config, source=source, names=_HF_NAMES)
    config = {key: getattr(checked, key) for key in config}
    # `encoder_stride` only shapes ViTForMaskedImageModeling's decoder: ignored here.
    task_config = {}
    if task == "classifier":
        id2label = hf_config.get("id2label")
        num_labels = len(id2label) if id2label else hf_config.get("num_labels", 2)
        task_config = {"num_classes": int(num_labels), "pooling": "token"}
    return FAMILY, config, task, task_config


def _parts(model):
    from kzoo.models.vit import ViTClassifier

    if isinstance(model, ViTClassifier):
        return model.backbone, model
    return model, None


def _dense(reader, dense, name):
    assign(dense.kernel, reader.take(name + ".weight", transpose=True), name + ".weight")
    if dense.use_bias:
        assign(dense.bias, reader.take(name + ".bias"), name + ".bias")


def _norm(reader, layer, name):
    assign(layer.gamma, reader.take(name + ".weight"), name + ".weight")
    assign(layer.beta, reader.take(name + ".bias"), name + ".bias")


def load_weights(model, weights):
    """Assign every tensor of a ViT checkpoint (a `WeightReader`) to a kzoo ViT model.

    A position table learned for another image size is resampled bicubically to the
    model's `image_size`.
    """
    backbone, classifier = _parts(model)
    if not backbone.use_class_token:
        raise ValueError(
            "Hugging Face ViT checkpoints have a class token; got a backbone with "
            "use_class_token=False."
        )
    prefix = "vit." if weights.has("vit.embeddings.cls_token") else ""
    emb = backbone.embedding
    name = prefix + "embeddings.cls_token"
    assign(emb.class_token, weights.take(name), name)
    name = prefix + "embeddings.position_embeddings"
    table = weights.take(name)
    if table is not None:
        assign(emb.position_embedding, emb.resample_table(table[0]), name)
    name = prefix + "embeddings.patch_embeddings.projection"
    kernel = weights.take(name + ".weight")
    if kernel is not None:
        kernel = kernel.transpose(2, 3, 1, 0)  # (out, in, kh, kw) -> (kh, kw, in, out)
    conv = emb.patch_embedding.projection
    assign(conv.kernel, kernel, name + ".weight")
    assign(conv.bias, weights.take(name + ".bias"), name + ".bias")

    for i, layer in enumerate(backbone.encoder_layers):
        p = f"{prefix}encoder.layer.{i}."
        att = layer.self_attention
        _dense(weights, att.query_dense, p + "attention.attention.query")
        _dense(weights, att.key_dense, p + "attention.attention.key")
        _dense(weights, att.value_dense, p + "attention.attention.value")
        _dense(weights, att.output_dense, p + "attention.output.dense")
        _dense(weights, layer.feedforward_layer.intermediate_dense, p + "intermediate.dense")
        _dense(weights, layer.feedforward_layer.output_dense, p + "output.dense")
        _norm(weights, layer.self_attention_norm, p + "layernorm_before")
        _norm(weights, layer.feedforward_norm, p + "layernorm_after")
    _norm(weights, backbone.final_norm, prefix + "layernorm")

    # A classifier head comes from a ViTForImageClassification checkpoint; a ViTModel
    # checkpoint loaded as a classifier keeps the fresh (zero) head.
    if classifier is not None and prefix:
        head = weights.state.get("classifier.weight")
        if head is not None and head.shape[0] != classifier.num_classes:
            raise ValueError(
                f"The checkpoint's classifier has {head.shape[0]} classes (classifier.weight "
                f"{tuple(head.shape)}) but the model has num_classes={classifier.num_classes}; "
                "load it with task='backbone' and put a new ViTClassifier on top."
            )
        _dense(weights, classifier.head, "classifier")
    elif classifier is not None:
        # (named as missing: a non-strict load warns of them, as transformers does)
        weights.missing.extend(["classifier.weight", "classifier.bias"])


def _np(variable):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(ops.cast(variable, "float32")))


def to_hf(model):
    """`(config.json dict, {name: array})` of the equivalent transformers model."""
    backbone, classifier = _parts(model)
    if not backbone.use_class_token:
        raise ValueError(
            "transformers' ViT always has a class token; cannot export a backbone with "
            "use_class_token=False."
        )
    if backbone.attention != "full":
        # (ViTModel's attention is full softmax attention: another kind written as ViT would
        # load and compute something else in silence)
        raise ValueError(
            f"attention={backbone.attention!r} has no Hugging Face ViT equivalent: ViTModel's "
            "self-attention is full (allowed: attention='full')."
        )
    if classifier is not None and classifier.pooling != "token":
        raise ValueError(
            "ViTForImageClassification classifies the class token; cannot export a "
            f"ViTClassifier with pooling={classifier.pooling!r} (only 'token')."
        )
    if backbone.activation not in _TO_HF_ACTIVATIONS:
        raise ValueError(
            f"activation={backbone.activation!r} has no transformers equivalent; exportable: "
            f"{sorted(_TO_HF_ACTIVATIONS)}."
        )
    patch = backbone.patch_size
    config = {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification" if classifier is not None else "ViTModel"],
        "image_size": _size(backbone.image_size),
        "patch_size": _size(patch),
        "num_channels": backbone.num_channels,
        "hidden_size": backbone.hidden_dim,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_heads,
        "intermediate_size": backbone.intermediate_dim,
        "hidden_act": _TO_HF_ACTIVATIONS[backbone.activation],
        "hidden_dropout_prob": backbone.dropout,
        "attention_probs_dropout_prob": backbone.attention_dropout,
        "layer_norm_eps": backbone.layer_norm_epsilon,
        "qkv_bias": backbone.qkv_bias,
        "encoder_stride": patch if isinstance(patch, int) else 16,
        "initializer_range": 0.02,
        "pooler_act": "tanh",
        "pooler_output_size": backbone.hidden_dim,
        "torch_dtype": "float32",
    }
    prefix = "vit." if classifier is not None else ""
    state = {}
    emb = backbone.embedding
    state[prefix + "embeddings.cls_token"] = _np(emb.class_token)
    state[prefix + "embeddings.position_embeddings"] = _np(emb.position_embedding)[None]
    conv = emb.patch_embedding.projection
    name = prefix + "embeddings.patch_embeddings.projection"
    state[name + ".weight"] = _np(conv.kernel).transpose(3, 2, 0, 1)
    state[name + ".bias"] = _np(conv.bias)

    def dense(layer, name):
        state[name + ".weight"] = _np(layer.kernel).T
        if layer.use_bias:
            state[name + ".bias"] = _np(layer.bias)

    def norm(layer, name):
        state[name + ".weight"] = _np(layer.gamma)
        state[name + ".bias"] = _np(layer.beta)

    for i, layer in enumerate(backbone.encoder_layers):
        p = f"{prefix}encoder.layer.{i}."
        att = layer.self_attention
        dense(att.query_dense, p + "attention.attention.query")
        dense(att.key_dense, p + "attention.attention.key")
        dense(att.value_dense, p + "attention.attention.value")
        dense(att.output_dense, p + "attention.output.dense")
        dense(layer.feedforward_layer.intermediate_dense, p + "intermediate.dense")
        dense(layer.feedforward_layer.output_dense, p + "output.dense")
        norm(layer.self_attention_norm, p + "layernorm_before")
        norm(layer.feedforward_norm, p + "layernorm_after")
    norm(backbone.final_norm, prefix + "layernorm")
    if classifier is not None:
        dense(classifier.head, "classifier")
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(classifier.num_classes)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(classifier.num_classes)}
    return config, state
