"""The callbacks every recipe trains with (see `training.loop`).

They share one `RunState` (global step, per-epoch history, best value, divergence):

- `StepCheckpoint`: a full training checkpoint every `save_every` steps and at every
  epoch end (`training.checkpoint`: atomic, exact, refuses non-finite losses);
- `BestModel`: the model with the best validation value so far, as a preset directory
  (`kzoo.presets.save`), like `ModelCheckpoint(save_best_only=True)` but resumable;
- `NaNGuard`: stops at the first non-finite loss and records where (in place of Keras'
  `TerminateOnNaN`, whose message it prints in verbose runs only), so that the run ends
  with a clear error and saves nothing broken;
- `RestoreMetrics`: puts the running metric averages of a checkpoint taken mid-epoch
  back at the start of the resumed epoch;
- `StopOnSignal`: on SIGTERM or SIGINT, stops after the current step with a checkpoint of
  it (a second signal ends the process at once);
- `EpochLog`: rewrites `log.csv` from the run's history at every epoch end (the epochs
  the checkpoints hold: none that diverged);
- `PlotCurves`: regenerates the PNG of the curves at every epoch end;
- `EpochProgbar`: Keras' progress bar, numbering epochs over the whole run (the loop
  calls `fit` once per epoch).
"""

import contextlib
import csv
import math
import os
import shutil
import signal
import sys
import threading

import keras
import numpy as np

from training import checkpoint
from training.plot import plot_history


class RunState:
    """What the callbacks share and the checkpoints carry."""

    def __init__(self):
        self.step = 0
        self.segment_start = 0
        self.epoch_end_step = 0
        self.history = []
        self.best = None
        self.best_epoch = None
        self.best_step = None
        # `(best, best_epoch, best_step)` before the validation of an epoch that the run's
        # last step ended early improved on it (else None): a longer run that continues
        # that epoch puts it back (`BestModel.forget_early_end`).
        self.best_before_early_end = None
        self.diverged = None
        self.wall_time_before = 0.0
        self.last_checkpoint_step = None

    def to_meta(self):
        return {
            "step": self.step,
            "history": self.history,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "best_step": self.best_step,
            "best_before_early_end": self.best_before_early_end,
        }

    def load_meta(self, meta):
        self.step = int(meta["step"])
        self.history = list(meta.get("history", []))
        self.best = meta.get("best")
        self.best_epoch = meta.get("best_epoch")
        self.best_step = meta.get("best_step")
        before = meta.get("best_before_early_end")
        self.best_before_early_end = None if before is None else tuple(before)
        self.last_checkpoint_step = self.step


def _finite(value):
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def weights_finite(model):
    checkpoint._sync(model)
    return all(
        np.isfinite(np.asarray(keras.ops.convert_to_numpy(v.value), np.float64)).all()
        for v in model.trainable_variables
    )


def _plain_logs(logs):
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class NaNGuard(keras.callbacks.Callback):
    """Stop training at the first non-finite loss; remember the step and the value.

    It stops where Keras' `TerminateOnNaN` does (the batch whose loss is NaN/inf) and, with
    `verbose`, prints the same line ("Batch 0: Invalid loss, terminating training");
    `TerminateOnNaN` printed it in `--verbose 0` runs too (and on every torch process).
    """

    def __init__(self, state, verbose=0):
        super().__init__()
        self.state = state
        self.verbose = verbose

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not _finite(loss):
            step = self.state.segment_start + batch + 1
            self.state.diverged = {"step": step, "loss": float(loss), "where": "training"}
            self.model.stop_training = True
            if self.verbose:
                print(f"Batch {batch}: Invalid loss, terminating training", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        for key in ("loss", "val_loss"):
            value = (logs or {}).get(key)
            if value is not None and not _finite(value) and self.state.diverged is None:
                self.state.diverged = {"step": self.state.step, "loss": float(value),
                                       "where": key}
                self.model.stop_training = True


class RestoreMetrics(keras.callbacks.Callback):
    """At the first epoch of a resumed run, put back the saved running metric states and
    the backend's generator state.

    The generator goes back exactly where the saved run was: for a checkpoint taken at an
    epoch end, before `fit` starts the next epoch's data iterator (`on_epoch_begin`); for
    one taken mid-epoch, right before the next training step (`on_train_batch_begin`,
    after the iterator was started). On torch, data loaders draw from the global generator
    that unseeded dropout uses too.
    """

    def __init__(self):
        super().__init__()
        self.pending = None
        self.rng = None
        self.mid_epoch = False

    def on_epoch_begin(self, epoch, logs=None):
        if self.pending is not None:
            checkpoint.assign_metrics(self.model, self.pending)
            self.pending = None
        if self.rng is not None and not self.mid_epoch:
            checkpoint.set_backend_rng_state(self.rng)
            self.rng = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.rng is not None and self.mid_epoch:
            checkpoint.set_backend_rng_state(self.rng)
            self.rng = None


class BestModel(keras.callbacks.Callback):
    """Save the model (`kzoo.presets.save`) whenever `monitor` improves.

    An epoch that the run's last step ends early (`--steps` inside an epoch of
    `epoch_steps` steps) is validated like any epoch, but a longer run continues that
    epoch and validates it only at its real end. So when such a validation improves on
    the best, the best model it replaces is moved to `previous_directory` first, and
    `forget_early_end()` (called when a longer run resumes) puts it back: the longer run's
    `best/` and best value are then those of a run that never stopped there.
    """

    def __init__(self, state, directory, monitor, mode, save_fn, epoch_steps=None,
                 previous_directory=None):
        super().__init__()
        if mode not in ("min", "max"):
            raise ValueError(f"`mode` must be 'min' or 'max'; got mode={mode!r}.")
        self.state = state
        self.directory = directory
        self.monitor = monitor
        self.mode = mode
        self.save_fn = save_fn
        self.epoch_steps = epoch_steps
        self.previous_directory = previous_directory

    def better(self, value):
        if self.state.best is None:
            return True
        return value < self.state.best if self.mode == "min" else value > self.state.best

    def _ended_early(self):
        return bool(self.epoch_steps) and bool(self.state.epoch_end_step % self.epoch_steps)

    def _drop_previous(self):
        if self.previous_directory and os.path.isdir(self.previous_directory):
            shutil.rmtree(self.previous_directory)

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.monitor)
        if not _finite(value) or self.state.diverged is not None:
            return
        value = float(value)
        if self.better(value) and weights_finite(self.model):
            self._drop_previous()
            self.state.best_before_early_end = None
            if self._ended_early() and self.previous_directory:
                self.state.best_before_early_end = (
                    self.state.best, self.state.best_epoch, self.state.best_step)
                if os.path.isdir(self.directory):
                    os.makedirs(os.path.dirname(self.previous_directory), exist_ok=True)
                    os.replace(self.directory, self.previous_directory)
            self.save_fn(self.model, self.directory)
            self.state.best = value
            self.state.best_epoch = epoch + 1
            self.state.best_step = self.state.step

    def forget_early_end(self):
        """Undo the best-model update that the validation of an early-ended epoch made (a
        longer run continues that epoch): put the previous best model and value back."""
        before, self.state.best_before_early_end = self.state.best_before_early_end, None
        if before is None:
            return
        self.state.best, self.state.best_epoch, self.state.best_step = before
        if os.path.isdir(self.directory):
            shutil.rmtree(self.directory)
        if self.previous_directory and os.path.isdir(self.previous_directory):
            os.replace(self.previous_directory, self.directory)


class StepCheckpoint(keras.callbacks.Callback):
    """A training checkpoint every `save_every` steps and at the end of every epoch.

    An epoch that a run's last step ends early (`--steps` inside an epoch of `epoch_steps`
    steps) is logged and validated as an epoch, but a longer run continues it: its
    checkpoint holds the metric states and backend generator state of that step taken
    before validation (`checkpoint.capture_step_state`), which a resumed run puts back as
    for any mid-epoch checkpoint, so that it continues step for step as a run that never
    stopped there (on torch, validation moved the global generator that dropout draws
    from: the resumed run drew other dropout masks)."""

    def __init__(self, state, directory, save_every, fingerprint, extra_meta=None, keep=2,
                 epoch_steps=None):
        super().__init__()
        self.state = state
        self.directory = directory
        self.save_every = int(save_every)
        self.fingerprint = fingerprint
        self.extra_meta = extra_meta or (lambda: {})
        self.keep = keep
        self.epoch_steps = epoch_steps
        self._step_state = None  # (the last step of an epoch ended early)

    def _save(self, metrics_state, step_state=None):
        meta = self.state.to_meta()
        meta["fingerprint"] = self.fingerprint
        meta.update(self.extra_meta())
        checkpoint.save(self.directory, self.model, meta, metrics_state=metrics_state,
                        keep=self.keep, step_state=step_state)
        self.state.last_checkpoint_step = self.state.step

    def on_train_batch_end(self, batch, logs=None):
        step = self.state.segment_start + batch + 1
        self.state.step = step
        if self.state.diverged is not None or not _finite((logs or {}).get("loss")):
            return
        if step % self.save_every == 0 and step < self.state.epoch_end_step:
            self._save(metrics_state=True)
        if self.epoch_steps and step == self.state.epoch_end_step and step % self.epoch_steps:
            self._step_state = checkpoint.capture_step_state(self.model)

    def on_epoch_end(self, epoch, logs=None):
        step_state, self._step_state = self._step_state, None
        row = {"epoch": epoch + 1, "step": self.state.step}
        row.update(_plain_logs(logs))
        if self.state.diverged is not None or not _finite(row.get("loss")):
            return
        self.state.history.append(row)
        self._save(metrics_state=False, step_state=step_state)


class Interrupted(Exception):
    """Raised out of `fit` by `StopOnSignal` once the step's checkpoint is written."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


class StopOnSignal(keras.callbacks.Callback):
    """While `handling()` is active, SIGTERM and SIGINT stop training after the current
    step instead of killing the process (SIGTERM's default) or raising `KeyboardInterrupt`
    wherever Python happens to be (SIGINT's, e.g. in a checkpoint write): at the end of the
    step a checkpoint of it is written (`StepCheckpoint`'s mid-epoch kind, unless that step
    was just saved) and `Interrupted` is raised out of `fit`. At an epoch's last step the
    epoch ends first (validation, the epoch's checkpoint) and the loop calls `check()`.
    A second signal ends the process as the signal would have without this."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, state, step_checkpoint):
        super().__init__()
        self.state = state
        self.step_checkpoint = step_checkpoint
        self.signum = None

    @contextlib.contextmanager
    def handling(self, enabled=True):
        """Install the handlers inside the block (only in the main thread and when
        `enabled`), and put the previous ones back after it."""
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}

        def handler(signum, frame):
            if self.signum is not None:  # the second one: what it would have done
                signal.signal(signum, previous[signum])
                os.kill(os.getpid(), signum)
                return
            self.signum = signum
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a "
                  "checkpoint (send it again to stop at once).", file=sys.stderr, flush=True)

        try:
            for s in self.SIGNALS:
                signal.signal(s, handler)
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def check(self):
        """Raise `Interrupted` if a signal came (the current step is in a checkpoint)."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def on_train_batch_end(self, batch, logs=None):
        if self.signum is None or self.state.diverged is not None:
            return  # (a diverged step: the loop reports that, with no checkpoint of it)
        if self.state.step >= self.state.epoch_end_step:
            return  # the epoch ends now: its checkpoint, then the loop's `check()`
        if self.state.last_checkpoint_step != self.state.step:
            self.step_checkpoint._save(metrics_state=True)
        self.check()


def write_log(path, history):
    """Write `history` (the run's rows, as the checkpoints carry them) to the CSV log
    `path` as Keras' `CSVLogger` lays it out: `epoch` counted from 0, then the logged
    values in sorted order ("NA" where a row lacks one). An empty history removes the log.
    Written to a temporary name and renamed, so the log is never half-written."""
    if not history:
        if os.path.exists(path):
            os.remove(path)
        return
    keys = sorted({k for row in history for k in row if k not in ("epoch", "step")})
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch"] + keys)
        writer.writeheader()
        for row in history:
            writer.writerow({"epoch": row["epoch"] - 1, **{k: row.get(k, "NA") for k in keys}})
    os.replace(tmp, path)


class EpochLog(keras.callbacks.Callback):
    """The CSV log (`write_log`) of the run's history, rewritten at every epoch end.

    It holds exactly the epochs that `StepCheckpoint` kept (placed after it): an epoch in
    which the loss became NaN/inf gets no row. Keras' `CSVLogger` wrote one, with a NaN
    loss and the metrics of broken weights (a plausible `accuracy` among them), that no
    checkpoint or saved model matches and that a resumed run dropped again.
    """

    def __init__(self, state, path):
        super().__init__()
        self.state = state
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        if self.state.diverged is None:
            write_log(self.path, self.state.history)


class PlotCurves(keras.callbacks.Callback):
    """Redraw the curves PNG from the run's history at every epoch end."""

    def __init__(self, state, path, title=None):
        super().__init__()
        self.state = state
        self.path = path
        self.title = title

    def on_epoch_end(self, epoch, logs=None):
        if self.state.history:
            plot_history(self.state.history, self.path, self.title)


class EpochProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar with "Epoch k/N" counted over the whole run."""

    def __init__(self, total_epochs):
        super().__init__()
        self.total_epochs = int(total_epochs)

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_progbar()
        self._maybe_init_progbar()
        if self.verbose:
            print(f"Epoch {epoch + 1}/{self.total_epochs}", flush=True)
