"""generate's logits processors (repetition_penalty, no_repeat_ngram_size, min_new_tokens):
the processing functions against transformers' own processor classes on random scores and
histories."""

import keras
import numpy as np
import pytest
import torch
import transformers
from transformers.generation import logits_process as hf_process

from kzoo import generation
from tests.helpers import to_numpy

VOCAB = 20


def _scores(rows, seed):
    """Random float32 scores of both signs (the penalty divides or multiplies by sign)."""
    return np.random.default_rng(seed).normal(size=(rows, VOCAB)).astype("float32") * 3


def _histories(seed, lengths, tokens=5):
    """Rows of the given lengths drawn from `tokens` ids only (many repeats), and the same
    left-padded with -1 into one array."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, tokens, n).tolist() for n in lengths]
    padded = np.full((len(rows), max(lengths)), -1, "int32")
    for r, row in enumerate(rows):
        padded[r, padded.shape[1] - len(row):] = row
    return rows, padded


def _hf(processor, rows, scores):
    """transformers' processor on each row alone (rows of different lengths)."""
    return np.concatenate([
        processor(torch.tensor([row], dtype=torch.long),
                  torch.tensor(scores[r:r + 1])).numpy()
        for r, row in enumerate(rows)])


def _assert_same(ours, theirs):
    ours = to_numpy(ours)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    finite = ~np.isneginf(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=0, atol=1e-6)


# === The processing functions against transformers' classes ===


LENGTHS = [1, 2, 3, 4, 5, 7, 9, 12]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    rows, padded = _histories(0, LENGTHS)
    scores = _scores(len(rows), 1)
    theirs = _hf(hf_process.RepetitionPenaltyLogitsProcessor(penalty), rows, scores)
    ours = generation.repetition_penalty(keras.ops.convert_to_tensor(scores),
                                         keras.ops.convert_to_tensor(padded), penalty)
    _assert_same(ours, theirs)
    # (the test can fail: tokens of the history changed, the others did not)
    assert not np.allclose(theirs, scores)
    unseen = np.ones_like(scores, bool)
    for r, row in enumerate(rows):
        unseen[r, row] = False
    np.testing.assert_array_equal(theirs[unseen], scores[unseen])


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
def test_no_repeat_ngram_equals_transformers(ngram_size):
    # Histories shorter than n, of n - 1 and of n tokens, and long ones with repeated
    # n-grams (3 ids only); every row alone in transformers.
    rows, padded = _histories(ngram_size, LENGTHS + [15, 20], tokens=3)
    scores = _scores(len(rows), 2)
    processor = hf_process.NoRepeatNGramLogitsProcessor(ngram_size)
    theirs = _hf(processor, rows, scores)
    assert np.isneginf(theirs).any()
    ours = generation.no_repeat_ngram(keras.ops.convert_to_tensor(scores),
                                      keras.ops.convert_to_tensor(padded), ngram_size)
    _assert_same(ours, theirs)
    # The loop's layout: room for new tokens (-1) after the history and the end a tensor
    # (a traced step), and a batch of equal rows in transformers in one call.
    room = np.concatenate([padded, np.full((len(rows), 4), -1, "int32")], axis=1)
    ours = generation.no_repeat_ngram(
        keras.ops.convert_to_tensor(scores), keras.ops.convert_to_tensor(room), ngram_size,
        keras.ops.convert_to_tensor(padded.shape[1], "int32"))
    _assert_same(ours, theirs)
    same = np.array([row for row in rows if len(row) == 20] * 3)
    scores3 = _scores(3, 3)
    theirs = processor(torch.tensor(same), torch.tensor(scores3)).numpy()
    ours = generation.no_repeat_ngram(keras.ops.convert_to_tensor(scores3),
                                      keras.ops.convert_to_tensor(same.astype("int32")),
                                      ngram_size)
    _assert_same(ours, theirs)


def test_no_repeat_ngram_matches_a_numpy_count():
    """Hand-made: (3, 4) occurred twice, followed by 5 then 6; the row ends with 3, 4."""
    history = np.array([[3, 4, 5, 1, 3, 4, 6, 2, 3, 4]], "int32")
    out = to_numpy(generation.no_repeat_ngram(keras.ops.zeros((1, 8)),
                                              keras.ops.convert_to_tensor(history), 3))
    np.testing.assert_array_equal(np.flatnonzero(np.isneginf(out[0])), [5, 6])


@pytest.mark.parametrize("traced", [False, True])
def test_min_new_tokens_equals_transformers(traced):
    scores = _scores(3, 4)
    stops = (2, 7, 7, 19)
    prompt = 4
    for new in range(6):
        processor = hf_process.MinNewTokensLengthLogitsProcessor(prompt, 3, list(stops))
        theirs = processor(torch.zeros((3, prompt + new), dtype=torch.long),
                           torch.tensor(scores)).numpy()
        step = keras.ops.convert_to_tensor(new, "int32") if traced else new
        ours = generation.min_new_tokens_mask(keras.ops.convert_to_tensor(scores), step, 3,
                                              stops)
        _assert_same(ours, theirs)
        assert np.isneginf(theirs).any() == (new < 3)

