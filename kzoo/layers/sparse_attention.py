"""Sparse attention kernels whose time and memory really grow sub-quadratically.

Every function here takes the layout of `kzoo.layers.dot_product_attention` — query, key and
value `(batch, seq, heads, head_dim)`, key/value heads dividing the query heads (GQA/MQA) —
computes self-attention (`q_len == k_len`) exactly for its sparsity pattern, and never builds
a `(seq, seq)` score tensor, forward or backward (the backward pass is autodiff of the same
blocked computation, so it stores only what the forward pass built). Each one equals
`reference_attention` with the equivalent dense boolean mask (see the tests).

- `sliding_window_attention`: local band, the convention of `kzoo.layers.sliding_window_mask`
  (bidirectional `|i - j| < window`; causal `0 <= i - j < window`). The sequence is cut into
  blocks of `block_size >= window`; each query block scores its own and the neighbouring key
  blocks only (causal: itself and the previous one): O(n * block) time and memory.
- `strided_attention`: the *strided* pattern of Child et al. 2019 ("Generating long
  sequences with sparse transformers"), both of its heads merged into one softmax: query `i`
  sees key `j` when `|i - j| < stride` (local) or `(i - j) % stride == 0` (strided); causal
  adds `j <= i`. O(n * (stride + n / stride)), i.e. O(n^1.5) with `stride ~ sqrt(n)`.
- `longformer_attention`: sliding window plus global tokens (Beltagy et al. 2020): global
  tokens attend to every key and every query attends to them. The global rows and columns are
  computed as separate dense `(n_global, n)` pieces, the rest as the banded kernel.
- `block_sparse_attention`: a user-given boolean block layout `(heads or 1, n_blocks,
  n_blocks)` (Sparse Transformer style): each query block gathers its active key blocks.
  Block rows that are fully active in every head (global blocks) run as a dense slab.
- `bigbird_layout` / `bigbird_attention`: BigBird's window + global + random blocks (Zaheer
  et al. 2020), random blocks drawn by NumPy from `seed`, so the layout is deterministic.

Conventions shared with `kernels.py`: `mask` is a key padding mask, `(batch, seq)` or 4-D
`(batch|1, 1, 1, seq)`, True = real token; softmax statistics in float32; a query row that
sees no key gives zeros, never NaN; `scale` defaults to `head_dim ** -0.5`. Sequences whose
length is not a multiple of the block size are padded internally (padded keys are never seen,
padded queries are cut off).
"""

import math
import warnings

import keras
import numpy as np
from keras import ops

from kzoo.layers.utils import check_bool, check_non_negative_int, check_positive_int

_NEG = -1e30  # finite "minus infinity" for float32 scores, as in kernels.py


# === Argument checks ===


def _check_qkv(query, key, value, scale):
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    for name, t in (("query", query), ("key", key), ("value", value)):
        if len(t.shape) != 4:
            raise ValueError(
                f"`{name}` must have rank 4 (batch, seq, heads, head_dim); got {name} with "
                f"shape {tuple(t.shape)}."
            )
    if tuple(key.shape) != tuple(value.shape):
        raise ValueError(
            f"`key` and `value` must have the same shape; got key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}."
        )
    b, n, heads, dim = query.shape
    kb, kn, kv_heads, kdim = key.shape
    if n is None or kn is None:
        raise ValueError("sparse attention needs static sequence lengths; got None.")
    if kn != n:
        raise ValueError(
            f"sparse attention is self-attention: `query` and `key` must have the same "
            f"sequence length; got query {tuple(query.shape)} and key {tuple(key.shape)}."
        )
    if kdim != dim:
        raise ValueError(
            f"`query` and `key` must have the same head_dim; got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
    if heads % kv_heads != 0:
        raise ValueError(
            f"the number of query heads ({heads}) must be a multiple of the number of "
            f"key/value heads ({kv_heads}); got query {tuple(query.shape)} and key "
            f"{tuple(key.shape)}."
        )
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"`scale` must be a Python number or None; got scale={scale!r}.")
    scale = float(scale)
    if scale < 1.0 and keras.backend.standardize_dtype(query.dtype) == "float16":
        # float16 products stop at 65504: `q . k` of 64 dims of size ~40 is inf before the
        # scale comes (NaN outputs where full attention gives numbers). Scale the queries
        # first, as the full kernels do, and the products stay in range.
        query, scale = query * ops.cast(scale, query.dtype), 1.0
    return query, key, value, scale


def _key_mask(mask, n):
    """A key padding mask as a `(batch|1, n)` boolean tensor (or None)."""
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    shape = tuple(mask.shape)
    if len(shape) == 4 and shape[1] == 1 and shape[2] == 1:
        mask = ops.reshape(mask, (-1, shape[3]))
    elif len(shape) != 2:
        raise ValueError(
            "`mask` must be a key padding mask of shape (batch, seq) or (batch, 1, 1, seq) "
            f"(True = real token); got mask with shape {shape}. Sparse kernels take no "
            "general (q, k) mask: their pattern is the mask."
        )
    if mask.shape[1] != n:
        raise ValueError(
            f"`mask` must have seq={n} keys in its last axis; got mask with shape {shape}."
        )
    return ops.cast(mask, "bool")


def _block_size(block_size, window, name="block_size"):
    if block_size is None:
        return window
    block_size = check_positive_int(name, block_size)
    if block_size < window:
        raise ValueError(
            f"`{name}` must be >= window={window} (a query block then needs only its "
            f"neighbouring key blocks); got {name}={block_size}."
        )
    return block_size


# === Shared numerics ===


def _softmax_parts(parts, out_dtype):
    """One softmax over the concatenated keys of several parts, and its output.

    `parts` is a list of `(scores, allowed, apply)`: float32 scores `(..., q, s_i)` laid out
    alike up to their last axis, a boolean `allowed` broadcasting to them, and `apply(w)` that
    turns normalised weights `w` (in the value dtype) into an output contribution. Rows with
    no allowed key give zeros.
    """
    masked = [ops.where(a, s, _NEG) for s, a, _ in parts]
    m = ops.max(masked[0], axis=-1, keepdims=True)
    for s in masked[1:]:
        m = ops.maximum(m, ops.max(s, axis=-1, keepdims=True))
    exps = [ops.where(a, ops.exp(s - m), 0.0) for s, (_, a, _) in zip(masked, parts)]
    den = sum(ops.sum(e, axis=-1, keepdims=True) for e in exps)
    den = ops.where(den > 0, den, 1.0)
    out = None
    for e, (_, _, apply) in zip(exps, parts):
        o = apply(e / den)
        out = o if out is None else out + o
    return ops.cast(out, out_dtype)


def _blocks(x, block, n_blocks):
    """(b, n, ...) -> (b, n_blocks, block, ...), padding the sequence with zeros/False."""
    pad = n_blocks * block - x.shape[1]
    if pad:
        widths = [[0, 0]] * len(x.shape)
        widths[1] = [0, pad]
        x = ops.pad(x, widths, constant_values=False if x.dtype == "bool" else 0)
    return ops.reshape(x, (-1, n_blocks, block) + tuple(x.shape[2:]))


def _neighbours(xb, causal):
    """(b, nb, B, ...) -> keys of blocks (i-1, i[, i+1]) per block: (b, nb, 2B|3B, ...)."""
    widths = [[0, 0]] * len(xb.shape)
    widths[1] = [1, 0 if causal else 1]
    fill = False if xb.dtype == "bool" else 0
    padded = ops.pad(xb, widths, constant_values=fill)
    nb = xb.shape[1]
    pieces = [padded[:, 0:nb], padded[:, 1:nb + 1]]
    if not causal:
        pieces.append(padded[:, 2:nb + 2])
    return ops.concatenate(pieces, axis=2)


def _local_setup(query, key, value, mask, window, block, causal):
    """Blocked queries and the banded local part shared by the window-based kernels."""
    n, heads, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[2]
    g = heads // kv_heads
    nb = -(-n // block)
    qb = ops.reshape(_blocks(query, block, nb), (-1, nb, block, kv_heads, g, dim))
    kn = _neighbours(_blocks(key, block, nb), causal)  # (b, nb, S, hk, d)
    vn = _neighbours(_blocks(value, block, nb), causal)
    valid = ops.ones((1, n), "bool") if mask is None else mask
    valid_n = _neighbours(_blocks(valid, block, nb), causal)  # (b|1, nb, S)
    # Band on positions: query i = a*B + r, key j = (a-1)*B + c.
    qpos = np.arange(block)[:, None]
    kpos = np.arange(valid_n.shape[2])[None, :] - block
    dist = qpos - kpos
    band = (dist >= 0) & (dist < window) if causal else np.abs(dist) < window
    allowed = ops.logical_and(
        valid_n[:, :, None, None, None, :],  # (b, nb, 1, 1, 1, S)
        ops.convert_to_tensor(band[None, None, None, None]),  # (1, 1, 1, 1, B, S)
    )
    scores = ops.cast(ops.einsum("bnqkgd,bnskd->bnkgqs", qb, kn), "float32")

    def apply(w):
        return ops.einsum("bnkgqs,bnskd->bnqkgd", ops.cast(w, value.dtype), vn)

    return qb, nb, (scores, allowed, apply)


def _unblock(out, n, heads):
    """(b, nb, B, hk, g, d) -> (b, n, heads, d)."""
    nb, block, dim = out.shape[1], out.shape[2], out.shape[-1]
    out = ops.reshape(out, (-1, nb * block, heads, dim))
    return out[:, :n]


# === Sliding window ===


def sliding_window_attention(query, key, value, window, *, causal=False, mask=None, scale=None,
                             block_size=None):
    """Exact local attention in O(n * window) time and memory.

    Query `i` sees key `j` when `|i - j| < window` (bidirectional) or `0 <= i - j < window`
    (`causal=True`), as `kzoo.layers.sliding_window_mask`; keys a padding `mask` hides are
    never seen. The sequence is cut into blocks of `block_size` (default `window`, at least
    `window`) and each query block scores 3 key blocks (causal: 2).

    Args:
        query: `(batch, seq, heads, head_dim)`.
        key, value: `(batch, seq, kv_heads, head_dim)`, `heads % kv_heads == 0`.
        window: positive int, the window described above.
        causal: also hide future keys.
        mask: key padding mask `(batch, seq)` or `(batch, 1, 1, seq)`, True = real token.
        scale: score multiplier, default `head_dim ** -0.5`.
        block_size: block length, `>= window`.

    Returns:
        `(batch, seq, heads, head_dim)` in the query's dtype.

    Example:
    >>> q = keras.random.normal((2, 100, 4, 16)); kv = keras.random.normal((2, 100, 2, 16))
    >>> sliding_window_attention(q, kv, kv, window=8, causal=True).shape
    (2, 100, 4, 16)
    """
    query, key, value, scale = _check_qkv(query, key, value, scale)
    window = check_positive_int("window", window)
    causal = check_bool("causal", causal)
    block = _block_size(block_size, window)
    n, heads = query.shape[1], query.shape[2]
    mask = _key_mask(mask, n)
    if n <= window:
        # The window hides no key of a sequence this short: plain attention on the backend's
        # kernel. (Blocks of `window` rows padded a 16-token sequence to 4,096 rows under
        # Mistral's window: 6 s instead of milliseconds, torch CPU.)
        from kzoo.layers.kernels import dot_product_attention

        return dot_product_attention(
            query, key, value, mask=None if mask is None else mask[:, None, None, :],
            is_causal=causal, scale=scale)
    if n < block:
        block = n  # one block holds every key (exact whatever the window)
    _, _, (scores, allowed, apply) = _local_setup(query, key, value, mask, window, block, causal)
    out = _softmax_parts([(scores * scale, allowed, apply)], query.dtype)
    return _unblock(out, n, heads)


# === Strided (Child et al. 2019) ===


def strided_attention(query, key, value, stride, *, causal=False, mask=None, scale=None):
    """Exact strided sparse attention of Child et al. (2019), both patterns in one softmax.

    Query `i` sees key `j` when `|i - j| < stride` (the local head) or `(i - j) % stride == 0`
    (the strided head); with `causal=True` only keys `j <= i`. Time and memory are
    O(n * (3 * stride + n / stride)): choose `stride ~ sqrt(n)` for O(n^1.5).

    Args:
        query, key, value, mask, scale: as `sliding_window_attention`.
        stride: positive int, the stride `l` of the paper (also the local window).
        causal: also hide future keys (the paper's autoregressive setting).

    Returns:
        `(batch, seq, heads, head_dim)` in the query's dtype.

    Example:
    >>> x = keras.random.normal((1, 64, 2, 8))
    >>> strided_attention(x, x, x, stride=8, causal=True).shape
    (1, 64, 2, 8)
    """
    query, key, value, scale = _check_qkv(query, key, value, scale)
    stride = check_positive_int("stride", stride)
    causal = check_bool("causal", causal)
    n, heads = query.shape[1], query.shape[2]
    mask = _key_mask(mask, n)
    qb, nb, (scores, allowed, apply) = _local_setup(query, key, value, mask, stride, stride,
                                                    causal)
    # Strided keys: query (a, r) sees key (a', r); a' == a is already in the local part.
    kb = _blocks(key, stride, nb)  # (b, nb, B, hk, d)
    vb = _blocks(value, stride, nb)
    s_scores = ops.cast(ops.einsum("bnqkgd,bmqkd->bnkgqm", qb, kb), "float32")
    a = np.arange(nb)
    blocks_ok = (a[:, None] > a[None, :]) if causal else (a[:, None] != a[None, :])
    valid = ops.ones((1, n), "bool") if mask is None else mask
    valid_b = ops.transpose(_blocks(valid, stride, nb), (0, 2, 1))  # (b, B=r, nb=a')
    s_allowed = ops.logical_and(
        ops.convert_to_tensor(blocks_ok[None, :, None, None, None, :]),
        valid_b[:, None, None, None, :, :],
    )

    def s_apply(w):
        return ops.einsum("bnkgqm,bmqkd->bnqkgd", ops.cast(w, value.dtype), vb)

    out = _softmax_parts(
        [(scores * scale, allowed, apply), (s_scores * scale, s_allowed, s_apply)],
        query.dtype,
    )
    return _unblock(out, n, heads)


# === Longformer (window + global tokens) ===


def _global_slots(global_tokens, n, batch, max_global):
    """Global tokens -> (flags (b|1, n) bool, one-hot (b|1, G, n) float32, slot valid (b|1, G)
    bool, positions (b|1, G) int32)."""
    if global_tokens is None:
        raise ValueError("`global_tokens` must be indices or a (batch, seq) boolean mask; "
                         "got global_tokens=None.")
    is_tensor_mask = hasattr(global_tokens, "shape") and len(global_tokens.shape) == 2
    if not is_tensor_mask:
        idx = np.asarray(global_tokens)
        if idx.dtype == bool and idx.ndim == 1:
            idx = np.flatnonzero(idx)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError(
                "`global_tokens` must be a 1-D list of integer positions or a (batch, seq) "
                f"boolean mask; got global_tokens={global_tokens!r}."
            )
        idx = np.unique(idx).astype("int64")  # an empty list is float64 in NumPy
        if idx.size > n:
            raise ValueError(
                f"`global_tokens` names {idx.size} global tokens, more than the sequence "
                f"length {n}; got global_tokens={global_tokens!r}."
            )
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(
                f"`global_tokens` positions must lie in [0, {n}); got "
                f"global_tokens={global_tokens!r}."
            )
        flags = np.zeros((1, n), bool)
        flags[0, idx] = True
        onehot = np.zeros((1, idx.size, n), "float32")
        onehot[0, np.arange(idx.size), idx] = 1.0
        return (ops.convert_to_tensor(flags), ops.convert_to_tensor(onehot),
                ops.ones((1, idx.size), "bool"),
                ops.convert_to_tensor(idx[None].astype("int32")))
    flags = ops.cast(ops.convert_to_tensor(global_tokens), "bool")
    if flags.shape[1] != n:
        raise ValueError(
            f"`global_tokens` as a mask must have shape (batch, {n}); got shape "
            f"{tuple(flags.shape)}."
        )
    if max_global is None:
        try:
            concrete = (global_tokens if isinstance(global_tokens, np.ndarray)
                        else ops.convert_to_numpy(flags))
            max_global = int(np.max(np.sum(concrete.astype(bool), axis=1)))
        except Exception as error:  # traced: the count is not known
            raise ValueError(
                "`max_global` (the largest number of global tokens in a row) is needed when "
                "`global_tokens` is a mask inside a traced function; got max_global=None."
            ) from error
    else:
        max_global = check_non_negative_int("max_global", max_global)
    if max_global > n:
        raise ValueError(
            f"`max_global` must be <= the sequence length {n}; got max_global={max_global}."
        )
    # The first `max_global` flagged positions, in order: top_k of flag * 2n - position.
    rank = ops.cast(flags, "int32") * (2 * n) - ops.arange(n, dtype="int32")[None, :]
    _, pos = ops.top_k(rank, max_global, sorted=True)
    pos = ops.cast(pos, "int32")
    onehot = ops.one_hot(pos, n, dtype="float32")  # (b, G, n)
    valid = ops.any(ops.logical_and(ops.cast(onehot, "bool"), flags[:, None, :]), axis=-1)
    # The tokens kept: a flagged token past the first `max_global` of its row is not global
    # (it keeps its band row; before, its row was replaced by an empty slot's zeros).
    flags = ops.any(ops.logical_and(ops.cast(onehot, "bool"), valid[:, :, None]), axis=1)
    return flags, onehot, valid, pos


def _gather(onehot, x):
    """Rows of `x` (b, n, ...) picked by `onehot` (b|1, G, n) -> (b, G, ...)."""
    if onehot.shape[0] == 1:
        return ops.einsum("gn,bnkd->bgkd", onehot[0], x)
    return ops.einsum("bgn,bnkd->bgkd", onehot, x)


def longformer_attention(query, key, value, window, global_tokens, *, causal=False, mask=None,
                         scale=None, block_size=None, max_global=None):
    """Exact Longformer attention: sliding window plus global tokens.

    Query `i` sees key `j` when `|i - j| < window` (causal: `0 <= i - j < window`), when `j`
    is a global token, or — when `i` is a global token — always; `causal=True` then still hides
    `j > i`. Keys a padding `mask` hides are never seen. Cost O(n * (block + G)) for G global
    tokens: the band runs as `sliding_window_attention`, global columns as an extra `(n, G)`
    score block in the same softmax (keys already in the band are not counted twice), global
    rows as a dense `(G, n)` attention that replaces those rows.

    Args:
        query, key, value, window, causal, mask, scale, block_size: as
            `sliding_window_attention`.
        global_tokens: positions shared by the batch (a list / 1-D array of ints, or a 1-D
            boolean array of length seq), or a `(batch, seq)` boolean mask (True = global).
        max_global: with a mask, the most global tokens a row has (a static bound; computed
            from the mask when it is a concrete tensor).

    Returns:
        `(batch, seq, heads, head_dim)` in the query's dtype.

    Example:
    >>> x = keras.random.normal((2, 128, 4, 16))
    >>> longformer_attention(x, x, x, window=16, global_tokens=[0]).shape
    (2, 128, 4, 16)
    """
    query, key, value, scale = _check_qkv(query, key, value, scale)
    window = check_positive_int("window", window)
    causal = check_bool("causal", causal)
    block = _block_size(block_size, window)
    n, heads, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[2]
    g = heads // kv_heads
    mask = _key_mask(mask, n)
    flags, onehot, slot_valid, gpos = _global_slots(global_tokens, n, query.shape[0],
                                                    max_global)
    n_global = onehot.shape[1]
    qb, nb, local = _local_setup(query, key, value, mask, window, block, causal)
    scores, allowed, apply = local
    parts = [(scores * scale, allowed, apply)]
    onehot_k = ops.cast(onehot, key.dtype)
    if n_global:
        # Global columns for every query: keys gathered by one-hot products, O(G * n).
        kg, vg = _gather(onehot_k, key), _gather(onehot_k, value)
        g_scores = ops.cast(ops.einsum("bnqkhd,bskd->bnkhqs", qb, kg), "float32")
        key_ok = slot_valid
        if mask is not None:
            key_ok = ops.logical_and(key_ok, ops.any(
                ops.logical_and(ops.cast(onehot, "bool"), mask[:, None, :]), axis=-1))
        qpos = ops.convert_to_tensor(np.arange(nb * block, dtype="int32").reshape(nb, block))
        dist = qpos[None, :, :, None] - gpos[:, None, None, :]  # (b|1, nb, B, G)
        in_band = ops.logical_and(dist >= 0, dist < window) if causal else ops.abs(dist) < window
        g_ok = ops.logical_and(ops.logical_not(in_band), key_ok[:, None, None, :])
        if causal:
            g_ok = ops.logical_and(g_ok, dist >= 0)
        g_allowed = g_ok[:, :, None, None, :, :]  # (b, nb, 1, 1, B, G)

        def g_apply(w):
            return ops.einsum("bnkhqs,bskd->bnqkhd", ops.cast(w, value.dtype), vg)

        parts.append((g_scores * scale, g_allowed, g_apply))
    out = _unblock(_softmax_parts(parts, query.dtype), n, heads)
    if not n_global:
        return out
    # Global rows: each global query against every key, dense (G, n).
    qg = ops.reshape(_gather(ops.cast(onehot, query.dtype), query),
                     (-1, n_global, kv_heads, g, dim))
    r_scores = ops.cast(ops.einsum("bgkhd,bnkd->bkhgn", qg, key), "float32")
    r_ok = ops.ones((1, 1, n), "bool") if mask is None else mask[:, None, :]
    if causal:
        r_ok = ops.logical_and(
            r_ok, ops.arange(n, dtype="int32")[None, None, :] <= gpos[:, :, None])
    r_allowed = r_ok[:, None, None, :, :]  # (b, 1, 1, G, n)

    def r_apply(w):
        return ops.einsum("bkhgn,bnkd->bgkhd", ops.cast(w, value.dtype), value)

    rows = _softmax_parts([(r_scores * scale, r_allowed, r_apply)], query.dtype)
    rows = ops.reshape(rows, (-1, n_global, heads, dim))
    scatter = ops.cast(onehot, rows.dtype) * ops.cast(slot_valid, rows.dtype)[:, :, None]
    if scatter.shape[0] == 1:
        rows = ops.einsum("gn,bghd->bnhd", scatter[0], rows)
    else:
        rows = ops.einsum("bgn,bghd->bnhd", scatter, rows)
    return ops.where(flags[:, :, None, None], rows, out)


# === Block-sparse and BigBird ===


def check_layout_rows(layout, causal=False):
    """Refuse a boolean layout `(heads, n_blocks, n_blocks)` with a query block that attends
    to no key block (causal: to no block at or before its own), naming the first such row."""
    blocks = layout.shape[1]
    seen = layout & np.tril(np.ones((blocks, blocks), bool)) if causal else layout
    empty = np.argwhere(~seen.any(axis=2))
    if empty.size:
        h, a = (int(i) for i in empty[0])
        where = "at or before itself (causal)" if causal else "at all"
        raise ValueError(
            f"`layout` row layout[{h}][{a}] (head {h}, query block {a}) attends to no key "
            f"block {where}; every query block needs at least one (e.g. its own block, the "
            f"diagonal). Got {len(empty)} such row(s) in a layout of shape {layout.shape}."
        )


def _check_layout(layout, heads, n, block_size, causal=False):
    try:
        layout = np.asarray(ops.convert_to_numpy(layout) if hasattr(layout, "shape")
                            and not isinstance(layout, np.ndarray) else layout)
    except Exception as error:
        raise ValueError("`layout` must be a concrete boolean array (NumPy, list or eager "
                         "tensor); got a traced tensor.") from error
    if layout.ndim == 2:
        layout = layout[None]
    if layout.ndim != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            "`layout` must have shape (heads or 1, n_blocks, n_blocks); got layout with "
            f"shape {layout.shape}."
        )
    if layout.shape[0] not in (1, heads):
        raise ValueError(
            f"`layout` must have 1 or heads={heads} entries in its first axis; got layout "
            f"with shape {layout.shape}."
        )
    n_blocks = -(-n // block_size)
    if layout.shape[1] != n_blocks:
        raise ValueError(
            f"`block_size`={block_size} cuts seq={n} into {n_blocks} blocks, but `layout` has "
            f"{layout.shape[1]} (shape {layout.shape}); choose block_size and layout so that "
            "n_blocks = ceil(seq / block_size)."
        )
    layout = layout.astype(bool)
    check_layout_rows(layout, causal)
    return layout


def block_sparse_attention(query, key, value, layout, block_size, *, causal=False, mask=None,
                           scale=None):
    """Exact attention on a block layout: query block `a` sees key block `c` where
    `layout[h, a, c]` is True (Sparse Transformer style).

    Each query block gathers its active key blocks (padded to the largest count `K` among
    rows that are not fully active), so cost is O(n * K * block_size). Rows fully active in
    every head (e.g. BigBird's global blocks) run as one dense `(rows * block_size, n)` slab.
    `causal=True` also hides keys after the query inside the blocks; a padding `mask` hides
    keys. The layout must be concrete (it fixes the shapes).

    Args:
        query, key, value, mask, scale: as `sliding_window_attention`.
        layout: boolean `(heads or 1, n_blocks, n_blocks)` (or `(n_blocks, n_blocks)`) with
            `n_blocks = ceil(seq / block_size)`.
        block_size: positive int.
        causal: also hide future keys.

    Returns:
        `(batch, seq, heads, head_dim)` in the query's dtype.

    Example:
    >>> import numpy as np
    >>> layout = np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool)
    >>> x = keras.random.normal((1, 64, 2, 8))
    >>> block_sparse_attention(x, x, x, layout, block_size=16, causal=True).shape
    (1, 64, 2, 8)
    """
    query, key, value, scale = _check_qkv(query, key, value, scale)
    block = check_positive_int("block_size", block_size)
    causal = check_bool("causal", causal)
    n, heads, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[2]
    layout = _check_layout(layout, heads, n, block, causal)
    mask = _key_mask(mask, n)
    lh, nb = layout.shape[0], layout.shape[1]
    full = layout.all(axis=(0, 2))
    sparse_rows = ~full
    counts = layout.sum(axis=2)[:, sparse_rows]
    k_max = max(int(counts.max()) if counts.size else 0, 1)
    idx = np.zeros((lh, nb, k_max), "int32")
    ok = np.zeros((lh, nb, k_max), bool)
    for h in range(lh):
        for a in np.flatnonzero(sparse_rows):
            cols = np.flatnonzero(layout[h, a])
            idx[h, a, :cols.size] = cols
            ok[h, a, :cols.size] = True
    # Heads layout: per-layout-head key/value copies (lh == heads) or shared (lh == 1, GQA).
    if lh == 1:
        kh, gq = kv_heads, heads // kv_heads
    else:
        kh, gq = heads, 1
    qb = ops.transpose(ops.reshape(_blocks(query, block, nb), (-1, nb, block, kh, gq, dim)),
                       (0, 3, 4, 1, 2, 5))  # (b, kh, gq, nb, B, d)

    def kv_blocks(x):
        xb = ops.transpose(_blocks(x, block, nb), (0, 3, 1, 2, 4))  # (b, hk, nb, B, d)
        if lh == 1:
            return ops.reshape(ops.take(xb, idx.reshape(-1), axis=2),
                               (-1, kh, nb, k_max * block, dim))
        per_head = ops.take(xb, np.arange(heads) // (heads // kv_heads), axis=1)
        flat = ops.reshape(per_head, (-1, heads * nb, block, dim))
        where = (np.arange(heads)[:, None, None] * nb + idx).reshape(-1)
        return ops.reshape(ops.take(flat, where, axis=1), (-1, kh, nb, k_max * block, dim))

    kg, vg = kv_blocks(key), kv_blocks(value)
    scores = ops.cast(ops.einsum("bkgnqd,bknsd->bkgnqs", qb, kg), "float32")
    kpos = (idx[..., None] * block + np.arange(block)).reshape(lh, nb, k_max * block)
    kok = np.repeat(ok, block, axis=2) & (kpos < n)
    qpos = np.arange(nb * block).reshape(nb, block)
    allowed_np = np.broadcast_to(kok[:, :, None, :], (lh, nb, block, k_max * block))
    if causal:
        allowed_np = allowed_np & (kpos[:, :, None, :] <= qpos[None, :, :, None])
    allowed = ops.convert_to_tensor(allowed_np[None, :, None])  # (1, lh, 1, nb, B, S)
    if mask is not None:
        mb = _blocks(mask, block, nb)  # (b, nb, B)
        gathered = ops.reshape(ops.take(mb, idx.reshape(-1), axis=1),
                               (-1, lh, nb, k_max * block))
        allowed = ops.logical_and(allowed, gathered[:, :, None, :, None, :])

    def apply(w):
        return ops.einsum("bkgnqs,bknsd->bkgnqd", ops.cast(w, value.dtype), vg)

    out = _softmax_parts([(scores * scale, allowed, apply)], query.dtype)
    out = ops.reshape(ops.transpose(out, (0, 3, 4, 1, 2, 5)), (-1, nb * block, heads, dim))
    out = out[:, :n]
    if not full.any():
        return out
    # Dense slab for the rows that see every block.
    rows = np.flatnonzero(full)
    q_rows = np.concatenate([np.arange(r * block, min((r + 1) * block, n)) for r in rows])
    qd = ops.take(query, q_rows, axis=1)
    qd = ops.reshape(qd, (-1, q_rows.size, kv_heads, heads // kv_heads, dim))
    d_scores = ops.cast(ops.einsum("btkgd,bskd->bkgts", qd, key), "float32")
    d_ok = np.ones((q_rows.size, n), bool)
    if causal:
        d_ok = np.arange(n)[None, :] <= q_rows[:, None]
    d_allowed = ops.convert_to_tensor(d_ok[None, None, None])
    if mask is not None:
        d_allowed = ops.logical_and(d_allowed, mask[:, None, None, None, :])

    def d_apply(w):
        return ops.einsum("bkgts,bskd->btkgd", ops.cast(w, value.dtype), value)

    dense = _softmax_parts([(d_scores * scale, d_allowed, d_apply)], query.dtype)
    dense = ops.reshape(dense, (-1, q_rows.size, heads, dim))
    scatter = np.zeros((q_rows.size, n), "float32")
    scatter[np.arange(q_rows.size), q_rows] = 1.0
    dense = ops.einsum("tn,bthd->bnhd", ops.cast(scatter, dense.dtype), dense)
    is_row = np.zeros((n,), bool)
    is_row[q_rows] = True
    return ops.where(ops.convert_to_tensor(is_row[None, :, None, None]), dense, out)


def bigbird_layout(num_blocks, *, window_blocks=3, global_blocks=1, random_blocks=2,
                   num_heads=1, seed=0, causal=False):
    """BigBird's block layout (Zaheer et al. 2020): window + global + random blocks.

    Query block `a` sees key blocks `|a - c| <= window_blocks // 2` (causal: `0 <= a - c <
    window_blocks`), the first `global_blocks` blocks (which also see every block), and
    `random_blocks` other blocks drawn without replacement by `numpy.random.default_rng(seed)`
    (per head when `num_heads > 1`; causal: only earlier blocks). Deterministic for a seed.

    A sequence too short for the pattern: when some query block that is not global has
    fewer than `random_blocks` blocks left outside its window and the global blocks
    (`max_random_blocks`), the layout is every block — full attention — and a `UserWarning`
    names `random_blocks`, its value and the most this length allows; likewise when
    `global_blocks` exceeds `num_blocks` (every block global; causal: causal full).
    Transformers' BigBird switches to full attention ("original_full") on short sequences
    too. Causal: a query block draws among the blocks before it, so the first blocks, whose
    whole past they already see, draw fewer (they attend to all of it); no warning.

    Returns:
        A NumPy boolean array `(num_heads, num_blocks, num_blocks)`.

    Example:
    >>> bigbird_layout(8, seed=1).shape
    (1, 8, 8)
    """
    num_blocks = check_positive_int("num_blocks", num_blocks)
    window_blocks = check_positive_int("window_blocks", window_blocks)
    global_blocks = check_non_negative_int("global_blocks", global_blocks)
    random_blocks = check_non_negative_int("random_blocks", random_blocks)
    num_heads = check_positive_int("num_heads", num_heads)
    causal = check_bool("causal", causal)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ValueError(f"`seed` must be an integer; got seed={seed!r}.")
    if global_blocks > num_blocks:
        # (a short input to a model whose first `global_blocks` blocks are global)
        warnings.warn(
            f"BigBird: `global_blocks`={global_blocks} is more than a sequence of "
            f"{num_blocks} blocks has; every block is global (full attention) at this "
            "length, as transformers' BigBird does for short sequences.", UserWarning,
            stacklevel=2)
        full = np.ones((num_heads, num_blocks, num_blocks), bool)
        return np.tril(full) if causal else full
    a = np.arange(num_blocks)
    dist = a[:, None] - a[None, :]
    band = (dist >= 0) & (dist < window_blocks) if causal else np.abs(dist) <= window_blocks // 2
    base = band.copy()
    base[:, :global_blocks] = True
    if not causal:
        base[:global_blocks, :] = True
    else:
        base &= dist >= 0
    if not causal and random_blocks and num_blocks > global_blocks:
        most = max_random_blocks(num_blocks, window_blocks=window_blocks,
                                 global_blocks=global_blocks)
        if random_blocks > most:
            warnings.warn(
                f"BigBird: `random_blocks`={random_blocks} is more than a sequence of "
                f"{num_blocks} blocks allows (at most {most} random blocks per query block "
                f"beside window_blocks={window_blocks} and global_blocks={global_blocks}); "
                "attending to every block (full attention) at this length, as transformers' "
                "BigBird does for short sequences. Lower random_blocks or block_size to keep "
                "the sparse pattern.", UserWarning, stacklevel=2)
            return np.ones((num_heads, num_blocks, num_blocks), bool)
    rng = np.random.default_rng(seed)
    layout = np.repeat(base[None], num_heads, axis=0)
    for h in range(num_heads):
        for row in range(global_blocks if not causal else 0, num_blocks):
            free = np.flatnonzero(~layout[h, row] & ((a <= row) if causal else True))
            take = min(random_blocks, free.size)
            if take:
                layout[h, row, rng.choice(free, size=take, replace=False)] = True
    return layout


def max_random_blocks(num_blocks, *, window_blocks=3, global_blocks=1):
    """The most random blocks every non-global query block of a non-causal BigBird layout of
    `num_blocks` blocks can draw: the fewest blocks any of them has outside its window and
    the global blocks (0 when every block is global: no block draws any).

    Example:
    >>> max_random_blocks(5, window_blocks=3, global_blocks=1)
    1
    """
    a = np.arange(num_blocks)
    rows = a[global_blocks:]
    if rows.size == 0:
        return 0
    seen = np.abs(rows[:, None] - a[None, :]) <= window_blocks // 2
    seen[:, :global_blocks] = True
    return int((~seen).sum(axis=1).min())


def bigbird_attention(query, key, value, block_size, *, window_blocks=3, global_blocks=1,
                      random_blocks=2, seed=0, per_head=False, causal=False, mask=None,
                      scale=None):
    """BigBird attention: `block_sparse_attention` on `bigbird_layout(...)`.

    Args:
        query, key, value, causal, mask, scale: as `block_sparse_attention`.
        block_size: positive int; `n_blocks = ceil(seq / block_size)`.
        window_blocks, global_blocks, random_blocks, seed: see `bigbird_layout`.
        per_head: draw the random blocks independently for each head.

    Returns:
        `(batch, seq, heads, head_dim)` in the query's dtype.

    Example:
    >>> x = keras.random.normal((1, 128, 2, 8))
    >>> bigbird_attention(x, x, x, block_size=16, seed=3).shape
    (1, 128, 2, 8)
    """
    query = ops.convert_to_tensor(query)
    block = check_positive_int("block_size", block_size)
    n, heads = query.shape[1], query.shape[2]
    layout = bigbird_layout(-(-n // block), window_blocks=window_blocks,
                            global_blocks=global_blocks, random_blocks=random_blocks,
                            num_heads=heads if check_bool("per_head", per_head) else 1,
                            seed=seed, causal=causal)
    return block_sparse_attention(query, key, value, layout, block, causal=causal, mask=mask,
                                  scale=scale)
