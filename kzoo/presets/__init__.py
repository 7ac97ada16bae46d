"""Presets: named model configurations shipped as JSON files inside this package.

- `list()`: the preset names.
- `info(name)`: the preset's JSON (family, task, config, paper, parameter count).
- `load(name_or_path, *, task=None, weights=None, dtype=None, **overrides)`: a Keras model
  from a preset name, a directory written by `save`, or a Hugging Face checkpoint directory.
- `save(model, directory, format="kzoo"|"hf")`: a directory `load` reads back.

Example:
>>> import kzoo
>>> model = kzoo.presets.load("gpt_mini")
>>> model = kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=3)
"""

import difflib
import json
import os
import time
from importlib import resources

import keras

from kzoo.models import FAMILY_MODULES, family_module

PRESET_SUFFIX = ".json"
CONFIG_FILE = "kzoo_config.json"
WEIGHTS_FILE = "model.weights.h5"
_RESERVED = ("name", "trainable", "dtype")


def _preset_dir():
    return resources.files(__name__)


def list():  # noqa: A001 - the public name the design asks for
    """Sorted names of the presets that ship with kzoo.

    Example:
    >>> "gpt2" in kzoo.presets.list()
    True
    """
    return sorted(
        p.name[: -len(PRESET_SUFFIX)]
        for p in _preset_dir().iterdir()
        if p.name.endswith(PRESET_SUFFIX)
    )


def info(name):
    """The JSON description of preset `name` (a dict).

    Example:
    >>> kzoo.presets.info("gpt2")["params"]
    124439808
    """
    names = list()
    if name not in names:
        close = difflib.get_close_matches(str(name), names, n=5, cutoff=0.4)
        hint = f" Did you mean {close}?" if close else ""
        raise ValueError(
            f"Unknown preset name={name!r}.{hint} Known presets: {names}."
        )
    with _preset_dir().joinpath(name + PRESET_SUFFIX).open() as f:
        return json.load(f)


def _is_hf_dir(path):
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return "model_type" in json.load(f)


def _split_overrides(module, task, overrides):
    """Separate backbone config overrides from task arguments; reject unknown names."""
    import inspect

    backbone_params = set(inspect.signature(module.BACKBONE.__init__).parameters) - {
        "self", "kwargs", "dtype"
    }
    task_cls = module.TASKS.get(task)
    task_params = set()
    if task_cls is not None:
        task_params = set(inspect.signature(task_cls.__init__).parameters) - {
            "self", "kwargs", "backbone", "dtype"
        }
    config, task_config = {}, {}
    for key, value in overrides.items():
        if key in backbone_params:
            config[key] = value
        elif key in task_params:
            task_config[key] = value
        else:
            allowed = sorted(backbone_params | task_params)
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f" Did you mean {close}?" if close else ""
            raise ValueError(
                f"Unknown override {key}={value!r} for family {module.FAMILY!r}, "
                f"task {task!r}.{hint} Allowed: {allowed}."
            )
    return config, task_config


def build(family, config, task=None, task_config=None, dtype=None):
    """Build a model of `family` from a backbone `config` and a task (no weights).

    Example:
    >>> kzoo.presets.build("gpt", kzoo.presets.info("gpt_mini")["config"], task="causal_lm")
    """
    module = family_module(family)
    task = module.DEFAULT_TASK if task is None else task
    if task not in module.TASKS:
        raise ValueError(
            f"`task` must be one of {sorted(module.TASKS)} for family {family!r}; "
            f"got task={task!r}."
        )
    kwargs = dict(config)
    if dtype is not None:
        kwargs["dtype"] = dtype
    backbone = module.BACKBONE(**kwargs)
    task_cls = module.TASKS[task]
    if task_cls is None:
        return backbone
    task_kwargs = dict(task_config or {})
    if dtype is not None:
        task_kwargs["dtype"] = dtype
    return task_cls(backbone=backbone, **task_kwargs)


def load(name_or_path, *, task=None, weights=None, dtype=None, **overrides):
    """Build a model by preset name, from a `save` directory, or from a Hugging Face checkpoint.

    Args:
        name_or_path: a name from `list()`, a directory written by `save`, or a Hugging Face
            checkpoint directory (`config.json` with `model_type` and safetensors/bin weights).
        task: task model to build ("backbone" for the backbone alone); defaults to the
            preset's / checkpoint's own task.
        weights: for a preset name, an optional weights file (`.weights.h5`) or Hugging Face
            checkpoint directory to load into the model; `False` skips the weights of a saved
            directory.
        dtype: dtype policy name (e.g. "float32", "bfloat16", "mixed_bfloat16").
        **overrides: backbone configuration fields or task arguments (e.g. `num_classes`),
            validated against the family's constructor.

    Example:
    >>> model = kzoo.presets.load("vit_tiny_patch16_224", num_classes=10, image_size=32)
    """
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, CONFIG_FILE)):
            return _load_saved(path, task=task, weights=weights, dtype=dtype,
                               overrides=overrides)
        if _is_hf_dir(path):
            from kzoo import convert

            return convert.load_hf(path, task=task, dtype=dtype, **overrides)
        raise ValueError(
            f"Directory {path!r} is neither a kzoo preset directory (no {CONFIG_FILE}) nor a "
            "Hugging Face checkpoint (no config.json with a model_type)."
        )
    spec = info(path)
    module = family_module(spec["family"])
    task = spec.get("task", module.DEFAULT_TASK) if task is None else task
    if task not in module.TASKS:
        raise ValueError(
            f"`task` must be one of {sorted(module.TASKS)} for preset {path!r}; got task={task!r}."
        )
    config_over, task_over = _split_overrides(module, task, overrides)
    config = {**spec["config"], **config_over}
    task_config = {**spec.get("task_config", {}), **task_over} if task == spec.get("task") \
        else task_over
    model = build(spec["family"], config, task=task, task_config=task_config, dtype=dtype)
    if weights:
        _load_weights_into(model, weights)
    return model


def _load_weights_into(model, weights):
    weights = os.fspath(weights)
    if os.path.isdir(weights) and _is_hf_dir(weights):
        from kzoo import convert

        convert.load_hf_weights_into(model, weights)
    elif os.path.isfile(weights):
        model.load_weights(weights)
    else:
        raise ValueError(
            f"`weights` must be a .weights.h5 file or a Hugging Face checkpoint directory; "
            f"got weights={weights!r} (not found)."
        )


def _describe(model):
    """(family, task, backbone config, task config) of a kzoo model."""
    family = getattr(model, "family", None)
    if family not in FAMILY_MODULES:
        raise ValueError(
            f"`model` must be a kzoo backbone or task model; got {type(model).__name__}."
        )
    task_name = getattr(model, "task_name", None)
    backbone = model.backbone if task_name else model
    config = {k: v for k, v in backbone.get_config().items() if k not in _RESERVED}
    task_config = {}
    if task_name:
        task_config = {
            k: v for k, v in model.get_config().items()
            if k not in _RESERVED and k != "backbone"
        }
    return family, task_name or "backbone", config, task_config


def save(model, directory, format="kzoo", overwrite=True):  # noqa: A002
    """Write `model` to `directory` so that `load(directory)` rebuilds it.

    `format="kzoo"` writes `kzoo_config.json` (family, task, configs, metadata) and
    `model.weights.h5`; `format="hf"` writes a Hugging Face checkpoint (`config.json` +
    `model.safetensors`) that transformers loads. Files are written to a temporary name
    first and renamed, so an interrupted save never leaves a half-written checkpoint.

    Example:
    >>> kzoo.presets.save(model, "runs/my_gpt")
    >>> same = kzoo.presets.load("runs/my_gpt")
    """
    if format not in ("kzoo", "hf"):
        raise ValueError(f"`format` must be 'kzoo' or 'hf'; got format={format!r}.")
    os.makedirs(directory, exist_ok=True)
    if format == "hf":
        from kzoo import convert

        return convert.save_hf(model, directory)
    family, task, config, task_config = _describe(model)
    config_path = os.path.join(directory, CONFIG_FILE)
    if os.path.exists(config_path) and not overwrite:
        raise ValueError(f"{config_path!r} exists and overwrite=False.")
    meta = {
        "family": family,
        "task": task,
        "config": config,
        "task_config": task_config,
        "dtype": model.dtype_policy.name,
        "kzoo_version": __import__("kzoo").__version__,
        "keras_version": keras.__version__,
        "saved_with_backend": keras.backend.backend(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": int(model.count_params()),
    }
    weights_tmp = os.path.join(directory, "tmp." + WEIGHTS_FILE)
    model.save_weights(weights_tmp, overwrite=True)
    os.replace(weights_tmp, os.path.join(directory, WEIGHTS_FILE))
    tmp = config_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, default=_json_default)
    os.replace(tmp, config_path)
    return directory


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _load_saved(path, task=None, weights=None, dtype=None, overrides=None):
    with open(os.path.join(path, CONFIG_FILE)) as f:
        meta = json.load(f)
    module = family_module(meta["family"])
    saved_task = meta.get("task", "backbone")
    task = saved_task if task is None else task
    config_over, task_over = _split_overrides(module, task, overrides or {})
    config = {**meta["config"], **config_over}
    task_config = {**meta.get("task_config", {}), **task_over} if task == saved_task \
        else task_over
    model = build(meta["family"], config, task=task, task_config=task_config, dtype=dtype)
    if weights is not False:
        weights_path = os.path.join(path, WEIGHTS_FILE)
        if task == saved_task:
            model.load_weights(weights_path)
        else:
            # Another head on the saved backbone: load the saved model, copy its backbone.
            saved = build(meta["family"], meta["config"], task=saved_task,
                          task_config=meta.get("task_config", {}), dtype=dtype)
            saved.load_weights(weights_path)
            source = saved.backbone if getattr(saved, "task_name", None) else saved
            target = model.backbone if getattr(model, "task_name", None) else model
            target.set_weights(source.get_weights())
    return model


__all__ = ["list", "info", "load", "save", "build"]
