"""Checks of the token ids (and other embedding ids) a user passes to a model.

An embedding lookup clips an id outside its table into range (`kzoo.layers.TokenEmbedding`
does so on purpose: XLA and TensorFlow would otherwise read garbage or fail inside the
compiled step), so a wrong id would silently become another token. Every user entry point of
a model with id inputs therefore checks its data once, on the host, before anything is
compiled (`kzoo.models.base.FunctionalModel` wires it in):

- `model(x)` with concrete inputs (NumPy arrays, lists, eager torch / TensorFlow / JAX
  tensors). Symbolic or traced inputs (a `keras.Input`, inside `jax.jit`, `tf.function`,
  `torch.compile`, Keras' meta-device shape inference) are not checked: the check belongs to
  whoever feeds the compiled function, outside it;
- `fit`, `evaluate`, `predict`, `train_on_batch`, `test_on_batch`, `predict_on_batch`:
  arrays, tensors and dicts of them are checked once up front (`fit`'s `validation_data`
  too); a `tf.data.Dataset`, a Python generator or a `keras.utils.PyDataset` is wrapped so
  that each batch is checked on the host as it is produced (a `tf.numpy_function` in the
  dataset's own pipeline; the generator / `__getitem__` itself), never inside the compiled
  train step. Inside those methods the model's own `__call__` does not check again.

The rules (`check_inputs`):

- an id input must have an integer dtype: float, bool, complex and object arrays are
  refused (a float id would be truncated), with a `ValueError` naming the input, its dtype
  and shape;
- every id must lie in `[0, size)` of its table; the first one that does not raises a
  `ValueError` naming the input, the id, its position (e.g. "batch row 1, token 5") and the
  allowed range with the field it comes from (`vocabulary_size=260`);
- document ids of packed rows (`DocumentIdInput`, GPT's and BERT's `document_ids` with
  `packed_inputs=True`): integer, the shape of the token ids, >= 0, and >= 1 where the
  padding mask marks a real token;
- padding: where an input has a padding mask (GPT's and BERT's `padding_mask`, T5's
  `encoder_padding_mask` / `decoder_padding_mask`), the mask must have the input's shape
  (a mask of another batch would broadcast silently), and the positions it marks as padding
  (0 / False) are not checked and may hold anything, e.g. the -1 fillers some pipelines use:
  the model never attends to them and their ids are clipped by the embedding. Every
  position the mask marks as a real token must hold a valid id. Graphormer has no mask
  input: its padding is id 0, which every table holds.

The cost is one vectorised min/max per id input on the host (one conversion of a backend
tensor to NumPy); the position of a bad id is only looked for once the min/max has failed.

Example:
>>> specs = (IdInput("token_ids", 260, "vocabulary_size", mask="padding_mask"),)
>>> check_inputs({"token_ids": np.array([[1, 2, 300]]), "padding_mask": np.ones((1, 3))},
...              specs)
ValueError: `token_ids` (model input) holds id 300 at batch row 0, token 2; ids must lie
in [0, 260) (vocabulary_size=260) ...
"""

import collections.abc
import contextlib
import dataclasses
import sys
import threading
import types
from typing import Optional

import keras
import numpy as np

# === Specification ===


@dataclasses.dataclass(frozen=True)
class IdInput:
    """One id input of a model: its key, the size of its table and how to name things.

    Args:
        key: the input's key in the model's input dict (e.g. "token_ids").
        size: ids must lie in `[0, size)`.
        size_name: how the model names that bound, for messages (e.g. "vocabulary_size",
            "num_atoms + 1").
        mask: the key of the padding mask of this input, if any: positions where it is
            0 / False are not checked.
        axes: names of the array's axes, to say where a bad id is ("batch row", "token").
        max_length: optional, the longest sequence (axis 1) the model takes (a learned
            position table's `max_sequence_length`): longer ones are refused by name on
            every backend (TensorFlow's graph failed with a slicing error).
    """

    key: str
    size: int
    size_name: str
    mask: Optional[str] = None
    axes: tuple = ("batch row", "token")
    max_length: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class DocumentIdInput:
    """The document ids of packed rows (`document_ids`: 1, 2, 3, ... the documents of a
    row, 0 padding; see `kzoo.layers.document_mask`).

    Rules: integer dtype; the shape of the input `like` (the token ids); every id >= 0; and
    >= 1 wherever the padding mask `mask` marks a real token (a real token with id 0 would
    attend to nothing). There is no upper bound.

    Args:
        key: the input's key (e.g. "document_ids").
        like: the key of the input whose shape it must have (e.g. "token_ids").
        mask: the key of the padding mask, if any.
        axes: names of the array's axes, for messages.
    """

    key: str
    like: Optional[str] = None
    mask: Optional[str] = None
    axes: tuple = ("batch row", "token")


@dataclasses.dataclass(frozen=True)
class PositionInput:
    """Positions into the sequence of another input (e.g. `mask_positions` into
    `token_ids`): integer dtype, `(batch, n)` with the batch of `like`, every value in
    `[0, seq)`, `seq` the length of `like`.

    Args:
        key: the input's key (e.g. "mask_positions").
        like: the key of the input whose sequence the positions index (e.g. "token_ids").
        axes: names of the array's axes, for messages.
    """

    key: str
    like: str
    axes: tuple = ("batch row", "entry")


@dataclasses.dataclass(frozen=True)
class FloatInput:
    """A real-valued input (ViT's `images`, Graphormer's `attn_bias`).

    Rules: a number dtype (bool, complex and object arrays refused); `len(axes)` axes (one
    example without its batch axis is named as such); every value finite (a NaN or
    infinite pixel made every output NaN, and `fit` turned every weight NaN in silence),
    except -inf where `negative_infinity` (an additive mask's "never attend"); and with
    `pair_of`, the shape `(batch, n + 1, n + 1)` for the `(batch, n, ...)` of that input
    (Graphormer's graph token plus its nodes).

    Args:
        key: the input's key (its only key for a model of one input).
        axes: names of the array's axes, for messages.
        negative_infinity: whether -inf is allowed.
        pair_of: the key of the input whose axis 1 sizes this one's last two axes (+1).
    """

    key: str
    axes: tuple
    negative_infinity: bool = False
    pair_of: Optional[str] = None


def is_optional_input(tensor):
    """True for a functional model's `keras.Input(..., optional=True)` (e.g. BERT's
    `mask_positions`): a model runs without it, so checks and exports may leave it out."""
    history = getattr(tensor, "_keras_history", None)
    layer = getattr(history, "operation", None)
    return bool(getattr(layer, "optional", False))


def check_positions(values, spec, source="model input"):
    """Raise `ValueError` unless `values[spec.key]` (if given) are valid positions into
    `values[spec.like]` (see `PositionInput`); symbolic inputs are skipped."""
    value = values.get(spec.key)
    like = values.get(spec.like)
    if value is None or is_symbolic(value):
        return
    array = to_host(value)
    check_integer_dtype(array, spec.key, source)
    if like is None or is_symbolic(like):
        return
    shape = tuple(np.shape(to_host(like)))
    if array.ndim != 2 or len(shape) < 2 or array.shape[0] != shape[0]:
        raise ValueError(
            f"`{spec.key}` ({source}) must have shape (batch, n) with the batch of "
            f"`{spec.like}` {shape}; got shape {tuple(array.shape)}."
        )
    if array.size == 0:
        return
    length = shape[1]
    bad = (array < 0) | (array >= length)
    if not bad.any():
        return
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), array.shape))
    raise ValueError(
        f"`{spec.key}` ({source}) holds position {int(array[index])} at "
        f"{_where(index, spec.axes)}; positions must lie in [0, {length}) (the length of "
        f"`{spec.like}`). A gather would silently clip or wrap it."
    )


def check_rank(array, spec, source="model input"):
    """Raise `ValueError` unless `array` has one axis per name of `spec.axes`; one example
    without its batch axis (one axis short) is named as such."""
    if array.ndim == len(spec.axes):
        return
    hint = ""
    if array.ndim == len(spec.axes) - 1:
        hint = (f" It looks like one example without its batch axis: add it, e.g. "
                f"`x[None]` for a batch of one.")
    raise ValueError(
        f"`{spec.key}` ({source}) must have {len(spec.axes)} axes "
        f"({', '.join(spec.axes)}); got shape {tuple(array.shape)}.{hint}")


def check_float_input(values, spec, source="model input"):
    """Raise `ValueError` unless `values[spec.key]` (if given, not symbolic) follows the
    rules of its `FloatInput` spec."""
    value = values.get(spec.key)
    if value is None or is_symbolic(value):
        return
    array = to_host(value)
    if array.dtype == object or array.dtype == bool or not (
            np.issubdtype(array.dtype, np.number) and not np.iscomplexobj(array)):
        raise ValueError(
            f"`{spec.key}` ({source}) must hold real numbers; got an array of dtype "
            f"{array.dtype} and shape {tuple(array.shape)}.")
    check_rank(array, spec, source)
    if spec.pair_of is not None:
        like = values.get(spec.pair_of)
        if like is not None and not is_symbolic(like):
            batch, nodes = np.shape(to_host(like))[:2]
            expected = (batch, nodes + 1, nodes + 1)
            if tuple(array.shape) != expected:
                raise ValueError(
                    f"`{spec.key}` ({source}) must have shape (batch, n + 1, n + 1) = "
                    f"{expected} for the {nodes} entries a row of `{spec.pair_of}` (shape "
                    f"{tuple(np.shape(to_host(like)))}) plus the graph token; got shape "
                    f"{tuple(array.shape)}.")
    if not np.issubdtype(array.dtype, np.floating) or array.size == 0:
        return
    bad = ~np.isfinite(array)
    if spec.negative_infinity:
        bad &= ~np.isneginf(array)
    if not bad.any():
        return
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), array.shape))
    allowed = ("finite numbers, or -inf for a pair that must not attend"
               if spec.negative_infinity else "finite numbers")
    raise ValueError(
        f"`{spec.key}` ({source}) holds {array[index]} at {_where(index, spec.axes)}; it "
        f"must hold {allowed} (a NaN or infinity would spread to every output and, in "
        "`fit`, to the weights).")


def check_document_ids(values, spec, source="model input"):
    """Raise `ValueError` unless `values[spec.key]` are valid document ids (see
    `DocumentIdInput`); symbolic inputs are skipped."""
    value = values.get(spec.key)
    if value is None and spec.like in values:
        raise ValueError(
            f"`{spec.key}` ({source}) is missing: this model takes packed rows "
            f"(packed_inputs=True) and needs the document of each token, 1, 2, ... a row and "
            f"0 for padding (`kzoo.data.pack` builds them; one document a row: the padding "
            f"mask); got the inputs {sorted(values)}."
        )
    if value is None or is_symbolic(value):
        return
    array = to_host(value)
    check_integer_dtype(array, spec.key, source)
    like = values.get(spec.like) if spec.like else None
    if like is not None and not is_symbolic(like):
        shape = tuple(np.shape(to_host(like)))
        if tuple(array.shape) != shape:
            raise ValueError(
                f"`{spec.key}` ({source}) must have the shape of `{spec.like}` {shape}; got "
                f"shape {tuple(array.shape)}."
            )
    if array.size == 0:
        return
    bad = array < 0
    rule = "must be >= 0 (0 = padding, 1, 2, ... = the documents of a row)"
    if not bad.any():
        mask = values.get(spec.mask) if spec.mask else None
        if mask is None or is_symbolic(mask):
            return
        mask = to_host(mask)
        if mask.shape != array.shape:
            return
        bad = (array == 0) & mask.astype(bool)
        rule = (f"must be >= 1 where `{spec.mask}` marks a real token (0 is padding: a "
                "token of document 0 attends to nothing)")
        if not bad.any():
            return
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), array.shape))
    raise ValueError(
        f"`{spec.key}` ({source}) holds document id {int(array[index])} at "
        f"{_where(index, spec.axes)}; document ids {rule}."
    )


# === Host conversion ===


def _module(value):
    return type(value).__module__.split(".")[0]


def is_symbolic(value):
    """True for a tensor without concrete values: a `keras.KerasTensor`, a JAX tracer, a
    TensorFlow graph tensor, a torch meta / fake tensor or any tensor while `torch.compile`
    traces. Such inputs are not checked (they are being traced, not fed)."""
    if isinstance(value, keras.KerasTensor):
        return True
    module = _module(value)
    if module == "jax" or module == "jaxlib":
        import jax

        return isinstance(value, jax.core.Tracer)
    if module == "torch":
        import torch

        if not isinstance(value, torch.Tensor):
            return False
        if value.is_meta or type(value).__name__ == "FakeTensor":
            return True
        return bool(torch.compiler.is_compiling())
    if module == "tensorflow":
        tf = sys.modules["tensorflow"]
        return not hasattr(value, "numpy") or tf.is_symbolic_tensor(value)
    return False


def to_host(value):
    """`value` (array, list, backend tensor) as a NumPy array, converted once."""
    if isinstance(value, np.ndarray):
        return value
    module = _module(value)
    if module == "torch":
        return value.detach().cpu().numpy()
    if module == "tensorflow":
        return value.numpy()
    return np.asarray(value)


def _is_numbers(value):
    """True for a number or a (nested) list / tuple of numbers (the first of each level
    decides; an empty list counts)."""
    while isinstance(value, (list, tuple)):
        if not value:
            return True
        value = value[0]
    return isinstance(value, (int, float, complex, np.generic))


def _is_array_like(value):
    """True for an array, a backend tensor or a (nested) list of numbers: what a model may
    take as one input (a list of arrays, one per input, is not)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return True
    if isinstance(value, (list, tuple)):
        return _is_numbers(value)
    return _module(value) in ("jax", "jaxlib", "torch", "tensorflow") or isinstance(
        value, keras.KerasTensor
    )


# === The checks ===


def check_mask_values(mask, key, source="model input"):
    """A padding mask holds 1 / True (a token) and 0 / False (padding) only: other values
    (0.5, -1, NaN) were read as padding on one backend and as a token on another."""
    mask = np.asarray(mask)
    if mask.dtype == bool or mask.size == 0:
        return
    if not (np.issubdtype(mask.dtype, np.number) and np.isin(mask, (0, 1)).all()):
        bad = (mask.reshape(-1)[~np.isin(mask.reshape(-1), (0, 1))][0].item()
               if np.issubdtype(mask.dtype, np.number) else mask.dtype)
        raise ValueError(
            f"`{key}` ({source}) must hold only 1 / True (a token) and 0 / False (padding); "
            f"got {bad!r} (dtype {mask.dtype}).")


def check_targets(y, classes, ignore_class=None, source="fit's y"):
    """Class-id targets of a sparse cross-entropy: whole numbers in `[0, classes)` (or
    `ignore_class`), every entry (a weight of 0 too: TensorFlow's loss asserts them all).
    Out of range, JAX's loss read them as 0 (a loss of 0.0, silently), torch and
    TensorFlow failed inside the step; a fraction was truncated on every backend. Arrays
    and tensors only (a dataset's batches are not checked here)."""
    if y is None or is_symbolic(y) or not _is_array_like(y):
        return
    y = to_host(y)
    if y.dtype == bool or not np.issubdtype(y.dtype, np.number):
        raise ValueError(f"`y` ({source}) must hold integer class ids; got dtype {y.dtype}.")
    valid = (y >= 0) & (y < classes) & (y == np.floor(y))
    if ignore_class is not None:
        valid |= y == ignore_class
    if valid.all():
        return
    where = tuple(int(i) for i in np.argwhere(~valid)[0])
    raise ValueError(
        f"`y` ({source}) holds {y[where].item()!r} at index {where}; the loss (a sparse "
        f"cross-entropy) takes whole class ids in [0, {classes}), the logits' last axis"
        + (f", or ignore_class={ignore_class}" if ignore_class is not None else "")
        + ".")


def check_integer_dtype(array, key, source="model input"):
    """Raise `ValueError` unless `array` (NumPy) has an integer dtype (bool refused)."""
    if array.dtype == object or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"`{key}` ({source}) must hold integer ids; got an array of dtype {array.dtype} "
            f"and shape {tuple(array.shape)}. Non-integer ids are refused rather than "
            "truncated: cast them yourself (e.g. `.astype('int32')`) if they are ids."
        )


def _where(index, axes):
    if len(index) == len(axes):
        return ", ".join(f"{axis} {i}" for axis, i in zip(axes, index))
    return f"index {tuple(index)}"


def check_id_range(array, spec, mask=None, source="model input"):
    """Raise `ValueError` naming the first id of integer `array` outside `[0, spec.size)`.

    `mask` (optional, the shape of `array`): only positions where it is non-zero / True are
    checked. One min/max when every id is in range; the position is looked for only then.
    """
    if array.size == 0:
        return
    low, high = array.min(), array.max()
    if low >= 0 and high < spec.size:
        return
    bad = (array < 0) | (array >= spec.size)
    masked = ""
    if mask is not None:
        mask = to_host(mask)
        if mask.shape == array.shape:
            bad &= mask.astype(bool)
            masked = f" where `{spec.mask}` marks a real token"
    if not bad.any():
        return
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), array.shape))
    value = int(array[index])
    raise ValueError(
        f"`{spec.key}` ({source}) holds id {value} at {_where(index, spec.axes)}; ids must "
        f"lie in [0, {spec.size}) ({spec.size_name}={spec.size}){masked}. An embedding would "
        "silently clip it to another id."
    )


def check_inputs(inputs, specs, source="model input"):
    """Check the id inputs of `inputs` (a dict of arrays / tensors, or one array for the
    first of `specs`) against `specs` (a sequence of `IdInput`).

    Raises `ValueError` for a non-integer dtype or an id out of range (see the module).
    Inputs that are symbolic or traced are not checked, nor are structures other than a
    dict or one array / tensor / list (Keras itself refuses those for kzoo's models).
    """
    if not specs or inputs is None:
        return
    if isinstance(inputs, dict):
        values = inputs
    elif _is_array_like(inputs):
        values = {specs[0].key: inputs}
    else:
        return
    batches = {}  # axis name -> (key, size) of the first input with that batch axis
    mask_shapes = {}  # mask key -> (key, shape) of the first id input checked against it
    for spec in specs:
        if isinstance(spec, DocumentIdInput):
            check_document_ids(values, spec, source)
            continue
        if isinstance(spec, PositionInput):
            check_positions(values, spec, source)
            continue
        if isinstance(spec, FloatInput):
            check_float_input(values, spec, source)
            continue
        value = values.get(spec.key)
        if value is None or is_symbolic(value):
            continue
        array = to_host(value)
        check_integer_dtype(array, spec.key, source)
        check_rank(array, spec, source)
        # (a row of no tokens failed inside attention: JAX with a ZeroDivisionError from a
        # reshape, torch and TensorFlow naming `query`)
        if array.ndim >= 2 and spec.axes[1:2] == ("token",) and array.shape[1] == 0:
            raise ValueError(
                f"`{spec.key}` ({source}) has no tokens (shape {tuple(array.shape)}); every "
                "row needs at least one token.")
        if spec.max_length is not None and array.ndim >= 2 and array.shape[1] > spec.max_length:
            raise ValueError(
                f"`{spec.key}` ({source}) has {array.shape[1]} tokens a row; the model takes "
                f"at most max_sequence_length={spec.max_length} (its learned position "
                "table).")
        first = mask_shapes.setdefault(spec.mask, (spec.key, array.shape))
        if spec.mask and array.shape != first[1]:
            # (BERT's `segment_ids` of another shape than `token_ids` blamed the padding mask,
            # which the model may have made itself from `token_ids`, and without a mask
            # failed deep inside the model: torch naming `Add`)
            raise ValueError(
                f"`{spec.key}` ({source}) has shape {tuple(array.shape)}; it must have the "
                f"shape of `{first[0]}`, {tuple(first[1])} (one entry a token).")
        mask = values.get(spec.mask) if spec.mask else None
        if mask is not None and is_symbolic(mask):
            mask = None
        if mask is not None:
            mask = to_host(mask)
            if mask.shape != array.shape:  # (it would broadcast, or fail deep inside)
                raise ValueError(
                    f"`{spec.mask}` ({source}) has shape {tuple(mask.shape)}; it must have "
                    f"the shape of `{spec.key}`, {tuple(array.shape)} (one entry a token)."
                )
            check_mask_values(mask, spec.mask, source)
        # (T5's encoder and decoder inputs of two batch sizes failed inside cross-attention,
        # naming `query` and `key`)
        if array.ndim >= 1:
            first = batches.setdefault(spec.axes[0], (spec.key, array.shape[0]))
            if first[1] != array.shape[0]:
                raise ValueError(
                    f"`{spec.key}` ({source}) has a batch of {array.shape[0]} and "
                    f"`{first[0]}` a batch of {first[1]}; the inputs of one call must have "
                    "the same batch size.")
        check_id_range(array, spec, mask, source)


# === Entry points: when to check ===

_state = threading.local()


def checks_suspended():
    """True inside `suspend_checks()` on this thread: an entry point that has already
    checked its data (e.g. `fit`) runs the model, whose `__call__` must not check again."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def suspend_checks():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def features(batch):
    """The model inputs `x` of a batch: `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`."""
    if isinstance(batch, tuple) and 1 <= len(batch) <= 3:
        return batch[0]
    return batch


# A check that failed inside a data pipeline (a `tf.data` map, a generator run by
# `tf.data.Dataset.from_generator`): TensorFlow turns the `ValueError` into one of its own
# errors; `pipeline_errors` turns it back.
_pipeline_error = None


def _check_in_pipeline(x, specs, source):
    global _pipeline_error
    try:
        check_inputs(x, specs, source)
    except ValueError as error:
        _pipeline_error = error
        raise


@contextlib.contextmanager
def pipeline_errors():
    """Re-raise, as the original `ValueError`, a check that failed in a data pipeline and
    reached the caller wrapped in another framework's error."""
    global _pipeline_error
    _pipeline_error = None
    try:
        yield
    except ValueError:
        raise
    except Exception as error:
        recorded = _pipeline_error
        if recorded is not None and str(recorded) in str(error):
            raise ValueError(str(recorded)) from None
        raise
    finally:
        _pipeline_error = None


def _is_tf_dataset(data):
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(data, tf.data.Dataset)


def _checked_tf_dataset(dataset, specs, source):
    """`dataset` with each element's ids checked on the host (a `tf.numpy_function` whose
    result the element depends on), in the dataset's own pipeline."""
    tf = sys.modules["tensorflow"]

    def check_element(*element):
        batch = element[0] if len(element) == 1 else element
        x = features(batch)
        if isinstance(x, dict):
            keys = [k for s in specs
                    for k in (s.key, getattr(s, "mask", None), getattr(s, "like", None),
                              getattr(s, "pair_of", None))
                    if k is not None and k in x]
            keys = list(dict.fromkeys(keys))
            tensors = [x[k] for k in keys]
        else:
            keys, tensors = [specs[0].key], [x]

        def run(*arrays):
            _check_in_pipeline(dict(zip(keys, arrays)), specs, f"a batch of {source}")
            return np.bool_(True)

        checked = tf.numpy_function(run, tensors, tf.bool, stateful=True,
                                    name="kzoo_check_ids")
        with tf.control_dependencies([checked]):
            return tf.nest.map_structure(tf.identity, batch)

    return dataset.map(check_element)


def _checked_generator(generator, specs, source):
    for i, batch in enumerate(generator):
        _check_in_pipeline(features(batch), specs, f"batch {i} of {source}")
        yield batch


class CheckedPyDataset(keras.utils.PyDataset):
    """A `keras.utils.PyDataset` whose batches are checked as `__getitem__` produces them;
    everything else (length, epoch hooks, workers) is the wrapped dataset's."""

    def __init__(self, dataset, specs, source):
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset = dataset
        self.specs = specs
        self.source = source

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def __getitem__(self, index):
        batch = self.dataset[index]
        _check_in_pipeline(features(batch), self.specs, f"batch {index} of {self.source}")
        return batch

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


def checked_data(data, specs, source, batch=False):
    """`data` as given to `fit` / `evaluate` / `predict` (`x`, or with `batch=True` a
    `validation_data` that may be an `(x, y[, w])` tuple), with its ids checked: arrays,
    tensors and dicts of them now; a `tf.data.Dataset`, a generator or a
    `keras.utils.PyDataset` wrapped to check each batch as it is produced. Returns what to
    pass on to Keras."""
    if not specs or data is None:
        return data
    if _is_tf_dataset(data):
        return _checked_tf_dataset(data, specs, source)
    if isinstance(data, types.GeneratorType):
        return _checked_generator(data, specs, source)
    if isinstance(data, keras.utils.PyDataset):
        return CheckedPyDataset(data, specs, source)
    check_inputs(features(data) if batch else data, specs, source)
    return data


# === Prompt checks of `generate` (kzoo.generation re-exports these names) ===


def integer_array(values, name):
    """`values` as a NumPy integer array; a float or boolean array is refused, not cast, and
    so is a one-pass iterator (a generator) or a set, by name."""
    if isinstance(values, (collections.abc.Iterator, set, frozenset)):
        raise ValueError(
            f"`{name}` must be a list, tuple or array of token ids (or token id lists); got a "
            f"{type(values).__name__}: make it a list first (`list(...)`)."
        )
    array = np.asarray(to_host(values) if not isinstance(values, (list, tuple)) else values)
    if array.dtype == object or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"`{name}` must hold integer token ids; got an array of dtype {array.dtype} "
            f"and shape {array.shape} (cast it to int32 yourself if the values are ids)."
        )
    return array


def integer_rows(rows, name):
    """A list of token id sequences -> a list of lists of Python ints (non-integers refused)."""
    out = []
    for i, row in enumerate(rows):
        values = []
        for j, token in enumerate(row):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                raise ValueError(
                    f"`{name}` must hold integer token ids; got {token!r} (of type "
                    f"{type(token).__name__}) at prompt {i}, token {j}."
                )
            values.append(int(token))
        out.append(values)
    return out


def prompt_rows(prompts, name="prompts"):
    """A list / tuple of token id rows (lists, tuples or 1-D arrays, any lengths) -> a list of
    lists of Python ints ([] for an empty list); None when `prompts` is not such a list (an
    array, one flat list).

    A row that is not 1-D, or rows mixed with single ids, is refused by name (were NumPy's
    "inhomogeneous shape" error, or, for T5, a nested row flattened in silence)."""
    if not isinstance(prompts, (list, tuple)):
        return None
    if not prompts:
        return []
    # (a backend tensor row counts as an array row: a list of 1-D torch / TensorFlow / JAX
    # tensors of different lengths failed with NumPy's "inhomogeneous shape" error, naming
    # no argument, where the same NumPy rows worked)
    prompts = [to_host(p) if _module(p) in ("torch", "tensorflow", "jax", "jaxlib")
               and len(getattr(p, "shape", ())) >= 1 else p for p in prompts]
    is_row = [isinstance(p, (list, tuple)) or (isinstance(p, np.ndarray) and p.ndim >= 1)
              for p in prompts]
    if not any(is_row):
        return None
    rows = []
    for i, (row, ok) in enumerate(zip(prompts, is_row)):
        if not ok:
            raise ValueError(
                f"`{name}` mixes token id lists and single values: prompt {i} is {row!r} (of "
                f"type {type(row).__name__}); give a list of token id lists (one a prompt), or "
                "one flat list of ids for a single prompt."
            )
        if isinstance(row, np.ndarray):
            if row.ndim != 1:
                raise ValueError(
                    f"`{name}` must hold 1-D token id rows; prompt {i} is an array of shape "
                    f"{row.shape}."
                )
            row = list(row)
        rows.append(row)
    return integer_rows(rows, name)


def prompt_dict(prompts, ids_key, mask_key, padding_mask=None, hint=""):
    """`generate`'s prompts given as a dict of the model's own input names ->
    `(ids, mask)`: the integer id array under `ids_key` and the mask under `mask_key` (or
    `padding_mask`, or None).

    Any other key is refused by name with the allowed ones (a misspelled mask key was
    ignored in silence: every token was taken as real), and so is a mask given both ways.
    `hint` ends the message about unknown keys.

    Example:
    >>> prompt_dict({"token_ids": [[5, 6]]}, "token_ids", "padding_mask")
    (array([[5, 6]]), None)
    """
    allowed = [ids_key, mask_key]
    unknown = [key for key in prompts if key not in allowed]
    if unknown:
        raise ValueError(
            f"`prompts` as a dict takes the keys {allowed} (the second optional); got "
            f"unknown key(s) {unknown}{hint}."
        )
    if ids_key not in prompts:
        raise ValueError(
            f"`prompts` as a dict needs {ids_key!r} (and optionally {mask_key!r}); got keys "
            f"{list(prompts)}."
        )
    if padding_mask is not None and mask_key in prompts:
        raise ValueError(
            f"Give the padding mask once: `padding_mask` or the dict's {mask_key!r}, not "
            "both."
        )
    return integer_array(prompts[ids_key], ids_key), prompts.get(mask_key, padding_mask)


def check_token_ids(ids, vocabulary_size, mask=None):
    """Raise `ValueError` naming the first id outside `[0, vocabulary_size)` and its position.

    Args:
        ids: a list of integer lists or a 2-D integer array (prompts x tokens).
        vocabulary_size: the model's vocabulary size.
        mask: optional boolean array the shape of `ids`: only `True` entries are checked
            (padding may hold anything).

    Example:
    >>> check_token_ids([[1, 2], [3, 99]], 50)   # ValueError: ... id 99 at prompt 1, token 1
    """
    for i, given in enumerate(ids):
        # (compared as given, not cast to int64: ids past int64 overflowed, and uint64
        # ids from 2**63 up were named as the negative ids they wrap to)
        row = np.asarray(given, dtype=None if hasattr(given, "dtype") else object)
        row = row.reshape(-1)
        bad = (row < 0) | (row >= vocabulary_size)
        if mask is not None:
            bad &= np.asarray(mask[i], bool).reshape(-1)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"Prompt token ids must be in [0, vocabulary_size={vocabulary_size}); got id "
                f"{row.tolist()[j]} at prompt {i}, token {j}."
            )
