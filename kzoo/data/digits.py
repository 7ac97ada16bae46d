"""scikit-learn's 8x8 handwritten digits as a small image-classification set (no download)."""

import numpy as np

__all__ = ["load_digits_split"]


def load_digits_split(test_size=0.2, seed=0):
    """Load scikit-learn's digits and split them into stratified train / test sets.

    The 1797 grey-scale 8x8 images of `sklearn.datasets.load_digits` (UCI optical
    recognition of handwritten digits, pixel values 0..16) are divided by 16 to lie in
    [0, 1] and given a channel axis, ready for a ViT with `patch_size` 2 or 4. The split
    is `sklearn.model_selection.train_test_split(..., stratify=labels)`, so each class
    keeps its proportion in both parts.

    Args:
        test_size: number in (0, 1), the fraction of images held out. Defaults to 0.2.
        seed: int, the `random_state` of the split (the same seed gives the same split).

    Returns:
        `(x_train, y_train, x_test, y_test)`: float32 images of shape `(N, 8, 8, 1)` in
        [0, 1] and int32 labels in 0..9.

    Example:

    ```python
    x_train, y_train, x_test, y_test = kzoo.data.load_digits_split(test_size=0.2, seed=0)
    x_train.shape  # (1437, 8, 8, 1)
    ```
    """
    if isinstance(test_size, bool) or not isinstance(test_size, (int, float)) or not (
        0.0 < test_size < 1.0
    ):
        raise ValueError(f"`test_size` must be a number in (0, 1); got test_size={test_size!r}.")
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
    return x_train, y_train, x_test, y_test
