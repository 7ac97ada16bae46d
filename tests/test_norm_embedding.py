"""RMSNorm, LayerNorm, TokenEmbedding and PatchEmbedding against NumPy formulas."""

import keras
import numpy as np
import pytest

from kzoo.layers.embedding import PatchEmbedding
from kzoo.layers.embedding import TokenEmbedding
from kzoo.layers.norm import LayerNorm
from kzoo.layers.norm import RMSNorm
from tests.harness import assert_close, check_layer, ref, rng, roundtrip_layer, to_numpy
from tests.helpers import value_and_grads


# === LayerNorm ===


@pytest.mark.parametrize("kwargs", [dict(epsilon=1e-5), dict(epsilon=1e-12, center=False),
                                    dict(epsilon=1e-3, scale=False)])
def test_layer_norm_layer_harness(kwargs):
    """kzoo's LayerNorm: build, call, NumPy reference, config / serialization round trip and
    mixed precision, through the shared check_layer."""
    check_layer(LayerNorm, kwargs, input_shape=(2, 5, 16), expected_output_shape=(2, 5, 16),
                reference=lambda layer, x: ref.norm(layer, x))


def _np_layer_norm_grads(x, gamma, beta, eps, dy):
    """y and d(sum(y * dy)) / d(x, gamma, beta) of (x - mean) / sqrt(var + eps) * gamma +
    beta over the last axis, float64, by the chain rule written out."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    n = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    x_hat = (x - mu) / np.sqrt(var + eps)
    g = np.ones(n) if gamma is None else gamma.astype(np.float64)
    y = x_hat * g + (0.0 if beta is None else beta)
    d_hat = dy * g
    # d x_hat_j / d x_i = (delta_ij - 1/n - x_hat_i x_hat_j / n) / sqrt(var + eps)
    dx = (d_hat - d_hat.mean(-1, keepdims=True)
          - x_hat * (d_hat * x_hat).mean(-1, keepdims=True)) / np.sqrt(var + eps)
    lead = tuple(range(x.ndim - 1))
    return y, dx, (dy * x_hat).sum(lead), dy.sum(lead)


@pytest.mark.parametrize("weights", ["both", "no_beta", "no_gamma"])
def test_tensorflow_layer_norm_in_a_graph_against_numpy(weights):
    """`norm._tf_layer_norm`, LayerNorm's TensorFlow form (pure TensorFlow, so checked under
    every backend), traced in a graph as `fit` runs it: the output and the gradients of the
    input, gamma and beta against NumPy, on rows of large mean and spread (statistics in
    float32), a 3-D input and a bfloat16 input (float32 statistics, the gradient back in
    bfloat16)."""
    import tensorflow as tf

    from kzoo.layers.norm import _tf_layer_norm

    r = np.random.default_rng(3)
    x = (r.normal(size=(3, 4, 32)) * 40.0 + 200.0).astype("float32")
    dy = r.normal(size=x.shape).astype("float32")
    gamma = None if weights == "no_gamma" else r.normal(size=32).astype("float32")
    beta = None if weights == "no_beta" else r.normal(size=32).astype("float32")

    @tf.function
    def run(x, gamma, beta):
        params = [w for w in (gamma, beta) if w is not None]
        with tf.GradientTape() as tape:
            tape.watch([x] + params)
            y = _tf_layer_norm(x, gamma, beta, 1e-5)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
        return [y] + tape.gradient(loss, [x] + params)

    got = [t.numpy() for t in run(tf.constant(x), None if gamma is None else tf.constant(gamma),
                                  None if beta is None else tf.constant(beta))]
    y, dx, dgamma, dbeta = _np_layer_norm_grads(x, gamma, beta, 1e-5, dy)
    expected = [y, dx] + ([dgamma] if gamma is not None else []) + (
        [dbeta] if beta is not None else [])
    for name, have, want in zip(["y", "dx", "dgamma", "dbeta"], got, expected):
        np.testing.assert_allclose(have, want, atol=2e-4, rtol=1e-4, err_msg=name)
    half = run(tf.constant(x[0], tf.bfloat16), None if gamma is None else tf.constant(gamma),
               None if beta is None else tf.constant(beta))
    assert half[1].dtype == tf.bfloat16
    y16, _, _, _ = _np_layer_norm_grads(x[0].astype(tf.bfloat16.as_numpy_dtype).astype(
        "float32"), gamma, beta, 1e-5, dy[0])
    np.testing.assert_allclose(half[0].numpy(), y16, atol=1e-4, rtol=1e-4)


def test_layer_norm_is_keras_layer_normalization():
    """Same weights, config and values as `keras.layers.LayerNormalization` (a subclass:
    the zoo's own code that asks for a Keras layer norm finds it), gradients equal to
    NumPy's chain rule on every backend, and a float64 input left to Keras' own formula."""
    x = (rng(4).normal(size=(2, 6, 16)) * 3.0 + 1.0).astype("float32")
    dy = rng(5).normal(size=x.shape).astype("float32")
    ours, theirs = LayerNorm(epsilon=1e-5), keras.layers.LayerNormalization(epsilon=1e-5)
    ours.build(x.shape)
    theirs.build(x.shape)
    assert isinstance(ours, keras.layers.LayerNormalization)
    assert [w.path.split("/")[-1] for w in ours.weights] == ["gamma", "beta"]
    gamma, beta = (rng(i).normal(size=16).astype("float32") for i in (6, 7))
    for layer in (ours, theirs):
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
    mine = {k: v for k, v in ours.get_config().items() if k != "name"}
    keras_config = {k: v for k, v in theirs.get_config().items() if k != "name"}
    assert mine == keras_config
    value, grads = value_and_grads(
        lambda t: keras.ops.sum(ours(t) * keras.ops.convert_to_tensor(dy)), x)
    y, dx, _, _ = _np_layer_norm_grads(x, gamma, beta, 1e-5, dy)
    # (a sum of signed terms that nearly cancel, e.g. -0.0875 from 192 terms up to ~3:
    # float32 rounding is bounded by eps x the sum of the terms' sizes, not by the result's
    # size; JAX on an Intel Xeon measured RMSNorm's 1.6e-6 off, 1.9e-5 relative)
    np.testing.assert_allclose(value, float((y * dy).sum()), rtol=0,
                               atol=float(np.finfo(np.float32).eps * np.abs(y * dy).sum()))
    np.testing.assert_allclose(grads[0], dx, atol=1e-5, rtol=1e-5)
    assert_close(ours(x), y, atol=1e-5, rtol=1e-5)
    if keras.backend.backend() != "jax":  # (JAX without x64 has no float64 arrays)
        wide = LayerNorm(epsilon=1e-5, dtype="float64")
        assert keras.backend.standardize_dtype(wide(x.astype("float64")).dtype) == "float64"


@pytest.mark.parametrize("axis", [1, -3, 2, [1, 2], [0], [0, 3], -1, [2, 3]])
def test_layer_norm_over_any_axes_against_numpy(axis):
    """LayerNorm over leading or middle axes of a 4-D input (Keras 3.15's torch form handed
    them to `F.layer_norm`, which raised), against the two-pass statistics in float64 in
    NumPy; gamma and beta shaped as the normalised axes."""
    x = (rng(11).normal(size=(4, 6, 5, 8)) * 3.0 + 10.0).astype("float32")
    norm = LayerNorm(axis=axis, epsilon=1e-5)
    norm.build(x.shape)
    axes = tuple(sorted(a % 4 for a in np.atleast_1d(axis)))
    assert tuple(norm.gamma.shape) == tuple(x.shape[a] for a in axes)
    gamma = rng(12).normal(size=norm.gamma.shape).astype("float32")
    beta = rng(13).normal(size=norm.beta.shape).astype("float32")
    norm.gamma.assign(gamma)
    norm.beta.assign(beta)
    wide = x.astype(np.float64)
    shape = [x.shape[a] if a in axes else 1 for a in range(4)]
    centred = wide - wide.mean(axes, keepdims=True)
    want = (centred / np.sqrt((centred ** 2).mean(axes, keepdims=True) + 1e-5)
            * gamma.reshape(shape) + beta.reshape(shape))
    assert_close(norm(x), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("axis,fragment", [([-3, 1], "same axis twice"), (4, "each in"),
                                           ([], "each in"), ([1, 1], "same axis twice")])
def test_layer_norm_bad_axes_named(axis, fragment):
    with pytest.raises(ValueError, match=fragment):
        LayerNorm(axis=axis).build((4, 6, 5, 8))


@pytest.mark.parametrize("epsilon", [0.0, -1e-5, float("nan"), float("inf"), "1e-5", None])
def test_layer_norm_bad_epsilon_named(epsilon):
    # Was accepted: 0, a negative or a NaN epsilon gave NaN for every constant row (an
    # all-zero padding token) in silence; a string or None failed inside the backend's op at
    # the first call (TypeError on JAX and torch, InvalidArgumentError on TensorFlow), or,
    # with None on JAX and torch, normalised without any epsilon.
    with pytest.raises(ValueError, match=r"`epsilon` must be a positive number; got "
                                         r"epsilon="):
        LayerNorm(epsilon=epsilon)


def test_layer_norm_constant_rows_with_a_tiny_epsilon_are_finite():
    # A constant row has variance 0: (x - mean) / sqrt(0 + epsilon) = 0, then + beta.
    norm = LayerNorm(epsilon=1e-12)
    x = np.full((2, 3, 8), 3.0, "float32")
    want = np.zeros((2, 3, 8), "float32")  # gamma 1, beta 0
    assert_close(norm(x), want, atol=1e-6, rtol=0)
    assert LayerNorm.from_config(norm.get_config()).epsilon == 1e-12


# === RMSNorm ===


np_rms_norm = ref.rms_norm  # (x, scale, eps)


@pytest.mark.parametrize("kwargs", [dict(epsilon=1e-5), dict(epsilon=1e-3, use_scale=False)])
def test_rms_norm_layer_harness(kwargs):
    """Build, call, NumPy reference, config / serialization round trip and mixed precision,
    through the shared check_layer."""
    check_layer(RMSNorm, kwargs, input_shape=(2, 5, 16), expected_output_shape=(2, 5, 16),
                reference=lambda layer, x: ref.norm(layer, x))


def test_rms_norm_matches_numpy():
    x = rng(0).normal(loc=0.5, scale=3.0, size=(2, 5, 16)).astype("float32")
    norm = RMSNorm(epsilon=1e-5)
    norm.build(x.shape)
    scale = rng(1).normal(size=(16,)).astype("float32")
    norm.scale.assign(scale)
    assert norm.scale.path.endswith("scale") and tuple(norm.scale.shape) == (16,)
    assert_close(norm(x), np_rms_norm(x, scale, 1e-5), atol=1e-5, rtol=1e-5)


def test_rms_norm_without_scale_and_epsilon_matters():
    x = np.array([[1e-3, -2e-3, 0.0, 5e-4]], "float32")
    norm = RMSNorm(epsilon=1e-6, use_scale=False)
    assert norm.weights == []
    assert_close(norm(x), np_rms_norm(x, 1.0, 1e-6), atol=1e-5, rtol=1e-5)
    # with a large epsilon the output shrinks as the formula says
    assert_close(RMSNorm(epsilon=1.0, use_scale=False)(x), np_rms_norm(x, 1.0, 1.0), atol=1e-7)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_rms_norm_mixed_precision_statistics_in_float32(policy):
    # x ~ 300: x^2 ~ 9e4 overflows float16 (max 65504), so half-precision statistics would
    # give inf/0 here; bfloat16 statistics would lose the 1e-2 accuracy asserted below.
    x = (rng(2).normal(size=(4, 512)) * 50.0 + 300.0).astype("float32")
    reference = np_rms_norm(x, 1.0, 1e-6)
    keras.config.set_dtype_policy(policy)
    norm = RMSNorm()
    y = norm(x)
    assert keras.backend.standardize_dtype(y.dtype) == policy.split("_")[1]
    assert norm.scale.dtype == "float32"
    y = to_numpy(keras.ops.cast(y, "float32"))
    assert np.isfinite(y).all()
    # inputs are rounded to bf16 before the layer (Keras autocast) and the result once more
    np.testing.assert_allclose(y, reference, rtol=2e-2, atol=2e-2)


def _np_rms_norm_grads(x, scale, eps, dy):
    """y and d(sum(y * dy)) / dx of x / sqrt(mean(x^2) + eps) * scale over the last axis,
    float64, through each row's full Jacobian (d y_j / d x_i = s_j (r delta_ij -
    r^3 x_i x_j / n), r = 1 / sqrt(mean(x^2) + eps))."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    n = x.shape[-1]
    s = np.ones(n) if scale is None else scale.astype(np.float64)
    r = 1.0 / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
    y = x * r * s
    jac = (r[..., None] * np.eye(n) - (r ** 3)[..., None] * x[..., :, None] * x[..., None, :]
           / n) * s  # [..., i, j] = d y_j / d x_i
    return y, np.einsum("...ij,...j->...i", jac, dy)


def test_rms_norm_gradients_on_every_backend():
    """The layer's input gradient on every backend against each row's Jacobian in NumPy, and
    a float64 layer (statistics in float32, as documented, the result in float64)."""
    x = (rng(8).normal(size=(2, 6, 16)) * 3.0 + 1.0).astype("float32")
    dy = rng(9).normal(size=x.shape).astype("float32")
    norm = RMSNorm(epsilon=1e-6)
    norm.build(x.shape)
    scale = rng(10).normal(size=(16,)).astype("float32")
    norm.scale.assign(scale)
    value, grads = value_and_grads(
        lambda t: keras.ops.sum(norm(t) * keras.ops.convert_to_tensor(dy)), x)
    y, dx = _np_rms_norm_grads(x, scale, 1e-6, dy)
    # (a sum of signed terms that nearly cancel, e.g. -0.0875 from 192 terms up to ~3:
    # float32 rounding is bounded by eps x the sum of the terms' sizes, not by the result's
    # size; JAX on an Intel Xeon measured RMSNorm's 1.6e-6 off, 1.9e-5 relative)
    np.testing.assert_allclose(value, float((y * dy).sum()), rtol=0,
                               atol=float(np.finfo(np.float32).eps * np.abs(y * dy).sum()))
    np.testing.assert_allclose(grads[0], dx, atol=1e-5, rtol=1e-5)
    assert_close(norm(x), y, atol=1e-5, rtol=1e-5)
    if keras.backend.backend() != "jax":  # (JAX without x64 has no float64 arrays)
        wide = RMSNorm(epsilon=1e-6, use_scale=False, dtype="float64")
        out = wide(x.astype("float64"))
        assert keras.backend.standardize_dtype(out.dtype) == "float64"
        np.testing.assert_allclose(to_numpy(out), np_rms_norm(x.astype("float64"), 1.0, 1e-6),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=-1e-6), "epsilon"),
        (dict(epsilon="1e-6"), "epsilon"),
        (dict(use_scale="yes"), "use_scale"),
    ],
)
def test_rms_norm_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        RMSNorm(**kwargs)


# === TokenEmbedding ===


def test_token_embedding_lookup_and_tied_logits():
    layer = TokenEmbedding(vocabulary_size=11, embedding_dim=4)
    ids = np.array([[0, 3, 10], [7, 7, 1]], "int32")
    hidden = layer(ids)
    table = to_numpy(layer.embeddings).astype(np.float64)
    assert table.shape == (11, 4) and layer.embeddings.path.endswith("embeddings")
    assert_close(hidden, table[ids], atol=0)
    h = rng(3).normal(size=(2, 3, 4)).astype("float32")
    assert_close(layer(h, reverse=True), h @ table.T, atol=1e-5)
    assert len(layer.weights) == 1


def test_token_embedding_untied_logits_and_soft_cap():
    layer = TokenEmbedding(11, 4, tie_weights=False, logit_soft_cap=2.0,
                           embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0))
    layer.build()
    reverse = to_numpy(layer.reverse_embeddings).astype(np.float64)
    assert reverse.shape == (4, 11)
    h = rng(4).normal(size=(3, 4)).astype("float32")
    logits = h @ reverse
    assert np.abs(logits).max() > 2.0  # the cap must bite
    assert_close(layer(h, reverse=True), 2.0 * np.tanh(logits / 2.0), atol=1e-5)
    assert not np.allclose(to_numpy(layer.embeddings).T, reverse)


def test_token_embedding_out_of_range_ids_are_clipped():
    layer = TokenEmbedding(5, 3)
    table = to_numpy(layer(np.arange(5)))
    out = to_numpy(layer(np.array([-3, 0, 4, 5, 99])))
    assert_close(out, table[[0, 0, 4, 4, 4]], atol=0)


def test_token_embedding_reverse_dtype_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = TokenEmbedding(64, 8, reverse_dtype="float32")
    hidden = layer(np.array([[1, 2]]))
    assert keras.backend.standardize_dtype(hidden.dtype) == "bfloat16"
    assert layer.embeddings.dtype == "float32"
    logits = layer(hidden, reverse=True)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    table = to_numpy(layer.embeddings).astype(np.float64)
    h = to_numpy(keras.ops.cast(hidden, "float32")).astype(np.float64)
    assert_close(logits, h @ table.T, atol=1e-5, rtol=1e-5)
    plain = TokenEmbedding(64, 8)
    plain.build()
    assert keras.backend.standardize_dtype(plain(hidden, reverse=True).dtype) == "bfloat16"


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(vocabulary_size=0, embedding_dim=4), "vocabulary_size"),
        (dict(vocabulary_size=10, embedding_dim=2.5), "embedding_dim"),
        (dict(vocabulary_size=10, embedding_dim=4, tie_weights="no"), "tie_weights"),
        (dict(vocabulary_size=10, embedding_dim=4, logit_soft_cap=0), "logit_soft_cap"),
        (dict(vocabulary_size=10, embedding_dim=4, reverse_dtype="int32"), "reverse_dtype"),
    ],
)
def test_token_embedding_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TokenEmbedding(**kwargs)


# === PatchEmbedding ===


def test_patch_embedding_layer_harness():
    check_layer(PatchEmbedding, dict(patch_size=(2, 3), hidden_dim=7), input_shape=(2, 8, 12, 3),
                expected_output_shape=(2, 16, 7),
                reference=lambda layer, x: np_patch_embed(
                    x, ref.w(layer.projection.kernel), ref.w(layer.projection.bias), 2, 3))


def np_patch_embed(images, kernel, bias, ph, pw):
    b, h, w, c = images.shape
    patches = images.reshape(b, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(b, (h // ph) * (w // pw), ph * pw * c).astype(np.float64)
    return patches @ kernel.reshape(ph * pw * c, -1) + bias


@pytest.mark.parametrize("channels", [1, 3, 5])
@pytest.mark.parametrize("patch", [4, (2, 3)])
def test_patch_embedding_matches_numpy(channels, patch):
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    images = rng(5).normal(size=(2, 8, 12, channels)).astype("float32")
    layer = PatchEmbedding(patch_size=patch, hidden_dim=7)
    layer.build(images.shape)
    layer.projection.bias.assign(rng(6).normal(size=(7,)).astype("float32"))
    kernel = to_numpy(layer.projection.kernel).astype(np.float64)
    assert kernel.shape == (ph, pw, channels, 7)
    expected = np_patch_embed(images, kernel, to_numpy(layer.projection.bias), ph, pw)
    out = layer(images)
    assert tuple(out.shape) == (2, (8 // ph) * (12 // pw), 7)
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_patch_embedding_shape_errors():
    with pytest.raises(ValueError, match="height=10 is not divisible by the patch height 4"):
        PatchEmbedding(4, 8)(np.zeros((1, 10, 8, 3), "float32"))
    with pytest.raises(ValueError, match="width=8 is not divisible by the patch width 3"):
        PatchEmbedding((2, 3), 8)(np.zeros((1, 4, 8, 3), "float32"))
    # a layer built on one size checks every call
    built = PatchEmbedding(4, 8)
    built(np.zeros((1, 8, 8, 3), "float32"))
    with pytest.raises(ValueError, match="height=10"):
        built(np.zeros((1, 10, 8, 3), "float32"))
    with pytest.raises(ValueError, match="num_channels=3"):
        PatchEmbedding(2, 8, num_channels=3)(np.zeros((1, 4, 4, 1), "float32"))
    with pytest.raises(ValueError, match="height"):
        PatchEmbedding(4, 8)(keras.Input((10, 8, 3)))


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(patch_size=0, hidden_dim=8), "patch_size"),
        (dict(patch_size=(2, 2, 2), hidden_dim=8), "patch_size"),
        (dict(patch_size=(2, "2"), hidden_dim=8), "patch_size"),
        (dict(patch_size=2, hidden_dim=-8), "hidden_dim"),
        (dict(patch_size=2, hidden_dim=8, num_channels=0), "num_channels"),
        (dict(patch_size=2, hidden_dim=8, use_bias=None), "use_bias"),
    ],
)
def test_patch_embedding_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        PatchEmbedding(**kwargs)


# === Serialization ===


def test_serialization_roundtrips():
    for layer in (
        RMSNorm(epsilon=1e-5, use_scale=False),
        TokenEmbedding(10, 4, tie_weights=False, logit_soft_cap=30.0, reverse_dtype="float32"),
        PatchEmbedding((2, 3), 8, num_channels=3, use_bias=False),
        PatchEmbedding(4, 8),
    ):
        roundtrip_layer(layer)


def test_keras_file_roundtrip(tmp_path):
    ids_in = keras.Input((5,), dtype="int32")
    embed = TokenEmbedding(13, 6, tie_weights=False, name="embed")
    hidden = RMSNorm(name="norm")(embed(ids_in))
    logits = embed(hidden, reverse=True)
    image_in = keras.Input((4, 6, 2))
    patches = PatchEmbedding((2, 3), 6, name="patches")(image_in)
    model = keras.Model([ids_in, image_in], [logits, patches])
    ids = rng(7).integers(0, 13, size=(2, 5)).astype("int32")
    images = rng(8).normal(size=(2, 4, 6, 2)).astype("float32")
    path = str(tmp_path / "embed.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    for a, b in zip(restored([ids, images]), model([ids, images])):
        assert_close(a, to_numpy(b), atol=1e-6)
    assert [v.path for v in restored.weights] == [v.path for v in model.weights]



@pytest.mark.parametrize("tied", [True, False])
def test_token_embedding_reverse_logits_with_bias_value_and_gradients(tied):
    """`reverse_logits(h, bias)` (BERT's decoder + output bias; one F.linear on torch when
    tied) = h @ E^T + b, soft cap before the bias; gradients of sum(logits * w) w.r.t. the
    table, the bias and h are w^T h, sum(w) and w E against NumPy."""
    layer = TokenEmbedding(11, 4, tie_weights=tied, logit_soft_cap=None if tied else 2.0,
                           embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0))
    layer.build()
    r = rng(5)
    h = r.normal(size=(2, 3, 4)).astype("float32")
    bias = r.normal(size=(11,)).astype("float32")
    w = r.normal(size=(2, 3, 11)).astype("float32")
    table = to_numpy(layer.embeddings).astype(np.float64)
    kernel = table.T if tied else to_numpy(layer.reverse_embeddings).astype(np.float64)
    pre = h.astype(np.float64) @ kernel
    logits = (pre if tied else 2.0 * np.tanh(pre / 2.0)) + bias
    got = keras.ops.convert_to_numpy(layer.reverse_logits(h, bias=bias))
    assert_close(got, logits, atol=1e-5)
    assert_close(keras.ops.convert_to_numpy(layer.reverse_logits(h)), logits - bias, atol=1e-5)
    if not tied:
        return

    def loss(e, b, x):  # the table through a StatelessScope, as Keras' stateless_call does
        with keras.StatelessScope(state_mapping=[(layer.embeddings, e)]):
            return keras.ops.sum(keras.ops.multiply(layer.reverse_logits(x, bias=b), w))

    value, (g_e, g_b, g_h) = value_and_grads(loss, to_numpy(layer.embeddings), bias, h)
    assert abs(value - float((logits * w).sum())) < 1e-3
    flat_w, flat_h = w.reshape(-1, 11).astype(np.float64), h.reshape(-1, 4).astype(np.float64)
    assert_close(g_b, flat_w.sum(0), atol=1e-5)
    assert_close(g_e, flat_w.T @ flat_h, atol=1e-5)
    assert_close(g_h, (flat_w @ table).reshape(h.shape), atol=1e-5)

    def loss_without_bias(e, x):  # the tied product alone (its own backward pass on JAX, TF)
        with keras.StatelessScope(state_mapping=[(layer.embeddings, e)]):
            return keras.ops.sum(keras.ops.multiply(layer.reverse_logits(x), w))

    value, (g_e, g_h) = value_and_grads(loss_without_bias, to_numpy(layer.embeddings), h)
    assert abs(value - float(((logits - bias) * w).sum())) < 1e-3
    assert_close(g_e, flat_w.T @ flat_h, atol=1e-5)
    assert_close(g_h, (flat_w @ table).reshape(h.shape), atol=1e-5)


def test_token_embedding_untied_logits_gradients_over_3d_hidden():
    """Untied head on `(batch, seq, dim)` hidden states (on JAX a product over the flattened
    rows): logits h @ R, gradients of sum(logits * w) w.r.t. R and h are h^T w and w R^T,
    against NumPy."""
    layer = TokenEmbedding(11, 4, tie_weights=False,
                           embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0))
    layer.build()
    r = rng(6)
    h = r.normal(size=(2, 3, 4)).astype("float32")
    w = r.normal(size=(2, 3, 11)).astype("float32")
    reverse = to_numpy(layer.reverse_embeddings).astype(np.float64)
    logits = h.astype(np.float64) @ reverse
    out = layer(h, reverse=True)
    assert tuple(out.shape) == (2, 3, 11)
    assert_close(keras.ops.convert_to_numpy(out), logits, atol=1e-5)

    def loss(kernel, x):
        with keras.StatelessScope(state_mapping=[(layer.reverse_embeddings, kernel)]):
            return keras.ops.sum(keras.ops.multiply(layer(x, reverse=True), w))

    value, (g_r, g_h) = value_and_grads(loss, to_numpy(layer.reverse_embeddings), h)
    assert abs(value - float((logits * w).sum())) < 1e-3
    flat_w, flat_h = w.reshape(-1, 11).astype(np.float64), h.reshape(-1, 4).astype(np.float64)
    assert_close(g_r, flat_h.T @ flat_w, atol=1e-5)
    assert_close(g_h, (flat_w @ reverse.T).reshape(h.shape), atol=1e-5)


def test_row_dense_is_a_dense_over_rows():
    """`RowDense` (T5 v1.1's `lm_head`): the values and kernel gradient of a `Dense` with the
    same weights on a 3-D input, against NumPy; its config round-trips as itself."""
    from kzoo.layers.utils import RowDense

    layer = RowDense(5, use_bias=True, bias_initializer="random_normal")
    x = rng(9).normal(size=(2, 3, 4)).astype("float32")
    out = layer(x)
    kernel, bias = (to_numpy(v).astype(np.float64) for v in (layer.kernel, layer.bias))
    assert tuple(out.shape) == (2, 3, 5)
    assert_close(keras.ops.convert_to_numpy(out), x @ kernel + bias, atol=1e-5)
    w = rng(10).normal(size=(2, 3, 5)).astype("float32")

    def loss(k, inputs):
        with keras.StatelessScope(state_mapping=[(layer.kernel, k)]):
            return keras.ops.sum(keras.ops.multiply(layer(inputs), w))

    _, (g_k, _) = value_and_grads(loss, to_numpy(layer.kernel), x)
    assert_close(g_k, x.reshape(-1, 4).T.astype(np.float64) @ w.reshape(-1, 5), atol=1e-5)
    restored = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(restored) is RowDense and restored.units == 5
    symbolic = layer(keras.Input((None, 4)))  # (symbolic sizes: Dense's own product)
    assert tuple(symbolic.shape) == (None, None, 5)


# === TensorFlow's tied head: the forms of its products (TensorFlow is installed with every
# backend, so these run under each; they call TensorFlow directly) ===


@pytest.fixture
def tf_head_forms():
    """Restores `set_tf_head_products`' mode and the timed choices after a test."""
    from kzoo.layers import embedding

    previous = embedding.set_tf_head_products("auto")
    yield embedding
    embedding.set_tf_head_products(*previous)


def _np_tied_head(h, table, bias, w):
    """NumPy float64: logits h @ E^T (+ b) and the gradients of sum(logits * w) with respect
    to h, E and b."""
    h, table, w = (a.astype(np.float64) for a in (h, table, w))
    flat_h, flat_w = h.reshape(-1, h.shape[-1]), w.reshape(-1, w.shape[-1])
    logits = h @ table.T + (0.0 if bias is None else bias.astype(np.float64))
    return logits, (flat_w @ table).reshape(h.shape), flat_w.T @ flat_h, flat_w.sum(0)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunks,table_gradient", [
    (1, "product_transposed"), (1, "d_transposed"), (3, "product_transposed"),
    (4, "d_transposed"), (16, "d_transposed")])  # (16 > the 11 rows: one row a slice)
def test_tf_tied_head_forms_values_and_gradients(tf_head_forms, chunks, table_gradient,
                                                 with_bias, graph):
    """Every fixed form of TensorFlow's tied head (the logits over slices of the table, the
    table's gradient either way), eager and in a graph, with and without the bias column:
    logits and the gradients of sum(logits * w) against NumPy's float64 formula."""
    import tensorflow as tf

    tf_head_forms.set_tf_head_products("fixed", chunks, table_gradient)
    r = rng(11)
    h = r.normal(size=(2, 3, 4)).astype("float32")
    table = r.normal(size=(11, 4)).astype("float32")
    bias = r.normal(size=(11,)).astype("float32") if with_bias else None
    w = r.normal(size=(2, 3, 11)).astype("float32")

    def run(h, table, bias):
        with tf.GradientTape() as tape:
            tape.watch([h, table] + ([] if bias is None else [bias]))
            logits = tf_head_forms._tf_tied_logits(h, table, bias)
            total = tf.reduce_sum(logits * w)
        return [logits] + tape.gradient(total, [h, table] + ([] if bias is None else [bias]))

    run = tf.function(run) if graph else run
    got = run(tf.constant(h), tf.constant(table), None if bias is None else tf.constant(bias))
    want = _np_tied_head(h, table, bias, w)
    assert tuple(got[0].shape) == (2, 3, 11)
    for g, expected in zip(got, want):
        assert_close(g.numpy(), expected, atol=1e-5)


def test_tf_head_forms_timed_once_per_shape_and_not_small_or_under_xla(tf_head_forms,
                                                                        monkeypatch):
    """The forms are timed once per (rows, dim, vocab, dtype); heads with fewer logits than
    `TF_HEAD_TIMING_LOGITS`, unknown sizes and XLA-compiled graphs take the plain forms
    untimed; "fixed" takes the given ones."""
    import tensorflow as tf

    calls = []

    def fake_timing(rows, dim, vocab, dtype):
        calls.append((rows, dim, vocab, dtype))
        return (32, "d_transposed")

    monkeypatch.setattr(tf_head_forms, "_time_tf_head", fake_timing)
    big = tf_head_forms.TF_HEAD_TIMING_LOGITS // 64
    plain = (1, "product_transposed")
    assert tf_head_forms._tf_head_forms(big - 1, 8, 64, "float32") == plain
    assert tf_head_forms._tf_head_forms(None, 8, 1 << 20, "float32") == plain
    assert calls == []
    for _ in range(2):
        assert tf_head_forms._tf_head_forms(big, 8, 64, "float32") == (32, "d_transposed")
    assert calls == [(big, 8, 64, "float32")]
    assert tf_head_forms._tf_head_forms(big, 8, 64, "bfloat16") == (32, "d_transposed")
    assert len(calls) == 2
    seen = []
    tf.function(lambda: seen.append(tf_head_forms._tf_head_forms(2 * big, 8, 64, "float32"))
                or tf.constant(0.0), jit_compile=True).get_concrete_function()
    assert seen == [plain] and len(calls) == 2
    tf_head_forms.set_tf_head_products("fixed", 5, "d_transposed")
    assert tf_head_forms._tf_head_forms(big, 8, 64, "float32") == (5, "d_transposed")
    assert len(calls) == 2


def test_tf_head_timing_inside_a_traced_step(tf_head_forms, monkeypatch):
    """With the timing threshold lowered, a head traced in a `tf.function` times its forms
    eagerly (outside the graph) once, keeps a valid choice and still computes the logits
    and gradients of NumPy's formula."""
    import tensorflow as tf

    monkeypatch.setattr(tf_head_forms, "TF_HEAD_TIMING_LOGITS", 64)
    monkeypatch.setattr(tf_head_forms, "TF_HEAD_CHUNKS", (1, 2))
    r = rng(12)
    h = r.normal(size=(4, 8, 6)).astype("float32")
    table = r.normal(size=(256, 6)).astype("float32")
    w = r.normal(size=(4, 8, 256)).astype("float32")

    @tf.function
    def step(h, table):
        with tf.GradientTape() as tape:
            tape.watch([h, table])
            logits = tf_head_forms._tf_tied_logits(h, table)
            total = tf.reduce_sum(logits * w)
        return [logits] + tape.gradient(total, [h, table])

    got = step(tf.constant(h), tf.constant(table))
    choice = tf_head_forms._TF_HEAD_CHOICE
    assert list(choice) == [(32, 6, 256, "float32")]
    chunks, form = choice[(32, 6, 256, "float32")]
    assert chunks in (1, 2) and form in tf_head_forms.TF_TABLE_GRADIENTS
    for g, expected in zip(got, _np_tied_head(h, table, None, w)[:3]):
        assert_close(g.numpy(), expected, atol=1e-5)


def test_tf_head_fastest_form_needs_a_margin(tf_head_forms):
    """`_fastest` (fake clock): the first call of each way is not counted, medians compare,
    and a way other than the first wins only below `_TF_HEAD_MARGIN` of the first's median."""
    def clock_of(durations):
        ticks, now = [], 0.0
        for d in durations:
            ticks += [now, now + d]
            now += d + 1.0
        it = iter(ticks)
        return lambda: next(it)

    ways = {"first": lambda: None, "second": lambda: None}
    # rounds alternate first, second; the first round (100 s each) is not counted
    slow_first = [100.0, 100.0] + [1.0, 0.9] * 3
    assert tf_head_forms._fastest(ways, 3, clock_of(slow_first)) == "second"
    close = [0.1, 100.0] + [1.0, 0.97] * 3
    assert tf_head_forms._fastest(ways, 3, clock_of(close)) == "first"
    assert tf_head_forms._fastest(ways, 3, clock_of([1.0, 2.0] * 4)) == "first"


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(mode="fast"), "mode"), (dict(mode="fixed", forward_chunks=0), "forward_chunks"),
    (dict(mode="fixed", forward_chunks=2.0), "forward_chunks"),
    (dict(mode="fixed", forward_chunks=True), "forward_chunks"),
    (dict(mode="fixed", table_gradient="hidden"), "table_gradient")])
def test_set_tf_head_products_refuses_bad_arguments(tf_head_forms, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        tf_head_forms.set_tf_head_products(**kwargs)
    assert tf_head_forms._TF_HEAD["mode"] == "auto"
