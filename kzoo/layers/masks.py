"""Boolean attention masks, always normalised to 4-D `(batch, 1|heads, q_len, k_len)`.

Convention: `True` means "this query may attend to this key". Every function here returns
a 4-D boolean tensor so that no kernel ever has to guess what a 2-D or 3-D mask means (Keras'
own `ops.dot_product_attention` reads them differently per backend).

Positions: query `i` sits at absolute position `offset + i` and key `j` at position `j`.
When `offset` is omitted it is `k_len - q_len` ("bottom-right" alignment), which is what
incremental decoding with a key/value cache needs: the last query sees every key.

Packed rows (several documents a row, `document_ids` 1, 2, ... and 0 for padding):
`document_mask` keeps each token inside its document, `document_positions` restarts the
positions at 0 at each document.
"""

import keras
import numpy as np
from keras import ops

from kzoo.layers.utils import FieldError, check_positive_int


def _check_length(name, value):
    """A static length must be an integer >= 0 (traced lengths pass): -1 gave an empty mask
    on JAX and errors from inside torch and TensorFlow, 2.5 a mask of 3 on two backends."""
    if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, (float, np.floating))
            or (isinstance(value, (int, np.integer)) and value < 0)):
        raise ValueError(f"`{name}` must be an integer >= 0; got {name}={value!r}.")


def _positions(query_length, key_length, offset):
    _check_length("query_length", query_length)
    _check_length("key_length", key_length)
    if key_length is None:
        key_length = query_length
    if offset is None:
        offset = key_length - query_length
    q_pos = ops.expand_dims(ops.arange(query_length, dtype="int32") + ops.cast(offset, "int32"), 1)
    k_pos = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
    return q_pos, k_pos


def causal_mask(query_length, key_length=None, offset=None):
    """Causal mask: query `i` may see key `j` when `j <= offset + i`.

    Args:
        query_length: number of queries (Python int).
        key_length: number of keys (defaults to `query_length`).
        offset: absolute position of the first query; an int or a scalar tensor (the cache
            index during decoding). Defaults to `key_length - query_length`.

    Returns:
        A boolean tensor of shape `(1, 1, query_length, key_length)`.

    Example:
    >>> causal_mask(3)[0, 0]        # lower-triangular
    >>> causal_mask(1, 5)[0, 0]     # the one query sees all five keys
    """
    q_pos, k_pos = _positions(query_length, key_length, offset)
    return ops.expand_dims(ops.expand_dims(k_pos <= q_pos, 0), 0)


def sliding_window_mask(query_length, key_length=None, window=None, offset=None, causal=True):
    """Local attention: each query sees at most `window` keys around its own position.

    With `causal=True` query at position p sees keys in `[p - window + 1, p]` (Mistral-style
    sliding window, the query's own position included). With `causal=False` it sees keys with
    `|p - j| < window`.

    Returns:
        A boolean tensor of shape `(1, 1, query_length, key_length)`.

    Example:
    >>> sliding_window_mask(6, window=3)[0, 0]   # a band of width 3 below the diagonal
    """
    check_positive_int("window", window)
    q_pos, k_pos = _positions(query_length, key_length, offset)
    distance = q_pos - k_pos
    if causal:
        allowed = ops.logical_and(distance >= 0, distance < window)
    else:
        allowed = ops.abs(distance) < window
    return ops.expand_dims(ops.expand_dims(allowed, 0), 0)


def padding_mask(mask):
    """Key padding mask `(batch, k_len)` (True/1 = real token) -> `(batch, 1, 1, k_len)`.

    Example:
    >>> padding_mask([[1, 1, 0]]).shape
    (1, 1, 1, 3)
    """
    mask = ops.convert_to_tensor(mask)
    if len(mask.shape) != 2:
        raise ValueError(
            "`mask` for padding_mask must have shape (batch, key_length); "
            f"got shape {tuple(mask.shape)}."
        )
    if "float" in keras.backend.standardize_dtype(mask.dtype):
        # (cast to bool, an additive mask of 0 / -1e9 was read the other way round)
        raise ValueError(
            "`mask` for padding_mask must be boolean (True = a token) or integer 0 / 1; got "
            f"dtype {keras.backend.standardize_dtype(mask.dtype)}. An additive mask (0 / "
            "-inf) goes in the attention's `bias`.")
    mask = ops.cast(mask, "bool")
    return mask[:, None, None, :]


def normalize_mask(mask, name="mask"):
    """Return `mask` as a 4-D boolean tensor.

    - rank 2 `(batch, k_len)`: a key padding mask -> `(batch, 1, 1, k_len)`;
    - rank 3 `(batch, q_len, k_len)`: a per-example mask -> `(batch, 1, q_len, k_len)`;
    - rank 4: returned as is (cast to bool).

    This is the convention of `kzoo.layers.MultiHeadAttention(attention_mask=...)` and of
    Keras' MHA. (`dot_product_attention` itself broadcasts NumPy-style instead.)

    Example:
    >>> normalize_mask([[1, 0]]).shape
    (1, 1, 1, 2)
    """
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    rank = len(mask.shape)
    if rank == 2:
        mask = mask[:, None, None, :]
    elif rank == 3:
        mask = mask[:, None, :, :]
    elif rank != 4:
        raise ValueError(
            f"`{name}` must have rank 2 (batch, k_len), 3 (batch, q_len, k_len) or "
            f"4 (batch, heads, q_len, k_len); got shape {tuple(mask.shape)}."
        )
    if mask.dtype != "bool":
        mask = ops.cast(mask, "bool")
    return mask


def merge_masks(*masks):
    """Logical AND of several masks (None entries are ignored); each is normalised to 4-D.

    Returns None when every mask is None.

    Example:
    >>> m = merge_masks(causal_mask(4), padding_mask([[1, 1, 1, 0]]))
    >>> m.shape
    (1, 1, 4, 4)
    """
    result, shapes = None, []
    for position, mask in enumerate(masks):
        if mask is None:
            continue
        mask = normalize_mask(mask, f"masks[{position}]")
        shapes.append((position, tuple(mask.shape)))
        if result is not None:
            _check_mergeable(shapes)
        result = mask if result is None else ops.logical_and(result, mask)
    return result


def _check_mergeable(shapes):
    """Refuse 4-D mask shapes that do not broadcast together (the backends' own errors
    named no mask: "Incompatible shapes" / "The size of tensor a (3) must match")."""
    for axis in range(4):
        sizes = {shape[axis] for _, shape in shapes if shape[axis] not in (None, 1)}
        if len(sizes) > 1:
            listed = ", ".join(f"masks[{position}] {shape}" for position, shape in shapes)
            raise ValueError(
                f"`merge_masks` takes masks that broadcast together to (batch, heads, query, "
                f"key); got {listed}, whose axis {axis} sizes {sorted(sizes)} differ.")


# === Packed sequences (several documents a row) ===


def _document_ids(document_ids, name="document_ids"):
    """`document_ids` as an int tensor `(batch, seq)`; NumPy / lists are checked for
    negative ids here (tensors are checked by the models' entry points, `kzoo.inputs`)."""
    host = None
    if isinstance(document_ids, (list, tuple, np.ndarray, np.generic)):
        host = np.asarray(document_ids)
        if host.dtype == object or not (np.issubdtype(host.dtype, np.integer)
                                        and host.dtype != np.bool_):
            raise TypeError(
                f"`{name}` must hold integer document ids; got an array of dtype "
                f"{host.dtype} and shape {host.shape}."
            )
    ids = ops.convert_to_tensor(document_ids)
    dtype = keras.backend.standardize_dtype(ids.dtype)
    if not dtype.startswith(("int", "uint")):
        raise TypeError(
            f"`{name}` must hold integer document ids (int32); got dtype {dtype} and shape "
            f"{tuple(ids.shape)}."
        )
    if len(ids.shape) != 2:
        raise ValueError(
            f"`{name}` must have shape (batch, seq); got shape {tuple(ids.shape)}."
        )
    if host is not None and host.size and host.min() < 0:
        raise ValueError(
            f"`{name}` must be >= 0 (0 = padding, 1, 2, ... = the documents of a row); got "
            f"{int(host.min())}."
        )
    return ops.cast(ids, "int32")


def document_mask(document_ids):
    """Block-diagonal mask of packed rows: query `i` may attend key `j` only when both
    tokens belong to the same document, i.e. `document_ids[b, i] == document_ids[b, j] != 0`.

    Convention of packed sequences: `document_ids (batch, seq)` numbers the documents of
    each row 1, 2, 3, ... and gives padding the id 0; a padding query attends to nothing
    (its row of the mask is all False; the kernels give such rows a finite output). Merge
    it with `causal_mask` (decoders) and `padding_mask` with `merge_masks`.

    Args:
        document_ids: int `(batch, seq)`, >= 0.

    Returns:
        A boolean tensor `(batch, 1, seq, seq)`.

    Raises:
        TypeError: `document_ids` is not an integer array.
        ValueError: its rank is not 2, or (NumPy input) it holds a negative id.

    Example:
    >>> document_mask([[1, 1, 2, 0]])[0, 0]
    [[ True,  True, False, False],
     [ True,  True, False, False],
     [False, False,  True, False],
     [False, False, False, False]]
    >>> merge_masks(causal_mask(4), document_mask([[1, 1, 2, 0]]))   # GPT on packed rows
    """
    ids = _document_ids(document_ids)
    same = ops.equal(ids[:, :, None], ids[:, None, :])
    real = ops.not_equal(ids, 0)[:, :, None]
    return ops.logical_and(same, real)[:, None, :, :]


def document_positions(document_ids):
    """Positions that restart at 0 at each document of a packed row: the position of a
    token is the number of earlier tokens of its row with the same document id, so each
    document sees positions `0, 1, ..., length - 1`, as it would alone. Padding (id 0)
    gets position 0.

    Args:
        document_ids: int `(batch, seq)`, >= 0 (see `document_mask`).

    Returns:
        An int32 tensor `(batch, seq)`: what `PositionEmbedding(..., start_index=...)` and
        `RotaryEmbedding(..., start_index=...)` take as per-token positions.

    Example:
    >>> document_positions([[1, 1, 1, 2, 2, 0]])
    [[0, 1, 2, 0, 1, 0]]
    """
    ids = _document_ids(document_ids)
    index = ops.cumsum(ops.ones_like(ids), axis=1)  # 1..seq (no arange: seq may be None)
    earlier = ops.less(index[:, None, :], index[:, :, None])  # (batch, q, k): k before q
    same = ops.logical_and(ops.equal(ids[:, :, None], ids[:, None, :]), earlier)
    positions = ops.sum(ops.cast(same, "int32"), axis=-1)
    return ops.where(ops.not_equal(ids, 0), positions, ops.zeros_like(positions))


def check_packed_attention(packed_inputs, attention):
    """Raise a `FieldError` (`ValueError`) on the field `packed_inputs` when packed rows
    (`document_mask`) meet an efficient attention type: those kernels take a key padding
    mask only, not a per-query block-diagonal mask."""
    if packed_inputs and attention != "full":
        raise FieldError(
            "`packed_inputs`=True (several documents a row, kept apart by a block-diagonal "
            f"mask) needs attention='full'; got attention={attention!r}, whose kernel takes "
            "a key padding mask only. Pack with attention='full', or train this attention "
            "type on one document a row (packed_inputs=False).",
            "packed_inputs",
        )
