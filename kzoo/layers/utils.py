"""Small shared helpers: argument validation and dtype handling.

These are the one set of validators every layer, family config and task uses: each raises a
`ValueError` that names the argument, its value and what is allowed.
"""

import numbers

import keras
import numpy as np
from keras import ops


def _is_int(value):
    """True for Python and NumPy integers, never for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_bool(name, value, allow_none=False):
    """Raise `ValueError` unless `value` is True or False (or None when allowed)."""
    if value is None and allow_none:
        return value
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; got {name}={value!r}.")
    return value


def check_positive_int(name, value, allow_none=False):
    """Raise `ValueError` unless `value` is a positive integer (or None when allowed).

    NumPy integers are accepted and returned as Python ints.
    """
    if value is None and allow_none:
        return value
    if not _is_int(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer; got {name}={value!r}.")
    return int(value)


def check_non_negative_int(name, value):
    if not _is_int(value) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer; got {name}={value!r}.")
    return int(value)


def check_rate(name, value):
    """A probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a float in [0, 1); got {name}={value!r}.")
    return float(value)


def check_positive_float(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{name}` must be a positive number; got {name}={value!r}.")
    return float(value)


def check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(
            f"`{name}` must be one of {sorted(allowed)}; got {name}={value!r}."
        )
    return value


def check_divides(name, value, other_name, other):
    """Raise unless `value` divides `other` exactly."""
    if other % value != 0:
        raise ValueError(
            f"`{name}`={value} must divide `{other_name}`={other} exactly."
        )


def check_rank(name, tensor, ranks):
    """Raise unless the static rank of `tensor` is one of `ranks`."""
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    rank = len(tensor.shape)
    if rank not in ranks:
        allowed = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"`{name}` must have rank {allowed}; got {name} with shape {tuple(tensor.shape)} "
            f"(rank {rank})."
        )


def compute_float32(x):
    """Cast to float32 for numerically sensitive statistics (softmax, norms)."""
    return ops.cast(x, "float32")


def serialize_initializer(initializer):
    return keras.initializers.serialize(keras.initializers.get(initializer))


def last_axis_size(layer_name, input_shape):
    """The size of the last axis of `input_shape`; a clear error when it is unknown."""
    dim = input_shape[-1]
    if dim is None:
        raise ValueError(
            f"The last axis of the input to {layer_name} must be known; got input shape "
            f"{tuple(input_shape)}."
        )
    return dim
