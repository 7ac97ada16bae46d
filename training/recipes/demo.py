"""`demo` (what `make demo` runs): a couple of minutes of a small GPT on the pydoc text.

Trains a narrowed `gpt_mini` (4 blocks of width 128 instead of 256) on the standard
library's `pydoc_data.topics` with a 1024-token byte-level BPE trained on the training 90%
of the text (`tokenizers`), showing one Keras progress bar, then prints a sample from
`generate` together with how many of its words occur in the training text (the check that
the sample reads as language, not as byte soup), and where the model, the CSV log and the
plot were written (`runs/demo/...` by default). Nothing is downloaded; running it again
resumes from or re-uses its checkpoints (`--fresh` starts over).

Why these choices (see the README's demo section for the measured figures):

- BPE tokens instead of bytes: a step sees ~4x more text, and what the model emits is
  made of the training text's own word pieces, so it reads as words much earlier.
- Width 128 and sequences of 128 tokens at batch 16: ~7x fewer FLOPs a step than
  `gpt_mini` at 32 x 128 bytes, so that enough steps fit in the few minutes `make demo`
  allows on a 2-core CPU.
- The sample is 96 new tokens after a 32-token prompt: every position it uses was trained
  (positions past `--seq-len` never are).
"""

import math
import os
import re

from training.recipes import _text
from training.recipes import gpt_text

NAME = "demo"
HELP = ("what `make demo` runs: ~2 minutes of a small GPT on the pydoc text (BPE tokens), "
        "then a sample and the share of its words found in the training text.")
DEFAULTS = dict(
    gpt_text.DEFAULTS,
    steps=600,
    batch_size=16,
    learning_rate=2e-3,
    warmup_steps=60,
    save_every=100,
    max_epoch_steps=600,
    overrides=dict(hidden_dim=128, intermediate_dim=512, num_heads=4, num_layers=4),
)
# Defaults of the text options that differ from `gpt_text`'s (set on the parser, so that
# `--help` shows them and the command line still overrides them).
OPTION_DEFAULTS = dict(tokenizer="bpe", bpe_vocab=1024, seq_len=128, sample_tokens=96,
                       prose_only=True)
# The printed sample: several prompts from the held-out text, continued in one batch, so that
# the share of known words is measured over a few hundred words rather than one sentence.
SAMPLING = dict(prompts=4, prompt_tokens=32, temperature=0.7, top_k=40, top_p=None)

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
        x, y, w = task.validation
        results = model.evaluate(x, y, sample_weight=w, batch_size=task.batch_size,
                                 verbose=0, return_dict=True)
        pairs = gpt_text.samples(model, task, cfg, **SAMPLING)
        out = {
            "val_loss": float(results["loss"]),
            "val_accuracy": float(results["accuracy"]),
            "val_nll": float(results["nll"]),
            "val_perplexity": float(math.exp(min(float(results["nll"]), 50.0))),
            "samples": [list(pair) for pair in pairs],
        }
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
    print("Where things are:")
    print(f"  model (kzoo.presets.load):  {_show(files['model'])}")
    print(f"  best model:                 {_show(files['best'])}")
    print(f"  CSV log:                    {_show(files['csv'])}")
    print(f"  loss/metric curves:         {_show(files['plot'])}")
    print(f"  metrics:                    {_show(files['metrics'])}")
    print(f"  checkpoints:                {_show(files['checkpoints'])}")
    print(f"Reload it with: kzoo.presets.load({_show(files['model'])!r})")
    return record
