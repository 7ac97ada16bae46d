"""Boolean attention masks, always normalised to 4-D `(batch, 1|heads, q_len, k_len)`.

Convention: `True` means "this query may attend to this key". Every function here returns
a 4-D boolean tensor so that no kernel ever has to guess what a 2-D or 3-D mask means (Keras'
own `ops.dot_product_attention` reads them differently per backend).

Positions: query `i` sits at absolute position `offset + i` and key `j` at position `j`.
When `offset` is omitted it is `k_len - q_len` ("bottom-right" alignment), which is what
incremental decoding with a key/value cache needs: the last query sees every key.
"""

from keras import ops

from kzoo.layers.utils import check_positive_int


def _positions(query_length, key_length, offset):
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
    result = None
    for mask in masks:
        if mask is None:
            continue
        mask = normalize_mask(mask)
        result = mask if result is None else ops.logical_and(result, mask)
    return result
