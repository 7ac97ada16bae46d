"""scikit-learn's 8x8 handwritten digits as a small image-classification set (no download)."""

import numpy as np

__all__ = ["load_digits_split"]


def load_digits_split(test_size=0.2, seed=0, validation_size=None):
    """Load scikit-learn's digits and split them into stratified train / test sets.

    The 1797 grey-scale 8x8 images of `sklearn.datasets.load_digits` (UCI optical
    recognition of handwritten digits, pixel values 0..16) are divided by 16 to lie in
    [0, 1] and given a channel axis, ready for a ViT with `patch_size` 2 or 4. The split
    is `sklearn.model_selection.train_test_split(..., stratify=labels)`, so each class
    keeps its proportion in both parts.

    With `validation_size`, a validation set (for early stopping or model selection) is
    split off the training part in the same way (stratified, `random_state=seed`); the
    test set is then the same as without it, and training + validation together are the
    training set of the two-way split.

    Args:
        test_size: number in (0, 1), the fraction of images held out. Defaults to 0.2.
        seed: int, the `random_state` of the split (the same seed gives the same split).
        validation_size: None (default: no validation set) or a number in (0, 1), the
            fraction of the non-test images held out for validation.

    Returns:
        `(x_train, y_train, x_test, y_test)`: float32 images of shape `(N, 8, 8, 1)` in
        [0, 1] and int32 labels in 0..9; with `validation_size`,
        `(x_train, y_train, x_val, y_val, x_test, y_test)`.

    Example:

    ```python
    x_train, y_train, x_test, y_test = kzoo.data.load_digits_split(test_size=0.2, seed=0)
    x_train.shape  # (1437, 8, 8, 1)
    x_train, y_train, x_val, y_val, x_test, y_test = kzoo.data.load_digits_split(
        test_size=0.2, seed=0, validation_size=0.1
    )
    x_train.shape, x_val.shape  # (1293, 8, 8, 1), (144, 8, 8, 1)
    ```
    """
    for name, value in (("test_size", test_size), ("validation_size", validation_size)):
        if name == "validation_size" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0.0 < value < 1.0
        ):
            raise ValueError(f"`{name}` must be a number in (0, 1); got {name}={value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"`seed` must be a non-negative integer; got seed={seed!r}.")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[..., None]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=float(test_size), stratify=labels, random_state=int(seed)
    )
    if validation_size is None:
        return x_train, y_train, x_test, y_test
    x_train, x_val, y_train, y_val = train_test_split(
        x_train, y_train, test_size=float(validation_size), stratify=y_train,
        random_state=int(seed)
    )
    return x_train, y_train, x_val, y_val, x_test, y_test
