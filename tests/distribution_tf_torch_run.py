"""Run by tests/test_distribution_cli.py in a subprocess (and to measure): data parallel
training on TensorFlow (`kzoo.distribution.mirrored`, 2 logical CPU devices) or torch
(`kzoo.distribution.torch_data_parallel`, 2 gloo processes on 127.0.0.1) against one device.

For every family of `tests/distribution_run.py` (the same tiny models and batches as the JAX
runs), `STEPS` AdamW steps (gradient clipping on) on the same global batch from the same
initial weights, on one device and in the backend's data-parallel mode. Prints one JSON
object: the losses and step times (the first step, which traces/compiles, left out) a
family and mode. torch: each process trains on its rows of the batch; its logged loss is
the running mean over its rows, and the global loss is the mean over the processes.

`KERAS_BACKEND=tensorflow|torch python tests/distribution_tf_torch_run.py [--clipnorm C]
[family ...]` (no clipping by default; with it, TensorFlow mirrored clips each replica's
gradients before the all-reduce, Keras 3.15, and departs from one device once it clips).
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

STEPS = 6
WORLD = 2


CLIPNORM = None  # --clipnorm C: measure with clipping (TensorFlow mirrored clips per replica)


def compile_model(model, name):
    import keras

    loss = "auto"
    if name == "vit":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "graphormer":
        loss = "mse"
    model.compile(optimizer=keras.optimizers.AdamW(1e-2, clipnorm=CLIPNORM), loss=loss)


def int_masks(x):
    """Boolean inputs as int32 (Keras 3.15 cannot feed booleans under a tf.distribute
    strategy; see docs/DISTRIBUTED.md); the same arrays on both sides."""
    import keras

    return keras.tree.map_structure(
        lambda a: a.astype("int32") if a.dtype == bool else a, x)


def train(model, x, y, batch_size):
    losses, times = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        logs = model.train_on_batch(x, y, return_dict=True)
        losses.append(float(logs["loss"]))
        times.append(time.perf_counter() - start)
    return losses, times[1:]


def rows(a, rank, world):
    return np.asarray(a).reshape(world, len(a) // world, *np.shape(a)[1:])[rank]


def run_tensorflow(names):
    import keras
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(WORLD)])
    import kzoo.distribution as kd
    from tests import distribution_run as run

    strategy = kd.mirrored()
    out = {"devices": [d for d in strategy.extended.worker_devices], "families": {}}
    for name in names:
        x, y = run.batch(name)
        x = int_masks(x)
        keras.utils.set_random_seed(0)
        model = run.build(name)
        initial = model.get_weights()
        compile_model(model, name)
        single = train(model, x, y, len(y))
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = run.build(name)
            model.set_weights(initial)
            compile_model(model, name)
        mirrored = train(model, x, y, len(y))
        out["families"][name] = {
            "single": {"losses": single[0], "step_s": single[1]},
            "mirrored": {"losses": mirrored[0], "step_s": mirrored[1]},
        }
    return out


def _torch_worker(rank, names, initial_dir, port, queue, clipnorm):
    global CLIPNORM
    CLIPNORM = clipnorm
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import keras

    import kzoo.distribution as kd
    from tests import distribution_run as run

    kd.init_torch_process_group()
    found = {}
    for name in names:
        x, y = run.batch(name)
        keras.utils.set_random_seed(0)
        model = run.build(name)
        with np.load(os.path.join(initial_dir, f"{name}.npz")) as f:
            model.set_weights([f[f"w{i}"] for i in range(len(f.files))])
        compile_model(model, name)
        sync = kd.torch_data_parallel(model)
        part = keras.tree.map_structure(lambda a: rows(a, rank, WORLD), x)
        found[name] = train(model, part, rows(y, rank, WORLD), len(y) // WORLD)
        sync.remove()
    queue.put((rank, found))
    import torch.distributed as dist

    dist.destroy_process_group()


def run_torch(names):
    import socket
    import tempfile

    import keras
    import torch.multiprocessing as mp

    from tests import distribution_run as run

    out = {"devices": [f"process {r} (cpu, gloo)" for r in range(WORLD)], "families": {}}
    with tempfile.TemporaryDirectory() as initial_dir:
        for name in names:
            x, y = run.batch(name)
            keras.utils.set_random_seed(0)
            model = run.build(name)
            initial = model.get_weights()
            np.savez(os.path.join(initial_dir, f"{name}.npz"),
                     **{f"w{i}": w for i, w in enumerate(initial)})
            compile_model(model, name)
            single = train(model, x, y, len(y))
            out["families"][name] = {"single": {"losses": single[0], "step_s": single[1]}}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.get_context("spawn")
        queue = context.Queue()
        workers = [context.Process(target=_torch_worker,
                                   args=(r, names, initial_dir, port, queue, CLIPNORM))
                   for r in range(WORLD)]
        for w in workers:
            w.start()
        results = dict(queue.get(timeout=900) for _ in workers)
        for w in workers:
            w.join(timeout=60)
            if w.exitcode != 0:
                raise SystemExit(f"a DDP worker exited with {w.exitcode}")
    for name in names:
        losses = np.mean([results[r][name][0] for r in range(WORLD)], axis=0)
        out["families"][name]["ddp"] = {
            "losses": losses.tolist(), "step_s": results[0][name][1],
            "rank_losses": [results[r][name][0] for r in range(WORLD)]}
    return out


def main():
    import keras

    from tests import distribution_run as run

    global CLIPNORM
    args = sys.argv[1:]
    if "--clipnorm" in args:
        i = args.index("--clipnorm")
        CLIPNORM = float(args[i + 1])
        del args[i:i + 2]
    names = args or list(run.CASES)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        result = run_tensorflow(names)
    elif backend == "torch":
        result = run_torch(names)
    else:
        raise SystemExit("KERAS_BACKEND must be tensorflow or torch (JAX: "
                         "tests/distribution_run.py)")
    result["backend"] = backend
    result["clipnorm"] = CLIPNORM
    print(json.dumps(result))


if __name__ == "__main__":
    main()
