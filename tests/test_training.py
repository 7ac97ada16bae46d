"""Tests of the training entry points (`python -m training ...`), run once per backend.

Every recipe trains a tiny model for a few steps and must leave its outputs behind; a run
killed with SIGKILL and restarted must end exactly where an uninterrupted run ends; a
damaged or half-written checkpoint must be skipped; a NaN loss must stop the run with a
clear error and save nothing.
"""

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest

import kzoo.presets
from training import checkpoint
from training import callbacks as cb
from training import data as D
from training.cli import build_parser, main
from training.losses import SmoothedSparseCrossentropy
from training.recipes import RECIPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_VIT = ["--override", "num_layers=1", "--override", "hidden_dim=16",
            "--override", "intermediate_dim=32", "--override", "num_heads=2"]
TINY_GPT = ["--override", "num_layers=1", "--override", "hidden_dim=16",
            "--override", "intermediate_dim=32", "--override", "num_heads=2",
            "--seq-len", "16", "--max-chars", "20000", "--sample-tokens", "8"]
TINY_BERT = ["--override", "num_layers=1", "--override", "hidden_dim=16",
             "--override", "intermediate_dim=32", "--override", "num_heads=2",
             "--seq-len", "16", "--max-chars", "20000"]
# num_decoder_layers too: the recipe's preset (t5_small) names its 6 decoder layers itself,
# so `num_layers=1` alone left them, and the recipe test took 21.8 s on JAX and 31.2 s on
# TensorFlow instead of 10.7 s each.
TINY_T5 = ["--override", "num_layers=1", "--override", "num_decoder_layers=1",
           "--override", "hidden_dim=16",
           "--override", "key_value_dim=8", "--override", "intermediate_dim=32",
           "--override", "num_heads=2", "--max-number", "100", "--heldout", "4"]
TINY_GRAPHORMER = ["--override", "num_layers=1", "--override", "hidden_dim=16",
                   "--override", "intermediate_dim=32", "--override", "num_heads=2",
                   "--max-molecules", "60"]

RECIPE_ARGS = {
    "vit_digits": TINY_VIT + ["--batch-size", "16"],
    "gpt_text": TINY_GPT + ["--batch-size", "4"],
    "demo": TINY_GPT + ["--batch-size", "4"],
    "bert_mlm": TINY_BERT + ["--batch-size", "4"],
    "t5_numbers": TINY_T5 + ["--batch-size", "8"],
    "graphormer_freesolv": TINY_GRAPHORMER + ["--batch-size", "8"],
}
FINAL_METRIC = {
    "vit_digits": "test_accuracy",
    "gpt_text": "val_perplexity",
    "demo": "val_perplexity",
    "bert_mlm": "val_masked_accuracy",
    "t5_numbers": "test_exact_match",
    "graphormer_freesolv": "test_rmse_kcal",
}


def _family_available(recipe):
    from training.recipes import recipe_module

    name = recipe_module(recipe).DEFAULTS["preset"]
    return name in kzoo.presets.list()


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


# === CLI ===


def test_help_lists_every_recipe():
    text = build_parser().format_help()
    for name in RECIPES:
        assert name in text


def test_recipe_help_prints_percent_signs_once():
    # A recipe's docstring is its --help description, printed as written ("the last 10%").
    subparsers = next(a for a in build_parser()._actions
                      if isinstance(a, argparse._SubParsersAction))
    for name in RECIPES:
        text = subparsers.choices[name].format_help()
        assert "%%" not in text, name
    assert "10% is held out" in subparsers.choices["gpt_text"].format_help()


@pytest.mark.parametrize("argv, needle", [
    (["nope"], "'nope'"),
    (["vit_digits", "--steps", "-3"], "'-3'"),
    (["vit_digits", "--steps", "2", "--epochs", "2"], "not allowed with"),
    (["vit_digits", "--preset", "vit_tiny_patch61"], "vit_tiny_patch61"),
    (["gpt_text", "--tokenizer", "wordpiece"], "'wordpiece'"),
    (["graphormer_freesolv", "--seeds", "0,x"], "'0,x'"),
    (["vit_digits", "--override", "num_layers"], "KEY=VALUE"),
    # (an empty --out trained into runs/<recipe>, the default, without a word)
    (["vit_digits", "--steps", "1", "--verbose", "0", "--out", ""] + TINY_VIT,
     "--out must be a directory path; got ''"),
])
def test_bad_arguments_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["gpt_text", "--preset", "bert_tiny_uncased"], "is a bert model; the recipe 'gpt_text'"),
    (["gpt_text", "--override", "num_layers=abc"], "`num_layers` must be a positive integer"),
    (["gpt_text", "--override", "foo=1"], "Unknown override foo=1"),
    (["vit_digits", "--override", "num_heads=5"], "`num_heads` must divide"),
    (["gpt_text", "--seq-len", "16", "--override", "max_sequence_length=8"],
     "--seq-len 16 is longer than the model's max_sequence_length=8"),
    (["bert_mlm", "--seq-len", "600"], "--seq-len 600 is longer than the model's "
                                       "max_sequence_length=512"),
    (["gpt_text", "--seq-len", "0"], "--seq-len must be an integer >= 2; got 0"),
    (["gpt_text", "--max-chars", "5"], "--max-chars must be at least 1000; got 5"),
    (["bert_mlm", "--tokenizer", "bpe", "--bpe-vocab", "5"],
     "--bpe-vocab must be an integer >= 260; got 5"),
    # (these three were ValueError tracebacks, exit 1, once the recipe had started)
    (["graphormer_freesolv", "--max-molecules", "0"],
     "--max-molecules must be an integer >= 20; got 0"),
    (["t5_numbers", "--max-number", "-4"], "--max-number must be an integer >= 20; got -4"),
    (["t5_numbers", "--max-number", "100", "--heldout", "100"],
     "--heldout must be an integer in [2, max_number/2=50]; got 100"),
])
def test_bad_presets_and_overrides_are_named_before_any_work(argv, needle, tmp_path, capsys):
    """A preset of another family, an unknown override or a bad value, a recipe option
    out of range, a --seq-len the positions cannot hold: exit 2 with one line naming it,
    before data, tokenizer or model are made (nothing written). The recipe options and
    --seq-len were tracebacks (exit 1), the latter once training had started."""
    out = str(tmp_path / "run")
    assert main(argv + ["--out", out]) == 2
    assert needle in capsys.readouterr().err
    assert not os.path.exists(out)


@pytest.mark.parametrize("overrides, expected", [
    (["attention=sliding_window", "window=32"], ("sliding_window", {"window": 32})),
    (["attention=performer", "num_features=12"], ("performer", {"num_features": 12})),
    (["attention=longformer", "window=4", "global_tokens=1"],
     ("longformer", {"window": 4, "global_tokens": 1})),
])
def test_attention_options_by_name_are_overrides(overrides, expected):
    """`--override window=32` names an attention option as `kzoo.presets.load(...,
    window=32)` does (the README's form; `benchmarks.long_context_train` passes it): the
    check before any work refused it as an unknown override (exit 2), so no run with an
    efficient attention's options could start. The options reach the model's config."""
    from training.cli import check_model_arguments, config_from_args, recipe_module

    argv = ["gpt_text"] + [a for o in overrides for a in ("--override", o)]
    cfg = config_from_args(build_parser().parse_args(argv))
    check_model_arguments(recipe_module("gpt_text"), cfg)
    config = kzoo.presets.load("gpt_mini", num_layers=1, **cfg.overrides).backbone.config
    assert config.attention == expected[0]
    assert {k: config.attention_options[k] for k in expected[1]} == expected[1]


def test_a_bad_attention_option_is_named_before_any_work(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = ["gpt_text", "--override", "attention=sliding_window", "--override", "window=0"]
    assert main(argv + ["--out", out]) == 2
    assert "`window` must be a positive integer; got window=0" in capsys.readouterr().err
    assert not os.path.exists(out)


@pytest.mark.parametrize("flag, needle", [
    (["--batch-size", "100000"], "--batch-size=100000 is larger than the training set"),
    (["--lora-rank", "1000"], "--lora-rank 1000"),
])
def test_flags_too_large_for_the_data_or_model_are_usage_errors(flag, needle, tmp_path,
                                                                capsys):
    """Values that only the loaded data or model can refuse: exit 2 and one line naming
    the flag, as for the parser's refusals (they were tracebacks, exit 1)."""
    out = str(tmp_path / "run")
    argv = ["vit_digits", "--steps", "1", "--out", out, "--verbose", "0"] + TINY_VIT
    assert main(argv + flag) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert checkpoint.list_checkpoints(os.path.join(out, "checkpoints")) == []


def test_an_out_that_is_a_file_is_named(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    assert main(["gpt_text", "--steps", "1", "--out", str(taken)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert taken.read_text() == "keep me"


# === Building blocks ===


def test_label_smoothing_loss_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype("float32")
    labels = rng.integers(0, 5, size=(2, 3))
    weights = np.array([[1, 1, 0], [1, 0, 0]], "float32")
    eps = 0.1
    z = logits - logits.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    target = np.full((2, 3, 5), eps / 5)
    target[np.arange(2)[:, None], np.arange(3)[None], labels] += 1 - eps
    per_token = -(target * log_p).sum(-1)
    expected = (per_token * weights).sum() / weights.sum()
    loss = SmoothedSparseCrossentropy(eps)(labels, logits, sample_weight=weights)
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(loss)), expected, rtol=1e-5)


def test_label_smoothing_loss_takes_targets_with_a_trailing_axis():
    """`(..., 1)` integer targets (as Keras' `SparseCategoricalCrossentropy` takes them, e.g.
    a `(batch, 1)` label column) give the loss of the same targets without the axis, here a
    NumPy formula; the rank-mismatch error of `take_along_axis` it raised said nothing of
    the loss."""
    rng = np.random.default_rng(1)
    eps = 0.2
    for shape in ((4,), (2, 3)):
        logits = rng.normal(size=shape + (6,)).astype("float32")
        labels = rng.integers(0, 6, size=shape)
        z = logits - logits.max(-1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
        expected = ((1 - eps) * nll - eps * log_p.mean(-1)).mean()
        loss = SmoothedSparseCrossentropy(eps)(labels[..., None], logits)
        np.testing.assert_allclose(float(keras.ops.convert_to_numpy(loss)), expected,
                                   rtol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_label_smoothing_loss_ignores_minus_100_as_torch(eps):
    """Targets of -100 (Hugging Face's labels for tokens without a loss) count for nothing,
    as `torch.nn.functional.cross_entropy(ignore_index=-100, label_smoothing=eps)`: the same
    loss and gradient with and without sample weights, and an all-ignored batch gives 0
    with a zero, finite gradient. (On JAX their loss was NaN even under a zero sample
    weight; TensorFlow raised.)"""
    import torch
    import torch.nn.functional as F

    from tests.helpers import value_and_grads

    rng = np.random.default_rng(2)
    logits = (3 * rng.normal(size=(3, 4, 7))).astype("float32")
    labels = rng.integers(0, 7, size=(3, 4))
    labels[0, 1] = labels[2, 0] = labels[2, 3] = -100
    weights = rng.uniform(0.5, 2.0, size=(3, 4)).astype("float32")

    def reference(labels, weights=None):
        z = torch.tensor(logits, requires_grad=True)
        per_token = F.cross_entropy(z.reshape(-1, 7), torch.tensor(labels).reshape(-1),
                                    ignore_index=-100, label_smoothing=eps,
                                    reduction="none").reshape(3, 4)
        w = torch.tensor(weights if weights is not None else np.ones((3, 4), "float32"))
        w = w * torch.tensor(labels != -100)
        loss = (per_token * w).sum() / w.sum() if w.sum() > 0 else (per_token * w).sum()
        loss.backward()
        return loss.item(), z.grad.numpy()

    loss_fn = SmoothedSparseCrossentropy(eps)
    for case_labels, case_weights in ((labels, None), (labels, weights),
                                      (np.full((3, 4), -100), weights)):
        expected, expected_grad = reference(case_labels, case_weights)
        sw = None if case_weights is None else keras.ops.convert_to_tensor(case_weights)
        y = keras.ops.convert_to_tensor(case_labels)
        value, (grad,) = value_and_grads(lambda z: loss_fn(y, z, sample_weight=sw), logits)
        assert np.isfinite(value) and np.isfinite(grad).all()
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-6)
    # reduction="none": the ignored tokens' losses are zeros
    per_token = keras.ops.convert_to_numpy(
        SmoothedSparseCrossentropy(eps, reduction="none")(labels, logits))
    assert (per_token[labels == -100] == 0).all() and (per_token[labels != -100] > 0).all()


@pytest.mark.parametrize("kwargs, needle", [
    ({"label_smoothing": "abc"}, "label_smoothing='abc'"),
    ({"label_smoothing": None}, "label_smoothing=None"),
    ({"label_smoothing": 1.0}, "label_smoothing=1.0"),
    ({"label_smoothing": True}, "label_smoothing=True"),
    ({"ignore_index": 1.5}, "ignore_index=1.5"),
    ({"ignore_index": "pad"}, "ignore_index='pad'"),
])
def test_label_smoothing_loss_names_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=r"must be") as error:
        SmoothedSparseCrossentropy(**kwargs)
    assert needle in str(error.value)


def test_batches_depend_only_on_seed_and_step():
    x = np.arange(100, dtype="float32")[:, None]
    y = np.arange(100)
    a = D.ArrayTask((x, y, None), 8, seed=3)
    b = D.ArrayTask((x, y, None), 8, seed=3)
    for step in (0, 11, 12, 40, 13):  # out of order: no hidden iterator state
        np.testing.assert_array_equal(a.train_batch(step)[1], b.train_batch(step)[1])
    # one pass covers distinct examples; the next pass is another permutation
    first = np.concatenate([a.train_batch(s)[1] for s in range(a.steps_per_epoch)])
    second = np.concatenate([a.train_batch(s)[1] for s in range(a.steps_per_epoch,
                                                                 2 * a.steps_per_epoch)])
    assert len(set(first.tolist())) == len(first)
    assert not np.array_equal(first, second)
    assert not np.array_equal(D.ArrayTask((x, y, None), 8, seed=4).train_batch(0)[1],
                              a.train_batch(0)[1])


def test_bert_masking_rates():
    tok = D.ByteTokenizer()
    windows = np.random.default_rng(0).integers(0, 256, size=(400, 128))
    x, y, w = D.masked_lm_batch(windows, np.random.default_rng(1), tok, rate=0.15)
    picked = w.astype(bool)
    assert (y[:, 0] == tok.bos_id).all() and (y[:, -1] == tok.eos_id).all()
    np.testing.assert_array_equal(y[:, 1:-1], windows[:, :126])
    assert not picked[:, 0].any() and not picked[:, -1].any()
    assert abs(picked.mean() - 0.15 * 126 / 128) < 0.01
    ids = x["token_ids"][picked]
    original = y[picked]
    masked = ids == tok.mask_id
    kept = ids == original
    assert abs(masked.mean() - 0.8) < 0.02
    assert abs((~masked & ~kept).mean() - 0.1) < 0.02  # random replacement (rarely = original)
    assert (x["token_ids"][~picked] == y[~picked]).all()
    assert (x["segment_ids"] == 0).all() and (x["padding_mask"] == 1).all()
    # Short windows: every row still predicts a token (0.85 ** 6 = 38% would have none).
    short = D.masked_lm_batch(windows[:, :8], np.random.default_rng(2), tok, rate=0.15)[2]
    assert (short.sum(axis=1) >= 1).all() and not short[:, [0, -1]].any()


def _tiny_compiled_model():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(keras.layers.Dropout(0.5)(keras.layers.Dense(8)(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def test_damaged_and_half_written_checkpoints_are_skipped(tmp_path):
    model = _tiny_compiled_model()
    x = np.ones((8, 4), "float32")
    model.fit(x, np.zeros((8, 3)), epochs=1, verbose=0)
    good = [v.numpy() if hasattr(v, "numpy") else keras.ops.convert_to_numpy(v)
            for v in model.variables]
    checkpoint.save(tmp_path, model, {"step": 10, "fingerprint": {"a": 1}})
    # A later checkpoint whose save was interrupted: the temporary file is garbage, the
    # final name holds a truncated file (as if the disk lost its end).
    with open(tmp_path / ".ckpt-00000020.npz.tmp-999", "wb") as f:
        f.write(b"\x00garbage")
    checkpoint.save(tmp_path, model, {"step": 20, "fingerprint": {"a": 1}})
    with open(tmp_path / "ckpt-00000020.npz", "r+b") as f:
        f.truncate(200)
    other = _tiny_compiled_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta, _ = checkpoint.restore_latest(tmp_path, other, {"a": 1})
    assert meta["step"] == 10
    assert any("ckpt-00000020" in str(w.message) for w in caught)
    for v, expected in zip(other.variables, good):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), expected)
    # A checkpoint of another configuration is refused, not loaded.
    with pytest.raises(checkpoint.CheckpointError, match="another configuration"):
        checkpoint.restore_latest(tmp_path, other, {"a": 2})


def test_a_save_removes_temporary_files_of_dead_writers_only(tmp_path):
    """A save killed mid-write leaves its `.ckpt-<step>.npz.tmp-<pid>` file (as large as a
    checkpoint); every kill added one that nothing removed. The next save removes those of
    processes that no longer run, and keeps a live writer's (another process saving)."""
    model = _tiny_compiled_model()
    model.fit(np.ones((8, 4), "float32"), np.zeros((8, 3)), epochs=1, verbose=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f".ckpt-00000004.npz.tmp-{dead.pid}", f".ckpt-00000006.npz.tmp-{live.pid}",
                 "notes.txt"]
        for name in names:
            (tmp_path / name).write_bytes(b"half a checkpoint")
        checkpoint.save(tmp_path, model, {"step": 8})
        assert sorted(os.listdir(tmp_path)) == sorted(
            [f".ckpt-00000006.npz.tmp-{live.pid}", "notes.txt", "ckpt-00000008.npz"])
    finally:
        live.kill()
        live.wait()


# === Recipes ===


# `demo` is the gpt_text code path with another default preset and length: `-m slow`.
SLOW_RECIPES = ("demo",)


@pytest.mark.parametrize("recipe", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_RECIPES else name
    for name in sorted(RECIPE_ARGS)
])
@pytest.mark.spread
def test_recipe_writes_its_outputs(recipe, tmp_path):
    if not _family_available(recipe):
        pytest.fail(f"the default preset of {recipe} is not registered in kzoo.presets")
    out = str(tmp_path / recipe)
    argv = [recipe, "--steps", "2", "--max-epoch-steps", "1", "--save-every", "1",
            "--out", out, "--verbose", "0"] + RECIPE_ARGS[recipe]
    assert main(argv) == 0
    rows = _read_csv(os.path.join(out, "log.csv"))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert "loss" in rows[0] and any(k.startswith("val_") for k in rows[0])
    with open(os.path.join(out, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    record = _metrics(out)
    value = record["metrics"][FINAL_METRIC[recipe]]
    assert np.isfinite(value)
    assert record["run"]["steps"] == 2 and record["run"]["backend"] == keras.backend.backend()
    model = kzoo.presets.load(os.path.join(out, "model"))
    assert model.count_params() == record["run"]["params"]
    # The model card carries the final numeric metrics.
    with open(os.path.join(out, "model", "README.md"), encoding="utf-8") as f:
        card = f.read()
    assert f"| {FINAL_METRIC[recipe]} | {value:.6g} |" in card
    assert os.path.isdir(os.path.join(out, "best"))
    assert checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))[0][0] == 2


def test_nan_loss_stops_the_run_and_saves_nothing(tmp_path, capsys):
    out = str(tmp_path / "nan")
    argv = ["vit_digits", "--steps", "6", "--max-epoch-steps", "6", "--save-every", "100",
            "--learning-rate", "1e12", "--warmup-steps", "1", "--clipnorm", "0",
            "--out", out, "--verbose", "0", "--no-augment"] + TINY_VIT + ["--batch-size", "16"]
    assert main(argv) == 3
    captured = capsys.readouterr()
    err = captured.err
    # A quiet run stays quiet (Keras' TerminateOnNaN printed "Batch 0: Invalid loss,
    # terminating training" under --verbose 0).
    assert "Invalid loss" not in captured.out and "Invalid loss" not in err
    assert "became nan" in err.lower() or "became inf" in err.lower()
    assert "no model was saved" in err
    # (it named "checkpoint is step None" and advised a lower --learning-rate alone, which
    # a checkpoint of this run would then have refused)
    assert "No checkpoint was written before it" in err and "step None" not in err
    assert "lower --learning-rate and start over with --fresh" in err
    assert not os.path.exists(os.path.join(out, "model"))
    assert not os.path.exists(os.path.join(out, "metrics.json"))
    assert checkpoint.list_checkpoints(os.path.join(out, "checkpoints")) == []


def test_nan_guard_stops_at_a_nan_loss_and_says_so_only_when_verbose(capsys):
    """`NaNGuard` stops where Keras' `TerminateOnNaN` did (the batch of the NaN loss), records
    the step, and prints Keras' line only in a verbose run."""
    import types

    for verbose, expected in ((0, ""), (1, "Batch 2: Invalid loss, terminating training\n")):
        state = cb.RunState()
        state.segment_start = 10
        guard = cb.NaNGuard(state, verbose=verbose)
        model = types.SimpleNamespace(stop_training=False)
        guard.set_model(model)
        guard.on_train_batch_end(1, {"loss": 0.5})
        assert not model.stop_training and state.diverged is None
        guard.on_train_batch_end(2, {"loss": float("nan")})
        assert model.stop_training
        assert state.diverged["step"] == 13 and np.isnan(state.diverged["loss"])
        assert capsys.readouterr().out == expected


def test_a_diverged_epoch_has_no_row_in_the_log_and_the_resumed_run_logs_it_once(
        tmp_path, capsys, monkeypatch):
    """Inputs at float32's largest value at the third step (one step an epoch; finite: NaN
    inputs are refused up front) make the run diverge in epoch 3
    after two good epochs. log.csv holds the rows of the last good checkpoint, no NaN row
    (Keras' CSVLogger had written epoch 3 with a NaN loss, a row no checkpoint or model
    has); with the data good again, the same command resumes and logs each epoch once."""
    out = str(tmp_path / "run")
    log = os.path.join(out, "log.csv")
    argv = ["vit_digits", "--steps", "4", "--max-epoch-steps", "1", "--save-every", "100",
            "--out", out, "--verbose", "0", "--no-augment"] + TINY_VIT + ["--batch-size", "16"]
    clean = D.ArrayTask.train_batch

    def poisoned(self, step):
        x, y, w = clean(self, step)
        return (np.full_like(x, np.finfo(np.float32).max) if step == 2 else x), y, w

    monkeypatch.setattr(D.ArrayTask, "train_batch", poisoned)
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "at step 3 " in err and "last good checkpoint is step 2" in err
    rows = _read_csv(log)
    assert [r["epoch"] for r in rows] == ["0", "1"]
    (step, path), = checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))[:1]
    history = checkpoint.read(path)[0]["history"]
    assert step == 2 and [h["epoch"] for h in history] == [1, 2]
    for row, kept in zip(rows, history):  # the log is what the checkpoint resumes from
        assert np.isfinite(float(row["loss"]))
        assert float(row["loss"]) == kept["loss"] and float(row["val_loss"]) == kept["val_loss"]

    monkeypatch.setattr(D.ArrayTask, "train_batch", clean)
    assert main(argv) == 0
    assert _metrics(out)["run"]["resumed_from_step"] == 2
    rows = _read_csv(log)
    assert [r["epoch"] for r in rows] == ["0", "1", "2", "3"]
    assert all(np.isfinite(float(r["loss"])) for r in rows)


def test_a_run_past_the_requested_steps_is_refused_without_a_traceback(tmp_path, capsys):
    """Re-running a finished run's command with fewer `--steps` than its checkpoint has is a
    usage error (exit 2, one line naming the steps and --fresh), not a traceback; the
    checkpoint and the outputs stay as they were."""
    out = str(tmp_path / "run")
    argv = ["vit_digits", "--max-epoch-steps", "2", "--save-every", "2", "--out", out,
            "--verbose", "0", "--no-augment"] + TINY_VIT + ["--batch-size", "16"]
    assert main(argv + ["--steps", "2"]) == 0
    before = _metrics(out)
    capsys.readouterr()
    assert main(argv + ["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "step 2" in err and "1 steps" in err and "--fresh" in err
    assert checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))[0][0] == 2
    assert _metrics(out) == before


# === Resumption ===


@pytest.mark.spread
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_save_the_step_then_resume_exactly(signum, tmp_path, monkeypatch,
                                                              capsys):
    """A SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) in the middle of an epoch,
    with no checkpoint due for long: the run stops after that step with a checkpoint of it
    (nothing trained is lost; before, SIGTERM killed the process and SIGINT raised a
    KeyboardInterrupt traceback, both losing every step since the last checkpoint), exits
    with 128 + the signal's number and a line saying how to resume, and the resumed run
    ends with the weights of an uninterrupted one (dropout on: the generator state too)."""
    from training import callbacks as cb

    argv = ["vit_digits", "--steps", "8", "--max-epoch-steps", "8", "--save-every", "1000",
            "--verbose", "0", "--batch-size", "16", "--override", "dropout=0.2"] + TINY_VIT
    reference = str(tmp_path / "reference")
    assert main(argv + ["--out", reference]) == 0

    out = str(tmp_path / "stopped")
    plain = cb.StepCheckpoint.on_train_batch_end

    def signal_at_step_3(self, batch, logs=None):
        plain(self, batch, logs)
        if self.state.step == 3:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(cb.StepCheckpoint, "on_train_batch_end", signal_at_step_3)
    previous = signal.getsignal(signum)
    assert main(argv + ["--out", out]) == 128 + signum
    assert signal.getsignal(signum) is previous  # the handler is put back
    err = capsys.readouterr().err
    assert "Traceback" not in err and "step 3" in err and "resume" in err
    assert [s for s, _ in checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))] == [3]
    assert not os.path.exists(os.path.join(out, "metrics.json"))
    monkeypatch.setattr(cb.StepCheckpoint, "on_train_batch_end", plain)

    assert main(argv + ["--out", out]) == 0
    assert _metrics(out)["run"]["resumed_from_step"] == 3
    assert _metrics(out)["metrics"] == _metrics(reference)["metrics"]
    got = kzoo.presets.load(os.path.join(out, "model")).get_weights()
    want = kzoo.presets.load(os.path.join(reference, "model")).get_weights()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.spread
def test_a_finished_run_extended_ends_like_an_uninterrupted_one(tmp_path, monkeypatch):
    """A finished run whose last step ends an epoch early (--steps 6 in epochs of 4), run
    again with --steps 12: the weights equal those of a 12-step run to 1e-6 and log.csv
    holds each epoch once, with the same values (before, on torch the final validation of
    the short run had moved the generator that dropout draws from, max weight difference
    ~2e-3, and every backend logged the early-ended epoch twice, the second row's averages
    counting only the resumed steps)."""
    argv = ["vit_digits", "--max-epoch-steps", "4", "--save-every", "1000",
            "--verbose", "0", "--batch-size", "16", "--override", "dropout=0.2"] + TINY_VIT
    # The validation value the best model is picked by, scripted by step so that the short
    # run's early validation (step 6) is the best one seen if it is wrongly kept.
    scripted = {4: 0.5, 6: 0.9, 8: 0.7, 12: 0.6}
    pick = cb.BestModel.on_epoch_end

    def on_epoch_end(self, epoch, logs=None):
        pick(self, epoch, dict(logs or {}, val_accuracy=scripted[self.state.step]))

    monkeypatch.setattr(cb.BestModel, "on_epoch_end", on_epoch_end)
    reference = str(tmp_path / "reference")
    assert main(argv + ["--steps", "12", "--out", reference]) == 0
    out = str(tmp_path / "extended")
    assert main(argv + ["--steps", "6", "--out", out]) == 0
    assert [r["epoch"] for r in _read_csv(os.path.join(out, "log.csv"))] == ["0", "1"]
    assert main(argv + ["--steps", "12", "--out", out]) == 0
    assert _metrics(out)["run"]["resumed_from_step"] == 6
    got = kzoo.presets.load(os.path.join(out, "model")).get_weights()
    want = kzoo.presets.load(os.path.join(reference, "model")).get_weights()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    rows = _read_csv(os.path.join(out, "log.csv"))
    expected = _read_csv(os.path.join(reference, "log.csv"))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    for row, want_row in zip(rows, expected):
        assert row.keys() == want_row.keys()
        np.testing.assert_allclose([float(row[k]) for k in row],
                                   [float(want_row[k]) for k in row], rtol=1e-6, atol=1e-7)
    # The best model and value: those of the uninterrupted run, not the short run's
    # validation at step 6 (before: the extended run's best was step 6's 0.9, its best/
    # the step-6 weights).
    best, want_best = _metrics(out)["best"], _metrics(reference)["best"]
    assert want_best == {"monitor": "val_accuracy", "value": 0.7, "epoch": 2, "step": 8}
    assert best == want_best
    got = kzoo.presets.load(os.path.join(out, "best")).get_weights()
    want = kzoo.presets.load(os.path.join(reference, "best")).get_weights()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert not os.path.exists(os.path.join(out, "checkpoints", "best-before-early-end"))


RESUME_ARGS = ["vit_digits", "--steps", "70", "--max-epoch-steps", "20", "--save-every", "4",
               "--batch-size", "16", "--verbose", "0"] + TINY_VIT + [
                   "--override", "dropout=0.2"]


@pytest.mark.slow
def test_sigkill_then_restart_ends_like_an_uninterrupted_run(tmp_path):
    """One SIGKILL in the second epoch, then a restart. The default suite covers this with
    tests/test_crash_safety.py (the same recipe with dropout, killed at random and inside
    checkpoint writes, resumed to the same metrics, CSV log and weights); this longer run
    stays for `make test-all`."""
    reference = str(tmp_path / "reference")
    assert main(RESUME_ARGS + ["--out", reference]) == 0

    out = str(tmp_path / "killed")
    command = [sys.executable, "-m", "training"] + RESUME_ARGS + ["--out", out]
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    ckpt_dir = os.path.join(out, "checkpoints")
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            found = checkpoint.list_checkpoints(ckpt_dir)
            if found and found[0][0] >= 24:  # the second epoch has started
                break
            time.sleep(0.02)
        assert proc.poll() is None, (
            "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = checkpoint.list_checkpoints(ckpt_dir)[0][0]
    assert 0 < killed_at < 70
    assert not os.path.exists(os.path.join(out, "metrics.json"))

    restarted = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, timeout=300)
    assert restarted.returncode == 0, restarted.stderr.decode()[-3000:]
    resumed, expected = _metrics(out), _metrics(reference)
    assert resumed["run"]["resumed_from_step"] >= killed_at
    assert resumed["metrics"] == expected["metrics"]
    assert resumed["best"] == expected["best"]
    assert _read_csv(os.path.join(out, "log.csv")) == _read_csv(
        os.path.join(reference, "log.csv"))


@pytest.mark.slow
def test_bert_accuracy_counts_masked_tokens_only(tmp_path):
    from training.cli import config_from_args
    from training.recipes import bert_mlm

    out = str(tmp_path / "bert")
    # Long enough for the model to predict real tokens (after 2 steps it may predict none
    # at all, and both accuracies would be 0), so that an accuracy over every token differs
    # from the masked-token one.
    argv = ["bert_mlm", "--steps", "40", "--max-epoch-steps", "40", "--out", out,
            "--learning-rate", "3e-3", "--warmup-steps", "5", "--verbose", "0",
            "--override", "dropout=0.0"] + RECIPE_ARGS["bert_mlm"]
    assert main(argv) == 0
    reported = _metrics(out)["metrics"]["val_masked_accuracy"]
    _, task = bert_mlm.build(config_from_args(build_parser().parse_args(argv)))
    trained = kzoo.presets.load(os.path.join(out, "model"))
    x, y, w = task.validation
    predicted = np.argmax(np.asarray(trained.predict(x, verbose=0)), -1)
    picked = w > 0
    expected = float(np.mean(predicted[picked] == y[picked]))
    unweighted = float(np.mean(predicted == y))
    assert reported == pytest.approx(expected, abs=1e-6)
    assert abs(unweighted - expected) > 1e-3  # the check can tell the two apart


def test_sample_prompt_starts_at_the_first_prose_line():
    from training.recipes.gpt_text import _prose_start

    tokenizer = D.ByteTokenizer()
    text = ">>> c['red'] += 1\n         1\n\n      The example above shows part of it.\n"
    ids = tokenizer.encode(text)
    assert _prose_start(tokenizer, ids, 16) == text.index("The example")
    code_only = tokenizer.encode("x = {'a': [1, 2]}\n" * 4)
    assert _prose_start(tokenizer, code_only, 16) == 0


@pytest.mark.spread
def test_warmup_longer_than_the_run_warns(tmp_path):
    """--warmup-steps past the run's updates is allowed (debug runs) but warned about,
    naming the flag, its value and the run's steps (before: accepted silently)."""
    argv = ["vit_digits", "--steps", "3", "--verbose", "0", "--batch-size", "16",
            "--out", str(tmp_path / "run")] + TINY_VIT
    with pytest.warns(UserWarning, match=r"--warmup-steps 50 .* 3 optimizer updates"):
        assert main(argv + ["--warmup-steps", "50"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="(?!--warmup-steps)")
        assert main(argv + ["--warmup-steps", "3", "--fresh"]) == 0
