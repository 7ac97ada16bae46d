"""T5 family: backbone and seq2seq LM against Hugging Face transformers, decoding, saving,
training, presets and the Hugging Face converter."""

import json
import os

import keras
import numpy as np
import pytest

import kzoo.presets
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM
from tests.harness import (
    assert_matches_transformers, assert_same_hf_tensors, check_config_round_trip,
    check_fit_lowers_loss, check_keras_file_round_trip, check_preset_round_trip,
    QUICKER_LOOP, hf_checkpoint, to_numpy, torch_forward,
)

VOCAB = 61

VERSIONS = {
    "v1_0": dict(feedforward="relu", tie_embeddings=True),
    "v1_1": dict(feedforward="gated-gelu", tie_embeddings=False),
}


def tiny_backbone(version="v1_0", **overrides):
    # num_heads * key_value_dim (24) differs from hidden_dim (16) on purpose.
    config = dict(
        vocabulary_size=VOCAB, num_layers=2, num_decoder_layers=3, num_heads=4,
        hidden_dim=16, key_value_dim=6, intermediate_dim=24, dropout=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )
    config.update(VERSIONS[version])
    config.update(overrides)
    return T5Backbone(**config)


def tiny_lm(version="v1_0", **overrides):
    return T5Seq2SeqLM(tiny_backbone(version, **overrides))


_SHARED = {}


def shared_lm(version):
    """One tiny model per version for the tests that only read it (building is the slow part)."""
    if version not in _SHARED:
        keras.utils.set_random_seed(0)
        _SHARED[version] = tiny_lm(version)
    return _SHARED[version]


def _batch(seed=0, batch=2, enc_len=9, dec_len=7, enc_real=(9, 5), dec_real=(7, 4),
           vocab=VOCAB, pad_id=0):
    """Right-padded encoder/decoder batches (real tokens in [2, vocab))."""
    rng = np.random.default_rng(seed)
    enc = rng.integers(2, vocab, (batch, enc_len)).astype("int32")
    dec = rng.integers(2, vocab, (batch, dec_len)).astype("int32")
    enc_mask = (np.arange(enc_len)[None] < np.asarray(enc_real)[:, None]).astype("int32")
    dec_mask = (np.arange(dec_len)[None] < np.asarray(dec_real)[:, None]).astype("int32")
    enc[enc_mask == 0] = pad_id
    dec[dec_mask == 0] = pad_id
    return {
        "encoder_token_ids": enc,
        "encoder_padding_mask": enc_mask,
        "decoder_token_ids": dec,
        "decoder_padding_mask": dec_mask,
    }


def _pad_more(inputs, extra_enc, extra_dec, seed=1):
    """The same batch with more padding, filled with arbitrary (non-pad) garbage ids."""
    rng = np.random.default_rng(seed)
    out = {}
    for side, extra in (("encoder", extra_enc), ("decoder", extra_dec)):
        ids = inputs[f"{side}_token_ids"]
        mask = inputs[f"{side}_padding_mask"]
        b, n = ids.shape
        new_ids = rng.integers(2, VOCAB, (b, n + extra)).astype("int32")
        new_mask = np.zeros((b, n + extra), "int32")
        new_ids[:, :n] = np.where(mask == 1, ids, new_ids[:, :n])
        new_mask[:, :n] = mask
        out[f"{side}_token_ids"] = new_ids
        out[f"{side}_padding_mask"] = new_mask
    return out


# === Forward ===


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_forward_shapes_and_dtypes(version):
    lm = shared_lm(version)
    inputs = _batch()
    out = lm.backbone(inputs)
    assert set(out) == {"encoder_sequence_output", "decoder_sequence_output"}
    assert tuple(out["encoder_sequence_output"].shape) == (2, 9, 16)
    assert tuple(out["decoder_sequence_output"].shape) == (2, 7, 16)
    logits = lm(inputs)
    assert tuple(logits.shape) == (2, 7, VOCAB)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    assert np.all(np.isfinite(to_numpy(logits)))
    # T5 has no biases, one bias table per stack, and the untied head only in v1.1.
    paths = [v.path for v in lm.weights]
    assert not any(p.endswith("/bias") for p in paths)
    assert sum("relative_attention_bias" in p for p in paths) == 2
    assert any("lm_head" in p for p in paths) == (version == "v1_1")


@pytest.mark.spread
def test_mixed_precision_dtypes():
    lm = tiny_lm("v1_1", dtype="mixed_bfloat16")
    out = lm.backbone(_batch())
    assert keras.backend.standardize_dtype(out["decoder_sequence_output"].dtype) == "bfloat16"
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in lm.weights)
    logits = to_numpy(lm(_batch())).astype("float32")
    assert np.all(np.isfinite(logits))


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_padding_invariance(version):
    lm = shared_lm(version)
    inputs = _batch()
    longer = _pad_more(inputs, extra_enc=4, extra_dec=3)
    a = to_numpy(lm(inputs))
    b = to_numpy(lm(longer))[:, : a.shape[1]]
    real = inputs["decoder_padding_mask"].astype(bool)
    np.testing.assert_allclose(b[real], a[real], atol=1e-5, rtol=1e-5)
    enc_a = to_numpy(lm.backbone(inputs)["encoder_sequence_output"])
    enc_b = to_numpy(lm.backbone(longer)["encoder_sequence_output"])[:, :9]
    enc_real = inputs["encoder_padding_mask"].astype(bool)
    np.testing.assert_allclose(enc_b[enc_real], enc_a[enc_real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_causality(version):
    lm = shared_lm(version)
    inputs = _batch(dec_real=(7, 7))
    base = to_numpy(lm(inputs))
    changed = dict(inputs)
    dec = inputs["decoder_token_ids"].copy()
    dec[:, 4:] = (dec[:, 4:] + 7) % (VOCAB - 2) + 2
    changed["decoder_token_ids"] = dec
    after = to_numpy(lm(changed))
    np.testing.assert_allclose(after[:, :4], base[:, :4], atol=1e-6, rtol=1e-6)
    assert np.abs(after[:, 4:] - base[:, 4:]).max() > 1e-3


def test_initialisation_follows_t5():
    """Std of every weight as in HF `T5PreTrainedModel._init_weights` (factor 1.0)."""
    d, kv, h, ff = 64, 16, 4, 256
    lm = T5Seq2SeqLM(T5Backbone(
        vocabulary_size=512, num_layers=2, num_decoder_layers=1, num_heads=h, hidden_dim=d,
        key_value_dim=kv, intermediate_dim=ff, feedforward="gated-gelu", tie_embeddings=False,
    ))
    expected = {
        "query_dense": (d * kv) ** -0.5, "key_dense": d ** -0.5, "value_dense": d ** -0.5,
        "attention/output_dense": (h * kv) ** -0.5,
        "gate_dense": d ** -0.5, "up_dense": d ** -0.5,
        "feedforward/output_dense": ff ** -0.5,
        "token_embedding": 1.0, "lm_head": 1.0,
    }
    seen = set()
    for v in lm.weights:
        value = to_numpy(v)
        if "norm" in v.path:
            np.testing.assert_array_equal(value, np.ones_like(value))
            continue
        if "relative_attention_bias" in v.path:
            assert value.shape == (32, h)  # (buckets, heads)
            assert 0.5 * d ** -0.5 < value.std() < 1.5 * d ** -0.5
            continue
        key = next(k for k in expected if k in v.path)
        seen.add(key)
        assert abs(value.mean()) < 0.1 * expected[key], v.path
        assert abs(value.std() / expected[key] - 1) < 0.1, (v.path, value.std(), expected[key])
    assert seen == set(expected)
    # Every kernel is its own draw (no two layers share values).
    kernels = [to_numpy(v) for v in lm.weights if "query_dense" in v.path]
    kernels += [to_numpy(v) for v in lm.weights if "feedforward/output_dense" in v.path]
    for i in range(len(kernels)):
        for j in range(i):
            assert kernels[i].shape != kernels[j].shape or not np.allclose(kernels[i], kernels[j])


# === Decoding ===


def _full_logits(lm, enc, enc_mask, dec):
    return to_numpy(lm({
        "encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
        "decoder_token_ids": dec, "decoder_padding_mask": np.ones_like(dec),
    }))


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_cached_decoding_equals_full_recompute(version):
    lm = shared_lm(version)
    backbone = lm.backbone
    inputs = _batch(dec_real=(7, 7))
    enc, enc_mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    dec = inputs["decoder_token_ids"]
    full = _full_logits(lm, enc, enc_mask, dec)
    encoded = backbone.encode(enc, enc_mask)
    self_cache, cross_cache = backbone.init_cache(2, 10, encoded)  # longer than needed
    assert tuple(self_cache.shape) == (2, 3, 2, 4, 10, 6)  # (batch, layers, k/v, heads, len, dim)
    assert tuple(cross_cache.shape) == (2, 3, 2, 4, 9, 6)
    # First three tokens in one call, then one token per step.
    hidden, self_cache = backbone.decode_step(dec[:, :3], enc_mask, self_cache, cross_cache, 0)
    steps = [to_numpy(lm._logits(hidden))]
    for i in range(3, 7):
        hidden, self_cache = backbone.decode_step(
            dec[:, i:i + 1], enc_mask, self_cache, cross_cache,
            keras.ops.convert_to_tensor(i, "int32"),
        )
        steps.append(to_numpy(lm._logits(hidden)))
    cached = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_decode_loop_steps_equal_full_recompute(version, monkeypatch):
    """The steps as the decode loop runs them (on torch: `fast_decode`'s path, with the
    causal relative-bias table made once per loop, attending to the written slots only for
    a Python int index), with a host or a tensor index, equal the full forward pass; a row
    whose encoder input is all padding included."""
    import contextlib

    from kzoo.layers import fast_decode
    from kzoo.models.t5 import T5Backbone

    lm = shared_lm(version)
    inputs = _batch(batch=3, enc_real=(9, 5, 0), dec_real=(7, 7, 7))
    enc, enc_mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    dec = inputs["decoder_token_ids"]
    dec[:, 0] = 0  # the decoder start token
    full = _full_logits(lm, enc, enc_mask, dec)
    torch = keras.backend.backend() == "torch"
    calls = []
    table_rows = T5Backbone._causal_bias_rows
    monkeypatch.setattr(T5Backbone, "_causal_bias_rows",
                        lambda *a: calls.append(1) or table_rows(*a))
    for index in ("int", "tensor"):
        no_grad = contextlib.nullcontext()
        if torch:
            import torch as th

            no_grad = th.no_grad()
        with no_grad, fast_decode.fast_steps():
            logits, state, constants = lm.generation_prefill(
                {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
                 "decoder_start_token_ids": dec[:, :1]}, 7)
            steps = [to_numpy(logits)]
            for t in range(6):
                i = t if index == "int" else keras.ops.convert_to_tensor(t, "int32")
                logits, state = lm.generation_step(dec[:, t + 1:t + 2], state, constants, i)
                steps.append(to_numpy(logits))
        np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert len(calls) == (14 if torch else 0)  # the fast path runs on torch only


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_generate_greedy_equals_recompute(version):
    lm = shared_lm(version)
    inputs = _batch()
    enc, enc_mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    out = lm.generate({"encoder_token_ids": enc, "encoder_padding_mask": enc_mask},
                      max_new_tokens=6, stop_token_ids=None, compile=QUICKER_LOOP)
    assert isinstance(out, list) and [len(row) for row in out] == [6, 6]
    assert all(type(token) is int for row in out for token in row)
    # Reference: re-run the whole model on the sequence so far, take the argmax. (The
    # sequence is kept at a fixed length, the future slots filled with zeros: the decoder
    # is causal, and a fixed shape saves JAX from compiling every op once per length.)
    dec = np.zeros((2, 7), "int32")
    for t in range(6):
        logits = _full_logits(lm, enc, enc_mask, dec)[:, t]
        dec[:, t + 1] = logits.argmax(-1)
    np.testing.assert_array_equal(np.array(out), dec[:, 1:])
    # Raw id arrays: the padding mask is ids != 0; the other loop (compiled / eager) agrees.
    assert lm.generate(enc, max_new_tokens=6, stop_token_ids=None,
                       compile=not QUICKER_LOOP) == out
    # ... or an explicit padding_mask.
    assert lm.generate(enc, padding_mask=enc_mask, max_new_tokens=6, stop_token_ids=None,
                       compile=QUICKER_LOOP) == out
    # A row alone, or rows of different lengths, give the same tokens as in the batch.
    alone = lm.generate(enc[1:, :5], max_new_tokens=6, stop_token_ids=None,
                        compile=QUICKER_LOOP)
    assert alone[0] == out[1]
    ragged = lm.generate([list(enc[0]), list(enc[1, :5])], max_new_tokens=6,
                         stop_token_ids=None, compile=QUICKER_LOOP)
    assert ragged == out


def test_generate_refuses_an_empty_input_as_gpt_does():
    """An encoder input without a real token (an empty list, or a row all padding) is
    refused by name, as GPT refuses an empty prompt (it was answered from nothing)."""
    lm = shared_lm("v1_0")
    with pytest.raises(ValueError, match="Input 1 is empty"):
        lm.generate([[5, 6], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="Input 0 is empty"):
        lm.generate(np.array([[0, 0, 0], [5, 6, 7]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="Input 0 is empty"):
        lm.generate({"encoder_token_ids": np.array([[5, 6]]),
                     "encoder_padding_mask": np.array([[0, 0]])}, max_new_tokens=2)
    assert len(lm.generate([[5, 6], [7]], max_new_tokens=2)) == 2
    # No prompt at all: the words GPT uses.
    for prompts in ([], np.zeros((0, 4), "int32"),
                    {"encoder_token_ids": np.zeros((0, 3), "int32")}):
        with pytest.raises(ValueError, match="`prompts` is empty"):
            lm.generate(prompts, max_new_tokens=2)


@pytest.mark.spread
def test_generate_refuses_a_cache_that_cannot_exist(monkeypatch):
    """`max_new_tokens` beyond int32 positions, or a self-attention cache larger than the
    machine's memory, is refused by name before anything is allocated (it was an overflow
    inside JAX's jit or the allocator's failure)."""
    from kzoo import generation

    lm = shared_lm("v1_0")
    backbone = lm.backbone
    for n in (2 ** 31, 10 ** 12):
        with pytest.raises(ValueError, match=f"max_new_tokens={n} needs {n} cache positions"):
            lm.generate([[5, 6]], max_new_tokens=n)
    # bytes a position: decoder layers x (keys, values) x rows x beams x heads x dim x 4
    per_position = (len(backbone.decoder_layers) * 2 * 2 * 3 * backbone.num_heads
                    * backbone.key_value_dim * 4)
    # plus the float32 logits of a step (rows x beams x vocabulary, a few copies)
    logits = generation._LOGITS_COPIES * 2 * 3 * backbone.vocabulary_size * 4
    monkeypatch.setattr(generation, "_memory_bytes", lambda: 10 * per_position + logits)
    with pytest.raises(ValueError, match=r"max_new_tokens=11 and num_beams=3 for 2 "
                                         r"prompt\(s\) need .* \(a key/value cache"):
        lm.generate([[5, 6], [7]], max_new_tokens=11, strategy="beam", num_beams=3)
    assert len(lm.generate([[5, 6], [7]], max_new_tokens=10, strategy="beam",
                           num_beams=3)) == 2


@pytest.mark.spread
def test_generate_stop_tokens():
    lm = shared_lm("v1_1")
    enc = _batch()["encoder_token_ids"]
    free = lm.generate(enc, max_new_tokens=8, stop_token_ids=None, compile=False)
    stop = free[0][2]
    for compile in (False, True):
        out = lm.generate(enc, max_new_tokens=8, stop_token_ids=(stop,), pad_token_id=0,
                          compile=compile)
        for row in range(2):
            if stop in free[row]:
                # cut right after the row's first stop token (nothing after it)
                assert out[row] == free[row][: free[row].index(stop) + 1]
            else:
                assert out[row] == free[row]
    # an id past the vocabulary is refused, as by the constructor (it never stops a row)
    with pytest.raises(ValueError, match=rf"stop_token_ids.*vocabulary_size={VOCAB}"):
        lm.generate(enc, max_new_tokens=2, stop_token_ids=[VOCAB])
    # That the loop itself ends once every row has ended is checked in test_generation.py
    # (test_loop_ends_when_every_row_has_ended), where the steps can be counted.


@pytest.mark.spread
def test_generate_sampling():
    lm = shared_lm("v1_0")
    enc = _batch()["encoder_token_ids"]
    greedy = lm.generate(enc, max_new_tokens=5, stop_token_ids=None, compile=False)
    top1 = lm.generate(enc, max_new_tokens=5, strategy="sample", top_k=1, seed=3,
                       stop_token_ids=None, compile=False)
    assert top1 == greedy
    a = lm.generate(enc, max_new_tokens=5, strategy="sample", temperature=2.0, seed=7,
                    stop_token_ids=None, compile=False)
    b = lm.generate(enc, max_new_tokens=5, strategy="sample", temperature=2.0, seed=7,
                    stop_token_ids=None, compile=False)
    assert a == b
    # the compiled loop draws the same tokens from the same seed
    assert lm.generate(enc, max_new_tokens=5, strategy="sample", temperature=2.0, seed=7,
                       stop_token_ids=None) == a
    flat = np.array(a)
    assert flat.min() >= 0 and flat.max() < VOCAB
    with pytest.raises(ValueError, match="strategy"):
        lm.generate(enc, strategy="nucleus")
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate(enc, strategy="sample", num_beams=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(enc, max_new_tokens=0)


@pytest.mark.spread
def test_generate_with_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", "</s>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "</s>"])
    lm = shared_lm("v1_0")
    lm.tokenizer = tok
    options = dict(max_new_tokens=4, stop_token_ids=None, compile=QUICKER_LOOP)
    ids = lm.generate(np.array([[5, 6, 7]], "int32"), **options)
    text = lm.generate("w3 w4 w5", **options)
    assert text == " ".join(words[i] for i in ids[0] if i > 1)
    texts = lm.generate(["w3 w4 w5", "w9"], **options)
    assert isinstance(texts, list) and len(texts) == 2 and texts[0] == text
    # return_scores: the same texts, the scores shaped as them (one string: one list)
    _, id_scores = lm.generate(np.array([[5, 6, 7]], "int32"), return_scores=True, **options)
    one, scores = lm.generate("w3 w4 w5", return_scores=True, **options)
    assert one == text and len(scores) == 4 and all(isinstance(s, float) for s in scores)
    np.testing.assert_allclose(scores, id_scores[0], atol=1e-5)
    both, scores = lm.generate(["w3 w4 w5", "w9"], return_scores=True, **options)
    assert both == texts and [len(s) for s in scores] == [4, 4]
    np.testing.assert_allclose(scores[0], id_scores[0], atol=1e-5)
    del lm.tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        lm.generate("w3 w4")


# === Saving ===


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_keras_file_round_trip(version, tmp_path):
    lm = shared_lm(version)
    inputs = _batch()
    restored = check_keras_file_round_trip(lm, inputs, tmp_path, atol=1e-6)
    assert isinstance(restored, T5Seq2SeqLM)
    assert restored.backbone.get_config() == lm.backbone.get_config()


def test_config_round_trip():
    backbone = tiny_backbone("v1_1", num_decoder_layers=None, layer_norm_epsilon=1e-5)
    config = backbone.get_config()
    clone = check_config_round_trip(backbone, _batch())
    assert clone.get_config() == config
    assert len(clone.decoder_layers) == 2


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_presets_directory_round_trip(version, tmp_path):
    lm = shared_lm(version)
    inputs = _batch()
    restored = check_preset_round_trip(lm, inputs, tmp_path, atol=1e-6)
    assert isinstance(restored, T5Seq2SeqLM)
    backbone = kzoo.presets.load(tmp_path, task="backbone")
    np.testing.assert_allclose(
        to_numpy(backbone(inputs)["decoder_sequence_output"]),
        to_numpy(lm.backbone(inputs)["decoder_sequence_output"]), atol=1e-6, rtol=1e-6,
    )


# === Training ===


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_fit_lowers_loss(version):
    lm = tiny_lm(version, dropout=0.1, num_layers=1, num_decoder_layers=1)
    inputs = _batch(batch=4, enc_real=(9, 5, 7, 3), dec_real=(7, 4, 6, 2))
    labels = np.roll(inputs["decoder_token_ids"], -1, axis=1)
    weights = inputs["decoder_padding_mask"].astype("float32")
    # jit_compile="auto": XLA on JAX (on TensorFlow only with an accelerator); torch.compile
    # takes minutes
    check_fit_lowers_loss(lm, inputs, labels, sample_weight=weights, batch_size=4, epochs=20,
                          min_drop=None, max_ratio=0.7, jit_compile="auto")


# === Validation ===


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_heads=0), "num_heads"),
        (dict(hidden_dim=-4), "hidden_dim"),
        (dict(key_value_dim=2.5), "key_value_dim"),
        (dict(num_decoder_layers=0), "num_decoder_layers"),
        (dict(dropout=1.0), "dropout"),
        (dict(layer_norm_epsilon=0), "layer_norm_epsilon"),
        (dict(feedforward="swiglu"), "feedforward"),
        (dict(relative_attention_num_buckets=3), "relative_attention_num_buckets"),
        (dict(relative_attention_num_buckets=32, relative_attention_max_distance=16),
         "relative_attention_max_distance"),
        (dict(tie_embeddings="yes"), "tie_embeddings"),
        (dict(kernel="flash"), "kernel"),
    ],
)
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_backbone("v1_0", **overrides)


def test_task_rejects_other_backbones():
    with pytest.raises(ValueError, match="T5Backbone"):
        T5Seq2SeqLM(keras.Sequential([keras.layers.Dense(2)]))


# === Presets ===


def _t5_param_formula(vocab, d, kv, heads, ff, enc_layers, dec_layers, buckets, gated, tied):
    """Parameters of Hugging Face's T5ForConditionalGeneration, counted by hand."""
    attention = 4 * d * heads * kv
    ffn = (3 if gated else 2) * d * ff
    encoder = enc_layers * (attention + ffn + 2 * d) + d + buckets * heads
    decoder = dec_layers * (2 * attention + ffn + 3 * d) + d + buckets * heads
    return vocab * d + encoder + decoder + (0 if tied else vocab * d)


def _formula_for(spec):
    c = spec["config"]
    return _t5_param_formula(
        c["vocabulary_size"], c["hidden_dim"], c["key_value_dim"], c["num_heads"],
        c["intermediate_dim"], c["num_layers"], c["num_decoder_layers"] or c["num_layers"],
        c["relative_attention_num_buckets"], c["feedforward"].startswith("gated"),
        c["tie_embeddings"],
    )


PRESETS = ["t5_small", "t5_base", "t5_large", "t5_v1_1_small", "t5_v1_1_base"]
PUBLISHED = {"t5_small": 60.5e6, "t5_base": 223e6, "t5_large": 738e6,
             "t5_v1_1_small": 77e6, "t5_v1_1_base": 248e6}


def test_preset_json_files():
    for name in PRESETS:
        spec = kzoo.presets.info(name)
        assert spec["family"] == "t5" and spec["task"] == "seq2seq_lm"
        assert spec["params"] == _formula_for(spec), name
        assert abs(spec["params"] / PUBLISHED[name] - 1) < 0.01, name
        assert "1910.10683" in spec["paper"] and spec["hf_reference"]


@pytest.mark.spread
@pytest.mark.parametrize("name", ["t5_small", "t5_v1_1_small"])
def test_small_preset_param_counts(name):
    model = kzoo.presets.load(name)
    assert isinstance(model, T5Seq2SeqLM)
    assert model.count_params() == kzoo.presets.info(name)["params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_base", "t5_large", "t5_v1_1_base"])
def test_large_preset_param_counts(name):
    model = kzoo.presets.load(name)
    assert model.count_params() == kzoo.presets.info(name)["params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_params_equal_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    c = kzoo.presets.info(name)["config"]
    config = transformers.T5Config(
        vocab_size=c["vocabulary_size"], d_model=c["hidden_dim"], d_kv=c["key_value_dim"],
        d_ff=c["intermediate_dim"], num_layers=c["num_layers"],
        num_decoder_layers=c["num_decoder_layers"], num_heads=c["num_heads"],
        feed_forward_proj=c["feedforward"], tie_word_embeddings=c["tie_embeddings"],
    )
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(config)
    assert sum(p.numel() for p in hf.parameters()) == kzoo.presets.info(name)["params"]


# === Hugging Face ===


def _hf_model(tmp_path, version, architecture="T5ForConditionalGeneration", seed=0,
              **overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(
        vocab_size=VOCAB, d_model=16, d_kv=6, d_ff=24, num_layers=3, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        feed_forward_proj=VERSIONS[version]["feedforward"],
        tie_word_embeddings=VERSIONS[version]["tie_embeddings"],
    )
    config.update(overrides)
    torch.manual_seed(seed)
    hf = getattr(transformers, architecture)(transformers.T5Config(**config)).eval()
    if getattr(hf.config, "tie_word_embeddings", True) is False and hasattr(hf, "lm_head"):
        # The N(0, 1) head makes logits of +-25, where float32 itself is only good to ~1e-5
        # (transformers in float32 vs float64 differ by 9e-6). A smaller head keeps the
        # logits O(5), the scale of the tied model, so the 1e-5 bound is meaningful.
        with torch.no_grad():
            hf.lm_head.weight.mul_(0.25)
    hf_checkpoint(tmp_path, hf)
    return hf


def _hf_kwargs(inputs):
    """kzoo's T5 inputs under transformers' names."""
    return dict(input_ids=inputs["encoder_token_ids"],
                attention_mask=inputs["encoder_padding_mask"],
                decoder_input_ids=inputs["decoder_token_ids"],
                decoder_attention_mask=inputs["decoder_padding_mask"])


def _hf_logits(hf, inputs):
    return torch_forward(hf, **_hf_kwargs(inputs)).logits.numpy()


def _assert_t5_matches(model, hf, inputs, label, **kwargs):
    return assert_matches_transformers(model, hf, inputs, _hf_kwargs(inputs),
                                       mask=inputs["decoder_padding_mask"], label=label,
                                       **kwargs)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_hf_logits_match_transformers(version, tmp_path):
    hf = _hf_model(tmp_path, version)
    model = kzoo.presets.load(tmp_path)
    assert isinstance(model, T5Seq2SeqLM)
    inputs = _batch(enc_len=20, dec_len=18, enc_real=(20, 11), dec_real=(12, 18))
    _assert_t5_matches(model, hf, inputs, f"T5 {version} logits")


@pytest.mark.spread
@pytest.mark.parametrize("proj", ["gelu_pytorch_tanh", "gelu_fast", "gelu_python",
                                  "gated-gelu_pytorch_tanh", "gated-gelu_fast"])
def test_hf_other_gelu_names_match_transformers(proj, tmp_path):
    """transformers' other names of the tanh GELU (and "gelu_python", the exact one) in
    `feed_forward_proj`: were refused, now read as kzoo's tanh / exact GELU feed-forwards."""
    hf = _hf_model(tmp_path, "v1_0", feed_forward_proj=proj)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(enc_len=12, dec_len=9, enc_real=(12, 7), dec_real=(9, 5))
    _assert_t5_matches(model, hf, inputs, f"T5 {proj} logits")



@pytest.mark.spread
@pytest.mark.parametrize("case", ["v1_1_own_head", "v1_1_embedding_as_head", "v1_0"])
def test_hf_transformers_5_scale_decoder_outputs_is_read(case, tmp_path):
    """transformers 5 writes `tie_word_embeddings: true` for every T5 (measured with 5.17:
    flan-T5 style too) and decides the decoder output's d_model ** -0.5 scaling by
    `scale_decoder_outputs`; an unscaled model saved without `lm_head.weight` uses
    `shared.weight` as its head. kzoo scaled such a v1.1 as v1.0, in silence; the reference
    is transformers 4.57's model of the same computation."""
    import torch
    from safetensors.numpy import load_file, save_file

    version = "v1_0" if case == "v1_0" else "v1_1"
    hf = _hf_model(tmp_path, version)
    if case == "v1_1_embedding_as_head":
        with torch.no_grad():
            hf.lm_head.weight.copy_(hf.shared.weight)
        weights = os.path.join(tmp_path, "model.safetensors")
        state = load_file(weights)
        del state["lm_head.weight"]
        save_file(state, weights, metadata={"format": "pt"})
    config_path = os.path.join(tmp_path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(tie_word_embeddings=True, scale_decoder_outputs=version == "v1_0")
    with open(config_path, "w") as f:
        json.dump(config, f)
    model = kzoo.presets.load(tmp_path)
    assert model.backbone.tie_embeddings == (version == "v1_0")
    inputs = _batch(enc_len=12, dec_len=9, enc_real=(12, 7), dec_real=(9, 5))
    _assert_t5_matches(model, hf, inputs, f"T5 {case} (transformers 5 config)")

def test_hf_backbone_matches_t5model(tmp_path):
    hf = _hf_model(tmp_path, "v1_1", architecture="T5Model", seed=1)
    backbone = kzoo.presets.load(tmp_path)
    assert isinstance(backbone, T5Backbone)
    inputs = _batch(enc_len=12, dec_len=10, enc_real=(12, 6), dec_real=(5, 10))
    assert_matches_transformers(
        backbone, hf, inputs, _hf_kwargs(inputs), mask=inputs["encoder_padding_mask"],
        kzoo_select=lambda o: o["encoder_sequence_output"],
        select=lambda o: o.encoder_last_hidden_state, label="T5Model encoder")
    _assert_t5_matches(backbone, hf, inputs, "T5Model decoder",
                       kzoo_select=lambda o: o["decoder_sequence_output"],
                       select=lambda o: o.last_hidden_state)


def _cut_at_stop(row, stop, pad_id=0):
    """A transformers output row (new tokens, padded) -> the tokens up to and including the
    first `stop`; checks that only padding follows it."""
    row = [int(t) for t in row]
    if stop not in row:
        return row
    end = row.index(stop) + 1
    assert all(t == pad_id for t in row[end:]), row
    return row[:end]


@pytest.mark.spread
def test_hf_generate_defaults_come_from_the_checkpoint(tmp_path):
    """A checkpoint whose decoder starts from 3, stops at 5 and pads with 2: `generate`
    with no arguments gives transformers' `generate` with none (the start, stop and pad ids
    of its generation_config.json), kzoo's save and the export keep them, and explicit
    arguments still win."""
    import json

    import torch
    import transformers

    src = os.path.join(tmp_path, "src")
    hf = _hf_model(src, "v1_0", seed=2, decoder_start_token_id=3, eos_token_id=5,
                   pad_token_id=2)
    inputs = _batch(enc_len=15, enc_real=(15, 8), pad_id=2)
    enc, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    enc[(enc == 2) & (mask == 1)] = 4  # (real tokens other than the pad id)

    def hf_generate(model, **kwargs):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor(enc, dtype=torch.long),
                                 attention_mask=torch.tensor(mask), do_sample=False,
                                 max_new_tokens=20, **kwargs).numpy()
        assert np.all(out[:, 0] == kwargs.get("decoder_start_token_id", 3))
        return [_cut_at_stop(row, kwargs.get("eos_token_id", 5), pad_id=2)
                for row in out[:, 1:]]

    model = kzoo.presets.load(src)
    assert (model.stop_token_ids, model.decoder_start_token_id, model.pad_token_id) == (
        (5,), 3, 2)
    expected = hf_generate(hf)
    assert model.generate(enc, max_new_tokens=20) == expected  # mask: ids != pad 2
    assert model.generate({"encoder_token_ids": enc, "encoder_padding_mask": mask},
                          max_new_tokens=20) == expected
    # T5's usual ids given explicitly: transformers with the same arguments
    usual = dict(decoder_start_token_id=0, eos_token_id=1, pad_token_id=2)
    assert model.generate(enc, max_new_tokens=20, decoder_start_token_id=0,
                          stop_token_ids=[1]) == hf_generate(hf, **usual)
    kept = os.path.join(tmp_path, "kept")
    kzoo.presets.save(model, kept)
    assert kzoo.presets.load(kept).generate(enc, max_new_tokens=20) == expected
    out = os.path.join(tmp_path, "out")
    kzoo.presets.save(model, out, format="hf")
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert (written["decoder_start_token_id"], written["eos_token_id"],
            written["pad_token_id"]) == (3, 5, 2)
    again = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    assert hf_generate(again) == expected
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        model.generate(enc, decoder_start_token_id=VOCAB)
    with pytest.raises(ValueError, match="pad_token_id"):
        T5Seq2SeqLM(model.backbone, pad_token_id=-1)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_hf_greedy_generation_matches_transformers(version, tmp_path):
    import torch

    hf = _hf_model(tmp_path, version, seed=2)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(enc_len=15, enc_real=(15, 8))
    enc = inputs["encoder_token_ids"]
    mask = inputs["encoder_padding_mask"]

    def hf_generate(eos):
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor(enc, dtype=torch.long),
                attention_mask=torch.tensor(mask), do_sample=False, max_new_tokens=20,
                eos_token_id=eos, pad_token_id=0, decoder_start_token_id=0,
            ).numpy()
        assert np.all(out[:, 0] == 0)
        return out[:, 1:]

    ref = hf_generate(1)
    ours = model.generate({"encoder_token_ids": enc, "encoder_padding_mask": mask},
                          max_new_tokens=20)
    assert ours == [_cut_at_stop(row, 1) for row in ref]
    # A stop token the model actually emits (row 0, 6th token): rows end at different steps.
    stop = int(ref[0, 5]) if ref.shape[1] > 5 else 1
    ref = hf_generate(stop)
    ours = model.generate({"encoder_token_ids": enc, "encoder_padding_mask": mask},
                          max_new_tokens=20, stop_token_ids=(stop,))
    assert ours == [_cut_at_stop(row, stop) for row in ref]


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_hf_export_loads_in_transformers(version, tmp_path):
    transformers = pytest.importorskip("transformers")
    lm = tiny_lm(version)
    if version == "v1_1":  # see _hf_model: keep the logits O(5)
        lm.lm_head.kernel.assign(lm.lm_head.kernel * 0.25)
    kzoo.presets.save(lm, tmp_path, format="hf")
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert hf.config.num_decoder_layers == 3 and hf.config.d_kv == 6
    inputs = _batch(enc_len=14, dec_len=12, enc_real=(14, 9), dec_real=(8, 12))
    _assert_t5_matches(lm, hf, inputs, f"T5 {version} export")


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_hf_kzoo_hf_tensors_identical(version, tmp_path):
    _hf_model(os.path.join(tmp_path, "a"), version)
    model = kzoo.presets.load(os.path.join(tmp_path, "a"))
    kzoo.presets.save(model, os.path.join(tmp_path, "b"), format="hf")
    assert_same_hf_tensors(os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b"))
    transformers = pytest.importorskip("transformers")
    config_a = transformers.T5Config.from_pretrained(os.path.join(tmp_path, "a"))
    config_b = transformers.T5Config.from_pretrained(os.path.join(tmp_path, "b"))
    for key in ("d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                "relative_attention_num_buckets", "relative_attention_max_distance",
                "feed_forward_proj", "dense_act_fn", "is_gated_act", "tie_word_embeddings",
                "vocab_size", "layer_norm_epsilon", "dropout_rate", "architectures"):
        assert getattr(config_b, key) == getattr(config_a, key), key


def _overflowing_t5(path):
    """A tiny transformers T5 v1.0 whose first encoder and decoder blocks' feed-forward
    outputs exceed float16's range (65504) in 4 channels (positive output weights times
    1e4-scale factors after a ReLU: every token, in any summation order), saved to `path`."""
    import torch

    hf = _hf_model(path, "v1_0")
    with torch.no_grad():
        for stack in (hf.encoder, hf.decoder):
            wo = stack.block[0].layer[-1].DenseReluDense.wo.weight  # (d_model, d_ff)
            wo[:4].copy_(wo[:4].abs() * 5e4)
    hf_checkpoint(path, hf)
    return hf


def _unclamped(model):
    for block in model.backbone.encoder_layers + model.backbone.decoder_layers:
        block.clamp_float16 = False
    return model


@pytest.mark.spread
@pytest.mark.parametrize("dtype", ["float16", "mixed_float16"])
def test_float16_overflow_is_clamped_as_transformers_does(dtype, tmp_path):
    """transformers' T5 clamps the hidden states after each sub-layer in float16 (to
    +-(65504 - 1000) once any is inf): a T5 whose activations overflow float16 gives finite
    logits there. kzoo's blocks did not: inf, then NaN from the next norm. T5 blocks now
    clamp the same way (`TransformerBlock(clamp_float16=True)`): the logits are finite and
    close to transformers' model run in torch.float16, the greedy tokens (cached decoding)
    equal its own; with the option off, NaN/inf as before."""
    import torch

    hf = _overflowing_t5(tmp_path)
    inputs = _batch()
    real = inputs["decoder_padding_mask"].astype(bool)
    hidden = torch_forward(hf, **_hf_kwargs(inputs), output_hidden_states=True)
    assert hidden.encoder_hidden_states[1].abs().max() > 65504  # (float32: it overflows)
    assert hidden.decoder_hidden_states[1].abs().max() > 65504
    hf = hf.half()
    expected = _hf_logits(hf, inputs).astype("float32")
    assert np.isfinite(expected).all()

    model = kzoo.presets.load(tmp_path, dtype=dtype)
    assert all(b.clamp_float16 and b.get_config()["clamp_float16"]
               for b in model.backbone.encoder_layers + model.backbone.decoder_layers)
    logits = to_numpy(model(inputs)).astype("float32")
    assert np.isfinite(logits).all()
    # (float16 rounding: the logits are O(3), float16's spacing there 2e-3)
    np.testing.assert_allclose(logits[real], expected[real], atol=1e-2)
    if dtype == "float16":
        prompts = {"encoder_token_ids": inputs["encoder_token_ids"],
                   "encoder_padding_mask": inputs["encoder_padding_mask"]}
        with torch.no_grad():
            ref = hf.generate(input_ids=torch.tensor(prompts["encoder_token_ids"]).long(),
                              attention_mask=torch.tensor(prompts["encoder_padding_mask"]),
                              do_sample=False, max_new_tokens=6, eos_token_id=None,
                              pad_token_id=0, decoder_start_token_id=0).numpy()[:, 1:]
        ours = model.generate(prompts, max_new_tokens=6, stop_token_ids=None)
        assert ours == ref.tolist()
    unclamped = to_numpy(_unclamped(kzoo.presets.load(tmp_path, dtype=dtype))(inputs))
    assert not np.isfinite(unclamped[real]).all()


def test_clamp_float16_is_float16_only_and_saved():
    """The block option: off by default, in the block config, T5's blocks on; a block
    computing in float32 or bfloat16 leaves an inf as it is (no clamp there)."""
    from kzoo.layers.blocks import TransformerBlock

    assert TransformerBlock(num_heads=2, intermediate_dim=8).clamp_float16 is False
    block = TransformerBlock(num_heads=2, intermediate_dim=8, clamp_float16=True)
    assert TransformerBlock.from_config(block.get_config()).clamp_float16 is True
    with pytest.raises(ValueError, match="clamp_float16"):
        TransformerBlock(num_heads=2, intermediate_dim=8, clamp_float16="yes")
    x = np.array([[[np.inf, -np.inf, 3.0, 65504.0]]], "float32")
    for dtype in ("float32", "bfloat16"):
        block = TransformerBlock(num_heads=2, intermediate_dim=8, clamp_float16=True,
                                 dtype=dtype)
        y = to_numpy(keras.ops.cast(block._clamped(keras.ops.cast(x, dtype)), "float32"))
        np.testing.assert_array_equal(y, to_numpy(keras.ops.cast(keras.ops.cast(x, dtype),
                                                                  "float32")))
    block = TransformerBlock(num_heads=2, intermediate_dim=8, clamp_float16=True,
                             dtype="float16")
    top = np.float16(65504 - 1000)  # 64512 in float16, as torch's clamp rounds it
    y = to_numpy(block._clamped(keras.ops.cast(x, "float16")))
    np.testing.assert_array_equal(y, np.array([[[top, -top, 3, top]]], "float16"))
    finite = np.array([[[-65504.0, 3.0, 65504.0]]], "float16")
    np.testing.assert_array_equal(to_numpy(block._clamped(keras.ops.convert_to_tensor(finite))),
                                  finite)


def _edit_config(path, **changes):
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def test_hf_config_fields_are_honoured():
    from kzoo.convert.t5 import config_from_hf

    base = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
            "d_model": 32, "d_kv": 8, "d_ff": 40, "num_layers": 3, "num_decoder_layers": 1,
            "num_heads": 2, "relative_attention_num_buckets": 16,
            "relative_attention_max_distance": 64, "layer_norm_epsilon": 1e-5,
            "dropout_rate": 0.2, "vocab_size": 77, "feed_forward_proj": "gated-silu",
            "tie_word_embeddings": False}
    family, config, task, _ = config_from_hf(base)
    assert (family, task) == ("t5", "seq2seq_lm")
    assert config == dict(
        vocabulary_size=77, num_layers=3, num_decoder_layers=1, num_heads=2, hidden_dim=32,
        key_value_dim=8, intermediate_dim=40, dropout=0.2, layer_norm_epsilon=1e-5,
        feedforward="gated-silu", relative_attention_num_buckets=16,
        relative_attention_max_distance=64, tie_embeddings=False,
    )
    assert config_from_hf({**base, "feed_forward_proj": "gated-gelu"})[1]["feedforward"] == \
        "gated-gelu"
    assert config_from_hf({**base, "feed_forward_proj": "relu"})[1]["feedforward"] == "relu"
    # transformers lets an explicit dense_act_fn / is_gated_act override feed_forward_proj.
    assert config_from_hf({**base, "feed_forward_proj": "gated-gelu", "dense_act_fn": "relu"}
                          )[1]["feedforward"] == "gated-relu"
    assert config_from_hf({**base, "architectures": ["T5Model"]})[2] == "backbone"
    with pytest.raises(ValueError, match="feed_forward_proj"):
        config_from_hf({**base, "feed_forward_proj": "gated-tanh"})
    with pytest.raises(ValueError, match="dense_act_fn"):
        config_from_hf({**base, "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu"})
    with pytest.raises(ValueError, match="architectures"):
        config_from_hf({**base, "architectures": ["T5EncoderModel"]})
    with pytest.raises(ValueError, match="tie_encoder_decoder"):
        config_from_hf({**base, "tie_encoder_decoder": True})


def test_hf_unsupported_feed_forward_raises(tmp_path):
    _hf_model(tmp_path, "v1_0")
    _edit_config(tmp_path, feed_forward_proj="gated-tanh", dense_act_fn="tanh",
                 is_gated_act=True)
    with pytest.raises(ValueError, match="feed_forward_proj"):
        kzoo.presets.load(tmp_path)


def test_hf_missing_unexpected_and_mismatched_weights(tmp_path):
    from safetensors.numpy import load_file, save_file

    _hf_model(tmp_path, "v1_1")
    weights = os.path.join(tmp_path, "model.safetensors")
    state = load_file(weights)
    missing = "decoder.block.1.layer.1.EncDecAttention.k.weight"
    del state[missing]
    state["encoder.block.0.layer.0.SelfAttention.extra.weight"] = np.zeros((2, 2), "float32")
    # Tied copies of shared.weight written by older checkpoints are fine.
    state["encoder.embed_tokens.weight"] = state["shared.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        kzoo.presets.load(tmp_path)
    assert missing in str(error.value)
    assert "SelfAttention.extra.weight" in str(error.value)
    assert "embed_tokens" not in str(error.value)

    _hf_model(tmp_path, "v1_1")
    _edit_config(tmp_path, d_ff=30)
    with pytest.raises(ValueError, match=r"\(16, 24\).*\(16, 30\)"):
        kzoo.presets.load(tmp_path)


@pytest.mark.spread
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_all_padding_encoder_row_matches_transformers(version, tmp_path):
    """Found by the parity audit: an encoder row whose padding mask is all zeros gave kzoo's
    zeros from the encoder's self-attention and the decoder's cross-attention, where
    transformers' T5 adds the float32 minimum to the masked scores (the position bias too)
    and so attends uniformly to every key: the decoder's logits of that row, at real
    positions, differed by up to 1.5. Checked on the full forward pass and on the cached
    decode steps (`generation_prefill` / `generation_step`, on torch the `fast_decode` path)."""
    from kzoo.layers import fast_decode

    hf = _hf_model(tmp_path, version)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(batch=3, enc_real=(9, 0, 5), dec_real=(7, 7, 4))
    _assert_t5_matches(model, hf, inputs, f"{version} all-padding encoder row")
    enc, enc_mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    dec = inputs["decoder_token_ids"].copy()
    dec[:, 0] = 0
    expected = _hf_logits(hf, {**inputs, "decoder_token_ids": dec,
                               "decoder_padding_mask": np.ones_like(dec)})
    context = fast_decode.fast_steps()
    if keras.backend.backend() == "torch":
        import torch

        no_grad = torch.no_grad()
        no_grad.__enter__()
    try:
        with context:
            logits, state, constants = model.generation_prefill(
                {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
                 "decoder_start_token_ids": dec[:, :1]}, 7)
            steps = [to_numpy(logits)]
            for t in range(6):
                logits, state = model.generation_step(dec[:, t + 1:t + 2], state, constants, t)
                steps.append(to_numpy(logits))
    finally:
        if keras.backend.backend() == "torch":
            no_grad.__exit__(None, None, None)
    np.testing.assert_allclose(np.stack(steps, 1), expected, atol=1e-5, rtol=0)
