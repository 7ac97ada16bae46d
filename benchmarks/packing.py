"""Sequence packing on the demo text: padding fraction and training throughput.

`python -m benchmarks.packing [--steps N] [--tokenizer bpe|byte] [--seq-len 128]` lays the
pydoc prose (the `demo` recipe's text, split into its paragraphs) out three ways for GPT and
two for BERT, with the recipes' own functions (`training.recipes._text`, `training.data`):

- windows: random windows of the token stream (the recipes' default; no padding, but
  examples cross document boundaries), GPT only;
- padded: one document a row, padded to `--seq-len` (`--documents`);
- packed: several documents a row (`kzoo.data.pack`, `--pack`) into a model with
  `packed_inputs=True`.

For each it prints the rows of the training set, the padding fraction, the real (non-padding)
tokens a step and, from timed `train_on_batch` steps, the real tokens a second and the steps
a second of wall time, and the CPU time a step and the real tokens a CPU second (`--rounds`
rounds of `--steps` steps after two warm-up steps, the layouts interleaved; the fastest
round counts, wall and CPU separately). Models: the `demo` recipe's GPT (`gpt_mini` narrowed
to 4 blocks of width 128) and `bert_tiny_uncased` (2 blocks of width 128), both resized to
the tokenizer. Time goes to whichever backend `KERAS_BACKEND` names.
"""

import argparse
import time

import keras
import numpy as np

import kzoo.data
import kzoo.presets
from kzoo.losses import TokenCrossentropy
from training import data as D
from training.recipes import _text

GPT_OVERRIDES = dict(hidden_dim=128, intermediate_dim=512, num_heads=4, num_layers=4)



def _time_steps(model, batches, steps):
    """(wall, CPU) seconds per step over `steps` train_on_batch calls (after the warm-up);
    the CPU time is this process's, all its threads (what carries over from a loaded
    machine)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        x, y, w = batches[i % len(batches)]
        model.train_on_batch(x, y, sample_weight=w)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def _compiled(model):
    model.compile(keras.optimizers.AdamW(1e-3), TokenCrossentropy("mean_with_sample_weight"))
    return model


def cases(options, batch_size, seq_len, batches=12):
    """[(model name, layout, model, batches, rows, padding fraction)] of the demo text."""
    tokenizer, train_docs, _, info = _text.load_documents(options)
    print(f"text: {info['train_documents']} training documents, {info['train_tokens']} "
          f"tokens ({info['tokenizer']}, vocabulary {info['vocabulary_size']}), "
          f"seq_len {seq_len}, batch {batch_size}, backend {keras.backend.backend()}")
    out = []

    # === GPT ===
    stream = np.concatenate(train_docs)
    gpt_docs = [np.concatenate([d, [tokenizer.eos_id]]).astype(np.int32) for d in train_docs]
    for name in ("windows", "padded", "packed"):
        if name == "windows":
            task = D.WindowTask(stream, seq_len + 1, batch_size, 0,
                                transform=lambda w, rng: D.causal_lm_batch(w))
            rows, padding = len(stream) // seq_len, 0.0
        else:
            laid_out = _text.document_rows(gpt_docs, seq_len, name, tokenizer.pad_id)
            task = D.ArrayTask(D.document_lm_batch(laid_out, name == "packed"), batch_size, 0)
            rows, padding = len(laid_out["token_ids"]), kzoo.data.padding_fraction(laid_out)
        model = kzoo.presets.load("gpt_mini", vocabulary_size=tokenizer.vocabulary_size,
                                  max_sequence_length=seq_len,
                                  packed_inputs=name == "packed", **GPT_OVERRIDES)
        out.append(("GPT", name, _compiled(model), [task.train_batch(s) for s in range(batches)],
                    rows, padding))

    # === BERT ===
    examples = D.bert_documents(train_docs, seq_len, tokenizer)
    for name in ("padded", "packed"):
        packed = name == "packed"
        laid_out = _text.document_rows(examples, seq_len, name, tokenizer.pad_id)
        task = D.ArrayTask((laid_out, None, None), batch_size, 0,
                           transform=lambda x, y, w, rng, p=packed: D.document_masked_lm_batch(
                               x, rng, tokenizer, p))
        model = kzoo.presets.load("bert_tiny_uncased", vocabulary_size=tokenizer.vocabulary_size,
                                  max_sequence_length=seq_len, packed_inputs=packed)
        out.append(("BERT", name, _compiled(model), [task.train_batch(s) for s in range(batches)],
                    len(laid_out["token_ids"]), kzoo.data.padding_fraction(laid_out)))
    return out


def run(options, steps, batch_size, seq_len, rounds=3):
    """Time every case `rounds` times, the cases interleaved (a shared machine's load
    then weighs on all of them alike); report each one's fastest round."""
    found = cases(options, batch_size, seq_len)
    for _, _, model, batches, _, _ in found:  # compile + warm up
        for x, y, w in batches[:2]:
            model.train_on_batch(x, y, sample_weight=w)
    wall = [float("inf")] * len(found)
    cpu = [float("inf")] * len(found)
    for _ in range(rounds):
        for i, (_, _, model, batches, _, _) in enumerate(found):
            seconds = _time_steps(model, batches, steps)
            wall[i], cpu[i] = min(wall[i], seconds[0]), min(cpu[i], seconds[1])
    print("| model | layout | rows | padding | real tokens/step | real tokens/s (wall) | "
          "steps/s (wall) | CPU ms/step | real tokens/CPU-s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for (family, name, _, batches, rows, padding), w, c in zip(found, wall, cpu):
        real = np.mean([np.asarray(x["padding_mask"]).sum() for x, _, _ in batches])
        results.append((family, name, rows, padding, real, real / w, 1 / w, c, real / c))
        print(f"| {family} | {name} | {rows} | {padding:.1%} | {real:.0f} | "
              f"{real / w:,.0f} | {1 / w:.2f} | {1000 * c:.0f} | {real / c:,.0f} |")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    parser.add_argument("--prose-only", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    options = {"text": "pydoc", "tokenizer": args.tokenizer, "bpe_vocab": 1024,
               "prose_only": args.prose_only, "seq_len": args.seq_len}
    run(options, args.steps, args.batch_size, args.seq_len, args.rounds)


if __name__ == "__main__":
    main()
