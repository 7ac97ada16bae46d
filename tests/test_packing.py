"""Packed sequences (issue #18, item 5): several documents a row for GPT and BERT.

References are independent of the code under test: the document mask and positions against
NumPy loops, a packed document's logits against the same weights in an ordinary model
(`packed_inputs=False`) running that document alone (unpadded, positions from 0), the packed
loss against a NumPy cross-entropy of those per-document logits, and `kzoo.data.pack`
against the documents it was given.
"""

import keras
import numpy as np
import pytest

import kzoo.data
from kzoo.layers import causal_mask, document_mask, document_positions, merge_masks
from kzoo.losses import TokenCrossentropy
from kzoo.models.bert import BertBackbone, BertClassifier, BertMaskedLM
from kzoo.models.gpt import GPTBackbone, GPTCausalLM, GPTConfig
from tests.harness import check_fit_lowers_loss, check_keras_file_round_trip, forward
from tests.helpers import to_numpy

VOCAB = 40
LENGTHS = (5, 1, 6)  # three documents, one of them a single token
ROW = 14  # 12 tokens + 2 padding slots


# === References ===


def numpy_document_mask(ids):
    """(batch, 1, q, k): same non-zero document id."""
    ids = np.asarray(ids)
    batch, n = ids.shape
    out = np.zeros((batch, 1, n, n), bool)
    for b in range(batch):
        for i in range(n):
            for j in range(n):
                out[b, 0, i, j] = ids[b, i] != 0 and ids[b, i] == ids[b, j]
    return out


def numpy_positions(ids):
    ids = np.asarray(ids)
    out = np.zeros(ids.shape, np.int64)
    for b in range(ids.shape[0]):
        seen = {}
        for i, d in enumerate(ids[b]):
            if d != 0:
                out[b, i] = seen.get(d, 0)
                seen[d] = out[b, i] + 1
    return out


def numpy_token_ce(logits, targets):
    """Per-token cross-entropy from logits (float64 log-softmax)."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


# === The mask and the positions ===


@pytest.mark.parametrize("ids", [
    [[1, 1, 1, 2, 2, 3, 0, 0], [1, 2, 2, 2, 2, 2, 2, 2]],    # three documents + padding
    [[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]],    # one document a row
    [[0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]],    # all padding; length-1 docs
    [[2, 2, 1, 1, 5, 5, 5, 0], [3, 0, 3, 3, 0, 0, 0, 0]],    # any numbering / layout
], ids=["three_docs", "one_doc", "padding_and_singletons", "any_numbering"])
def test_document_mask_and_positions_match_numpy(ids):
    got = to_numpy(document_mask(np.asarray(ids, "int32")))
    assert got.dtype == bool and got.shape == (2, 1, 8, 8)
    np.testing.assert_array_equal(got, numpy_document_mask(ids))
    np.testing.assert_array_equal(to_numpy(document_positions(np.asarray(ids, "int32"))),
                                  numpy_positions(ids))
    # GPT's mask: the block-diagonal mask AND causal.
    causal = np.tril(np.ones((8, 8), bool))
    np.testing.assert_array_equal(
        to_numpy(merge_masks(causal_mask(8), document_mask(np.asarray(ids, "int32")))),
        numpy_document_mask(ids) & causal)


def test_document_helpers_refuse_bad_ids():
    with pytest.raises(TypeError, match="document_ids.*integer.*float"):
        document_mask(np.ones((1, 4), "float32"))
    with pytest.raises(TypeError, match="document_ids.*integer"):
        document_positions(np.ones((1, 4), bool))
    with pytest.raises(ValueError, match=r"document_ids.*shape \(batch, seq\).*\(4,\)"):
        document_mask(np.ones((4,), "int32"))
    with pytest.raises(ValueError, match=r"document_ids.*>= 0.*-1"):
        document_positions(np.array([[1, -1, 2]]))


def test_position_layers_take_per_token_positions():
    from kzoo.layers import PositionEmbedding, RotaryEmbedding

    positions = np.array([[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]], "int32")
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    layer = PositionEmbedding(8)
    got = to_numpy(layer(x, start_index=positions))
    np.testing.assert_array_equal(got, to_numpy(layer.embeddings)[positions])
    with pytest.raises(ValueError, match="sequence length must be <= sequence_length=4"):
        PositionEmbedding(4)(x, start_index=positions)
    # RoPE, rotate-half pairing, written out in NumPy.
    heads = np.random.default_rng(1).normal(size=(2, 6, 3, 8)).astype("float32")
    angles = positions[..., None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)  # (2, 6, 4)
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    x1, x2 = heads[..., :4], heads[..., 4:]
    expected = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    got = to_numpy(RotaryEmbedding()(heads, start_index=positions))
    np.testing.assert_allclose(got, expected, atol=1e-5)


# === Models ===


def _documents(seed=0, lengths=LENGTHS, bert=False):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, VOCAB, n).astype("int32") for n in lengths]
    if bert:  # each document its own [CLS] (1) ... [SEP] (2)
        docs = [np.concatenate([[1], d, [2]]).astype("int32") for d in docs]
    return docs


def _packed_row(docs, row=ROW):
    """Documents side by side in one row (in their order), then padding."""
    ids = np.zeros((1, row), "int32")
    doc_ids = np.zeros((1, row), "int32")
    start = 0
    for d, tokens in enumerate(docs):
        ids[0, start:start + len(tokens)] = tokens
        doc_ids[0, start:start + len(tokens)] = d + 1
        start += len(tokens)
    return ids, doc_ids


def _spans(docs):
    start = 0
    for tokens in docs:
        yield slice(start, start + len(tokens))
        start += len(tokens)


GPT_SMALL = dict(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=16,
                 intermediate_dim=32, max_sequence_length=24, dropout=0.0)
GPT_STYLES = {
    "gpt2": {},
    "llama": dict(norm="rmsnorm", position="rotary", feedforward="gated", activation="silu",
                  num_kv_heads=2, use_bias=False, tie_embeddings=False),
}


_PAIRS = {}


def _gpt_pair(style):
    """A packed GPTCausalLM and an ordinary one with the same weights (made once a style:
    the tests share them, and with them JAX's compiled predict steps of each shape)."""
    if style not in _PAIRS:
        packed = GPTCausalLM(GPTBackbone(**GPT_SMALL, **GPT_STYLES[style], packed_inputs=True))
        plain = GPTCausalLM(GPTBackbone(**GPT_SMALL, **GPT_STYLES[style]))
        plain.set_weights(packed.get_weights())
        _PAIRS[style] = packed, plain
    return _PAIRS[style]


def _alone(model, tokens, extra=None):
    x = {"token_ids": tokens[None], "padding_mask": np.ones((1, len(tokens)), "int32"),
         **(extra or {})}
    return to_numpy(forward(model, x))[0]


@pytest.mark.spread
@pytest.mark.parametrize("style", sorted(GPT_STYLES))
def test_gpt_packed_row_matches_documents_alone(style):
    packed, plain = _gpt_pair(style)
    docs = _documents(1)
    ids, doc_ids = _packed_row(docs)
    # A second row: one document that fills it, a third: all padding.
    rows = np.concatenate([ids, np.arange(3, 3 + ROW, dtype="int32")[None],
                           np.zeros((1, ROW), "int32")])
    doc_rows = np.concatenate([doc_ids, np.ones((1, ROW), "int32"),
                               np.zeros((1, ROW), "int32")])
    x = {"token_ids": rows, "padding_mask": (doc_rows != 0).astype("int32"),
         "document_ids": doc_rows}
    logits = to_numpy(forward(packed, x))
    assert np.isfinite(logits).all()  # the padding slots and the all-padding row too
    worst = 0.0
    for span, tokens in zip(_spans(docs), docs):
        worst = max(worst, float(np.abs(logits[0, span] - _alone(plain, tokens)).max()))
    worst = max(worst, float(np.abs(logits[1] - _alone(plain, rows[1])).max()))
    print(f"GPT {style}: max |packed - alone| = {worst:.2e}")
    assert worst < 1e-5


def test_bert_packed_row_matches_documents_alone():
    small = dict(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                 intermediate_dim=32, max_sequence_length=24, dropout=0.0)
    packed = BertMaskedLM(BertBackbone(**small, packed_inputs=True))
    plain = BertMaskedLM(BertBackbone(**small))
    plain.set_weights(packed.get_weights())
    docs = _documents(2, lengths=(3, 1, 4), bert=True)  # 5 + 3 + 6 = 14 tokens
    ids, doc_ids = _packed_row(docs, row=16)
    segments = np.zeros_like(ids)
    segments[0, 10:14] = 1  # sentence B inside the third document
    x = {"token_ids": ids, "segment_ids": segments,
         "padding_mask": (doc_ids != 0).astype("int32"), "document_ids": doc_ids}
    logits = to_numpy(forward(packed, x))
    assert np.isfinite(logits).all()
    worst = 0.0
    assembled = np.zeros_like(logits)
    for span, tokens in zip(_spans(docs), docs):
        alone = _alone(plain, tokens, {"segment_ids": segments[:, span]})
        worst = max(worst, float(np.abs(logits[0, span] - alone).max()))
        assembled[:, span] = alone
    print(f"BERT: max |packed - alone| = {worst:.2e}")
    assert worst < 1e-5
    # At `mask_positions` the last block computes those rows only, each under its own row
    # of the document mask.
    positions = np.array([[13, 0, 6, 9, 5, 6]], "int32")  # the three documents, a repeat
    rows = to_numpy(forward(packed, {**x, "mask_positions": positions}))
    np.testing.assert_allclose(rows, assembled[:, positions[0]], atol=1e-5)


def test_gpt_packed_loss_is_the_token_weighted_mean_of_document_losses():
    packed, plain = _gpt_pair("gpt2")
    # The documents of the test above (their shapes are compiled already on JAX) and one
    # that fills a row: 26 tokens in two rows of 14.
    docs = _documents(1) + [np.arange(3, 3 + ROW, dtype="int32")]
    rows = kzoo.data.pack(docs, ROW)
    assert rows["token_ids"].shape[0] == 2
    x, y, w = kzoo.data.next_token_targets(rows)
    packed.compile(loss=TokenCrossentropy(reduction="mean_with_sample_weight"))
    got = packed.evaluate(x, y, sample_weight=w, batch_size=len(y), verbose=0)
    losses, counts = [], []
    for tokens in docs:
        if len(tokens) > 1:
            ce = numpy_token_ce(_alone(plain, tokens)[:-1], tokens[1:])
            losses.append(ce.mean())
            counts.append(len(tokens) - 1)
    expected = np.average(losses, weights=counts)
    print(f"packed loss {got:.7f}, token-weighted mean of {len(losses)} documents "
          f"{expected:.7f}")
    assert abs(got - expected) < 1e-5


def _check_packed_ids(model, x):
    def call(**changes):
        model({**x, **changes})

    ids = x["document_ids"]
    with pytest.raises(ValueError, match=r"document_ids.*missing.*packed_inputs=True"):
        model({k: v for k, v in x.items() if k != "document_ids"})
    with pytest.raises(ValueError, match=r"document_ids.*integer.*float32"):
        call(document_ids=ids.astype("float32"))
    with pytest.raises(ValueError, match=r"document_ids.*shape of `token_ids`"):
        call(document_ids=ids[:, :-1])
    bad = ids.copy()
    bad[0, 2] = -3
    with pytest.raises(ValueError, match=r"document id -3 at batch row 0, token 2.*>= 0"):
        call(document_ids=bad)
    bad = ids.copy()
    bad[0, 1] = 0
    with pytest.raises(ValueError, match=r"document id 0 at batch row 0, token 1.*>= 1"):
        call(document_ids=bad)
    bad = ids.copy()
    bad[0, 0] = -3
    with pytest.raises(ValueError, match=r"document_ids. \(fit.s x\) holds document id -3"):
        model.fit({**x, "document_ids": bad}, x["token_ids"], verbose=0)
    # A tf.data pipeline is checked batch by batch, on the host.
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices({**x, "document_ids": bad}).batch(1)
    with pytest.raises(ValueError, match=r"document_ids. \(a batch of predict.s x\) holds "
                                         r"document id -3"):
        model.predict(dataset, verbose=0)


def test_bad_document_ids_raise_clear_errors():
    model = GPTCausalLM(GPTBackbone(**GPT_SMALL, packed_inputs=True))
    model.compile("adam")
    ids, doc_ids = _packed_row(_documents(4))
    _check_packed_ids(model, {"token_ids": ids, "padding_mask": (doc_ids != 0).astype("int32"),
                              "document_ids": doc_ids})
    bert = BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                        intermediate_dim=16, max_sequence_length=ROW, packed_inputs=True)
    with pytest.raises(ValueError, match=r"document id 0 at batch row 0, token 1.*>= 1"):
        bert({"token_ids": ids, "segment_ids": np.zeros_like(ids),
              "padding_mask": np.ones_like(ids), "document_ids": np.where(
                  np.arange(ROW) == 1, 0, 1)[None].astype("int32")})


def test_packed_config_rules():
    with pytest.raises(ValueError, match=r"`packed_inputs`.*attention='full'.*sliding_window"):
        GPTConfig(packed_inputs=True, attention="sliding_window",
                  attention_options={"window": 4})
    with pytest.raises(ValueError, match=r"`packed_inputs`.*attention='full'.*linear"):
        BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                     intermediate_dim=16, attention="linear", packed_inputs=True)
    with pytest.raises(ValueError, match=r"`packed_inputs`.*'yes'"):
        GPTConfig(packed_inputs="yes")
    backbone = BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                            intermediate_dim=16, packed_inputs=True)
    with pytest.raises(ValueError, match=r"BertClassifier.*packed_inputs=True"):
        BertClassifier(backbone, num_classes=2)
    # Without the flag the inputs are keras-hub's, exactly as before.
    assert sorted(GPTBackbone(**GPT_SMALL).input) == ["padding_mask", "token_ids"]
    assert sorted(backbone.input) == ["document_ids", "output_positions", "padding_mask",
                                      "segment_ids", "token_ids"]


@pytest.mark.spread
def test_packed_models_round_trip_keras_files(tmp_path):
    packed, _ = _gpt_pair("llama")
    ids, doc_ids = _packed_row(_documents(5))
    x = {"token_ids": ids, "padding_mask": (doc_ids != 0).astype("int32"),
         "document_ids": doc_ids}
    restored = check_keras_file_round_trip(packed, x, str(tmp_path / "gpt"))
    assert restored.backbone.packed_inputs is True
    bert = BertMaskedLM(BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                     hidden_dim=8, intermediate_dim=16,
                                     max_sequence_length=ROW, packed_inputs=True))
    check_keras_file_round_trip(bert, {**x, "segment_ids": np.zeros_like(ids)},
                                str(tmp_path / "bert"))


def _repetitive_documents(count, seed):
    """Documents that count up from a random start (learnable next tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        start, length = rng.integers(3, VOCAB - 12), rng.integers(2, 11)
        out.append(np.arange(start, start + length, dtype="int32"))
    return out


@pytest.mark.spread
def test_gpt_fit_on_packed_data_lowers_the_loss():
    model = GPTCausalLM(GPTBackbone(**{**GPT_SMALL, "num_layers": 1}, packed_inputs=True))
    x, y, w = kzoo.data.next_token_targets(kzoo.data.pack(_repetitive_documents(48, 6), 16))
    check_fit_lowers_loss(model, x, y, loss=TokenCrossentropy("mean_with_sample_weight"),
                          sample_weight=w, epochs=5, batch_size=8, min_drop=0.5)


@pytest.mark.spread
def test_bert_fit_on_packed_data_lowers_the_loss():
    model = BertMaskedLM(BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                      hidden_dim=16, intermediate_dim=32,
                                      max_sequence_length=16, dropout=0.0,
                                      packed_inputs=True))
    docs = [np.concatenate([[1], d, [2]]).astype("int32") for d in _repetitive_documents(48, 7)]
    rows = kzoo.data.pack(docs, 16)
    inputs, labels, weights = kzoo.data.mask_tokens(
        rows["token_ids"], 0 + 3, VOCAB, rate=0.3, rng=0, special_ids=(0, 1, 2),
        at_least_one=True)
    x = {**rows, "token_ids": inputs, "segment_ids": np.zeros_like(inputs)}
    check_fit_lowers_loss(model, x, labels, loss=TokenCrossentropy("mean_with_sample_weight"),
                          sample_weight=weights, epochs=5, batch_size=8, min_drop=0.5)


# === kzoo.data.pack ===


def test_pack_keeps_every_document_whole_and_in_one_row():
    rng = np.random.default_rng(8)
    docs = [list(rng.integers(1, 99, rng.integers(1, 20))) for _ in range(60)]
    packed = kzoo.data.pack(docs, 20)
    tokens, doc_ids = packed["token_ids"], packed["document_ids"]
    np.testing.assert_array_equal(packed["padding_mask"], doc_ids != 0)
    assert (tokens[doc_ids == 0] == 0).all()
    found = []
    for r in range(len(tokens)):
        row_ids = doc_ids[r][doc_ids[r] != 0]
        assert (np.diff(row_ids) >= 0).all() and row_ids[0] == 1  # 1, 1, 2, 2, 3, ...
        assert (doc_ids[r][: len(row_ids)] != 0).all()  # padding only at the end
        for d in np.unique(row_ids):
            found.append(tokens[r][doc_ids[r] == d].tolist())
    assert sorted(found) == sorted(docs)
    # Greedy packing needs fewer rows than one document a row; a lower bound holds.
    total = sum(len(d) for d in docs)
    assert -(-total // 20) <= len(tokens) < len(docs)
    assert kzoo.data.padding_fraction(packed) == pytest.approx(1 - total / tokens.size)
    one_a_row = kzoo.data.pack(docs, 20, max_documents_per_row=1)
    assert one_a_row["token_ids"].shape == (len(docs), 20)
    assert (one_a_row["document_ids"] <= 1).all()


def test_pack_long_documents_and_targets():
    long = list(range(1, 11))
    split = kzoo.data.pack([long], 4)
    assert sorted(split["token_ids"][split["document_ids"] != 0].tolist()) == long
    assert split["token_ids"].shape == (3, 4)
    truncated = kzoo.data.pack([long, [7]], 4, long_documents="truncate")
    assert sorted(truncated["token_ids"][truncated["document_ids"] != 0].tolist()) == [
        1, 2, 3, 4, 7]
    with pytest.raises(ValueError, match="Document 0 has 10 tokens.*sequence_length=4"):
        kzoo.data.pack([long], 4, long_documents="error")
    # Next-token targets never cross a document boundary.
    x, y, w = kzoo.data.next_token_targets(kzoo.data.pack([[5, 6, 7], [8, 9]], 6))
    row = x["token_ids"][0].tolist()
    docs = x["document_ids"][0].tolist()
    for i in range(6):
        same = i + 1 < 6 and docs[i] != 0 and docs[i + 1] == docs[i]
        assert w[0, i] == float(same)
        assert y[0, i] == (row[i + 1] if same else 0)
    assert w.sum() == (3 - 1) + (2 - 1)


def test_pack_refuses_bad_input():
    with pytest.raises(ValueError, match="sequence_length.*positive.*0"):
        kzoo.data.pack([[1]], 0)
    with pytest.raises(TypeError, match="documents.*integer.*float"):
        kzoo.data.pack([[1.5, 2.0]], 4)
    with pytest.raises(ValueError, match="documents.*1-D.*document 1"):
        kzoo.data.pack([[1], [[1, 2]]], 4)
    with pytest.raises(ValueError, match="long_documents.*'drop'"):
        kzoo.data.pack([[1]], 4, long_documents="drop")
    with pytest.raises(ValueError, match="max_documents_per_row.*0"):
        kzoo.data.pack([[1]], 4, max_documents_per_row=0)
    with pytest.raises(ValueError, match="packed.*document_ids"):
        kzoo.data.next_token_targets({"token_ids": np.ones((1, 3), "int32")})


# === The recipes' document tasks (--documents / --pack) ===


@pytest.mark.parametrize("mode", ["documents", "pack"])
def test_recipe_document_tasks(mode):
    from training import data as D
    from training.loop import RunConfig
    from training.recipes import bert_mlm, gpt_text

    options = {"text": "pydoc", "tokenizer": "byte", "max_chars": 6000, "seq_len": 48,
               mode: True}
    cfg = RunConfig(recipe="gpt_text", out="unused", batch_size=4, options=options)
    tokenizer, _, task = gpt_text.text_task(cfg)
    packed = mode == "pack"
    x, y, w = task.train_batch(0)
    assert ("document_ids" in x) == packed
    assert x["token_ids"].shape == (4, 48) and task.info["documents"] == (
        "packed" if packed else "padded")
    docs = x["document_ids"] if packed else x["padding_mask"]
    # A target is the next token of the same document, never across a boundary.
    for b in range(4):
        for i in range(47):
            same = docs[b, i] != 0 and docs[b, i + 1] == docs[b, i]
            assert w[b, i] == float(same) and (not same or y[b, i] == x["token_ids"][b, i + 1])
        assert w[b, 47] == 0
    assert (task.info["padding_fraction"] < 0.05) == packed
    # BERT: [CLS] ... [SEP] documents, padding and special tokens never picked.
    cfg = RunConfig(recipe="bert_mlm", out="unused", batch_size=4, preset="bert_tiny_uncased",
                    options=options)
    task = bert_mlm.document_task(cfg, tokenizer, *_text_documents(options), 48)
    x, y, w = task.train_batch(3)
    assert ("document_ids" in x) == packed
    assert (w[x["padding_mask"] == 0] == 0).all() and w.sum() > 0
    assert not np.isin(y[w > 0], tokenizer.special_ids).any()
    starts = (x["document_ids"] if packed else x["padding_mask"])
    first = np.diff(np.pad(starts, ((0, 0), (1, 0))), axis=1) != 0
    np.testing.assert_array_equal(y[first & (starts != 0)], tokenizer.bos_id)
    assert D.bert_documents([np.arange(10)], 6, tokenizer)[2].tolist() == [
        tokenizer.bos_id, 8, 9, tokenizer.eos_id]


def _text_documents(options):
    from training.recipes import _text

    _, train_docs, val_docs, _ = _text.load_documents(options)
    return train_docs, val_docs
