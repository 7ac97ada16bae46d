"""Tests of kzoo.schedules against plain-Python formulas (step convention t = step + 1)."""

import math

import keras
import numpy as np
import pytest

from kzoo.schedules import WarmupCosineDecay
from kzoo.schedules import WarmupInverseSqrt
from kzoo.schedules import WarmupLinearDecay
from kzoo.schedules import plot_schedule
from tests.helpers import assert_close
from tests.helpers import to_numpy

# --- reference formulas, written independently of kzoo (t is the 1-based update index) ---


def paper_lr(step, d_model, warmup, scale=1.0):
    t = step + 1
    return scale * d_model**-0.5 * min(t**-0.5, t * warmup**-1.5)


def peak_lr(step, peak, warmup):
    t = step + 1
    return peak * min(t / warmup, math.sqrt(warmup / t))


def linear_lr(step, peak, warmup, decay, end=0.0):
    t = step + 1
    if t <= warmup:
        return peak * t / warmup
    frac = min((t - warmup) / decay, 1.0)
    return peak * (1 - frac) + end * frac


def cosine_lr(step, peak, warmup, decay, alpha=0.0):
    t = step + 1
    if t <= warmup:
        return peak * t / warmup
    frac = min((t - warmup) / decay, 1.0)
    return peak * (alpha + (1 - alpha) * (1 + math.cos(math.pi * frac)) / 2)


def _steps(warmup):
    return [0, 1, warmup - 2, warmup - 1, warmup, warmup + 1, 3 * warmup, 10 * warmup]


@pytest.mark.parametrize("d_model,warmup,scale", [(512, 4000, 1.0), (64, 10, 2.0)])
def test_inverse_sqrt_paper_form_values(d_model, warmup, scale):
    schedule = WarmupInverseSqrt(d_model=d_model, warmup_steps=warmup, scale=scale)
    for step in _steps(warmup):
        value = schedule(step)
        assert keras.backend.standardize_dtype(value.dtype) == "float32"
        assert_close(value, paper_lr(step, d_model, warmup, scale), atol=0, rtol=1e-6)


@pytest.mark.parametrize("peak,warmup", [(1e-3, 100), (5e-4, 7)])
def test_inverse_sqrt_peak_form_values(peak, warmup):
    schedule = WarmupInverseSqrt(peak_learning_rate=peak, warmup_steps=warmup)
    for step in _steps(warmup):
        assert_close(schedule(step), peak_lr(step, peak, warmup), atol=0, rtol=1e-6)
    # step 0 is the first update: non-zero; the warmup_steps-th update is the peak.
    assert float(to_numpy(schedule(0))) == pytest.approx(peak / warmup, rel=1e-6)
    assert float(to_numpy(schedule(warmup - 1))) == pytest.approx(peak, rel=1e-6)
    assert float(to_numpy(schedule(warmup))) < float(to_numpy(schedule(warmup - 1)))


def test_inverse_sqrt_vectorised_and_peak_property():
    schedule = WarmupInverseSqrt(d_model=128, warmup_steps=50)
    steps = np.arange(0, 400, 7)
    expected = [paper_lr(int(s), 128, 50) for s in steps]
    assert_close(schedule(steps), expected, atol=0, rtol=1e-6)
    assert schedule.peak == pytest.approx(paper_lr(49, 128, 50), rel=1e-12)


def test_linear_decay_values():
    schedule = WarmupLinearDecay(2e-4, warmup_steps=10, decay_steps=90, end_learning_rate=1e-5)
    for step in [0, 5, 8, 9, 10, 11, 50, 98, 99, 100, 1000]:
        assert_close(schedule(step), linear_lr(step, 2e-4, 10, 90, 1e-5), atol=0, rtol=1e-5)
    assert float(to_numpy(schedule(99))) == pytest.approx(1e-5, rel=1e-5)


def test_cosine_decay_values():
    schedule = WarmupCosineDecay(6e-4, warmup_steps=20, decay_steps=200, alpha=0.1)
    for step in [0, 1, 18, 19, 20, 21, 119, 218, 219, 220, 5000]:
        assert_close(schedule(step), cosine_lr(step, 6e-4, 20, 200, 0.1), atol=0, rtol=1e-5)


@pytest.mark.parametrize(
    "schedule",
    [
        WarmupInverseSqrt(d_model=32, warmup_steps=5, scale=0.5),
        WarmupInverseSqrt(peak_learning_rate=0.05, warmup_steps=4),
        WarmupLinearDecay(0.05, warmup_steps=2, decay_steps=3),
        WarmupCosineDecay(0.05, warmup_steps=2, decay_steps=3, alpha=0.2),
    ],
    ids=["paper", "peak", "linear", "cosine"],
)
def test_sgd_updates_inside_fit_use_schedule(schedule):
    """Full-batch SGD on a linear model: each of the 3 updates must use lr(step)."""
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")).astype("float32")
    w0 = np.full((3, 1), 0.1, dtype="float32")

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].set_weights([w0])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=schedule), loss="mse")
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    expected_lr = {
        WarmupInverseSqrt: lambda s: (
            paper_lr(s, 32, 5, 0.5) if schedule.d_model else peak_lr(s, 0.05, 4)
        ),
        WarmupLinearDecay: lambda s: linear_lr(s, 0.05, 2, 3),
        WarmupCosineDecay: lambda s: cosine_lr(s, 0.05, 2, 3, 0.2),
    }[type(schedule)]
    w = w0.astype("float64")
    x64, y64 = x.astype("float64"), y.astype("float64")
    for step in range(3):
        grad = 2.0 / len(x64) * x64.T @ (x64 @ w - y64)
        w = w - expected_lr(step) * grad
    assert_close(model.layers[0].kernel, w, atol=1e-6, rtol=1e-5)
    assert int(to_numpy(model.optimizer.iterations)) == 3
    assert_close(model.optimizer.learning_rate, expected_lr(3), atol=0, rtol=1e-6)


def test_adamw_fit_and_keras_roundtrip(tmp_path):
    schedule = WarmupInverseSqrt(peak_learning_rate=1e-2, warmup_steps=4)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=schedule), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 4)).astype("float32")
    y = rng.normal(size=(12, 2)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 3 steps
    assert int(to_numpy(model.optimizer.iterations)) == 3
    assert_close(model.optimizer.learning_rate, peak_lr(3, 1e-2, 4), atol=0, rtol=1e-6)

    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.AdamW)
    lr_config = loaded.optimizer.get_config()["learning_rate"]
    restored = keras.saving.deserialize_keras_object(lr_config)
    assert isinstance(restored, WarmupInverseSqrt)
    assert restored.get_config() == schedule.get_config()
    assert int(to_numpy(loaded.optimizer.iterations)) == 3
    assert_close(loaded.optimizer.learning_rate, peak_lr(3, 1e-2, 4), atol=0, rtol=1e-6)
    assert_close(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize(
    "schedule",
    [
        WarmupInverseSqrt(d_model=512, warmup_steps=4000, scale=2.0, name="lr"),
        WarmupInverseSqrt(peak_learning_rate=3e-4, warmup_steps=10),
        WarmupLinearDecay(1e-4, 10, 100, end_learning_rate=1e-6),
        WarmupCosineDecay(1e-4, 10, 100, alpha=0.05),
    ],
)
def test_config_roundtrip(schedule):
    config = schedule.get_config()
    clone = type(schedule).from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(schedule)
    )
    assert type(restored) is type(schedule) and restored.get_config() == config
    for step in (0, 9, 10, 500):
        assert_close(restored(step), to_numpy(schedule(step)), atol=0, rtol=0)


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: WarmupInverseSqrt(warmup_steps=10), "exactly one"),
        (lambda: WarmupInverseSqrt(d_model=512, peak_learning_rate=1e-3), "exactly one"),
        (lambda: WarmupInverseSqrt(d_model=0), "d_model"),
        (lambda: WarmupInverseSqrt(d_model=51.2), "d_model"),
        (lambda: WarmupInverseSqrt(peak_learning_rate=-1e-3), "peak_learning_rate"),
        (lambda: WarmupInverseSqrt(d_model=512, warmup_steps=0), "warmup_steps"),
        (lambda: WarmupInverseSqrt(d_model=512, warmup_steps=True), "warmup_steps"),
        (lambda: WarmupInverseSqrt(d_model=512, scale=0.0), "scale"),
        (lambda: WarmupInverseSqrt(d_model=512, name=3), "name"),
        (lambda: WarmupLinearDecay(1e-3, 10, 0), "decay_steps"),
        (lambda: WarmupLinearDecay(1e-3, 10, 10, end_learning_rate=1e-2), "end_learning_rate"),
        (lambda: WarmupCosineDecay(0.0, 10, 10), "peak_learning_rate"),
        (lambda: WarmupCosineDecay(1e-3, 10, 10, alpha=1.5), "alpha"),
        (lambda: plot_schedule(WarmupCosineDecay(1e-3, 1, 1), 0, "x.png"), "steps"),
    ],
)
def test_bad_arguments_raise(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_plot_schedule_writes_png(tmp_path):
    path = tmp_path / "lr.png"
    schedule = WarmupInverseSqrt(d_model=256, warmup_steps=30)
    assert plot_schedule(schedule, 300, str(path)) == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("schedule", [
    WarmupInverseSqrt(peak_learning_rate=1e-3, warmup_steps=10),
    WarmupLinearDecay(peak_learning_rate=1e-3, warmup_steps=10, decay_steps=100),
    WarmupCosineDecay(peak_learning_rate=1e-3, warmup_steps=10, decay_steps=100),
])
def test_a_step_before_the_first_counts_as_the_first(schedule):
    """A negative step (no optimizer gives one) is step 0: finite and positive, not the
    NaN of `sqrt` of a negative index (WarmupInverseSqrt gave NaN at step -2)."""
    first = float(to_numpy(schedule(0)))
    assert first == pytest.approx(1e-3 / 10)
    for step in (-1, -2, -1000, float("nan"), np.float32("nan")):
        assert float(to_numpy(schedule(step))) == first
