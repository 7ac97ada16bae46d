"""The training harness every recipe uses: `RunConfig` and `run(...)`.

`run` compiles the model with AdamW on a `kzoo.schedules.WarmupInverseSqrt` schedule and
gradient clipping, trains it with `model.fit` (Keras' progress bar and the callbacks of
`training.callbacks`, `NaNGuard` stopping at a NaN loss), and writes into `cfg.out`:

- `log.csv`: one row per epoch, laid out as Keras' `CSVLogger` does: the epochs the latest
  checkpoint holds (a resumed run continues it; an epoch in which the loss became NaN/inf
  has no row, the error says where it diverged);
- `curves.png`: the loss and metric curves, redrawn at every epoch end and at the end;
- `metrics.json`: the final metrics (`"metrics"`) and facts about the run (`"run"`);
- `model/`: the trained model as a preset directory (`kzoo.presets.load("<out>/model")`);
- `best/`: the model at the best validation value;
- `checkpoints/`: training checkpoints (every `save_every` steps and every epoch end).

Epochs: an epoch is one pass over the training data (`task.steps_per_epoch` steps), or
`max_epoch_steps` steps if a pass is longer; `--steps N` ends the run after `N` steps (the
last epoch may be shorter). The loop calls `fit` once per epoch, on the arrays of exactly
that epoch's steps (see `training.data`), so a run resumed from a checkpoint taken in the
middle of an epoch continues with the very batches it would have seen. Re-running a
finished run's command re-evaluates the final model and rewrites its outputs.
"""

import dataclasses
import json
import math
import os
import shutil
import signal
import time
import warnings

import keras
import numpy as np

import kzoo.lora
import kzoo.presets
from kzoo.schedules import WarmupInverseSqrt
from training import callbacks as cb
from training import checkpoint
from training.data import UsageError
from training.plot import plot_history


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; nothing broken was saved."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT stopped the run after a step, with a checkpoint of that step.

    Attributes: `signum` (the signal), `step` (the step the checkpoint holds)."""

    def __init__(self, message, signum, step):
        super().__init__(message)
        self.signum = signum
        self.step = step


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a run (the CLI fills it; recipes provide defaults)."""

    recipe: str
    out: str
    preset: str = None
    steps: int = None
    epochs: int = None
    batch_size: int = 32
    seed: int = 0
    mixed_precision: object = False  # False, "bfloat16" (True means it too) or "float16"
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    clipnorm: float = 1.0
    label_smoothing: float = 0.0
    save_every: int = 100
    max_epoch_steps: int = 200
    overrides: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    fresh: bool = False
    verbose: int = 1
    lora_rank: int = None  # LoRA fine-tuning: only rank-`lora_rank` adapters train
    lora_targets: tuple = ("query", "value")
    # How the run is spread over devices / processes (`training.distributed.Plan`; None:
    # one device). Not in the fingerprint: a checkpoint resumes under any mode.
    plan: object = None
    accumulate: int = 1  # gradient accumulation: one optimizer update every `accumulate` steps

    def __post_init__(self):
        if self.mixed_precision is True:
            self.mixed_precision = "bfloat16"
        if self.mixed_precision not in (False, None, "bfloat16", "float16"):
            raise ValueError(
                "`mixed_precision` must be False, 'bfloat16' (or True) or 'float16'; got "
                f"mixed_precision={self.mixed_precision!r}.")
        self.mixed_precision = self.mixed_precision or False
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) \
                or self.accumulate < 1:
            raise ValueError(
                "`accumulate` (--accumulate) must be a positive integer (1: no gradient "
                f"accumulation); got accumulate={self.accumulate!r}.")

    def fingerprint(self):
        """What a checkpoint must agree on to be resumed (not the run length)."""
        keys = ("recipe", "preset", "batch_size", "seed", "mixed_precision", "learning_rate",
                "warmup_steps", "weight_decay", "clipnorm", "label_smoothing",
                "max_epoch_steps", "overrides", "options")
        out = {k: getattr(self, k) for k in keys}
        out["backend"] = keras.backend.backend()
        # Checkpoints written before float16 and accumulation existed stay resumable:
        # bfloat16 keeps its old record (True), accumulation is recorded only when used.
        if self.mixed_precision == "bfloat16":
            out["mixed_precision"] = True
        if self.accumulate > 1:
            out["accumulate"] = self.accumulate
        if self.lora_rank:
            out["lora"] = {"rank": self.lora_rank, "targets": list(self.lora_targets)}
        return json.loads(json.dumps(out, sort_keys=True, default=str))

    @property
    def dtype(self):
        return f"mixed_{self.mixed_precision}" if self.mixed_precision else "float32"


def set_seed(seed):
    """Seed Python's, NumPy's and the backend's generators (`keras.utils.set_random_seed`):
    with the step-indexed data of `training.data`, the whole run follows from the seed."""
    keras.utils.set_random_seed(int(seed))


@keras.saving.register_keras_serializable(package="kzoo")
class PerUpdateSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule` counted in optimizer updates under gradient accumulation.

    With `gradient_accumulation_steps=N`, Keras' optimizers call their learning-rate
    schedule with the count of *batches* (`optimizer._iterations`), while the update that
    the N-th batch makes is one step of the N-times-larger batch (and `optimizer.iterations`,
    which drives Adam's bias correction, counts updates). This evaluates `schedule` at
    `batches // N`, so the k-th update uses the learning rate of step k, as the large
    batch would.

    Example:
    >>> PerUpdateSchedule(WarmupInverseSqrt(1e-3, warmup_steps=100), accumulate=4)(399)
    """

    def __init__(self, schedule, accumulate):
        self.schedule = schedule
        self.accumulate = int(accumulate)

    def __call__(self, step):
        return self.schedule(keras.ops.floor_divide(step, self.accumulate))

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule),
                "accumulate": self.accumulate}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


def make_optimizer(cfg):
    """AdamW on warmup + inverse-square-root decay, global-norm gradient clipping; no
    weight decay on biases, norms and embeddings' position tables.

    With `cfg.accumulate = N > 1` the optimizer accumulates gradients (Keras'
    `gradient_accumulation_steps`): every N-th batch it applies the mean of the N batches'
    gradients (clipped, then one weight decay), the update of one batch N times larger;
    the schedule counts updates (`PerUpdateSchedule`). A loss that is a mean over each
    batch's examples (the recipes' losses) then gives exactly the large batch's update when
    the batches hold the same number of counted examples. Under `mixed_precision="float16"`
    the optimizer is wrapped in Keras' `LossScaleOptimizer` (dynamic loss scaling)."""
    schedule = WarmupInverseSqrt(peak_learning_rate=float(cfg.learning_rate),
                                 warmup_steps=int(cfg.warmup_steps))
    accumulate = int(getattr(cfg, "accumulate", 1) or 1)
    optimizer = keras.optimizers.AdamW(
        learning_rate=PerUpdateSchedule(schedule, accumulate) if accumulate > 1 else schedule,
        weight_decay=float(cfg.weight_decay),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=1e-9 if not cfg.mixed_precision else 1e-6,
        clipnorm=float(cfg.clipnorm) if cfg.clipnorm else None,
        gradient_accumulation_steps=accumulate if accumulate > 1 else None,
    )
    optimizer.exclude_from_weight_decay(
        var_names=["bias", "gamma", "beta", "norm", "scale", "position", "token"])
    if cfg.mixed_precision == "float16":
        # Dynamic loss scaling (float16's range is too small for raw gradients). Keras adds
        # it in `compile` only when the compiled model's own policy is mixed_float16, and a
        # task model may keep its head in float32 on a float16 backbone.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def total_steps(cfg, task):
    if cfg.steps is not None and cfg.epochs is not None:
        raise ValueError("Give --steps or --epochs, not both.")
    if cfg.steps is not None:
        return int(cfg.steps)
    return int(cfg.epochs) * task.steps_per_epoch


def _write_json(path, data):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def _count(variables):
    return int(sum(np.prod(v.shape) for v in variables))


def save_model(model, directory, extra_files=None):
    """`kzoo.presets.save` plus the recipe's extra files (e.g. the tokenizer). A LoRA model
    is saved with its adapters merged into the float kernels (Keras' Dense saves the merged
    kernel; on int8 / int4 layers `kzoo.presets.save` keeps them apart instead, see
    `kzoo.lora`), plus the adapters alone in `adapters.lora.npz`, written first."""
    if kzoo.lora.lora_layers(model):
        os.makedirs(directory, exist_ok=True)
        model.save_lora_weights(os.path.join(directory, "adapters.lora.npz"))
        with warnings.catch_warnings():  # (the warning that saving merges the adapters:
            # they and their optimizer state are in adapters.lora.npz, next to the model)
            warnings.filterwarnings("ignore", message=r"Saving .* merges its LoRA adapters")
            kzoo.presets.save(model, directory)
    else:
        kzoo.presets.save(model, directory)
    for writer in extra_files or ():
        writer(directory)
    return directory


def run(cfg, model, task, *, loss, metrics, monitor, mode, evaluate=None, report=None,
        extra_files=None, extra_run_info=None):
    """Train `model` on `task` as `cfg` says; write the outputs; return the metrics dict.

    Args:
        cfg: a `RunConfig`.
        model: the (uncompiled) kzoo task model.
        task: a `training.data.Task`.
        loss, metrics: for `compile`.
        monitor, mode: the validation value that picks the best model ("val_accuracy",
            "max").
        evaluate: `evaluate(model, task) -> dict` of final metrics (test set, generation).
        report: `report(model, task, metrics)` prints samples at the end.
        extra_files: callables `f(directory)` writing files next to a saved model.
        extra_run_info: dict added to the `"run"` record of `metrics.json`.

    Distributed (`cfg.plan`, see `training.distributed`): the model is placed on the
    devices (JAX, TensorFlow: a copy built in the distribution's scope) and trained there;
    after training, `model` holds the trained values on one device and is compiled for the
    final evaluation. With torch processes, rank 0 alone evaluates and writes files; the
    others return the record without the final evaluation.

    Raises:
        TrainingDiverged: the loss became NaN/inf (no final model or checkpoint is written
            from the broken weights).
    """
    from training.distributed import Plan

    started = time.time()
    plan = cfg.plan or Plan()
    out = cfg.out
    ckpt_dir = os.path.join(out, "checkpoints")
    if cfg.fresh and os.path.isdir(out) and plan.leader:
        for name in ("checkpoints", "best", "model", "log.csv", "curves.png", "metrics.json"):
            path = os.path.join(out, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    os.makedirs(out, exist_ok=True)
    plan.barrier()  # the others read checkpoints only after rank 0 cleaned up
    paths = {
        "csv": os.path.join(out, "log.csv"),
        "plot": os.path.join(out, "curves.png"),
        "metrics": os.path.join(out, "metrics.json"),
        "model": os.path.join(out, "model"),
        "best": os.path.join(out, "best"),
        "checkpoints": ckpt_dir,
    }

    steps_total = total_steps(cfg, task)
    if steps_total <= 0:
        raise ValueError(f"The run needs at least one step; got {steps_total}.")
    updates = steps_total // max(1, int(cfg.accumulate))
    if int(cfg.warmup_steps) > updates and plan.leader:
        # (Allowed: short debug runs; but the learning rate never reaches its peak.)
        warnings.warn(
            f"--warmup-steps {cfg.warmup_steps} is more than the run's {updates} optimizer "
            f"updates ({steps_total} steps, --accumulate {cfg.accumulate}): the learning "
            f"rate never reaches its peak {cfg.learning_rate}. Use --warmup-steps "
            f"{updates} or fewer to reach it.", UserWarning, stacklevel=2)
    epoch_steps = max(1, min(task.steps_per_epoch, int(cfg.max_epoch_steps)))
    num_epochs = math.ceil(steps_total / epoch_steps)

    verbose = cfg.verbose if plan.leader else 0
    validation = plan.validation(task.validation, task.batch_size)
    single_model = model
    model = plan.place(model)  # checks the mesh against the model, before compiling
    with plan.scope():
        record = _train(cfg, plan, model, task, loss, metrics, monitor, mode, extra_files,
                        paths, validation, steps_total, epoch_steps, num_epochs, verbose,
                        started)
    state, resumed_from, wall_before = record
    lora = (int(cfg.lora_rank), tuple(cfg.lora_targets)) if cfg.lora_rank else None
    trained = model
    model = plan.unplace(trained, single_model, lora)
    if model is not trained:  # for the final evaluation on one device
        model.compile(optimizer=make_optimizer(cfg), loss=loss,
                      weighted_metrics=[_fresh_metric(m) for m in metrics])
    plan.close()

    if not cb.weights_finite(model):
        raise TrainingDiverged(
            f"{cfg.recipe}: the weights contain NaN/inf after training; refusing to save "
            "the model. Lower --learning-rate."
        )
    final = {}
    if state.history:
        last = state.history[-1]
        final.update({k: v for k, v in last.items() if k.startswith("val_")})
        final["loss"] = last.get("loss")
    if not plan.leader:  # rank 0 evaluates and writes; the others are done
        plan.barrier()
        return {"metrics": final, "run": {"recipe": cfg.recipe, "rank": plan.rank,
                                          "distribution": plan.info()}, "files": {}}
    try:
        return _finish(cfg, plan, model, task, state, final, evaluate, report, extra_files,
                       extra_run_info, paths, monitor, steps_total, num_epochs, epoch_steps,
                       resumed_from, wall_before, started)
    finally:
        plan.barrier()


def _fresh_metric(metric):
    """A new metric object of the same configuration (its state not shared)."""
    if isinstance(metric, keras.metrics.Metric):
        return metric.__class__.from_config(metric.get_config())
    return metric


def _train(cfg, plan, model, task, loss, metrics, monitor, mode, extra_files, paths,
           validation, steps_total, epoch_steps, num_epochs, verbose, started):
    """Compile, restore and train `model` in the current scope; `(state, resumed_from,
    wall time before)`."""
    out, ckpt_dir = cfg.out, paths["checkpoints"]
    if cfg.lora_rank:  # before compile and restore: the adapters are the trained variables
        try:
            model.enable_lora(int(cfg.lora_rank), targets=tuple(cfg.lora_targets))
        except ValueError as error:  # (a rank larger than the kernels)
            raise UsageError(f"--lora-rank {cfg.lora_rank}: {error}") from None
        if verbose:
            print(f"LoRA rank {cfg.lora_rank} on {list(cfg.lora_targets)}: "
                  f"{_count(model.trainable_weights):,} trainable of "
                  f"{_count(model.weights):,} parameters.", flush=True)

    # `weighted_metrics`: the metrics count what the loss counts (Keras' plain `metrics`
    # ignore sample weights: BERT's accuracy would include the unmasked tokens).
    if plan.mode in ("data", "model", "mirrored"):  # metric variables made in the scope
        metrics = [_fresh_metric(m) for m in metrics]
    model.compile(optimizer=make_optimizer(cfg), loss=loss, weighted_metrics=metrics)
    model.optimizer.build(model.trainable_variables)

    state = cb.RunState()
    fingerprint = cfg.fingerprint()
    restored = checkpoint.restore_latest(ckpt_dir, model, fingerprint)
    restore_metrics = cb.RestoreMetrics()
    resumed_from = None
    forget_early_end = None
    if restored is not None:
        meta, metric_values = restored
        state.load_meta(meta)
        state.wall_time_before = float(meta.get("wall_time_s", 0.0))
        resumed_from = state.step
        restore_metrics.rng = meta.get("backend_rng")
        restore_metrics.mid_epoch = bool(state.step % epoch_steps)
        if (restore_metrics.mid_epoch and state.step < steps_total and state.history
                and state.history[-1].get("step") == state.step):
            # The last row is an epoch that the earlier run's last step ended early: this
            # run completes that epoch and logs it then (once, as an uninterrupted run), and
            # picks its best model without that epoch's early validation.
            state.history.pop()
            forget_early_end = state.best_before_early_end
        if state.step % epoch_steps and metric_values is not None:
            # The compiled metrics are built lazily (on TensorFlow only by a first step):
            # build them with one inference pass so the saved running states fit them.
            x, y, w, size = plan.feed(*task.train_batch(state.step), task.batch_size)
            model.evaluate(x, y, sample_weight=w, batch_size=size, verbose=0)
            restore_metrics.pending = metric_values
        if verbose:
            print(f"Resuming {cfg.recipe} from step {state.step} "
                  f"(checkpoint in {ckpt_dir}).", flush=True)
        if plan.leader:
            cb.write_log(paths["csv"], state.history)
    elif os.path.exists(paths["csv"]) and plan.leader:
        os.remove(paths["csv"])  # a log without checkpoints belongs to no resumable run
    plan.attach(model)  # torch: the same weights everywhere, gradients averaged
    if state.step > steps_total:  # (a usage error: the CLI prints it, no traceback)
        raise checkpoint.CheckpointError(
            f"The checkpoint in {ckpt_dir} is at step {state.step}, past the requested "
            f"{steps_total} steps; use --fresh (or another --out) to start over."
        )

    best_model = cb.BestModel(state, paths["best"], monitor, mode,
                              lambda m, d: save_model(m, d, extra_files),
                              epoch_steps=epoch_steps,
                              previous_directory=os.path.join(ckpt_dir, "best-before-early-end"))
    if forget_early_end and plan.leader:
        best_model.forget_early_end()
    elif forget_early_end:
        state.best_before_early_end = None
        state.best, state.best_epoch, state.best_step = forget_early_end

    def extra_meta():
        return {"wall_time_s": state.wall_time_before + (time.time() - started)}

    named = [
        ("restore", restore_metrics),
        # (in place of Keras' `TerminateOnNaN`, which printed "Invalid loss" in quiet runs)
        ("nan_guard", cb.NaNGuard(state, verbose=verbose)),
        ("best", best_model),
        ("checkpoint", cb.StepCheckpoint(state, ckpt_dir, cfg.save_every, fingerprint,
                                         extra_meta, epoch_steps=epoch_steps)),
        ("csv", cb.EpochLog(state, paths["csv"])),  # (after "checkpoint")
        ("plot", cb.PlotCurves(state, paths["plot"],
                               title=f"{cfg.recipe} ({keras.backend.backend()})")),
    ]
    # SIGTERM / SIGINT: stop after the current step with a checkpoint of it (one process
    # only: torch's processes would stop at different steps and wait on each other).
    stop = cb.StopOnSignal(state, dict(named)["checkpoint"])
    named.append(("signal", stop))
    if verbose:
        named.append(("progress", cb.EpochProgbar(num_epochs)))
    callbacks = plan.callbacks(named)  # torch: rank 0 writes, the others wait for it
    with stop.handling(plan.world == 1):
        try:
            _fit_segments(cfg, model, task, plan, state, callbacks, stop, validation,
                          steps_total, epoch_steps, verbose, ckpt_dir)
        except cb.Interrupted as interrupted:
            signum = interrupted.signum
            name = signal.Signals(signum).name
            raise TrainingInterrupted(
                f"{cfg.recipe}: {name} stopped the run after step {state.step} of "
                f"{steps_total}; its checkpoint is in {ckpt_dir}. Run the same command "
                "again to resume from it.", signum, state.step) from None
    return state, resumed_from, state.wall_time_before


def _fit_segments(cfg, model, task, plan, state, callbacks, stop_on_signal, validation,
                  steps_total, epoch_steps, verbose, ckpt_dir):
    """`fit` once per epoch from `state.step` to `steps_total`."""
    while state.step < steps_total:
        epoch = state.step // epoch_steps
        stop = min((epoch + 1) * epoch_steps, steps_total)
        state.segment_start = state.step
        state.epoch_end_step = stop
        x, y, w, size = plan.feed(*task.segment(state.step, stop), task.batch_size)
        model.fit(
            x, y, sample_weight=w, batch_size=size, epochs=epoch + 1,
            initial_epoch=epoch, shuffle=False, validation_data=validation,
            validation_batch_size=task.batch_size, callbacks=callbacks,
            verbose=verbose,
        )
        if state.diverged is not None:
            d = state.diverged
            # (The message named "step None" when no checkpoint had been written, and
            # advised a lower --learning-rate, which the checkpoint then refused: it resumes
            # only under the configuration it was written with.)
            kept = ("No checkpoint was written before it." if state.last_checkpoint_step
                    is None else f"The last good checkpoint is step "
                    f"{state.last_checkpoint_step} in {ckpt_dir}; it resumes only under this "
                    "configuration.")
            raise TrainingDiverged(
                f"{cfg.recipe}: the {d['where']} loss became {d['loss']} at step "
                f"{d['step']} (learning rate peak {cfg.learning_rate}); training stopped "
                f"and no model was saved from the diverged weights. {kept} Check the data, "
                "or lower --learning-rate and start over with --fresh (or another --out)."
            )
        state.step = stop
        stop_on_signal.check()  # (a signal that came in validation: the epoch is saved)


def _finish(cfg, plan, model, task, state, final, evaluate, report, extra_files,
            extra_run_info, paths, monitor, steps_total, num_epochs, epoch_steps,
            resumed_from, wall_before, started):
    """The final evaluation and the files of a finished run (rank 0)."""
    if evaluate is not None:
        final.update(evaluate(model, task))
    bad = [k for k, v in final.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise TrainingDiverged(
            f"{cfg.recipe}: final metrics {bad} are not finite ({ {k: final[k] for k in bad} }); "
            "refusing to save the model."
        )
    save_model(model, paths["model"], extra_files)
    # The card lists the numeric metrics (not e.g. the demo's sample texts).
    numeric = {k: v for k, v in final.items()
               if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}
    kzoo.presets.write_model_card(model, paths["model"], metrics=numeric)
    if state.history:
        plot_history(state.history, paths["plot"],
                     title=f"{cfg.recipe} ({keras.backend.backend()})")
    wall = wall_before + (time.time() - started)
    record = {
        "metrics": final,
        "best": {"monitor": monitor, "value": state.best, "epoch": state.best_epoch,
                 "step": state.best_step},
        "run": {
            "recipe": cfg.recipe,
            "preset": cfg.preset,
            "backend": keras.backend.backend(),
            "steps": steps_total,
            "epochs": num_epochs,
            "steps_per_epoch": epoch_steps,
            "batch_size": task.batch_size,
            "seed": cfg.seed,
            "dtype": cfg.dtype,
            "accumulate": cfg.accumulate,
            "effective_batch_size": task.batch_size * cfg.accumulate,
            "params": int(model.count_params()),
            "trainable_params": _count(model.trainable_weights),
            "lora": ({"rank": cfg.lora_rank, "targets": list(cfg.lora_targets)}
                     if cfg.lora_rank else None),
            "wall_time_s": round(wall, 2),
            "resumed_from_step": resumed_from,
            "distribution": plan.info(),
            "overrides": cfg.overrides,
            "options": cfg.options,
            **(extra_run_info or {}),
        },
        "files": {k: os.path.abspath(v) for k, v in paths.items()},
    }
    _write_json(paths["metrics"], record)
    if report is not None:
        report(model, task, final)
    return record
