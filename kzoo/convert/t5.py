"""Hugging Face T5 checkpoints (`T5ForConditionalGeneration`, `T5Model`) <-> kzoo T5.

Weight layout (Hugging Face -> kzoo; Linear weights `(out, in)` are transposed to Keras
kernels `(in, out)`):

- `shared.weight` -> `token_embedding.embeddings` (the encoder's and decoder's
  `embed_tokens.weight` are tied copies: ignored on load, not written on export);
- `{encoder,decoder}.block.0.layer.0.SelfAttention.relative_attention_bias.weight` ->
  `{encoder,decoder}_relative_attention_bias.embeddings` (same `(buckets, heads)` layout);
- `{stack}.block.N.layer.0.SelfAttention.{q,k,v,o}.weight` -> the block's self-attention
  `{query,key,value,output}_dense.kernel`, `layer.0.layer_norm.weight` ->
  `self_attention_norm.scale`;
- decoder `layer.1.EncDecAttention.*` / `layer.1.layer_norm` -> cross-attention;
- feed-forward `layer.{1,2}.DenseReluDense.{wi | wi_0, wi_1, wo}.weight` ->
  `feedforward.{intermediate_dense | gate_dense, up_dense, output_dense}.kernel` and its
  `layer_norm.weight` -> `feedforward_norm.scale`;
- `{stack}.final_layer_norm.weight` -> `{stack}_output_norm.scale`;
- `lm_head.weight` -> `T5Seq2SeqLM.lm_head.kernel` (untied, v1.1; a tied checkpoint's copy of
  `shared.weight` is ignored).

Checkpoints saved by transformers 5 have `tie_word_embeddings=true` whatever the version and
a `scale_decoder_outputs` field, which then decides kzoo's `tie_embeddings` (the decoder
output scaled by `d_model ** -0.5`); an unscaled model without `lm_head.weight` uses
`shared.weight` as its head, as transformers 5 does.

Example:
>>> model = kzoo.presets.load("/path/to/t5-small")           # a save_pretrained directory
>>> kzoo.presets.save(model, "/tmp/t5_out", format="hf")
"""

import keras
import numpy as np

from kzoo import registry
from kzoo.convert import assign, hf_token_ids
from kzoo.models.t5 import T5Config

FAMILY = "t5"
MODEL_TYPES = registry.family(FAMILY).model_types

ARCHITECTURES = {
    "T5ForConditionalGeneration": "seq2seq_lm",
    "T5Model": "backbone",
}

IGNORED_WEIGHTS = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    # Old checkpoints carried an unused bias table in the first cross-attention.
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)

# (is_gated_act, dense_act_fn) of Hugging Face's T5Config -> kzoo `feedforward`.
_FEEDFORWARD_FROM_HF = {
    (False, "relu"): "relu",
    (False, "gelu"): "gelu",
    (False, "gelu_python"): "gelu",
    (False, "gelu_new"): "gelu_new",
    # (transformers' other names of the tanh GELU: the same formula, "gelu_fast" with its
    # factors grouped otherwise, within float32 rounding)
    (False, "gelu_pytorch_tanh"): "gelu_new",
    (False, "gelu_fast"): "gelu_new",
    (False, "silu"): "silu",
    (False, "swish"): "silu",
    (True, "relu"): "gated-relu",
    (True, "gelu_new"): "gated-gelu",
    (True, "gelu_pytorch_tanh"): "gated-gelu",
    (True, "gelu_fast"): "gated-gelu",
    (True, "silu"): "gated-silu",
    (True, "swish"): "gated-silu",
}

# kzoo `feedforward` -> Hugging Face `feed_forward_proj` (which T5Config turns back into
# the same `(is_gated_act, dense_act_fn)`; "gated-gelu" becomes "gelu_new" there).
_FEEDFORWARD_TO_HF = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "silu": "silu",
    "gated-relu": "gated-relu",
    "gated-gelu": "gated-gelu",
    "gated-gelu_new": "gated-gelu",
    "gated-silu": "gated-silu",
}


def _feedforward(hf):
    proj = hf.get("feed_forward_proj", "relu")
    parts = str(proj).split("-")
    if (len(parts) > 1 and parts[0] != "gated") or len(parts) > 2:
        raise ValueError(
            f"Unsupported T5 feed_forward_proj={proj!r}: expected 'ACT' or 'gated-ACT'."
        )
    gated = hf.get("is_gated_act", parts[0] == "gated")
    act = hf.get("dense_act_fn", "gelu_new" if proj == "gated-gelu" else parts[-1])
    key = (bool(gated), act)
    if key not in _FEEDFORWARD_FROM_HF:
        supported = sorted(f"{'gated-' if g else ''}{a}" for g, a in _FEEDFORWARD_FROM_HF)
        raise ValueError(
            f"Unsupported T5 feed-forward: feed_forward_proj={proj!r} with "
            f"is_gated_act={gated!r} and dense_act_fn={act!r}. Supported (gating-activation): "
            f"{supported} (a gated GELU only in its tanh form: gelu_new, gelu_pytorch_tanh, "
            "gelu_fast)."
        )
    return _FEEDFORWARD_FROM_HF[key]


# kzoo field -> its config.json key (named in the errors of `T5Config`).
_HF_NAMES = {
    "vocabulary_size": "vocab_size",
    "num_layers": "num_layers",
    "num_decoder_layers": "num_decoder_layers",
    "num_heads": "num_heads",
    "hidden_dim": "d_model",
    "key_value_dim": "d_kv",
    "intermediate_dim": "d_ff",
    "dropout": "dropout_rate",
    "layer_norm_epsilon": "layer_norm_epsilon",
    "feedforward": "feed_forward_proj",
    "relative_attention_num_buckets": "relative_attention_num_buckets",
    "relative_attention_max_distance": "relative_attention_max_distance",
    "tie_embeddings": "tie_word_embeddings",
}


def config_from_hf(hf, source="config.json"):
    """(family, backbone config, task, task config) of a Hugging Face T5 `config.json`.

    The kzoo fields are checked by `T5Config`: a bad value raises a `ValueError` naming the
    kzoo field, the config.json key and `source` (the file it came from).
    """
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"config_from_hf for T5 needs model_type in {list(MODEL_TYPES)}; got "
            f"model_type={hf.get('model_type')!r}."
        )
    architectures = hf.get("architectures") or ["T5ForConditionalGeneration"]
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported T5 architectures={architectures!r}; supported: "
            f"{sorted(ARCHITECTURES)}."
        )
    if hf.get("is_encoder_decoder", True) is not True:
        raise ValueError(
            "T5 checkpoints must be encoder-decoder; got "
            f"is_encoder_decoder={hf.get('is_encoder_decoder')!r}."
        )
    if hf.get("tie_encoder_decoder", False):
        raise ValueError(
            "Unsupported tie_encoder_decoder=True (encoder and decoder sharing weights)."
        )
    if hf.get("pruned_heads"):
        # (was loaded as if no head were pruned)
        raise ValueError(
            f"Unsupported pruned_heads={hf['pruned_heads']!r}: kzoo's T5 attention has "
            "num_heads heads in every layer."
        )
    num_layers = hf.get("num_layers", 6)
    num_decoder_layers = hf.get("num_decoder_layers")
    config = {
        "vocabulary_size": hf.get("vocab_size", 32128),
        "num_layers": num_layers,
        "num_decoder_layers": num_layers if num_decoder_layers is None else num_decoder_layers,
        "num_heads": hf.get("num_heads", 8),
        "hidden_dim": hf.get("d_model", 512),
        "key_value_dim": hf.get("d_kv", 64),
        "intermediate_dim": hf.get("d_ff", 2048),
        "dropout": hf.get("dropout_rate", 0.1),
        "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-6),
        "feedforward": _feedforward(hf),
        "relative_attention_num_buckets": hf.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": hf.get("relative_attention_max_distance", 128),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
    }
    names = _HF_NAMES if num_decoder_layers is not None else {
        **_HF_NAMES, "num_decoder_layers": "num_layers"}
    if hf.get("scale_decoder_outputs") is not None:
        # transformers 5 writes tie_word_embeddings=true for every T5 (v1.1 and flan-T5
        # too) and says with `scale_decoder_outputs` alone whether the decoder output is
        # scaled by d_model ** -0.5 (what kzoo's tie_embeddings does): read from
        # tie_word_embeddings, a v1.1 checkpoint it saved was scaled as v1.0, in silence.
        config["tie_embeddings"] = hf["scale_decoder_outputs"]
        names = {**names, "tie_embeddings": "scale_decoder_outputs"}
    checked = T5Config.from_dict(config, source=source, names=names)
    config = {key: getattr(checked, key) for key in config}
    task = ARCHITECTURES[architecture]
    task_config = {}
    if task == "seq2seq_lm":  # `generate`'s defaults (transformers': these fields)
        pad = hf.get("pad_token_id")
        pad = 0 if pad is None else pad
        start = hf.get("decoder_start_token_id")
        task_config = {
            "stop_token_ids": hf_token_ids(hf.get("eos_token_id", 1),
                                           config["vocabulary_size"]),
            "decoder_start_token_id": pad if start is None else start,
            "pad_token_id": pad,
        }
    return FAMILY, config, task, task_config


# === Name mapping ===


def _backbone_of(model):
    return model.backbone if getattr(model, "task_name", None) else model


def _pairs(model):
    """(Hugging Face name, Keras variable, transpose) for every weight of `model`."""
    backbone = _backbone_of(model)
    pairs = [
        ("shared.weight", backbone.token_embedding.embeddings, False),
        (
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            backbone.encoder_relative_attention_bias.embeddings,
            False,
        ),
        (
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            backbone.decoder_relative_attention_bias.embeddings,
            False,
        ),
        ("encoder.final_layer_norm.weight", backbone.encoder_output_norm.scale, False),
        ("decoder.final_layer_norm.weight", backbone.decoder_output_norm.scale, False),
    ]

    def attention(prefix, layer):
        for hf_name, dense in (("q", layer.query_dense), ("k", layer.key_dense),
                               ("v", layer.value_dense), ("o", layer.output_dense)):
            pairs.append((f"{prefix}.{hf_name}.weight", dense.kernel, True))

    def feedforward(prefix, block):
        ffn = block.feedforward_layer
        if block.feedforward == "gated":
            pairs.append((f"{prefix}.DenseReluDense.wi_0.weight", ffn.gate_dense.kernel, True))
            pairs.append((f"{prefix}.DenseReluDense.wi_1.weight", ffn.up_dense.kernel, True))
        else:
            pairs.append((f"{prefix}.DenseReluDense.wi.weight",
                          ffn.intermediate_dense.kernel, True))
        pairs.append((f"{prefix}.DenseReluDense.wo.weight", ffn.output_dense.kernel, True))
        pairs.append((f"{prefix}.layer_norm.weight", block.feedforward_norm.scale, False))

    for i, block in enumerate(backbone.encoder_layers):
        prefix = f"encoder.block.{i}.layer"
        attention(f"{prefix}.0.SelfAttention", block.self_attention)
        pairs.append((f"{prefix}.0.layer_norm.weight", block.self_attention_norm.scale, False))
        feedforward(f"{prefix}.1", block)
    for i, block in enumerate(backbone.decoder_layers):
        prefix = f"decoder.block.{i}.layer"
        attention(f"{prefix}.0.SelfAttention", block.self_attention)
        pairs.append((f"{prefix}.0.layer_norm.weight", block.self_attention_norm.scale, False))
        attention(f"{prefix}.1.EncDecAttention", block.cross_attention_layer)
        pairs.append((f"{prefix}.1.layer_norm.weight", block.cross_attention_norm.scale, False))
        feedforward(f"{prefix}.2", block)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        pairs.append(("lm_head.weight", lm_head.kernel, True))
    return pairs


def load_weights(model, weights):
    """Assign every weight of a T5 checkpoint (a `WeightReader`) to a kzoo T5 model."""
    for name, variable, transpose in _pairs(model):
        if name == "lm_head.weight" and not weights.has(name) and weights.has("shared.weight"):
            # An unscaled head stored as `shared.weight` alone: transformers 5 ties T5's head
            # to the embedding whenever the checkpoint has no other (scale_decoder_outputs
            # false, the embedding's table as the head).
            name = "shared.weight"
        assign(variable, weights.take(name, transpose=transpose), name)
    if getattr(model, "lm_head", None) is None and weights.has("lm_head.weight"):
        # A tied checkpoint may carry the output projection as a copy of `shared.weight`.
        weights.take("lm_head.weight")


def to_hf(model):
    """(Hugging Face config dict, state dict of NumPy arrays) for a kzoo T5 model."""
    backbone = _backbone_of(model)
    task = getattr(model, "task_name", None)
    if task not in (None, "seq2seq_lm"):
        raise ValueError(f"No Hugging Face T5 architecture for task {task!r}.")
    architecture = "T5ForConditionalGeneration" if task == "seq2seq_lm" else "T5Model"
    hf_config = {
        "model_type": "t5",
        "architectures": [architecture],
        "vocab_size": backbone.vocabulary_size,
        "d_model": backbone.hidden_dim,
        "d_kv": backbone.key_value_dim,
        "d_ff": backbone.intermediate_dim,
        "num_layers": backbone.num_layers,
        "num_decoder_layers": len(backbone.decoder_layers),
        "num_heads": backbone.num_heads,
        "relative_attention_num_buckets": backbone.relative_attention_num_buckets,
        "relative_attention_max_distance": backbone.relative_attention_max_distance,
        "dropout_rate": backbone.dropout,
        "layer_norm_epsilon": backbone.layer_norm_epsilon,
        "initializer_factor": 1.0,
        "feed_forward_proj": _FEEDFORWARD_TO_HF[backbone.feedforward],
        "tie_word_embeddings": backbone.tie_embeddings,
        "is_encoder_decoder": True,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }
    if task == "seq2seq_lm":  # `generate`'s defaults, as transformers reads them
        stops = model.stop_token_ids
        hf_config.update(
            pad_token_id=model.pad_token_id,
            decoder_start_token_id=model.decoder_start_token_id,
            eos_token_id=None if not stops else stops[0] if len(stops) == 1 else list(stops))
    state = {}
    for name, variable, transpose in _pairs(model):
        value = np.asarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)
        state[name] = np.ascontiguousarray(value.T if transpose else value)
    return hf_config, state
