"""kzoo.distribution: layout maps, mesh checks, and sharded training against one device.

The layout map is data: on every backend it is built for each family and checked against
this file's own statement of Megatron's splits (`expected_axes`), and a mesh that does not
fit a model raises a `ValueError` naming the axis, its size and the dimension.

Training runs on JAX only (Keras' distribution API shards on JAX alone): on the JAX backend a
subprocess with 8 virtual CPU devices (`tests/distribution_run.py`; XLA's device count must
be set before JAX starts) trains every family three Adam steps on one device, under
`data_parallel()` and under `model_parallel` on a 2 x 4 mesh; the losses must agree to 1e-5
(relative) and every variable's actual sharding (and its optimizer slots') must be the
expected split. The default suite runs the MoE GPT (GQA, experts, untied head, embedding
split on hidden) plus the build/fit checks; the other five families are behind `slow` (the
whole matrix takes ~2 min of JAX compiling on a 2-core machine). On torch and TensorFlow the
split of every variable of every family is checked on `layout_map` itself (built from models
made without initialising), and the distribution constructors must refuse with a message
pointing at JAX and at kzoo's tf.distribute / torchrun support: the JAX tests exist on
the JAX backend only and these on the other two, so nothing is skipped.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from kzoo import distribution as kd
from kzoo import registry
from tests import distribution_run as run

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ("gpt_moe",)  # default suite (~20 s of JAX); the rest of run.CASES is `slow`
SLOW = tuple(n for n in run.CASES if n not in DEFAULT)
FAMILIES = [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in run.CASES]
MODEL = 4  # devices on the model axis of the 2 x 4 mesh


def mesh(data=2, model=MODEL):
    """A mesh of named CPU devices: `DeviceMesh` is plain data on every backend."""
    return kd.device_mesh(data, model, devices=[f"cpu:{i}" for i in range(data * model)])


def expected_axes(name, path, rank):
    """Megatron's split of the weight at `path` for case `name`, stated from the names of
    the weights (not from kzoo's rules): None per dimension where it is replicated."""
    fields = run.CASES[name][1]
    last = path.split("/")[-1]
    layer = path.split("/")[-2] if "/" in path else ""
    in_attention = "/self_attention/" in path or "/cross_attention/" in path
    if in_attention and layer in ("query_dense", "key_dense", "value_dense"):
        return (None, "model") if last == "kernel" else ("model",)
    if in_attention and layer == "output_dense" and last == "kernel":
        return ("model", None)
    if "/feedforward/" in path:
        if last in ("gate_kernel", "up_kernel", "intermediate_kernel", "output_kernel"):
            return ("model", None, None)  # experts
        if layer in ("intermediate_dense", "gate_dense", "up_dense"):
            return (None, "model") if last == "kernel" else ("model",)
        if layer == "output_dense" and last == "kernel":
            return ("model", None)
    by_vocabulary = fields.get("vocabulary_size", 1) % MODEL == 0
    if path == "token_embedding/embeddings":
        return ("model", None) if by_vocabulary else (None, "model")
    if path in ("token_embedding/reverse_embeddings", "lm_head/kernel"):
        return (None, "model") if by_vocabulary else ("model", None)
    if path == "mlm_output_bias/bias":
        return ("model",)
    if path.endswith("relative_attention_bias/embeddings") or path in (
            "attention_bias/edge_embeddings", "attention_bias/spatial_embeddings",
            "attention_bias/virtual_distance"):
        return (None, "model")  # a column a head
    if path in ("node_feature/atom_embeddings", "node_feature/in_degree_embeddings",
                "node_feature/out_degree_embeddings"):
        return (None, "model")
    return (None,) * rank


def config(name, **overrides):
    family, fields, _ = run.CASES[name]
    return registry.family(family).config_class.from_dict({**fields, **overrides})


# === The layout map (every backend) ===


def test_family_name_alone_gives_the_rules_without_sizes():
    layouts = kd.layout_map("gpt", mesh())
    assert layouts["transformer_layer_3/self_attention/key_dense/kernel"].axes == (None, "model")
    assert layouts["transformer_layer_0/feedforward/up_kernel"].axes == ("model", None, None)
    assert layouts["transformer_layer_0/feedforward/gate_dense/kernel"].axes == (None, "model")
    assert layouts["final_norm/gamma"] is None
    # A preset: its sizes are known (vocabulary 260 divides by 4: split by rows).
    preset = kd.layout_map("gpt_mini", mesh())
    assert preset["token_embedding/embeddings"].axes == ("model", None)


@pytest.mark.parametrize("name, overrides, message", [
    ("gpt", dict(num_heads=6, hidden_dim=24), "does not divide num_heads=6"),
    ("gpt_moe", dict(num_kv_heads=2), "does not divide num_kv_heads=2"),
    ("bert", dict(intermediate_dim=30), "does not divide intermediate_dim=30"),
    ("gpt_moe", dict(num_experts=6), "does not divide num_experts=6"),
    ("t5", dict(vocabulary_size=63, hidden_dim=18), "divides neither vocabulary_size=63 "
                                                    "nor hidden_dim=18"),
    ("graphormer", dict(num_heads=2, hidden_dim=16), "does not divide num_heads=2"),
])
def test_a_mesh_that_does_not_fit_raises_naming_axis_size_and_dimension(name, overrides,
                                                                         message):
    with pytest.raises(ValueError, match="'model'") as e:
        kd.layout_map(config(name, **overrides), mesh())
    assert message in str(e.value) and "size 4" in str(e.value), str(e.value)
    # The same model fits a mesh whose model axis divides it.
    kd.layout_map(config(name, **overrides), mesh(data=4, model=2))


def test_bad_mesh_arguments_raise():
    with pytest.raises(ValueError, match="num_kv_heads=2"):  # a preset: GQA 8/2 on 4
        kd.layout_map("gpt_modern_mini", mesh())
    with pytest.raises(ValueError, match=r"`data_axis`='data' is not an axis.*\['batch', "):
        kd.layout_map("gpt", mesh(), data_axis="data")
    with pytest.raises(ValueError, match="must be different"):
        kd.layout_map("gpt", mesh(), data_axis="model")
    with pytest.raises(ValueError, match=r"data=3, model=4 \(12 devices\)"):
        kd.device_mesh(3, 4, devices=[f"cpu:{i}" for i in range(8)])
    with pytest.raises(ValueError, match="`model_or_family`.*'gpt3'"):
        kd.layout_map("gpt3", mesh())
    with pytest.raises(ValueError, match="`device_mesh` must be"):
        kd.layout_map("gpt", (2, 4))


# === Training (JAX: a subprocess with 8 devices; other backends: a clear refusal) ===


def _run_jax(*args):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "distribution_run.py"),
                           *args], cwd=ROOT, env=env, capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


if BACKEND == "jax":

    @pytest.fixture(scope="module")
    def default_run():
        return _run_jax("--errors", *DEFAULT)

    @pytest.fixture(scope="module")
    def slow_run():
        return _run_jax(*SLOW)

    def _family(request, name):
        result = request.getfixturevalue("default_run" if name in DEFAULT else "slow_run")
        assert result["devices"] == 8
        return result["families"][name]

    @pytest.mark.parametrize("name", FAMILIES)
    def test_data_and_model_parallel_losses_equal_one_device(request, name):
        result = _family(request, name)
        single = np.array(result["single"]["losses"])
        assert single.shape == (3,) and np.all(np.isfinite(single))
        assert single[-1] < single[0]  # it trains
        for mode in ("data", "model"):
            np.testing.assert_allclose(result[mode]["losses"], single, rtol=1e-5, atol=0,
                                       err_msg=f"{name} {mode}")

    @pytest.mark.parametrize("name", FAMILIES)
    def test_variables_are_really_sharded(request, name):
        result = _family(request, name)
        for path, v in result["data"]["variables"].items():  # data parallel: replicated
            assert v["spec"] == [None] * len(v["shape"]) and v["shard"] == v["shape"], path
        variables = result["model"]["variables"]
        assert variables.keys() == result["data"]["variables"].keys()
        split = 0
        for path, v in variables.items():
            axes = list(expected_axes(name, path, len(v["shape"])))
            assert v["spec"] == axes, (path, v)
            local = [s // MODEL if a == "model" else s for s, a in zip(v["shape"], axes)]
            assert v["shard"] == local, (path, v)  # each device holds a quarter
            split += axes != [None] * len(axes)
        assert split >= 6, split
        # Adam's moments follow their variable's layout.
        for slot, v in result["model"]["optimizer"].items():
            owner = next(p for p in variables if slot.split("/", 1)[1] in (
                p.replace("/", "_") + "_momentum", p.replace("/", "_") + "_velocity"))
            assert v["spec"] == variables[owner]["spec"], (slot, owner)

    def test_checks_before_compilation_at_build_and_fit(default_run):
        errors = default_run["errors"]
        # With a family name only, the split variables are checked as they are created.
        assert ("'model' has size 4" in errors["variable"]
                and "dimension 1 (size 30)" in errors["variable"]
                and "feedforward/intermediate_dense/kernel" in errors["variable"])
        # A batch that does not split over the batch axis, caught in fit.
        assert "batch size 5" in errors["batch_model"] and "'batch' of size 2" in \
            errors["batch_model"]
        assert "batch size 4" in errors["batch_data"] and "'batch' of size 8" in \
            errors["batch_data"]

else:
    # On JAX, building six models in this process costs ~45 s of tracing; there the split of
    # every variable is checked on the real shardings above instead.

    def test_layout_map_of_every_family_splits_what_megatron_splits():
        for name in run.CASES:
            with keras.StatelessScope():  # paths and shapes, no initialisation
                model = run.build(name)
            layouts = kd.layout_map(model, mesh())  # from a model; the config path is the same
            split = 0
            for v in model.weights:
                layout = layouts[v.path]  # raises if two rules match one path
                axes = (None,) * len(v.shape) if layout is None else layout.axes
                assert axes == expected_axes(name, v.path, len(v.shape)), (name, v.path)
                for size, axis in zip(v.shape, axes):
                    assert axis is None or size % MODEL == 0, (name, v.path, v.shape)
                split += any(a is not None for a in axes)
            assert split >= 6, (name, split)
            assert kd.layout_map(config(name), mesh()).keys() == layouts.keys()

    def test_distributions_need_jax_and_say_what_comes_instead():
        layouts = kd.layout_map("gpt_mini", mesh())  # the map itself is built here too
        assert layouts["transformer_layer_0/self_attention/output_dense/kernel"].axes == (
            "model", None)
        for make in (kd.data_parallel, lambda: kd.model_parallel("gpt_mini", mesh()),
                     lambda: kd.device_mesh(2, 4)):
            with pytest.raises(ValueError) as e:
                make()
            message = str(e.value)
            for words in ("needs the JAX backend", f"KERAS_BACKEND={BACKEND!r}",
                          "tf.distribute", "torchrun", "kzoo.distribution.mirrored()",
                          "torch_data_parallel(model)", "DISTRIBUTED.md"):
                assert words in message, (words, message)
