"""kzoo.interpret.analysis: attention entropy, rollout and flow.

Each number is checked against a formula written here (scipy's entropy per row, a plain loop
of matrix products for rollout, a linear program for max flow) on random softmax maps with
masks, and on maps recorded with a `Tap` from a tiny GPT on the current backend.
"""

import keras
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

import kzoo.presets
from kzoo.interpret import attention_entropy, attention_flow, attention_rollout
from kzoo.layers.taps import Tap


def softmax_maps(rng, layers, batch, heads, queries, keys=None, key_mask=None, causal=False,
                 sharp=1.0):
    """Random attention maps with the properties attention_maps guarantees: rows sum to 1,
    masked keys exactly 0, fully masked query rows all 0."""
    keys = queries if keys is None else keys
    allowed = np.ones((batch, 1, queries, keys), bool)
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    if causal:
        allowed &= np.tril(np.ones((queries, keys), bool))
    out = []
    for _ in range(layers):
        logits = sharp * rng.normal(size=(batch, heads, queries, keys))
        logits = np.where(allowed, logits, -np.inf)
        top = np.max(logits, -1, keepdims=True)
        e = np.where(allowed, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
        s = e.sum(-1, keepdims=True)
        out.append(np.divide(e, s, out=np.zeros_like(e), where=s > 0))
    return out


@pytest.fixture(scope="module")
def gpt_maps():
    """Maps recorded from a tiny GPT (2 layers, 2 heads) on this backend, right-padded."""
    keras.utils.set_random_seed(1)
    model = kzoo.presets.load("gpt_mini", num_layers=2, num_heads=2, hidden_dim=32,
                              intermediate_dim=64, vocabulary_size=50, max_sequence_length=16)
    ids = np.array([[5, 9, 13, 2, 7, 30, 4], [11, 3, 8, 21, 1, 1, 1]], "int32")
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3], bool)
    with Tap() as tap:
        model({"token_ids": ids, "padding_mask": mask})
    maps = [keras.ops.convert_to_numpy(r.weights).astype(np.float64)
            for r in tap.attention_records]
    return maps, mask


# === Entropy ===

def test_entropy_matches_scipy_per_row_with_masks():
    rng = np.random.default_rng(0)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], bool)
    maps = softmax_maps(rng, 2, 3, 4, 6, key_mask=mask, sharp=2.0)
    result = attention_entropy(maps, padding_mask=mask)
    assert result.per_query.shape == (2, 3, 4, 6) and result.per_head.shape == (2, 4)
    expected = np.full((2, 3, 4, 6), np.nan)
    for l in range(2):
        for b in range(3):
            for h in range(4):
                for i in range(6):
                    if mask[b, i]:
                        expected[l, b, h, i] = scipy.stats.entropy(maps[l][b, h, i][mask[b]])
    np.testing.assert_allclose(result.per_query, expected, rtol=1e-12, atol=1e-12)
    # per head: the mean over the batch and the real queries only
    means = np.array([[np.mean([expected[l, b, h, i] for b in range(3) for i in range(6)
                                if mask[b, i]]) for h in range(4)] for l in range(2)])
    np.testing.assert_allclose(result.per_head, means, rtol=1e-12)
    np.testing.assert_array_equal(result.query_mask, mask)


def test_entropy_limits_and_fully_masked_rows():
    # one-hot rows: 0 nats (0 log 0 = 0); uniform rows over n keys: log n; a zero row: NaN
    one_hot = np.zeros((1, 1, 3, 4))
    one_hot[0, 0, [0, 1, 2], [2, 0, 3]] = 1.0
    uniform = np.zeros((1, 1, 3, 4))
    uniform[0, 0, 0, :] = 0.25
    uniform[0, 0, 1, :2] = 0.5
    result = attention_entropy([np.concatenate([one_hot, uniform], axis=1)])
    np.testing.assert_array_equal(result.per_query[0, 0, 0], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(result.per_query[0, 0, 1, :2], [np.log(4), np.log(2)])
    # query 2 is a zero row in head 1 but real in head 0: it stays a real query, and head
    # 1 has no distribution there (as scipy.stats.entropy of a zero row: NaN, not 0 nats)
    assert result.query_mask.tolist() == [[True, True, True]]
    assert np.isnan(result.per_query[0, 0, 1, 2])
    np.testing.assert_allclose(result.per_head[0], [0.0, np.mean([np.log(4), np.log(2)])])
    zero_row = np.zeros((1, 1, 2, 2))
    zero_row[0, 0, 0, 0] = 1.0
    result = attention_entropy([zero_row])
    assert result.query_mask.tolist() == [[True, False]]
    assert np.isnan(result.per_query[0, 0, 0, 1]) and result.per_head[0, 0] == 0.0


def test_entropy_dict_for_t5_masks():
    rng = np.random.default_rng(1)
    enc_mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    dec_mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    maps = {
        "encoder": softmax_maps(rng, 2, 2, 2, 5, key_mask=enc_mask),
        "decoder": softmax_maps(rng, 2, 2, 2, 3, key_mask=dec_mask, causal=True),
        "cross": softmax_maps(rng, 2, 2, 2, 3, 5, key_mask=enc_mask),
    }
    result = attention_entropy(
        maps, padding_mask={"encoder_padding_mask": enc_mask, "decoder_padding_mask": dec_mask})
    assert set(result) == {"encoder", "decoder", "cross"}
    cross = result["cross"]
    assert cross.per_query.shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(cross.query_mask, dec_mask)
    row = maps["cross"][1][1, 0, 1][enc_mask[1]]
    np.testing.assert_allclose(cross.per_query[1, 1, 0, 1], scipy.stats.entropy(row))
    assert np.isnan(cross.per_query[1, 1, 0, 2])
    # decoder: causal rows, query 0 sees one key -> 0 nats
    np.testing.assert_allclose(result["decoder"].per_query[:, :, :, 0], 0.0, atol=1e-12)


def test_entropy_right_padded_gpt(gpt_maps):
    """A right-padded GPT's padded queries still attend (to the real keys): only the
    padding mask can exclude them."""
    maps, mask = gpt_maps
    result = attention_entropy({"self": maps}, padding_mask=mask)["self"]
    assert np.isnan(result.per_query[:, 1, :, 4:]).all()
    for l, layer in enumerate(maps):
        for h in range(layer.shape[1]):
            for i in range(4):
                row = layer[1, h, i, : i + 1]
                np.testing.assert_allclose(result.per_query[l, 1, h, i],
                                           scipy.stats.entropy(row), rtol=1e-6, atol=1e-7)


def test_entropy_of_head_masked_maps_is_that_of_each_heads_distribution(gpt_maps):
    # (maps of attention_maps(..., head_mask=...) scale a head's rows: a removed head read
    # as 0 nats, "looks at one token only", and a halved one as 0.5 H + 0.5 log 2)
    maps, mask = gpt_maps
    scale = np.array([[0.0, 1.0], [0.5, 1.0]])  # (layers, heads): as a head mask scales
    masked = [layer * scale[l][None, :, None, None] for l, layer in enumerate(maps)]
    result = attention_entropy(masked, padding_mask=mask)
    expected = np.full(result.per_query.shape, np.nan)
    for l, layer in enumerate(masked):
        for b in range(2):
            for h in range(2):
                for i in range(7):
                    if mask[b, i]:  # scipy normalises the row (NaN for a zero row)
                        with np.errstate(invalid="ignore"):
                            expected[l, b, h, i] = scipy.stats.entropy(layer[b, h, i][mask[b]])
    real = np.broadcast_to(mask[:, None, :], expected.shape[1:])  # (batch, heads, query)
    assert np.isnan(expected[0, :, 0]).all() and not np.isnan(expected[1][real]).any()
    np.testing.assert_allclose(result.per_query, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(result.query_mask, mask)
    seen = ~np.isnan(expected)
    counts = seen.sum(axis=(1, 3))
    per_head = np.where(seen, expected, 0.0).sum(axis=(1, 3)) / np.where(counts, counts, 1)
    per_head[counts == 0] = np.nan  # (a mean over the real queries; none for head 0 of 0)
    assert np.isnan(result.per_head[0, 0])
    np.testing.assert_allclose(result.per_head, per_head, rtol=1e-6, atol=1e-7)


# === Rollout ===

def reference_rollout(maps, fusion, residual):
    fuse = {"mean": np.mean, "max": np.max, "min": np.min}[fusion]
    batch, _, n, _ = maps[0].shape
    out = np.zeros((batch, n, n))
    for b in range(batch):
        total = np.eye(n)
        for layer in maps:
            a = fuse(layer[b], axis=0)
            if residual:
                a = a + np.eye(n)  # same as 0.5 a + 0.5 I after renormalising rows
            a = np.array([row / row.sum() if row.sum() > 0 else row for row in a])
            total = a @ total
        out[b] = total
    return out


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rollout_matches_loop_formula(fusion):
    rng = np.random.default_rng(2)
    maps = softmax_maps(rng, 3, 2, 3, 5)
    for residual in (True, False):
        got = attention_rollout(maps, head_fusion=fusion, residual=residual)
        np.testing.assert_allclose(got, reference_rollout(maps, fusion, residual), rtol=1e-12)
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-12)
    partial = attention_rollout(maps, head_fusion=fusion, return_all=True)
    assert partial.shape == (3, 2, 5, 5)
    np.testing.assert_allclose(partial[0], reference_rollout(maps[:1], fusion, True))
    np.testing.assert_allclose(partial[1], reference_rollout(maps[:2], fusion, True))


def test_rollout_causal_gpt_is_lower_triangular(gpt_maps):
    maps, _ = gpt_maps
    got = attention_rollout({"self": maps})["self"]
    np.testing.assert_allclose(got, reference_rollout(maps, "mean", True), rtol=1e-9)
    assert np.all(np.triu(got, k=1) == 0.0)
    flow = attention_flow(maps)
    assert np.all(np.triu(flow, k=1) == 0.0)
    np.testing.assert_allclose(flow.sum(-1), 1.0, rtol=1e-9)


def test_rollout_dict_leaves_cross_out():
    rng = np.random.default_rng(3)
    maps = {"encoder": softmax_maps(rng, 2, 1, 2, 4),
            "decoder": softmax_maps(rng, 2, 1, 2, 3, causal=True),
            "cross": softmax_maps(rng, 2, 1, 2, 3, 4)}
    got = attention_rollout(maps, head_fusion="max")
    assert set(got) == {"encoder", "decoder"}
    np.testing.assert_allclose(got["decoder"], reference_rollout(maps["decoder"], "max", True))
    assert np.all(np.triu(got["decoder"][0], k=1) == 0.0)


# === Flow ===

def test_flow_on_a_hand_checked_graph():
    # 2 layers, 2 tokens, 1 head, no residual: layer 1 [[1, 0], [.5, .5]], layer 2
    # [[1, 0], [.25, .75]]. Output 1 -> input 0: via mid 0: min(.25, 1) = .25; via mid 1:
    # min(.75, .5) = .5; total .75. Output 1 -> input 1: only via mid 1: min(.75, .5) = .5.
    a1 = np.array([[1.0, 0.0], [0.5, 0.5]])[None, None]
    a2 = np.array([[1.0, 0.0], [0.25, 0.75]])[None, None]
    flow = attention_flow([a1, a2], residual=False, normalize=False)
    np.testing.assert_allclose(flow[0], [[1.0, 0.0], [0.75, 0.5]], atol=1e-12)
    np.testing.assert_allclose(attention_flow([a1, a2], residual=False)[0],
                               [[1.0, 0.0], [0.6, 0.4]], atol=1e-12)
    # rollout multiplies instead: [[1, 0], [.25 + .75 * .5, .75 * .5]]
    np.testing.assert_allclose(attention_rollout([a1, a2], residual=False)[0],
                               [[1.0, 0.0], [0.625, 0.375]], atol=1e-12)


def lp_max_flow(layers, source, sink):
    """Max flow by linear programming (scipy), on the layered graph attention_flow uses:
    node (level, i) -> (level - 1, j) with capacity layers[level - 1][i, j]."""
    edges, caps = [], []
    for level, a in enumerate(layers, start=1):
        for i, j in zip(*np.nonzero(a > 0)):
            edges.append(((level, i), (level - 1, j)))
            caps.append(a[i, j])
    nodes = sorted({u for e in edges for u in e} - {source, sink})
    a_eq = np.zeros((len(nodes), len(edges)))
    for k, (u, v) in enumerate(edges):
        if u in nodes:
            a_eq[nodes.index(u), k] -= 1
        if v in nodes:
            a_eq[nodes.index(v), k] += 1
    gain = np.array([(u == source) - (v == source) for u, v in edges], float)
    res = scipy.optimize.linprog(-gain, A_eq=a_eq, b_eq=np.zeros(len(nodes)),
                                 bounds=list(zip([0.0] * len(edges), caps)), method="highs")
    assert res.status == 0
    return -res.fun


def test_flow_matches_linear_program():
    rng = np.random.default_rng(4)
    maps = softmax_maps(rng, 3, 1, 2, 4, sharp=2.0)
    flow = attention_flow(maps, residual=True, normalize=False)
    fused = [np.mean(m[0], axis=0) * 0.5 + 0.5 * np.eye(4) for m in maps]
    fused = [a / a.sum(-1, keepdims=True) for a in fused]
    expected = np.array([[lp_max_flow(fused, (3, i), (0, j)) for j in range(4)]
                         for i in range(4)])
    np.testing.assert_allclose(flow[0], expected, rtol=1e-7, atol=1e-9)


# === Bad arguments ===

def test_bad_arguments_raise_value_errors():
    rng = np.random.default_rng(5)
    maps = softmax_maps(rng, 2, 1, 2, 4)
    with pytest.raises(ValueError, match="head_fusion.*'median'"):
        attention_rollout(maps, head_fusion="median")
    with pytest.raises(ValueError, match="head_fusion"):
        attention_flow(maps, head_fusion="sum")
    with pytest.raises(ValueError, match=r"rank 4.*rank 3"):
        attention_entropy([maps[0][0]])
    with pytest.raises(ValueError, match=r"maps`\[1\] has shape"):
        attention_rollout([maps[0], maps[1][:, :, :3, :3]])
    with pytest.raises(ValueError, match="unknown key.*'selff'"):
        attention_rollout({"selff": maps})
    with pytest.raises(ValueError, match="square"):
        attention_rollout([m[:, :, :3] for m in maps])
    with pytest.raises(ValueError, match=r"padding_mask.*\(1, 4\).*\(1, 3\)"):
        attention_entropy(maps, padding_mask=np.ones((1, 3), bool))
    with pytest.raises(ValueError, match="max_tokens`=3"):
        attention_flow(maps, max_tokens=3)
    with pytest.raises(ValueError, match="non-empty list"):
        attention_entropy([])
