"""A randomized parity sweep of kzoo's beam search against Hugging Face transformers' own.

Hypothesis draws small transformers models (GPT-2 from `tests/test_parity_sweep_text.py`'s
config space; T5 v1.0 and v1.1 from `tests/test_parity_sweep_t5_vit.py`'s), perturbs their
weights (seeded), makes the drawn stop tokens likelier (their output-embedding rows scaled by
a drawn factor, so that some beams end at their first steps, others later, others never),
saves them, loads them with `kzoo.presets.load` and checks that kzoo's
`generate(strategy="beam" | num_beams=..., length_penalty, early_stopping, stop_token_ids,
max_new_tokens)` returns the token rows of transformers' `generate(num_beams=...,
do_sample=False, length_penalty, early_stopping, eos_token_id, max_new_tokens,
num_return_sequences=1)`: each row's new tokens up to and including its first stop token
(transformers fills the rest of its fixed-width rows). GPT-2 prompts are a batch of 1-3 rows
of different lengths, left padded for transformers (attention_mask) and given to kzoo as a
list or as a left- or right-padded array with `padding_mask`; T5 inputs are 1-3 rows with right or
scattered encoder padding.

Drawn: num_beams 1-5, length_penalty in {-1, 0, 0.6, 1, 2}, early_stopping in {False, True,
"never"}, 1-3 stop tokens, max_new_tokens 1-12, how kzoo is asked for beams
(`strategy="beam"` or `num_beams` alone). transformers' `num_beams=1` is greedy search, and so
is kzoo's `num_beams=1` alone; kzoo's `strategy="beam", num_beams=1` is beam search with one
beam, compared with transformers' beam search loop run with one beam (see
`_one_beam_is_beam_search`: the two differ from greedy search with early_stopping="never"
and length_penalty > 0).

Near ties: float32 results of two libraries differ in the last bits, so a decision whose two
sides are closer than that may legitimately go either way. While transformers runs, every
decision of its beam search is recorded with its margin: the set of candidates kept
(`beams_to_keep`-th against the next), the candidates allowed to finish (`num_beams`-th
against the next), the running beams (the `num_beams`-th best not finished against the
next), the finished hypotheses kept (the `num_beams`-th merged score against the next), the
early-stop heuristic (best possible running score against the worst finished one), and the
answer (the best finished score against the second); greedy search records each step's
top-two logit gap. An example where one margin is under the float32 tolerance (about 3.5
times the largest difference measured between the two libraries' log-probabilities, times
the steps summed, through the length normalisation) is rejected (`hypothesis.assume`) and another is
drawn; every other example must match exactly.

Examples are derandomized (the same every run); `KZOO_SWEEP_EXAMPLES=n` multiplies their number
by n.

The sweeps (mark `sweep`) run on torch by default and on JAX and TensorFlow too with
`make test-all` (tests/conftest.py).
"""

import contextlib
import os
from unittest import mock

import keras
import numpy as np
import pytest
import torch
import transformers
from hypothesis import assume, given
from hypothesis import strategies as st

import kzoo.presets
from tests.harness import QUICKER_LOOP, hf_checkpoint
from tests.test_parity_sweep_t5_vit import (  # noqa: F401 (_one_torch_thread: a fixture)
    _first_then,
    _ints,
    _one_torch_thread,
    _t5_hf_model,
    _t5_inputs,
    sweep,
    t5_cases,
)
from tests.test_parity_sweep_text import (
    _checkpoint_dir,
    _hf_gpt2,
    _left_padded,
    _settings,
    gpt2_configs,
)

BACKEND = keras.backend.backend()
# Examples a version of T5: two on JAX, which compiles each drawn model's decode loop (~4 s an
# example; GPT-2 draws two there too, see `_settings`), six elsewhere (~0.2 s each on torch).
# TensorFlow traces each drawn model's beam loop (~1-2 s): three there, and six GPT-2 draws.
T5_EXAMPLES = ({"jax": 2, "tensorflow": 3}.get(BACKEND, 6)
               * int(os.environ.get("KZOO_SWEEP_EXAMPLES", "1")))

# Scores transformers (and kzoo) exclude carry -1e9 added; anything below this is one.
_EXCLUDED_BELOW = -1e8
# The float32 tolerance of one step's log-probability. kzoo's and transformers' log-softmax
# of such models (initializer_range 0.3, stop rows scaled by 3) differed by at most 2.9e-5 over
# 15 drawn GPT-2 and 10 drawn T5 models (on torch; typically 1e-6 to 5e-6): about 3.5 times
# the largest. A sum of n steps gets n times it.
STEP_TOLERANCE = 1e-4


# === Drawing the search ===


@st.composite
def beam_options(draw):
    """`generate` options shared by both libraries."""
    num_beams = draw(_ints(3, 1, 5), label="num_beams")
    return dict(
        num_beams=num_beams,
        length_penalty=draw(_first_then(1.0, -1.0, 0.0, 0.6, 2.0), label="length_penalty"),
        early_stopping=draw(_first_then(False, True, "never"), label="early_stopping"),
        max_new_tokens=draw(_ints(8, 1, 12), label="max_new_tokens"),
        # how kzoo is asked for beams: strategy="beam", or num_beams alone (num_beams=1
        # alone: greedy search, as transformers' num_beams=1)
        via_strategy=draw(st.booleans(), label="strategy='beam'"),
    )


def _draw_stops(draw, vocab):
    """1-3 distinct stop tokens (0, the padding id and T5's decoder start, included) and the
    factor their output rows are scaled by (larger: likelier, at least at some steps)."""
    stops = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3, unique=True),
                 label="stop_token_ids")
    return stops, draw(_first_then(2.0, 1.0, 1.5, 3.0), label="stop boost")


def _boost_stops(hf, path, stops, boost):
    """Scales the output-embedding rows of `stops` (tied or not) and saves `hf` again."""
    with torch.no_grad():
        hf.get_output_embeddings().weight[stops] *= boost
    hf_checkpoint(path, hf)


# === transformers' side ===


class _Margins:
    """While transformers' `generate` runs (inside `with`), records every decision of its beam
    search (or greedy search) with its margin and its float32 tolerance; `near_tie()` then
    says whether a decision was within its tolerance, i.e. could go the other way in another
    library's float32 arithmetic. Only the margins that can change the result are recorded:
    a boundary between two candidates matters where it changes which ones run on or finish."""

    def __init__(self, hf, options):
        self.hf = hf
        self.greedy = options["num_beams"] == 1 and not options["via_strategy"]
        self.length_penalty = options["length_penalty"]
        # A finished score is a sum of `length` steps / length ** length_penalty; the largest
        # tolerance over the lengths possible.
        self.finished_tolerance = STEP_TOLERANCE * max(
            1.0, options["max_new_tokens"] ** (1.0 - self.length_penalty))
        self.closest = []  # (margin, tolerance, what)
        self.final_scores = self.ordered = None
        self.calls = set()  # the instrumented steps that ran

    def _record(self, gaps, tolerance, what):
        if gaps.numel():
            self.closest.append((float(gaps.min()), tolerance, what))

    def __enter__(self):
        if self.greedy:
            return self
        hf = self.hf
        top_k = hf._get_top_k_continuations
        running = hf._get_running_beams_for_next_iteration
        update = hf._update_finished_beams
        heuristic = hf._check_early_stop_heuristic

        def top_k_continuations(**kw):
            self.calls.add("top_k_continuations")
            # the candidates kept and the best one left out
            self.ordered = torch.topk(kw["accumulated_log_probs"].double(),
                                      kw["beams_to_keep"] + 1, dim=-1).values
            self.raw_tolerance = STEP_TOLERANCE * (kw["cur_len"] + 1 - kw["decoder_prompt_len"])
            return top_k(**kw)

        def running_beams(**kw):
            self.calls.add("running_beams")
            k, scores = kw["num_beams"], kw["topk_log_probs"].double()
            hits = kw["next_token_hits_stopping_criteria"]
            last_step = hits.all(-1)  # (every candidate ends: nothing runs on)
            # the running beams: the k-th best candidate that did not end against the next
            not_ended = torch.sort(torch.where(hits, -torch.inf, scores), -1,
                                   descending=True).values
            real = ~last_step & (not_ended[:, k] > _EXCLUDED_BELOW)
            self._record((not_ended[:, k - 1] - not_ended[:, k])[real], self.raw_tolerance,
                         "running beams")
            # the candidates that may finish (the first k): their boundary, where a stop
            # token lies on either side of it
            either = hits[:, k - 1] | hits[:, k]
            self._record((scores[:, k - 1] - scores[:, k])[either], self.raw_tolerance,
                         "may finish")
            # the candidates kept, where the last of them runs on
            uses_last = ~last_step & ((~hits[:, :-1]).sum(-1) < k)
            ordered = self.ordered
            self._record((ordered[:, -2] - ordered[:, -1])[uses_last], self.raw_tolerance,
                         "candidates kept")
            return running(**kw)

        def finished_beams(**kw):
            self.calls.add("finished_beams")
            length = kw["cur_len"] + 1 - kw["decoder_prompt_len"]
            new = kw["topk_log_probs"] / length ** kw["length_penalty"]
            full = kw["is_sent_finished"].all(-1, keepdim=True) & (
                kw["early_stopping"] is True)
            eligible = (kw["next_token_hits_stopping_criteria"]
                        & kw["top_num_beam_mask"][None, :]
                        & kw["is_early_stop_heuristic_unsatisfied"] & ~full)
            merged = torch.cat([kw["beam_scores"], torch.where(eligible, new, -1e9)], 1)
            merged = torch.sort(merged.double(), -1, descending=True).values
            k = kw["num_beams"]
            real = merged[:, k] > _EXCLUDED_BELOW
            self._record((merged[:, k - 1] - merged[:, k])[real], self.finished_tolerance,
                         "finished kept")
            out = update(**kw)
            self.final_scores = out[1]
            return out

        def early_stop_heuristic(**kw):
            self.calls.add("early_stop_heuristic")
            if kw["early_stopping"] == "never" and kw["length_penalty"] > 0.0:
                length = kw["max_length"] - kw["decoder_prompt_len"]
            else:
                length = kw["cur_len"] - kw["decoder_prompt_len"]
            best = kw["running_beam_scores"][:, 0].double() / length ** kw["length_penalty"]
            worst = kw["beam_scores"].double().min(-1).values
            decided = (kw["is_early_stop_heuristic_unsatisfied"][:, 0]
                       & kw["is_sent_finished"].all(-1))
            self._record((best - worst).abs()[decided], self.finished_tolerance, "early stop")
            return heuristic(**kw)

        hf._get_top_k_continuations = top_k_continuations
        hf._get_running_beams_for_next_iteration = running_beams
        hf._update_finished_beams = finished_beams
        hf._check_early_stop_heuristic = early_stop_heuristic
        return self

    def __exit__(self, *exc):
        if self.greedy:
            return
        # (the steps instrumented are transformers 4.57's: a renamed one would record nothing)
        assert exc[0] is not None or len(self.calls) == 4, self.calls
        for name in ("_get_top_k_continuations", "_get_running_beams_for_next_iteration",
                     "_update_finished_beams", "_check_early_stop_heuristic"):
            object.__delattr__(self.hf, name)
        if self.final_scores is not None:  # the answer: the best finished hypothesis
            best = torch.sort(self.final_scores.double(), -1, descending=True).values
            if best.shape[1] > 1:
                self._record((best[:, 0] - best[:, 1])[best[:, 1] > _EXCLUDED_BELOW],
                             self.finished_tolerance, "best finished")

    def logits_processor(self):
        """Greedy search: records each step's gap between the two largest logits (of every
        row, ended or not)."""
        margins = self

        class Record(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                margins.calls.add("greedy")
                top = torch.topk(scores.double(), 2, dim=-1).values
                margins._record(top[:, 0] - top[:, 1], STEP_TOLERANCE, "greedy")
                return scores

        return transformers.LogitsProcessorList([Record()] if self.greedy else [])

    def near_tie(self):
        assert not self.greedy or self.calls == {"greedy"}, self.calls
        close = [c for c in self.closest if c[0] <= c[1]]
        if close:
            print(f"near tie, example rejected: {min(close)}")
        return bool(close)


def _new_tokens(row, stops):
    """A transformers output row (new tokens only) -> the tokens up to and including its first
    stop token; what follows must be transformers' filling (its pad_token_id 0 being falsy,
    it fills with the first stop token)."""
    row = [int(t) for t in row]
    ends = [i for i, t in enumerate(row) if t in stops]
    if not ends:
        return row
    end = ends[0] + 1
    assert all(t in (0, stops[0]) for t in row[end:]), (row, stops)
    return row[:end]


@contextlib.contextmanager
def _one_beam_is_beam_search(options):
    """kzoo's `strategy="beam", num_beams=1` is beam search with one beam; transformers'
    `generate(num_beams=1)` is greedy search, whatever `early_stopping` and `length_penalty`
    say. Both agree except with early_stopping="never" and length_penalty > 0, where the one
    beam runs on past a stop token that greedy search stops at (the finished hypothesis
    kept, a longer one may score better; `test_one_beam_is_beam_search_not_greedy`). The
    reference for one beam is then transformers' own beam search loop (`_beam_search`,
    reached by reporting the beam-search mode for the call)."""
    if options["num_beams"] != 1 or not options["via_strategy"]:
        yield
        return
    from transformers.generation.configuration_utils import GenerationMode

    with mock.patch.object(transformers.GenerationConfig, "get_generation_mode",
                           lambda self, assistant_model=None: GenerationMode.BEAM_SEARCH):
        yield


def _hf_generate(hf, options, stops, **inputs):
    """transformers' output rows (new tokens, padded) and whether a decision was a near tie."""
    margins = _Margins(hf, options)
    with torch.no_grad(), margins, _one_beam_is_beam_search(options):
        out = hf.generate(
            **{name: torch.tensor(value, dtype=torch.long) for name, value in inputs.items()},
            num_beams=options["num_beams"], do_sample=False,
            length_penalty=options["length_penalty"],
            early_stopping=options["early_stopping"], eos_token_id=list(stops),
            max_new_tokens=options["max_new_tokens"], num_return_sequences=1,
            logits_processor=margins.logits_processor(), **_HF_FIXED[hf.config.model_type])
    return out.numpy(), margins.near_tie()


_HF_FIXED = {
    "gpt2": dict(pad_token_id=0),
    # (use_cache=False: transformers 4.57 sizes the decoder cache by `num_layers`, the
    # encoder's depth, and fails with an IndexError when num_decoder_layers is larger; see
    # tests/test_parity_sweep_t5_vit.py. Without a cache it recomputes the decoder each step.)
    "t5": dict(pad_token_id=0, decoder_start_token_id=0, use_cache=False),
}


def _kzoo_generate(model, inputs, options, stops, compile=QUICKER_LOOP, **kwargs):
    extra = dict(strategy="beam") if options["via_strategy"] else {}
    return model.generate(inputs, max_new_tokens=options["max_new_tokens"],
                          num_beams=options["num_beams"],
                          length_penalty=options["length_penalty"],
                          early_stopping=options["early_stopping"], stop_token_ids=stops,
                          compile=compile, **extra, **kwargs)


def _summary(rows, stops, options):
    ended = [len(r) for r in rows if r and r[-1] in stops]
    return f"{options} stops {stops}: {rows} (rows ended by a stop at lengths {ended})"


# === GPT-2 ===


@pytest.mark.sweep
@_settings(6 if BACKEND == "tensorflow" else 16)
@given(data=st.data())
def test_gpt2_beam_search_sweep(data, tmp_path):
    options = data.draw(beam_options(), label="options")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    vocab = data.draw(st.integers(64, 128), label="vocab_size")
    count = data.draw(st.integers(1, 3), label="prompts")
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=9),
                         label="prompt") for _ in range(count)]
    stops, boost = _draw_stops(data.draw, vocab)
    spare = data.draw(st.integers(0, 3), label="spare positions")
    config = {**data.draw(gpt2_configs(), label="config"), "vocab_size": vocab,
              # large weights: peaked, varied distributions (beams diverge, few near ties)
              "initializer_range": 0.3,
              "n_positions": max(map(len, prompts)) + options["max_new_tokens"] + spare}
    path = _checkpoint_dir(tmp_path)
    hf = _hf_gpt2(path, config, seed)
    _boost_stops(hf, path, stops, boost)
    model = kzoo.presets.load(path)

    ids, mask = _left_padded(prompts)
    out, near_tie = _hf_generate(hf, options, stops, input_ids=ids, attention_mask=mask)
    assume(not near_tie)
    expected = [_new_tokens(row, stops) for row in out[:, ids.shape[1]:]]

    layout = data.draw(st.sampled_from(["list", "left-padded array", "right-padded array"]),
                       label="kzoo's prompts")
    compile = QUICKER_LOOP or (BACKEND == "torch" and data.draw(st.booleans(), label="compile"))
    if layout == "list":
        got = _kzoo_generate(model, prompts, options, stops, compile=compile)
    else:
        if layout == "right-padded array":  # (kzoo takes padding on either side)
            ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()
            for row, prompt in enumerate(prompts):
                ids[row, :len(prompt)] = prompt
        got = _kzoo_generate(model, ids.astype("int32"), options, stops, compile=compile,
                             padding_mask=mask.astype("int32"))
    print(f"[gpt2] {_summary(expected, stops, options)}")
    assert got == expected, (config, prompts, options, stops, got, expected)


# === T5 ===


@pytest.mark.sweep
@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
@sweep(T5_EXAMPLES)
@given(data=st.data())
def test_t5_beam_search_sweep(version, data, tmp_path):
    options = data.draw(beam_options(), label="options")
    case = data.draw(t5_cases(version, architectures=("T5ForConditionalGeneration",),
                              padded_encoder=data.draw(st.booleans(), label="right padded")),
                     label="case")
    # (stop rows are scaled after the helper saved the model: a config.json rewritten as an
    # older transformers would have written it is the converter sweep's concern)
    case["legacy_config"] = False
    stops, boost = _draw_stops(data.draw, case["config"]["vocab_size"])
    path = _checkpoint_dir(tmp_path)
    hf = _t5_hf_model(path, case)
    _boost_stops(hf, path, stops, boost)
    model = kzoo.presets.load(path)

    inputs = _t5_inputs(case, hf.config.vocab_size)
    ids, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    out, near_tie = _hf_generate(hf, options, stops, input_ids=ids, attention_mask=mask)
    assume(not near_tie)
    assert np.all(out[:, 0] == 0)  # the decoder start token
    expected = [_new_tokens(row, stops) for row in out[:, 1:]]

    got = _kzoo_generate(model, {"encoder_token_ids": ids, "encoder_padding_mask": mask},
                         options, stops)
    print(f"[t5 {version}] {_summary(expected, stops, options)}")
    assert got == expected, (case["config"], options, stops, got, expected)


def test_one_beam_is_beam_search_not_greedy(tmp_path):
    """kzoo's `strategy="beam", num_beams=1` runs beam search with one beam (transformers'
    `_beam_search` loop, which its `generate(num_beams=1)` never reaches: that is greedy
    search); kzoo's `num_beams=1` alone is greedy search. With early_stopping="never" and
    length_penalty 2, greedy search stops at the stop token 52 at once, while the one beam
    keeps that hypothesis and runs on to a longer one that scores better."""
    config = dict(vocab_size=64, n_layer=1, n_head=2, n_embd=16, n_positions=32,
                  initializer_range=0.3)
    hf = _hf_gpt2(tmp_path, config, seed=3)
    _boost_stops(hf, tmp_path, [52], 2.5)
    model = kzoo.presets.load(tmp_path)
    prompt = [5, 11, 15, 11, 51]
    options = dict(num_beams=1, length_penalty=2.0, early_stopping="never", max_new_tokens=10)
    rows = {}
    for via_strategy in (False, True):
        both = {**options, "via_strategy": via_strategy}
        out, near_tie = _hf_generate(hf, both, [52], input_ids=np.array([prompt]),
                                     attention_mask=np.ones((1, 5), "int64"))
        assert not near_tie
        expected = [_new_tokens(out[0, 5:], [52])]
        assert _kzoo_generate(model, [prompt], both, [52]) == expected
        rows[via_strategy] = expected[0]
    assert rows == {False: [52], True: [0, 0, 0, 0, 22, 22, 31, 0, 0, 19]}
