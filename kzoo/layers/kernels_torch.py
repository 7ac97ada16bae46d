"""PyTorch's attention kernels: `scaled_dot_product_attention` and the chunked kernel as a
Python loop over query blocks under activation checkpointing. Imported by `kernels` only when
the torch backend runs; the arguments arrive checked and broadcast to 4-D there (see
`kernels.dot_product_attention`).
"""

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from keras import ops

from kzoo.layers.kernels import _NEG, _grouped_output, _grouped_scores
from kzoo.layers.masks import causal_mask


def device():
    """'gpu' when CUDA is available (where keras places new tensors), else 'cpu'."""
    return "gpu" if torch.cuda.is_available() else "cpu"


# === Fused ===


def _all_true(mask):
    """Whether a boolean mask allows everything, asked only where the answer is free: on a
    CPU tensor outside `torch.compile` (on CUDA the question would wait for the device)."""
    if mask.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return bool(mask.all())


# Devices where a padding mask's "no padding?" is asked once per mask tensor (one wait for
# the device, at the start of a forward pass) rather than never (see `no_padding`).
ASKED_ONCE = ("cuda",)
_ANSWER = "_kzoo_no_padding"  # (the tensor's attribute: (its version counter, the answer))


def _capturing(device):
    """Whether a CUDA graph is being captured on `device`'s current stream (no waiting for
    the device is allowed then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def no_padding(padding_mask):
    """Whether `padding_mask` (a model's `(batch, length)` input, the same tensor handed to
    every layer) marks every token: then its layers attend without a mask (a causal layer
    takes SDPA's `is_causal` path). On a CPU tensor the question is free (`_all_true`); on a
    CUDA tensor it waits for the device's queued work, so it is asked once per tensor, by
    the first layer, and remembered on the tensor with its version counter (an in-place
    change asks again). Never asked while torch.compile traces or a CUDA graph is captured,
    nor of a tensor made under `torch.inference_mode` (which keeps no version counter).
    H200, GPT-2 small training in mixed bf16 (8 x 1024 tokens, no padding): the mask cost
    every layer a (q, k) mask built, ANDed and scanned on the host's busy path, and cuDNN's
    masked attention backward, 285 us a layer, where transformers' unmasked one took 148."""
    if not isinstance(padding_mask, torch.Tensor) or padding_mask.dim() != 2:
        return False
    device = padding_mask.device
    if device.type not in ASKED_ONCE:
        return device.type == "cpu" and _all_true(padding_mask)
    if torch.compiler.is_compiling() or _capturing(device) or padding_mask.is_inference():
        return False  # (an inference tensor has no version counter to remember the answer by)
    try:
        version = padding_mask._version
        known = getattr(padding_mask, _ANSWER, None)
        if known is not None and known[0] == version:
            return known[1]
        answer = bool(padding_mask.all())
        setattr(padding_mask, _ANSWER, (version, answer))
    except RuntimeError:  # (a tensor that cannot be asked here, e.g. under torch.func's
        return False      # transforms: the layers keep the mask, as they always could)
    return answer


def fused(query, key, value, mask, bias, is_causal, scale):
    """`F.scaled_dot_product_attention`: boolean masks stay boolean, a causal-only call of
    equal lengths becomes `is_causal`, grouped heads use `enable_gqa`."""
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    q_len, k_len = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if mask is not None and _all_true(mask):
        # A padding mask with no padding (every training batch of full rows): dropping it
        # lets a causal call take SDPA's `is_causal` path, with no (q, k) mask built, ANDed
        # and scanned for empty rows in every layer.
        mask = None
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
            # On CPU -inf: SDPA gives a row without a finite score zeros, as a -inf bias
            # alone (the lowest finite value gave a row blocked by -inf in the bias and by
            # the mask elsewhere the mean of its masked keys' values). Elsewhere the lowest
            # finite value, and `kernels.dot_product_attention` raises a -inf bias to `_NEG`.
            low = float("-inf") if q.device.type == "cpu" else torch.finfo(attn_mask.dtype).min
            attn_mask = attn_mask.masked_fill(~mask, low)
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


def uniform_empty_rows(out, mask, value):
    """`kernels.uniform_empty_rows` in torch ops (the Keras form dispatched five ops a layer,
    at every decode step of a T5 cross-attention: its greedy decode was 5% slower). `out`
    `(batch, q_len, heads, head_dim)`; `mask` boolean, broadcasting to `(batch, heads, q_len,
    k_len)`, or None; `value` `(batch, k_len, kv_heads, head_dim)`.

    Where the answer is free (a CPU tensor outside `torch.compile`) a mask that leaves every
    row a key returns `out` itself: no `where` and no mean of the values, in the forward or
    the backward pass (BERT training on torch, the peers' benchmark: the unconditional form
    cost about 2% of a step, 4 layers).
    """
    if mask is None:
        return out
    mask = mask if mask.dtype == torch.bool else mask.bool()
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    visible = mask.any(-1)  # (b|1, h|1, q|1)
    if _all_true(visible):
        return out
    empty = torch.logical_not(visible).unsqueeze(-1).transpose(1, 2)  # (b|1, q|1, h|1, 1)
    mean = value.float().mean(1, keepdim=True)  # (batch, 1, kv_heads, head_dim)
    if out.shape[2] != value.shape[2]:  # (grouped heads share their key/value head's mean)
        mean = mean.repeat_interleave(out.shape[2] // value.shape[2], dim=2)
    return torch.where(empty, mean.to(out.dtype), out)


# === Chunked ===


def _slice_axis(x, axis, start, stop):
    """Slice `x` along `axis` unless that axis is broadcast (size 1)."""
    if x is None or x.shape[axis] == 1:
        return x
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def chunked(query, key, value, mask, bias, is_causal, scale, bq, bk):
    """The chunked kernel as a Python loop over query blocks, each under activation
    checkpointing (its backward pass recomputes the block), with an online softmax over the
    key blocks inside. Key blocks in a query block's causal future are never visited."""
    q_len, k_len = query.shape[1], key.shape[1]
    offset = k_len - q_len  # bottom-right causal alignment
    out_dtype = query.dtype
    has_mask, has_bias = mask is not None, bias is not None

    def block_fn(q_blk, k_all, v_all, *extras):
        extras = list(extras)
        m_blk = extras.pop(0) if has_mask else None
        b_blk = extras.pop(0) if has_bias else None
        q_start = extras.pop(0)  # static int, bound per block below
        t = q_blk.shape[1]
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
            # (torch.amax: keras' `ops.max` on torch refuses any tensor with a zero-size
            # axis, a batch of 0 rows too, where the other kernels return an empty output.)
            # (clamped at _NEG as the other backends' running maxima start: a row whose scores
            # are all -inf (a -inf bias) then gets zero weights, and zeros, not NaN; a NaN
            # score stays NaN)
            blk_max = torch.amax(s, dim=-1).clamp_min(_NEG)
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
        # (a row that sees no key: zeros; a NaN sum, from a NaN or infinite score, stays
        # NaN as in the reference kernel: `denom > 0` turned it into zeros)
        empty = denom == 0
        out = ops.where(empty, 0.0, acc / ops.where(empty, 1.0, denom))
        return ops.cast(out, out_dtype)

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

        outputs.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
    if len(outputs) == 1:
        return outputs[0]
    return ops.concatenate(outputs, axis=1)
