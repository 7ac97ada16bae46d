"""The torch decode loop's compiled step (`kzoo.layers.compiled_decode`): its logits equal
the model's own full forward pass (the Keras layers) at each new position, left padding
included; `generate` gives the eager loop's tokens with it (greedy, beam, sampling); models
it cannot express, and a compiler that fails, decode eagerly; the "auto" policy compiles from
a shape's second call. On JAX and TensorFlow it never applies (their loops compile whole):
there `test_models_it_cannot_express_decode_eagerly` checks by default that no step is
planned; the others, marked `torch_path`, run there with `make test-all`.

The suite runs with `KZOO_COMPILED_DECODE=0` (tests/conftest.py); these tests set it."""

import keras
import numpy as np
import pytest

from kzoo.layers import compiled_decode
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from tests.harness import to_numpy
from tests.helpers import count_compiled_steps

TORCH = keras.backend.backend() == "torch"

CONFIGS = {
    "gpt2": dict(num_layers=2),
    "post_ln_rms_gqa_untied": dict(norm="rmsnorm", num_kv_heads=1, tie_embeddings=False,
                                   activation="relu", use_bias=False),
    "gelu_silu_scale": dict(activation="gelu", attention_scale=0.3),
    # Llama-style (`gpt_modern_mini`): rotary positions, SwiGLU, RMSNorm, grouped heads
    "rotary_swiglu_gqa": dict(norm="rmsnorm", position="rotary", feedforward="gated",
                              activation="silu", num_kv_heads=1, use_bias=False,
                              tie_embeddings=False, rope_max_wavelength=500.0),
    # heads wider than hidden_dim / num_heads (12, not 8) and Llama 3.1's RoPE scaling, its
    # original context (4) shorter than the prompts and steps
    "rotary_llama3_head_dim": dict(norm="rmsnorm", position="rotary", feedforward="gated",
                                   activation="silu", num_kv_heads=1, use_bias=False,
                                   head_dim=12, rope_scaling_type="llama3",
                                   rope_scaling_factor=4.0, rope_low_freq_factor=1.0,
                                   rope_high_freq_factor=4.0,
                                   rope_original_max_position_embeddings=4),
    # YaRN: its ramp over the frequencies and its attention factor (the default, 1.14) on
    # cos and sin, the original context (4) shorter than the prompts and steps
    "rotary_yarn": dict(norm="rmsnorm", position="rotary", feedforward="gated",
                        activation="silu", use_bias=False, rope_scaling_type="yarn",
                        rope_scaling_factor=4.0, rope_original_max_position_embeddings=4,
                        rope_beta_fast=8.0),
    # the paper's pairing and linear position interpolation, set on the layers below
    "rotary_interleaved_scaled_geglu": dict(position="rotary", feedforward="gated",
                                            activation="gelu_tanh"),
    # Mixtral-style experts (`gpt_moe_mini`): 2 rows x top 2 of 4, every expert on each row
    "moe_top2_rotary": dict(feedforward="moe", num_experts=4, top_k=2, position="rotary",
                            norm="rmsnorm", num_kv_heads=1, activation="silu"),
    # plain experts with biases, 2 rows x top 1 of 3: the chosen experts' kernels gathered
    "moe_top1_plain": dict(feedforward="moe", num_experts=3, top_k=1, expert_type="plain",
                           activation="gelu"),
    # a rolling cache of 3 slots (`gpt_long_mini`): the prompts are longer than the window
    "sliding_window": dict(attention="sliding_window", attention_options={"window": 3}),
}


def _lm(num_layers=1, **extra):
    # (one layer where two add nothing to the check: Inductor's compile time grows with the
    # layers, and each model shape here compiles once, 10-25 s in a fresh `make test`)
    keras.utils.set_random_seed(3)
    return GPTCausalLM(GPTBackbone(vocabulary_size=97, num_layers=num_layers, num_heads=2,
                                   hidden_dim=16, intermediate_dim=32, max_sequence_length=40,
                                   dropout=0.0, **extra))


def _no_grad():
    import contextlib

    if TORCH:
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


@pytest.mark.torch_path
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_step_logits_match_the_full_forward(monkeypatch, name):
    monkeypatch.setenv(compiled_decode.ENV, "1")
    lm = _lm(**CONFIGS[name])
    if name == "post_ln_rms_gqa_untied":  # (GPT is pre-LN: turn its blocks to post-LN)
        for block in lm.backbone.transformer_layers:
            block.norm_first = False
    rng = np.random.default_rng(7)  # (biases and shifts start at zero: make them count)
    for weight in lm.weights:
        if weight.path.split("/")[-1] in ("bias", "beta") or weight.path.endswith("_bias"):
            weight.assign(rng.normal(0.0, 0.1, weight.shape).astype("float32"))
    if name == "rotary_interleaved_scaled_geglu":
        for block in lm.backbone.transformer_layers:
            block.self_attention.rotary.interleaved = True
            block.self_attention.rotary.scaling_factor = 2.5
    rows = [[5, 6, 7, 8], [9, 10]]
    inputs = {"token_ids": np.array([[5, 6, 7, 8], [0, 0, 9, 10]], "int32"),
              "padding_mask": np.array([[1, 1, 1, 1], [0, 0, 1, 1]], "int32"),
              "position_offset": np.array([0, 2], "int32")}
    with _no_grad():
        logits, state, constants = lm.generation_prefill(inputs, 3)
        step = compiled_decode.model_step(lm, state, constants)
        if not TORCH:
            assert step is None
            return
        assert step is not None
        import torch

        for index in range(2):
            new = np.argmax(to_numpy(logits), axis=-1)
            rows = [r + [int(t)] for r, t in zip(rows, new)]
            logits = step(torch.as_tensor(new[:, None]), index)
            for b, row in enumerate(rows):  # each row alone, unpadded, through Keras' layers
                full = lm({"token_ids": np.array([row], "int32"),
                           "padding_mask": np.ones((1, len(row)), "int32")})
                np.testing.assert_allclose(to_numpy(logits)[b], to_numpy(full)[0, -1],
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.torch_path
@pytest.mark.parametrize("strategy,kwargs", [("greedy", {}), ("beam", dict(num_beams=2)),
                                             ("sample", dict(top_k=5, seed=4))])
def test_generate_gives_the_eager_tokens(monkeypatch, strategy, kwargs):
    lm = _lm()
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    monkeypatch.setenv(compiled_decode.ENV, "0")
    eager = lm.generate(prompts, max_new_tokens=10, strategy=strategy, stop_token_ids=None,
                        **kwargs)
    calls = count_compiled_steps(monkeypatch)
    compiled = lm.generate(prompts, max_new_tokens=10, strategy=strategy, stop_token_ids=None,
                           **kwargs)
    assert compiled == eager
    assert len(calls) == (9 if TORCH else 0)  # every step after the prefill's


@pytest.mark.torch_path
@pytest.mark.parametrize("name", ["sliding_window", "moe_top2_rotary"])
def test_beam_search_on_rolling_caches_and_experts_gives_the_eager_tokens(monkeypatch, name):
    lm = _lm(**CONFIGS[name])  # (a rolling cache is one tensor a layer: reordered in place)
    prompts = [[5, 6, 7, 8, 9], [9, 10], [11, 12, 13]]
    kwargs = dict(max_new_tokens=8, strategy="beam", num_beams=2, stop_token_ids=None)
    monkeypatch.setenv(compiled_decode.ENV, "0")
    eager = lm.generate(prompts, **kwargs)
    monkeypatch.setenv(compiled_decode.ENV, "1")
    calls = []
    real = compiled_decode._compiled
    monkeypatch.setattr(compiled_decode, "_compiled", lambda config, fn=None: (
        lambda *a, run=real(config, fn): calls.append(1) or run(*a)))
    assert lm.generate(prompts, **kwargs) == eager
    assert len(calls) == (7 if TORCH else 0)  # every step after the prefill's


@pytest.mark.torch_path
def test_moe_capacity_drops_what_the_eager_step_drops(monkeypatch):
    """With a `capacity_factor` a decode step's rows compete for the experts (here 3 rows x
    top 2 of 2 experts, capacity 1 each: most assignments dropped): the compiled step keeps
    the ones the layer's own call keeps, so its logits are the eager step's."""
    monkeypatch.setenv(compiled_decode.ENV, "1")
    lm = _lm(feedforward="moe", num_experts=2, top_k=2, capacity_factor=0.25)
    inputs = {"token_ids": np.array([[5, 6, 7], [8, 9, 10], [0, 11, 12]], "int32"),
              "padding_mask": np.array([[1, 1, 1], [1, 1, 1], [0, 1, 1]], "int32"),
              "position_offset": np.array([0, 0, 1], "int32")}
    with _no_grad():
        logits, state, constants = lm.generation_prefill(inputs, 3)
        tokens = np.argmax(to_numpy(logits), axis=-1)[:, None].astype("int32")
        copy = keras.tree.map_structure(lambda x: keras.ops.copy(x), state)
        eager, _ = lm.generation_step(tokens, copy, constants, 0)
        moe = lm.backbone.transformer_layers[0].feedforward_layer
        moe.capacity_factor = None  # (nothing dropped: other logits)
        undropped, _ = lm.generation_step(
            tokens, keras.tree.map_structure(lambda x: keras.ops.copy(x), state), constants, 0)
        moe.capacity_factor = 0.25
        step = compiled_decode.model_step(lm, state, constants)
        if not TORCH:
            assert step is None
            return
        import torch

        compiled = step(torch.as_tensor(tokens), 0)
    eager, undropped = to_numpy(eager), to_numpy(undropped)
    assert np.abs(eager - undropped).max() > 1e-3
    np.testing.assert_allclose(to_numpy(compiled), eager, rtol=1e-5, atol=1e-5)


@pytest.mark.torch_path
def test_moe_ties_pick_the_experts_the_layer_picks(monkeypatch):
    """A zero router ties every expert: `MixtureOfExperts` takes the lowest ids on every
    backend, and the compiled step must too (`torch.topk` took others: experts 6 and 5 of
    8), so its logits are the eager step's."""
    monkeypatch.setenv(compiled_decode.ENV, "1")
    lm = _lm(feedforward="moe", num_experts=8, top_k=2)
    router = lm.backbone.transformer_layers[0].feedforward_layer.router
    router.kernel.assign(np.zeros(router.kernel.shape, "float32"))
    inputs = {"token_ids": np.array([[5, 6, 7], [0, 11, 12]], "int32"),
              "padding_mask": np.array([[1, 1, 1], [0, 1, 1]], "int32"),
              "position_offset": np.array([0, 1], "int32")}
    with _no_grad():
        logits, state, constants = lm.generation_prefill(inputs, 3)
        tokens = np.argmax(to_numpy(logits), axis=-1)[:, None].astype("int32")
        copy = keras.tree.map_structure(lambda x: keras.ops.copy(x), state)
        eager, _ = lm.generation_step(tokens, copy, constants, 0)
        step = compiled_decode.model_step(lm, state, constants)
        if not TORCH:
            assert step is None
            return
        import torch

        compiled = step(torch.as_tensor(tokens), 0)
    np.testing.assert_allclose(to_numpy(compiled), to_numpy(eager), rtol=1e-5, atol=1e-5)


def test_models_it_cannot_express_decode_eagerly(monkeypatch):
    monkeypatch.setenv(compiled_decode.ENV, "1")
    for extra in (dict(attention="strided", attention_options={"stride": 2}),
                  dict(attention="linear")):
        lm = _lm(**extra)
        assert compiled_decode._plan(lm) is None
        out = lm.generate([[5, 6, 7]], max_new_tokens=4, stop_token_ids=None)
        assert len(out[0]) == 4
    assert (compiled_decode._plan(_lm()) is not None) == TORCH


@pytest.mark.torch_path
def test_a_compiler_that_fails_warns_and_decodes_eagerly(monkeypatch):
    lm = _lm()
    prompts = [[5, 6, 7, 8], [9, 10]]
    monkeypatch.setenv(compiled_decode.ENV, "0")
    eager = lm.generate(prompts, max_new_tokens=6, stop_token_ids=None)
    monkeypatch.setenv(compiled_decode.ENV, "1")

    def broken(config, fn=None):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(compiled_decode, "_compiled", broken)
    if TORCH:
        with pytest.warns(UserWarning, match="no compiled step for GPTCausalLM.*no C\\+\\+"):
            out = lm.generate(prompts, max_new_tokens=6, stop_token_ids=None)
    else:
        out = lm.generate(prompts, max_new_tokens=6, stop_token_ids=None)
    assert out == eager


@pytest.mark.torch_path
def test_auto_policy_compiles_from_a_shapes_second_call(monkeypatch):
    import functools

    monkeypatch.delenv(compiled_decode.ENV, raising=False)
    assert compiled_decode.policy() == "auto"
    made = []  # (the step uncompiled: the policy is what is tested here)
    monkeypatch.setattr(compiled_decode, "_compiled", lambda config, fn=None: made.append(
        config) or functools.partial(fn or compiled_decode._step, config))
    lm = _lm()
    for prompts, expected in (([[5, 6, 7]], 0), ([[8, 9, 10]], 1),  # same shape: compiled
                              ([[5, 6, 7], [1, 2, 3]], 1),  # a new batch size: eager first
                              ([[5, 6, 7], [1, 2, 3]], 2)):
        lm.generate(prompts, max_new_tokens=3, stop_token_ids=None)
        assert len(made) == (expected if TORCH else 0)
    monkeypatch.setenv(compiled_decode.ENV, "sometimes")
    with pytest.raises(ValueError, match="KZOO_COMPILED_DECODE must be 'auto', '1' or '0'"):
        compiled_decode.policy()


def _t5(**extra):
    from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM

    keras.utils.set_random_seed(5)
    return T5Seq2SeqLM(T5Backbone(vocabulary_size=61, num_layers=1, num_heads=2, hidden_dim=16,
                                  intermediate_dim=24, key_value_dim=8, dropout=0.0, **extra))


@pytest.mark.torch_path
@pytest.mark.parametrize("extra", [dict(tie_embeddings=True),  # v1.0: tied head, ReLU
                                   # v1.1: untied head, tanh-GELU gated feed-forward
                                   dict(tie_embeddings=False, feedforward="gated-gelu")],
                         ids=["v1_0", "v1_1"])
def test_t5_compiled_step_logits_match_the_full_forward(monkeypatch, extra):
    monkeypatch.setenv(compiled_decode.ENV, "1")
    lm = _t5(**extra)
    encoder = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], "int32")
    encoder_mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], "int32")
    start = np.zeros((2, 1), "int32")
    with _no_grad():
        logits, state, constants = lm.generation_prefill(
            {"encoder_token_ids": encoder, "encoder_padding_mask": encoder_mask,
             "decoder_start_token_ids": start}, 4)
        step = compiled_decode.model_step(lm, state, constants)
        if not TORCH:
            assert step is None
            return
        assert step is not None
        import torch

        decoded = start
        for index in range(3):
            new = np.argmax(to_numpy(logits), axis=-1)
            decoded = np.concatenate([decoded, new[:, None].astype("int32")], axis=1)
            logits = step(torch.as_tensor(new[:, None]), index)
            full = lm({"encoder_token_ids": encoder, "encoder_padding_mask": encoder_mask,
                       "decoder_token_ids": decoded,
                       "decoder_padding_mask": np.ones_like(decoded)})
            np.testing.assert_allclose(to_numpy(logits), to_numpy(full)[:, -1], rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.torch_path
def test_t5_generate_gives_the_eager_tokens(monkeypatch):
    lm = _t5()
    prompts = np.array([[5, 6, 7, 8], [9, 10, 11, 0]], "int32")
    monkeypatch.setenv(compiled_decode.ENV, "0")
    eager = lm.generate(prompts, max_new_tokens=8, stop_token_ids=None)
    beams = lm.generate(prompts, max_new_tokens=8, stop_token_ids=None, strategy="beam",
                        num_beams=2)
    monkeypatch.setenv(compiled_decode.ENV, "1")
    assert lm.generate(prompts, max_new_tokens=8, stop_token_ids=None) == eager
    assert lm.generate(prompts, max_new_tokens=8, stop_token_ids=None, strategy="beam",
                       num_beams=2) == beams
    assert (compiled_decode._t5_plan(lm) is not None) == TORCH
    assert compiled_decode._t5_plan(_t5(feedforward="gated-gelu")) is not None or not TORCH
