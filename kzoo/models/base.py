"""Base classes shared by every family: configs, functional backbones and task models.

- `FamilyConfig`: the base of each family's frozen dataclass config (`GPTConfig`,
  `BertConfig`, ...): validated once in `__post_init__`, read from a dict with `from_dict`
  (unknown keys refused, errors naming where the dict came from), turned into its backbone
  with `build()`.
- `FunctionalModel`: a functional `keras.Model` whose subclasses may create their layers as
  attributes before `super().__init__(inputs=..., outputs=...)`, on every backend, and whose
  variables are registered as torch parameters on the torch backend (so `zero_grad`, and
  with it `fit`, sees all of them).
- `Backbone`: a `FunctionalModel` described by a `FamilyConfig` (`backbone.config`);
  `get_config()` is the base entries plus exactly the config's fields.
- `TaskModel`: the configuration plumbing of a task model built on a backbone
  (`get_config` serialises the backbone; `from_config` rebuilds it).

Every `FunctionalModel` checks the ids its user passes (see `kzoo.inputs`): a family's
backbone lists its id inputs in `id_inputs()` (a task model uses its backbone's), and
`__call__`, `fit`, `evaluate`, `predict`, `train_on_batch`, `test_on_batch` and
`predict_on_batch` check them on the host, once, before Keras runs anything compiled.
"""

import contextlib
import dataclasses
import difflib
import inspect
import weakref
from collections.abc import Mapping

import keras
import numpy as np

from kzoo import allocator
from kzoo import inputs as input_checks
from kzoo.inputs import FloatInput, IdInput  # noqa: F401  (the families declare their inputs)
from kzoo.layers.feedforward import get_activation
from kzoo.layers.gradients import adopt_custom_gradients
from kzoo.layers.norm import LayerNorm
from kzoo.layers.taps import RetracesUnderTaps
from kzoo.layers.utils import FieldError, check_positive_float, serialize_initializer


# === Config ===


class FamilyConfig:
    """Base of the family configs: frozen dataclasses whose `__post_init__` validates.

    A subclass is a `@dataclasses.dataclass(frozen=True)` whose fields are exactly the
    keyword arguments of its backbone (same names, same defaults) and whose
    `__post_init__` checks every field with the validators of `kzoo.layers.utils` (each
    returns the normalised value, e.g. a NumPy integer as an int, which `_check` stores),
    then the rules that tie fields together. An invalid config can't be built: the first
    bad field raises one `ValueError` naming the field, its value and what is allowed.

    Example (with `GPTConfig`; every family is alike):
    >>> config = GPTConfig(num_layers=2, hidden_dim=64, num_heads=4, intermediate_dim=256)
    >>> backbone = config.build()                  # == GPTBackbone(**config.to_dict())
    >>> backbone.config == config
    True
    >>> GPTConfig.from_dict({"num_layerz": 2})
    ValueError: Unknown GPTConfig field 'num_layerz' ... Did you mean ['num_layers']? ...
    """

    # The backbone class that `build` constructs; each family module sets it.
    backbone_class = None

    def _check(self, name, validator, *args, **kwargs):
        """`validator(name, value, *args, **kwargs)` on field `name`; store what it returns."""
        object.__setattr__(self, name, validator(name, getattr(self, name), *args, **kwargs))

    def _check_attention_fields(self):
        """Validate the `attention` / `attention_options` pair (see
        `kzoo.layers.efficient_attention`); options are stored with their defaults filled
        in (None for "full"), so equal settings give equal configs."""
        from kzoo.layers.efficient_attention import check_attention

        try:
            # (num_heads: a block_sparse layout must have 1 head or one per attention head;
            # without it a wrong count passed here and failed only when the blocks were built)
            attention, options = check_attention(self.attention, self.attention_options,
                                                  num_heads=getattr(self, "num_heads", None))
        except FieldError:
            raise
        except ValueError as error:
            message = str(error)
            field = "attention" if "`attention`" in message else "attention_options"
            if field == "attention_options" and "`attention_options`" not in message:
                message = f"`attention_options` of attention={self.attention!r}: {message}"
            raise FieldError(message, field) from error
        object.__setattr__(self, "attention", attention)
        object.__setattr__(self, "attention_options", options or None)

    @classmethod
    def field_names(cls):
        return [field.name for field in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values, source=None, names=None):
        """The config of a dict of fields, e.g. a preset's "config" entry.

        Args:
            values: a mapping field name -> value; fields it leaves out take their defaults.
            source: where the dict came from (a preset JSON path, a Hugging Face
                `config.json` path), named in every error.
            names: optional mapping field -> the name the source gives it (a Hugging Face
                key such as "n_layer" for `num_layers`), named in the error too.

        Raises:
            ValueError: `values` has a key that is not a field (the message lists the
                allowed fields), or a field is invalid.

        Example:
        >>> BertConfig.from_dict({"num_layers": 2, "hidden_dim": 128, "num_heads": 2,
        ...                       "intermediate_dim": 512}, source="my_preset.json")
        """
        where = f" in {source}" if source else ""
        if not isinstance(values, Mapping):
            raise ValueError(
                f"A {cls.__name__} is read from a dict of fields; got "
                f"{type(values).__name__}{where}."
            )
        allowed = cls.field_names()
        unknown = [key for key in values if key not in allowed]
        if unknown:
            hints = {
                key: difflib.get_close_matches(str(key), allowed, n=3) for key in unknown
            }
            hint = "".join(
                f" Did you mean {close} for {key!r}?" for key, close in hints.items() if close
            )
            plural = "s" if len(unknown) > 1 else ""
            raise ValueError(
                f"Unknown {cls.__name__} field{plural} "
                f"{', '.join(repr(k) for k in unknown)}{where}.{hint} Allowed fields: "
                f"{allowed}."
            )
        try:
            return cls(**values)
        except FieldError as error:
            if not source and not names:
                raise
            field = error.field
            alias = (names or {}).get(field)
            also = f" (field `{alias}`{where})" if alias else where
            message = f"Invalid {cls.__name__}{also}: {error}"
            raise FieldError(message, field) from error
        except ValueError as error:
            if not source:
                raise
            raise ValueError(f"Invalid {cls.__name__}{where}: {error}") from error

    def to_dict(self):
        """The fields as a plain dict (`dataclasses.asdict`)."""
        return dataclasses.asdict(self)

    def replace(self, **changes):
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def build(self, **kwargs):
        """The backbone of this config; `kwargs` are Keras' own (`dtype`, `name`, ...).

        Example:
        >>> backbone = GPTConfig(num_layers=2).build(dtype="mixed_bfloat16")
        """
        return type(self).backbone_class(**self.to_dict(), **kwargs)


# === Generation defaults of the generative task models (GPTCausalLM, T5Seq2SeqLM) ===

# `generate(stop_token_ids="auto", ...)`: the model's own default (a constructor argument,
# saved with the model; a Hugging Face checkpoint's `eos_token_id` when it came from one).
AUTO = "auto"


def is_auto(value):
    return isinstance(value, str) and value == AUTO


def check_stop_token_ids(stop_token_ids, vocabulary_size):
    """A generative task model's `stop_token_ids` (its `generate` default): None or a tuple
    of token ids in `[0, vocabulary_size)` (a tuple: Keras would track a list attribute)."""
    from kzoo.generation import stop_ids  # (generation sits above the families)

    if stop_token_ids is None:
        return None
    ids = stop_ids(stop_token_ids)
    if any(i >= vocabulary_size for i in ids):
        raise ValueError(
            f"`stop_token_ids` must be None or token ids in [0, vocabulary_size="
            f"{vocabulary_size}); got stop_token_ids={stop_token_ids!r}."
        )
    return ids


def check_token_id(name, value, vocabulary_size):
    """An int token id in `[0, vocabulary_size)` (`decoder_start_token_id`, ...)."""
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
            or not 0 <= int(value) < vocabulary_size):
        raise ValueError(
            f"`{name}` must be a token id, an int in [0, vocabulary_size={vocabulary_size}); "
            f"got {name}={value!r}."
        )
    return int(value)


def _deserialize_dtype(config):
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = keras.dtype_policies.deserialize(config["dtype"])
    return config


def _on_torch():
    return keras.config.backend() == "torch"


# Device types where Keras' torch tensors live and a copy from the host waits for the
# device's queued work (torch copies from pageable memory synchronously).
WAITING_DEVICES = ("cuda",)


def _waits_for_device():
    """torch: whether Keras puts new tensors on a device of `WAITING_DEVICES`."""
    from keras.src.backend.torch.core import get_device

    return str(get_device()).split(":")[0] in WAITING_DEVICES


def _on_device(data):
    """torch: a training batch `(x, y, sample_weight)` with every NumPy array and host
    tensor copied to Keras' device up front, as Keras' own conversions would copy them
    (same dtypes), while the device is idle at the start of a step. Keras copies the
    targets and weights later, inside the loss, after the forward pass is queued: each copy
    there waits for the whole forward pass (an H200 training GPT-2 small: with the loss's
    count and the loss tracker's batch size, three waits a step, the device idle while the
    host then queued the backward pass)."""
    import torch

    def move(value):
        if isinstance(value, np.ndarray) or (isinstance(value, torch.Tensor)
                                             and value.device.type == "cpu"):
            return keras.ops.convert_to_tensor(value)
        return value

    return keras.tree.map_structure(move, data)


# Outputs of `predict_on_batch` at least this large are handed out without a copy (smaller
# ones are copied as Keras does: nothing to gain there).
_ZERO_COPY_BYTES = 1 << 20


class _Writable:
    """Exposes the memory of a NumPy `view` as writable (`np.asarray(_Writable(...))`) and keeps
    `owner`, the backend array that owns that memory, alive as long as any array over it."""

    def __init__(self, owner, view):
        self.owner = owner
        interface = dict(view.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


def _shared_view(value):
    """A writable NumPy array sharing the memory of the backend array `value` (a CPU torch
    tensor, TensorFlow eager tensor or JAX array on one CPU device, of a NumPy dtype), or None
    where there is none to share (then Keras' own conversion copies)."""
    import numpy as np

    backend = keras.config.backend()
    if backend == "torch":
        import torch

        if (isinstance(value, torch.Tensor) and value.device.type == "cpu"
                and value.dtype != torch.bfloat16 and not isinstance(value, torch.nn.Parameter)):
            return value.detach().numpy()
        return None
    if backend == "tensorflow":
        import tensorflow as tf

        if not isinstance(value, tf.Tensor) or not hasattr(value, "_numpy"):
            return None  # (symbolic, ragged, sparse)
        if value.device and "CPU" not in value.device.upper():
            return None
        view = value._numpy()  # the tensor's own buffer, writable
        return view if isinstance(view, np.ndarray) and view.flags.writeable else None
    if backend == "jax":
        import jax

        if not isinstance(value, jax.Array) or not value.is_fully_addressable:
            return None
        devices = value.sharding.device_set
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return None
        try:
            np.dtype(value.dtype.name)
        except TypeError:  # bfloat16 and other ml_dtypes: Keras' copy
            return None
        view = np.asarray(value)  # the buffer itself on CPU, read-only
        if view.__array_interface__["data"][0] != value.unsafe_buffer_pointer():
            return None
        return np.asarray(_Writable(value, view))
    return None


def _numpy_outputs(outputs, sources):
    """`outputs` (a structure of backend arrays) as NumPy arrays, as Keras' `predict_on_batch`
    returns them (writable, the caller's own), without copying the large ones.

    Keras converts every output with `np.array(...)`: a second buffer the size of the output
    (64 MiB for the logits of 8 x 256 tokens and a vocabulary of 8192: ~5-10 ms on the 2-core
    CPU, 3-5% of a GPT or BERT forward, and ~13 ms more of page faults without kzoo's
    allocator setting). A model output is normally memory its last op made for this call, so
    the array can be that memory, kept alive by the array. Not where it could be anything
    else: an output sharing memory with an input or a variable (`sources(nbytes)` gives the
    arrays of those at least as large, called only for a large output; JAX forwards inputs to
    outputs unchanged, TensorFlow's graphs forward a variable's buffer), or with another
    output, is copied."""
    import numpy as np

    taken = []

    def convert(value):
        view = _shared_view(value)
        if view is None or view.nbytes < _ZERO_COPY_BYTES:
            return _keras_numpy(value)
        if any(np.may_share_memory(view, other) for other in sources(view.nbytes) + taken):
            return np.array(view)
        taken.append(view)
        return view

    return keras.tree.map_structure(convert, outputs)


def _keras_numpy(value):
    """What Keras' `predict_on_batch` makes of an output: a copy (TensorFlow's ragged and
    sparse tensors as they are)."""
    import numpy as np

    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
            return value
        return value.numpy()
    if backend == "jax":
        return np.array(value)
    return keras.ops.convert_to_numpy(value)


def _source_arrays(model, data, nbytes):
    """NumPy views of those inputs (`data`) and variables of `model` that may hold `nbytes`
    bytes or more, what an output of that size could share memory with (see
    `_numpy_outputs`)."""
    import numpy as np

    def large(value):
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if shape is None or dtype is None or any(d is None for d in shape):
            return True  # (unknown: looked at)
        try:
            itemsize = np.dtype(keras.backend.standardize_dtype(dtype)).itemsize
        except TypeError:
            itemsize = 1  # (bfloat16 and the like: no smaller than this)
        return int(np.prod(shape, dtype="int64")) * itemsize >= nbytes

    values = [v for v in keras.tree.flatten(data) if large(v)]
    values += [v.value for v in model.variables if large(v)]
    arrays = []
    for value in values:
        if isinstance(value, np.ndarray):
            arrays.append(value)
            continue
        if keras.config.backend() == "torch" and hasattr(value, "detach"):
            value = value.detach()  # (a variable's value is a parameter)
        view = _shared_view(value)
        if view is not None:
            arrays.append(view)
    return arrays


class FunctionalModel(RetracesUnderTaps, keras.Model):
    """A functional `keras.Model` that may set attributes before `super().__init__`.

    With the torch backend `torch.nn.Module.__setattr__` refuses sub-modules before
    `Module.__init__` has run. All state lives in the functional graph, so until the
    functional `__init__` has finished (and for properties) attributes are set as plain
    Python attributes there; afterwards Keras' own `__setattr__` (variable tracking, torch
    module registration) applies. The torch parameter dictionary that Keras may have built
    during `__init__` is registered again afterwards, so `model.parameters()`, and with it
    the `zero_grad` of every training step, covers every variable.

    Subclasses list their constructor arguments in `get_config`; `from_config` turns a
    serialised dtype policy back into a policy and calls the constructor.

    Id checks (`kzoo.inputs`): a subclass with id inputs returns them from `id_inputs()`;
    `__call__` with concrete inputs checks them, and `fit` / `evaluate` / `predict` /
    `train_on_batch` / `test_on_batch` / `predict_on_batch` check their data once up front
    (a dataset or generator batch by batch, as it is produced) and then run Keras' own
    method with the checks of `__call__` suspended, so nothing is checked inside a train
    step.

    Compiled functions (`kzoo.layers.taps.RetracesUnderTaps`): `predict`, `evaluate` and
    `fit` trace their function again when the active taps are not those it was traced
    under, so a `kzoo.layers.taps.Tap` sees a `predict` that an earlier call had compiled.
    """

    def __init__(self, *args, **kwargs):
        dtype = kwargs.get("dtype")
        super().__init__(*args, **kwargs)
        # Keras' functional constructor drops `dtype` (3.15): a task model built with
        # dtype="mixed_bfloat16" reported float32, and was saved and reloaded as float32.
        policy = keras.dtype_policies.get(dtype) if dtype is not None else None
        if policy is not None:
            from kzoo import registry

            registry.check_float64_available(policy, dtype)
        if (type(policy) in (keras.DTypePolicy, keras.dtype_policies.FloatDTypePolicy)
                and policy.name != self.dtype_policy.name):
            self.dtype_policy = policy
        # Keras wraps `quantize` per instance (checking the mode its own way); kzoo's
        # `quantize` checks it and quantizes the sub-layers through their own wrappers.
        self.__dict__.pop("quantize", None)
        self._initialized = True
        if keras.config.backend() == "torch" and "_torch_params" in self.__dict__:
            # Built while `__setattr__` bypassed torch: a plain attribute that
            # `torch.nn.Module.parameters()` does not see. Register it properly.
            del self.__dict__["_torch_params"]
            self._track_variables()

    def __setattr__(self, name, value):
        is_property = isinstance(getattr(type(self), name, None), property)
        uninitialized = "_initialized" not in self.__dict__
        if keras.config.backend() == "torch" and (is_property or uninitialized):
            if uninitialized and not is_property and name != "_tracker":
                # Keras' tracker still sees the value, as on JAX and TensorFlow: the layers
                # are then listed (and the trainable variables, and so the optimizer's
                # variables, ordered) in assignment order on every backend. Without it the
                # torch order was the functional graph's: a T5 `.keras` file saved with its
                # optimizer on one backend failed to load on the other kind ("The shape of
                # the target variable ... must match"), or swapped equal-shaped moments.
                if not hasattr(self, "_tracker"):
                    self._initialize_tracker()
                value = self._tracker.track(value)
            return object.__setattr__(self, name, value)
        return super().__setattr__(name, value)

    def compile(self, *args, **kwargs):
        jit_compile = _signature("compile").bind(None, *args, **kwargs).arguments.get(
            "jit_compile", "auto")
        super().compile(*args, **kwargs)
        self._jit_compile_auto = isinstance(jit_compile, str) and jit_compile == "auto"
        _sum_sparse_gradients(getattr(self, "optimizer", None))
        from kzoo import fused_adam  # (Keras' Adam / AdamW by torch's / TF's fused kernel)

        fused_adam.install(getattr(self, "optimizer", None))

    def get_compile_config(self):
        return _portable_compile_config(
            super().get_compile_config(), getattr(self, "_jit_compile_auto", False))

    def compile_from_config(self, config):
        # Keras skips a custom `compile` when loading a saved model (with a warning, and the
        # model comes back without optimizer, loss or metrics: every backbone, whose
        # `compile` is this class's); kzoo's only records "auto" and installs the fused Adam
        # (a task model's also fills in the default loss), so the saved config is replayed
        # through it.
        config = _portable_compile_config(config, False)
        self.compile(**keras.saving.deserialize_keras_object(config))
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    def _symbolic_build(self, iterator=None, data_batch=None):
        # torch: Keras' `train_on_batch` / `test_on_batch` call this at every batch, and it
        # rebuilds the torch parameter dict of every variable (`_post_build`) even when
        # nothing is left to build (~5 ms of host time a call for GPT-2's 148 variables; a
        # GPU waits for it). Once the model, its compiled loss and metrics and the optimizer
        # are built and the variables tracked, nothing is done (a variable created later is
        # added to the dict by Keras' own tracking hook).
        if _on_torch() and hasattr(self, "_torch_params") and self._built_for_training():
            return
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)

    def _built_for_training(self):
        """What Keras' `_symbolic_build` would build: nothing left."""
        for part in (getattr(self, "_compile_metrics", None),
                     getattr(self, "_compile_loss", None), getattr(self, "optimizer", None)):
            if part is not None and not part.built:
                return False
        return all(layer.built for layer in self._flatten_layers())

    # === Prediction with XLA on TensorFlow ===

    @property
    def xla_prediction(self):
        """Whether `predict` / `predict_on_batch` run an XLA-compiled function on TensorFlow
        where Keras' own `jit_compile="auto"` would not.

        Keras' "auto" is no XLA on a TensorFlow machine without an accelerator. kzoo compiles
        the *prediction* function with XLA there all the same (training and evaluation keep
        Keras' choice: XLA's training step holds ~120-270 MiB more memory) unless
        `compile(jit_compile=False)` (or True) said otherwise, the model runs eagerly or under
        a `tf.distribute` strategy, or a layer has no XLA support. Measured on the 2-core CPU
        (8 x 256 tokens, width 256, 4 layers, vocabulary 8192, 6 interleaved rounds in one
        process): GPT logits 12,102 -> 14,529 tokens/s, BERT 14,201 -> 13,875 (within the
        spread); outputs equal to 2e-6. XLA compiles once per input shape (the graph function
        of Keras' "auto" relaxes shapes instead), and keeps its program in memory.
        """
        if keras.config.backend() != "tensorflow" or not getattr(
                self, "_jit_compile_auto", True):
            return False
        if self.jit_compile or self.run_eagerly:
            return False
        import tensorflow as tf
        from keras.src.trainers.trainer import model_supports_jit

        if tf.distribute.has_strategy() or getattr(self, "_distribute_strategy", None):
            return False
        return bool(model_supports_jit(self))

    @property
    def _needs_static_shapes(self):
        """Whether the model's graph needs its inputs' static shape: on TensorFlow its
        prediction, training and evaluation functions are then traced once per input shape,
        never with relaxed (`None`) shapes. ViT says so for its patch grid (a class
        attribute there); any model does whose attention is not "full" (sliding window,
        strided, Longformer, block-sparse, BigBird: layouts built from the sequence length;
        linear / performer: feature maps shaped by it) or runs the "chunked" kernel (blocks
        cut from the length; asked for by a layer or by `set_attention_kernel`), where the
        second sequence length a function saw on TensorFlow raised."""
        from kzoo.layers.attention import MultiHeadAttention
        from kzoo.layers.kernels import get_attention_kernel_override

        attentions = [layer for layer in self._flatten_layers()
                      if isinstance(layer, MultiHeadAttention)]
        if attentions and get_attention_kernel_override() == "chunked":
            return True
        return any(layer.attention != "full" or layer.kernel == "chunked"
                   for layer in attentions)

    def make_predict_function(self, force=False):
        force = force or self._traced_under_other_taps("predict_function")
        if self.predict_function is not None and not force:
            return self.predict_function
        with _exact_tracing(self._needs_static_shapes):
            if not self.xla_prediction:
                return super().make_predict_function(force)
            # Keras' TensorFlow trainer reads `jit_compile` once, when it makes the function.
            keras_choice = self._jit_compile
            self._jit_compile = True
            try:
                return super().make_predict_function(force)
            finally:
                self._jit_compile = keras_choice

    def make_train_function(self, force=False):
        force = force or self._traced_under_other_taps("train_function")
        if self.train_function is not None and not force:
            return self.train_function
        with _exact_tracing(self._needs_static_shapes):  # (ViT's fit at a new image size)
            return super().make_train_function(force)

    def make_test_function(self, force=False):
        force = force or self._traced_under_other_taps("test_function")
        if self.test_function is not None and not force:
            return self.test_function
        with _exact_tracing(self._needs_static_shapes):
            return super().make_test_function(force)

    # === Id checks (kzoo.inputs) ===

    def id_inputs(self):
        """The id inputs of this model, a tuple of `kzoo.inputs.IdInput` (none here)."""
        return ()

    # Keys of the input dict that may be left out because the model fills them in
    # (`FilledInputs`: padding masks, BERT's `segment_ids`); optional Keras inputs may always
    # be left out.
    _input_fills = {}

    def check_input_keys(self, inputs, source=None):
        """Refuse an input dict with a key the model does not take, or without one it needs
        (JAX's Keras warned and ran on, the ids of a misspelt key unchecked; torch and
        TensorFlow said "Missing data for input" or nothing for an extra key)."""
        names = self.__dict__.get("_input_names")
        if names is None:
            names = {}
            if isinstance(getattr(self, "_inputs_struct", None), dict):
                names = {k: input_checks.is_optional_input(t) or k in self._input_fills
                         for k, t in self._inputs_struct.items()}
            self.__dict__["_input_names"] = names
        if not names:
            return
        source = source or f"the input of {self.name}"
        if not isinstance(inputs, dict):
            if _number_lists(inputs) or (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
                # (Keras' messages differed per backend: "The structure of `inputs` doesn't
                # match" on JAX, "expects 2 named input(s)" on torch and TensorFlow)
                shape = tuple(np.shape(inputs) if isinstance(inputs, (list, tuple))
                              else inputs.shape)
                raise ValueError(
                    f"{source} must be a dict with the keys {sorted(names)} (optional: "
                    f"{sorted(k for k, o in names.items() if o) or 'none'}); got one "
                    f"{type(inputs).__name__} of shape {shape}. Pass e.g. "
                    f"{{{sorted(names, key=lambda k: (names[k], k))[0]!r}: ...}}.")
            return
        unknown = sorted(str(k) for k in inputs if k not in names)
        missing = sorted(k for k, may_leave_out in names.items()
                         if not may_leave_out and k not in inputs)
        if unknown or missing:
            raise ValueError(
                f"{source} must be a dict with the keys {sorted(names)} (optional: "
                f"{sorted(k for k, o in names.items() if o) or 'none'}); got "
                + (f"the unknown key(s) {unknown}" if unknown else "")
                + (" and " if unknown and missing else "")
                + (f"no {missing}" if missing else "") + ".")

    def __call__(self, *args, **kwargs):
        initialized = "_initialized" in self.__dict__
        specs = self.id_inputs() if initialized else ()
        if args and isinstance(args[0], dict) and any(
                isinstance(value, (list, tuple)) for value in args[0].values()):
            # Nested Python lists as arrays (as `predict` and `generate` take them): Keras
            # flattened each list into inputs of its own ("expects 2 named input(s) ... but
            # it received 6 input tensors").
            args = ({key: np.asarray(value) if isinstance(value, (list, tuple)) else value
                     for key, value in args[0].items()},) + args[1:]
        if initialized and not input_checks.checks_suspended():
            inputs = args[0] if args else kwargs.get("inputs")
            if specs:
                input_checks.check_inputs(inputs, specs, f"input of {self.name}")
            self.check_input_keys(inputs)
        with input_checks.suspend_checks():
            return super().__call__(*args, **kwargs)

    def _run_checked(self, method, args, kwargs, data_arguments, keras_method=None):
        """Keras' `method` (or `keras_method`, a replacement with its signature) with the
        `data_arguments` (name -> whether it may be an `(x, y, w)` tuple) checked or wrapped
        first, the checks of `__call__` suspended while it runs, and a check that failed
        inside a data pipeline re-raised as its ValueError."""
        keras_method = keras_method or getattr(super(), method)
        # Only the looping methods detach the variables (`*_on_batch` keep them attached):
        # listing and holding every variable costs ~30 ms a call on a 4-layer GPT.
        kept = _jax_variables_kept(self) if method in _DETACHING else contextlib.nullcontext()
        if input_checks.checks_suspended():
            with kept:
                return keras_method(*args, **kwargs)
        specs = self.id_inputs()
        bound = _signature(method).bind(None, *args, **kwargs)
        for name in ("x", "y", "sample_weight", "validation_data"):
            if name in bound.arguments:
                bound.arguments[name] = _lists_as_arrays(bound.arguments[name],
                                                         tuples=name == "validation_data")
        if method in _TRAINING_OR_TESTING and _empty_batch(bound.arguments.get("x")):
            # (torch's data adapter said "num_samples should be a positive integer", JAX's a
            # bare StopIteration, and TensorFlow's ran no step and only warned)
            raise ValueError(
                f"{method}'s x has no rows (a batch of 0 examples): there is nothing to "
                f"{'train on' if method in ('fit', 'train_on_batch') else 'evaluate'}; "
                "give at least one example.")
        self._check_targets(method, bound.arguments)
        for name, batch in data_arguments.items():
            data = bound.arguments.get(name)
            if data is None:
                continue
            if specs:  # (first: their messages are the more precise, e.g. document_ids)
                bound.arguments[name] = input_checks.checked_data(
                    data, specs, f"{method}'s {name}", batch=batch)
            self.check_input_keys(input_checks.features(data) if batch else data,
                                  f"{method}'s {name}")
        with input_checks.suspend_checks(), input_checks.pipeline_errors(), kept:
            return keras_method(*bound.args[1:], **bound.kwargs)

    def _check_targets(self, method, arguments):
        """The targets of a sparse cross-entropy (`y`, and `validation_data`'s) against the
        logits: class ids in range (`kzoo.inputs.check_targets`), of the logits' shape
        without the class axis (`_check_target_shape`), and given at all when `x` is arrays
        (`y=None` failed inside the step with a backend error)."""
        from kzoo.losses import TokenCrossentropy

        loss = getattr(self, "loss", None)
        sparse = (isinstance(loss, (TokenCrossentropy,
                                    keras.losses.SparseCategoricalCrossentropy))
                  or loss in ("sparse_categorical_crossentropy",
                              keras.losses.sparse_categorical_crossentropy))
        outputs = getattr(self, "outputs", None) or []
        if not sparse or len(outputs) != 1 or outputs[0].shape[-1] is None:
            return
        classes, ignore = outputs[0].shape[-1], getattr(loss, "ignore_class", None)
        pairs = [(arguments.get("x"), arguments.get("y"), f"{method}'s y")]
        validation = arguments.get("validation_data")
        if isinstance(validation, tuple) and len(validation) in (2, 3):
            pairs.append((validation[0], validation[1], f"{method}'s validation_data"))
        for x, y, source in pairs:
            if method not in ("predict", "predict_on_batch"):
                self._check_target_shape(x, y, source)
            input_checks.check_targets(y, classes, ignore, source)
        if method in ("predict", "predict_on_batch"):
            return
        if arguments.get("sample_weight") is not None:
            arguments["sample_weight"] = self._checked_sample_weight(
                arguments.get("x"), arguments["sample_weight"], f"{method}'s sample_weight")
        if isinstance(validation, tuple) and len(validation) == 3 and validation[2] is not None:
            arguments["validation_data"] = validation[:2] + (self._checked_sample_weight(
                validation[0], validation[2], f"{method}'s validation_data weights"),)

    def _checked_sample_weight(self, x, weights, source):
        """Array sample weights of a sparse cross-entropy: numbers, finite, of the targets'
        shape (the logits' without the class axis), `(batch, 1)`-like shapes that broadcast
        to it, or the targets' shape with a trailing 1 (squeezed here: TensorFlow's step
        failed on it). Another shape failed inside the step with each backend's own
        broadcasting error (torch a RuntimeError, TensorFlow an InvalidArgumentError), and a
        NaN or infinite weight made the loss NaN in silence."""
        arrays = isinstance(x, dict) and x and all(
            input_checks._is_array_like(v) for v in x.values())
        arrays = arrays or (not isinstance(x, dict) and input_checks._is_array_like(x))
        if (not arrays or not input_checks._is_array_like(weights)
                or input_checks.is_symbolic(weights)
                or any(input_checks.is_symbolic(v)
                       for v in (x.values() if isinstance(x, dict) else [x]))):
            return weights
        host = input_checks.to_host(weights) if not isinstance(weights, (list, tuple)) \
            else np.asarray(weights)
        if host.dtype == bool or not np.issubdtype(host.dtype, np.number):
            raise ValueError(
                f"`sample_weight` ({source}) must hold numbers; got dtype {host.dtype}.")
        if not np.isfinite(host).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(host))[0])
            raise ValueError(
                f"`sample_weight` ({source}) holds {host[where].item()!r} at index {where}; "
                "weights must be finite numbers (a NaN or infinite weight makes the loss "
                "NaN).")
        logits = self._logits_shape(x)
        if logits is None:
            return weights
        wanted = tuple(logits[:-1])
        shape = tuple(host.shape)
        if shape == wanted + (1,):
            return np.squeeze(host, -1)
        broadcasts = (len(shape) == len(wanted) and len(shape) > 0 and shape[0] == wanted[0]
                      and all(s in (w, 1) for s, w in zip(shape[1:], wanted[1:])))
        if not broadcasts:
            per_row = (f" or {(wanted[0],) + (1,) * (len(wanted) - 1)} (one weight a row)"
                       if len(wanted) > 1 else "")
            raise ValueError(
                f"`sample_weight` ({source}) has shape {shape}; the loss for these inputs has "
                f"one value per target, shape {wanted}: give weights of that shape{per_row}.")
        return weights

    def _check_target_shape(self, x, y, source):
        """Refuse `y=None` beside array inputs, and array targets whose shape is not the
        logits' for `x` without the class axis (or with it as 1): a sequence of another
        length or another batch failed inside the step with a broadcasting or indexing
        error that named neither (and on JAX could broadcast silently)."""
        arrays = isinstance(x, dict) and x and all(
            input_checks._is_array_like(v) for v in x.values())
        arrays = arrays or (not isinstance(x, dict) and input_checks._is_array_like(x))
        if not arrays or any(input_checks.is_symbolic(v)
                             for v in (x.values() if isinstance(x, dict) else [x])):
            return
        logits = self._logits_shape(x)
        if logits is None:
            return
        wanted = tuple(logits[:-1])
        if y is None:
            raise ValueError(
                f"`y` ({source}) is missing: the model's loss (a sparse cross-entropy) needs "
                f"class-id targets of shape {wanted} for these inputs"
                + (" (for a causal LM, the token ids shifted by one: "
                   "`GPTCausalLM.lm_batch(token_ids)` returns x, y and weights)"
                   if hasattr(self, "lm_batch") else "") + ".")
        if input_checks.is_symbolic(y) or not input_checks._is_array_like(y):
            return
        shape = tuple(np.shape(y) if isinstance(y, (list, tuple)) else y.shape)
        if shape not in (wanted, wanted + (1,)):
            raise ValueError(
                f"`y` ({source}) has shape {shape}; the logits for these inputs have shape "
                f"{tuple(logits)}, so the loss (a sparse cross-entropy) takes class ids of "
                f"shape {wanted}" + (f" (or {wanted + (1,)})" if wanted else "") + ".")

    def _logits_shape(self, x):
        """The output shape for inputs of `x`'s shapes (symbolic, remembered per shapes), or
        None where it cannot be worked out (the check is then left to Keras)."""
        items = sorted(x.items()) if isinstance(x, dict) else [(None, x)]
        shapes = tuple((k, tuple(np.shape(v) if isinstance(v, (list, tuple)) else v.shape))
                       for k, v in items)
        known = self.__dict__.setdefault("_logits_shapes", {})
        if shapes not in known:
            if len(known) >= 256:  # (many lengths: forget the oldest)
                del known[next(iter(known))]
            try:
                specs = {k: keras.KerasTensor(shape, dtype=_dtype_name(v))
                         for (k, shape), (_, v) in zip(shapes, items)}
                specs = specs if isinstance(x, dict) else specs[None]
                if isinstance(specs, dict) and hasattr(self, "_filled"):
                    specs = self._filled(specs)
                if isinstance(specs, dict) and any(v is None for v in specs.values()):
                    # Optional inputs left out: the functional graph's shape inference
                    # cannot run them as None; trace `call` instead (~0.1 s, once a shape).
                    from keras.src import backend as keras_backend

                    out = keras_backend.compute_output_spec(self.call, specs)
                else:
                    out = self.compute_output_spec(specs)  # (~1 ms)
                known[shapes] = tuple(out.shape) if isinstance(out, keras.KerasTensor) else None
            except Exception:  # noqa: BLE001  (no shape to check against: Keras checks)
                known[shapes] = None
        return known[shapes]

    def fit(self, *args, **kwargs):
        try:
            return self._run_checked("fit", args, kwargs,
                                     {"x": False, "validation_data": True})
        finally:
            # (torch: the logits' memory kept from step to step, `losses.tied_logits_into`,
            # is given back once the loop ends; `train_on_batch` keeps it for the next call)
            for layer in self._flatten_layers():
                layer.__dict__.pop("_logits_buffer", None)
            # (TensorFlow: the training step's graph is freed with the model; see
            # `kzoo.layers.gradients`)
            adopt_custom_gradients()
            allocator.release_memory()  # what malloc kept for the steps (kzoo.allocator)

    def evaluate(self, *args, **kwargs):
        try:
            return self._run_checked("evaluate", args, kwargs, {"x": False})
        finally:
            allocator.release_memory()

    def predict(self, *args, **kwargs):
        try:
            x = _signature("predict").bind(None, *args, **kwargs).arguments.get("x")
            if _empty_batch(x):  # (Keras' loop over no batch fails with an UnboundLocalError)
                return self.predict_on_batch(x)
            return self._run_checked("predict", args, kwargs, {"x": False})
        finally:
            allocator.release_memory()

    def train_on_batch(self, *args, **kwargs):
        return self._run_checked("train_on_batch", args, kwargs, {"x": False})

    def test_on_batch(self, *args, **kwargs):
        return self._run_checked("test_on_batch", args, kwargs, {"x": False})

    def predict_on_batch(self, *args, **kwargs):
        return self._run_checked("predict_on_batch", args, kwargs, {"x": False},
                                 keras_method=self._predict_on_batch)

    def _predict_on_batch(self, x):
        """Keras' `predict_on_batch` on each backend, with its outputs handed out without a
        copy where that is safe (`_numpy_outputs`): the same arrays, writable, the caller's
        own. On JAX, Keras' steps around the compiled function (build, the variables' state
        in and back) as in its `JAXTrainer.predict_on_batch`."""
        backend = keras.config.backend()
        if backend == "jax":
            if not all(layer.built for layer in self._flatten_layers()):
                with keras.StatelessScope():
                    self(x)
            self.make_predict_function()
            state = self._get_jax_state(trainable_variables=True,
                                        non_trainable_variables=True,
                                        metrics_variables=False, purge_model_variables=False)
            self._jax_state_synced = False
            outputs, state = self.predict_function(state, iter([(x,)]))
            self._jax_state = {"trainable_variables": state[0],
                               "non_trainable_variables": state[1]}
            self.jax_state_sync()
        elif backend in ("torch", "tensorflow"):
            self.make_predict_function()
            outputs = self.predict_function([(x,)])
        else:
            return super().predict_on_batch(x)
        return _numpy_outputs(outputs, lambda nbytes: _source_arrays(self, x, nbytes))

    def _base_config(self):
        """The `name`, `trainable` and `dtype` entries every kzoo model config starts with.

        A quantized model's `dtype` is a `DTypePolicyMap` (float default, one quantized
        policy per quantized layer path; see `kzoo.quantize`). A model with LoRA adapters
        on int8/int4 layers also has a `lora` entry, `{"rank", "alpha", "targets"}`: its
        saves keep the adapters apart from the integer kernels, and `from_config` enables
        LoRA with these settings so that loading puts them back (see `kzoo.lora`)."""
        from kzoo import lora
        from kzoo import quantize as quantization

        policy = quantization.policy_map(self) if self.built else None
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(policy or self.dtype_policy),
        }
        entry = lora.config_entry(self) if self.built else None
        if entry is not None:
            config["lora"] = entry
        return config

    @classmethod
    def from_config(cls, config):
        config, quantized = _split_quantization(_deserialize_dtype(dict(config)))
        entry = config.pop("lora", None)
        return _adapted(_quantized(cls(**config), quantized), entry)

    # === Fine-tuning and deployment (kzoo.lora, kzoo.quantize) ===

    def enable_lora(self, rank, targets=("query", "value"), alpha=None):
        """Add LoRA adapters to `targets` and freeze the rest (see `kzoo.lora.enable_lora`).

        Example:
        >>> model.enable_lora(4, targets=("query", "value"))
        >>> sum(int(np.prod(v.shape)) for v in model.trainable_weights)  # adapters only
        """
        from kzoo import lora

        return lora.enable_lora(self, rank, targets=targets, alpha=alpha)

    def save_lora_weights(self, path):
        """Write the LoRA adapters to an `.npz` file (see `kzoo.lora.save_lora_weights`).

        Example:
        >>> model.save_lora_weights("adapters.lora.npz")
        """
        from kzoo import lora

        return lora.save_lora_weights(self, path)

    def load_lora_weights(self, path):
        """Load adapters written by `save_lora_weights` (see `kzoo.lora.load_lora_weights`).

        Example:
        >>> fresh.load_lora_weights("adapters.lora.npz")
        """
        from kzoo import lora

        return lora.load_lora_weights(self, path)

    def merge_lora(self):
        """Fold the adapters into the kernels and remove them (see `kzoo.lora.merge_lora`).

        Example:
        >>> model.merge_lora()
        """
        from kzoo import lora

        return lora.merge_lora(self)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Keras' `Model.save`. With LoRA adapters on int8/int4-quantized layers the file
        keeps the integer kernels and scales as they are and the adapters apart, and the
        config records rank, alpha and targets: `keras.saving.load_model` gives the model
        back with its adapters, trainable, the rest frozen (see `kzoo.lora`). Refused
        (ValueError) before the file is opened for a backbone whose adapters were added on
        the task model holding it (see `kzoo.lora.check_savable`).

        Example:
        >>> model.save("gpt.keras")
        """
        from kzoo import lora

        lora.check_savable(self)
        return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Keras' `Model.save_weights` (adapters on int8/int4 layers kept apart, as `save`
        keeps them), refused before the file is opened where `save` is.

        Example:
        >>> model.save_weights("gpt.weights.h5")
        """
        from kzoo import lora

        lora.check_savable(self)
        return super().save_weights(filepath, overwrite=overwrite,
                                    max_shard_size=max_shard_size)

    def export(self, filepath, format="tf_saved_model", verbose=None,  # noqa: A002
               input_signature=None, shapes=None, **kwargs):
        """Export for inference to a TensorFlow SavedModel, ONNX or LiteRT (see
        `kzoo.export.export`: which formats each backend writes, the named axes of
        `shapes`, the exportable attention kernel).

        Example:
        >>> model.export("gpt.onnx", format="onnx", shapes={"sequence": 128})
        >>> onnxruntime.InferenceSession("gpt.onnx").run(None, {"token_ids": ids,
        ...                                                       "padding_mask": mask})
        """
        from kzoo import export as exporting

        return exporting.export(self, filepath, format=format, shapes=shapes,
                                input_signature=input_signature, verbose=bool(verbose),
                                **kwargs)

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Quantize the weights to "int8", "int4" or "float8" (see `kzoo.quantize.quantize`:
        which layers are quantized and which stay in float).

        Example:
        >>> model.quantize("int8")
        """
        from kzoo import quantize as quantization

        given = {**kwargs, "config": config, "filters": filters}
        given = sorted(key for key, value in given.items() if value is not None)
        if given:
            raise ValueError(
                f"kzoo models take quantize(mode) only; got {given}. Use "
                "keras.Model.quantize(model, ...) for Keras' other options."
            )
        return quantization.quantize(self, mode)


def _split_quantization(config):
    """`(config with a float dtype, {path: quantized policy name})` of a saved config whose
    `dtype` may be a `DTypePolicyMap` (see `kzoo.quantize`)."""
    from kzoo import quantize as quantization

    dtype, quantized = quantization.split_dtype(config.get("dtype"))
    if quantized:
        config["dtype"] = dtype
    return config, quantized


def _quantized(model, quantized):
    if quantized:
        from kzoo import quantize as quantization

        quantization.apply_quantization(model, quantized, f"the config of {model.name!r}")
    return model


def _adapted(model, entry):
    """`model` (rebuilt by `from_config`, quantized) with the LoRA adapters its config's
    `lora` entry records (see `kzoo.lora.config_entry`), before Keras loads the variables."""
    if entry is not None:
        from kzoo import lora

        lora.restore(model, entry, f"the config of {model.name!r}")
    return model


def _sum_sparse_gradients(optimizer):
    """On TensorFlow, hand `optimizer` every gradient as a dense tensor.

    The gradient of a table lookup (`ops.take`: BERT's segment embedding, T5's relative
    position bias, any embedding not tied to a dense head) is a `tf.IndexedSlices` with one
    entry per looked-up id, duplicates included. Keras 3.15's TensorFlow ops apply
    element-wise functions to its entries one by one (`keras.src.backend.tensorflow.sparse.
    elementwise_unary`), so Adam's second moment gets the sum of the squared entries of an
    id instead of the square of their sum: one Adam step of BERT's segment table moved
    0.013 away from JAX's and torch's (learning rate 0.01). Summing the entries first
    (`tf.convert_to_tensor`) gives the gradient the other backends use. Under a
    `tf.distribute` strategy the dense gradients are all-reduced as any other."""
    if keras.config.backend() != "tensorflow" or optimizer is None \
            or getattr(optimizer, "_kzoo_dense_gradients", False):
        return
    import tensorflow as tf

    apply = optimizer.apply

    def apply_dense(grads, trainable_variables=None):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        return apply(grads, trainable_variables)

    object.__setattr__(optimizer, "apply", apply_dense)
    object.__setattr__(optimizer, "_kzoo_dense_gradients", True)


_SIGNATURES = {}
# The methods whose JAX loop detaches the model's variables while it runs (Keras'
# `_get_jax_state(purge_model_variables=True)`); `_jax_variables_kept` guards these.
_DETACHING = ("fit", "evaluate", "predict")


@contextlib.contextmanager
def _jax_variables_kept(model):
    """On JAX, keep the model usable when `fit` / `evaluate` / `predict` stop with an error
    (e.g. a batch whose ids a wrapped generator refuses).

    Keras' JAX trainer detaches the variables' values (`_purge_model_variables`) while its
    loop runs and reattaches them at the end; `evaluate` and `predict` do not reattach them
    when the loop raises, nor does `fit` when the first step raises, which would leave a
    model whose weights are gone. On an error this reattaches Keras' last state
    (`jax_state_sync`), then the values held before the call for whatever is still
    detached; a variable the call created and detached (an optimizer slot built by the
    first `fit`) restarts from zeros, its initial value."""
    if keras.config.backend() != "jax":
        yield
        return
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables) + list(model.metrics_variables)
    if optimizer is not None:
        variables += list(optimizer.variables)
    saved = {id(v): v.value for v in variables}
    try:
        yield
    except BaseException:
        model.jax_state_sync()
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables) + list(model.metrics_variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        for v in variables:
            if getattr(v, "_value", 0) is None:  # detached by the trainer
                value = saved.get(id(v))
                v.assign(keras.ops.zeros(v.shape, v.dtype) if value is None else value)
        model._jax_state = None
        model._jax_state_synced = True
        raise


@contextlib.contextmanager
def _exact_tracing(enabled):
    """On TensorFlow, `tf.function`s made inside trace once per input shape: Keras makes
    its step functions with `reduce_retracing=True`, whose second shape traces with `None`
    dimensions (ViT's second image size then failed on TensorFlow alone)."""
    if not enabled or keras.config.backend() != "tensorflow":
        yield
        return
    import tensorflow as tf

    original = tf.function

    def exact(*args, **kwargs):
        kwargs["reduce_retracing"] = False
        return original(*args, **kwargs)

    tf.function = exact
    try:
        yield
    finally:
        tf.function = original


def _dtype_name(value):
    """The dtype of an array, a backend tensor or a list, as Keras names it."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = np.asarray(value).dtype
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        return "int32"


_TRAINING_OR_TESTING = ("fit", "evaluate", "train_on_batch", "test_on_batch")


def _empty_batch(x):
    """Whether `x` is arrays (a dict, list or tuple of them, or one) whose batch axis is
    empty: what `predict` answers with the model's empty outputs."""
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    shapes = [getattr(leaf, "shape", None) for leaf in leaves]
    return bool(shapes) and all(
        shape is not None and len(shape) > 0 and shape[0] == 0 for shape in shapes)


def _number_lists(value):
    """Whether `value` is a (nested) Python list or tuple whose leaves are all numbers."""
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(_number_lists(item) for item in value)
    return isinstance(value, (int, float, bool, np.number, np.bool_))


def _lists_as_arrays(data, tuples=False):
    """`data` with nested Python lists of numbers as NumPy arrays: one such list, or the
    values of a dict (or, with `tuples`, each part of an `(x, y[, sample_weight])` tuple).
    Keras' data adapters refused them in `fit`, `evaluate` and `predict` ("Unrecognized data
    type: x={'token_ids': [[1, 2, 3], ...]}") where calling the model and `generate` took
    them; a list of arrays (a model's several inputs) is left as it is."""
    if isinstance(data, dict):
        return {key: _lists_as_arrays(value) for key, value in data.items()}
    if tuples and isinstance(data, tuple):
        return tuple(_lists_as_arrays(part) for part in data)
    if _number_lists(data):
        array = np.asarray(data)
        return array if array.dtype != object else data
    return data


def _portable_compile_config(config, jit_compile_auto):
    """A compile config (`get_compile_config`) that loads on every backend.

    - Keras saves the `jit_compile` that "auto" resolved to on this backend: True on JAX,
      which on torch turned `torch.compile` on when the `.keras` file was loaded there (a
      GPT's first `predict` raised inductor's `LoweringException`). A model compiled with
      "auto" saves "auto", resolved again by the backend that loads it.
    - On torch an optimizer is the backend's subclass (`keras.optimizers.AdamW(...)` is a
      `keras.src.backend.torch.optimizers.torch_adamw.AdamW`), saved under that module: JAX
      and TensorFlow then built torch's optimizer, whose first update raised "expected
      Tensor as element 0 in argument 0". Such an entry (also a wrapped one, as a
      `LossScaleOptimizer`'s inner optimizer) names the public `keras.optimizers` class.
    """
    if not config:
        return config

    def portable(value):
        if isinstance(value, dict):
            value = {key: portable(item) for key, item in value.items()}
            module, name = value.get("module"), value.get("class_name")
            if (isinstance(module, str) and module.startswith("keras.src.backend.")
                    and isinstance(name, str) and hasattr(keras.optimizers, name)):
                value["module"] = "keras.optimizers"
        elif isinstance(value, (list, tuple)):
            value = type(value)(portable(item) for item in value)
        return value

    config = portable(dict(config))
    if jit_compile_auto:
        config["jit_compile"] = "auto"
    return config


def _signature(method):
    """The signature of Keras' own `Model.<method>` (with `self`), to bind a call's arguments
    by name."""
    if method not in _SIGNATURES:
        _SIGNATURES[method] = inspect.signature(getattr(keras.Model, method))
    return _SIGNATURES[method]


class FilledInputs:
    """Lets the input dict of a model leave out its optional inputs and the inputs it can
    fill in itself. Optional Keras inputs (BERT's `global_attention_mask`,
    `mask_positions`) run as None. A key of `_input_fills`, `{key: (like, value)}`, runs as
    a tensor shaped like the input `like` holding `value` everywhere: padding masks of ones
    (every token real) and BERT's segment ids of zeros, as in Hugging Face's models.
    `model(x)`, `fit`, `predict`, ... all fill in the same way (`__call__` and `call`)."""

    _input_fills = {}

    def _filled(self, inputs):
        if not (isinstance(inputs, dict) and isinstance(self.input, dict)):
            return inputs
        missing = [k for k, t in self.input.items()
                   if k not in inputs and input_checks.is_optional_input(t)]
        if missing:
            inputs = {**inputs, **{k: None for k in missing}}
        for key, (like, value) in self._input_fills.items():
            ids = inputs.get(like)
            if key in self.input and inputs.get(key) is None and ids is not None:
                host = isinstance(ids, (np.ndarray, list, tuple))  # (Keras refuses a mix)
                full_like = np.full_like if host else keras.ops.full_like
                inputs = {**inputs, key: full_like(ids, value, dtype="int32")}
        return inputs

    def __call__(self, *args, **kwargs):
        if "_initialized" in self.__dict__:
            if args:
                args = (self._filled(args[0]),) + args[1:]
            elif "inputs" in kwargs:
                kwargs["inputs"] = self._filled(kwargs["inputs"])
        return super().__call__(*args, **kwargs)

    def call(self, inputs, training=None, mask=None, **kwargs):
        # Functional.call's own signature: Keras passes `training` only to a `call` naming it.
        return super().call(self._filled(inputs), training=training, mask=mask, **kwargs)


class Backbone(FunctionalModel):
    """A functional backbone described by a family config (`config_class`).

    The backbone's constructor takes the config's fields as keyword arguments (the public
    API presets, converters and users call), builds `config = config_class(**fields)` first
    (which validates them all) and builds its layers from it. `backbone.config` is that
    dataclass, each field is also an attribute (`backbone.num_layers`), and `get_config()` is
    the base entries (name, trainable, dtype) plus exactly the config's fields, so
    `from_config(get_config())` rebuilds an identical model.
    """

    config_class = None

    def _store_config(self, config, dtype=None):
        """Keep `config` as `self.config` and each of its fields as an attribute; with
        `dtype`, make it the model's own dtype policy too (what `get_config` records, so
        `from_config` rebuilds a mixed-precision backbone as one)."""
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)
        self.config = config
        for name in config.field_names():
            setattr(self, name, getattr(config, name))

    def get_config(self):
        return {**self._base_config(), **self.config.to_dict()}


def class_loss(num_classes):
    """The default loss of a head with `num_classes` outputs, as transformers' sequence and
    image classifiers and its Graphormer pick theirs: one output is a regression (mean
    squared error), more are the logits of one class an example (sparse categorical
    cross-entropy on class ids). Several binary tasks per example need an explicit
    `keras.losses.BinaryCrossentropy(from_logits=True)`."""
    if num_classes == 1:
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# backbone -> the task models built on it (weakly held: a task model that is gone drops out)
_TASK_MODELS = weakref.WeakKeyDictionary()


def task_models_of(backbone):
    """The live task models whose `backbone` is `backbone` (a list; empty for none). What
    changes how a backbone computes without Keras seeing it (`kzoo.interpret.masked_heads`)
    drops the functions those models compiled around it too."""
    try:
        return list(_TASK_MODELS.get(backbone, ()))
    except TypeError:  # (an object that cannot be weakly referenced holds no task models)
        return []


class TaskModel(FunctionalModel):
    """A task model on a backbone: config = base entries, the backbone, `_task_config()`.

    `compile(optimizer, loss="auto", ...)`: "auto" is the task's `default_loss()` (the token
    models: `kzoo.losses.TokenCrossentropy`; the classifiers and Graphormer's predictor:
    `class_loss`, as transformers' heads choose theirs).
    """

    family = None
    task_name = None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "backbone" and value is not None:
            try:
                _TASK_MODELS.setdefault(value, weakref.WeakSet()).add(self)
            except TypeError:  # (not weakly referable: nothing to remember)
                pass

    def default_loss(self):
        """The loss `compile` uses when given none (None: the task has no default)."""
        return None

    def compile(self, optimizer="rmsprop", loss="auto", **kwargs):
        if isinstance(loss, str) and loss == "auto":
            loss = self.default_loss()
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def train_step(self, *args, **kwargs):  # (data) on torch and TF, (state, data) on JAX
        # torch: when nothing but the compiled loss reads the predictions (Keras' own
        # `compute_loss` and `compute_metrics`, no compiled metrics), `TokenCrossentropy`
        # may turn the logits' memory into their gradient instead of writing a new tensor
        # (`kzoo.losses.logits_released`).
        if not _on_torch():
            return super().train_step(*args, **kwargs)
        import torch

        if torch.compiler.is_compiling():
            # (`compile(jit_compile=True)`: the step is traced whole, and Dynamo failed on
            # these eager-only context managers, "expected len(self.block_stack) == 1")
            return super().train_step(*args, **kwargs)
        if args and _waits_for_device():
            args = (_on_device(args[0]),) + args[1:]
        with self._trainable_fixed_for_step(), self._device_batch_size():
            if self._predictions_unread_after_backward():
                from kzoo.losses import logits_released

                with logits_released():
                    return super().train_step(*args, **kwargs)
            return super().train_step(*args, **kwargs)

    @contextlib.contextmanager
    def _trainable_fixed_for_step(self):
        """torch: Keras' train step asks for `trainable_weights` three times, each a walk
        over every layer's weights (and here the unused layers' too): ~4 ms of the host's
        84 ms a step for GPT-2 small on an H200, where the step is bound by the host. Nothing
        changes which weights train inside one step: the list is walked once for it."""
        outer = self.__dict__.get("_step_trainable")
        self.__dict__["_step_trainable"] = self._without_unused(
            super().trainable_weights, [])[0]
        try:
            yield
        finally:
            self.__dict__["_step_trainable"] = outer

    @contextlib.contextmanager
    def _device_batch_size(self):
        """torch on CUDA: Keras' step weighs the loss tracker's update by the batch size, a
        Python int it copies to the device, and a copy from the host waits for the device's
        queued work: there, for the whole forward pass and the loss, with nothing left queued
        for the backward pass. The count is made on the device instead (`torch.full`)."""
        tracker = getattr(self, "_loss_tracker", None)
        if tracker is None or not _waits_for_device() or "update_state" in vars(tracker):
            yield
            return
        import torch

        keras_update = tracker.update_state

        def update_state(values, sample_weight=None):
            if isinstance(sample_weight, int) and isinstance(values, torch.Tensor):
                sample_weight = torch.full((), float(sample_weight), dtype=torch.float32,
                                           device=values.device)
            return keras_update(values, sample_weight=sample_weight)

        object.__setattr__(tracker, "update_state", update_state)
        try:
            yield
        finally:
            del vars(tracker)["update_state"]

    def _predictions_unread_after_backward(self):
        return (getattr(self, "_compile_metrics", None) is None
                and type(self).compute_metrics is keras.Model.compute_metrics
                and type(self).compute_loss is keras.Model.compute_loss)

    def id_inputs(self):
        """The backbone's id inputs (a task model takes the backbone's inputs)."""
        backbone = getattr(self, "backbone", None)
        return backbone.id_inputs() if backbone is not None else ()

    def _task_config(self):
        return {}

    # === Weights the task does not use ===

    def _unused_layers(self):
        """Layers of the backbone that this task's outputs never depend on (BERT's pooler
        under the masked-LM head, which Hugging Face's `BertForMaskedLM` does not even
        build). Their weights count as non-trainable for this model only: `fit` neither
        warns that they get no gradient (torch, TensorFlow: Keras' "Gradients do not exist
        for variables") nor moves them (JAX: a zero gradient, which AdamW's weight decay
        still applied). The backbone's own lists, its saved weights and another task on the
        same backbone (a classifier trains the pooler) are unchanged."""
        return ()

    def _unused_ids(self):
        return {id(v) for layer in self._unused_layers() for v in layer.weights}

    def _without_unused(self, trainable, non_trainable):
        unused = self._unused_ids()
        if not unused or not self.trainable:
            return trainable, non_trainable
        return ([v for v in trainable if id(v) not in unused],
                non_trainable + [v for v in trainable if id(v) in unused])

    @property
    def trainable_weights(self):
        fixed = self.__dict__.get("_step_trainable")
        if fixed is not None:  # (inside a torch train step: see `_trainable_fixed_for_step`)
            return list(fixed)
        return self._without_unused(super().trainable_weights, [])[0]

    @property
    def non_trainable_weights(self):
        return self._without_unused(super().trainable_weights,
                                    super().non_trainable_weights)[1]

    @property
    def trainable_variables(self):
        return self._without_unused(super().trainable_variables, [])[0]

    @property
    def non_trainable_variables(self):
        return self._without_unused(super().trainable_variables,
                                    super().non_trainable_variables)[1]

    def get_config(self):
        return {
            **self._base_config(),
            "backbone": keras.layers.serialize(self.backbone),
            **self._task_config(),
        }

    @classmethod
    def from_config(cls, config):
        config, quantized = _split_quantization(_deserialize_dtype(dict(config)))
        entry = config.pop("lora", None)
        config["backbone"] = keras.layers.deserialize(config["backbone"])
        return _adapted(_quantized(cls(**config), quantized), entry)


class HeadTransform(keras.layers.Layer):
    """`LayerNorm(act(Dense(x)))` at the input's width: the transform in front of an output
    head (BERT's masked-LM head, Graphormer's head). Sublayers `dense` and `layer_norm`.

    Args:
        activation: activation name (see `kzoo.layers.get_activation`).
        layer_norm_epsilon: epsilon of the layer norm.
        kernel_initializer: initialiser of the dense kernel.
    """

    def __init__(self, activation="gelu", layer_norm_epsilon=1e-5,
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        get_activation(activation)
        self.activation = activation
        self.layer_norm_epsilon = check_positive_float("layer_norm_epsilon", layer_norm_epsilon)
        self.kernel_initializer = serialize_initializer(kernel_initializer)
        self._activation_fn = get_activation(activation)
        self.dense = None
        self.layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="layer_norm"
        )

    def build(self, input_shape):
        self.dense = keras.layers.Dense(
            input_shape[-1],
            kernel_initializer=keras.initializers.get(self.kernel_initializer),
            dtype=self.dtype_policy,
            name="dense",
        )
        self.dense.build(input_shape)
        self.layer_norm.build(input_shape)
        self.built = True

    def call(self, inputs):
        return self.layer_norm(self._activation_fn(self.dense(inputs)))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "activation": self.activation,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "kernel_initializer": self.kernel_initializer,
            }
        )
        return config
