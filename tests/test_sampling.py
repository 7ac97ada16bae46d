"""Next-token selection against NumPy formulas."""

import keras
import numpy as np
import pytest

from kzoo.models.sampling import (
    filter_logits,
    mask_finished,
    select_next_token,
    update_finished,
)
from tests.helpers import to_numpy


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def _logits(batch=3, vocab=11, seed=0, scale=2.0):
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype("float32") * scale


def _topk_set(row, k):
    return set(np.argsort(-row)[:k].tolist())


def _topp_set(row, p):
    probs = _softmax(row)
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, p - 1e-7) + 1)  # smallest prefix with mass >= p
    return set(order[:n].tolist())


def test_greedy_is_argmax():
    logits = _logits(5, 50)
    ids = to_numpy(select_next_token(keras.ops.convert_to_tensor(logits)))
    assert ids.dtype == np.int32 and ids.shape == (5,)
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    # temperature / top-k / top-p do not change greedy decoding
    ids = select_next_token(logits, strategy="greedy", temperature=0.3, top_k=3, top_p=0.5)
    np.testing.assert_array_equal(to_numpy(ids), logits.argmax(-1))


def test_top_k_one_equals_greedy():
    logits = _logits(64, 30, seed=1)
    gen = keras.random.SeedGenerator(3)
    for _ in range(3):
        ids = select_next_token(logits, strategy="sample", top_k=1, temperature=2.0, seed=gen)
        np.testing.assert_array_equal(to_numpy(ids), logits.argmax(-1))


def test_tiny_top_p_equals_greedy():
    logits = _logits(64, 30, seed=2)
    ids = select_next_token(logits, strategy="sample", top_p=1e-6, seed=5)
    np.testing.assert_array_equal(to_numpy(ids), logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 5])
def test_samples_inside_top_k(k):
    base = _logits(3, 20, seed=3, scale=0.5)  # flat-ish: sampling would often leave top-k
    reps = 400
    logits = np.repeat(base, reps, axis=0)
    ids = to_numpy(select_next_token(logits, strategy="sample", top_k=k, seed=11))
    ids = ids.reshape(3, reps)
    for row in range(3):
        allowed = _topk_set(base[row], k)
        assert set(ids[row].tolist()) <= allowed
        assert len(set(ids[row].tolist())) == k  # every allowed token is drawn at some point


@pytest.mark.parametrize("p", [0.3, 0.75, 0.95])
def test_samples_inside_top_p(p):
    base = _logits(3, 20, seed=4, scale=1.5)
    reps = 400
    logits = np.repeat(base, reps, axis=0)
    ids = to_numpy(select_next_token(logits, strategy="sample", top_p=p, seed=12))
    ids = ids.reshape(3, reps)
    for row in range(3):
        allowed = _topp_set(base[row], p)
        assert set(ids[row].tolist()) <= allowed
    # the filtered distribution keeps exactly the nucleus
    filtered = to_numpy(filter_logits(base, top_p=p))
    for row in range(3):
        assert set(np.nonzero(filtered[row] > -1e29)[0].tolist()) == _topp_set(base[row], p)


def test_top_k_and_top_p_combined():
    base = _logits(2, 20, seed=5, scale=1.0)
    filtered = to_numpy(filter_logits(base, temperature=0.5, top_k=6, top_p=0.6))
    for row in range(2):
        scaled = base[row] / 0.5
        top6 = np.argsort(-scaled)[:6]
        renorm = np.full_like(scaled, -np.inf)
        renorm[top6] = scaled[top6]
        expect = _topp_set(renorm, 0.6)
        assert set(np.nonzero(filtered[row] > -1e29)[0].tolist()) == expect
        kept = sorted(expect)
        np.testing.assert_allclose(filtered[row, kept], scaled[kept], rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_empirical_distribution_matches_softmax(temperature):
    base = np.array([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]], "float32")
    n = 20000
    logits = np.repeat(base, n, axis=0)
    ids = to_numpy(
        select_next_token(logits, strategy="sample", temperature=temperature, seed=7)
    )
    freq = np.bincount(ids, minlength=6) / n
    expected = _softmax(base[0] / temperature)
    # 4 standard errors of a binomial proportion
    tol = 4 * np.sqrt(expected * (1 - expected) / n) + 1e-3
    assert np.all(np.abs(freq - expected) < tol), (freq, expected)


def test_empirical_distribution_top_k_renormalised():
    base = np.array([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]], "float32")
    n = 20000
    ids = to_numpy(
        select_next_token(np.repeat(base, n, 0), strategy="sample", top_k=3, seed=8)
    )
    freq = np.bincount(ids, minlength=6) / n
    expected = np.zeros(6)
    keep = [3, 0, 1]
    expected[keep] = _softmax(base[0, keep])
    tol = 4 * np.sqrt(expected * (1 - expected) / n) + 1e-3
    assert np.all(np.abs(freq - expected) < tol), (freq, expected)


def test_seed_generator_advances_and_int_seed_repeats():
    logits = np.zeros((256, 50), "float32")
    a = to_numpy(select_next_token(logits, strategy="sample", seed=123))
    b = to_numpy(select_next_token(logits, strategy="sample", seed=123))
    np.testing.assert_array_equal(a, b)
    gen = keras.random.SeedGenerator(1)
    c = to_numpy(select_next_token(logits, strategy="sample", seed=gen))
    d = to_numpy(select_next_token(logits, strategy="sample", seed=gen))
    assert (c != d).any()


def test_update_and_mask_finished():
    finished = update_finished(None, np.array([3, 7, 9], "int32"), stop_token_ids=[7, 9])
    np.testing.assert_array_equal(to_numpy(finished), [False, True, True])
    finished2 = update_finished(finished, np.array([7, 1, 1], "int32"), stop_token_ids=7)
    np.testing.assert_array_equal(to_numpy(finished2), [True, True, True])
    same = update_finished(finished, np.array([7, 1, 1], "int32"), stop_token_ids=None)
    np.testing.assert_array_equal(to_numpy(same), [False, True, True])
    masked = mask_finished(np.array([5, 6, 8], "int32"), finished, pad_id=-1)
    np.testing.assert_array_equal(to_numpy(masked), [5, -1, -1])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"strategy": "beam"}, "strategy"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        select_next_token(np.zeros((1, 4), "float32"), **kwargs)
