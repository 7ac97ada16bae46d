"""Hugging Face Graphormer checkpoints (`GraphormerForGraphClassification`, `GraphormerModel`,
transformers' `models/deprecated/graphormer`) <-> kzoo Graphormer.

`GraphormerForGraphClassification` becomes a `GraphormerPredictor` (its `num_classes`),
`GraphormerModel` a `GraphormerBackbone`. Weight layout (Hugging Face -> kzoo; the
classification model prefixes the encoder's names with `encoder.`; Linear weights
`(out, in)` are transposed to Keras kernels `(in, out)`):

- `graph_encoder.graph_node_feature.{atom,in_degree,out_degree}_encoder.weight`,
  `graph_token.weight` -> `node_feature.{atom,in_degree,out_degree}_embeddings`,
  `graph_token`;
- `graph_encoder.graph_attn_bias.edge_encoder.weight`, `spatial_pos_encoder.weight`,
  `graph_token_virtual_distance.weight` -> `attention_bias.edge_embeddings`,
  `spatial_embeddings`, `virtual_distance`; `edge_dis_encoder.weight`
  `(num_edge_dis * heads * heads, 1)` -> `attention_bias.edge_distance_weights`
  `(num_edge_dis, heads, heads)` (a reshape);
- `graph_encoder.emb_layer_norm` -> `embedding_norm`;
- `graph_encoder.layers.N.self_attn.{q,k,v,out}_proj` -> the layer's
  `self_attention.{query,key,value,output}_dense`, `self_attn_layer_norm` ->
  `self_attention_norm`, `fc1`/`fc2` -> `feedforward.{intermediate,output}_dense`,
  `final_layer_norm` -> `feedforward_norm`;
- `lm_head_transform_weight`, `layer_norm` -> `head_transform.dense`, `.layer_norm`;
- `classifier.classifier.weight`, `classifier.lm_output_learned_bias` -> the predictor's
  `classifier.kernel`, `.bias`.

With `pre_layernorm=True` transformers (like the reference code) creates
`graph_encoder.final_layer_norm` but never uses it: it is read and dropped on load, and
written as ones/zeros on export. Embedding row 0 is padding in kzoo (a zero vector); the
edge table's row 0, which transformers uses for "no edge" and for hops past the end of a
path, must be zero in the checkpoint (it always is: `padding_idx=0`), and every padding row
is written as zeros on export.

Configuration fields that only the data collator reads (`spatial_pos_max`, `max_nodes`) or
that change nothing in transformers' forward pass (`traceable`, `self_attention`,
`qn_block_size` with `q_noise=0`) are ignored; fields that change the computation and have
no kzoo equivalent raise `ValueError` naming them.

Example:
>>> model = kzoo.presets.load("/path/to/graphormer-base-pcqm4mv2")  # save_pretrained dir
>>> kzoo.presets.save(model, "/tmp/graphormer_out", format="hf")
"""

import keras
import numpy as np

from kzoo import registry
from kzoo.convert import assign
from kzoo.models.graphormer import GraphormerConfig

FAMILY = "graphormer"
MODEL_TYPES = registry.family(FAMILY).model_types

ARCHITECTURES = {
    "GraphormerForGraphClassification": "predictor",
    "GraphormerModel": "backbone",
}

# Unused by the forward pass of both the reference code and transformers (the reference
# encoder's `masked_lm_pooler`); ignored if a converted checkpoint carries them.
IGNORED_WEIGHTS = ("masked_lm_pooler.weight", "masked_lm_pooler.bias")

# Hugging Face `activation_fn` (ACT2FN names) -> kzoo activation; the same functions.
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",  # (the same formula, written in Python)
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",  # (transformers' AccurateGELU: the same formula)
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}
_ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "gelu_new": "gelu_new",
                      "gelu_pytorch_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu",
                      "relu": "relu", "silu": "silu", "swish": "silu", "tanh": "tanh",
                      "sigmoid": "sigmoid", "linear": "linear"}

HF_LAYER_NORM_EPSILON = 1e-5  # torch's nn.LayerNorm default; transformers has no field


def _unsupported(field, value, why):
    raise ValueError(f"Unsupported Graphormer config field {field}={value!r}: {why}")


# kzoo field -> its config.json key (named in the errors of `GraphormerConfig`).
_HF_NAMES = {
    "num_atoms": "num_atoms",
    "num_in_degree": "num_in_degree",
    "num_out_degree": "num_out_degree",
    "num_edges": "num_edges",
    "num_spatial": "num_spatial",
    "num_edge_dis": "num_edge_dis",
    "edge_type": "edge_type",
    "multi_hop_max_dist": "multi_hop_max_dist",
    "num_layers": "num_hidden_layers",
    "hidden_dim": "embedding_dim",
    "intermediate_dim": "ffn_embedding_dim",
    "num_heads": "num_attention_heads",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "activation_dropout": "activation_dropout",
    "activation": "activation_fn",
    "pre_layernorm": "pre_layernorm",
    "encoder_normalize_before": "encoder_normalize_before",
    "embed_scale": "embed_scale",
    "apply_graphormer_init": "apply_graphormer_init",
    "use_attention_bias": "bias",
    "num_frozen_layers": "num_trans_layers_to_freeze",
    "layerdrop": "layerdrop",
}


def config_from_hf(hf, source="config.json"):
    """(family, backbone config, task, task config) of a Hugging Face Graphormer
    `config.json` (a dict).

    The kzoo fields are checked by `GraphormerConfig`: a bad value raises a `ValueError`
    naming the kzoo field, the config.json key and `source` (the file it came from).
    """
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"config_from_hf for Graphormer needs model_type in {list(MODEL_TYPES)}; got "
            f"model_type={hf.get('model_type')!r}."
        )
    architectures = hf.get("architectures") or ["GraphormerForGraphClassification"]
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported Graphormer architectures={architectures!r}; supported: "
            f"{sorted(ARCHITECTURES)}."
        )
    hidden = hf.get("embedding_dim", hf.get("hidden_size", 768))
    checks = (
        ("q_noise", hf.get("q_noise", 0.0), lambda v: not v,
         "quantisation noise (which also adds a random projection of the embeddings) is "
         "not implemented in kzoo (set it to 0.0)."),
        ("freeze_embeddings", hf.get("freeze_embeddings", False), lambda v: not v,
         "transformers raises NotImplementedError for it too."),
        ("share_input_output_embed", hf.get("share_input_output_embed", False),
         lambda v: not v, "transformers' model cannot run with it either."),
        ("kdim", hf.get("kdim"), lambda v: v is None or v == hidden,
         f"keys must have the embedding width {hidden} (self-attention)."),
        ("vdim", hf.get("vdim"), lambda v: v is None or v == hidden,
         f"values must have the embedding width {hidden} (self-attention)."),
        ("pad_token_id", hf.get("pad_token_id", 0), lambda v: v in (0, None),
         "kzoo's Graphormer uses id 0 as the padding id of every embedding table."),
    )
    for field, value, ok, why in checks:
        if not ok(value):
            _unsupported(field, value, why)
    activation = hf.get("activation_fn", "gelu")
    if activation not in _ACTIVATIONS:
        _unsupported("activation_fn", activation, f"supported: {sorted(_ACTIVATIONS)}.")
    multi_hop = hf.get("multi_hop_max_dist", 5)
    embed_scale = hf.get("embed_scale")
    config = {
        "num_atoms": hf.get("num_atoms", 512 * 9),
        "num_in_degree": hf.get("num_in_degree", 512),
        "num_out_degree": hf.get("num_out_degree", 512),
        "num_edges": hf.get("num_edges", 512 * 3),
        "num_spatial": hf.get("num_spatial", 512),
        "num_edge_dis": hf.get("num_edge_dis", 128),
        # transformers runs the multi-hop encoding for "multi_hop" and the single-hop one
        # for any other value.
        "edge_type": "multi_hop" if hf.get("edge_type", "multi_hop") == "multi_hop"
        else "single_hop",
        # transformers cuts hops only when multi_hop_max_dist > 0.
        "multi_hop_max_dist": max(multi_hop, 0) if isinstance(multi_hop, int) else multi_hop,
        "num_layers": hf.get("num_hidden_layers", 12),
        "hidden_dim": hidden,
        "intermediate_dim": hf.get("ffn_embedding_dim", 768),
        "num_heads": hf.get("num_attention_heads", 32),
        "dropout": hf.get("dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.1),
        "activation_dropout": hf.get("activation_dropout", 0.1),
        "activation": _ACTIVATIONS[activation],
        "pre_layernorm": hf.get("pre_layernorm", False),
        "layer_norm_epsilon": HF_LAYER_NORM_EPSILON,
        "encoder_normalize_before": hf.get("encoder_normalize_before", False),
        "embed_scale": embed_scale,
        "apply_graphormer_init": hf.get("apply_graphormer_init", False),
        "use_attention_bias": hf.get("bias", True),
        "num_frozen_layers": hf.get("num_trans_layers_to_freeze", 0),
        # transformers' LayerDropModuleList: in training each encoder layer is skipped with
        # this probability, one draw per layer and forward pass (as kzoo's `layerdrop`).
        "layerdrop": hf.get("layerdrop", 0.0),
    }
    names = _HF_NAMES if "embedding_dim" in hf or "hidden_size" not in hf else {
        **_HF_NAMES, "hidden_dim": "hidden_size"}
    checked = GraphormerConfig.from_dict(config, source=source, names=names)
    config = {key: getattr(checked, key) for key in config}
    task = ARCHITECTURES[architecture]
    task_config = {"num_classes": hf.get("num_classes", 1)} if task == "predictor" else {}
    return FAMILY, config, task, task_config


# === Name mapping ===


def _backbone_of(model):
    return model.backbone if getattr(model, "task_name", None) else model


def _dense(pairs, prefix, dense):
    pairs.append((f"{prefix}.weight", dense.kernel, "transpose"))
    if dense.use_bias:
        pairs.append((f"{prefix}.bias", dense.bias, None))


def _norm(pairs, prefix, norm):
    pairs.append((f"{prefix}.weight", norm.gamma, None))
    pairs.append((f"{prefix}.bias", norm.beta, None))


def _pairs(model, prefix):
    """(Hugging Face name, Keras variable, how) for every weight of `model`; `how` is None,
    "transpose", "edge_dis" (reshape) or "padding" (row 0 zero on export)."""
    backbone = _backbone_of(model)
    enc = prefix + "graph_encoder."
    nodes, bias = backbone.node_feature, backbone.attention_bias
    pairs = [
        (enc + "graph_node_feature.atom_encoder.weight", nodes.atom_embeddings, "padding"),
        (enc + "graph_node_feature.in_degree_encoder.weight", nodes.in_degree_embeddings,
         "padding"),
        (enc + "graph_node_feature.out_degree_encoder.weight", nodes.out_degree_embeddings,
         "padding"),
        (enc + "graph_node_feature.graph_token.weight", nodes.graph_token, None),
        (enc + "graph_attn_bias.edge_encoder.weight", bias.edge_embeddings, "padding"),
        (enc + "graph_attn_bias.spatial_pos_encoder.weight", bias.spatial_embeddings,
         "padding"),
        (enc + "graph_attn_bias.graph_token_virtual_distance.weight", bias.virtual_distance,
         None),
    ]
    if bias.edge_distance_weights is not None:
        pairs.append((enc + "graph_attn_bias.edge_dis_encoder.weight",
                      bias.edge_distance_weights, "edge_dis"))
    if backbone.embedding_norm is not None:
        _norm(pairs, enc + "emb_layer_norm", backbone.embedding_norm)
    for i, layer in enumerate(backbone.encoder_layers):
        p = f"{enc}layers.{i}."
        attention = layer.self_attention
        for hf_name, dense in (("q_proj", attention.query_dense),
                               ("k_proj", attention.key_dense),
                               ("v_proj", attention.value_dense),
                               ("out_proj", attention.output_dense)):
            _dense(pairs, p + "self_attn." + hf_name, dense)
        _norm(pairs, p + "self_attn_layer_norm", layer.self_attention_norm)
        _dense(pairs, p + "fc1", layer.feedforward_layer.intermediate_dense)
        _dense(pairs, p + "fc2", layer.feedforward_layer.output_dense)
        _norm(pairs, p + "final_layer_norm", layer.feedforward_norm)
    _dense(pairs, prefix + "lm_head_transform_weight", backbone.head_transform.dense)
    _norm(pairs, prefix + "layer_norm", backbone.head_transform.layer_norm)
    if getattr(model, "task_name", None) == "predictor":
        pairs.append(("classifier.classifier.weight", model.head.kernel, "transpose"))
        pairs.append(("classifier.lm_output_learned_bias", model.head.bias, None))
    return pairs


def _prefix(weights):
    """"encoder." for a `GraphormerForGraphClassification` checkpoint, "" for a
    `GraphormerModel` one."""
    if any(name.startswith("encoder.graph_encoder.") for name in weights.state):
        return "encoder."
    return ""


def load_weights(model, weights):
    """Assign every weight of a Graphormer checkpoint (a `WeightReader`) to a kzoo model."""
    prefix = _prefix(weights)
    backbone = _backbone_of(model)
    for name, variable, how in _pairs(model, prefix):
        value = weights.take(name, transpose=how == "transpose")
        if value is None:
            continue
        if how == "edge_dis":
            heads = backbone.num_heads
            if value.size != int(np.prod(variable.shape)):
                raise ValueError(
                    f"Shape mismatch for {name!r}: checkpoint has {tuple(value.shape)}, model "
                    f"variable {variable.path!r} has {tuple(variable.shape)} (expected "
                    f"({variable.shape[0] * heads * heads}, 1))."
                )
            value = value.reshape(tuple(variable.shape))
        if name.endswith("edge_encoder.weight") and np.any(value[0] != 0):
            raise ValueError(
                f"{name!r} has a non-zero row 0: transformers uses that row for 'no edge' "
                "and for hops past the end of a path, and kzoo treats id 0 as padding "
                "(a zero vector), as `padding_idx=0` does for every trained checkpoint."
            )
        assign(variable, value, name)
    if backbone.pre_layernorm:
        # Created but never used by transformers (and the reference code).
        for suffix in ("weight", "bias"):
            weights.take(f"{prefix}graph_encoder.final_layer_norm.{suffix}")


def to_hf(model):
    """(Hugging Face config dict, state dict of NumPy arrays) for a kzoo Graphormer."""
    backbone = _backbone_of(model)
    task = getattr(model, "task_name", None)
    if task not in (None, "predictor"):
        raise ValueError(f"No Hugging Face Graphormer architecture for task {task!r}.")
    if backbone.layer_norm_epsilon != HF_LAYER_NORM_EPSILON:
        raise ValueError(
            f"transformers' Graphormer uses LayerNorm epsilon {HF_LAYER_NORM_EPSILON}; got "
            f"layer_norm_epsilon={backbone.layer_norm_epsilon}, which it cannot represent."
        )
    if backbone.activation not in _ACTIVATIONS_TO_HF:
        raise ValueError(
            f"No transformers activation for activation={backbone.activation!r}; supported: "
            f"{sorted(_ACTIVATIONS_TO_HF)}."
        )
    architecture = "GraphormerForGraphClassification" if task else "GraphormerModel"
    hf_config = {
        "model_type": "graphormer",
        "architectures": [architecture],
        "num_classes": model.num_classes if task else 1,
        "num_atoms": backbone.num_atoms,
        "num_edges": backbone.num_edges,
        "num_in_degree": backbone.num_in_degree,
        "num_out_degree": backbone.num_out_degree,
        "num_spatial": backbone.num_spatial,
        "num_edge_dis": backbone.num_edge_dis,
        "multi_hop_max_dist": backbone.multi_hop_max_dist,
        "edge_type": backbone.edge_type,
        "num_hidden_layers": backbone.num_layers,
        "embedding_dim": backbone.hidden_dim,
        "hidden_size": backbone.hidden_dim,
        "ffn_embedding_dim": backbone.intermediate_dim,
        "num_attention_heads": backbone.num_heads,
        "dropout": backbone.dropout,
        "attention_dropout": backbone.attention_dropout,
        "activation_dropout": backbone.activation_dropout,
        "layerdrop": backbone.layerdrop,
        "encoder_normalize_before": backbone.encoder_normalize_before,
        "pre_layernorm": backbone.pre_layernorm,
        "apply_graphormer_init": backbone.apply_graphormer_init,
        "activation_fn": _ACTIVATIONS_TO_HF[backbone.activation],
        "embed_scale": backbone.embed_scale,
        "freeze_embeddings": False,
        "num_trans_layers_to_freeze": backbone.num_frozen_layers,
        "share_input_output_embed": False,
        "traceable": False,
        "q_noise": 0.0,
        "qn_block_size": 8,
        "kdim": None,
        "vdim": None,
        "bias": backbone.use_attention_bias,
        "self_attention": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    prefix = "encoder." if task else ""
    state = {}
    for name, variable, how in _pairs(model, prefix):
        value = np.array(keras.ops.convert_to_numpy(variable), dtype=np.float32)
        if how == "transpose":
            value = value.T
        elif how == "edge_dis":
            value = value.reshape(-1, 1)
        elif how == "padding":
            value[0] = 0.0  # kzoo looks id 0 up as a zero vector
        state[name] = np.ascontiguousarray(value)
    if backbone.pre_layernorm:
        enc = prefix + "graph_encoder.final_layer_norm."
        state[enc + "weight"] = np.ones((backbone.hidden_dim,), np.float32)
        state[enc + "bias"] = np.zeros((backbone.hidden_dim,), np.float32)
    return hf_config, state
