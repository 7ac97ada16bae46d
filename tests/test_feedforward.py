"""FeedForward, GatedFeedForward and get_activation against NumPy formulas."""

import keras
import numpy as np
import pytest

from kzoo.layers.feedforward import FeedForward
from kzoo.layers.feedforward import GatedFeedForward
from kzoo.layers.feedforward import get_activation
from tests.harness import assert_close, check_layer, ref, rng, roundtrip_layer, to_numpy
from tests.helpers import value_and_grads

NP_ACTIVATIONS = {name: ref.activation(name) for name in (
    "relu", "gelu", "gelu_tanh", "quick_gelu", "silu", "tanh", "sigmoid", "linear")}
ALIASES = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "swish": "silu"}


def x_values():
    return np.concatenate([np.linspace(-6, 6, 49), rng(0).normal(scale=2, size=31)]).astype(
        "float32"
    )


@pytest.mark.parametrize("name", sorted(NP_ACTIVATIONS) + sorted(ALIASES))
def test_activation_matches_numpy(name):
    x = x_values()
    expected = NP_ACTIVATIONS[ALIASES.get(name, name)](x.astype(np.float64))
    assert_close(get_activation(name)(keras.ops.convert_to_tensor(x)), expected, atol=2e-6,
                 rtol=1e-5)


def _weighted_gelu(name, seed, repeat=1):
    """(x, w, sum(w * act(x)), d/dx of it, the activation, x in float64) with x reaching far
    into both tails; x's 84 values `repeat` times (torch's CPU tanh GELU takes its own
    passes from 8,192 elements on)."""
    x = np.concatenate([x_values(), np.array([-30.0, -9.0, 9.0, 30.0], "float32")])
    x = np.tile(x, repeat)
    w = rng(seed).uniform(0.5, 1.5, size=x.shape).astype("float32")
    gelu = get_activation(name)
    value, (grad,) = value_and_grads(
        lambda t: keras.ops.sum(keras.ops.convert_to_tensor(w) * gelu(t)), x)
    return x, w, value, grad, gelu, x.astype(np.float64)


def test_gelu_tanh_gradient_matches_numpy():
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), written in float64:
    0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), far into both tails
    too (TensorFlow and torch run their own gradient of the sigmoid form here, torch from
    8,192 elements on: 88 and 8,800 values)."""
    for repeat in (1, 100):
        _check_gelu_tanh_gradient(repeat)


def _check_gelu_tanh_gradient(repeat):
    x, w, value, grad, gelu, z = _weighted_gelu("gelu_tanh", 3, repeat)
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (z + 0.044715 * z**3))
    slope = 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * c * (1 + 3 * 0.044715 * z**2)
    np.testing.assert_allclose(grad, w * slope, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, np.sum(w * 0.5 * z * (1 + t)), rtol=1e-5)
    half = gelu(keras.ops.convert_to_tensor(x[:8], "bfloat16"))
    assert keras.backend.standardize_dtype(half.dtype) == "bfloat16"


def _second_derivative(fn, x, w, v):
    """d/dx of sum(v * d/dx sum(w * fn(x))) by the backend's autodiff (a gradient of a
    gradient: torch with `create_graph`, nested tapes on TensorFlow)."""
    b = keras.backend.backend()
    if b == "jax":
        import jax
        import jax.numpy as jnp

        inner = jax.grad(lambda t: jnp.sum(w * fn(t)))
        return np.asarray(jax.grad(lambda t: jnp.sum(v * inner(t)))(x))
    if b == "torch":
        import torch

        t = torch.tensor(x, requires_grad=True)
        (d,) = torch.autograd.grad(torch.sum(torch.tensor(w) * fn(t)), t, create_graph=True)
        (h,) = torch.autograd.grad(torch.sum(torch.tensor(v) * d), t)
        return h.numpy()
    import tensorflow as tf

    t = tf.Variable(x)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            y = tf.reduce_sum(w * fn(t))
        d = inner.gradient(y, t)
        z = tf.reduce_sum(v * d)
    return outer.gradient(z, t).numpy()


def test_gelu_tanh_second_derivative_and_strided_input_match_numpy():
    """The tanh GELU's second derivative (torch's hand-written backward under `create_graph`
    is made of differentiable ops), written in float64: with u = c (x + a x^3), t = tanh(u),
    f'' = (1 - t^2) (u' - x t u'^2 + x u'' / 2); and values of a transposed (strided) input of
    the size of a feed-forward's hidden layer (the torch CPU path works in passes over it)."""
    x, w, _, _, gelu, z = _weighted_gelu("gelu_tanh", 5, repeat=100)
    v = rng(6).uniform(0.5, 1.5, size=x.shape).astype("float32")
    a, c = 0.044715, np.sqrt(2 / np.pi)
    t = np.tanh(c * (z + a * z**3))
    du, ddu = c * (1 + 3 * a * z**2), 6 * a * c * z
    expected = w * v * (1 - t**2) * (du - z * t * du**2 + 0.5 * z * ddu)
    # (atol: in float32 1 - t^2 rounds to 0 from |x| ~ 5 on, where f'' is still ~1e-5)
    np.testing.assert_allclose(_second_derivative(gelu, x, w, v), expected, rtol=1e-4, atol=5e-5)
    big = rng(7).normal(scale=3, size=(1024, 2048)).astype("float32")
    strided = keras.ops.transpose(keras.ops.convert_to_tensor(big))
    bz = big.T.astype(np.float64)
    np.testing.assert_allclose(
        to_numpy(gelu(strided)), 0.5 * bz * (1 + np.tanh(c * (bz + a * bz**3))),
        rtol=1e-5, atol=2e-6)


def test_gelu_exact_gradient_matches_numpy():
    """d/dx of x Phi(x) = Phi(x) + x phi(x), written in float64 with math.erf, far into both
    tails too (JAX runs its own erf form here, torch and TensorFlow their native GELU)."""
    import math

    x, w, value, grad, gelu, z = _weighted_gelu("gelu", 4)
    cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in z])
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    np.testing.assert_allclose(grad, w * (cdf + z * pdf), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, np.sum(w * z * cdf), rtol=1e-5)
    out = to_numpy(gelu(keras.ops.convert_to_tensor(x)))
    np.testing.assert_allclose(out, z * cdf, rtol=1e-5, atol=2e-6)
    half = gelu(keras.ops.convert_to_tensor(x[:8], "bfloat16"))
    assert keras.backend.standardize_dtype(half.dtype) == "bfloat16"
    np.testing.assert_allclose(to_numpy(keras.ops.cast(half, "float32")), (z * cdf)[:8],
                               rtol=2e-2, atol=2e-2)


def test_gelu_exact_and_tanh_differ():
    # Guards against one name silently mapping to the other form.
    x = keras.ops.convert_to_tensor(np.array([-2.5, -1.0, 1.5], "float32"))
    diff = to_numpy(get_activation("gelu")(x)) - to_numpy(get_activation("gelu_tanh")(x))
    assert np.abs(diff).max() > 1e-4


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="activation.*'gelu_fast'"):
        get_activation("gelu_fast")


def dense_weights(layer):
    return {
        v.path.split("/")[-2] + "/" + v.name: to_numpy(v).astype(np.float64) for v in layer.weights
    }


def randomize_biases(layer):
    r = rng(3)
    for v in layer.weights:
        if v.name == "bias":
            v.assign(r.normal(size=v.shape).astype("float32"))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "tanh"])
def test_feedforward_matches_numpy(activation):
    x = rng(1).normal(size=(2, 5, 6)).astype("float32")
    layer = FeedForward(intermediate_dim=12, activation=activation)
    layer.build(x.shape)
    randomize_biases(layer)
    w = dense_weights(layer)
    assert w["intermediate_dense/kernel"].shape == (6, 12)
    assert w["output_dense/kernel"].shape == (12, 6)
    h = NP_ACTIVATIONS[activation](x @ w["intermediate_dense/kernel"] + w["intermediate_dense/bias"])
    expected = h @ w["output_dense/kernel"] + w["output_dense/bias"]
    assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_feedforward_output_dim_and_no_bias():
    x = rng(2).normal(size=(3, 4)).astype("float32")
    layer = FeedForward(intermediate_dim=8, output_dim=5, use_bias=False, activation="relu")
    y = layer(x)
    assert tuple(y.shape) == (3, 5)
    assert [v.name for v in layer.weights] == ["kernel", "kernel"]
    w = dense_weights(layer)
    expected = np.maximum(x @ w["intermediate_dense/kernel"], 0) @ w["output_dense/kernel"]
    assert_close(y, expected, atol=1e-5)


def _np_feedforward(layer, x):
    act = ref.activation(layer.activation)
    return ref.apply_dense(layer.output_dense, act(ref.apply_dense(layer.intermediate_dense, x)))


def _np_gated(layer, x):
    gate = ref.activation(layer.activation)(ref.apply_dense(layer.gate_dense, x))
    return ref.apply_dense(layer.output_dense, gate * ref.apply_dense(layer.up_dense, x))


@pytest.mark.parametrize("cls, kwargs, reference, out_dim", [
    (FeedForward, dict(intermediate_dim=12, activation="gelu"), _np_feedforward, 6),
    (FeedForward, dict(intermediate_dim=8, output_dim=5, use_bias=False, activation="relu"),
     _np_feedforward, 5),
    (GatedFeedForward, dict(intermediate_dim=10, activation="silu"), _np_gated, 6),
    (GatedFeedForward, dict(intermediate_dim=10, activation="gelu", use_bias=True,
                            output_dim=3), _np_gated, 3),
])
def test_layer_harness(cls, kwargs, reference, out_dim):
    """Build, call, NumPy reference, config / serialization round trip and mixed precision,
    through the shared check_layer."""
    check_layer(cls, kwargs, input_shape=(2, 5, 6), expected_output_shape=(2, 5, out_dim),
                reference=reference)


GLU_VARIANTS = {  # activation of the gate branch for each named variant of Shazeer (2020)
    "GLU": "sigmoid",
    "ReGLU": "relu",
    "GEGLU": "gelu",
    "GEGLU-tanh (T5 v1.1)": "gelu_tanh",
    "SwiGLU": "silu",
    "Bilinear": "linear",
}


@pytest.mark.parametrize("variant", sorted(GLU_VARIANTS))
def test_gated_feedforward_variants_match_numpy(variant):
    activation = GLU_VARIANTS[variant]
    x = rng(4).normal(size=(2, 5, 6)).astype("float32")
    layer = GatedFeedForward(intermediate_dim=10, activation=activation)
    layer.build(x.shape)
    w = dense_weights(layer)
    assert sorted(w) == ["gate_dense/kernel", "output_dense/kernel", "up_dense/kernel"]
    gate = NP_ACTIVATIONS[activation](x @ w["gate_dense/kernel"])
    expected = (gate * (x @ w["up_dense/kernel"])) @ w["output_dense/kernel"]
    assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_gated_feedforward_with_bias_and_output_dim():
    x = rng(5).normal(size=(4, 6)).astype("float32")
    layer = GatedFeedForward(intermediate_dim=10, activation="gelu", use_bias=True, output_dim=3)
    layer.build(x.shape)
    randomize_biases(layer)
    w = dense_weights(layer)
    gate = NP_ACTIVATIONS["gelu"](x @ w["gate_dense/kernel"] + w["gate_dense/bias"])
    up = x @ w["up_dense/kernel"] + w["up_dense/bias"]
    expected = (gate * up) @ w["output_dense/kernel"] + w["output_dense/bias"]
    assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [FeedForward, GatedFeedForward])
def test_dropout_only_in_training(cls):
    x = rng(6).normal(size=(4, 16)).astype("float32")
    layer = cls(intermediate_dim=64, dropout=0.5)
    inference = to_numpy(layer(x, training=False))
    assert_close(layer(x), inference, atol=0)
    training = to_numpy(layer(x, training=True))
    assert np.isfinite(training).all()
    assert not np.allclose(training, inference, atol=1e-3)


@pytest.mark.parametrize("cls", [FeedForward, GatedFeedForward])
def test_mixed_precision_dtypes(cls):
    keras.config.set_dtype_policy("mixed_bfloat16")
    x = rng(7).normal(size=(2, 8)).astype("float32")
    layer = cls(intermediate_dim=16)
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    assert all(v.dtype == "float32" for v in layer.weights)
    assert layer.output_dense.compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    "cls,kwargs,fragment",
    [
        (FeedForward, dict(intermediate_dim=0), "intermediate_dim"),
        (FeedForward, dict(intermediate_dim=8, activation="gelu_fast"), "activation"),
        (FeedForward, dict(intermediate_dim=8, dropout=1.5), "dropout"),
        (FeedForward, dict(intermediate_dim=8, output_dim=-2), "output_dim"),
        (FeedForward, dict(intermediate_dim=8, use_bias=1), "use_bias"),
        (GatedFeedForward, dict(intermediate_dim=8.0), "intermediate_dim"),
        (GatedFeedForward, dict(intermediate_dim=8, activation="glu"), "activation"),
        (GatedFeedForward, dict(intermediate_dim=8, dropout=-0.1), "dropout"),
    ],
)
def test_bad_arguments_raise(cls, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        cls(**kwargs)


def test_serialization_and_keras_file(tmp_path):
    for layer in (
        FeedForward(8, activation="gelu_new", dropout=0.1, output_dim=3,
                    kernel_initializer=keras.initializers.RandomNormal(stddev=0.02)),
        GatedFeedForward(8, activation="gelu_tanh", use_bias=True),
    ):
        clone = roundtrip_layer(layer)
        assert clone.activation == layer.activation
    x = rng(8).normal(size=(2, 3, 4)).astype("float32")
    inp = keras.Input((3, 4))
    out = GatedFeedForward(8, name="glu")(FeedForward(6, name="ffn")(inp))
    model = keras.Model(inp, out)
    path = str(tmp_path / "ffn.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert_close(restored(x), to_numpy(model(x)), atol=1e-6)
    assert [v.path for v in restored.weights] == [v.path for v in model.weights]


@pytest.mark.parametrize("cls", [FeedForward, GatedFeedForward])
def test_output_kernel_initializer(cls):
    const = keras.initializers.Constant
    layer = cls(8, kernel_initializer=const(0.1), output_kernel_initializer=const(0.6))
    roundtrip_layer(layer)
    layer(np.zeros((1, 3, 4), "float32"))
    for w in layer.weights:
        if w.path.endswith("kernel"):
            expected = 0.6 if "output_dense" in w.path else 0.1
            np.testing.assert_array_equal(to_numpy(w), np.float32(expected), w.path)
    default = cls(8, kernel_initializer=const(0.1))
    default(np.zeros((1, 3, 4), "float32"))
    np.testing.assert_array_equal(to_numpy(default.output_dense.kernel), np.float32(0.1))


def test_unknown_last_axis_is_a_clear_error():
    from kzoo.layers.moe import MixtureOfExperts
    from kzoo.layers.norm import RMSNorm

    layers = [FeedForward(8), GatedFeedForward(8), RMSNorm(),
              MixtureOfExperts(num_experts=2, intermediate_dim=8, top_k=1)]
    for layer in layers:
        name = layer.__class__.__name__
        with pytest.raises(ValueError, match=f"last axis of the input to {name} must be known"):
            layer.build((2, 3, None))


def test_portable_activations_give_the_same_exact_gelu():
    """Under `portable_activations()` (what `kzoo.export` traces under) the exact GELU has
    the same values; on JAX it is traced through `erfc` (jax.nn.gelu) instead of `erf`."""
    from kzoo.layers.feedforward import portable_activations

    x = x_values()
    gelu = get_activation("gelu")
    plain = to_numpy(gelu(keras.ops.convert_to_tensor(x)))
    with portable_activations():
        portable = to_numpy(gelu(keras.ops.convert_to_tensor(x)))
    np.testing.assert_allclose(portable, plain, rtol=1e-5, atol=2e-6)
    if keras.backend.backend() == "jax":
        import jax

        # (a new function each time: JAX caches a function's trace)
        assert " erf " in str(jax.make_jaxpr(lambda t: gelu(t))(x)).replace("(", " ")
        with portable_activations():
            traced = str(jax.make_jaxpr(lambda t: gelu(t))(x))
        assert "erfc" in traced and " erf " not in traced.replace("(", " ")
