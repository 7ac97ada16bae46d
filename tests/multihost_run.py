"""Multi-host JAX training on one machine: 2 processes x 4 virtual CPU devices, one global mesh.

Three roles, one file (`python tests/multihost_run.py [data] [model] [model_across]` runs
them all and prints `{"single": ..., "workers": {id: ...}}` as one JSON line):

- `single(workdir)` (the reference, in the calling process, on one device) builds a
  `gpt_mini` cut down to `TINY`, writes its initial weights and the global batch to
  `workdir/data.npz`, trains it `STEPS` Adam steps and writes the trained weights to
  `workdir/single.npz`.
- `launch(workdir, modes)` (plain Python: the caller need not run JAX) starts 2 copies of this
  file as workers on 127.0.0.1 (the coordinator on a free port, bound to the loopback with
  `JAX_COORDINATOR_BIND_ADDRESS`), waits for all of them under one deadline, and on a failure
  or at the deadline kills every worker still running and raises `WorkerError` with each
  one's exit status and stderr tail.
- a worker (`--worker ID`) sets `XLA_FLAGS=--xla_force_host_platform_device_count=4` before
  JAX starts, joins the others with `keras.distribution.initialize("127.0.0.1:PORT", 2, ID)`
  (`jax.distributed.initialize`; the CPU collectives between processes are gloo, jax 0.10.2's
  default `jax_cpu_collectives_implementation`), and for each mode builds a distribution over
  the 8 global devices (`keras.distribution.list_devices()`, 4 of them its own), loads the
  weights of `data.npz` into the model built in its scope and trains it on the same global
  batch, feeding only the rows of the batch positions its devices hold (Keras makes one
  global array of them with `jax.make_array_from_process_local_data`). It writes the trained
  weights it holds to `workdir/worker{ID}_{mode}.npz` and prints one JSON line: losses, step
  times, every variable's and Adam slot's sharding (spec, the processes of its devices, the
  slice each local device holds), the global input's placement, the sockets it listens on.

Modes: `data` is `data_parallel()` over the 8 devices (4 rows a process); `model` the 2 x 4
(batch x model) mesh with the batch axis across the processes: process i is batch position i
and holds a whole replica split over its own 4 devices, the layout Keras' input sharding
assumes (`Distribution.data_shard_id`: process i feeds batch position i) and the one a GPU
cluster wants (the model axis's all-reduces inside a host, only gradients between hosts);
`model_across` the 2 x 4 mesh with the model axis across the processes (each model row: 2
devices of each process), so every split weight is half on each process and the model
axis's all-reduces cross them (each process then holds both batch positions: it feeds all 8
rows).
"""

import time

_START = time.perf_counter()  # noqa: E402 (a worker reports how long its imports took)

import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

DEVICES_PER_PROCESS = 4
MESH = (2, 4)  # (batch, model) of the model-parallel run
BATCH, SEQ, STEPS = 8, 16, 3
PRESET = "gpt_mini"
# gpt_mini's architecture (learned positions, LayerNorm, tied byte vocabulary of 260 that the
# model axis of 4 splits by rows) at a size that compiles in seconds.
TINY = dict(num_layers=1, hidden_dim=32, num_heads=4, intermediate_dim=64,
            max_sequence_length=SEQ)
MODES = ("data", "model", "model_across")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# === Launcher (plain Python: the caller need not run JAX) ===


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, n=3000):
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-n:]


class WorkerError(RuntimeError):
    """A multi-host run that failed or ran out of time; every worker it started is dead.

    Attributes: `pids` (the workers' process ids), `returncodes` (each one's exit status,
    negative when it was killed).
    """

    def __init__(self, message, pids, returncodes):
        super().__init__(message)
        self.pids, self.returncodes = pids, returncodes


def launch(workdir, modes=MODES, *, num_processes=2, timeout=300, fail=None):
    """Run `num_processes` workers on 127.0.0.1 and return their JSON outputs, by process id.

    `workdir` holds `data.npz` (written by `single`); the workers write their logs and trained
    weights there. Every wait is bounded: all workers must finish within `timeout` seconds. As
    soon as one exits with an error, or when the deadline passes, every worker still running
    is killed (by its own pid) and `WorkerError` gives each one's exit status and stderr tail.
    `fail={process_id: "start" | "hang"}` makes that worker exit with an error, or sleep,
    before it joins the others (what the tests of this path use).

    Example:
    >>> results = launch(workdir, ("data",), timeout=120)
    >>> results[1]["modes"]["data"]["losses"]
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"`num_processes` must be a positive int; got {num_processes!r}.")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"`timeout` must be a positive number of seconds; got {timeout!r}.")
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"`modes` must be a non-empty subset of {MODES}; got {modes!r}.")
    port = free_port()
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = lambda i, kind: os.path.join(workdir, f"worker{i}.{kind}")  # noqa: E731
    procs = []
    try:
        for i in range(num_processes):
            args = [sys.executable, os.path.abspath(__file__), "--worker", str(i),
                    "--processes", str(num_processes), "--port", str(port),
                    "--workdir", workdir, *modes]
            if fail and i in fail:
                args += ["--fail", fail[i]]
            with open(log(i, "out"), "wb") as out, open(log(i, "err"), "wb") as err:
                procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out,
                                              stderr=err, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while not all(p.poll() == 0 for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = (f"worker {failed[0]} exited with status {procs[failed[0]].returncode}"
                       if failed else f"the workers did not finish within timeout={timeout} s")
                _kill(procs)
                report = "\n".join(f"--- worker {i} (pid {p.pid}): exit status {p.returncode}; "
                                   f"stderr tail:\n{_tail(log(i, 'err'))}"
                                   for i, p in enumerate(procs))
                raise WorkerError(f"Multi-host run on 127.0.0.1:{port}: {why}; every worker "
                                  f"still running was killed.\n{report}",
                                  [p.pid for p in procs], [p.returncode for p in procs])
            time.sleep(0.05)
        results = {}
        for i in range(num_processes):
            with open(log(i, "out"), "rb") as f:
                results[i] = json.loads(f.read().decode().strip().splitlines()[-1])
        return results
    finally:
        _kill(procs)  # whatever went wrong here (KeyboardInterrupt included)


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)


# === The model, the batch, the training (JAX or any backend for `single`) ===


def config():
    """The GPTConfig of the tiny gpt_mini (what `model_parallel` checks the mesh against)."""
    from kzoo import registry
    spec = registry.preset_spec(PRESET)
    return registry.family("gpt").config_class.from_dict({**spec["config"], **TINY},
                                                         source=PRESET)


def build():
    import kzoo
    return kzoo.presets.load(PRESET, **TINY)


def global_batch():
    """The global batch: token ids, a padding mask (some rows end in padding) and targets."""
    import numpy as np
    rng = np.random.default_rng(0)
    vocab = config().vocabulary_size
    mask = np.ones((BATCH, SEQ), bool)
    mask[::2, -3:] = False
    return (rng.integers(0, vocab, (BATCH, SEQ)).astype("int32"), mask,
            rng.integers(0, vocab, (BATCH, SEQ)).astype("int32"))


def train(model, x, y):
    """`STEPS` Adam steps on the same batch: the losses and the step times (compile excluded)."""
    import keras
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="auto")
    losses, times = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        logs = model.train_on_batch(x, y, return_dict=True)
        losses.append(float(logs["loss"]))
        times.append(time.perf_counter() - start)
    return losses, times[1:]


def host_weights(model, mismatches=None):
    """Every weight as a NumPy array on this host. On JAX, assembled from the shards this
    process holds (a whole replica under `data` and `model`; under `model_across` the other
    half is gathered from the other process); a local copy of a slice that differs from
    another local copy of it is named in `mismatches`."""
    import keras
    import numpy as np
    if keras.backend.backend() != "jax":
        return [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in model.weights]
    mismatches = [] if mismatches is None else mismatches
    out = []
    for v in model.weights:
        value = v.value
        full = np.zeros(value.shape, value.dtype)
        seen = np.zeros(value.shape, bool)
        for shard in value.addressable_shards:
            data = np.asarray(shard.data)
            if seen[shard.index].all() and not np.array_equal(full[shard.index], data):
                mismatches.append(f"{v.path} on device {shard.device.id}")
            full[shard.index] = data
            seen[shard.index] = True
        if not seen.all():
            from jax.experimental import multihost_utils
            full = np.asarray(multihost_utils.process_allgather(value, tiled=True))
        out.append(full)
    return out


def single(workdir):
    """The reference: one process, one device. Writes the initial weights and the global batch
    to `workdir/data.npz` (the workers read it), trains, writes the trained weights to
    `workdir/single.npz` and returns the losses and step times."""
    import keras
    import numpy as np
    keras.utils.set_random_seed(0)
    model = build()
    ids, mask, y = global_batch()
    weights = model.get_weights()
    np.savez(os.path.join(workdir, "data.npz"), ids=ids, mask=mask, y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})
    losses, times = train(model, {"token_ids": ids, "padding_mask": mask}, y)
    np.savez(os.path.join(workdir, "single.npz"), *host_weights(model))
    return {"losses": losses, "step_s": times, "backend": keras.backend.backend(),
            "paths": [v.path for v in model.weights]}


# === Worker (JAX, one of several processes) ===


def _sharding(value):
    """Where a global jax.Array lives: its spec, the process of each of its devices, and the
    slice of the global array each of this process's devices holds."""
    sharding = value.sharding
    spec = list(getattr(sharding, "spec", ()))
    spec += [None] * (value.ndim - len(spec))
    spec = [a if a is None or isinstance(a, str) else list(a) for a in spec]
    local = []
    for shard in value.addressable_shards:
        index = [[s.start or 0, value.shape[d] if s.stop is None else s.stop]
                 for d, s in enumerate(shard.index)]
        local.append({"device": shard.device.id, "index": index,
                      "shape": list(shard.data.shape)})
    return {"spec": spec, "shape": list(value.shape),
            "processes": sorted({d.process_index for d in sharding.device_set}),
            "devices": len(sharding.device_set), "local": local}


def _listening():
    """The addresses this process accepts TCP connections on (Linux: /proc), as strings."""
    import ipaddress
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words, each little-endian
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1]
                                                   for i in range(0, len(raw), 4)))
                found.append(f"{ip}:{int(port, 16)}")
    return found


def _across():
    """The 8 global devices ordered for a 2 x 4 mesh whose model axis crosses the processes:
    row b holds devices 2b, 2b+1 of process 0, then of process 1."""
    import jax
    per = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    return [f"cpu:{per[p][2 * b + k].id}" for b in range(MESH[0]) for p in range(len(per))
            for k in range(2)]


def worker(process_id, num_processes, port, workdir, modes):
    import jax
    import keras
    import numpy as np

    from kzoo import distribution as kd

    keras.utils.set_random_seed(0)  # (Keras' initialize agrees on a seed otherwise)
    start = time.perf_counter()
    imported = start - _START
    keras.distribution.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    out = {"process": jax.process_index(), "processes": jax.process_count(),
           "import_s": imported, "initialize_s": time.perf_counter() - start,
           "devices": [{"id": d.id, "process": d.process_index} for d in jax.devices()],
           "local_devices": [d.id for d in jax.local_devices()],
           "list_devices": keras.distribution.list_devices(), "modes": {}}
    data = np.load(os.path.join(workdir, "data.npz"))
    initial = [data[f"w{i}"] for i in range(len(data.files) - 3)]
    for mode in modes:
        start = time.perf_counter()
        if mode == "data":
            dist = kd.data_parallel()
        elif mode == "model":
            dist = kd.model_parallel(config(), kd.device_mesh(*MESH))
        else:
            dist = kd.model_parallel(config(), kd.device_mesh(*MESH, devices=_across()))
        # This process's rows: those of the batch positions its devices hold (Keras' order:
        # position by position), the whole batch when they hold every position.
        mesh = dist.device_mesh
        positions = np.moveaxis(np.asarray(mesh.devices),
                                list(mesh.axis_names).index(dist.batch_dim_name), 0)
        mine = {f"cpu:{d.id}" for d in jax.local_devices()}
        held = [i for i, row in enumerate(positions) if mine & set(row.ravel().tolist())]
        share = BATCH // len(positions)
        rows = np.concatenate([np.arange(i * share, (i + 1) * share) for i in held])
        x = {"token_ids": data["ids"][rows], "padding_mask": data["mask"][rows]}
        y = data["y"][rows]
        with dist.scope():
            model = build()
            model.set_weights(initial)
            built = time.perf_counter()
            losses, times = train(model, x, y)
            trained = time.perf_counter()
            if mode == "data":  # a batch of 2 rows a process: kzoo's check, before compiling
                try:
                    model.train_on_batch(keras.tree.map_structure(lambda a: a[:2], x), y[:2])
                except ValueError as e:
                    out["batch_error"] = str(e)
            mismatches = []
            np.savez(os.path.join(workdir, f"worker{process_id}_{mode}.npz"),
                     *host_weights(model, mismatches))
            layout = dist.get_data_layout(x["token_ids"].shape).backend_layout
            batch = jax.make_array_from_process_local_data(layout, x["token_ids"])
            out["modes"][mode] = {
                "losses": losses, "step_s": times, "build_s": built - start,
                "train_s": trained - built, "replica_mismatches": mismatches,
                "mesh": [[int(d.split(":")[1]) for d in row]
                         for row in np.asarray(dist.device_mesh.devices).reshape(
                             dist.device_mesh.shape[0], -1)],
                "variables": {v.path: _sharding(v.value) for v in model.weights},
                "optimizer": {v.path: _sharding(v.value) for v in model.optimizer.variables
                              if len(v.shape) >= 2},
                "input": _sharding(batch),
                "input_first_tokens": [np.asarray(sh.data)[:, 0].tolist()
                                       for sh in batch.addressable_shards],
                "rows": rows.tolist(),
            }
        out["modes"][mode]["seconds"] = time.perf_counter() - start
    out["listening"] = _listening()  # the coordinator's and gloo's sockets, still open
    print(json.dumps(out), flush=True)


def main(argv):
    """`python tests/multihost_run.py [data] [model] [model_across]`: the reference, then the
    workers; prints `{"single": ..., "workers": {id: ...}}` as one JSON line."""
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modes", nargs="*", help=f"any of {MODES} (default: all)")
    parser.add_argument("--worker", type=int, help="(internal) this worker's process id")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--port", type=int)
    parser.add_argument("--workdir", help="(internal) where data.npz is, results go")
    parser.add_argument("--fail", choices=["start", "hang"],
                        help="(tests) exit with an error, or sleep, before joining")
    args = parser.parse_args(argv)
    modes = tuple(args.modes) or MODES
    if any(m not in MODES for m in modes):
        parser.error(f"modes must be among {MODES}; got {modes}")
    if args.worker is not None:
        if args.fail == "start":
            raise SystemExit(f"worker {args.worker}: told to fail before it joins")
        if args.fail == "hang":
            time.sleep(3600)
        worker(args.worker, args.processes, args.port, args.workdir, modes)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.environ.get("KZOO_MULTIHOST_DIR", tmp)
        reference = single(tmp)
        workers = launch(tmp, modes, num_processes=args.processes)
    print(json.dumps({"single": reference, "workers": workers}))


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if "--worker" in sys.argv:  # before JAX starts: this process's share of the devices
        os.environ["KERAS_BACKEND"] = "jax"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={DEVICES_PER_PROCESS}").strip()
    main(sys.argv[1:])
