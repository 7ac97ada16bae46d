"""Public layer functions given hostile input: a ValueError that names the argument, the
same on every backend, instead of a backend's own error deep inside (or a silently wrong
result); and the edge cases that are valid still give the NumPy formula's numbers."""

import numpy as np
import pytest
from keras import ops

from kzoo.layers import dot_product_attention
from kzoo.layers.position import ALiBiBias
from kzoo.layers.position import PositionEmbedding
from kzoo.layers.position import RelativePositionBias
from kzoo.layers.position import RotaryEmbedding
from kzoo.layers.position import SinusoidalPositionEncoding
from tests.harness import assert_close, backend, to_numpy

KERNELS = ["auto", "reference", "fused", "chunked"]
INT32_MAX = 2**31 - 1


def _qkv(b=2, t=5, s=None, h=4, hk=None, d=8, seed=0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, t, h, d)).astype("float32")
    k = r.normal(size=(b, s or t, hk or h, d)).astype("float32")
    v = r.normal(size=(b, s or t, hk or h, d)).astype("float32")
    return q, k, v


# === dot_product_attention ===


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_head_dim_is_refused_by_name(kernel):
    # Was a ZeroDivisionError (the default scale 1 / sqrt(0)) on every backend; with an
    # explicit scale an empty output.
    q = np.zeros((1, 4, 2, 0), "float32")
    for scale in (None, 1.0):
        with pytest.raises(ValueError, match=r"`head_dim` .* got 0;"):
            dot_product_attention(q, q, q, scale=scale, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_float_inputs_are_refused_by_name(kernel):
    # Were integer outputs in silence on JAX and TensorFlow (softmax weights truncated to 0
    # or 1), a RuntimeError from torch's kernels, and for booleans errors of each backend.
    q, k, v = _qkv()
    ints = (np.round(q * 3).astype("int32"), np.round(k * 3).astype("int32"))
    with pytest.raises(ValueError, match="`query` must have a floating-point dtype.*int32"):
        dot_product_attention(ints[0], ints[1], v, kernel=kernel)
    with pytest.raises(ValueError, match="`key` must have a floating-point dtype.*int32"):
        dot_product_attention(q, ints[1], v, kernel=kernel)
    with pytest.raises(ValueError, match="`value` must have a floating-point dtype.*bool"):
        dot_product_attention(q, k, v > 0, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_float_mask_is_refused_and_integer_masks_still_work(kernel):
    # A float mask was cast to bool on every backend: an additive mask (0 = attend,
    # -1e9 = not) was read the other way round, a silently wrong output.
    q, k, v = _qkv()
    allowed = np.tril(np.ones((5, 5), bool))[None, None]
    for mask in (np.where(allowed, 0.0, -1e9), allowed.astype("float32")):
        with pytest.raises(ValueError, match=r"`mask` must be boolean .*float.*`bias`"):
            dot_product_attention(q, k, v, mask=mask.astype("float32"), kernel=kernel)
    want = dot_product_attention(q, k, v, mask=allowed, kernel=kernel)
    assert_close(dot_product_attention(q, k, v, mask=allowed.astype("int32"), kernel=kernel),
                 want)
    assert_close(dot_product_attention(q, k, v, bias=np.where(allowed, 0.0, -1e9).astype(
        "float32"), kernel=kernel), want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_heads_are_refused_by_name(kernel):
    # No key/value heads was a ZeroDivisionError (`heads % kv_heads`); no query heads an
    # empty reshape error on torch, and an empty output from some kernels.
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="at least one head"):
        dot_product_attention(q, k[:, :, :0], v[:, :, :0], kernel=kernel)
    with pytest.raises(ValueError, match="at least one head"):
        dot_product_attention(q[:, :, :0], k[:, :, :1], v[:, :, :1], kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", ["plain", "gqa_causal_mask_bias"])
def test_empty_batch_gives_an_empty_output(kernel, case):
    # torch's chunked kernel failed in keras' `ops.max` ("Cannot compute the max of an empty
    # tensor"); every other kernel and backend returned the empty output.
    if case == "plain":
        q, k, v = _qkv(b=0, t=5, s=7)
        kwargs = {}
    else:
        q, k, v = _qkv(b=0, t=5, s=7, h=4, hk=2)
        kwargs = dict(is_causal=True, mask=np.ones((0, 1, 1, 7), bool),
                      bias=np.zeros((1, 4, 5, 7), "float32"))
    out = dot_product_attention(q, k, v, kernel=kernel, **kwargs)
    assert tuple(out.shape) == (0, 5, 4, 8)
    assert to_numpy(out).dtype == np.float32
    # An empty sequence of queries, by contrast, is refused by name.
    q, k, v = _qkv(b=1, t=5)
    with pytest.raises(ValueError, match="`query` has no positions"):
        dot_product_attention(q[:, :0], k, v, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_smallest_valid_attention_matches_numpy_softmax(kernel):
    """head_dim 1 (the default scale is 1), one query, or one key, grouped heads: still the
    formula softmax(q k^T / sqrt(d)) v, written here in NumPy."""
    def np_attention(q, k, v):
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
        g = q.shape[2] // k.shape[2]
        k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
        scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
        e = np.exp(scores - scores.max(-1, keepdims=True))
        return np.einsum("bhts,bshd->bthd", e / e.sum(-1, keepdims=True), v)

    for t, s, h, hk, d in ((1, 3, 2, 1, 1), (3, 1, 2, 2, 4), (1, 1, 1, 1, 1)):
        q, k, v = _qkv(b=2, t=t, s=s, h=h, hk=hk, d=d, seed=t + 10 * s)
        out = dot_product_attention(q, k, v, kernel=kernel)
        assert tuple(out.shape) == (2, t, h, d)
        assert_close(out, np_attention(q, k, v), atol=2e-6, rtol=2e-6)
    # One key: every query's output is that key's value, exactly.
    q, k, v = _qkv(b=2, t=3, s=1, h=2, d=4)
    np.testing.assert_allclose(to_numpy(dot_product_attention(q, k, v, kernel=kernel)),
                               np.broadcast_to(v, (2, 3, 2, 4)), rtol=1e-6, atol=1e-6)


# === Position layers' start_index ===


@pytest.mark.parametrize("start_index", [2**31, 2**40, INT32_MAX - 1])
def test_rope_start_index_past_int32_positions_is_refused(start_index):
    # Positions are int32: JAX raised an OverflowError from 2**31 on, torch and TensorFlow
    # wrapped them round to negative positions in silence (INT32_MAX - 1 with 3 tokens
    # puts the last token at 2**31).
    x = np.random.default_rng(0).normal(size=(1, 3, 2, 8)).astype("float32")
    rope = RotaryEmbedding()
    with pytest.raises(ValueError, match=r"`start_index` .*must be <= 2147483647 \(positions "
                                         r"are int32\); got start_index=\d+ and a sequence "
                                         r"of length 3"):
        rope(x, start_index=start_index)
    with pytest.raises(ValueError, match="non-negative"):
        rope(x, start_index=-1)
    # The last start that fits works; a tensor start_index stays unchecked (traced) and
    # agrees with the Python int.
    assert tuple(rope(x, start_index=INT32_MAX - 2).shape) == (1, 3, 2, 8)
    tensor_start = ops.convert_to_tensor(37, dtype="int32")
    if backend() == "jax":
        import jax

        traced = jax.jit(lambda x, s: rope(x, start_index=s))(x, tensor_start)
    else:
        traced = rope(x, start_index=tensor_start)
    np.testing.assert_allclose(to_numpy(traced), to_numpy(rope(x, start_index=37)), atol=1e-6)
    per_row = ops.convert_to_tensor([37], dtype="int32")
    np.testing.assert_allclose(to_numpy(rope(x, start_index=per_row)),
                               to_numpy(rope(x, start_index=37)), atol=1e-6)


@pytest.mark.parametrize("layer", ["sinusoidal", "alibi", "relative"])
def test_other_position_layers_refuse_start_index_past_int32(layer):
    # The same int32 positions (`_positions`) and the same check as RotaryEmbedding.
    x = np.zeros((1, 3, 4), "float32")
    make = {"sinusoidal": SinusoidalPositionEncoding, "alibi": lambda: ALiBiBias(2),
            "relative": lambda: RelativePositionBias(2)}[layer]
    for start_index in (2**40, INT32_MAX - 1):
        with pytest.raises(ValueError, match=r"`start_index` .*\(positions are int32\)"):
            make()(x, start_index=start_index)
    assert np.isfinite(to_numpy(make()(x, start_index=INT32_MAX - 2))).all()  # the last fits



@pytest.mark.parametrize("layer", ["rotary", "sinusoidal", "alibi", "relative"])
def test_numpy_scalar_start_index_is_checked_as_a_python_int(layer):
    # Keras makes a tensor of a NumPy call argument before `call`, so an np.int64 past int32
    # skipped the check above and its positions wrapped round (a 0-d array too).
    rng = np.random.default_rng(0)
    if layer == "rotary":
        x, make = rng.normal(size=(1, 3, 2, 8)).astype("float32"), RotaryEmbedding
    else:
        x = rng.normal(size=(1, 3, 4)).astype("float32")
        make = {"sinusoidal": SinusoidalPositionEncoding, "alibi": lambda: ALiBiBias(2),
                "relative": lambda: RelativePositionBias(2)}[layer]
    for start_index in (np.int64(INT32_MAX - 1), np.array(2**40), np.uint64(2**63)):
        with pytest.raises(ValueError, match=r"`start_index` .*\(positions are int32\)"):
            make()(x, start_index=start_index)
    for start_index in (np.int64(-1), np.float32(2.0), np.array(2.5), np.bool_(True)):
        with pytest.raises(ValueError, match="`start_index` must be a non-negative integer"):
            make()(x, start_index=start_index)
    if layer in ("alibi", "relative"):  # (query, key, start_index) given by position: Keras
        # takes only tensors there, and asks for the keyword, as it does for a Python int
        with pytest.raises(ValueError, match="should be passed as a keyword argument"):
            make()(x, x, np.int64(INT32_MAX))
    # A NumPy integer that fits gives what the same Python int gives.
    one = make()  # (the relative bias's table is drawn at random: one layer for both)
    for start_index in (np.int32(5), np.array(5, dtype="int64")):
        np.testing.assert_allclose(to_numpy(one(x, start_index=start_index)),
                                   to_numpy(one(x, start_index=5)), atol=1e-6)



def test_learned_positions_refuse_a_numpy_start_index_past_the_table():
    # Before: np.int64(10) into a table of 8 rows gave rows 5-7 in silence on torch and JAX
    # (the slice clamped), a Slice error deep in TensorFlow; a Python 10 was refused by name.
    x = np.zeros((1, 3, 4), "float32")
    layer = PositionEmbedding(8)
    for start_index in (10, np.int64(10), np.array(6)):
        with pytest.raises(ValueError, match=r"start_index \+ sequence length must be <= "
                                             r"sequence_length=8; got start_index=(10|6)"):
            layer(x, start_index=start_index)
    table = to_numpy(layer.embeddings)
    np.testing.assert_allclose(to_numpy(layer(x, start_index=np.int64(5)))[0], table[5:8])


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_key_attends_without_a_warning(kernel):
    # One key is valid attention (a one-token sequence): the reference kernel on torch and
    # TensorFlow passed on Keras' "softmax over an axis of size 1" UserWarning.
    import warnings

    q, k, v = _qkv(t=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = dot_product_attention(q, k, v, kernel=kernel)
    assert_close(to_numpy(out), v, atol=1e-6)  # the one key's value, whatever the score


@pytest.mark.parametrize("kernel", KERNELS)
def test_keys_and_values_of_another_float_dtype_run_in_the_querys(kernel):
    # torch's kernels and JAX's fused kernel refused float32 keys/values beside float16
    # queries, the other kernels ran them: every kernel now casts them to the query's dtype.
    q, k, v = _qkv(t=3, h=2, d=4)
    out = dot_product_attention(q.astype("float16"), k, v, kernel=kernel)
    assert "float16" in str(out.dtype)
    scores = np.einsum("bthd,bshd->bhts", q.astype("float16").astype("float32"),
                       k.astype("float16").astype("float32")) / 2.0
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhts,bshd->bthd", weights, v.astype("float16").astype("float32"))
    assert_close(to_numpy(out).astype("float32"), expected, atol=1e-2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_symbolic_inputs_give_the_output_spec(kernel):
    # On keras.Input (a functional model being built) torch's fused and chunked kernels
    # failed on KerasTensors ("no attribute 'transpose'"); an unknown head_dim without a
    # scale was a TypeError (JAX) or passed (torch). Now the spec on every backend, and the
    # unknown head_dim refused by name.
    import keras

    q, k = keras.Input(shape=(3, 2, 4)), keras.Input(shape=(5, 1, 4))
    out = dot_product_attention(q, k, k, kernel=kernel, is_causal=True)
    assert isinstance(out, keras.KerasTensor) and tuple(out.shape) == (None, 3, 2, 4)
    out, weights = dot_product_attention(q, k, k, return_weights=True)
    assert tuple(weights.shape) == (None, 2, 3, 5)
    unknown = keras.Input(shape=(3, 2, None))
    with pytest.raises(ValueError, match=r"`head_dim` .* must be known .* pass `scale`"):
        dot_product_attention(unknown, unknown, unknown, kernel=kernel)
    if kernel != "chunked":  # (TensorFlow's chunked kernel needs a known head_dim)
        assert tuple(dot_product_attention(unknown, unknown, unknown, scale=0.5,
                                           kernel=kernel).shape) == (None, 3, 2, None)


# === MultiHeadAttention ===


def test_multi_head_attention_refuses_an_additive_float_mask():
    # A float attention_mask was cast to bool: an additive mask (0 = attend, -1e9 = not)
    # was read the other way round, in silence. 0 / 1 floats (a padding mask given as
    # floats) still work, as the booleans they hold.
    from kzoo.layers import MultiHeadAttention

    mha = MultiHeadAttention(num_heads=2, head_dim=4)
    x = np.random.default_rng(0).normal(size=(1, 3, 8)).astype("float32")
    allowed = np.tril(np.ones((3, 3), bool))[None]
    want = to_numpy(mha(x, attention_mask=allowed))
    assert_close(to_numpy(mha(x, attention_mask=allowed.astype("float32"))), want)
    with pytest.raises(ValueError, match=r"`attention_mask` must be boolean .* got "
                                         r"-1000000000\.0 .*goes in `attention_bias`"):
        mha(x, attention_mask=np.where(allowed, 0.0, -1e9).astype("float32"))


# === Initialiser arguments ===


def _initializer_cases():
    from kzoo.layers import (FeedForward, GatedFeedForward, MixtureOfExperts,
                             MultiHeadAttention, RMSNorm, TokenEmbedding, TransformerBlock)
    from kzoo.layers.embedding import PatchEmbedding

    return [
        (MultiHeadAttention, dict(num_heads=2), "kernel_initializer"),
        (MultiHeadAttention, dict(num_heads=2), "bias_initializer"),
        (MultiHeadAttention, dict(num_heads=2), "query_initializer"),
        (MultiHeadAttention, dict(num_heads=2), "key_value_initializer"),
        (MultiHeadAttention, dict(num_heads=2), "output_kernel_initializer"),
        (FeedForward, dict(intermediate_dim=8), "kernel_initializer"),
        (FeedForward, dict(intermediate_dim=8), "bias_initializer"),
        (GatedFeedForward, dict(intermediate_dim=8), "output_kernel_initializer"),
        (MixtureOfExperts, dict(num_experts=2, intermediate_dim=8), "kernel_initializer"),
        (MixtureOfExperts, dict(num_experts=2, intermediate_dim=8), "bias_initializer"),
        (MixtureOfExperts, dict(num_experts=2, intermediate_dim=8), "router_initializer"),
        (MixtureOfExperts, dict(num_experts=2, intermediate_dim=8),
         "output_kernel_initializer"),
        (RMSNorm, dict(), "scale_initializer"),
        (TokenEmbedding, dict(vocabulary_size=5, embedding_dim=4), "embeddings_initializer"),
        (PatchEmbedding, dict(patch_size=2, hidden_dim=4), "kernel_initializer"),
        (PatchEmbedding, dict(patch_size=2, hidden_dim=4), "bias_initializer"),
        (TransformerBlock, dict(num_heads=2, intermediate_dim=8), "kernel_initializer"),
        (TransformerBlock, dict(num_heads=2, intermediate_dim=8), "query_initializer"),
        (TransformerBlock, dict(num_heads=2, intermediate_dim=8), "feedforward_initializer"),
        (TransformerBlock, dict(num_heads=2, intermediate_dim=8), "router_initializer"),
    ]


@pytest.mark.spread
@pytest.mark.parametrize("case", range(len(_initializer_cases())))
@pytest.mark.parametrize("bad", ["glorot_bogus", 3, [1.0]])
def test_bad_initializers_are_refused_by_name(case, bad):
    # Were Keras' "Could not interpret initializer identifier: glorot_bogus", naming neither
    # the argument nor what is allowed (PositionEmbedding and RelativePositionBias already
    # named theirs).
    cls, kwargs, argument = _initializer_cases()[case]
    with pytest.raises(ValueError, match=rf"`{argument}` must be a Keras initializer, its "
                                         rf"name .* got {argument}="):
        cls(**kwargs, **{argument: bad})
    cls(**kwargs, **{argument: "zeros"})  # a good one still works
