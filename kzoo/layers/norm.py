"""Normalisation layers."""

import keras
from keras import ops

from kzoo.layers.gradients import tf_custom_gradient
from kzoo.layers.utils import check_positive_float
from kzoo.layers.utils import last_axis_size
from kzoo.layers.utils import serialize_initializer


@keras.saving.register_keras_serializable(package="kzoo")
class RMSNorm(keras.layers.Layer):
    """Root mean square layer normalisation (Zhang & Sennrich, 2019).

    `y = x / sqrt(mean(x^2, axis=-1) + epsilon) * scale`: no mean subtraction and no bias.
    This is T5's `LayerNorm` (and LLaMA's / Mixtral's `RMSNorm`).

    Precision: the mean square, the reciprocal square root, the normalisation and the
    multiplication by `scale` are all done in float32, and the result is cast once to the
    layer's compute dtype. Under `"mixed_bfloat16"` / `"mixed_float16"` this keeps the
    statistics in float32 as the zoo's conventions require. Hugging Face's T5 instead casts
    the normalised value to the (half-precision) weight dtype before multiplying by the
    weight, i.e. it rounds twice; the two agree to the half-precision rounding of the result.

    Args:
        epsilon: small positive number added to the mean square (default 1e-6, as in T5).
        use_scale: whether to learn the per-feature `scale` (shape `(dim,)`).
        scale_initializer: initializer of `scale` (default ones).
        **kwargs: base `keras.layers.Layer` arguments.

    Call args:
        inputs: tensor `(..., dim)`, normalised over the last axis.

    Returns:
        Tensor of the same shape, in the layer's compute dtype.

    Example:

    ```python
    norm = kzoo.layers.norm.RMSNorm(epsilon=1e-6)
    y = norm(keras.random.normal((2, 16, 512)))
    ```
    """

    def __init__(self, epsilon=1e-6, use_scale=True, scale_initializer="ones", **kwargs):
        super().__init__(**kwargs)
        self.epsilon = check_positive_float("epsilon", epsilon)
        if not isinstance(use_scale, bool):
            raise ValueError(f"`use_scale` must be True or False; got use_scale={use_scale!r}.")
        self.use_scale = use_scale
        self.scale_initializer = serialize_initializer(scale_initializer, "scale_initializer")
        self.supports_masking = True

    def build(self, input_shape):
        dim = last_axis_size("RMSNorm", input_shape)
        if self.use_scale:
            self.scale = self.add_weight(
                name="scale",
                shape=(dim,),
                initializer=keras.initializers.get(self.scale_initializer),
                trainable=True,
                autocast=False,
            )
        else:
            self.scale = None
        self.built = True

    def call(self, inputs):
        x = ops.cast(inputs, "float32")
        mean_square = ops.mean(ops.square(x), axis=-1, keepdims=True)
        y = x * ops.rsqrt(mean_square + self.epsilon)
        if self.scale is not None:
            y = y * ops.cast(self.scale, "float32")
        return ops.cast(y, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "epsilon": self.epsilon,
                "use_scale": self.use_scale,
                "scale_initializer": self.scale_initializer,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="kzoo")
class LayerNorm(keras.layers.LayerNormalization):
    """Keras' `LayerNormalization`: the same arguments, weights, config and values (in
    float32, cast to the compute dtype), whose TensorFlow form normalising the last axis has
    a hand-written backward pass (`_tf_layer_norm`). The zoo's models build their layer
    norms with it; elsewhere, and for other axes or `rms_scaling`, it is Keras' layer, except
    that on torch axes other than the trailing ones are normalised by `_layer_norm_over`
    (Keras 3.15 gave them to `F.layer_norm`, which raised), and `build` names an `axis` out
    of the input's range or given twice.

    Example:

    ```python
    norm = kzoo.layers.norm.LayerNorm(epsilon=1e-5)
    y = norm(keras.random.normal((2, 16, 512)))
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Keras takes any epsilon: 0, a negative or a NaN one gave NaN for every constant
        # row (an all-zero padding token) in silence, and a string or None failed in the
        # backend's op at the first call (or, None on JAX and torch, meant no epsilon).
        self.epsilon = check_positive_float("epsilon", self.epsilon)

    def build(self, input_shape):
        ndim = len(input_shape)
        axes = list(self.axis) if isinstance(self.axis, (list, tuple)) else [self.axis]
        bad = [a for a in axes if not isinstance(a, int) or not -ndim <= a < ndim]
        if bad or not axes:
            raise ValueError(f"`axis` must name axes of the {ndim}-D input (each in "
                             f"[{-ndim}, {ndim})); got axis={self.axis!r}.")
        if len({a % ndim for a in axes}) != len(axes):
            raise ValueError(f"`axis` names the same axis twice for a {ndim}-D input; got "
                             f"axis={self.axis!r}.")
        super().build(input_shape)

    def call(self, inputs):
        if (TF_HAND_GRADIENT and keras.backend.backend() == "tensorflow"
                and not self.rms_scaling and len(self.axis) == 1
                and self.axis[0] in (-1, len(inputs.shape) - 1)
                and keras.backend.standardize_dtype(inputs.dtype) != "float64"):
            return ops.cast(_tf_layer_norm(inputs, self.gamma, self.beta, self.epsilon),
                            self.compute_dtype)
        if (keras.backend.backend() == "torch" and not self.rms_scaling
                and not _trailing_axes(self.axis, len(inputs.shape))):
            # Keras 3.15 hands any run of adjacent axes to `F.layer_norm`, which normalises
            # trailing axes only: `axis=1` of a 3-D input raised a RuntimeError there.
            return ops.cast(_layer_norm_over(inputs, self.gamma, self.beta, self.axis,
                                             self.epsilon), self.compute_dtype)
        return super().call(inputs)


def _trailing_axes(axes, ndim):
    """Whether `axes` (ints, negative allowed) are exactly the last `len(axes)` of `ndim`."""
    return {a % ndim for a in axes} == set(range(ndim - len(axes), ndim))


def _layer_norm_over(x, gamma, beta, axes, epsilon):
    """Layer normalisation over any `axes` in `keras.ops`: the mean, then the variance of the
    centred values (two passes: torch's `ops.moments` takes `E[x^2] - E[x]^2`, which loses
    the digits of a large mean), in at least float32, `gamma` / `beta` shaped as the
    normalised axes; the result in `x`'s dtype."""
    dtype = keras.backend.standardize_dtype(x.dtype)
    ndim = len(x.shape)
    axes = sorted(a % ndim for a in axes)
    wide = ops.cast(x, keras.backend.result_type(dtype, "float32"))
    centred = wide - ops.mean(wide, axis=axes, keepdims=True)
    inv = ops.rsqrt(ops.mean(ops.square(centred), axis=axes, keepdims=True) + epsilon)
    shape = [x.shape[a] if a in axes else 1 for a in range(ndim)]
    if gamma is not None:
        inv = inv * ops.reshape(ops.cast(gamma, wide.dtype), shape)
    out = centred * inv
    if beta is not None:
        out = out + ops.reshape(ops.cast(beta, wide.dtype), shape)
    return ops.cast(out, dtype)


# TensorFlow: `LayerNorm` normalises with `_tf_layer_norm` (a hand-written backward pass).
TF_HAND_GRADIENT = True


def _tf_layer_norm(x, gamma, beta, epsilon):
    """Layer normalisation over the last axis on TensorFlow, in float32, with a hand-written
    backward pass: `x_hat = (x - mean) * r` (`r = 1 / sqrt(var + epsilon)`), `y = x_hat *
    gamma + beta`; `dx = r * (dx_hat - mean(dx_hat) - x_hat * mean(dx_hat * x_hat))` with
    `dx_hat = dy * gamma`, `dgamma = sum(dy * x_hat)`, `dbeta = sum(dy)` over the leading
    axes. Keras' form (`ops.layer_normalization`: `tf.nn.moments`, then `x * (r * gamma) +
    (beta - mean * r * gamma)`) is differentiated by TensorFlow op by op, with the moments'
    broadcasting (`Tile`) and the per-row products as extra passes. Measured on the 2-core
    CPU at (2048, 256) float32, forward + backward in a graph: 2.48-2.58 -> 1.87-1.91 ms."""
    import tensorflow as tf

    x = tf.cast(x, tf.float32)
    weights = [tf.cast(tf.convert_to_tensor(w), tf.float32)
               for w in (gamma, beta) if w is not None]
    has_gamma, has_beta = gamma is not None, beta is not None
    lead = list(range(len(x.shape) - 1))

    @tf_custom_gradient
    def norm(x, *weights):
        centred = x - tf.reduce_mean(x, axis=-1, keepdims=True)
        r = tf.math.rsqrt(tf.reduce_mean(tf.square(centred), axis=-1, keepdims=True)
                          + epsilon)
        x_hat = centred * r
        y = x_hat * weights[0] if has_gamma else x_hat
        if has_beta:
            y = y + weights[-1]

        def grad(dy):
            d_hat = dy * weights[0] if has_gamma else dy
            dx = r * (d_hat - tf.reduce_mean(d_hat, axis=-1, keepdims=True)
                      - x_hat * tf.reduce_mean(d_hat * x_hat, axis=-1, keepdims=True))
            grads = [dx]
            if has_gamma:
                grads.append(tf.reduce_sum(dy * x_hat, axis=lead))
            if has_beta:
                grads.append(tf.reduce_sum(dy, axis=lead))
            return grads

        return y, grad

    return norm(x, *weights)

