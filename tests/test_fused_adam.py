"""Keras' Adam / AdamW through torch's fused kernel (`kzoo.fused_adam`): the same update as a
NumPy formula of Keras' Adam, where it is taken and where it is not."""

import math

import keras
import numpy as np
import pytest

from kzoo import fused_adam
from tests.helpers import backend

TORCH = backend() == "torch"
FUSED = backend() in ("torch", "tensorflow")  # (JAX: XLA fuses Keras' update itself)
SHAPES = [(30, 4), (4,), (3, 2, 5)]


def numpy_adamw(init, grads, lr, wd=0.0, beta_1=0.9, beta_2=0.999, eps=1e-7, decayed=None,
                clipnorm=None):
    """Keras' AdamW in float64: clip each gradient by its norm, decay `w -= w * wd * lr_t`,
    then `m += (g - m)(1 - b1)`, `v += (g^2 - v)(1 - b2)`, `w -= lr_t sqrt(1 - b2^t) / (1 -
    b1^t) * m / (sqrt(v) + eps)`; `lr(step)` the learning rate at the step's count (from 0)."""
    w = [a.astype(np.float64) for a in init]
    m = [np.zeros_like(a) for a in w]
    v = [np.zeros_like(a) for a in w]
    decayed = decayed or [True] * len(w)
    for step, gs in enumerate(grads):
        t, lr_t = step + 1, lr(step)
        for i, g in enumerate(gs):
            g = g.astype(np.float64)
            if clipnorm is not None:
                g = g * clipnorm / max(np.sqrt((g * g).sum()), clipnorm)
            if wd and decayed[i]:
                w[i] = w[i] - w[i] * wd * lr_t
            m[i] = m[i] + (g - m[i]) * (1 - beta_1)
            v[i] = v[i] + (g * g - v[i]) * (1 - beta_2)
            alpha = lr_t * math.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
            w[i] = w[i] - alpha * m[i] / (np.sqrt(v[i]) + eps)
    return w


def run_keras(optimizer, init, grads):
    """`optimizer.apply` (eager) over `grads` (lists of NumPy arrays) from `init`, after
    `fused_adam.install`; returns the variables, whether it was installed, and how many
    variables the fused kernel updated (torch's `_fused_adam_`, TensorFlow's
    `ResourceApplyAdam`)."""
    variables = [keras.Variable(a, name=f"w{i}") for i, a in enumerate(init)]
    installed = fused_adam.install(optimizer)
    calls = []
    if TORCH:
        import torch as module

        name = "_fused_adam_"
    elif FUSED:
        import tensorflow as tf

        module, name = tf.raw_ops, "ResourceApplyAdam"
    if FUSED:
        kernel = getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(len(args[0]) if TORCH else 1)
            return kernel(*args, **kwargs)

        setattr(module, name, counted)
    try:
        for gs in grads:
            optimizer.apply([keras.ops.convert_to_tensor(g) for g in gs], variables)
    finally:
        if FUSED:
            setattr(module, name, kernel)
    return [keras.ops.convert_to_numpy(v) for v in variables], installed, sum(calls)


def problem(seed=0, steps=6, scale=1.0):
    r = np.random.default_rng(seed)
    init = [r.normal(size=s).astype("float32") for s in SHAPES]
    grads = [[(scale * r.normal(size=s)).astype("float32") for s in SHAPES]
             for _ in range(steps)]
    return init, grads


@pytest.mark.parametrize("lr_on_device", [False, True])
def test_adamw_with_schedule_decay_and_exclusion_equals_numpy(lr_on_device, monkeypatch):
    """AdamW with a decaying learning rate, weight decay (one variable excluded by name) and
    a large epsilon (so its place in the formula shows): NumPy's Keras AdamW after 6 steps;
    on torch and TensorFlow all three variables went through the fused kernel at every
    step. `lr_on_device`: torch's CUDA form, the learning rate handed to the kernel as a
    tensor (`fused_adam.LR_ON_DEVICE`), taken here on the CPU."""
    if lr_on_device:
        monkeypatch.setattr(fused_adam, "LR_ON_DEVICE", ("cpu", "cuda"))
    init, grads = problem()
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5)
    optimizer = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.1, epsilon=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["w1"])
    got, installed, calls = run_keras(optimizer, init, grads)
    want = numpy_adamw(init, grads, lambda s: 1e-2 * 0.5 ** (s / 2), wd=0.1, eps=1e-3,
                       decayed=[True, False, True])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert installed == FUSED
    assert calls == (3 * 6 if FUSED else 0)


@pytest.mark.parametrize("lr_on_device", [False, True])
def test_adam_with_clipping_and_small_gradients_equals_numpy(lr_on_device, monkeypatch):
    """Adam (no decay) with `clipnorm` (Keras clips before the fused update) and gradients
    of 1e-4 (the bias-corrected epsilon dominates): NumPy's. `lr_on_device`: as above, a
    constant learning rate (a Keras variable) handed over as a tensor."""
    if lr_on_device:
        monkeypatch.setattr(fused_adam, "LR_ON_DEVICE", ("cpu", "cuda"))
    init, grads = problem(seed=1, steps=4, scale=1e-4)
    grads[1][0] *= 1e5  # (a large one for the clip)
    optimizer = keras.optimizers.Adam(learning_rate=3e-3, clipnorm=0.5)
    got, installed, calls = run_keras(optimizer, init, grads)
    want = numpy_adamw(init, grads, lambda s: 3e-3, clipnorm=0.5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert calls == (3 * 4 if FUSED else 0)


@pytest.mark.parametrize("case", ["amsgrad", "float64", "sgd"])
def test_other_optimizers_keep_keras_update(case):
    """Where the fused kernel does not apply, Keras' own update runs and the kernel is not
    called: `amsgrad=True`, float64 variables (NumPy's Adam), another optimizer."""
    init, grads = problem(seed=2, steps=3)
    if case == "float64":
        init = [a.astype("float64") for a in init]
        grads = [[g.astype("float64") for g in gs] for gs in grads]
    optimizer = {
        "amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
        "float64": lambda: keras.optimizers.Adam(1e-2),
        "sgd": lambda: keras.optimizers.SGD(1e-2),
    }[case]()
    got, installed, calls = run_keras(optimizer, init, grads)
    assert calls == 0
    assert installed == (FUSED and case != "sgd")
    if case == "float64":
        want = numpy_adamw(init, grads, lambda s: 1e-2)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kzoo_model_compile_installs_it_and_trains():
    """A kzoo model compiled with AdamW updates through the fused kernel on torch and
    TensorFlow (installed once, installing again keeps one wrapper) and its loss falls over
    a few steps."""
    from tests.test_gpt import tiny_lm

    model = tiny_lm()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.01))
    assert getattr(model.optimizer, "_kzoo_fused_adam", False) == FUSED
    assert fused_adam.install(model.optimizer) == FUSED
    r = np.random.default_rng(5)
    x = r.integers(1, 50, (4, 12))
    inputs = {"token_ids": x[:, :-1], "padding_mask": np.ones((4, 11), bool)}
    calls = []
    if FUSED:  # (TensorFlow: counted while the training graph is traced)
        if TORCH:
            import torch as module

            name = "_fused_adam_"
        else:
            import tensorflow as tf

            module, name = tf.raw_ops, "ResourceApplyAdam"
        kernel = getattr(module, name)
        setattr(module, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    try:
        losses = [float(model.train_on_batch(inputs, x[:, 1:])) for _ in range(5)]
    finally:
        if FUSED:
            setattr(module, name, kernel)
    assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses)
    if TORCH:
        assert len(calls) == 5
    elif FUSED:  # (once a variable each time the graph is traced)
        assert calls and len(calls) % len(model.trainable_variables) == 0
    else:
        assert calls == []


def test_torch_compile_tracing_takes_keras_update(monkeypatch):
    """While torch.compile traces the step (`compile(jit_compile=True)` on torch) the fused
    kernel, whose step count and learning rate are read on the host, is not called: Keras'
    own update runs, equal to Keras' formula. Before, tracing the fused call failed the whole
    training step. (JAX / TensorFlow: nothing traces with torch; their update is checked.)"""
    if TORCH:
        import torch

        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    init, grads = problem(seed=4, steps=3)
    got, installed, calls = run_keras(keras.optimizers.Adam(1e-2), init, grads)
    assert installed == FUSED
    assert calls == (0 if TORCH or not FUSED else 3 * len(SHAPES))
    for a, b in zip(got, numpy_adamw(init, grads, lambda s: 1e-2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_device_scalar_keeps_numbers_and_moves_tensors():
    """`_device_scalar` (torch): a Python number stays a float, a Keras variable and a
    tensor become a float32 0-d tensor on the device, with the same value."""
    if not TORCH:
        assert not fused_adam.install(keras.optimizers.SGD(1e-2))
        return
    import torch

    cpu = torch.device("cpu")
    assert fused_adam._device_scalar(torch, 0.25, cpu) == 0.25
    for value in (keras.Variable(0.5), torch.tensor([0.5], dtype=torch.float64)):
        got = fused_adam._device_scalar(torch, value, cpu)
        assert isinstance(got, torch.Tensor) and got.shape == () and got.dtype == torch.float32
        assert float(got) == 0.5
