"""`demo` (what `make demo` runs): a couple of minutes of a small GPT on the pydoc text.

Trains a narrowed `gpt_mini` (4 blocks of width 128 instead of 256) on the prose paragraphs
of the standard library's `pydoc_data.topics`, with a 1024-token byte-level BPE trained on
the training 90% of that prose (`tokenizers`), showing one Keras progress bar; then prints
four samples from `generate`, each after a prompt from the held-out prose, together with how
many of their words occur in the training text (the check that the samples read as
language, not as byte soup), and where the model, the CSV log and the plot were written
(`runs/demo/...` by default). Nothing is downloaded; running it again resumes from or
re-uses its checkpoints (`--fresh` starts over).

Why these choices (see the README's demo section for the measured figures):

- Prose only (`--prose-only`, on by default here; `--no-prose-only` trains on everything):
  two thirds of pydoc's text are code listings, grammar rules and tables. An earlier 400-step
  run on all of it (BPE of 2048) wrote code-like soup (14 of 27 words known) after a prompt
  that ended inside code (`len(`). `_text.is_prose` keeps the paragraphs that have no
  indented line, start with a capital, end with `.` or `:` and are at least 90% letters
  and spaces: ~150K of the 465K characters, 602 paragraphs. The words the samples are
  checked against are those of this filtered training text, so the check is no easier.
- BPE tokens instead of bytes: a step sees ~4x more text, and what the model emits is made
  of the training text's own word pieces. The BPE's pre-tokenizer (GPT-2's split) already
  keeps every token inside one word (a leading space, then letters; or digits; or
  punctuation), so the model still has to put words together from pieces: 1024 tokens is
  small enough that many words take two or more, which keeps the known-word share a real
  test (a one-block model of width 16 after 3 steps scored 33%: 29 of 88 words).
- Width 128 and sequences of 128 tokens at batch 16: ~7x fewer FLOPs a step than
  `gpt_mini` at 32 x 128 bytes. 300 steps at learning rate 2e-3 after 60 warmup steps
  (inverse-square-root decay, so a longer run only continues this one): 88% and 91% known
  words on the samples of seeds 0 and 2, validation loss 4.21-4.24, in 115 s wall on a
  lightly loaded machine; 400 steps gave 78-90% over three seeds at about the same
  validation loss (4.16-4.22), for a third more time in a run that has to fit in the few minutes `make demo`
  allows on a 2-core CPU.
- The samples: four prompts of 32 tokens, each a capitalised prose line of the held-out
  text that ends where a word ends (`gpt_text._prose_starts`, spread over the held-out
  text), continued by 96 new tokens in one batch, so that the share is measured over ~200
  words rather than one sentence of ~20 (too noisy a figure). Every position a sample uses
  was trained (32 + 96 = `--seq-len`). Temperature 0.7 with top-k 40 (gpt_text's sample
  uses 0.8): the model's more likely continuations, still drawn at random.
"""

import os
import re

import numpy as np

from training.recipes import _text
from training.recipes import gpt_text

# (checked by the CLI before any work: a bad value is a usage error)
check_options = _text.check_options

NAME = "demo"
HELP = ("what `make demo` runs: a few minutes of a small GPT on the pydoc prose (BPE tokens), "
        "then samples and the share of their words found in the training text.")
DEFAULTS = dict(
    gpt_text.DEFAULTS,
    steps=300,
    batch_size=16,
    learning_rate=2e-3,
    warmup_steps=60,
    save_every=100,
    max_epoch_steps=300,
    overrides=dict(hidden_dim=128, intermediate_dim=512, num_heads=4, num_layers=4),
)
# Defaults of the text options that differ from `gpt_text`'s (set on the parser, so that
# `--help` shows them and the command line still overrides them).
OPTION_DEFAULTS = dict(tokenizer="bpe", bpe_vocab=1024, seq_len=128, sample_tokens=96,
                       prose_only=True)
# The printed sample: several prompts from the held-out text, continued in one batch, so that
# the share of known words is measured over a few hundred words rather than one sentence.
SAMPLING = dict(prompts=4, prompt_tokens=32, temperature=0.7, top_k=40, top_p=None,
                whole_words=True)

EDGE_PUNCTUATION = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def add_arguments(parser):
    gpt_text.add_arguments(parser)
    parser.set_defaults(**OPTION_DEFAULTS)
    for action in parser._actions:  # the shared help texts name gpt_text's defaults
        if action.dest in OPTION_DEFAULTS and action.help:
            action.help += " [the demo's default: %(default)s]"


def words(text):
    """The words of `text`: its whitespace-separated pieces, lower-cased, without the
    punctuation at their ends (`"popitem()"` -> `popitem`; `to*i` stays one word, which no
    text contains); pieces made only of punctuation are not words."""
    out = []
    for piece in text.split():
        piece = EDGE_PUNCTUATION.sub("", piece)
        if piece:
            out.append(piece.lower())
    return out


def word_coverage(sample, vocabulary):
    """`(found, total)`: how many of the words of `sample` occur in `vocabulary`."""
    sample_words = words(sample)
    return sum(w in vocabulary for w in sample_words), len(sample_words)


def training_vocabulary(options):
    """The set of words of the run's training text (the text the model and the BPE were
    trained on: `_text.load_texts`, prose only by default)."""
    train_text, _ = _text.load_texts(options)
    return set(words(train_text))


def report(model, task, metrics):
    print(f"Validation: loss {metrics['val_loss']:.4f}, next-token accuracy "
          f"{metrics['val_accuracy']:.4f}, perplexity {metrics['val_perplexity']:.2f} "
          f"({task.info['tokenizer']} tokens)")
    pairs = metrics["samples"]
    print(f"--- {len(pairs)} samples: a prompt from the held-out text \u2502 what the model "
          "wrote after it ---")
    for prompt, text in pairs:
        print(prompt + "\u2502" + text)
        print()
    found, total = metrics["sample_words_found"], metrics["sample_words"]
    share = metrics["sample_words_in_training_text"]
    print(f"Words of the generated text found in the training text: {found} of {total} "
          f"({100 * share:.0f}%)")


def _show(path):
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


HEATMAP_TOKENS = 16


def attention_heatmap(model, task, prompt, path):
    """One picture of what the trained model attends to: every head of its last layer over
    the first `HEATMAP_TOKENS` tokens of a held-out prompt (`kzoo.interpret`). Returns the
    PNG's path; `python -m kzoo.interpret <model dir> --text ...` draws every layer."""
    from kzoo.interpret import attention_maps, plot_attention

    tokenizer = task.info["tokenizer_object"]
    ids = np.asarray(tokenizer.encode(prompt), "int32")[:HEATMAP_TOKENS]
    labels = [tokenizer.decode([int(i)]) for i in ids]
    maps = attention_maps(model, {"token_ids": ids[None], "padding_mask": np.ones_like(ids)[None]})
    last = len(maps["self"]) - 1
    figure = plot_attention(maps, labels, layer=last, head=None,
                            title=f"demo GPT: attention of every head, layer {last}")
    figure.savefig(path)
    return path


def train(cfg):
    from training.loop import run
    from training.losses import SmoothedSparseCrossentropy

    _text.check_options(cfg.options)
    model, task = gpt_text.build(cfg)
    # One epoch for the whole run, so that Keras shows one progress bar: the training
    # examples are random windows of the text, a "pass" over it is only nominal here.
    task.steps_per_epoch = max(task.steps_per_epoch, cfg.steps or 0)
    vocabulary = training_vocabulary(cfg.options)

    def evaluate(model, task):
        pairs = gpt_text.samples(model, task, cfg, **SAMPLING)
        out = gpt_text.validation_metrics(model, task)
        out["samples"] = [list(pair) for pair in pairs]
        found, total = word_coverage(" ".join(text for _, text in pairs), vocabulary)
        out["sample_words_found"] = found
        out["sample_words"] = total
        out["sample_words_in_training_text"] = found / total if total else 0.0
        return out

    info = {k: v for k, v in task.info.items() if k not in ("tokenizer_object", "val_ids")}
    record = run(cfg, model, task,
                 loss=SmoothedSparseCrossentropy(cfg.label_smoothing),
                 metrics=gpt_text.lm_metrics(), monitor="val_loss", mode="min",
                 evaluate=evaluate, report=report,
                 extra_files=[gpt_text.tokenizer_writer(task)],
                 extra_run_info={"data": info})
    files = record["files"]
    prompt = record["metrics"]["samples"][0][0]
    heatmap = attention_heatmap(model, task, prompt,
                                os.path.join(os.path.dirname(files["plot"]), "attention.png"))
    print("Where things are:")
    print(f"  model (kzoo.presets.load):  {_show(files['model'])}")
    print(f"  best model:                 {_show(files['best'])}")
    print(f"  CSV log:                    {_show(files['csv'])}")
    print(f"  loss/metric curves:         {_show(files['plot'])}")
    print(f"  metrics:                    {_show(files['metrics'])}")
    print(f"  checkpoints:                {_show(files['checkpoints'])}")
    print(f"  attention heatmap:          {_show(heatmap)}")
    print(f"Reload it with: kzoo.presets.load({_show(files['model'])!r})")
    return record
