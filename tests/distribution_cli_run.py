"""Run by tests/test_distribution_cli.py in a subprocess: `python -m training` in every
distributed mode of the backend (KERAS_BACKEND), against one device.

`python tests/distribution_cli_run.py OUT [--errors] recipe[:mode,...] ...` prints one JSON
object. For each recipe (tiny models of `ARGS`, dropout 0, `--max-epoch-steps 1`: one log.csv
row a step), in the modes named after its colon (default: every mode of the backend):

- `single`: 3 steps on one device;
- each mode of the backend (JAX: `data` = `--data-parallel 4`, `model` = `--data-parallel 2
  --model-parallel 2`; TensorFlow: `mirrored` = `--strategy mirrored`; torch: `ddp` =
  `torchrun --nproc_per_node 2`, gloo on 127.0.0.1): 2 steps at the same global batch,
  checkpointing every step, then the same command on ONE device with `--steps 3`, which
  resumes from the mode's step-2 checkpoint;
- `checkpoint_equals_model`: the mode's last checkpoint loaded into a one-device model
  gives exactly the outputs of the model the mode's run saved.

With `--errors`, it first runs the bad settings of `ERRORS` (a mesh that does not cover the
devices or does not divide the heads or the experts, a batch that does not split) and
records the exit status, the message and whether anything was written.

JAX and TensorFlow get virtual CPU devices (`--cpu-devices`: 4 JAX, 2 TensorFlow) in this
process, before the backend starts: hence a process of its own.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import csv  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

STEPS = 3  # the one-device run; a mode runs STEPS - 1 and one device resumes it

_TINY = ["--override", "num_layers=1", "--override", "hidden_dim=16",
         "--override", "intermediate_dim=32", "--override", "num_heads=2"]
_TEXT = ["--seq-len", "16", "--max-chars", "4000"]
ARGS = {
    "gpt_text": _TINY + _TEXT + ["--override", "dropout=0.0", "--sample-tokens", "4",
                                 "--batch-size", "8"],
    "bert_mlm": _TINY + _TEXT + ["--override", "dropout=0.0", "--override",
                                 "attention_dropout=0.0", "--batch-size", "8"],
    "t5_numbers": _TINY + ["--override", "num_decoder_layers=1",  # t5_small names its 6
                           "--override", "key_value_dim=8", "--override", "dropout=0.0",
                           "--max-number", "100", "--heldout", "4", "--batch-size", "8"],
    "vit_digits": _TINY + ["--override", "dropout=0.0", "--batch-size", "16"],
    "graphormer_freesolv": _TINY + ["--override", "dropout=0.0", "--override",
                                    "attention_dropout=0.0", "--override",
                                    "activation_dropout=0.0", "--max-molecules", "60",
                                    "--batch-size", "8"],
}
COMMON = ["--max-epoch-steps", "1", "--save-every", "1", "--warmup-steps", "2",
          "--verbose", "0", "--seed", "0"]
CPU_DEVICES = {"jax": 4, "tensorflow": 2}
MODES = {
    "jax": {"data": ["--data-parallel", "4"],
            "model": ["--data-parallel", "2", "--model-parallel", "2"]},
    "tensorflow": {"mirrored": ["--strategy", "mirrored"]},
    "torch": {"ddp": None},  # torchrun
}
TORCH_PROCESSES = 2


def log_rows(out):
    with open(os.path.join(out, "log.csv")) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def argv(recipe, out, steps, extra=()):
    import keras

    # TensorFlow mirrored clips each replica's gradients (Keras 3.15): no clipping there,
    # and the same on its one-device reference (the fingerprint includes it).
    clip = ["--clipnorm", "0"] if keras.backend.backend() == "tensorflow" else []
    return [recipe, "--steps", str(steps), "--out", out, *COMMON, *ARGS[recipe], *clip,
            *extra]


def run_here(args):
    """`python -m training ARGS` in this process; (exit status, seconds)."""
    from training.cli import main

    start = time.perf_counter()
    status = main(args)
    return status, time.perf_counter() - start


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args):
    """`torchrun --nproc_per_node 2 -m training ARGS` (gloo, 127.0.0.1)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="torch",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
         str(TORCH_PROCESSES), "--master_addr", "127.0.0.1", "--master_port",
         str(free_port()), "-m", "training", *args],
        cwd=root, env=env, capture_output=True, timeout=600)
    if done.returncode:
        sys.stderr.write(done.stderr.decode()[-6000:])
    return done.returncode, time.perf_counter() - start


def checkpoint_equals_model(out, args):
    """Whether the newest checkpoint of `out`, loaded into a one-device model, gives exactly
    the outputs of the model the run saved in `out/model`, on 4 validation examples of the
    recipe (and the largest difference)."""
    import keras

    import kzoo.presets
    from training import checkpoint
    from training.cli import build_parser, config_from_args
    from training.recipes import recipe_module

    parsed = build_parser().parse_args(args)
    cfg = config_from_args(parsed)
    module = recipe_module(parsed.recipe)
    task = module.build(cfg)[1]
    x = keras.tree.map_structure(lambda a: a[:4], task.validation[0])
    saved = kzoo.presets.load(os.path.join(out, "model"))
    fresh = kzoo.presets.load(os.path.join(out, "model"))
    step, path = checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))[0]
    meta, arrays = checkpoint.read(path)
    assert meta["num_model_variables"] == len(fresh.variables)
    for i, v in enumerate(fresh.variables):
        v.assign(arrays[f"model/{i}"].astype(v.dtype))
    a = np.asarray(keras.ops.convert_to_numpy(saved(x)))
    b = np.asarray(keras.ops.convert_to_numpy(fresh(x)))
    return {"step": step, "equal": bool(np.array_equal(a, b)), "finite": bool(
        np.isfinite(a).all()), "max_abs_diff": float(np.max(np.abs(a - b)))}


# Bad settings that only this process can try (it has the virtual devices): argv -> the
# error `python -m training` must print, before anything is compiled.
ERRORS = {
    "jax": {
        "devices": ["--data-parallel", "3"],
        "heads": ["--model-parallel", "4", "--override", "num_heads=2"],
        "experts": ["--model-parallel", "4", "--override", "num_heads=4", "--override",
                    "feedforward=\"moe\"", "--override", "num_experts=2"],
        "batch": ["--data-parallel", "4", "--batch-size", "6"],
    },
    "tensorflow": {"batch": ["--strategy", "mirrored", "--batch-size", "7"],
                   "clipnorm": ["--strategy", "mirrored", "--clipnorm", "1"]},
    "torch": {},
}


def errors(out_root, devices):
    """{name: (exit status, stderr, files written)} of the `ERRORS` of this backend."""
    import contextlib
    import io

    import keras

    found = {}
    for name, flags in ERRORS[keras.backend.backend()].items():
        out = os.path.join(out_root, "errors", name)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            status, seconds = run_here(argv("gpt_text", out, STEPS, devices + flags))
        written = sorted(os.listdir(os.path.join(out, "checkpoints"))) if os.path.isdir(
            os.path.join(out, "checkpoints")) else []
        found[name] = {"status": status, "stderr": stderr.getvalue()[-2000:],
                       "checkpoints": written, "seconds": seconds}
    return found


def main():
    import keras

    args = sys.argv[1:]
    with_errors = "--errors" in args
    out_root, *recipes = [a for a in args if a != "--errors"]
    backend = keras.backend.backend()
    devices = ["--cpu-devices", str(CPU_DEVICES[backend])] if backend in CPU_DEVICES else []
    result = {"backend": backend, "recipes": {}}
    if with_errors:
        result["errors"] = errors(out_root, devices)
    for item in recipes:
        recipe, _, names = item.partition(":")
        modes = names.split(",") if names else list(MODES[backend])
        unknown = [m for m in modes if m not in MODES[backend]]
        assert not unknown, f"modes {unknown} are not {backend}'s: {list(MODES[backend])}"
        found = result["recipes"][recipe] = {}
        out = os.path.join(out_root, recipe, "single")
        status, seconds = run_here(argv(recipe, out, STEPS, devices))
        assert status == 0, (recipe, "single", status)
        found["single"] = {"log": log_rows(out), "seconds": seconds,
                           "distribution": metrics(out)["run"]["distribution"]}
        for mode in modes:
            flags = MODES[backend][mode]
            out = os.path.join(out_root, recipe, mode)
            args = argv(recipe, out, STEPS - 1, devices + (flags or []))
            status, seconds = run_torchrun(args) if flags is None else run_here(args)
            assert status == 0, (recipe, mode, status)
            entry = found[mode] = {"log": log_rows(out), "seconds": seconds,
                                   "distribution": metrics(out)["run"]["distribution"],
                                   "checkpoint": checkpoint_equals_model(out, args)}
            status, _ = run_here(argv(recipe, out, STEPS, devices))  # one device resumes
            assert status == 0, (recipe, mode, "resume", status)
            entry["resumed"] = {"log": log_rows(out),
                                "from_step": metrics(out)["run"]["resumed_from_step"],
                                "distribution": metrics(out)["run"]["distribution"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
