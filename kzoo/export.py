"""Export kzoo models for inference: TensorFlow SavedModel, ONNX and LiteRT.

`model.export(path, format=...)` on every kzoo model calls `export` here, which wraps Keras'
own `Model.export` (keras/src/export) with what kzoo models need:

- an input signature from the model's own inputs, with named axes: the same symbol for the
  same axis across inputs (`token_ids` and `padding_mask` share "sequence"; T5 has
  "encoder_sequence" and "decoder_sequence"; Graphormer's `attn_bias` is "nodes + 1"), so
  batch and sequence stay dynamic where the format allows it, and sizes can be fixed by
  name (`shapes={"batch": 1, "sequence": 128}`);
- a check of `format` against what the current backend can write (`export_formats()`);
- for ONNX and LiteRT, whose runtimes have no bfloat16 arithmetic, a model with a bfloat16
  dtype policy ("mixed_bfloat16", "bfloat16") is exported computing in float32 with
  its weights (a warning says so; "tf_saved_model" keeps bfloat16);
- an exportable graph: attention runs the reference formula (einsum + softmax; the fused
  torch/cuDNN kernels and the chunked while loops are not exportable), and the host-side
  id checks are off while the graph is traced (they read values, which a trace cannot).

Formats by backend (Keras 3.15; each checked by running the file in its own runtime against
the Keras outputs, tests/test_export.py):

| backend    | "tf_saved_model"     | "onnx"               | "litert"          |
|------------|----------------------|----------------------|-------------------|
| tensorflow | yes, dynamic shapes  | yes, tf2onnx         | yes, fixed sizes  |
| jax        | yes, jax2tf          | yes, jax2onnx; fixed | no                |
|            |                      | sizes, dynamic batch |                   |
| torch      | no                   | yes, fixed sizes     | no                |

Example:
>>> model = kzoo.presets.load("gpt_mini")
>>> model.export("gpt.onnx", format="onnx")          # dynamic batch and sequence
>>> import onnxruntime
>>> session = onnxruntime.InferenceSession("gpt.onnx")
>>> logits = session.run(None, {"token_ids": ids, "padding_mask": mask})[0]
"""

import contextlib
import os
from collections.abc import Mapping

import keras
import numpy as np

from kzoo.inputs import is_optional_input

FORMATS = ("tf_saved_model", "onnx", "litert")

# What each backend's Keras exporter can write here, and why not the rest.
_BACKEND_FORMATS = {
    "tensorflow": ("tf_saved_model", "onnx", "litert"),
    "jax": ("tf_saved_model", "onnx"),
    "torch": ("onnx",),
}
_WHY_NOT = {
    ("jax", "litert"): "Keras 3.15 converts to LiteRT from the TensorFlow and torch backends "
                       "only",
    ("torch", "tf_saved_model"): "Keras writes a SavedModel from torch through torch_xla's "
                                 "StableHLO bridge, which has no build for torch 2.13",
    ("torch", "litert"): "Keras converts torch models to LiteRT with litert-torch, whose "
                         "dependency xdsl pins typing-extensions<4.13, which the JAX "
                         "exporter's dependencies (chex >= 4.15) exclude",
}
_SUFFIX = {"onnx": ".onnx", "litert": ".tflite"}
# The axes a (backend, format) can leave dynamic (None: every axis; the rest need a size,
# "batch" defaulting to 1). LiteRT's builtin ops take no dynamic strided slices; jax2onnx
# traces `arange` over a symbolic length as a sentinel; torch's dynamo ONNX exporter
# specialises every size, and its TorchScript exporter (Keras' dynamic-shape path) cannot
# export the shape arithmetic of Keras' torch ops.
_DYNAMIC_AXES = {
    ("tensorflow", "litert"): (),
    ("jax", "onnx"): ("batch",),
    ("torch", "onnx"): (),
}

# The axes of each model input, by the input names of DESIGN.md (keras-hub's): one symbol an
# axis, shared by the inputs that must agree on it. "nodes + 1" is Graphormer's graph token.
AXES = {
    "token_ids": ("batch", "sequence"),
    "segment_ids": ("batch", "sequence"),
    "padding_mask": ("batch", "sequence"),
    "encoder_token_ids": ("batch", "encoder_sequence"),
    "encoder_padding_mask": ("batch", "encoder_sequence"),
    "decoder_token_ids": ("batch", "decoder_sequence"),
    "decoder_padding_mask": ("batch", "decoder_sequence"),
    "images": ("batch", "height", "width", "channels"),
    "input_nodes": ("batch", "nodes", "atom_features"),
    "attn_bias": ("batch", "nodes + 1", "nodes + 1"),
    "attn_edge_type": ("batch", "nodes", "nodes", "bond_features"),
    "spatial_pos": ("batch", "nodes", "nodes"),
    "in_degree": ("batch", "nodes"),
    "out_degree": ("batch", "nodes"),
    "input_edges": ("batch", "nodes", "nodes", "hops", "bond_features"),
}
_DERIVED = {"nodes + 1": ("nodes", 1)}


def export_formats(backend=None):
    """The export formats kzoo writes on `backend` (default: the current one).

    Example:
    >>> kzoo.export.export_formats("jax")
    ('tf_saved_model', 'onnx')
    """
    backend = backend or keras.backend.backend()
    return _BACKEND_FORMATS.get(backend, ())


def check_format(format, backend=None):  # noqa: A002 - Keras' own argument name
    """`format` if the current backend can write it, else a ValueError naming the format,
    the backend, why not and the formats it can write."""
    backend = backend or keras.backend.backend()
    allowed = export_formats(backend)
    if format in allowed:
        return format
    if format not in FORMATS:
        raise ValueError(
            f"Unknown export format={format!r}; kzoo exports to {list(FORMATS)} (on the "
            f"{backend} backend: {list(allowed)})."
        )
    why = _WHY_NOT.get((backend, format), "not supported")
    raise ValueError(
        f"format={format!r} cannot be written on the {backend} backend ({why}); the "
        f"{backend} backend exports to {list(allowed)}. Switch KERAS_BACKEND (the weights "
        "load on every backend) to export to another format."
    )


# The keyword options each (backend, format) reads; Keras' exporters take **kwargs and pass
# on what they do not read to nothing (torch's ONNX, TensorFlow's SavedModel and ONNX: ignored
# in silence) or to a converter that fails late. "litert": the TFLite converter's settings.
_OPTIONS = {
    ("tensorflow", "tf_saved_model"): (),
    ("jax", "tf_saved_model"): ("is_static", "jax2tf_kwargs"),
    ("tensorflow", "onnx"): ("opset_version",),
    ("jax", "onnx"): ("opset_version",),
    ("torch", "onnx"): ("opset_version",),
}


def _litert_options():
    """The settings of TensorFlow's TFLite converter (what Keras' LiteRT export sets from
    its keyword arguments), or None where they cannot be listed."""
    try:
        import tensorflow as tf

        converter = tf.lite.TFLiteConverter([], None)
    except Exception:  # noqa: BLE001 - then the converter checks them itself
        return None
    return tuple(sorted(name for name, value in vars(converter).items()
                        if not name.startswith("_") and not callable(value)))


def export_options(format, backend=None):  # noqa: A002
    """The keyword options `export(..., format=format)` takes on `backend` (default: the
    current one), besides its named arguments.

    Example:
    >>> kzoo.export.export_options("onnx")
    ('opset_version',)
    """
    backend = backend or keras.backend.backend()
    if format == "litert":
        return _litert_options()
    return _OPTIONS.get((backend, format), ())


def _check_options(options, format, backend):  # noqa: A002
    """Refuse a keyword option `format` does not read on `backend` (a misspelled one was
    ignored in silence or failed deep inside a converter), and option values of the wrong
    type."""
    allowed = export_options(format, backend)
    unknown = [name for name in options if allowed is not None and name not in allowed]
    if unknown:
        takes = (f"takes the options {list(allowed)}" if allowed else "takes no options")
        raise ValueError(
            f"Unknown export option(s) {unknown} for format={format!r} on the {backend} "
            f"backend, which {takes} besides filepath, format, shapes, input_signature and "
            "verbose."
        )
    opset = options.get("opset_version")
    if opset is not None and (isinstance(opset, bool)
                              or not isinstance(opset, (int, np.integer)) or opset < 1):
        raise ValueError(
            f"`opset_version` must be None or a positive int (an ONNX opset); got "
            f"opset_version={opset!r}."
        )
    if not isinstance(options.get("jax2tf_kwargs") or {}, Mapping):
        raise ValueError(
            "`jax2tf_kwargs` must be None or a dict of `jax2tf.convert` arguments; got "
            f"jax2tf_kwargs={options['jax2tf_kwargs']!r}."
        )
    if not isinstance(options.get("is_static", False), bool):
        raise ValueError(f"`is_static` must be True or False; got "
                         f"is_static={options['is_static']!r}.")


# === Input signature ===


def _inputs_struct(model):
    """The model's functional inputs less the optional ones: an exported program has fixed
    inputs, and kzoo's models run without their optional inputs (BERT's masked-LM head at
    every position, Longformer without global tokens)."""
    struct = getattr(model, "_inputs_struct", None)
    if struct is None:
        raise ValueError(
            f"Model {model.name!r} has no functional inputs to export; kzoo exports its "
            "functional models (backbones and task models)."
        )
    if isinstance(struct, dict):
        struct = {key: tensor for key, tensor in struct.items()
                  if not is_optional_input(tensor)}
    return struct


def _config_of(model):
    config = getattr(model, "config", None)
    if config is None and getattr(model, "backbone", None) is not None:
        config = getattr(model.backbone, "config", None)
    return config


def _fixed_sizes(model):
    """Axis sizes a model fixes itself: the image size and channels of a ViT (its position
    table is sized when traced), the feature columns of kzoo.graphs' featurisation."""
    sizes = {}
    config = _config_of(model)
    image = getattr(config, "image_size", None)
    if image is not None:
        height, width = (image, image) if isinstance(image, int) else tuple(image)
        sizes.update(height=int(height), width=int(width))
    channels = getattr(config, "num_channels", None)
    if channels is not None:
        sizes["channels"] = int(channels)
    if getattr(config, "num_atoms", None) is not None:
        from kzoo import graphs

        sizes.update(atom_features=len(graphs.ATOM_FEATURE_VOCABULARIES),
                     bond_features=len(graphs.BOND_FEATURE_VOCABULARIES))
    return sizes


def input_axes(model):
    """`{input name: (axis name or a fixed int, ...)}` of `model`'s inputs.

    Example:
    >>> kzoo.export.input_axes(gpt)
    {'token_ids': ('batch', 'sequence'), 'padding_mask': ('batch', 'sequence')}
    """
    struct = _inputs_struct(model)
    items = struct.items() if isinstance(struct, dict) else [(struct.name, struct)]
    axes = {}
    for key, tensor in items:
        names = AXES.get(key)
        if names is None and len(tensor.shape) == 4:  # one image input, whatever its name
            names = AXES["images"]
        if names is None or len(names) != len(tensor.shape):
            raise ValueError(
                f"Input {key!r} of shape {tuple(tensor.shape)} of model {model.name!r} has "
                f"no known axes; kzoo exports the inputs {sorted(AXES)} (pass "
                "`input_signature` for others)."
            )
        axes[key] = tuple(
            size if size is not None else name for name, size in zip(names, tensor.shape))
    return axes


def _check_shapes(shapes, known):
    # (a non-mapping failed in `dict(...)`: "'int' object is not iterable", "dictionary
    # update sequence element #0 ...", naming no argument)
    if shapes is not None and not isinstance(shapes, Mapping):
        raise ValueError(
            "`shapes` must be None or a dict {axis name: size or None}, e.g. "
            f"{{'batch': 1, 'sequence': 128}}; got shapes={shapes!r}."
        )
    shapes = dict(shapes or {})
    for name, size in shapes.items():
        if name not in known:
            raise ValueError(
                f"`shapes` names axis {name!r}, which this model's inputs do not have; its "
                f"axes are {sorted(known)}."
            )
        if size is not None and (isinstance(size, bool) or not isinstance(
                size, (int, np.integer)) or size < 1):
            raise ValueError(
                f"`shapes[{name!r}]` must be a positive int or None (dynamic); got "
                f"{size!r}."
            )
    return {name: (None if size is None else int(size)) for name, size in shapes.items()}


def _check_sequence_sizes(model, sizes):
    """A fixed sequence size past a learned position table (BERT, GPT with learned
    positions) is refused by name: failed inside the trace (torch: a RuntimeError from
    PositionEmbedding's slice)."""
    backbone = getattr(model, "backbone", None) or model
    limit = getattr(_config_of(model), "max_sequence_length", None)
    if limit is None or getattr(backbone, "position_embedding", None) is None:
        return
    for name, size in sizes.items():
        if name.endswith("sequence") and size is not None and size > limit:
            raise ValueError(
                f"`shapes[{name!r}]`={size} exceeds max_sequence_length={int(limit)} of "
                f"{model.name!r} (its learned position table); give at most {int(limit)}."
            )


# Attention types whose kernels work on blocks of a static sequence length (see
# `kzoo.layers.sparse_attention`): an exported graph needs the length fixed.
_STATIC_LENGTH_ATTENTION = ("sliding_window", "strided", "longformer", "block_sparse",
                            "bigbird")


def _check_static_length_attention(model, shapes):
    """A model whose attention needs a static sequence length, exported without one, is
    refused naming `shapes`: it failed inside the trace ("sparse attention needs static
    sequence lengths; got None.", wrapped in a Keras call error), naming no argument."""
    attention = getattr(_config_of(model), "attention", "full")
    if attention not in _STATIC_LENGTH_ATTENTION:
        return
    given = shapes if isinstance(shapes, Mapping) else {}
    missing = sorted({name for names in input_axes(model).values() for name in names
                      if isinstance(name, str) and name.endswith("sequence")
                      and given.get(name) is None})
    if missing:
        raise ValueError(
            f"{model.name!r} has attention={attention!r}, whose kernel needs a fixed sequence "
            f"length in the exported graph; give it with `shapes`, e.g. "
            f"shapes={{{missing[0]!r}: 128}} (the batch may stay dynamic); got "
            f"shapes={shapes!r}."
        )


def resolve_axes(model, shapes=None, dynamic=None):
    """`{input name: (int or axis name, ...)}`: `input_axes` with the sizes of `shapes`
    (axis name -> int, or None for dynamic) and the model's own fixed sizes filled in.
    `dynamic`: the axes that may stay without a size (None: all); every other axis must
    get one ("batch" defaults to 1), a missing one raises ValueError naming it."""
    axes = input_axes(model)
    known = {name for names in axes.values() for name in names if isinstance(name, str)}
    known |= {_DERIVED[name][0] for name in known if name in _DERIVED}
    known -= set(_DERIVED)
    sizes = {**_fixed_sizes(model), **_check_shapes(shapes, known)}
    _check_sequence_sizes(model, sizes)
    if dynamic is not None and "batch" not in dynamic and sizes.get("batch") is None:
        sizes["batch"] = 1

    def size_of(name):
        if not isinstance(name, str):
            return name
        if name in _DERIVED:
            base, offset = _DERIVED[name]
            return None if sizes.get(base) is None else sizes[base] + offset
        return sizes.get(name)

    resolved = {key: tuple(size_of(n) if size_of(n) is not None else n for n in names)
                for key, names in axes.items()}
    if dynamic is not None:
        missing = sorted({_DERIVED.get(n, (n,))[0] for names in resolved.values()
                          for n in names if isinstance(n, str)} - set(dynamic))
        if missing:
            raise ValueError(
                f"This export ({keras.backend.backend()} backend) needs a fixed size for "
                f"the axes {missing}: pass shapes={{{', '.join(repr(m) + ': ...' for m in missing)}}} "
                f"(axes it can leave dynamic: {list(dynamic)}), or an `input_signature`."
            )
    return resolved


def input_signature(model, shapes=None, dynamic=None):
    """The Keras input signature of `model` for export: `[{name: keras.InputSpec}]` (one
    positional argument, as Keras' exporters expect of a functional model), or `[spec]`
    for a model with one tensor input. Axes without a size are dynamic (None)."""
    struct = _inputs_struct(model)
    resolved = resolve_axes(model, shapes, dynamic=dynamic)

    def spec(key, tensor):
        shape = tuple(s if isinstance(s, int) else None for s in resolved[key])
        return keras.InputSpec(shape=shape, dtype=tensor.dtype, name=key)

    if isinstance(struct, dict):
        return [{key: spec(key, tensor) for key, tensor in struct.items()}]
    return [spec(struct.name, struct)]


def _polymorphic_shapes(model, shapes):
    """jax2tf / jax2onnx shape strings, `{input: "(batch, sequence)"}` (shared symbols)."""
    resolved = resolve_axes(model, shapes)
    return {key: "(" + ", ".join(str(s) for s in names) + ")"
            for key, names in resolved.items()}


def _max_sequence_constraints(model, shapes):
    """`"sequence <= max_sequence_length"` for the dynamic sequence axes of a model with a
    learned position table (JAX's shape polymorphism must know the slice fits)."""
    config = _config_of(model)
    limit = getattr(config, "max_sequence_length", None)
    resolved = resolve_axes(model, shapes)
    names = {n for axes in resolved.values() for n in axes if isinstance(n, str)}
    if limit is None:
        return []
    return [f"{name} <= {int(limit)}" for name in sorted(names) if name.endswith("sequence")]


def _check_moe_dynamic_batch(model, format, backend, signature):  # noqa: A002
    """ONNX on JAX of a mixture-of-experts model with a dynamic batch is refused by name,
    with or without `capacity_factor`: the routing sizes its slot grid from the token count,
    which jax2onnx cannot carry as a symbolic size. Measured (Dec 2026, refusal lifted): the
    `arange` over the assignments traced as a sentinel size ("Incompatible types for
    broadcasting: int32[JAX2ONNX_DYNAMIC_DIM_SENTINEL] and int32[16*batch]"); without it,
    the grid's zeros failed ("no origin recorded for symbolic dim '32*batch + 1'"), and
    without those, a slice by the grid size ("Symbolic dimension '32*batch' used in a
    context that requires a constant")."""
    if (backend, format) != ("jax", "onnx"):
        return
    from keras import tree

    from kzoo.layers.moe import MixtureOfExperts

    if not any(isinstance(layer, MixtureOfExperts) for layer in model._flatten_layers()):
        return
    if all(None not in tuple(getattr(spec, "shape", ()) or ()) for spec in tree.flatten(
            signature)):
        return
    raise ValueError(
        f"{model.name!r} has mixture-of-experts layers, whose routing jax2onnx cannot "
        "export with a dynamic batch (with or without capacity_factor: the routing sizes its "
        "slots by the token count, which jax2onnx cannot trace as a symbolic size): "
        "format='onnx' on the jax backend needs a fixed batch for it, e.g. "
        "shapes={'batch': 1, 'sequence': 128}; got a dynamic batch. format='tf_saved_model' "
        "on JAX, or format='onnx' on the tensorflow backend, keep the batch dynamic."
    )


# === bfloat16 compute ===

# Formats whose runtimes cannot run bfloat16 arithmetic (onnxruntime has no bfloat16
# MatMul / Einsum: the files of every backend were refused when loaded; TensorFlow's
# LiteRT converter has no bfloat16 Gather); a model that computes in bfloat16 is exported
# computing in float32 there.
_NO_BFLOAT16 = ("onnx", "litert")


def _bfloat16_layers(model):
    return [layer for layer in model._flatten_layers()
            if keras.backend.standardize_dtype(layer.compute_dtype) == "bfloat16"]


def _policies_in_float32(config):
    """`config` (a model's `get_config()`) with every bfloat16 dtype policy made float32
    (a quantized layer's source policy too), other entries unchanged."""
    if isinstance(config, list):
        return [_policies_in_float32(item) for item in config]
    if not isinstance(config, dict):
        return config
    out = {key: _policies_in_float32(value) for key, value in config.items()}
    if str(out.get("class_name", "")).endswith("DTypePolicy") and isinstance(
            out.get("config"), dict):
        inner = dict(out["config"])
        for key in ("name", "source_name"):
            if inner.get(key) in ("bfloat16", "mixed_bfloat16"):
                inner[key] = "float32"
        out["config"] = inner
    if out.get("dtype") in ("bfloat16", "mixed_bfloat16"):
        out["dtype"] = "float32"
    return out


def _in_float32(model, format):  # noqa: A002
    """A copy of `model` computing in float32 with the same weights (a mixed_bfloat16
    model's variables are float32 already; bfloat16 ones widen exactly), for a format
    whose runtime has no bfloat16 arithmetic; a UserWarning names the policy. The model
    itself is left as it is."""
    import warnings

    policy = model.dtype_policy.name
    clone = model.__class__.from_config(_policies_in_float32(model.get_config()))
    if not clone.built:
        raise ValueError(f"Could not rebuild {model.name!r} in float32 to export it.")
    source, target = model.weights, clone.weights
    if [tuple(v.shape) for v in source] != [tuple(v.shape) for v in target]:
        raise ValueError(
            f"Could not rebuild {model.name!r} in float32 to export it (its weights and the "
            "float32 copy's differ); give it dtype='float32' (kzoo.presets.load(..., "
            "dtype='float32')) and export that.")
    for mine, theirs in zip(source, target):
        theirs.assign(keras.ops.cast(mine.value, theirs.dtype))
    for name in ("tokenizer", "generation_config"):
        if getattr(model, name, None) is not None:
            setattr(clone, name, getattr(model, name))
    warnings.warn(
        f"format={format!r} cannot run bfloat16 arithmetic (onnxruntime and LiteRT have "
        f"no bfloat16 kernels), and {model.name!r} has dtype policy {policy!r}: the file "
        "computes in float32 with the model's weights (the outputs of the model loaded with "
        "dtype='float32'). Export to 'tf_saved_model' to keep bfloat16.", UserWarning,
        stacklevel=4)  # (the caller of model.export)
    return clone


# === Export ===


@contextlib.contextmanager
def exportable():
    """Run the model as an exportable graph: the reference attention kernel, the portable
    activations (`kzoo.layers.feedforward.portable_activations`), no host-side id checks
    (they need concrete values; the exported graph clips ids like the embedding layers
    do)."""
    from kzoo import inputs as input_checks
    from kzoo.layers import kernels
    from kzoo.layers.feedforward import portable_activations
    from kzoo.layers.moe import exporting as moe_exporting

    previous = kernels._OVERRIDE["kernel"]
    kernels.set_attention_kernel("reference")
    try:
        with (input_checks.suspend_checks(), _no_default_save_signature(),
              portable_activations(), moe_exporting()):
            yield
    finally:
        kernels.set_attention_kernel(previous)


@contextlib.contextmanager
def _no_default_save_signature():
    """On TensorFlow, TensorFlow's SavedModel writer traces every functional model it
    finds with a default signature from the model's own `keras.Input`s (Keras'
    `TFLayer._default_save_signature`), besides the export's own endpoint; a ViT, whose
    inputs have no fixed height and width, cannot be traced so. The exported endpoint is
    the export's signature alone, so that default is switched off while exporting."""
    if keras.backend.backend() != "tensorflow":
        yield
        return
    from keras.src.backend.tensorflow.layer import TFLayer  # no public equivalent

    saved = TFLayer.__dict__["_default_save_signature"]
    TFLayer._default_save_signature = property(lambda self: None)
    try:
        yield
    finally:
        TFLayer._default_save_signature = saved


def _check_parent_directory(filepath, format):  # noqa: A002
    """The directory the export writes in: a path through an existing file is refused, a
    missing one is made (see `checkpoints.make_parent_directory`)."""
    from kzoo import checkpoints

    checkpoints.make_parent_directory(filepath,
                                      f"format={format!r} cannot write filepath={filepath!r}")


def export(model, filepath, format="tf_saved_model", *, shapes=None,  # noqa: A002
           input_signature=None, verbose=False, **kwargs):
    """Export `model` for inference (see the module docstring for formats and backends).

    Args:
        model: a kzoo model (backbone or task model).
        filepath: where to write: a directory for "tf_saved_model", a file ending in
            ".onnx" / ".tflite" for "onnx" / "litert".
        format: "tf_saved_model", "onnx" or "litert" (`export_formats()` lists what the
            current backend writes).
        shapes: optional `{axis name: size}` fixing axes (`input_axes(model)` names them:
            "batch", "sequence", "encoder_sequence", "nodes", ...); None keeps an axis
            dynamic. LiteRT and torch's ONNX need every axis fixed ("batch" defaults to 1).
        input_signature: a Keras input signature replacing the one kzoo builds.
        verbose: print Keras' export messages.
        **kwargs: options passed on to Keras' exporter, those the format reads on this
            backend only (`export_options(format)`): `opset_version` for "onnx";
            `is_static` and `jax2tf_kwargs` for "tf_saved_model" on JAX; the TFLite
            converter's settings (`optimizations`, `representative_dataset`, ...) for
            "litert". Any other is refused by name.

    Returns:
        `filepath`.

    Example:
    >>> model.export("gpt_saved_model")                                  # SavedModel
    >>> model.export("gpt.tflite", format="litert", shapes={"sequence": 64})
    """
    backend = keras.backend.backend()
    check_format(format, backend)
    _check_options(kwargs, format, backend)
    if not isinstance(filepath, (str, os.PathLike)):
        raise ValueError(
            f"`filepath` must be a path (str or os.PathLike); got filepath={filepath!r}."
        )
    filepath = os.fspath(filepath)
    suffix = _SUFFIX.get(format)
    if suffix and not filepath.endswith(suffix):
        raise ValueError(
            f"format={format!r} writes a file ending in {suffix!r}; got filepath={filepath!r}."
        )
    # (An existing file where a SavedModel directory goes failed deep inside TensorFlow's
    # writer: a FailedPrecondition on JAX, another error per backend.)
    if suffix is None and os.path.isfile(filepath):
        raise ValueError(
            f"format={format!r} writes a directory; filepath={filepath!r} is an existing file."
        )
    if suffix and os.path.isdir(filepath):
        raise ValueError(
            f"format={format!r} writes a file; filepath={filepath!r} is an existing directory."
        )
    if not isinstance(verbose, bool):
        raise TypeError(f"`verbose` must be True or False; got verbose={verbose!r}.")
    _check_parent_directory(filepath, format)
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built; call it on inputs first.")
    if format == "litert":
        from kzoo.quantize import quantization_map

        if quantization_map(model):
            raise ValueError(
                f"format='litert' cannot take a quantized model ({model.name!r} has "
                f"{len(quantization_map(model))} quantized layers): Keras' int8/int4 layers "
                "multiply quantized activations, which LiteRT's builtin fully_connected "
                "does not take. Export the float model and let the converter quantize it "
                "(`optimizations=[tf.lite.Optimize.DEFAULT]`), or use 'tf_saved_model' / "
                "'onnx', which take quantized models."
            )
    dynamic = _DYNAMIC_AXES.get((backend, format))
    if input_signature is None:
        signature = globals()["input_signature"](model, shapes, dynamic=dynamic)
        _check_static_length_attention(model, shapes)
    else:
        if shapes is not None:
            raise ValueError("Give `shapes` or `input_signature`, not both.")
        if isinstance(input_signature, (bool, int, float, str, bytes)):
            # (was "object of type 'int' has no len()" from inside Keras' export)
            raise ValueError(
                "`input_signature` must be a structure (dict, list or tuple) of input specs "
                "(keras.InputSpec, tf.TensorSpec or KerasTensor), as the model's inputs are; "
                f"got input_signature={input_signature!r}.")
        signature = input_signature
    _check_moe_dynamic_batch(model, format, backend, signature)
    if format in _NO_BFLOAT16 and _bfloat16_layers(model):
        model = _in_float32(model, format)
    with exportable():
        if format == "onnx" and backend == "jax":
            _onnx_jax(model, filepath, signature, shapes, **kwargs)
        elif format == "onnx" and backend == "torch":
            with _torch_take_without_squeeze():
                keras.Model.export(model, filepath, format=format, verbose=verbose,
                                   input_signature=signature, **kwargs)
        elif format == "onnx" and backend == "tensorflow":
            _register_tf2onnx_ops()
            keras.Model.export(model, filepath, format=format, verbose=verbose,
                               input_signature=signature, **kwargs)
        elif format == "tf_saved_model" and backend == "jax":
            jax2tf_kwargs = dict(kwargs.pop("jax2tf_kwargs", None) or {})
            # An inference graph: no gradient functions (those of the dropout layers'
            # seed updates cannot be saved).
            jax2tf_kwargs.setdefault("with_gradient", False)
            if input_signature is None:
                poly = _polymorphic_shapes(model, shapes)
                struct = signature[0]
                jax2tf_kwargs.setdefault("polymorphic_shapes", [
                    {k: poly[k] for k in struct} if isinstance(struct, dict)
                    else poly[struct.name]])
                jax2tf_kwargs.setdefault("polymorphic_constraints",
                                         _max_sequence_constraints(model, shapes))
            keras.Model.export(model, filepath, format=format, verbose=verbose,
                               input_signature=signature, jax2tf_kwargs=jax2tf_kwargs,
                               **kwargs)
        elif format == "litert":
            import tensorflow as tf

            # Builtin ops only: the LiteRT runtime (ai-edge-litert) has no TF "flex" ops.
            kwargs.setdefault("target_spec", {
                "supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]})
            keras.Model.export(model, filepath, format=format, verbose=verbose,
                               input_signature=signature, **kwargs)
        else:
            keras.Model.export(model, filepath, format=format, verbose=verbose,
                               input_signature=signature, **kwargs)
    return filepath


def _onnx_jax(model, filepath, signature, shapes, opset_version=None):
    """ONNX from JAX with jax2onnx, the axes named as in `input_axes` (Keras' own JAX path
    gives every dynamic axis of every input its own symbol, so a mask and its ids would not
    be known to agree)."""
    import jax
    import jax2onnx

    from keras import tree

    flat = tree.flatten(signature)
    names = [spec.name for spec in flat]
    resolved = resolve_axes(model, shapes)
    structs = []
    for spec in flat:
        axes = resolved.get(spec.name, ())
        dims = []
        for i, size in enumerate(spec.shape):
            if size is None:
                named = i < len(axes) and isinstance(axes[i], str)
                size = axes[i].replace(" ", "") if named else f"{spec.name}_{i}"
            dims.append(size)
        structs.append(jax.ShapeDtypeStruct(tuple(dims), np.dtype(spec.dtype)))

    def predict(*flat_args):
        args = tree.pack_sequence_as(signature, flat_args)
        return model(args[0], training=False)

    options = {"input_names": names, "return_mode": "file", "output_path": filepath}
    # Weights of 1 MB or more go to `<file>.data`; onnx refuses to write one that exists
    # (an earlier export to this path: FileExistsError) when the path is relative to the
    # working directory, and appended to it otherwise. This export replaces it.
    sidecar = filepath + ".data"
    if os.path.isfile(sidecar):
        os.remove(sidecar)
    if opset_version is not None:
        options["opset"] = opset_version
    with _arange_with_stop():
        jax2onnx.to_onnx(predict, inputs=structs, **options)


@contextlib.contextmanager
def _arange_with_stop():
    """Keras' JAX `arange(n)` calls `jnp.arange(n, None, step=None)`, which jax2onnx's
    traced `arange` cannot read (it takes the None as the stop); give it
    `(0, n, 1)`, the same numbers."""
    from keras.src.backend.jax import numpy as jax_numpy  # no public equivalent

    original = jax_numpy.arange

    def arange(start, stop=None, step=None, dtype=None):
        if stop is None:
            start, stop = 0, start
        return original(start, stop, 1 if step is None else step, dtype=dtype)

    jax_numpy.arange = arange
    try:
        yield
    finally:
        jax_numpy.arange = original


_TF2ONNX_REGISTERED = []


def _register_tf2onnx_ops():
    """Teach tf2onnx TensorFlow's `Erfc` (exact GELU, `tf.nn.gelu`, is written with it):
    erfc(x) = 1 - erf(x)."""
    if _TF2ONNX_REGISTERED:
        return
    from tf2onnx import utils
    from tf2onnx.handler import tf_op

    @tf_op("Erfc")
    class _Erfc:  # noqa: F841 - registered by the decorator
        @classmethod
        def version_9(cls, ctx, node, **kwargs):
            dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
            erf = ctx.make_node("Erf", [node.input[0]])
            one = ctx.make_const(utils.make_name("one"), np.array(1, dtype=dtype))
            node.type = "Sub"
            ctx.replace_inputs(node, [one.output[0], erf.output[0]])

    _TF2ONNX_REGISTERED.append(_Erfc)


@contextlib.contextmanager
def _torch_take_without_squeeze():
    """Keras' torch `take` along an axis is `index_select(...).squeeze(axis).reshape(...)`;
    torch's ONNX exporter writes the no-op squeeze of a longer axis as an ONNX `Squeeze`,
    which onnxruntime refuses (T5's relative position buckets). The same numbers without
    the squeeze (the reshape that follows gives the shape)."""
    import torch
    from keras.src.backend.torch import numpy as torch_numpy  # no public equivalent

    original = torch_numpy.take

    def take(x, indices, axis=None):
        x = torch_numpy.convert_to_tensor(x)
        indices = torch_numpy.convert_to_tensor(indices)
        if axis is None or (x.ndim == 2 and axis == 0):
            return original(x, indices, axis=axis)
        indices = indices.long()
        axis = axis % x.ndim
        indices = torch.where(indices < 0, indices + x.shape[axis], indices)
        shape = x.shape[:axis] + indices.shape + x.shape[axis + 1:]
        return torch.index_select(x, axis, indices.reshape(-1)).reshape(shape)

    torch_numpy.take = take
    try:
        yield
    finally:
        torch_numpy.take = original
