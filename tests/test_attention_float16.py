"""float16 attention whose raw products `q . k` pass float16's largest value (65504).

Every kernel and the weights path must give the formula's finite numbers there: the queries
are multiplied by the scale before the product, so that only the scaled scores (well inside
float16's range) are ever formed in float16.
"""

import keras
import numpy as np
import pytest
from keras import ops

from kzoo.layers import dot_product_attention
from kzoo.layers.attention import MultiHeadAttention
from kzoo.layers.kernels import reference_attention
from tests.harness import to_numpy

F16_MAX = float(np.finfo(np.float16).max)


def _np_softmax_attention(q, k, v, scale):
    """(output `(b, t, h, d)`, weights `(b, h, t, s)`) of softmax(q k^T * scale) v in
    float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    e = np.exp(scores - scores.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v), p


def _large_data(d=64, seed=0):
    """float16 q, k with entries in [20, 60] (raw products ~100,000 > 65504) and values
    ~N(0, 1)."""
    r = np.random.default_rng(seed)
    q = r.uniform(20, 60, size=(2, 8, 2, d)).astype("float16")
    k = r.uniform(20, 60, size=(2, 8, 2, d)).astype("float16")
    v = r.normal(size=(2, 8, 2, d)).astype("float16")
    return q, k, v


# scale 2**-11 (a power of two: the scaled queries are exact in float16) leaves the scores
# ~50 apart by ~2 between keys, so the weights spread over several keys; the default
# 64 ** -0.5 = 1/8 leaves scores ~12,800 whose float16 spacing (8) makes the weights nearly
# one-hot, checked against the float64 formula with a tolerance for that spacing.
CASES = {"spread": (2.0 ** -11, 3e-2), "default_scale": (None, 0.25)}


def _check(out, q, k, v, scale, atol):
    want, _ = _np_softmax_attention(q, k, v, 64 ** -0.5 if scale is None else scale)
    got = to_numpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "float16 attention gave NaN / inf"
    np.testing.assert_allclose(got, want, atol=atol)


def test_the_raw_products_overflow_float16():
    q, k, _ = _large_data()
    raw = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k.astype(np.float64))
    assert raw.min() > F16_MAX


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kernel", ["reference", "fused", "chunked", "auto"])
def test_float16_kernels_beyond_float16_products(kernel, case):
    scale, atol = CASES[case]
    q, k, v = _large_data()
    out = dot_product_attention(*(ops.convert_to_tensor(x) for x in (q, k, v)),
                                scale=scale, kernel=kernel)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    _check(out, q, k, v, scale, atol)


@pytest.mark.parametrize("case", sorted(CASES))
def test_float16_reference_attention_and_its_weights(case):
    scale, atol = CASES[case]
    q, k, v = _large_data()
    args = [ops.convert_to_tensor(x) for x in (q, k, v)]
    _check(reference_attention(*args, scale=scale), q, k, v, scale, atol)
    out, weights = dot_product_attention(*args, scale=scale, return_weights=True)
    _check(out, q, k, v, scale, atol)
    _, want = _np_softmax_attention(q, k, v, 64 ** -0.5 if scale is None else scale)
    w = to_numpy(weights).astype(np.float64)
    assert np.isfinite(w).all()
    np.testing.assert_allclose(w, want, atol=atol)


@pytest.mark.parametrize("case", sorted(CASES))
def test_float16_mha_explicit_weights_path(case):
    """MultiHeadAttention with return_attention_weights=True in float16: identity projections
    without biases make its q, k and v the input itself (one head of 64)."""
    scale, atol = CASES[case]
    q, _, _ = _large_data()
    x = q[:, :, 0, :]  # (2, 8, 64)
    layer = MultiHeadAttention(num_heads=1, use_bias=False, scale=scale, dtype="float16",
                               kernel_initializer="identity")
    out, weights = layer(ops.convert_to_tensor(x), return_attention_weights=True)
    xs = x[:, :, None, :]
    want_out, want_w = _np_softmax_attention(xs, xs, xs, 64 ** -0.5 if scale is None else scale)
    w = to_numpy(weights).astype(np.float64)
    assert np.isfinite(w).all(), "float16 attention weights gave NaN / inf"
    np.testing.assert_allclose(w, want_w, atol=atol)
    got = to_numpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    # (values of size ~40: the output's tolerance scales with them)
    np.testing.assert_allclose(got, want_out[:, :, 0, :], atol=atol * 60)
