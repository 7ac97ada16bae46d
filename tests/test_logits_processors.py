"""generate's logits processors (repetition_penalty, no_repeat_ngram_size, min_new_tokens):
the processing functions against transformers' own processor classes on random scores and
histories, kzoo's `generate` token for token against transformers' `generate` (GPT-2 and T5,
greedy and beam search), and the argument checks."""

import keras
import numpy as np
import pytest
import torch
import transformers
from transformers.generation import logits_process as hf_process

from kzoo import generation
from tests.helpers import count_compiled_steps, to_numpy

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


@pytest.mark.spread
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


# === generate against transformers' generate ===

BACKEND = keras.backend.backend()
MAX_NEW = 12
OPTIONS = [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(no_repeat_ngram_size=2),
    dict(min_new_tokens=5),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5),
]


def _until_stop(row, stop):
    """A transformers row's new tokens up to and including the first stop token (it pads
    the rest of its fixed-width rows)."""
    row = list(row)
    return row[:row.index(stop) + 1] if stop in row else row


class _Pair:
    """A tiny random transformers model, the same weights loaded by kzoo, prompts of one
    length (no padding: transformers counts the pad tokens of left-padded rows in the
    history, kzoo does not) and a stop token that the model produces at its third step
    without the options (so that min_new_tokens changes the output)."""

    def __init__(self, path, family):
        torch.manual_seed(0)
        if family == "gpt2":
            # (initializer_range 0.2 rather than 0.02: outputs that are not one token repeated)
            config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=60,
                                             n_positions=64, initializer_range=0.2)
            self.hf = transformers.GPT2LMHeadModel(config).eval()
            self.prompts = np.random.default_rng(0).integers(1, 60, (3, 5))
            self.fixed = dict(pad_token_id=0)
        else:
            config = transformers.T5Config(
                d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                vocab_size=60, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                initializer_factor=3.0)
            self.hf = transformers.T5ForConditionalGeneration(config).eval()
            self.prompts = np.random.default_rng(0).integers(2, 60, (3, 6))
            self.fixed = dict(pad_token_id=0, decoder_start_token_id=0)
        self.family = family
        self.hf.save_pretrained(path)
        import kzoo.presets

        self.model = kzoo.presets.load(str(path))
        self.stop = None
        self.stop = self.transformers(eos_token_id=None)[0][2]

    def transformers(self, num_beams=1, **options):
        with torch.no_grad():
            out = self.hf.generate(
                torch.tensor(self.prompts, dtype=torch.long),
                attention_mask=torch.ones(self.prompts.shape, dtype=torch.long),
                do_sample=False, num_beams=num_beams, max_new_tokens=MAX_NEW,
                **{"eos_token_id": self.stop, **self.fixed, **options}).numpy()
        new = out[:, 1:] if self.family == "t5" else out[:, self.prompts.shape[1]:]
        return [_until_stop(row, self.stop) for row in new.tolist()]

    def kzoo(self, num_beams=1, **options):
        return self.model.generate(self.prompts, max_new_tokens=MAX_NEW, num_beams=num_beams,
                                   stop_token_ids=[self.stop], **options)


@pytest.fixture(scope="module", params=["gpt2", "t5"])
def pair(request, tmp_path_factory):
    return _Pair(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.spread
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_equals_transformers(pair, num_beams):
    off = pair.kzoo(num_beams)
    assert off == pair.transformers(num_beams)
    for options in OPTIONS:
        ours = pair.kzoo(num_beams, **options)
        assert ours == pair.transformers(num_beams, **options), options
        # (each option changes these outputs; but T5's beams follow tokens of probability
        # near 1, whose log-probabilities near 0 the penalty scales by little: the same
        # beams in transformers too)
        if not (pair.family == "t5" and num_beams > 1 and list(options) == [
                "repetition_penalty"]):
            assert ours != off, options
    # Afterwards, the options off give the same tokens as before (and as transformers): a
    # loop compiled with options is not reused without them.
    assert pair.kzoo(num_beams, repetition_penalty=1.0, no_repeat_ngram_size=0,
                     min_new_tokens=0) == off


@pytest.mark.spread
@pytest.mark.parametrize("num_beams", [1, 3])
def test_eager_loop_equals_transformers(pair, num_beams):
    options = OPTIONS[-1]
    assert pair.kzoo(num_beams, compile=False, **options) == pair.transformers(num_beams,
                                                                                **options)


@pytest.mark.parametrize("pair", ["gpt2"], indirect=True)
@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_batch_of_lengths_continues_as_each_prompt_alone(pair, num_beams):
    """GPT's history is a prompt's real tokens (transformers counts the pad tokens of a
    left-padded row too): prompts of different lengths in one batch give transformers'
    tokens for each prompt alone. (GPT only: T5's history is the decoder start token,
    whatever the encoder input.)"""
    options = OPTIONS[-1]
    rows = [pair.prompts[0, :2].tolist(), pair.prompts[1].tolist(), pair.prompts[2, :4].tolist()]
    ours = pair.model.generate(rows, max_new_tokens=MAX_NEW, num_beams=num_beams,
                               stop_token_ids=[pair.stop], **options)
    alone = []
    for row in rows:
        with torch.no_grad():
            out = pair.hf.generate(torch.tensor([row]), attention_mask=torch.ones((1, len(row)),
                                   dtype=torch.long), do_sample=False, num_beams=num_beams,
                                   max_new_tokens=MAX_NEW, eos_token_id=pair.stop,
                                   pad_token_id=0, **options)
        alone.append(_until_stop(out[0, len(row):].tolist(), pair.stop))
    assert ours == alone


def test_torch_compiled_step_equals_transformers(pair, monkeypatch):
    """The torch loop's compiled model step (kzoo.layers.compiled_decode) only gives logits:
    the processors apply after it as after the eager step."""
    calls = count_compiled_steps(monkeypatch)
    options = OPTIONS[-1]
    assert pair.kzoo(3, **options) == pair.transformers(3, **options)
    assert bool(calls) == (BACKEND == "torch")


@pytest.mark.spread
def test_sampling_with_processors(pair):
    """Sampling draws from the processed logits: with no_repeat_ngram_size=1 no token of the
    history comes again, no stop token before min_new_tokens; compiled == eager."""
    model, prompts = pair.model, pair.prompts
    kwargs = dict(max_new_tokens=MAX_NEW, strategy="sample", temperature=2.0, seed=3,
                  stop_token_ids=[pair.stop])
    out = model.generate(prompts, no_repeat_ngram_size=1, **kwargs)
    for prompt, row in zip(prompts.tolist(), out):
        history = ([0] if pair.family == "t5" else prompt) + row
        assert len(set(history)) == len(history), history
    out = model.generate(prompts, min_new_tokens=MAX_NEW, **kwargs)
    assert all(len(row) == MAX_NEW and pair.stop not in row for row in out)
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4)
    assert (model.generate(prompts, compile=False, **options, **kwargs)
            == model.generate(prompts, **options, **kwargs))


# === Argument checks; nothing added with the options off ===


@pytest.mark.parametrize("name,value,allowed", [
    ("repetition_penalty", 0.0, "finite number > 0"),
    ("repetition_penalty", -1.3, "finite number > 0"),
    ("repetition_penalty", float("nan"), "finite number > 0"),
    ("repetition_penalty", float("inf"), "finite number > 0"),
    ("repetition_penalty", True, "finite number > 0"),
    ("repetition_penalty", "1.3", "finite number > 0"),
    ("repetition_penalty", None, "finite number > 0"),
    ("no_repeat_ngram_size", -1, "int >= 0"),
    ("no_repeat_ngram_size", 2.0, "int >= 0"),
    ("no_repeat_ngram_size", True, "int >= 0"),
    ("no_repeat_ngram_size", None, "int >= 0"),
    ("min_new_tokens", -2, "int >= 0"),
    ("min_new_tokens", 1.5, "int >= 0"),
    ("min_new_tokens", False, "int >= 0"),
])
def test_bad_options_are_refused_by_name(pair, name, value, allowed):
    message = rf"`{name}` must be an? {allowed}.*got {name}={value!r}"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pair.model.generate(pair.prompts, max_new_tokens=2, **{name: value})
    with pytest.raises(ValueError, match=f"`{name}`"):
        generation.make_sampler("beam", **{name: value})


def test_options_off_add_nothing():
    """The defaults (transformers' own: 1.0, 0, 0) make no processors: the loop is the one
    without them."""
    for strategy in ("greedy", "sample", "beam"):
        assert generation.make_sampler(strategy).processors is None
        assert generation.make_sampler(strategy, repetition_penalty=1, no_repeat_ngram_size=0,
                                       min_new_tokens=0).processors is None
    sampler = generation.make_sampler("greedy", min_new_tokens=np.int64(3))
    assert sampler.processors.key == (1.0, 0, 3)
    # (min_new_tokens keeps no history: only the step index is read)
    assert sampler.processors.start({}, None, 4, (2,)) == {}


@pytest.mark.spread
def test_min_new_tokens_above_max_new_tokens_means_no_stop(pair):
    """Allowed, as by transformers: no stop token at all then."""
    out = pair.model.generate(pair.prompts, max_new_tokens=4, stop_token_ids=[pair.stop],
                              min_new_tokens=10)
    assert all(len(row) == 4 and pair.stop not in row for row in out)
