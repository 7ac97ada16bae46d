"""A randomized parity sweep of the text converters against Hugging Face transformers.

Hypothesis draws small transformers models over the options kzoo's converters say they honour
(`kzoo/convert/gpt.py`, `kzoo/convert/bert.py` module docs), perturbs their weights (biases and
norm weights nonzero), saves them with `save_pretrained`, loads them with
`kzoo.presets.load(directory)` and compares kzoo's outputs with transformers' own (float32,
max |diff| <= 1e-5 at the real positions) on drawn batch sizes, lengths and right padding; the
decoders also decode greedily on left-padded prompts and must produce transformers' tokens
(`generate(do_sample=False)`). Options the converters do not implement must be refused with a
`ValueError` naming the option, never loaded into a model that computes something else.

Drawn option space:
- GPT-2 (`GPT2LMHeadModel` / `GPT2Model`): n_layer 1-3, n_head 1-4, n_embd = n_head * head_dim
  (head_dim 4, 8 or 16), n_inner None (4 * n_embd) or another size, every
  `activation_function` the converter documents, layer_norm_epsilon, scale_attn_weights,
  scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, tie_word_embeddings,
  n_positions, vocabulary 64-128.
- LLaMA / Mistral / Mixtral (`*ForCausalLM` / `*Model`): layers, heads, num_key_value_heads
  (any divisor: MHA, GQA, MQA), head_dim, intermediate_size, hidden_act, rope_theta,
  rms_norm_eps, tie_word_embeddings, attention_bias = mlp_bias (LLaMA), sliding_window
  (Mistral, Mixtral: None, shorter than the sequence, or no shorter than
  max_position_embeddings; LLaMA: a value in config.json that transformers ignores),
  experts and top-k (Mixtral), sequences longer than max_position_embeddings (rotary
  positions have no table).
- BERT (`BertModel`, `BertForMaskedLM`, `BertForSequenceClassification`,
  `BertForPreTraining`): layers, heads, head_dim, intermediate_size, hidden_act,
  type_vocab_size 1-3 with nonzero token_type_ids, layer_norm_eps, max_position_embeddings,
  num_labels.

The examples are derandomized (the same cases every run); `KZOO_SWEEP_EXAMPLES=n` multiplies
the number of examples of each test by n for a longer search.

The sweeps (mark `sweep`) run on torch by default and on JAX and TensorFlow too with
`make test-all` (tests/conftest.py).
"""

import json
import os
import tempfile

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kzoo.presets
from tests.harness import QUICKER_LOOP, assert_matches_transformers, hf_checkpoint

_MORE = int(os.environ.get("KZOO_SWEEP_EXAMPLES", "1"))


def _settings(examples):
    """`examples` draws on torch and TensorFlow, two on JAX (which compiles each new model's
    initializers and predict step: ~3.5 s an example against ~0.5 s), so that the file takes
    about half a minute on each backend. The draws are derandomized: JAX's two are the first
    two of the others'."""
    if keras.backend.backend() == "jax":
        examples = 2
    return settings(max_examples=examples * _MORE, deadline=None, derandomize=True,
                    print_blob=True, suppress_health_check=list(HealthCheck))


# `activation_function` / `hidden_act` values the converters document as honoured (written
# out here, not read back from the converters).
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu", "gelu_python", "relu",
                  "silu", "swish", "quick_gelu", "tanh", "sigmoid", "linear", "gelu_accurate")
EPSILONS = (1e-12, 1e-6, 1e-5, 1e-3, 1e-1)
HEAD_DIMS = (4, 8, 16)


def _checkpoint_dir(tmp_path):
    """A fresh directory under pytest's tmp_path for one hypothesis example."""
    return tempfile.mkdtemp(dir=tmp_path)


def _perturb(model, seed, scale=0.1):
    """Biases and norm weights away from transformers' initial 0 and 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name.lower() or ".ln_" in name:
                param.add_(torch.randn(param.shape, generator=gen) * scale)
    return model


def _right_padded(draw, vocab, max_len, max_batch=4):
    """(ids, mask) `(batch, seq)`: row 0 full, the others any length >= 1, right padded
    (arbitrary ids behind the padding)."""
    batch = draw(st.integers(1, max_batch), label="batch")
    seq = draw(st.one_of(st.just(max_len), st.integers(1, max_len)), label="seq")
    lengths = [seq] + [draw(st.integers(1, seq)) for _ in range(batch - 1)]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    ids = rng.integers(0, vocab, (batch, seq)).astype("int32")
    mask = (np.arange(seq)[None, :] < np.array(lengths)[:, None]).astype("int32")
    return ids, mask


def _gpt_inputs(ids, mask):
    return {"token_ids": ids, "padding_mask": mask}


def _assert_decoder_matches(model, hf, ids, mask, label, atol=1e-5):
    assert_matches_transformers(model, hf, _gpt_inputs(ids, mask),
                                dict(input_ids=ids, attention_mask=mask), atol=atol, mask=mask,
                                label=label)


# === GPT-2 ===


@st.composite
def gpt2_configs(draw):
    heads = draw(st.integers(1, 4), label="n_head")
    hidden = heads * draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    return dict(
        vocab_size=draw(st.integers(64, 128), label="vocab_size"),
        n_layer=draw(st.integers(1, 3), label="n_layer"),
        n_head=heads,
        n_embd=hidden,
        n_inner=draw(st.sampled_from([None, 8, 24, 40, 64, 72]), label="n_inner"),
        # (often no longer than the sequences drawn: every position used)
        n_positions=draw(st.one_of(st.integers(8, 16), st.integers(17, 48)),
                         label="n_positions"),
        activation_function=draw(st.sampled_from(HF_ACTIVATIONS), label="activation"),
        layer_norm_epsilon=draw(st.sampled_from(EPSILONS), label="layer_norm_epsilon"),
        scale_attn_weights=draw(st.booleans(), label="scale_attn_weights"),
        scale_attn_by_inverse_layer_idx=draw(st.booleans(),
                                             label="scale_attn_by_inverse_layer_idx"),
        reorder_and_upcast_attn=draw(st.booleans(), label="reorder_and_upcast_attn"),
        tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"),
        initializer_range=draw(st.sampled_from([0.02, 0.05, 0.1, 0.2])),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def _saved_hf_model(path, cls, config_cls, config, seed):
    """`cls(config_cls(**config))` seeded, perturbed and saved to `path`. The eager attention
    is transformers' reference path (its SDPA path ignores scale_attn_weights=False in
    4.57)."""
    import torch

    torch.manual_seed(seed)
    model = cls(config_cls(**config, attn_implementation="eager")).eval()
    _perturb(model, seed)
    hf_checkpoint(path, model)
    return model


def _hf_gpt2(path, config, seed, lm_head=True):
    import transformers

    cls = transformers.GPT2LMHeadModel if lm_head else transformers.GPT2Model
    return _saved_hf_model(path, cls, transformers.GPT2Config, config, seed)


@pytest.mark.sweep
@_settings(12)
@given(data=st.data())
def test_gpt2_parity_sweep(data, tmp_path):
    config = data.draw(gpt2_configs(), label="config")
    lm_head = data.draw(st.booleans(), label="lm_head")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    path = _checkpoint_dir(tmp_path)
    hf = _hf_gpt2(path, config, seed, lm_head)
    model = kzoo.presets.load(path)
    assert (getattr(model, "task_name", None) or "backbone") == (
        "causal_lm" if lm_head else "backbone")
    ids, mask = _right_padded(data.draw, config["vocab_size"], min(config["n_positions"], 16))
    _assert_decoder_matches(model, hf, ids, mask, f"GPT-2 {config} lm_head={lm_head}")


# === LLaMA / Mistral / Mixtral ===


@st.composite
def modern_configs(draw, model_type=None):
    if model_type is None:
        model_type = draw(st.sampled_from(["llama", "mistral", "mixtral"]), label="model_type")
    heads = draw(st.integers(1, 4), label="num_attention_heads")
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]),
                    label="num_key_value_heads")
    hidden = heads * draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    config = dict(
        vocab_size=draw(st.integers(64, 128), label="vocab_size"),
        hidden_size=hidden,
        intermediate_size=draw(st.integers(4, 64), label="intermediate_size"),
        num_hidden_layers=draw(st.integers(1, 3), label="num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # (often shorter than the sequences drawn: rotary positions have no table)
        max_position_embeddings=draw(st.one_of(st.integers(4, 12), st.integers(13, 40)),
                                     label="max_position_embeddings"),
        hidden_act=draw(st.sampled_from(["silu", "silu", "gelu", "gelu_pytorch_tanh", "relu",
                                         "tanh"]), label="hidden_act"),
        rms_norm_eps=draw(st.sampled_from(EPSILONS), label="rms_norm_eps"),
        rope_theta=draw(st.sampled_from([10000.0, 500.0, 1e6, 37.5]), label="rope_theta"),
        tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"),
        initializer_range=draw(st.sampled_from([0.02, 0.05, 0.1, 0.2])),
        attention_dropout=0.0,
    )
    if model_type == "llama":
        bias = draw(st.booleans(), label="attention_bias = mlp_bias")
        config.update(attention_bias=bias, mlp_bias=bias)
        # kept in config.json, ignored by transformers' LLaMA
        config["sliding_window"] = draw(st.one_of(st.none(), st.integers(1, 6)),
                                        label="sliding_window (ignored)")
    else:
        # None, shorter than the sequences, or no shorter than max_position_embeddings
        config["sliding_window"] = draw(
            st.one_of(st.none(), st.integers(1, 12),
                      st.integers(config["max_position_embeddings"],
                                  config["max_position_embeddings"] + 4)),
            label="sliding_window")
    # A head size of its own (Mistral-Nemo style: heads x head_dim != hidden_size) and RoPE
    # scaling, "linear" or Llama 3.1's "llama3" (its original length often shorter than the
    # sequences, where the scaling matters), under either key spelling.
    head_dim = draw(st.one_of(st.none(), st.sampled_from(HEAD_DIMS)), label="explicit head_dim")
    if head_dim is not None:
        config["head_dim"] = head_dim
    scaling = draw(st.sampled_from([None, "linear", "llama3", "yarn"]), label="rope_scaling")
    if scaling is not None:
        key = draw(st.sampled_from(["rope_type", "type"]), label="rope_scaling key")
        config["rope_scaling"] = {key: scaling, "factor": draw(
            st.sampled_from([1.0, 2.0, 8.0, 32.0]), label="rope factor")}
        if scaling == "llama3":
            low = draw(st.sampled_from([0.5, 1.0, 2.0]), label="low_freq_factor")
            config["rope_scaling"].update(
                low_freq_factor=low,
                high_freq_factor=low + draw(st.sampled_from([0.5, 3.0]), label="high - low"),
                original_max_position_embeddings=draw(st.integers(4, 24),
                                                      label="original_max_position_embeddings"))
        if scaling == "yarn":  # each setting given or left to transformers' default
            yarn = dict(
                original_max_position_embeddings=draw(st.one_of(st.none(), st.integers(
                    4, 24)), label="original_max_position_embeddings"),
                beta_fast=draw(st.sampled_from([None, 8.0, 32.0]), label="beta_fast"),
                beta_slow=draw(st.sampled_from([None, 0.5, 1.0]), label="beta_slow"),
                attention_factor=draw(st.sampled_from([None, 0.8, 1.3]),
                                      label="attention_factor"),
                truncate=draw(st.sampled_from([None, True, False]), label="truncate"))
            if draw(st.booleans(), label="DeepSeek's mscales"):
                yarn.update(mscale=draw(st.sampled_from([0.707, 1.0]), label="mscale"),
                            mscale_all_dim=draw(st.sampled_from([0.707, 1.0]),
                                                label="mscale_all_dim"))
            config["rope_scaling"].update(
                {key: value for key, value in yarn.items() if value is not None})
            # (transformers' YaRN reads `head_dim` from the config, None in Mistral's and
            # Mixtral's unless given)
            config.setdefault("head_dim", hidden // heads)
    if model_type == "mixtral":
        experts = draw(st.integers(1, 4), label="num_local_experts")
        config.update(num_local_experts=experts,
                      num_experts_per_tok=draw(st.integers(1, experts), label="top_k"),
                      router_jitter_noise=0.0)
    return model_type, config


def _hf_modern(path, model_type, config, seed, lm_head=True):
    import transformers

    name = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral"}[model_type]
    cls = getattr(transformers, f"{name}ForCausalLM" if lm_head else f"{name}Model")
    return _saved_hf_model(path, cls, getattr(transformers, f"{name}Config"), config, seed)


@pytest.mark.sweep
@_settings(12)
@given(data=st.data())
def test_llama_mistral_mixtral_parity_sweep(data, tmp_path):
    model_type, config = data.draw(modern_configs(), label="config")
    lm_head = data.draw(st.booleans(), label="lm_head")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    path = _checkpoint_dir(tmp_path)
    hf = _hf_modern(path, model_type, config, seed, lm_head)
    model = kzoo.presets.load(path)
    assert (getattr(model, "task_name", None) or "backbone") == (
        "causal_lm" if lm_head else "backbone")
    # Rotary positions have no table: sequences may run past max_position_embeddings (in
    # transformers as in kzoo), where a sliding window longer than max_position_embeddings
    # starts to matter.
    ids, mask = _right_padded(data.draw, config["vocab_size"], 16)
    _assert_decoder_matches(model, hf, ids, mask, f"{model_type} {config} lm_head={lm_head}")


def test_mistral_window_longer_than_max_position_embeddings(tmp_path):
    """Found by the sweep: a Mistral sliding_window no shorter than max_position_embeddings
    was dropped (full attention), but a rotary model runs on longer sequences, where
    transformers applies the window (here max |diff| 1.02 before the fix)."""
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
                  sliding_window=10, initializer_range=0.2)
    hf = _hf_modern(tmp_path, "mistral", config, seed=0)
    model = kzoo.presets.load(tmp_path)
    ids = np.random.default_rng(0).integers(0, 64, (2, 14)).astype("int32")
    mask = np.ones_like(ids)
    mask[1, 12:] = 0
    _assert_decoder_matches(model, hf, ids, mask, "mistral window 10 > positions 8, seq 14")


def test_llama_ignores_a_sliding_window_as_transformers_does(tmp_path):
    """Found while building the sweep: transformers' LLaMA never applies a `sliding_window` its
    config.json carries; kzoo applied it (here max |diff| 3.35 before the fix)."""
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                  sliding_window=3, initializer_range=0.2)
    hf = _hf_modern(tmp_path, "llama", config, seed=0)
    model = kzoo.presets.load(tmp_path)
    ids = np.random.default_rng(1).integers(0, 64, (2, 10)).astype("int32")
    _assert_decoder_matches(model, hf, ids, np.ones_like(ids), "llama with sliding_window=3")


@pytest.mark.spread
@pytest.mark.parametrize("model_type", ["mistral", "mixtral"])
@pytest.mark.parametrize("biases", [dict(attention_bias=True),
                                    dict(attention_bias=True, mlp_bias=True)])
def test_mistral_mixtral_ignore_bias_fields_as_transformers_does(tmp_path, model_type, biases):
    """transformers' Mistral and Mixtral have no biases whatever `attention_bias` / `mlp_bias`
    their config.json carries; kzoo read them as LLaMA's and refused the checkpoint (one
    field: "must be equal"; both: missing bias weights)."""
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                  initializer_range=0.2, **biases)
    if model_type == "mixtral":
        config.update(num_local_experts=3, num_experts_per_tok=2)
    hf = _hf_modern(tmp_path, model_type, config, seed=0)
    model = kzoo.presets.load(tmp_path)
    assert not model.backbone.use_bias
    ids = np.random.default_rng(3).integers(0, 64, (2, 10)).astype("int32")
    _assert_decoder_matches(model, hf, ids, np.ones_like(ids), f"{model_type} with {biases}")



@pytest.mark.parametrize("model_type, field, match", [
    ("llama", "attention_dropout", "attention_dropout=0.1 is kzoo's one dropout rate"),
    ("mistral", "attention_dropout", "attention_dropout=0.1 is kzoo's one dropout rate"),
    ("mixtral", "router_jitter_noise", "router_jitter_noise=0.1 is not implemented"),
])
def test_training_only_fields_warn_and_match_in_inference(tmp_path, model_type, field, match):
    """transformers' LLaMA / Mistral / Mixtral drop only the attention probabilities and
    Mixtral jitters its router in training; kzoo loaded both fields in silence (its dropout
    rate drops the embeddings and sub-layer outputs too; it has no router jitter)."""
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                  initializer_range=0.2, **{field: 0.1})
    if model_type == "mixtral":
        config.update(num_local_experts=3, num_experts_per_tok=2)
    hf = _hf_modern(tmp_path, model_type, config, seed=0)
    with pytest.warns(UserWarning, match=match):
        model = kzoo.presets.load(tmp_path)
    ids = np.random.default_rng(4).integers(0, 64, (2, 10)).astype("int32")
    _assert_decoder_matches(model, hf, ids, np.ones_like(ids), f"{model_type} {field}=0.1")


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"type": "default"}])
def test_llama_default_rope_scaling_loads_as_none(tmp_path, scaling):
    """transformers' `rope_type` "default" is the plain rotary frequencies, as no
    `rope_scaling`; kzoo refused it with the scalings it does not implement."""
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                  rope_scaling=scaling, rope_theta=500.0, initializer_range=0.2)
    hf = _hf_modern(tmp_path, "llama", config, seed=0)
    model = kzoo.presets.load(tmp_path)
    ids = np.random.default_rng(2).integers(0, 64, (2, 12)).astype("int32")
    _assert_decoder_matches(model, hf, ids, np.ones_like(ids), f"llama rope_scaling {scaling}")


@pytest.mark.spread
@pytest.mark.parametrize("model_type, scaling", [
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    ("mistral", {"type": "yarn", "factor": 8.0, "beta_fast": 8.0, "beta_slow": 0.5,
                 "truncate": False}),
    ("mixtral", {"rope_type": "yarn", "factor": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 6}),
    ("llama", {"rope_type": "yarn", "factor": 16.0, "attention_factor": 1.5}),
])
def test_yarn_rope_scaling_matches_transformers(model_type, scaling, tmp_path):
    """YaRN (`rope_scaling` type "yarn", Qwen2.5 / DeepSeek style settings): the forward pass
    past the original context, greedy decoding of left-padded prompts (the decode loops
    rotate with their own tables) and the checkpoint written back."""
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=32, rope_theta=50.0, rope_scaling=scaling,
                  initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    if model_type == "mixtral":
        config.update(num_local_experts=3, num_experts_per_tok=2)
    hf = _hf_modern(tmp_path / "hf", model_type, config, seed=5)
    model = kzoo.presets.load(tmp_path / "hf")
    assert model.backbone.rope_scaling_type == "yarn"
    ids = np.random.default_rng(5).integers(0, 64, (3, 24)).astype("int32")
    mask = np.ones_like(ids)
    mask[2, 17:] = 0
    # An explicit attention factor multiplies cos and sin, so the scores and their float32
    # rounding by its square. At 1.5 (x2.25), JAX on an Intel Xeon (AVX-512, AMX) measured
    # 8.4e-6 and 1.04e-5 at logits of scale 3.69, where torch and TensorFlow measured 3.3e-6
    # to 4.0e-6: the tolerance scales with it.
    atol = 1e-5 * max(1.0, scaling.get("attention_factor", 1.0) ** 2)
    _assert_decoder_matches(model, hf, ids, mask, f"{model_type} {scaling}", atol=atol)
    prompts = [[5, 9, 11, 3, 40, 2, 7], [17, 8], [60, 61, 62, 1]]
    expected = _hf_greedy(hf, prompts, 16, eos=None)
    got = model.generate(prompts, max_new_tokens=16, strategy="greedy", stop_token_ids=None,
                         compile=QUICKER_LOOP)
    assert got == expected
    assert min(len(set(row)) for row in got) >= 3, got  # (not one token repeated)
    # written back (every setting explicit), read by transformers: the same logits
    kzoo.presets.save(model, tmp_path / "again", format="hf")
    written = json.loads((tmp_path / "again" / "config.json").read_text())["rope_scaling"]
    assert written["rope_type"] == "yarn" and written["factor"] == scaling["factor"]
    again = type(hf).from_pretrained(tmp_path / "again").eval()
    _assert_decoder_matches(model, again, ids, mask, f"{model_type} {scaling} written back",
                            atol=atol)


# === Greedy decoding (both decoder kinds) ===


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), "int64")
    mask = np.zeros((len(prompts), width), "int64")
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _hf_greedy(hf, prompts, max_new_tokens, eos):
    """transformers' greedy continuation of the left-padded batch: each row's new tokens up
    to and including its first `eos`."""
    import torch

    ids, mask = _left_padded(prompts)
    # transformers 4.57's cached decoding disagrees with its own forward pass in two cases,
    # where it decodes without the cache (each step the argmax of the full forward pass):
    # - sliding_window=1: `DynamicSlidingWindowLayer` keeps `keys[:, :, -window + 1:]`, i.e.
    #   every key (a Mistral, prompt [0]: [18, 17, 18, ...] against [18, 54, 17, ...]);
    # - a LLaMA whose config carries a sliding_window: `DynamicCache` builds sliding layers
    #   from `config.sliding_window` for any model, while LLaMA's forward pass ignores it.
    window = getattr(hf.config, "sliding_window", None)
    use_cache = window is None or (window > 1 and hf.config.model_type != "llama")
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                          do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                          pad_token_id=0, use_cache=use_cache)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.mark.sweep
@_settings(8)
@given(data=st.data())
def test_greedy_generation_sweep(data, tmp_path):
    kind = data.draw(st.sampled_from(["gpt2", "llama", "mistral", "mixtral"]), label="kind")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    max_new = data.draw(st.integers(2, 10), label="max_new_tokens")
    vocab = data.draw(st.integers(64, 128), label="vocab_size")
    count = data.draw(st.integers(1, 3), label="prompts")
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=9),
                         label="prompt") for _ in range(count)]
    # The longest prompt plus the new tokens fill the positions up to the last few or exactly.
    positions = max(map(len, prompts)) + max_new + data.draw(st.integers(0, 3), label="spare")
    eos = data.draw(st.integers(0, vocab - 1), label="eos_token_id")
    # Weights large enough that greedy decoding does not just repeat one token.
    common = dict(vocab_size=vocab, initializer_range=0.3, eos_token_id=eos, bos_token_id=eos)
    path = _checkpoint_dir(tmp_path)
    if kind == "gpt2":
        config = {**data.draw(gpt2_configs(), label="config"), **common,
                  "n_positions": positions}
        hf = _hf_gpt2(path, config, seed)
    else:
        _, config = data.draw(modern_configs(kind), label="config")
        config.update(common, max_position_embeddings=positions)
        hf = _hf_modern(path, kind, config, seed)
    model = kzoo.presets.load(path)
    assert model.stop_token_ids == (eos,)  # generate's default: the checkpoint's eos_token_id
    expected = _hf_greedy(hf, prompts, max_new, eos)
    if data.draw(st.booleans(), label="left-padded array"):
        ids, mask = _left_padded(prompts)
        got = model.generate(ids.astype("int32"), max_new_tokens=max_new, strategy="greedy",
                             padding_mask=mask.astype("int32"), compile=QUICKER_LOOP)
    else:
        got = model.generate(prompts, max_new_tokens=max_new, strategy="greedy",
                             compile=QUICKER_LOOP)
    print(f"[{kind}] {config} prompts {prompts}: {got}")
    assert got == expected, (kind, config, prompts)


# === BERT ===

BERT_CLASSES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification",
                "BertForPreTraining")


@st.composite
def bert_configs(draw):
    heads = draw(st.integers(1, 4), label="num_attention_heads")
    return dict(
        vocab_size=draw(st.integers(64, 128), label="vocab_size"),
        hidden_size=heads * draw(st.sampled_from(HEAD_DIMS), label="head_dim"),
        num_hidden_layers=draw(st.integers(1, 3), label="num_hidden_layers"),
        num_attention_heads=heads,
        intermediate_size=draw(st.integers(4, 80), label="intermediate_size"),
        hidden_act=draw(st.sampled_from(HF_ACTIVATIONS), label="hidden_act"),
        type_vocab_size=draw(st.integers(1, 3), label="type_vocab_size"),
        layer_norm_eps=draw(st.sampled_from(EPSILONS), label="layer_norm_eps"),
        max_position_embeddings=draw(st.one_of(st.integers(8, 16), st.integers(17, 48)),
                                     label="max_position_embeddings"),
        initializer_range=draw(st.sampled_from([0.02, 0.05, 0.1, 0.2])),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


# kzoo output -> transformers output compared, per architecture
_BERT_OUTPUTS = {
    "BertModel": [(lambda o: o["sequence_output"], lambda o: o.last_hidden_state),
                  (lambda o: o["pooled_output"], lambda o: o.pooler_output)],
    "BertForMaskedLM": [(None, lambda o: o.logits)],
    "BertForSequenceClassification": [(None, lambda o: o.logits)],
    "BertForPreTraining": [(None, lambda o: o.prediction_logits)],
}


@pytest.mark.sweep
@_settings(12)
@given(data=st.data())
def test_bert_parity_sweep(data, tmp_path):
    import torch
    import transformers

    config = data.draw(bert_configs(), label="config")
    cls_name = data.draw(st.sampled_from(BERT_CLASSES), label="class")
    if cls_name == "BertForSequenceClassification":
        config["num_labels"] = data.draw(st.integers(1, 4), label="num_labels")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(
        transformers.BertConfig(**config, attn_implementation="eager")).eval()
    _perturb(hf, seed)
    path = hf_checkpoint(_checkpoint_dir(tmp_path), hf)
    model = kzoo.presets.load(path)

    ids, mask = _right_padded(data.draw, config["vocab_size"],
                              min(config["max_position_embeddings"], 16))
    segments = np.random.default_rng(seed).integers(0, config["type_vocab_size"], ids.shape)
    segments = np.where(mask == 1, segments, 0).astype("int32")
    if config["type_vocab_size"] > 1:  # at least one nonzero token type among the real tokens
        segments[0, -1] = config["type_vocab_size"] - 1
    inputs = {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}
    hf_inputs = dict(input_ids=ids, token_type_ids=segments, attention_mask=mask)
    for kzoo_select, hf_select in _BERT_OUTPUTS[cls_name]:
        assert_matches_transformers(model, hf, inputs, hf_inputs, atol=1e-5, select=hf_select,
                                    kzoo_select=kzoo_select, mask=mask,
                                    label=f"{cls_name} {config}")


# === Options kzoo does not implement: refused, naming the option ===


def _tiny_gpt2(**overrides):
    import transformers

    config = dict(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def _pruned_gpt2():
    """A tiny GPT-2 with one head of its first layer pruned (transformers writes
    `pruned_heads` to config.json and prunes them again on load)."""
    model = _tiny_gpt2()
    model.prune_heads({0: [0]})
    return model


def _tiny_modern(model_type, **overrides):
    import transformers

    name = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral"}[model_type]
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    if model_type == "mixtral":
        config.update(num_local_experts=2, num_experts_per_tok=1)
    return getattr(transformers, f"{name}ForCausalLM")(
        getattr(transformers, f"{name}Config")(**{**config, **overrides}))


def _tiny_bert(cls_name="BertForMaskedLM", **overrides):
    import transformers

    config = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=24, max_position_embeddings=16)
    return getattr(transformers, cls_name)(transformers.BertConfig(**{**config, **overrides}))


UNSUPPORTED = {
    "gpt2 add_cross_attention": (lambda: _tiny_gpt2(add_cross_attention=True),
                                 "add_cross_attention"),
    "gpt2 pruned_heads": (_pruned_gpt2, "pruned_heads"),
    "gpt2 gelu_10": (lambda: _tiny_gpt2(activation_function="gelu_10"),
                     "activation_function"),
    "gpt2 mish": (lambda: _tiny_gpt2(activation_function="mish"), "activation_function"),
    "gpt2 relu6": (lambda: _tiny_gpt2(activation_function="relu6"), "activation_function"),
    "llama rope_scaling longrope": (
        lambda: _tiny_modern("llama", rope_scaling={
            "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
        "rope_scaling"),
    "llama rope_scaling dynamic": (
        lambda: _tiny_modern("llama", rope_scaling={"type": "dynamic", "factor": 2.0}),
        "rope_scaling"),
    "llama partial_rotary_factor": (lambda: _tiny_modern("llama", partial_rotary_factor=0.5),
                                    "partial_rotary_factor"),
    "llama attention_bias only": (lambda: _tiny_modern("llama", attention_bias=True),
                                  "attention_bias"),
    "llama mlp_bias only": (lambda: _tiny_modern("llama", mlp_bias=True), "mlp_bias"),
    "llama hidden_act gelu_10": (lambda: _tiny_modern("llama", hidden_act="gelu_10"),
                                 "hidden_act"),
    "mixtral rope_scaling dynamic": (
        # (transformers' Mixtral computes a scaled RoPE from `head_dim` alone)
        lambda: _tiny_modern("mixtral", head_dim=8, rope_scaling={
            "rope_type": "dynamic", "factor": 2.0}),
        "rope_scaling"),
    "bert relative_key": (lambda: _tiny_bert(position_embedding_type="relative_key"),
                          "position_embedding_type"),
    "bert relative_key_query": (
        lambda: _tiny_bert(position_embedding_type="relative_key_query"),
        "position_embedding_type"),
    "bert is_decoder": (lambda: _tiny_bert(is_decoder=True), "is_decoder"),
    "bert untied decoder": (lambda: _tiny_bert(tie_word_embeddings=False),
                            "tie_word_embeddings"),
    "bert hidden_act mish": (lambda: _tiny_bert(hidden_act="mish"), "hidden_act"),
    "bert hidden_act gelu_10": (lambda: _tiny_bert("BertModel", hidden_act="gelu_10"),
                                "hidden_act"),
}


@pytest.mark.spread
@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_options_are_refused(case, tmp_path):
    build, option = UNSUPPORTED[case]
    hf_checkpoint(tmp_path, build())
    with pytest.raises(ValueError, match=option):
        kzoo.presets.load(tmp_path)
