"""keras-hub preset directories <-> kzoo models (BERT, GPT-2, ViT).

A keras-hub preset is the directory that `save_to_preset(dir)` of a keras-hub backbone or
task writes: `config.json` (the backbone, serialised by Keras: `module`, `class_name`,
`config`, `registered_name`), `metadata.json`, `model.weights.h5` (the backbone's weights in
Keras' HDF5 layout) and, for a task, `task.json` (the task's config, backbone included) and
`task.weights.h5` (the head's weights), besides the tokenizer / preprocessor files.

Reading needs no keras-hub: the JSON is mapped field by field to a kzoo family config, and
the HDF5 files are read with h5py, each dataset going to the kzoo variable it corresponds to
(`_weights`). Writing is the same table the other way: the JSON files and HDF5 files that
`keras_hub.models.<X>Backbone.from_preset(dir)` (and the task classes' `from_preset`) load.
keras-hub is a test extra, never imported here.

keras-hub backbone -> kzoo family (keras-hub task -> kzoo task):
- `BertBackbone` -> `bert` with activation "gelu_tanh" and layer norm epsilon 1e-12
  (`BertTextClassifier` -> "classifier");
- `GPT2Backbone` -> `gpt` in its GPT-2 configuration: learned positions, LayerNorm 1e-5,
  "gelu_tanh", tied head (`GPT2CausalLM` -> "causal_lm");
- `ViTBackbone` -> `vit` with activation "gelu" (`ViTImageClassifier` -> "classifier").

Numerics: keras-hub's BERT and GPT-2 use the tanh approximation of GELU (kzoo
"gelu_tanh"), ViT's MLP the exact one; BERT's epsilons are 1e-12, GPT-2's 1e-5, ViT's its
`layer_norm_epsilon`. Attention kernels `(hidden, heads, head_dim)` and output kernels
`(heads, head_dim, hidden)` are kzoo's `(hidden, hidden)` Dense kernels reshaped (heads
major). A keras-hub ViT without some biases (`use_mha_bias`, `use_mlp_bias`,
`use_patch_bias` False) loads with those kzoo biases at zero (the same function); it is
exported back only while they are still zero.

What kzoo cannot express raises `ValueError` naming the field, its value and what is
allowed: an unknown backbone or task class, a config field kzoo does not know (e.g. from a
newer keras-hub), `ViTImageClassifier(pooling="gap")` on a class-token backbone (keras-hub
averages the class token too; kzoo's "mean" pooling leaves it out), its `intermediate_dim`
or an output `activation`, a quantized or sharded preset. keras-hub's `BertMaskedLM` head
uses exact GELU and a LayerNorm epsilon of 1e-5 while its backbone uses tanh-GELU and 1e-12;
kzoo's `BertMaskedLM` head uses the backbone's two, so such a preset loads only as
`task="backbone"` or `task="classifier"` (the backbone is exact), and a kzoo `BertMaskedLM`
is not exported (save its `.backbone`). Tokenizers and preprocessors are not converted.

A ViT preset loads at another image size too (`load(path, image_size=384)`): its position
table is resampled bicubically, as `kzoo.models.vit` does for other inputs.

Example:
>>> model = kzoo.presets.load("/path/to/keras_hub_preset")         # e.g. a GPT2CausalLM
>>> kzoo.presets.save(model, "/tmp/hub_preset", format="keras_hub")
>>> # keras_hub.models.GPT2CausalLM.from_preset("/tmp/hub_preset") gives the same logits
"""

import dataclasses
import datetime
import importlib.metadata
import math
import os
import warnings

import h5py
import keras
import numpy as np

import kzoo
from kzoo import checkpoints, registry
from kzoo.layers.utils import check_int_pair
from kzoo.models.bert import BertConfig
from kzoo.models.gpt import GPTConfig
from kzoo.models.vit import ViTConfig, resample_position_grid

CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
TASK_FILE = "task.json"
WEIGHTS_FILE = "model.weights.h5"
TASK_WEIGHTS_FILE = "task.weights.h5"
SHARDED_WEIGHTS_FILE = "model.weights.json"
# Packages whose serialised classes a keras-hub preset names (keras-nlp: keras-hub's old name).
MODULES = ("keras_hub", "keras_nlp")
# Keras' own entries of a serialised config.
_KERAS_KEYS = ("name", "trainable", "dtype")
_TANH_GELU = ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh")


def _hub(module, class_name):
    """The serialised class reference keras-hub writes for `module.class_name`."""
    return {"module": f"keras_hub.src.models.{module}", "class_name": class_name,
            "registered_name": f"keras_hub>{class_name}"}


# === Detection and reading ===


def is_preset(path):
    """True when `path` is a keras-hub preset directory: a `config.json` naming a keras-hub
    (or keras-nlp) class with `module` and `registered_name`, and a `metadata.json`.

    Example:
    >>> is_preset("/tmp/bert_preset")   # written by keras_hub's save_to_preset
    True
    """
    path = os.fspath(path)
    config_path = checkpoints.file_in(path, CONFIG_FILE, "keras-hub config")
    metadata_path = checkpoints.file_in(path, METADATA_FILE, "keras-hub metadata")
    if not (os.path.isdir(path) and os.path.isfile(config_path)
            and os.path.isfile(metadata_path)):
        return False
    config = checkpoints.read_json(config_path, "keras-hub config")
    module = config.get("module")
    return ("registered_name" in config and isinstance(module, str)
            and module.split(".")[0] in MODULES)


def _read_object(path, name, what):
    """A serialised Keras object of the preset (`config.json`, `task.json`), checked."""
    file = checkpoints.file_in(path, name, what)
    data = checkpoints.read_json(file, what)
    for key in ("class_name", "config"):
        if key not in data:
            raise ValueError(f"The {what} {file!r} has no {key!r} entry; is it a keras-hub "
                             "preset written by save_to_preset?")
    if not isinstance(data["config"], dict):
        raise ValueError(f"The {what} {file!r}: `config` must be a JSON object; got "
                         f"{data['config']!r}.")
    return data, file


def _check_dtype(config, source):
    """Refuse quantized presets (a `DTypePolicyMap` or a quantized policy)."""
    dtype = config.get("dtype")
    if isinstance(dtype, dict):
        name = dtype.get("config", {}).get("name")
        if dtype.get("class_name") != "DTypePolicy" or not isinstance(name, str) or \
                name.startswith(("int", "float8")):
            raise ValueError(
                f"In {source}: dtype={dtype!r} is not supported; kzoo reads keras-hub presets "
                "saved with a float DTypePolicy (float32, float16, bfloat16, mixed_*), not "
                "quantized ones."
            )


def read_preset(path, task=None):
    """`(family, backbone_config, task, task_config)` of a keras-hub preset directory.

    The task is the preset's own (from `task.json`: `BertTextClassifier` -> "classifier",
    `GPT2CausalLM` -> "causal_lm", `ViTImageClassifier` -> "classifier"), "backbone" for a
    backbone preset. `task` is the task the caller will build (None: the preset's own); it
    decides only whether a head kzoo cannot express is an error.

    Example:
    >>> read_preset("/tmp/gpt2_preset")
    ('gpt', {'vocabulary_size': 50257, ...}, 'causal_lm', {})
    """
    path = os.fspath(path)
    backbone_json, config_file = _read_object(path, CONFIG_FILE, "keras-hub config")
    spec = _spec_of_class(backbone_json["class_name"], config_file)
    _check_dtype(backbone_json["config"], config_file)
    config = spec.config_to_kzoo(backbone_json["config"], config_file)
    task_file = checkpoints.file_in(path, TASK_FILE, "keras-hub task config")
    if not os.path.isfile(task_file):
        return spec.family, config, registry.BACKBONE_TASK, {}
    task_json, task_file = _read_object(path, TASK_FILE, "keras-hub task config")
    task_class = task_json["class_name"]
    if task_class in spec.refused_tasks:
        if task in (None, spec.refused_tasks[task_class][0]):
            raise ValueError(
                f"The preset {path!r} is a keras-hub {task_class}: "
                f"{spec.refused_tasks[task_class][1]}"
            )
        return spec.family, config, registry.BACKBONE_TASK, {}
    if task_class not in spec.tasks:
        raise ValueError(
            f"Unsupported keras-hub task class_name={task_class!r} in {task_file!r} for a "
            f"{spec.hub_class}; kzoo reads {sorted(spec.tasks)} (or the backbone alone: load "
            "with task='backbone')."
        )
    task_spec = spec.tasks[task_class]
    task_config = dict(task_json["config"])
    nested = task_config.pop("backbone", None)
    if isinstance(nested, dict) and isinstance(nested.get("config"), dict):
        if spec.config_to_kzoo(nested["config"], task_file) != config:
            raise ValueError(
                f"The backbone in {task_file!r} differs from the one in {config_file!r}; "
                "the preset is inconsistent."
            )
    task_config.pop("preprocessor", None)
    for key in _KERAS_KEYS:
        task_config.pop(key, None)
    return spec.family, config, task_spec.kzoo_task, task_spec.to_kzoo(task_config, task_file,
                                                                        config)


def load_weights(model, path):
    """Assign the weights of the keras-hub preset at `path` to the kzoo `model` (built from
    `read_preset`): the backbone's always, the head's (`task.weights.h5`) when `model` is
    the preset's own task. Every dataset of the files must find its variable, and the
    reverse; a shape that differs raises `ValueError` naming the dataset and both shapes.

    Example:
    >>> family, config, task, task_config = read_preset(path)
    >>> model = kzoo.presets.build(family, config, task, task_config)
    >>> load_weights(model, path)
    """
    path = os.fspath(path)
    family = registry.for_model(model)
    backbone_json, config_file = _read_object(path, CONFIG_FILE, "keras-hub config")
    spec = _spec_of_class(backbone_json["class_name"], config_file)
    if spec.family != family.name:
        raise ValueError(
            f"The preset {path!r} holds a keras-hub {spec.hub_class} (kzoo family "
            f"{spec.family!r}); got a {family.name!r} model ({type(model).__name__})."
        )
    task = family.task_of(model)
    backbone = model if task == registry.BACKBONE_TASK else model.backbone
    weights_file = checkpoints.file_in(path, WEIGHTS_FILE, "keras-hub weights")
    if not os.path.isfile(weights_file):
        sharded = checkpoints.file_in(path, SHARDED_WEIGHTS_FILE, "keras-hub weights index")
        if os.path.isfile(sharded):
            raise ValueError(
                f"The preset {path!r} holds sharded weights ({SHARDED_WEIGHTS_FILE}); kzoo "
                f"reads keras-hub presets with one {WEIGHTS_FILE}."
            )
        checkpoints.require_file(weights_file, "keras-hub weights file")
    _read_into(weights_file, spec.weights(backbone, backbone_json["config"]))
    _, _, preset_task, _ = read_preset(path, task=task)
    if task != registry.BACKBONE_TASK and task == preset_task:
        head = _task_spec(spec, task).head(model)
        if head:
            task_weights = checkpoints.require_file(
                checkpoints.file_in(path, TASK_WEIGHTS_FILE, "keras-hub task weights"),
                "keras-hub task weights file")
            _read_into(task_weights, head)


# === Writing ===


def save(model, directory):
    """Write `model` (a kzoo BERT, GPT-2 or ViT backbone or task model) as a keras-hub preset
    directory that `keras_hub.models.<X>.from_preset(directory)` loads with the same outputs.

    A backbone writes `config.json`, `metadata.json` and `model.weights.h5`; a task model
    adds `task.json` (and `task.weights.h5` when its head has weights). Fields keras-hub
    cannot express (e.g. an efficient attention type, RMSNorm, an activation other than
    keras-hub's) raise `ValueError` naming them. Files are written to temporary names and
    renamed; a task file of an earlier save that this model does not write is removed.

    Example:
    >>> save(kzoo.presets.load("gpt_mini"), "/tmp/gpt_mini_hub")
    """
    family = registry.for_model(model)
    if family.name not in _SPECS_BY_FAMILY:
        raise ValueError(
            f"kzoo writes keras-hub presets of the families {sorted(_SPECS_BY_FAMILY)}; got a "
            f"{family.name!r} model ({type(model).__name__})."
        )
    spec = _SPECS_BY_FAMILY[family.name]
    task = family.task_of(model)
    backbone = model if task == registry.BACKBONE_TASK else model.backbone
    task_spec = None
    if task != registry.BACKBONE_TASK:
        refused = [reason for kzoo_task, reason in spec.refused_tasks.values()
                   if kzoo_task == task]
        if refused:
            raise ValueError(
                f"A kzoo {type(model).__name__} cannot be written as a keras-hub task: "
                f"{refused[0]} Save `model.backbone` instead."
            )
        task_spec = _task_spec(spec, task)
    backbone_json = {**_hub(spec.module, spec.hub_class),
                     "config": {"name": spec.default_name, "trainable": True,
                                "dtype": _dtype_config(backbone),
                                **spec.config_from_kzoo(backbone)}}
    backbone_weights = spec.weights(backbone)
    head_weights = task_spec.head(model) if task_spec else []
    for weight in backbone_weights + head_weights:  # refuse before writing anything
        weight.hub_value()
    os.makedirs(directory, exist_ok=True)
    if task_spec is not None:
        task_json = {**_hub(task_spec.module, task_spec.hub_class),
                     "config": {"backbone": backbone_json, "preprocessor": None,
                                "name": task_spec.default_name,
                                **task_spec.from_kzoo(model)}}
        checkpoints.write_json(os.path.join(directory, TASK_FILE), task_json)
        if head_weights:
            _write_h5(os.path.join(directory, TASK_WEIGHTS_FILE), head_weights)
    written = {TASK_FILE: task_spec is not None, TASK_WEIGHTS_FILE: bool(head_weights)}
    for name, was_written in written.items():
        stale = os.path.join(directory, name)  # from an earlier save of a task model
        if not was_written and os.path.isfile(stale):
            os.remove(stale)
    _write_h5(os.path.join(directory, WEIGHTS_FILE), backbone_weights)
    checkpoints.write_json(os.path.join(directory, CONFIG_FILE), backbone_json)
    checkpoints.write_json(os.path.join(directory, METADATA_FILE), {
        "keras_version": keras.__version__,
        "keras_hub_version": _keras_hub_version(),
        "parameter_count": int(backbone.count_params()),
        "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
        "tasks": list(spec.hub_tasks),
        "saved_by": f"kzoo {kzoo.__version__}",
    })
    return directory


def _keras_hub_version():
    """The installed keras-hub's version (package metadata only; nothing is imported)."""
    try:
        return importlib.metadata.version("keras-hub")
    except importlib.metadata.PackageNotFoundError:
        return None


def _dtype_config(model):
    return {"module": "keras", "class_name": "DTypePolicy",
            "config": {"name": model.dtype_policy.name}, "registered_name": None}


# === Weights: one table, read and written ===


@dataclasses.dataclass
class _Weight:
    """One kzoo variable and its keras-hub dataset (`path`, e.g.
    "layers/dense/vars/0", with the keras-hub shape), or `path=None` for a kzoo variable
    keras-hub's model lacks (a bias it does not have): it loads as zeros and is written
    only while it is zero."""

    path: str | None
    variable: object
    hub_shape: tuple = ()
    absent_because: str = ""
    # Reading only: a function turning the file's array into the variable's value (ViT's
    # position table, resampled when the kzoo model is built for another image size).
    resample: object = None

    def hub_value(self):
        value = np.asarray(keras.ops.convert_to_numpy(
            keras.ops.cast(self.variable, "float32")))
        if self.path is None:
            if np.any(value != 0):
                raise ValueError(
                    f"The variable {self.variable.path!r} is not zero, but keras-hub's model "
                    f"has no such weight ({self.absent_because}); it can be written only "
                    "while it is zero."
                )
            return None
        return value.reshape(self.hub_shape)


def _read_h5(file):
    """{dataset path: float32 array} of a Keras `.weights.h5` file (the optimizer's entries
    of a task weights file are left out: kzoo loads weights, not training state)."""
    import ml_dtypes  # a Keras dependency

    datasets = {}

    def visit(name, node):
        if isinstance(node, h5py.Dataset) and not name.startswith("optimizer/"):
            if node.attrs.get("dtype") == "bfloat16":
                value = np.array(node, dtype=ml_dtypes.bfloat16)
            else:
                value = np.asarray(node)
            datasets[name] = value.astype(np.float32)

    try:
        with h5py.File(file, "r") as f:
            f.visititems(visit)
    except OSError as e:
        raise ValueError(f"The keras-hub weights file {file!r} cannot be read (not HDF5, or "
                         f"truncated): {e}") from e
    return datasets


def _read_into(file, weights):
    datasets = _read_h5(file)
    for weight in weights:
        variable = weight.variable
        if weight.path is None:
            variable.assign(np.zeros(tuple(variable.shape), "float32"))
            continue
        if weight.path not in datasets:
            raise ValueError(
                f"The keras-hub weights file {file!r} has no dataset {weight.path!r} (for "
                f"{variable.path!r}); it holds {sorted(datasets)}."
            )
        value = datasets.pop(weight.path)
        if weight.resample is not None:
            value = weight.resample(value)
        elif value.shape != tuple(weight.hub_shape):
            raise ValueError(
                f"Shape mismatch for {weight.path!r} in {file!r}: the file has "
                f"{value.shape}, the model needs {tuple(weight.hub_shape)} (for "
                f"{variable.path!r})."
            )
        variable.assign(value.reshape(tuple(variable.shape)))
    if datasets:
        raise ValueError(
            f"The keras-hub weights file {file!r} has weights kzoo's model does not: "
            f"{sorted(datasets)}."
        )


def _write_h5(file, weights):
    tmp = file + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.create_group("vars")  # the model's own (none), as Keras writes it
        for weight in weights:
            value = weight.hub_value()
            if value is None:
                continue
            group, _, index = weight.path.rpartition("/")
            f.require_group(group).create_dataset(index, data=value)
    os.replace(tmp, file)


def _layer(name, i):
    """Keras' name of the i-th tracked layer of a class: `name`, `name_1`, `name_2`, ..."""
    return name if i == 0 else f"{name}_{i}"


def _dense(weights, path, layer, hub_kernel, hub_bias=None):
    weights.append(_Weight(path + "/vars/0", layer.kernel, hub_kernel))
    if hub_bias is not None:
        weights.append(_Weight(path + "/vars/1", layer.bias, hub_bias))


def _norm(weights, path, layer):
    d = tuple(layer.gamma.shape)
    weights.append(_Weight(path + "/vars/0", layer.gamma, d))
    weights.append(_Weight(path + "/vars/1", layer.beta, d))


def _attention(weights, path, attention, hidden, heads, bias=True, no_bias_reason=""):
    """q/k/v EinsumDense kernels `(hidden, heads, head_dim)`, biases `(heads, head_dim)`,
    output kernel `(heads, head_dim, hidden)`; kzoo's Dense kernels are the same reshaped."""
    head_dim = hidden // heads
    for name in ("query", "key", "value"):
        dense = getattr(attention, f"{name}_dense")
        _dense(weights, f"{path}/{name}_dense", dense, (hidden, heads, head_dim),
               (heads, head_dim) if bias else None)
    out = attention.output_dense
    _dense(weights, f"{path}/output_dense", out, (heads, head_dim, hidden),
           (hidden,) if bias else None)
    if not bias:
        weights.append(_Weight(None, out.bias, absent_because=no_bias_reason))


def _feedforward(weights, path_in, path_out, ff, hidden, intermediate, bias=True,
                 no_bias_reason=""):
    for path, dense, shape in ((path_in, ff.intermediate_dense, (hidden, intermediate)),
                               (path_out, ff.output_dense, (intermediate, hidden))):
        _dense(weights, path, dense, shape, (shape[1],) if bias else None)
        if not bias:
            weights.append(_Weight(None, dense.bias, absent_because=no_bias_reason))


# === Families ===


def _unknown_fields(config, known, source, hub_class):
    unknown = sorted(set(config) - set(known) - set(_KERAS_KEYS))
    if unknown:
        raise ValueError(
            f"In {source}: {hub_class} field(s) {unknown} (values "
            f"{[config[k] for k in unknown]}) are not supported by kzoo; it reads "
            f"{sorted(known)}."
        )


def _require(field, value, allowed, what):
    """ValueError unless `value` is one of `allowed` (a kzoo field keras-hub can't vary)."""
    if value not in allowed:
        raise ValueError(
            f"{what}: {field}={value!r} has no keras-hub equivalent; allowed: "
            f"{list(allowed)}."
        )


def _require_full_attention(backbone, what):
    _require("attention", backbone.attention, ("full",), what)


@dataclasses.dataclass(frozen=True)
class _Task:
    """A keras-hub task class and the kzoo task it is."""

    hub_class: str
    module: str
    default_name: str
    kzoo_task: str
    to_kzoo: object  # (hub task config, source, backbone config) -> kzoo task config
    from_kzoo: object  # kzoo task model -> hub task config entries
    head: object  # kzoo task model -> list of _Weight (task.weights.h5)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one keras-hub backbone class maps to a kzoo family."""

    hub_class: str
    module: str
    default_name: str
    family: str
    config_to_kzoo: object  # (hub config, source) -> kzoo backbone config (validated)
    config_from_kzoo: object  # kzoo backbone -> hub config entries
    weights: object  # kzoo backbone -> list of _Weight (model.weights.h5)
    tasks: dict  # hub task class -> _Task
    hub_tasks: tuple = ()  # metadata.json "tasks" (keras-hub's task base classes)
    # hub task class -> (kzoo task, why kzoo's task model cannot be that class).
    refused_tasks: dict = dataclasses.field(default_factory=dict)


def _task_spec(spec, kzoo_task):
    for task in spec.tasks.values():
        if task.kzoo_task == kzoo_task:
            return task
    raise ValueError(
        f"kzoo's {spec.family} task {kzoo_task!r} has no keras-hub task class; writable: "
        f"{sorted(t.kzoo_task for t in spec.tasks.values())} or the backbone."
    )


def _validated(config_class, config, source, names):
    checked = config_class.from_dict(config, source=source, names=names)
    return {key: getattr(checked, key) for key in config}


def _linear_activation(config, source, hub_class):
    activation = config.pop("activation", None)
    if activation not in (None, "linear"):
        raise ValueError(
            f"In {source}: {hub_class} activation={activation!r} is not supported; kzoo's "
            "task models return logits (allowed: None or 'linear')."
        )


# --- BERT ---

_BERT_FIELDS = ("vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim",
                "dropout", "max_sequence_length", "num_segments")
_BERT_EPSILON = 1e-12


def _bert_to_kzoo(hub, source):
    _unknown_fields(hub, _BERT_FIELDS, source, "BertBackbone")
    config = {key: hub[key] for key in _BERT_FIELDS if key in hub}
    config.update(activation="gelu_tanh", layer_norm_epsilon=_BERT_EPSILON)
    return _validated(BertConfig, config, source, None)


def _bert_from_kzoo(backbone):
    what = "keras-hub's BertBackbone"
    _require("activation", backbone.activation, _TANH_GELU, what)
    _require("layer_norm_epsilon", backbone.layer_norm_epsilon, (_BERT_EPSILON,), what)
    _require("position_padding_id", backbone.position_padding_id, (None,), what)
    if backbone.attention_dropout not in (None, backbone.dropout):
        warnings.warn(
            f"{what} has one dropout rate: attention_dropout={backbone.attention_dropout} is "
            f"written as dropout={backbone.dropout} (inference is unaffected).", stacklevel=3)
    _require_full_attention(backbone, what)
    return {key: getattr(backbone, key) for key in _BERT_FIELDS}


def _bert_weights(backbone, hub_config=None):
    hidden, heads = backbone.hidden_dim, backbone.num_heads
    inter = backbone.intermediate_dim
    w = [
        _Weight("layers/reversible_embedding/vars/0", backbone.token_embedding.embeddings,
                (backbone.vocabulary_size, hidden)),
        _Weight("layers/position_embedding/vars/0", backbone.position_embedding.embeddings,
                (backbone.max_sequence_length, hidden)),
        _Weight("layers/embedding/vars/0", backbone.segment_embedding.embeddings,
                (backbone.num_segments, hidden)),
    ]
    _norm(w, "layers/layer_normalization", backbone.embeddings_layer_norm)
    for i, block in enumerate(backbone.transformer_layers):
        p = "layers/" + _layer("transformer_encoder", i)
        _attention(w, p + "/_self_attention_layer", block.self_attention, hidden, heads)
        _norm(w, p + "/_self_attention_layer_norm", block.self_attention_norm)
        _feedforward(w, p + "/_feedforward_intermediate_dense",
                     p + "/_feedforward_output_dense", block.feedforward_layer, hidden, inter)
        _norm(w, p + "/_feedforward_layer_norm", block.feedforward_norm)
    _dense(w, "layers/dense", backbone.pooler_dense, (hidden, hidden), (hidden,))
    return w


def _bert_classifier_to_kzoo(config, source, backbone_config):
    _linear_activation(config, source, "BertTextClassifier")
    _unknown_fields(config, ("num_classes", "dropout"), source, "BertTextClassifier")
    return {"num_classes": config.get("num_classes"), "dropout": config.get("dropout", 0.1)}


def _bert_classifier_head(model):
    hidden = model.backbone.hidden_dim
    w = []
    _dense(w, "layers/dense", model.classifier_dense, (hidden, model.num_classes),
           (model.num_classes,))
    return w


_BERT_MLM_REFUSED = (
    "its head uses exact GELU and a LayerNorm epsilon of 1e-5 while its backbone uses "
    "tanh-GELU and 1e-12, and kzoo's BertMaskedLM head uses the backbone's activation and "
    "epsilon, so the logits would differ. Load it with task='backbone' (or "
    "task='classifier'): the backbone loads exactly."
)

_BERT = _Spec(
    hub_class="BertBackbone", module="bert.bert_backbone", default_name="bert_backbone",
    family="bert", config_to_kzoo=_bert_to_kzoo, config_from_kzoo=_bert_from_kzoo,
    weights=_bert_weights,
    tasks={"BertTextClassifier": _Task(
        "BertTextClassifier", "bert.bert_text_classifier", "bert_text_classifier",
        "classifier", _bert_classifier_to_kzoo,
        lambda m: {"num_classes": m.num_classes, "activation": "linear",
                   "dropout": m.dropout},
        _bert_classifier_head)},
    hub_tasks=("MaskedLM", "TextClassifier", "TextEmbedder"),
    refused_tasks={"BertMaskedLM": ("masked_lm", _BERT_MLM_REFUSED)},
)

# --- GPT-2 ---

_GPT2_FIELDS = ("vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim",
                "dropout", "max_sequence_length")
_GPT2_EPSILON = 1e-5


def _gpt2_to_kzoo(hub, source):
    _unknown_fields(hub, _GPT2_FIELDS, source, "GPT2Backbone")
    config = {key: hub[key] for key in _GPT2_FIELDS if key in hub}
    config.update(layer_norm_epsilon=_GPT2_EPSILON, activation="gelu_tanh", norm="layernorm",
                  position="learned", feedforward="plain", use_bias=True, tie_embeddings=True)
    return _validated(GPTConfig, config, source, None)


def _gpt2_from_kzoo(backbone):
    what = "keras-hub's GPT2Backbone"
    _require("activation", backbone.activation, _TANH_GELU, what)
    _require("layer_norm_epsilon", backbone.layer_norm_epsilon, (_GPT2_EPSILON,), what)
    _require("norm", backbone.norm, ("layernorm",), what)
    _require("position", backbone.position, ("learned",), what)
    _require("feedforward", backbone.feedforward, ("plain",), what)
    _require("num_kv_heads", backbone.num_kv_heads, (None, backbone.num_heads), what)
    _require("use_bias", backbone.use_bias, (True,), what)
    _require("tie_embeddings", backbone.tie_embeddings, (True,), what)
    head_dim = backbone.hidden_dim // backbone.num_heads
    # (keras-hub's heads split the width: a head size of its own failed in a reshape)
    _require("head_dim", getattr(backbone, "head_dim", None), (None, head_dim), what)
    scale = backbone.attention_scale
    if scale is not None and math.isclose(scale, 1 / math.sqrt(head_dim), rel_tol=1e-12):
        scale = None  # e.g. head_dim ** -0.5, which can differ from 1 / sqrt in the last bit
    _require("attention_scale", scale, (None, 1 / math.sqrt(head_dim)), what)
    _require("attention_scale_by_inverse_layer", backbone.attention_scale_by_inverse_layer,
             (False,), what)
    _require_full_attention(backbone, what)
    return {key: getattr(backbone, key) for key in _GPT2_FIELDS}


def _gpt2_weights(backbone, hub_config=None):
    hidden, heads = backbone.hidden_dim, backbone.num_heads
    inter = backbone.intermediate_dim
    w = [
        _Weight("layers/reversible_embedding/vars/0", backbone.token_embedding.embeddings,
                (backbone.vocabulary_size, hidden)),
        _Weight("layers/position_embedding/vars/0", backbone.position_embedding.embeddings,
                (backbone.max_sequence_length, hidden)),
    ]
    for i, block in enumerate(backbone.transformer_layers):
        p = "layers/" + _layer("transformer_decoder", i)
        _attention(w, p + "/_self_attention_layer", block.self_attention, hidden, heads)
        _norm(w, p + "/_self_attention_layer_norm", block.self_attention_norm)
        _feedforward(w, p + "/_feedforward_intermediate_dense",
                     p + "/_feedforward_output_dense", block.feedforward_layer, hidden, inter)
        _norm(w, p + "/_feedforward_layer_norm", block.feedforward_norm)
    _norm(w, "layers/layer_normalization", backbone.final_norm)
    return w


def _gpt2_lm_to_kzoo(config, source, backbone_config):
    _unknown_fields(config, (), source, "GPT2CausalLM")
    return {}


_GPT2 = _Spec(
    hub_class="GPT2Backbone", module="gpt2.gpt2_backbone", default_name="gpt2_backbone",
    family="gpt", config_to_kzoo=_gpt2_to_kzoo, config_from_kzoo=_gpt2_from_kzoo,
    weights=_gpt2_weights,
    tasks={"GPT2CausalLM": _Task("GPT2CausalLM", "gpt2.gpt2_causal_lm", "gpt2_causal_lm",
                                 "causal_lm", _gpt2_lm_to_kzoo, lambda m: {},
                                 lambda m: [])},  # the head is the tied embedding
    hub_tasks=("CausalLM",),
)

# --- ViT ---

_VIT_FIELDS = ("image_shape", "patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim",
               "dropout_rate", "attention_dropout", "layer_norm_epsilon", "use_mha_bias",
               "use_mlp_bias", "use_class_token", "use_patch_bias")


def _pair(value):
    """keras-hub's `(h, w)` as kzoo writes it: an int when square, else a list."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        return value[0]
    return list(value) if isinstance(value, (list, tuple)) else value


def _vit_to_kzoo(hub, source):
    _unknown_fields(hub, _VIT_FIELDS, source, "ViTBackbone")
    for key in ("image_shape", "patch_size", "num_layers", "num_heads", "hidden_dim",
                "mlp_dim"):
        if key not in hub:
            raise ValueError(f"In {source}: the ViTBackbone config has no {key!r}.")
    shape = hub["image_shape"]
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3):
        raise ValueError(
            f"In {source}: ViTBackbone image_shape={shape!r} must be (height, width, "
            "channels) (kzoo takes channels-last images)."
        )
    patch = hub["patch_size"]
    config = {
        "image_size": _pair(shape[:2]),
        "patch_size": _pair(patch if isinstance(patch, (list, tuple)) else [patch, patch]),
        "num_channels": shape[2],
        "num_layers": hub["num_layers"],
        "num_heads": hub["num_heads"],
        "hidden_dim": hub["hidden_dim"],
        "intermediate_dim": hub["mlp_dim"],
        "dropout": hub.get("dropout_rate", 0.0),
        "attention_dropout": hub.get("attention_dropout", 0.0),
        "layer_norm_epsilon": hub.get("layer_norm_epsilon", 1e-6),
        "activation": "gelu",
        "use_class_token": hub.get("use_class_token", True),
        "qkv_bias": hub.get("use_mha_bias", True),
    }
    names = {"image_size": "image_shape", "num_channels": "image_shape",
             "intermediate_dim": "mlp_dim", "dropout": "dropout_rate",
             "qkv_bias": "use_mha_bias"}
    config = _validated(ViTConfig, config, source, names)
    for key in ("use_mlp_bias", "use_patch_bias"):
        value = hub.get(key, True)
        if not isinstance(value, bool):
            raise ValueError(f"In {source}: ViTBackbone {key}={value!r} must be a bool.")
    return config


def _vit_from_kzoo(backbone):
    what = "keras-hub's ViTBackbone"
    _require("activation", backbone.activation, ("gelu",), what)
    _require_full_attention(backbone, what)
    image = check_int_pair("image_size", backbone.image_size)
    patch = check_int_pair("patch_size", backbone.patch_size)
    return {
        "image_shape": [image[0], image[1], backbone.num_channels],
        "patch_size": [patch[0], patch[1]],
        "num_layers": backbone.num_layers,
        "num_heads": backbone.num_heads,
        "hidden_dim": backbone.hidden_dim,
        "mlp_dim": backbone.intermediate_dim,
        "dropout_rate": backbone.dropout,
        "attention_dropout": backbone.attention_dropout,
        "layer_norm_epsilon": backbone.layer_norm_epsilon,
        "use_mha_bias": backbone.qkv_bias,
        "use_mlp_bias": True,
        "use_class_token": backbone.use_class_token,
        "use_patch_bias": True,
    }


def _vit_weights(backbone, hub_config=None):
    """The table for a ViT backbone; the biases are those of the preset's config
    (`hub_config`, when reading), else those `_vit_from_kzoo` writes."""
    if hub_config is None:
        mha_bias, mlp_bias, patch_bias = backbone.qkv_bias, True, True
    else:
        mha_bias, mlp_bias, patch_bias = (hub_config.get(k, True) for k in (
            "use_mha_bias", "use_mlp_bias", "use_patch_bias"))
    hidden, heads = backbone.hidden_dim, backbone.num_heads
    inter = backbone.intermediate_dim
    emb = backbone.embedding
    conv = emb.patch_embedding.projection
    p = "layers/vi_t_patching_and_embedding"
    w = [_Weight(f"{p}/patch_embedding/vars/0", conv.kernel, tuple(conv.kernel.shape))]
    if patch_bias:
        w.append(_Weight(f"{p}/patch_embedding/vars/1", conv.bias, (hidden,)))
    else:
        w.append(_Weight(None, conv.bias, absent_because="use_patch_bias=False"))
    w.append(_Weight(f"{p}/position_embedding/vars/0", emb.position_embedding,
                     (emb.num_positions, hidden),
                     resample=None if hub_config is None else _position_resampler(
                         emb, hub_config)))
    if backbone.use_class_token:
        w.append(_Weight(f"{p}/vars/0", emb.class_token, (1, 1, hidden)))
    for i, block in enumerate(backbone.encoder_layers):
        b = "layers/vi_t_encoder/encoder_layers/" + _layer("vi_t_encoder_block", i)
        _norm(w, b + "/layer_norm_1", block.self_attention_norm)
        _attention(w, b + "/mha", block.self_attention, hidden, heads, bias=mha_bias,
                   no_bias_reason="use_mha_bias=False")
        _norm(w, b + "/layer_norm_2", block.feedforward_norm)
        _feedforward(w, b + "/mlp/dense_1", b + "/mlp/dense_2", block.feedforward_layer,
                     hidden, inter, bias=mlp_bias, no_bias_reason="use_mlp_bias=False")
    _norm(w, "layers/vi_t_encoder/layer_norm", backbone.final_norm)
    return w


def _position_resampler(embedding, hub_config):
    """Reads the preset's position table, resampled bicubically (as `ViTEmbedding` does for
    other inputs) when the kzoo model is built for another image size than the preset's."""
    image = check_int_pair("image_shape", list(hub_config["image_shape"][:2]))
    patch = hub_config["patch_size"]
    patch = check_int_pair("patch_size", patch if isinstance(patch, (list, tuple)) else patch)
    grid = (image[0] // patch[0], image[1] // patch[1])
    prefix, hidden = embedding.num_prefix, embedding.hidden_dim

    def resample(table):
        expected = (prefix + grid[0] * grid[1], hidden)
        if table.shape != expected:
            raise ValueError(
                f"The preset's position table has shape {table.shape}; its config "
                f"(image_shape={hub_config['image_shape']}, "
                f"patch_size={hub_config['patch_size']}) needs {expected}."
            )
        if tuple(grid) == tuple(embedding.grid):
            return table
        patches = resample_position_grid(table[prefix:].reshape(*grid, hidden), embedding.grid)
        return np.concatenate([table[:prefix], patches.reshape(-1, hidden)], axis=0)

    return resample


def _vit_classifier_to_kzoo(config, source, backbone_config):
    _linear_activation(config, source, "ViTImageClassifier")
    _unknown_fields(config, ("num_classes", "pooling", "dropout", "intermediate_dim"), source,
                    "ViTImageClassifier")
    if config.get("intermediate_dim") is not None:
        raise ValueError(
            f"In {source}: ViTImageClassifier intermediate_dim={config['intermediate_dim']!r} "
            "(a tanh pre-logits layer) is not supported by kzoo's ViTClassifier; allowed: "
            "None."
        )
    pooling = config.get("pooling", "token")
    if pooling == "gap" and not backbone_config["use_class_token"]:
        pooling = "mean"  # no class token: both average the patch tokens
    elif pooling == "token" and not backbone_config["use_class_token"]:
        # (was refused by ViTClassifier's constructor, which suggested pooling='mean')
        raise ValueError(
            f"In {source}: ViTImageClassifier pooling='token' on a backbone with "
            "use_class_token=False (keras-hub then classifies the first patch token) is not "
            "supported by kzoo's ViTClassifier; allowed: pooling='token' with a class token, "
            "or 'gap' without one."
        )
    elif pooling != "token":
        raise ValueError(
            f"In {source}: ViTImageClassifier pooling={pooling!r} is not supported on a "
            "backbone with a class token (keras-hub's 'gap' averages the class token with "
            "the patches, kzoo's 'mean' only the patches); allowed: 'token', or 'gap' with "
            "use_class_token=False."
        )
    return {"num_classes": config.get("num_classes"), "pooling": pooling,
            "dropout": config.get("dropout", 0.0)}


def _vit_classifier_from_kzoo(model):
    pooling = {"token": "token", "mean": "gap"}[model.pooling]
    if model.pooling == "mean" and model.backbone.use_class_token:
        raise ValueError(
            "A ViTClassifier with pooling='mean' on a backbone with a class token has no "
            "keras-hub equivalent (keras-hub's 'gap' averages the class token too); allowed: "
            "pooling='token', or pooling='mean' with use_class_token=False."
        )
    return {"num_classes": model.num_classes, "pooling": pooling, "activation": None,
            "dropout": model.dropout, "intermediate_dim": None}


def _vit_classifier_head(model):
    hidden = model.backbone.hidden_dim
    w = []
    _dense(w, "layers/dense", model.head, (hidden, model.num_classes), (model.num_classes,))
    return w


_VIT = _Spec(
    hub_class="ViTBackbone", module="vit.vit_backbone", default_name="vi_t_backbone",
    family="vit", config_to_kzoo=_vit_to_kzoo, config_from_kzoo=_vit_from_kzoo,
    weights=_vit_weights,
    tasks={"ViTImageClassifier": _Task(
        "ViTImageClassifier", "vit.vit_image_classifier", "vi_t_image_classifier",
        "classifier", _vit_classifier_to_kzoo, _vit_classifier_from_kzoo,
        _vit_classifier_head)},
    hub_tasks=("ImageClassifier",),
)

_SPECS = (_BERT, _GPT2, _VIT)
_SPECS_BY_CLASS = {spec.hub_class: spec for spec in _SPECS}
_SPECS_BY_FAMILY = {spec.family: spec for spec in _SPECS}
SUPPORTED_BACKBONES = tuple(sorted(_SPECS_BY_CLASS))


def _spec_of_class(class_name, source):
    if class_name not in _SPECS_BY_CLASS:
        raise ValueError(
            f"Unsupported keras-hub backbone class_name={class_name!r} in {source!r}; kzoo "
            f"reads {list(SUPPORTED_BACKBONES)}."
        )
    return _SPECS_BY_CLASS[class_name]


__all__ = ["SUPPORTED_BACKBONES", "is_preset", "read_preset", "load_weights", "save"]
