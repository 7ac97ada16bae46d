"""Quantization of trained models: size on disk, peak memory, speed and quality.

For each trained model (the demo GPT and the ViT digits classifier, trained by the training
recipes into preset directories) and each mode (float32, int8, int4, float8), in a fresh
process: load the preset, `model.quantize(mode)`, save it as a preset directory (its size on
disk), time `predict_on_batch` on one validation batch (median of `--calls`), evaluate on
the recipe's own held-out data (GPT: perplexity of the validation windows; ViT: test
accuracy), and read the process' peak resident memory (`ru_maxrss`, the whole process:
framework included, so compare rows, not absolute values). Prints one table.

Run (from the repository root; trains the two models first if their directories are missing):

    KERAS_BACKEND=torch python -m benchmarks.quantize [--modes int8,int4,float8] [--calls 5]
"""

import argparse
import json
import os
import subprocess
import sys
import time

MODES = ("float32", "int8", "int4", "float8")
MODELS = {"gpt": ("demo", "runs/quantize/demo"), "vit": ("vit_digits", "runs/quantize/vit_digits")}
MARK = "QUANTIZE_RESULT "


def _directory_size(path):
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)


def _task(recipe):
    """The recipe's model-independent data, built as its training run built it."""
    from training.cli import build_parser, config_from_args
    from training.recipes import recipe_module

    cfg = config_from_args(build_parser().parse_args([recipe]))
    module = recipe_module("gpt_text" if recipe == "demo" else recipe)
    _, task = module.build(cfg)
    return task


def worker(model_name, mode, calls):
    import resource
    import statistics
    import tempfile

    import keras
    import numpy as np

    import kzoo

    recipe, out = MODELS[model_name]
    task = _task(recipe)
    model = kzoo.presets.load(os.path.join(out, "model"))
    if mode != "float32":
        model.quantize(mode)
    with tempfile.TemporaryDirectory() as tmp:
        kzoo.presets.save(model, tmp)
        size = _directory_size(tmp)
    if model_name == "gpt":
        x, y, w = task.validation
        model.compile(loss="auto")
        loss = model.evaluate(x, y, sample_weight=w, batch_size=task.batch_size, verbose=0)
        quality = {"val_perplexity": float(np.exp(loss))}
    else:
        x, y = task.test[0], task.test[1]
        logits = model.predict(x, batch_size=task.batch_size, verbose=0)
        quality = {"test_accuracy": float(np.mean(np.argmax(logits, -1) == y))}
    batch = keras.tree.map_structure(lambda a: a[:task.batch_size], x)
    model.predict_on_batch(batch)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        model.predict_on_batch(batch)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(MARK + json.dumps({"model": model_name, "mode": mode, "size": size,
                             "forward_ms": 1000 * statistics.median(times),
                             "peak_rss_mib": peak, **quality}), flush=True)


def _train_if_missing(model_name):
    recipe, out = MODELS[model_name]
    if not os.path.isdir(os.path.join(out, "model")):
        subprocess.run([sys.executable, "-m", "training", recipe, "--out", out, "--verbose", "0"],
                       check=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES[1:]))
    parser.add_argument("--models", default="gpt,vit")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(*args.worker, args.calls)
    modes = ["float32"] + [m for m in args.modes.split(",") if m and m != "float32"]
    bad = [m for m in modes if m not in MODES]
    models = [m for m in args.models.split(",") if m]
    if bad or any(m not in MODELS for m in models):
        parser.error(f"--modes takes {list(MODES[1:])}, --models {list(MODELS)}; got "
                     f"{args.modes!r}, {args.models!r}")
    rows = []
    for model_name in models:
        _train_if_missing(model_name)
        for mode in modes:
            done = subprocess.run([sys.executable, "-m", "benchmarks.quantize", "--worker",
                                   model_name, mode, "--calls", str(args.calls)],
                                  capture_output=True, text=True)
            found = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
            if done.returncode or not found:
                rows.append({"model": model_name, "mode": mode,
                             "error": done.stderr.strip().splitlines()[-1:]})
                continue
            rows.append(json.loads(found[-1][len(MARK):]))
    import keras

    print(f"backend: {keras.backend.backend()}")
    print("| model | mode | size on disk | vs float32 | peak RSS (MiB) | forward ms (batch) | "
          "quality | change |")
    print("|---|---|---|---|---|---|---|---|")
    base = {}
    for row in rows:
        if "error" in row:
            print(f"| {row['model']} | {row['mode']} | failed: {row['error']} | | | | | |")
            continue
        key = "val_perplexity" if "val_perplexity" in row else "test_accuracy"
        if row["mode"] == "float32":
            base[row["model"]] = row
        ref = base.get(row["model"], row)
        print(f"| {row['model']} | {row['mode']} | {row['size'] / 1024:,.0f} KiB | "
              f"{row['size'] / ref['size']:.2f}x | {row['peak_rss_mib']:,.0f} | "
              f"{row['forward_ms']:.1f} | {key} {row[key]:.4f} | {row[key] - ref[key]:+.4f} |")


if __name__ == "__main__":
    main()
