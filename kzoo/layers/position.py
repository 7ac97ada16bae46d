"""Positional encodings: sinusoidal, learned, rotary (RoPE), ALiBi and T5 relative buckets.

Every layer here takes a `start_index` call argument (a Python int or a scalar integer
tensor) giving the absolute position of the first query token, so that the same layer
serves full sequences and cached, token-by-token decoding inside compiled functions.
`PositionEmbedding` and `RotaryEmbedding` also take an integer tensor `(batch, seq)` there:
the position of every token (packed rows, `kzoo.layers.document_positions`).

Layouts:
- `SinusoidalPositionEncoding`, `PositionEmbedding`: `(batch, seq, dim)` in, the encoding
  (not added) broadcast to the same shape out.
- `RotaryEmbedding`: `(batch, seq, heads, head_dim)` in, the rotated tensor out.
- `ALiBiBias`, `RelativePositionBias`: an additive attention bias of shape
  `(1, num_heads, q_len, k_len)`, broadcastable to `(batch, heads, q_len, k_len)`, for
  `dot_product_attention(..., bias=...)`.
"""

import math

import keras
import numpy as np
from keras import ops

from kzoo.layers.utils import broadcast_leading
from kzoo.layers.utils import check_bool
from kzoo.layers.utils import check_choice
from kzoo.layers.utils import clip
from kzoo.layers.utils import FieldError
from kzoo.layers.utils import check_positive_float
from kzoo.layers.utils import check_positive_int
from kzoo.layers.utils import check_rank
from kzoo.layers.utils import serialize_initializer

# === Helpers ===


# Positions are int32 tensors (`_positions`): the last one, `start_index + length - 1`, must
# fit. Past it JAX refused the Python int with an OverflowError, while torch and TensorFlow
# wrapped the positions round to negative ones in silence.
_MAX_POSITION = 2**31 - 1


def _check_start_index(start_index, length=None):
    """Validate a Python `start_index` (with `length`, a static sequence length, the last
    position it gives too); tensors pass through unchecked (traced values)."""
    if isinstance(start_index, bool):
        raise ValueError(
            "`start_index` must be a non-negative integer or a scalar integer tensor; "
            f"got start_index={start_index!r}."
        )
    if isinstance(start_index, (int, np.integer)):
        if start_index < 0:
            raise ValueError(
                "`start_index` must be a non-negative integer or a scalar integer tensor; "
                f"got start_index={start_index!r}."
            )
        known = isinstance(length, int) and length > 0
        if int(start_index) + (length - 1 if known else 0) > _MAX_POSITION:
            raise ValueError(
                "`start_index` + sequence length - 1 (the last position) must be <= "
                f"{_MAX_POSITION} (positions are int32); got start_index={start_index!r}"
                + (f" and a sequence of length {length}." if known else ".")
            )
        return int(start_index)
    if isinstance(start_index, float):
        raise ValueError(
            "`start_index` must be a non-negative integer or a scalar integer tensor; "
            f"got start_index={start_index!r}."
        )
    shape = getattr(start_index, "shape", None)
    if shape is not None and len(shape) != 0:
        raise ValueError(
            "`start_index` must be a non-negative integer or a scalar integer tensor; "
            f"got a tensor of shape {tuple(shape)}."
        )
    return start_index


def _token_positions(start_index, seq_len):
    """The per-token positions `(batch, seq)` when `start_index` is a rank-2 tensor (packed
    rows: positions restarting at each document, `kzoo.layers.document_positions`), else
    None. Its sequence axis must match the inputs'."""
    shape = getattr(start_index, "shape", None)
    if shape is None or len(shape) != 2:
        return None
    if isinstance(seq_len, int) and shape[1] is not None and shape[1] != seq_len:
        raise ValueError(
            "Per-token positions `start_index` (batch, seq) must have the inputs' sequence "
            f"length {seq_len}; got a tensor of shape {tuple(shape)}."
        )
    return ops.cast(start_index, "int32")


def _positions(length, start_index, dtype="int32"):
    """`start_index + arange(length)` in `dtype` (start_index: int or scalar tensor)."""
    positions = ops.arange(length, dtype="int32")
    if isinstance(start_index, int):
        if start_index:
            positions = positions + start_index
    else:
        positions = positions + ops.cast(start_index, "int32")
    return ops.cast(positions, dtype)


def _host_scalar(value):
    """A NumPy scalar (`np.int64(5)`, a 0-d array) as the Python value it holds; anything else
    as it is. Keras turns NumPy call arguments into tensors before `call`, which would skip
    `_check_start_index`'s checks of a host value (an `np.int64` past int32 wrapped round)."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    return value


class _StartIndexLayer(keras.layers.Layer):
    """A position layer whose `call` takes `start_index`: a NumPy scalar given there is read
    as the Python value it holds before Keras makes a tensor of it (`_host_scalar`), so that
    it is checked as a Python int is."""

    # index of `start_index` among `call`'s positional arguments
    _START_INDEX_ARG = 1

    def __call__(self, *args, **kwargs):
        if "start_index" in kwargs:
            kwargs["start_index"] = _host_scalar(kwargs["start_index"])
        elif len(args) > self._START_INDEX_ARG:
            args = list(args)
            args[self._START_INDEX_ARG] = _host_scalar(args[self._START_INDEX_ARG])
        return super().__call__(*args, **kwargs)


class _Shape:
    """Adapter so `check_rank` can validate a shape tuple in `build`."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def _is_float_dtype(dtype):
    return "float" in keras.backend.standardize_dtype(dtype)


# === Sinusoidal ===


@keras.saving.register_keras_serializable(package="kzoo")
class SinusoidalPositionEncoding(_StartIndexLayer):
    """Fixed sinusoidal position encoding (Vaswani et al., 2017, "Attention Is All You Need").

    For position `pos` and feature index `j` (with `i = j // 2`):

        PE[pos, 2i]   = sin(pos / max_wavelength ** (2i / dim))
        PE[pos, 2i+1] = cos(pos / max_wavelength ** (2i / dim))

    Sines and cosines are interleaved exactly as in the paper's formula. An odd `dim` is
    supported: the last feature `dim - 1 = 2i` is a sine and has no cosine partner.
    The encoding is returned (not added to the inputs), broadcast to the inputs' shape, in
    the inputs' floating dtype; angles are computed in float32.

    Args:
        max_wavelength: positive number, the base of the geometric progression of
            wavelengths (10000 in the paper).
        **kwargs: standard `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: tensor of shape `(batch, seq, dim)`; only its shape and dtype are used.
        start_index: int or scalar integer tensor, the position of the first token
            (positions `start_index .. start_index + seq - 1`). Default 0.

    Returns:
        Tensor of the same shape as `inputs`.

    Example:

    ```python
    x = keras.random.normal((2, 16, 64))
    x = x + SinusoidalPositionEncoding()(x)
    # Decoding the 6th token on its own:
    pe = SinusoidalPositionEncoding()(x[:, :1], start_index=5)
    ```
    """

    def __init__(self, max_wavelength=10000, **kwargs):
        super().__init__(**kwargs)
        check_positive_float("max_wavelength", max_wavelength)
        self.max_wavelength = max_wavelength
        self.supports_masking = True

    def build(self, input_shape):
        check_rank("inputs", _Shape(input_shape), 3)
        if input_shape[-1] is None:
            raise ValueError(
                "SinusoidalPositionEncoding needs a known last (feature) dimension; got "
                f"input shape {tuple(input_shape)}."
            )
        self.built = True

    def _inverse_frequencies(self, dim):
        # 1 / max_wavelength ** (2 * (j // 2) / dim) for every feature j, in float64 then
        # rounded once to float32.
        pair = 2.0 * (np.arange(dim) // 2)
        return (float(self.max_wavelength) ** (-pair / dim)).astype("float32")

    def call(self, inputs, start_index=0):
        check_rank("inputs", inputs, 3)
        shape = ops.shape(inputs)
        seq_len, dim = shape[1], inputs.shape[-1]
        start_index = _check_start_index(start_index, seq_len)
        positions = _positions(seq_len, start_index, "float32")
        inv_freq = ops.convert_to_tensor(self._inverse_frequencies(dim))
        angles = positions[:, None] * inv_freq[None, :]
        is_even = (np.arange(dim) % 2) == 0
        encoding = ops.where(is_even[None, :], ops.sin(angles), ops.cos(angles))
        dtype = inputs.dtype if _is_float_dtype(inputs.dtype) else self.compute_dtype
        encoding = ops.cast(encoding, dtype)
        return ops.broadcast_to(encoding[None, :, :], shape)

    def get_config(self):
        config = super().get_config()
        config.update({"max_wavelength": self.max_wavelength})
        return config


# === Learned ===


@keras.saving.register_keras_serializable(package="kzoo")
class PositionEmbedding(_StartIndexLayer):
    """Learned absolute position embedding (as in BERT and GPT-2).

    Holds a trainable table `embeddings` of shape `(sequence_length, dim)`, with `dim`
    taken from the last dimension of the inputs at build time. The call returns rows
    `start_index .. start_index + seq - 1` of the table (not added to the inputs),
    broadcast to the inputs' shape, in the layer's compute dtype.

    Args:
        sequence_length: positive int, the maximum number of positions (table rows).
        initializer: initializer of the table (default `"glorot_uniform"`); stored
            serialised.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: tensor of shape `(batch, seq, dim)`; only its shape is used.
        start_index: int or scalar integer tensor, the first position. A tensor is read
            with `ops.slice`, so it can vary inside a compiled decoding loop; a Python int
            is checked against `sequence_length`, a tensor cannot be (out of range, JAX
            clamps the slice while TensorFlow and torch raise). Or an integer tensor
            `(batch, seq)`: the position of every token (packed rows, whose positions
            restart at each document: `kzoo.layers.document_positions`), gathered from the
            table (clipped into `[0, sequence_length)`; the sequence itself may be at most
            `sequence_length` long).

    Returns:
        Tensor of the same shape as `inputs`.

    Example:

    ```python
    token_embeddings = keras.random.normal((2, 10, 32))
    layer = PositionEmbedding(sequence_length=128)
    x = token_embeddings + layer(token_embeddings)   # layer.embeddings.shape == (128, 32)
    step = layer(token_embeddings[:, :1], start_index=keras.ops.convert_to_tensor(9))
    ```
    """

    def __init__(self, sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        check_positive_int("sequence_length", sequence_length)
        try:
            initializer = serialize_initializer(initializer)
        except (ValueError, TypeError) as error:
            raise ValueError(
                "`initializer` must be a Keras initializer, its name or its config; "
                f"got initializer={initializer!r}."
            ) from error
        self.sequence_length = sequence_length
        self.initializer = initializer
        self.supports_masking = True

    def build(self, input_shape):
        check_rank("inputs", _Shape(input_shape), 3)
        dim = input_shape[-1]
        if dim is None:
            raise ValueError(
                "PositionEmbedding needs a known last (feature) dimension; got input shape "
                f"{tuple(input_shape)}."
            )
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, dim),
            initializer=keras.initializers.get(self.initializer),
            trainable=True,
        )
        self.built = True

    def call(self, inputs, start_index=0):
        check_rank("inputs", inputs, 3)
        shape = ops.shape(inputs)
        seq_len = shape[1]
        dim = self.embeddings.shape[-1]
        positions = _token_positions(start_index, seq_len)
        if positions is not None:
            if isinstance(seq_len, int) and seq_len > self.sequence_length:
                raise ValueError(
                    f"The sequence length must be <= sequence_length={self.sequence_length}; "
                    f"got inputs of length {seq_len}."
                )
            positions = clip(positions, 0, self.sequence_length - 1)
            rows = ops.take(ops.convert_to_tensor(self.embeddings), positions, axis=0)
            return ops.cast(rows, self.compute_dtype)
        start_index = _check_start_index(start_index)
        if isinstance(seq_len, int):
            first = start_index if isinstance(start_index, int) else 0
            if first + seq_len > self.sequence_length:
                raise ValueError(
                    f"start_index + sequence length must be <= sequence_length="
                    f"{self.sequence_length}; got start_index={start_index} and inputs "
                    f"of length {seq_len}."
                )
        if isinstance(start_index, int):
            start = [start_index, 0]
        else:
            start = ops.stack([ops.cast(start_index, "int32"), ops.zeros((), "int32")])
        table = ops.convert_to_tensor(self.embeddings)
        rows = ops.slice(table, start, [seq_len, dim])
        rows = ops.cast(rows, self.compute_dtype)
        return broadcast_leading(rows, shape)  # (its gradient: a product on JAX's CPU)

    def compute_output_shape(self, input_shape):
        # Declared rather than traced: symbolic tracing substitutes arbitrary lengths for
        # unknown dimensions, which may exceed `sequence_length`.
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {"sequence_length": self.sequence_length, "initializer": self.initializer}
        )
        return config


# === Rotary ===


# RoPE scaling types (`RotaryEmbedding.scaling_type`): "linear" position interpolation
# (Chen et al. 2023: every frequency divided by `scaling_factor`), Llama 3.1's
# frequency-dependent rescaling ("llama3": low frequencies divided by the factor, high ones
# kept, a smooth blend between) and YaRN ("yarn", Peng et al. 2023: a linear ramp between
# interpolated and kept frequencies over a band of dimensions, and the rotated vectors
# scaled by an attention factor).
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")
# The settings of "llama3" besides the factor (Meta's Llama 3.1: 1.0, 4.0, 8192).
LLAMA3_ROPE_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# The settings of "yarn" besides the factor (the paper's defaults: beta_fast 32, beta_slow 1,
# attention factor 0.1 ln(factor) + 1; `truncate` rounds the ramp's ends to whole
# dimensions, as the paper's code and transformers do by default).
YARN_ROPE_FIELDS = ("original_max_position_embeddings", "beta_fast", "beta_slow",
                    "attention_factor", "truncate")
# Every scaling setting besides the type and the factor, in the order `check_rope_scaling`
# takes and returns them.
ROPE_SCALING_FIELDS = ("low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "attention_factor", "truncate")
# The settings each scaling type reads.
ROPE_FIELDS_OF_TYPE = {"linear": (), "llama3": LLAMA3_ROPE_FIELDS, "yarn": YARN_ROPE_FIELDS}
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}


def yarn_attention_factor(scaling_factor, mscale=None, mscale_all_dim=None):
    """YaRN's default attention factor for `scaling_factor`: `0.1 ln(s) + 1` (1 for `s <=
    1`); with both `mscale` and `mscale_all_dim` (DeepSeek's configurations) the ratio
    `(0.1 mscale ln(s) + 1) / (0.1 mscale_all_dim ln(s) + 1)`."""
    def scale(m):
        return 1.0 if scaling_factor <= 1 else 0.1 * m * math.log(scaling_factor) + 1.0

    if mscale and mscale_all_dim:
        return float(scale(mscale) / scale(mscale_all_dim))
    return float(scale(1.0))


def check_rope_scaling(scaling_type="linear", scaling_factor=1.0, low_freq_factor=None,
                       high_freq_factor=None, original_max_position_embeddings=None,
                       beta_fast=None, beta_slow=None, attention_factor=None, truncate=None,
                       names=None):
    """The validated RoPE scaling settings `(scaling_type, scaling_factor, *settings)`, the
    settings in `ROPE_SCALING_FIELDS` order, None where the type does not use one; a bad
    one raises a `FieldError` naming it (by `names[argument]` where given: a config's field
    names).

    `scaling_type` is one of `ROPE_SCALING_TYPES`; `scaling_factor` a positive number.
    "llama3" requires its three settings (positive numbers, `high_freq_factor >
    low_freq_factor`, a positive integer `original_max_position_embeddings`). "yarn"
    requires `original_max_position_embeddings` (the context length before scaling); its
    others may be None for their defaults (`yarn_settings`): `beta_fast` 32.0 and
    `beta_slow` 1.0 (positive, `beta_fast > beta_slow`), `attention_factor`
    `yarn_attention_factor(scaling_factor)` (positive) and `truncate` True. A setting its
    type does not use must be None."""
    names = names or {}

    def name(argument):
        return names.get(argument, argument)

    scaling_type = check_choice(name("scaling_type"), scaling_type, ROPE_SCALING_TYPES)
    scaling_factor = check_positive_float(name("scaling_factor"), scaling_factor)
    given = dict(low_freq_factor=low_freq_factor, high_freq_factor=high_freq_factor,
                 original_max_position_embeddings=original_max_position_embeddings,
                 beta_fast=beta_fast, beta_slow=beta_slow, attention_factor=attention_factor,
                 truncate=truncate)
    used = ROPE_FIELDS_OF_TYPE[scaling_type]
    for argument, value in given.items():
        if argument not in used and value is not None:
            users = [kind for kind, fields in ROPE_FIELDS_OF_TYPE.items() if argument in fields]
            raise FieldError(
                f"`{name(argument)}` is only used with {name('scaling_type')} in {users}; "
                f"got {name(argument)}={value!r} with {name('scaling_type')}="
                f"{scaling_type!r} (leave it None).",
                name(argument),
            )
    settings = dict.fromkeys(ROPE_SCALING_FIELDS)
    if scaling_type == "linear":
        return (scaling_type, scaling_factor) + tuple(settings.values())
    required = LLAMA3_ROPE_FIELDS if scaling_type == "llama3" else (
        "original_max_position_embeddings",)
    for argument in required:
        if given[argument] is None:
            raise FieldError(
                f"`{name(argument)}` is required by {name('scaling_type')}="
                f"{scaling_type!r} ("
                + ("Llama 3.1 uses low_freq_factor=1.0, high_freq_factor=4.0, "
                   "original_max_position_embeddings=8192" if scaling_type == "llama3" else
                   "the context length the model was trained at before scaling")
                + f"); got {name(argument)}=None.",
                name(argument),
            )
    original = check_positive_int(name("original_max_position_embeddings"),
                                  given["original_max_position_embeddings"])
    settings["original_max_position_embeddings"] = original
    if scaling_type == "llama3":
        low, high = "low_freq_factor", "high_freq_factor"
    else:
        low, high = "beta_slow", "beta_fast"
        settings["attention_factor"] = check_positive_float(
            name("attention_factor"), given["attention_factor"], allow_none=True)
        settings["truncate"] = check_bool(name("truncate"), given["truncate"], allow_none=True)
    for argument in (low, high):
        settings[argument] = check_positive_float(
            name(argument), given[argument], allow_none=scaling_type == "yarn")
    bounds = {key: _YARN_DEFAULTS[key] if settings[key] is None else settings[key]
              for key in (low, high)}
    if bounds[high] <= bounds[low]:
        raise FieldError(
            f"`{name(high)}` must be greater than {name(low)}={bounds[low]} (the "
            f"{scaling_type} blend runs between them); got {name(high)}={bounds[high]}.",
            name(high),
        )
    return (scaling_type, scaling_factor) + tuple(settings.values())


def yarn_settings(scaling_factor, beta_fast=None, beta_slow=None, attention_factor=None,
                  truncate=None):
    """YaRN's `(beta_fast, beta_slow, attention_factor, truncate)` with the defaults in
    place of None: 32.0, 1.0, `yarn_attention_factor(scaling_factor)` and True."""
    return (_YARN_DEFAULTS["beta_fast"] if beta_fast is None else beta_fast,
            _YARN_DEFAULTS["beta_slow"] if beta_slow is None else beta_slow,
            yarn_attention_factor(scaling_factor) if attention_factor is None
            else attention_factor,
            _YARN_DEFAULTS["truncate"] if truncate is None else truncate)


def rope_rotation_scale(scaling_type="linear", scaling_factor=1.0, *settings,
                        **named_settings):
    """The factor RoPE's cos and sin are multiplied by for these scaling settings (those of
    `check_rope_scaling`): YaRN's attention factor (its default filled in), 1.0 for the
    other scalings."""
    scaling_type, factor, *values = check_rope_scaling(
        scaling_type, scaling_factor, *settings, **named_settings)
    if scaling_type != "yarn":
        return 1.0
    values = dict(zip(ROPE_SCALING_FIELDS, values))
    return float(yarn_settings(factor, values["beta_fast"], values["beta_slow"],
                               values["attention_factor"], values["truncate"])[2])


def _yarn_ramp_band(head_dim, max_wavelength, original, beta_fast, beta_slow, truncate):
    """YaRN's band of dimensions `(low, high)` over which the ramp runs: the dimensions
    whose wavelengths make `beta_fast` and `beta_slow` turns over `original` positions
    (`d(r) = head_dim ln(original / (2 pi r)) / (2 ln base)`), rounded outward when
    `truncate`, clipped to `[0, head_dim - 1]`."""
    def dimension(turns):
        return (head_dim * math.log(original / (turns * 2 * math.pi))
                / (2 * math.log(max_wavelength)))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def rope_inverse_frequencies(max_wavelength, head_dim, scaling_type="linear",
                             scaling_factor=1.0, *settings, **named_settings):
    """RoPE's inverse frequencies, `i < head_dim / 2`, with the scaling applied: float64,
    then float32 (NumPy). The one place they are computed: `RotaryEmbedding` and the torch
    decode paths (`kzoo.layers.fast_decode`, `kzoo.layers.compiled_decode`) all call it.
    `settings` are those of `check_rope_scaling` after the factor (`ROPE_SCALING_FIELDS`,
    positional or by name; validated here too).

    - unscaled: `theta_i = max_wavelength ** (-2i / head_dim)`;
    - "linear": `theta_i / scaling_factor` (dividing the frequencies divides the angles
      `position * theta_i` as dividing the positions would, as transformers does it);
    - "llama3" (Llama 3.1): with `wavelength_i = 2 pi / theta_i` and `L =
      original_max_position_embeddings`, wavelengths longer than `L / low_freq_factor` are
      divided by the factor, those shorter than `L / high_freq_factor` kept, and those
      between blended: `(1 - s) theta_i / factor + s theta_i` with `s = (L / wavelength_i -
      low_freq_factor) / (high_freq_factor - low_freq_factor)`;
    - "yarn": `r_i theta_i / factor + (1 - r_i) theta_i` with the ramp `r_i = clip((i -
      low) / (high - low), 0, 1)` over the band `_yarn_ramp_band` gives (`high` nudged by
      0.001 when the band is empty); the attention factor is applied to the rotation, not
      here (`RotaryEmbedding.attention_factor`).

    Example:
    >>> rope_inverse_frequencies(500000.0, 128, "llama3", 8.0, 1.0, 4.0, 8192)
    """
    scaling_type, factor, *values = check_rope_scaling(
        scaling_type, scaling_factor, *settings, **named_settings)
    values = dict(zip(ROPE_SCALING_FIELDS, values))
    theta = float(max_wavelength) ** (-np.arange(0, head_dim, 2) / head_dim)
    if scaling_type == "linear":
        if factor != 1.0:
            theta = theta / factor
    elif scaling_type == "llama3":
        low, high = values["low_freq_factor"], values["high_freq_factor"]
        original = values["original_max_position_embeddings"]
        wavelength = 2 * math.pi / theta
        low_wavelength, high_wavelength = original / low, original / high
        scaled = np.where(wavelength > low_wavelength, theta / factor, theta)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * theta / factor + smooth * theta
        between = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        theta = np.where(between, blended, scaled)
    else:
        beta_fast, beta_slow, _, truncate = yarn_settings(
            factor, values["beta_fast"], values["beta_slow"], None, values["truncate"])
        low, high = _yarn_ramp_band(
            head_dim, float(max_wavelength), values["original_max_position_embeddings"],
            beta_fast, beta_slow, truncate)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
        theta = ramp * (theta / factor) + (1 - ramp) * theta
    return theta.astype("float32")


@keras.saving.register_keras_serializable(package="kzoo")
class RotaryEmbedding(_StartIndexLayer):
    """Rotary position embedding, RoPE (Su et al., 2021, "RoFormer").

    Feature pairs `(x1, x2)` of each head are rotated by the angle `theta_i * pos` with
    `theta_i = max_wavelength ** (-2i / head_dim)` (scaled, see below):

        x1' = x1 * cos - x2 * sin
        x2' = x2 * cos + x1 * sin

    so that the dot product of a rotated query and key depends only on their relative
    position. Pairing:

    - `interleaved=False` (default): pairs `(i, i + head_dim / 2)`, the "rotate half"
      convention of GPT-NeoX and Hugging Face LLaMA/Mistral/Qwen checkpoints.
    - `interleaved=True`: pairs `(2i, 2i + 1)`, as in the paper, GPT-J and Meta's LLaMA.

    Scaling (`rope_inverse_frequencies` computes the frequencies, with it):
    `scaling_type="linear"` divides every `theta_i` by `scaling_factor` (linear position
    interpolation, Chen et al. 2023: the same as dividing the positions); "llama3" is Llama
    3.1's frequency-dependent rescaling (low frequencies divided by `scaling_factor`, high
    ones kept, a blend between; it needs `low_freq_factor`, `high_freq_factor` and
    `original_max_position_embeddings`); "yarn" is YaRN (Peng et al. 2023: a linear ramp
    between divided and kept frequencies over the dimensions between `beta_fast` and
    `beta_slow` turns in `original_max_position_embeddings` positions, and cos and sin
    multiplied by `attention_factor`, which scales every attention logit by its square).
    Angles and the rotation are computed in float32; the result is cast back to the
    inputs' dtype.

    Args:
        max_wavelength: positive number, the RoPE base (10000; LLaMA-3 uses 500000).
        scaling_factor: positive number, the scaling factor (1.0 with "linear" = no
            scaling).
        interleaved: bool, the pairing convention (see above).
        scaling_type: "linear" (default), "llama3" or "yarn".
        low_freq_factor, high_freq_factor, original_max_position_embeddings: the "llama3"
            settings (None otherwise; Llama 3.1 uses 1.0, 4.0 and 8192);
            `original_max_position_embeddings` is also required by "yarn".
        beta_fast, beta_slow, attention_factor, truncate: the other "yarn" settings (None
            otherwise; None with "yarn" takes the defaults 32.0, 1.0, `0.1 ln(factor) + 1`
            and True, see `check_rope_scaling`).
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: tensor of shape `(batch, seq, heads, head_dim)` (rank 3
            `(batch, seq, head_dim)` is accepted too); `head_dim` must be even.
        start_index: int or scalar integer tensor, the position of the first token; or an
            integer tensor `(batch,)`, one first position a row (decoding left-padded rows
            whose positions must not shift, e.g. under linear attention, where rotated
            feature maps are not a function of relative positions alone); or an integer
            tensor `(batch, seq)`, the position of every token (packed rows, whose
            positions restart at each document: `kzoo.layers.document_positions`).

    Returns:
        Tensor with the shape and dtype of `inputs`.

    Example:

    ```python
    rope = RotaryEmbedding(max_wavelength=10000)
    q = keras.random.normal((2, 16, 8, 64))   # (batch, seq, heads, head_dim)
    k = keras.random.normal((2, 16, 8, 64))
    q, k = rope(q), rope(k)
    ```
    """

    def __init__(self, max_wavelength=10000, scaling_factor=1.0, interleaved=False,
                 scaling_type="linear", low_freq_factor=None, high_freq_factor=None,
                 original_max_position_embeddings=None, beta_fast=None, beta_slow=None,
                 attention_factor=None, truncate=None, **kwargs):
        super().__init__(**kwargs)
        check_positive_float("max_wavelength", max_wavelength)
        check_rope_scaling(scaling_type, scaling_factor, low_freq_factor, high_freq_factor,
                           original_max_position_embeddings, beta_fast, beta_slow,
                           attention_factor, truncate)
        check_bool("interleaved", interleaved)
        self.max_wavelength = max_wavelength
        self.scaling_factor = scaling_factor
        self.interleaved = interleaved
        self.scaling_type = scaling_type
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.attention_factor = attention_factor
        self.truncate = truncate

    def scaling(self):
        """The scaling settings as a tuple `(scaling_type, scaling_factor, *settings)`,
        the settings in `ROPE_SCALING_FIELDS` order as given (read at each call: what the
        torch decode paths key their tables on)."""
        return (self.scaling_type, float(self.scaling_factor)) + tuple(
            getattr(self, field) for field in ROPE_SCALING_FIELDS)

    def rotation_scale(self):
        """The factor cos and sin are multiplied by (`rope_rotation_scale`)."""
        return rope_rotation_scale(*self.scaling())

    def inverse_frequencies(self, head_dim):
        """float32 NumPy `(head_dim / 2,)`: `rope_inverse_frequencies` of this layer's base
        and scaling."""
        return rope_inverse_frequencies(self.max_wavelength, head_dim, *self.scaling())

    def _check_head_dim(self, shape):
        check_rank("inputs", _Shape(shape), (3, 4))
        head_dim = shape[-1]
        if head_dim is None or head_dim % 2 != 0:
            raise ValueError(
                "RotaryEmbedding needs an even, known head_dim (last dimension of inputs); "
                f"got head_dim={head_dim} for inputs of shape {tuple(shape)}."
            )
        return head_dim

    def build(self, input_shape):
        self._check_head_dim(input_shape)
        self.built = True

    def call(self, inputs, start_index=0):
        head_dim = self._check_head_dim(inputs.shape)
        rank = len(inputs.shape)
        half = head_dim // 2
        seq_len = ops.shape(inputs)[1]
        per_token = _token_positions(start_index, seq_len)
        per_row = getattr(start_index, "shape", None) is not None and len(
            start_index.shape) == 1
        if not per_row and per_token is None:
            start_index = _check_start_index(start_index, seq_len)

        inv_freq = ops.convert_to_tensor(self.inverse_frequencies(head_dim))
        if per_token is not None:  # (batch, seq)
            positions = ops.cast(per_token, "float32")
        elif per_row:  # (batch, seq)
            positions = ops.cast(ops.arange(seq_len, dtype="int32")[None, :]
                                 + ops.cast(start_index, "int32")[:, None], "float32")
        else:
            positions = _positions(seq_len, start_index, "float32")[None, :]
        angles = positions[..., None] * inv_freq  # (batch|1, seq, half)
        # Broadcast over [heads]: (batch|1, seq, [1,] half).
        angles = ops.reshape(angles, (ops.shape(angles)[0], -1) + (1,) * (rank - 3) + (half,))
        cos, sin = ops.cos(angles), ops.sin(angles)
        scale = self.rotation_scale()
        if scale != 1.0:  # (YaRN's attention factor, as transformers applies it)
            cos, sin = cos * scale, sin * scale

        x = ops.cast(inputs, "float32")
        if not self.interleaved:
            # `x * [cos, cos] + [x2, x1] * [-sin, sin]`: the products and sums of the halves'
            # `x1 cos - x2 sin` and `x2 cos + x1 sin` (the sign moved onto sin, exact), with
            # one concatenation of `x` and none of the results. On JAX XLA's CPU fusion ran the halves' slices and
            # concatenation (and their gradients) as extra passes: a rotary GPT training step
            # (8 x 256 tokens, 4 layers, width 256), interleaved, 12 pairs, median speed-up
            # per pair 1.029 and 1.045 in two runs, the same losses; torch 1.001, TensorFlow
            # 1.012.
            cos2 = ops.concatenate([cos, cos], axis=-1)
            sin2 = ops.concatenate([-sin, sin], axis=-1)
            swapped = ops.concatenate([x[..., half:], x[..., :half]], axis=-1)
            return ops.cast(x * cos2 + swapped * sin2, inputs.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]  # (interleaved pairs)
        y = ops.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return ops.cast(ops.reshape(y, ops.shape(inputs)), inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor,
                "interleaved": self.interleaved,
                "scaling_type": self.scaling_type,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "attention_factor": self.attention_factor,
                "truncate": self.truncate,
            }
        )
        return config


# === ALiBi ===


def alibi_slopes(num_heads):
    """ALiBi head slopes (Press et al., 2022) as a float64 NumPy array of length `num_heads`.

    For a power of two `n`, the geometric sequence `2**(-8/n * (h + 1))`, h = 0..n-1.
    Otherwise with `m` the largest power of two below `n`: the `m`-head slopes followed by
    every other slope of the `2m`-head sequence (starting with its first), up to `n` slopes.
    """
    check_positive_int("num_heads", num_heads)

    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(lower)
    if lower != num_heads:
        slopes += power_of_two(2 * lower)[0::2][: num_heads - lower]
    return np.asarray(slopes, dtype="float64")


@keras.saving.register_keras_serializable(package="kzoo")
class ALiBiBias(_StartIndexLayer):
    """Attention with Linear Biases, ALiBi (Press et al., 2022, "Train Short, Test Long").

    Query `i` sits at position `start_index + i` and key `j` at position `j`. The additive
    bias of head `h` is

        bias[h, i, j] = -slope_h * (query_pos - key_pos)       (bidirectional=False)
        bias[h, i, j] = -slope_h * |query_pos - key_pos|       (bidirectional=True)

    with slopes from `alibi_slopes(num_heads)`. For causal use, keys after the query get a
    positive bias and must be masked out by the causal mask, as in the paper. The bias is
    always float32 (whatever the dtype policy): distances times slopes lose their ordering
    in bfloat16 for long sequences, and the attention scores it is added to are float32.

    Args:
        num_heads: positive int, the number of attention heads.
        bidirectional: bool, symmetric `|distance|` bias for encoders.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        query: tensor `(batch, q_len, ...)`; only its length is used.
        key: tensor `(batch, k_len, ...)` or None (then `key = query`).
        start_index: int or scalar integer tensor, the position of the first query.

    Returns:
        float32 tensor of shape `(1, num_heads, q_len, k_len)`.

    Example:

    ```python
    alibi = ALiBiBias(num_heads=8)
    x = keras.random.normal((2, 10, 8, 64))   # (batch, seq, heads, head_dim)
    bias = alibi(x)                            # (1, 8, 10, 10)
    alibi.slopes()                             # [0.5, 0.25, ..., 0.00390625]
    ```
    """

    _START_INDEX_ARG = 2  # (query, key, start_index)

    def __init__(self, num_heads, bidirectional=False, **kwargs):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_bool("bidirectional", bidirectional)
        self.num_heads = num_heads
        self.bidirectional = bidirectional

    def slopes(self):
        """The per-head slopes as a float64 NumPy array of shape `(num_heads,)`."""
        return alibi_slopes(self.num_heads)

    def build(self, input_shape):
        self.built = True

    def call(self, query, key=None, start_index=0):
        key = query if key is None else key
        q_len, k_len = ops.shape(query)[1], ops.shape(key)[1]
        start_index = _check_start_index(start_index, q_len)
        query_pos = _positions(q_len, start_index, "float32")
        key_pos = _positions(k_len, 0, "float32")
        distance = query_pos[:, None] - key_pos[None, :]
        if self.bidirectional:
            distance = ops.abs(distance)
        slopes = ops.convert_to_tensor(self.slopes().astype("float32"))
        bias = -slopes[:, None, None] * distance[None, :, :]
        return bias[None]

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "bidirectional": self.bidirectional})
        return config


# === T5 relative position buckets ===


def _check_bucket_args(bidirectional, num_buckets, max_distance):
    check_bool("bidirectional", bidirectional)
    minimum = 4 if bidirectional else 2
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < minimum:
        raise ValueError(
            f"`num_buckets` must be an integer >= {minimum} (bidirectional={bidirectional}); "
            f"got num_buckets={num_buckets!r}."
        )
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if (
        isinstance(max_distance, bool)
        or not isinstance(max_distance, int)
        or max_distance <= max_exact
    ):
        raise ValueError(
            f"`max_distance` must be an integer > {max_exact} (the number of exact buckets "
            f"for num_buckets={num_buckets}, bidirectional={bidirectional}); got "
            f"max_distance={max_distance!r}."
        )


def _bucket_table(num_buckets, max_distance):
    """Bucket of each distance 0..max_distance for one direction with `num_buckets` buckets.

    Reproduces the float32 arithmetic of Mesh TensorFlow / Hugging Face T5 on the host, with
    every float32 operation correctly rounded, so the in-graph lookup is exact integer work
    on every backend (the backends' own float32 `log` differ by an ulp at the bucket edges,
    e.g. XLA on CPU, which would move a distance into the neighbouring bucket).
    Distances >= max_distance all fall in the last bucket.
    """
    max_exact = num_buckets // 2
    distance = np.arange(max_distance + 1)
    ratio = np.maximum(distance, max_exact).astype(np.float32) / np.float32(max_exact)
    log = np.log(ratio.astype(np.float64)).astype(np.float32)
    scaled = log / np.float32(math.log(max_distance / max_exact))
    scaled = scaled * np.float32(num_buckets - max_exact)
    large = max_exact + np.trunc(scaled).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return np.where(distance < max_exact, distance, large).astype("int32")


def relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """T5 relative-position buckets (Raffel et al., 2020), as in Mesh TensorFlow / HF T5.

    `relative_position = key_pos - query_pos` (integers, any shape). If `bidirectional`,
    half of the buckets are for positive relative positions (offset `num_buckets // 2`)
    and `|relative_position|` is bucketed in the other half; otherwise only non-positive
    relative positions are distinguished (`-min(relative_position, 0)`). Of the buckets
    left, half hold the exact small distances and the rest are log-spaced up to
    `max_distance`; larger distances share the last bucket.

    Returns an int32 tensor of the input's shape with values in `[0, num_buckets)`, equal
    to `transformers`' `T5Attention._relative_position_bucket`, except at a few distances of
    unusual settings (none at T5's 32 / 128) where torch's float32 log on CPU is one ulp off
    and the exact value sits on a bucket edge: 2 of the 4,053 settings of 2-32 buckets a
    direction and distances up to 8x that, e.g. 17 buckets, max_distance 27, distance 12
    (27 / 8 = 1.5 ** 3): kzoo keeps the correctly rounded log's bucket (`_bucket_table`),
    the same on every backend and device.

    Example:

    ```python
    rel = keras.ops.arange(8)[None, :] - keras.ops.arange(8)[:, None]
    buckets = relative_position_bucket(rel, bidirectional=True, num_buckets=32,
                                       max_distance=128)
    ```
    """
    _check_bucket_args(bidirectional, num_buckets, max_distance)
    relative_position = ops.cast(relative_position, "int32")
    if bidirectional:
        num_buckets //= 2
        offset = ops.cast(ops.greater(relative_position, 0), "int32") * num_buckets
        distance = ops.abs(relative_position)
    else:
        offset = None
        distance = -ops.minimum(relative_position, 0)
    table = ops.convert_to_tensor(_bucket_table(num_buckets, max_distance))
    buckets = ops.take(table, ops.minimum(distance, max_distance), axis=0)
    return buckets if offset is None else buckets + offset


@keras.saving.register_keras_serializable(package="kzoo")
class RelativePositionBias(_StartIndexLayer):
    """T5 relative position bias (Raffel et al., 2020, "Exploring the Limits of Transfer
    Learning with a Unified Text-to-Text Transformer").

    A learned table `embeddings` of shape `(num_buckets, num_heads)` (the layout of Hugging
    Face's `relative_attention_bias.weight`, so checkpoints copy over as they are). Query
    `i` sits at position `start_index + i` and key `j` at `j`; the bias of head `h` is
    `embeddings[relative_position_bucket(key_pos - query_pos), h]`.

    Args:
        num_heads: positive int.
        num_buckets: int, number of buckets (>= 2; >= 4 when bidirectional). T5: 32.
        max_distance: int, distances from here on share the last bucket. T5: 128.
        bidirectional: bool, True for encoders, False for causal decoders.
        embeddings_initializer: initializer of the table (default
            `RandomNormal(stddev=0.05)`, close to T5's `d_model ** -0.5`); stored serialised.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        query: tensor `(batch, q_len, ...)`; only its length is used.
        key: tensor `(batch, k_len, ...)` or None (then `key = query`).
        start_index: int or scalar integer tensor, the position of the first query.

    Returns:
        Tensor of shape `(1, num_heads, q_len, k_len)` in the layer's compute dtype.

    Example:

    ```python
    bias_layer = RelativePositionBias(num_heads=8, bidirectional=True)
    x = keras.random.normal((2, 10, 512))
    bias = bias_layer(x)        # (1, 8, 10, 10); bias_layer.embeddings.shape == (32, 8)
    ```
    """

    _START_INDEX_ARG = 2  # (query, key, start_index)

    def __init__(
        self,
        num_heads,
        num_buckets=32,
        max_distance=128,
        bidirectional=True,
        embeddings_initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        _check_bucket_args(bidirectional, num_buckets, max_distance)
        if embeddings_initializer is None:
            embeddings_initializer = keras.initializers.RandomNormal(stddev=0.05)
        try:
            embeddings_initializer = serialize_initializer(embeddings_initializer)
        except (ValueError, TypeError) as error:
            raise ValueError(
                "`embeddings_initializer` must be a Keras initializer, its name or its "
                f"config; got embeddings_initializer={embeddings_initializer!r}."
            ) from error
        self.num_heads = num_heads
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.embeddings_initializer = embeddings_initializer

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.num_buckets, self.num_heads),
            initializer=keras.initializers.get(self.embeddings_initializer),
            trainable=True,
        )
        self.built = True

    def call(self, query, key=None, start_index=0):
        key = query if key is None else key
        q_len, k_len = ops.shape(query)[1], ops.shape(key)[1]
        start_index = _check_start_index(start_index, q_len)
        query_pos = _positions(q_len, start_index)
        key_pos = _positions(k_len, 0)
        relative = key_pos[None, :] - query_pos[:, None]
        buckets = relative_position_bucket(
            relative, self.bidirectional, self.num_buckets, self.max_distance
        )
        values = ops.take(self.embeddings, buckets, axis=0)  # (q, k, heads)
        values = ops.transpose(values, (2, 0, 1))[None]
        return ops.cast(values, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "num_buckets": self.num_buckets,
                "max_distance": self.max_distance,
                "bidirectional": self.bidirectional,
                "embeddings_initializer": self.embeddings_initializer,
            }
        )
        return config
