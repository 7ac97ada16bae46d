"""GPT family: backbone and causal LM against a NumPy reference, decoding, saving, training."""

import math
import os

import keras
import numpy as np
import pytest

import kzoo
import kzoo.presets
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from tests.harness import (
    assert_matches_transformers, assert_same_hf_tensors, check_config_round_trip,
    check_fit_lowers_loss, check_keras_file_round_trip, check_preset_round_trip, forward,
    QUICKER_LOOP, hf_checkpoint, ref, to_numpy, torch_forward,
)

VOCAB = 61

CONFIGS = {
    "gpt2": dict(),
    "modern": dict(
        norm="rmsnorm", position="rotary", feedforward="gated", activation="silu",
        num_kv_heads=2, use_bias=False, tie_embeddings=False,
    ),
    "moe": dict(
        norm="rmsnorm", position="rotary", feedforward="moe", activation="silu",
        num_kv_heads=1, use_bias=False, num_experts=4, top_k=2, tie_embeddings=False,
    ),
}


def tiny_backbone(kind="gpt2", **overrides):
    config = dict(
        vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=32,
        intermediate_dim=48, max_sequence_length=24, dropout=0.0,
    )
    config.update(CONFIGS[kind])
    config.update(overrides)
    return GPTBackbone(**config)


def tiny_lm(kind="gpt2", **overrides):
    return GPTCausalLM(tiny_backbone(kind, **overrides))


_MODELS = {}


def shared_lm(kind):
    """One tiny LM per kind for the read-only tests (weights large enough that greedy
    decoding does not just repeat the prompt)."""
    if kind not in _MODELS:
        _MODELS[kind] = tiny_lm(kind, initializer_range=0.3)
    return _MODELS[kind]


def _inputs(ids, mask=None):
    ids = np.asarray(ids, "int32")
    mask = np.ones_like(ids) if mask is None else np.asarray(mask, "int32")
    return {"token_ids": ids, "padding_mask": mask}


_forward = forward  # the name the decoding tests below use


def _ids(batch, seq, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)).astype("int32")


# === NumPy reference (the pieces come from tests.harness.ref) ===


def numpy_gpt(backbone, ids, mask):
    """An independent NumPy implementation of the GPT forward pass (float64)."""
    cfg = backbone.get_config()
    act = ref.activation(cfg["activation"])
    norm, _dense, _np = ref.norm, ref.apply_dense, ref.w
    b, t = ids.shape
    h, d = cfg["num_heads"], cfg["hidden_dim"] // cfg["num_heads"]
    kvh = cfg["num_kv_heads"] or h
    x = _np(backbone.token_embedding.embeddings)[ids]
    if cfg["position"] == "learned":
        x = x + _np(backbone.position_embedding.embeddings)[:t][None]
    pad = mask.astype(bool)[:, None, None, :]
    for block in backbone.transformer_layers:
        attn = block.self_attention
        y = norm(block.self_attention_norm, x)
        q = _dense(attn.query_dense, y).reshape(b, t, h, d)
        k = _dense(attn.key_dense, y).reshape(b, t, kvh, d)
        v = _dense(attn.value_dense, y).reshape(b, t, kvh, d)
        if cfg["position"] == "rotary":  # rotate-half pairing, positions 0..t-1
            q = ref.rope(q, base=cfg["rope_max_wavelength"])
            k = ref.rope(k, base=cfg["rope_max_wavelength"])
        # GQA: query head i uses kv head i // (h / kvh)
        o = ref.attention(q, k, v, mask=pad, causal=True, scale=1 / math.sqrt(d))
        x = x + _dense(attn.output_dense, o.reshape(b, t, h * d))
        y = norm(block.feedforward_norm, x)
        ff = block.feedforward_layer
        if cfg["feedforward"] == "plain":
            f = _dense(ff.output_dense, act(_dense(ff.intermediate_dense, y)))
        elif cfg["feedforward"] == "gated":
            f = _dense(ff.output_dense, act(_dense(ff.gate_dense, y)) * _dense(ff.up_dense, y))
        else:
            probs = ref.softmax(y @ _np(ff.router.kernel))
            top = np.argsort(-probs, -1)[..., : cfg["top_k"]]
            f = np.zeros_like(y)
            gk, uk, ok = _np(ff.gate_kernel), _np(ff.up_kernel), _np(ff.output_kernel)
            for bi in range(b):
                for ti in range(t):
                    w = probs[bi, ti, top[bi, ti]]
                    w = w / w.sum()
                    for e, we in zip(top[bi, ti], w):
                        hid = act(y[bi, ti] @ gk[e]) * (y[bi, ti] @ uk[e])
                        f[bi, ti] += we * (hid @ ok[e])
        x = x + f
    x = norm(backbone.final_norm, x)
    emb = backbone.token_embedding
    head = _np(emb.embeddings).T if cfg["tie_embeddings"] else _np(emb.reverse_embeddings)
    return x, x @ head


# === Forward ===


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_forward_matches_numpy_reference(kind):
    lm = tiny_lm(kind)
    ids = _ids(2, 7)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3])
    hidden = _forward(lm.backbone, _inputs(ids, mask))
    logits = _forward(lm, _inputs(ids, mask))
    assert tuple(hidden.shape) == (2, 7, 32) and tuple(logits.shape) == (2, 7, VOCAB)
    assert keras.backend.standardize_dtype(hidden.dtype) == "float32"
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    ref_hidden, ref_logits = numpy_gpt(lm.backbone, ids, mask)
    real = mask.astype(bool)
    err_h = np.abs(to_numpy(hidden)[real] - ref_hidden[real]).max()
    err_l = np.abs(to_numpy(logits)[real] - ref_logits[real]).max()
    print(f"{kind}: max |diff| hidden {err_h:.2e}, logits {err_l:.2e}")
    assert err_h < 1e-4 and err_l < 1e-4


@pytest.mark.spread
def test_mixed_precision_dtypes():
    lm = tiny_lm("modern", dtype="mixed_bfloat16")
    for layer in lm.backbone._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        assert layer.dtype_policy.name == "mixed_bfloat16", layer.name
    logits = _forward(lm, _inputs(_ids(2, 5)))
    assert keras.backend.standardize_dtype(logits.dtype) == "bfloat16"
    assert lm.backbone.token_embedding.embeddings.dtype == "float32"


@pytest.mark.spread
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_padding_invariance_and_causality(kind):
    lm = shared_lm(kind)
    ids = _ids(1, 9)[0]
    padded = ids.copy()
    padded[5:] = _ids(1, 4, seed=3)[0]  # arbitrary ids behind the padding
    future = ids.copy()
    future[6:] = (future[6:] + 7) % VOCAB  # different future tokens
    mask = np.ones((3, 9), "int32")
    mask[1, 5:] = 0
    out = to_numpy(_forward(lm, _inputs(np.stack([ids, padded, future]), mask)))
    # padding never changes the outputs at real positions
    np.testing.assert_allclose(out[1, :5], out[0, :5], atol=2e-5)
    # future tokens never change earlier logits (and do change later ones)
    np.testing.assert_allclose(out[2, :6], out[0, :6], atol=2e-5)
    assert np.abs(out[2, 6:] - out[0, 6:]).max() > 1e-3
    # the same sequence alone (no batch neighbours, no padding) gives the same logits
    alone = to_numpy(_forward(lm, _inputs(ids[None, :5])))
    np.testing.assert_allclose(alone[0], out[0, :5], atol=2e-5)


def test_gpt2_initialisation():
    backbone = GPTBackbone(vocabulary_size=512, num_layers=8, num_heads=4, hidden_dim=256,
                           intermediate_dim=1024, max_sequence_length=128)
    std = lambda v: float(np.std(to_numpy(v)))  # noqa: E731
    residual = 0.02 / math.sqrt(2 * 8)
    assert abs(std(backbone.token_embedding.embeddings) - 0.02) < 0.002
    assert abs(std(backbone.position_embedding.embeddings) - 0.02) < 0.002
    for block in backbone.transformer_layers:
        attention, ff = block.self_attention, block.feedforward_layer
        for dense in (attention.query_dense, attention.key_dense, attention.value_dense,
                      ff.intermediate_dense):
            assert abs(std(dense.kernel) - 0.02) < 0.002, dense.kernel.path
        assert abs(std(attention.output_dense.kernel) - residual) < 0.1 * residual
        assert abs(std(ff.output_dense.kernel) - residual) < 0.1 * residual
        np.testing.assert_array_equal(to_numpy(attention.query_dense.bias), 0.0)
        np.testing.assert_array_equal(to_numpy(ff.output_dense.bias), 0.0)
        np.testing.assert_array_equal(to_numpy(block.self_attention_norm.gamma), 1.0)
    # Every residual projection is its own draw.
    outputs = [to_numpy(b.feedforward_layer.output_dense.kernel)
               for b in backbone.transformer_layers]
    assert not np.allclose(outputs[0], outputs[1])


def test_moe_initialisation():
    backbone = tiny_backbone("moe", hidden_dim=128, intermediate_dim=256)
    ff = backbone.transformer_layers[0].feedforward_layer
    residual = 0.02 / math.sqrt(2 * 2)
    assert abs(np.std(to_numpy(ff.gate_kernel)) - 0.02) < 0.002
    assert abs(np.std(to_numpy(ff.router.kernel)) - 0.02) < 0.004
    assert abs(np.std(to_numpy(ff.output_kernel)) - residual) < 0.1 * residual


# === Cached decoding and generation ===


def test_call_with_cache_equals_full_recompute():
    backbone = shared_lm("modern").backbone
    ids = _ids(2, 8, seed=4)
    full = to_numpy(_forward(backbone, _inputs(ids)))
    cache = backbone.init_cache(2, 12)
    assert tuple(cache.shape) == (2, 2, 2, 2, 12, 8)  # (batch, layers, k/v, heads, len, dim)
    h0, cache = backbone.call_with_cache(ids[:, :5], cache, 0)
    steps = [to_numpy(h0)]
    for i in range(5, 8):
        h, cache = backbone.call_with_cache(ids[:, i:i + 1], cache, i)
        steps.append(to_numpy(h))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5)


@pytest.mark.spread
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_generation_prefill_and_steps_equal_full_recompute(kind):
    """The prefill + one-token steps that the decode loop runs (the model's decoding
    interface) give the logits of a full forward pass over the whole sequence, also with a
    left-padded row."""
    lm = shared_lm(kind)
    ids = _ids(2, 8, seed=4)
    full = to_numpy(_forward(lm, _inputs(ids)))
    # Row 1 holds the last 6 tokens of its sequence, left-padded by 2 slots.
    row1 = ids[1, :6]
    full1 = to_numpy(_forward(lm, _inputs(row1[None])))
    prompt = np.stack([ids[0, :5], np.concatenate([[0, 0], row1[:3]])]).astype("int32")
    mask = np.ones((2, 5), "int32")
    mask[1, :2] = 0
    offset = np.array([0, 2], "int32")
    logits, state, constants = lm.generation_prefill(
        {"token_ids": prompt, "padding_mask": mask, "position_offset": offset}, 3
    )
    caches = state["cache"]  # per layer: (keys, values), each (batch, kv_heads, slots, dim)
    assert len(caches) == 2 and all(isinstance(c, tuple) and len(c) == 2 for c in caches)
    assert all(tuple(part.shape)[0] == 2 and tuple(part.shape)[2] == 8
               for c in caches for part in c)
    got0, got1 = [to_numpy(logits)[0]], [to_numpy(logits)[1]]
    for i in range(5, 8):
        tokens = np.array([[ids[0, i]], [row1[i - 2] if i - 2 < 6 else 0]], "int32")
        logits, state = lm.generation_step(tokens, state, constants, i - 5)
        got0.append(to_numpy(logits)[0])
        got1.append(to_numpy(logits)[1])
    np.testing.assert_allclose(np.stack(got0), full[0, 4:8], atol=2e-5)
    np.testing.assert_allclose(np.stack(got1), full1[0, 2:6], atol=2e-5)


def _greedy_by_recompute(lm, prompt, steps, width=16):
    """Greedy decoding by running the whole sequence again at every step (no cache), at a
    fixed right-padded width so that one compiled predict function serves every step."""
    seq = list(prompt)
    for _ in range(steps):
        ids = np.zeros((1, width), "int32")
        mask = np.zeros((1, width), "int32")
        ids[0, : len(seq)], mask[0, : len(seq)] = seq, 1
        logits = lm.predict_on_batch(_inputs(ids, mask))
        seq.append(int(to_numpy(logits)[0, len(seq) - 1].argmax()))
    return seq[len(prompt):]


@pytest.mark.spread
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_generate_greedy_equals_recompute_and_batch_equals_alone(kind):
    lm = shared_lm(kind)
    prompts = [[5, 6, 7, 8, 9, 10], [3], [11, 12, 13]]
    batch = lm.generate(prompts, max_new_tokens=6)
    assert [len(o) for o in batch] == [6, 6, 6]
    assert len({tuple(o) for o in batch}) > 1  # not a degenerate model
    for prompt, out in zip(prompts, batch):
        assert out == _greedy_by_recompute(lm, prompt, 6)
        assert lm.generate([prompt], max_new_tokens=6) == [out]


@pytest.mark.spread
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_generate_beam_batch_equals_alone(kind):
    """Beam search (token-for-token parity with transformers: tests/test_generation.py) on
    every kind: a prompt gives the same best hypothesis alone or in a left-padded batch."""
    lm = shared_lm(kind)
    prompts = [[5, 6, 7, 8, 9, 10], [3], [11, 12, 13]]
    options = dict(max_new_tokens=5, strategy="beam", num_beams=3, length_penalty=0.7,
                   compile=QUICKER_LOOP)
    batch = lm.generate(prompts, **options)
    assert [len(o) for o in batch] == [5, 5, 5]
    for prompt, out in zip(prompts, batch):
        assert lm.generate([prompt], **options) == [out]


def test_generate_eager_equals_compiled():
    lm = shared_lm("gpt2")
    prompts = [[5, 6, 7, 8, 9, 10], [3]]
    assert lm.generate(prompts, max_new_tokens=2, compile=False) == lm.generate(
        prompts, max_new_tokens=2
    )


def test_generate_array_prompts_with_padding_mask():
    lm = shared_lm("gpt2")
    prompts = [[5, 6, 7, 8], [3, 4]]
    expected = lm.generate(prompts, max_new_tokens=4)
    right = np.array([[5, 6, 7, 8], [3, 4, 0, 0]])
    left = np.array([[5, 6, 7, 8], [0, 0, 3, 4]])
    assert lm.generate(right, padding_mask=right > 0, max_new_tokens=4) == expected
    assert lm.generate(left, padding_mask=left > 0, max_new_tokens=4) == expected


@pytest.mark.spread
def test_generate_stop_tokens():
    lm = shared_lm("gpt2")
    prompts = [[5, 6, 7], [9, 2]]
    free = lm.generate(prompts, max_new_tokens=8)
    stop = free[0][2]
    first = free[0].index(stop)
    stopped = lm.generate(prompts, max_new_tokens=8, stop_token_ids=[stop])
    assert stopped[0] == free[0][: first + 1]
    other = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert stopped[1] == other


@pytest.mark.spread
def test_generate_sampling():
    lm = shared_lm("modern")
    prompts = [[5, 6, 7], [9]]
    greedy = lm.generate(prompts, max_new_tokens=8)
    assert lm.generate(prompts, max_new_tokens=8, strategy="sample", top_k=1, seed=3) == greedy
    a = lm.generate(prompts, max_new_tokens=8, strategy="sample", temperature=2.0, seed=7)
    b = lm.generate(prompts, max_new_tokens=8, strategy="sample", temperature=2.0, seed=7)
    assert a == b
    c = lm.generate(prompts, max_new_tokens=8, strategy="sample", temperature=2.0, seed=8)
    assert a != c
    # top-p sampled first tokens always lie in the nucleus of the model's own distribution
    logits = to_numpy(_forward(lm, _inputs([[5, 6, 7]])))[0, -1].astype(np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5) + 1)].tolist())
    firsts = set()
    for seed in range(3):
        out = lm.generate([[5, 6, 7]] * 4, max_new_tokens=1, strategy="sample", top_p=0.5,
                          seed=seed)
        firsts |= {row[0] for row in out}
    assert firsts <= nucleus


@pytest.mark.spread
def test_generate_with_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(VOCAB)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins tokens with spaces
    lm = shared_lm("gpt2")
    lm.tokenizer = tok
    try:
        ids = lm.generate([[3, 4]], max_new_tokens=3)[0]
        text = lm.generate("w3 w4", max_new_tokens=3)
        assert text == " ".join(words[i] for i in [3, 4] + ids)
        texts = lm.generate(["w3 w4", "w7"], max_new_tokens=3)
        assert texts[0] == text and texts[1].startswith("w7")
        # return_scores: the same texts, and the scores shaped as them (a single string: one
        # list of floats), those of the same prompt given as ids
        _, id_scores = lm.generate([[3, 4]], max_new_tokens=3, return_scores=True)
        one, scores = lm.generate("w3 w4", max_new_tokens=3, return_scores=True)
        assert one == text and len(scores) == 3 and all(isinstance(s, float) for s in scores)
        np.testing.assert_allclose(scores, id_scores[0], atol=1e-5)
        both, scores = lm.generate(["w3 w4", "w7"], max_new_tokens=3, return_scores=True)
        assert both == texts and [len(s) for s in scores] == [3, 3]
        np.testing.assert_allclose(scores[0], id_scores[0], atol=1e-5)
    finally:
        lm.tokenizer = None


def test_generate_errors():
    lm = shared_lm("gpt2")
    with pytest.raises(ValueError, match="max_sequence_length"):
        lm.generate([[1] * 20], max_new_tokens=10)
    with pytest.raises(ValueError, match="empty"):
        lm.generate([[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="tokenizer"):
        lm.generate("hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        lm.generate([[1]], strategy="sample", top_p=2.0)
    # a seed JAX could not take (OverflowError there, accepted elsewhere), a non-bool compile
    for seed in (-5, 2 ** 40, 1.5, "0"):
        with pytest.raises(ValueError, match=r"`seed` must be None, an int in \[0, 2\*\*32\)"):
            lm.generate([[1]], max_new_tokens=2, strategy="sample", seed=seed)
    with pytest.raises(ValueError, match="`compile` must be True or False"):
        lm.generate([[1]], max_new_tokens=2, compile="no")
    # NumPy ints are ints (Keras' SeedGenerator refused np.int64)
    assert (lm.generate([[1]], max_new_tokens=3, strategy="sample", seed=np.int64(3))
            == lm.generate([[1]], max_new_tokens=3, strategy="sample", seed=3))


def test_generate_refuses_a_cache_larger_than_memory(monkeypatch):
    """A rotary GPT has no position table to bound `max_new_tokens`: a key/value cache that
    cannot fit the machine's memory is refused by name (it was the allocator's failure)."""
    from kzoo import generation

    lm = tiny_lm("modern", max_sequence_length=10 ** 12)
    with pytest.raises(ValueError, match="max_new_tokens=10000000000 needs"):
        lm.generate([[1, 2]], max_new_tokens=10 ** 10)
    # bytes a position: layers x (keys, values) x rows x kv heads x head dim x 4; the
    # prompts are left-padded to 8 positions; plus the float32 logits of a step (rows x
    # vocabulary, a few copies)
    per_position = 2 * 2 * 2 * 2 * (32 // 4) * 4
    logits = generation._LOGITS_COPIES * 2 * lm.backbone.vocabulary_size * 4
    monkeypatch.setattr(generation, "_memory_bytes", lambda: 20 * per_position + logits)
    with pytest.raises(ValueError, match=r"max_new_tokens=13 for 2 prompt\(s\) need .* \(a "
                                         r"key/value cache of .* for 21 positions x 2 rows"):
        lm.generate([[1, 2], [3]], max_new_tokens=13)
    assert len(lm.generate([[1, 2], [3]], max_new_tokens=12)) == 2


# === Saving ===


@pytest.mark.spread
@pytest.mark.parametrize("kind", ["gpt2", "modern"])
def test_keras_file_round_trip(kind, tmp_path):
    lm = shared_lm(kind)
    x = _inputs(_ids(2, 6))
    restored = check_keras_file_round_trip(lm, x, os.path.join(tmp_path, "lm"), forward,
                                           atol=1e-6)
    assert isinstance(restored, GPTCausalLM)
    assert restored.backbone.get_config() == lm.backbone.get_config()
    check_keras_file_round_trip(lm.backbone, x, os.path.join(tmp_path, "backbone"), forward,
                                atol=1e-6)


def test_config_round_trip():
    backbone = tiny_backbone("modern")
    config = backbone.get_config()
    clone = GPTBackbone.from_config(config)
    assert clone.get_config() == config
    lm = GPTCausalLM(backbone)
    again = check_config_round_trip(lm, _inputs(_ids(2, 6)), forward)
    assert again.backbone.get_config() == config


@pytest.mark.spread
def test_presets_directory_round_trip(tmp_path):
    lm = kzoo.presets.load("gpt_moe_mini", num_layers=1, max_sequence_length=32)
    x = _inputs(_ids(2, 6))
    restored = check_preset_round_trip(lm, x, tmp_path, forward, atol=1e-6)
    assert isinstance(restored, GPTCausalLM)
    backbone = kzoo.presets.load(tmp_path, task="backbone")
    np.testing.assert_allclose(
        to_numpy(_forward(backbone, x)), to_numpy(_forward(lm.backbone, x)), atol=1e-6
    )


# === Training ===


@pytest.mark.spread
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_fit_lowers_loss(kind):
    lm = tiny_lm(kind)
    rng = np.random.default_rng(0)
    data = np.tile(rng.integers(0, VOCAB, (1, 9)), (8, 1)).astype("int32")
    mask = np.ones_like(data)
    mask[4:, 7:] = 0
    x, y, w = GPTCausalLM.lm_batch(data, mask)
    assert x["token_ids"].shape == (8, 8) and y.shape == (8, 8)
    check_fit_lowers_loss(lm, x, y, sample_weight=w, epochs=8, evaluate=True, min_drop=0.5,
                          jit_compile="auto")


@pytest.mark.spread
@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_chunked_kernel_trains_like_reference(monkeypatch, jit_compile):
    """A training step with every attention forced onto the chunked kernel (blocks of 3, so
    3 query and key blocks with padding) gives the loss and updated weights of the reference
    kernel: its backward pass runs inside the model's traced step, with XLA ("auto") and
    without (TensorFlow graph mode, eager JAX and torch)."""
    from kzoo.layers import kernels, set_attention_kernel

    monkeypatch.setattr(kernels, "DEFAULT_BLOCK_SIZE", 3)
    rng = np.random.default_rng(0)
    data = rng.integers(0, VOCAB, (4, 9)).astype("int32")
    mask = np.ones_like(data)
    mask[2:, 6:] = 0
    x, y, w = GPTCausalLM.lm_batch(data, mask)
    results = {}
    for kernel in ("reference", "chunked"):
        keras.utils.set_random_seed(3)
        lm = tiny_lm("modern")
        initial = [to_numpy(v) for v in lm.weights]
        lm.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=jit_compile,
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        set_attention_kernel(kernel)
        try:
            loss = lm.train_on_batch(x, y, sample_weight=w)
        finally:
            set_attention_kernel(None)
        results[kernel] = (float(np.asarray(loss)), [to_numpy(v) for v in lm.weights])
    (loss_r, w_r), (loss_c, w_c) = results["reference"], results["chunked"]
    np.testing.assert_allclose(loss_c, loss_r, rtol=1e-5)
    for a, b in zip(w_r, w_c):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4)
    # The step moved the attention weights (same seed: same initial weights for both).
    assert max(np.abs(a - i).max() for a, i in zip(w_r, initial)) > 1e-3


# === Validation ===


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_heads=5), "num_heads"),
        (dict(vocabulary_size=0), "vocabulary_size"),
        (dict(norm="batchnorm"), "norm"),
        (dict(position="alibi"), "position"),
        (dict(feedforward="dense"), "feedforward"),
        (dict(activation="gelu_fast"), "activation"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(dropout=1.5), "dropout"),
        (dict(feedforward="moe"), "num_experts"),
        (dict(feedforward="moe", num_experts=2, top_k=3), "top_k"),
        (dict(num_experts=4), "num_experts"),
        (dict(tie_embeddings="yes"), "tie_embeddings"),
        (dict(position="rotary", num_heads=8, hidden_dim=24), "rotary"),
        (dict(layer_norm_epsilon=-1.0), "layer_norm_epsilon"),
        (dict(attention_scale_by_inverse_layer=1), "attention_scale_by_inverse_layer"),
    ],
)
def test_config_validation(overrides, field):
    config = dict(vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=32,
                  intermediate_dim=48, max_sequence_length=16)
    config.update(overrides)
    with pytest.raises(ValueError, match=field):
        GPTBackbone(**config)


def test_task_rejects_other_backbones():
    with pytest.raises(ValueError, match="GPTBackbone"):
        GPTCausalLM(keras.Sequential([keras.layers.Dense(2)]))


# === Presets ===

SMALL = ["gpt_mini", "gpt_modern_mini", "gpt_moe_mini"]
LARGE = ["gpt2", "gpt2_medium", "gpt2_large", "gpt2_xl"]


@pytest.mark.parametrize("name", SMALL)
def test_small_preset_param_counts(name):
    info = kzoo.presets.info(name)
    assert info["family"] == "gpt" and info["task"] == "causal_lm"
    model = kzoo.presets.load(name)
    assert isinstance(model, GPTCausalLM)
    assert model.count_params() == info["params"]


def test_gpt2_param_count_formula():
    """GPT-2's count from the architecture (V d + P d + L (12 d^2 + 13 d) + 2 d) equals the
    JSON figures; the published sizes are within 1%."""
    for name in LARGE:
        info = kzoo.presets.info(name)
        c = info["config"]
        v, p, d, n = (c["vocabulary_size"], c["max_sequence_length"], c["hidden_dim"],
                      c["num_layers"])
        assert c["intermediate_dim"] == 4 * d
        assert info["params"] == v * d + p * d + n * (12 * d * d + 13 * d) + 2 * d
        assert abs(info["params"] - info["published_params"]) / info["published_params"] < 0.01
    assert kzoo.presets.info("gpt2")["params"] == 124439808


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_large_preset_param_counts(name):
    model = kzoo.presets.load(name)
    assert model.count_params() == kzoo.presets.info(name)["params"]


# === Hugging Face GPT-2 conversion ===


def _hf_gpt2(path, lm_head=True, **overrides):
    """A tiny randomly initialised transformers GPT-2, saved to `path` (safetensors)."""
    import torch
    import transformers

    config = dict(
        vocab_size=97, n_positions=40, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1, bos_token_id=96,
        eos_token_id=96,
    )
    config.update(overrides)
    torch.manual_seed(0)
    cls = transformers.GPT2LMHeadModel if lm_head else transformers.GPT2Model
    # The eager attention is transformers' reference path: its SDPA path ignores
    # scale_attn_weights=False (4.57).
    model = cls(transformers.GPT2Config(**config, attn_implementation="eager")).eval()
    with torch.no_grad():  # non-trivial layer norms and biases (HF starts them at 1 and 0)
        for name, param in model.named_parameters():
            if ".ln_" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    hf_checkpoint(path, model)
    return model


def _hf_forward(hf, ids, mask):
    out = torch_forward(hf, input_ids=ids, attention_mask=mask)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


def _assert_gpt_matches(model, hf, ids, mask, label, atol=1e-5):
    assert_matches_transformers(model, hf, _inputs(ids, mask),
                                dict(input_ids=ids, attention_mask=mask), atol=atol,
                                mask=mask, label=label)


def _right_padded(lengths=(10, 7, 4), width=10, vocab=97, seed=0):
    ids = np.random.default_rng(seed).integers(1, vocab, (len(lengths), width)).astype("int32")
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
    return ids, mask


HF_VARIANTS = {
    "default": dict(),
    "gelu_untied_unscaled": dict(activation_function="gelu", n_inner=48,
                                 scale_attn_weights=False, tie_word_embeddings=False),
    "relu_eps": dict(activation_function="relu", layer_norm_epsilon=1e-3, n_head=2),
    # (BERT's and ViT's converters took it; GPT-2's too now)
    "gelu_python": dict(activation_function="gelu_python"),
    # (ViT's converter took it; the others too now)
    "gelu_python_tanh": dict(activation_function="gelu_python_tanh"),
}


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_gpt2_parity(variant, tmp_path):
    hf = _hf_gpt2(tmp_path, **HF_VARIANTS[variant])
    model = kzoo.presets.load(tmp_path)
    assert isinstance(model, GPTCausalLM)
    ids, mask = _right_padded()
    _assert_gpt_matches(model, hf, ids, mask, f"GPT-2 {variant}")


def test_hf_gpt2_untied_head_refuses_a_tied_model(tmp_path):
    """An untied checkpoint's lm_head differs from wte: loading it into a tied model must
    fail with the fix named, never silently drop the head."""
    _hf_gpt2(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"wte\.weight.*tie_embeddings=False"):
        kzoo.presets.load(tmp_path, tie_embeddings=True)


def test_hf_gpt2_tied_config_with_a_stored_head_is_refused_saying_what_transformers_does(
        tmp_path):
    """config.json ties the head (tie_word_embeddings=True) but the file stores another
    `lm_head.weight`: transformers drops the stored head (checked here: its logits stay those
    of the tied model); kzoo refuses, and the message says so (it said only "load with
    tie_embeddings=False", which gives outputs that differ from transformers')."""
    import safetensors.numpy
    import transformers

    hf = _hf_gpt2(tmp_path)
    (path,) = list(tmp_path.glob("*.safetensors"))
    state = safetensors.numpy.load_file(str(path))
    state["lm_head.weight"] = state["transformer.wte.weight" if "transformer.wte.weight" in
                                    state else "wte.weight"] + 1.0
    safetensors.numpy.save_file(state, str(path), metadata={"format": "pt"})
    ids, mask = _right_padded()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_forward(reloaded, ids, mask), _hf_forward(hf, ids, mask),
                               atol=1e-6)
    with pytest.raises(ValueError, match=r"If it has True, transformers drops the stored head "
                                         r"and uses the embedding"):
        kzoo.presets.load(tmp_path)


def test_hf_gpt2_backbone_parity(tmp_path):
    hf = _hf_gpt2(tmp_path, lm_head=False)
    model = kzoo.presets.load(tmp_path)
    assert isinstance(model, GPTBackbone)
    ids, mask = _right_padded()
    _assert_gpt_matches(model, hf, ids, mask, "GPT2Model")


def test_hf_gpt2_sgd_step_matches_transformers(tmp_path):
    """One SGD step of a converted GPT-2 with kzoo's default loss (token cross-entropy)
    reaches the weights that transformers' autograd reaches: the loss before and the logits
    after the step agree within 1e-5, so every gradient (blocks, tied head, loss) does."""
    import torch

    hf = _hf_gpt2(tmp_path, n_layer=3)
    lm = kzoo.presets.load(tmp_path)
    lr = 0.5
    lm.compile(optimizer=keras.optimizers.SGD(lr))
    ids = np.random.default_rng(1).integers(0, 97, (3, 12)).astype("int32")
    loss = lm.train_on_batch(_inputs(ids[:, :-1]), ids[:, 1:])

    logits = hf(input_ids=torch.tensor(ids[:, :-1], dtype=torch.long)).logits
    targets = torch.tensor(ids[:, 1:], dtype=torch.long).reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
    expected.backward()
    with torch.no_grad():
        for param in hf.parameters():
            param -= lr * param.grad
    assert abs(float(loss) - expected.item()) < 1e-5, (float(loss), expected.item())
    _assert_gpt_matches(lm, hf, ids, np.ones_like(ids), "GPT-2 after one SGD step")


def _hf_generate_alone(hf, prompts, max_new_tokens=20):
    """transformers' greedy `generate` of each prompt alone (its own defaults otherwise):
    the new token ids of each."""
    import torch

    rows = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=0)
        rows.append(out[0, len(prompt):].tolist())
    return rows


def test_hf_gpt2_greedy_generation(tmp_path):
    import torch

    hf = _hf_gpt2(tmp_path, initializer_range=0.3)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3], [29, 8, 50, 90, 12]]
    alone = _hf_generate_alone(hf, prompts)
    # one prompt at a time, then all three in one left-padded batch (eos 96 ends a row)
    for prompt, expected in zip(prompts, alone):
        assert model.generate([prompt], max_new_tokens=20, stop_token_ids=[96]) == [expected]
    ours = model.generate(prompts, max_new_tokens=20, stop_token_ids=[96])
    assert ours == alone
    assert len({tuple(o) for o in ours}) == 3
    # transformers' own left-padded batch (attention_mask + derived position ids)
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.no_grad():
        batch = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                            pad_token_id=0)
    for row, expected in enumerate(ours):
        new = batch[row, width:].tolist()
        assert new[: len(expected)] == expected


@pytest.mark.spread
def test_hf_gpt2_generate_stops_where_transformers_does_by_default(tmp_path):
    """Without `stop_token_ids`, `generate` stops at the checkpoint's `eos_token_id` as
    transformers' `generate` does (generation_config.json before config.json), keeps it
    through kzoo's save and the Hugging Face export, and `stop_token_ids=None` turns it
    off."""
    import json

    import transformers

    src = os.path.join(tmp_path, "src")
    hf = _hf_gpt2(src, initializer_range=0.3)  # config.json: eos_token_id 96
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3], [29, 8, 50, 90, 12]]

    # A stop the model emits early in one row (not at all in another, ideally).
    free = kzoo.presets.load(src).generate(prompts, max_new_tokens=20, stop_token_ids=None)
    stop = free[0][3]
    hf.generation_config.eos_token_id = stop  # generation_config.json only
    tuned = os.path.join(tmp_path, "tuned")
    hf.save_pretrained(tuned)
    with open(os.path.join(tuned, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == 96
    expected = _hf_generate_alone(hf, prompts)
    assert len(expected[0]) == 4 and expected[0][-1] == stop

    model = kzoo.presets.load(tuned)
    assert model.stop_token_ids == (stop,)
    assert model.generate(prompts, max_new_tokens=20) == expected
    assert model.generate(prompts, max_new_tokens=20, stop_token_ids="auto") == expected
    assert model.generate(prompts, max_new_tokens=20, stop_token_ids=None) == free
    # kzoo's own save, the .keras file and the Hugging Face export keep it
    kept = os.path.join(tmp_path, "kept")
    kzoo.presets.save(model, kept)
    assert kzoo.presets.load(kept).generate(prompts, max_new_tokens=20) == expected
    keras_file = os.path.join(tmp_path, "lm.keras")
    model.save(keras_file)
    assert keras.saving.load_model(keras_file).stop_token_ids == (stop,)
    out = os.path.join(tmp_path, "out")
    kzoo.presets.save(model, out, format="hf")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == stop
    again = transformers.GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager")
    assert _hf_generate_alone(again.eval(), prompts) == expected
    # No stop token: exported as an explicit null (left out, transformers stopped at its
    # own default), so both run to max_new_tokens, and it loads back without one.
    model.stop_token_ids = None
    free_out = os.path.join(tmp_path, "free")
    kzoo.presets.save(model, free_out, format="hf")
    with open(os.path.join(free_out, "config.json")) as f:
        assert json.load(f)["eos_token_id"] is None
    again = transformers.GPT2LMHeadModel.from_pretrained(free_out, attn_implementation="eager")
    assert _hf_generate_alone(again.eval(), prompts) == free
    assert kzoo.presets.load(free_out).stop_token_ids is None


def test_causal_lm_stop_token_ids_errors():
    backbone = GPTBackbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
                           intermediate_dim=16, max_sequence_length=16)
    for bad in ([50], [-1], "eos", [1.5], True):
        with pytest.raises(ValueError, match="stop_token_ids"):
            GPTCausalLM(backbone, stop_token_ids=bad)
    assert GPTCausalLM(backbone, stop_token_ids=7).stop_token_ids == (7,)
    assert GPTCausalLM(backbone).get_config()["stop_token_ids"] is None
    # generate's own argument the same way (an id past the vocabulary never stops a row)
    lm = GPTCausalLM(backbone)
    for bad in ([50], 50, [3, 99]):
        with pytest.raises(ValueError, match=r"stop_token_ids.*vocabulary_size=50"):
            lm.generate([[1, 2]], max_new_tokens=2, stop_token_ids=bad)
    assert len(lm.generate([[1, 2]], max_new_tokens=2, stop_token_ids=[49])[0]) >= 1


def test_hf_gpt2_export_round_trip(tmp_path):
    import transformers

    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    hf = _hf_gpt2(src)
    model = kzoo.presets.load(src)
    kzoo.presets.save(model, out, format="hf")
    assert_same_hf_tensors(src, out)
    again = transformers.GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").eval()
    ids, mask = _right_padded()
    real = mask.astype(bool)
    expected = _hf_forward(hf, ids, mask)
    np.testing.assert_array_equal(_hf_forward(again, ids, mask)[real], expected[real])


INVERSE_LAYER_VARIANTS = {
    "reorder_and_upcast": dict(reorder_and_upcast_attn=True),
    "unscaled_untied": dict(scale_attn_weights=False, tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", [
    "reorder_and_upcast", pytest.param("unscaled_untied", marks=pytest.mark.slow)])
def test_hf_gpt2_scale_attn_by_inverse_layer_idx(variant, tmp_path):
    """GPT-2's `scale_attn_by_inverse_layer_idx` (layer i's scores divided by i + 1 as well;
    Stanford CRFM's "Mistral" GPT-2 runs, with `reorder_and_upcast_attn`) was refused. It now
    loads as `attention_scale_by_inverse_layer`: logits and greedy generation (compiled and
    eager) equal transformers' eager attention, and it survives the .keras file and the
    export back to transformers."""
    import json

    import transformers

    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    hf = _hf_gpt2(src, n_layer=3, initializer_range=0.3, scale_attn_by_inverse_layer_idx=True,
                  **INVERSE_LAYER_VARIANTS[variant])
    model = kzoo.presets.load(src)
    assert model.backbone.attention_scale_by_inverse_layer
    ids, mask = _right_padded()
    _assert_gpt_matches(model, hf, ids, mask, f"GPT-2 inverse layer scale {variant}")
    # (the scale matters: without it the logits are far from transformers')
    plain = kzoo.presets.load(src, attention_scale_by_inverse_layer=False)
    real = mask.astype(bool)
    assert np.abs(to_numpy(forward(plain, _inputs(ids, mask)))[real]
                  - _hf_forward(hf, ids, mask)[real]).max() > 1e-2
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3]]
    expected = _hf_generate_alone(hf, prompts, max_new_tokens=12)
    for compile in (True, False):
        assert model.generate(prompts, max_new_tokens=12, stop_token_ids=[96],
                              compile=compile) == expected, compile
    restored = check_keras_file_round_trip(model, _inputs(ids, mask),
                                           os.path.join(tmp_path, "lm"), forward, atol=1e-6)
    assert restored.backbone.get_config()["attention_scale_by_inverse_layer"] is True
    assert GPTBackbone.from_config(model.backbone.get_config()).get_config() == (
        model.backbone.get_config())
    kzoo.presets.save(model, out, format="hf")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["scale_attn_by_inverse_layer_idx"] is True
    assert_same_hf_tensors(src, out)
    again = transformers.GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_forward(again, ids, mask)[real],
                               _hf_forward(hf, ids, mask)[real], atol=1e-5)


@pytest.mark.spread
@pytest.mark.parametrize("kind", ["modern", "moe"])
def test_rotary_export_warns_that_only_attention_dropout_is_written(kind, tmp_path):
    """transformers' LLaMA / Mixtral have only `attention_dropout`: kzoo's dropout (also on the
    embeddings and sub-layer outputs) was written there in silence. The outputs agree."""
    import transformers

    lm = tiny_lm(kind, dropout=0.1, initializer_range=0.1)
    with pytest.warns(UserWarning, match=r"dropout=0\.1 is written as attention_dropout"):
        kzoo.presets.save(lm, tmp_path, format="hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    assert hf.config.attention_dropout == 0.1
    ids, mask = _right_padded(vocab=VOCAB, lengths=(10, 6), width=10)
    _assert_gpt_matches(lm, hf, ids, mask, f"{kind} with dropout 0.1 -> transformers")


@pytest.mark.spread
@pytest.mark.parametrize("tie", [True, False])
def test_kzoo_model_exports_to_transformers(tie, tmp_path):
    import transformers

    lm = tiny_lm("gpt2", tie_embeddings=tie, initializer_range=0.1)
    kzoo.presets.save(lm, tmp_path, format="hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids, mask = _right_padded(vocab=VOCAB, lengths=(10, 6), width=10)
    _assert_gpt_matches(lm, hf, ids, mask, f"kzoo -> transformers (tie={tie})")
    backbone_dir = os.path.join(tmp_path, "backbone")
    kzoo.presets.save(lm.backbone, backbone_dir, format="hf")
    hf_base = transformers.GPT2Model.from_pretrained(backbone_dir).eval()
    _assert_gpt_matches(lm.backbone, hf_base, ids, mask, "kzoo -> transformers backbone")


def test_hf_checkpoint_with_tokenizer(tmp_path):
    import tokenizers

    _hf_gpt2(tmp_path)
    words = [f"w{i}" for i in range(97)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(os.path.join(tmp_path, "tokenizer.json"))
    model = kzoo.presets.load(tmp_path)
    ids = model.generate([[5, 6]], max_new_tokens=4, stop_token_ids=[96])[0]
    assert model.generate("w5 w6", max_new_tokens=4, stop_token_ids=[96]) == " ".join(
        words[i] for i in [5, 6] + ids
    )
    # num_return_sequences: a list of that many strings a prompt, prompt by prompt
    beams = model.generate([[5, 6], [7]], max_new_tokens=4, num_beams=3,
                           num_return_sequences=2, stop_token_ids=[96])
    texts = model.generate(["w5 w6", "w7"], max_new_tokens=4, num_beams=3,
                           num_return_sequences=2, stop_token_ids=[96])
    assert texts == [" ".join(words[i] for i in prompt + out)
                     for prompt, out in zip([[5, 6], [5, 6], [7], [7]], beams)]
    assert model.generate("w5 w6", max_new_tokens=4, num_beams=3, num_return_sequences=2,
                          stop_token_ids=[96]) == texts[:2]


@pytest.mark.parametrize(
    "field, value",
    [
        ("add_cross_attention", True),
        ("scale_attn_by_inverse_layer_idx", "yes"),
        ("activation_function", "gelu_10"),
        ("architectures", ["GPT2ForSequenceClassification"]),
    ],
)
def test_hf_config_errors(field, value):
    from kzoo.convert import gpt as convert_gpt

    with pytest.raises(ValueError, match=field if field != "architectures" else "architecture"):
        convert_gpt.config_from_hf({"model_type": "gpt2", field: value})


def test_hf_weight_errors(tmp_path):
    import json

    import safetensors.numpy

    _hf_gpt2(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    state = safetensors.numpy.load_file(path)
    missing = dict(state)
    del missing["transformer.h.1.mlp.c_fc.bias"]
    missing["transformer.h.0.extra.weight"] = np.zeros(3, "float32")
    safetensors.numpy.save_file(missing, path)
    with pytest.raises(ValueError) as err:
        kzoo.presets.load(tmp_path)
    assert "transformer.h.1.mlp.c_fc.bias" in str(err.value)
    assert "transformer.h.0.extra.weight" in str(err.value)
    safetensors.numpy.save_file(state, path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    config["n_positions"] = 50
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"\(40, 32\).*\(50, 32\)"):
        kzoo.presets.load(tmp_path)


def test_to_hf_rejects_configs_without_hf_equivalent(tmp_path):
    with pytest.raises(ValueError, match="norm='layernorm'"):
        kzoo.presets.save(tiny_lm("gpt2", position="rotary"), tmp_path, format="hf")
    with pytest.raises(ValueError, match="norm='rmsnorm'"):
        kzoo.presets.save(tiny_lm("gpt2", norm="rmsnorm"), tmp_path, format="hf")
    with pytest.raises(ValueError, match="capacity_factor"):
        kzoo.presets.save(tiny_lm("moe", capacity_factor=1.0), tmp_path, format="hf")
    with pytest.raises(ValueError, match="attention_scale_by_inverse_layer=True"):
        kzoo.presets.save(tiny_lm("modern", attention_scale_by_inverse_layer=True), tmp_path,
                          format="hf")


def test_gpt2_export_refuses_a_head_dim_gpt2_cannot_express(tmp_path):
    """GPT-2's config has no head width: its heads are n_embd // n_head wide. A GPT-2-style
    model with another `head_dim` (4 heads of 4 on a width of 32) was written as a GPT-2
    checkpoint that transformers could not load ("Error(s) in loading state_dict for
    Conv1D": c_attn is (32, 48), not (32, 96)); it is refused, naming the field, before
    anything is written. A `head_dim` equal to hidden_dim // num_heads is the same model:
    transformers loads it and gives kzoo's logits."""
    import torch
    import transformers

    with pytest.raises(ValueError, match=r"head_dim=4 \(GPT-2: hidden_dim // num_heads = 8\)"):
        kzoo.presets.save(tiny_lm("gpt2", head_dim=4), tmp_path / "narrow", format="hf")
    assert not (tmp_path / "narrow").exists()
    lm = tiny_lm("gpt2", head_dim=8, initializer_range=0.3)
    kzoo.presets.save(lm, tmp_path / "same", format="hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "same").eval()
    ids = _ids(2, 7)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids).long()).logits.numpy()
    np.testing.assert_allclose(to_numpy(lm(_inputs(ids))), want, atol=1e-5)


# === LLaMA / Mixtral: the modern configurations as Hugging Face checkpoints ===


def _hf_modern(path, model_type="llama", **overrides):
    import torch
    import transformers

    config = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1, bos_token_id=96,
        eos_token_id=96, attn_implementation="eager",
    )
    if model_type == "mixtral":
        config.update(num_local_experts=4, num_experts_per_tok=2)
        cls, cfg_cls = transformers.MixtralForCausalLM, transformers.MixtralConfig
    elif model_type == "mistral":
        cls, cfg_cls = transformers.MistralForCausalLM, transformers.MistralConfig
    else:
        cls, cfg_cls = transformers.LlamaForCausalLM, transformers.LlamaConfig
    config.update(overrides)
    torch.manual_seed(0)
    model = cls(cfg_cls(**config)).eval()
    with torch.no_grad():  # non-trivial RMSNorm scales
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf_checkpoint(path, model)
    return model


def _load_modern(path):
    """config_from_hf + load_weights of kzoo.convert.gpt (the converter contract), also
    where kzoo.convert does not route model_type llama/mixtral to it."""
    from kzoo import convert
    from kzoo.convert import gpt as convert_gpt

    family, config, task, task_config = convert_gpt.config_from_hf(convert.read_hf_config(path))
    model = kzoo.presets.build(family, config, task=task, task_config=task_config)
    reader = convert.WeightReader(convert.read_hf_state(path),
                                  ignore=convert_gpt.IGNORED_WEIGHTS)
    convert_gpt.load_weights(model, reader)
    reader.finish()
    return model


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4, "attention_bias": True,
               "mlp_bias": True, "rope_theta": 500.0}),
    ("mixtral", {}),
])
def test_hf_llama_mixtral_parity_and_round_trip(model_type, overrides, tmp_path):
    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    hf = _hf_modern(src, model_type, **overrides)
    model = _load_modern(src)
    backbone = model.backbone
    assert backbone.position == "rotary" and backbone.norm == "rmsnorm"
    assert backbone.feedforward == ("moe" if model_type == "mixtral" else "gated")
    ids, mask = _right_padded()
    _assert_gpt_matches(model, hf, ids, mask, f"{model_type} {sorted(overrides)}")
    # kzoo -> HF: the same tensors, and transformers reads them back
    kzoo.presets.save(model, out, format="hf")
    assert_same_hf_tensors(src, out)


@pytest.mark.spread
@pytest.mark.parametrize("kind", ["modern", "moe"])
def test_modern_kzoo_model_exports_to_transformers(kind, tmp_path):
    import transformers

    lm = tiny_lm(kind, initializer_range=0.1)
    kzoo.presets.save(lm, tmp_path, format="hf")
    cls = transformers.MixtralForCausalLM if kind == "moe" else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = _right_padded(vocab=VOCAB, lengths=(10, 6), width=10)
    _assert_gpt_matches(lm, hf, ids, mask, f"kzoo {kind} -> transformers {cls.__name__}")


def test_hf_llama_greedy_generation_left_padding(tmp_path):
    hf = _hf_modern(tmp_path, initializer_range=0.3)
    model = _load_modern(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3], [29, 8, 50, 90, 12]]
    alone = _hf_generate_alone(hf, prompts)
    ours = model.generate(prompts, max_new_tokens=20, stop_token_ids=[96])
    assert ours == alone
    assert len({tuple(o) for o in ours}) == 3


@pytest.mark.spread
@pytest.mark.parametrize("model_type, overrides, num_beams", [
    ("llama", {}, 1),
    ("llama", {}, 3),
    ("mistral", {"sliding_window": 4}, 1),
    ("mixtral", {"sliding_window": None}, 1),
])
def test_hf_rotary_generation_past_max_position_embeddings(model_type, overrides, num_beams,
                                                           tmp_path):
    """Found by the parity audit: `generate` refused a prompt plus max_new_tokens longer than
    max_position_embeddings for the rotary models too ("exceeds max_sequence_length"), where
    transformers' LLaMA / Mistral / Mixtral generate on (rotary positions have no table)."""
    import torch

    hf = _hf_modern(tmp_path, model_type, max_position_embeddings=8, initializer_range=0.3,
                    eos_token_id=None, bos_token_id=None, pad_token_id=0, **overrides)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40, 11, 3], [11, 64, 3, 8]]
    ids = np.zeros((2, 9), "int64")
    mask = np.zeros((2, 9), "int64")
    for row, prompt in enumerate(prompts):
        ids[row, 9 - len(prompt):] = prompt
        mask[row, 9 - len(prompt):] = 1
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                          num_beams=num_beams, max_new_tokens=12, pad_token_id=0)
    expected = out[:, 9:].tolist()
    ours = model.generate(prompts, max_new_tokens=12, num_beams=num_beams,
                          stop_token_ids=None, compile=QUICKER_LOOP)
    assert ours == expected
    # GPT-2's learned positions still bound it.
    with pytest.raises(ValueError, match="max_sequence_length"):
        shared_lm("gpt2").generate([[1] * 20], max_new_tokens=10)


# Llama 3.1's RoPE scaling with a tiny original context (8 positions: the test sequences are
# longer) and head_dim 16 where hidden_size / num_attention_heads is 8: every frequency of
# the tiny model is scaled (wavelengths 6.3 blended, the others divided by the factor).
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
ROPE_VARIANTS = {
    "llama_llama3_head_dim": ("llama", dict(head_dim=16, rope_scaling=_LLAMA3)),
    # the older key spelling "type"
    "llama_linear_type_key": ("llama", dict(rope_scaling={"type": "linear", "factor": 2.5},
                                            rope_theta=500.0)),
    "mistral_llama3_head_dim_window": ("mistral", dict(head_dim=12, rope_scaling=_LLAMA3,
                                                       sliding_window=6)),
}


@pytest.mark.spread
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_hf_rope_scaling_and_head_dim_parity_generation_and_round_trip(variant, tmp_path):
    """LLaMA-family checkpoints with `head_dim` other than hidden_size / num_attention_heads
    (Mistral-Nemo style) and `rope_scaling` "llama3" (Llama 3.1 / 3.2) or "linear": logits on
    a right-padded batch longer than original_max_position_embeddings equal transformers',
    greedy `generate` (the torch fast decode path on torch) gives transformers' tokens, and
    `save(format="hf")` writes head_dim and rope_scaling back, transformers reading it to the
    same logits."""
    import json

    import transformers

    model_type, overrides = ROPE_VARIANTS[variant]
    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    # (initializer_range 0.1 for the logits, whose scale stays near 2: at 0.3 they reach 6
    # and float32 rounding alone differs by up to 2e-5, with or without scaling)
    hf = _hf_modern(src, model_type, **overrides)
    model = kzoo.presets.load(src)
    backbone = model.backbone
    head_dim = overrides.get("head_dim")
    assert backbone.head_size == (head_dim or 8) and backbone.head_dim == head_dim
    scaling = overrides["rope_scaling"]
    kind = scaling.get("rope_type", scaling.get("type"))
    assert backbone.rope_scaling_type == kind
    assert backbone.rope_scaling_factor == scaling["factor"]
    attention = backbone.transformer_layers[0].self_attention
    assert attention.query_dense.kernel.shape == (32, 4 * backbone.head_size)
    assert attention.key_dense.kernel.shape == (32, 2 * backbone.head_size)
    assert attention.output_dense.kernel.shape == (4 * backbone.head_size, 32)

    ids, mask = _right_padded(lengths=(14, 11, 5), width=14)
    _assert_gpt_matches(model, hf, ids, mask, variant)

    # greedy decoding past original_max_position_embeddings, on weights large enough that
    # it does not just repeat the prompt
    gen = os.path.join(tmp_path, "gen")
    hf_gen = _hf_modern(gen, model_type, initializer_range=0.3, **overrides)
    prompts = [[5, 17, 33, 2, 71, 9, 40, 3, 8], [11, 64, 3], [29, 8, 50, 90, 12]]
    alone = _hf_generate_alone(hf_gen, prompts, max_new_tokens=12)
    ours = kzoo.presets.load(gen).generate(prompts, max_new_tokens=12, stop_token_ids=[96],
                                           compile=QUICKER_LOOP)
    assert ours == alone
    assert len({tuple(o) for o in ours}) == 3

    kzoo.presets.save(model, out, format="hf")
    assert_same_hf_tensors(src, out)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["head_dim"] == backbone.head_size
    assert written["rope_scaling"]["rope_type"] == kind
    assert {k: v for k, v in written["rope_scaling"].items() if k not in ("type", "rope_type")} \
        == {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    cls = {"llama": transformers.LlamaForCausalLM,
           "mistral": transformers.MistralForCausalLM}[model_type]
    again = cls.from_pretrained(out, attn_implementation="eager").eval()
    _assert_gpt_matches(model, again, ids, mask, f"{variant} -> transformers")



# transformers 5 writes the rotary settings as one `rope_parameters` dict (measured with
# 5.17: `{"rope_theta": 500000.0, "rope_type": "llama3", "factor": 4.0, ...}`) and its
# config.json has no `rope_theta` or `rope_scaling`.
ROPE_PARAMETERS_VARIANTS = {
    "llama_llama3_theta": ("llama", dict(rope_theta=500.0, rope_scaling=_LLAMA3)),
    "mistral_linear_window": ("mistral", dict(rope_theta=50.0, sliding_window=6,
                                              rope_scaling={"rope_type": "linear",
                                                            "factor": 2.5})),
    "mixtral_theta": ("mixtral", dict(rope_theta=30.0)),
}


@pytest.mark.spread
@pytest.mark.parametrize("variant", list(ROPE_PARAMETERS_VARIANTS))
def test_hf_transformers_5_rope_parameters_are_read(variant, tmp_path):
    """A checkpoint whose config.json keeps its rotary base and scaling in transformers 5's
    `rope_parameters` gives the logits of transformers' model with the same `rope_theta` /
    `rope_scaling` (kzoo used the default base and no scaling in silence); a legacy key
    that disagrees with it is refused by name."""
    import json

    model_type, overrides = ROPE_PARAMETERS_VARIANTS[variant]
    src = os.path.join(tmp_path, "src")
    hf = _hf_modern(src, model_type, **overrides)
    config_path = os.path.join(src, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    parameters = {"rope_type": "default", **(config.pop("rope_scaling", None) or {}),
                  "rope_theta": config.pop("rope_theta")}
    with open(config_path, "w") as f:
        json.dump({**config, "rope_parameters": parameters}, f)
    model = kzoo.presets.load(src)
    assert model.backbone.rope_max_wavelength == overrides["rope_theta"]
    ids, mask = _right_padded(lengths=(14, 11, 5), width=14)
    _assert_gpt_matches(model, hf, ids, mask, variant)

    with open(config_path, "w") as f:
        json.dump({**config, "rope_parameters": parameters, "rope_theta": 10000.0}, f)
    with pytest.raises(ValueError, match="`rope_theta`=10000.0 disagrees with `rope_parameters`"):
        kzoo.presets.load(src)

def test_hf_llama3_rope_frequencies_equal_transformers():
    """kzoo's llama3 inverse frequencies (`rope_inverse_frequencies`, the one function every
    path reads) equal transformers' `_compute_llama3_parameters` for Llama 3.1 8B's settings
    (head_dim 128, theta 500000) and the tiny test model's."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kzoo.layers.position import rope_inverse_frequencies

    for theta, head_dim, scaling in (
            (500000.0, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            (10000.0, 16, _LLAMA3)):
        config = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                          rope_theta=theta, rope_scaling=dict(scaling),
                                          max_position_embeddings=131072)
        theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        assert attention_factor == 1.0
        ours = rope_inverse_frequencies(
            theta, head_dim, "llama3", scaling["factor"], scaling["low_freq_factor"],
            scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=2e-6, atol=0)


def test_gpt_head_dim_and_rope_scaling_config_round_trip_and_errors():
    """`head_dim` None round-trips as None (the size in use, `head_size`, is hidden_dim //
    num_heads); a head_dim and llama3 scaling round-trip through get_config / from_config;
    bad values raise naming the field."""
    plain = tiny_backbone("modern")
    assert plain.get_config()["head_dim"] is None and plain.head_dim is None
    assert plain.head_size == 8
    assert plain.get_config()["rope_scaling_type"] is None
    scaled = tiny_backbone("modern", head_dim=6, num_heads=3, num_kv_heads=1,
                           rope_scaling_type="llama3", rope_scaling_factor=4,
                           rope_low_freq_factor=1, rope_high_freq_factor=2,
                           rope_original_max_position_embeddings=16)
    config = scaled.get_config()
    assert config["head_dim"] == 6 and config["rope_scaling_factor"] == 4.0
    again = GPTBackbone.from_config(config)
    assert again.get_config() == config and again.head_dim == again.head_size == 6
    again.set_weights(scaled.get_weights())
    x = _inputs(_ids(2, 5))
    np.testing.assert_allclose(to_numpy(again(x)), to_numpy(scaled(x)), atol=0)
    assert tuple(scaled.init_cache(2, 7).shape) == (2, 2, 2, 1, 7, 6)
    rotary = dict(CONFIGS["modern"])
    for bad, field in (
            (dict(head_dim=0), "head_dim"),
            (dict(head_dim=7, **rotary), "head_dim"),
            (dict(rope_scaling_type="dynamic", **rotary), "rope_scaling_type"),
            (dict(rope_scaling_type="linear"), "rope_scaling_type"),  # learned positions
            (dict(rope_scaling_factor=2.0, **rotary), "rope_scaling_factor"),
            (dict(rope_scaling_type="linear", rope_scaling_factor=0, **rotary),
             "rope_scaling_factor"),
            (dict(rope_scaling_type="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1,
                  rope_high_freq_factor=4, **rotary), "rope_original_max_position_embeddings"),
            (dict(rope_scaling_type="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=4,
                  rope_high_freq_factor=1, rope_original_max_position_embeddings=8, **rotary),
             "rope_high_freq_factor"),
            (dict(rope_scaling_type="linear", rope_scaling_factor=2.0, rope_low_freq_factor=1,
                  **rotary), "rope_low_freq_factor")):
        with pytest.raises(ValueError, match=f"`{field}`"):
            tiny_backbone("gpt2", **bad)


@pytest.mark.spread
@pytest.mark.parametrize("model_type, field, value", [
    ("llama", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("llama", "rope_scaling", {"type": "yarn"}),  # no factor
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0,
                               "beta_slow": 32.0}),  # the ramp's ends swapped
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}),
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}),
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}),
    ("mistral", "rope_scaling", {"rope_type": "longrope", "factor": 2.0}),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0}),  # original_max_position_embeddings?
    ("llama", "rope_scaling", {"rope_type": "linear"}),  # no factor
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": -2.0}),
    ("llama", "rope_scaling", "linear"),
    ("llama", "partial_rotary_factor", 0.5),
    ("llama", "head_dim", 0),
    ("llama", "head_dim", 15),
    ("llama", "head_dim", "16"),
    ("llama", "mlp_bias", True),
    ("llama", "hidden_act", "gelu_10"),
    ("mixtral", "sliding_window", 0),
    ("mistral", "sliding_window", 2.5),
])
def test_hf_modern_config_errors(model_type, field, value):
    from kzoo.convert import gpt as convert_gpt

    config = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4,
              "max_position_embeddings": 128, field: value}
    with pytest.raises(ValueError, match=field):
        convert_gpt.config_from_hf(config)
