"""Losses for the recipes.

Keras 3's `SparseCategoricalCrossentropy` has no label smoothing, so the classification
and language-model recipes use `SmoothedSparseCrossentropy`: cross-entropy against
`(1 - eps) * onehot(y) + eps / V` (Szegedy et al. 2016), computed in float32 from logits,
averaged over the sample weights (`mean_with_sample_weight`: padding and unmasked
positions count for nothing and do not dilute the mean).
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="kzoo_training")
class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Sparse categorical cross-entropy from logits with label smoothing.

    `loss = (1 - eps) * (-log p_y) + eps * mean_v(-log p_v)`.

    Args:
        label_smoothing: `eps` in [0, 1).
        name: loss name.

    Example:
    >>> loss = SmoothedSparseCrossentropy(label_smoothing=0.1)
    >>> loss(np.array([[1]]), np.array([[[0.0, 5.0]]]), sample_weight=np.array([[1.0]]))
    """

    def __init__(self, label_smoothing=0.0, name="smoothed_sparse_crossentropy",
                 reduction="mean_with_sample_weight", dtype=None):
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(
                f"`label_smoothing` must be in [0, 1); got label_smoothing={label_smoothing!r}."
            )
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == 1:
            y_true = ops.squeeze(y_true, -1)  # (..., 1) targets, as Keras' loss takes them
        logits = ops.cast(y_pred, "float32")
        log_probs = ops.log_softmax(logits, axis=-1)
        labels = ops.cast(y_true, "int32")
        nll = -ops.take_along_axis(log_probs, ops.expand_dims(labels, -1), axis=-1)[..., 0]
        if not self.label_smoothing:
            return nll
        uniform = -ops.mean(log_probs, axis=-1)
        return (1.0 - self.label_smoothing) * nll + self.label_smoothing * uniform

    def get_config(self):
        config = super().get_config()
        config["label_smoothing"] = self.label_smoothing
        return config
