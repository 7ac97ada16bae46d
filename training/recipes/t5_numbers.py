"""`t5_numbers`: T5 translates numbers written in English words into French words.

Data: `num2words` pairs for the numbers `0 .. --max-number - 1` ("one thousand, two
hundred and thirty-four" -> "mille deux cent trente-quatre"); a random `--heldout` of them
(drawn from the seed) are never trained on: half of them are the validation set (the best
model is picked on them), the other half the test set. Tokens are words, spaces and
punctuation (a vocabulary built from the training pairs only). Training is teacher forcing
(decoder inputs = targets shifted right behind T5's start token 0) with label smoothing.
Reports the exact-match accuracy of greedy `generate` on the held-out test numbers (and
on the validation numbers), and prints examples.
"""

import json
import os

import keras
import numpy as np

import kzoo.data
import kzoo.presets
from training import data as D
from training.loop import set_seed

NAME = "t5_numbers"
HELP = "T5 English -> French number words (num2words); exact match on held-out numbers."
DEFAULTS = dict(
    preset="t5_small",
    steps=3000,
    batch_size=64,
    learning_rate=2e-3,
    warmup_steps=300,
    weight_decay=0.01,
    label_smoothing=0.1,
    save_every=200,
    overrides=dict(num_layers=3, num_heads=4, hidden_dim=128, key_value_dim=32,
                   intermediate_dim=512, dropout=0.1),
)


def add_arguments(parser):
    parser.add_argument("--max-number", type=int, default=10000,
                        help="numbers 0 .. N-1 are used (default 10000)")
    parser.add_argument("--heldout", type=int, default=1000,
                        help="numbers never trained on: half validation, half test "
                             "(default 1000)")
    parser.add_argument("--target-language", default="fr",
                        help="num2words language of the targets (default fr)")


def check_options(options):
    """The recipe's options, checked before any work (`training.cli` calls it)."""
    _check(options)


def _check(options):
    max_number = options.get("max_number", 10000)
    heldout = options.get("heldout", 1000)
    if not isinstance(max_number, int) or max_number < 20:
        raise ValueError(f"--max-number must be an integer >= 20; got {max_number!r}.")
    if not isinstance(heldout, int) or not 2 <= heldout <= max_number // 2:
        raise ValueError(f"--heldout must be an integer in [2, max_number/2="
                         f"{max_number // 2}]; got {heldout!r}.")
    language = options.get("target_language", "fr")
    try:
        kzoo.data.number_words(21, language)
    except ValueError:
        raise ValueError(f"--target-language={language!r} is not a num2words language.") \
            from None
    return max_number, heldout, language


def split_numbers(max_number, heldout, seed):
    """(training numbers, held-out numbers), each sorted: a random `heldout` of
    `0 .. max_number - 1`, drawn from its own stream of the seed, is never trained on."""
    held, train = kzoo.data.random_split(
        max_number, (heldout / max_number, 1.0 - heldout / max_number),
        seed=D.step_rng(seed, 5))
    return train, held


def number_pairs(numbers, language):
    return [(kzoo.data.number_words(n, "en"), kzoo.data.number_words(n, language))
            for n in numbers]


def build(cfg):
    set_seed(cfg.seed)
    max_number, heldout, language = _check(cfg.options)
    train_numbers, held = split_numbers(max_number, heldout, cfg.seed)
    val_numbers, test_numbers = held[: heldout // 2], held[heldout // 2:]
    train_pairs = number_pairs(train_numbers, language)
    vocab = D.WordVocabulary([s for pair in train_pairs for s in pair])
    val_pairs = number_pairs(val_numbers, language)
    test_pairs = number_pairs(test_numbers, language)
    every = train_pairs + val_pairs + test_pairs
    source_length = max(len(vocab.encode(s)) for s, _ in every)
    target_length = max(len(vocab.encode(t)) for _, t in every)
    train = D.seq2seq_arrays(train_pairs, vocab, source_length, target_length)
    validation = D.seq2seq_arrays(val_pairs, vocab, source_length, target_length)
    task = D.ArrayTask(train, cfg.batch_size, cfg.seed, validation=validation)
    task.info.update({
        "vocab": vocab, "val_pairs": val_pairs, "test_pairs": test_pairs,
        "val_numbers": val_numbers, "test_numbers": test_numbers,
        "source_length": source_length, "target_length": target_length,
        "sizes": {"train": len(train_pairs), "validation": len(val_pairs),
                  "test": len(test_pairs)},
    })
    overrides = dict(cfg.overrides)
    if not os.path.isdir(cfg.preset):
        overrides.setdefault("vocabulary_size", vocab.vocabulary_size)
    model = kzoo.presets.load(cfg.preset, dtype=cfg.dtype, **overrides)
    return model, task


def translate(model, vocab, sources, source_length, max_new_tokens, batch_size=250):
    """Greedy `generate` for a list of English strings; the decoded French strings."""
    out = []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start:start + batch_size]
        ids = np.asarray([vocab.encode(s, source_length) for s in chunk], np.int32)
        generated = model.generate(ids, max_new_tokens=max_new_tokens, strategy="greedy",
                                   stop_token_ids=(vocab.eos_id,))
        out.extend(vocab.decode(row) for row in generated)  # one id list per source
    return out


def exact_match(model, task, pairs):
    vocab = task.info["vocab"]
    predictions = translate(model, vocab, [s for s, _ in pairs], task.info["source_length"],
                            task.info["target_length"])
    hits = [p == t for p, (_, t) in zip(predictions, pairs)]
    return float(np.mean(hits)), predictions


def evaluate(model, task):
    val_em, _ = exact_match(model, task, task.info["val_pairs"])
    test_em, predictions = exact_match(model, task, task.info["test_pairs"])
    examples = [{"number": int(n), "english": s, "expected": t, "predicted": p}
                for n, (s, t), p in zip(task.info["test_numbers"][:8],
                                        task.info["test_pairs"][:8], predictions[:8])]
    return {"val_exact_match": val_em, "test_exact_match": test_em,
            "test_examples": int(len(task.info["test_pairs"])), "examples": examples}


def report(model, task, metrics):
    print(f"Exact match on {metrics['test_examples']} held-out numbers (greedy generate): "
          f"{metrics['test_exact_match']:.4f} (validation numbers: "
          f"{metrics['val_exact_match']:.4f})")
    for e in metrics["examples"]:
        mark = "ok " if e["predicted"] == e["expected"] else "BAD"
        print(f"  {mark} {e['number']:>6}  {e['english']}  ->  {e['predicted']}"
              + ("" if mark == "ok " else f"   (expected {e['expected']})"))


def train(cfg):
    from training.loop import run
    from training.losses import SmoothedSparseCrossentropy

    model, task = build(cfg)
    vocab = task.info["vocab"]

    def write_vocab(directory):
        path = os.path.join(directory, "vocabulary.json")
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(vocab.to_json(), f)
        os.replace(tmp, path)

    return run(cfg, model, task,
               loss=SmoothedSparseCrossentropy(cfg.label_smoothing),
               metrics=[keras.metrics.SparseCategoricalAccuracy(name="token_accuracy")],
               monitor="val_token_accuracy", mode="max", evaluate=evaluate, report=report,
               extra_files=[write_vocab],
               extra_run_info={"data": task.info["sizes"],
                               "source_length": task.info["source_length"],
                               "target_length": task.info["target_length"]})
