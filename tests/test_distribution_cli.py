"""`python -m training` in every distributed mode, against one device (issue #17, items 2,
4 and 5).

Each backend's pytest run trains through the CLI in the modes of its own backend, in a
subprocess (`tests/distribution_cli_run.py`: virtual devices must be set up before the
backend starts): JAX `--data-parallel 4` and `--data-parallel 2 --model-parallel 2` on 4
virtual CPU devices, TensorFlow `--strategy mirrored` on 2 logical CPU devices, torch
`torchrun --nproc_per_node 2` (gloo on 127.0.0.1). The reference is the same command on one
device: the per-step training losses and the validation losses must agree to 1e-5
(relative) at the same global batch; the mode's checkpoint must resume on ONE device and
continue exactly as the one-device run does (step 3), and loaded into a one-device model it
must give exactly the outputs of the model the mode saved. The bad settings (a mesh that
does not cover the devices, does not divide the heads or the experts; a batch that does not
split) must exit with a message naming the flag, its value and what is allowed, before
anything is compiled or written.

In the default suite: GPT on every backend (JAX: the 2 x 2 mesh; data parallelism alone is
checked at the API level by tests/test_distribution.py); the other recipes and JAX's
data-parallel mode are `slow`, trained only when a slow case runs. Recipes whose loss is a
mean over sample weights (BERT's masked tokens, T5's padding) are compared on JAX only:
TensorFlow mirrored and torch normalise it per replica (docs/DISTRIBUTED.md). At the API level
(`tests/distribution_tf_torch_run.py`, every family's tiny model, 6 AdamW steps), TensorFlow
mirrored and torch DDP must give the one-device losses to 1e-5: BERT in the default suite
(its segment table is the case of sparse gradients, summed over repeated ids by kzoo before
Keras' optimizer, `kzoo.models.base._sum_sparse_gradients`; GPT's mirrored / DDP steps are
the CLI case above), the others `slow` (mixture of experts: the same first step, then within
5%, as each replica routes its own tokens). The checks of a flag on the wrong backend run in
the pytest process on every backend (nothing is built).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from training.cli import main

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ("gpt_text",)
ALL = ("gpt_text", "bert_mlm", "t5_numbers", "vit_digits", "graphormer_freesolv")
MODES = {"jax": ("model", "data"), "tensorflow": ("mirrored",), "torch": ("ddp",)}[BACKEND]
DEFAULT_MODE = MODES[0]  # JAX's data-parallel mode is slow (the 2 x 2 mesh covers it)


def _run(out, *args):
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "distribution_cli_run.py"), str(out),
         *args], cwd=ROOT, env=env, capture_output=True, timeout=1800)
    assert done.returncode == 0, done.stderr.decode()[-6000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


# The default run trains the default recipes in the default mode only (JAX's data-parallel
# run of gpt_text, a `slow` case, was trained there too and never checked: 51 -> 38 s for
# JAX's default case alone); the slow run trains every other (recipe, mode) pair.
@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("dist_cli"), "--errors",
                *[f"{r}:{DEFAULT_MODE}" for r in DEFAULT])


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    other_modes = ",".join(m for m in MODES if m != DEFAULT_MODE)
    return _run(tmp_path_factory.mktemp("dist_cli_slow"),
                *[f"{r}:{other_modes}" for r in DEFAULT if other_modes],
                *[r for r in ALL if r not in DEFAULT])


# Losses averaged over the sample weights of a batch (`mean_with_sample_weight`: BERT's
# masked tokens, T5's target padding) are normalised by each replica's own weights under
# TensorFlow mirrored and torch processes (as DDP does): not the one-device mean when the
# replicas' weights differ. JAX computes over the global batch. See docs/DISTRIBUTED.md.
PER_REPLICA_MEAN = ("bert_mlm", "t5_numbers")


def _cases():
    for recipe in ALL:
        for mode in MODES:
            if recipe in PER_REPLICA_MEAN and mode in ("mirrored", "ddp"):
                continue
            slow = recipe not in DEFAULT or mode != DEFAULT_MODE
            yield pytest.param(recipe, mode, marks=[pytest.mark.slow] if slow else [],
                               id=f"{recipe}-{mode}")


def _result(request, recipe, mode):
    default = recipe in DEFAULT and mode == DEFAULT_MODE
    run = request.getfixturevalue("default_run" if default else "slow_run")
    assert run["backend"] == BACKEND
    return run["recipes"][recipe]


def _column(rows, key):
    return np.array([row[key] for row in rows])


@pytest.mark.parametrize("recipe, mode", _cases())
def test_mode_gives_the_one_device_losses_and_its_checkpoint_resumes_on_one_device(
        request, recipe, mode):
    result = _result(request, recipe, mode)
    single, dist = result["single"], result[mode]
    assert single["distribution"]["mode"] == "single"
    info = dist["distribution"]
    assert info["mode"] == mode
    assert info["data_parallel"] * info["model_parallel"] == info["devices"] >= 2
    if mode == "model":
        assert info["model_parallel"] == 2 and info["data_parallel"] == 2
    if mode == "ddp":
        assert info["processes"] == 2

    one = _column(single["log"], "loss")
    assert one.shape == (3,) and np.all(np.isfinite(one))
    # The same global batches: the mode's two steps are the one-device steps.
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(_column(dist["log"], key), _column(single["log"], key)[:2],
                                   rtol=1e-5, atol=0, err_msg=f"{recipe} {mode} {key}")
    # Its checkpoint, on one device: exactly the saved model's outputs ...
    ckpt = dist["checkpoint"]
    assert ckpt["step"] == 2 and ckpt["finite"] and ckpt["equal"], ckpt
    # ... and resumed there, the run continues as the one-device run does.
    resumed = dist["resumed"]
    assert resumed["from_step"] == 2 and resumed["distribution"]["mode"] == "single"
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(_column(resumed["log"], key), _column(single["log"], key),
                                   rtol=1e-5, atol=0, err_msg=f"{recipe} {mode} resumed {key}")


# === The API on TensorFlow and torch, every family (tests/distribution_tf_torch_run.py) ===

# BERT: its segment table is the case of sparse gradients. GPT's mirrored / DDP steps are
# checked against one device by the CLI test above (gpt_text, the same helpers), so its API
# case is `slow` with the others.
API_DEFAULT = ("bert",)
API_ALL = API_DEFAULT + tuple(n for n in ("gpt", "bert", "t5", "vit", "graphormer", "gpt_moe")
                              if n not in API_DEFAULT)


@pytest.fixture(scope="module")
def api_default_run():
    return _run_api(*API_DEFAULT)


@pytest.fixture(scope="module")
def api_slow_run():
    return _run_api(*[n for n in API_ALL if n not in API_DEFAULT])


def _run_api(*names):
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "distribution_tf_torch_run.py"),
         *names], cwd=ROOT, env=env, capture_output=True, timeout=1800)
    assert done.returncode == 0, done.stderr.decode()[-6000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _api_cases():
    for name in API_ALL:
        marks = [] if name in API_DEFAULT else [pytest.mark.slow]
        yield pytest.param(name, marks=marks, id=name)


if BACKEND in ("tensorflow", "torch"):

    @pytest.mark.parametrize("name", _api_cases())
    def test_mirrored_or_ddp_steps_equal_one_device_steps(request, name):
        run = request.getfixturevalue("api_default_run" if name in API_DEFAULT
                                      else "api_slow_run")
        assert run["backend"] == BACKEND and len(run["devices"]) == 2
        result = run["families"][name]
        single = np.array(result["single"]["losses"])
        assert single.shape == (6,) and np.all(np.isfinite(single)) and single[-1] < single[0]
        mode = "mirrored" if BACKEND == "tensorflow" else "ddp"
        dist = np.array(result[mode]["losses"])
        if name == "gpt_moe":  # routing per replica: expert capacity and balance loss
            np.testing.assert_allclose(dist[0], single[0], rtol=1e-5)  # the same start
            assert 0 < np.max(np.abs(dist - single) / single) < 0.05
        else:
            np.testing.assert_allclose(dist, single, rtol=1e-5, atol=0, err_msg=name)
        if mode == "ddp":  # the processes' own losses differ: each saw its own rows
            ranks = np.array(result["ddp"]["rank_losses"])
            assert np.max(np.abs(ranks[0] - ranks[1])) > 1e-4

else:

    def test_mirrored_and_ddp_helpers_refuse_jax():
        import kzoo.distribution as kd

        with pytest.raises(ValueError, match="mirrored needs the tensorflow backend"):
            kd.mirrored()
        with pytest.raises(ValueError, match="torch_data_parallel needs the torch backend"):
            kd.torch_data_parallel(keras.Sequential())
        with pytest.raises(ValueError, match="init_torch_process_group needs the torch"):
            kd.init_torch_process_group()


# === Bad settings ===


def test_bad_mesh_or_batch_exits_before_compiling_naming_flag_value_and_allowed(default_run):
    errors = default_run["errors"]
    expected = {
        "jax": {
            "devices": ["--data-parallel 3 x --model-parallel 1 = 3 devices",
                        "JAX has 4", "must equal 4"],
            "heads": ["--model-parallel 4", "'model' has size 4",
                      "does not divide num_heads=2"],
            "experts": ["--model-parallel 4", "'model' has size 4",
                        "does not divide num_experts=2"],
            "batch": ["--batch-size 6", "--data-parallel 4", "multiple of 4"],
        },
        "tensorflow": {"batch": ["--batch-size 7", "--strategy mirrored (2 replicas",
                                 "multiple of 2"],
                       "clipnorm": ["--strategy mirrored needs --clipnorm 0",
                                    "clipping norm 1", "before it all-reduces"]},
        "torch": {},
    }[BACKEND]
    assert errors.keys() == expected.keys()
    for name, words in expected.items():
        found = errors[name]
        assert found["status"] == 2, found
        assert found["stderr"].startswith("error: "), found
        for w in words:
            assert w in found["stderr"], (name, w, found["stderr"])
        assert found["checkpoints"] == [], found  # nothing trained, nothing written


def _error(capsys, argv, monkeypatch=None, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    status = main(["gpt_text", "--steps", "1", "--verbose", "0", *argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: "), err
    return err


def test_a_flag_of_another_backend_says_which_backend_and_what_to_use_here(
        capsys, monkeypatch, tmp_path):
    out = ["--out", str(tmp_path / "run")]
    if BACKEND != "jax":
        for flag in ("--data-parallel", "--model-parallel"):
            err = _error(capsys, [flag, "2", *out])
            assert f"{flag} 2 needs KERAS_BACKEND=jax" in err and repr(BACKEND) in err, err
    if BACKEND != "tensorflow":
        err = _error(capsys, ["--strategy", "mirrored", *out])
        assert "--strategy mirrored needs KERAS_BACKEND=tensorflow" in err, err
        assert repr(BACKEND) in err, err
    if BACKEND != "torch":
        err = _error(capsys, out, monkeypatch, WORLD_SIZE="2")
        assert "WORLD_SIZE=2" in err and "needs KERAS_BACKEND=torch" in err, err
    if BACKEND == "torch":
        err = _error(capsys, ["--cpu-devices", "2", *out])
        assert "--cpu-devices is for JAX and TensorFlow" in err and "torchrun" in err, err
    assert not os.path.exists(tmp_path / "run")  # refused before anything was made


def test_checks_of_this_backend_in_one_process(capsys, monkeypatch, tmp_path):
    out = ["--out", str(tmp_path / "run")]
    if BACKEND == "jax":
        n = len(keras.distribution.list_devices())
        err = _error(capsys, ["--data-parallel", str(n + 1), *out])
        assert f"--data-parallel {n + 1} x --model-parallel 1" in err and \
            f"JAX has {n}" in err, err
        err = _error(capsys, ["--model-parallel", str(n + 1), *out])
        assert f"--model-parallel {n + 1} does not divide the {n} devices" in err, err
        recipe_error = ["--data-parallel", str(n)]
    elif BACKEND == "torch":  # torchrun's environment, refused before joining a group
        err = _error(capsys, ["--batch-size", "7", *out], monkeypatch, WORLD_SIZE="2")
        assert "--batch-size 7" in err and "WORLD_SIZE=2" in err and "multiple of 2" in err
        for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key, raising=False)
        err = _error(capsys, out, monkeypatch, WORLD_SIZE="2")  # not from torchrun
        assert "WORLD_SIZE=2" in err and "'RANK', 'MASTER_ADDR', 'MASTER_PORT'" in err, err
        assert "torchrun --nproc_per_node" in err, err
        monkeypatch.setenv("WORLD_SIZE", "x")
        err = _error(capsys, out)
        assert "WORLD_SIZE must be an integer" in err and "'x'" in err, err
        monkeypatch.delenv("WORLD_SIZE")
        recipe_error = None
    else:
        recipe_error = ["--strategy", "mirrored", "--clipnorm", "0"]
    if recipe_error:  # a recipe with its own training loop runs on one device
        status = main(["distill_gpt", "--steps", "1", "--verbose", "0", *recipe_error, *out])
        err = capsys.readouterr().err
        assert status == 2 and "distill_gpt recipe" in err and "one device" in err, err
    assert not os.path.exists(tmp_path / "run")


def test_parser_refuses_bad_values(capsys):
    from training.cli import build_parser

    for argv, words in ((["--data-parallel", "0"], "--data-parallel must be a positive"),
                        (["--model-parallel", "x"], "--model-parallel must be a positive"),
                        (["--strategy", "multiworker"], "invalid choice: 'multiworker'"),
                        (["--cpu-devices", "-2"], "--cpu-devices must be a positive")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["gpt_text", *argv])
        err = capsys.readouterr().err
        assert words in err, (argv, err)


@pytest.mark.parametrize("mode", ["data", "model", "mirrored", "ddp"])
def test_validation_data_may_be_an_x_y_pair_as_fit_takes_it(mode):
    # vit_digits and graphormer_freesolv hand the plan (x, y) without sample weights; JAX's
    # off-mesh validation unpacked three values (and --strategy mirrored took the batch size
    # for the weights). The validation loss is checked against NumPy's mean squared error.
    from training.distributed import Plan

    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3)).astype("float32")
    y = rng.normal(size=(6, 1)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    kernel, bias = (keras.ops.convert_to_numpy(v) for v in model.layers[0].weights)
    expected = float(np.mean((x @ kernel + bias - y) ** 2))

    plan = Plan(mode=mode)
    given = plan.validation((x, y), 4)
    if mode in ("data", "model"):  # JAX: evaluated by a callback at every epoch end
        assert given is None
        callback = plan.callbacks([])[0]
        callback.set_model(model)
        logs = {}
        callback.on_epoch_end(0, logs)
        np.testing.assert_allclose(logs["val_loss"], expected, rtol=1e-5)
    else:
        assert len(given) == 3 and given[2] is None
        results = model.evaluate(*given[:2], sample_weight=given[2], verbose=0,
                                 return_dict=True)
        np.testing.assert_allclose(results["loss"], expected, rtol=1e-5)
