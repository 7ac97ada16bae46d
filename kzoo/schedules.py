"""Learning-rate schedules with a warmup phase, as used to train transformers.

Three schedules, all `keras.optimizers.schedules.LearningRateSchedule` subclasses that
work as float32 tensor ops inside a jit-compiled `fit` on JAX, PyTorch and TensorFlow,
and serialise with the optimizer into `.keras` files:

- `WarmupInverseSqrt`: linear warmup then `1/sqrt(step)` decay (Vaswani et al., 2017,
  "Attention Is All You Need", eq. 3), either in the paper's `d_model` form or in a
  "peak learning rate" form.
- `WarmupLinearDecay`: linear warmup then linear decay (BERT, Devlin et al., 2019).
- `WarmupCosineDecay`: linear warmup then cosine decay (Loshchilov & Hutter, 2017;
  GPT-2/3 style).

Step convention (all three): a Keras optimizer's `iterations` counter is 0 while the
first update is computed, so the schedules evaluate their formula at `t = step + 1`.
`schedule(0)` is the learning rate of the first update and is never zero;
`schedule(warmup_steps - 1)` (the `warmup_steps`-th update) is the peak.

`plot_schedule(schedule, steps, path)` writes a PNG of a schedule with matplotlib.
"""

import math
import os

import keras
import numpy as np
from keras import ops

from kzoo.layers.utils import _is_real
from kzoo.layers.utils import check_positive_float
from kzoo.layers.utils import check_positive_int

__all__ = [
    "WarmupInverseSqrt",
    "WarmupLinearDecay",
    "WarmupCosineDecay",
    "plot_schedule",
]


def _check_name(name):
    if name is not None and not isinstance(name, str):
        raise ValueError(f"`name` must be a string or None; got name={name!r}.")
    return name


def _check_unit_interval(name, value):
    # (NumPy floats other than float64, e.g. np.float32(0.1), were refused)
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1]; got {name}={value!r}.")
    return float(value)


# The optimizer's step counter is an int64: longer phases are never reached (and larger
# Python ints overflowed float() inside `__call__`, an OverflowError).
_MAX_STEPS = 2**63 - 1
_FLOAT32_MAX = float(np.finfo("float32").max)
_FLOAT32_TINY = float(np.finfo("float32").tiny)


def _check_steps(name, value, why=" (the optimizer's int64 step counter)"):
    value = check_positive_int(name, value)
    if value > _MAX_STEPS:
        raise ValueError(
            f"`{name}` must be a positive integer of at most 2**63 - 1{why}; got "
            f"{name}={value!r}."
        )
    return value


def _check_peak(peak, given):
    """Refuse a peak learning rate that float32 (the schedules' dtype) cannot hold: it was
    inf (every update then made the weights NaN) or 0 (no update at all), in silence."""
    if not _FLOAT32_TINY <= peak <= _FLOAT32_MAX:
        raise ValueError(
            f"The peak learning rate must be a normal float32 number (in [{_FLOAT32_TINY:.4g}, "
            f"{_FLOAT32_MAX:.4g}]); got a peak of {peak:.4g} from {given}."
        )


def _check_step(step):
    """Refuse a `step` that is not a number or a numeric tensor. A string step (`"10"`)
    was read as the number 10 on JAX and failed inside the cast on PyTorch and TensorFlow.
    Only the (static) dtype is read: nothing is computed inside a compiled train step."""
    dtype = step.dtype if hasattr(step, "dtype") else np.asarray(step).dtype
    try:
        name = keras.backend.standardize_dtype(dtype)
    except ValueError:  # NumPy strings, objects (None) and the like
        name = str(dtype)
    if isinstance(step, (str, bytes)) or not name.startswith(("int", "uint", "float",
                                                              "bfloat")):
        raise TypeError(
            "`step` must be a number or an integer or float tensor (the optimizer's "
            f"`iterations`); got step={step!r:.80} of type {type(step).__name__} "
            f"(dtype {name})."
        )


def _update_index(step):
    """The 1-based index `t = step + 1` of the update, as a float32 tensor. A negative
    `step` (before the first update: never an optimizer's), and a NaN one, count as step
    0, so no schedule answers NaN (`sqrt` of a negative) or a negative rate there."""
    _check_step(step)
    step = ops.cast(step, "float32")
    return ops.where(step > 0.0, step, 0.0) + 1.0  # (NaN > 0 is False: step 0)


@keras.saving.register_keras_serializable(package="kzoo")
class WarmupInverseSqrt(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup followed by inverse-square-root decay.

    Two equivalent parametrisations; give exactly one of `d_model` and
    `peak_learning_rate`. With `t = step + 1` (see "Step convention" below):

    - Paper form (Vaswani et al., 2017, eq. 3), when `d_model` is given:
      `lr = scale * d_model**-0.5 * min(t**-0.5, t * warmup_steps**-1.5)`.
      The peak, reached at `t = warmup_steps`, is
      `scale * (d_model * warmup_steps)**-0.5`.
    - Peak form, when `peak_learning_rate` is given:
      `lr = scale * peak_learning_rate * min(t / warmup_steps, sqrt(warmup_steps / t))`.
      The learning rate rises linearly to `scale * peak_learning_rate` at
      `t = warmup_steps` and then decays as `1/sqrt(t)`.

    Step convention: the optimizer's `iterations` counter is 0 during the first
    update, so the formula is evaluated at `t = step + 1`. The first update
    therefore uses a non-zero learning rate, and the peak is used by the
    `warmup_steps`-th update (`step = warmup_steps - 1`).

    Args:
        d_model: positive int, the model width of the paper form, or None.
        peak_learning_rate: positive float, the peak of the peak form, or None.
        warmup_steps: positive int, the number of updates of the linear warmup.
            Defaults to 4000 (the paper's value).
        scale: positive float multiplying the learning rate. Defaults to 1.0.
        name: optional string, the name scope of the op.

    Example:

    ```python
    schedule = kzoo.schedules.WarmupInverseSqrt(d_model=512, warmup_steps=4000)
    float(schedule(3999))  # peak: 512**-0.5 * 4000**-0.5 ~= 6.99e-4
    optimizer = keras.optimizers.AdamW(
        learning_rate=kzoo.schedules.WarmupInverseSqrt(
            peak_learning_rate=1e-3, warmup_steps=100
        )
    )
    ```
    """

    def __init__(
        self,
        d_model=None,
        peak_learning_rate=None,
        warmup_steps=4000,
        scale=1.0,
        name=None,
    ):
        super().__init__()
        if (d_model is None) == (peak_learning_rate is None):
            raise ValueError(
                "Give exactly one of `d_model` (the paper form) and `peak_learning_rate` "
                f"(the peak form); got d_model={d_model!r}, "
                f"peak_learning_rate={peak_learning_rate!r}."
            )
        if d_model is not None:
            d_model = _check_steps("d_model", d_model, why="")
        if peak_learning_rate is not None:
            peak_learning_rate = check_positive_float("peak_learning_rate", peak_learning_rate)
        warmup_steps = _check_steps("warmup_steps", warmup_steps)
        scale = check_positive_float("scale", scale)
        self.d_model = d_model
        self.peak_learning_rate = peak_learning_rate
        self.warmup_steps = warmup_steps
        self.scale = scale
        form = (f"d_model={d_model!r}, warmup_steps={warmup_steps!r}" if d_model is not None
                else f"peak_learning_rate={peak_learning_rate!r}")
        _check_peak(self.peak, f"{form} and scale={scale!r}")
        self.name = _check_name(name)

    @property
    def peak(self):
        """The largest learning rate of the schedule (a Python float)."""
        if self.d_model is not None:
            return self.scale * (self.d_model * self.warmup_steps) ** -0.5
        return self.scale * self.peak_learning_rate

    def __call__(self, step):
        with keras.name_scope(self.name or "WarmupInverseSqrt"):
            t = _update_index(step)
            warmup = float(self.warmup_steps)
            # Both forms are `peak * min(t / warmup, sqrt(warmup / t))`; the paper's
            # form is that identity with peak = (d_model * warmup) ** -0.5.
            ramp = t / warmup
            decay = ops.sqrt(warmup / t)
            return ops.cast(self.peak, "float32") * ops.minimum(ramp, decay)

    def get_config(self):
        return {
            "d_model": self.d_model,
            "peak_learning_rate": self.peak_learning_rate,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "name": self.name,
        }


def _check_warmup_decay(peak_learning_rate, warmup_steps, decay_steps):
    peak_learning_rate = check_positive_float("peak_learning_rate", peak_learning_rate)
    _check_peak(peak_learning_rate, f"peak_learning_rate={peak_learning_rate!r}")
    return (peak_learning_rate, _check_steps("warmup_steps", warmup_steps),
            _check_steps("decay_steps", decay_steps))


@keras.saving.register_keras_serializable(package="kzoo")
class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to a peak, then linear decay (BERT's schedule).

    With `t = step + 1` (see `WarmupInverseSqrt` for the step convention):

    - `t <= warmup_steps`: `lr = peak_learning_rate * t / warmup_steps`;
    - afterwards, with `p = min((t - warmup_steps) / decay_steps, 1)`:
      `lr = peak_learning_rate + (end_learning_rate - peak_learning_rate) * p`.

    So a run of `warmup_steps + decay_steps` updates ends at `end_learning_rate`,
    which is kept from then on. Devlin et al. (2019) train BERT with
    `peak_learning_rate=1e-4`, `warmup_steps=10_000`, and a decay to 0 over the
    rest of the run.

    Args:
        peak_learning_rate: positive float, the learning rate at the end of warmup.
        warmup_steps: positive int, number of updates of the linear warmup.
        decay_steps: positive int, number of updates of the decay after warmup.
        end_learning_rate: float in `[0, peak_learning_rate]`, the final value.
            Defaults to 0.0.
        name: optional string, the name scope of the op.

    Example:

    ```python
    schedule = kzoo.schedules.WarmupLinearDecay(
        peak_learning_rate=1e-4, warmup_steps=100, decay_steps=900
    )
    optimizer = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01)
    ```
    """

    def __init__(
        self,
        peak_learning_rate,
        warmup_steps,
        decay_steps,
        end_learning_rate=0.0,
        name=None,
    ):
        super().__init__()
        peak_learning_rate, warmup_steps, decay_steps = _check_warmup_decay(
            peak_learning_rate, warmup_steps, decay_steps)
        if not _is_real(end_learning_rate) or not 0.0 <= end_learning_rate <= peak_learning_rate:
            raise ValueError(
                "`end_learning_rate` must be a number in [0, peak_learning_rate="
                f"{peak_learning_rate}]; got end_learning_rate={end_learning_rate!r}."
            )
        self.peak_learning_rate = peak_learning_rate
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.end_learning_rate = float(end_learning_rate)
        self.name = _check_name(name)

    def __call__(self, step):
        with keras.name_scope(self.name or "WarmupLinearDecay"):
            t = _update_index(step)
            warmup = float(self.warmup_steps)
            peak = self.peak_learning_rate
            ramp = peak * t / warmup
            progress = ops.clip((t - warmup) / float(self.decay_steps), 0.0, 1.0)
            decay = peak + (self.end_learning_rate - peak) * progress
            return ops.cast(ops.where(t <= warmup, ramp, decay), "float32")

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package="kzoo")
class WarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to a peak, then cosine decay to `alpha * peak`.

    With `t = step + 1` (see `WarmupInverseSqrt` for the step convention):

    - `t <= warmup_steps`: `lr = peak_learning_rate * t / warmup_steps`;
    - afterwards, with `p = min((t - warmup_steps) / decay_steps, 1)`:
      `lr = peak_learning_rate * (alpha + (1 - alpha) * 0.5 * (1 + cos(pi * p)))`.

    A run of `warmup_steps + decay_steps` updates ends at `alpha * peak_learning_rate`
    (SGDR, Loshchilov & Hutter 2017, without restarts), which is kept from then on.

    Args:
        peak_learning_rate: positive float, the learning rate at the end of warmup.
        warmup_steps: positive int, number of updates of the linear warmup.
        decay_steps: positive int, number of updates of the cosine decay.
        alpha: float in `[0, 1]`, the final learning rate as a fraction of the peak.
            Defaults to 0.0.
        name: optional string, the name scope of the op.

    Example:

    ```python
    schedule = kzoo.schedules.WarmupCosineDecay(
        peak_learning_rate=6e-4, warmup_steps=200, decay_steps=5000, alpha=0.1
    )
    optimizer = keras.optimizers.AdamW(learning_rate=schedule)
    ```
    """

    def __init__(self, peak_learning_rate, warmup_steps, decay_steps, alpha=0.0, name=None):
        super().__init__()
        self.peak_learning_rate, warmup_steps, decay_steps = _check_warmup_decay(
            peak_learning_rate, warmup_steps, decay_steps
        )
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.alpha = _check_unit_interval("alpha", alpha)
        self.name = _check_name(name)

    def __call__(self, step):
        with keras.name_scope(self.name or "WarmupCosineDecay"):
            t = _update_index(step)
            warmup = float(self.warmup_steps)
            peak = self.peak_learning_rate
            ramp = peak * t / warmup
            progress = ops.clip((t - warmup) / float(self.decay_steps), 0.0, 1.0)
            cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
            decay = peak * (self.alpha + (1.0 - self.alpha) * cosine)
            return ops.cast(ops.where(t <= warmup, ramp, decay), "float32")

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "name": self.name,
        }


def plot_schedule(schedule, steps, path, title=None):
    """Plot `schedule(step)` for `step = 0 .. steps - 1` into a PNG file.

    Uses matplotlib's Agg canvas directly (no display, no global pyplot state).

    Args:
        schedule: a `LearningRateSchedule` (or any callable taking an integer array).
        steps: positive int, how many optimizer steps to plot.
        path: the PNG file to write (a str, path-like or file object). An existing
            directory is refused with a `ValueError` (no file name is made up: name the
            file, e.g. `os.path.join(directory, "lr.png")`).
        title: optional title; defaults to the schedule's class name.

    Returns:
        `path`.

    Example:

    ```python
    kzoo.schedules.plot_schedule(
        kzoo.schedules.WarmupInverseSqrt(d_model=512), steps=20_000, path="lr.png"
    )
    ```
    """
    check_positive_int("steps", steps)
    # (checked before the schedule is evaluated: matplotlib's IsADirectoryError came last)
    if isinstance(path, (str, bytes, os.PathLike)) and os.path.isdir(path):
        raise ValueError(
            f"`path` must be the PNG file to write; got path={os.fspath(path)!r}, an existing "
            "directory (name a file in it, e.g. os.path.join(path, 'lr.png'))."
        )
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    step = np.arange(steps, dtype="int64")
    values = np.asarray(ops.convert_to_numpy(schedule(step)), dtype="float64")
    values = np.broadcast_to(values, step.shape)

    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(step, values)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("learning rate")
    axes.set_title(title if title is not None else type(schedule).__name__)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
