"""Multi-host training: 2 JAX processes x 4 CPU devices on 127.0.0.1 against one device.

`tests/multihost_run.py` starts two worker processes that join with
`keras.distribution.initialize` (a coordinator on a free 127.0.0.1 port, gloo collectives
between them), build one mesh of the 8 global devices and train a tiny `gpt_mini` three Adam
steps, each process feeding only its rows of the global batch. The reference is the same
model trained in this process on one device from the same weights on the same global batch
(`multihost_run.single`): the losses must agree to 1e-5 (relative) and the trained weights
to a thousandth of how far training moved them; the variables must really live on both
processes (every device of the mesh, the split ones a slice a device).

On the JAX run of the suite the default test is data parallel (~15 s of two processes
compiling on a 2-core machine); the 2 x 4 model-parallel meshes (batch axis across the
processes, and model axis across them) are `slow`. The launcher's bounded waits are
checked on every backend (the workers set KERAS_BACKEND=jax themselves): a worker that
fails or a run past its deadline must stop every worker at once, not when JAX's own
five-minute initialisation timeout would.
"""

import ipaddress
import os
import signal
import time

import keras
import numpy as np
import pytest

from tests import multihost_run as run

BACKEND = keras.backend.backend()
DEFAULT = ("data",)
SLOW = ("model", "model_across")
MODES = [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in run.MODES]


# === The launcher (every backend) ===


def _all_dead(pids):
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_a_worker_that_fails_stops_the_run_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(run.WorkerError) as e:
        # Worker 0 gets as far as waiting for worker 1 in jax.distributed.initialize.
        run.launch(str(tmp_path), DEFAULT, fail={1: "start"}, timeout=300)
    elapsed = time.monotonic() - start
    message = str(e.value)
    assert "worker 1 exited with status 1" in message, message
    assert "told to fail before it joins" in message, message  # its stderr, quoted
    assert e.value.returncodes == [-signal.SIGKILL, 1], e.value.returncodes
    assert _all_dead(e.value.pids)
    assert elapsed < 60, elapsed  # not JAX's 300 s wait for the missing peer


def test_a_run_past_its_deadline_is_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(run.WorkerError, match="did not finish within timeout=2 s") as e:
        run.launch(str(tmp_path), DEFAULT, fail={1: "hang"}, timeout=2)
    assert e.value.returncodes == [-signal.SIGKILL, -signal.SIGKILL]
    assert _all_dead(e.value.pids)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_processes=0), "`num_processes` must be a positive int; got 0"),
    (dict(timeout=-1), "`timeout` must be a positive number of seconds; got -1"),
    (dict(modes=("pipeline",)), r"`modes` must be a non-empty subset of .*'pipeline'"),
])
def test_launch_checks_its_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run.launch(str(tmp_path), **kwargs)


# === Training across two processes (JAX) ===


def expected_axes(path, rank):
    """Megatron's split of this GPT's weight at `path` on the model axis, stated from the
    names of the weights (not from kzoo's rules)."""
    layer, last = path.split("/")[-2:]
    if "/self_attention/" in path and layer in ("query_dense", "key_dense", "value_dense"):
        return [None, "model"] if last == "kernel" else ["model"]
    if "/feedforward/" in path and layer == "intermediate_dense":
        return [None, "model"] if last == "kernel" else ["model"]
    if layer == "output_dense" and last == "kernel":  # attention and feed-forward outputs
        return ["model", None]
    if path == "token_embedding/embeddings":  # 260 byte ids: 65 rows a device
        return ["model", None]
    return [None] * rank


if BACKEND == "jax":

    @pytest.fixture(scope="module")
    def reference(tmp_path_factory):
        workdir = str(tmp_path_factory.mktemp("multihost"))
        assert keras.distribution.distribution() is None  # one device, no mesh
        return workdir, run.single(workdir)

    @pytest.fixture(scope="module")
    def default_run(reference):
        return run.launch(reference[0], DEFAULT, timeout=600)

    @pytest.fixture(scope="module")
    def slow_run(reference):
        return run.launch(reference[0], SLOW, timeout=600)

    def _mode(request, mode):
        workers = request.getfixturevalue("default_run" if mode in DEFAULT else "slow_run")
        assert sorted(workers) == [0, 1]
        return [workers[i]["modes"][mode] for i in (0, 1)]

    def test_the_processes_form_one_mesh_of_their_devices(default_run):
        for i, out in default_run.items():
            assert out["process"] == i and out["processes"] == 2
            devices = {d["id"]: d["process"] for d in out["devices"]}
            assert len(devices) == 8 and sorted(devices.values()) == [0] * 4 + [1] * 4
            assert [devices[d] for d in out["local_devices"]] == [i] * 4
            assert out["list_devices"] == [f"cpu:{d}" for d in devices]  # Keras sees all 8
        assert default_run[0]["devices"] == default_run[1]["devices"]

    def test_the_workers_listen_on_the_loopback_only(default_run):
        for out in default_run.values():
            assert out["listening"], out  # gloo's socket at least; the coordinator's on 0
            for address in out["listening"]:
                ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
                ip = getattr(ip, "ipv4_mapped", None) or ip
                assert ip.is_loopback, out["listening"]

    @pytest.mark.parametrize("mode", MODES)
    def test_two_processes_train_like_one_device(request, reference, mode):
        workdir, single = reference
        losses = np.array(single["losses"])
        assert losses.shape == (run.STEPS,) and losses[-1] < losses[0]  # it trains
        initial = np.load(os.path.join(workdir, "data.npz"))
        trained = np.load(os.path.join(workdir, "single.npz"))
        paths = single["paths"]
        moved = max(np.abs(trained[f"arr_{k}"] - initial[f"w{k}"]).max()
                    for k in range(len(paths)))
        assert moved > 1e-3, moved
        copies = []
        for i, out in enumerate(_mode(request, mode)):
            np.testing.assert_allclose(out["losses"], losses, rtol=1e-5, atol=0,
                                       err_msg=f"{mode}, process {i}")
            assert out["replica_mismatches"] == []  # a process's copies of a slice agree
            copies.append(np.load(os.path.join(workdir, f"worker{i}_{mode}.npz")))
            for k, path in enumerate(paths):  # a thousandth of how far training moved them
                np.testing.assert_allclose(copies[i][f"arr_{k}"], trained[f"arr_{k}"],
                                           rtol=0, atol=1e-3 * moved,
                                           err_msg=f"{mode}, process {i}, {path}")
        for k, path in enumerate(paths):  # the two processes end with the same model
            np.testing.assert_array_equal(copies[0][f"arr_{k}"], copies[1][f"arr_{k}"],
                                          err_msg=f"{mode}: {path}")

    @pytest.mark.parametrize("mode", MODES)
    def test_each_process_feeds_only_its_rows(request, reference, mode):
        ids = np.load(os.path.join(reference[0], "data.npz"))["ids"]
        half = run.BATCH // 2
        for i, out in enumerate(_mode(request, mode)):
            # The batch axis: across the processes (data, model), or inside each (model_across:
            # both batch rows of the mesh hold devices of both processes, so each feeds all).
            mine = (list(range(run.BATCH)) if mode == "model_across"
                    else list(range(i * half, (i + 1) * half)))
            assert out["rows"] == mine
            batch = out["input"]
            assert batch["shape"] == [run.BATCH, run.SEQ] and batch["spec"] == ["batch", None]
            assert batch["processes"] == [0, 1] and batch["devices"] == 8
            for shard, first in zip(batch["local"], out["input_first_tokens"]):
                (lo, hi), _ = shard["index"]
                assert set(range(lo, hi)) <= set(mine), (shard, mine)
                assert first == ids[lo:hi, 0].tolist()  # the global array holds the batch

    @pytest.mark.parametrize("mode", MODES)
    def test_variables_live_on_both_processes(request, mode):
        outs = _mode(request, mode)
        split = 0
        for path in outs[0]["variables"]:
            held = []  # per process: the slices its devices hold
            for out in outs:
                v = out["variables"][path]
                axes = [None] * len(v["shape"]) if mode == "data" else expected_axes(
                    path, len(v["shape"]))
                assert v["spec"] == axes, (mode, path, v["spec"])
                assert v["processes"] == [0, 1] and v["devices"] == 8, (path, v)
                assert len(v["local"]) == 4
                held.append({tuple(map(tuple, s["index"])) for s in v["local"]})
                for s in v["local"]:
                    assert s["shape"] == [b - a for a, b in s["index"]]
            if "model" not in axes:
                for slices in held:  # replicated: every device holds all of it
                    assert slices == {tuple((0, n) for n in v["shape"])}, (path, slices)
                continue
            split += 1
            dim = axes.index("model")
            quarter = v["shape"][dim] // 4
            starts = [sorted(s[dim][0] for s in slices) for slices in held]
            if mode == "model":  # each process: the 4 quarters, a replica of the model
                assert starts == [[0, quarter, 2 * quarter, 3 * quarter]] * 2, (path, starts)
            else:  # model_across: process 0 the first 2 quarters, process 1 the other 2
                assert starts == [[0, quarter], [2 * quarter, 3 * quarter]], (path, starts)
        assert split >= (0 if mode == "data" else 9), split  # 8 block kernels/biases + table
        for out in outs:  # Adam's moments follow their variable's layout
            for slot, v in out["optimizer"].items():
                owner = next(p for p in out["variables"]
                             if slot.split("/", 1)[1].startswith(p.replace("/", "_") + "_"))
                assert v["spec"] == out["variables"][owner]["spec"], (slot, owner)
                assert v["local"] == out["variables"][owner]["local"], (slot, owner)

    def test_a_batch_that_does_not_split_names_the_process_share(default_run):
        for out in default_run.values():  # 2 rows a process; each holds 4 batch positions
            message = out["batch_error"]
            assert "batch size 2" in message and "4 of the 8 positions of mesh axis " \
                "'batch' that this process's devices hold" in message, message
            assert "2 processes" in message and "multiple of 4" in message, message
