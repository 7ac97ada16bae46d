"""`python -m training <recipe> [options]`: the command line of the training recipes."""

import argparse
import json
import os
import sys

from training.recipes import RECIPES, recipe_module

EXIT_DIVERGED = 3


def _positive_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a positive integer; got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer; got {text!r}")
        return value
    return parse


def _non_negative_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a non-negative integer; got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(
                f"{name} must be a non-negative integer; got {text!r}")
        return value
    return parse


def _float(name, low=None, high=None, low_open=False, high_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number; got {text!r}") from None
        if value != value or (low is not None and (value < low or (low_open and value == low))) \
                or (high is not None and (value > high or (high_open and value == high))):
            lo = "(" if low_open else "["
            hi = ")" if high_open else "]"
            raise argparse.ArgumentTypeError(
                f"{name} must be in {lo}{low}, {'inf' if high is None else high}{hi}; "
                f"got {text!r}")
        return value
    return parse


def _directory(name):
    def parse(text):
        if not text.strip():  # (`args.out or default` took it for "not given")
            raise argparse.ArgumentTypeError(f"{name} must be a directory path; got {text!r}")
        return text
    return parse


def _override(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(
            f"--override must look like KEY=VALUE (VALUE parsed as JSON); got {text!r}")
    key, value = text.split("=", 1)
    if not key.isidentifier():
        raise argparse.ArgumentTypeError(f"--override key must be a name; got {key!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key, parsed


def _preset(text):
    import kzoo

    names = kzoo.presets.list()
    if text in names or os.path.isdir(text):
        return text
    import difflib

    close = difflib.get_close_matches(text, names, n=3, cutoff=0.4)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown preset {text!r}{hint}; choose one of {names} or a saved preset directory")


_LORA_TARGETS = ("query", "key", "value", "output", "feedforward_in", "feedforward_out",
                 "head")  # kzoo.lora.TARGETS (not imported: the parser stays light)


def _lora_targets(text):
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in targets if t not in _LORA_TARGETS]
    if unknown or not targets:
        raise argparse.ArgumentTypeError(
            f"--lora-targets must be a comma-separated list of {list(_LORA_TARGETS)}; got "
            f"{text!r}")
    return targets


def _common_arguments(parser, defaults):
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int("--steps"),
                        help="optimizer steps to train for")
    length.add_argument("--epochs", type=_positive_int("--epochs"),
                        help="passes over the training data (default: "
                             f"{defaults.get('epochs', '-')}; steps: "
                             f"{defaults.get('steps', '-')})")
    parser.add_argument("--preset", type=_preset,
                        help=f"kzoo preset or saved preset directory (default: "
                             f"{defaults.get('preset')})")
    parser.add_argument("--batch-size", type=_positive_int("--batch-size"),
                        help=f"examples per step, the micro-batch when --accumulate N > 1 "
                             f"(default: {defaults.get('batch_size', 32)})")
    _memory_arguments(parser)
    parser.add_argument("--out", type=_directory("--out"), help="output directory (default: runs/<recipe>)")
    parser.add_argument("--seed", type=_non_negative_int("--seed"), default=0,
                        help="seed of the initialisation, data order, masking, dropout")
    # (inf passed the parser and failed in the schedule, a traceback)
    parser.add_argument("--learning-rate", type=_float("--learning-rate", 0, float("inf"),
                                                       low_open=True, high_open=True),
                        help="peak learning rate of the WarmupInverseSqrt schedule "
                             f"(default: {defaults.get('learning_rate', 1e-3)})")
    parser.add_argument("--warmup-steps", type=_positive_int("--warmup-steps"),
                        help=f"warmup steps (default: {defaults.get('warmup_steps', 100)})")
    parser.add_argument("--weight-decay", type=_float("--weight-decay", 0, float("inf"),
                                                      high_open=True),
                        help="AdamW weight decay")
    parser.add_argument("--clipnorm", type=_float("--clipnorm", 0),
                        help="clip gradients to this global norm (0: no clipping; default 1)")
    parser.add_argument("--label-smoothing", type=_float("--label-smoothing", 0, 1,
                                                         high_open=True),
                        help="label smoothing of the cross-entropy")
    parser.add_argument("--save-every", type=_positive_int("--save-every"),
                        help="checkpoint every N steps (and at every epoch end)")
    parser.add_argument("--max-epoch-steps", type=_positive_int("--max-epoch-steps"),
                        help="validate/log at least every N steps (default 200)")
    parser.add_argument("--override", type=_override, action="append", default=[],
                        metavar="KEY=VALUE",
                        help="preset config override, repeatable, e.g. --override num_layers=2")
    parser.add_argument("--fresh", action="store_true",
                        help="discard the checkpoints and outputs in --out and start over")
    parser.add_argument("--lora-rank", type=_positive_int("--lora-rank"),
                        help="fine-tune LoRA adapters of this rank only (kzoo.lora); the "
                             "saved model has them merged in")
    parser.add_argument("--lora-targets", type=_lora_targets, default=("query", "value"),
                        help="comma-separated sub-layers that get adapters (default "
                             "query,value; allowed: " + ",".join(_LORA_TARGETS) + ")")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                        help="0 silent, 1 progress bar (default), 2 one line per epoch")
    _distributed_arguments(parser)


# === Distributed training (training.distributed; docs/DISTRIBUTED.md) ===

DISTRIBUTED = ("data_parallel", "model_parallel", "strategy", "cpu_devices")


def _distributed_arguments(parser):
    group = parser.add_argument_group(
        "distributed training",
        "--batch-size stays the global batch. On torch, start the processes with "
        "`torchrun --nproc_per_node N -m training <recipe> ...` (DistributedDataParallel "
        "style, gloo on CPU, nccl on CUDA); rank 0 writes the outputs.")
    group.add_argument("--data-parallel", type=_positive_int("--data-parallel"), metavar="N",
                       help="JAX: split every batch over N devices (with --model-parallel: "
                            "the batch axis of an N x M mesh; default: devices / M)")
    group.add_argument("--model-parallel", type=_positive_int("--model-parallel"),
                       metavar="M", help="JAX: split the weights over M devices (Megatron "
                                         "heads / feed-forward columns, experts)")
    group.add_argument("--strategy", choices=("mirrored",),
                       help="TensorFlow: tf.distribute.MirroredStrategy over the local "
                            "devices")
    group.add_argument("--cpu-devices", type=_positive_int("--cpu-devices"), metavar="N",
                       help="JAX, TensorFlow: split the CPU into N virtual devices (to try "
                            "the modes without accelerators)")


def plan_from_args(args, cfg):
    """The `training.distributed.Plan` of parsed arguments (checked before any data is
    loaded; `DistributedError` names the flag, its value and what is allowed)."""
    from training import distributed

    return distributed.plan_from_args(
        args.recipe, cfg.batch_size, data_parallel=args.data_parallel,
        model_parallel=args.model_parallel, strategy=args.strategy,
        cpu_devices=args.cpu_devices, clipnorm=cfg.clipnorm)


# === Memory savers (--mixed-precision, --remat, --accumulate) ===

MIXED_PRECISION = ("bfloat16", "float16")


def _mixed_precision(text):
    if text not in MIXED_PRECISION:
        raise argparse.ArgumentTypeError(
            f"--mixed-precision must be one of {list(MIXED_PRECISION)} (or given alone, "
            f"meaning bfloat16); got {text!r}")
    return text


def _memory_arguments(parser):
    parser.add_argument("--mixed-precision", type=_mixed_precision, nargs="?",
                        const="bfloat16", default=None, metavar="{bfloat16,float16}",
                        help="compute in bfloat16 (the bare flag; dtype policy "
                             "mixed_bfloat16) or float16 (mixed_float16, with Keras' dynamic "
                             "loss scaling); variables, softmax and norm statistics stay "
                             "float32")
    parser.add_argument("--remat", action="store_true",
                        help="gradient checkpointing: each transformer block recomputes its "
                             "activations in the backward pass (less memory, ~1/3 more "
                             "compute; the same as --override remat=true)")
    parser.add_argument("--accumulate", type=_positive_int("--accumulate"), default=1,
                        metavar="N",
                        help="gradient accumulation: the optimizer updates once every N "
                             "batches with the mean of their gradients, so the effective "
                             "batch is N x --batch-size; --steps/--epochs/--save-every count "
                             "batches, --warmup-steps counts updates (default 1: update "
                             "every batch)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m training",
        description="Train kzoo models on real data that ships with Python packages. "
                    "Each run writes a CSV log, a PNG of the curves, metrics.json, "
                    "checkpoints (resumed automatically) and the model as a preset "
                    "directory into --out.",
    )
    sub = parser.add_subparsers(dest="recipe", metavar="recipe", required=True,
                                title="recipes", help="one of: " + ", ".join(RECIPES))
    for name in RECIPES:
        module = recipe_module(name)
        # (argparse %-formats a `help` string but prints a description as it is)
        recipe_parser = sub.add_parser(name, help=module.HELP.replace("%", "%%"),
                                       description=module.__doc__,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
        _common_arguments(recipe_parser, module.DEFAULTS)
        module.add_arguments(recipe_parser)
    return parser


COMMON = {"recipe", "steps", "epochs", "preset", "batch_size", "mixed_precision", "out",
          "remat", "accumulate",
          "seed", "learning_rate", "warmup_steps", "weight_decay", "clipnorm",
          "label_smoothing", "save_every", "max_epoch_steps", "override", "fresh", "verbose",
          "lora_rank", "lora_targets", *DISTRIBUTED}


def config_from_args(args):
    """A `RunConfig` from parsed arguments and the recipe's defaults."""
    from training.loop import RunConfig

    module = recipe_module(args.recipe)
    defaults = dict(module.DEFAULTS)
    overrides = dict(defaults.pop("overrides", {}))
    options = dict(defaults.pop("options", {}))
    overrides.update(dict(args.override))
    if args.remat:
        overrides["remat"] = True
    for key, value in vars(args).items():
        if key not in COMMON:
            options[key] = value
    values = dict(defaults)
    for key in ("preset", "batch_size", "learning_rate", "warmup_steps", "weight_decay",
                "clipnorm", "label_smoothing", "save_every", "max_epoch_steps"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if args.steps is not None or args.epochs is not None:
        values["steps"], values["epochs"] = args.steps, args.epochs
    elif "steps" not in values and "epochs" not in values:
        values["epochs"] = 1
    return RunConfig(
        recipe=args.recipe,
        out=args.out or os.path.join("runs", args.recipe),
        seed=args.seed,
        mixed_precision=args.mixed_precision or False,
        accumulate=args.accumulate,
        overrides=overrides,
        options=options,
        fresh=args.fresh,
        verbose=args.verbose,
        lora_rank=args.lora_rank,
        lora_targets=tuple(args.lora_targets),
        **values,
    )


def _check_preset_directory(path):
    """A `--preset` path is a directory `kzoo.presets.load` reads (its kzoo config checked),
    or `ValueError` naming it: any other directory, or a damaged config, was a traceback
    once the recipe had started (its data loaded)."""
    import kzoo.presets
    from kzoo import checkpoints, registry

    if not os.path.isdir(path):
        raise ValueError(f"--preset {path!r} is neither a preset name nor a directory.")
    if os.path.isfile(os.path.join(path, kzoo.presets.CONFIG_FILE)):
        weights = kzoo.presets._read_saved_config(path)[4]  # (its errors name the file)
        if weights.endswith(".h5"):
            import h5py

            try:  # (HDF5 checks the file's stored length when it opens: a truncated copy)
                h5py.File(weights, "r").close()
            except OSError as error:
                raise ValueError(
                    f"--preset {path!r}: the weights file {weights!r} cannot be read "
                    f"(truncated or not HDF5): {error}") from None
        return
    if checkpoints.is_hf_dir(path) or registry.keras_hub_converter().is_preset(path):
        return
    raise ValueError(
        f"--preset {path!r} is neither a kzoo preset directory (no "
        f"{kzoo.presets.CONFIG_FILE}), a Hugging Face checkpoint nor a keras-hub preset.")


def check_model_arguments(module, cfg):
    """`--preset` and `--override` checked before any work (data, tokenizer, compiling):
    a preset of another family than the recipe trains, an override name the family does
    not have, or a bad value (`num_layers=abc`) raise `ValueError` naming it. A path given
    as `--preset` must be a directory that `kzoo.presets.load` reads (its family and
    overrides are checked when the recipe loads it)."""
    import kzoo.presets
    from kzoo import registry

    if cfg.preset not in kzoo.presets.list():
        if os.path.sep in cfg.preset or os.path.exists(cfg.preset):
            _check_preset_directory(cfg.preset)
            return
        kzoo.presets.info(cfg.preset)  # an unknown name: the error lists the known ones
    spec = kzoo.presets.info(cfg.preset)
    family = registry.family(spec["family"])
    trains = kzoo.presets.info(module.DEFAULTS["preset"])["family"]
    if family.name != trains:
        same = [name for name in kzoo.presets.list()
                if kzoo.presets.info(name)["family"] == trains]
        raise ValueError(
            f"--preset {cfg.preset} is a {family.name} model; the recipe {cfg.recipe!r} trains "
            f"{trains} models: {same}."
        )
    task = spec.get("task", family.default_task)
    # (attention options by name, `--override window=32`, as `kzoo.presets.load` takes them)
    overrides = kzoo.presets._fold_attention_options(family, spec["config"], cfg.overrides)
    config_over, _ = family.split_overrides(task, overrides)  # unknown names
    if family.config_class is not None:
        try:
            family.config_class(**{**spec["config"], **config_over})
        except (ValueError, TypeError) as error:
            raise ValueError(f"--override: {error}") from None
    limit = {**spec["config"], **config_over}.get("max_sequence_length")
    seq_len = cfg.options.get("seq_len")
    if isinstance(limit, int) and isinstance(seq_len, int) and seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is longer than the model's max_sequence_length={limit} "
            f"(--preset {cfg.preset}{' and --override' if config_over else ''}); give a "
            f"shorter --seq-len or --override max_sequence_length={seq_len}.")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from training.checkpoint import CheckpointError
    from training.data import UsageError
    from training.distributed import DistributedError
    from training.loop import TrainingDiverged, TrainingInterrupted

    module = recipe_module(args.recipe)
    try:
        cfg = config_from_args(args)
        if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
            raise ValueError(f"--out {cfg.out!r} exists and is not a directory.")
        import kzoo.presets

        kzoo.presets._check_writable_directory(cfg.out, "--out")  # (before the data loads)
        if hasattr(module, "check_options"):
            module.check_options(cfg.options)
        check_model_arguments(module, cfg)
    except ValueError as error:  # a usage error: no traceback, nothing written
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        cfg.plan = plan_from_args(args, cfg)
        module.train(cfg)
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_DIVERGED
    except TrainingInterrupted as error:  # (the shell's code of a process a signal ended)
        print(f"stopped: {error}", file=sys.stderr)
        return 128 + int(error.signum)
    except (CheckpointError, DistributedError, UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        from training.distributed import shutdown

        shutdown()
    return 0
