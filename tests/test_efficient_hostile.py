"""Efficient attention types under hostile inputs: query rows that see no key (padding
queries whose window is all padding, rows of padding only) with `uniform_empty_rows`, block
layouts that cannot work, BigBird on sequences too short for its random blocks, odd lengths,
batch 1, length 1 and half-precision inputs.

References: the dense boolean pattern of each type written out here from its paper and a
softmax in NumPy (float64) whose rows without a visible key read the mean of every value (what
full attention gives under transformers' additive float-minimum masks).
"""

import numpy as np
import pytest
import keras

from kzoo.layers import MultiHeadAttention, bigbird_layout
from kzoo.layers import efficient_attention as ea
from kzoo.layers.blocks import TransformerBlock
from tests.helpers import assert_close, to_numpy

B, N, H, HK, D = 3, 23, 4, 2, 8  # N: not a multiple of any block size below


# === NumPy references ===


def np_pattern(kind, n, options, heads=H):
    """The non-causal boolean pattern `(heads|1, n, n)` of a sparse type, from its paper."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    if kind == "sliding_window":
        return (np.abs(i - j) < options["window"])[None]
    if kind == "strided":
        s = options["stride"]
        return ((np.abs(i - j) < s) | ((i - j) % s == 0))[None]
    if kind == "longformer":
        g = np.zeros(n, bool)
        g[list(options["global_positions"])] = True
        return ((np.abs(i - j) < options["window"]) | g[None, :] | g[:, None])[None]
    layout, block = np.asarray(options["layout"], bool), options["block_size"]
    if layout.ndim == 2:
        layout = layout[None]
    return layout[:, i // block, j // block]


def np_attention(q, k, v, allowed, empty_rows_uniform=True):
    """Softmax attention in float64; `allowed` `(b|1, h|1, n, n)`; k, v with kv heads (GQA
    repeated here). Rows with no allowed key: the mean of every value, or zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    w = e / np.where(tot > 0, tot, 1.0)
    if empty_rows_uniform:
        w = np.where(allowed.any(-1, keepdims=True), w, 1.0 / s.shape[-1])
    return np.einsum("bhqk,bkhd->bqhd", w, v)


def np_elu_linear(q, k, v, padding):
    """Non-causal elu(x)+1 linear attention (Katharopoulos et al. 2020), rows of padding only
    reading the mean of every value."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731
    a = np.einsum("bqhm,bkhm->bhqk", phi(q), phi(k)) * padding[:, None, None, :]
    tot = a.sum(-1, keepdims=True)
    w = np.where(tot > 0, a / np.where(tot > 0, tot, 1.0), 1.0 / k.shape[1])
    return np.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(B, N, H, D)).astype("float32")
    k = rng.normal(size=(B, N, HK, D)).astype("float32")
    v = rng.normal(size=(B, N, HK, D)).astype("float32")
    padding = np.ones((B, N), bool)
    padding[0, 5:] = False    # right padding: the late queries' windows hold padding only
    padding[1, :] = False     # a row of padding only: every query sees nothing
    padding[2, :15] = False   # left padding
    return q, k, v, padding


LAYOUT = np.random.default_rng(8).random((H, 6, 6)) < 0.3
LAYOUT[:, np.arange(6), np.arange(6)] = True  # each block sees itself; per-head random rest
BIGBIRD = dict(block_size=4, window_blocks=1, global_blocks=0, random_blocks=1, seed=2)
EMPTY_ROW_CASES = [
    ("sliding_window", {"window": 3}, {}),
    ("sliding_window", {"window": 3, "block_size": 5}, {}),
    ("sliding_window", {"window": 30}, {}),  # longer than the sequence: plain attention
    ("strided", {"stride": 4}, {}),
    ("longformer", {"window": 2, "global_tokens": [9]}, {"global_positions": [9]}),
    ("longformer", {"window": 2, "global_tokens": 0}, {"global_positions": []}),
    ("block_sparse", {"block_size": 4, "layout": LAYOUT.tolist()}, {}),
    ("bigbird", BIGBIRD, {}),
]


def _pattern_options(kind, options, extra):
    if kind == "bigbird":
        return {"block_size": 4, "layout": bigbird_layout(
            6, window_blocks=1, global_blocks=0, random_blocks=1, seed=2)}
    return {**options, **extra}


# === uniform_empty_rows: rows that see no key read the mean of the values ===


@pytest.mark.spread
@pytest.mark.parametrize("kind, options, extra", EMPTY_ROW_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(EMPTY_ROW_CASES)])
def test_rows_without_a_visible_key_read_the_mean_of_the_values(data, kind, options, extra):
    q, k, v, padding = data
    kind, opts = ea.check_attention(kind, options)
    allowed = np_pattern(kind, N, _pattern_options(kind, options, extra))[None] & \
        padding[:, None, None, :]
    empty = ~allowed.any(-1)  # (b, h|1, n)
    assert empty[1].all() and not empty[2].all()  # (the case has rows of both kinds)
    got = ea.efficient_attention(q, k, v, kind, opts, mask=padding, uniform_empty_rows=True)
    assert_close(got, np_attention(q, k, v, allowed), atol=2e-5)
    # The default keeps zeros for those rows (and the same numbers elsewhere).
    plain = ea.efficient_attention(q, k, v, kind, opts, mask=padding)
    assert_close(plain, np_attention(q, k, v, allowed, empty_rows_uniform=False), atol=2e-5)
    # Which rows are empty, from the mask alone.
    seen = to_numpy(ea.visible_rows(kind, opts, N, padding))
    np.testing.assert_array_equal(np.broadcast_to(seen, empty.shape), ~empty)


def test_longformer_call_time_global_mask_rows(data):
    q, k, v, padding = data
    flags = np.zeros((B, N), bool)
    flags[0, 3] = True   # a real global token: every query of row 0 sees it
    flags[2, 4] = True   # a padding global token: its row sees the real keys
    kind, opts = ea.check_attention("longformer", {"window": 2})
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    pattern = (np.abs(i - j) < 2)[None] | flags[:, None, :] | flags[:, :, None]
    allowed = pattern[:, None] & padding[:, None, None, :]
    got = ea.efficient_attention(q, k, v, kind, opts, mask=padding, global_mask=flags,
                                 uniform_empty_rows=True)
    assert_close(got, np_attention(q, k, v, allowed), atol=2e-5)


@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_linear_rows_of_padding_only_read_the_mean(data, kind):
    q, k, v, padding = data
    kind, opts = ea.check_attention(kind, {})
    proj = ea.projection(kind, opts, D)
    got = to_numpy(ea.efficient_attention(q, k, v, kind, opts, mask=padding,
                                          projection_matrix=proj, uniform_empty_rows=True))
    mean = np.repeat(v[1].astype(np.float64).mean(0), H // HK, axis=0)  # (heads, d)
    assert_close(got[1], np.broadcast_to(mean, got[1].shape), atol=1e-5)
    if kind == "linear":
        assert_close(got, np_elu_linear(q, k, v, padding), atol=2e-5)


def test_uniform_empty_rows_refuses_causal(data):
    q, k, v, padding = data
    kind, opts = ea.check_attention("sliding_window", {"window": 3})
    with pytest.raises(ValueError, match="uniform_empty_rows.*causal=True"):
        ea.efficient_attention(q, k, v, kind, opts, causal=True, mask=padding,
                               uniform_empty_rows=True)


@pytest.mark.parametrize("kind, options", [
    ("sliding_window", {"window": 3}),
    ("block_sparse", {"block_size": 4, "layout": LAYOUT[:1].tolist()}),
    ("linear", {}),
])
def test_layer_weights_path_equals_kernel_path_on_empty_rows(data, kind, options):
    """`return_attention_weights` (the explicit formula) and the kernel agree on every row,
    the empty ones included (their weights: 1 / n on every key)."""
    x = np.random.default_rng(5).normal(size=(B, N, 16)).astype("float32")
    padding = data[3]
    layer = MultiHeadAttention(H, num_kv_heads=HK, attention=kind, attention_options=options)
    out = layer(x, attention_mask=padding, uniform_empty_rows=True)
    out_w, weights = layer(x, attention_mask=padding, uniform_empty_rows=True,
                           return_attention_weights=True)
    assert_close(out_w, to_numpy(out), atol=2e-5)
    w = to_numpy(weights)
    assert_close(w[1], np.full(w[1].shape, 1.0 / N), atol=1e-6)
    assert_close(w.sum(-1), np.ones(w.shape[:-1]), atol=1e-5)


def test_block_with_a_window_over_the_whole_sequence_equals_full_attention():
    """A non-causal block whose window covers every key is full attention, also on a row of
    padding only (before: 0.75 apart there, the efficient block gave that row zeros)."""
    x = np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32")
    padding = np.ones((2, 8), bool)
    padding[1, :] = False
    full = TransformerBlock(num_heads=2, intermediate_dim=32)
    window = TransformerBlock(num_heads=2, intermediate_dim=32, attention="sliding_window",
                              attention_options={"window": 8})
    expected = full(x, padding_mask=padding)
    window(x, padding_mask=padding)
    window.set_weights(full.get_weights())
    assert_close(window(x, padding_mask=padding), to_numpy(expected), atol=2e-5)


# === Block layouts that cannot work are refused when the layer is made ===


def test_layout_with_the_wrong_number_of_heads_is_refused_at_construction():
    three = np.ones((3, 4, 4), bool).tolist()
    options = {"block_size": 4, "layout": three}
    with pytest.raises(ValueError, match=r"`layout`.*num_heads=4.*\(3, 4, 4\) \(3 heads\)"):
        MultiHeadAttention(4, attention="block_sparse", attention_options=options)
    with pytest.raises(ValueError, match=r"`layout`.*num_heads=2.*\(3, 4, 4\)"):
        TransformerBlock(num_heads=2, intermediate_dim=8, attention="block_sparse",
                         attention_options=options)
    # 1 (shared) or num_heads heads are fine.
    MultiHeadAttention(3, attention="block_sparse", attention_options=options)
    MultiHeadAttention(5, attention="block_sparse",
                       attention_options={"block_size": 4, "layout": three[:1]})


def test_layout_with_a_query_block_that_sees_nothing_is_refused_at_construction():
    layout = np.ones((2, 4, 4), bool)
    layout[1, 2] = False
    options = {"block_size": 4, "layout": layout.tolist()}
    with pytest.raises(ValueError, match=r"`layout` row layout\[1\]\[2\] \(head 1, query "
                                         r"block 2\) attends to no key block"):
        ea.check_attention("block_sparse", options)
    with pytest.raises(ValueError, match=r"layout\[1\]\[2\]"):
        MultiHeadAttention(2, attention="block_sparse", attention_options=options)


def test_causal_layout_row_with_only_later_blocks_is_refused(data):
    q, k, v, _ = data
    layout = np.eye(6, dtype=bool)
    layout[3] = False
    layout[3, 5] = True  # block 3 sees only block 5: nothing once causal
    kind, opts = ea.check_attention("block_sparse", {"block_size": 4,
                                                     "layout": layout.tolist()})
    ea.efficient_attention(q, k, v, kind, opts)  # fine without causality
    with pytest.raises(ValueError, match=r"layout\[0\]\[3\].*at or before itself"):
        ea.efficient_attention(q, k, v, kind, opts, causal=True)


# === BigBird on sequences too short for its random blocks ===


def _np_band_and_globals(blocks, window_blocks, global_blocks):
    a = np.arange(blocks)
    seen = np.abs(a[:, None] - a[None, :]) <= window_blocks // 2
    seen[:, :global_blocks] = True
    seen[:global_blocks, :] = True
    return seen


def test_bigbird_random_blocks_that_fit_are_all_drawn():
    # 10 blocks, window 5, 1 global: a middle block has 10 - 6 = 4 blocks left.
    layout = bigbird_layout(10, window_blocks=5, global_blocks=1, random_blocks=4, seed=3)
    base = _np_band_and_globals(10, 5, 1)
    counts = layout[0].sum(1)
    np.testing.assert_array_equal(counts[1:], base.sum(1)[1:] + 4)
    assert (layout[0] | ~base).all() and not layout.all()


def test_bigbird_short_sequence_warns_and_attends_to_every_block(data):
    """One more random block than a middle block has left: full attention (transformers'
    BigBird switches to "original_full"), with a warning naming random_blocks; before, the
    draw was silently cut short and block 1 still skipped a block."""
    with pytest.warns(UserWarning, match=r"`random_blocks`=5 is more than a sequence of 10 "
                                         r"blocks allows \(at most 4 random blocks"):
        layout = bigbird_layout(10, window_blocks=5, global_blocks=1, random_blocks=5, seed=3)
    assert layout.all()
    q, k, v, padding = data  # 23 tokens in blocks of 3: 8 blocks, 2 left beside window 5
    kind, opts = ea.check_attention("bigbird", {"block_size": 3, "window_blocks": 5,
                                                "random_blocks": 3})
    with pytest.warns(UserWarning, match=r"`random_blocks`=3 .* 8 blocks .*at most 2"):
        got = ea.efficient_attention(q, k, v, kind, opts, mask=padding)
    full = np.ones((1, 1, N, N), bool) & padding[:, None, None, :]
    assert_close(got, np_attention(q, k, v, full, empty_rows_uniform=False), atol=2e-5)


def test_bigbird_causal_draws_among_earlier_blocks_without_warning(recwarn):
    layout = bigbird_layout(6, window_blocks=1, global_blocks=1, random_blocks=2, seed=0,
                            causal=True)[0]
    assert not np.triu(layout, 1).any()
    assert not [w for w in recwarn if "random_blocks" in str(w.message)]


# === Half precision ===


HALF_CASES = [
    ("sliding_window", {"window": 3}, {}),
    ("sliding_window", {"window": 30}, {}),
    ("strided", {"stride": 4}, {}),
    ("longformer", {"window": 2, "global_tokens": [9]}, {"global_positions": [9]}),
    ("block_sparse", {"block_size": 4, "layout": LAYOUT.tolist()}, {}),
]


@pytest.mark.parametrize("kind, options, extra", HALF_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(HALF_CASES)])
def test_float16_products_beyond_65504_stay_finite(kind, options, extra):
    """float16 queries and keys whose dot products exceed float16's range (64 dims of size
    ~40: |q . k| ~ 1e5) while the scaled scores do not; before, the products were taken
    unscaled and every sparse kernel returned NaN (full attention gives numbers)."""
    rng = np.random.default_rng(6)
    q = (rng.normal(size=(1, N, H, 64)) * 40).astype("float16")
    k = (q + rng.normal(size=q.shape)).astype("float16")  # each query's own key stands out
    v = rng.normal(size=(1, N, H, 64)).astype("float16")
    assert np.isinf(np.einsum("bqhd,bkhd->bhqk", q, k)).any()  # (in float16)
    kind, opts = ea.check_attention(kind, options)
    got = to_numpy(ea.efficient_attention(q, k, v, kind, opts)).astype("float32")
    allowed = np_pattern(kind, N, {**options, **extra})[None]
    assert np.isfinite(got).all()
    assert_close(got, np_attention(q, k, v, allowed, empty_rows_uniform=False), atol=2e-3)


# === Longformer: more global tokens than max_global ===


def test_longformer_tokens_past_max_global_keep_their_band_rows(data):
    """With `max_global` (the bound compiled calls use) a row's first `max_global` global
    tokens are kept; the others are ordinary tokens. Before, their rows were zeros."""
    from kzoo.layers.sparse_attention import longformer_attention

    q, k, v, _ = data
    flags = np.zeros((B, N), bool)
    flags[0, [2, 8]] = True
    flags[1, [5, 6, 10]] = True
    flags[2, 20] = True
    kept = np.zeros((B, N), bool)
    kept[0, 2] = kept[1, 5] = kept[2, 20] = True
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    allowed = ((np.abs(i - j) < 2)[None] | kept[:, None, :] | kept[:, :, None])[:, None]
    got = longformer_attention(q, k, v, 2, flags, max_global=1)
    assert_close(got, np_attention(q, k, v, allowed, empty_rows_uniform=False), atol=2e-5)


def test_bigbird_sequence_shorter_than_its_global_blocks_is_full_attention(data, recwarn):
    """A 23-token input to a BigBird of global_blocks=4 in blocks of 8 (3 blocks): every
    block is global, i.e. full attention, with a warning; before, a ValueError at call."""
    q, k, v, padding = data
    kind, opts = ea.check_attention("bigbird", {"block_size": 8, "global_blocks": 4})
    with pytest.warns(UserWarning, match=r"`global_blocks`=4 is more than a sequence of 3 "):
        got = ea.efficient_attention(q, k, v, kind, opts, mask=padding)
    full = np.ones((1, 1, N, N), bool) & padding[:, None, None, :]
    assert_close(got, np_attention(q, k, v, full, empty_rows_uniform=False), atol=2e-5)
    # Every block global and no random block to draw: no random_blocks warning.
    assert not [w for w in recwarn if "random_blocks" in str(w.message)]
    assert bigbird_layout(1, global_blocks=1, random_blocks=2).all()
    assert not [w for w in recwarn if "random_blocks" in str(w.message)]


def test_longformer_global_rows_in_float16_stay_finite():
    """Hugging Face Longformer's global rows (global projections) in float16 with raw
    products past 65504; before, their scores overflowed to NaN."""
    rng = np.random.default_rng(7)
    n, heads = 10, 2
    key = (rng.normal(size=(1, n, heads, 64)) * 40).astype("float16")
    value = rng.normal(size=(1, n, heads, 64)).astype("float16")
    global_mask = np.zeros((1, n), bool)
    global_mask[0, [1, 6]] = True
    query = (key[:, [1, 6]] + rng.normal(size=(1, 2, heads, 64))).astype("float16")
    assert np.isinf(np.einsum("bghd,bnhd->bhgn", query, key)).any()  # (in float16)
    options = ea.check_attention("longformer", {"window": 2, "global_projections": True})[1]
    slots = ea.longformer_slots(options, n, 1, global_mask)
    out = np.zeros((1, n, heads, 64), "float16")
    got = to_numpy(ea.longformer_global_rows(query, key, value, slots, out)).astype("float32")
    expected = np.zeros(got.shape)
    expected[:, [1, 6]] = np_attention(query, key, value, np.ones((1, 1, 2, n), bool))
    assert np.isfinite(got).all()
    assert_close(got, expected, atol=2e-3)
