"""dot_product_attention (every kernel), masks and MultiHeadAttention against NumPy."""

import keras
import numpy as np
import pytest
from keras import ops

from kzoo.layers import (
    attention_kernel,
    causal_mask,
    choose_kernel,
    dot_product_attention,
    merge_masks,
    normalize_mask,
    padding_mask,
    set_attention_kernel,
    sliding_window_mask,
)
from kzoo.layers.attention import MultiHeadAttention
from tests.harness import assert_close, backend, check_layer, ref, roundtrip_layer, to_numpy

KERNEL_NAMES = ["reference", "fused", "chunked"]


# === The NumPy definition every kernel is checked against ===


# softmax(q k^T * scale + bias) v in float64; masked keys excluded; empty rows -> 0;
# GQA: query head i uses kv head i // (h // hk). Written once, in tests/harness.py.
np_attention = ref.attention


def _data(b=2, t=6, s=None, h=4, hk=None, d=8, seed=0):
    r = np.random.default_rng(seed)
    s = s or t
    hk = hk or h
    q = r.normal(size=(b, t, h, d)).astype("float32")
    k = r.normal(size=(b, s, hk, d)).astype("float32")
    v = r.normal(size=(b, s, hk, d)).astype("float32")
    return q, k, v


def _pad(b, s, lengths):
    m = np.zeros((b, s), bool)
    for i, n in enumerate(lengths):
        m[i, :n] = True
    return m


def _cases():
    r = np.random.default_rng(1)
    cases = {}
    cases["no_mask"] = dict(shape=dict(), kw=dict())
    cases["causal"] = dict(shape=dict(), kw=dict(causal=True))
    pad = _pad(2, 6, [6, 3])[:, None, None, :]
    cases["padding"] = dict(shape=dict(), kw=dict(mask=pad))
    cases["causal_padding"] = dict(shape=dict(), kw=dict(mask=pad, causal=True))
    i = np.arange(6)
    window = ((i[:, None] - i[None, :]) >= 0) & ((i[:, None] - i[None, :]) < 3)
    cases["sliding_window"] = dict(shape=dict(), kw=dict(mask=window[None, None]))
    bias = r.normal(size=(1, 4, 6, 6)).astype("float32")
    cases["bias"] = dict(shape=dict(), kw=dict(bias=bias))
    cases["mask_bias"] = dict(shape=dict(), kw=dict(bias=bias, mask=pad, causal=True))
    cases["gqa"] = dict(shape=dict(h=4, hk=2), kw=dict(causal=True))
    cases["mqa"] = dict(shape=dict(h=4, hk=1), kw=dict(mask=pad))
    cross_pad = _pad(2, 9, [9, 4])[:, None, None, :]
    cases["cross"] = dict(shape=dict(t=5, s=9), kw=dict(mask=cross_pad))
    cases["decode_offset"] = dict(shape=dict(t=1, s=7, hk=2), kw=dict(causal=True))
    cases["decode_chunk"] = dict(shape=dict(t=3, s=7), kw=dict(causal=True))
    # More queries than keys: bottom-right alignment leaves the first 3 rows no key at all.
    cases["causal_more_queries"] = dict(shape=dict(t=7, s=4), kw=dict(causal=True))
    # batch == heads: a 3-D mask must never be misread as (heads, q, k).
    bh = r.random((4, 6, 6)) > 0.4
    cases["batch_eq_heads"] = dict(shape=dict(b=4, h=4), kw=dict(mask=bh[:, None]))
    full = np.ones((2, 1, 6, 6), bool)
    full[1, 0, 2:4] = False  # two query rows of example 1 see nothing
    cases["fully_masked_rows"] = dict(shape=dict(), kw=dict(mask=full))
    cases["scale_one"] = dict(shape=dict(), kw=dict(scale=1.0, causal=True))
    # Scales JAX's CPU kernel multiplies into the queries: another float32 one, a power of two.
    cases["scale_custom"] = dict(shape=dict(), kw=dict(scale=0.3, mask=pad))
    cases["scale_power_of_two"] = dict(shape=dict(d=16), kw=dict(causal=True))
    # A padding mask with no padding (torch drops it and takes SDPA's is_causal path).
    no_pad = np.ones((2, 1, 1, 6), bool)
    cases["all_true_padding_causal"] = dict(shape=dict(), kw=dict(mask=no_pad, causal=True))
    cases["all_true_padding_bias"] = dict(shape=dict(), kw=dict(mask=no_pad, bias=bias))
    return cases


CASES = _cases()


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_numpy_forward(kernel, case):
    spec = CASES[case]
    q, k, v = _data(**spec["shape"])
    kw = dict(spec["kw"])
    expected = np_attention(q, k, v, **kw)
    out = dot_product_attention(
        q, k, v, mask=kw.get("mask"), bias=kw.get("bias"), is_causal=kw.get("causal", False),
        scale=kw.get("scale"), kernel=kernel,
    )
    assert tuple(out.shape) == expected.shape
    assert np.isfinite(to_numpy(out)).all()
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_chunked_small_blocks_match_numpy():
    """Several query and key blocks (including ragged last blocks and skipped causal blocks)."""
    from kzoo.layers import chunked_attention

    q, k, v = _data(t=13, s=13, h=4, hk=2)
    pad = _pad(2, 13, [13, 7])[:, None, None, :]
    bias = np.random.default_rng(3).normal(size=(1, 4, 13, 13)).astype("float32")
    for kw in (dict(causal=True), dict(mask=pad, bias=bias, causal=True), dict(mask=pad)):
        expected = np_attention(q, k, v, **kw)
        out = chunked_attention(
            *(ops.convert_to_tensor(x) for x in (q, k, v)),
            mask=None if "mask" not in kw else ops.convert_to_tensor(kw["mask"]),
            bias=None if "bias" not in kw else ops.convert_to_tensor(kw["bias"]),
            is_causal=kw.get("causal", False), query_block_size=4, key_block_size=3,
        )
        assert_close(out, expected)


@pytest.mark.spread
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_small_blocks_gradients_match_reference(monkeypatch, causal):
    """Backward pass over many blocks, with key blocks that trailing padding hides in every
    row (skipped by the chunked kernel) and, with `causal`, blocks in the future."""
    from kzoo.layers import kernels

    monkeypatch.setattr(kernels, "DEFAULT_BLOCK_SIZE", 3)
    q, k, v = _data(t=13, s=13, h=4, hk=2)
    kw = dict(mask=_pad(2, 13, [7, 5])[:, None, None, :], causal=causal)
    ref = _grad_fn("reference", kw)(q, k, v, None)
    got = _grad_fn("chunked", kw)(q, k, v, None)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)
    out = dot_product_attention(q, k, v, mask=kw["mask"], is_causal=causal, kernel="chunked")
    assert_close(out, np_attention(q, k, v, **kw))


def _multi_block_cases():
    """Cases for the chunked kernel with blocks of 3: ragged last blocks, tiles a mask hides
    before the first visible key (sliding window), broadcast and full biases (their
    gradients too), grouped heads, cross-attention with a causal offset, empty rows."""
    r = np.random.default_rng(7)
    i = np.arange(13)
    window = ((i[:, None] - i[None, :]) >= 0) & ((i[:, None] - i[None, :]) < 4)
    empty = np.ones((2, 1, 13, 13), bool)
    empty[0, 0, 4:9] = False  # rows 4..8 of example 0 see no key
    pad = _pad(2, 13, [13, 6])[:, None, None, :]
    return {
        "full_bias_mask_causal": (dict(t=13, h=4, hk=2), dict(
            mask=pad, causal=True, bias=r.normal(size=(2, 4, 13, 13)).astype("float32"))),
        "key_bias_broadcast": (dict(t=13, h=4), dict(
            bias=r.normal(size=(1, 4, 1, 13)).astype("float32"))),
        "head_bias_broadcast": (dict(t=13, h=4, hk=1), dict(
            causal=True, bias=r.normal(size=(1, 4, 13, 13)).astype("float32"))),
        "sliding_window": (dict(t=13, h=4), dict(mask=window[None, None])),
        "cross_causal_offset": (dict(t=5, s=13, h=4, hk=2), dict(causal=True)),
        "more_queries_than_keys": (dict(t=13, s=7, h=2), dict(causal=True)),
        "fully_masked_rows": (dict(t=13, h=2), dict(mask=empty)),
    }


MULTI_BLOCK_CASES = _multi_block_cases()


@pytest.mark.spread
@pytest.mark.parametrize("case", sorted(MULTI_BLOCK_CASES))
def test_chunked_multi_block_forward_and_gradients(monkeypatch, case):
    from kzoo.layers import kernels

    monkeypatch.setattr(kernels, "DEFAULT_BLOCK_SIZE", 3)
    shape, kw = MULTI_BLOCK_CASES[case]
    q, k, v = _data(**shape)
    out = dot_product_attention(q, k, v, mask=kw.get("mask"), bias=kw.get("bias"),
                                is_causal=kw.get("causal", False), kernel="chunked")
    assert_close(out, np_attention(q, k, v, **kw))
    ref = _grad_fn("reference", kw)(q, k, v, kw.get("bias"))
    got = _grad_fn("chunked", kw)(q, k, v, kw.get("bias"))
    assert len(ref) == len(got) == (4 if "bias" in kw else 3)
    for r, g in zip(ref, got):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)


def test_eager_chunked_kernel_compiles_once_per_shape():
    """Called eagerly (outside any jit), the chunked kernel gives the reference's output on
    every call, and on JAX compiles on its first call only: the next call with the same shapes
    reuses that program (its `lax.scan`s used to be traced afresh, and so compiled again,
    ~0.5 s, on every call)."""
    q, k, v = _data(b=2, t=10, h=2, d=4)
    mask = _pad(2, 10, [10, 6])[:, None, None, :]

    def call():
        return to_numpy(dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                              kernel="chunked"))

    first = call()
    compiles = []
    if backend() == "jax":
        import jax

        def listen(event, duration, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                compiles.append(kwargs.get("fun_name"))

        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            again = call()
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    else:
        again = call()
    assert compiles == [], compiles
    np.testing.assert_array_equal(again, first)
    assert_close(first, ref.attention(q, k, v, mask=mask, causal=True), atol=1e-5)


def test_chunked_never_holds_a_score_matrix():
    """The chunked forward and backward hold (block x block) tiles, never (q_len x k_len):
    checked on what the backend keeps or compiles (XLA's optimised HLO on JAX and
    TensorFlow; the tensors autograd saves on torch), with the reference as a control."""
    from kzoo.layers import kernels

    t, blk = 64, 16
    q, k, v = _data(b=1, t=t, h=2, d=8)
    mask = _pad(1, t, [50])[:, None, None, :]
    b = backend()

    def loss(kernel):
        def f(q, k, v):
            return ops.sum(dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                                 kernel=kernel))
        return f

    def holds_square(kernel):
        if b == "jax":
            import jax

            text = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2))).lower(q, k, v)
            text = text.compile().as_text()
            return f",{t},{t}]" in text
        if b == "tensorflow":
            import tensorflow as tf

            @tf.function(jit_compile=True)
            def g(q, k, v):
                with tf.GradientTape() as tape:
                    tape.watch([q, k, v])
                    y = loss(kernel)(q, k, v)
                return tape.gradient(y, [q, k, v])

            text = g.experimental_get_compiler_ir(q, k, v)(stage="optimized_hlo")
            return f",{t},{t}]" in text
        import torch

        shapes = []

        def pack(x):
            shapes.append(tuple(x.shape))
            return x

        ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            y = loss(kernel)(*ts)
        y.backward()
        return any(s[-2:] == (t, t) for s in shapes)

    old = kernels.DEFAULT_BLOCK_SIZE
    kernels.DEFAULT_BLOCK_SIZE = blk
    try:
        assert holds_square("reference")  # the control: the check can see a score matrix
        assert not holds_square("chunked")
    finally:
        kernels.DEFAULT_BLOCK_SIZE = old


def _grad_fn(kernel, kw):
    """Gradient of sum(out * w) with respect to q, k, v (and the bias) via the backend."""
    b = backend()
    mask, bias = kw.get("mask"), kw.get("bias")
    causal = kw.get("causal", False)

    def f(q, k, v, bias_t):
        out = dot_product_attention(q, k, v, mask=mask, bias=bias_t, is_causal=causal,
                                    kernel=kernel)
        w = ops.cast(ops.reshape(ops.arange(ops.size(out)), out.shape) % 7, "float32") - 3.0
        return ops.sum(out * w)

    def grads(q, k, v, bias_np):
        if b == "jax":
            import jax

            args = [q, k, v, bias_np]
            argnums = (0, 1, 2, 3) if bias_np is not None else (0, 1, 2)
            g = jax.grad(f, argnums=argnums)(*args)
            return [np.asarray(x) for x in g]
        if b == "torch":
            import torch

            ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
            bt = torch.tensor(bias_np, requires_grad=True) if bias_np is not None else None
            f(*ts, bt).backward()
            out = [t.grad.numpy() for t in ts]
            return out + ([bt.grad.numpy()] if bt is not None else [])
        import tensorflow as tf

        ts = [tf.Variable(x) for x in (q, k, v)]
        bt = tf.Variable(bias_np) if bias_np is not None else None
        with tf.GradientTape() as tape:
            loss = f(*ts, bt)
        g = tape.gradient(loss, ts + ([bt] if bt is not None else []))
        return [x.numpy() for x in g]

    return grads


@pytest.mark.parametrize("kernel", ["fused", "chunked"])
@pytest.mark.parametrize(
    "case", ["causal", "causal_padding", "mask_bias", "gqa", "cross", "decode_offset",
             "fully_masked_rows"]
)
def test_kernel_gradients_match_reference(kernel, case):
    spec = CASES[case]
    q, k, v = _data(**spec["shape"])
    kw = spec["kw"]
    bias = kw.get("bias")
    ref = _grad_fn("reference", kw)(q, k, v, bias)
    got = _grad_fn(kernel, kw)(q, k, v, bias)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)


def _np_attention_grads(q, k, v, w, mask=None, bias=None, causal=False):
    """Gradients of sum(attention(q, k, v) * w) in float64 with respect to q, k, v and the
    bias (summed to its shape): the softmax's backward written out (dV = P^T dO,
    dS = P * (dO V^T - rowsum(dO V^T * P)), dQ = scale dS K, dK = scale dS^T Q)."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    b, t, h, d = q.shape
    s_len, hk = k.shape[1], k.shape[2]
    kr, vr = (np.repeat(x, h // hk, axis=2) for x in (k, v))
    scale = 1.0 / np.sqrt(d)
    scores = np.einsum("bthd,bshd->bhts", q, kr) * scale + (0.0 if bias is None else bias)
    allowed = np.ones(scores.shape, bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask, scores.shape)
    if causal:
        allowed &= np.arange(s_len)[None, :] <= np.arange(t)[:, None] + (s_len - t)
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    dv = np.einsum("bhts,bthd->bshd", p, w)
    dp = np.einsum("bthd,bshd->bhts", w, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, kr) * scale
    dk = np.einsum("bhts,bthd->bshd", ds, q) * scale
    group = lambda x: x.reshape(b, s_len, hk, h // hk, d).sum(3)  # noqa: E731
    grads = [dq, group(dk), group(dv)]
    if bias is not None:
        axes = tuple(i for i, n in enumerate(bias.shape) if n == 1)
        grads.append(ds.sum(axis=axes, keepdims=True))
    return grads


@pytest.mark.parametrize("case", ["causal", "padding_bias_gqa", "empty_rows"])
def test_reference_causal_query_blocks_match_numpy(monkeypatch, case):
    """Causal self-attention split into query blocks (JAX's reference kernel; 13 positions
    in blocks of 4, 4 and 5 rows here) gives the NumPy formula's outputs and gradients; on
    the other backends the same checks run on the whole product."""
    from kzoo.layers import kernels

    monkeypatch.setattr(kernels, "CAUSAL_BLOCK_ROWS", 4)
    assert kernels.causal_query_blocks(13, 13, True, backend="jax") == [(0, 4), (4, 8),
                                                                      (8, 13)]
    assert kernels.causal_query_blocks(13, 13, False, backend="jax") is None
    assert kernels.causal_query_blocks(6, 13, True, backend="jax") is None  # not square
    assert kernels.causal_query_blocks(13, 13, True, backend="torch") is None
    r = np.random.default_rng(11)
    if case == "causal":
        q, k, v = _data(t=13, h=4, d=8)
        kw = dict(causal=True)
    elif case == "padding_bias_gqa":
        q, k, v = _data(t=13, h=4, hk=2, d=8)
        kw = dict(causal=True, mask=_pad(2, 13, [13, 6])[:, None, None, :],
                  bias=r.normal(size=(1, 4, 13, 13)).astype("float32"))
    else:  # rows whose only visible keys are masked: zeros, zero gradients
        q, k, v = _data(t=13, h=4, d=8)
        mask = np.ones((2, 1, 13, 13), bool)
        mask[1, 0, 9:11, :] = False
        kw = dict(causal=True, mask=mask)
    expected = np_attention(q, k, v, **kw)
    out = dot_product_attention(q, k, v, mask=kw.get("mask"), bias=kw.get("bias"),
                                is_causal=True, kernel="reference")
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    w = (np.arange(expected.size).reshape(expected.shape) % 7 - 3.0).astype("float32")
    got = _grad_fn("reference", kw)(q, k, v, kw.get("bias"))
    want = _np_attention_grads(q, k, v, w, kw.get("mask"), kw.get("bias"), True)
    assert len(got) == len(want)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("additive", [False, True])
def test_masked_scores_select_and_additive_forms_match_numpy(additive):
    """`_masked_scores` with the mask selected into the scores or added as a 0 / -1e30 bias
    (JAX's heads-major kernel adds it, -1e30 to -2e30): after a softmax both give NumPy's
    masked softmax, scores up to 1e4 and a bias included; rows without a visible key are
    flagged."""
    from kzoo.layers import kernels

    r = np.random.default_rng(5)
    scores = (r.normal(size=(2, 3, 5, 7)) * np.array([1.0, 100.0, 1e4])[None, :, None, None]
              ).astype("float32")
    bias = r.normal(size=(1, 3, 5, 7)).astype("float32")
    mask = r.random((2, 1, 5, 7)) > 0.4
    mask[1, 0, 2] = False  # a row with no visible key
    mask[0, 0, 0] = [False] * 6 + [True]  # one visible key
    got, rows = kernels._masked_scores(ops.convert_to_tensor(scores), ops.convert_to_tensor(mask),
                                       ops.convert_to_tensor(bias), False, 0.5, 5, 7,
                                       additive=additive)
    weights = to_numpy(ops.softmax(got, axis=-1)).astype("float64")
    s = scores.astype("float64") * 0.5 + bias
    s = np.where(mask, s, -np.inf)
    visible = mask.any(-1, keepdims=True)
    e = np.exp(s - np.where(visible, s.max(-1, keepdims=True), 0.0))
    want = np.where(visible, e / np.where(visible, e.sum(-1, keepdims=True), 1.0), 0.0)
    np.testing.assert_array_equal(to_numpy(rows), np.broadcast_to(visible, (2, 1, 5, 1)))
    np.testing.assert_allclose(np.where(visible, weights, 0.0), want, atol=1e-6, rtol=1e-5)
    masked_scores = to_numpy(got)[np.broadcast_to(~mask, got.shape)]
    if not additive:
        np.testing.assert_array_equal(masked_scores, np.float32(-1e30))
        return
    # Added: exactly the call's own constant, -1e30 to -2e30 (`DISTINCT_MASK_BIAS`), one per
    # call, so that XLA cannot merge the biases of two layers.
    np.testing.assert_array_equal(masked_scores, masked_scores[0])
    assert -2e30 <= masked_scores[0] <= -1e30
    again, _ = kernels._masked_scores(ops.convert_to_tensor(scores), ops.convert_to_tensor(mask),
                                      None, False, 0.5, 5, 7, additive=True)
    assert to_numpy(again)[np.broadcast_to(~mask, got.shape)][0] != masked_scores[0]


def test_reference_gradient_matches_finite_differences():
    """The reference kernel's gradient against central differences of the NumPy formula."""
    q, k, v = _data(b=1, t=3, h=2, d=4)
    w = np.random.default_rng(5).normal(size=(1, 3, 2, 4))
    mask = _pad(1, 3, [2])[:, None, None, :]

    def loss_np(qq):
        return float((np_attention(qq, k, v, mask=mask, causal=True) * w).sum())

    eps = 1e-5
    num = np.zeros_like(q, dtype=np.float64)
    it = np.nditer(q, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        qp = q.astype(np.float64).copy()
        qm = qp.copy()
        qp[idx] += eps
        qm[idx] -= eps
        num[idx] = (loss_np(qp) - loss_np(qm)) / (2 * eps)

    kw = dict(mask=mask, causal=True)
    b = backend()
    wt = w.astype("float32")
    if b == "jax":
        import jax

        g = jax.grad(lambda qq: ops.sum(dot_product_attention(
            qq, k, v, mask=mask, is_causal=True, kernel="reference") * wt))(q)
        g = np.asarray(g)
    elif b == "torch":
        import torch

        qt = torch.tensor(q, requires_grad=True)
        ops.sum(dot_product_attention(qt, k, v, mask=mask, is_causal=True,
                                      kernel="reference") * torch.tensor(wt)).backward()
        g = qt.grad.numpy()
    else:
        import tensorflow as tf

        qt = tf.Variable(q)
        with tf.GradientTape() as tape:
            loss = ops.sum(dot_product_attention(qt, k, v, **{"mask": kw["mask"]},
                                                 is_causal=True, kernel="reference") * wt)
        g = tape.gradient(loss, qt).numpy()
    np.testing.assert_allclose(g, num, atol=2e-4, rtol=2e-3)


GRAD_CASES = {  # (t, s, h, hk, mask, bias, causal); masks (1, 1, t or 1, s)
    "mask_bias": (4, 4, 2, 2, np.array([True, True, True, False])[None, None, None], True,
                  True),
    "gqa": (4, 4, 4, 2, None, False, True),
    "fully_masked_rows": (3, 4, 2, 2, np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]],
                                               bool)[None, None], False, False),
    "cross": (3, 5, 2, 1, np.array([True] * 4 + [False])[None, None, None], True, False),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_reference_gradients_of_every_input_match_finite_differences(case):
    """d(sum(out * w)) / d(q, k, v, bias) of the reference kernel (on JAX its heads-major,
    normalised-after form) against central differences of the NumPy formula, float64."""
    t, s, h, hk, mask, has_bias, causal = GRAD_CASES[case]
    q, k, v = _data(b=1, t=t, s=s, h=h, hk=hk, d=4, seed=7)
    r = np.random.default_rng(8)
    w = r.normal(size=q.shape)
    args = [q.astype("float64"), k.astype("float64"), v.astype("float64")]
    if has_bias:
        args.append(r.normal(size=(1, h, t, s)))

    def loss_np(*xs):
        out = np_attention(xs[0], xs[1], xs[2], mask=mask, causal=causal,
                           bias=xs[3] if len(xs) > 3 else None)
        return float((out * w).sum())

    expected = []
    for i, x in enumerate(args):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[i][idx] += 1e-6
            minus[i][idx] -= 1e-6
            num[idx] = (loss_np(*plus) - loss_np(*minus)) / 2e-6
        expected.append(num)

    def loss(*xs):
        out = dot_product_attention(xs[0], xs[1], xs[2], mask=mask, is_causal=causal,
                                    bias=xs[3] if len(xs) > 3 else None, kernel="reference")
        return ops.sum(out * ops.convert_to_tensor(w.astype("float32")))

    inputs = [a.astype("float32") for a in args]
    b = backend()
    if b == "jax":
        import jax

        grads = jax.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    elif b == "torch":
        import torch

        ts = [torch.tensor(a, requires_grad=True) for a in inputs]
        loss(*ts).backward()
        grads = [t_.grad for t_ in ts]
    else:
        import tensorflow as tf

        ts = [tf.Variable(a) for a in inputs]
        with tf.GradientTape() as tape:
            value = loss(*ts)
        grads = tape.gradient(value, ts)
    for name, g, want in zip("qkvb", grads, expected):
        np.testing.assert_allclose(to_numpy(g), want, atol=2e-4, rtol=2e-3, err_msg=name)


def test_bfloat16_kernels_close_to_float32():
    """bfloat16 operands, head widths 8 (scale 1/sqrt(8): JAX's CPU kernel scales the float32
    scores) and 16 (scale 1/4, a power of two: it scales the bfloat16 queries, exactly)."""
    for d in (8, 16):
        q, k, v = _data(t=16, s=16, d=d)
        expected = np_attention(q, k, v, causal=True)
        for kernel in KERNEL_NAMES:
            qb, kb, vb = (ops.cast(x, "bfloat16") for x in (q, k, v))
            out = dot_product_attention(qb, kb, vb, is_causal=True, kernel=kernel)
            assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
            assert_close(ops.cast(out, "float32"), expected, atol=2e-2, rtol=2e-2)


def test_return_weights_are_probabilities():
    q, k, v = _data()
    pad = _pad(2, 6, [6, 3])[:, None, None, :]
    out, w = dot_product_attention(q, k, v, mask=pad, is_causal=True, return_weights=True)
    w = to_numpy(w)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert (w[1, :, :, 3:] == 0).all()  # padded keys get no weight
    assert (np.triu(w[0, 0], 1) == 0).all()  # no weight on the future


@pytest.mark.parametrize("kernel", ["auto"] + KERNEL_NAMES)
def test_minus_infinity_in_the_bias_blocks_keys_and_whole_rows(kernel):
    # The refusal of float masks asks for an additive mask in `bias` (-inf not to attend):
    # a row blocked entirely gave NaN on the reference and fused kernels of JAX and
    # TensorFlow (the softmax's max -inf) and zeros on the chunked kernel and torch's SDPA.
    q, k, v = _data(b=2, t=5, s=7, h=2)
    r = np.random.default_rng(1)
    bias = r.normal(size=(2, 2, 5, 7)).astype("float32")
    bias[:, :, :, 5:] = -np.inf  # the last two keys of every row blocked
    bias[0, 1, 2, :] = -np.inf  # one (batch, head, query) row blocked entirely
    bias[1, :, 4, :] = -np.inf
    # NumPy: softmax over the keys with a finite bias; a row without one gives zeros
    scores = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k.astype(np.float64))
    scores = scores / np.sqrt(q.shape[-1]) + bias
    open_keys = np.isfinite(bias)
    e = np.where(open_keys, np.exp(scores - np.where(open_keys, scores, -1e300).max(
        -1, keepdims=True)), 0.0)
    total = e.sum(-1, keepdims=True)
    weights = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    expected = np.einsum("bhts,bshd->bthd", weights, v.astype(np.float64))
    out = to_numpy(dot_product_attention(q, k, v, bias=bias, kernel=kernel))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert (out[0, 2, 1] == 0).all() and (out[1, 4] == 0).all()
    if kernel in ("auto", "reference"):
        out, w = dot_product_attention(q, k, v, bias=bias, kernel=kernel, return_weights=True)
        np.testing.assert_allclose(to_numpy(w), weights, atol=1e-6)
    with_mask = dot_product_attention(q, k, v, bias=bias, mask=open_keys[:1, :1, :1],
                                      is_causal=False, kernel=kernel)
    np.testing.assert_allclose(to_numpy(with_mask), expected, atol=1e-5, rtol=1e-5)


# === Errors ===


def test_bad_inputs_raise_value_error():
    q, k, v = _data()
    with pytest.raises(ValueError, match="rank 4"):
        dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        dot_product_attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="does not broadcast"):
        dot_product_attention(q, k, v, mask=np.ones((2, 1, 5, 6), bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        dot_product_attention(q, k, v, bias=np.ones((3, 4, 6, 6), "float32"))
    with pytest.raises(ValueError, match="kernel"):
        dot_product_attention(q, k, v, kernel="flash9")
    with pytest.raises(ValueError, match="head_dim"):
        dot_product_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="return_weights"):
        dot_product_attention(q, k, v, kernel="fused", return_weights=True)
    # Arguments some kernels took in silence and others failed on deep inside (an audit)
    for kernel in ("reference", "fused", "chunked"):
        with pytest.raises(ValueError, match="`value` must have the head_dim of `key`"):
            dot_product_attention(q, k, np.concatenate([v, v], -1), kernel=kernel)
        with pytest.raises(ValueError, match="`is_causal` must be True or False"):
            dot_product_attention(q, k, v, is_causal="no", kernel=kernel)
        for rate in (1.5, -0.5, 1.0):
            with pytest.raises(ValueError, match=r"`dropout_rate` must be a number in \[0, 1\)"):
                dot_product_attention(q, k, v, dropout_rate=rate, kernel=kernel)
        for scale in (float("nan"), float("inf"), "0.5", True):
            with pytest.raises(ValueError, match="`scale` must be a finite number or None"):
                dot_product_attention(q, k, v, scale=scale, kernel=kernel)
        with pytest.raises(ValueError, match="`key` has no positions"):
            dot_product_attention(q, k[:, :0], v[:, :0], kernel=kernel)
    # a NumPy scale is a number like any other
    np.testing.assert_allclose(
        to_numpy(dot_product_attention(q, k, v, scale=np.float32(0.5))),
        to_numpy(dot_product_attention(q, k, v, scale=0.5)), rtol=0, atol=0)


# === Masks ===


def test_mask_helpers_against_numpy():
    c = to_numpy(causal_mask(3, 5))
    assert c.shape == (1, 1, 3, 5)
    np.testing.assert_array_equal(c[0, 0], np.tril(np.ones((3, 5), bool), 2))
    c0 = to_numpy(causal_mask(2, 6, offset=1))  # queries at positions 1, 2
    np.testing.assert_array_equal(c0[0, 0], np.arange(6)[None, :] <= np.array([[1], [2]]))
    sw = to_numpy(sliding_window_mask(5, window=2))[0, 0]
    i = np.arange(5)
    np.testing.assert_array_equal(sw, (i[:, None] - i[None] >= 0) & (i[:, None] - i[None] < 2))
    swb = to_numpy(sliding_window_mask(5, window=2, causal=False))[0, 0]
    np.testing.assert_array_equal(swb, np.abs(i[:, None] - i[None]) < 2)
    p = to_numpy(padding_mask(np.array([[1, 1, 0]])))
    assert p.shape == (1, 1, 1, 3) and p.dtype == bool
    m = to_numpy(merge_masks(None, causal_mask(3), padding_mask(np.array([[1, 1, 0]]))))
    np.testing.assert_array_equal(m[0, 0], np.tril(np.ones((3, 3), bool)) & [True, True, False])
    assert merge_masks(None, None) is None
    # masks that do not broadcast together are refused by name (the backends' errors named
    # no mask), at any position among the arguments
    with pytest.raises(ValueError, match=r"masks\[2\] \(1, 1, 1, 4\).*axis 3 sizes \[3, 4\]"):
        merge_masks(causal_mask(3), None, padding_mask(np.array([[1, 1, 1, 0]])))
    with pytest.raises(ValueError, match=r"axis 0 sizes \[2, 3\]"):
        merge_masks(np.ones((2, 4, 4), bool), np.ones((3, 4), bool))
    assert to_numpy(normalize_mask(np.ones((2, 3, 4)))).shape == (2, 1, 3, 4)
    with pytest.raises(ValueError, match="rank"):
        normalize_mask(np.ones((2,)))
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(4, window=0)
    # lengths: -1 gave an empty mask on JAX and errors inside torch / TensorFlow
    for bad, kwargs in (((-1,), {}), ((2.5,), {}), ((3, -2), {}), ((True,), {})):
        with pytest.raises(ValueError, match=r"_length` must be an integer >= 0; got"):
            causal_mask(*bad, **kwargs)
    with pytest.raises(ValueError, match=r"`query_length` must be an integer >= 0; got "
                                         r"query_length=-2"):
        sliding_window_mask(-2, window=2)
    with pytest.raises(ValueError, match="must be boolean.*float32.*`bias`"):
        padding_mask(np.array([[0.0, 0.0, -1e9]], "float32"))  # (read backwards as a bool)


# === Dispatch ===


def test_choose_kernel_decisions_for_accelerators():
    base = dict(query_length=1024, key_length=1024, head_dim=64)
    # torch: SDPA everywhere (flash / memory-efficient on CUDA, flash on CPU).
    assert choose_kernel(backend="torch", device="gpu", dtype="bfloat16", **base) == "fused"
    assert choose_kernel(backend="torch", device="cpu", dtype="float32", **base) == "fused"
    # JAX: cuDNN for half precision on CUDA, with masks and biases.
    for mk in ("none", "causal", "general"):
        assert choose_kernel(backend="jax", device="gpu", dtype="bfloat16", mask_kind=mk,
                             **base) == "fused"
    assert choose_kernel(backend="jax", device="gpu", dtype="float16", has_bias=True,
                         **base) == "fused"
    # cuDNN needs head_dim <= 128 and a multiple of 8; float32 does not go to cuDNN.
    assert choose_kernel(backend="jax", device="gpu", dtype="bfloat16", query_length=8,
                         key_length=8, head_dim=256) == "reference"
    assert choose_kernel(backend="jax", device="gpu", dtype="float32", **base) == "chunked"
    assert choose_kernel(backend="jax", device="tpu", dtype="bfloat16", **base) == "fused"
    # CPU: short sequences on the einsum reference, long ones chunked.
    assert choose_kernel(backend="jax", device="cpu", dtype="float32", query_length=512,
                         key_length=512, head_dim=64) == "reference"
    assert choose_kernel(backend="jax", device="cpu", dtype="float32", query_length=8192,
                         key_length=8192, head_dim=64) == "chunked"
    # TensorFlow: the chunked XLA while loops from 512 keys, whatever the mask or device.
    tf_cases = [  # (device, dtype, length, mask_kind, has_bias) -> kernel
        (("cpu", "float32", 8192, "causal", False), "chunked"),
        (("cpu", "float32", 8192, "general", False), "chunked"),
        (("cpu", "float32", 2048, "causal", False), "chunked"),
        (("cpu", "float32", 2048, "none", False), "chunked"),
        (("cpu", "float32", 512, "general", False), "chunked"),
        (("cpu", "float32", 256, "causal", False), "reference"),
        (("gpu", "bfloat16", 8192, "none", True), "chunked"),
    ]
    for (device, dtype, length, mask_kind, has_bias), want in tf_cases:
        got = choose_kernel(backend="tensorflow", device=device, dtype=dtype,
                            query_length=length, key_length=length, head_dim=64,
                            mask_kind=mask_kind, has_bias=has_bias)
        assert got == want, (device, dtype, length, mask_kind, has_bias, got)
    assert choose_kernel(backend="tensorflow", device="gpu", dtype="float32",
                         query_length=128, key_length=128, head_dim=64) == "fused"
    # Decoding one token never chunks.
    assert choose_kernel(backend="jax", device="cpu", dtype="float32", query_length=1,
                         key_length=8192, head_dim=64) == "reference"
    # Weights or dropout force the reference kernel.
    assert choose_kernel(backend="torch", device="gpu", dtype="bfloat16", needs_weights=True,
                         **base) == "reference"
    assert choose_kernel(backend="jax", device="tpu", dtype="bfloat16", dropout=True,
                         **base) == "reference"
    with pytest.raises(ValueError, match="device"):
        choose_kernel(backend="jax", device="npu", dtype="float32", **base)


def test_override_setter_and_environment(monkeypatch):
    q, k, v = _data()
    try:
        set_attention_kernel("chunked")
        assert attention_kernel(q, k) == "chunked"
        assert attention_kernel(q, k, kernel="fused") == "fused"  # explicit wins
    finally:
        set_attention_kernel(None)
    monkeypatch.setenv("KZOO_ATTENTION_KERNEL", "reference")
    assert attention_kernel(q, k) == "reference"
    monkeypatch.delenv("KZOO_ATTENTION_KERNEL")
    automatic = attention_kernel(q, k)
    forced = "chunked" if automatic != "chunked" else "reference"
    monkeypatch.setenv("KZOO_ATTENTION_KERNEL", forced)
    try:  # "auto" in code wins over the environment; None gives the environment back
        set_attention_kernel("auto")
        assert attention_kernel(q, k) == automatic
    finally:
        set_attention_kernel(None)
    assert attention_kernel(q, k) == forced
    monkeypatch.setenv("KZOO_ATTENTION_KERNEL", "bogus")
    with pytest.raises(ValueError, match="KZOO_ATTENTION_KERNEL"):
        attention_kernel(q, k)
    with pytest.raises(ValueError, match="kernel"):
        set_attention_kernel("bogus")


# === MultiHeadAttention ===


def _np_mha(layer, x, value=None, mask=None, bias=None, causal=False):
    """MultiHeadAttention written out in NumPy from the layer's weights."""
    value = x if value is None else value
    h, d = layer.num_heads, layer._head_dim
    hk = layer._kv_heads

    def dense(dl, inp):
        return ref.apply_dense(dl, inp)

    b, t, _ = x.shape
    s = value.shape[1]
    q = dense(layer.query_dense, x).reshape(b, t, h, d)
    k = dense(layer.key_dense, value).reshape(b, s, hk, d)
    v = dense(layer.value_dense, value).reshape(b, s, hk, d)
    o = np_attention(q, k, v, mask=mask, bias=bias, causal=causal, scale=layer.scale)
    return dense(layer.output_dense, o.reshape(b, t, h * d))


def test_mha_self_and_cross_against_numpy():
    r = np.random.default_rng(0)
    x = r.normal(size=(2, 5, 16)).astype("float32")
    enc = r.normal(size=(2, 7, 12)).astype("float32")
    pad = _pad(2, 5, [5, 3])
    layer = MultiHeadAttention(num_heads=4, num_kv_heads=2)
    out = layer(x, attention_mask=pad, use_causal_mask=True)
    assert_close(out, _np_mha(layer, x, mask=pad[:, None, None, :], causal=True), atol=2e-5)
    cross = MultiHeadAttention(num_heads=2, head_dim=5, use_bias=False, scale=1.0)
    enc_pad = _pad(2, 7, [7, 2])
    out = cross(x, value=enc, attention_mask=enc_pad)
    assert tuple(out.shape) == (2, 5, 16)
    assert_close(out, _np_mha(cross, x, enc, mask=enc_pad[:, None, None, :]), atol=2e-5)
    bias = r.normal(size=(1, 2, 5, 7)).astype("float32")
    out = cross(x, value=enc, attention_bias=bias)
    assert_close(out, _np_mha(cross, x, enc, bias=bias), atol=2e-5)


def test_mha_rotary_matches_numpy_rotate_half():
    r = np.random.default_rng(0)
    x = r.normal(size=(1, 6, 8)).astype("float32")
    layer = MultiHeadAttention(num_heads=2, rope_max_wavelength=10000)
    out = to_numpy(layer(x, use_causal_mask=True))
    h, d = 2, 4

    def rope(t):  # rotate-half convention, positions 0..5
        return ref.rope(t, base=10000)

    q, k, v = (ref.apply_dense(dl, x).reshape(1, 6, h, d)
               for dl in (layer.query_dense, layer.key_dense, layer.value_dense))
    o = np_attention(rope(q), rope(k), v, causal=True).reshape(1, 6, h * d)
    expected = ref.apply_dense(layer.output_dense, o)
    np.testing.assert_allclose(out, expected, atol=2e-5)


@pytest.mark.parametrize("kwargs", [dict(num_heads=4, num_kv_heads=2),
                                    dict(num_heads=2, head_dim=5, use_bias=False, scale=1.0)])
def test_mha_layer_harness(kwargs):
    """Build, call (causal self-attention), NumPy reference, config / serialization round
    trip and mixed precision, through the shared check_layer."""
    check_layer(MultiHeadAttention, kwargs, input_shape=(2, 5, 16),
                expected_output_shape=(2, 5, 16), call_kwargs=dict(use_causal_mask=True),
                reference=lambda layer, x: _np_mha(layer, x, causal=True), atol=2e-5)


@pytest.mark.parametrize("form", ["stacked", "pair"])
def test_mha_cache_decoding_equals_full_pass(form):
    r = np.random.default_rng(0)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    layer = MultiHeadAttention(num_heads=4, num_kv_heads=2, rope_max_wavelength=10000)
    full = to_numpy(layer(x, use_causal_mask=True))
    if form == "stacked":
        cache = ops.zeros((2, 2, 2, 6, 4))  # (batch, k/v, kv_heads, length, head_dim)
    else:  # (keys, values), each (batch, kv_heads, length, head_dim)
        cache = (ops.zeros((2, 2, 6, 4)), ops.zeros((2, 2, 6, 4)))
    # Prefill 4 tokens, then decode two one at a time.
    out, cache = layer(x[:, :4], use_causal_mask=True, cache=cache, cache_index=0)
    steps = [to_numpy(out)]
    for i in (4, 5):
        out, cache = layer(x[:, i:i + 1], use_causal_mask=True, cache=cache, cache_index=i)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5)
    # The cache comes back in the form it was given, holding the projected keys/values.
    keys, values = layer.project_key_value(x)
    if form == "pair":
        assert isinstance(cache, tuple) and len(cache) == 2
        got_keys, got_values = to_numpy(cache[0]), to_numpy(cache[1])
    else:
        assert tuple(cache.shape) == (2, 2, 2, 6, 4)
        got_keys, got_values = to_numpy(cache[:, 0]), to_numpy(cache[:, 1])
    np.testing.assert_allclose(got_values, to_numpy(values).transpose(0, 2, 1, 3), atol=1e-6)
    assert got_keys.shape == (2, 2, 6, 4)  # (rotated keys: compared through `full` above)


def test_mha_returns_weights_and_validates():
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    layer = MultiHeadAttention(num_heads=4)
    out, w = layer(x, use_causal_mask=True, return_attention_weights=True)
    assert tuple(w.shape) == (2, 4, 5, 5)
    np.testing.assert_allclose(to_numpy(w).sum(-1), 1.0, atol=1e-6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadAttention(num_heads=0)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(num_heads=2, dropout=1.5)
    with pytest.raises(ValueError, match="must divide the hidden size"):
        MultiHeadAttention(num_heads=3)(x)
    with pytest.raises(ValueError, match="attention_mask"):
        MultiHeadAttention(num_heads=4)(x, attention_mask=np.ones((2,), bool))
    with pytest.raises(ValueError, match="rank 3"):
        MultiHeadAttention(num_heads=4)(x[0])


def test_mha_serialization_and_keras_file(tmp_path):
    layer = MultiHeadAttention(num_heads=4, num_kv_heads=2, rope_max_wavelength=500.0,
                               dropout=0.1, kernel="reference")
    roundtrip_layer(layer)
    inp = keras.Input((5, 16))
    model = keras.Model(inp, MultiHeadAttention(num_heads=4, num_kv_heads=1)(
        inp, use_causal_mask=True))
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


def test_mha_qkv_bias_and_per_projection_initializers():
    const = keras.initializers.Constant
    layer = MultiHeadAttention(num_heads=2, qkv_bias=False, kernel_initializer=const(0.1),
                               query_initializer=const(0.2), key_value_initializer=const(0.3),
                               output_kernel_initializer=const(0.4))
    roundtrip_layer(layer)
    layer(np.zeros((1, 3, 4), "float32"))
    values = {w.path.split("/", 1)[1]: to_numpy(w) for w in layer.weights}
    assert sorted(values) == ["key_dense/kernel", "output_dense/bias", "output_dense/kernel",
                              "query_dense/kernel", "value_dense/kernel"]
    for name, value in [("query", 0.2), ("key", 0.3), ("value", 0.3), ("output", 0.4)]:
        np.testing.assert_array_equal(values[f"{name}_dense/kernel"], np.float32(value))
    both = MultiHeadAttention(num_heads=2, use_bias=False, qkv_bias=True)
    both(np.zeros((1, 3, 4), "float32"))
    assert sorted(w.path.split("/", 1)[1] for w in both.weights if "bias" in w.path) == [
        "key_dense/bias", "query_dense/bias", "value_dense/bias"]
    with pytest.raises(ValueError, match="qkv_bias"):
        MultiHeadAttention(num_heads=2, qkv_bias="no")


def test_mha_mixed_bfloat16_and_finite_gradients():
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = MultiHeadAttention(num_heads=4)
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    out = layer(x, use_causal_mask=True)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    assert np.isfinite(to_numpy(ops.cast(out, "float32"))).all()


def test_tpu_flash_plan_decisions():
    from kzoo.layers.kernels_jax import tpu_flash_plan

    q = (2, 1024, 8, 64)
    assert tpu_flash_plan(q, q, is_causal=True) == "pallas"
    assert tpu_flash_plan(q, q, mask_shape=(2, 1, 1, 1024)) == "pallas_segments"
    assert tpu_flash_plan(q, q, mask_shape=(2, 1, 1, 1024), has_bias=True) == "pallas_bias"
    assert tpu_flash_plan(q, q, mask_shape=(2, 8, 1024, 1024)) == "pallas_bias"
    assert tpu_flash_plan(q, q, has_bias=True, is_causal=True) == "pallas_bias"
    # Lengths that are not multiples of the 128 block, and bottom-right causal decoding.
    assert tpu_flash_plan((2, 1000, 8, 64), (2, 1000, 8, 64)) == "xla"
    assert tpu_flash_plan((2, 128, 8, 64), q, is_causal=True) == "xla"
    assert tpu_flash_plan((2, 128, 8, 64), q) == "pallas"


def test_jax_cuda_dispatch_gives_cudnn_full_length_masks(monkeypatch):
    """On a CUDA GPU, JAX's cuDNN attention takes a mask or bias only with the full
    (q_len, k_len) trailing shape (a (b, 1, 1, k) padding mask raised "Bias must have same seq
    length as QKV" on an H100). The dispatch is checked here on the CPU: `device()` says
    "gpu", a stand-in for `jax.nn.dot_product_attention` enforces cuDNN's argument rules and
    runs XLA's kernel; the output is checked against NumPy. Other backends: the same calls,
    checked against NumPy only."""
    calls = []
    if backend() == "jax":
        import jax

        from kzoo.layers import kernels_jax

        real = jax.nn.dot_product_attention

        def cudnn_rules(query, key, value, bias=None, mask=None, implementation=None,
                        **kwargs):
            calls.append(implementation)
            if implementation == "cudnn":
                want = (query.shape[1], key.shape[1])
                for name, x in (("mask", mask), ("bias", bias)):
                    if x is not None and tuple(x.shape[-2:]) != want:
                        raise ValueError(f"{name} {x.shape}: cuDNN needs (..., {want})")
                assert query.dtype == jax.numpy.bfloat16 and query.shape[-1] % 8 == 0
            return real(query, key, value, bias=bias, mask=mask, implementation=None,
                        **kwargs)

        monkeypatch.setattr(kernels_jax, "device", lambda: "gpu")
        monkeypatch.setattr(kernels_jax.jax.nn, "dot_product_attention", cudnn_rules)
    q, k, v = _data(t=8, d=16)
    mask = np.ones((2, 1, 1, 8), bool)
    mask[1, ..., 6:] = False
    bias = np.random.default_rng(1).normal(size=(1, 4, 8, 8)).astype("float32")
    cases = [(dict(mask=mask), True), (dict(bias=bias), False),
             (dict(mask=mask, bias=bias), True)]
    for kwargs, causal in cases:
        args = [ops.cast(x, "bfloat16") for x in (q, k, v)]
        out = dot_product_attention(*args, is_causal=causal, kernel="fused", **kwargs)
        expected = np_attention(*(to_numpy(ops.cast(x, "float32")) for x in args),
                                causal=causal, **kwargs)
        assert_close(ops.cast(out, "float32"), expected, atol=3e-2, rtol=3e-2)
    # float32, a head width cuDNN does not take, and one decode query: XLA's kernel.
    dot_product_attention(q, k, v, mask=mask, kernel="fused")
    q12, k12, v12 = (ops.cast(x, "bfloat16") for x in _data(t=8, d=12))
    dot_product_attention(q12, k12, v12, mask=mask, kernel="fused")
    dot_product_attention(ops.cast(q[:, -1:], "bfloat16"), *(ops.cast(x, "bfloat16")
                          for x in (k, v)), mask=mask, is_causal=True, kernel="fused")
    if backend() == "jax":
        assert calls == ["cudnn"] * 3 + [None] * 3


def test_unknown_sequence_length_under_tracing():
    """Symbolic lengths (a tf.function / jit signature with None) must work."""
    layer = MultiHeadAttention(num_heads=4, num_kv_heads=2)
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    expected = to_numpy(layer(x, use_causal_mask=True))
    if backend() == "tensorflow":
        import tensorflow as tf

        fn = tf.function(lambda t: layer(t, use_causal_mask=True),
                         input_signature=[tf.TensorSpec((None, None, 16), tf.float32)])
        np.testing.assert_allclose(fn(x).numpy(), expected, atol=1e-6)
    inp = keras.Input((None, 16))
    model = keras.Model(inp, layer(inp, use_causal_mask=True))
    np.testing.assert_allclose(to_numpy(model(x)), expected, atol=1e-6)


def test_torch_drops_an_all_true_mask_and_keeps_a_real_one(monkeypatch):
    """On torch's CPU SDPA path a padding mask that allows every key is dropped (the causal
    call then runs SDPA's `is_causal`, with no mask built per layer); a mask with one False
    is kept. Other backends: the same calls, checked against NumPy only."""
    q, k, v = _data()
    calls = []
    if backend() == "torch":
        import torch.nn.functional as F

        from kzoo.layers import kernels_torch

        real = F.scaled_dot_product_attention

        def spy(*args, **kwargs):
            calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
            return real(*args, **kwargs)

        monkeypatch.setattr(kernels_torch.F, "scaled_dot_product_attention", spy)
    full = np.ones((2, 1, 1, 6), bool)
    padded = full.copy()
    padded[1, ..., 5] = False
    for mask in (full, padded):
        out = dot_product_attention(q, k, v, mask=mask, is_causal=True, kernel="fused")
        assert_close(out, np_attention(q, k, v, mask=mask, causal=True), atol=1e-5, rtol=1e-5)
    if backend() == "torch":
        assert calls[0] == (None, True)
        assert calls[1][0] is not None and calls[1][1] is False


@pytest.mark.parametrize("bias_shape", [(1, 2, 5, 5), (2, 5, 5), (3, 2, 5, 5)],
                         ids=["shared_4d", "shared_3d", "per_row"])
def test_bias_gradient_against_numpy(bias_shape):
    """The gradient of an attention bias: for a bias shared by the batch's rows (T5's relative
    bias; on JAX broadcast by `broadcast_leading`, its sum over the batch a product) the sum
    of the rows' score gradients, for a per-row bias each row's own; NumPy's softmax backward
    written out here. Causal, with a padding mask, so masked scores are in the sum too."""
    from tests.helpers import value_and_grads

    r = np.random.default_rng(11)
    q, k, v = (r.normal(size=(3, 5, 2, 4)).astype("float32") for _ in range(3))
    bias = r.normal(size=bias_shape).astype("float32")
    w = r.normal(size=(3, 5, 2, 4)).astype("float32")
    keep = np.ones((3, 5), bool)
    keep[1, 3:] = False  # (right padding: every query keeps a key)
    mask = keep[:, None, None, :]

    def loss(b):
        out = dot_product_attention(q, k, v, bias=b, mask=mask, is_causal=True, scale=0.5)
        return ops.sum(ops.multiply(ops.cast(out, "float32"), ops.convert_to_tensor(w)))

    value, (grad,) = value_and_grads(loss, bias)
    qh, kh, vh, wh = (np.transpose(x, (0, 2, 1, 3)).astype(np.float64) for x in (q, k, v, w))
    full_bias = np.broadcast_to(bias.astype(np.float64), (3, 2, 5, 5))
    allowed = np.tril(np.ones((5, 5), bool))[None, None] & mask
    scores = np.where(allowed, qh @ np.swapaxes(kh, -1, -2) * 0.5 + full_bias, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert abs(value - float(((p @ vh) * wh).sum())) < 1e-3
    dp = wh @ np.swapaxes(vh, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    padded = (1,) * (4 - len(bias_shape)) + bias_shape  # (the axes the bias broadcast over)
    expected = ds.sum(axis=tuple(i for i, n in enumerate(padded) if n == 1), keepdims=True)
    assert_close(grad, expected.reshape(bias_shape), atol=1e-5)


@pytest.mark.parametrize("form", ["padding", "per_query", "none_empty", "grouped"])
def test_uniform_empty_rows_against_numpy(form):
    """`kernels.uniform_empty_rows`: a query row with no allowed key reads the mean of all the
    values of its key/value head, every other row keeps the attention output (a NumPy loop
    over rows). The "none_empty" mask leaves every row a key: on torch's CPU path the output
    is returned as is (no `where`, no mean), here it must still equal the input exactly."""
    from kzoo.layers.kernels import uniform_empty_rows

    r = np.random.default_rng(3)
    b, t, s, h, d = 3, 4, 5, 4, 8
    kv = 2 if form == "grouped" else h
    out = r.normal(size=(b, t, h, d)).astype("float32")
    value = r.normal(size=(b, s, kv, d)).astype("float32")
    if form in ("padding", "grouped"):
        mask = np.ones((b, 1, 1, s), bool)  # (a padding mask as `normalize_mask` gives it)
        mask[1] = False  # a whole row of padding
        mask[2, ..., 3:] = False
        full = np.broadcast_to(mask, (b, h, t, s))
    elif form == "per_query":
        mask = r.random((b, 1, t, s)) > 0.5
        mask[0, 0, 2] = False
        mask[2, 0, 0] = False
        mask[1, 0, 1] = True
        full = np.broadcast_to(mask, (b, h, t, s))
    else:
        mask = np.ones((b, 1, 1, s), bool)
        mask[0, ..., 4] = False
        full = np.broadcast_to(mask, (b, h, t, s))
    expected = out.copy()
    for i in range(b):
        for j in range(t):
            for head in range(h):
                if not full[i, head, j].any():
                    expected[i, j, head] = value[i, :, head // (h // kv)].mean(0)
    if form == "padding":
        assert not np.array_equal(expected, out)  # (the case has empty rows)
    got = uniform_empty_rows(ops.convert_to_tensor(out), ops.convert_to_tensor(mask),
                             ops.convert_to_tensor(value))
    assert_close(got, expected, atol=1e-6, rtol=1e-6)
    if form == "none_empty":
        np.testing.assert_array_equal(to_numpy(got), out)


def test_uniform_empty_rows_refused_with_a_causal_mask():
    """`uniform_empty_rows=True` with `use_causal_mask=True` found the empty rows from the
    padding mask alone and gave them the mean of every value: query 0 of an all-padding row
    changed when only the last token did (a causal attention reading the future). It is
    refused now; without it such a causal row gives zeros (the output projection's bias),
    and a non-causal one the mean of every projected value (NumPy)."""
    r = np.random.default_rng(5)
    mha = MultiHeadAttention(num_heads=2, head_dim=3, bias_initializer="glorot_uniform")
    x = r.normal(size=(2, 4, 6)).astype("float32")
    mask = np.ones((2, 4), bool)
    mask[1] = False  # a whole row of padding
    mha(x)
    with pytest.raises(ValueError, match=r"`uniform_empty_rows=True` is for non-causal .*"
                                         r"use_causal_mask=True"):
        mha(x, attention_mask=mask, use_causal_mask=True, uniform_empty_rows=True)
    vk, vb = to_numpy(mha.value_dense.kernel), to_numpy(mha.value_dense.bias)
    ok, ob = to_numpy(mha.output_dense.kernel), to_numpy(mha.output_dense.bias)
    causal = to_numpy(mha(x, attention_mask=mask, use_causal_mask=True))
    assert_close(causal[1], np.broadcast_to(ob, (4, 6)), atol=1e-6, rtol=0)
    uniform = to_numpy(mha(x, attention_mask=mask, uniform_empty_rows=True))
    mean_value = (x[1] @ vk + vb).mean(0)  # (heads * head_dim,): each head's mean value
    assert_close(uniform[1], np.broadcast_to(mean_value @ ok + ob, (4, 6)), atol=1e-5)


# === TensorFlow's reference formula with a hand-written gradient ===


def _np_hand_attention_grads(q, k, v, allowed, bias, scale, w):
    """Output and d(sum(out * w)) / d(q, k, v, full bias) of softmax(q k^T * scale + bias,
    masked) v in float64, heads-major algebra written out; rows without a key give 0."""
    qh, kh, vh, wh = (np.transpose(x, (0, 2, 1, 3)).astype(np.float64) for x in (q, k, v, w))
    scores = qh @ np.swapaxes(kh, -1, -2) * scale + bias
    scores = np.where(allowed, scores, -np.inf)
    empty = ~allowed.any(-1, keepdims=True)
    scores = np.where(empty, 0.0, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = np.where(empty, 0.0, p / p.sum(-1, keepdims=True))
    out = p @ vh
    dp = wh @ np.swapaxes(vh, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq, dk, dv = ds @ kh * scale, np.swapaxes(ds, -1, -2) @ qh * scale, np.swapaxes(p, -1, -2) @ wh
    back = lambda x: np.transpose(x, (0, 2, 1, 3))  # noqa: E731
    return back(out), back(dq), back(dk), back(dv), ds


TF_HAND_CASES = {  # (t, s, mask kind, bias shape or None, causal, scale)
    "causal": (6, 6, None, None, True, None),
    "padding_empty_row": (5, 7, "rows", None, False, None),
    "causal_padding_shared_bias": (6, 6, "keys", (1, 3, 6, 6), True, None),
    "bias_per_key_unscaled": (4, 5, None, (2, 1, 1, 5), False, 1.0),
    "decode_row": (1, 7, "keys", (2, 3, 1, 7), True, 0.3),
}


@pytest.mark.parametrize("case", sorted(TF_HAND_CASES))
def test_tensorflow_hand_gradient_in_a_graph_against_numpy(case):
    """`kernels_tf.reference_with_gradient` (pure TensorFlow, so checked under every backend),
    traced in a graph as `fit` runs it: the output and the gradients of the queries, keys,
    values and bias (summed over the bias' broadcast axes) against NumPy's float64 formula,
    with a causal mask, padded keys, a query row with no key at all (zeros, zero gradients),
    a scale of 1 and a one-row decode step."""
    import tensorflow as tf

    from kzoo.layers import kernels_tf

    t, s, mask_kind, bias_shape, causal, scale = TF_HAND_CASES[case]
    b, h, d = 2, 3, 4
    q, k, v = _data(b=b, t=t, s=s, h=h, d=d, seed=21)
    r = np.random.default_rng(22)
    w = r.normal(size=q.shape).astype("float32")
    mask = None
    if mask_kind == "keys":
        mask = _pad(b, s, [s, s - 2])[:, None, None, :]
    elif mask_kind == "rows":
        mask = r.random((b, 1, t, s)) > 0.4
        mask[0, 0, 1] = False  # a query row with no key
    bias = None if bias_shape is None else r.normal(size=bias_shape).astype("float32")
    scale_value = 1 / np.sqrt(d) if scale is None else scale
    allowed = np.ones((b, h, t, s), bool) if mask is None else np.broadcast_to(mask, (b, h, t, s))
    if causal:
        allowed = allowed & np.tril(np.ones((t, s), bool), s - t)
    full_bias = 0.0 if bias is None else np.broadcast_to(bias.astype(np.float64), (b, h, t, s))
    out, dq, dk, dv, ds = _np_hand_attention_grads(q, k, v, allowed, full_bias, scale_value, w)

    full = rows = None  # (the mask, the causal one in it, and the rows with a key)
    if mask is not None or causal:
        visible = np.ones((1, 1, t, s), bool) if mask is None else mask
        if causal:
            visible = visible & np.tril(np.ones((t, s), bool), s - t)
        full = tf.constant(visible)
        if mask is not None:
            rows = tf.constant(visible.any(-1, keepdims=True))

    @tf.function
    def run(q, k, v, bias):
        inputs = [q, k, v] + ([] if bias is None else [bias])
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            o = kernels_tf.reference_with_gradient(q, k, v, full, bias, scale_value, rows)
            loss = tf.reduce_sum(o * w)
        return [o] + tape.gradient(loss, inputs)

    got = [x.numpy() for x in run(tf.constant(q), tf.constant(k), tf.constant(v),
                                  None if bias is None else tf.constant(bias))]
    for name, have, want in zip(["out", "dq", "dk", "dv"], got, [out, dq, dk, dv]):
        np.testing.assert_allclose(have, want, atol=2e-5, rtol=1e-4, err_msg=name)
    if mask_kind == "rows":
        assert not got[0][0, 1].any() and not got[1][0, 1].any()
    if bias is not None:
        axes = tuple(i for i, n in enumerate(bias_shape) if n == 1)
        np.testing.assert_allclose(got[4], ds.sum(axis=axes, keepdims=True), atol=2e-5,
                                   rtol=1e-4, err_msg="dbias")


def test_tensorflow_hand_gradient_is_taken_for_float32_equal_heads(monkeypatch):
    """On TensorFlow the reference kernel's float32 calls with as many key/value heads as
    query heads run `kernels_tf.reference_with_gradient`; grouped heads, half precision,
    returned weights, attention dropout and `TF_HAND_GRADIENT = False` keep the formula.
    Other backends never reach it. Every call's output equals NumPy's."""
    import tensorflow as tf  # noqa: F401  (kernels_tf imports it)

    from kzoo.layers import kernels, kernels_tf

    calls = []
    real = kernels_tf.reference_with_gradient
    monkeypatch.setattr(kernels_tf, "reference_with_gradient",
                        lambda *a: calls.append(1) or real(*a))
    on_tf = backend() == "tensorflow"
    q, k, v = _data(b=2, t=5, h=4, d=8, seed=3)
    _, kg, vg = _data(b=2, t=5, h=2, d=8, seed=4)
    mask = _pad(2, 5, [5, 2])[:, None, None, :]
    cases = [  # (query, key, value, kwargs, taken on TensorFlow)
        (q, k, v, dict(mask=mask, is_causal=True), True),
        (q, kg, vg, dict(is_causal=True), False),
        (q.astype("float16"), k.astype("float16"), v.astype("float16"), {}, False),
    ]
    for query, key, value, kw, taken in cases:
        calls.clear()
        out = dot_product_attention(query, key, value, kernel="reference", **kw)
        assert len(calls) == int(on_tf and taken), (query.dtype, key.shape, kw)
        tol = 2e-3 if query.dtype == np.float16 else 1e-5
        assert_close(out, np_attention(query.astype("float64"), key, value,
                                       mask=kw.get("mask"), causal=kw.get("is_causal", False)),
                     atol=tol, rtol=tol)
    calls.clear()
    dot_product_attention(q, k, v, kernel="reference", return_weights=True)
    dot_product_attention(q, k, v, kernel="reference", dropout_rate=0.5, training=True,
                          seed_generator=keras.random.SeedGenerator(0))
    monkeypatch.setattr(kernels, "TF_HAND_GRADIENT", False)
    dot_product_attention(q, k, v, kernel="reference")
    assert not calls
