"""Efficient attention inside the models (issue #16, item 3): the `attention` /
`attention_options` fields of BERT, GPT and ViT, `presets.load(..., attention=..., window=...)`,
the rolling sliding-window cache and the recurrent linear state in decoding.

References: transformers' Mistral and Mixtral (sliding-window attention, eager), full attention
under an explicit NumPy mask of each pattern, and NumPy formulas of linear attention written
here. The kernels themselves are checked in test_sparse_attention.py / test_linear_attention.py.
"""

import os

import keras
import numpy as np
import pytest

import kzoo
from kzoo.interpret import attention_maps
from kzoo.layers import MultiHeadAttention, bigbird_layout
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from tests.harness import assert_same_hf_tensors
from tests.helpers import assert_close, to_numpy
from tests.test_gpt import _assert_gpt_matches, _hf_modern, _right_padded

N, DIM, HEADS, KV_HEADS = 13, 16, 4, 2


# === NumPy references ===


def _np_projections(layer, x):
    """q (b, n, h, d), k and v (b, n, kv, d) of a built layer, in NumPy."""
    w = {name: to_numpy(getattr(layer, name).kernel) for name in
         ("query_dense", "key_dense", "value_dense")}
    b = {name: to_numpy(getattr(layer, name).bias) for name in w}
    d = layer._head_dim
    q = (x @ w["query_dense"] + b["query_dense"]).reshape(x.shape[0], x.shape[1], -1, d)
    k = (x @ w["key_dense"] + b["key_dense"]).reshape(x.shape[0], x.shape[1], -1, d)
    v = (x @ w["value_dense"] + b["value_dense"]).reshape(x.shape[0], x.shape[1], -1, d)
    rep = q.shape[2] // k.shape[2]
    return q, np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)


def _np_output(layer, out):
    b, n = out.shape[:2]
    return (out.reshape(b, n, -1) @ to_numpy(layer.output_dense.kernel)
            + to_numpy(layer.output_dense.bias))


def _np_linear_mha(layer, x, padding, feature):
    """Causal normalised linear attention, the explicit quadratic form:
    out_i = sum_{j<=i, j real} (f(q_i).f(k_j)) v_j / sum_{j<=i, j real} f(q_i).f(k_j)."""
    q, k, v = _np_projections(layer, x)
    fq, fk = feature(q), feature(k)
    a = np.einsum("bqhm,bkhm->bhqk", fq, fk)
    allowed = np.tril(np.ones((x.shape[1], x.shape[1]), bool))[None, None] & \
        padding[:, None, None, :]
    a = np.where(allowed, a, 0.0)
    den = a.sum(-1, keepdims=True)
    w = np.where(den > 0, a / np.where(den > 0, den, 1.0), 0.0)
    return _np_output(layer, np.einsum("bhqk,bkhd->bqhd", w, v))


def _elu_feature(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _favor_feature(projection, scale):
    def feature(x):  # Choromanski et al. 2021: exp(w.x - |x|^2 / 2) / sqrt(m), x scaled
        xs = x * np.sqrt(scale)
        return np.exp(xs @ projection.T - 0.5 * (xs ** 2).sum(-1, keepdims=True)) / np.sqrt(
            projection.shape[0])
    return feature


def _np_pattern(kind, n, causal, **options):
    """The boolean (n, n) pattern of a sparse type, written out from the papers."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    if kind == "sliding_window":
        allowed = np.abs(i - j) < options["window"]
    elif kind == "strided":
        s = options["stride"]
        allowed = (np.abs(i - j) < s) | ((i - j) % s == 0)
    elif kind == "longformer":
        g = np.zeros(n, bool)
        g[:options["global_tokens"]] = True
        allowed = (np.abs(i - j) < options["window"]) | g[None, :] | g[:, None]
    else:  # block layouts
        layout, block = options["layout"], options["block_size"]
        allowed = layout[i // block, j // block]
    return allowed & (j <= i) if causal else allowed


def _padding(batch=2, n=N, pad=3):
    mask = np.ones((batch, n), bool)
    mask[1, -pad:] = False
    return mask


def _copy_weights(dst, src):
    for a, b in zip(dst.weights, src.weights):
        a.assign(b.value)


# === Layer level: every type against full attention under its pattern ===


BLOCK_LAYOUT = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 1], [0, 1, 0, 1]], bool)
SPARSE_CASES = [
    ("sliding_window", {"window": 3}),
    ("strided", {"stride": 4}),
    ("longformer", {"window": 2, "global_tokens": 2}),
    ("block_sparse", {"block_size": 4, "layout": BLOCK_LAYOUT.tolist()}),
    ("bigbird", {"block_size": 4, "window_blocks": 3, "global_blocks": 1, "random_blocks": 1,
                 "seed": 5}),
]


@pytest.mark.spread
@pytest.mark.parametrize("kind, options", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sparse_layer_equals_full_attention_under_its_pattern(kind, options, causal):
    x = np.random.default_rng(1).normal(size=(2, N, DIM)).astype("float32")
    padding = _padding()
    layer = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, attention=kind,
                               attention_options=options)
    full = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS)
    layer.build(x.shape)
    full.build(x.shape)
    _copy_weights(full, layer)
    if kind == "bigbird":
        pattern_options = {"layout": bigbird_layout(
            4, window_blocks=3, global_blocks=1, random_blocks=1, seed=5, causal=causal)[0],
            "block_size": 4}
    elif kind == "block_sparse":
        pattern_options = {"layout": BLOCK_LAYOUT, "block_size": 4}
    else:
        pattern_options = options
    pattern = _np_pattern(kind, N, causal, **pattern_options)
    dense = pattern[None, None] & padding[:, None, None, :]
    expected = full(x, attention_mask=dense)
    got = layer(x, attention_mask=padding, use_causal_mask=causal)
    rows = padding  # rows of padded queries differ (no key) only where nothing is visible
    assert_close(to_numpy(got)[rows], to_numpy(expected)[rows], atol=2e-5)
    # Gradients flow through the efficient path to every projection.
    assert all(np.isfinite(to_numpy(w)).all() for w in layer.weights)


@pytest.mark.spread
@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_linear_layer_equals_numpy_and_decodes_with_a_constant_state(kind):
    x = np.random.default_rng(2).normal(size=(2, N, DIM)).astype("float32")
    padding = _padding()
    options = {} if kind == "linear" else {"num_features": 32, "seed": 3}
    layer = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, attention=kind,
                               attention_options=options)
    got = layer(x, attention_mask=padding, use_causal_mask=True)
    if kind == "linear":
        feature = _elu_feature
    else:
        feature = _favor_feature(layer._projection, layer._head_dim ** -0.5)
    expected = _np_linear_mha(layer, x, padding, feature)
    assert_close(got, expected, atol=2e-5)
    # Decoding: a 5-token prompt, then one token a step, on the O(1) state (S, z).
    state = layer.init_cache(2, 10_000)
    features = 4 if kind == "linear" else 32  # elu: head_dim; FAVOR+: num_features
    assert [tuple(t.shape) for t in state] == [(2, KV_HEADS, features, 4), (2, KV_HEADS,
                                                                            features)]
    out, state = layer(x[:, :5], attention_mask=padding, use_causal_mask=True, cache=state,
                       cache_index=0)
    steps = [out]
    for t in range(5, N):
        out, state = layer(x[:, t:t + 1], attention_mask=padding, use_causal_mask=True,
                           cache=state, cache_index=t)
        steps.append(out)
        assert tuple(state[0].shape) == (2, KV_HEADS, features, 4)
    assert_close(np.concatenate([to_numpy(s) for s in steps], axis=1), expected, atol=2e-5)


def test_rolling_cache_holds_window_slots_and_equals_the_band():
    window = 4
    x = np.random.default_rng(3).normal(size=(2, N, DIM)).astype("float32")
    padding = np.ones((2, N), bool)
    padding[1, :3] = False  # left padding, as generate lays prompts out
    layer = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, attention="sliding_window",
                               attention_options={"window": window}, rope_max_wavelength=100)
    full = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, rope_max_wavelength=100)
    layer.build(x.shape)
    full.build(x.shape)
    _copy_weights(full, layer)
    dense = _np_pattern("sliding_window", N, True, window=window)[None, None] & \
        padding[:, None, None, :]
    expected = to_numpy(full(x, attention_mask=dense))
    for prompt in (3, 6):  # shorter and longer than the window
        cache = layer.init_cache(2, 10_000)
        assert tuple(cache.shape) == (2, 2, KV_HEADS, window, 4)  # not 10_000
        out, cache = layer(x[:, :prompt], attention_mask=padding, use_causal_mask=True,
                           cache=cache, cache_index=0)
        steps = [to_numpy(out)]
        for t in range(prompt, N):
            out, cache = layer(x[:, t:t + 1], attention_mask=padding, use_causal_mask=True,
                               cache=cache, cache_index=t)
            steps.append(to_numpy(out))
        got = np.concatenate(steps, axis=1)
        assert_close(got[1, 3:], expected[1, 3:], atol=2e-5)
        assert_close(got[0], expected[0], atol=2e-5)


# Patterns that depend on where the tokens are, not only on how far apart (global tokens,
# blocks): `generate` left-pads prompts (to a multiple of 8), which must not move them.
POSITIONAL_CASES = [c for c in SPARSE_CASES if c[0] in ("longformer", "block_sparse")] + [
    ("bigbird", {"block_size": 2, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1,
                 "seed": 5})]


@pytest.mark.spread
@pytest.mark.parametrize("kind, options", POSITIONAL_CASES,
                         ids=[c[0] for c in POSITIONAL_CASES])
def test_decoding_lays_the_pattern_on_a_left_padded_rows_tokens(kind, options):
    pad = 3  # row 1: 3 pad slots in front, its tokens at positions 0, 1, ... after them
    x = np.random.default_rng(4).normal(size=(2, N, DIM)).astype("float32")
    padding = np.ones((2, N), bool)
    padding[1, :pad] = False
    layer = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, attention=kind,
                               attention_options=options)
    full = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS)
    layer.build(x.shape)
    full.build(x.shape)
    _copy_weights(full, layer)
    if kind == "bigbird":
        pattern_options = {"layout": bigbird_layout(
            -(-N // 2), **{k: v for k, v in options.items() if k != "block_size"},
            causal=True)[0], "block_size": 2}
    elif kind == "block_sparse":
        pattern_options = {"layout": BLOCK_LAYOUT, "block_size": 4}
    else:
        pattern_options = options
    dense = np.zeros((2, 1, N, N), bool)
    dense[0, 0] = _np_pattern(kind, N, True, **pattern_options)
    dense[1, 0, pad:, pad:] = _np_pattern(kind, N - pad, True, **pattern_options)
    expected = to_numpy(full(x, attention_mask=dense))
    shift = np.array([0, pad], "int32")
    cache = layer.init_cache(2, N)
    prompt = 5
    out, cache = layer(x[:, :prompt], attention_mask=padding, use_causal_mask=True,
                       cache=cache, cache_index=0, position_index=0 - shift)
    steps = [to_numpy(out)]
    for t in range(prompt, N):
        out, cache = layer(x[:, t:t + 1], attention_mask=padding, use_causal_mask=True,
                           cache=cache, cache_index=t, position_index=t - shift)
        steps.append(to_numpy(out))
    got = np.concatenate(steps, axis=1)
    assert_close(got[0], expected[0], atol=2e-5)
    assert_close(got[1, pad:], expected[1, pad:], atol=2e-5)
    # `generate` (prompts of 7 and 3 tokens, left-padded to 8 slots): each new token is the
    # argmax of the model's forward pass on the prompt and the tokens before it, unpadded.
    layout = {"layout": np.eye(6, dtype=bool) | np.eye(6, k=-2, dtype=bool)} \
        if kind == "block_sparse" else {}
    backbone = GPTBackbone(vocabulary_size=50, num_layers=1, num_heads=4, hidden_dim=16,
                           intermediate_dim=32, max_sequence_length=32, dropout=0.0,
                           initializer_range=0.5, attention=kind,
                           attention_options={**options, **layout})
    lm = GPTCausalLM(backbone)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 12]]
    for prompt, tokens in zip(prompts, lm.generate(prompts, max_new_tokens=8,
                                                    stop_token_ids=None)):
        ids = np.array([prompt + tokens], "int32")
        logits = to_numpy(lm({"token_ids": ids, "padding_mask": np.ones_like(ids)}))
        assert tokens == np.argmax(logits[0, len(prompt) - 1:-1], axis=-1).tolist()
    if kind == "block_sparse":  # the layout covers 24 tokens: 7 + 17, not the 8 + 17 slots
        assert len(lm.generate([prompts[0]], max_new_tokens=17, stop_token_ids=None)[0]) == 17
        with pytest.raises(ValueError, match=r"max_new_tokens=18 exceeds the 24 tokens that "
                           r"the attention option `layout` covers"):
            lm.generate([prompts[0]], max_new_tokens=18)


# === Decoding on a cache equals the forward pass without one, at every step ===


DECODE_CASES = SPARSE_CASES + [
    # Global tokens past a short prefix (a count of 4 on a 3-token prompt; position 9), and
    # `max_global` below the count (it bounds call-time masks only: every option token stays).
    ("longformer", {"window": 2, "global_tokens": 4, "block_size": 4, "max_global": 1}),
    ("longformer", {"window": 2, "global_tokens": [2, 9]}),
]


def _np_global_flags(n, global_tokens):
    flags = np.zeros(n, bool)
    flags[list(global_tokens) if isinstance(global_tokens, list) else slice(global_tokens)] = 1
    return flags


# Each case on one backend (`spread`): with the prefix checks the seven cases took ~80 s on
# JAX; the decode paths are the same code on the three backends.
@pytest.mark.spread
@pytest.mark.parametrize("kind, options", DECODE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(DECODE_CASES)])
def test_cache_decoding_equals_the_forward_pass_at_every_step(kind, options):
    """Greedy decoding runs a 3-token prompt, then one token a step, on the cache. Each step's
    output (and, with return_attention_weights, its weights) must equal the last row of the
    forward pass without a cache on the tokens so far (checked on prefixes of 1, 3, 6, 10 and
    13 tokens), and a NumPy softmax under the type's causal pattern. A causal longformer
    refused the prefixes shorter than its global positions ("asks for more global tokens
    than the sequence has", "positions must lie in [0, n)") that decoding took."""
    x = np.random.default_rng(7).normal(size=(2, N, DIM)).astype("float32")
    layer = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, attention=kind,
                               attention_options=options)
    layer.build(x.shape)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    if kind == "longformer":
        flags = _np_global_flags(N, options["global_tokens"])
        pattern = (np.abs(i - j) < options["window"]) | flags[None, :] | flags[:, None]
    elif kind == "bigbird":
        pattern = bigbird_layout(4, **{k: v for k, v in options.items() if k != "block_size"},
                                 causal=True)[0][i // 4, j // 4]
    elif kind == "block_sparse":
        pattern = BLOCK_LAYOUT[i // 4, j // 4]
    else:
        pattern = _np_pattern(kind, N, False, **options)
    pattern &= j <= i
    q, k, v = _np_projections(layer, x)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(pattern, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = _np_output(layer, np.einsum("bhqk,bkhd->bqhd", weights, v))
    prompt = 3
    for return_weights in (False, True):
        cache = layer.init_cache(2, N)
        got = layer(x[:, :prompt], use_causal_mask=True, cache=cache, cache_index=0,
                    return_attention_weights=return_weights)
        steps, cache = [to_numpy(got[0])], got[-1]
        for t in range(prompt, N):
            got = layer(x[:, t:t + 1], use_causal_mask=True, cache=cache, cache_index=t,
                        return_attention_weights=return_weights)
            steps.append(to_numpy(got[0]))
            cache = got[-1]
            if return_weights:  # (the cache's N slots: those after t weigh nothing)
                keys = np.arange(N)
                if kind == "sliding_window":  # a rolling cache: slot s holds the position
                    keys = t - (t - np.arange(options["window"])) % options["window"]
                assert_close(to_numpy(got[1])[:, :, 0], weights[:, :, t, keys], atol=1e-5)
        assert_close(np.concatenate(steps, axis=1), expected, atol=1e-5)
    for t in (1, 3, 6, 10, N):  # the forward pass on prefixes, without a cache
        out, prefix_weights = layer(x[:, :t], use_causal_mask=True,
                                    return_attention_weights=True)
        assert_close(to_numpy(out), expected[:, :t], atol=1e-5)
        assert_close(to_numpy(layer(x[:, :t], use_causal_mask=True)), expected[:, :t],
                     atol=1e-5)
        assert_close(to_numpy(prefix_weights), weights[:, :, :t, :t], atol=1e-5)


def test_longformer_cache_refuses_a_call_time_global_mask():
    """A cache keeps no record of which keys a call's `global_attention_mask` made global:
    decoding with one ignored it (4.2 away from the forward pass with the mask); it is
    refused, naming the mask and the option that decoding reads."""
    x = np.random.default_rng(8).normal(size=(2, 6, DIM)).astype("float32")
    layer = MultiHeadAttention(HEADS, attention="longformer",
                               attention_options={"window": 2, "global_tokens": 0})
    global_mask = np.zeros((2, 6), bool)
    global_mask[:, 1] = True
    layer.build(x.shape)
    cache = layer.init_cache(2, 6)
    with pytest.raises(ValueError, match=r"`global_attention_mask` cannot be used with a "
                       r"decoding `cache`.*`global_tokens`.*shape \(2, 4\)"):
        layer(x[:, :4], use_causal_mask=True, cache=cache, cache_index=0,
              global_attention_mask=global_mask[:, :4])
    # Without a cache the same mask is read.
    assert tuple(layer(x, use_causal_mask=True, global_attention_mask=global_mask).shape) == (
        2, 6, DIM)


# === GPT: Mistral / Mixtral sliding windows against transformers ===


@pytest.mark.parametrize("model_type", ["mistral", "mixtral"])
def test_hf_sliding_window_parity_and_round_trip(model_type, tmp_path):
    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    hf = _hf_modern(src, model_type, sliding_window=3)
    model = kzoo.presets.load(src)
    backbone = model.backbone
    assert backbone.attention == "sliding_window"
    assert backbone.attention_options["window"] == 3
    ids, mask = _right_padded()
    _assert_gpt_matches(model, hf, ids, mask, f"{model_type} sliding_window=3")
    kzoo.presets.save(model, out, format="hf")
    assert_same_hf_tensors(src, out)
    with open(os.path.join(out, "config.json")) as f:
        assert '"sliding_window": 3' in f.read()


def test_mistral_greedy_generation_on_the_rolling_cache(tmp_path):
    import torch

    hf = _hf_modern(tmp_path, "mistral", sliding_window=4, initializer_range=0.3)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3], [29, 8, 50, 90, 12]]
    alone = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), do_sample=False, max_new_tokens=16,
                pad_token_id=0)
        alone.append(out[0, len(prompt):].tolist())
    ours = model.generate(prompts, max_new_tokens=16, stop_token_ids=[96])
    assert ours == alone
    assert len({tuple(o) for o in ours}) == 3
    caches = model.backbone.init_cache(3, 5000, per_layer=True)
    assert all(tuple(c.shape) == (3, 2, 2, 4, 8) for c in caches)


@pytest.mark.spread
def test_linear_gpt_generation_equals_the_forward_pass():
    backbone = GPTBackbone(vocabulary_size=50, num_layers=2, num_heads=4, hidden_dim=16,
                           intermediate_dim=32, max_sequence_length=64, dropout=0.0,
                           position="rotary", num_kv_heads=2, initializer_range=0.5,
                           attention="performer", attention_options={"num_features": 16})
    lm = GPTCausalLM(backbone)
    prompt = [5, 6, 7, 8, 9, 10]
    tokens = lm.generate([prompt], max_new_tokens=8)[0]
    ids = np.array([prompt + tokens], "int32")
    logits = to_numpy(lm({"token_ids": ids, "padding_mask": np.ones_like(ids)}))
    # Each generated token is the argmax of the full (non-cached) forward pass there.
    assert tokens == [int(t) for t in np.argmax(logits[0, len(prompt) - 1:-1], axis=-1)]
    state = backbone.init_cache(1, 100_000, per_layer=True)
    assert all(tuple(s.shape) == (1, 2, 16, 4) and tuple(z.shape) == (1, 2, 16)
               for s, z in state)


# === BERT, GPT and ViT through presets.load ===


def test_presets_load_attention_overrides_and_errors():
    lm = kzoo.presets.load("gpt_mini", attention="sliding_window", window=8, num_layers=1)
    assert lm.backbone.config.attention == "sliding_window"
    assert lm.backbone.config.attention_options == {"window": 8, "block_size": None}
    same = kzoo.presets.load("gpt_long_mini", window=64, num_layers=1)  # updates the options
    assert same.backbone.attention_options["window"] == 64
    switched = kzoo.presets.load("gpt_long_mini", attention="linear", num_layers=1)
    assert switched.backbone.attention_options == {"feature_map": "elu", "num_features": None,
                                                   "seed": 0}
    bad = [
        (dict(attention="sliding_window", window=0), "`window`"),
        (dict(attention="sliding_window"), "`window`"),
        (dict(attention="performer", num_features=0), "`num_features`"),
        (dict(attention="linear", window=4), "window"),
        (dict(attention="flash"), "`attention`"),
        (dict(attention="sliding_window", window=8, block_size=4), "`block_size`"),
        (dict(attention="block_sparse", block_size=4, layout=[[1, 0]]), "`layout`"),
    ]
    for overrides, named in bad:
        with pytest.raises(ValueError, match=named.replace("`", "`?")):
            kzoo.presets.load("gpt_mini", num_layers=1, **overrides)
    for family, name in (("bert", "bert_tiny_uncased"),
                         ("vit", "vit_tiny_patch16_224")):
        with pytest.raises(ValueError, match="window"):
            kzoo.presets.load(name, attention="sliding_window", window=-2)
    # An option of other attention types names them; `seed` points to the weights' seed.
    with pytest.raises(ValueError, match=r"'seed' is an option of attention=\['bigbird', "
                       r"'linear', 'performer'\].*keras.utils.set_random_seed"):
        kzoo.presets.load("gpt_mini", num_layers=1, seed=1)
    with pytest.raises(ValueError, match=r"'window' is an option of attention=\["
                       r"'sliding_window', 'longformer'\]\.$"):
        kzoo.presets.load("gpt_mini", num_layers=1, attention="linear", window=4)


def test_call_time_errors_name_the_problem():
    layer = MultiHeadAttention(2, attention="longformer",
                               attention_options={"window": 2, "global_tokens": 9})
    x = np.zeros((1, 6, 8), "float32")
    with pytest.raises(ValueError, match="global_tokens"):
        layer(x)
    sliding = MultiHeadAttention(2, attention="sliding_window",
                                 attention_options={"window": 2})
    with pytest.raises(ValueError, match="attention_bias"):
        sliding(x, attention_bias=np.zeros((1, 2, 6, 6), "float32"))
    with pytest.raises(ValueError, match="key padding mask"):
        sliding(x, attention_mask=np.ones((1, 6, 6), bool))
    block = MultiHeadAttention(2, attention="block_sparse", attention_options={
        "block_size": 2, "layout": np.eye(2, dtype=bool).tolist()})
    with pytest.raises(ValueError, match="layout"):
        block(x)  # 6 tokens are 3 blocks; the layout has 2


COVERING = {  # patterns that hide no key for the 17-token inputs below
    "sliding": ("sliding_window", {"window": 64}),
    "longformer": ("longformer", {"window": 1, "global_tokens": list(range(17))}),
    "block_sparse": ("block_sparse", {"block_size": 8,
                                      "layout": np.ones((1, 3, 3), bool).tolist()}),
}
COVERING_CASES = [("bert", "sliding"), ("gpt", "sliding"), ("vit", "sliding"),
                  ("bert", "longformer"), ("vit", "longformer"), ("gpt", "block_sparse")]


@pytest.mark.spread
@pytest.mark.parametrize("family, case", COVERING_CASES,
                         ids=[f"{f}-{c}" for f, c in COVERING_CASES])
def test_patterns_that_cover_every_key_equal_full_attention(family, case):
    """Through each family's whole model: an efficient type whose pattern hides nothing
    gives the full model's outputs (padding and causality still applied)."""
    kind, options = COVERING[case]
    rng = np.random.default_rng(4)
    if family == "vit":
        name, extra = "vit_tiny_patch16_224", dict(image_size=16, patch_size=4, num_layers=1,
                                                   hidden_dim=16, num_heads=2,
                                                   intermediate_dim=32)
        inputs = rng.normal(size=(2, 16, 16, 3)).astype("float32")  # 17 tokens
    else:
        name = "bert_tiny_uncased" if family == "bert" else "gpt_mini"
        extra = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32,
                     vocabulary_size=40, max_sequence_length=32)
        ids = rng.integers(1, 40, (2, 17)).astype("int32")
        mask = np.ones_like(ids)
        mask[1, 12:] = 0
        inputs = {"token_ids": ids, "padding_mask": mask}
        if family == "bert":
            inputs["segment_ids"] = np.zeros_like(ids)
    full = kzoo.presets.load(name, task="backbone", **extra)
    sparse = kzoo.presets.load(name, task="backbone", attention=kind,
                               attention_options=options, **extra)
    _copy_weights(sparse, full)
    a, b = full(inputs), sparse(inputs)
    if isinstance(a, dict):
        a, b = a["sequence_output"], b["sequence_output"]
    a, b = to_numpy(a), to_numpy(b)
    if family != "vit":
        real = inputs["padding_mask"].astype(bool)
        a, b = a[real], b[real]
    assert_close(b, a, atol=2e-5)


def test_sliding_window_decoding_weights_are_in_rolling_slot_order():
    """A sliding-window GPT decoding one token a call hands its taps (and returns) weights
    over the rolling cache's `window` slots in slot order, not in position order: slot `s`
    holds position `t - ((t - s) mod window)` at query position `t`. Mapped back by that
    formula, each step's row is row `t` of the full forward pass's weights (which has no
    weight outside those positions); the prompt's weights are in position order."""
    from kzoo.layers.taps import Tap

    window, n, prompt = 3, 6, 2
    backbone = GPTBackbone(vocabulary_size=24, num_layers=1, num_heads=2, hidden_dim=16,
                           intermediate_dim=32, max_sequence_length=n, dropout=0.0,
                           attention="sliding_window", attention_options={"window": window})
    ids = np.random.default_rng(4).integers(0, 24, (2, n)).astype("int32")
    with Tap() as full:
        backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    expected = to_numpy(full.attention_records[0].weights)  # (batch, heads, n, n)
    cache = backbone.init_cache(2, n)
    with Tap() as tap:
        _, cache = backbone.call_with_cache(ids[:, :prompt], cache, 0)
        for t in range(prompt, n):
            _, cache = backbone.call_with_cache(ids[:, t:t + 1], cache, t)
    prefill, *steps = [to_numpy(r.weights) for r in tap.attention_records]
    assert_close(prefill, expected[:, :, :prompt, :prompt], atol=1e-5)
    assert len(steps) == n - prompt
    shuffled = 0
    for t, got in zip(range(prompt, n), steps):
        assert got.shape == (2, 2, 1, window)
        held = t - (t - np.arange(window)) % window  # the position in each slot
        assert_close(expected[:, :, t, held].sum(-1), np.ones((2, 2)), atol=1e-5)
        assert_close(got[:, :, 0], expected[:, :, t, held], atol=1e-5)
        shuffled += list(held) != sorted(held)
    assert shuffled == 2  # (t = 3, 4: slot order is not position order)


@pytest.mark.spread
def test_sliding_window_gpt_saves_taps_and_fits(tmp_path):
    lm = kzoo.presets.load("gpt_long_mini", num_layers=1, hidden_dim=16, num_heads=2,
                           num_kv_heads=1, intermediate_dim=32, window=3)
    ids = np.random.default_rng(5).integers(0, 260, (2, 12)).astype("int32")
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    before = to_numpy(lm(inputs))
    lm.save(os.path.join(tmp_path, "m.keras"))
    again = kzoo.presets.load(os.path.join(tmp_path, "m.keras"))
    assert again.backbone.attention_options["window"] == 3
    assert_close(again(inputs), before)
    kzoo.presets.save(lm, os.path.join(tmp_path, "dir"))
    assert_close(kzoo.presets.load(os.path.join(tmp_path, "dir"))(inputs), before)
    # The maps a tap records are the band: nothing outside it, rows summing to one.
    maps = to_numpy(attention_maps(lm, inputs)["self"][0])
    i, j = np.arange(12)[:, None], np.arange(12)[None, :]
    outside = ~((j <= i) & (i - j < 3))
    assert np.all(maps[..., outside] == 0)
    assert_close(maps.sum(-1), np.ones(maps.shape[:-1]))
    lm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="auto")
    x, y, w = lm.lm_batch(ids)
    losses = [lm.train_on_batch(x, y, sample_weight=w) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.spread
@pytest.mark.parametrize("kind", ["sliding_window", "strided", "longformer", "bigbird",
                                  "linear", "performer", "chunked kernel"])
def test_compiled_functions_take_a_new_sequence_length(kind):
    """predict / train / evaluate at three sequence lengths in a row, each prediction equal to
    the model's direct call at that length. Keras traces TensorFlow's step functions with
    relaxed shapes from the second shape on, and the length-shaped layouts of these
    attentions (and the chunked kernel's blocks) raised there."""
    options = {"sliding_window": dict(attention="sliding_window", window=4),
               "strided": dict(attention="strided", stride=4),
               "longformer": dict(attention="longformer", window=4, global_tokens=1),
               "bigbird": dict(attention="bigbird", block_size=4),
               "linear": dict(attention="linear"), "performer": dict(attention="performer"),
               "chunked kernel": {}}[kind]
    lm = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                           intermediate_dim=32, vocabulary_size=50, max_sequence_length=32,
                           **options)
    if kind == "chunked kernel":
        for block in lm.backbone.transformer_layers:
            block.self_attention.kernel = "chunked"
    assert lm._needs_static_shapes
    lm.compile(optimizer=keras.optimizers.Adam(1e-3), loss="auto")
    rng = np.random.default_rng(6)
    for length in (16, 8, 12):
        ids = rng.integers(0, 50, (2, length)).astype("int32")
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        assert_close(lm.predict_on_batch(x), to_numpy(lm(x)), atol=1e-5, rtol=1e-5)
        assert np.isfinite(lm.train_on_batch(x, ids))
        assert np.isfinite(lm.test_on_batch(x, ids))
    full = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                             intermediate_dim=32, vocabulary_size=50)
    assert not full._needs_static_shapes
    if kind == "chunked kernel":  # the kernel asked for everywhere (`set_attention_kernel`)
        from kzoo.layers import set_attention_kernel

        set_attention_kernel("chunked")
        try:
            assert full._needs_static_shapes
            for length in (16, 8):
                ids = rng.integers(0, 50, (2, length)).astype("int32")
                assert_close(full.predict_on_batch({"token_ids": ids}),
                             to_numpy(full({"token_ids": ids})), atol=1e-5, rtol=1e-5)
        finally:
            set_attention_kernel(None)


# === Longformer: per-row global masks in compiled functions, and no global token ===


def _compiled(fn):
    """`fn` compiled the way the backend compiles a training step (torch runs eagerly)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf
        return tf.function(fn)
    return fn


def _longformer_rows_pattern(global_mask, window):
    """(b, 1, n, n): |i - j| < window, or i or j a global token of that row."""
    n = global_mask.shape[1]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    band = np.abs(i - j) < window
    g = global_mask[:, None, :, None] | global_mask[:, None, None, :]
    return band[None, None] | g


def test_longformer_global_mask_compiles_with_max_global_slots():
    x = np.random.default_rng(3).normal(size=(2, N, DIM)).astype("float32")
    global_mask = np.zeros((2, N), bool)
    global_mask[0, [0, 5]] = True
    global_mask[1, 3] = True
    options = {"window": 2, "max_global": 2}
    layer = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, attention="longformer",
                               attention_options=options)
    full = MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS)
    layer.build(x.shape)
    full.build(x.shape)
    _copy_weights(full, layer)
    expected = to_numpy(full(x, attention_mask=_longformer_rows_pattern(global_mask, 2)))
    compiled = _compiled(lambda a, g: layer(a, global_attention_mask=g))
    assert_close(to_numpy(compiled(x, global_mask)), expected, atol=2e-5)
    assert_close(to_numpy(layer(x, global_attention_mask=global_mask)), expected, atol=2e-5)
    # Traced, the mask's count is unknown: the slots are `max_global`, not one per position.
    checked = kzoo.layers.efficient_attention.check_attention("longformer", options)[1]
    slots = _compiled(lambda g: kzoo.layers.efficient_attention.longformer_slots(
        checked, N, 2, g)[1])(global_mask)
    assert tuple(slots.shape) == (2, 2, N)
    # Eagerly, more global tokens in a row than max_global is an error naming it.
    with pytest.raises(ValueError, match="max_global=2"):
        layer(x, global_attention_mask=np.ones((2, N), bool))
    with pytest.raises(ValueError, match="max_global"):
        MultiHeadAttention(HEADS, attention="longformer",
                           attention_options={"window": 2, "max_global": 0})


def test_longformer_without_global_tokens_is_the_band():
    x = np.random.default_rng(4).normal(size=(2, N, DIM)).astype("float32")
    layer = MultiHeadAttention(HEADS, attention="longformer",
                               attention_options={"window": 3, "global_tokens": []})
    full = MultiHeadAttention(HEADS)
    layer.build(x.shape)
    full.build(x.shape)
    _copy_weights(full, layer)
    band = _np_pattern("sliding_window", N, False, window=3)
    assert_close(to_numpy(layer(x)), to_numpy(full(x, attention_mask=band[None, None])),
                 atol=2e-5)


@pytest.mark.parametrize("global_projections", [False, True])
def test_longformer_weights_path_keeps_the_kernels_first_max_global_tokens(
        global_projections):
    """Compiled, a row with more global flags than `max_global` keeps its first `max_global`
    as global tokens in the kernel; the explicit-weights path (return_attention_weights)
    must keep the same ones (it used every flag: the other rows' outputs differed)."""
    x = np.random.default_rng(5).normal(size=(2, N, DIM)).astype("float32")
    global_mask = np.zeros((2, N), bool)
    global_mask[0, [1, 6, 10]] = True  # three flags, max_global 2: position 10 is not global
    global_mask[1, 4] = True
    options = {"window": 2, "max_global": 2, "global_projections": global_projections}
    layer = MultiHeadAttention(HEADS, attention="longformer", attention_options=options)
    layer.build(x.shape)
    kernel = _compiled(lambda a, g: layer(a, global_attention_mask=g))
    weights_path = _compiled(
        lambda a, g: layer(a, global_attention_mask=g, return_attention_weights=True))
    if keras.backend.backend() == "torch":
        # (eagerly the count is known: more flags than max_global is refused on both paths)
        with pytest.raises(ValueError, match="max_global=2"):
            weights_path(x, global_mask)
        global_mask[0, 10] = False
    out, weights = weights_path(x, global_mask)
    assert_close(to_numpy(out), to_numpy(kernel(x, global_mask)), atol=2e-5)
    # Independently: the weights vanish exactly outside the pattern of the kept tokens.
    kept = global_mask.copy()
    kept[0, 10] = False
    allowed = np.broadcast_to(_longformer_rows_pattern(kept, 2), tuple(weights.shape))
    w = to_numpy(weights)
    assert np.all(w[~allowed] == 0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


@pytest.mark.spread
@pytest.mark.parametrize("family", ["bert", "gpt", "vit"])
def test_config_refuses_a_block_layout_of_another_head_count(family):
    """A block_sparse layout needs 1 head (shared) or one per attention head: the config
    refuses 3 heads for num_heads=4 when it is made, naming num_heads and the layout's
    shape (it was accepted until the blocks were built)."""
    from kzoo.models.bert import BertConfig
    from kzoo.models.gpt import GPTConfig
    from kzoo.models.vit import ViTConfig

    sizes = dict(num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32)
    make = {"bert": lambda **kw: BertConfig(vocabulary_size=50, **sizes, **kw),
            "gpt": lambda **kw: GPTConfig(vocabulary_size=50, **sizes, **kw),
            "vit": lambda **kw: ViTConfig(image_size=16, patch_size=4, **sizes, **kw)}[family]
    layout = np.ones((3, 2, 2), bool).tolist()
    with pytest.raises(ValueError, match=r"num_heads=4.*\(3, 2, 2\)") as error:
        make(attention="block_sparse", attention_options={"block_size": 4, "layout": layout})
    assert getattr(error.value, "field", None) == "attention_options"
    # One head (shared) and one per head are allowed.
    for heads in (1, 4):
        config = make(attention="block_sparse", attention_options={
            "block_size": 4, "layout": np.ones((heads, 2, 2), bool).tolist()})
        assert len(config.attention_options["layout"]) == heads
