"""A randomized parity sweep of kzoo's sampling path against Hugging Face transformers.

transformers samples (`generate(do_sample=True)`) from `softmax` of the scores that its
logits warpers leave: `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, in
the order `GenerationMixin._get_logits_processor` appends them (temperature if != 1, top-k if
not None/0, top-p if < 1; `min_tokens_to_keep=1` without beams). kzoo draws from
`softmax(kzoo.generation.filter_logits(logits, temperature, top_k, top_p))` (the function
`RandomSampler.next_ids` calls inside the decode loop), so the filtered distribution is
compared directly:

1. `filter_logits` on drawn float32 logits (ties, -inf entries, very peaked, very flat and
   all-negative rows, vocabularies 2-300) and drawn settings (temperatures from 1e-45 to
   1e30, top_k from 1 to past the vocabulary, top_p from 1e-12 to exactly 1.0): the tokens of
   nonzero probability and the renormalized probabilities (1e-5) against transformers'
   warpers, which this file builds with transformers' own `_get_logits_processor`;
2. the draws: chi-square tests of the decode loop's sampler (`generation.decode`, the loop
   every `generate` runs) and of `select_next_token` against transformers' distribution;
   `GPTCausalLM.generate(strategy="sample")` with a fixed seed is reproducible and each
   sampled token is one transformers could sample from the model's own logits (recomputed
   with a full forward pass);
3. argument validation of `generate` (GPT and T5), `make_sampler`, `filter_logits` and
   `select_next_token`: hostile values raise a ValueError/TypeError that names the argument
   and its value.

Two deliberate differences, tested as they are (evidence at `_check_row`):
- ties at the top-p boundary: kzoo keeps every token whose logit equals the smallest kept
  one (its set does not depend on the order of equal logits); transformers keeps the tied
  tokens that its `torch.sort` happens to place last.
- kzoo divides a row that overflows (or holds -inf) as `(logits - max) / temperature`, the
  same probabilities as transformers' `logits / temperature` without the overflow (where
  transformers returns NaN), and it divides by no less than 1e-30.

Logits are drawn on a grid of multiples of 2**-10 in [-60, 60] (and -inf): exact in float32,
their differences too, so both libraries order and tie the scaled values identically and the
comparison does not hinge on float rounding of the inputs.

The examples are derandomized (the same cases every run); `KZOO_SWEEP_EXAMPLES=n` multiplies
the number of examples by n for a longer search.

The sweep of `filter_logits` (mark `sweep`) runs on torch by default and on JAX and TensorFlow
too with `make test-all` (tests/conftest.py); the other tests run on every backend.
"""

import math
import os
import re
import warnings

import keras
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerationMixin

from kzoo import generation
from kzoo.generation import filter_logits, make_sampler, select_next_token
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM
from tests.helpers import to_numpy

_MORE = int(os.environ.get("KZOO_SWEEP_EXAMPLES", "1"))
BACKEND = keras.backend.backend()

PROB_ATOL = 1e-5
# Float32 softmax + cumulative sums (both libraries, up to 300 terms) can put a token whose
# float64 "mass before it" lies this close to top_p on either side of the cut.
MASS_EPS = 1e-4
GRID = 1024.0  # logits are multiples of 1 / GRID


def _settings(examples):
    return settings(max_examples=examples * _MORE, deadline=None, derandomize=True,
                    print_blob=True, suppress_health_check=list(HealthCheck))


# === transformers' side ===


class _Warpers(GenerationMixin):
    """Only for `_get_logits_processor` (which reads nothing else of a model)."""


def hf_processors(temperature, top_k, top_p):
    """transformers' own warper list for `generate(do_sample=True, ...)` (one beam)."""
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k,
                              top_p=top_p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processors = _Warpers()._get_logits_processor(config, device="cpu")
    names = [type(p).__name__ for p in processors]
    expected = ([TemperatureLogitsWarper.__name__] * (temperature != 1.0)
                + [TopKLogitsWarper.__name__] * (top_k is not None)
                + [TopPLogitsWarper.__name__] * (top_p is not None and top_p < 1.0))
    assert names == expected, (names, expected)  # the composition this file models
    return processors


def hf_filter(logits, temperature, top_k, top_p):
    """`(before_top_p, after_all)`: transformers' float32 scores (-inf = removed) after its
    temperature and top-k warpers, and after every warper."""
    scores = torch.from_numpy(np.array(logits, "float32"))
    before_top_p = None
    for processor in hf_processors(temperature, top_k, top_p):  # (top-p last, if at all)
        if isinstance(processor, TopPLogitsWarper):
            before_top_p = scores
        scores = processor(None, scores)
    return (scores if before_top_p is None else before_top_p).numpy(), scores.numpy()


def softmax64(x):
    """Softmax in float64 (NaN rows where the maximum is not finite)."""
    x = np.asarray(x, np.float64)
    top = x.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - top)
        return e / e.sum(-1, keepdims=True)


# === The comparison of one row ===


def _check_row(kz_filtered, hf_before, hf_after, top_p):
    """Problems (a list of strings, empty if none) of kzoo's filtered row against one
    transformers candidate.

    The support is the set of tokens of nonzero float64 probability. With `before` =
    transformers' temperature + top-k scores, sorted by value into groups of equal values
    with `mass_before(g)` = the float64 probability of the groups above:
    - kzoo keeps whole groups: all of `before`'s groups with mass_before < top_p (its
      threshold rule), none with mass_before >= top_p; within MASS_EPS of top_p either;
    - its probabilities are `before`'s renormalized over its support (1e-5), which is
      transformers' own result whenever the two supports agree.
    Transformers' cut is checked against the same model token by token (ties broken in its
    sort order): e.g. four equal logits and top_p=0.5 keep two tokens there, all four in kzoo.
    """
    problems = []
    q = softmax64(hf_before)
    if not np.isfinite(q).all():
        return ["transformers' scores overflow (NaN probabilities)"]
    kz = softmax64(kz_filtered)
    if not np.isfinite(kz).all():
        return [f"kzoo's filtered logits give NaN probabilities: {kz_filtered}"]
    kz_in, hf_in = kz > 0, softmax64(hf_after) > 0
    alive = q > 0
    values = np.unique(np.asarray(hf_before, np.float64)[alive])[::-1]  # descending
    group_mass = np.array([q[hf_before == v].sum() for v in values])
    mass_before = np.cumsum(group_mass) - group_mass
    cut = 2.0 if top_p is None or top_p >= 1.0 else float(top_p)  # (no top-p: keep all)
    sure_in, sure_out = mass_before < cut - MASS_EPS, mass_before > cut + MASS_EPS
    if (kz_in & ~alive).any():
        problems.append(f"kzoo keeps tokens transformers' temperature/top-k removed: "
                        f"{np.nonzero(kz_in & ~alive)[0].tolist()}")
    kept_groups = []
    for g, v in enumerate(values):
        members = hf_before == v
        kept = kz_in[members]
        if kept.any() != kept.all():
            problems.append(f"kzoo splits the tie group of value {v}")
        if sure_in[g] and not kept.all():
            problems.append(f"kzoo drops value {v} (mass before {mass_before[g]:.6g} < "
                            f"top_p={top_p})")
        if sure_out[g] and kept.any():
            problems.append(f"kzoo keeps value {v} (mass before {mass_before[g]:.6g} > "
                            f"top_p={top_p})")
        kept_groups.append(bool(kept.all()))
    if kept_groups != sorted(kept_groups, reverse=True):
        problems.append(f"kzoo's kept values are not the largest ones: {kept_groups}")
    # transformers' own cut, per token in its order: the model above describes it too.
    order = np.argsort(-np.asarray(hf_before, np.float64)[alive], kind="stable")
    per_token_before = np.cumsum(q[alive][order]) - q[alive][order]
    low = (per_token_before < cut - MASS_EPS).sum()
    high = (per_token_before <= cut + MASS_EPS).sum()
    if not low <= hf_in.sum() <= high or (hf_in & ~alive).any():
        problems.append(f"this file's model of transformers' top-p is wrong: it kept "
                        f"{hf_in.sum()} tokens, expected {low}..{high}")
    if problems:
        return problems
    expected = np.where(kz_in, q, 0.0)
    expected = expected / expected.sum()
    if np.abs(kz - expected).max() > PROB_ATOL:
        problems.append(f"probabilities differ by {np.abs(kz - expected).max():.3g}")
    if (kz_in == hf_in).all() and np.abs(kz - softmax64(hf_after)).max() > PROB_ATOL:
        problems.append("probabilities differ from transformers' on the same support")
    return problems


def assert_matches_transformers(logits, kz_filtered, temperature, top_k, top_p):
    """Each row of kzoo's filtered logits must agree (`_check_row`) with transformers'
    warpers applied to the row as it is, or to the row minus its maximum (the same
    distribution; kzoo shifts rows that overflow or hold -inf, see the module doc)."""
    logits = np.asarray(logits, "float32")
    shifted = logits - logits.max(-1, keepdims=True)  # exact on the grid
    candidates = [hf_filter(logits, temperature, top_k, top_p),
                  hf_filter(shifted, temperature, top_k, top_p)]
    for row in range(logits.shape[0]):
        reports = []
        for name, (before, after) in zip(("as is", "minus its max"), candidates):
            problems = _check_row(kz_filtered[row], before[row], after[row], top_p)
            if not problems:
                break
            reports.append(f"  against transformers on the row {name}: {problems}")
        else:
            raise AssertionError(
                f"row {row} (temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r})"
                f"\n  logits={logits[row].tolist()}\n  kzoo={kz_filtered[row].tolist()}\n"
                + "\n".join(reports))


# === Drawn logits and settings ===

VOCABS = (2, 3, 4, 7, 16, 50, 129, 300)
ROW_KINDS = ("gauss", "ties", "flat", "peaked", "neg_inf", "negative", "one_finite")


def _grid(values):
    return (np.clip(np.round(np.asarray(values) * GRID), -60 * GRID, 60 * GRID)
            / GRID).astype("float32")


def _row(kind, vocab, rng):
    if kind == "gauss":
        return _grid(rng.normal(size=vocab) * rng.choice([0.01, 1.0, 5.0, 20.0]))
    if kind == "ties":
        levels = _grid(rng.normal(size=rng.integers(1, 5)) * 3.0)
        return levels[rng.integers(0, len(levels), vocab)]
    if kind == "flat":  # all equal, or a step of one grid unit here and there
        return _grid(rng.normal() + rng.integers(0, 2, vocab) * (rng.random() < 0.5) / GRID)
    if kind == "peaked":
        row = _grid(rng.normal(size=vocab) - 40.0)
        row[rng.choice(vocab, rng.integers(1, min(vocab, 3) + 1), replace=False)] = 40.0
        return row
    if kind == "neg_inf":
        row = _grid(rng.normal(size=vocab) * 2.0)
        row[rng.random(vocab) < rng.random()] = -np.inf
        row[rng.integers(vocab)] = _grid(rng.normal())  # at least one finite entry
        return row
    if kind == "negative":  # a tiny temperature takes these below -1e30
        return _grid(-rng.uniform(1.0, 50.0, vocab))
    row = np.full(vocab, -np.inf, "float32")  # one_finite
    row[rng.integers(vocab)] = _grid(rng.normal() * 10.0)
    return row


@st.composite
def logits_batches(draw):
    # (a few sizes, six rows: JAX compiles every eager op once per shape)
    vocab = draw(st.sampled_from(VOCABS), label="vocab")
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=6, max_size=6), label="rows")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1), label="rng"))
    return np.stack([_row(kind, vocab, rng) for kind in kinds]).astype("float32")


TEMPERATURES = st.one_of(
    st.just(1.0),
    st.floats(0.05, 20.0),
    st.sampled_from([1e-2, 1e-4, 1e-8, 1e-20, 1e-30, 1e-35, 1e-38, 1e-45]),  # small
    st.sampled_from([50.0, 1e3, 1e6, 1e30]),  # large
)


def top_ks(vocab):
    return st.one_of(st.none(), st.integers(1, 4), st.integers(1, vocab + 5),
                     st.just(vocab), st.just(10 ** 9))


TOP_PS = st.one_of(
    st.none(),
    st.just(1.0),
    st.floats(1e-6, 1.0, exclude_min=False),
    st.sampled_from([1e-12, 1e-7, 0.25, 0.5, 0.75, 0.9, 0.999999]),
)


# === 1. The filtered distribution against transformers' warpers ===


@pytest.mark.sweep
@_settings(45)
@given(data=st.data())
def test_filtered_distribution_matches_transformers(data):
    logits = data.draw(logits_batches(), label="logits")
    temperature = data.draw(TEMPERATURES, label="temperature")
    top_k = data.draw(top_ks(logits.shape[1]), label="top_k")
    top_p = data.draw(TOP_PS, label="top_p")
    kz = to_numpy(filter_logits(keras.ops.convert_to_tensor(logits), temperature=temperature,
                                top_k=top_k, top_p=top_p))
    assert kz.shape == logits.shape and kz.dtype == np.float32
    assert_matches_transformers(logits, kz, temperature, top_k, top_p)


@pytest.mark.parametrize("temperature", [1e-30, 1e-34, 1e-37])
@pytest.mark.parametrize("option", [dict(top_k=1), dict(top_k=2), dict(top_p=0.5),
                                    dict(top_p=1e-9)])
def test_tiny_temperature_on_negative_logits_keeps_the_top_tokens(temperature, option):
    """Regression: `logits / temperature` at or below kzoo's mask value (-1e30: here -2 /
    1e-30) left the *masked* tokens the largest, so top-k / top-p sampled only tokens they
    had removed (before the fix: [-3, -2, -5], temperature 1e-30, top_k=1 gave tokens 0 and 2
    probability 1/2 each and the argmax, 1, none). transformers keeps token 1 alone."""
    logits = np.array([[-3.0, -2.0, -5.0], [-40.0, -50.0, -40.0]], "float32")
    kz = to_numpy(filter_logits(logits, temperature=temperature, **option))
    assert_matches_transformers(logits, kz, temperature, option.get("top_k"),
                                option.get("top_p"))
    np.testing.assert_array_equal(softmax64(kz)[0], [0.0, 1.0, 0.0])
    ids = to_numpy(select_next_token(np.tile(logits, (64, 1)), strategy="sample",
                                     temperature=temperature, seed=0, **option))
    assert set(ids[0::2].tolist()) == {1} and set(ids[1::2].tolist()) <= {0, 2}
    # the same without a temperature: raw logits below -1e30
    extreme = np.array([[-3e30, -2e30, -5e30]], "float32")
    kz = to_numpy(filter_logits(extreme, **option))
    assert_matches_transformers(extreme, kz, 1.0, option.get("top_k"), option.get("top_p"))
    np.testing.assert_array_equal(softmax64(kz)[0], [0.0, 1.0, 0.0])


def test_ties_at_the_top_p_boundary_are_kept_whole():
    """The documented difference, with transformers' own numbers: four equal logits and
    top_p=0.5 keep two of them in transformers (which two depends on its sort order), all
    four in kzoo; logits [2, 1, 1, 0] and top_p=0.7 (mass before the tied pair: 0.475)."""
    logits = np.array([[1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 1.0, 0.0]], "float32")
    _, hf = hf_filter(logits, 1.0, None, 0.5)
    assert (softmax64(hf[0]) > 0).sum() == 2
    kz = to_numpy(filter_logits(logits, top_p=0.5))
    np.testing.assert_allclose(softmax64(kz)[0], [0.25] * 4, atol=PROB_ATOL)
    _, hf = hf_filter(logits, 1.0, None, 0.7)
    kz = to_numpy(filter_logits(logits, top_p=0.7))
    assert (softmax64(hf[1]) > 0).sum() == 2  # one of the tied tokens only
    e = np.exp([2.0, 1.0, 1.0])
    np.testing.assert_allclose(softmax64(kz)[1], np.append(e / e.sum(), 0.0), atol=PROB_ATOL)
    assert_matches_transformers(logits, kz, 1.0, None, 0.7)


# === 2. The draws ===


class TableLM:
    """A stand-in model for `generation.decode` whose logits are `table[last token]`: the
    decoding interface with probabilities the test chooses."""

    def __init__(self, table):
        self.table = np.asarray(table, "float32")
        self.variables = []

    def _lookup(self, last):
        return keras.ops.take(keras.ops.convert_to_tensor(self.table), last, axis=0)

    def generation_prefill(self, inputs, max_new_tokens):
        last = keras.ops.convert_to_tensor(inputs["token_ids"])[:, -1]
        return self._lookup(last), {"last": last}, {"unused": keras.ops.zeros_like(last)}

    def generation_step(self, token_ids, state, constants, index):
        last = token_ids[:, 0]
        return self._lookup(last), {"last": last}


def sampling_distribution(logits, temperature, top_k, top_p):
    """The distribution (float64) each row is sampled from: transformers' warpers, with a tie
    group that its top-p cut splits kept whole (kzoo's rule, see `_check_row`): the
    temperature + top-k probabilities renormalized over that set. Asserts that no cut lies
    within MASS_EPS of top_p (where float rounding may move it)."""
    before, after = hf_filter(logits, temperature, top_k, top_p)
    q, hf = softmax64(before), softmax64(after)
    probs = np.zeros_like(q)
    for row in range(len(q)):
        keep = (q[row] > 0) & (before[row] >= before[row][hf[row] > 0].min())
        if top_p is not None and top_p < 1.0:
            values = np.unique(before[row][q[row] > 0])[::-1]
            mass = np.array([q[row][before[row] == v].sum() for v in values])
            assert np.all(np.abs(np.cumsum(mass) - mass - top_p) > MASS_EPS), "pick other logits"
        probs[row] = np.where(keep, q[row], 0.0) / q[row][keep].sum()
    return probs


CHI2_ALPHA = 1e-6  # false-positive rate of each chi-square test (fixed seeds: deterministic)


def assert_frequencies(ids, probs, label):
    """Draws `ids` against the distribution `probs`: none outside its support, and a
    chi-square goodness-of-fit test (cells of expected count < 5 pooled) at CHI2_ALPHA."""
    n = len(ids)
    counts = np.bincount(ids, minlength=len(probs)).astype(np.float64)
    assert counts.shape == probs.shape, (label, "an id past the vocabulary")
    outside = np.nonzero((counts > 0) & (probs == 0))[0]
    assert outside.size == 0, f"{label}: drew ids {outside.tolist()} of probability 0"
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    if len(exp) < 2:
        return
    statistic = ((obs - exp) ** 2 / exp).sum()
    p_value = stats.chi2.sf(statistic, len(exp) - 1)
    assert p_value > CHI2_ALPHA, (label, p_value, counts / n, probs)


# Rows (no tie at any cut below): ties elsewhere, -inf, a flat row, a peaked one.
TABLE = np.array([
    [1.0, 0.5, 0.5, -1.0, 2.0, -np.inf, 0.0, 0.25],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [-np.inf, 3.0, -np.inf, 2.0, 1.5, 1.5, -np.inf, 0.5],
    [8.0, -2.0, 0.0, 1.0, 0.5, 7.5, -1.0, 2.0],
    [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
    [-1.0, -1.0, 2.0, 2.0, -3.0, 0.0, 1.0, -np.inf],
    [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0],
    [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0],
], "float32")

SAMPLING_CASES = [
    dict(temperature=0.7, top_k=5, top_p=0.9),
    dict(temperature=1.8, top_k=None, top_p=0.6),
]


@pytest.mark.parametrize("case", range(len(SAMPLING_CASES)))
def test_the_decode_loop_draws_transformers_distribution(case):
    """The sampler every `generate` uses, two steps of the loop (the first from the prompt's
    logits, the second from the drawn token's row), against transformers' distributions."""
    options = SAMPLING_CASES[case]
    probs = sampling_distribution(TABLE, **options)
    reps = 1500
    firsts = np.repeat(np.arange(len(TABLE), dtype="int32"), reps)[:, None]
    out = np.array(generation.decode(TableLM(TABLE), {"token_ids": firsts},
                                     sampler=make_sampler("sample", **options),
                                     max_new_tokens=2, seed=1234 + case))
    assert out.shape == (len(firsts), 2)
    for row in range(len(TABLE)):
        assert_frequencies(out[row * reps:(row + 1) * reps, 0], probs[row], f"step 0, row {row}")
    # step 1: the marginal over the first draws of all rows (uniform over the rows)
    marginal = (probs.mean(0)[:, None] * probs).sum(0)
    assert_frequencies(out[:, 1], marginal, "step 1")
    # the same seed draws the same tokens
    again = generation.decode(TableLM(TABLE), {"token_ids": firsts[:64]},
                              sampler=make_sampler("sample", **options), max_new_tokens=2,
                              seed=99)
    assert again == generation.decode(TableLM(TABLE), {"token_ids": firsts[:64]},
                                      sampler=make_sampler("sample", **options),
                                      max_new_tokens=2, seed=99)


@pytest.mark.parametrize("options", [dict(temperature=1.0, top_k=None, top_p=None),
                                     dict(temperature=0.5, top_k=3, top_p=None),
                                     SAMPLING_CASES[0]])
def test_select_next_token_draws_transformers_distribution(options):
    probs = sampling_distribution(TABLE, **options)
    reps = 1500
    ids = to_numpy(select_next_token(np.repeat(TABLE, reps, 0), strategy="sample", seed=7,
                                     **options))
    for row in range(len(TABLE)):
        assert_frequencies(ids[row * reps:(row + 1) * reps], probs[row], f"row {row}")


# GPT's logits are small at initialization (std ~0.1): small temperatures spread them.
GPT_CASES = [
    dict(temperature=0.05, top_k=3, top_p=None),
    dict(temperature=0.03, top_k=None, top_p=0.7),
    dict(temperature=0.02, top_k=12, top_p=0.4),
    dict(temperature=1.0, top_k=1, top_p=None),  # greedy in both libraries
]
GPT_VOCAB = 48
_GPT = {}


def _gpt():
    if "lm" not in _GPT:
        keras.utils.set_random_seed(0)
        _GPT["lm"] = GPTCausalLM(GPTBackbone(
            vocabulary_size=GPT_VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=24, max_sequence_length=32))
    return _GPT["lm"]


# The cached decode's logits and a full forward pass's differ by float32 rounding: a token
# at a cut may fall on either side. One raised by this much (raw logits) must be inside.
FORWARD_SLACK = 1e-4


PROMPTS = [[5, 17, 3], [40], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW_TOKENS = 10


def _step_logits(lm, prompts, outputs):
    """`logits[b][t]`: a full forward pass's logits that row b's new token t was drawn from
    (one right-padded batch: the model is causal, the padding comes after)."""
    rows = [prompt + row for prompt, row in zip(prompts, outputs)]
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), "int32")
    mask = np.zeros((len(rows), width), "int32")
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = r, 1
    logits = to_numpy(lm({"token_ids": ids, "padding_mask": mask}))
    return [logits[b, len(p) - 1:len(p) - 1 + len(o)]
            for b, (p, o) in enumerate(zip(prompts, outputs))]


@pytest.mark.spread
@pytest.mark.parametrize("case", range(len(GPT_CASES)))
def test_gpt_generate_samples_reproducibly_inside_transformers_support(case):
    options = GPT_CASES[case]
    lm = _gpt()
    kwargs = dict(max_new_tokens=NEW_TOKENS, strategy="sample", seed=2024 + case,
                  stop_token_ids=None, **options)
    out = lm.generate(PROMPTS, **kwargs)
    assert out == lm.generate(PROMPTS, **kwargs)
    assert [len(row) for row in out] == [NEW_TOKENS] * len(PROMPTS)
    for row, steps in zip(out, _step_logits(lm, PROMPTS, out)):
        _, after = hf_filter(steps, **options)
        for t, token in enumerate(row):
            if softmax64(after[t])[token] > 0:
                continue
            raised = steps[t:t + 1].copy()
            raised[0, token] += FORWARD_SLACK
            _, near = hf_filter(raised, **options)
            assert softmax64(near[0])[token] > 0, (
                f"token {token} at step {t} of {row} is outside transformers' support "
                f"{np.nonzero(softmax64(after[t]) > 0)[0].tolist()} ({options})")
    if options["top_k"] == 1:  # the argmax at every step
        assert out == lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=None)
    else:  # not one token repeated: sampling did happen
        assert sum(len(set(row)) for row in out) > len(PROMPTS)


def test_generate_sample_seed_forms():
    """An int seed repeats (above); a SeedGenerator advances (two calls differ); eager ==
    compiled (the settings and shapes of the first case above: no new compile)."""
    lm = _gpt()
    kwargs = dict(max_new_tokens=NEW_TOKENS, strategy="sample", stop_token_ids=None,
                  **GPT_CASES[0])
    gen = keras.random.SeedGenerator(5)
    assert lm.generate(PROMPTS, seed=gen, **kwargs) != lm.generate(PROMPTS, seed=gen, **kwargs)
    if BACKEND != "jax":  # (eager JAX: seconds of per-op compiles)
        assert (lm.generate(PROMPTS, seed=11, **kwargs)
                == lm.generate(PROMPTS, seed=11, compile=False, **kwargs))


# === 3. Argument validation ===

NAN, INF = float("nan"), float("inf")

BAD_ARGUMENTS = [
    ("top_k", 0), ("top_k", -1), ("top_k", 2.0), ("top_k", 1.5), ("top_k", True),
    ("top_k", False), ("top_k", "3"), ("top_k", np.float32(2.0)), ("top_k", np.bool_(True)),
    ("top_p", 0), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.0000001), ("top_p", 2),
    ("top_p", NAN), ("top_p", INF), ("top_p", -INF), ("top_p", True), ("top_p", "0.9"),
    ("top_p", np.float32(NAN)),
    ("temperature", 0), ("temperature", 0.0), ("temperature", -0.0), ("temperature", -1.0),
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF),
    ("temperature", np.float64(INF)), ("temperature", True), ("temperature", "1.0"),
    ("temperature", None),
]


def _message_names(error, name, value):
    text = str(error.value)
    assert f"`{name}`" in text and f"{name}={value!r}" in text, text


@pytest.mark.parametrize("name, value", BAD_ARGUMENTS, ids=lambda x: repr(x))
def test_bad_sampling_arguments_are_refused_everywhere(name, value):
    """Before the fix temperature=inf was accepted: logits / inf are all 0 (top_k then keeps
    every token, a tie) and -inf / inf is NaN (NaN probabilities)."""
    logits = np.zeros((1, 5), "float32")
    calls = [
        lambda: filter_logits(logits, **{name: value}),
        lambda: select_next_token(logits, strategy="sample", **{name: value}),
        lambda: make_sampler("sample", **{name: value}),
        lambda: generation.RandomSampler(**{name: value}),
        lambda: _gpt().generate([[1, 2]], max_new_tokens=2, strategy="sample",
                                **{name: value}),
        lambda: _t5().generate(np.array([[3, 4, 1]]), max_new_tokens=2, strategy="sample",
                               **{name: value}),
    ]
    for call in calls:
        with pytest.raises((ValueError, TypeError)) as error:
            call()
        _message_names(error, name, value)


_T5 = {}


def _t5():
    if "lm" not in _T5:
        keras.utils.set_random_seed(0)
        _T5["lm"] = T5Seq2SeqLM(T5Backbone(
            vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8, key_value_dim=4,
            intermediate_dim=16, dropout=0.0))
    return _T5["lm"]


BAD_GENERATE_ARGUMENTS = [
    ("num_beams", 2, dict(strategy="sample")),
    ("num_beams", 5, dict(strategy="sample", top_p=0.9)),
    ("num_beams", 0, dict(strategy="sample")),
    ("num_beams", -1, dict(strategy="beam")),
    ("num_beams", 2.0, dict(strategy="beam")),
    ("num_beams", True, dict(strategy="sample")),
    ("strategy", "nucleus", {}),
    ("strategy", "Sample", {}),
    ("strategy", None, {}),
    ("seed", -1, dict(strategy="sample")),
    ("seed", 2 ** 32, dict(strategy="sample")),
    ("seed", 1.5, dict(strategy="sample")),
    ("seed", True, dict(strategy="sample")),
    ("seed", "0", dict(strategy="sample")),
    ("max_new_tokens", 0, dict(strategy="sample")),
    ("max_new_tokens", -3, dict(strategy="sample")),
    ("max_new_tokens", 2.0, dict(strategy="sample")),
    ("length_penalty", NAN, dict(strategy="beam")),
    ("early_stopping", "sometimes", dict(strategy="beam")),
    # the beam arguments are checked with every strategy (they were ignored in silence)
    ("length_penalty", NAN, dict(strategy="sample")),
    ("length_penalty", "long", {}),
    ("early_stopping", "sometimes", dict(strategy="sample")),
    ("early_stopping", 1, {}),
    ("stop_token_ids", [1.5], dict(strategy="sample")),
    ("stop_token_ids", -1, dict(strategy="sample")),
]


@pytest.mark.parametrize("name, value, extra", BAD_GENERATE_ARGUMENTS, ids=lambda x: repr(x))
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_bad_generate_arguments_are_refused(family, name, value, extra):
    kwargs = dict(max_new_tokens=2)
    kwargs.update(extra)
    kwargs[name] = value
    with pytest.raises((ValueError, TypeError)) as error:
        if family == "gpt":
            _gpt().generate([[1, 2]], **kwargs)
        else:
            _t5().generate(np.array([[3, 4, 1]]), **kwargs)
    _message_names(error, name, value)


def test_extreme_but_valid_settings_are_accepted():
    """The edges of the allowed ranges stay allowed (and agree with transformers)."""
    logits = _grid(np.random.default_rng(0).normal(size=(3, 7)) * 2)
    for temperature, top_k, top_p in [(1e-45, None, None), (1e30, None, None),
                                      (1.0, 10 ** 30, 1.0), (np.float32(0.5), np.int64(2),
                                                             np.float32(1e-12)),
                                      (2, 7, None)]:
        kz = to_numpy(filter_logits(logits, temperature=temperature, top_k=top_k,
                                    top_p=top_p))
        assert_matches_transformers(logits, kz, float(temperature),
                                    None if top_k is None else int(top_k),
                                    None if top_p is None else float(top_p))
    assert math.isfinite(float(to_numpy(filter_logits(logits, temperature=1e-45)).max()))
