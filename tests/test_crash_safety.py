"""Crash safety of training, measured: SIGKILL a run many times, resume it each time.

`python -m training vit_digits` (a tiny ViT, dropout on, so the generator state matters too)
is started in a subprocess and killed with SIGKILL, then started again with the same command,
over and over, until it finishes. Kills land at random moments (a seeded random delay once
the run has made progress, anywhere in the step / validation / save cycle) and, every other
round, in the middle of a checkpoint write: the test hook `KZOO_CHECKPOINT_WRITE_DELAY`
(see `training.checkpoint`) pauses each save half-way through its temporary file, and the
test kills the process while that half-written file is on disk.

After every kill:
- every well-named checkpoint (`ckpt-<step>.npz`) on disk reads back whole, with the step
  its name says (saves are atomic: a temporary name, fsync, `os.replace`);
- once the first checkpoint has been written, at least one is always there;
- a kill inside a write leaves that write's temporary file behind, unread.

At the end, the resumed run's metrics, best value, CSV log, final weights and best weights
equal those of an uninterrupted run (in this process) exactly.

The default suite kills 4 times (about 30 s per backend on an idle 2-core CPU); the `slow`
variant kills 16 times.
"""

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import kzoo.presets
from training import checkpoint
from training.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 48
ARGS = ["vit_digits", "--steps", str(STEPS), "--max-epoch-steps", "12", "--save-every", "3",
        "--batch-size", "16", "--verbose", "0",
        "--override", "num_layers=1", "--override", "hidden_dim=16",
        "--override", "intermediate_dim=32", "--override", "num_heads=2",
        "--override", "dropout=0.2"]
WRITE_DELAY_S = "0.6"
TIMEOUT_S = 300


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def _weights(directory):
    return [np.asarray(w) for w in kzoo.presets.load(directory).get_weights()]


def _temporary_files(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return []
    return [n for n in os.listdir(ckpt_dir) if n.startswith(".ckpt-") and ".tmp-" in n]


def _check_checkpoints(ckpt_dir):
    """Every well-named checkpoint loads whole; return the newest step (or None)."""
    found = checkpoint.list_checkpoints(ckpt_dir)
    for step, path in found:
        meta, arrays = checkpoint.read(path)  # raises on a damaged file
        assert meta["step"] == step, path
        assert len([k for k in arrays if k.startswith("model/")]) == meta["num_model_variables"]
    return found[0][0] if found else None


def _env(write_delay):
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop(checkpoint.WRITE_DELAY_ENV, None)
    if write_delay:
        env[checkpoint.WRITE_DELAY_ENV] = WRITE_DELAY_S
    return env


def _kill_round(command, ckpt_dir, rng, in_write, last_step):
    """Start the run and kill it: inside a checkpoint write that ends past `last_step`, or
    at a random moment once a checkpoint past `last_step` exists. Return `(newest
    checkpoint step after the kill or None, finished before the kill, killed in a write)`."""
    stale = set(_temporary_files(ckpt_dir))
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(in_write), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + TIMEOUT_S
    killed_in_write = False
    try:
        while time.time() < deadline and proc.poll() is None:
            newest = checkpoint.list_checkpoints(ckpt_dir)
            newest = newest[0][0] if newest else 0
            if in_write:
                if set(_temporary_files(ckpt_dir)) - stale and newest >= last_step:
                    killed_in_write = True
                    break
            elif newest > last_step:
                time.sleep(rng.uniform(0.0, 0.4))
                break
            time.sleep(0.01)
        if proc.poll() is not None:  # it finished before the kill: the run is over
            assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]
            return _check_checkpoints(ckpt_dir), True, False
        assert time.time() < deadline, "the run made no progress"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    if killed_in_write:
        assert set(_temporary_files(ckpt_dir)) - stale, "the kill left no half-written file"
    return _check_checkpoints(ckpt_dir), False, killed_in_write


def _kill_and_resume_many_times(tmp_path, kills, seed):
    reference = str(tmp_path / "reference")
    assert main(ARGS + ["--out", reference]) == 0

    out = str(tmp_path / "killed")
    ckpt_dir = os.path.join(out, "checkpoints")
    command = [sys.executable, "-m", "training"] + ARGS + ["--out", out]
    rng = random.Random(seed)
    last_step, finished, writes_hit = 0, False, 0
    for round_index in range(kills):
        newest, finished, in_write = _kill_round(command, ckpt_dir, rng,
                                                 round_index % 2 == 0, last_step)
        if last_step:  # once there was a checkpoint, a loadable one always remains
            assert newest is not None and newest >= last_step, (newest, last_step)
        last_step = newest or 0
        writes_hit += in_write
        if finished:
            break
    assert writes_hit >= 1, "no kill landed inside a checkpoint write"

    if not finished:
        done = subprocess.run(command, cwd=ROOT, env=_env(False), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    resumed, expected = _metrics(out), _metrics(reference)
    assert resumed["run"]["resumed_from_step"] is not None
    assert resumed["metrics"] == expected["metrics"]
    assert resumed["best"] == expected["best"]
    assert _read_csv(os.path.join(out, "log.csv")) == _read_csv(
        os.path.join(reference, "log.csv"))
    for name in ("model", "best"):
        got, want = _weights(os.path.join(out, name)), _weights(os.path.join(reference, name))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    # The temporary files of killed saves are never read and never block a resume.
    assert _check_checkpoints(ckpt_dir) == STEPS


@pytest.mark.spread
def test_killed_many_times_at_random_and_inside_writes_ends_like_an_uninterrupted_run(
        tmp_path):
    _kill_and_resume_many_times(tmp_path, kills=4, seed=0)


@pytest.mark.slow
def test_killed_sixteen_times_ends_like_an_uninterrupted_run(tmp_path):
    _kill_and_resume_many_times(tmp_path, kills=16, seed=1)


def test_write_delay_hook_pauses_inside_the_write_and_the_file_stays_whole(tmp_path,
                                                                         monkeypatch):
    """The hook the kills rely on: a save with the delay takes at least the delay, and
    produces the same checkpoint as one without."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), epochs=1, verbose=0)
    plain = checkpoint.save(tmp_path / "plain", model, {"step": 1})
    monkeypatch.setenv(checkpoint.WRITE_DELAY_ENV, "0.3")
    started = time.time()
    slow = checkpoint.save(tmp_path / "slow", model, {"step": 1})
    assert time.time() - started >= 0.3
    (meta_a, arrays_a), (meta_b, arrays_b) = checkpoint.read(plain), checkpoint.read(slow)
    assert meta_a == meta_b and arrays_a.keys() == arrays_b.keys()
    for key in arrays_a:
        np.testing.assert_array_equal(arrays_a[key], arrays_b[key])
    monkeypatch.setenv(checkpoint.WRITE_DELAY_ENV, "soon")
    with pytest.raises(ValueError, match="KZOO_CHECKPOINT_WRITE_DELAY"):
        checkpoint.save(tmp_path / "bad", model, {"step": 1})
