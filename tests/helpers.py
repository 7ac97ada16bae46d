"""Test helpers shared by every test module (no kzoo numerics here)."""

import numpy as np
import keras


def backend():
    return keras.backend.backend()


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(
        to_numpy(actual).astype(np.float64),
        np.asarray(expected, dtype=np.float64),
        atol=atol,
        rtol=rtol,
    )


def roundtrip_layer(layer):
    """from_config(get_config()) must rebuild a layer with the identical config."""
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    restored = keras.saving.deserialize_keras_object(serialized)
    assert restored.get_config() == config
    return clone


def rng(seed=0):
    return np.random.default_rng(seed)


def value_and_grads(fn, *arrays):
    """fn(*tensors) -> scalar, and its gradients with respect to every array, via the
    backend's own autodiff."""
    b = keras.backend.backend()
    if b == "jax":
        import jax

        value, grads = jax.value_and_grad(fn, argnums=tuple(range(len(arrays))))(*arrays)
        return float(value), [np.asarray(g) for g in grads]
    if b == "torch":
        import torch

        ts = [torch.tensor(a, requires_grad=True) for a in arrays]
        value = fn(*ts)
        value.backward()
        return float(value), [t.grad.numpy() for t in ts]
    import tensorflow as tf

    ts = [tf.Variable(a) for a in arrays]
    with tf.GradientTape() as tape:
        value = fn(*ts)
    return float(value), [g.numpy() for g in tape.gradient(value, ts)]


def count_compiled_steps(monkeypatch):
    """Turn on the torch loop's compiled decode step (`KZOO_COMPILED_DECODE=1`) for the test
    and return a list that gets one entry per call of a compiled step."""
    from kzoo.layers import compiled_decode

    monkeypatch.setenv(compiled_decode.ENV, "1")
    calls = []
    real = compiled_decode._compiled

    def counted(config, fn=None):
        run = real(config, fn)
        return lambda *a: calls.append(1) or run(*a)

    monkeypatch.setattr(compiled_decode, "_compiled", counted)
    return calls
