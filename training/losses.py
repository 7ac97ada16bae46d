"""Losses for the recipes.

Keras 3's `SparseCategoricalCrossentropy` has no label smoothing, so the classification
and language-model recipes use `SmoothedSparseCrossentropy`: cross-entropy against
`(1 - eps) * onehot(y) + eps / V` (Szegedy et al. 2016), computed in float32 from logits,
averaged over the sample weights (`mean_with_sample_weight`: padding and unmasked
positions count for nothing and do not dilute the mean). Targets equal to `ignore_index`
(-100, Hugging Face's labels for tokens without a loss) count for nothing either, as in
`torch.nn.functional.cross_entropy(ignore_index=-100, label_smoothing=eps)`.
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
        reduction: a Keras reduction name (default `"mean_with_sample_weight"`).
        ignore_index: targets equal to it get a zero loss and gradient and a zero sample
            weight (so the default reduction leaves them out of the mean); None: none.

    Example:
    >>> loss = SmoothedSparseCrossentropy(label_smoothing=0.1)
    >>> loss(np.array([[1]]), np.array([[[0.0, 5.0]]]), sample_weight=np.array([[1.0]]))
    """

    def __init__(self, label_smoothing=0.0, name="smoothed_sparse_crossentropy",
                 reduction="mean_with_sample_weight", dtype=None, ignore_index=-100):
        try:
            in_range = 0.0 <= float(label_smoothing) < 1.0
        except (TypeError, ValueError):  # (float()'s own message named no argument)
            in_range = False
        if not in_range:
            raise ValueError(
                f"`label_smoothing` must be in [0, 1); got label_smoothing={label_smoothing!r}."
            )
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.label_smoothing = float(label_smoothing)
        if ignore_index is not None and (isinstance(ignore_index, bool)
                                         or not isinstance(ignore_index, int)):
            raise ValueError(
                "`ignore_index` must be an integer target to leave out of the loss, or None; "
                f"got ignore_index={ignore_index!r}.")
        self.ignore_index = ignore_index

    def __call__(self, y_true, y_pred, sample_weight=None):
        if self.ignore_index is None:
            return super().__call__(y_true, y_pred, sample_weight)
        y_true = ops.convert_to_tensor(y_true)
        kept = ops.cast(ops.not_equal(_drop_trailing_axis(y_true, y_pred), self.ignore_index),
                        "float32")
        if sample_weight is not None:  # ((batch,) weights of (batch, seq) targets too)
            sample_weight = ops.cast(ops.convert_to_tensor(sample_weight), "float32")
            while len(sample_weight.shape) < len(kept.shape):
                sample_weight = ops.expand_dims(sample_weight, -1)
            kept = kept * sample_weight
        return super().__call__(y_true, y_pred, kept)

    def call(self, y_true, y_pred):
        y_true = _drop_trailing_axis(y_true, y_pred)
        logits = ops.cast(y_pred, "float32")
        log_probs = ops.log_softmax(logits, axis=-1)
        labels = ops.cast(y_true, "int32")
        ignored = None
        if self.ignore_index is not None:
            ignored = ops.equal(labels, self.ignore_index)
            labels = ops.where(ignored, 0, labels)  # (a valid index; its loss is dropped)
        nll = -ops.take_along_axis(log_probs, ops.expand_dims(labels, -1), axis=-1)[..., 0]
        if self.label_smoothing:
            uniform = -ops.mean(log_probs, axis=-1)
            nll = (1.0 - self.label_smoothing) * nll + self.label_smoothing * uniform
        return nll if ignored is None else ops.where(ignored, 0.0, nll)

    def get_config(self):
        config = super().get_config()
        config["label_smoothing"] = self.label_smoothing
        config["ignore_index"] = self.ignore_index
        return config


def _drop_trailing_axis(y_true, y_pred):
    """`(..., 1)` targets of `(..., vocab)` logits without the 1, as Keras' loss takes them."""
    if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == 1:
        return ops.squeeze(y_true, -1)
    return y_true
