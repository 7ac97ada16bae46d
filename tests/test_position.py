"""Tests of kzoo.layers.position against NumPy formulas written here (and HF T5 for buckets)."""

import math

import keras
import numpy as np
import pytest
from keras import ops

from kzoo.layers.position import ALiBiBias
from kzoo.layers.position import PositionEmbedding
from kzoo.layers.position import RelativePositionBias
from kzoo.layers.position import RotaryEmbedding
from kzoo.layers.position import SinusoidalPositionEncoding
from kzoo.layers.position import alibi_slopes
from kzoo.layers.position import relative_position_bucket
from kzoo.layers.position import rope_inverse_frequencies
from tests.harness import assert_close, backend, ref, rng, roundtrip_layer, to_numpy

# --- NumPy references -------------------------------------------------------------------


def np_sinusoidal(positions, dim, base=10000.0):
    table = np.zeros((len(positions), dim))
    for p_idx, pos in enumerate(positions):
        for j in range(dim):
            i = j // 2
            angle = pos / base ** (2.0 * i / dim)
            table[p_idx, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return table


# x: (batch, seq, heads, d), float64; rotate-half or interleaved pairs. In tests/harness.py.
np_rope = ref.rope  # (x, positions, base=10000.0, scale=1.0, interleaved=False)


def np_t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Mesh-TF/HF T5 bucketing, with the float32 arithmetic of the original."""
    rel = np.asarray(relative_position, dtype=np.int64)
    out = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        out += (rel > 0).astype(np.int64) * num_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    safe = np.where(is_small, max_exact, rel).astype(np.float32)
    val = (
        np.log(safe / np.float32(max_exact))
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    ).astype(np.float32)
    large = np.minimum(max_exact + val.astype(np.int64), num_buckets - 1)
    return out + np.where(is_small, rel, large)


def compiled(fn):
    """Compile `fn` with the backend's tracer, to show that tensor start indices trace."""
    if backend() == "jax":
        import jax

        return jax.jit(fn)
    if backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def scalar(value):
    return ops.convert_to_tensor(value, dtype="int32")


# --- Sinusoidal -------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [8, 7])
@pytest.mark.parametrize("start_index", [0, 5])
def test_sinusoidal_table(dim, start_index):
    x = rng().normal(size=(2, 6, dim)).astype("float32")
    out = SinusoidalPositionEncoding()(x, start_index=start_index)
    assert tuple(out.shape) == (2, 6, dim)
    expected = np_sinusoidal(np.arange(start_index, start_index + 6), dim)
    assert_close(out, np.broadcast_to(expected, (2, 6, dim)), atol=2e-6)


def test_sinusoidal_hand_values_and_base():
    # position 1, dim 4, base 100: [sin 1, cos 1, sin(1/10), cos(1/10)].
    out = SinusoidalPositionEncoding(max_wavelength=100)(np.zeros((1, 2, 4), "float32"))
    expected = [[0, 1, 0, 1], [math.sin(1), math.cos(1), math.sin(0.1), math.cos(0.1)]]
    assert_close(out[0], expected, atol=1e-6)


def test_sinusoidal_large_positions_and_tensor_start():
    x = np.zeros((1, 4, 16), "float32")
    layer = SinusoidalPositionEncoding()
    out = compiled(lambda x, s: layer(x, start_index=s))(x, scalar(1000))
    expected = np_sinusoidal(np.arange(1000, 1004), 16)
    assert_close(out[0], expected, atol=3e-4)


# --- Learned ----------------------------------------------------------------------------


def test_position_embedding_rows_int_and_tensor_start():
    layer = PositionEmbedding(sequence_length=10)
    x = np.zeros((3, 4, 5), "float32")
    layer.build(x.shape)
    assert layer.embeddings.path.endswith("embeddings")
    assert tuple(layer.embeddings.shape) == (10, 5)
    table = rng(1).normal(size=(10, 5)).astype("float32")
    layer.embeddings.assign(table)

    assert_close(layer(x), np.broadcast_to(table[:4], (3, 4, 5)), atol=0)
    assert_close(layer(x, start_index=6), np.broadcast_to(table[6:10], (3, 4, 5)), atol=0)
    step = compiled(lambda x, s: layer(x, start_index=s))
    for start in (0, 3, 9):
        out = step(x[:, :1], scalar(start))
        assert tuple(out.shape) == (3, 1, 5)
        assert_close(out, np.broadcast_to(table[start : start + 1], (3, 1, 5)), atol=0)
    assert_close(step(x[:, :2], scalar(7)), np.broadcast_to(table[7:9], (3, 2, 5)), atol=0)


def test_position_embedding_is_trainable_and_initializer_used():
    layer = PositionEmbedding(sequence_length=4, initializer="ones")
    out = layer(np.zeros((1, 3, 2), "float32"))
    assert_close(out, np.ones((1, 3, 2)), atol=0)
    assert len(layer.trainable_weights) == 1


# --- Rotary -----------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("start_index,scale,base", [(0, 1.0, 10000), (7, 2.0, 500)])
def test_rope_matches_numpy(interleaved, start_index, scale, base):
    x = rng(2).normal(size=(2, 5, 3, 8)).astype("float32")
    layer = RotaryEmbedding(max_wavelength=base, scaling_factor=scale, interleaved=interleaved)
    out = layer(x, start_index=start_index)
    assert tuple(out.shape) == x.shape
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    positions = np.arange(start_index, start_index + 5)
    expected = np_rope(x.astype(np.float64), positions, base, scale, interleaved)
    assert_close(out, expected, atol=2e-5)
    # Rotations preserve each head vector's norm.
    np.testing.assert_allclose(
        np.linalg.norm(to_numpy(out), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )


def np_llama3_inverse_frequencies(base, dim, factor, low, high, original):
    """Llama 3.1's RoPE rescaling written out frequency by frequency (Meta's
    `apply_scaling`): wavelengths shorter than original / high kept, longer than
    original / low divided by the factor, a linear blend in 1 / wavelength between."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def np_rotate_half(x, positions, inv_freq):
    """Rotate-half RoPE of x (batch, seq, heads, d) with the given inverse frequencies."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    angles = np.asarray(positions, np.float64)[:, None] * np.asarray(inv_freq)[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[None, :, None, :]
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1) * sin


@pytest.mark.parametrize("base, dim, factor, low, high, original", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (10000.0, 16, 8.0, 1.0, 4.0, 8),
    (100.0, 8, 4.0, 0.5, 2.0, 16),
])
def test_rope_llama3_inverse_frequencies_match_numpy(base, dim, factor, low, high, original):
    expected = np_llama3_inverse_frequencies(base, dim, factor, low, high, original)
    got = rope_inverse_frequencies(base, dim, "llama3", factor, low, high, original)
    assert got.dtype == np.float32 and got.shape == (dim // 2,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    plain = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    wavelength = 2 * math.pi / plain
    if dim == 128:  # Meta's model has frequencies in all three bands
        assert (wavelength < original / high).any() and (wavelength > original / low).any()
        assert ((wavelength >= original / high) & (wavelength <= original / low)).any()
    # linear: every frequency divided by the factor; none: the plain ones
    np.testing.assert_allclose(rope_inverse_frequencies(base, dim, "linear", factor),
                               plain / factor, rtol=1e-6)
    np.testing.assert_allclose(rope_inverse_frequencies(base, dim), plain, rtol=1e-6)
    # the layer rotates with them, at positions past the original context (of the small
    # settings: float32 angles near 8192 radians are good to ~1e-3 only, here and in
    # transformers alike)
    layer = RotaryEmbedding(max_wavelength=base, scaling_factor=factor, scaling_type="llama3",
                            low_freq_factor=low, high_freq_factor=high,
                            original_max_position_embeddings=original)
    x = rng(3).normal(size=(2, 4, 2, dim)).astype("float32")
    start = min(original + 3, 40)
    out = layer(x, start_index=start)
    assert_close(out, np_rotate_half(x, np.arange(start, start + 4), expected), atol=2e-5)


def np_yarn(base, dim, factor, original, beta_fast=32.0, beta_slow=1.0, truncate=True,
            attention_factor=None):
    """YaRN (Peng et al. 2023, as its reference code and transformers compute it), one
    frequency at a time: the dimension index where a frequency makes `beta` turns over the
    original context is `dim * ln(original / (2 pi beta)) / (2 ln base)`; between the
    index for beta_fast (floor when truncating) and for beta_slow (ceil), frequency i moves
    linearly from kept to divided by the factor. Returns (inverse frequencies, the factor
    cos and sin are multiplied by: 0.1 ln(factor) + 1 unless given)."""
    def index(beta):
        return dim * math.log(original / (2 * math.pi * beta)) / (2 * math.log(base))

    start, stop = index(beta_fast), index(beta_slow)
    if truncate:
        start, stop = math.floor(start), math.ceil(stop)
    start, stop = max(start, 0), min(stop, dim - 1)
    if start == stop:
        stop += 0.001
    out = []
    for i in range(dim // 2):
        freq = base ** (-2 * i / dim)
        weight = min(max((i - start) / (stop - start), 0.0), 1.0)  # 0: kept, 1: divided
        out.append((1 - weight) * freq + weight * freq / factor)
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    return np.array(out), attention_factor


@pytest.mark.parametrize("base, dim, factor, original, settings", [
    (10000.0, 128, 4.0, 4096, {}),  # Qwen2.5's YaRN settings (factor 4 over 32768 in theirs)
    (500000.0, 64, 8.0, 8192, dict(beta_fast=16.0, beta_slow=2.0, truncate=False)),
    (10000.0, 16, 2.0, 16, dict(attention_factor=1.25)),
    (100.0, 8, 0.5, 64, {}),  # a factor below 1: no attention factor
    (10.0, 4, 4.0, 1, {}),  # every index clipped to 0: an empty band
])
def test_rope_yarn_matches_numpy_and_transformers(base, dim, factor, original, settings):
    expected, scale = np_yarn(base, dim, factor, original, **settings)
    got = rope_inverse_frequencies(base, dim, "yarn", factor,
                                   original_max_position_embeddings=original, **settings)
    assert got.dtype == np.float32 and got.shape == (dim // 2,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    layer = RotaryEmbedding(max_wavelength=base, scaling_factor=factor, scaling_type="yarn",
                            original_max_position_embeddings=original, **settings)
    assert layer.rotation_scale() == pytest.approx(scale, rel=1e-12)
    x = rng(4).normal(size=(2, 5, 2, dim)).astype("float32")
    start = min(original + 2, 40)  # (float32 angles of thousands of radians: ~1e-3 only)
    out = layer(x, start_index=start)
    assert_close(out, scale * np_rotate_half(x, np.arange(start, start + 5), expected),
                 atol=2e-5)
    # transformers' own YaRN (the frequencies and the factor its rotary layer multiplies cos
    # and sin by)
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=dim * 2, num_attention_heads=2, rope_theta=base,
        max_position_embeddings=original, rope_scaling={
            "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": original, **settings})
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    np.testing.assert_allclose(got, theirs.numpy(), rtol=2e-6)
    assert layer.rotation_scale() == pytest.approx(their_scale, rel=1e-7)


def test_rope_conventions_by_hand():
    # head_dim 4, position 1, base 1 => every pair is rotated by exactly 1 radian.
    x = np.zeros((1, 2, 1, 4), "float32")
    x[0, 1, 0] = [1.0, 2.0, 3.0, 4.0]
    c, s = math.cos(1.0), math.sin(1.0)
    half = RotaryEmbedding(max_wavelength=1)(x)
    # pairs (0, 2) and (1, 3)
    assert_close(half[0, 1, 0], [1 * c - 3 * s, 2 * c - 4 * s, 3 * c + 1 * s, 4 * c + 2 * s])
    inter = RotaryEmbedding(max_wavelength=1, interleaved=True)(x)
    # pairs (0, 1) and (2, 3)
    assert_close(inter[0, 1, 0], [1 * c - 2 * s, 2 * c + 1 * s, 3 * c - 4 * s, 4 * c + 3 * s])
    assert_close(half[0, 0, 0], [0, 0, 0, 0])  # position 0 has angle 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    layer = RotaryEmbedding(interleaved=interleaved)
    q = rng(3).normal(size=(1, 6, 2, 16)).astype("float32")
    k = rng(4).normal(size=(1, 6, 2, 16)).astype("float32")

    def scores(offset):
        qr = to_numpy(layer(q, start_index=offset)).astype(np.float64)
        kr = to_numpy(layer(k, start_index=offset)).astype(np.float64)
        return np.einsum("bqhd,bkhd->bhqk", qr, kr)

    base = scores(0)
    np.testing.assert_allclose(scores(37), base, atol=2e-4)
    np.testing.assert_allclose(to_numpy(layer(q, start_index=scalar(37))),
                               to_numpy(layer(q, start_index=37)), atol=1e-6)
    # ... and do depend on it (the test can fail): unrotated scores differ.
    assert not np.allclose(base, np.einsum("bqhd,bkhd->bhqk", q, k), atol=1e-2)


def test_rope_bfloat16_layer_keeps_dtype():
    x = ops.cast(rng(5).normal(size=(1, 4, 2, 8)), "bfloat16")
    out = RotaryEmbedding(dtype="bfloat16")(x, start_index=3)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    expected = np_rope(to_numpy(ops.cast(x, "float32")).astype(np.float64), np.arange(3, 7))
    assert_close(ops.cast(out, "float32"), expected, atol=3e-2, rtol=1e-2)


# --- ALiBi ------------------------------------------------------------------------------


def test_alibi_slopes():
    assert_close(ALiBiBias(8).slopes(), [2.0**-k for k in range(1, 9)], atol=0, rtol=1e-12)
    eight = [2.0**-k for k in range(1, 9)]
    sixteen = [2.0 ** (-0.5 * k) for k in range(1, 17)]
    expected_12 = eight + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
    assert_close(alibi_slopes(12), expected_12, atol=0, rtol=1e-12)
    assert_close(alibi_slopes(12), eight + sixteen[0::2][:4], atol=0, rtol=1e-12)
    assert_close(alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3], rtol=1e-12)
    assert_close(alibi_slopes(1), [2**-8], rtol=1e-12)
    assert_close(alibi_slopes(16), sixteen, rtol=1e-12)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_alibi_bias_values(bidirectional):
    heads, q_len, k_len, start = 12, 3, 7, 4
    layer = ALiBiBias(heads, bidirectional=bidirectional)
    query = np.zeros((2, q_len, heads, 4), "float32")
    key = np.zeros((2, k_len, heads, 4), "float32")
    slopes = np.array([2.0**-k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5])
    dist = (start + np.arange(q_len))[:, None] - np.arange(k_len)[None, :]
    dist = np.abs(dist) if bidirectional else dist
    expected = (-slopes[:, None, None] * dist[None])[None]

    out = layer(query, key, start_index=start)
    assert tuple(out.shape) == (1, heads, q_len, k_len)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    assert_close(out, expected, atol=1e-6)
    traced = compiled(lambda q, k, s: layer(q, k, start_index=s))(query, key, scalar(start))
    assert_close(traced, expected, atol=1e-6)
    # key defaults to query, positions from 0.
    self_dist = np.arange(q_len)[:, None] - np.arange(q_len)[None, :]
    self_dist = np.abs(self_dist) if bidirectional else self_dist
    assert_close(layer(query), (-slopes[:, None, None] * self_dist[None])[None], atol=1e-6)


# --- T5 relative position buckets -------------------------------------------------------

BUCKET_CONFIGS = [
    (True, 32, 128),
    (False, 32, 128),
    (True, 64, 256),
    (False, 16, 32),
    (True, 8, 20),
    (True, 6, 100),  # bucket edges fall on exact float boundaries (distance 10)
    (False, 20, 1000),
    (False, 128, 100),
    (True, 256, 100),
    (True, 33, 77),
]


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance", BUCKET_CONFIGS)
def test_t5_buckets_match_numpy(bidirectional, num_buckets, max_distance):
    rel = np.arange(-2500, 2501)
    out = relative_position_bucket(ops.convert_to_tensor(rel), bidirectional, num_buckets,
                                   max_distance)
    assert keras.backend.standardize_dtype(out.dtype) == "int32"
    expected = np_t5_bucket(rel, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(to_numpy(out), expected)
    # Far distances share the last bucket of their direction.
    half = num_buckets // 2 if bidirectional else num_buckets
    assert to_numpy(out)[0] == half - 1
    if bidirectional:
        assert to_numpy(out)[-1] == 2 * half - 1


def test_t5_bucket_small_distances_by_hand():
    rel = np.array([[-3, -1, 0, 1, 3]])
    out = to_numpy(relative_position_bucket(rel, True, 32, 128))
    np.testing.assert_array_equal(out, [[3, 1, 0, 17, 19]])
    out = to_numpy(relative_position_bucket(rel, False, 32, 128))
    np.testing.assert_array_equal(out, [[3, 1, 0, 0, 0]])


@pytest.fixture(scope="module")
def hf_t5():
    import torch
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    return torch, T5Config, T5Attention


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance", BUCKET_CONFIGS)
def test_t5_buckets_match_transformers(hf_t5, bidirectional, num_buckets, max_distance):
    torch, _, T5Attention = hf_t5
    rel = np.arange(-2500, 2501)
    expected = T5Attention._relative_position_bucket(
        torch.tensor(rel), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance,
    ).numpy()
    out = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(to_numpy(out), expected)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias_values(hf_t5, bidirectional):
    torch, T5Config, T5Attention = hf_t5
    heads, buckets, max_dist = 4, 16, 40
    layer = RelativePositionBias(heads, num_buckets=buckets, max_distance=max_dist,
                                 bidirectional=bidirectional)
    q_len, k_len, start = 3, 50, 47
    query = np.zeros((2, q_len, 8), "float32")
    key = np.zeros((2, k_len, 8), "float32")
    layer.build(query.shape)
    assert layer.embeddings.path.endswith("embeddings")
    assert tuple(layer.embeddings.shape) == (buckets, heads)
    table = rng(6).normal(size=(buckets, heads)).astype("float32")
    layer.embeddings.assign(table)

    rel = np.arange(k_len)[None, :] - (start + np.arange(q_len))[:, None]
    expected = table[np_t5_bucket(rel, bidirectional, buckets, max_dist)]  # (q, k, h)
    expected = expected.transpose(2, 0, 1)[None]
    out = layer(query, key, start_index=start)
    assert tuple(out.shape) == (1, heads, q_len, k_len)
    assert_close(out, expected, atol=0)
    traced = compiled(lambda q, k, s: layer(q, k, start_index=s))(query, key, scalar(start))
    assert_close(traced, expected, atol=0)

    # Same numbers as Hugging Face's T5Attention.compute_bias with the weights copied over.
    config = T5Config(d_model=8, d_kv=2, num_heads=heads, relative_attention_num_buckets=buckets,
                      relative_attention_max_distance=max_dist, is_decoder=not bidirectional)
    attention = T5Attention(config, has_relative_attention_bias=True)
    with torch.no_grad():
        attention.relative_attention_bias.weight.copy_(torch.tensor(table))
        hf = attention.compute_bias(q_len, k_len, cache_position=torch.arange(start, start + q_len))
    assert_close(out, hf.numpy(), atol=0)


# --- Validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: SinusoidalPositionEncoding(max_wavelength=0), "max_wavelength"),
        (lambda: PositionEmbedding(sequence_length=0), "sequence_length"),
        (lambda: PositionEmbedding(sequence_length=8, initializer="nope"), "initializer"),
        (lambda: RotaryEmbedding(max_wavelength=-1), "max_wavelength"),
        (lambda: RotaryEmbedding(scaling_factor=0), "scaling_factor"),
        (lambda: RotaryEmbedding(scaling_type="dynamic"), "scaling_type"),
        (lambda: RotaryEmbedding(scaling_type="yarn"), "original_max_position_embeddings"),
        (lambda: RotaryEmbedding(scaling_type="yarn", original_max_position_embeddings=8,
                                 beta_fast=1.0, beta_slow=2.0), "beta_fast"),
        (lambda: RotaryEmbedding(scaling_type="yarn", original_max_position_embeddings=8,
                                 attention_factor=0.0), "attention_factor"),
        (lambda: RotaryEmbedding(scaling_type="yarn", original_max_position_embeddings=8,
                                 truncate=1), "truncate"),
        (lambda: RotaryEmbedding(scaling_type="yarn", original_max_position_embeddings=8,
                                 low_freq_factor=1.0), "low_freq_factor"),
        (lambda: RotaryEmbedding(scaling_type="llama3", beta_fast=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8),
         "beta_fast"),
        (lambda: RotaryEmbedding(scaling_type="llama3", high_freq_factor=4.0,
                                 original_max_position_embeddings=8), "low_freq_factor"),
        (lambda: RotaryEmbedding(scaling_type="llama3", low_freq_factor=2.0,
                                 high_freq_factor=2.0, original_max_position_embeddings=8),
         "high_freq_factor"),
        (lambda: RotaryEmbedding(scaling_type="llama3", low_freq_factor=1.0,
                                 high_freq_factor=2.0, original_max_position_embeddings=0),
         "original_max_position_embeddings"),
        (lambda: RotaryEmbedding(low_freq_factor=1.0), "low_freq_factor"),
        (lambda: RotaryEmbedding(interleaved="yes"), "interleaved"),
        (lambda: ALiBiBias(num_heads=0), "num_heads"),
        (lambda: ALiBiBias(num_heads=2.5), "num_heads"),
        (lambda: ALiBiBias(num_heads=4, bidirectional=1), "bidirectional"),
        (lambda: RelativePositionBias(num_heads=-1), "num_heads"),
        (lambda: RelativePositionBias(num_heads=2, num_buckets=1, bidirectional=False),
         "num_buckets"),
        (lambda: RelativePositionBias(num_heads=2, num_buckets=3), "num_buckets"),
        (lambda: RelativePositionBias(num_heads=2, num_buckets=32, max_distance=8),
         "max_distance"),
        (lambda: relative_position_bucket(np.zeros(3, "int32"), False, 1, 128), "num_buckets"),
    ],
)
def test_bad_config_raises(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_call_raises():
    with pytest.raises(ValueError, match="head_dim=5"):
        RotaryEmbedding()(np.zeros((1, 3, 2, 5), "float32"))
    with pytest.raises(ValueError, match="rank"):
        RotaryEmbedding()(np.zeros((4, 6), "float32"))
    with pytest.raises(ValueError, match="rank"):
        SinusoidalPositionEncoding()(np.zeros((4, 6), "float32"))
    layer = PositionEmbedding(sequence_length=4)
    with pytest.raises(ValueError, match="sequence_length=4"):
        layer(np.zeros((1, 3, 2), "float32"), start_index=2)
    with pytest.raises(ValueError, match="start_index"):
        layer(np.zeros((1, 3, 2), "float32"), start_index=-1)
    with pytest.raises(ValueError, match="start_index"):
        ALiBiBias(2)(np.zeros((1, 3, 2), "float32"), start_index=1.5)


# --- Serialization and mixed precision --------------------------------------------------


def all_layers():
    return [
        SinusoidalPositionEncoding(max_wavelength=500),
        PositionEmbedding(sequence_length=12, initializer="he_normal"),
        RotaryEmbedding(max_wavelength=1000, scaling_factor=4.0, interleaved=True,
                        scaling_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64),
        ALiBiBias(num_heads=6, bidirectional=True),
        RelativePositionBias(num_heads=2, num_buckets=8, max_distance=16, bidirectional=False,
                             embeddings_initializer="uniform"),
    ]


def test_config_roundtrip():
    for layer in all_layers():
        clone = roundtrip_layer(layer)
        config = layer.get_config()
        for name in ("max_wavelength", "sequence_length", "scaling_factor", "interleaved",
                     "scaling_type", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings", "num_heads", "bidirectional", "num_buckets", "max_distance"):
            if name in config:
                assert getattr(clone, name) == config[name]
    assert RelativePositionBias(2).get_config()["embeddings_initializer"]["class_name"] == (
        "RandomNormal"
    )


def test_keras_file_roundtrip(tmp_path):
    sin, emb, rope, alibi, rel = all_layers()
    tokens = keras.Input((None, 4))  # dynamic lengths exercise the symbolic shape paths
    heads = keras.Input((None, 2, 4))
    outputs = [sin(tokens), emb(tokens, start_index=3), rope(heads, start_index=2),
               alibi(heads), rel(tokens, heads)]
    model = keras.Model([tokens, heads], outputs)
    x = [rng(7).normal(size=(2, 6, 4)).astype("float32"),
         rng(8).normal(size=(2, 6, 2, 4)).astype("float32")]
    before = [to_numpy(y) for y in model(x)]
    path = tmp_path / "position.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    after = [to_numpy(y) for y in restored(x)]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    for cls, original in ((PositionEmbedding, emb), (RelativePositionBias, rel)):
        (loaded,) = [layer for layer in restored.layers if isinstance(layer, cls)]
        assert_close(loaded.embeddings, to_numpy(original.embeddings), atol=0)


def test_mixed_bfloat16_outputs_finite():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        tokens = rng(9).normal(size=(2, 5, 6)).astype("float32")
        heads = rng(10).normal(size=(2, 5, 3, 8)).astype("float32")
        outs = {
            "sin": SinusoidalPositionEncoding()(tokens, start_index=100),
            "emb": PositionEmbedding(8)(tokens, start_index=2),
            "rope": RotaryEmbedding()(heads, start_index=50),
            "rel": RelativePositionBias(3)(heads, start_index=1),
        }
        for name, out in outs.items():
            assert keras.backend.standardize_dtype(out.dtype) == "bfloat16", name
            assert np.all(np.isfinite(to_numpy(ops.cast(out, "float32")))), name
        alibi = ALiBiBias(3)(heads, start_index=1000)
        # ALiBi stays float32 by design (see its docstring) and keeps exact distances.
        assert keras.backend.standardize_dtype(alibi.dtype) == "float32"
        assert np.all(np.isfinite(to_numpy(alibi)))
        assert_close(alibi[0, 0, 0, :2], [-0.0625 * 1000, -0.0625 * 999], atol=0)
    finally:
        keras.config.set_dtype_policy("float32")
