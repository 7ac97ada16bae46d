"""Distributed training for `python -m training`: one `Plan` a run, from the flags and the
environment, on each backend's own engine.

========================================  ==========  ====================================
how the run is started                    backend     what trains
========================================  ==========  ====================================
`--data-parallel N`                       JAX         `kzoo.distribution.data_parallel`:
                                                      weights replicated, batch split N ways
`--data-parallel N --model-parallel M`    JAX         `kzoo.distribution.model_parallel` on
                                                      an N x M mesh (Megatron splits, experts)
`--strategy mirrored`                     TensorFlow  `tf.distribute.MirroredStrategy` over
                                                      the local devices
`torchrun --nproc_per_node N -m training` torch       one process a device; gradients
                                                      averaged after every backward pass
                                                      (`kzoo.distribution.torch_data_parallel`)
========================================  ==========  ====================================

`--batch-size` stays the global batch in every mode: a step sees the same examples as a
one-device step, so the losses are the same (to float rounding; dropout masks are drawn
differently). `--cpu-devices N` splits the CPU into N virtual devices (JAX, TensorFlow), to
try the modes on a machine without accelerators.

Every check runs before any data is loaded or anything is compiled: a flag on the wrong
backend, a mesh that does not cover the devices, a batch that does not split; the mesh is
checked against the model (heads, key/value heads, intermediate size, experts, vocabulary)
as soon as the model is built, before it is placed on the devices.

What `training.loop.run` asks of a plan: `place(model)` (JAX and TensorFlow: a copy of the
model built inside the distribution's scope, holding the same values), `scope()` (to
compile and fit in), `feed(...)` (the arrays each process gives `fit`), `callbacks(...)`
(torch: only rank 0 writes files; the others wait for its checkpoints at a barrier), and
`unplace(...)` (the trained values back in the one-device model the recipe built, for the
final evaluation, the saved model and whatever the recipe does after the run).
Checkpoints do not depend on the mode: one written under any mode resumes (or loads) on
one device and under any other mode, with the same values.
"""

import contextlib
import dataclasses
import os

import keras
import numpy as np

import kzoo.distribution as kd
from training import callbacks as cb
from training import checkpoint

# Recipes that train outside `training.loop.run` (their own loop): one device only.
OWN_LOOP = {"distill_gpt": "trains its teacher and students in its own loop"}


class DistributedError(ValueError):
    """A distributed flag or setting that cannot work for this run (raised before any data
    is loaded or anything compiled; the CLI prints it and exits with status 2)."""


@dataclasses.dataclass
class Plan:
    """How one run is spread over devices or processes.

    Attributes:
        mode: "single", "data" (JAX data parallel), "model" (JAX data x model mesh),
            "mirrored" (TensorFlow) or "ddp" (torch processes).
        data: replicas on the batch (JAX batch axis, TensorFlow replicas, torch processes).
        model: devices on the model axis (JAX "model" mode).
        rank, world: this process and the number of processes (torch).
        devices: the devices used (names).
        distribution: the Keras distribution (JAX) or the tf.distribute strategy.
    """

    mode: str = "single"
    data: int = 1
    model: int = 1
    rank: int = 0
    world: int = 1
    devices: tuple = ()
    distribution: object = None
    mesh: object = None
    _sync: object = None
    _validation: tuple = None

    @property
    def leader(self):
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0

    def info(self):
        """The `"distribution"` record of metrics.json."""
        return {"mode": self.mode, "devices": len(self.devices) or 1,
                "data_parallel": self.data, "model_parallel": self.model,
                "processes": self.world}

    # --- the model ---

    def place(self, model):
        """The model to train: `model` itself (one device, torch) or a copy with the same
        values built inside the distribution's scope (JAX, TensorFlow). JAX model parallel:
        the mesh is checked against the model first (`DistributedError` naming the axis,
        its size and the dimension it must divide)."""
        if self.mode == "model":
            try:
                self.distribution = kd.model_parallel(model, self.mesh)
            except ValueError as error:
                raise DistributedError(
                    f"--model-parallel {self.model} does not fit this model: {error}") from None
        if self.mode in ("single", "ddp"):
            return model
        with self.scope():
            placed = model.__class__.from_config(model.get_config())
        _copy_values(placed, model)
        return placed

    def unplace(self, placed, model, lora=None):
        """`model` (the recipe's one-device model) holding the trained values of `placed`."""
        if placed is model:
            return model
        if lora is not None:
            model.enable_lora(*lora)
        _copy_values(model, placed)
        return model

    @contextlib.contextmanager
    def scope(self):
        """Where the model is built, compiled and trained (the distribution's scope)."""
        if self.mode in ("data", "model", "mirrored"):
            with self.distribution.scope():
                yield
        else:
            yield

    def attach(self, model):
        """torch: average the gradients over the processes from now on (after compile)."""
        if self.mode == "ddp":
            self._sync = kd.torch_data_parallel(model)

    # --- data ---

    def feed(self, x, y=None, w=None, batch_size=None):
        """`(x, y, w, batch_size)` that this process gives `fit` for consecutive global
        batches of `batch_size`: torch, its rows of every batch; TensorFlow mirrored,
        boolean inputs as int32 (Keras 3.15's symbolic build under a strategy sums a batch
        across replicas, which TensorFlow cannot do for booleans)."""
        if self.mode == "ddp":
            share = batch_size // self.world

            def rows(a):
                if a is None:
                    return None
                a = np.asarray(a)
                if len(a) % batch_size:
                    raise DistributedError(
                        f"{len(a)} training examples are not whole batches of {batch_size}.")
                a = a.reshape(len(a) // batch_size, self.world, share, *a.shape[1:])
                return a[:, self.rank].reshape(-1, *a.shape[3:])

            x, y, w = (keras.tree.map_structure(rows, t) if t is not None else None
                       for t in (x, y, w))
            return x, y, w, share
        if self.mode == "mirrored":
            x = keras.tree.map_structure(
                lambda a: a.astype("int32") if getattr(a, "dtype", None) == bool else a, x)
        return x, y, w, batch_size

    def validation(self, data, batch_size):
        """The validation data `fit` gets. JAX: None, and `callbacks` evaluates it at every
        epoch end outside the mesh instead (`OffMeshValidation`): JAX splits every batch
        over the batch axis, and a validation set need not be a multiple of it."""
        if data is None:
            return None
        data = (tuple(data) + (None, None))[:3]  # (x, y) or (x, y, sample_weight), as `fit`
        if self.mode in ("data", "model"):
            self._validation = (data, batch_size)
            return None
        if self.mode == "mirrored":
            x, y, w, _ = self.feed(*data, batch_size)
            return x, y, w
        return data  # torch: every process validates on all of it

    # --- processes ---

    def callbacks(self, named):
        """The callbacks of `fit` from `(name, callback)` pairs in order: all of them in one
        process; with torch processes, `AverageLogs` first, on rank 0 every callback with
        the checkpoint one made a `SharedCheckpoint`, on the others only those that write
        nothing ("restore", "nan_guard") and the shared checkpoint."""
        if self.world == 1:
            first = [OffMeshValidation(*self._validation)] if self._validation else []
            return first + [c for _, c in named]
        keep = ("restore", "nan_guard")
        out = [AverageLogs()]
        for name, c in named:
            if name == "checkpoint":
                out.append(SharedCheckpoint(self, c))
            elif self.leader or name in keep:
                out.append(c)
        return out

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self):
        if self._sync is not None:
            self._sync.remove()
            self._sync = None


def _copy_values(target, source):
    """Assign every variable of `source` to the same variable of `target` (the same model
    built twice: the same variables in the same order)."""
    if len(target.variables) != len(source.variables):
        raise RuntimeError(
            f"Cannot copy the model: {len(source.variables)} variables into "
            f"{len(target.variables)}.")
    for t, s in zip(target.variables, source.variables):
        # (paths may differ in a counter suffix: `seed_generator_1` for `seed_generator`)
        if t.path.split("/")[-1] != s.path.split("/")[-1] or tuple(t.shape) != tuple(s.shape):
            raise RuntimeError(f"Cannot copy variable {s.path} {tuple(s.shape)} into "
                               f"{t.path} {tuple(t.shape)}.")
        t.assign(checkpoint.to_numpy(s))


class OffMeshValidation(keras.callbacks.Callback):
    """JAX: evaluate the validation data at every epoch end with the distribution unset and
    put the values in the logs as `fit` does (`val_<name>`), first in the callback list.

    JAX's sharded arrays need every batch to split over the batch axis; evaluated outside
    the distribution, the batch is placed by XLA around the sharded weights (the model is
    still split over the model axis), so a validation set of any size works. The compiled
    evaluation is the model's own (`model.evaluate`)."""

    def __init__(self, data, batch_size):
        super().__init__()
        self.data = data
        self.batch_size = batch_size

    def on_epoch_end(self, epoch, logs=None):
        x, y, w = self.data
        current = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            results = self.model.evaluate(x, y, sample_weight=w, batch_size=self.batch_size,
                                          verbose=0, return_dict=True)
        finally:
            keras.distribution.set_distribution(current)
        if logs is not None:
            logs.update({f"val_{k}": float(v) for k, v in results.items()})


class AverageLogs(keras.callbacks.Callback):
    """torch processes: replace the logged training values by their mean over the processes
    (first in the callback list, so every later callback, and every process, sees the same
    numbers). Every process trains on an equal share of each batch, so the mean is the
    global value of the loss exactly, and of a metric whose weights are the same on every
    process (e.g. unweighted accuracy); a weighted metric gets the mean of the processes'
    weighted means."""

    def _average(self, logs, skip_validation):
        import torch
        import torch.distributed as dist

        keys = sorted(k for k in (logs or {})
                      if not (skip_validation and k.startswith("val_")))
        if not keys:
            return
        values = torch.tensor([float(keras.ops.convert_to_numpy(logs[k])) for k in keys],
                              dtype=torch.float64)
        dist.all_reduce(values)
        for k, v in zip(keys, (values / dist.get_world_size()).tolist()):
            logs[k] = v

    def on_train_batch_end(self, batch, logs=None):
        self._average(logs, skip_validation=True)

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, skip_validation=True)  # every process validates on all of it


class SharedCheckpoint(cb.StepCheckpoint):
    """A `StepCheckpoint` for several processes holding the same weights: rank 0 writes the
    checkpoint, then every process waits at a barrier (none runs ahead of a checkpoint that
    is not on disk yet)."""

    def __init__(self, plan, checkpoint):
        super().__init__(checkpoint.state, checkpoint.directory, checkpoint.save_every,
                         checkpoint.fingerprint, checkpoint.extra_meta, checkpoint.keep)
        self.plan = plan

    def _save(self, metrics_state, step_state=None):
        if self.plan.leader:
            super()._save(metrics_state, step_state=step_state)
        else:
            self.state.last_checkpoint_step = self.state.step
        self.plan.barrier()


# === From the command line ===


def _fail(message):
    raise DistributedError(message)


def _cpu_devices(backend, count):
    """Split the host CPU into `count` devices before the backend starts."""
    if backend == "jax":
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", int(count))
        except RuntimeError as error:  # JAX's backends are initialised already
            if len(jax.devices("cpu")) != count:
                _fail(f"--cpu-devices {count}: JAX has started with {len(jax.devices('cpu'))} "
                      f"CPU devices already ({error}).")
    elif backend == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
        except RuntimeError as error:  # TensorFlow's runtime is initialised already
            if len(tf.config.list_logical_devices("CPU")) != count:
                _fail(f"--cpu-devices {count}: TensorFlow has started with "
                      f"{len(tf.config.list_logical_devices('CPU'))} CPU devices already "
                      f"({error}).")
    else:
        _fail(f"--cpu-devices is for JAX and TensorFlow; got KERAS_BACKEND={backend!r}. On "
              "torch, start CPU processes with `torchrun --nproc_per_node N -m training ...` "
              "(gloo).")


def plan_from_args(recipe, batch_size, data_parallel=None, model_parallel=None,
                   strategy=None, cpu_devices=None, environ=None, clipnorm=None):
    """The `Plan` of a run from its flags and the environment (torchrun's `WORLD_SIZE`).

    Raises `DistributedError` (a `ValueError`) naming the flag, its value and what is
    allowed: a flag on the wrong backend, `--data-parallel` x `--model-parallel` not equal
    to the device count, a `--batch-size` that does not split over the replicas or
    processes, a recipe that trains in its own loop."""
    backend = keras.backend.backend()
    environ = os.environ if environ is None else environ
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        _fail(f"WORLD_SIZE must be an integer (torchrun sets it); got "
              f"{environ.get('WORLD_SIZE')!r}.")
    jax_flags = {"--data-parallel": data_parallel, "--model-parallel": model_parallel}
    for flag, value in jax_flags.items():
        if value is not None and backend != "jax":
            _fail(f"{flag} {value} needs KERAS_BACKEND=jax (keras.distribution shards on JAX "
                  f"only); got KERAS_BACKEND={backend!r}. On TensorFlow use --strategy "
                  "mirrored; on torch start the processes with `torchrun --nproc_per_node N "
                  "-m training ...`.")
    if strategy is not None and strategy != "mirrored":
        _fail(f"--strategy must be 'mirrored'; got {strategy!r}.")
    if strategy is not None and backend != "tensorflow":
        _fail(f"--strategy {strategy} needs KERAS_BACKEND=tensorflow (tf.distribute); got "
              f"KERAS_BACKEND={backend!r}. On JAX use --data-parallel N; on torch `torchrun "
              "--nproc_per_node N -m training ...`.")
    if strategy == "mirrored" and clipnorm:
        _fail(f"--strategy mirrored needs --clipnorm 0 (got the clipping norm {clipnorm:g}): "
              f"Keras {keras.__version__}'s TensorFlow optimizer clips each replica's gradients "
              "before it all-reduces them, so a clipped step would not be the one-device step "
              "(docs/DISTRIBUTED.md). JAX (--data-parallel) and torch (torchrun) clip the "
              "averaged gradients.")
    if world > 1 and backend != "torch":
        _fail(f"WORLD_SIZE={world} (several processes, as torchrun starts them) needs "
              f"KERAS_BACKEND=torch; got KERAS_BACKEND={backend!r}. On JAX use "
              "--data-parallel N in one process; on TensorFlow --strategy mirrored.")
    if cpu_devices is not None:
        _cpu_devices(backend, cpu_devices)
    distributed = any(v is not None for v in jax_flags.values()) or strategy or world > 1
    if distributed and recipe in OWN_LOOP:
        _fail(f"The {recipe} recipe {OWN_LOOP[recipe]} and runs on one device; drop "
              "--data-parallel / --model-parallel / --strategy / torchrun.")

    if backend == "jax" and (data_parallel or model_parallel):
        devices = keras.distribution.list_devices()
        model = model_parallel or 1
        if data_parallel is None:
            if len(devices) % model:
                _fail(f"--model-parallel {model} does not divide the {len(devices)} devices "
                      f"({', '.join(devices)}); allowed: a divisor of {len(devices)}.")
            data_parallel = len(devices) // model
        if data_parallel * model != len(devices):
            _fail(f"--data-parallel {data_parallel} x --model-parallel {model} = "
                  f"{data_parallel * model} devices, but JAX has {len(devices)} "
                  f"({', '.join(devices)}); the product must equal {len(devices)} (more CPU "
                  "devices: --cpu-devices N).")
        _check_batch(batch_size, data_parallel, f"--data-parallel {data_parallel}")
        if model == 1:
            return Plan("data", data_parallel, 1, devices=tuple(devices),
                        distribution=kd.data_parallel(devices))
        mesh = kd.device_mesh(data_parallel, model, devices=devices)
        return Plan("model", data_parallel, model, devices=tuple(devices), mesh=mesh)
    if strategy == "mirrored":
        distribution = _mirrored()
        devices = tuple(distribution.extended.worker_devices)
        replicas = int(distribution.num_replicas_in_sync)
        _check_batch(batch_size, replicas, f"--strategy mirrored ({replicas} replicas: "
                                           f"{', '.join(devices)})")
        return Plan("mirrored", replicas, devices=devices, distribution=distribution)
    if world > 1:
        _check_batch(batch_size, world, f"torchrun's WORLD_SIZE={world}")
        try:
            rank, world = kd.init_torch_process_group()
        except ValueError as error:  # torchrun's variables missing
            _fail(f"WORLD_SIZE={world}: {error}")
        import torch

        device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                  else "cpu")
        return Plan("ddp", world, rank=rank, world=world,
                    devices=tuple(f"rank{r}:{device.split(':')[0]}" for r in range(world)))
    return Plan()


def shutdown():
    """Leave the torch process group, if this process joined one (at the end of a run)."""
    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


_STRATEGIES = {}


def _mirrored():
    """One `MirroredStrategy` a process, kept for later runs in the same process: a second
    strategy over the same devices restarts the collective instance keys, and TensorFlow
    then matches its all-reduces with the first one's (a shape mismatch error)."""
    import tensorflow as tf

    devices = tuple(d.name for d in tf.config.list_logical_devices("GPU")) or tuple(
        d.name for d in tf.config.list_logical_devices("CPU"))
    if devices not in _STRATEGIES:
        _STRATEGIES[devices] = kd.mirrored(list(devices))
    return _STRATEGIES[devices]


def _check_batch(batch_size, parts, what):
    if batch_size % parts:
        _fail(f"--batch-size {batch_size} does not split over {what}: the global batch must "
              f"be a multiple of {parts} (e.g. --batch-size {max(parts, batch_size // parts * parts)}).")
