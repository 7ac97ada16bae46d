"""Hugging Face GPT-2 checkpoints <-> kzoo `GPTBackbone` / `GPTCausalLM`.

Reads `model_type="gpt2"` directories (`GPT2LMHeadModel` -> `causal_lm`, `GPT2Model` ->
`backbone`), with or without the `transformer.` prefix (the original OpenAI checkpoints on the
Hub have none). GPT-2's projections are `Conv1D` layers whose weights are already laid out
`(in, out)` like a Keras `Dense` kernel, so nothing is transposed; the fused `c_attn`
projection `(hidden, 3 * hidden)` is split into the query, key and value kernels (in that
order). `to_hf` writes the reverse.

Every field of `GPT2Config` that changes the computation is honoured or rejected:
`n_embd`, `n_layer`, `n_head`, `n_inner` (None -> 4 * n_embd), `n_positions`,
`activation_function`, `layer_norm_epsilon`, `tie_word_embeddings`, `scale_attn_weights`
(False -> attention scale 1.0) are honoured; `scale_attn_by_inverse_layer_idx`,
`reorder_and_upcast_attn` and `add_cross_attention` raise `ValueError`.

Example:
>>> lm = kzoo.presets.load("/path/to/gpt2")             # a save_pretrained directory
>>> kzoo.presets.save(lm, "/tmp/gpt2_again", format="hf")
"""

import warnings

import keras
import numpy as np

from kzoo.convert import assign

FAMILY = "gpt"
MODEL_TYPES = ("gpt2",)
# Causal-mask buffers that older checkpoints saved along with the weights.
IGNORED_WEIGHTS = (".attn.bias", ".attn.masked_bias")

ARCHITECTURES = {"GPT2LMHeadModel": "causal_lm", "GPT2Model": "backbone"}

# Hugging Face `activation_function` -> kzoo activation name. "gelu_fast" is the same tanh
# approximation written with the constant 0.7978845608 for sqrt(2 / pi) (equal in float32).
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "quick_gelu": "quick_gelu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}
# kzoo activation -> the name written to config.json.
_HF_ACTIVATIONS = {
    "gelu_tanh": "gelu_new",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "quick_gelu": "quick_gelu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}

# GPT2Config defaults (a config.json may leave out fields equal to them).
_DEFAULTS = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    embd_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    initializer_range=0.02,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)


def config_from_hf(hf_config):
    """`(family, backbone_config, task, task_config)` for a GPT-2 `config.json` dict.

    Example:
    >>> config_from_hf({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2})
    """
    cfg = {**_DEFAULTS, **hf_config}
    if hf_config.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"`model_type` must be one of {list(MODEL_TYPES)} for the GPT converter; got "
            f"model_type={hf_config.get('model_type')!r}."
        )
    architectures = hf_config.get("architectures") or ["GPT2LMHeadModel"]
    arch = architectures[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported GPT-2 architecture {arch!r} (config field `architectures`); kzoo "
            f"reads {sorted(ARCHITECTURES)}. Load it with task='backbone' after editing "
            "`architectures`, or convert the head yourself."
        )
    for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                  "add_cross_attention"):
        if cfg[field]:
            raise ValueError(
                f"GPT-2 config field `{field}`={cfg[field]!r} is not supported by kzoo "
                f"(only {field}=False)."
            )
    act = cfg["activation_function"]
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"GPT-2 config field `activation_function`={act!r} is not supported; kzoo reads "
            f"{sorted(_ACTIVATIONS)}."
        )
    if cfg["n_embd"] % cfg["n_head"]:
        raise ValueError(
            f"GPT-2 config: `n_head`={cfg['n_head']} must divide `n_embd`={cfg['n_embd']}."
        )
    if cfg.get("n_ctx") is not None and cfg["n_ctx"] != cfg["n_positions"]:
        warnings.warn(
            f"GPT-2 config: n_ctx={cfg['n_ctx']} differs from n_positions="
            f"{cfg['n_positions']}; n_positions (the position table size) is used.",
            stacklevel=2,
        )
    if not (cfg["embd_pdrop"] == cfg["resid_pdrop"] == cfg["attn_pdrop"]):
        warnings.warn(
            "GPT-2 config: kzoo uses one dropout rate for embeddings, residuals and "
            f"attention; using resid_pdrop={cfg['resid_pdrop']} (embd_pdrop="
            f"{cfg['embd_pdrop']}, attn_pdrop={cfg['attn_pdrop']}). Inference is unaffected.",
            stacklevel=2,
        )
    config = dict(
        vocabulary_size=int(cfg["vocab_size"]),
        num_layers=int(cfg["n_layer"]),
        num_heads=int(cfg["n_head"]),
        hidden_dim=int(cfg["n_embd"]),
        intermediate_dim=int(cfg["n_inner"] or 4 * cfg["n_embd"]),
        max_sequence_length=int(cfg["n_positions"]),
        dropout=float(cfg["resid_pdrop"]),
        layer_norm_epsilon=float(cfg["layer_norm_epsilon"]),
        activation=_ACTIVATIONS[act],
        norm="layernorm",
        position="learned",
        feedforward="plain",
        use_bias=True,
        tie_embeddings=bool(cfg["tie_word_embeddings"]),
        attention_scale=None if cfg["scale_attn_weights"] else 1.0,
        initializer_range=float(cfg["initializer_range"]),
    )
    return FAMILY, config, ARCHITECTURES[arch], {}


def _parts(model):
    task = getattr(model, "task_name", None)
    backbone = model.backbone if task else model
    return backbone, task


def load_weights(model, weights):
    """Copy a GPT-2 checkpoint (a `kzoo.convert.WeightReader`) into a kzoo GPT model.

    Example:
    >>> load_weights(model, WeightReader(read_hf_state("/path/to/gpt2")))
    """
    backbone, task = _parts(model)
    if backbone.position != "learned" or backbone.norm != "layernorm" or (
        backbone.feedforward != "plain"
    ):
        raise ValueError(
            "GPT-2 checkpoints need a GPT-2 configuration (position='learned', "
            f"norm='layernorm', feedforward='plain'); got position={backbone.position!r}, "
            f"norm={backbone.norm!r}, feedforward={backbone.feedforward!r}."
        )
    prefix = "transformer." if weights.has("transformer.wte.weight") else ""
    d = backbone.hidden_dim

    def put(variable, name, value=None):
        assign(variable, weights.take(name) if value is None else value, name)

    put(backbone.token_embedding.embeddings, prefix + "wte.weight")
    put(backbone.position_embedding.embeddings, prefix + "wpe.weight")
    for i, block in enumerate(backbone.transformer_layers):
        p = f"{prefix}h.{i}."
        attn = block.self_attention
        put(block.self_attention_norm.gamma, p + "ln_1.weight")
        put(block.self_attention_norm.beta, p + "ln_1.bias")
        w = weights.take(p + "attn.c_attn.weight")
        b = weights.take(p + "attn.c_attn.bias")
        if w is not None and w.shape != (d, 3 * d):
            raise ValueError(
                f"Shape mismatch for {p + 'attn.c_attn.weight'!r}: checkpoint has "
                f"{tuple(w.shape)}, the model needs {(d, 3 * d)}."
            )
        if b is not None and b.shape != (3 * d,):
            raise ValueError(
                f"Shape mismatch for {p + 'attn.c_attn.bias'!r}: checkpoint has "
                f"{tuple(b.shape)}, the model needs {(3 * d,)}."
            )
        for j, dense in enumerate((attn.query_dense, attn.key_dense, attn.value_dense)):
            if w is not None:
                assign(dense.kernel, w[:, j * d:(j + 1) * d], p + "attn.c_attn.weight")
            if b is not None:
                assign(dense.bias, b[j * d:(j + 1) * d], p + "attn.c_attn.bias")
        put(attn.output_dense.kernel, p + "attn.c_proj.weight")
        put(attn.output_dense.bias, p + "attn.c_proj.bias")
        put(block.feedforward_norm.gamma, p + "ln_2.weight")
        put(block.feedforward_norm.beta, p + "ln_2.bias")
        ff = block.feedforward_layer
        put(ff.intermediate_dense.kernel, p + "mlp.c_fc.weight")
        put(ff.intermediate_dense.bias, p + "mlp.c_fc.bias")
        put(ff.output_dense.kernel, p + "mlp.c_proj.weight")
        put(ff.output_dense.bias, p + "mlp.c_proj.bias")
    put(backbone.final_norm.gamma, prefix + "ln_f.weight")
    put(backbone.final_norm.beta, prefix + "ln_f.bias")

    if backbone.tie_embeddings:
        if weights.has("lm_head.weight"):
            head = weights.take("lm_head.weight")
            wte = weights.state.get(prefix + "wte.weight")
            if wte is not None and not np.array_equal(np.asarray(wte, head.dtype), head):
                raise ValueError(
                    "The checkpoint's `lm_head.weight` differs from `wte.weight` but the "
                    "model ties them (tie_word_embeddings=True); load with "
                    "tie_embeddings=False."
                )
    elif task is not None or weights.has("lm_head.weight"):
        head = weights.take("lm_head.weight")
        if head is not None:
            assign(backbone.token_embedding.reverse_embeddings, head.T, "lm_head.weight")


def to_hf(model):
    """`(config.json dict, {name: array})` of a GPT-2-configured kzoo model for transformers.

    Example:
    >>> hf_config, state = to_hf(kzoo.presets.load("gpt_mini"))
    """
    backbone, task = _parts(model)
    problems = []
    if backbone.position != "learned":
        problems.append(f"position={backbone.position!r} (GPT-2: 'learned')")
    if backbone.norm != "layernorm":
        problems.append(f"norm={backbone.norm!r} (GPT-2: 'layernorm')")
    if backbone.feedforward != "plain":
        problems.append(f"feedforward={backbone.feedforward!r} (GPT-2: 'plain')")
    if backbone.num_kv_heads not in (None, backbone.num_heads):
        problems.append(f"num_kv_heads={backbone.num_kv_heads} (GPT-2: num_heads)")
    if not backbone.use_bias:
        problems.append("use_bias=False (GPT-2: True)")
    if backbone.activation not in _HF_ACTIVATIONS:
        problems.append(f"activation={backbone.activation!r}")
    if backbone.attention_scale not in (None, 1.0):
        problems.append(f"attention_scale={backbone.attention_scale} (GPT-2: None or 1.0)")
    if problems:
        raise ValueError(
            "Only GPT-2-configured models can be written as Hugging Face GPT-2 checkpoints; "
            "this model has " + ", ".join(problems) + "."
        )
    hf_config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel" if task == "causal_lm" else "GPT2Model"],
        "vocab_size": backbone.vocabulary_size,
        "n_positions": backbone.max_sequence_length,
        "n_embd": backbone.hidden_dim,
        "n_layer": backbone.num_layers,
        "n_head": backbone.num_heads,
        "n_inner": backbone.intermediate_dim,
        "activation_function": _HF_ACTIVATIONS[backbone.activation],
        "resid_pdrop": backbone.dropout,
        "embd_pdrop": backbone.dropout,
        "attn_pdrop": backbone.dropout,
        "layer_norm_epsilon": backbone.layer_norm_epsilon,
        "initializer_range": backbone.initializer_range,
        "scale_attn_weights": backbone.attention_scale is None,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": backbone.tie_embeddings,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if backbone.vocabulary_size == 50257:
        hf_config.update(bos_token_id=50256, eos_token_id=50256)

    def val(variable):
        return np.asarray(keras.ops.convert_to_numpy(variable.value), dtype=np.float32)

    prefix = "transformer." if task is not None else ""
    state = {
        prefix + "wte.weight": val(backbone.token_embedding.embeddings),
        prefix + "wpe.weight": val(backbone.position_embedding.embeddings),
        prefix + "ln_f.weight": val(backbone.final_norm.gamma),
        prefix + "ln_f.bias": val(backbone.final_norm.beta),
    }
    for i, block in enumerate(backbone.transformer_layers):
        p = f"{prefix}h.{i}."
        attn = block.self_attention
        ff = block.feedforward_layer
        state[p + "ln_1.weight"] = val(block.self_attention_norm.gamma)
        state[p + "ln_1.bias"] = val(block.self_attention_norm.beta)
        state[p + "attn.c_attn.weight"] = np.concatenate(
            [val(attn.query_dense.kernel), val(attn.key_dense.kernel),
             val(attn.value_dense.kernel)], axis=1)
        state[p + "attn.c_attn.bias"] = np.concatenate(
            [val(attn.query_dense.bias), val(attn.key_dense.bias), val(attn.value_dense.bias)])
        state[p + "attn.c_proj.weight"] = val(attn.output_dense.kernel)
        state[p + "attn.c_proj.bias"] = val(attn.output_dense.bias)
        state[p + "ln_2.weight"] = val(block.feedforward_norm.gamma)
        state[p + "ln_2.bias"] = val(block.feedforward_norm.beta)
        state[p + "mlp.c_fc.weight"] = val(ff.intermediate_dense.kernel)
        state[p + "mlp.c_fc.bias"] = val(ff.intermediate_dense.bias)
        state[p + "mlp.c_proj.weight"] = val(ff.output_dense.kernel)
        state[p + "mlp.c_proj.bias"] = val(ff.output_dense.bias)
    if task is not None and not backbone.tie_embeddings:
        state["lm_head.weight"] = np.ascontiguousarray(
            val(backbone.token_embedding.reverse_embeddings).T
        )
    return hf_config, state


__all__ = ["FAMILY", "MODEL_TYPES", "IGNORED_WEIGHTS", "config_from_hf", "load_weights",
           "to_hf"]
