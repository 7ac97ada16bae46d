"""Normalisation layers."""

import keras
from keras import ops

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
        self.scale_initializer = serialize_initializer(scale_initializer)
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
