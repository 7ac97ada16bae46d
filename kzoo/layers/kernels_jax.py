"""JAX's attention kernels: `jax.nn.dot_product_attention` (cuDNN flash on CUDA for half
precision, XLA elsewhere, Pallas flash attention on TPU) and the chunked kernel as two nested
`lax.scan`s. Imported by `kernels` only when the JAX backend runs; the arguments arrive
checked and broadcast to 4-D there (see `kernels.dot_product_attention`).
"""

import jax
import jax.numpy as jnp
import keras
from keras import ops

from kzoo.layers.kernels import (
    _NEG,
    _grouped_output,
    _grouped_scores,
    _pad_axis,
    _rows_with_any_key,
)
from kzoo.layers.masks import causal_mask


def device():
    """'cpu', 'gpu' or 'tpu': JAX's default platform."""
    platform = jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


# === Fused ===


def fused(query, key, value, mask, bias, is_causal, scale):
    """`jax.nn.dot_product_attention`, or Pallas flash attention on TPU where it applies."""
    if device() == "tpu":
        plan = tpu_flash_plan(query.shape, key.shape, None if mask is None else mask.shape,
                              bias is not None, is_causal)
        if plan != "xla":
            return _tpu_flash(query, key, value, mask, bias, is_causal, scale, plan)

    q_len, k_len = query.shape[1], key.shape[1]
    if is_causal and q_len != k_len:
        c = causal_mask(q_len, k_len)
        mask = c if mask is None else ops.logical_and(mask, c)
        is_causal = False
    implementation = None
    if device() == "gpu" and cudnn_applies(query.shape, key.shape, value.shape, query.dtype):
        implementation = "cudnn"
        # cuDNN takes a mask only as an additive bias, and a bias only with the full
        # (q_len, k_len) trailing shape (JAX raises "Bias must have same seq length as QKV"
        # for a (batch, 1, 1, k_len) padding mask): broadcast the two sequence axes.
        if mask is not None:
            mask = jnp.broadcast_to(mask, tuple(mask.shape[:2]) + (q_len, k_len))
        if bias is not None:
            bias = jnp.broadcast_to(bias, tuple(bias.shape[:2]) + (q_len, k_len))
    if bias is not None:
        bias = ops.cast(bias, query.dtype)
    out = jax.nn.dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
        implementation=implementation,
    )
    if mask is not None:
        # A row can be emptied by the mask and the causal flag together (both stay passed
        # to jax.nn): the rows to zero are those of mask AND causal.
        seen = ops.logical_and(mask, causal_mask(q_len, k_len)) if is_causal else mask
        visible = ops.transpose(_rows_with_any_key(seen), (0, 2, 1, 3))
        out = ops.where(visible, out, ops.zeros((), dtype=out.dtype))
    return out


def cudnn_applies(query_shape, key_shape, value_shape, dtype):
    """Whether a call on a CUDA GPU takes cuDNN's fused (flash) attention: half precision
    (float16 / bfloat16), one head width for query, key and value that is a multiple of 8 and
    at most 128 (what cuDNN's fused kernels accept), and more than one query (a decode step's
    single query runs XLA's attention: nothing to tile)."""
    head = query_shape[-1]
    return (keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")
            and head is not None and head == key_shape[-1] == value_shape[-1]
            and head % 8 == 0 and head <= 128
            and query_shape[1] is not None and query_shape[1] > 1)


def tpu_flash_plan(query_shape, key_shape, mask_shape=None, has_bias=False, is_causal=False,
                   block=128):
    """How the JAX/TPU path runs a call: which form of the Pallas flash kernel, or XLA.

    Returns one of:
    - "pallas": Pallas TPU flash attention, causal flag only (no mask, no bias);
    - "pallas_segments": key padding expressed as segment ids (no O(n^2) tensor);
    - "pallas_bias": mask and bias folded into one additive bias `ab`;
    - "xla": `jax.nn.dot_product_attention` (sequence lengths not multiples of `block`,
      or causal attention with q_len != k_len, which the kernel aligns top-left).
    """
    q_len, k_len = query_shape[1], key_shape[1]
    if q_len is None or k_len is None or q_len % block or k_len % block:
        return "xla"
    if is_causal and q_len != k_len:
        return "xla"
    if mask_shape is None and not has_bias:
        return "pallas"
    if (not has_bias and mask_shape is not None and len(mask_shape) == 4
            and tuple(mask_shape[1:3]) == (1, 1)):
        return "pallas_segments"
    return "pallas_bias"


def _tpu_flash(query, key, value, mask, bias, is_causal, scale, plan):
    # Pallas ships with jax but only runs (and is only imported) on TPU.
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds, flash_attention

    groups = query.shape[2] // key.shape[2]
    if groups > 1:  # the kernel wants equal head counts
        key = jnp.repeat(key, groups, axis=2)
        value = jnp.repeat(value, groups, axis=2)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    kwargs = dict(causal=is_causal, sm_scale=scale)
    if plan == "pallas_segments":
        b = query.shape[0]
        kv_seg = jnp.broadcast_to(mask[:, 0, 0, :], (b, key.shape[1])).astype(jnp.int32)
        q_seg = jnp.ones((b, query.shape[1]), jnp.int32)
        kwargs["segment_ids"] = SegmentIds(q=q_seg, kv=kv_seg)
    elif plan == "pallas_bias":
        full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
        ab = jnp.zeros(full, jnp.float32)
        if bias is not None:
            ab = ab + bias.astype(jnp.float32)
        if mask is not None:
            ab = jnp.where(mask, ab, _NEG)
        kwargs["ab"] = ab
    out = jnp.swapaxes(flash_attention(q, k, v, **kwargs), 1, 2)
    if mask is not None:
        visible = jnp.swapaxes(jnp.any(mask, axis=-1, keepdims=True), 1, 2)
        out = jnp.where(visible, out, 0)
    return out.astype(query.dtype)


# === Chunked ===


def chunked(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """The chunked kernel as two nested `lax.scan`s, under one `jax.jit` (see `_chunked`).

    Called eagerly, a `lax.scan` traces its body into a new function each time and so
    compiles it again on every call (~0.5 s on a CPU even for tiny inputs); the jit compiles
    once per shapes and settings. Inside a traced function (a Keras train or predict step)
    the jit is simply inlined.
    """
    return _chunked_jit(query, key, value, mask, bias, bool(is_causal), float(scale),
                        int(bq), int(bk))


def _chunked(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """The chunked kernel as two nested `lax.scan`s.

    An unrolled Python loop lets XLA schedule every block at once, which keeps the whole
    score matrix alive; a scan runs one block at a time in the forward pass and, with the
    query-block body under `jax.checkpoint`, in the backward pass too. Key blocks that a
    causal mask hides entirely are skipped with `lax.cond`.
    """
    b, q_len, h, d = query.shape
    k_len = key.shape[1]
    bq, bk = min(bq, q_len), min(bk, k_len)
    nq, nk = -(-q_len // bq), -(-k_len // bk)
    pad_q, pad_k = nq * bq - q_len, nk * bk - k_len
    offset = k_len - q_len
    out_dtype = query.dtype

    q = _pad_axis(query, 1, pad_q)
    k = _pad_axis(key, 1, pad_k)
    v = _pad_axis(value, 1, pad_k)
    if mask is not None:
        mask = _pad_axis(_pad_axis(mask, 2, pad_q, True), 3, pad_k, False)
    if bias is not None:
        bias = _pad_axis(_pad_axis(bias.astype(jnp.float32), 2, pad_q), 3, pad_k)

    def q_rows(x, i):
        if x is None or x.shape[2] == 1:
            return x
        return jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=2)

    def k_cols(x, j):
        if x is None or x.shape[3] == 1:
            return x
        return jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=3)

    def q_block(i):
        q_blk = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
        m_rows, b_rows = q_rows(mask, i), q_rows(bias, i)
        q_pos = i * bq + jnp.arange(bq)[:, None] + offset

        def k_step(carry, j):
            def update(carry):
                run_max, run_sum, acc = carry
                k_blk = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
                v_blk = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
                sc = _grouped_scores(q_blk, k_blk).astype(jnp.float32) * scale
                if b_rows is not None:
                    sc = sc + k_cols(b_rows, j)
                k_pos = j * bk + jnp.arange(bk)[None, :]
                allowed = jnp.broadcast_to(k_pos < k_len, (bq, bk))
                if is_causal:
                    allowed = allowed & (k_pos <= q_pos)
                allowed = allowed[None, None]
                if m_rows is not None:
                    allowed = allowed & k_cols(m_rows, j)
                sc = jnp.where(allowed, sc, _NEG)
                new_max = jnp.maximum(run_max, sc.max(-1))
                p = jnp.where(allowed, jnp.exp(sc - new_max[..., None]), 0.0)
                alpha = jnp.exp(run_max - new_max)
                pv = _grouped_output(p, v_blk, "float32")
                acc = acc * jnp.swapaxes(alpha, 1, 2)[..., None] + pv
                return new_max, run_sum * alpha + p.sum(-1), acc

            # Rematerialise each key block too: the backward pass then keeps only the small
            # running statistics per key block, not its (bq, bk) scores.
            # Skip key blocks that no query of this block may see: those in the causal
            # future, and those a mask hides entirely (e.g. trailing padding).
            visible = None
            if is_causal:
                visible = j * bk <= i * bq + bq - 1 + offset
            if m_rows is not None:
                any_key = jnp.any(k_cols(m_rows, j))
                visible = any_key if visible is None else visible & any_key
            if visible is None:
                step = update
            else:
                def step(carry):
                    return jax.lax.cond(visible, update, lambda c: c, carry)
            return jax.checkpoint(step)(carry), None

        init = (
            jnp.full((b, h, bq), _NEG, jnp.float32),
            jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, bq, h, d), jnp.float32),
        )
        (_, run_sum, acc), _ = jax.lax.scan(k_step, init, jnp.arange(nk))
        denom = jnp.swapaxes(run_sum, 1, 2)[..., None]
        # (a row that sees no key: zeros; a NaN sum, from a NaN or infinite score, stays
        # NaN as in the other kernels: `denom > 0` turned it into zeros)
        empty = denom == 0
        return jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, denom)).astype(out_dtype)

    def q_step(carry, i):
        return carry, jax.checkpoint(q_block)(i)

    _, blocks = jax.lax.scan(q_step, None, jnp.arange(nq))  # (nq, b, bq, h, d)
    out = jnp.moveaxis(blocks, 0, 1).reshape(b, nq * bq, h, d)
    return out[:, :q_len]


_chunked_jit = jax.jit(_chunked, static_argnums=(5, 6, 7, 8))
