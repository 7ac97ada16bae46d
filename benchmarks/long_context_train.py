"""Validation loss of `gpt_text` trained the same way with full, sliding-window and linear
attention, side by side (issue #16's quality check of the efficient variants).

Run:   KERAS_BACKEND=torch python -m benchmarks.long_context_train
       python -m benchmarks.long_context_train --steps 300 --seq-len 256 --window 32

Each variant is one run of the `gpt_text` recipe (`python -m training gpt_text`) in its own
process, from the same seed, preset, data, schedule and step count; only the attention type
differs (`--override attention=... --override window=...`). The table gives the held-out
validation loss, perplexity and next-token accuracy from each run's `metrics.json`, the wall
time of the run, and the loss gap to full attention. Training time here is not the point (at
256 tokens full attention is cheap; see `benchmarks.long_context` for time and memory
against the length): the table says how much model quality each approximation costs.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "full": [],
    "sliding_window": ["attention=sliding_window", "window={window}"],
    "linear (elu)": ["attention=linear"],
    "performer": ["attention=performer", "num_features={features}"],
}


def command(variant, out, args):
    """The `python -m training gpt_text` command line of one variant."""
    cmd = [sys.executable, "-m", "training", "gpt_text", "--preset", args.preset,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--seed", str(args.seed), "--out", out,
           "--fresh", "--verbose", "0", "--sample-tokens", "1"]
    for item in VARIANTS[variant]:
        cmd += ["--override", item.format(window=args.window, features=args.features)]
    return cmd


def read_metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)["metrics"]
    loss = metrics.get("val_loss", metrics.get("loss"))
    return {"val_loss": loss, "perplexity": metrics.get("val_perplexity", math.exp(loss)),
            "accuracy": metrics.get("val_accuracy")}


def table(rows, args):
    """Markdown table: one row per variant, with the loss gap to full attention."""
    full = next((r["val_loss"] for r in rows if r["variant"] == "full"), None)
    lines = [
        f"gpt_text, preset {args.preset}, {args.steps} steps, batch {args.batch_size} x "
        f"{args.seq_len} tokens, seed {args.seed}, backend {os.environ.get('KERAS_BACKEND')}",
        "",
        "| attention | val loss | perplexity | accuracy | loss - full | run time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "" if full is None else f"{r['val_loss'] - full:+.4f}"
        acc = "—" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        lines.append(f"| {r['variant']} | {r['val_loss']:.4f} | {r['perplexity']:.2f} | {acc} "
                     f"| {gap} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt_mini")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--out", default=None, help="keep the runs here (default: temp)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    root = args.out or tempfile.mkdtemp(prefix="kzoo_long_train_")
    rows = []
    for variant in chosen:
        out = os.path.join(root, variant.split()[0])
        start = time.perf_counter()
        print(f"... {variant}: {' '.join(command(variant, out, args)[1:])}", flush=True)
        subprocess.run(command(variant, out, args), check=True)
        rows.append({"variant": variant, "seconds": time.perf_counter() - start,
                     **read_metrics(out)})
    print(table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
