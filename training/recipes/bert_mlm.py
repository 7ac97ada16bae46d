"""`bert_mlm`: BERT masked-language modelling on real English text.

Data: the text of `gpt_text` (pydoc topics by default, 10% held out), byte-level tokens or
a BPE. Each example is `[CLS] + seq_len - 2 tokens + [SEP]`; 15% of the text tokens are
picked for prediction, of which 80% become `[MASK]`, 10% a random token and 10% stay
(Devlin et al. 2019). The masking of a training step is a function of the seed and the
step; the validation windows are masked once, with a fixed generator. The loss and the
accuracy count the picked positions only (sample weights), so `val_accuracy` is the
masked-token accuracy.
With `--documents` each example is a whole document instead (a paragraph, or a piece of
`--seq-len - 2` tokens of a longer one, between `[CLS]` and `[SEP]`), one a row padded to
`--seq-len`; with `--pack` several a row (`kzoo.data.pack`) into a backbone with
`packed_inputs=True` (each document attends to itself only, its positions restart at 0).
`metrics.json` then records the padding fraction of the training rows.
"""

import os

import keras

import kzoo.data
import kzoo.presets
from training import data as D
from training.loop import set_seed
from training.recipes import _text

# (checked by the CLI before any work: a bad value is a usage error)
check_options = _text.check_options

NAME = "bert_mlm"
HELP = "BERT masked-language modelling (15%, 80/10/10) on the same text; masked-token accuracy."
DEFAULTS = dict(
    preset="bert_tiny_uncased",
    steps=2000,
    batch_size=32,
    learning_rate=1e-3,
    warmup_steps=200,
    weight_decay=0.01,
    label_smoothing=0.0,
    save_every=100,
    overrides=dict(),
)
VALIDATION_WINDOWS = 128
MASK_RATE = 0.15


def add_arguments(parser):
    _text.add_text_arguments(parser, seq_len=128)
    _text.add_document_arguments(parser)


def document_task(cfg, tokenizer, train_docs, val_docs, seq_len):
    """Whole documents (see the module), masked anew at every step; the validation rows
    are masked once, with a fixed generator."""
    mode = _text.document_mode(cfg.options)
    packed = mode == "packed"

    def rows(docs):
        return _text.document_rows(D.bert_documents(docs, seq_len, tokenizer), seq_len, mode,
                                   tokenizer.pad_id)

    train_rows, val_rows = rows(train_docs), rows(val_docs)
    val_rows = {k: v[:VALIDATION_WINDOWS] for k, v in val_rows.items()}
    validation = D.document_masked_lm_batch(val_rows, D.step_rng(cfg.seed, 7), tokenizer,
                                            packed, MASK_RATE)
    task = D.ArrayTask(
        (train_rows, None, None), cfg.batch_size, cfg.seed, validation=validation,
        transform=lambda x, y, w, rng: D.document_masked_lm_batch(x, rng, tokenizer, packed,
                                                                  MASK_RATE))
    task.info.update(documents=mode, train_rows=int(len(train_rows["token_ids"])),
                     padding_fraction=round(kzoo.data.padding_fraction(train_rows), 4))
    return task


def build(cfg):
    set_seed(cfg.seed)
    seq_len = int(cfg.options.get("seq_len", 128))
    if _text.document_mode(cfg.options):
        tokenizer, train_docs, val_docs, info = _text.load_documents(cfg.options)
        task = document_task(cfg, tokenizer, train_docs, val_docs, seq_len)
        task.info.update(info)
        task.info["tokenizer_object"] = tokenizer
        model = kzoo.presets.load(cfg.preset, dtype=cfg.dtype,
                                  **_text.model_overrides(cfg, tokenizer, seq_len))
        return model, task
    tokenizer, train_ids, val_ids, info = _text.load_tokens(cfg.options)
    windows = D.tile_windows(val_ids, seq_len, max_windows=VALIDATION_WINDOWS)
    validation = D.masked_lm_batch(windows, D.step_rng(cfg.seed, 7), tokenizer, MASK_RATE)
    task = D.WindowTask(
        train_ids, seq_len, cfg.batch_size, cfg.seed,
        transform=lambda w, rng: D.masked_lm_batch(w, rng, tokenizer, MASK_RATE),
        validation=validation)
    task.info.update(info)
    task.info["tokenizer_object"] = tokenizer
    model = kzoo.presets.load(cfg.preset, dtype=cfg.dtype,
                              **_text.model_overrides(cfg, tokenizer, seq_len))
    return model, task


def evaluate(model, task):
    x, y, w = task.validation
    results = model.evaluate(x, y, sample_weight=w, batch_size=task.batch_size, verbose=0,
                             return_dict=True)
    return {"val_loss": float(results["loss"]),
            "val_masked_accuracy": float(results["masked_accuracy"]),
            "val_masked_tokens": int(w.sum())}


def report(model, task, metrics):
    import numpy as np

    tokenizer = task.info["tokenizer_object"]
    print(f"Validation: masked-token accuracy {metrics['val_masked_accuracy']:.4f} on "
          f"{metrics['val_masked_tokens']} masked tokens, loss {metrics['val_loss']:.4f}")
    x, y, w = task.validation
    row = {k: v[:1] for k, v in x.items()}
    predicted = np.argmax(np.asarray(model.predict(row, verbose=0))[0], -1)
    shown = [tokenizer.decode([t]) if w[0, i] == 0 else
             "[" + tokenizer.decode([predicted[i]]) + "]"
             for i, t in enumerate(y[0]) if i < 80]
    print("--- a held-out window, masked positions as [prediction] ---")
    print("".join(shown))
    print("---")


def train(cfg):
    from training.loop import run
    from training.losses import SmoothedSparseCrossentropy

    model, task = build(cfg)
    tokenizer = task.info["tokenizer_object"]
    info = {k: v for k, v in task.info.items() if k != "tokenizer_object"}
    return run(cfg, model, task,
               loss=SmoothedSparseCrossentropy(cfg.label_smoothing),
               metrics=[keras.metrics.SparseCategoricalAccuracy(name="masked_accuracy")],
               monitor="val_masked_accuracy", mode="max", evaluate=evaluate, report=report,
               extra_files=[tokenizer.save], extra_run_info={"data": info})
