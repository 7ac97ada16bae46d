"""Attention speed and memory: kzoo `auto` beside `keras.ops.dot_product_attention` and einsum.

Run one backend:      KERAS_BACKEND=jax python -m benchmarks.attention
Run all three:        python -m benchmarks.attention --all-backends

For each sequence length, mask (causal, padded) and pass (forward, forward+backward) it
prints the median wall time and the peak extra resident memory of each method, and the
ratios of kzoo to the best of the others. Every method runs under the backend's compiler
(jax.jit, tf.function(jit_compile=True), eager torch). Peak memory is the high-water mark of
the process' resident set during one call after a warm-up (the mark is reset through
/proc/self/clear_refs), minus the resident set before the call; glibc is told to return
large blocks to the system so that freed buffers are not silently reused. TensorFlow keeps
XLA's buffers pooled after the first call, so its peak is taken over the first call,
compilation included (an upper bound for every method alike). Before it is measured, each
method runs once at 128 tokens, so that the process' one-time start-up is not counted.
Times are medians of calls interleaved method by method in one process (15 calls at 512, 7
at 2048, 3 at 8192; 41 at 512, where one call takes milliseconds), so that load changes hit all methods alike; each call frees its
buffers before the next, so interleaving does not inflate memory.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

BATCH, HEADS, HEAD_DIM = 1, 8, 64
DEFAULT_LENGTHS = (512, 2048, 8192)
METHODS = ("kzoo", "keras", "einsum")


def _rss_kib():
    with open("/proc/self/status") as f:
        d = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith("Vm")}
    return d["VmRSS"], d["VmHWM"]


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _build(method, mask_kind, length, backward):
    import keras
    import numpy as np
    from keras import ops

    from kzoo.layers import attention_kernel, dot_product_attention

    rng = np.random.default_rng(0)
    shape = (BATCH, length, HEADS, HEAD_DIM)
    q, k, v = (ops.convert_to_tensor(rng.normal(size=shape).astype("float32")) for _ in range(3))
    mask = None
    if mask_kind == "padded":
        valid = np.ones((BATCH, 1, 1, length), bool)
        valid[..., int(length * 0.75):] = False
        mask = ops.convert_to_tensor(valid)
    causal = mask_kind == "causal"

    def einsum_attention(q, k, v, mask):
        s = ops.einsum("bthd,bshd->bhts", q, k) * (HEAD_DIM ** -0.5)
        if causal:
            s = ops.where(ops.tril(ops.ones((length, length), "bool")), s, -1e30)
        if mask is not None:
            s = ops.where(mask, s, -1e30)
        return ops.einsum("bhts,bshd->bthd", ops.softmax(s, axis=-1), v)

    def attend(q, k, v, mask):
        if method == "kzoo":
            return dot_product_attention(q, k, v, mask=mask, is_causal=causal)
        if method == "keras":
            return ops.dot_product_attention(q, k, v, mask=mask, is_causal=causal)
        return einsum_attention(q, k, v, mask)

    backend = keras.backend.backend()
    chosen = attention_kernel(q, k, v, mask=mask, is_causal=causal) if method == "kzoo" else ""
    if backend == "jax":
        import jax

        if backward:
            fn = jax.jit(jax.grad(lambda q, k, v, m: attend(q, k, v, m).sum(), argnums=(0, 1, 2)))
        else:
            fn = jax.jit(attend)

        def run():
            jax.block_until_ready(fn(q, k, v, mask))

    elif backend == "tensorflow":
        import tensorflow as tf

        if backward:
            @tf.function(jit_compile=True)
            def fn(q, k, v, m):
                with tf.GradientTape() as tape:
                    tape.watch([q, k, v])
                    loss = tf.reduce_sum(attend(q, k, v, m))
                return tape.gradient(loss, [q, k, v])
        else:
            fn = tf.function(attend, jit_compile=True)

        def run():
            out = fn(q, k, v, mask)
            (out[0] if isinstance(out, list) else out).numpy()

    else:
        import torch

        qs, ks, vs = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))

        def run():
            if backward:
                for t in (qs, ks, vs):
                    t.grad = None
                attend(qs, ks, vs, mask).sum().backward()
            else:
                with torch.no_grad():
                    attend(qs, ks, vs, mask)

    return run, chosen


WARM_UP_LENGTH = 128


def _warm_up_process(method, mask_kind, backward, chosen):
    """Run the same method (and kzoo kernel) once at a tiny length, so that the process'
    one-time start-up (the runtime's devices and thread pools, the XLA compiler's first use:
    70-100 MiB on TensorFlow, whichever method comes first) is not counted as the memory of
    the call measured."""
    from kzoo.layers import kernels

    if chosen:
        kernels.set_attention_kernel(chosen)
    try:
        _build(method, mask_kind, WARM_UP_LENGTH, backward)[0]()
    finally:
        kernels.set_attention_kernel(None)


def measure(method, mask_kind, length, backward, repeats):
    import keras

    run, chosen = _build(method, mask_kind, length, backward)
    _warm_up_process(method, mask_kind, backward, chosen)
    # TensorFlow's XLA runtime keeps the buffers of the first call in its allocator's pool,
    # so a call after the warm-up shows no growth at all; there the peak is taken over the
    # first call (compilation included: an upper bound). Elsewhere: after a warm-up.
    first_call = keras.backend.backend() == "tensorflow"
    if first_call:
        gc.collect()
        _reset_peak()
        before, _ = _rss_kib()
        run()
        _, first_peak = _rss_kib()
    else:
        run()  # warm-up: compilation and first allocations
    gc.collect()
    _reset_peak()
    if not first_call:
        before, _ = _rss_kib()
    t0 = time.perf_counter()
    run()
    times = [time.perf_counter() - t0]
    _, peak = _rss_kib()
    if first_call:
        peak = max(peak, first_peak)
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "method": method, "mask": mask_kind, "length": length,
        "pass": "fwd+bwd" if backward else "fwd", "kernel": chosen,
        "ms": 1000 * times[len(times) // 2], "extra_mib": max(peak - before, 0) / 1024,
    }


def _child(args):
    """Measure one configuration in this (fresh) process and print it as JSON."""
    result = measure(args.method, args.mask, args.length, args.backward, args.repeats)
    print("RESULT " + json.dumps(result), flush=True)


def _child_times(args):
    """Time every method in this one process, interleaved call by call, so that a change in
    machine load hits all methods alike; print the medians as JSON."""
    runs = {m: _build(m, args.mask, args.length, args.backward)[0] for m in METHODS}
    for run in runs.values():
        run()  # warm-up: compilation and first allocations
    times = {m: [] for m in METHODS}
    for _ in range(args.repeats):
        for method, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[method].append(time.perf_counter() - t0)
    medians = {m: 1000 * sorted(t)[len(t) // 2] for m, t in times.items()}
    print("TIMES " + json.dumps(medians), flush=True)


def _repeats(length):
    return 41 if length <= 512 else (7 if length <= 2048 else 3)


# Up to this length the three methods are timed together in one process, interleaved (the
# medians reported); beyond it, each method in its own process.
INTERLEAVE_MAX_LENGTH = 8192


def _interleaved_times(env, mask, length, backward):
    cmd = [sys.executable, "-m", "benchmarks.attention", "--child-times", "--mask", mask,
           "--length", str(length), "--repeats", str(_repeats(length))]
    cmd += ["--backward"] if backward else []
    # glibc's settings for the memory children would slow every allocation: not for timing.
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("TIMES ")]
    return json.loads(line[0][len("TIMES "):]) if proc.returncode == 0 and line else {}


def run_backend(backend, lengths, out_rows):
    env = dict(os.environ, KERAS_BACKEND=backend, MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="0", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.getcwd())
    for length in lengths:
        for mask in ("causal", "padded"):
            for backward in (False, True):
                interleaved = {}
                if length <= INTERLEAVE_MAX_LENGTH:
                    interleaved = _interleaved_times(env, mask, length, backward)
                for method in METHODS:
                    # Memory (and, for long sequences, time) from a fresh process per method.
                    repeats = 1 if interleaved else _repeats(length)
                    cmd = [sys.executable, "-m", "benchmarks.attention", "--child",
                           "--method", method, "--mask", mask, "--length", str(length),
                           "--repeats", str(repeats)] + (["--backward"] if backward else [])
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if proc.returncode != 0 or not line:
                        tail = (proc.stderr or "").strip().splitlines()[-3:]
                        row = {"method": method, "mask": mask, "length": length,
                               "pass": "fwd+bwd" if backward else "fwd", "kernel": "",
                               "ms": float("nan"), "extra_mib": float("nan"),
                               "error": " | ".join(tail)}
                    else:
                        row = json.loads(line[0][len("RESULT "):])
                        if method in interleaved:
                            row["ms"] = interleaved[method]
                    row["backend"] = backend
                    out_rows.append(row)
                    print(f"  {backend:10s} {length:5d} {mask:6s} {row['pass']:7s} {method:6s} "
                          f"{row['ms']:10.1f} ms {row['extra_mib']:9.1f} MiB {row.get('kernel','')}"
                          f"{'  ERROR ' + row['error'] if 'error' in row else ''}",
                          file=sys.stderr, flush=True)


def table(rows):
    """Markdown table: one line per (backend, length, mask, pass) with ratios."""
    import math

    lines = [
        "| backend | seq | mask | pass | kzoo kernel | kzoo ms | keras ms | einsum ms | "
        "kzoo / best other (time) | kzoo MiB | keras MiB | einsum MiB | kzoo MiB / scores MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = []
    for r in rows:
        key = (r["backend"], r["length"], r["mask"], r["pass"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        by = {r["method"]: r for r in rows if (r["backend"], r["length"], r["mask"], r["pass"]) == key}
        if not all(m in by for m in METHODS):
            continue
        best_other = min(
            (by[m]["ms"] for m in ("keras", "einsum") if not math.isnan(by[m]["ms"])),
            default=float("nan"),
        )
        scores_mib = BATCH * HEADS * key[1] * key[1] * 4 / 2**20
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {by['kzoo']['kernel']} | "
            f"{by['kzoo']['ms']:.1f} | {by['keras']['ms']:.1f} | {by['einsum']['ms']:.1f} | "
            f"{by['kzoo']['ms'] / best_other:.2f} | {by['kzoo']['extra_mib']:.0f} | "
            f"{by['keras']['extra_mib']:.0f} | {by['einsum']['extra_mib']:.0f} | "
            f"{by['kzoo']['extra_mib'] / scores_mib:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-backends", action="store_true")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    parser.add_argument("--json", default=None, help="also write the raw rows here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-times", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--mask", choices=("causal", "padded"), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    if args.child_times:
        return _child_times(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    backends = ("jax", "torch", "tensorflow") if args.all_backends else (
        os.environ.get("KERAS_BACKEND", "jax"),)
    rows = []
    print(f"B={BATCH} H={HEADS} d={HEAD_DIM}, float32, CPU ({os.cpu_count()} cores)",
          file=sys.stderr)
    for backend in backends:
        run_backend(backend, lengths, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nAttention, B={BATCH} H={HEADS} head_dim={HEAD_DIM}, float32; time = median; "
          "MiB = peak extra resident memory of one call; scores MiB = B*H*T*T*4 bytes.\n")
    print(table(rows))


if __name__ == "__main__":
    main()
