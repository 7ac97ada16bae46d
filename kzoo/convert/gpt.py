"""Hugging Face GPT-2 (and LLaMA / Mixtral) checkpoints <-> kzoo `GPTBackbone` / `GPTCausalLM`.

Reads `model_type="gpt2"` directories (`GPT2LMHeadModel` -> `causal_lm`, `GPT2Model` ->
`backbone`), with or without the `transformer.` prefix (the original OpenAI checkpoints on the
Hub have none). GPT-2's projections are `Conv1D` layers whose weights are already laid out
`(in, out)` like a Keras `Dense` kernel, so nothing is transposed; the fused `c_attn`
projection `(hidden, 3 * hidden)` is split into the query, key and value kernels (in that
order). `to_hf` writes the reverse.

Every field of `GPT2Config` that changes the computation is honoured or rejected:
`n_embd`, `n_layer`, `n_head`, `n_inner` (None -> 4 * n_embd), `n_positions`,
`activation_function`, `layer_norm_epsilon`, `tie_word_embeddings`, `scale_attn_weights`
(False -> attention scale 1.0), `scale_attn_by_inverse_layer_idx` (layer i's scores divided
by i + 1 as well: kzoo's `attention_scale_by_inverse_layer`, written back by `to_hf`) are
honoured; `reorder_and_upcast_attn` is accepted and changes nothing in kzoo: transformers
then multiplies q and k in float32 (the scale applied to that product) before its float32
softmax, which in float32 is the attention it computes without the flag. kzoo's softmax
is float32 under every dtype policy too, but under a float16 / bfloat16 policy its q k^T
product is in that dtype (then cast to float32 and scaled), so half-precision scores round
differently and float16 ones above 65504 overflow where transformers' would not (`to_hf`
writes the flag False). `add_cross_attention` and a non-empty `pruned_heads` raise
`ValueError`.

The modern configurations of the same backbone are LLaMA and Mixtral: `model_type="llama"`
(`LlamaForCausalLM` / `LlamaModel`: RMSNorm, rotary "rotate-half" positions, SwiGLU, grouped-
query attention) and `model_type="mixtral"` (`MixtralForCausalLM` / `MixtralModel`: the same
with a top-k sparse mixture of SwiGLU experts). `config_from_hf` / `load_weights` read them and
`to_hf` writes a kzoo model of such a configuration as a LLaMA or Mixtral checkpoint. Their
projections are `nn.Linear` weights `(out, in)`, transposed to Keras kernels. Honoured:
`hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
`num_key_value_heads`, `hidden_act`, `max_position_embeddings`, `rms_norm_eps`, `rope_theta`
(or transformers 5's `rope_parameters`, which holds it and the `rope_scaling` settings),
`attention_bias` / `mlp_bias` (equal; LLaMA only: Mistral and Mixtral have no biases and
ignore them, as transformers does), `tie_word_embeddings`, `num_local_experts`,
`num_experts_per_tok`, `sliding_window` (Mistral and Mixtral, whatever its size: rotary models
run on sequences longer than `max_position_embeddings`, where a window that long still
bites; LLaMA's attention ignores the field, and so does kzoo), `head_dim` (heads of any
size: the query projection `num_attention_heads * head_dim`, Mistral-Nemo style; kzoo's
`head_dim` field), `rope_scaling` (its type under "rope_type" or the older "type") of type
"default" (no scaling), "linear" (`factor`: kzoo's `rope_scaling_type="linear"`),
"llama3" (Llama 3.1 / 3.2: `factor`, `low_freq_factor`, `high_freq_factor`,
`original_max_position_embeddings`, each required) and "yarn" (`factor` required;
`original_max_position_embeddings`, `beta_fast`, `beta_slow`, `attention_factor` or
DeepSeek's `mscale` / `mscale_all_dim`, and `truncate` read with transformers' defaults);
warned about (training only): `attention_dropout` > 0 (kzoo's one `dropout` also drops
embeddings and sub-layer outputs), Mixtral's `router_jitter_noise` > 0 (not implemented);
rejected: any other `rope_scaling` type ("dynamic", "longrope", ...: named in the error;
"dynamic" changes the frequencies with the length of each call, which a compiled decode
loop of fixed shapes does not see), a `partial_rotary_factor` other than
1, `attention_bias != mlp_bias`. `to_hf` writes `head_dim` (always) and `rope_scaling` back.

Example:
>>> lm = kzoo.presets.load("/path/to/gpt2")             # a save_pretrained directory
>>> kzoo.presets.save(lm, "/tmp/gpt2_again", format="hf")
>>> modern = kzoo.presets.load("gpt_modern_mini")
>>> kzoo.presets.save(modern, "/tmp/llama", format="hf")  # transformers' LlamaForCausalLM
"""

import warnings

import keras
import numpy as np

from kzoo import registry
from kzoo.convert import assign, hf_token_ids
from kzoo.layers.position import yarn_attention_factor, yarn_settings
from kzoo.models.gpt import GPTConfig

FAMILY = "gpt"
MODEL_TYPES = registry.family(FAMILY).model_types
# Buffers that older checkpoints saved along with the weights (GPT-2's causal mask, LLaMA's
# rotary frequencies).
IGNORED_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

ARCHITECTURES = {"GPT2LMHeadModel": "causal_lm", "GPT2Model": "backbone"}
MODERN_ARCHITECTURES = {
    "llama": {"LlamaForCausalLM": "causal_lm", "LlamaModel": "backbone"},
    "mixtral": {"MixtralForCausalLM": "causal_lm", "MixtralModel": "backbone"},
    "mistral": {"MistralForCausalLM": "causal_lm", "MistralModel": "backbone"},
}

# Hugging Face `activation_function` -> kzoo activation name. "gelu_fast" is the same tanh
# approximation written with the constant 0.7978845608 for sqrt(2 / pi) (equal in float32).
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",  # (the same formula, written in Python)
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",  # (transformers' AccurateGELU: the same formula)
    "gelu": "gelu",
    "gelu_python": "gelu",
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


# kzoo field -> its GPT-2 config.json key (named in the errors of `GPTConfig`).
_HF_NAMES = dict(
    vocabulary_size="vocab_size", num_layers="n_layer", num_heads="n_head",
    hidden_dim="n_embd", intermediate_dim="n_inner", max_sequence_length="n_positions",
    dropout="resid_pdrop", layer_norm_epsilon="layer_norm_epsilon",
    activation="activation_function", tie_embeddings="tie_word_embeddings",
    initializer_range="initializer_range",
    attention_scale_by_inverse_layer="scale_attn_by_inverse_layer_idx",
)


def _times(factor, value):
    """`factor * value` for a number, else `value` itself (left for `GPTConfig` to reject)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return factor * value if is_number else value


def _validated(config, source, names):
    """`config` checked by `GPTConfig` (errors name the config.json key and `source`),
    with each value as `GPTConfig` normalises it."""
    checked = GPTConfig.from_dict(config, source=source, names=names)
    return {key: getattr(checked, key) for key in config}


def config_from_hf(hf_config, source="config.json"):
    """`(family, backbone_config, task, task_config)` for a GPT-2 `config.json` dict.

    The kzoo fields are checked by `GPTConfig`: a bad value raises a `ValueError` naming
    the kzoo field, the config.json key and `source` (the file it came from).

    Example:
    >>> config_from_hf({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2})
    """
    if hf_config.get("model_type") in MODERN_ARCHITECTURES:
        return _modern_config_from_hf(hf_config, source)
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
    if cfg["add_cross_attention"]:
        raise ValueError(
            f"GPT-2 config field `add_cross_attention`={cfg['add_cross_attention']!r} is not "
            "supported by kzoo (only add_cross_attention=False)."
        )
    if cfg.get("pruned_heads"):
        # (transformers prunes them on load, shrinking `c_attn` and `c_proj`: kzoo stopped at a
        # shape mismatch that did not name the field)
        raise ValueError(
            f"GPT-2 config field `pruned_heads`={cfg['pruned_heads']!r} is not supported by "
            "kzoo (only pruned_heads={}: every layer has n_head heads)."
        )
    act = cfg["activation_function"]
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"GPT-2 config field `activation_function`={act!r} is not supported; kzoo reads "
            f"{sorted(_ACTIVATIONS)}."
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
        vocabulary_size=cfg["vocab_size"],
        num_layers=cfg["n_layer"],
        num_heads=cfg["n_head"],
        hidden_dim=cfg["n_embd"],
        intermediate_dim=cfg["n_inner"] or _times(4, cfg["n_embd"]),
        max_sequence_length=cfg["n_positions"],
        dropout=cfg["resid_pdrop"],
        layer_norm_epsilon=cfg["layer_norm_epsilon"],
        activation=_ACTIVATIONS[act],
        norm="layernorm",
        position="learned",
        feedforward="plain",
        use_bias=True,
        tie_embeddings=cfg["tie_word_embeddings"],
        attention_scale=None if cfg["scale_attn_weights"] else 1.0,
        attention_scale_by_inverse_layer=cfg["scale_attn_by_inverse_layer_idx"],
        initializer_range=cfg["initializer_range"],
    )
    names = _HF_NAMES if cfg["n_inner"] else {**_HF_NAMES, "intermediate_dim": "n_embd"}
    config = _validated(config, source, names)
    return FAMILY, config, ARCHITECTURES[arch], _task_config(ARCHITECTURES[arch], cfg, config)


# LlamaConfig / MixtralConfig defaults.
_MODERN_DEFAULTS = {
    "llama": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
        max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, head_dim=None,
    ),
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
        max_position_embeddings=4096 * 32, initializer_range=0.02, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_theta=1e6, sliding_window=None,
        attention_dropout=0.0, num_experts_per_tok=2, num_local_experts=8,
        router_jitter_noise=0.0, rope_scaling=None,
    ),
    "mistral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
        max_position_embeddings=4096 * 32, initializer_range=0.02, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, sliding_window=4096,
        attention_dropout=0.0, rope_scaling=None,
    ),
}


# kzoo field -> its LLaMA / Mixtral config.json key.
_MODERN_HF_NAMES = dict(
    vocabulary_size="vocab_size", num_layers="num_hidden_layers",
    num_heads="num_attention_heads", hidden_dim="hidden_size",
    intermediate_dim="intermediate_size", max_sequence_length="max_position_embeddings",
    dropout="attention_dropout", layer_norm_epsilon="rms_norm_eps",
    activation="hidden_act", num_kv_heads="num_key_value_heads",
    rope_max_wavelength="rope_theta", tie_embeddings="tie_word_embeddings",
    initializer_range="initializer_range", num_experts="num_local_experts",
    top_k="num_experts_per_tok", head_dim="head_dim", rope_scaling_type="rope_scaling",
    rope_scaling_factor="rope_scaling", rope_low_freq_factor="rope_scaling",
    rope_high_freq_factor="rope_scaling", rope_original_max_position_embeddings="rope_scaling",
    rope_beta_fast="rope_scaling", rope_beta_slow="rope_scaling",
    rope_attention_factor="rope_scaling", rope_truncate="rope_scaling",
)

# transformers' `rope_scaling` types that kzoo computes: "default" (none), "linear", "llama3"
# and "yarn" (their settings -> GPTConfig fields). The others ("dynamic", "longrope", ...)
# are refused by name.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LLAMA3_KEYS = dict(low_freq_factor="rope_low_freq_factor",
                    high_freq_factor="rope_high_freq_factor",
                    original_max_position_embeddings="rope_original_max_position_embeddings")
_YARN_KEYS = dict(original_max_position_embeddings="rope_original_max_position_embeddings",
                  beta_fast="rope_beta_fast", beta_slow="rope_beta_slow",
                  attention_factor="rope_attention_factor", truncate="rope_truncate")
# transformers' other "yarn" keys: DeepSeek's two `mscale`s, which set the attention factor
# when `attention_factor` is not given.
_YARN_MSCALE_KEYS = ("mscale", "mscale_all_dim")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _rope_scaling_from_hf(model_type, scaling, max_position_embeddings=None):
    """The GPTConfig RoPE scaling fields of a config.json's `rope_scaling` (its type under
    "rope_type" or the older "type"): {} for None / "default", else `rope_scaling_type`,
    `rope_scaling_factor` and for "llama3" its three settings, for "yarn" its settings as
    transformers reads them (`original_max_position_embeddings` falling back to
    `max_position_embeddings`, `beta_fast` / `beta_slow` of 0 or null meaning the defaults,
    the attention factor from `factor` and the `mscale`s when not given). Their values are
    checked by `GPTConfig`, whose errors then name `rope_scaling`."""
    if scaling is None:
        return {}
    field = f"{model_type} config field `rope_scaling`={scaling!r}"
    if not isinstance(scaling, dict):
        raise ValueError(f"{field} must be null or a dict with a \"rope_type\".")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"{field}: rope_type {kind!r} is not supported; kzoo computes rope_type "
            f"{list(_ROPE_TYPES)} (\"dynamic\", \"longrope\" and the others are not "
            "implemented)."
        )
    if kind == "default":
        return {}  # (transformers' name for no scaling: the plain rotary frequencies)
    needed = ["factor"] + (list(_LLAMA3_KEYS) if kind == "llama3" else [])
    missing = [key for key in needed if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{field}: rope_type {kind!r} needs the key(s) {missing}.")
    rope = dict(rope_scaling_type=kind, rope_scaling_factor=scaling["factor"])
    if kind == "llama3":
        rope.update({ours: scaling[key] for key, ours in _LLAMA3_KEYS.items()})
    if kind == "yarn":
        unknown = sorted(set(scaling) - {"rope_type", "type", "factor", *_YARN_KEYS,
                                         *_YARN_MSCALE_KEYS})
        if unknown:
            raise ValueError(f"{field}: unknown \"yarn\" key(s) {unknown}; transformers "
                             f"reads {['factor', *_YARN_KEYS, *_YARN_MSCALE_KEYS]}.")
        rope.update({ours: scaling.get(key) for key, ours in _YARN_KEYS.items()})
        # (transformers: `x or default` for these three)
        rope["rope_original_max_position_embeddings"] = (
            scaling.get("original_max_position_embeddings") or max_position_embeddings)
        rope["rope_beta_fast"] = scaling.get("beta_fast") or None
        rope["rope_beta_slow"] = scaling.get("beta_slow") or None
        factor, mscales = scaling["factor"], [scaling.get(key) for key in _YARN_MSCALE_KEYS]
        if rope["rope_attention_factor"] is None and all(mscales) and isinstance(
                factor, (int, float)) and not isinstance(factor, bool) and factor > 0:
            rope["rope_attention_factor"] = yarn_attention_factor(factor, *mscales)
    return rope


def _rope_scaling_to_hf(backbone):
    """config.json's `rope_scaling` of a GPT configuration (None without scaling)."""
    kind = backbone.rope_scaling_type
    if kind is None:
        return None
    scaling = {"rope_type": kind, "factor": float(backbone.rope_scaling_factor)}
    if kind == "llama3":
        scaling.update(low_freq_factor=float(backbone.rope_low_freq_factor),
                       high_freq_factor=float(backbone.rope_high_freq_factor),
                       original_max_position_embeddings=int(
                           backbone.rope_original_max_position_embeddings))
    if kind == "yarn":  # (every setting written, the defaults filled in)
        beta_fast, beta_slow, attention_factor, truncate = yarn_settings(
            backbone.rope_scaling_factor, backbone.rope_beta_fast, backbone.rope_beta_slow,
            backbone.rope_attention_factor, backbone.rope_truncate)
        scaling.update(original_max_position_embeddings=int(
                           backbone.rope_original_max_position_embeddings),
                       beta_fast=float(beta_fast), beta_slow=float(beta_slow),
                       attention_factor=float(attention_factor), truncate=bool(truncate))
    return scaling


def _from_rope_parameters(model_type, hf_config):
    """transformers 5's `rope_parameters` (one dict: `rope_theta`, the scaling's `rope_type`
    and settings, `partial_rotary_factor`; the config.json it writes has no `rope_theta` or
    `rope_scaling`) as the 4.x keys the rest of the converter reads. Left out, those keys
    would fall back to their defaults: another rotary base and no scaling, in silence."""
    parameters = hf_config["rope_parameters"]
    field = f"{model_type} config field `rope_parameters`={parameters!r}"
    if not isinstance(parameters, dict):
        raise ValueError(f"{field} must be a dict holding \"rope_theta\" and \"rope_type\".")
    scaling = dict(parameters)
    legacy = {key: scaling.pop(key) for key in ("rope_theta", "partial_rotary_factor")
              if key in scaling}
    legacy["rope_scaling"] = scaling or None
    for key, value in legacy.items():
        if hf_config.get(key) is not None and hf_config[key] != value:
            raise ValueError(
                f"{model_type} config: `{key}`={hf_config[key]!r} disagrees with `rope_parameters`"
                f"={parameters!r} (transformers 5 keeps rotary settings in `rope_parameters` "
                f"only); remove one of them.")
    return legacy


def _modern_config_from_hf(hf_config, source):
    model_type = hf_config["model_type"]
    cfg = {**_MODERN_DEFAULTS[model_type], **hf_config}
    if hf_config.get("rope_parameters") is not None:
        cfg.update(_from_rope_parameters(model_type, hf_config))
    archs = MODERN_ARCHITECTURES[model_type]
    arch = (hf_config.get("architectures") or [next(iter(archs))])[0]
    if arch not in archs:
        raise ValueError(
            f"Unsupported {model_type} architecture {arch!r} (config field `architectures`); "
            f"kzoo reads {sorted(archs)}."
        )
    rope = _rope_scaling_from_hf(model_type, cfg.get("rope_scaling"),
                                 cfg.get("max_position_embeddings"))
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        # (transformers' rotary frequencies read it for any model type: only the first
        # fraction of each head would be rotated)
        raise ValueError(
            f"{model_type} config field `partial_rotary_factor`={partial!r} is not supported "
            "(kzoo rotates every feature of a head: only partial_rotary_factor=1.0)."
        )
    act = cfg["hidden_act"]
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"{model_type} config field `hidden_act`={act!r} is not supported; kzoo reads "
            f"{sorted(_ACTIVATIONS)}."
        )
    # transformers' Mistral and Mixtral have no biases whatever their config.json says (their
    # layers never read `attention_bias` / `mlp_bias`); LLaMA's follow the two fields.
    bias = bool(cfg.get("attention_bias", False)) if model_type == "llama" else False
    if model_type == "llama" and bias != bool(cfg.get("mlp_bias", False)):
        raise ValueError(
            f"{model_type} config: `attention_bias`={cfg.get('attention_bias')} and "
            f"`mlp_bias`={cfg.get('mlp_bias')} must be equal (kzoo has one use_bias)."
        )
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        warnings.warn(
            f"{model_type} config: pretraining_tp={cfg['pretraining_tp']} only splits the "
            "matrix products; the result is the same.", stacklevel=2,
        )
    # Training-only differences, said as GPT-2's dropouts are.
    attention_dropout = cfg.get("attention_dropout") or 0.0
    if attention_dropout:
        warnings.warn(
            f"{model_type} config: attention_dropout={attention_dropout} is kzoo's one dropout "
            "rate, which also drops the embeddings and every sub-layer's output (transformers' "
            f"{model_type} drops the attention probabilities only). Inference is unaffected.",
            stacklevel=2,
        )
    if model_type == "mixtral" and cfg.get("router_jitter_noise"):
        warnings.warn(
            f"mixtral config: router_jitter_noise={cfg['router_jitter_noise']} is not "
            "implemented by kzoo (transformers multiplies the router's input by uniform noise "
            "in training). Inference is unaffected.",
            stacklevel=2,
        )
    # transformers' LLaMA ignores a `sliding_window` in its config.json (its mask is always
    # the plain causal one); Mistral and Mixtral apply it.
    window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(
            f"{model_type} config field `sliding_window`={window!r} must be None or a "
            "positive integer."
        )
    # Query i sees keys j with 0 <= i - j < sliding_window (transformers'
    # `sliding_window_overlay`): kzoo's causal sliding window of the same size. Kept even when
    # it is no shorter than max_position_embeddings: a rotary model's forward pass and
    # `generate` take longer sequences, and transformers applies the window there.
    sliding = window is not None
    heads = cfg["num_attention_heads"]
    config = dict(
        vocabulary_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        hidden_dim=cfg["hidden_size"],
        intermediate_dim=cfg["intermediate_size"],
        max_sequence_length=cfg["max_position_embeddings"],
        dropout=cfg.get("attention_dropout") or 0.0,
        layer_norm_epsilon=cfg["rms_norm_eps"],
        activation=_ACTIVATIONS[act],
        norm="rmsnorm",
        position="rotary",
        feedforward="moe" if model_type == "mixtral" else "gated",
        num_kv_heads=cfg["num_key_value_heads"] or heads,
        use_bias=bias,
        rope_max_wavelength=cfg["rope_theta"],
        tie_embeddings=cfg["tie_word_embeddings"],
        initializer_range=cfg["initializer_range"],
        **rope,
    )
    # transformers' LLaMA takes head_dim=None as hidden_size // num_attention_heads;
    # Mistral's and Mixtral's attention any false value (`head_dim or ...`). kzoo keeps its
    # default (None) for that size, so that the config equals one written without it.
    head_dim = cfg.get("head_dim")
    if model_type != "llama" and not head_dim:
        head_dim = None
    if head_dim is not None and not (
            _is_int(head_dim) and _is_int(heads) and _is_int(cfg["hidden_size"])
            and heads > 0 and cfg["hidden_size"] % heads == 0
            and head_dim == cfg["hidden_size"] // heads):
        config["head_dim"] = head_dim
    if model_type == "mixtral":
        config.update(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                      capacity_factor=None, expert_type="gated")
    if sliding:
        config.update(attention="sliding_window", attention_options={"window": window})
    names = dict(_MODERN_HF_NAMES, attention_options="sliding_window")
    if hf_config.get("rope_parameters") is not None:
        names.update({key: "rope_parameters" for key, hf in _MODERN_HF_NAMES.items()
                      if hf in ("rope_theta", "rope_scaling")})
    if not cfg["num_key_value_heads"]:
        names["num_kv_heads"] = "num_attention_heads"
    config = _validated(config, source, names)
    return FAMILY, config, archs[arch], _task_config(archs[arch], cfg, config)


def _task_config(task, hf_config, config):
    """The causal LM's `stop_token_ids` (`generate`'s default): the checkpoint's
    `eos_token_id`; the backbone has no task config."""
    if task != "causal_lm":
        return {}
    return {"stop_token_ids": hf_token_ids(hf_config.get("eos_token_id"),
                                           config["vocabulary_size"])}


def _parts(model):
    task = getattr(model, "task_name", None)
    backbone = model.backbone if task else model
    return backbone, task


def _check_tied_head(weights, embedding_name):
    """A tied model takes the checkpoint's `lm_head.weight` only if it equals the
    embedding `embedding_name`; a different head needs tie_embeddings=False."""
    if not weights.has("lm_head.weight"):
        return
    head = weights.take("lm_head.weight")
    embedding = weights.state.get(embedding_name)
    if embedding is not None and not np.array_equal(np.asarray(embedding, head.dtype), head):
        raise ValueError(
            f"The checkpoint's `lm_head.weight` differs from `{embedding_name}` but the model "
            "ties them (tie_embeddings=True). If its config.json has tie_word_embeddings=False, "
            "load with tie_embeddings=False. If it has True, transformers drops the stored head "
            "and uses the embedding; kzoo does not drop a tensor in silence: remove "
            "`lm_head.weight` from the checkpoint to load what transformers loads, or load with "
            "tie_embeddings=False to use the stored head (the outputs then differ from "
            "transformers')."
        )


def load_weights(model, weights):
    """Copy a GPT-2 checkpoint (a `kzoo.convert.WeightReader`) into a kzoo GPT model.

    Example:
    >>> load_weights(model, WeightReader(read_hf_state("/path/to/gpt2")))
    """
    backbone, task = _parts(model)
    if backbone.position == "rotary":
        return _load_modern_weights(backbone, task, weights)
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
        _check_tied_head(weights, prefix + "wte.weight")
    elif task is not None or weights.has("lm_head.weight"):
        head = weights.take("lm_head.weight")
        if head is not None:
            assign(backbone.token_embedding.reverse_embeddings, head.T, "lm_head.weight")


def _load_modern_weights(backbone, task, weights):
    """LLaMA / Mixtral names (`nn.Linear` weights are `(out, in)`: transposed)."""
    if backbone.norm != "rmsnorm" or backbone.feedforward not in ("gated", "moe"):
        raise ValueError(
            "LLaMA / Mixtral checkpoints need norm='rmsnorm' and feedforward='gated' or 'moe'; "
            f"got norm={backbone.norm!r}, feedforward={backbone.feedforward!r}."
        )
    prefix = "model." if weights.has("model.embed_tokens.weight") else ""

    def put(variable, name, transpose=False):
        value = weights.take(name)
        assign(variable, None if value is None else (value.T if transpose else value), name)

    put(backbone.token_embedding.embeddings, prefix + "embed_tokens.weight")
    for i, block in enumerate(backbone.transformer_layers):
        p = f"{prefix}layers.{i}."
        attn = block.self_attention
        put(block.self_attention_norm.scale, p + "input_layernorm.weight")
        for proj, dense in (("q_proj", attn.query_dense), ("k_proj", attn.key_dense),
                            ("v_proj", attn.value_dense), ("o_proj", attn.output_dense)):
            put(dense.kernel, p + f"self_attn.{proj}.weight", transpose=True)
            if backbone.use_bias:
                put(dense.bias, p + f"self_attn.{proj}.bias")
        put(block.feedforward_norm.scale, p + "post_attention_layernorm.weight")
        ff = block.feedforward_layer
        if backbone.feedforward == "gated":
            for proj, dense in (("gate_proj", ff.gate_dense), ("up_proj", ff.up_dense),
                                ("down_proj", ff.output_dense)):
                put(dense.kernel, p + f"mlp.{proj}.weight", transpose=True)
                if backbone.use_bias:
                    put(dense.bias, p + f"mlp.{proj}.bias")
        else:
            m = p + "block_sparse_moe."
            put(ff.router.kernel, m + "gate.weight", transpose=True)
            stacks = {"w1": [], "w3": [], "w2": []}
            for j in range(backbone.num_experts):
                for w in stacks:
                    value = weights.take(f"{m}experts.{j}.{w}.weight")
                    stacks[w].append(None if value is None else value.T)
            for w, variable in (("w1", ff.gate_kernel), ("w3", ff.up_kernel),
                                ("w2", ff.output_kernel)):
                if all(v is not None for v in stacks[w]):
                    shapes = {v.shape for v in stacks[w]}
                    if len(shapes) != 1:
                        raise ValueError(
                            f"Experts of {m}experts.*.{w}.weight have different shapes "
                            f"{sorted(shapes)}."
                        )
                    assign(variable, np.stack(stacks[w]), f"{m}experts.*.{w}.weight")
    put(backbone.final_norm.scale, prefix + "norm.weight")
    if backbone.tie_embeddings:
        _check_tied_head(weights, prefix + "embed_tokens.weight")
    elif task is not None or weights.has("lm_head.weight"):
        put(backbone.token_embedding.reverse_embeddings, "lm_head.weight", transpose=True)


def to_hf(model):
    """`(config.json dict, {name: array})` of a GPT-2-configured kzoo model for transformers.

    Example:
    >>> hf_config, state = to_hf(kzoo.presets.load("gpt_mini"))
    """
    backbone, task = _parts(model)
    if backbone.position == "rotary":
        hf_config, state = _modern_to_hf(backbone, task)
    else:
        hf_config, state = _gpt2_to_hf(backbone, task)
    if task is not None:
        # `generate`'s default stop, as transformers' `eos_token_id`; written as null when
        # there is none (left out, transformers would stop at its own default: 2 for LLaMA,
        # 50256 for GPT-2)
        stops = getattr(model, "stop_token_ids", None)
        hf_config["eos_token_id"] = (None if not stops else stops[0] if len(stops) == 1
                                     else list(stops))
    return hf_config, state


def _gpt2_to_hf(backbone, task):
    """A learned-position GPT configuration as a GPT-2 checkpoint."""
    problems = []
    if backbone.position != "learned":
        problems.append(f"position={backbone.position!r} (GPT-2: 'learned')")
    if backbone.norm != "layernorm":
        problems.append(f"norm={backbone.norm!r} (GPT-2: 'layernorm')")
    if backbone.feedforward != "plain":
        problems.append(f"feedforward={backbone.feedforward!r} (GPT-2: 'plain')")
    if backbone.num_kv_heads not in (None, backbone.num_heads):
        problems.append(f"num_kv_heads={backbone.num_kv_heads} (GPT-2: num_heads)")
    if backbone.head_dim not in (None, backbone.hidden_dim // backbone.num_heads) or (
            backbone.hidden_dim % backbone.num_heads):
        # (GPT-2 has no such field: its heads are n_embd // n_head wide; written without
        # it, transformers failed to load the query/key/value weights)
        problems.append(f"head_dim={backbone.head_dim} (GPT-2: hidden_dim // num_heads = "
                        f"{backbone.hidden_dim / backbone.num_heads:g})")
    if not backbone.use_bias:
        problems.append("use_bias=False (GPT-2: True)")
    if backbone.activation not in _HF_ACTIVATIONS:
        problems.append(f"activation={backbone.activation!r}")
    if backbone.attention_scale not in (None, 1.0):
        problems.append(f"attention_scale={backbone.attention_scale} (GPT-2: None or 1.0)")
    if backbone.attention != "full":
        problems.append(f"attention={backbone.attention!r} (GPT-2: 'full')")
    if problems:
        raise ValueError(
            "Only GPT-2-configured models (or rotary LLaMA / Mixtral configurations) can be "
            "written as Hugging Face checkpoints; this model has " + ", ".join(problems) + "."
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
        "scale_attn_by_inverse_layer_idx": backbone.attention_scale_by_inverse_layer,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": backbone.tie_embeddings,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if backbone.vocabulary_size == 50257:
        hf_config.update(bos_token_id=50256, eos_token_id=50256)

    val = _val
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


def _val(variable):
    """A float32 NumPy copy of a variable, or of a tensor: a LoRA layer's `kernel` is its
    merged kernel `W + (alpha / rank) A B`, what the checkpoint gets."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return np.asarray(keras.ops.convert_to_numpy(value), dtype=np.float32)


def _modern_to_hf(backbone, task):
    """A rotary GPT configuration as a LLaMA (gated) or Mixtral (MoE) checkpoint."""
    problems = []
    if backbone.norm != "rmsnorm":
        problems.append(f"norm={backbone.norm!r} (LLaMA: 'rmsnorm')")
    if backbone.feedforward not in ("gated", "moe"):
        problems.append(f"feedforward={backbone.feedforward!r} (LLaMA: 'gated'; Mixtral: 'moe')")
    if backbone.attention_scale is not None:
        problems.append(f"attention_scale={backbone.attention_scale} (LLaMA: None)")
    if backbone.attention_scale_by_inverse_layer:
        problems.append("attention_scale_by_inverse_layer=True (LLaMA: False)")
    if backbone.activation not in _HF_ACTIVATIONS:
        problems.append(f"activation={backbone.activation!r}")
    moe = backbone.feedforward == "moe"
    sliding = backbone.attention == "sliding_window"
    if backbone.attention not in ("full", "sliding_window"):
        problems.append(f"attention={backbone.attention!r} (LLaMA / Mixtral: 'full'; "
                        "Mistral / Mixtral: 'sliding_window')")
    if sliding and not moe and backbone.use_bias:
        problems.append("use_bias=True (Mistral has no biases)")
    if moe:
        if backbone.use_bias:
            problems.append("use_bias=True (Mixtral has no biases)")
        if backbone.expert_type != "gated":
            problems.append(f"expert_type={backbone.expert_type!r} (Mixtral: 'gated')")
        if backbone.capacity_factor is not None:
            problems.append(f"capacity_factor={backbone.capacity_factor} (Mixtral: None)")
    if problems:
        raise ValueError(
            "This rotary GPT configuration has no Hugging Face equivalent (LLaMA / Mixtral): "
            + ", ".join(problems) + "."
        )
    if backbone.dropout:
        # (a training setting: a plain batch gives the same outputs)
        warnings.warn(
            f"transformers' LLaMA / Mistral / Mixtral drop only the attention probabilities: "
            f"dropout={backbone.dropout} is written as attention_dropout, without the dropout "
            "of the embeddings and sub-layer outputs (training the saved model there runs "
            "without them).", stacklevel=3,
        )
    act = {"gelu_tanh": "gelu_pytorch_tanh", "gelu_new": "gelu_pytorch_tanh"}.get(
        backbone.activation, _HF_ACTIVATIONS[backbone.activation])
    model_type = "mixtral" if moe else ("mistral" if sliding else "llama")
    name = {"llama": "Llama", "mixtral": "Mixtral", "mistral": "Mistral"}[model_type]
    window = backbone.attention_options["window"] if sliding else None
    hf_config = {
        "model_type": model_type,
        "architectures": [f"{name}ForCausalLM" if task == "causal_lm" else f"{name}Model"],
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_heads,
        "num_key_value_heads": backbone.num_kv_heads or backbone.num_heads,
        "head_dim": backbone.head_size,
        "hidden_act": act,
        "max_position_embeddings": backbone.max_sequence_length,
        "rms_norm_eps": backbone.layer_norm_epsilon,
        "rope_theta": float(backbone.rope_max_wavelength),
        "rope_scaling": _rope_scaling_to_hf(backbone),
        "attention_dropout": backbone.dropout,
        "initializer_range": backbone.initializer_range,
        "tie_word_embeddings": backbone.tie_embeddings,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if moe:
        hf_config.update(num_local_experts=backbone.num_experts,
                         num_experts_per_tok=backbone.top_k, sliding_window=window,
                         router_jitter_noise=0.0)
    elif sliding:
        hf_config.update(sliding_window=window)
    else:
        hf_config.update(attention_bias=backbone.use_bias, mlp_bias=backbone.use_bias)
    prefix = "model." if task is not None else ""
    state = {prefix + "embed_tokens.weight": _val(backbone.token_embedding.embeddings),
             prefix + "norm.weight": _val(backbone.final_norm.scale)}

    def linear(name, dense):
        state[name + ".weight"] = np.ascontiguousarray(_val(dense.kernel).T)
        if backbone.use_bias:
            state[name + ".bias"] = _val(dense.bias)

    for i, block in enumerate(backbone.transformer_layers):
        p = f"{prefix}layers.{i}."
        attn = block.self_attention
        state[p + "input_layernorm.weight"] = _val(block.self_attention_norm.scale)
        state[p + "post_attention_layernorm.weight"] = _val(block.feedforward_norm.scale)
        for proj, dense in (("q_proj", attn.query_dense), ("k_proj", attn.key_dense),
                            ("v_proj", attn.value_dense), ("o_proj", attn.output_dense)):
            linear(p + "self_attn." + proj, dense)
        ff = block.feedforward_layer
        if not moe:
            for proj, dense in (("gate_proj", ff.gate_dense), ("up_proj", ff.up_dense),
                                ("down_proj", ff.output_dense)):
                linear(p + "mlp." + proj, dense)
        else:
            m = p + "block_sparse_moe."
            state[m + "gate.weight"] = np.ascontiguousarray(_val(ff.router.kernel).T)
            for w, variable in (("w1", ff.gate_kernel), ("w3", ff.up_kernel),
                                ("w2", ff.output_kernel)):
                stack = _val(variable)
                for j in range(backbone.num_experts):
                    state[f"{m}experts.{j}.{w}.weight"] = np.ascontiguousarray(stack[j].T)
    if task is not None and not backbone.tie_embeddings:
        state["lm_head.weight"] = np.ascontiguousarray(
            _val(backbone.token_embedding.reverse_embeddings).T)
    return hf_config, state


__all__ = ["FAMILY", "MODEL_TYPES", "IGNORED_WEIGHTS", "config_from_hf", "load_weights",
           "to_hf"]
