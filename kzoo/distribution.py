"""Data, model and expert parallel training of every kzoo family with `keras.distribution`.

Keras' distribution API (`keras.distribution.DeviceMesh`, `LayoutMap`, `DataParallel`,
`ModelParallel`) shards variables and batches over a mesh of devices; in Keras 3.15 it does
so on the JAX backend only. This module gives it what it cannot guess: for each family, which
weight is split along which mesh axis (`layout_map`), and checks, before anything is
compiled, that the mesh fits the model (`ValueError` naming the axis, its size and the
dimension it must divide).

The splits are Megatron-LM's (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053), on
the mesh axis `model_axis`; the batch is split on `data_axis`:

=========================================  ==================  ===============================
weight (every block, self- and cross-)     split               the model axis must divide
=========================================  ==================  ===============================
attention query kernel `(d, H*k)` + bias   columns (outputs)   num_heads
attention key/value kernels + biases       columns (outputs)   num_kv_heads (GQA) / num_heads
attention output kernel `(H*k, d)`         rows (inputs)       (num_heads, checked above)
feed-forward intermediate/gate/up kernels  columns (outputs)   intermediate_dim
  and their biases
feed-forward output kernel `(f, d)`        rows (inputs)       (intermediate_dim, above)
mixture-of-experts kernels `(E, ., .)`     experts (axis 0)    num_experts (expert parallel)
  and biases `(E, .)`
token embedding `(V, d)`                   vocabulary rows if  vocabulary_size, else
                                           V divides, else d   hidden_dim
untied LM head `(d, V)` (GPT, T5)          as the embedding    (same)
BERT MLM output bias `(V,)`                with the vocabulary (same)
T5 relative / Graphormer edge, spatial     heads (last axis)   num_heads
  and virtual-distance bias tables
Graphormer atom / degree tables `(n, d)`   hidden (columns)    hidden_dim
=========================================  ==================  ===============================

Everything else is replicated: layer/RMS norms, the biases of row-split kernels (the
attention and feed-forward output biases are added after the all-reduce, so they stay
whole), position embeddings, ViT's patch projection and class token, Graphormer's
hop-distance matrices and graph token, routers, poolers and classification heads (small
next to the blocks). The replicated residual stream between blocks is Megatron's layout:
one all-reduce after the attention and one after the feed-forward of each block.

Use it on JAX (`KERAS_BACKEND=jax`); build the model inside the distribution's scope so
its variables are created sharded:

Example:
>>> import keras, kzoo
>>> mesh = kzoo.distribution.device_mesh(data=2, model=4)     # 8 devices
>>> dist = kzoo.distribution.model_parallel("gpt_mini", mesh)
>>> with dist.scope():
...     lm = kzoo.presets.load("gpt_mini")
...     lm.compile("adam")
...     lm.fit(x, y, batch_size=8)                            # batches divide by 2

`data_parallel()` replicates every weight and splits the batch over all devices. On the
TensorFlow and torch backends `layout_map` still builds (it is data), but `data_parallel`,
`model_parallel` and `device_mesh` without explicit devices raise a `ValueError`: Keras'
distribution API needs JAX. Data parallel training on those backends uses their own engines:

- TensorFlow: `mirrored()` is a `tf.distribute.MirroredStrategy` over the local devices;
  build and compile the model inside `strategy.scope()` and `fit` splits every global batch
  over the replicas and all-reduces the gradients (Keras' TensorFlow trainer does it).
- torch: start one process per device with `torchrun`; `init_torch_process_group()` joins
  the group (gloo on CPU, nccl on CUDA) and `torch_data_parallel(model)` makes `fit`
  average the gradients over the processes after every backward pass (each process feeds
  its own share of every global batch).

`python -m training <recipe>` does all of this from flags (`--data-parallel`,
`--model-parallel`, `--strategy mirrored`, or `torchrun`); see docs/DISTRIBUTED.md.
"""

import dataclasses

import keras
import numpy as np

from kzoo import registry
from kzoo.models.base import FamilyConfig

DATA_AXIS = "batch"
MODEL_AXIS = "model"

# Variable path patterns (matched whole, with `re.fullmatch`, as `LayoutMap` does).
_BLOCK = r"(?:.*/)?(?:transformer|encoder|decoder)_layer_\d+"
_ATTENTION = _BLOCK + r"/(?:self_attention|cross_attention)"
_FEEDFORWARD = _BLOCK + r"/feedforward"


@dataclasses.dataclass(frozen=True)
class Split:
    """One rule of a layout map: variables whose path matches `pattern` get `axes`.

    Attributes:
        pattern: a regular expression matched against the whole variable path.
        axes: one mesh axis name (or None: not split) per dimension of the variable.
        divides: for each split dimension, `(name, size)`: the model dimension the mesh
            axis must divide (e.g. `("num_heads", 12)`), checked by `layout_map`; `size` is
            None when only the family is known (the check then runs on the variable's shape
            when it is created under `model_parallel`).
        why: a few words on the role of the weight, named in errors.
    """

    pattern: str
    axes: tuple
    divides: tuple = ()
    why: str = ""


def _require_jax(what):
    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"kzoo.distribution.{what} needs the JAX backend: Keras' distribution API "
            f"(keras.distribution DataParallel / ModelParallel) only shards on JAX in Keras "
            f"{keras.__version__}; got KERAS_BACKEND={backend!r}. Run with KERAS_BACKEND=jax. "
            "For data parallel training on TensorFlow use kzoo.distribution.mirrored() "
            "(tf.distribute.MirroredStrategy); on torch start the processes with torchrun and "
            "use kzoo.distribution.torch_data_parallel(model); see docs/DISTRIBUTED.md. "
            "`layout_map` itself works on every backend."
        )


# === The family and its sizes ===


def _resolve(model_or_family):
    """(family, config or None) of a kzoo model, a family config, a preset or family name."""
    if isinstance(model_or_family, FamilyConfig):
        for fam in registry.families():
            if isinstance(model_or_family, fam.config_class):
                return fam, model_or_family
    elif isinstance(model_or_family, keras.Model):
        fam = registry.for_model(model_or_family)
        backbone = getattr(model_or_family, "backbone", model_or_family)
        return fam, backbone.config
    elif isinstance(model_or_family, str):
        names = [f.name for f in registry.families()]
        if model_or_family in names:
            return registry.family(model_or_family), None
        if model_or_family in registry.preset_names():
            spec = registry.preset_spec(model_or_family)
            fam = registry.family(spec["family"])
            return fam, fam.config_class.from_dict(spec["config"], source=model_or_family)
        raise ValueError(
            f"`model_or_family` must be a kzoo model, a family config, a family name "
            f"{names} or a preset name; got model_or_family={model_or_family!r}. Presets: "
            f"{registry.preset_names()}."
        )
    raise ValueError(
        "`model_or_family` must be a kzoo model (backbone or task), a family config (e.g. "
        "`kzoo.models.gpt.GPTConfig(...)`), a family name or a preset name; got "
        f"{type(model_or_family).__name__}: {model_or_family!r}."
    )


def _sizes(family, config):
    """The dimensions the splits of `family` depend on (None where no config is known)."""
    get = (lambda name, default=None: getattr(config, name, default)) if config else (
        lambda name, default=None: None)
    sizes = {
        "num_heads": get("num_heads"),
        "num_kv_heads": get("num_kv_heads") or get("num_heads"),
        "intermediate_dim": get("intermediate_dim"),
        "hidden_dim": get("hidden_dim"),
        "vocabulary_size": get("vocabulary_size"),
        "num_experts": get("num_experts"),
        "moe": None if config is None else getattr(config, "feedforward", None) == "moe",
        "tied": get("tie_embeddings", True),
    }
    return sizes


def _divisible(size, n):
    return size is not None and size % n == 0


# === Rules a family ===


def _rules(family, sizes, model_size, model):
    """The `Split`s of `family` for a model axis called `model` of `model_size` devices."""
    heads = ("num_heads", sizes["num_heads"])
    kv_heads = ("num_kv_heads" if family.name == "gpt" else "num_heads", sizes["num_kv_heads"])
    inter = ("intermediate_dim", sizes["intermediate_dim"])
    hidden = ("hidden_dim", sizes["hidden_dim"])
    rules = [
        Split(_ATTENTION + r"/query_dense/kernel", (None, model), (heads,), "query kernel"),
        Split(_ATTENTION + r"/query_dense/bias", (model,), (heads,), "query bias"),
        Split(_ATTENTION + r"/(?:key|value)_dense/kernel", (None, model), (kv_heads,),
              "key/value kernel"),
        Split(_ATTENTION + r"/(?:key|value)_dense/bias", (model,), (kv_heads,),
              "key/value bias"),
        Split(_ATTENTION + r"/output_dense/kernel", (model, None), (heads,),
              "attention output kernel"),
    ]
    moe = sizes["moe"]
    if moe or moe is None:  # experts: split over the experts axis (expert parallel)
        experts = ("num_experts", sizes["num_experts"])
        rules += [
            Split(_FEEDFORWARD + r"/(?:gate|up|intermediate|output)_kernel", (model, None, None),
                  (experts,), "expert kernel"),
            Split(_FEEDFORWARD + r"/(?:gate|up|intermediate|output)_bias", (model, None),
                  (experts,), "expert bias"),
        ]
    if not moe:
        rules += [
            Split(_FEEDFORWARD + r"/(?:intermediate|gate|up)_dense/kernel", (None, model),
                  (inter,), "feed-forward input kernel"),
            Split(_FEEDFORWARD + r"/(?:intermediate|gate|up)_dense/bias", (model,), (inter,),
                  "feed-forward input bias"),
            Split(_FEEDFORWARD + r"/output_dense/kernel", (model, None), (inter,),
                  "feed-forward output kernel"),
        ]
    if family.name in ("gpt", "bert", "t5"):
        rules += _vocabulary_rules(family, sizes, model_size, model)
    if family.name == "t5":
        rules.append(Split(r"(?:encoder|decoder)_relative_attention_bias/embeddings",
                           (None, model), (heads,), "relative position bias table"))
    if family.name == "graphormer":
        rules += [
            Split(r"(?:.*/)?node_feature/(?:atom|in_degree|out_degree)_embeddings",
                  (None, model), (hidden,), "atom / degree embedding table"),
            Split(r"(?:.*/)?attention_bias/(?:edge|spatial)_embeddings", (None, model),
                  (heads,), "edge / spatial bias table"),
            Split(r"(?:.*/)?attention_bias/virtual_distance", (None, model), (heads,),
                  "virtual-node distance bias"),
        ]
    return rules


def _vocabulary_rules(family, sizes, model_size, model):
    """Token embedding (and untied head / output bias): vocabulary rows when they divide,
    else the hidden columns."""
    vocab, hidden = sizes["vocabulary_size"], sizes["hidden_dim"]
    by_vocab = vocab is None or _divisible(vocab, model_size)
    if not by_vocab and not _divisible(hidden, model_size):
        raise ValueError(
            f"Mesh axis {model!r} of size {model_size} divides neither vocabulary_size={vocab} "
            f"nor hidden_dim={hidden} of this {family.name} model: the token embedding is split "
            f"on one of them. Choose a {model!r} size that divides one of them."
        )
    dim = ("vocabulary_size", vocab) if by_vocab else ("hidden_dim", hidden)
    table = (model, None) if by_vocab else (None, model)
    head = (None, model) if by_vocab else (model, None)
    rules = [Split(r"(?:.*/)?token_embedding/embeddings", table, (dim,), "token embedding")]
    if family.name == "gpt" and not sizes["tied"]:
        rules.append(Split(r"(?:.*/)?token_embedding/reverse_embeddings", head, (dim,),
                           "untied LM head"))
    if family.name == "t5" and not sizes["tied"]:
        rules.append(Split(r"(?:.*/)?lm_head/kernel", head, (dim,), "untied LM head"))
    if family.name == "bert" and by_vocab:
        rules.append(Split(r"(?:.*/)?mlm_output_bias/bias", (model,), (dim,),
                           "MLM output bias"))
    return rules


# === Checks ===


def _axis_sizes(device_mesh, data_axis, model_axis):
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise ValueError(
            "`device_mesh` must be a keras.distribution.DeviceMesh (see "
            f"kzoo.distribution.device_mesh); got {type(device_mesh).__name__}: {device_mesh!r}."
        )
    names = list(device_mesh.axis_names)
    for arg, axis in (("data_axis", data_axis), ("model_axis", model_axis)):
        if axis not in names:
            raise ValueError(
                f"`{arg}`={axis!r} is not an axis of the device mesh; its axes are {names}."
            )
    if data_axis == model_axis:
        raise ValueError(
            f"`data_axis` and `model_axis` must be different mesh axes; both are {data_axis!r}."
        )
    return dict(zip(names, (int(s) for s in device_mesh.shape)))


def _check_rules(family, rules, axis_sizes):
    for rule in rules:
        split_axes = [a for a in rule.axes if a is not None]
        for axis, (name, size) in zip(split_axes, rule.divides):
            n = axis_sizes[axis]
            if size is not None and size % n:
                raise ValueError(
                    f"Mesh axis {axis!r} has size {n}, which does not divide {name}={size} of "
                    f"this {family.name} model (the {rule.why} is split on {axis!r}). Choose a "
                    f"{axis!r} size that divides {name}={size}."
                )


def _process_positions(mesh, axis, n):
    """How many of the `n` positions of mesh axis `axis` hold a device of this process (JAX
    with several processes: each process feeds the rows of those positions only)."""
    import jax

    mine = {f"{d.platform}:{d.id}" for d in jax.local_devices()}
    name = lambda d: d if isinstance(d, str) else f"{d.platform}:{d.id}"  # noqa: E731
    rows = np.moveaxis(np.asarray(mesh.devices), list(mesh.axis_names).index(axis), 0)
    return max(1, sum(any(name(d) in mine for d in row.ravel()) for row in rows.reshape(n, -1)))


def check_batch_size(distribution, batch_size):
    """Raise `ValueError` unless `batch_size` splits evenly across the batch axis of
    `distribution` (a Keras `DataParallel` or `ModelParallel`).

    `fit`, `evaluate` and `predict` under a distribution made here check every batch with
    it (last one included) before the step runs; call it yourself to check a plan early.
    With several processes (`keras.distribution.initialize`), `batch_size` is this process's
    share of the global batch, and it must divide by the positions of the batch axis that
    this process's devices hold (e.g. 4 of 8 under `data_parallel()` on 2 hosts of 4
    devices; 1 of 2 on a 2 x 4 mesh whose batch axis runs across the 2 hosts).

    Example:
    >>> check_batch_size(model_parallel("gpt_mini", device_mesh(data=2, model=4)), 5)
    ValueError: The batch size 5 does not split across mesh axis 'batch' of size 2: ...
    """
    mesh = distribution.device_mesh
    axis = distribution.batch_dim_name
    n = int(mesh.shape[list(mesh.axis_names).index(axis)])
    processes = getattr(distribution, "num_processes", 1) or 1
    local = _process_positions(mesh, axis, n) if processes > 1 else n
    if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0 or batch_size % local:
        where = (f"mesh axis {axis!r} of size {n}" if local == n else
                 f"the {local} of the {n} positions of mesh axis {axis!r} that this process's "
                 f"devices hold (the batch a process feeds is its share of the global batch; "
                 f"{processes} processes)")
        raise ValueError(
            f"The batch size {batch_size!r} does not split across {where}: every batch must be "
            f"a positive multiple of {local}, the last one too (pick a dataset size that is a "
            f"multiple of batch_size, or drop the remainder)."
        )
    return int(batch_size)


class _Checked:
    """What kzoo's `DataParallel` and `ModelParallel` add to Keras': every batch and every
    split variable is checked before it is placed."""

    def get_data_layout(self, data_shape):
        if len(data_shape) and data_shape[0] is not None:
            check_batch_size(self, data_shape[0])
        return super().get_data_layout(data_shape)

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        if layout is not None:
            if len(layout.axes) != len(variable.shape):
                raise ValueError(
                    f"The layout {layout.axes} has {len(layout.axes)} axes but variable "
                    f"{variable.path!r} has shape {tuple(variable.shape)}; the layout map "
                    "does not fit this model (was it made for another family?)."
                )
            sizes = dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))
            for dim, (axis, size) in enumerate(zip(layout.axes, variable.shape)):
                if axis is not None and size % sizes[axis]:
                    raise ValueError(
                        f"Mesh axis {axis!r} has size {sizes[axis]}, which does not divide "
                        f"dimension {dim} (size {size}) of variable {variable.path!r} "
                        f"{tuple(variable.shape)} that the layout map splits on {axis!r}."
                    )
        return layout


class DataParallel(_Checked, keras.distribution.DataParallel):
    """`keras.distribution.DataParallel` that checks every batch size before the step
    (a `ValueError` naming the batch axis and its size, instead of JAX's error)."""


class ModelParallel(_Checked, keras.distribution.ModelParallel):
    """`keras.distribution.ModelParallel` that checks every batch size and every split
    variable (a `ValueError` naming the axis, its size and the dimension) before anything
    is placed or compiled."""


# === Public API ===


def layout_map(model_or_family, device_mesh, *, data_axis=DATA_AXIS, model_axis=MODEL_AXIS):
    """The `keras.distribution.LayoutMap` of a kzoo family on `device_mesh`.

    Megatron-style tensor parallelism on `model_axis` (see the module docstring for every
    rule), experts split on `model_axis` (expert parallel), the rest replicated; the batch
    goes on `data_axis` (given to `ModelParallel` as its `batch_dim_name`). The map is data:
    it builds on every backend, but only JAX applies it.

    Args:
        model_or_family: a kzoo model (backbone or task model), a family config (e.g.
            `GPTConfig(...)`), a preset name ("gpt_mini"), or a family name ("gpt"). With
            sizes known, every split is checked against the mesh here; with a family name
            alone, each split variable is checked when it is created under `model_parallel`.
        device_mesh: a `keras.distribution.DeviceMesh` with both axes.
        data_axis: the mesh axis of the batch.
        model_axis: the mesh axis the weights are split on.

    Returns:
        A `LayoutMap` of regular expressions (matched against whole variable paths) to
        `TensorLayout`s; `layout_map[variable.path]` is a variable's layout, None when it
        is replicated.

    Raises:
        ValueError: a mesh axis that does not divide the heads, the key/value heads, the
            intermediate size, the split vocabulary/hidden axis or the number of experts
            (naming the axis, its size and the dimension), or bad arguments.

    Example:
    >>> mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"),
    ...                                      devices=[f"cpu:{i}" for i in range(8)])
    >>> lm = layout_map("gpt_mini", mesh)
    >>> lm["transformer_layer_0/self_attention/query_dense/kernel"].axes
    (None, 'model')
    >>> lm["transformer_layer_0/feedforward/output_dense/kernel"].axes
    ('model', None)
    """
    family, config = _resolve(model_or_family)
    axis_sizes = _axis_sizes(device_mesh, data_axis, model_axis)
    rules = _rules(family, _sizes(family, config), axis_sizes[model_axis], model_axis)
    _check_rules(family, rules, axis_sizes)
    result = keras.distribution.LayoutMap(device_mesh)
    for rule in rules:
        result[rule.pattern] = rule.axes
    return result


def splits(model_or_family, device_mesh, *, data_axis=DATA_AXIS, model_axis=MODEL_AXIS):
    """The `Split` rules behind `layout_map` (pattern, axes, what must divide, role), to
    read or print a plan.

    Example:
    >>> for s in splits("gpt_moe_mini", mesh):
    ...     print(s.why, s.axes, s.divides)
    """
    family, config = _resolve(model_or_family)
    axis_sizes = _axis_sizes(device_mesh, data_axis, model_axis)
    rules = _rules(family, _sizes(family, config), axis_sizes[model_axis], model_axis)
    _check_rules(family, rules, axis_sizes)
    return rules


def device_mesh(data=None, model=1, *, devices=None, data_axis=DATA_AXIS,
                model_axis=MODEL_AXIS):
    """A 2-D `keras.distribution.DeviceMesh` of `data` x `model` devices.

    Args:
        data: devices on the batch axis (default: all devices / `model`).
        model: devices on the model axis.
        devices: the devices (default: `keras.distribution.list_devices()`, JAX only);
            an explicit list (e.g. `["cpu:0", ...]`) builds a mesh on any backend, for
            `layout_map`.
        data_axis, model_axis: the axis names.

    Example:
    >>> mesh = device_mesh(data=2, model=4)     # on 8 devices
    >>> mesh.shape, mesh.axis_names
    ((2, 4), ('batch', 'model'))
    """
    if devices is None:
        _require_jax("device_mesh (without `devices`)")
        devices = keras.distribution.list_devices()
    devices = list(devices)
    if not isinstance(model, (int, np.integer)) or model <= 0:
        raise ValueError(f"`model` must be a positive integer; got model={model!r}.")
    if data is None:
        if len(devices) % model:
            raise ValueError(
                f"`model`={model} does not divide the {len(devices)} devices; choose a model "
                f"size that divides {len(devices)}."
            )
        data = len(devices) // model
    if not isinstance(data, (int, np.integer)) or data <= 0:
        raise ValueError(f"`data` must be a positive integer or None; got data={data!r}.")
    if data * model != len(devices):
        raise ValueError(
            f"`data` x `model` must equal the number of devices ({len(devices)}); got "
            f"data={data}, model={model} ({data * model} devices)."
        )
    return keras.distribution.DeviceMesh(
        (int(data), int(model)), (data_axis, model_axis), devices=devices
    )


def data_parallel(devices=None):
    """A checked `keras.distribution.DataParallel` over `devices` (default: all of them):
    every weight replicated, every batch split over all devices (JAX only).

    Example:
    >>> with data_parallel().scope():
    ...     model = kzoo.presets.load("gpt_mini")
    ...     model.compile("adam")
    ...     model.fit(x, y, batch_size=16)            # a multiple of the device count
    """
    _require_jax("data_parallel")
    if devices is None:
        devices = keras.distribution.list_devices()
    return DataParallel(devices=list(devices))


def model_parallel(model_or_family, device_mesh, *, data_axis=DATA_AXIS,
                   model_axis=MODEL_AXIS):
    """A checked `keras.distribution.ModelParallel` with kzoo's `layout_map` of
    `model_or_family` (JAX only): weights split on `model_axis`, the batch on `data_axis`.

    Raises `ValueError` when the mesh does not fit the model (see `layout_map`), before
    anything is built; during `fit` / `evaluate` / `predict`, when a batch does not split
    over `data_axis`.

    Example:
    >>> dist = model_parallel("gpt_moe_mini", device_mesh(data=2, model=4))
    >>> with dist.scope():
    ...     lm = kzoo.presets.load("gpt_moe_mini")   # experts 2 a device, heads 2 a device
    """
    _require_jax("model_parallel")
    layouts = layout_map(model_or_family, device_mesh, data_axis=data_axis,
                         model_axis=model_axis)
    return ModelParallel(layout_map=layouts, batch_dim_name=data_axis)


# === TensorFlow: tf.distribute ===


def _require(backend_name, what, instead):
    backend = keras.backend.backend()
    if backend != backend_name:
        raise ValueError(
            f"kzoo.distribution.{what} needs the {backend_name} backend; got "
            f"KERAS_BACKEND={backend!r}. {instead}"
        )


def mirrored(devices=None):
    """A `tf.distribute.MirroredStrategy` over `devices` (default: every local GPU, else
    every local CPU device) for data parallel training on TensorFlow.

    Build and compile the model inside `strategy.scope()`: its variables are mirrored on
    every device, and Keras' TensorFlow trainer splits each global batch over the replicas,
    all-reduces the gradients and scales the loss so that a step equals a one-device step
    on the same global batch (tests/test_distribution_cli.py checks the losses to 1e-5).
    Keras 3.15 cannot feed boolean inputs (padding masks) to `fit` / `evaluate` / `predict`
    of a model built under a strategy (its symbolic build sums a batch across replicas, and
    TensorFlow has no sum of booleans); give the masks as integers 0/1 (`astype("int32")`).

    Args:
        devices: device names such as `["/gpu:0", "/gpu:1"]`; by default all local GPUs or,
            without GPUs, all logical CPU devices (split one CPU for tests with
            `tf.config.set_logical_device_configuration` before TensorFlow starts).

    Example:
    >>> strategy = kzoo.distribution.mirrored()              # KERAS_BACKEND=tensorflow
    >>> with strategy.scope():
    ...     lm = kzoo.presets.load("gpt_mini")
    ...     lm.compile("adam")
    >>> lm.fit(x, y, batch_size=32)                          # 16 a replica on 2 devices
    """
    _require("tensorflow", "mirrored", "Data parallel on JAX: kzoo.distribution."
             "data_parallel(); on torch: torchrun + kzoo.distribution.torch_data_parallel.")
    import tensorflow as tf

    if devices is None:
        devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
            d.name for d in tf.config.list_logical_devices("CPU")]
    else:
        if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
            raise ValueError(
                "`devices` must be a list of device names such as ['/gpu:0', '/gpu:1']; got "
                f"devices={devices!r}.")
        devices = list(devices)
        if not devices:
            raise ValueError("`devices` must name at least one device; got devices=[].")
    return tf.distribute.MirroredStrategy(devices)


# === torch: torch.distributed ===


def init_torch_process_group(backend=None):
    """Join the process group that `torchrun` describes in the environment (`RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); return `(rank, world_size)`.

    The backend is nccl when CUDA is available (each process then uses GPU `LOCAL_RANK`),
    gloo otherwise. Call it before building the model. Does nothing (and returns the
    group's rank and size) when the group exists already.

    Example (in a script started with `torchrun --nproc_per_node 2 script.py`):
    >>> rank, world = kzoo.distribution.init_torch_process_group()
    """
    _require("torch", "init_torch_process_group", "Use torchrun with KERAS_BACKEND=torch.")
    import os

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise ValueError(
            f"init_torch_process_group reads the process group from the environment that "
            f"torchrun sets; {missing} are not set. Start the processes with `torchrun "
            "--nproc_per_node N ...`.")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"`backend` must be 'gloo' or 'nccl'; got backend={backend!r}.")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


class GradientAverage:
    """Averages the gradients of a model's trainable variables over a torch process group
    after every backward pass; made by `torch_data_parallel`.

    What `torch.nn.parallel.DistributedDataParallel` does for an `nn.Module` it wraps, for a
    Keras model that Keras' torch trainer calls directly: a post-accumulate-grad hook on
    every trainable parameter queues, once a backward pass, a callback that the autograd
    engine runs when the pass ends (where DDP finalises its reduction too). The callback
    all-reduces the gradients, one flat buffer per dtype, and divides them by the group
    size; `fit`'s train step then reads the averaged `.grad`s and the optimizer clips and
    applies them exactly as on one device. A gradient that is missing on some processes
    counts as zeros there; one missing on all of them stays missing.

    `remove()` takes the hooks off.
    """

    def __init__(self, model, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(
                "torch_data_parallel needs an initialised process group; call "
                "kzoo.distribution.init_torch_process_group() first (under torchrun).")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.parameters = [v.value for v in model.trainable_variables]
        if not self.parameters:
            raise ValueError("torch_data_parallel: the model has no trainable variables.")
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._ready)
                         for p in self.parameters]

    def _ready(self, parameter):
        if not self._queued:
            import torch

            self._queued = True
            # The hook of DDP's and FSDP's Python side: runs once the backward pass is done.
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self):
        import torch
        import torch.distributed as dist

        self._queued = False
        params = self.parameters
        device = params[0].device
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                               device=device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        present = present.tolist()
        by_dtype = {}
        for p, has in zip(params, present):
            if has:
                by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for group_params in by_dtype.values():
                flat = torch.cat([
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in group_params])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                flat /= self.world_size
                offset = 0
                for p in group_params:
                    chunk = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if p.grad is None:
                        p.grad = chunk.clone()
                    else:
                        p.grad.copy_(chunk)

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def torch_data_parallel(model, group=None, broadcast=True):
    """Make `model.fit` data parallel over a torch process group (torch backend).

    Broadcasts every variable of `model` from rank 0 (so all processes start equal, as DDP
    does) and returns a `GradientAverage` that averages the gradients over the group after
    every backward pass. Call it after `compile` (and after `enable_lora`, which changes
    the trainable variables). Each process must then `fit` its own share of every global
    batch (rows `rank * B / world` to `(rank + 1) * B / world` of a global batch of `B`),
    with the same number of batches in every process; the optimizer state stays equal on
    every process, so rank 0 alone needs to write checkpoints.

    Args:
        model: a compiled Keras model (torch backend).
        group: a `torch.distributed` process group (default: the whole world).
        broadcast: copy rank 0's variables to the others first.

    Example (under `torchrun --nproc_per_node 2`):
    >>> rank, world = kzoo.distribution.init_torch_process_group()
    >>> lm = kzoo.presets.load("gpt_mini"); lm.compile("adam")
    >>> sync = kzoo.distribution.torch_data_parallel(lm)
    >>> lm.fit(x[rank::world], y[rank::world], batch_size=16)   # 32 a global batch
    """
    _require("torch", "torch_data_parallel", "On JAX use kzoo.distribution.data_parallel(); "
             "on TensorFlow kzoo.distribution.mirrored().")
    import torch
    import torch.distributed as dist

    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model; got {type(model).__name__}.")
    averaged = GradientAverage(model, group)
    if broadcast:
        with torch.no_grad():
            for v in model.variables:
                dist.broadcast(v.value.data, src=0, group=group)
    return averaged


__all__ = ["DATA_AXIS", "MODEL_AXIS", "Split", "DataParallel", "ModelParallel", "layout_map",
           "splits", "device_mesh", "data_parallel", "model_parallel", "check_batch_size",
           "mirrored", "init_torch_process_group", "GradientAverage", "torch_data_parallel"]
