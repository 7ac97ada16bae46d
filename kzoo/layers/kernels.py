"""Scaled dot-product attention and its per-backend kernel dispatch.

`dot_product_attention` is the single entry point through which every attention in kzoo
runs. It takes `(batch, seq, heads, head_dim)` tensors and picks one of four kernels:

- ``"reference"``: einsum + float32 softmax in `keras.ops`; the definition every other kernel
  is tested against, and the only one that can return attention weights. On JAX, where it
  is the CPU kernel, a call without weights or dropout multiplies heads-major operands,
  divides by the softmax's sum after the second product (`_normalized_after`) and splits a
  causal self-attention of 256 positions or more into query blocks that skip the keys
  above the diagonal (`causal_query_blocks`).
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

This file holds the public API, the choice of kernel, the argument checks and the reference
formula. The fused and chunked kernels live in one module per backend (`kernels_jax`,
`kernels_torch`, `kernels_tf`), imported only when that backend runs; backends without one
(numpy, openvino) run the reference formula for every kernel.
"""

import importlib
import itertools
import math
import os
import warnings

import keras
import numpy as np
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

# The reference kernel splits causal self-attention into query blocks of about this many
# rows (see `causal_query_blocks`) on these backends. JAX, 8 x 256 tokens, 4 heads of 64,
# 2 cores: one attention forward + backward 20.3 -> 13.7 ms in 2 blocks (14.2 in 4), forward
# 6.4 -> 4.9 ms; GPT training (the peers' model) 4,449 -> 4,621 tokens/s, forward 14,520 ->
# 15,256. TensorFlow's XLA trained slower with the blocks (4,585 -> 4,395 heads-major, 4,502
# -> 4,360 with its own formula) and keeps the whole product.
# (Only the JAX path of `reference_attention` runs blocks: adding a backend here needs a
# blocked path there too.)
CAUSAL_BLOCK_ROWS = 128
CAUSAL_BLOCK_BACKENDS = ("jax",)

_NEG = -1e30  # finite "minus infinity" for float32 scores: exp(_NEG - m) == 0, never NaN


# === Per-backend kernel modules ===

_BACKEND_MODULES = {
    "jax": "kzoo.layers.kernels_jax",
    "torch": "kzoo.layers.kernels_torch",
    "tensorflow": "kzoo.layers.kernels_tf",
}


def _backend_kernels():
    """The running backend's kernel module, or None for a backend without one.

    Each module defines `device()`, `fused(query, key, value, mask, bias, is_causal, scale)`
    and `chunked(..., scale, bq, bk)` on arguments already checked here. It is imported on
    first use, so that a process never imports another backend's framework, and it may
    import the shared helpers below from this module.
    """
    name = _BACKEND_MODULES.get(keras.backend.backend())
    return None if name is None else importlib.import_module(name)


# === Kernel selection ===


def set_attention_kernel(kernel):
    """Force every `kernel="auto"` call to use `kernel`. "auto" restores the automatic choice
    whatever `KZOO_ATTENTION_KERNEL` says; None restores the default (the environment
    variable if it is set, else the automatic choice).

    Example:
    >>> kzoo.layers.set_attention_kernel("reference")   # debug with the plain formula
    >>> kzoo.layers.set_attention_kernel("auto")
    """
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(
            f"`kernel` must be one of {list(KERNELS)} or None; got kernel={kernel!r}."
        )
    _OVERRIDE["kernel"] = kernel


def get_attention_kernel_override():
    """The forced kernel (from `set_attention_kernel` or `KZOO_ATTENTION_KERNEL`), or None."""
    if _OVERRIDE["kernel"] is not None:
        return None if _OVERRIDE["kernel"] == "auto" else _OVERRIDE["kernel"]
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
    impl = _backend_kernels()
    return "cpu" if impl is None else impl.device()


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
        # Integer or boolean inputs ran the products in integers: JAX and TensorFlow
        # returned integer outputs (weights truncated to 0 or 1) in silence, torch failed
        # inside its kernels.
        dtype = keras.backend.standardize_dtype(t.dtype)
        if "float" not in dtype:
            raise ValueError(
                f"`{name}` must have a floating-point dtype (attention needs floating-point "
                f"query/key/value); got {name} with dtype {dtype}."
            )
    b, q_len, heads, dim = query.shape
    kb, k_len, kv_heads, kdim = key.shape
    if heads == 0 or kv_heads == 0:  # (`heads % kv_heads` below; empty reshapes on torch)
        raise ValueError(
            f"`query` and `key` must have at least one head; got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
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
    if dim == 0:  # (the default scale is head_dim ** -0.5)
        raise ValueError(
            "`head_dim` (the last axis of `query`, `key` and `value`) must be at least 1; "
            f"got 0; query has shape {tuple(query.shape)}."
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
    vdim = value.shape[-1]
    if vdim is not None and kdim is not None and vdim != kdim:
        raise ValueError(
            f"`value` must have the head_dim of `key` (every kernel's layout); got key "
            f"{tuple(key.shape)} and value {tuple(value.shape)}."
        )
    for name, t in (("query", query), ("key", key)):
        if t.shape[1] == 0:
            raise ValueError(
                f"`{name}` has no positions (shape {tuple(t.shape)}); attention needs at "
                "least one query and one key.")
    if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float, np.integer, np.floating))
            or not math.isfinite(scale)):
        raise ValueError(f"`scale` must be a finite number or None; got scale={scale!r}.")
    target = (b, heads, q_len, k_len)
    if mask is not None:
        mask = ops.convert_to_tensor(mask)
        mask = _check_broadcast("mask", mask, target)
        # (a float mask was cast to bool: an additive mask, 0 where a key may be attended
        # and -inf / -1e9 where not, was silently read the other way round)
        if "float" in keras.backend.standardize_dtype(mask.dtype):
            raise ValueError(
                "`mask` must be boolean (True = may attend) or integer 0 / 1; got mask with "
                f"dtype {keras.backend.standardize_dtype(mask.dtype)}. An additive mask "
                "(0 to attend, -inf or a large negative number not to) goes in `bias`."
            )
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
        mask: boolean, True = may attend (or integer 0 / 1; a float mask is refused: an
            additive mask goes in `bias`); any shape that broadcasts (NumPy-style) to
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
        `(batch, q_len, heads, head_dim)` in the query's dtype (and the weights if asked);
        keys and values of another float dtype are cast to the query's first.
        Rows in which every key is masked give zeros, never NaN.

    Example:
    >>> q = keras.random.normal((2, 5, 4, 16)); k = v = keras.random.normal((2, 7, 2, 16))
    >>> dot_product_attention(q, k, v, is_causal=True).shape
    (2, 5, 4, 16)
    """
    _check_kernel_name(kernel)
    shape = getattr(query, "shape", None)
    if scale is None and shape is not None and len(shape) and shape[-1] is None:
        raise ValueError(
            "`head_dim` (the last axis of `query`) must be known when the call is traced to "
            "give the default scale head_dim ** -0.5; got query with shape "
            f"{tuple(shape)}. Trace with a static head_dim or pass `scale`."
        )
    if any(isinstance(x, keras.KerasTensor) for x in (query, key, value, mask, bias)):
        # Symbolic inputs (a functional model being built): the output spec, traced through
        # the backend (torch's kernels call torch functions, which take no KerasTensor).
        from keras.src import backend as keras_backend

        return keras_backend.compute_output_spec(
            lambda q, k, v, m, b: dot_product_attention(
                q, k, v, mask=m, bias=b, is_causal=is_causal, scale=scale, kernel=kernel,
                return_weights=return_weights, dropout_rate=dropout_rate,
                training=training, seed_generator=seed_generator),
            query, key, value, mask, bias)
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"`is_causal` must be True or False; got is_causal={is_causal!r}.")
    if isinstance(dropout_rate, bool) or not isinstance(
            dropout_rate, (int, float, np.integer, np.floating)) or not 0 <= dropout_rate < 1:
        raise ValueError(
            f"`dropout_rate` must be a number in [0, 1); got dropout_rate={dropout_rate!r}.")
    mask, bias = _check_inputs(query, key, value, mask, bias, scale)
    # Keys and values of another float dtype than the queries are cast to the queries'
    # (the output's dtype): torch's kernels and JAX's fused one refused the mix, while the
    # other kernels ran it.
    key, value = (x if x.dtype == query.dtype else ops.cast(x, query.dtype)
                  for x in (key, value))
    is_causal, dropout_rate = bool(is_causal), float(dropout_rate)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
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
    bias_rows = None
    if chosen == "reference" or (chosen == "fused" and not (
            keras.backend.backend() == "torch" and current_device() == "cpu")):
        # (the chunked kernels and torch's SDPA on CPU give a row blocked by -inf zeros)
        bias, bias_rows = _finite_bias(bias)
    if chosen == "reference":
        result = reference_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
            return_weights=return_weights, dropout_rate=dropout_rate if dropout_active else 0.0,
            seed_generator=seed_generator,
        )
    elif chosen == "chunked":
        result = chunked_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale
        )
    else:
        result = fused_attention(query, key, value, mask=mask, bias=bias,
                                 is_causal=is_causal, scale=scale)
    if bias_rows is None:
        return result
    out, weights = result if return_weights else (result, None)
    out = ops.where(ops.transpose(bias_rows, (0, 2, 1, 3)), out, ops.zeros((), out.dtype))
    if return_weights:
        return out, ops.where(bias_rows, weights, ops.zeros((), weights.dtype))
    return out


def _finite_bias(bias):
    """(`bias` with -inf raised to `_NEG`, the `(b|1, h|1, q|1, 1)` flags of the query rows
    whose bias is above `_NEG` at some key, or None without a bias).

    An additive mask in `bias` (what the refusal of float masks asks for) may block a whole
    row with -inf: the softmax's maximum is then -inf and the reference and fused kernels
    gave NaN (`-inf - -inf`) where the chunked kernel and torch's SDPA gave zeros. Raised to
    `_NEG`, such a row's weights are finite; the flags give it zeros on every kernel, as a
    fully masked row. Both cost an elementwise pass and a reduction over the bias' own
    (broadcasting) shape, not the scores'."""
    if bias is None:
        return None, None
    if "float" not in keras.backend.standardize_dtype(bias.dtype):
        return bias, None
    dtype = keras.backend.standardize_dtype(bias.dtype)
    floor = ops.cast(float(np.finfo(np.float16).min) if dtype == "float16" else _NEG, dtype)
    bias = ops.maximum(bias, floor)  # (4-D: see `_check_inputs`)
    return bias, ops.any(bias > floor, axis=-1, keepdims=True)


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


def _heads_major_scores(q, k):
    """Scores `(b, h, t, s)` from heads-major `(b, h, t, d)` / `(b, hk, s, d)` operands,
    query head i using kv head `i // (h // hk)` (see `_normalized_after`)."""
    h, d = q.shape[1], q.shape[3]
    hk = k.shape[1]
    if h == hk:
        return ops.einsum("bhtd,bhsd->bhts", q, k)
    t, s = ops.shape(q)[2], ops.shape(k)[2]
    scores = ops.einsum("bkgtd,bksd->bkgts", ops.reshape(q, (-1, hk, h // hk, t, d)), k)
    return ops.reshape(scores, (-1, h, t, s))


def _normalized_after(scores, v):
    """`softmax(scores) @ v` as `(exp(scores - max) @ v) / sum(exp(scores - max))` with
    heads-major operands: scores `(b, h, t, s)` float32, v `(b, hk, s, d)` -> `(b, h, t, d)`
    float32. The sum divides the `(t, d)` outputs instead of the `(t, s)` weights, and both
    products take `(b, h, ., .)` operands. XLA on CPU (JAX) multiplies those faster than the
    `(b, s, h, d)` einsums of `_grouped_scores` / `_grouped_output` and does not fuse the
    softmax into the second product (a fusion it ran slower than the two apart): 8 x 256
    tokens, 4 heads of 64, 2 cores, one attention 8.5 -> 4.8 ms forward, 43 -> 21 ms
    forward + backward. The maximum is a constant to differentiation (the softmax does not
    depend on it)."""
    top = ops.stop_gradient(ops.max(scores, axis=-1, keepdims=True))
    e = ops.exp(scores - top)
    total = ops.sum(e, axis=-1, keepdims=True)  # (b, h, t, 1)
    h = scores.shape[1]
    t, s = ops.shape(scores)[2], ops.shape(scores)[3]
    hk, d = v.shape[1], v.shape[3]
    e = ops.cast(e, v.dtype)
    if h == hk:
        out = ops.einsum("bhts,bhsd->bhtd", e, v)
    else:
        g = h // hk
        out = ops.einsum("bkgts,bksd->bkgtd", ops.reshape(e, (-1, hk, g, t, s)), v)
        out = ops.reshape(out, (-1, h, t, d))
    return ops.cast(out, "float32") / total


def _heads_major_attention(q, k, v, mask, bias, is_causal, scale):
    """The reference formula without weights or dropout on heads-major `(b, h, t, d)` /
    `(b, hk, s, d)` operands -> `(b, h, t, d)` float32 (JAX's CPU kernel, see
    `reference_attention`); the arguments as `reference_attention`'s."""
    q_len = q.shape[2] if q.shape[2] is not None else ops.shape(q)[2]
    k_len = k.shape[2] if k.shape[2] is not None else ops.shape(k)[2]
    if SCALED_QUERIES and scale != 1.0 and (
            math.frexp(scale)[0] == 0.5
            or keras.backend.standardize_dtype(q.dtype) == "float32"):
        q, scale = q * ops.cast(scale, q.dtype), 1.0
    scores, rows = _masked_scores(_heads_major_scores(q, k), mask, bias, is_causal, scale,
                                  q_len, k_len, additive=ADDITIVE_MASK)
    out = _normalized_after(scores, v)
    if rows is not None:
        out = ops.where(rows, out, ops.zeros((), out.dtype))
    return out


# JAX's heads-major kernel multiplies the queries `(b, h, t, d)` by the scale instead of the
# scores `(b, h, t, s)` where that rounds no worse (float32 queries, or a power of two:
# `head_dim ** -0.5` for head_dim 64 is 1/8, exact either way): XLA's CPU fusion of the
# scores' product (YNNPACK) took the scale as a `(b, h, t, s)` operand, materialised
# from the constant (8 MiB at 8 x 256 tokens, 4 heads) and read again in every layer; the
# multiply now joins the queries' transposing copy.
SCALED_QUERIES = True

# JAX's heads-major kernel gives each call's additive mask its own large negative constant
# (`_NEG * (1 + i / 64)`, i = 0..63 in turn as calls are traced): XLA merged the layers'
# identical `(b, 1, 1, s)` padding-mask biases into one tensor broadcast to `(b, h, t, s)`
# (8 MiB at 8 x 256 tokens, 4 heads) that every layer's product fusion read again; a bias
# of its own stays at the mask's shape inside its layer's fusion. The weights are the same
# (a masked score rounds to the constant, whose weight is exactly 0). Paired A/B, 40
# alternating `predict_on_batch` calls, 8 x 256 tokens: BERT forward 197.8 -> 190.9 ms
# (median paired speed-up 1.030), GPT 1.006 (its causal blocks were not affected).
DISTINCT_MASK_BIAS = True
_MASK_BIAS_STEPS = itertools.cycle(range(64))

# JAX's heads-major kernel adds its mask to the scores (see `_masked_scores`); A/B in one
# process, 4 rounds, the peers' sizes: BERT forward 14,065 -> 14,739 tokens/s, GPT forward
# 14,795 -> 14,930, training unchanged. TensorFlow's path measured no gain and selects.
ADDITIVE_MASK = True


def _bias_over(bias, scores):
    """`bias` to add to `scores`: on JAX, a bias shared by the rows of the batch (T5's
    relative position bias, `(1, heads, q, k)`) broadcast by `broadcast_leading`, so that its
    gradient, the sum over the batch, is a product by a row of ones instead of XLA's slow CPU
    reduce over the major axis. A T5 v1.0 training step (8 x 256 tokens, 4 + 4 layers, width
    256, vocabulary 8192, 2-core CPU) spent ~90 ms of ~1.1 s in those sums (a step with the
    bias table's gradient stopped: 1,860 -> 2,029 decoder tokens/s); with this, interleaved
    in one process, 10 pairs: 1,833 -> 2,012 decoder tokens/s, median speed-up per pair
    1.10x, the same losses; the forward pass unchanged (0.998x). Elsewhere, or when the bias
    is not shared that way, `bias` itself (the add broadcasts it)."""
    if not BIAS_OVER_ROWS or keras.backend.backend() != "jax":
        return bias
    from kzoo.layers.utils import _static, broadcast_leading

    shape = tuple(bias.shape)
    target = tuple(scores.shape)
    if not (_static(shape) and _static(target)) or len(shape) > len(target):
        return bias
    lead = 0
    while lead < len(shape) and shape[lead] == 1:
        lead += 1
    trailing = shape[lead:]
    if not trailing or trailing != target[len(target) - len(trailing):] or (
            trailing == target):
        return bias
    return broadcast_leading(ops.reshape(bias, trailing), target)


# JAX: a batch-shared attention bias is broadcast by `broadcast_leading` (see `_bias_over`).
BIAS_OVER_ROWS = True

# TensorFlow: the reference formula on float32 operands without weights or dropout runs
# `kernels_tf.reference_with_gradient` (the scaled queries, an additive mask, the softmax's
# kernel and a hand-written backward pass). GPT training at benchmarks.peers' size
# (interleaved in one process): see that function and docs/PERFORMANCE.md.
TF_HAND_GRADIENT = True


def _masked_scores(scores, mask, bias, is_causal, scale, q_len, k_len, additive=False):
    """(float32 scores scaled, biased and masked, the `(…, q, 1)` flags of rows with a
    visible key or None where every row has one).

    `additive`: the mask is added to the scores as a float32 bias of 0 / `_NEG` made at the
    mask's own (broadcasting) shape instead of selecting `_NEG` into the full scores. The
    values are the same (`s + c` rounds to the constant `c`, `_NEG` to `2 * _NEG` (see
    `DISTINCT_MASK_BIAS`), for any `|s| < 3e22`, and its weight is exactly 0 either way).
    XLA on CPU (JAX) keeps an add in the fusion of the scores' product but runs a select as
    a separate pass: 8 x 256 tokens, 4 heads of 64, 2 cores, one attention 5.1-5.7 ->
    3.1-3.4 ms (padding or causal mask)."""
    scores = ops.cast(scores, "float32")
    if scale != 1.0:
        scores = scores * scale
    if bias is not None:
        scores = scores + _bias_over(ops.cast(bias, "float32"), scores)
    mask, rows = _mask_and_rows(mask, is_causal, q_len, k_len)
    if mask is not None and additive:
        # (each call its own constant: see `DISTINCT_MASK_BIAS`)
        negative = _NEG * (1 + next(_MASK_BIAS_STEPS) / 64) if DISTINCT_MASK_BIAS else _NEG
        added = ops.cast(ops.where(mask, 0.0, negative), "float32")
        scores = scores + added
    elif mask is not None:
        scores = ops.where(mask, scores, _NEG)
    return scores, rows


def _mask_and_rows(mask, is_causal, q_len, k_len):
    """(the mask with the causal one in it or None, the `(…, q, 1)` flags of rows with a
    visible key or None where every row has one).

    Masked keys get exactly 0 (exp(_NEG - max) underflows); a fully masked row would average
    every value uniformly instead, so the kernels zero such rows. That is done on these row
    flags and the output, not on the (q, k) weights, unless the weights themselves are
    returned or dropped out."""
    # A causal mask alone (bottom-right aligned, q_len <= k_len) leaves every row a key.
    causal_only_full_rows = (
        isinstance(q_len, int) and isinstance(k_len, int) and q_len <= k_len
    )
    may_empty_rows = mask is not None or (is_causal and not causal_only_full_rows)
    mask = _full_mask(mask, is_causal, q_len, k_len)
    return mask, _rows_with_any_key(mask) if may_empty_rows else None


def _rows_with_any_key(mask):
    """(…, q, 1) boolean: the query row has at least one visible key."""
    return ops.any(mask, axis=-1, keepdims=True)


def _full_mask(mask, is_causal, q_len, k_len):
    if is_causal:
        c = causal_mask(q_len, k_len)
        mask = c if mask is None else ops.logical_and(mask, c)
    return mask


def causal_query_blocks(q_len, k_len, is_causal, backend=None):
    """The `(start, end)` query-row blocks in which the reference kernel splits a causal
    self-attention of `q_len == k_len` (static) positions, or None to run it whole.

    Rows `[a, e)` of a causal attention see only keys `[0, e)`, so block by block the two
    products skip the keys above the diagonal blocks: with 2 blocks a quarter of their
    multiply-adds, with n blocks `(n - 1) / 2n`. Blocks are ~`CAUSAL_BLOCK_ROWS` rows, from
    `2 * CAUSAL_BLOCK_ROWS` positions on, and only on the backends in
    `CAUSAL_BLOCK_BACKENDS` (JAX: XLA's CPU kernels multiply the smaller batched products
    no slower per multiply-add; torch's SDPA skips those keys itself; see the constant).

    Example:
    >>> causal_query_blocks(256, 256, True, backend="jax")
    [(0, 128), (128, 256)]
    """
    backend = backend or keras.backend.backend()
    if not (is_causal and backend in CAUSAL_BLOCK_BACKENDS and isinstance(q_len, int)
            and q_len == k_len and q_len >= 2 * CAUSAL_BLOCK_ROWS):
        return None
    n = max(2, round(q_len / CAUSAL_BLOCK_ROWS))
    bounds = [i * q_len // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _rows_keys(x, a, e):
    """A mask or bias broadcasting to `(..., q_len, k_len)`, cut to query rows `[a, e)` and
    keys `[0, e)` (axes of size 1 stay)."""
    if x is None:
        return None
    if len(x.shape) >= 2 and x.shape[-2] != 1:
        x = x[..., a:e, :]
    if x.shape[-1] != 1:
        x = x[..., :e]
    return x


def uniform_empty_rows(out, mask, value):
    """`out` `(batch, q_len, heads, head_dim)` of an attention whose query rows without any
    allowed key read the mean of all the values instead (every key weighted equally).

    The kernels give such a row zeros. Hugging Face's encoders and cross-attentions (BERT,
    eager or SDPA; T5's encoder and cross-attention) add the float32 minimum to the scores of
    masked keys, which leaves every score of a fully masked row equal (the minimum absorbs
    the scores and the position bias): the row attends uniformly to every key, padding
    included. The non-causal attention of kzoo's blocks gives those rows the same output
    (`TransformerBlock`, `kzoo.layers.fast_decode`); a causal one keeps zeros (transformers'
    causal models give zeros there too with SDPA, their default).

    `mask`: boolean, broadcasting to `(batch, heads, q_len, k_len)` (None: nothing to do);
    `value`: `(batch, k_len, kv_heads, head_dim)` (grouped heads share their key/value
    head's mean).
    """
    if mask is None:
        return out
    module = _backend_kernels()
    if module is not None and hasattr(module, "uniform_empty_rows"):
        return module.uniform_empty_rows(out, mask, value)  # (torch: its own ops)
    mask = ops.convert_to_tensor(mask)
    if mask.dtype != "bool":
        mask = ops.cast(mask, "bool")
    while len(mask.shape) < 4:
        mask = ops.expand_dims(mask, 0)
    empty = ops.logical_not(ops.any(mask, axis=-1))  # (batch|1, heads|1, q_len|1)
    rows = ops.transpose(ops.expand_dims(empty, -1), (0, 2, 1, 3))
    mean = ops.mean(ops.cast(value, "float32"), axis=1, keepdims=True)  # (batch, 1, kv, d)
    heads, kv_heads = out.shape[2], value.shape[2]
    if heads != kv_heads:
        mean = ops.repeat(mean, heads // kv_heads, axis=2)
    return ops.where(rows, ops.cast(mean, out.dtype), out)


def reference_attention(
    query, key, value, *, mask=None, bias=None, is_causal=False, scale=None,
    return_weights=False, dropout_rate=0.0, seed_generator=None,
):
    """The plain formula in `keras.ops`, softmax in float32. See `dot_product_attention`."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    query, scale = _float16_scaled_query(query, scale)
    q_len = query.shape[1] if query.shape[1] is not None else ops.shape(query)[1]
    k_len = key.shape[1] if key.shape[1] is not None else ops.shape(key)[1]
    if not (return_weights or dropout_rate > 0) and keras.backend.backend() == "jax":
        # JAX: the products heads-major, normalised after (`_normalized_after`), causal
        # self-attention in query blocks (`causal_query_blocks`).
        blocks = causal_query_blocks(q_len, k_len, is_causal)
        q, k, v = (ops.transpose(x, (0, 2, 1, 3)) for x in (query, key, value))
        if blocks:
            # Query rows [a, e) see keys [0, e) only: each block multiplies just those.
            out = ops.concatenate([_heads_major_attention(
                q[:, :, a:e], k[:, :, :e], v[:, :, :e], _rows_keys(mask, a, e),
                _rows_keys(bias, a, e), True, scale) for a, e in blocks], axis=2)
        else:
            out = _heads_major_attention(q, k, v, mask, bias, is_causal, scale)
        return ops.cast(ops.transpose(out, (0, 2, 1, 3)), query.dtype)
    if (TF_HAND_GRADIENT and not (return_weights or dropout_rate > 0)
            and keras.backend.backend() == "tensorflow"):
        kernels_tf = _backend_kernels()
        if kernels_tf.hand_gradient_applies(query, key, value, bias):
            mask, rows = _mask_and_rows(mask, is_causal, q_len, k_len)
            return kernels_tf.reference_with_gradient(
                query, key, value, mask, bias, scale, rows)
    # (TensorFlow measured the same with JAX's heads-major products and keeps this formula.)
    scores, rows = _masked_scores(_grouped_scores(query, key), mask, bias, is_causal, scale,
                                  q_len, k_len)
    if scores.shape[-1] == 1:
        with warnings.catch_warnings():
            # One key (a one-token sequence, a first decoding step) is a valid attention:
            # Keras warns that a softmax over an axis of size 1 "is likely not what you
            # intended".
            warnings.filterwarnings("ignore", message="You are using a softmax over axis",
                                    category=UserWarning)
            weights = ops.softmax(scores, axis=-1)
    else:
        weights = ops.softmax(scores, axis=-1)
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


def _float16_scaled_query(query, scale):
    """(query, scale) with float16 queries multiplied by a scale below 1 beforehand (the
    scale becomes 1.0); any other query as it is.

    A float16 product stops at 65504: `q . k` over 64 dims of entries ~40 is inf before a
    later scale can shrink it, and the softmax of those scores gave NaN where the formula
    has finite numbers. Scaled first, the queries keep the products in range (the sparse
    kernels do the same). Other dtypes keep the scale on the float32 scores, so their
    results do not change."""
    scale = float(scale)
    if scale < 1.0 and keras.backend.standardize_dtype(query.dtype) == "float16":
        return query * ops.cast(scale, query.dtype), 1.0
    return query, scale


# === Chunked (memory-efficient) kernel ===


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
    if query.shape[1] is None or key.shape[1] is None:
        raise ValueError("chunked attention needs static sequence lengths.")
    # (float16 products past 65504 gave every backend's blocks inf scores and zero outputs)
    query, scale = _float16_scaled_query(query, scale)
    impl = _backend_kernels()
    if impl is None:  # no blocked kernel for this backend: the same numbers, O(n^2) memory
        return reference_attention(query, key, value, mask=mask, bias=bias,
                                   is_causal=is_causal, scale=scale)
    return impl.chunked(query, key, value, mask, bias, is_causal, scale, bq, bk)


# === Fused (backend-native) kernel ===


def fused_attention(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None):
    """The backend's native fused attention. See the module docstring."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    impl = _backend_kernels()
    if impl is None:
        return reference_attention(query, key, value, mask=mask, bias=bias,
                                   is_causal=is_causal, scale=scale)
    return impl.fused(query, key, value, mask, bias, is_causal, scale)


# === Helpers shared with the backend modules ===


def _pad_axis(x, axis, amount, value=0):
    """`x` padded with `amount` trailing `value`s along `axis`, unless that axis is broadcast
    (size 1)."""
    if amount == 0 or x.shape[axis] == 1:
        return x
    widths = [[0, 0]] * len(x.shape)
    widths[axis] = [0, amount]
    return ops.pad(x, widths, constant_values=value)
