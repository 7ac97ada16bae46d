"""The torch decode fast path (`kzoo.layers.fast_decode`): token-by-token cached decoding
through `decode_block` equals a full causal pass written in NumPy (or, for rotary and
mixture-of-experts blocks, the block's own full pass), for every block configuration the
families use; it only runs inside the decode loop, with autograd off, on torch; and
`generate` returns the same tokens with it on and off.

On JAX and TensorFlow `decode_block` is the Keras call and the same numbers are checked."""

import contextlib

import keras
import numpy as np
import pytest

from kzoo.layers import TransformerBlock, fast_decode
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from tests.harness import to_numpy
from tests.test_blocks import _np_block

TORCH = keras.backend.backend() == "torch"

CONFIGS = {
    "gpt2": dict(norm_first=True, causal=True),
    "post_ln": dict(norm_first=False, causal=True, activation="relu"),
    "llama": dict(norm="rmsnorm", feedforward="gated", activation="silu", use_bias=False,
                  num_kv_heads=2, causal=True, rope_max_wavelength=10000),
    "t5_decoder": dict(norm="rmsnorm", activation="relu", use_bias=False, attention_scale=1.0,
                       cross_attention=True, head_dim=3, causal=True),
    "moe": dict(causal=True, feedforward="moe", num_experts=4, top_k=2),
    "gqa": dict(causal=True, num_kv_heads=1),
}


def _no_grad():
    if TORCH:
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _decode(block, x, enc, bias, pad):
    """Step-by-step cached decoding of `x` through `decode_block` inside the loop context."""
    b, t, _ = x.shape
    heads = block.self_attention._kv_heads
    cache = keras.ops.zeros((b, 2, heads, t, block.self_attention._head_dim))
    cross = None
    if block.cross_attention:
        k, v = block.cross_attention_layer.project_key_value(keras.ops.convert_to_tensor(enc))
        cross = keras.ops.transpose(keras.ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))
    outs = []
    with _no_grad(), fast_decode.fast_steps():
        for i in range(t):
            kwargs = dict(padding_mask=keras.ops.convert_to_tensor(pad), cache=cache,
                          cache_index=i)
            if bias is not None:
                kwargs["attention_bias"] = keras.ops.convert_to_tensor(bias[:, :, i:i + 1])
            if cross is not None:
                kwargs.update(cross_cache=cross,
                              encoder_padding_mask=keras.ops.convert_to_tensor(
                                  np.ones(enc.shape[:2], "int32")))
            result = fast_decode.decode_block(block, keras.ops.convert_to_tensor(x[:, i:i + 1]),
                                              **kwargs)
            out, cache = result[0], result[1]
            outs.append(to_numpy(out))
    return np.concatenate(outs, 1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_steps_equal_the_full_causal_pass(name):
    kwargs = CONFIGS[name]
    r = np.random.default_rng(3)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    enc = r.normal(size=(2, 5, 16)).astype("float32")
    bias = r.normal(size=(1, 4, 6, 6)).astype("float32") if name == "t5_decoder" else None
    pad = np.ones((2, 6), "int32")
    block = TransformerBlock(num_heads=4, intermediate_dim=24, **kwargs)
    call = dict(attention_bias=bias)
    if block.cross_attention:
        call["encoder_outputs"] = enc
    full = to_numpy(block(x, **call))  # builds the block
    if "rope_max_wavelength" in kwargs or kwargs.get("feedforward") == "moe":
        expected = full  # the NumPy block has neither rotary positions nor experts
    else:
        expected = _np_block(block, x, None, enc, None, bias)
        np.testing.assert_allclose(full, expected, atol=3e-5, rtol=1e-4)
    got = _decode(block, x, enc, bias, pad)
    np.testing.assert_allclose(got, expected, atol=3e-5, rtol=1e-4)


def test_padding_slots_are_not_attended():
    r = np.random.default_rng(4)
    x = r.normal(size=(2, 5, 16)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=24, causal=True)
    block(x)
    pad = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], "int32")  # row 1 left-padded by 2
    got = _decode(block, x, None, None, pad)
    expected = _np_block(block, x, pad.astype(bool))
    np.testing.assert_allclose(got[:, 2:], expected[:, 2:], atol=3e-5, rtol=1e-4)


def test_fast_path_only_in_the_loop_without_autograd(monkeypatch):
    assert not fast_decode.enabled()  # outside the decode loop
    with fast_decode.fast_steps():
        with _no_grad():
            assert fast_decode.enabled() is TORCH
            assert not fast_decode.enabled(training=True)
            monkeypatch.setenv("KZOO_FAST_DECODE", "0")
            assert not fast_decode.enabled()
            monkeypatch.delenv("KZOO_FAST_DECODE")
        if TORCH:
            assert not fast_decode.enabled()  # autograd on: the Keras path
    assert not fast_decode.enabled()


def test_call_with_cache_outside_the_loop_leaves_the_callers_cache_alone():
    backbone = GPTBackbone(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
                           intermediate_dim=16, max_sequence_length=16)
    cache = backbone.init_cache(1, 8)
    before = to_numpy(cache).copy()
    with _no_grad():
        _, new = backbone.call_with_cache(np.array([[3, 4, 5]]), cache, 0)
    np.testing.assert_array_equal(to_numpy(cache), before)
    assert np.abs(to_numpy(new)).sum() > 0


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_generate_gives_the_same_tokens_with_the_fast_path_off(monkeypatch, style):
    extra = {} if style == "gpt2" else dict(norm="rmsnorm", position="rotary",
                                             feedforward="gated", activation="silu",
                                             num_kv_heads=1, use_bias=False)
    keras.utils.set_random_seed(5)
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=97, num_layers=2, num_heads=2, hidden_dim=16,
                                 intermediate_dim=32, max_sequence_length=40, **extra))
    prompts = [[5, 6, 7, 8], [9, 10]]
    for strategy, kw in (("greedy", {}), ("beam", dict(num_beams=3))):
        fast = lm.generate(prompts, max_new_tokens=12, strategy=strategy, **kw)
        monkeypatch.setenv("KZOO_FAST_DECODE", "0")
        slow = lm.generate(prompts, max_new_tokens=12, strategy=strategy, **kw)
        monkeypatch.delenv("KZOO_FAST_DECODE")
        assert fast == slow
        assert all(len(row) == 12 for row in fast)
