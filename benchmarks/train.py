"""Training side by side: kzoo's GPT and BERT against keras-hub's of the same size.

Run once per backend:

    KERAS_BACKEND=jax .venv/bin/python -m benchmarks.train
    KERAS_BACKEND=torch .venv/bin/python -m benchmarks.train
    KERAS_BACKEND=tensorflow .venv/bin/python -m benchmarks.train

Both sides are built from random initialisation with the same sizes (keras-hub's
`GPT2Backbone` / `GPT2CausalLM` and `BertBackbone` / `BertMaskedLM` constructed directly, no
preset download; kzoo's `gpt_mini` / `bert_tiny_uncased` presets with the same overrides),
and trained with the same `model.fit` setup as `python -m training`: AdamW on a
`WarmupInverseSqrt` schedule, gradient clipping at 1.0, no label smoothing, dropout 0.1
for both, on the same batches in the same order: random windows of the pydoc text
(byte-level tokens, ids 0-255; 256-259 special). For BERT every row has the same number
of masked positions (15% of the text tokens, 80/10/10), given to kzoo as per-token sample
weights and to keras-hub as `mask_positions`, so both see the identical problem.

Reported per model: parameters, validation loss and accuracy (next-token for GPT,
masked-token for BERT) on held-out text after training, and training throughput in tokens
per second (input tokens of every step but the first, which includes compilation; the
median of per-step times, so that a stall of the shared machine does not dominate).
The `kzoo/keras-hub` line gives the ratios.
"""

import argparse
import json
import statistics
import time
import warnings

import keras
import numpy as np

import kzoo.data
import kzoo.presets
from kzoo.schedules import WarmupInverseSqrt
from training import data as D

BYTE = kzoo.data.ByteTokenizer()


def _optimizer(lr, warmup):
    return keras.optimizers.AdamW(
        learning_rate=WarmupInverseSqrt(peak_learning_rate=lr, warmup_steps=warmup),
        weight_decay=0.01, beta_1=0.9, beta_2=0.98, clipnorm=1.0)


class StepTimer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def _fixed_count_mask(windows, rng, rate=0.15):
    """BERT masking with the same number of picks per row: (inputs, positions, targets)."""
    windows = np.asarray(windows, np.int32)
    body = windows[:, : windows.shape[1] - 2]
    seq = np.concatenate([np.full((len(body), 1), BYTE.bos_id, np.int32), body,
                          np.full((len(body), 1), BYTE.eos_id, np.int32)], axis=1)
    count = max(1, int(round(rate * body.shape[1])))
    positions = np.sort(np.stack([rng.choice(np.arange(1, seq.shape[1] - 1), count,
                                             replace=False) for _ in range(len(seq))]), 1)
    targets = np.take_along_axis(seq, positions, 1)
    inputs = seq.copy()
    action = rng.random(positions.shape)
    replaced = np.where(action < 0.8, BYTE.mask_id,
                        np.where(action < 0.9, rng.integers(0, 256, positions.shape), targets))
    np.put_along_axis(inputs, positions, replaced, 1)
    return inputs, positions.astype(np.int32), targets


def _pydoc_ids():
    """Byte ids of the pydoc text: (training ids, held-out ids), the last 10% held out."""
    train_text, val_text = kzoo.data.train_val_split(kzoo.data.load_text("pydoc"), 0.1)
    return (np.asarray(BYTE.encode(train_text), np.int32),
            np.asarray(BYTE.encode(val_text), np.int32))


def gpt_data(args):
    train_ids, val_ids = _pydoc_ids()
    task = D.WindowTask(train_ids, args.seq_len + 1, args.batch_size, args.seed,
                        transform=lambda w, rng: D.causal_lm_batch(w))
    train = task.segment(0, args.steps)
    val = D.causal_lm_batch(D.tile_windows(val_ids, args.seq_len + 1, args.val_windows))
    return train, val


def bert_data(args):
    train_ids, val_ids = _pydoc_ids()
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(train_ids) - args.seq_len, args.steps * args.batch_size)
    windows = np.stack([train_ids[s:s + args.seq_len] for s in starts])
    train = _fixed_count_mask(windows, rng)
    val = _fixed_count_mask(D.tile_windows(val_ids, args.seq_len, args.val_windows),
                            np.random.default_rng(args.seed + 1))
    return train, val


def _bert_inputs(inputs, positions, targets, style):
    """The same masked batch in each side's format: (x, y, sample_weight)."""
    base = {"token_ids": inputs, "segment_ids": np.zeros_like(inputs),
            "padding_mask": np.ones_like(inputs)}
    if style == "keras_hub":
        return {**base, "mask_positions": positions}, targets, np.ones(targets.shape,
                                                                       np.float32)
    y = np.zeros_like(inputs)
    w = np.zeros(inputs.shape, np.float32)
    np.put_along_axis(y, positions, targets, 1)
    np.put_along_axis(w, positions, 1.0, 1)
    return base, y, w


def build(family, side, args):
    size = dict(num_layers=args.layers, num_heads=args.heads, hidden_dim=args.hidden,
                intermediate_dim=args.intermediate)
    keras.utils.set_random_seed(args.seed)
    if side == "kzoo":
        if family == "gpt":
            return kzoo.presets.load("gpt_mini", vocabulary_size=260, dropout=0.1,
                                     max_sequence_length=args.seq_len, **size)
        return kzoo.presets.load("bert_tiny_uncased", vocabulary_size=260, dropout=0.1,
                                 attention_dropout=0.1, max_sequence_length=args.seq_len,
                                 **size)
    import keras_hub

    if family == "gpt":
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=260, dropout=0.1,
                                                 max_sequence_length=args.seq_len, **size)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=260, dropout=0.1,
                                             max_sequence_length=args.seq_len, **size)
    return keras_hub.models.BertMaskedLM(backbone=backbone, preprocessor=None)


def run_one(family, side, data, args):
    (train, val) = data
    if family == "gpt":
        x, y, w = train
        vx, vy, vw = val
    else:
        x, y, w = _bert_inputs(*train, "keras_hub" if side == "keras_hub" else "kzoo")
        vx, vy, vw = _bert_inputs(*val, "keras_hub" if side == "keras_hub" else "kzoo")
    model = build(family, side, args)
    model.compile(optimizer=_optimizer(args.learning_rate, args.warmup),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, reduction="mean_with_sample_weight"),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    timer = StepTimer()
    start = time.perf_counter()
    model.fit(x, y, sample_weight=w, batch_size=args.batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[timer])
    wall = time.perf_counter() - start
    result = model.evaluate(vx, vy, sample_weight=vw, batch_size=args.batch_size, verbose=0,
                            return_dict=True)
    step_time = statistics.median(timer.times[1:])
    tokens = args.batch_size * args.seq_len
    return {
        "params": int(model.count_params()),
        "val_loss": float(result["loss"]),
        "val_accuracy": float(result["accuracy"]),
        "tokens_per_s": tokens / step_time,
        "first_step_s": timer.times[0],
        "wall_s": wall,
    }


def table(family, rows):
    label = {"gpt": ("GPT", "next-token"), "bert": ("BERT MLM", "masked-token")}[family]
    lines = [
        f"{label[0]} ({keras.backend.backend()}) | params | val loss | val {label[1]} acc "
        "| tokens/s | first step (s)",
        "--- | ---: | ---: | ---: | ---: | ---:",
    ]
    for side in ("kzoo", "keras_hub"):
        r = rows[side]
        lines.append(f"{side.replace('_', '-')} | {r['params']:,} | {r['val_loss']:.4f} | "
                     f"{r['val_accuracy']:.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['first_step_s']:.1f}")
    k, h = rows["kzoo"], rows["keras_hub"]
    acc_ratio = (f"{k['val_accuracy'] / h['val_accuracy']:.3f}" if h["val_accuracy"] > 0
                 else "n/a")
    lines.append(f"kzoo/keras-hub | {k['params'] / h['params']:.3f} | "
                 f"{k['val_loss'] / h['val_loss']:.3f} | {acc_ratio} | "
                 f"{k['tokens_per_s'] / h['tokens_per_s']:.2f} | "
                 f"{k['first_step_s'] / h['first_step_s']:.2f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--val-windows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default="gpt,bert")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    # Both BERTs carry a pooler that masked-LM training does not use.
    warnings.filterwarnings("ignore", message="Gradients do not exist for variables")
    for name in ("steps", "batch_size", "seq_len", "layers", "heads", "hidden",
                 "intermediate", "warmup", "val_windows"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive; got "
                         f"{getattr(args, name)}")
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (the first step is not timed); got "
                     f"{args.steps}")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in families if f not in ("gpt", "bert")]
    if bad or not families:
        parser.error(f"--families must name gpt and/or bert; got {args.families!r}")
    print(f"backend={keras.backend.backend()} steps={args.steps} batch={args.batch_size} "
          f"seq={args.seq_len} layers={args.layers} hidden={args.hidden} "
          f"heads={args.heads} ff={args.intermediate}", flush=True)
    results = {}
    for family in families:
        data = gpt_data(args) if family == "gpt" else bert_data(args)
        rows = {side: run_one(family, side, data, args) for side in ("kzoo", "keras_hub")}
        results[family] = rows
        print()
        print(table(family, rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": keras.backend.backend(), "args": vars(args),
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
