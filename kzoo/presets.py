"""Presets: named model configurations, saved directories and Hugging Face checkpoints in, out.

- `list()`: the preset names (the JSON files of the top-level `presets/` directory, installed
  with the package).
- `info(name)`: the preset's JSON (family, task, config, paper, parameter count).
- `load(name_or_path, *, task=None, weights=None, dtype=None, **overrides)`: a Keras model
  from a preset name, a directory written by `save`, a Hugging Face checkpoint directory, a
  keras-hub preset directory (BERT, GPT-2, ViT: `kzoo.convert.keras_hub`), or a `.keras` file.
- `save(model, directory, format="kzoo"|"hf"|"keras_hub")`: a directory `load` reads back.
- `build(family, config, task=None, task_config=None, dtype=None)`: a model from a config.

Which family a preset, a saved directory or a Hugging Face `model_type` belongs to, and how
that family builds, imports and exports, comes from `kzoo.registry`. A file that is missing,
empty, truncated or not JSON raises `ValueError` naming it.

Loading never runs code from the files: configs are JSON validated field by field, weights are
HDF5 / safetensors / `torch.load(weights_only=True)` (see `kzoo.checkpoints`), and a `.keras`
file is read with Keras' safe mode forced on, after its config has been checked to name only
Keras and kzoo classes (no `Lambda` layer, no serialised Python function, no other module).

Example:
>>> import kzoo
>>> model = kzoo.presets.load("gpt_mini")
>>> model = kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=3)
"""

import builtins
import contextlib
import os
import tempfile
import time
import warnings
import zipfile

import keras

import kzoo
import kzoo.lora
import kzoo.quantize
from kzoo import checkpoints, registry
from kzoo.layers.utils import FieldError

CONFIG_FILE = "kzoo_config.json"
WEIGHTS_FILE = "model.weights.h5"
KERAS_SUFFIX = ".keras"
# Modules whose classes a `.keras` file may name, and classes it may not name even there (they
# carry Python code or pickles: Keras' safe mode refuses them too, this is the second lock).
# A function is named by its module like a class (`keras.activations.relu`).
_KERAS_FILE_MODULES = ("keras", "kzoo")
_KERAS_FILE_REFUSED = ("Lambda", "__lambda__", "TorchModuleWrapper")
# Functions (class_name "function") only from the modelling namespaces: never e.g.
# `keras.config.enable_unsafe_deserialization` or `keras.utils.get_file`.
_KERAS_FILE_FUNCTION_MODULES = tuple(
    f"{root}.{name}" for root in ("keras", "keras.src")
    for name in ("activations", "losses", "metrics", "ops", "initializers", "regularizers",
                 "constraints")
) + ("kzoo",)


def list():  # noqa: A001 - the public name the design asks for
    """Sorted names of the presets that ship with kzoo.

    Example:
    >>> "gpt2" in kzoo.presets.list()
    True
    """
    return registry.preset_names()


def info(name):
    """The JSON description of preset `name` (a dict).

    Example:
    >>> kzoo.presets.info("gpt2")["params"]
    124439808
    """
    return registry.preset_spec(name)


def build(family, config, task=None, task_config=None, dtype=None):
    """Build a model of `family` from a backbone `config` and a task (no weights).

    Example:
    >>> kzoo.presets.build("gpt", kzoo.presets.info("gpt_mini")["config"], task="causal_lm")
    """
    return registry.family(family).build(config, task=task, task_config=task_config, dtype=dtype)


def load(name_or_path, *, task=None, weights=None, dtype=None, **overrides):
    """Build a model by preset name, from a `save` directory, or from a Hugging Face checkpoint.

    Args:
        name_or_path: a name from `list()`, a directory written by `save`, a Hugging Face
            checkpoint directory (`config.json` with `model_type` and safetensors/bin weights),
            a keras-hub preset directory (written by keras-hub's `save_to_preset`: BERT,
            GPT-2, ViT), or a `.keras` file (`model.save("m.keras")`; loaded as saved, so `task`,
            `weights`, `dtype` and overrides do not apply; only Keras and kzoo classes, safe
            mode always on).
        task: task model to build ("backbone" for the backbone alone); defaults to the
            preset's / checkpoint's own task.
        weights: a weights file (`.weights.h5`), a directory written by `save` or a Hugging
            Face checkpoint directory whose weights to load into the model (for a directory:
            instead of its own); `False`: no weights (a directory's configuration alone, a
            fresh model; with overrides that change the shapes, a model of the new shape).
        dtype: dtype policy name (e.g. "float32", "bfloat16", "mixed_bfloat16"); a
            directory written by `save` loads with the policy it was saved with unless
            one is given here.
        **overrides: backbone configuration fields or task arguments (e.g. `num_classes`),
            validated against the family's constructor. The attention type of BERT, GPT and
            ViT is one of them, with its options by name: `attention="sliding_window",
            window=256` (see `kzoo.layers.efficient_attention`).

    Example:
    >>> model = kzoo.presets.load("vit_tiny_patch16_224", num_classes=10, image_size=32)
    >>> long = kzoo.presets.load("gpt_mini", attention="sliding_window", window=64)
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(
            "`name_or_path` must be a preset name (see `kzoo.presets.list()`), a directory or "
            f"a .keras file; got name_or_path={name_or_path!r}."
        )
    if weights is not None and weights is not False and not isinstance(
            weights, (str, os.PathLike)):
        raise ValueError(
            "`weights` must be None, False (a saved directory without its weights) or the "
            f"path of a weights file or checkpoint directory; got weights={weights!r}."
        )
    path = os.fspath(name_or_path)
    if path.endswith(KERAS_SUFFIX) and os.path.isfile(path):
        given = {"task": task, "weights": weights, "dtype": dtype, **overrides}
        given = {k: v for k, v in given.items() if v is not None}
        if given:
            raise ValueError(
                f"A .keras file loads as it was saved; got {sorted(given)} for {path!r}. "
                "Save a preset directory (`kzoo.presets.save`) to load it with another task, "
                "dtype or configuration."
            )
        return load_keras_file(path)
    if os.path.isdir(path):
        if os.path.isfile(checkpoints.file_in(path, CONFIG_FILE, "saved kzoo config")):
            return _load_saved(path, task=task, weights=weights, dtype=dtype,
                               overrides=overrides)
        if checkpoints.is_hf_dir(path):
            return _load_hf(path, task=task, dtype=dtype, overrides=overrides,
                            weights=weights)
        if registry.keras_hub_converter().is_preset(path):
            return _load_keras_hub(path, task=task, dtype=dtype, overrides=overrides,
                                   weights=weights)
        raise ValueError(
            f"Directory {path!r} is neither a kzoo preset directory (no {CONFIG_FILE}), a "
            "Hugging Face checkpoint (no config.json with a model_type) nor a keras-hub preset "
            "(no config.json naming a keras_hub class, or no metadata.json)."
        )
    try:
        spec = info(path)
    except ValueError as error:
        if (os.sep in path or (os.altsep and os.altsep in path) or path.startswith(".")
                or path.endswith(KERAS_SUFFIX)) and not os.path.exists(path):
            # (said only "must be a preset name", as if the path had been meant as a name)
            raise ValueError(
                f"`name_or_path` {path!r} does not exist (no such file or directory); as a "
                f"name: {error}") from None
        raise
    family = registry.family(spec["family"])
    model = _build(family, spec["config"], spec.get("task", family.default_task),
                   spec.get("task_config", {}), task=task, dtype=dtype, overrides=overrides)
    if weights:
        _load_weights_into(model, weights, overrides)
    return model


def _build(family, config, source_task, source_task_config, *, task, dtype, overrides,
           source=None):
    """A model from a stored (config, task, task config) with the caller's task and overrides.

    The stored task config applies only when the caller keeps the stored task.
    """
    task = source_task if task is None else task
    overrides = _fold_attention_options(family, config, overrides)
    config_over, task_over = family.split_overrides(task, overrides)
    task_config = {**source_task_config, **task_over} if task == source_task else task_over
    try:
        return family.build({**config, **config_over}, task=task, task_config=task_config,
                            dtype=dtype, source=source)
    except FieldError as e:
        # A bad value read from a file (not one given as an override) names the file: the
        # message named the field alone, as if the caller had passed it.
        stored = {**config, **(source_task_config if task == source_task else {})}
        if source is None or e.field is None or e.field in overrides or e.field not in stored:
            raise
        raise FieldError(f"{str(e).rstrip('.')} (read from {source!r}).", e.field) from None


def _fold_attention_options(family, config, overrides):
    """`load(..., attention="sliding_window", window=256)`: the attention options given by
    name (`window`, `block_size`, `num_features`, ...; see
    `kzoo.layers.efficient_attention`) become the `attention_options` field. A new
    `attention` type starts from no options; the same type updates the stored ones."""
    from kzoo.layers.efficient_attention import OPTION_NAMES

    named = {key: overrides[key] for key in OPTION_NAMES if key in overrides}
    if "attention_options" not in family.config_fields:
        return overrides
    stored_type = config.get("attention", "full")
    new_type = overrides.get("attention", stored_type) != stored_type
    if not named:
        if new_type and "attention_options" not in overrides:  # drop the old type's options
            return {**overrides, "attention_options": None}
        return overrides
    if "attention_options" in overrides:
        raise ValueError(
            f"Give the attention options either as `attention_options` or by name; got both "
            f"attention_options={overrides['attention_options']!r} and {named}."
        )
    rest = {key: value for key, value in overrides.items() if key not in named}
    base = {} if new_type else dict(config.get("attention_options") or {})
    rest["attention_options"] = {**base, **named}
    return rest


def _load_weights_into(model, weights, overrides=None):
    weights = os.fspath(weights)
    saved = os.path.isdir(weights) and os.path.isfile(
        checkpoints.file_in(weights, CONFIG_FILE, "saved kzoo config"))
    if os.path.isdir(weights) and checkpoints.is_hf_dir(weights):
        model_type = checkpoints.read_hf_config(weights)["model_type"]
        registry.for_model_type(model_type).load_hf_weights(
            model, checkpoints.read_hf_state(weights))
    elif saved:  # a directory written by `save`: its weights file
        weights_path = _read_saved_config(weights)[4]
        checkpoints.require_file(weights_path, f"weights file named in {CONFIG_FILE}")
        _read_keras_weights(model, weights_path, overrides)
    elif os.path.isfile(weights):
        _read_keras_weights(model, weights, overrides)
    else:
        what = "a directory of neither kind" if os.path.isdir(weights) else "not found"
        raise ValueError(
            f"`weights` must be a .weights.h5 file, a directory written by "
            f"`kzoo.presets.save` or a Hugging Face checkpoint directory; got "
            f"weights={weights!r} ({what})."
        )


def load_keras_file(path):
    """The model in a `.keras` file, read without running code from it.

    The archive's `config.json` is checked first: every object it names must come from Keras
    or kzoo, and none may be a `Lambda` layer, a serialised Python function or a wrapped
    torch module. Keras then loads it with `safe_mode=True` passed explicitly, so neither the
    file nor an earlier `keras.config.enable_unsafe_deserialization()` turns safe mode off.
    Any problem raises `ValueError` naming the file.

    Example:
    >>> model.save("m.keras")
    >>> same = kzoo.presets.load("m.keras")
    """
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as archive:
            data = archive.read("config.json")
    except KeyError:
        raise ValueError(f"The Keras file {path!r} has no config.json.") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(
            f"The Keras file {path!r} cannot be read (not a .keras zip archive, or "
            f"truncated): {e}"
        ) from None
    config = checkpoints.parse_json(data, f"{path}:config.json", "Keras model config")
    _check_keras_config(config, path)
    try:
        with _forced_safe_mode():
            return keras.saving.load_model(path, safe_mode=True)
    except Exception as e:  # Keras raises ValueError, TypeError, KeyError, OSError ...
        raise ValueError(f"The Keras file {path!r} cannot be loaded: {e}") from e


def _forced_safe_mode():
    """A context in which Keras deserialises in safe mode whatever the process set before.

    Keras 3.15 lets a global `keras.config.enable_unsafe_deserialization()` win over
    `load_model(..., safe_mode=True)` (its deserialiser reads the global flag first), so
    the flag itself is set for the duration of the load, with Keras' own scope.
    """
    from keras.src.saving.serialization_lib import SafeModeScope  # no public equivalent

    return SafeModeScope(True)


def _check_keras_config(node, path, where="config"):
    """Refuse any object of a `.keras` config outside Keras and kzoo, or carrying code."""
    if isinstance(node, builtins.list):  # this module's `list` is the preset list
        for i, item in enumerate(node):
            _check_keras_config(item, path, f"{where}[{i}]")
        return
    if not isinstance(node, dict):
        return
    class_name, module = node.get("class_name"), node.get("module")
    if class_name is not None:
        package = module.split(".")[0] if isinstance(module, str) else None
        foreign_function = class_name == "function" and module is not None and not (
            isinstance(module, str) and module.startswith(_KERAS_FILE_FUNCTION_MODULES))
        if class_name in _KERAS_FILE_REFUSED or foreign_function or (
                module is not None and package not in _KERAS_FILE_MODULES):
            raise ValueError(
                f"The Keras file {path!r} names {class_name!r} from module {module!r} at "
                f"{where}; kzoo loads only Keras and kzoo classes and never code (Lambda "
                "layers, Python functions, pickled modules) from a file."
            )
    for key, value in node.items():
        _check_keras_config(value, path, f"{where}.{key}")


def _read_keras_weights(model, path, overrides=None):
    try:
        model.load_weights(path)
    except OSError as e:  # h5py: truncated or not an HDF5 file
        raise ValueError(f"The weights file {path!r} cannot be read: {e}") from e
    except ValueError as e:  # Keras: the file's variables do not fit the model's
        raise ValueError(
            f"The weights file {path!r} does not fit the model {model.name!r}."
            f"{_shaping_hint(overrides, 'pass weights=False')} Keras said: {e}"
        ) from e


def _shaping_hint(overrides, fresh):
    """The sentence added to a weights mismatch when the model was built with overrides
    (empty without): the overrides by name, and what to do instead (`fresh`: how to get a
    model of the new shape without the weights)."""
    shaping = sorted(overrides or {})
    if not shaping:
        return ""
    return (f" The model was built with the overrides {shaping}: an override that changes "
            "the number or shapes of the weights (layers, widths, vocabulary, positions) "
            f"cannot take weights saved without it; load without it, or {fresh} for a fresh "
            "model of the new shape.")


@contextlib.contextmanager
def _naming_overrides(path, overrides):
    """A checkpoint directory's weights (Hugging Face, keras-hub) that do not fit a model
    built with `overrides`: the error names them (it named only the first weight whose
    shape differs, as if the checkpoint were broken)."""
    try:
        yield
    except ValueError as e:
        if not overrides:
            raise
        fresh = "pass weights=False"
        raise ValueError(f"{str(e).rstrip('.')} (checkpoint {path!r})."
                         f"{_shaping_hint(overrides, fresh)}") from e


def _in_stored_dtype(model, hf_config, state):
    """A Hugging Face checkpoint of a model whose variables are bfloat16 or float16 (dtype
    policy "bfloat16" / "float16", not the mixed ones, whose variables are float32): each
    float tensor written in that dtype where it holds exactly (the converters hand out
    float32; a variable the model keeps in float32, e.g. a router's, stays float32), and
    `torch_dtype` set to it, as transformers' `save_pretrained` of such a model writes it."""
    import numpy as np

    stored = keras.backend.standardize_dtype(model.dtype_policy.variable_dtype)
    if stored not in ("bfloat16", "float16"):
        return hf_config, state
    import ml_dtypes  # (a dependency of Keras)

    dtype = ml_dtypes.bfloat16 if stored == "bfloat16" else np.float16

    def narrow(array):
        if not np.issubdtype(np.asarray(array).dtype, np.floating):
            return array
        cast = np.asarray(array).astype(dtype)
        return cast if np.array_equal(cast.astype(np.float32), array) else array

    return {**hf_config, "torch_dtype": stored}, {k: narrow(v) for k, v in state.items()}


def save(model, directory, format="kzoo", overwrite=True, *,  # noqa: A002
         max_shard_size=None, metrics=None):
    """Write `model` to `directory` so that `load(directory)` rebuilds it, with a model card.

    `format="kzoo"` writes `kzoo_config.json` (family, task, configs, the weights file name,
    metadata) and `model.weights.h5`; `format="hf"` writes a Hugging Face checkpoint
    (`config.json` + `model.safetensors`) that transformers loads, in shards
    `model-00001-of-0000N.safetensors` with `model.safetensors.index.json` when the weights
    are larger than `max_shard_size` (bytes or a string such as "200MB", "5GB"; default
    "5GB", as transformers; a model whose variables are bfloat16 or float16 in that dtype,
    with `torch_dtype` set to it); `format="keras_hub"` a keras-hub preset. With
    `overwrite=False` a directory that already holds a checkpoint of that format is
    refused before anything is written. Each writes `README.md`, a model card (see
    `model_card`), with `metrics` (name -> number, e.g. `{"val_accuracy": 0.91}`) when
    given. Files are written to a temporary name first and renamed, so an interrupted save
    never leaves a half-written checkpoint.

    Example:
    >>> kzoo.presets.save(model, "runs/my_gpt", metrics={"val_loss": 2.31})
    >>> same = kzoo.presets.load("runs/my_gpt")
    >>> kzoo.presets.save(model, "runs/my_gpt_hf", format="hf", max_shard_size="200MB")
    """
    if format not in ("kzoo", "hf", "keras_hub"):
        raise ValueError(
            f"`format` must be 'kzoo', 'hf' or 'keras_hub'; got format={format!r}.")
    if max_shard_size is not None and format != "hf":
        raise ValueError(
            f"`max_shard_size` applies to format='hf' (safetensors shards); got "
            f"max_shard_size={max_shard_size!r} with format={format!r}."
        )
    metrics = _check_metrics(metrics)
    if max_shard_size is not None:
        checkpoints.parse_size(max_shard_size)  # checked before anything is written
    if format != "kzoo":
        _refuse_quantized(model, format)
    kzoo.lora.check_savable(model)  # (before any folder or file is made)
    if not isinstance(overwrite, bool):
        raise ValueError(f"`overwrite` must be True or False; got overwrite={overwrite!r}.")
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(
            "`directory` must be the path (a str or path-like) of the directory to write the "
            f"checkpoint in; got directory={directory!r}."
        )
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(
            f"`directory` must be a directory to write the checkpoint in (made if missing); "
            f"{directory!r} is a file."
        )
    # The file that says a checkpoint of this format is there (keras-hub's and transformers'
    # alike: config.json).
    marker = os.path.join(directory, CONFIG_FILE if format == "kzoo" else checkpoints.HF_CONFIG)
    if os.path.exists(marker) and not overwrite:
        raise ValueError(f"{marker!r} exists and overwrite=False.")
    _check_writable_directory(directory)
    if format == "keras_hub":
        registry.keras_hub_converter().save(model, directory)
        _warn_training_settings_dropped(model, "keras-hub preset", written=())
        write_model_card(model, directory, format=format, metrics=metrics)
        return directory
    family = registry.for_model(model)
    if format == "hf":
        hf_config, state = family.to_hf(model)  # (first: a model it refuses leaves no folder)
        hf_config, state = _in_stored_dtype(model, hf_config, state)
        _warn_training_settings_dropped(model, "Hugging Face checkpoint", written=hf_config)
        os.makedirs(directory, exist_ok=True)
        checkpoints.write_hf(directory, hf_config, state,
                             tokenizer=getattr(model, "tokenizer", None),
                             max_shard_size=max_shard_size or checkpoints.DEFAULT_MAX_SHARD_SIZE)
        write_model_card(model, directory, format=format, metrics=metrics)
        return directory
    os.makedirs(directory, exist_ok=True)
    task, config, task_config = family.describe(model)
    config_path = marker
    meta = {
        "family": family.name,
        "task": task,
        "config": config,
        "task_config": task_config,
        "weights": WEIGHTS_FILE,
        "dtype": model.dtype_policy.name,
        "kzoo_version": kzoo.__version__,
        "keras_version": keras.__version__,
        "saved_with_backend": keras.backend.backend(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": int(model.count_params()),
    }
    quantized = kzoo.quantize.quantization_map(model)
    if quantized:  # {layer path: quantized policy}; `load` quantizes these layers again
        meta["quantization"] = quantized
    adapters = kzoo.lora.config_entry(model)
    if adapters:  # LoRA on int8/int4 layers: `load` enables it again (weights kept apart)
        meta["lora"] = adapters
    if metrics:
        meta["metrics"] = metrics
    weights_tmp = os.path.join(directory, "tmp." + WEIGHTS_FILE)
    model.save_weights(weights_tmp, overwrite=True)
    # An earlier save's config does not describe these weights: removed first, a save
    # interrupted before its own config is written leaves no config (`load` says so) where
    # it left the old config over the new weights, loaded as a mixed model with nothing said.
    with contextlib.suppress(FileNotFoundError):
        os.remove(config_path)
    os.replace(weights_tmp, os.path.join(directory, WEIGHTS_FILE))
    checkpoints.write_tokenizer(directory, getattr(model, "tokenizer", None))
    checkpoints.write_json(config_path, meta, default=_json_default)
    write_model_card(model, directory, format=format, metrics=metrics)
    return directory


def _check_writable_directory(directory, name="directory"):
    """Refuse, before anything is written, a `directory` that cannot be made or written in
    (a path through a file, a read-only parent): it was an OSError (NotADirectoryError,
    PermissionError) from `os.makedirs` or halfway through the save."""
    parent = directory
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent.rstrip(os.sep))
    parent = parent or os.curdir
    why = None
    if not os.path.isdir(parent):
        why = f"{parent!r} is a file, not a directory"
    elif not os.access(parent, os.W_OK | os.X_OK):
        why = f"{parent!r} is not writable"
    else:  # (os.access says yes to root everywhere, and knows no read-only file system)
        try:
            with tempfile.TemporaryFile(dir=parent):
                pass
        except OSError as error:
            why = f"{parent!r} is not writable ({error.strerror or error})"
    if why:
        shown = f"`{name}`" if name.isidentifier() else name
        raise ValueError(
            f"{shown} must be a directory that can be made or written in; got "
            f"{name}={directory!r}: {why}."
        )


# Settings used in training (a plain batch without dropout gives the same outputs with them or
# without them) that the Hugging Face and keras-hub formats of some families have no field
# for, with the value that means "off".
_TRAINING_SETTINGS = {"layerdrop": 0.0, "packed_inputs": False}


def _warn_training_settings_dropped(model, what, written):
    """Warn, naming them, about the training settings of `model` that are on and that the
    exported config (`written`, the keys it holds) does not carry: the exported model gives the
    same outputs, but a run that trains it there goes without them."""
    backbone = getattr(model, "backbone", model)
    dropped = {name: getattr(backbone, name) for name, off in _TRAINING_SETTINGS.items()
               if name not in written and getattr(backbone, name, off) != off}
    if dropped:
        settings = ", ".join(f"{name}={value!r}" for name, value in dropped.items())
        warnings.warn(
            f"The {what} has no field for {settings}, written without it (used in training; "
            "a plain batch gives the same outputs): training the saved model there runs "
            "without it.", stacklevel=3)


MODEL_CARD = "README.md"


def _check_metrics(metrics):
    """`metrics` as a plain dict name -> float (or None), or a ValueError naming the bad
    entry."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(
            f"`metrics` must be a dict name -> number; got metrics={metrics!r} of type "
            f"{type(metrics).__name__}."
        )
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"`metrics` names must be non-empty strings; got {name!r}.")
        if value is not None:
            try:
                is_number = not isinstance(value, (bool, str)) and float(value) == float(value)
            except (TypeError, ValueError):
                is_number = False
            if not is_number:
                raise ValueError(
                    f"`metrics[{name!r}]` must be a number; got {value!r}."
                )
            value = float(value)
        checked[name] = value
    return checked


def _refuse_quantized(model, format):  # noqa: A002
    """A `ValueError` for a quantized `model` saved in another format than kzoo's own:
    transformers' and keras-hub's checkpoints hold float kernels, and the converters read
    each Dense layer's `kernel`, which after `model.quantize(...)` holds the integer codes
    (int8 values up to 127 were written as float weights, with nothing said)."""
    quantized = kzoo.quantize.quantization_map(model)
    if not quantized:
        return
    modes = sorted({str(policy).split("_from_")[0] for policy in quantized.values()})
    raise ValueError(
        f"`format={format!r}` writes float weights, and this model is quantized "
        f"({', '.join(modes)}: {len(quantized)} layers, e.g. {next(iter(quantized))!r}); "
        "its kernels hold integer codes, not weights. Save it with format='kzoo' (it loads "
        "back quantized), or save the float model before `model.quantize(...)`.")


def model_card(model, format="kzoo", metrics=None):  # noqa: A002
    """The model card (`README.md` text) of `model` saved in `format`: family, task, the
    configuration, parameter count, dtype and quantization, the kzoo / Keras versions, how
    to load it, and `metrics` when given.

    Example:
    >>> print(kzoo.presets.model_card(model, metrics={"val_loss": 2.31}))
    """
    family = registry.for_model(model)
    task, config, task_config = family.describe(model)
    metrics = _check_metrics(metrics)
    quantized = kzoo.quantize.quantization_map(model)
    modes = sorted({str(policy).split("_from_")[0] for policy in quantized.values()})
    library = "transformers" if format == "hf" else "keras"
    lines = [
        "---",
        f"library_name: {library}",
        f"tags: [kzoo, keras, {family.name}, {task}]",
        "---",
        "",
        f"# {model.name}",
        "",
        f"A kzoo {family.name} model ({task}), saved by `kzoo.presets.save` in the "
        f"{_FORMAT_NAMES[format]} format.",
        "",
        "| | |",
        "|---|---|",
        f"| family | {family.name} |",
        f"| task | {task} |",
        f"| parameters | {int(model.count_params()):,} |",
        f"| dtype | {model.dtype_policy.name} |",
        f"| quantization | {', '.join(f'{m} ({len(quantized)} layers)' for m in modes) if quantized else 'none'} |",
        f"| kzoo | {kzoo.__version__} |",
        f"| keras | {keras.__version__} ({keras.backend.backend()} backend) |",
        "",
        "## Configuration",
        "",
        "| field | value |",
        "|---|---|",
    ]
    lines += [f"| {key} | `{_card_value(value)}` |"
              for key, value in {**config, **task_config}.items()]
    if metrics:
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {'n/a' if value is None else f'{value:.6g}'} |"
                  for name, value in metrics.items()]
    lines += ["", "## How to load", "", "```python", "import kzoo", "",
              'model = kzoo.presets.load("path/to/this/directory")', "```"]
    if format == "hf":
        lines += ["", "With transformers:", "", "```python",
                  "from transformers import AutoModel", "",
                  'model = AutoModel.from_pretrained("path/to/this/directory")', "```"]
    if format == "keras_hub":
        lines += ["", "With keras-hub:", "", "```python", "import keras_hub", "",
                  'model = keras_hub.models.Backbone.from_preset("path/to/this/directory")',
                  "```"]
    return "\n".join(lines) + "\n"


_FORMAT_NAMES = {"kzoo": "kzoo", "hf": "Hugging Face", "keras_hub": "keras-hub preset"}


def _card_value(value):
    text = repr(value) if not isinstance(value, str) else value
    return text.replace("|", "\\|").replace("`", "'")


def write_model_card(model, directory, format="kzoo", metrics=None):  # noqa: A002
    """Write `model_card(model, format, metrics)` to `directory/README.md`.

    Example:
    >>> kzoo.presets.write_model_card(model, "runs/my_gpt", metrics={"val_loss": 2.31})
    """
    path = os.path.join(os.fspath(directory), MODEL_CARD)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(model_card(model, format=format, metrics=metrics))
    os.replace(tmp, path)
    return path


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _read_saved_config(path):
    """The checked contents of a saved directory's `kzoo_config.json`:
    (family, task, config, task config, weights path, quantization map, dtype policy name
    or None, LoRA settings or None)."""
    config_path = checkpoints.file_in(path, CONFIG_FILE, "saved kzoo config")
    meta = {"task": registry.BACKBONE_TASK, "task_config": {},
            **checkpoints.read_json(config_path, "saved kzoo config")}
    family = registry.check_spec(meta, repr(config_path))
    # Directories saved before the "weights" entry existed hold model.weights.h5.
    weights = checkpoints.file_in(path, meta.get("weights", WEIGHTS_FILE), "weights file")
    dtype = meta.get("dtype")
    if dtype is not None:
        try:
            registry.check_model_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"{config_path!r}: {e}") from None
    return (family, meta["task"], meta["config"], meta["task_config"], weights,
            meta.get("quantization") or {}, dtype, meta.get("lora"))


def _load_saved(path, task=None, weights=None, dtype=None, overrides=None):
    (family, saved_task, config, saved_task_config, weights_path, quantized, saved_dtype,
     adapters) = _read_saved_config(path)
    if dtype is None:  # the policy it was saved with (`dtype=` picks another)
        dtype = saved_dtype
    if weights is not False:
        checkpoints.require_file(weights_path, f"weights file named in {CONFIG_FILE}")
    source = os.path.join(path, CONFIG_FILE)
    model = _build(family, config, saved_task, saved_task_config, task=task, dtype=dtype,
                   overrides=overrides or {}, source=source)
    _attach_tokenizer(model, path)
    if weights is False:
        return model
    task = family.task_of(model)
    if task == saved_task:
        kzoo.quantize.apply_quantization(model, quantized, source)
        kzoo.lora.restore(model, adapters, repr(source))
        _read_keras_weights(model, weights_path, overrides)
    else:
        if adapters:
            raise ValueError(
                f"{path!r} was saved with LoRA adapters on quantized layers ({adapters}), "
                f"which load with its own task only; got task={task!r} (saved: "
                f"{saved_task!r}). Load it with its own task, or merge the adapters "
                "(`model.merge_lora()`) before saving it to load it with another.")
        # Another head on the saved backbone: load the saved model, copy its backbone.
        saved = family.build(config, task=saved_task, task_config=saved_task_config,
                             dtype=dtype, source=source)
        kzoo.quantize.apply_quantization(saved, quantized, source)
        kzoo.quantize.apply_quantization(_backbone(model, task), quantized, source,
                                         strict=False)
        _read_keras_weights(saved, weights_path)
        _backbone(model, task).set_weights(_backbone(saved, saved_task).get_weights())
        _warn_of_fresh_head(model, task, path)
    return model


def _backbone(model, task):
    return model if task == registry.BACKBONE_TASK else model.backbone


def _warn_of_fresh_head(model, task, path):
    """A task model whose head weights a checkpoint of another task did not hold (a
    backbone loaded as a masked LM, say) warns of them by name, as transformers does: they
    keep their initial values (the Hugging Face path names the checkpoint's missing
    tensors, `registry.Family.load_hf_weights`)."""
    if task == registry.BACKBONE_TASK:
        return
    loaded = {id(v) for v in model.backbone.weights}
    fresh = [v.path for v in model.weights if id(v) not in loaded]
    if fresh:
        registry.warn_fresh_weights(f"The checkpoint {path!r}", fresh, task)


def _load_keras_hub(path, task=None, dtype=None, overrides=None, weights=None):
    """The kzoo model of a keras-hub preset directory (`save_to_preset`), with its weights
    (`weights`: False none, a path those instead; see `load`)."""
    converter = registry.keras_hub_converter()
    family, config, hub_task, task_config = converter.read_preset(path, task=task)
    model = _build(registry.family(family), config, hub_task, task_config, task=task,
                   dtype=dtype, overrides=overrides or {},
                   source=os.path.join(path, "config.json"))
    if weights is None:
        with _naming_overrides(path, overrides):
            converter.load_weights(model, path)
        task = registry.family(family).task_of(model)
        if task != hub_task:  # (the preset's own head is read from task.weights.h5)
            _warn_of_fresh_head(model, task, path)
    elif weights is not False:
        _load_weights_into(model, weights, overrides)
    return model


def _load_hf(path, task=None, dtype=None, overrides=None, weights=None):
    """The kzoo model of a Hugging Face checkpoint directory, with its weights (`weights`:
    False none, a path those instead; see `load`) and tokenizer."""
    # `generate`'s defaults come from generation_config.json first, as in transformers
    hf_config = {**checkpoints.read_hf_config(path),
                 **checkpoints.read_hf_generation_config(path)}
    family = registry.for_model_type(hf_config["model_type"])
    _, config, hf_task, task_config = family.config_from_hf(
        hf_config, source=os.path.join(path, "config.json")
    )
    model = _build(family, config, hf_task, task_config, task=task, dtype=dtype,
                   overrides=overrides or {})
    # Another head than the checkpoint's: its head weights are left over, the new head's
    # are missing; only the backbone's must match.
    strict = family.task_of(model) == hf_task
    if weights is None:
        with _naming_overrides(path, overrides):
            family.load_hf_weights(model, checkpoints.read_hf_state(path), strict=strict)
    elif weights is not False:
        _load_weights_into(model, weights, overrides)
    _attach_tokenizer(model, path)
    return model


def _attach_tokenizer(model, path):
    """The directory's tokenizer (`tokenizer.json`, or a BERT / GPT-2 vocabulary) as
    `model.tokenizer`, which `generate` uses for text prompts; nothing when it has none."""
    tokenizer = checkpoints.load_tokenizer(path)
    if tokenizer is not None:
        model.tokenizer = tokenizer


__all__ = ["list", "info", "load", "save", "build", "load_keras_file", "model_card",
           "write_model_card"]
