"""Tests of what `make demo` runs (`python -m training demo`, training/recipes/demo.py).

The pieces the demo's claims rest on are checked against hand-written expectations: the
prose filter (what the model trains on), the word split and the share of known words (the
figure printed with the sample), the choice of prompts. A tiny run of the real command then
checks that the printed share is the share of the printed samples' words found in the
training text, recomputed here with a regular expression instead of the demo's code.
"""

import json
import os
import re

import pytest

import kzoo.data
from training import data as D
from training.cli import build_parser, config_from_args, main
from training.recipes import _text
from training.recipes import demo
from training.recipes import gpt_text

PROSE = ("A function definition is an executable statement.  Its execution binds\n"
         "the function name in the current local namespace to a function object.")
CODE = "   @f1(arg)\n   def func(): pass"
GRAMMAR = 'funcdef ::= [decorators] "def" funcname "(" [parameter_list] ")"'
HEADING = "Function definitions\n===================="
SYMBOLS = 'If "x" is "{a: b, c: d}" then "x[a]" is "b" and "x[c]" is "d".'
LOWER = "is roughly equivalent to the code below, which binds the name func."
NO_STOP = "Changed in version 3.9 Functions may be decorated with any valid expression"


def test_prose_filter_keeps_sentences_and_drops_code_grammar_and_headings():
    text = "\n\n".join([HEADING, PROSE, CODE, GRAMMAR, SYMBOLS, LOWER, NO_STOP,
                        "Another paragraph of plain English text, ending in a colon:"])
    kept = _text.prose_only(text)
    assert kept == (
        "A function definition is an executable statement.  Its execution binds "
        "the function name in the current local namespace to a function object."
        "\n\nAnother paragraph of plain English text, ending in a colon:")


def test_prose_filter_names_the_option_when_nothing_is_left():
    with pytest.raises(ValueError, match="--prose-only"):
        _text.prose_only(CODE + "\n\n" + GRAMMAR)


def test_prose_filter_on_pydoc_keeps_only_unindented_sentences_of_the_text():
    text = kzoo.data.load_text("pydoc")
    kept = _text.prose_only(text)
    flat = re.sub(r"\s+", " ", text)
    paragraphs = kept.split("\n\n")
    assert len(kept) < len(text) and len(paragraphs) > 100
    for paragraph in paragraphs:
        assert "\n" not in paragraph and paragraph == paragraph.strip()
        assert paragraph[0].isupper() and paragraph[-1] in ".:"
        assert ">>>" not in paragraph and "::=" not in paragraph
        assert re.sub(r"\s+", " ", paragraph) in flat  # the text's own words, reflowed


def test_words_and_coverage_match_a_hand_count():
    assert demo.words('Call "popitem()" -- then (x) ends.  TO*I') == [
        "call", "popitem", "then", "x", "ends", "to*i"]
    vocabulary = {"call", "then", "ends"}
    # call, popitem, then, x, ends: 3 of 5 are known.
    assert demo.word_coverage('Call "popitem()" -- then (x) ends.', vocabulary) == (3, 5)
    assert demo.word_coverage("... --", vocabulary) == (0, 0)


def test_prompts_are_non_overlapping_prose_that_ends_at_a_word():
    tokenizer = D.ByteTokenizer()
    text = ("x = [1, 2]\n" * 30 + "The first words here and more. " + "y(z)\n" * 40
            + "Other words come now and more. " + "a[b] = c\n" * 40
            + "Third, words all new end here.")
    ids = tokenizer.encode(text)
    length = 20
    starts = gpt_text._prose_starts(tokenizer, ids, length, count=3, whole_words=True)
    assert len(starts) == 3 and starts == sorted(starts)
    for first, second in zip(starts, starts[1:]):
        assert second >= first + length
    for start in starts:
        prompt = text[start:start + length]
        assert prompt[0].isupper() and text[start - 1] in " \n"
        assert text[start + length] == " "  # the prompt ends where a word ends
        assert all(ch.isalpha() or ch in " ," for ch in prompt)
    assert [text[s:s + length] for s in starts] == [
        "The first words here", "Other words come now", "Third, words all new"]
    assert gpt_text._prose_start(tokenizer, ids, length) == starts[0]
    # Without whole_words a prompt may end inside a word ("The first words her").
    assert gpt_text._prose_starts(tokenizer, ids, length - 1, count=3) == starts
    assert gpt_text._prose_starts(tokenizer, ids, length - 1, count=3, whole_words=True) == [0]


def test_prose_only_is_the_demos_default_and_off_for_the_other_text_recipes():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["demo"])).options["prose_only"] is True
    assert config_from_args(
        parser.parse_args(["demo", "--no-prose-only"])).options["prose_only"] is False
    for recipe in ("gpt_text", "bert_mlm"):
        assert config_from_args(parser.parse_args([recipe])).options["prose_only"] is False


TINY = ["--override", "num_layers=1", "--override", "hidden_dim=16",
        "--override", "intermediate_dim=32", "--override", "num_heads=2",
        "--seq-len", "48", "--max-chars", "150000", "--sample-tokens", "16",
        "--batch-size", "4", "--bpe-vocab", "300"]


@pytest.mark.spread
def test_demo_prints_the_share_of_known_words_of_its_samples(tmp_path, capsys):
    out = str(tmp_path / "demo")
    assert main(["demo", "--steps", "2", "--out", out, "--verbose", "0"] + TINY) == 0
    printed = capsys.readouterr().out
    with open(os.path.join(out, "metrics.json")) as f:
        record = json.load(f)
    metrics = record["metrics"]
    pairs = metrics["samples"]
    assert len(pairs) == demo.SAMPLING["prompts"]
    assert record["run"]["data"]["prose_only"] is True

    # Recount with a regular expression, on the training 90% of the filtered text.
    text = _text.prose_only(kzoo.data.load_text("pydoc", 150000))
    train_text = text[: len(text) - round(len(text) * 0.1)]

    def split(s):
        pieces = (re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", p) for p in s.split())
        return [p.lower() for p in pieces if p]

    known = set(split(train_text))
    generated = [w for _, sample in pairs for w in split(sample)]
    found = sum(w in known for w in generated)
    assert (metrics["sample_words_found"], metrics["sample_words"]) == (found, len(generated))
    share = round(100 * found / len(generated)) if generated else 0
    assert (f"Words of the generated text found in the training text: {found} of "
            f"{len(generated)} ({share}%)") in printed
    for prompt, sample in pairs:
        assert prompt + "\u2502" + sample in printed
        assert prompt in text[len(train_text):]  # a prompt of the held-out text
    # The run ends with one attention heatmap of the trained model (kzoo.interpret).
    heatmap = os.path.join(out, "attention.png")
    line = next(l for l in printed.splitlines() if "attention heatmap:" in l)
    assert os.path.samefile(line.split(":", 1)[1].strip(), heatmap)
    import matplotlib.image

    picture = matplotlib.image.imread(heatmap)
    assert picture.ndim == 3 and picture.shape[0] > 100 and picture.shape[1] > 100
    assert picture[..., :3].std() > 0.05  # drawn, not blank
