"""TensorFlow's attention kernels: the reference formula compiled by XLA as the "fused" kernel
(TensorFlow has no fused attention op), and the chunked kernel: FlashAttention's forward and
backward as XLA while loops. Imported by `kernels` only when the TensorFlow backend runs; the
arguments arrive checked and broadcast to 4-D there (see `kernels.dot_product_attention`).

The chunked kernel. XLA schedules an unrolled Python block loop freely,
so the score blocks of every iteration can be alive at once. Here both passes are
`tf.while_loop`s, whose bodies XLA runs one iteration at a time in one set of buffers, and
the gradient is written by hand (`tf.custom_gradient`), so no per-iteration intermediates
are stacked for the backward pass. The forward pass keeps only the output and each row's
log-sum-exp; the backward pass recomputes each (query block, key block) tile of
probabilities from them (Dao et al. 2022, Algorithm 2 in FlashAttention-2's form):

    P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
    dQ += dS K * scale,  dK += dS^T Q * scale,  dBias += dS.

Peak memory is O(seq x head_dim) for the inputs, outputs and gradients plus a few
(query block x key block) tiles. Tiles that a causal mask or an explicit mask hides entirely
are never visited: each query block loops over the range of key blocks that any of its rows
may see, and each key block over the range of query blocks that may see it.
"""

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from kzoo.layers.gradients import tf_custom_gradient
from kzoo.layers.kernels import _NEG, _grouped_scores, _pad_axis, reference_attention

_LSE_EMPTY = 1e30  # log-sum-exp of a row with no visible key: exp(s - 1e30) == 0


def device():
    """'tpu', 'gpu' or 'cpu': the fastest logical device TensorFlow sees."""
    if tf.config.list_logical_devices("TPU"):
        return "tpu"
    return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"


# === Eager calls compiled with XLA ===

_COMPILED = {}


def _run_compiled(config, fn, *args):
    """`fn(*args)`: traced inline inside a graph (where `fit` may already compile it with
    XLA); called eagerly, through one `tf.function(jit_compile=True)` per static `config`."""
    if not tf.executing_eagerly():
        return fn(*args)
    if config not in _COMPILED:
        _COMPILED[config] = tf.function(fn, jit_compile=True)
    return _COMPILED[config](*args)


def fused(query, key, value, mask, bias, is_causal, scale):
    """TensorFlow has no fused attention op: the reference formula, compiled by XLA."""
    def run(q, k, v, m, b):
        return reference_attention(q, k, v, mask=m, bias=b, is_causal=is_causal, scale=scale)

    config = ("reference", is_causal, float(scale), mask is not None, bias is not None)
    return _run_compiled(config, run, query, key, value, mask, bias)


def chunked(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """`chunked_attention_tf`, XLA-compiled when called eagerly."""
    def run(q, k, v, m, b):
        return chunked_attention_tf(q, k, v, m, b, is_causal, scale, bq, bk)

    config = ("chunked", is_causal, float(scale), bq, bk, mask is not None, bias is not None)
    return _run_compiled(config, run, query, key, value, mask, bias)


# === The reference formula with its gradient written by hand ===


def hand_gradient_applies(query, key, value, bias):
    """Whether `reference_with_gradient` takes this call: float32 queries, keys and values
    with as many key / value heads as query heads (grouped heads keep the formula of
    `kernels.reference_attention`), and a bias of static shape if any."""
    return (query.shape[2] is not None and query.shape[2] == key.shape[2]
            and all(x.dtype == tf.float32 for x in (query, key, value))
            and (bias is None or None not in tuple(bias.shape)))


def reference_with_gradient(query, key, value, mask, bias, scale, rows):
    """`softmax(q k^T * scale + bias, masked) v`, the reference formula's result, with a
    hand-written backward pass (TensorFlow's graph, not compiled by XLA, on the CPU).

    The queries are scaled before the product (`(b, t, h, d)` values instead of the
    `(b, h, t, s)` scores), the mask is added to the scores as a float32 0 / `_NEG` bias at
    the mask's own shape (the same values as the reference's select: `s + _NEG` rounds to
    `_NEG` for `|s| < 3e22`, and its weight is exactly 0 either way), the softmax is one
    kernel, and the backward pass is FlashAttention's (Dao et al. 2022) on the kept
    probabilities `P`: `dV = P^T dO`, `dP = dO V^T`, `dS = P (dP - rowsum(dO * O))`,
    `dQ = dS K * scale`, `dK = dS^T Q * scale`, `dBias = dS` summed over the bias' broadcast
    axes. TensorFlow's own derivative of the formula takes four `(b, h, t, s)` passes for the
    softmax (`rowsum(dP * P)` among them, where `rowsum(dO * O)` reads `(b, t, h, d)`), one
    for the mask's select and one for the scale, and transposes the einsums' operands
    again. Measured on the 2-core CPU, one attention of 8 x 256 tokens, 4 heads of 64,
    causal, forward + backward in a graph: 16.6-20.3 -> 14.2-18.4 ms (faster in each of 4
    rounds).

    `query` `(b, t, h, d)`, `key` / `value` `(b, s, h, d)` float32; `mask` boolean and
    `bias` (float, static shape) broadcasting to `(b, h, t, s)`, or None, the causal mask
    already in `mask`; `rows`: the `(…, t, 1)` flags of rows with a visible key, or None
    where every row has one (such rows give zeros, as the reference's)."""
    inputs = [query, key, value]
    if bias is not None:
        inputs.append(tf.cast(bias, tf.float32))
    additive = None if mask is None else tf.where(mask, 0.0, _NEG)

    @tf_custom_gradient
    def attend(*args):
        q, k, v = (tf.transpose(x, (0, 2, 1, 3)) for x in args[:3])  # (b, h, ., d)
        if scale != 1.0:
            q = q * scale
        s = tf.matmul(q, k, transpose_b=True)
        if len(args) > 3:
            s = s + args[3]
        if additive is not None:
            s = s + additive
        p = tf.nn.softmax(s)
        o = tf.matmul(p, v)

        def grad(d_out):
            do = tf.transpose(d_out, (0, 2, 1, 3))
            dv = tf.matmul(p, do, transpose_a=True)
            ds = p * (tf.matmul(do, v, transpose_b=True)
                      - tf.reduce_sum(do * o, axis=-1, keepdims=True))
            dq = tf.matmul(ds, k)
            if scale != 1.0:
                dq = dq * scale
            dk = tf.matmul(ds, q, transpose_a=True)  # (q already scaled)
            grads = [tf.transpose(x, (0, 2, 1, 3)) for x in (dq, dk, dv)]
            if len(args) > 3:
                b = args[3]
                axes = [i for i in range(4) if b.shape[i] == 1 and ds.shape[i] != 1]
                grads.append(tf.reshape(tf.reduce_sum(ds, axes, keepdims=True), tf.shape(b))
                             if axes else ds)
            return grads

        return tf.transpose(o, (0, 2, 1, 3)), grad

    out = attend(*inputs)
    if rows is not None:
        out = tf.where(tf.transpose(rows, (0, 2, 1, 3)), out, tf.zeros((), out.dtype))
    return out


# === The chunked kernel's pieces ===


def _ceil_div(a, b):
    return -(-a // b)


def _to_blocks(x, n, size):
    """(b, n*size, heads, d) -> (b, n, size, heads, d): a reshape, no copy."""
    shape = tf.shape(x)
    return tf.reshape(x, tf.stack([shape[0], n, size, x.shape[2], x.shape[3]]))


def _from_blocks(x, length):
    """(b, n, size, heads, d) -> (b, length, heads, d), dropping padded rows."""
    shape = tf.shape(x)
    x = tf.reshape(x, tf.stack([shape[0], shape[1] * shape[2], x.shape[3], x.shape[4]]))
    return x if x.shape[1] == length else x[:, :length]


def _write_block(buf, i, blk, add=False):
    """`buf` with block `i` of axis 1 set to (or, with `add`, increased by) `blk`, which has
    size 1 there dropped: (b, n, size, ...) <- (b, size, ...).

    XLA's dynamic-update-slice, which updates a loop-carried buffer in place; a scatter
    (`tensor_scatter_nd_*`) is copied whole on every iteration by XLA on CPU, which cost a
    second of the 8192-token backward pass."""
    if add:
        blk = tf.gather(buf, i, axis=1) + blk
    start = [0, i] + [0] * (len(buf.shape) - 2)
    return _dynamic_update_slice(buf, tf.expand_dims(blk, 1), start)


def _write_tile(buf, index, tile, add=False):
    """`buf` (n1, n2, ...) with tile `index` = (i, j) of its two leading axes set to (or
    increased by) `tile`."""
    if add:
        tile = tf.gather_nd(buf, index) + tile
    start = [index[0], index[1]] + [0] * (len(buf.shape) - 2)
    return _dynamic_update_slice(buf, tile[None, None], start)


def _dynamic_update_slice(buf, update, start):
    # XLA's DynamicUpdateSlice as a TensorFlow op; it also runs outside XLA (compiled on
    # demand), so graph-mode training without `jit_compile` works too.
    return xla.dynamic_update_slice(buf, update, tf.stack([tf.cast(x, tf.int32) for x in start]))


def _tile_layout(x, nq, bq, nk, bk):
    """A (B', H', Q', K') mask or bias whose Q' / K' may be 1 (broadcast) -> tiles of shape
    (nq', nk', B', H', bq', bk'), where a broadcast axis keeps one block of size 1."""
    rows_full, cols_full = x.shape[2] != 1, x.shape[3] != 1
    nq_, bq_ = (nq, bq) if rows_full else (1, 1)
    nk_, bk_ = (nk, bk) if cols_full else (1, 1)
    shape = tf.shape(x)
    x = tf.reshape(x, tf.stack([shape[0], shape[1], nq_, bq_, nk_, bk_]))
    return tf.transpose(x, (2, 4, 0, 1, 3, 5)), rows_full, cols_full


def _untile(x, shape_like, q_len, k_len):
    """Inverse of `_tile_layout`, cropping padding back to (B', H', Q', K')."""
    x = tf.transpose(x, (2, 3, 0, 4, 1, 5))  # (B', H', nq', bq', nk', bk')
    s = tf.shape(x)
    x = tf.reshape(x, tf.stack([s[0], s[1], s[2] * s[3], s[4] * s[5]]))
    q_keep = q_len if shape_like.shape[2] != 1 else 1
    k_keep = k_len if shape_like.shape[3] != 1 else 1
    return x[:, :, :q_keep, :k_keep]


def _scores(q, k):
    """q (b,t,h,d), k (b,s,hk,d) -> (b,h,t,s) float32; query head i uses kv head i // g."""
    return tf.cast(_grouped_scores(q, k), tf.float32)


def _group_heads(w, hk):
    """(b, h, t, s) -> (b, hk, h // hk, t, s): query heads grouped by their kv head."""
    s = tf.shape(w)
    return tf.reshape(w, tf.stack([s[0], hk, w.shape[1] // hk, s[2], s[3]]))


def _weighted(w, x):
    """w (b,h,t,s) float32, x (b,s,hk,d) -> (b,t,h,d) float32: sum_s w * x."""
    h, hk, d = w.shape[1], x.shape[2], x.shape[3]
    x = tf.cast(x, tf.float32)
    if h == hk:
        return tf.einsum("bhts,bshd->bthd", w, x)
    out = tf.einsum("bkgts,bskd->btkgd", _group_heads(w, hk), x)
    o = tf.shape(out)
    return tf.reshape(out, tf.stack([o[0], o[1], h, d]))


def _weighted_t(w, x, hk):
    """w (b,h,t,s) float32, x (b,t,h,d) -> (b,s,hk,d) float32: sum_t w * x, summed over
    the query heads that share a kv head."""
    x = tf.cast(x, tf.float32)
    if w.shape[1] == hk:
        return tf.einsum("bhts,bthd->bshd", w, x)
    x5 = tf.reshape(x, tf.stack([tf.shape(x)[0], tf.shape(x)[1], hk, -1, x.shape[3]]))
    return tf.einsum("bkgts,btkgd->bskd", _group_heads(w, hk), x5)


def _block_ranges(mask_tiles, nq, nk, bq, bk, offset, is_causal):
    """For each query block, the [first, last] key blocks any of its rows may see, and for
    each key block the [first, last] query blocks that may see it (empty: first > last)."""
    if mask_tiles is None:
        vis = tf.ones((nq, nk), tf.bool)
    else:
        vis = tf.reduce_any(mask_tiles, axis=(2, 3, 4, 5))  # (nq', nk')
        vis = tf.broadcast_to(vis, (nq, nk))
    if is_causal:
        i = tf.range(nq)[:, None]
        j = tf.range(nk)[None, :]
        # The last row of query block i sees keys up to i*bq + bq - 1 + offset.
        vis = vis & (j * bk <= i * bq + bq - 1 + offset)
    ar_k, ar_q = tf.range(nk)[None, :], tf.range(nq)[:, None]
    k_first = tf.reduce_min(tf.where(vis, ar_k, nk), axis=1)
    k_last = tf.reduce_max(tf.where(vis, ar_k, -1), axis=1)
    q_first = tf.reduce_min(tf.where(vis, ar_q, nq), axis=0)
    q_last = tf.reduce_max(tf.where(vis, ar_q, -1), axis=0)
    return k_first, k_last, q_first, q_last


def chunked_attention_tf(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """Exact attention with O(n) memory forward and backward on TensorFlow (see module doc).

    `mask` (boolean) and `bias` broadcast to (batch, heads, q_len, k_len); the bias is
    differentiated, the mask is not. Rows with no visible key give zeros.
    """
    q_len, k_len = query.shape[1], key.shape[1]
    h, hk, d = query.shape[2], key.shape[2], query.shape[3]
    bq, bk = min(bq, q_len), min(bk, k_len)
    nq, nk = _ceil_div(q_len, bq), _ceil_div(k_len, bk)
    pad_q, pad_k = nq * bq - q_len, nk * bk - k_len
    offset = k_len - q_len  # bottom-right causal alignment
    out_dtype = query.dtype
    scale = float(scale)

    mask_tiles = None
    m_rows = m_cols = False
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        m = _pad_axis(_pad_axis(mask, 2, pad_q, True), 3, pad_k, False)
        mask_tiles, m_rows, m_cols = _tile_layout(m, nq, bq, nk, bk)
    k_first, k_last, q_first, q_last = _block_ranges(
        mask_tiles, nq, nk, bq, bk, offset, is_causal
    )
    q_pos0 = tf.range(bq)[:, None] + offset
    k_pos0 = tf.range(bk)[None, :]

    def tile_index(i, j, rows_full, cols_full):
        """Index of tile (i, j) in a `_tile_layout`; a broadcast axis has only tile 0."""
        return tf.stack([i if rows_full else 0, j if cols_full else 0])

    def allowed_tile(i, j):
        """(…, bq, bk) boolean: key padding, causal order and the mask for tile (i, j)."""
        k_pos = j * bk + k_pos0
        allowed = k_pos < k_len
        if is_causal:
            allowed = allowed & (k_pos <= i * bq + q_pos0)
        if mask_tiles is not None:
            allowed = allowed & tf.gather_nd(mask_tiles, tile_index(i, j, m_rows, m_cols))
        return allowed

    def run(q, k, v, *maybe_bias):
        has_bias = bool(maybe_bias)
        bias_tiles = b_rows = b_cols = None
        if has_bias:
            bb = tf.cast(maybe_bias[0], tf.float32)
            bb = _pad_axis(_pad_axis(bb, 2, pad_q, 0.0), 3, pad_k, 0.0)
            bias_tiles, b_rows, b_cols = _tile_layout(bb, nq, bq, nk, bk)

        def tile_scores(q_i, k_j, i, j):
            s = _scores(q_i, k_j) * scale
            if has_bias:
                s = s + tf.gather_nd(bias_tiles, tile_index(i, j, b_rows, b_cols))
            return s

        qb = _to_blocks(_pad_axis(q, 1, pad_q, 0), nq, bq)
        kb = _to_blocks(_pad_axis(k, 1, pad_k, 0), nk, bk)
        vb = _to_blocks(_pad_axis(v, 1, pad_k, 0), nk, bk)
        batch = tf.shape(q)[0]

        # --- forward: query blocks outside, the key blocks they may see inside ---
        def q_body(i, out_b, lse_b):
            q_i = tf.gather(qb, i, axis=1)

            def k_body(j, run_max, run_sum, acc):
                s = tile_scores(q_i, tf.gather(kb, j, axis=1), i, j)
                allowed = allowed_tile(i, j)
                s = tf.where(allowed, s, _NEG)
                new_max = tf.maximum(run_max, tf.reduce_max(s, axis=-1))
                p = tf.where(allowed, tf.exp(s - new_max[..., None]), 0.0)
                alpha = tf.exp(run_max - new_max)
                pv = _weighted(p, tf.gather(vb, j, axis=1))
                acc = acc * tf.transpose(alpha, (0, 2, 1))[..., None] + pv
                return j + 1, new_max, run_sum * alpha + tf.reduce_sum(p, -1), acc

            init = (
                k_first[i],
                tf.fill(tf.stack([batch, h, bq]), _NEG),
                tf.zeros(tf.stack([batch, h, bq]), tf.float32),
                tf.zeros(tf.stack([batch, bq, h, d]), tf.float32),
            )
            _, run_max, run_sum, acc = tf.while_loop(
                lambda j, *_: j <= k_last[i], k_body, init
            )
            denom = tf.transpose(run_sum, (0, 2, 1))[..., None]
            # (a row that sees no key: zeros; a NaN sum, from a NaN or infinite score, stays
            # NaN as in the reference kernel: `denom > 0` turned it into zeros)
            empty = tf.equal(denom, 0.0)
            out_i = tf.where(empty, 0.0, acc / tf.where(empty, 1.0, denom))
            no_key = tf.equal(run_sum, 0.0)
            lse_i = tf.where(no_key, _LSE_EMPTY,
                             run_max + tf.math.log(tf.where(no_key, 1.0, run_sum)))
            out_b = _write_block(out_b, i, out_i)
            lse_b = _write_block(lse_b, i, lse_i)
            return i + 1, out_b, lse_b

        _, out_b, lse_b = tf.while_loop(
            lambda i, *_: i < nq, q_body,
            (tf.constant(0), tf.zeros(tf.stack([batch, nq, bq, h, d]), tf.float32),
             tf.zeros(tf.stack([batch, nq, h, bq]), tf.float32)),
        )
        out = tf.cast(_from_blocks(out_b, q_len), out_dtype)

        def grad(d_out):
            do_b = _to_blocks(_pad_axis(tf.cast(d_out, tf.float32), 1, pad_q, 0.0), nq, bq)
            # D = rowsum(dO * O), per (block, b, h, row)
            delta_b = tf.transpose(tf.reduce_sum(do_b * out_b, axis=-1), (0, 1, 3, 2))
            # (b, nq, h, bq), like lse_b

            # --- backward: key blocks outside, the query blocks that see them inside ---
            def j_body(j, dq_b, dk_b, dv_b, db_t):
                k_j, v_j = tf.gather(kb, j, axis=1), tf.gather(vb, j, axis=1)

                def i_body(i, dq_b, dk_j, dv_j, db_t):
                    q_i, do_i = tf.gather(qb, i, axis=1), tf.gather(do_b, i, axis=1)
                    s = tile_scores(q_i, k_j, i, j)
                    allowed = allowed_tile(i, j)
                    p = tf.where(allowed, tf.exp(s - tf.gather(lse_b, i, axis=1)[..., None]), 0.0)
                    dv_j = dv_j + _weighted_t(p, do_i, hk)
                    dp = _scores(do_i, tf.cast(v_j, tf.float32))
                    ds = p * (dp - tf.gather(delta_b, i, axis=1)[..., None])
                    dq_b = _write_block(dq_b, i, _weighted(ds, k_j) * scale, add=True)
                    dk_j = dk_j + _weighted_t(ds, q_i, hk) * scale
                    if has_bias:
                        red = [a for a in (0, 1) if bias_tiles.shape[2 + a] == 1]
                        ds_b = tf.reduce_sum(ds, axis=red, keepdims=True) if red else ds
                        if not b_rows:
                            ds_b = tf.reduce_sum(ds_b, axis=2, keepdims=True)
                        if not b_cols:
                            ds_b = tf.reduce_sum(ds_b, axis=3, keepdims=True)
                        db_t = _write_tile(db_t, tile_index(i, j, b_rows, b_cols), ds_b,
                                           add=True)
                    return i + 1, dq_b, dk_j, dv_j, db_t

                zeros_kv = tf.zeros(tf.stack([batch, bk, hk, d]), tf.float32)
                _, dq_b, dk_j, dv_j, db_t = tf.while_loop(
                    lambda i, *_: i <= q_last[j], i_body,
                    (q_first[j], dq_b, zeros_kv, zeros_kv, db_t),
                )
                dk_b = _write_block(dk_b, j, dk_j)
                dv_b = _write_block(dv_b, j, dv_j)
                return j + 1, dq_b, dk_b, dv_b, db_t

            kv_shape = tf.stack([batch, nk, bk, hk, d])
            db0 = tf.zeros_like(bias_tiles) if has_bias else tf.zeros((), tf.float32)
            _, dq_b, dk_b, dv_b, db_t = tf.while_loop(
                lambda j, *_: j < nk, j_body,
                (tf.constant(0), tf.zeros(tf.stack([batch, nq, bq, h, d]), tf.float32),
                 tf.zeros(kv_shape, tf.float32), tf.zeros(kv_shape, tf.float32), db0),
            )
            grads = [
                tf.cast(_from_blocks(dq_b, q_len), q.dtype),
                tf.cast(_from_blocks(dk_b, k_len), k.dtype),
                tf.cast(_from_blocks(dv_b, k_len), v.dtype),
            ]
            if has_bias:
                grads.append(tf.cast(_untile(db_t, maybe_bias[0], q_len, k_len),
                                     maybe_bias[0].dtype))
            return grads

        return out, grad

    args = [query, key, value] + ([bias] if bias is not None else [])
    return tf_custom_gradient(run)(*args)
