"""TransformerBlock written out in NumPy from its own weights; fit, masks, config."""

import math

import keras
import numpy as np
import pytest

from kzoo.layers import TransformerBlock
from tests.helpers import assert_close, roundtrip_layer, to_numpy
from tests.test_attention import np_attention


def _dense(layer, x):
    out = x @ to_numpy(layer.kernel)
    if layer.use_bias:
        out = out + to_numpy(layer.bias)
    return out


def _np_layernorm(x, norm, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * to_numpy(norm.gamma) + to_numpy(norm.beta)


def _np_rmsnorm(x, norm, eps):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * to_numpy(norm.scale)


def _gelu(x):
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def _np_block(block, x, pad=None, enc=None, enc_pad=None, bias=None):
    eps = block.layer_norm_epsilon
    norm_fn = _np_rmsnorm if block.norm == "rmsnorm" else _np_layernorm

    def mha(layer, h, value, mask, causal, bias_):
        b, t, _ = h.shape
        s = value.shape[1]
        nh, hd, hk = layer.num_heads, layer._head_dim, layer._kv_heads
        q = _dense(layer.query_dense, h).reshape(b, t, nh, hd)
        k = _dense(layer.key_dense, value).reshape(b, s, hk, hd)
        v = _dense(layer.value_dense, value).reshape(b, s, hk, hd)
        o = np_attention(q, k, v, mask=mask, causal=causal, bias=bias_, scale=layer.scale)
        return _dense(layer.output_dense, o.reshape(b, t, nh * hd))

    def ffn(h):
        f = block.feedforward_layer
        if block.feedforward == "gated":
            g = _dense(f.gate_dense, h)
            act = g / (1 + np.exp(-g))  # silu
            return _dense(f.output_dense, act * _dense(f.up_dense, h))
        inner = _dense(f.intermediate_dense, h)
        inner = _gelu(inner) if block.activation == "gelu" else np.maximum(inner, 0)
        return _dense(f.output_dense, inner)

    def sub(h, norm, fn):
        if block.norm_first:
            return h + fn(norm_fn(h, norm, eps))
        return norm_fn(h + fn(h), norm, eps)

    mask = None if pad is None else pad[:, None, None, :]
    x = sub(x, block.self_attention_norm,
            lambda h: mha(block.self_attention, h, h, mask, block.causal, bias))
    if block.cross_attention:
        emask = None if enc_pad is None else enc_pad[:, None, None, :]
        x = sub(x, block.cross_attention_norm,
                lambda h: mha(block.cross_attention_layer, h, enc, emask, False, None))
    return sub(x, block.feedforward_norm, ffn)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(norm_first=False, activation="gelu", layer_norm_epsilon=1e-12),  # BERT
        dict(norm_first=True, causal=True),  # GPT-2
        dict(norm="rmsnorm", feedforward="gated", activation="silu", use_bias=False,
             num_kv_heads=2, causal=True),  # modern decoder
        dict(norm="rmsnorm", activation="relu", use_bias=False, attention_scale=1.0,
             cross_attention=True, head_dim=3),  # T5-like decoder
    ],
)
def test_block_matches_numpy(kwargs):
    r = np.random.default_rng(0)
    x = r.normal(size=(2, 5, 16)).astype("float32")
    enc = r.normal(size=(2, 7, 16)).astype("float32")
    pad = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    enc_pad = np.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    bias = r.normal(size=(1, 4, 5, 5)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, **kwargs)
    call = dict(padding_mask=pad, attention_bias=bias)
    if block.cross_attention:
        call.update(encoder_outputs=enc, encoder_padding_mask=enc_pad)
    out = block(x, **call)
    expected = _np_block(block, x, pad, enc, enc_pad, bias)
    real = pad[:, :, None].repeat(16, -1)
    assert_close(to_numpy(out)[real], expected[real], atol=3e-5, rtol=1e-4)


def test_block_cache_decoding_equals_full_pass():
    r = np.random.default_rng(1)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    enc = r.normal(size=(2, 4, 16)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, causal=True, cross_attention=True,
                             rope_max_wavelength=10000, num_kv_heads=2)
    full = to_numpy(block(x, encoder_outputs=enc))
    cache = keras.ops.zeros((2, 2, 6, 2, 4))
    k, v = block.cross_attention_layer.project_key_value(keras.ops.convert_to_tensor(enc))
    cross = keras.ops.stack([k, v], axis=1)
    outs = []
    for i in range(6):
        out, cache, _ = block(x[:, i:i + 1], cache=cache, cache_index=i, cross_cache=cross)
        outs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=3e-5)


def test_block_with_moe_fits_and_serializes(tmp_path):
    block = TransformerBlock(num_heads=2, intermediate_dim=16, feedforward="moe",
                             num_experts=4, top_k=2, causal=True)
    roundtrip_layer(block)
    inp = keras.Input((8, 16))
    model = keras.Model(inp, keras.layers.Dense(1)(block(inp)))
    # XLA-compiled on JAX and TensorFlow. On torch Keras' jit means torch.compile, which took
    # 260 s for this model on a 2-core CPU; torch trains eagerly here.
    jit = keras.backend.backend() != "torch"
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=jit)
    r = np.random.default_rng(0)
    x = r.normal(size=(32, 8, 16)).astype("float32")
    y = (x.mean(-1, keepdims=True) > 0).astype("float32")
    hist = model.fit(x, y, epochs=6, batch_size=16, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    path = tmp_path / "moe.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(x[:2])), to_numpy(model(x[:2])), atol=1e-5)


def test_block_validation():
    with pytest.raises(ValueError, match="norm"):
        TransformerBlock(num_heads=2, intermediate_dim=8, norm="batchnorm")
    with pytest.raises(ValueError, match="feedforward"):
        TransformerBlock(num_heads=2, intermediate_dim=8, feedforward="conv")
    with pytest.raises(ValueError, match="num_experts"):
        TransformerBlock(num_heads=2, intermediate_dim=8, feedforward="moe")
    with pytest.raises(ValueError, match="intermediate_dim"):
        TransformerBlock(num_heads=2, intermediate_dim=0)
    with pytest.raises(ValueError, match="encoder_outputs"):
        TransformerBlock(num_heads=2, intermediate_dim=8, cross_attention=True)(
            np.zeros((1, 3, 8), "float32"))
