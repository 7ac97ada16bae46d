"""Exact, crash-safe training checkpoints.

A checkpoint is one `.npz` file holding everything that decides how training continues:

- every model variable (`model.variables`: weights, non-trainable state and the dropout
  `SeedGenerator` states), the backend's global generator where Keras draws from it
  (torch, for unseeded dropout), every optimizer variable (moments, the iteration counter that
  drives the learning-rate schedule) and, for a checkpoint taken mid-epoch, the running
  state of the epoch's metrics (so the resumed epoch logs the same averages);
- a JSON record: the global step, the per-epoch history (what the CSV log and the plot
  are rebuilt from), the best validation value so far, the wall time spent, and a
  fingerprint of the run's configuration (a checkpoint of another configuration is
  refused, not silently loaded).

The data a step sees is a function of the seed and the step (see `training.data`), so
model + optimizer + step is the whole training state.

Crash safety: a checkpoint is written to a temporary name in the same directory, flushed
and fsync'ed, then renamed with `os.replace` (atomic on POSIX), and only then are older
checkpoints removed (the newest `keep` stay). Only names `ckpt-<8 digits>.npz` are ever
read, so a temporary file left by a killed save is ignored (and removed by the next save,
once its process is gone); a checkpoint that does not
load (truncated, garbage, wrong model) is skipped with a warning in favour of the
previous one.

`tests/test_crash_safety.py` measures it: it SIGKILLs a training run many times, at random
moments and in the middle of checkpoint writes (held there by the test hook
`KZOO_CHECKPOINT_WRITE_DELAY`), resumes it each time, and checks that a loadable checkpoint
always remains and that the final weights equal those of an uninterrupted run.
"""

import io
import json
import os
import re
import time
import warnings
import zipfile

import keras
import numpy as np

CHECKPOINT_RE = re.compile(r"^ckpt-(\d{8})\.npz$")
TEMPORARY_RE = re.compile(r"^\.ckpt-\d{8}\.npz\.tmp-(\d+)$")  # (a save's, until renamed)
META_KEY = "__meta__"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used for this run."""


def checkpoint_name(step):
    return f"ckpt-{int(step):08d}.npz"


def list_checkpoints(directory):
    """`[(step, path)]` of the well-named checkpoints in `directory`, newest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = CHECKPOINT_RE.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def to_numpy(variable):
    """A variable's value as a NumPy array, on one device or distributed (a sharded JAX
    array is gathered; a TensorFlow `MirroredVariable` gives its value through `.numpy()`,
    which `convert_to_numpy` cannot do for the optimizer's int64 iteration counter)."""
    value = variable.value
    if keras.backend.backend() == "tensorflow" and hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


_to_numpy = to_numpy


def _sync(model):
    """On JAX, `fit` keeps the training state outside the model between batches."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None and keras.backend.backend() == "jax":
        sync()


def _backend_rng_state():
    """The backend's global generator state, where Keras uses one.

    On torch, a layer whose `SeedGenerator` was created without a seed (Dropout's default)
    draws its masks from torch's global generator, which is no Keras variable."""
    if keras.backend.backend() == "torch":
        import torch

        return {"rng/torch_cpu": torch.get_rng_state().numpy()}
    return {}


def set_backend_rng_state(arrays):
    """Put a saved backend generator state back (see `_backend_rng_state`)."""
    if keras.backend.backend() == "torch" and arrays and "rng/torch_cpu" in arrays:
        import torch

        torch.set_rng_state(torch.from_numpy(np.array(arrays["rng/torch_cpu"], np.uint8)))


def capture_step_state(model):
    """`(metric values, backend generator state)` now: what a mid-epoch checkpoint holds
    besides the weights. Taken at a run's last step when that step ends an epoch early
    (`--steps` inside an epoch), before validation resets the metrics and, on torch, moves
    the global generator; `save(..., step_state=...)` writes them instead of the values
    at the time of the save."""
    _sync(model)
    return [_to_numpy(v) for v in model.metrics_variables], _backend_rng_state()


def save(directory, model, meta, metrics_state=False, keep=2, step_state=None):
    """Write a checkpoint of `model` (and its optimizer) at `meta["step"]`; return its path.

    Args:
        directory: the checkpoint directory (created if missing).
        model: a compiled model whose optimizer is built.
        meta: JSON-serialisable dict; must contain `step`.
        metrics_state: also store the model's metric variables (mid-epoch checkpoints).
        keep: how many checkpoints to keep (the newest).
        step_state: `capture_step_state(model)` taken earlier in the step: its metric
            values (stored as with `metrics_state`) and generator state are written
            instead of the current ones.
    """
    os.makedirs(directory, exist_ok=True)
    _sync(model)
    arrays = {}
    for i, v in enumerate(model.variables):
        arrays[f"model/{i}"] = _to_numpy(v)
    for i, v in enumerate(model.optimizer.variables):
        arrays[f"optimizer/{i}"] = _to_numpy(v)
    arrays.update(_backend_rng_state() if step_state is None else step_state[1])
    meta = dict(meta)
    meta["num_model_variables"] = len(model.variables)
    meta["num_optimizer_variables"] = len(model.optimizer.variables)
    meta["model_shapes"] = [list(np.shape(a)) for k, a in arrays.items()
                            if k.startswith("model/")]
    if metrics_state or step_state is not None:
        values = ([_to_numpy(v) for v in model.metrics_variables] if step_state is None
                  else step_state[0])
        for i, value in enumerate(values):
            arrays[f"metrics/{i}"] = value
        meta["num_metrics_variables"] = len(values)
    else:
        meta["num_metrics_variables"] = None
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)

    final = os.path.join(directory, checkpoint_name(meta["step"]))
    tmp = os.path.join(directory, f".{checkpoint_name(meta['step'])}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        delay = _write_delay()
        np.savez(_SlowWriter(f, delay, sum(a.nbytes for a in arrays.values()) // 2)
                 if delay else f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    _remove_dead_writers_files(directory)
    for _, path in list_checkpoints(directory)[keep:]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    return final


def _remove_dead_writers_files(directory):
    """Remove the temporary files that saves killed mid-write left in `directory` (each as
    large as a checkpoint; never read): those named for a process that no longer runs."""
    for name in os.listdir(directory):
        match = TEMPORARY_RE.match(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # a live process's (another run saving here): left to it
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, OSError):
            continue  # (another user's process, or a number no process has: keep it)
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


WRITE_DELAY_ENV = "KZOO_CHECKPOINT_WRITE_DELAY"


def _write_delay():
    """Seconds to pause in the middle of every checkpoint write (0: none), from the
    environment variable `KZOO_CHECKPOINT_WRITE_DELAY`: a test hook that holds a save
    half-written on disk long enough for `tests/test_crash_safety.py` to SIGKILL it there."""
    text = os.environ.get(WRITE_DELAY_ENV)
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV} must be a number of seconds; got {text!r}.") from None
    if not value >= 0:
        raise ValueError(f"{WRITE_DELAY_ENV} must be >= 0; got {text!r}.")
    return value


class _SlowWriter:
    """A file wrapper that sleeps `delay` seconds once `after` bytes have been written."""

    def __init__(self, file, delay, after):
        self._file = file
        self._delay = delay
        self._after = after
        self._written = 0

    def write(self, data):
        count = self._file.write(data)
        self._written += len(data)
        if self._delay and self._written >= self._after:
            self._file.flush()
            time.sleep(self._delay)
            self._delay = 0
        return count

    def __getattr__(self, name):
        return getattr(self._file, name)


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - not on every platform
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def read(path):
    """`(meta, arrays)` of one checkpoint file; raises on any damage."""
    with open(path, "rb") as f:
        data = f.read()
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    if META_KEY not in arrays:
        raise CheckpointError(f"{path}: no metadata record.")
    meta = json.loads(arrays.pop(META_KEY).tobytes().decode("utf-8"))
    return meta, arrays


def _check_compatible(path, meta, arrays, model, fingerprint):
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        changed = sorted(
            k for k in set(fingerprint) | set(meta.get("fingerprint") or {})
            if (meta.get("fingerprint") or {}).get(k) != fingerprint.get(k)
        )
        raise CheckpointError(
            f"{path} belongs to a run with another configuration (differs in {changed}). "
            "Use another --out directory, or --fresh to discard its checkpoints."
        )
    variables = model.variables
    if meta["num_model_variables"] != len(variables):
        raise CheckpointError(
            f"{path} holds {meta['num_model_variables']} model variables; the model has "
            f"{len(variables)}."
        )
    for i, v in enumerate(variables):
        if tuple(arrays[f"model/{i}"].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{path}: variable {i} ({v.path}) has shape {arrays[f'model/{i}'].shape} "
                f"in the checkpoint and {tuple(v.shape)} in the model."
            )
    if meta["num_optimizer_variables"] != len(model.optimizer.variables):
        raise CheckpointError(
            f"{path} holds {meta['num_optimizer_variables']} optimizer variables; the "
            f"optimizer has {len(model.optimizer.variables)}."
        )


def restore(path, model, fingerprint=None):
    """Load checkpoint `path` into `model` and its (built) optimizer; return
    `(meta, metrics_arrays or None)`. Raises `CheckpointError` / IO errors on damage.

    The backend generator state is returned in `meta["backend_rng"]`, not set: the caller
    sets it (`set_backend_rng_state`) at the moment of the run it was saved at (torch's
    data loaders draw from the global generator whenever `fit` starts an epoch)."""
    meta, arrays = read(path)
    _check_compatible(path, meta, arrays, model, fingerprint)
    for i, v in enumerate(model.variables):
        v.assign(arrays[f"model/{i}"].astype(v.dtype))
    for i, v in enumerate(model.optimizer.variables):
        v.assign(arrays[f"optimizer/{i}"].astype(v.dtype))
    metrics = None
    if meta.get("num_metrics_variables") is not None:
        metrics = [arrays[f"metrics/{i}"] for i in range(meta["num_metrics_variables"])]
    meta["backend_rng"] = {k: v for k, v in arrays.items() if k.startswith("rng/")}
    return meta, metrics


def restore_latest(directory, model, fingerprint=None):
    """Restore the newest loadable checkpoint of `directory`; `(meta, metrics)` or None.

    A damaged file is skipped with a warning (the previous checkpoint is used); a
    checkpoint of another configuration raises `CheckpointError`.
    """
    for step, path in list_checkpoints(directory):
        try:
            return restore(path, model, fingerprint)
        except CheckpointError as error:
            if "another configuration" in str(error):
                raise
            warnings.warn(f"Skipping unusable checkpoint {path}: {error}", stacklevel=2)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile,
                json.JSONDecodeError, UnicodeDecodeError) as error:
            warnings.warn(f"Skipping damaged checkpoint {path}: {type(error).__name__}: "
                          f"{error}", stacklevel=2)
    return None


def assign_metrics(model, values):
    """Put saved metric states back (the running averages of a resumed epoch)."""
    variables = model.metrics_variables
    if len(variables) != len(values):
        return False
    for v, value in zip(variables, values):
        v.assign(np.asarray(value).astype(v.dtype))
    return True
