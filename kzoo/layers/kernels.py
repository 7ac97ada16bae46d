"""Scaled dot-product attention and its per-backend kernel dispatch.

`dot_product_attention` is the single entry point through which every attention in kzoo
runs. It takes `(batch, seq, heads, head_dim)` tensors and picks one of four kernels:

- ``"reference"``: einsum + float32 softmax in `keras.ops`; the definition every other kernel
  is tested against, and the only one that can return attention weights.
- ``"fused"``: the backend's native fused op. torch: `scaled_dot_product_attention` with
  boolean masks passed as booleans, causal-only calls passed as `is_causal` and native GQA;
  JAX: `jax.nn.dot_product_attention` (cuDNN on CUDA for half precision, XLA elsewhere);
  TensorFlow: the reference computation compiled by XLA (TensorFlow has no fused kernel).
- ``"chunked"``: exact memory-efficient attention on any backend: blocked over queries and
  keys with an online softmax (Rabe & Staats 2021; Dao et al. 2022), so peak memory is
  O(seq x block) both ways: JAX rematerialises each block under `lax.scan`, TensorFlow runs
  XLA while loops with a hand-written backward pass (`kernels_tf`), torch an unrolled loop
  with activation checkpointing. Key blocks that a causal mask hides entirely are skipped.
- ``"auto"``: what `attention_kernel` says is fastest for these arguments on this device.

A process-wide override (`set_attention_kernel` or the `KZOO_ATTENTION_KERNEL` environment
variable) replaces ``"auto"`` everywhere, for debugging.
"""

import math
import os

import keras
from keras import ops

from kzoo.layers.masks import causal_mask

KERNELS = ("auto", "reference", "fused", "chunked")
_OVERRIDE = {"kernel": None}

# Sequence length (number of keys) from which `auto` prefers the chunked kernel on backends
# without an O(n)-memory fused kernel. Chosen from benchmarks/attention.py on a 2-core CPU:
# on JAX the chunked scan is already faster at 2048 (causal blocks skipped). On TensorFlow
# the chunked XLA while loops (256x128 tiles) take 0.43-0.84x the XLA reference's time from
# 512 keys up, with a causal mask, a padding mask, forward and forward+backward; at 256 they
# are slower (1.05-1.54x), at 128 level.
CHUNKED_MIN_LENGTH = {"jax": 2048, "tensorflow": 512, "torch": None}
DEFAULT_BLOCK_SIZE = 512
# (query block, key block) where a backend measured better with other tiles, capped by
# DEFAULT_BLOCK_SIZE. TensorFlow at 8192 tokens, forward+backward (2-core CPU, median of 4
# interleaved): 512x512 2463 ms causal / 3029 ms padded; 256x128 1584 / 2066 ms.
BLOCK_SIZES = {"tensorflow": (256, 128)}

_NEG = -1e30  # finite "minus infinity" for float32 scores: exp(_NEG - m) == 0, never NaN


# === Kernel selection ===


def set_attention_kernel(kernel):
    """Force every `kernel="auto"` call to use `kernel` (None restores automatic choice).

    Example:
    >>> kzoo.layers.set_attention_kernel("reference")   # debug with the plain formula
    >>> kzoo.layers.set_attention_kernel(None)
    """
    if kernel is not None and kernel not in KERNELS[1:]:
        raise ValueError(
            f"`kernel` must be one of {list(KERNELS[1:])} or None; got kernel={kernel!r}."
        )
    _OVERRIDE["kernel"] = kernel


def get_attention_kernel_override():
    """The forced kernel (from `set_attention_kernel` or `KZOO_ATTENTION_KERNEL`), or None."""
    if _OVERRIDE["kernel"] is not None:
        return _OVERRIDE["kernel"]
    env = os.environ.get("KZOO_ATTENTION_KERNEL", "").strip().lower()
    if not env or env == "auto":
        return None
    if env not in KERNELS[1:]:
        raise ValueError(
            f"KZOO_ATTENTION_KERNEL must be one of {list(KERNELS)}; got {env!r}."
        )
    return env


def current_device():
    """'cpu', 'gpu' or 'tpu': where the current backend places new tensors."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        platform = jax.default_backend()
        return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.config.list_logical_devices("TPU"):
            return "tpu"
        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def choose_kernel(
    *,
    backend,
    device,
    dtype,
    query_length,
    key_length,
    head_dim,
    mask_kind="none",
    has_bias=False,
    needs_weights=False,
    dropout=False,
):
    """The kernel `auto` uses, as a pure function of the call's description.

    Args:
        backend: "jax", "torch" or "tensorflow".
        device: "cpu", "gpu" or "tpu".
        dtype: compute dtype name of the query ("float32", "bfloat16", "float16").
        query_length, key_length, head_dim: static sizes.
        mask_kind: "none", "causal" (only `is_causal`), or "general" (an explicit mask).
        has_bias: an additive bias is present.
        needs_weights: the caller wants the attention probabilities back.
        dropout: attention dropout is active (training with rate > 0).

    Returns:
        One of "reference", "fused", "chunked".

    Example:
    >>> choose_kernel(backend="jax", device="gpu", dtype="bfloat16", query_length=1024,
    ...               key_length=1024, head_dim=64, mask_kind="causal")
    'fused'
    """
    check = {"backend": (backend, ("jax", "torch", "tensorflow", "numpy", "openvino")),
             "device": (device, ("cpu", "gpu", "tpu")),
             "mask_kind": (mask_kind, ("none", "causal", "general"))}
    for name, (value, allowed) in check.items():
        if value not in allowed:
            raise ValueError(f"`{name}` must be one of {list(allowed)}; got {name}={value!r}.")
    if needs_weights or dropout:
        return "reference"
    if backend == "torch":
        # SDPA covers every mask/bias/GQA combination; on CPU and CUDA it runs flash or
        # memory-efficient kernels with O(n) memory when the mask allows it.
        return "fused"
    if backend == "jax":
        if device == "gpu":
            if dtype in ("float16", "bfloat16") and head_dim <= 128 and head_dim % 8 == 0:
                return "fused"  # cuDNN flash attention
            threshold = 1024
        elif device == "tpu":
            return "fused"
        else:
            threshold = CHUNKED_MIN_LENGTH["jax"]
        return "chunked" if key_length >= threshold and query_length > 1 else "reference"
    if backend == "tensorflow":
        # XLA while loops (kernels_tf): O(n) memory forward and backward on every device.
        if key_length >= CHUNKED_MIN_LENGTH["tensorflow"] and query_length > 1:
            return "chunked"
        return "fused" if device == "gpu" else "reference"
    return "reference"


def attention_kernel(
    query, key, value=None, *, mask=None, bias=None, is_causal=False, needs_weights=False,
    dropout=False, kernel="auto",
):
    """Which kernel `dot_product_attention` runs for these arguments.

    Example:
    >>> q = keras.ops.ones((1, 8, 2, 16))
    >>> attention_kernel(q, q)
    'reference'
    """
    _check_kernel_name(kernel)
    if kernel != "auto":
        return kernel
    forced = get_attention_kernel_override()
    if forced is not None:
        return "reference" if needs_weights else forced
    if mask is not None:
        mask_kind = "general"
    elif is_causal:
        mask_kind = "causal"
    else:
        mask_kind = "none"
    return choose_kernel(
        backend=keras.backend.backend(),
        device=current_device(),
        dtype=keras.backend.standardize_dtype(query.dtype),
        query_length=query.shape[1] if query.shape[1] is not None else 0,
        key_length=key.shape[1] if key.shape[1] is not None else 0,
        head_dim=query.shape[-1],
        mask_kind=mask_kind,
        has_bias=bias is not None,
        needs_weights=needs_weights,
        dropout=dropout,
    )


def _check_kernel_name(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {list(KERNELS)}; got kernel={kernel!r}.")


# === Argument checking ===


def _static_dim(x, axis):
    return x.shape[axis]


def _check_broadcast(name, tensor, target):
    """`tensor` must broadcast to the 4-D `target` shape; return it as a 4-D tensor."""
    shape = tuple(tensor.shape)
    if len(shape) > 4:
        raise ValueError(
            f"`{name}` must broadcast to (batch, heads, q_len, k_len)={target}; "
            f"got {name} with shape {shape} (rank {len(shape)} > 4)."
        )
    padded = (1,) * (4 - len(shape)) + shape
    for have, want in zip(padded, target):
        if have is not None and want is not None and have not in (1, want):
            raise ValueError(
                f"`{name}` with shape {shape} does not broadcast to "
                f"(batch, heads, q_len, k_len)={target}."
            )
    if len(shape) < 4:
        tensor = ops.reshape(tensor, tuple(-1 if d is None else d for d in padded))
    return tensor


def _check_inputs(query, key, value, mask, bias, scale):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if len(t.shape) != 4:
            raise ValueError(
                f"`{name}` must have rank 4 (batch, seq, heads, head_dim); got {name} with "
                f"shape {tuple(t.shape)}."
            )
    b, q_len, heads, dim = query.shape
    kb, k_len, kv_heads, kdim = key.shape
    if tuple(value.shape[:3]) != tuple(key.shape[:3]):
        raise ValueError(
            f"`key` and `value` must agree on (batch, seq, heads); got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}."
        )
    if kdim != dim:
        raise ValueError(
            f"`query` and `key` must have the same head_dim; got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
    if heads % kv_heads != 0:
        raise ValueError(
            f"the number of query heads ({heads}) must be a multiple of the number of "
            f"key/value heads ({kv_heads}) (grouped-query attention); got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}."
        )
    if b is not None and kb is not None and b != kb:
        raise ValueError(
            f"`query` and `key` must have the same batch size; got {b} and {kb}."
        )
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"`scale` must be a Python number or None; got scale={scale!r}.")
    target = (b, heads, q_len, k_len)
    if mask is not None:
        mask = ops.convert_to_tensor(mask)
        mask = _check_broadcast("mask", mask, target)
        if mask.dtype != "bool":
            mask = ops.cast(mask, "bool")
    if bias is not None:
        bias = ops.convert_to_tensor(bias)
        bias = _check_broadcast("bias", bias, target)
    return mask, bias


# === Public entry point ===


def dot_product_attention(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal=False,
    scale=None,
    kernel="auto",
    return_weights=False,
    dropout_rate=0.0,
    training=False,
    seed_generator=None,
):
    """Scaled dot-product attention, softmax(q k^T * scale + bias, masked) v.

    Args:
        query: `(batch, q_len, heads, head_dim)`.
        key, value: `(batch, k_len, kv_heads, head_dim)`; `heads % kv_heads == 0`
            (grouped-query / multi-query attention).
        mask: boolean, True = may attend; any shape that broadcasts (NumPy-style) to
            `(batch, heads, q_len, k_len)`.
        bias: added to the scores before the softmax; broadcasts like `mask`.
        is_causal: causal masking, bottom-right aligned when `q_len < k_len` (query i sees keys
            up to `i + k_len - q_len`, as cached decoding needs). Combines with `mask`.
        scale: multiplies the scores; defaults to `head_dim ** -0.5` (T5 uses 1.0).
        kernel: "auto", "reference", "fused" or "chunked" (see the module docstring).
        return_weights: also return the attention probabilities `(batch, heads, q, k)`
            (forces the reference kernel).
        dropout_rate, training, seed_generator: dropout on the attention probabilities
            (reference kernel; active only when `training` is true).

    Returns:
        `(batch, q_len, heads, head_dim)` in the query's dtype (and the weights if asked).
        Rows in which every key is masked give zeros, never NaN.

    Example:
    >>> q = keras.random.normal((2, 5, 4, 16)); k = v = keras.random.normal((2, 7, 2, 16))
    >>> dot_product_attention(q, k, v, is_causal=True).shape
    (2, 5, 4, 16)
    """
    _check_kernel_name(kernel)
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    mask, bias = _check_inputs(query, key, value, mask, bias, scale)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    dropout_active = bool(training) and dropout_rate > 0
    chosen = attention_kernel(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal,
        needs_weights=return_weights, dropout=dropout_active, kernel=kernel,
    )
    if return_weights and chosen != "reference":
        raise ValueError(
            f"`return_weights=True` needs kernel='reference' (or 'auto'); got kernel={kernel!r}."
        )
    if dropout_active and chosen != "reference":
        raise ValueError(
            f"attention dropout needs kernel='reference' (or 'auto'); got kernel={kernel!r}."
        )
    if chosen == "reference":
        return reference_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
            return_weights=return_weights, dropout_rate=dropout_rate if dropout_active else 0.0,
            seed_generator=seed_generator,
        )
    if chosen == "chunked":
        return chunked_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale
        )
    return fused_attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal,
                           scale=scale)


# === Reference kernel ===


def _grouped_scores(query, key):
    """q (b,t,h,d), k (b,s,hk,d) -> scores (b,h,t,s) with query head i using kv head i // g."""
    h, d = query.shape[2], query.shape[3]
    hk = key.shape[2]
    if h == hk:
        return ops.einsum("bthd,bshd->bhts", query, key)
    g = h // hk
    t, s = ops.shape(query)[1], ops.shape(key)[1]
    q = ops.reshape(query, (-1, t, hk, g, d))
    scores = ops.einsum("btkgd,bskd->bkgts", q, key)
    return ops.reshape(scores, (-1, h, t, s))


def _grouped_output(weights, value, out_dtype):
    """weights (b,h,t,s), v (b,s,hk,d) -> (b,t,h,d)."""
    h = weights.shape[1]
    t, s = ops.shape(weights)[2], ops.shape(weights)[3]
    hk, d = value.shape[2], value.shape[3]
    weights = ops.cast(weights, value.dtype)
    if h == hk:
        out = ops.einsum("bhts,bshd->bthd", weights, value)
    else:
        g = h // hk
        w = ops.reshape(weights, (-1, hk, g, t, s))
        out = ops.einsum("bkgts,bskd->btkgd", w, value)
        out = ops.reshape(out, (-1, t, h, d))
    return ops.cast(out, out_dtype)


def _full_mask(mask, is_causal, q_len, k_len):
    if is_causal:
        c = causal_mask(q_len, k_len)
        mask = c if mask is None else ops.logical_and(mask, c)
    return mask


def reference_attention(
    query, key, value, *, mask=None, bias=None, is_causal=False, scale=None,
    return_weights=False, dropout_rate=0.0, seed_generator=None,
):
    """The plain formula in `keras.ops`, softmax in float32. See `dot_product_attention`."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    q_len = query.shape[1] if query.shape[1] is not None else ops.shape(query)[1]
    k_len = key.shape[1] if key.shape[1] is not None else ops.shape(key)[1]
    scores = ops.cast(_grouped_scores(query, key), "float32") * scale
    if bias is not None:
        scores = scores + ops.cast(bias, "float32")
    # A causal mask alone (bottom-right aligned, q_len <= k_len) leaves every row a key.
    causal_only_full_rows = (
        isinstance(q_len, int) and isinstance(k_len, int) and q_len <= k_len
    )
    may_empty_rows = mask is not None or (is_causal and not causal_only_full_rows)
    mask = _full_mask(mask, is_causal, q_len, k_len)
    if mask is not None:
        scores = ops.where(mask, scores, _NEG)
    weights = ops.softmax(scores, axis=-1)
    # Masked keys already get exactly 0 (exp(_NEG - max) underflows); a fully masked row
    # would average every value uniformly instead, so such rows are zeroed. That is done on
    # the (…, q, 1) row flags and the output, not on the (q, k) weights, unless the
    # weights themselves are returned or dropped out.
    rows = _rows_with_any_key(mask) if may_empty_rows else None
    if rows is not None and (return_weights or dropout_rate > 0):
        weights = ops.where(rows, weights, 0.0)
    if dropout_rate > 0:
        weights = keras.random.dropout(weights, dropout_rate, seed=seed_generator)
    out = _grouped_output(weights, value, query.dtype)
    if rows is not None:
        out = ops.where(ops.transpose(rows, (0, 2, 1, 3)), out, ops.zeros((), out.dtype))
    if return_weights:
        return out, weights
    return out


# === Chunked (memory-efficient) kernel ===


def _remat(fn):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.checkpoint(fn)
    if backend == "torch":
        import torch.utils.checkpoint as checkpoint

        def wrapped(*args):
            return checkpoint.checkpoint(fn, *args, use_reentrant=False)

        return wrapped
    return fn


def _slice_axis(x, axis, start, stop):
    """Slice `x` along `axis` unless that axis is broadcast (size 1)."""
    if x is None or x.shape[axis] == 1:
        return x
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def chunked_attention(
    query, key, value, *, mask=None, bias=None, is_causal=False, scale=None,
    block_size=None, query_block_size=None, key_block_size=None,
):
    """Exact attention in O(seq x block) memory (forward and backward).

    Queries are processed in blocks of `query_block_size`; within a block, keys are visited
    in blocks of `key_block_size` with a running maximum and a running sum (online softmax),
    so no `(q_len, k_len)` score matrix ever exists. The backward pass recomputes each block
    (JAX: `jax.checkpoint` under `lax.scan`; torch: activation checkpointing; TensorFlow: a
    hand-written FlashAttention backward in XLA while loops, see `kernels_tf`). Key blocks that
    lie entirely in a query block's causal future are skipped, which halves the work of long
    causal sequences; JAX and TensorFlow also skip blocks a mask hides for the whole block.
    Block sizes default to `DEFAULT_BLOCK_SIZE`, or the backend's `BLOCK_SIZES` entry
    (capped by it); `block_size` sets both, the other two each one.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    block_size = block_size or DEFAULT_BLOCK_SIZE
    pref_q, pref_k = BLOCK_SIZES.get(keras.backend.backend(), (block_size, block_size))
    bq = query_block_size or min(pref_q, block_size)
    bk = key_block_size or min(pref_k, block_size)
    q_len, k_len = query.shape[1], key.shape[1]
    if q_len is None or k_len is None:
        raise ValueError("chunked attention needs static sequence lengths.")
    offset = k_len - q_len  # bottom-right causal alignment
    out_dtype = query.dtype
    has_mask, has_bias = mask is not None, bias is not None

    def block_fn(q_blk, k_all, v_all, *extras):
        extras = list(extras)
        m_blk = extras.pop(0) if has_mask else None
        b_blk = extras.pop(0) if has_bias else None
        q_start = extras.pop(0)  # static int closed over via partial below
        t = q_blk.shape[1]
        h = q_blk.shape[2]
        d = v_all.shape[-1]
        running_max = None
        running_sum = None
        acc = None
        for k_start in range(0, k_len, bk):
            k_stop = min(k_start + bk, k_len)
            if is_causal and k_start > q_start + t - 1 + offset:
                break  # this key block and all after it are in every query's future
            s = ops.cast(
                _grouped_scores(q_blk, k_all[:, k_start:k_stop]), "float32"
            ) * scale
            if b_blk is not None:
                s = s + ops.cast(_slice_axis(b_blk, 3, k_start, k_stop), "float32")
            allowed = None
            if m_blk is not None:
                allowed = _slice_axis(m_blk, 3, k_start, k_stop)
            if is_causal and k_stop - 1 > q_start + offset:
                c = causal_mask(t, k_stop - k_start, offset=q_start + offset - k_start)
                allowed = c if allowed is None else ops.logical_and(allowed, c)
            if allowed is not None:
                s = ops.where(allowed, s, _NEG)
            blk_max = ops.max(s, axis=-1)
            new_max = blk_max if running_max is None else ops.maximum(running_max, blk_max)
            p = ops.exp(s - new_max[..., None])
            if allowed is not None:
                p = ops.where(allowed, p, 0.0)
            pv = _grouped_output(p, v_all[:, k_start:k_stop], "float32")  # (b,t,h,d)
            if running_max is None:
                running_sum = ops.sum(p, axis=-1)
                acc = pv
            else:
                alpha = ops.exp(running_max - new_max)  # (b,h,t)
                running_sum = running_sum * alpha + ops.sum(p, axis=-1)
                acc = acc * ops.transpose(alpha, (0, 2, 1))[..., None] + pv
            running_max = new_max
        if running_max is None:  # every key lies in this block's future: no row sees one
            return ops.zeros(tuple(ops.shape(q_blk)[:3]) + (d,), out_dtype)
        denom = ops.transpose(running_sum, (0, 2, 1))[..., None]  # (b,t,h,1)
        out = ops.where(denom > 0, acc / ops.maximum(denom, 1e-30), 0.0)
        return ops.cast(out, out_dtype)

    if keras.backend.backend() == "jax":
        return _chunked_scan_jax(query, key, value, mask, bias, is_causal, scale, bq, bk)
    if keras.backend.backend() == "tensorflow":
        return _chunked_tf(query, key, value, mask, bias, is_causal, scale, bq, bk)

    outputs = []
    for q_start in range(0, q_len, bq):
        q_stop = min(q_start + bq, q_len)
        args = [query[:, q_start:q_stop], key, value]
        if has_mask:
            args.append(_slice_axis(mask, 2, q_start, q_stop))
        if has_bias:
            args.append(_slice_axis(bias, 2, q_start, q_stop))

        def fn(*a, _q_start=q_start):
            return block_fn(*a, _q_start)

        outputs.append(_remat(fn)(*args))
    if len(outputs) == 1:
        return outputs[0]
    return ops.concatenate(outputs, axis=1)


def _chunked_tf(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """TensorFlow's chunked kernel (`kernels_tf`), XLA-compiled when called eagerly."""
    from kzoo.layers.kernels_tf import chunked_attention_tf

    def run(q, k, v, m, b):
        return chunked_attention_tf(q, k, v, m, b, is_causal, scale, bq, bk)

    config = ("chunked", is_causal, float(scale), bq, bk, mask is not None, bias is not None)
    return _tf_run_compiled(config, run, query, key, value, mask, bias)


def _chunked_scan_jax(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """The chunked kernel as two nested `lax.scan`s (JAX).

    An unrolled Python loop lets XLA schedule every block at once, which keeps the whole
    score matrix alive; a scan runs one block at a time in the forward pass and, with the
    query-block body under `jax.checkpoint`, in the backward pass too. Key blocks that a
    causal mask hides entirely are skipped with `lax.cond`.
    """
    import jax
    import jax.numpy as jnp

    b, q_len, h, d = query.shape
    k_len = key.shape[1]
    bq, bk = min(bq, q_len), min(bk, k_len)
    nq, nk = -(-q_len // bq), -(-k_len // bk)
    pad_q, pad_k = nq * bq - q_len, nk * bk - k_len
    offset = k_len - q_len
    out_dtype = query.dtype

    def pad(x, axis, amount, value=0):
        if amount == 0 or x.shape[axis] == 1:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, amount)
        return jnp.pad(x, widths, constant_values=value)

    q = pad(query, 1, pad_q)
    k = pad(key, 1, pad_k)
    v = pad(value, 1, pad_k)
    if mask is not None:
        mask = pad(pad(mask, 2, pad_q, True), 3, pad_k, False)
    if bias is not None:
        bias = pad(pad(bias.astype(jnp.float32), 2, pad_q), 3, pad_k)

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
        return jnp.where(denom > 0, acc / jnp.maximum(denom, 1e-30), 0.0).astype(out_dtype)

    def q_step(carry, i):
        return carry, jax.checkpoint(q_block)(i)

    _, blocks = jax.lax.scan(q_step, None, jnp.arange(nq))  # (nq, b, bq, h, d)
    out = jnp.moveaxis(blocks, 0, 1).reshape(b, nq * bq, h, d)
    return out[:, :q_len]


# === Fused (backend-native) kernels ===


def fused_attention(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None):
    """The backend's native fused attention. See the module docstring."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    backend = keras.backend.backend()
    if backend == "torch":
        return _torch_sdpa(query, key, value, mask, bias, is_causal, scale)
    if backend == "jax":
        return _jax_attention(query, key, value, mask, bias, is_causal, scale)
    if backend == "tensorflow":
        return _tf_xla_attention(query, key, value, mask, bias, is_causal, scale)
    return reference_attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal,
                               scale=scale)


def _rows_with_any_key(mask):
    """(…, q, 1) boolean: the query row has at least one visible key."""
    return ops.any(mask, axis=-1, keepdims=True)


def _torch_sdpa(query, key, value, mask, bias, is_causal, scale):
    import torch
    import torch.nn.functional as F

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    q_len, k_len = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    causal_flag = False
    if is_causal:
        if mask is None and bias is None and q_len == k_len:
            causal_flag = True  # SDPA's is_causal is top-left aligned: only equal lengths
        else:
            c = torch.ones((q_len, k_len), dtype=torch.bool, device=q.device).tril(k_len - q_len)
            c = c[None, None]
            mask = c if mask is None else torch.logical_and(mask, c)
    attn_mask = None
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, torch.finfo(attn_mask.dtype).min)
    elif mask is not None:
        attn_mask = mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal_flag, scale=scale, enable_gqa=gqa
    )
    out = out.transpose(1, 2)
    if mask is not None:
        # Fully masked rows: zeros on every SDPA backend (some return NaN for them).
        visible = torch.any(mask, dim=-1, keepdim=True)  # (b|1, h|1, q, 1)
        visible = visible.transpose(1, 2)  # (b|1, q, h|1, 1)
        out = torch.where(visible, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


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


def _jax_tpu_flash(query, key, value, mask, bias, is_causal, scale, plan):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    groups = query.shape[2] // key.shape[2]
    if groups > 1:  # the kernel wants equal head counts
        key = jnp.repeat(key, groups, axis=2)
        value = jnp.repeat(value, groups, axis=2)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    kwargs = dict(causal=is_causal, sm_scale=scale)
    if plan == "pallas_segments":
        from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds

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


def _jax_attention(query, key, value, mask, bias, is_causal, scale):
    import jax

    if current_device() == "tpu":
        plan = tpu_flash_plan(query.shape, key.shape, None if mask is None else mask.shape,
                              bias is not None, is_causal)
        if plan != "xla":
            return _jax_tpu_flash(query, key, value, mask, bias, is_causal, scale, plan)

    q_len, k_len = query.shape[1], key.shape[1]
    if is_causal and q_len != k_len:
        c = causal_mask(q_len, k_len)
        mask = c if mask is None else ops.logical_and(mask, c)
        is_causal = False
    implementation = None
    if current_device() == "gpu" and keras.backend.standardize_dtype(query.dtype) in (
        "float16", "bfloat16"
    ):
        implementation = "cudnn"
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


_TF_COMPILED = {}


def _tf_run_compiled(config, fn, *args):
    """`fn(*args)` on TensorFlow: traced inline inside a graph (where `fit` may already
    compile it with XLA); called eagerly, through one `tf.function(jit_compile=True)` per
    static `config`."""
    import tensorflow as tf

    if not tf.executing_eagerly():
        return fn(*args)
    if config not in _TF_COMPILED:
        _TF_COMPILED[config] = tf.function(fn, jit_compile=True)
    return _TF_COMPILED[config](*args)


def _tf_xla_attention(query, key, value, mask, bias, is_causal, scale):
    def run(q, k, v, m, b):
        return reference_attention(q, k, v, mask=m, bias=b, is_causal=is_causal, scale=scale)

    config = ("reference", is_causal, float(scale), mask is not None, bias is not None)
    return _tf_run_compiled(config, run, query, key, value, mask, bias)
