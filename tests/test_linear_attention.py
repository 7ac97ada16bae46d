"""Linear attention: equals the explicit quadratic form of its feature map (causal and not,
forward and gradients), the recurrent step equals the whole-sequence call, FAVOR+ approaches
softmax attention as features grow, and bad parameters raise."""

import math

import numpy as np
import pytest
from keras import ops

from kzoo.layers import kernels
from kzoo.layers.linear_attention import (
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    random_projection,
)
from tests.helpers import assert_close, to_numpy
from tests.test_sparse_attention import grads, largest_intermediate, run

B, N, H, HK, D = 2, 27, 4, 2, 8


def _phi_numpy(x, feature_map, w, scale):
    """The feature maps written out from their papers, in float64."""
    x = np.asarray(x, np.float64)
    if feature_map == "elu":
        return np.where(x > 0, x + 1.0, np.exp(x))
    x = x * math.sqrt(scale)
    wx = x @ np.asarray(w, np.float64).T
    half_sq = 0.5 * np.sum(x * x, axis=-1, keepdims=True)
    if feature_map == "fourier":
        return np.concatenate([np.cos(wx), np.sin(wx)], -1) * np.exp(half_sq) / math.sqrt(len(w))
    return np.exp(wx - half_sq) / math.sqrt(len(w))


def _quadratic_numpy(q, k, v, feature_map, w, causal, pad):
    scale = 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[2] // k.shape[2]
    fq = _phi_numpy(q, feature_map, w, scale)
    fk = np.repeat(_phi_numpy(k, feature_map, w, scale), g, axis=2)
    a = np.einsum("bihm,bjhm->bhij", fq, fk) * pad[:, None, None, :]
    if causal:
        a = a * np.tril(np.ones((q.shape[1], k.shape[1])))
    out = np.einsum("bhij,bjhd->bihd", a, np.repeat(v, g, axis=2).astype(np.float64))
    return out / a.sum(-1).transpose(0, 2, 1)[..., None]


def _quadratic_ops(q, k, v, feature_map, w, causal):
    """The same quadratic form in keras.ops (for gradients), with its own feature maps."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[2] // k.shape[2]

    def phi(x):
        if feature_map == "elu":
            return ops.where(x > 0, x + 1.0, ops.exp(ops.minimum(x, 0.0)))
        x = x * math.sqrt(scale)
        wx = ops.matmul(x, ops.transpose(ops.convert_to_tensor(w)))
        return ops.exp(wx - 0.5 * ops.sum(x * x, axis=-1, keepdims=True)) / math.sqrt(len(w))

    fq, fk = phi(q), ops.repeat(phi(k), g, axis=2)
    a = ops.einsum("bihm,bjhm->bhij", fq, fk)
    if causal:
        a = a * ops.convert_to_tensor(np.tril(np.ones((q.shape[1], k.shape[1]), "float32")))
    out = ops.einsum("bhij,bjhd->bihd", a, ops.repeat(v, g, axis=2))
    return out / ops.expand_dims(ops.transpose(ops.sum(a, axis=-1), (0, 2, 1)), -1)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    q = (0.5 * rng.normal(size=(B, N, H, D))).astype("float32")
    k = (0.5 * rng.normal(size=(B, N, HK, D))).astype("float32")
    v = rng.normal(size=(B, N, HK, D)).astype("float32")
    pad = np.ones((B, N), bool)
    pad[1, 20:] = False
    cot = rng.normal(size=(B, N, H, D)).astype("float32")
    return q, k, v, pad, cot


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("feature_map", ["elu", "fourier", "favor"])
def test_equals_quadratic_form_of_its_feature_map(data, feature_map, causal):
    q, k, v, pad, _ = data
    w = None if feature_map == "elu" else random_projection(16, D, feature_map, seed=3)
    # chunk_size 8 does not divide N: padded chunks and several prefix steps are exercised.
    out = run(lambda q_, k_, v_: linear_attention(q_, k_, v_, feature_map=feature_map,
                                                  causal=causal, mask=pad, projection=w,
                                                  chunk_size=8), [q, k, v])
    want = _quadratic_numpy(q, k, v, feature_map, w, causal, pad)
    assert_close(out, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("feature_map, causal", [("elu", False), ("favor", True)])
def test_gradients_equal_quadratic_form(data, feature_map, causal):
    q, k, v, _, cot = data
    w = None if feature_map == "elu" else random_projection(16, D, feature_map, seed=4)

    def linear(q_, k_, v_):
        return linear_attention(q_, k_, v_, feature_map=feature_map, causal=causal,
                                projection=w, chunk_size=8)

    def quadratic(q_, k_, v_):
        return _quadratic_ops(q_, k_, v_, feature_map, w, causal)

    for got, want in zip(grads(linear, [q, k, v], cot), grads(quadratic, [q, k, v], cot)):
        assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_recurrent_steps_equal_the_causal_call(data):
    q, k, v, _, _ = data
    w = random_projection(16, D, "favor", seed=5)
    whole = to_numpy(linear_attention(q, k, v, feature_map="favor", causal=True, projection=w))
    state = linear_attention_state(B, HK, 16, D)
    outs = []
    # One token at a time, then the rest in one step (prefill-style) on top of the state.
    for t in range(4):
        out, state = linear_attention_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], state,
                                           feature_map="favor", projection=w)
        outs.append(to_numpy(out))
    out, state = linear_attention_step(q[:, 4:], k[:, 4:], v[:, 4:], state,
                                       feature_map="favor", projection=w)
    outs.append(to_numpy(out))
    assert tuple(state[0].shape) == (B, HK, 16, D)  # constant in the length
    assert_close(np.concatenate(outs, axis=1), whole, atol=1e-5, rtol=1e-4)


def test_favor_error_falls_as_features_grow(data):
    q, k, v, _, _ = data
    exact = to_numpy(kernels.reference_attention(q, k, v))
    errors = []
    for m in (16, 64, 256):
        errors.append(np.mean([
            np.abs(run(lambda q_, k_, v_: linear_attention(
                q_, k_, v_, feature_map="favor", num_features=m, seed=s), [q, k, v])
                - exact).mean()
            for s in range(3)]))
    assert errors[0] > errors[1] > errors[2], errors
    # Monte Carlo error ~ 1/sqrt(m): 16 times the features should at least halve it.
    assert errors[2] < 0.5 * errors[0], errors


def test_random_projection_is_seeded_and_orthogonal():
    w = random_projection(20, D, "favor", seed=9)
    np.testing.assert_array_equal(w, random_projection(20, D, "favor", seed=9))
    assert not np.array_equal(w, random_projection(20, D, "favor", seed=10))
    block = w[:D] / np.linalg.norm(w[:D], axis=1, keepdims=True)
    np.testing.assert_allclose(block @ block.T, np.eye(D), atol=1e-5)


def test_causal_never_builds_n_by_n():
    n = 512
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, n, 2, 8)).astype("float32")
    w = random_projection(16, 8, "favor", seed=0)
    biggest = largest_intermediate(
        lambda q_, k_, v_: linear_attention(q_, k_, v_, feature_map="favor", causal=True,
                                            projection=w, chunk_size=32), [x, x, x.copy()])
    assert biggest < n * n // 4, (biggest, n * n)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"feature_map": "relu"}, "feature_map"),
        ({"feature_map": "favor", "num_features": 0}, "num_features"),
        ({"feature_map": "fourier", "num_features": -4}, "num_features"),
        ({"feature_map": "elu", "num_features": 8}, "num_features"),
        ({"feature_map": "favor", "causal": True, "chunk_size": 0}, "chunk_size"),
        ({"feature_map": "favor", "projection": np.ones((8, 3), "float32")}, "projection"),
        ({"mask": np.ones((1, 1, N, N), bool)}, "mask"),
        ({"return_state": True}, "causal"),
    ],
)
def test_bad_parameters_raise_value_error_naming_them(kwargs, field):
    x = np.zeros((1, N, 2, D), "float32")
    with pytest.raises(ValueError, match=field):
        linear_attention(x, x, x, **kwargs)
