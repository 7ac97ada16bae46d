"""kzoo.generation: next-token selection against NumPy formulas, the decode loop (ending,
compiled == eager, prompt checks), and beam search token for token against Hugging Face
transformers (GPT-2, LLaMA-style, T5) and against an exhaustive search."""

import itertools
import re

import keras
import numpy as np
import pytest

from kzoo import generation
from kzoo.generation import (
    BeamSampler,
    GreedySampler,
    RandomSampler,
    filter_logits,
    make_sampler,
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


# === Next-token selection ===


def test_greedy_is_argmax():
    logits = _logits(5, 50)
    ids = to_numpy(select_next_token(keras.ops.convert_to_tensor(logits)))
    assert ids.dtype == np.int32 and ids.shape == (5,)
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    # temperature / top-k / top-p do not change greedy decoding
    ids = select_next_token(logits, strategy="greedy", temperature=0.3, top_k=3, top_p=0.5)
    np.testing.assert_array_equal(to_numpy(ids), logits.argmax(-1))


def test_greedy_step_equals_numpy_with_ties_and_finished_rows(monkeypatch):
    """One greedy `select` as the eager loop runs it (a Python int step: torch calls on
    torch) and as the compiled loop does (a tensor step: `keras.ops`), against NumPy: the
    first maximal logit (ties, +inf), padding for rows that had ended, a row ending at its
    stop token, the others unchanged."""
    logits = np.array([[1, 5, 5, 0], [2, 2, 2, 2], [0, np.inf, 3, np.inf], [4, 0, 9, 1],
                       [7, 1, 1, 7]], "float32")
    sampler = GreedySampler()
    carry = sampler.start(5, 6, (2,), -1)
    carry["finished"] = keras.ops.convert_to_tensor([False, True, False, False, False])
    carry["lengths"] = keras.ops.convert_to_tensor([6, 2, 6, 6, 6], "int32")
    tokens = np.full((5, 6), -1, "int32")
    tokens[:, :3] = np.arange(15).reshape(5, 3)
    carry["tokens"] = keras.ops.convert_to_tensor(tokens)
    torch_calls = []
    eager = generation.Sampler._select_torch
    monkeypatch.setattr(generation.Sampler, "_select_torch",
                        lambda *a: torch_calls.append(1) or eager(*a))
    ids = logits.argmax(-1)  # [1, 0, 1, 2, 0]
    ids[1] = -1  # ended before this step
    want_tokens = tokens.copy()
    want_tokens[:, 3] = ids
    want = {"tokens": want_tokens, "lengths": [6, 2, 6, 4, 6],  # row 3 hit the stop (2)
            "finished": [False, True, False, True, False]}
    for step in (3, keras.ops.convert_to_tensor(3, "int32")):
        new, rows = sampler.select(keras.ops.convert_to_tensor(logits), carry, step)
        assert rows is None
        for name, value in want.items():
            np.testing.assert_array_equal(to_numpy(new[name]), value)
        np.testing.assert_array_equal(to_numpy(sampler.last_tokens(new, step)), ids)
    np.testing.assert_array_equal(to_numpy(carry["tokens"]), tokens)  # not written in place
    assert len(torch_calls) == (1 if keras.backend.backend() == "torch" else 0)


def test_first_max_index_is_numpys_argmax():
    """The compiled loops' greedy pick (`first_max_index`, two reductions) against NumPy's
    argmax: ties (the first), +inf and -inf, a row of -inf only, NaN (the first NaN, as
    argmax), random rows; eager and under the backend's compiler."""
    logits = np.concatenate([
        np.array([[1, 5, 5, 0, 0, 0], [2, 2, 2, 2, 2, 2], [0, np.inf, 3, np.inf, 1, 1],
                  [-np.inf] * 6, [3, np.nan, 9, np.nan, 1, 1], [-np.inf, -1, -np.inf, 0, 0, -2]],
                 "float32"),
        np.random.default_rng(2).normal(size=(5, 6)).astype("float32")])
    want = logits.argmax(-1)
    assert want[4] == 1  # (NumPy's argmax takes the first NaN too)
    x = keras.ops.convert_to_tensor(logits)
    got = generation.first_max_index(x)
    assert keras.backend.standardize_dtype(got.dtype) == "int32"
    np.testing.assert_array_equal(to_numpy(got), want)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        compiled = jax.jit(generation.first_max_index)(x)
    elif backend == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(generation.first_max_index, jit_compile=True)(x)
        # A graph that does not know the vocabulary size until it runs.
        unknown = tf.function(generation.first_max_index, input_signature=[
            tf.TensorSpec((None, None), tf.float32)])(x)
        np.testing.assert_array_equal(to_numpy(unknown), want)
    else:
        compiled = got
    np.testing.assert_array_equal(to_numpy(compiled), want)


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
        ({"strategy": "beam"}, "strategy"),  # one step has no beams: use generate
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        select_next_token(np.zeros((1, 4), "float32"), **kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"strategy": "nucleus"}, "strategy"),
        ({"strategy": "sample", "num_beams": 2}, "num_beams"),
        ({"strategy": "beam", "num_beams": 0}, "num_beams"),
        ({"strategy": "beam", "length_penalty": float("nan")}, "length_penalty"),
        ({"strategy": "beam", "early_stopping": "sometimes"}, "early_stopping"),
        ({"strategy": "beam", "early_stopping": 1}, "early_stopping"),
        ({"strategy": "sample", "temperature": -1.0}, "temperature"),
    ],
)
def test_make_sampler_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_sampler(**kwargs)


def test_make_sampler_picks_the_strategy():
    assert isinstance(make_sampler(), GreedySampler)
    assert isinstance(make_sampler("sample", top_p=0.9), RandomSampler)
    beam = make_sampler("beam")
    assert isinstance(beam, BeamSampler) and beam.num_beams == generation.DEFAULT_NUM_BEAMS
    beam = make_sampler("greedy", num_beams=3, length_penalty=0.5, early_stopping="never")
    assert isinstance(beam, BeamSampler) and beam.num_beams == 3
    assert beam.length_penalty == 0.5 and beam.early_stopping == "never"
    assert isinstance(make_sampler("greedy", num_beams=1), GreedySampler)


def test_stop_ids_and_prompt_checks():
    assert generation.stop_ids(None) == () and generation.stop_ids(np.int64(4)) == (4,)
    assert generation.stop_ids([1, 2]) == (1, 2)
    with pytest.raises(ValueError, match="stop_token_ids"):
        generation.stop_ids([1.5])
    # int32 ids only (2**32 + 3 failed on JAX and stopped at 3 on torch), none negative
    assert generation.stop_ids(2 ** 31 - 1) == (2 ** 31 - 1,)
    for bad in (2 ** 32 + 3, [5, 2 ** 31], -1, np.int64(-2)):
        with pytest.raises(ValueError, match=r"an int in \[0, 2\*\*31\)"):
            generation.stop_ids(bad)


def test_stop_ids_take_arrays_tensors_and_numpy_integers():
    """Any integer scalar or 1-D integer array-like is a stop id list: NumPy arrays (0-D,
    1-D, any integer dtype), NumPy integers and every backend's tensors (they were refused:
    iterating one gives 0-D arrays / tensors). Float, bool and 2-D arrays are refused."""
    tensor = keras.ops.convert_to_tensor
    for given, expected in (
        (np.array([3, 7]), (3, 7)), (np.array(5), (5,)), (np.array([4], "uint8"), (4,)),
        (np.int32(9), (9,)), (tensor([2, 8], "int32"), (2, 8)), (tensor(6, "int32"), (6,)),
        (tensor([1], "int64"), (1,)), (np.array([], "int64"), ()),
        ([tensor(2, "int32"), np.array(3), np.int16(4), 5], (2, 3, 4, 5)),
    ):
        got = generation.stop_ids(given)
        assert got == expected and all(type(i) is int for i in got), (given, got)
    for bad in (np.array([2.0]), tensor([2.0]), np.array([[1, 2]]), np.array([True]),
                np.array([-1, 3]), tensor([3, -2], "int32"), np.array([2 ** 31], "int64"),
                [tensor(2.0)], [np.array([2])], [tensor(-1, "int32")]):
        with pytest.raises(ValueError, match=r"stop_token_ids.*1-D list, array or tensor"):
            generation.stop_ids(bad)


def _stop_forms(stop):
    tensor = keras.ops.convert_to_tensor
    return (np.array([stop]), np.array(stop), np.int64(stop), tensor([stop], "int32"),
            tensor(stop, "int32"), [np.int32(stop)], [tensor(stop, "int32")])


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_generate_takes_stop_ids_as_arrays_and_tensors(family):
    """`generate(stop_token_ids=...)` of GPT and T5 with a NumPy array / integer or a backend
    tensor stops where the same id as a Python list does (a row ends with it, early), and
    refuses floats, negative ids and ids past the vocabulary by name."""
    if family == "gpt":
        from tests.test_gpt import VOCAB, shared_lm

        lm, prompts = shared_lm("gpt2"), [[5, 17, 33], [11, 4]]
    else:
        from tests.test_t5 import VOCAB, shared_lm

        lm, prompts = shared_lm("v1_0"), [[5, 17, 33, 1], [11, 4, 1]]
    free = lm.generate(prompts, max_new_tokens=8, stop_token_ids=None)
    stop = free[0][2]  # a token the first row produces third
    expected = lm.generate(prompts, max_new_tokens=8, stop_token_ids=[stop])
    assert expected[0] == free[0][:free[0].index(stop) + 1] and len(expected[0]) <= 3
    for given in _stop_forms(stop):
        assert lm.generate(prompts, max_new_tokens=8, stop_token_ids=given) == expected, given
    tensor = keras.ops.convert_to_tensor
    for bad in (np.array([float(stop)]), tensor([float(stop)]), np.array([-1]),
                tensor([stop, -3], "int32")):
        with pytest.raises(ValueError, match="stop_token_ids"):
            lm.generate(prompts, max_new_tokens=2, stop_token_ids=bad)
    for bad in (np.array([VOCAB]), tensor(VOCAB + 5, "int32"), np.int64(VOCAB)):
        with pytest.raises(ValueError, match=rf"stop_token_ids.*vocabulary_size={VOCAB}"):
            lm.generate(prompts, max_new_tokens=2, stop_token_ids=bad)


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    """Near 0 the temperature leaves only the largest logit: its id every draw (it was
    inf / NaN logits: TensorFlow drew id `vocab`, past the table; torch raised)."""
    logits = _logits(6, 40, seed=3)
    expected = logits.argmax(-1)
    for seed in range(3):
        ids = to_numpy(select_next_token(keras.ops.convert_to_tensor(logits),
                                         strategy="sample", temperature=temperature,
                                         seed=seed))
        np.testing.assert_array_equal(ids, expected)
    filtered = to_numpy(filter_logits(logits, temperature=temperature))
    assert np.isfinite(filtered).all()
    np.testing.assert_array_equal(filtered.argmax(-1), expected)
    with pytest.raises(ValueError, match=r"id 99 at prompt 1, token 2"):
        generation.check_token_ids([[1, 2], [3, 4, 99]], 50)
    with pytest.raises(ValueError, match=r"id -1 at prompt 0, token 1"):
        generation.check_token_ids(np.array([[1, -1, 2]]), 50)
    # padding (mask False) may hold anything
    generation.check_token_ids(np.array([[1, -1, 2]]), 50, mask=np.array([[1, 0, 1]]) > 0)
    with pytest.raises(ValueError, match="float32"):
        generation.integer_array(np.array([[1.0, 2.0]], "float32"), "prompts")
    with pytest.raises(ValueError, match=r"2.5 .* at prompt 0, token 1"):
        generation.integer_rows([[1, 2.5]], "prompts")


# === The loop, on a model with known probabilities ===


class MarkovLM:
    """A model whose next-token logits depend only on the last token (`table[last]`): the
    decoding interface of kzoo.generation with probabilities a test can enumerate. Counts
    the steps it runs (meaningful when the loop runs eagerly)."""

    def __init__(self, table):
        self.table = np.asarray(table, "float32")
        self.variables = []
        self.steps = 0

    def generation_prefill(self, inputs, max_new_tokens):
        last = keras.ops.convert_to_tensor(inputs["token_ids"])[:, -1]
        logits = keras.ops.take(keras.ops.convert_to_tensor(self.table), last, axis=0)
        return logits, {"last": last}, {"unused": keras.ops.zeros_like(last)}

    def generation_step(self, token_ids, state, constants, index):
        self.steps += 1
        last = token_ids[:, 0]
        logits = keras.ops.take(keras.ops.convert_to_tensor(self.table), last, axis=0)
        return logits, {"last": last}


def _markov(vocab=6, seed=0, scale=2.0):
    return MarkovLM(np.random.default_rng(seed).normal(size=(vocab, vocab)) * scale)


def test_greedy_loop_follows_the_chain_and_ends_when_every_row_has_ended():
    model = _markov()
    firsts = np.array([[0], [1], [2]], "int32")
    free = generation.decode(model, {"token_ids": firsts}, sampler=GreedySampler(),
                             max_new_tokens=12, compile=False)
    for row, first in zip(free, firsts[:, 0]):
        expected, last = [], first
        for _ in range(12):
            last = int(model.table[last].argmax())
            expected.append(last)
        assert row == expected
    # A stop token every row reaches: rows are cut after it, and the loop runs no step
    # after the last row has ended.
    stop = next(t for t in range(6) if all(t in row for row in free))
    ends = [row.index(stop) for row in free]
    model.steps = 0
    out = generation.decode(model, {"token_ids": firsts}, sampler=GreedySampler(),
                            max_new_tokens=12, stop_token_ids=[stop], compile=False)
    assert out == [row[: end + 1] for row, end in zip(free, ends)]
    assert model.steps == max(ends)
    compiled = generation.decode(model, {"token_ids": firsts}, sampler=GreedySampler(),
                                 max_new_tokens=12, stop_token_ids=[stop])
    assert compiled == out


def test_loop_ends_when_every_row_has_ended():
    """A row that ends at its first token: no step runs at all."""
    table = np.full((4, 4), -5.0, "float32")
    table[:, 3] = 5.0  # token 3 is always the most likely: it is the stop token
    model = MarkovLM(table)
    out = generation.decode(model, {"token_ids": np.zeros((2, 1), "int32")},
                            sampler=GreedySampler(), max_new_tokens=10, stop_token_ids=3,
                            compile=False)
    assert out == [[3], [3]] and model.steps == 0


def test_sampling_loop_is_seeded_and_compiled_equals_eager():
    model = _markov(vocab=8, scale=0.5)
    firsts = np.arange(8, dtype="int32")[:, None]
    sampler = RandomSampler(temperature=1.5)
    a = generation.decode(model, {"token_ids": firsts}, sampler=sampler, max_new_tokens=10,
                          seed=5, compile=False)
    assert a == generation.decode(model, {"token_ids": firsts}, sampler=sampler,
                                  max_new_tokens=10, seed=5, compile=False)
    assert a == generation.decode(model, {"token_ids": firsts}, sampler=sampler,
                                  max_new_tokens=10, seed=5)
    assert a != generation.decode(model, {"token_ids": firsts}, sampler=sampler,
                                  max_new_tokens=10, seed=6)
    # A SeedGenerator advances: two calls draw differently.
    gen = keras.random.SeedGenerator(3)
    b = generation.decode(model, {"token_ids": firsts}, sampler=sampler, max_new_tokens=10,
                          seed=gen)
    c = generation.decode(model, {"token_ids": firsts}, sampler=sampler, max_new_tokens=10,
                          seed=gen)
    assert b != c


def _exhaustive_best(table, first, length, stop, length_penalty):
    """The best sequence over every continuation of up to `length` tokens (ended by `stop`
    or by the length): max of sum(log p) / len ** length_penalty, by enumeration."""
    log_p = np.log(_softmax(table.astype(np.float64)))
    best, best_score = None, -np.inf
    for n in range(1, length + 1):
        for seq in itertools.product(range(table.shape[0]), repeat=n):
            if stop in seq[:-1] or (n < length and seq[-1] != stop):
                continue
            prev, score = first, 0.0
            for token in seq:
                score += log_p[prev, token]
                prev = token
            score /= n ** length_penalty
            if score > best_score:
                best, best_score = list(seq), score
    return best


@pytest.mark.spread
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, -0.7, 2.0])
def test_beam_search_with_every_prefix_is_exhaustive(length_penalty):
    """With more beams than prefixes and early_stopping="never" (the exact bound), beam
    search returns the best of all sequences: checked by enumeration."""
    model = _markov(vocab=4, seed=1, scale=1.5)
    firsts = np.array([[0], [2]], "int32")
    sampler = BeamSampler(num_beams=40, length_penalty=length_penalty,
                          early_stopping="never")
    out = generation.decode(model, {"token_ids": firsts}, sampler=sampler, max_new_tokens=3,
                            stop_token_ids=[3], compile=False)
    for row, first in zip(out, firsts[:, 0]):
        assert row == _exhaustive_best(model.table, first, 3, 3, length_penalty)
    assert out == generation.decode(model, {"token_ids": firsts}, sampler=sampler,
                                    max_new_tokens=3, stop_token_ids=[3])


@pytest.mark.spread
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_compiled_equals_eager(early_stopping):
    model = _markov(vocab=9, seed=3)
    firsts = np.array([[0], [4], [7]], "int32")
    sampler = BeamSampler(num_beams=3, length_penalty=0.8, early_stopping=early_stopping)
    options = dict(sampler=sampler, max_new_tokens=7, stop_token_ids=[5])
    eager = generation.decode(model, {"token_ids": firsts}, compile=False, **options)
    assert eager == generation.decode(model, {"token_ids": firsts}, **options)
    assert all(len(row) <= 7 and (len(row) == 7 or row[-1] == 5) for row in eager)


# === Beam search against Hugging Face transformers ===


def _hf_new_tokens(row, stop):
    """The new tokens of a transformers beam-search row: up to and including the first
    stop token (after it, transformers fills with padding or the stop token)."""
    row = [int(t) for t in row]
    if stop is not None and stop in row:
        end = row.index(stop) + 1
        assert all(t in (0, stop) for t in row[end:]), row
        return row[:end]
    assert -1 not in row, row
    return row


GPT2_BEAM_CASES = {
    # name: (num_beams, length_penalty, early_stopping, stop token from the free output)
    "beams3_eos": (3, 1.0, False, True),
    "beams4_no_eos_lp2": (4, 2.0, False, False),
    "beams2_eos_lp_neg_early": (2, -0.5, True, True),
    "beams5_eos_lp06_never": (5, 0.6, "never", True),
}


def _pick_stop(generate, free_rows, length):
    """A stop token that ends at least one beam-search output early, after a few tokens (so
    that the case exercises stopping): the first such token of the free outputs."""
    for token in dict.fromkeys(t for row in free_rows for t in row):
        rows = generate(token)
        if any(row[-1] == token and 2 < len(row) < length for row in rows):
            return token, rows
    raise AssertionError(f"no token of {free_rows} ends a beam early")


@pytest.mark.spread
@pytest.mark.parametrize("case", list(GPT2_BEAM_CASES))
def test_gpt2_beam_search_matches_transformers(case, tmp_path):
    import torch

    import kzoo.presets
    from tests.test_gpt import _hf_gpt2

    num_beams, length_penalty, early_stopping, with_stop = GPT2_BEAM_CASES[case]
    hf = _hf_gpt2(tmp_path, initializer_range=0.3)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3], [29, 8, 50, 90, 12]]
    options = dict(num_beams=num_beams, length_penalty=length_penalty,
                   early_stopping=early_stopping, do_sample=False, max_new_tokens=12,
                   pad_token_id=0)

    def hf_alone(prompt, stop):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), eos_token_id=stop, **options)
        return _hf_new_tokens(out[0, len(prompt):].tolist(), stop)

    def hf_all(stop):
        return [hf_alone(prompt, stop) for prompt in prompts]

    stop, expected = None, hf_all(None)
    if with_stop:
        stop, expected = _pick_stop(hf_all, expected, 12)
    ours = model.generate(prompts, max_new_tokens=12, strategy="beam", num_beams=num_beams,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          stop_token_ids=stop)
    print(f"GPT-2 beam {case} (stop {stop}): {ours}")
    assert ours == expected
    assert len({tuple(row) for row in ours}) == 3


def test_llama_beam_search_matches_transformers(tmp_path):
    import torch

    from tests.test_gpt import _hf_modern, _load_modern

    hf = _hf_modern(tmp_path, initializer_range=0.3)
    model = _load_modern(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3]]
    options = dict(num_beams=3, length_penalty=0.5, do_sample=False, max_new_tokens=10,
                   pad_token_id=0)

    def hf_alone(prompt, stop):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), eos_token_id=stop, **options)
        return _hf_new_tokens(out[0, len(prompt):].tolist(), stop)

    def hf_all(stop):
        return [hf_alone(prompt, stop) for prompt in prompts]

    stop, expected = _pick_stop(hf_all, hf_all(None), 10)
    ours = model.generate(prompts, max_new_tokens=10, num_beams=3, length_penalty=0.5,
                          stop_token_ids=[stop])
    assert ours == expected


T5_BEAM_CASES = {
    # name: (version, weights seed, num_beams, length_penalty, early_stopping, stop)
    "v1_0_beams3_never_lp08": ("v1_0", 2, 3, 0.8, "never", None),
    "v1_1_beams3_eos1": ("v1_1", 4, 3, 1.0, False, "eos"),
    "v1_1_beams4_stop_lp07": ("v1_1", 2, 4, 0.7, False, "emitted"),
    "v1_1_beams2_no_eos_early": ("v1_1", 3, 2, 1.3, True, None),
}


@pytest.mark.spread
@pytest.mark.parametrize("case", list(T5_BEAM_CASES))
def test_t5_beam_search_matches_transformers(case, tmp_path):
    import torch

    import kzoo.presets
    from tests.test_t5 import _batch, _hf_model

    version, seed, num_beams, length_penalty, early_stopping, stop_kind = T5_BEAM_CASES[case]
    hf = _hf_model(tmp_path, version, seed=seed)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(enc_len=15, enc_real=(15, 8))
    enc, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    options = dict(num_beams=num_beams, length_penalty=length_penalty,
                   early_stopping=early_stopping, do_sample=False, max_new_tokens=12,
                   pad_token_id=0, decoder_start_token_id=0)

    def hf_generate(stop):
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor(enc, dtype=torch.long),
                              attention_mask=torch.tensor(mask), eos_token_id=stop,
                              **options).numpy()
        assert np.all(out[:, 0] == 0)
        return [_hf_new_tokens(row[1:], stop) for row in out]

    stop = {"eos": 1, None: None}.get(stop_kind)
    expected = hf_generate(stop)
    if stop_kind == "emitted":
        stop, expected = _pick_stop(hf_generate, expected, 12)
    ours = model.generate({"encoder_token_ids": enc, "encoder_padding_mask": mask},
                          max_new_tokens=12, strategy="beam", num_beams=num_beams,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          stop_token_ids=stop)
    print(f"T5 beam {case} (stop {stop}): {ours}")
    assert ours == expected
    if stop is not None:
        assert any(row[-1] == stop and len(row) < 12 for row in ours)  # a row did stop


# === Prompt checks on the models ===


def test_gpt_prompt_ids_are_checked():
    from tests.test_gpt import VOCAB, shared_lm

    lm = shared_lm("gpt2")
    with pytest.raises(ValueError, match=rf"id {VOCAB} at prompt 1, token 2"):
        lm.generate([[1, 2], [3, 4, VOCAB]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"id -3 at prompt 0, token 0"):
        lm.generate(np.array([[-3, 4]]), max_new_tokens=2)
    # (ids past int64 raised OverflowError; uint64 ids from 2**63 up were named as the
    # negative ids they wrap to: the id as given)
    with pytest.raises(ValueError, match=rf"got id {2 ** 63} at prompt 0, token 1"):
        lm.generate(np.array([[1, 2 ** 63]], dtype=np.uint64), max_new_tokens=2)
    for row in ([1, 2 ** 63], [1, 2 ** 70]):
        with pytest.raises(ValueError, match=rf"got id {row[1]} at prompt 1, token 1"):
            lm.generate([[3], row], max_new_tokens=2)
    with pytest.raises(ValueError, match="float"):
        lm.generate(np.array([[1.7, 4.0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="integer"):
        lm.generate([[1, 2.0]], max_new_tokens=2)
    # padding may hold any id
    ids = np.array([[-1, 5, 6], [3, 4, 7]])
    assert lm.generate(ids, padding_mask=ids >= 0, max_new_tokens=2) == lm.generate(
        [[5, 6], [3, 4, 7]], max_new_tokens=2)


def test_t5_prompt_ids_are_checked():
    from tests.test_t5 import VOCAB, shared_lm

    lm = shared_lm("v1_0")
    with pytest.raises(ValueError, match=rf"id {VOCAB + 3} at prompt 1, token 0"):
        lm.generate([[5, 6], [VOCAB + 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="float"):
        lm.generate(np.array([[5.0, 6.0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="float"):
        lm.generate({"encoder_token_ids": np.array([[5.5, 6.0]])}, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"id -2 at prompt 0, token 1"):
        lm.generate(np.array([[5, -2, 6]]), max_new_tokens=2)


# === num_return_sequences (transformers' name and meaning) ===


GPT2_RETURN_CASES = {
    # name: (num_beams, num_return_sequences, length_penalty, early_stopping, with a stop)
    "beams4_n3_eos": (4, 3, 1.0, False, True),
    "beams3_n3_no_eos_lp2": (3, 3, 2.0, False, False),
    "beams5_n2_eos_never": (5, 2, 0.6, "never", True),
}


@pytest.mark.spread
@pytest.mark.parametrize("case", list(GPT2_RETURN_CASES))
def test_gpt2_beam_num_return_sequences_match_transformers(case, tmp_path):
    """GPT-2 beam search with `num_return_sequences=n`: the n best finished hypotheses of each
    prompt, best first, grouped prompt by prompt, token for token transformers'
    `generate(num_beams=..., num_return_sequences=n)`, compiled and eager."""
    import torch

    import kzoo.presets
    from tests.test_gpt import _hf_gpt2

    num_beams, n, length_penalty, early_stopping, with_stop = GPT2_RETURN_CASES[case]
    hf = _hf_gpt2(tmp_path, initializer_range=0.3)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71, 9, 40], [11, 64, 3]]
    options = dict(num_beams=num_beams, num_return_sequences=n, length_penalty=length_penalty,
                   early_stopping=early_stopping, do_sample=False, max_new_tokens=10,
                   pad_token_id=0)

    def hf_all(stop):
        rows = []
        for prompt in prompts:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                    1, len(prompt), dtype=torch.long), eos_token_id=stop, **options)
            assert out.shape[0] == n
            rows += [_hf_new_tokens(row[len(prompt):].tolist(), stop) for row in out]
        return rows

    stop, expected = None, hf_all(None)
    if with_stop:
        stop, expected = _pick_stop(hf_all, expected, 10)
    for compile in (True, False):
        ours = model.generate(prompts, max_new_tokens=10, strategy="beam", num_beams=num_beams,
                              num_return_sequences=n, length_penalty=length_penalty,
                              early_stopping=early_stopping, stop_token_ids=stop,
                              compile=compile)
        assert ours == expected, f"compile={compile}"
    # n distinct hypotheses a prompt
    assert all(len({tuple(r) for r in expected[i * n:(i + 1) * n]}) == n for i in range(2))


@pytest.mark.spread
@pytest.mark.parametrize("n, num_beams", [(3, 3), (2, 4)])
def test_t5_beam_num_return_sequences_match_transformers(n, num_beams, tmp_path):
    import torch

    import kzoo.presets
    from tests.test_t5 import _batch, _hf_model

    hf = _hf_model(tmp_path, "v1_1", seed=4)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(enc_len=15, enc_real=(15, 8))
    enc, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(enc, dtype=torch.long),
                          attention_mask=torch.tensor(mask), eos_token_id=1,
                          num_beams=num_beams, num_return_sequences=n, length_penalty=0.8,
                          do_sample=False, max_new_tokens=10, pad_token_id=0,
                          decoder_start_token_id=0).numpy()
    assert out.shape[0] == 2 * n
    expected = [_hf_new_tokens(row[1:], 1) for row in out]
    for compile in (True, False):
        ours = model.generate({"encoder_token_ids": enc, "encoder_padding_mask": mask},
                              max_new_tokens=10, num_beams=num_beams, num_return_sequences=n,
                              length_penalty=0.8, stop_token_ids=1, compile=compile)
        assert ours == expected, f"compile={compile}"


@pytest.mark.spread  # (one backend in turn; ~40 s on JAX, compiling many shapes)
def test_gpt2_sampling_num_return_sequences(tmp_path):
    """`strategy="sample", num_return_sequences=n`: n draws of each prompt, grouped prompt by
    prompt. With top_k=1 every draw is transformers' greedy continuation of its own prompt;
    the first tokens of 1500 draws a prompt (top_k=4) follow the softmax of transformers'
    logits for that prompt over its 4 best tokens; a seed gives the same draws again,
    compiled or eagerly."""
    import torch

    import kzoo.presets
    from tests.test_gpt import _hf_gpt2

    hf = _hf_gpt2(tmp_path, initializer_range=0.3)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71], [11, 64, 3]]
    greedy = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                              eos_token_id=None, pad_token_id=0)
        greedy.append(out[0, len(prompt):].tolist())
    ours = model.generate(prompts, max_new_tokens=6, strategy="sample", top_k=1,
                          num_return_sequences=3, seed=1, stop_token_ids=None)
    assert ours == [greedy[0]] * 3 + [greedy[1]] * 3
    draws = 1500
    first = np.array(model.generate(prompts, max_new_tokens=1, strategy="sample", top_k=4,
                                    num_return_sequences=draws, seed=2, stop_token_ids=None))
    assert first.shape == (2 * draws, 1)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
        top = np.argsort(-logits)[:4]
        p = np.exp(logits[top] - logits[top].max())
        p /= p.sum()
        got = first[i * draws:(i + 1) * draws, 0]
        assert set(got.tolist()) <= set(top.tolist()), (i, set(got.tolist()), top)
        freq = np.array([(got == t).mean() for t in top])
        # (5 standard deviations of a binomial frequency)
        np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / draws) + 1e-9)
    options = dict(max_new_tokens=8, strategy="sample", num_return_sequences=4, seed=7,
                   stop_token_ids=None)
    a = model.generate(prompts, **options)
    assert len(a) == 8 and a == model.generate(prompts, **options)
    assert a == model.generate(prompts, compile=False, **options)
    assert len({tuple(r) for r in a[:4]}) > 1  # independent draws, not one row repeated


@pytest.mark.spread  # (one backend in turn; ~40 s on JAX, compiling many shapes)
def test_t5_sampling_num_return_sequences(tmp_path):
    import torch

    import kzoo.presets
    from tests.test_t5 import _batch, _hf_model

    hf = _hf_model(tmp_path, "v1_0", seed=2)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(enc_len=11, enc_real=(11, 6))
    enc, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(enc, dtype=torch.long),
                          attention_mask=torch.tensor(mask), do_sample=False, max_new_tokens=6,
                          eos_token_id=None, pad_token_id=0, decoder_start_token_id=0).numpy()
    greedy = [row[1:].tolist() for row in out]
    prompts = {"encoder_token_ids": enc, "encoder_padding_mask": mask}
    ours = model.generate(prompts, max_new_tokens=6, strategy="sample", top_k=1,
                          num_return_sequences=2, seed=0, stop_token_ids=None)
    assert ours == [greedy[0]] * 2 + [greedy[1]] * 2
    options = dict(max_new_tokens=6, strategy="sample", num_return_sequences=3, seed=5,
                   stop_token_ids=None)
    a = model.generate(prompts, **options)
    assert len(a) == 6 and a == model.generate(prompts, compile=False, **options)


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_one_prompt_sampled_several_times(family, tmp_path):
    """One prompt, `num_return_sequences=3` draws: each row has its own key/value cache.
    (On PyTorch the prompt's cache was repeated as a view whose rows share memory, and the
    first in-place cache write failed: "more than one element of the written-to tensor
    refers to a single memory location".) With top_k=1 each draw is transformers' greedy
    continuation."""
    import torch

    import kzoo.presets

    if family == "gpt":
        from tests.test_gpt import _hf_gpt2

        hf, prompt = _hf_gpt2(tmp_path, initializer_range=0.3), [5, 17, 33]
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=5,
                              eos_token_id=None, pad_token_id=0)
        greedy = out[0, len(prompt):].tolist()
    else:
        from tests.test_t5 import _hf_model

        hf, prompt = _hf_model(tmp_path, "v1_0", seed=2), [5, 17, 33, 1]
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=5,
                              eos_token_id=None, pad_token_id=0, decoder_start_token_id=0)
        greedy = out[0, 1:].tolist()
    model = kzoo.presets.load(tmp_path)
    for compile in (True, False):
        ours = model.generate([prompt], max_new_tokens=5, strategy="sample", top_k=1,
                              num_return_sequences=3, seed=0, stop_token_ids=None,
                              compile=compile)
        assert ours == [greedy] * 3, compile


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_num_return_sequences_is_checked(family):
    if family == "gpt":
        from tests.test_gpt import shared_lm

        lm, prompts = shared_lm("gpt2"), [[5, 17, 33]]
    else:
        from tests.test_t5 import shared_lm

        lm, prompts = shared_lm("v1_0"), [[5, 17, 33, 1]]
    for bad in (0, -2, 1.0, 2.5, True, "2", None):
        with pytest.raises(ValueError, match=rf"`num_return_sequences` must be a positive int.*"
                                             rf"num_return_sequences={bad!r}"):
            lm.generate(prompts, max_new_tokens=2, strategy="sample", num_return_sequences=bad)
    with pytest.raises(ValueError, match=r"at most num_beams=3.*num_return_sequences=4"):
        lm.generate(prompts, max_new_tokens=2, num_beams=3, num_return_sequences=4)
    with pytest.raises(ValueError, match=r"at most num_beams=4.*num_return_sequences=5"):
        lm.generate(prompts, max_new_tokens=2, strategy="beam", num_return_sequences=5)
    with pytest.raises(ValueError, match=r"must be 1 with greedy.*num_return_sequences=2"):
        lm.generate(prompts, max_new_tokens=2, num_return_sequences=2)
    assert len(lm.generate(prompts, max_new_tokens=2, num_return_sequences=np.int64(1))) == 1
    # (a cache and logits for 10**9 rows: refused up front, naming the argument)
    with pytest.raises(ValueError, match=r"`num_return_sequences` are too large.*"
                                         r"num_return_sequences=1000000000"):
        lm.generate(prompts, max_new_tokens=2, strategy="sample", num_return_sequences=10 ** 9)


# === return_scores (transformers' output_scores / compute_transition_scores) ===


def _hf_token_scores(hf, sequences, scores, lengths):
    """transformers' `compute_transition_scores(..., normalize_logits=True)` of each row, cut
    to that row's new tokens."""
    table = hf.compute_transition_scores(sequences, scores, normalize_logits=True).numpy()
    return [table[i, :n].tolist() for i, n in enumerate(lengths)]


def _warped_scores(hf_logits, tokens, history, processors):
    """The log-probability of each of `tokens` under transformers' `processors` (a
    `LogitsProcessorList`) applied to `hf_logits (steps, vocab)`, the row's history being
    `history` followed by the tokens chosen before: an independent reference for sampled
    tokens (which no transformers `generate` draws)."""
    import torch

    row = torch.tensor([history], dtype=torch.long)
    out = []
    for t, token in enumerate(tokens):
        warped = processors(row, hf_logits[t:t + 1].clone())
        out.append(float(torch.log_softmax(warped, dim=-1)[0, token]))
        row = torch.cat([row, torch.tensor([[token]])], dim=1)
    return out


def _assert_scores(ours, expected):
    assert len(ours) == len(expected)
    for a, b in zip(ours, expected):
        if isinstance(b, float):
            assert isinstance(a, float)
        else:
            assert len(a) == len(b) and all(isinstance(x, float) for x in a)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


GPT2_SCORE_CASES = {
    # name: (kzoo options, transformers options; None: sampled, checked by `_warped_scores`)
    # (the stop tokens end a row after a few tokens: 56 greedy, 91 with the processors,
    # where min_new_tokens=2 bans it at the other row's first step)
    "greedy_stop": (dict(stop_token_ids=56), dict(do_sample=False, eos_token_id=56)),
    "greedy_processors": (
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=2,
             stop_token_ids=91),
        dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2,
             min_new_tokens=2, eos_token_id=91)),
    "sample_top_k1": (dict(strategy="sample", top_k=1, seed=3, stop_token_ids=None),
                      dict(do_sample=True, top_k=1, eos_token_id=None)),
    "sample_warped": (dict(strategy="sample", temperature=0.7, top_k=20, top_p=0.9,
                           repetition_penalty=1.2, seed=5, num_return_sequences=2,
                           stop_token_ids=None), None),
    "beam_n2": (dict(strategy="beam", num_beams=4, num_return_sequences=2,
                     length_penalty=0.8, stop_token_ids=55),
                dict(do_sample=False, num_beams=4, num_return_sequences=2, length_penalty=0.8,
                     eos_token_id=55)),
}


@pytest.mark.spread
@pytest.mark.parametrize("case", list(GPT2_SCORE_CASES))
def test_gpt2_return_scores_match_transformers(case, tmp_path):
    """`generate(return_scores=True)`: the same tokens as without, and each new token's
    log-probability under the distribution it was chosen from (greedy, sampling: transformers'
    `compute_transition_scores(normalize_logits=True)`, or its processors applied to its own
    logits for drawn tokens), beam search's final scores (`sequences_scores`), to 1e-5,
    compiled and eager."""
    import torch
    import transformers

    import kzoo.presets
    from tests.test_gpt import _hf_gpt2

    ours_options, hf_options = GPT2_SCORE_CASES[case]
    hf = _hf_gpt2(tmp_path, initializer_range=0.3)
    model = kzoo.presets.load(tmp_path)
    prompts = [[5, 17, 33, 2, 71], [11, 64, 3]]
    length = 8
    results = []
    for compile in (True, False):
        tokens, scores = model.generate(prompts, max_new_tokens=length, return_scores=True,
                                        compile=compile, **ours_options)
        assert tokens == model.generate(prompts, max_new_tokens=length, compile=compile,
                                        **ours_options)
        results.append((tokens, scores))
    tokens = results[0][0]
    assert results[1][0] == tokens  # (the same draws compiled or not, for a seed)
    if hf_options is None:  # sampled tokens: transformers' processors on its own logits
        processors = transformers.LogitsProcessorList([
            transformers.RepetitionPenaltyLogitsProcessor(1.2),
            transformers.TemperatureLogitsWarper(0.7), transformers.TopKLogitsWarper(20),
            transformers.TopPLogitsWarper(0.9)])
        expected = []
        for i, row in enumerate(tokens):
            prompt = prompts[i // 2]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + row])).logits[0, len(prompt) - 1:-1]
            expected.append(_warped_scores(logits, row, prompt, processors))
        assert all(len(row) == length for row in tokens)
    else:
        expected_tokens, expected = [], []
        for prompt in prompts:
            torch.manual_seed(0)
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                    1, len(prompt), dtype=torch.long), max_new_tokens=length, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True, **hf_options)
            stop = hf_options["eos_token_id"]
            rows = [_hf_new_tokens(row[len(prompt):].tolist(), stop) for row in out.sequences]
            expected_tokens += rows
            if "num_beams" in hf_options:
                expected += out.sequences_scores.tolist()
            else:
                expected += _hf_token_scores(hf, out.sequences, out.scores,
                                             [len(r) for r in rows])
        assert tokens == expected_tokens
        if ours_options.get("stop_token_ids") is not None:  # a row did stop early
            assert any(len(row) < length for row in tokens)
    for compile, (_, scores) in zip((True, False), results):
        print(f"GPT-2 scores {case} compile={compile}: {scores}")
        _assert_scores(scores, expected)
    if case == "sample_top_k1":
        assert np.allclose(np.concatenate(results[0][1]), 0.0)


T5_SCORE_CASES = {
    "greedy_eos": (dict(stop_token_ids=1), dict(do_sample=False, eos_token_id=1)),
    "greedy_processors": (
        dict(repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=3,
             stop_token_ids=1),
        dict(do_sample=False, repetition_penalty=1.4, no_repeat_ngram_size=2,
             min_new_tokens=3, eos_token_id=1)),
    "sample_top_k1": (dict(strategy="sample", top_k=1, seed=3, stop_token_ids=None),
                      dict(do_sample=True, top_k=1, eos_token_id=None)),
    "beam_n3": (dict(strategy="beam", num_beams=3, num_return_sequences=3,
                     length_penalty=0.7, stop_token_ids=1),
                dict(do_sample=False, num_beams=3, num_return_sequences=3, length_penalty=0.7,
                     eos_token_id=1)),
}


@pytest.mark.spread
@pytest.mark.parametrize("case", list(T5_SCORE_CASES))
def test_t5_return_scores_match_transformers(case, tmp_path):
    import torch

    import kzoo.presets
    from tests.test_t5 import _batch, _hf_model

    ours_options, hf_options = T5_SCORE_CASES[case]
    hf = _hf_model(tmp_path, "v1_1", seed=4)
    model = kzoo.presets.load(tmp_path)
    inputs = _batch(enc_len=15, enc_real=(15, 8))
    enc, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    length = 8
    torch.manual_seed(0)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(enc, dtype=torch.long),
                          attention_mask=torch.tensor(mask), max_new_tokens=length,
                          pad_token_id=0, decoder_start_token_id=0, output_scores=True,
                          return_dict_in_generate=True, **hf_options)
    stop = hf_options["eos_token_id"]
    expected_tokens = [_hf_new_tokens(row[1:].tolist(), stop) for row in out.sequences]
    if "num_beams" in hf_options:
        expected = out.sequences_scores.tolist()
    else:
        expected = _hf_token_scores(hf, out.sequences, out.scores,
                                    [len(r) for r in expected_tokens])
    prompts = {"encoder_token_ids": enc, "encoder_padding_mask": mask}
    for compile in (True, False):
        tokens, scores = model.generate(prompts, max_new_tokens=length, return_scores=True,
                                        compile=compile, **ours_options)
        print(f"T5 scores {case} compile={compile}: {tokens} {scores}")
        assert tokens == expected_tokens
        _assert_scores(scores, expected)
    if stop is not None:
        assert any(len(row) < length for row in tokens)


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_return_scores_is_checked(family):
    if family == "gpt":
        from tests.test_gpt import shared_lm

        lm, prompts = shared_lm("gpt2"), [[5, 17, 33]]
    else:
        from tests.test_t5 import shared_lm

        lm, prompts = shared_lm("v1_0"), [[5, 17, 33, 1]]
    for bad in (1, 0, "yes", None, np.bool_(True), [True]):
        with pytest.raises(ValueError, match=rf"`return_scores` must be True or False; got "
                                             rf"return_scores={re.escape(repr(bad))}"):
            lm.generate(prompts, max_new_tokens=2, return_scores=bad)
