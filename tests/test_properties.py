"""Property tests (hypothesis): every attention kernel agrees with a NumPy formula.

For each kernel that `kzoo.layers.dot_product_attention(kernel=...)` offers ("reference",
"fused", "chunked", and "auto"), hypothesis draws the batch, the query and key lengths
(queries may outnumber keys), the number of key/value heads and the grouped-query ratio, the
head size, a causal flag, an optional boolean mask (per head or shared across heads, with
fully masked rows forced in), an optional additive bias, an optional scale, and for the
chunked kernel block sizes small enough that the online softmax runs over several blocks.
The expected output is computed here in float64 NumPy, straight from the definition:

    out[b, t, h] = sum_s softmax_s(q[b, t, h] . k[b, s, h // g] * scale + bias[b, h, t, s],
                                   over the keys s that may be seen) v[b, s, h // g]

with causal masking bottom-right aligned (query t sees key s when s <= t + k_len - q_len),
and a row that may see no key giving zeros (kzoo's convention, see `kzoo/layers/kernels.py`;
never NaN). Examples are derandomized, so CI sees the same cases every run.
"""

import contextlib

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kzoo.layers import dot_product_attention
from kzoo.layers import kernels

KERNELS = ("reference", "fused", "chunked", "auto")
assert set(KERNELS) == set(kernels.KERNELS), "a new kernel needs its property test"

# Keras warns about a softmax over one key (k_len == 1), a case drawn on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:You are using a softmax over axis")

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow])


def numpy_attention(q, k, v, mask, bias, is_causal, scale):
    """The definition, in float64 (see the module docstring)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    k = np.repeat(k, h // hk, axis=2)  # query head i reads key/value head i // (h // hk)
    v = np.repeat(v, h // hk, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    allowed = np.ones((b, h, t, s), bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask, (b, h, t, s))
    if is_causal:
        allowed &= np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)
    any_key = allowed.any(axis=-1, keepdims=True)
    scores = np.where(allowed, scores, -np.inf)
    top = np.where(any_key, scores.max(axis=-1, keepdims=True), 0.0)
    e = np.where(allowed, np.exp(scores - top), 0.0)
    weights = e / np.where(any_key, e.sum(axis=-1, keepdims=True), 1.0)
    return np.einsum("bhts,bshd->bthd", weights, v)


@st.composite
def attention_case(draw, kernel):
    batch = draw(st.integers(1, 2))
    # A few lengths rather than every one: each new shape is a new compilation on JAX and
    # TensorFlow, and these already cover q < k, q == k, q > k and a single key or query.
    q_len = draw(st.sampled_from([1, 3, 6, 9]))
    k_len = draw(st.sampled_from([1, 3, 6, 9]))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))  # heads per key/value head (GQA / MQA ratio)
    heads = kv_heads * group
    head_dim = 8
    is_causal = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, q_len, heads, head_dim)).astype("float32")
    k = rng.normal(size=(batch, k_len, kv_heads, head_dim)).astype("float32")
    v = rng.normal(size=(batch, k_len, kv_heads, head_dim)).astype("float32")
    mask = None
    mask_kind = draw(st.sampled_from(["none", "per_head", "shared", "padding"]))
    if mask_kind != "none":
        shape = {"per_head": (batch, heads, q_len, k_len),
                 "shared": (batch, 1, q_len, k_len),
                 "padding": (batch, 1, 1, k_len)}[mask_kind]
        density = draw(st.sampled_from([0.3, 0.7, 1.0]))
        mask = rng.random(shape) < density
        if draw(st.booleans()):  # a fully masked row (or, for padding, a fully masked batch)
            index = tuple(int(rng.integers(n)) for n in shape[:-1])
            mask[index] = False
    bias = None
    if draw(st.booleans()):
        bias = rng.normal(size=(batch, heads, q_len, k_len)).astype("float32")
    scale = draw(st.sampled_from([None, 1.0, 0.3]))
    blocks = None
    if kernel == "chunked":
        blocks = draw(st.sampled_from([None, (2, 3), (4, 2), (3, 3)]))
    return q, k, v, mask, bias, is_causal, scale, blocks


@contextlib.contextmanager
def block_sizes(blocks):
    """Small chunked-kernel tiles (so that one call spans several blocks)."""
    if blocks is None:
        yield
        return
    saved = kernels.DEFAULT_BLOCK_SIZE, dict(kernels.BLOCK_SIZES)
    kernels.DEFAULT_BLOCK_SIZE = max(blocks)
    kernels.BLOCK_SIZES[keras.backend.backend()] = blocks
    try:
        yield
    finally:
        kernels.DEFAULT_BLOCK_SIZE = saved[0]
        kernels.BLOCK_SIZES.clear()
        kernels.BLOCK_SIZES.update(saved[1])


def _check(kernel, case):
    q, k, v, mask, bias, is_causal, scale, blocks = case
    with block_sizes(blocks):
        out = dot_product_attention(q, k, v, mask=mask, bias=bias, is_causal=is_causal,
                                    scale=scale, kernel=kernel)
    out = keras.ops.convert_to_numpy(out)
    assert out.shape == q.shape
    assert np.isfinite(out).all(), "attention output has NaN/inf"
    used_scale = scale if scale is not None else q.shape[-1] ** -0.5
    expected = numpy_attention(q, k, v, mask, bias, is_causal, used_scale)
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-5)


@pytest.mark.spread
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_matches_numpy_formula(kernel):
    @SETTINGS
    @given(attention_case(kernel))
    def check(case):
        _check(kernel, case)

    check()


def test_fully_masked_rows_give_zeros_on_every_kernel():
    """The convention the property relies on, shown on one explicit case."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 3, 2, 4)).astype("float32")
    k = v = rng.normal(size=(1, 5, 2, 4)).astype("float32")
    mask = np.ones((1, 1, 3, 5), bool)
    mask[0, 0, 1] = False
    for kernel in KERNELS:
        out = keras.ops.convert_to_numpy(dot_product_attention(q, k, v, mask=mask,
                                                                kernel=kernel))
        np.testing.assert_array_equal(out[0, 1], np.zeros((2, 4), np.float32))
        assert np.abs(out[0, 0]).sum() > 0


def test_rows_emptied_by_mask_and_causal_together_give_zeros_on_every_kernel():
    """Found by the property above (JAX's fused kernel, equal lengths): query 0 may only see
    key 0 causally, and the mask hides key 0, so its row sees nothing; neither the mask nor
    the causal flag alone empties it."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 4, 2, 8)).astype("float32")
    k = v = rng.normal(size=(1, 4, 1, 8)).astype("float32")
    mask = np.ones((1, 1, 4, 4), bool)
    mask[0, 0, 0, 0] = False
    for kernel in KERNELS:
        out = keras.ops.convert_to_numpy(dot_product_attention(q, k, v, mask=mask,
                                                                is_causal=True, kernel=kernel))
        np.testing.assert_array_equal(out[0, 0], np.zeros((2, 8), np.float32), err_msg=kernel)
        np.testing.assert_allclose(out, numpy_attention(q, k, v, mask, None, True, 8 ** -0.5),
                                   rtol=2e-4, atol=2e-5, err_msg=kernel)
