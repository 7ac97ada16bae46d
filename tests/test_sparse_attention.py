"""Sparse attention kernels: each equals the plain formula with the equivalent dense mask
(forward and gradients), never builds an n x n tensor, and rejects bad parameters."""

import numpy as np
import pytest
import keras
from keras import ops

from kzoo.layers import kernels
from kzoo.layers.sparse_attention import (
    bigbird_attention,
    bigbird_layout,
    block_sparse_attention,
    longformer_attention,
    sliding_window_attention,
    strided_attention,
)
from tests.helpers import assert_close, backend, to_numpy

B, N, H, HK, D = 2, 29, 4, 2, 8  # N is not a multiple of any block size used below


# === Per-backend gradients and largest intermediate (shared with test_linear_attention) ===


def grads(fn, args, cotangent):
    """d/d args of sum(fn(*args) * cotangent), as NumPy arrays, with the backend's autodiff."""
    name = backend()
    if name == "jax":
        import jax

        # One compiled program: much cheaper on CPU than JAX's op-by-op eager dispatch.
        return [np.asarray(g) for g in jax.jit(jax.grad(
            lambda *a: (fn(*a) * cotangent).sum(), argnums=tuple(range(len(args)))))(*args)]
    if name == "torch":
        import torch

        ts = [torch.tensor(np.asarray(a), requires_grad=True) for a in args]
        (fn(*ts) * torch.tensor(cotangent)).sum().backward()
        return [t.grad.numpy() for t in ts]
    import tensorflow as tf

    ts = [tf.Variable(a) for a in args]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(fn(*ts) * cotangent)
    return [g.numpy() for g in tape.gradient(loss, ts)]


def largest_intermediate(fn, args):
    """Most elements of any tensor built by fn(*args) and its gradient (forward+backward)."""
    name = backend()
    if name == "jax":
        import jax

        closed = jax.make_jaxpr(jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2)))(*args)
        biggest = 0

        def walk(jaxpr):
            nonlocal biggest
            for eqn in jaxpr.eqns:
                for var in eqn.outvars:
                    biggest = max(biggest, int(np.prod(var.aval.shape, dtype=np.int64)))
                for param in eqn.params.values():
                    for sub in param if isinstance(param, (list, tuple)) else [param]:
                        inner = getattr(sub, "jaxpr", None)
                        if inner is not None:
                            walk(getattr(inner, "jaxpr", inner))

        walk(closed.jaxpr)
        return biggest
    if name == "torch":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class Record(TorchDispatchMode):
            biggest = 0

            def __torch_dispatch__(self, func, types, a=(), kw=None):
                out = func(*a, **(kw or {}))
                for t in out if isinstance(out, (list, tuple)) else [out]:
                    if isinstance(t, torch.Tensor):
                        Record.biggest = max(Record.biggest, t.numel())
                return out

        ts = [torch.tensor(np.asarray(a), requires_grad=True) for a in args]
        with Record():
            fn(*ts).sum().backward()
        return Record.biggest
    import tensorflow as tf

    def step(*ts):
        with tf.GradientTape() as tape:
            tape.watch(ts)
            loss = tf.reduce_sum(fn(*ts))
        return tape.gradient(loss, ts)

    graph = tf.function(step).get_concrete_function(
        *[tf.TensorSpec(a.shape, a.dtype) for a in args]).graph
    return max(int(np.prod(o.shape.as_list(), dtype=np.int64))
               for op in graph.get_operations() for o in op.outputs
               if o.shape.rank is not None and None not in o.shape.as_list())


# === Cases: the kernel call and the equivalent dense mask written out in NumPy ===


def _positions():
    return np.arange(N)[:, None], np.arange(N)[None, :]


def _band(window, causal):
    i, j = _positions()
    return ((i - j >= 0) & (i - j < window)) if causal else (np.abs(i - j) < window)


def _with_globals(band, is_global, causal):
    """band | global columns | global rows, per example; is_global (B|1, N)."""
    m = band[None] | is_global[:, None, :] | is_global[:, :, None]
    if causal:
        i, j = _positions()
        m = m & (j <= i)[None]
    return m[:, None]  # (b, 1, q, k)


def _blocks_to_tokens(layout, block, causal):
    m = np.kron(layout, np.ones((block, block), bool))[:, :N, :N]
    if causal:
        i, j = _positions()
        m = m & (j <= i)[None]
    return m[None]  # (1, heads|1, q, k)


def _case(name, causal):
    """(kernel(q, k, v, mask), dense mask (.., q, k) without padding)."""
    if name == "sliding_window":
        return (lambda q, k, v, m: sliding_window_attention(q, k, v, 5, causal=causal, mask=m,
                                                            block_size=7),
                _band(5, causal)[None, None])
    if name == "strided":
        i, j = _positions()
        dense = (np.abs(i - j) < 6) | ((i - j) % 6 == 0)
        if causal:
            dense = dense & (j <= i)
        return (lambda q, k, v, m: strided_attention(q, k, v, 6, causal=causal, mask=m),
                dense[None, None])
    if name == "longformer_indices":
        glob = [0, 11, N - 1]
        flags = np.zeros((1, N), bool)
        flags[0, glob] = True
        return (lambda q, k, v, m: longformer_attention(q, k, v, 4, glob, causal=causal,
                                                        mask=m),
                _with_globals(_band(4, causal), flags, causal))
    if name == "longformer_mask":
        flags = np.zeros((B, N), bool)
        flags[0, [2, 3]] = True
        flags[1, 17] = True
        return (lambda q, k, v, m: longformer_attention(q, k, v, 4, flags, causal=causal, mask=m,
                                                        block_size=6),
                _with_globals(_band(4, causal), flags, causal))
    if name == "block_sparse_per_head":
        rng = np.random.default_rng(5)
        layout = rng.random((H, 4, 4)) < 0.4
        layout[:, np.arange(4), np.arange(4)] = True  # every row sees its own block
        return (lambda q, k, v, m: block_sparse_attention(q, k, v, layout, 8, causal=causal,
                                                          mask=m),
                _blocks_to_tokens(layout, 8, causal))
    if name == "bigbird":
        layout = bigbird_layout(5, global_blocks=1, random_blocks=1, seed=7, causal=causal)
        return (lambda q, k, v, m: bigbird_attention(q, k, v, 6, global_blocks=1,
                                                     random_blocks=1, seed=7, causal=causal,
                                                     mask=m),
                _blocks_to_tokens(layout, 6, causal))
    raise AssertionError(name)


# Each kernel once, each also or otherwise causal once (test time: see common budget).
CASES = [("sliding_window", False), ("sliding_window", True), ("strided", True),
         ("longformer_indices", False), ("longformer_mask", True),
         ("block_sparse_per_head", True), ("bigbird", False), ("bigbird", True)]


def run(fn, args):
    """fn(*args) as NumPy; compiled on JAX (its op-by-op eager mode is slow on CPU)."""
    if backend() == "jax":
        import jax

        fn = jax.jit(fn)
    return to_numpy(fn(*args))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, N, H, D)).astype("float32")
    k = rng.normal(size=(B, N, HK, D)).astype("float32")
    v = rng.normal(size=(B, N, HK, D)).astype("float32")
    pad = np.ones((B, N), bool)
    pad[1, 22:] = False
    cot = rng.normal(size=(B, N, H, D)).astype("float32")
    return q, k, v, pad, cot


@pytest.mark.spread
@pytest.mark.parametrize("name, causal", CASES)
def test_equals_dense_formula_forward_and_gradients(data, name, causal):
    q, k, v, pad, cot = data
    kernel, dense = _case(name, causal)
    full = dense & pad[:, None, None, :]

    def ref(q_, k_, v_):
        return kernels.reference_attention(q_, k_, v_, mask=full)

    def sparse(q_, k_, v_):
        return kernel(q_, k_, v_, pad)

    assert_close(run(sparse, [q, k, v]), run(ref, [q, k, v]), atol=1e-5)
    for got, want in zip(grads(sparse, [q, k, v], cot), grads(ref, [q, k, v], cot)):
        assert_close(got, want, atol=1e-5)



@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window, block_size", [(4096, None), (N, None), (5, 64)])
def test_sliding_window_on_a_sequence_shorter_than_a_block(data, monkeypatch, causal, window,
                                                           block_size):
    # Blocks of `window` rows padded a short sequence to the whole window (Mistral's 4,096:
    # 6 s for 16 tokens on torch's CPU). A window no shorter than the sequence hides no key
    # (plain attention, never the blocked path); a block longer than it is cut to its length.
    import kzoo.layers.sparse_attention as sparse

    q, k, v, pad, cot = data
    blocks = []
    local_setup = sparse._local_setup

    def recorded(query, key, value, mask, window_, block, causal_):
        blocks.append(block)
        return local_setup(query, key, value, mask, window_, block, causal_)

    monkeypatch.setattr(sparse, "_local_setup", recorded)
    full = _band(window, causal)[None, None] & pad[:, None, None, :]

    def ref(q_, k_, v_):
        return kernels.reference_attention(q_, k_, v_, mask=full)

    def sliding(q_, k_, v_):
        return sliding_window_attention(q_, k_, v_, window, causal=causal, mask=pad,
                                        block_size=block_size)

    assert_close(run(sliding, [q, k, v]), run(ref, [q, k, v]), atol=1e-5)
    for got, want in zip(grads(sliding, [q, k, v], cot), grads(ref, [q, k, v], cot)):
        assert_close(got, want, atol=1e-5)
    assert set(blocks) == (set() if window >= N else {N})


def test_fully_padded_rows_are_zero_not_nan(data):
    q, k, v, _, _ = data
    pad = np.zeros((B, N), bool)
    pad[0] = True
    out = run(lambda q_, k_, v_: longformer_attention(q_, k_, v_, 3, [1], mask=pad), [q, k, v])
    assert np.isfinite(out).all() and np.all(out[1] == 0)
    alone = run(lambda q_, k_, v_: longformer_attention(q_, k_, v_, 3, [1]),
                [q[:1], k[:1], v[:1]])
    np.testing.assert_allclose(out[0], alone[0], atol=1e-6)


def test_bigbird_layout_is_seeded_and_has_its_parts():
    a = bigbird_layout(12, window_blocks=3, global_blocks=2, random_blocks=2, num_heads=3,
                       seed=11)
    np.testing.assert_array_equal(a, bigbird_layout(12, window_blocks=3, global_blocks=2,
                                                    random_blocks=2, num_heads=3, seed=11))
    assert not np.array_equal(a, bigbird_layout(12, window_blocks=3, global_blocks=2,
                                                random_blocks=2, num_heads=3, seed=12))
    i = np.arange(12)
    assert a[:, np.abs(i[:, None] - i[None, :]) <= 1].all()  # window
    assert a[:, :2, :].all() and a[:, :, :2].all()  # global rows and columns
    # Each non-global row: 3 window blocks (2 at the ends, one of them maybe global), the 2
    # global blocks, and exactly 2 random ones on top.
    for row in range(2, 12):
        base = (np.abs(row - i) <= 1) | (i < 2)
        assert (a[:, row].sum(axis=-1) == base.sum() + 2).all()


@pytest.mark.parametrize("name", ["sliding_window", "longformer", "bigbird"])
def test_never_builds_n_by_n(name):
    n, window = 512, 16
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, n, 2, 8)).astype("float32")
    k = rng.normal(size=(1, n, 1, 8)).astype("float32")
    fn = {
        "sliding_window": lambda q_, k_, v_: sliding_window_attention(q_, k_, v_, window,
                                                                      causal=True),
        "longformer": lambda q_, k_, v_: longformer_attention(q_, k_, v_, window, [0, 500]),
        "bigbird": lambda q_, k_, v_: bigbird_attention(q_, k_, v_, window, seed=0),
    }[name]
    biggest = largest_intermediate(fn, [q, k, k.copy()])
    # Banded blocks: heads * n * (3 * window) scores, far below one n x n matrix.
    # Full attention would hold heads * n * n = 2 * n * n scores.
    assert biggest < n * n // 2, (biggest, n * n)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda x, m: sliding_window_attention(x, x, x, 0), "window"),
        (lambda x, m: sliding_window_attention(x, x, x, -3), "window"),
        (lambda x, m: sliding_window_attention(x, x, x, 4, block_size=2), "block_size"),
        (lambda x, m: sliding_window_attention(x, x, x, 4, block_size=0), "block_size"),
        (lambda x, m: strided_attention(x, x, x, 0), "stride"),
        (lambda x, m: longformer_attention(x, x, x, 4, list(range(N + 1))), "global_tokens"),
        (lambda x, m: longformer_attention(x, x, x, 4, [N]), "global_tokens"),
        (lambda x, m: block_sparse_attention(x, x, x, np.ones((1, 3, 3), bool), 8),
         "block_size"),
        (lambda x, m: block_sparse_attention(x, x, x, np.ones((3, 4, 4), bool), 8), "layout"),
        (lambda x, m: block_sparse_attention(x, x, x, np.ones((1, 4, 4), bool), 0),
         "block_size"),
        (lambda x, m: bigbird_attention(x, x, x, 8, global_blocks=-1), "global_blocks"),
        (lambda x, m: sliding_window_attention(x, x, x, 4, mask=m), "mask"),
        (lambda x, m: sliding_window_attention(x, x[:, :5], x[:, :5], 4), "sequence length"),
    ],
)
def test_bad_parameters_raise_value_error_naming_them(call, field):
    x = np.zeros((1, N, 2, 4), "float32")
    general_mask = np.ones((1, 1, N, N), bool)
    with pytest.raises(ValueError, match=field):
        call(x, general_mask)


def test_inside_a_compiled_function():
    """The kernels trace (jax.jit, tf.function; torch runs eagerly) with a global-token mask
    tensor whose count is given as `max_global`, and still equal the dense formula."""
    n = 40
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, n, 2, 8)).astype("float32")
    flags = np.zeros((1, n), bool)
    flags[0, 5] = True
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = (np.abs(i - j) < 4) | flags[0][None, :] | flags[0][:, None]

    def fn(x_):
        return longformer_attention(x_, x_, x_, 4, ops.convert_to_tensor(flags), max_global=1)

    if backend() == "jax":
        import jax

        fn = jax.jit(fn)
    elif backend() == "tensorflow":
        import tensorflow as tf

        fn = tf.function(fn)
    assert_close(fn(x), to_numpy(kernels.reference_attention(x, x, x, mask=dense[None, None])), atol=1e-5)
