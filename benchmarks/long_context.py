"""Long-context attention: time and peak memory of the sparse and linear kernels beside full
attention, n = 1k .. 32k, and where each one crosses below full attention.

Run one backend:      KERAS_BACKEND=torch python -m benchmarks.long_context
Run all three:        python -m benchmarks.long_context --all-backends --json out.json
A quick look:         python -m benchmarks.long_context --quick --in-process

Methods (batch 1, 4 heads, head_dim 64, float32, causal unless `--bidirectional`; window
`w = --window`, default 256; every block-based kernel uses blocks of `w`):

- `full`: `kzoo.layers.dot_product_attention(kernel="auto")`, the backend's own choice
  (torch: fused SDPA; jax / tensorflow on CPU: the chunked kernel from 2048 / 512 tokens on,
  the reference one below); `full_chunked`: `kernel="chunked"`, run only where `auto` picks
  something else.
- `sliding_window` (`|i - j| < w`), `strided` (stride `round(sqrt(n))`), `longformer` (window
  `w` plus 4 global tokens at 0, n/4, n/2, 3n/4), `block_sparse` (local blocks: itself and its
  neighbours, plus the first block column), `bigbird` (3 window blocks, 1 global, 2 random,
  seed 0), `linear_elu`, `linear_favor` (Performer, 128 features), `linear_fourier` (128
  random Fourier frequencies) — the kernels of `kzoo.layers`.

Measurement, as `benchmarks.attention` (whose resident-set helpers it uses): every call runs
under the backend's compiler (jax.jit, tf.function(jit_compile=True), eager torch), forward and
forward+backward (the gradient of the output's sum with respect to q, k and v). Memory: one
fresh process per (method, pass) walks the lengths upward; at each length it compiles and runs
the call once, resets the resident-set high-water mark (/proc/self/clear_refs) and reports the
peak of the next call minus the resident set before it (glibc returns freed blocks to the
system, so one length's buffers are gone before the next). TensorFlow's XLA runtime pools its
buffers, so there the first call is measured, compilation included; pooled buffers of the
shorter lengths before it can make that a slight underestimate. Time: the medians of calls
interleaved method by method in one process per pass and length (3..9 rounds), so that load
changes hit all methods alike; a method whose single call takes longer than 5 s is timed by
that single call of its memory process instead (marked `*`).

Guards: before each length, a method's time per call and memory are extrapolated from its last
measured length (time ~ n^2 for full attention, n^1.5 strided, n otherwise; memory by the
slope of its last two lengths, 1..2, and the (n, n) score tensor when the reference kernel runs).
Above `--time-budget` seconds per call (default 60) or `--memory-limit` MiB (default 4096) the
method is skipped at that length and beyond and the table shows `—` with the reason; a child
that dies or runs out of time loses only the lengths it had not reported.

Finally, for each method: the first n from which it is faster than full attention (and stays
so up to the longest length run), the first n from which its memory is below full attention's,
and the least-squares slope of log(time) and log(memory) against log(n) over the lengths run
(about 1 for the sliding-window and linear kernels, 1.5 strided, 2 for quadratic time).
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time

from benchmarks.attention import _reset_peak, _rss_kib

BATCH, HEADS, HEAD_DIM = 1, 4, 64
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (128, 256)
DEFAULT_WINDOW = 256
QUICK_WINDOW = 32
GLOBAL_TOKENS = 4
NUM_FEATURES = 128
METHODS = ("full", "full_chunked", "sliding_window", "strided", "longformer", "block_sparse",
           "bigbird", "linear_elu", "linear_favor", "linear_fourier")
# How time per call grows with n, to extrapolate the guard's prediction to the next length.
TIME_EXPONENT = {"full": 2.0, "full_chunked": 2.0, "strided": 1.5}
DEFAULT_TIME_BUDGET_S = 60.0
DEFAULT_MEMORY_LIMIT_MIB = 4096.0
# A method whose single call is longer than this is not interleaved: its memory process' timed
# call is reported instead.
LONG_CALL_S = 5.0
ROUND_BUDGET_S = 20.0
MIN_ROUNDS, MAX_ROUNDS = 3, 9
WARM_UP_LENGTH = 128


# === The methods ===


def _layout(n_blocks, causal):
    """Local blocks (the block itself and its neighbours; causal: itself and the previous one)
    plus the first block column, `(1, n_blocks, n_blocks)`."""
    import numpy as np

    layout = np.eye(n_blocks, dtype=bool) | np.eye(n_blocks, k=-1, dtype=bool)
    if not causal:
        layout |= np.eye(n_blocks, k=1, dtype=bool)
    layout[:, 0] = True
    return layout[None]


def full_kernel(length, causal):
    """The kernel `auto` picks for full attention at this length on this backend."""
    import numpy as np
    from keras import ops

    from kzoo.layers import attention_kernel

    q = ops.convert_to_tensor(np.zeros((BATCH, length, HEADS, HEAD_DIM), "float32"))
    return attention_kernel(q, q, q, is_causal=causal)


def attend_function(method, length, window, causal):
    """`(attend(q, k, v), label)`: the method's attention at this length, and what it runs
    (the kernel of full attention, the stride, the global tokens...)."""
    from kzoo.layers import (bigbird_attention, block_sparse_attention, dot_product_attention,
                             linear_attention, longformer_attention, sliding_window_attention,
                             strided_attention)

    if method not in METHODS:
        raise ValueError(f"`method` must be one of {list(METHODS)}; got method={method!r}.")
    if method == "full":
        return (lambda q, k, v: dot_product_attention(q, k, v, is_causal=causal),
                full_kernel(length, causal))
    if method == "full_chunked":
        return (lambda q, k, v: dot_product_attention(q, k, v, is_causal=causal,
                                                      kernel="chunked"), "chunked")
    if method == "sliding_window":
        return (lambda q, k, v: sliding_window_attention(q, k, v, window, causal=causal),
                f"w={window}")
    if method == "strided":
        stride = max(1, int(round(math.sqrt(length))))
        return (lambda q, k, v: strided_attention(q, k, v, stride, causal=causal),
                f"stride={stride}")
    if method == "longformer":
        positions = sorted({i * length // GLOBAL_TOKENS for i in range(GLOBAL_TOKENS)})
        return (lambda q, k, v: longformer_attention(q, k, v, window, positions, causal=causal),
                f"w={window}, {len(positions)} global")
    if method == "block_sparse":
        layout = _layout(-(-length // window), causal)
        return (lambda q, k, v: block_sparse_attention(q, k, v, layout, window, causal=causal),
                f"block={window}, local+col 0")
    if method == "bigbird":
        return (lambda q, k, v: bigbird_attention(q, k, v, window, seed=0, causal=causal),
                f"block={window}, 3+1+2r")
    feature_map = method[len("linear_"):]
    extra = {} if feature_map == "elu" else {"num_features": NUM_FEATURES}
    label = "elu+1" if feature_map == "elu" else f"{NUM_FEATURES} features"
    return (lambda q, k, v: linear_attention(q, k, v, feature_map=feature_map, causal=causal,
                                             **extra), label)


def _inputs(length):
    import numpy as np
    from keras import ops

    rng = np.random.default_rng(0)
    shape = (BATCH, length, HEADS, HEAD_DIM)
    return tuple(ops.convert_to_tensor(rng.normal(size=shape).astype("float32"))
                 for _ in range(3))


def compile_call(attend, q, k, v, backward):
    """A no-argument function that runs `attend(q, k, v)` (or its gradient with respect to q,
    k and v of the output's sum) compiled for the backend, waits for it and returns it (a
    tensor, or a tuple/list of three)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if backward:
            fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
        else:
            fn = jax.jit(attend)
        return lambda: jax.block_until_ready(fn(q, k, v))
    if backend == "tensorflow":
        import tensorflow as tf

        if backward:
            @tf.function(jit_compile=True)
            def fn(q, k, v):
                with tf.GradientTape() as tape:
                    tape.watch([q, k, v])
                    loss = tf.reduce_sum(attend(q, k, v))
                return tape.gradient(loss, [q, k, v])
        else:
            fn = tf.function(attend, jit_compile=True)

        def run():
            out = fn(q, k, v)
            (out[0] if isinstance(out, list) else out).numpy()
            return out

        return run
    import torch

    qs, ks, vs = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))

    def run():
        if backward:
            for t in (qs, ks, vs):
                t.grad = None
            attend(qs, ks, vs).sum().backward()
            return qs.grad, ks.grad, vs.grad
        with torch.no_grad():
            return attend(qs, ks, vs)

    return run


def build(method, length, window, causal, backward):
    """`(run, label)` for one method at one length."""
    attend, label = attend_function(method, length, window, causal)
    return compile_call(attend, *_inputs(length), backward), label


# === Guards ===


def local_slope(points):
    """Slope of log(y) against log(n) between the last two points `(n, y)` with y > 0, or
    None."""
    pts = [(n, y) for n, y in points if y is not None and y > 0 and math.isfinite(y)]
    if len(pts) < 2:
        return None
    (n0, y0), (n1, y1) = pts[-2], pts[-1]
    return math.log(y1 / y0) / math.log(n1 / n0)


def guard(method, length, history, *, time_budget_s, memory_limit_mib, kernel=None):
    """Why `method` should not run at `length` (a sentence), or None to run it.

    `history` is the list of `(n, seconds_per_call, extra_mib)` measured at shorter lengths,
    ascending. Time is extrapolated from the last point with the method's exponent (2 full,
    1.5 strided, 1 otherwise); memory with the slope of the last two points clipped to
    [1, 2] (1 with a single point). With the reference kernel the `(batch, heads, n, n)`
    float32 score tensor alone must also fit.

    Example:
    >>> guard("full", 32768, [(16384, 20.0, 100.0)], time_budget_s=60, memory_limit_mib=4096)
    'predicted 80 s per call > 60 s budget'
    """
    if kernel == "reference":
        scores_mib = BATCH * HEADS * length * length * 4 / 2**20
        if scores_mib > memory_limit_mib:
            return (f"the (n, n) scores alone take {scores_mib:.0f} MiB > "
                    f"{memory_limit_mib:.0f} MiB limit")
    if not history:
        return None
    n0, t0, m0 = history[-1]
    ratio = length / n0
    if t0 is not None and math.isfinite(t0):
        predicted = t0 * ratio ** TIME_EXPONENT.get(method, 1.0)
        if predicted > time_budget_s:
            return f"predicted {predicted:.0f} s per call > {time_budget_s:.0f} s budget"
    if m0 is not None and math.isfinite(m0) and m0 > 0:
        slope = local_slope([(n, m) for n, _, m in history])
        slope = 1.0 if slope is None else min(max(slope, 1.0), 2.0)
        predicted = m0 * ratio ** slope
        if predicted > memory_limit_mib:
            return f"predicted {predicted:.0f} MiB > {memory_limit_mib:.0f} MiB limit"
    return None


# === Measuring (children) ===


def measure_lengths(method, lengths, window, causal, backward, *, time_budget_s,
                    memory_limit_mib, emit=None, runs=None):
    """Measure one method at each length, upward, in this process: one row per length (a
    `skipped` reason instead of numbers where the guard says so). `emit(row)` sees each row as
    soon as it is measured. With a dict `runs` (in-process use), the compiled calls are kept
    there, keyed by (method, length), and the fresh-process warm-up is left out."""
    import keras

    rows, history, stop = [], [], None
    first_call = keras.backend.backend() == "tensorflow"
    # A full collection is cheap in a fresh process, seconds in a test process full of
    # objects: in-process (memory only indicative there) it is left out.
    collect = gc.collect if runs is None else (lambda: None)
    if runs is None:
        # The process' one-time start-up (thread pools, the compiler's first use) is not
        # counted.
        build(method, WARM_UP_LENGTH, min(window, 32), causal, backward)[0]()
    for length in lengths:
        row = {"method": method, "length": length, "pass": "fwd+bwd" if backward else "fwd",
               "causal": causal, "window": window}
        kernel = full_kernel(length, causal) if method.startswith("full") else None
        if method == "full_chunked" and kernel == "chunked":
            row["skipped"] = "= full (auto runs the chunked kernel)"
        elif stop is not None:
            row["skipped"] = stop
        else:
            reason = guard(method, length, history, time_budget_s=time_budget_s,
                           memory_limit_mib=memory_limit_mib,
                           kernel="chunked" if method == "full_chunked" else kernel)
            if reason is not None:
                row["skipped"] = stop = reason
        if "skipped" not in row:
            run, label = build(method, length, window, causal, backward)
            row["label"] = label
            if first_call:
                collect()
                _reset_peak()
                before, _ = _rss_kib()
                run()
                _, first_peak = _rss_kib()
            else:
                run()  # warm-up: compilation and first allocations
            collect()
            _reset_peak()
            if not first_call:
                before, _ = _rss_kib()
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            _, peak = _rss_kib()
            if first_call:
                peak = max(peak, first_peak)
            row["ms"] = 1000 * seconds
            row["extra_mib"] = max(peak - before, 0) / 1024
            row["timing"] = "single"
            history.append((length, seconds, row["extra_mib"]))
            if runs is not None:
                runs[(method, length)] = run
            del run
            collect()
        rows.append(row)
        if emit is not None:
            emit(row)
    return rows


def rounds_for(seconds_per_call):
    """Interleaved rounds for methods whose calls take these seconds in total per round."""
    total = sum(seconds_per_call)
    if total <= 0:
        return MAX_ROUNDS
    return int(min(max(ROUND_BUDGET_S / total, MIN_ROUNDS), MAX_ROUNDS))


def interleaved_times(length, methods, window, causal, backward, rounds, runs=None):
    """Median ms of each method at one length, calls interleaved method by method (compiled
    here, or taken from `runs` keyed by (method, length))."""
    runs = {m: (runs or {}).get((m, length)) or build(m, length, window, causal, backward)[0]
            for m in methods}
    for run in runs.values():
        run()  # warm-up: compilation and first allocations
    times = {m: [] for m in methods}
    for _ in range(rounds):
        for method, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[method].append(time.perf_counter() - t0)
    return {m: 1000 * sorted(t)[len(t) // 2] for m, t in times.items()}


def interleave_plan(rows):
    """{length: (methods to interleave, rounds)} from memory rows: the measured methods whose
    single call took at most LONG_CALL_S."""
    plan = {}
    for length in sorted({r["length"] for r in rows}):
        quick = [r for r in rows if r["length"] == length and "ms" in r
                 and r["ms"] <= 1000 * LONG_CALL_S]
        if len(quick) >= 1:
            plan[length] = ([r["method"] for r in quick],
                            rounds_for([r["ms"] / 1000 for r in quick]))
    return plan


def apply_times(rows, length, medians):
    for r in rows:
        if r["length"] == length and r["method"] in medians:
            r["ms"] = medians[r["method"]]
            r["timing"] = "interleaved"


def _child_args(args):
    common = ["--window", str(args.window), "--time-budget", str(args.time_budget),
              "--memory-limit", str(args.memory_limit)]
    return common + (["--bidirectional"] if args.bidirectional else [])


def _child_memory(args):
    measure_lengths(args.method, args.lengths, args.window, not args.bidirectional,
                    args.backward, time_budget_s=args.time_budget,
                    memory_limit_mib=args.memory_limit,
                    emit=lambda row: print("ROW " + json.dumps(row), flush=True))


def _child_times(args):
    plan = json.loads(args.plan)
    for length, (methods, rounds) in sorted(plan.items(), key=lambda kv: int(kv[0])):
        medians = interleaved_times(int(length), methods, args.window, not args.bidirectional,
                                    args.backward, rounds)
        print("TIMES " + json.dumps({"length": int(length), "medians": medians}), flush=True)


def _run_child(env, cmd, timeout):
    """Run a child; its tagged stdout lines (also those printed before a timeout), and a
    reason when it did not finish."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, failure = proc.stdout, None
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-2:])
            failure = f"process died (exit {proc.returncode}): {tail[-160:]}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        failure = f"process ran past {timeout:.0f} s"
    return out.splitlines(), failure


def _log(row, backend):
    numbers = (f"{row['ms']:10.1f} ms {row['extra_mib']:8.1f} MiB {row.get('label', '')}"
               if "ms" in row else f"— {row.get('skipped', '')}")
    print(f"  {backend:10s} {row['pass']:7s} {row['length']:6d} {row['method']:15s} {numbers}",
          file=sys.stderr, flush=True)


def run_backend(backend, args, passes):
    """All rows of one backend, each (method, pass) measured in its own process."""
    env = dict(os.environ, KERAS_BACKEND=backend, MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="0", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.getcwd())
    lengths = ",".join(map(str, args.lengths))
    # A child walks every length; it may take the budget at each one, plus compilation.
    timeout = len(args.lengths) * (4 * args.time_budget + 120)
    rows = []
    for backward in passes:
        pass_rows = []
        for method in METHODS:
            cmd = [sys.executable, "-m", "benchmarks.long_context", "--child-memory",
                   "--method", method, "--lengths", lengths] + _child_args(args)
            cmd += ["--backward"] if backward else []
            lines, failure = _run_child(env, cmd, timeout)
            got = [json.loads(x[4:]) for x in lines if x.startswith("ROW ")]
            done = {r["length"] for r in got}
            for length in args.lengths:
                if length not in done:
                    got.append({"method": method, "length": length,
                                "pass": "fwd+bwd" if backward else "fwd",
                                "causal": not args.bidirectional, "window": args.window,
                                "skipped": failure or "not reported"})
            for r in sorted(got, key=lambda r: r["length"]):
                r["backend"] = backend
                _log(r, backend)
                pass_rows.append(r)
        # Times: interleaved, one process for the pass (the memory processes' single call
        # stays where a method is too slow to interleave or the process fails).
        plan = interleave_plan(pass_rows)
        cmd = [sys.executable, "-m", "benchmarks.long_context", "--child-times",
               "--plan", json.dumps(plan)] + _child_args(args)
        cmd += ["--backward"] if backward else []
        t_env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
        lines, failure = _run_child(t_env, cmd, timeout * 2)
        for x in lines:
            if x.startswith("TIMES "):
                got = json.loads(x[6:])
                apply_times(pass_rows, got["length"], got["medians"])
        if failure:
            print(f"  {backend} interleaved timing: {failure}", file=sys.stderr, flush=True)
        rows += pass_rows
    return rows


def run_in_process(args, passes, runs=None):
    """Everything in this process (the backend already imported): memory is then only
    indicative, as earlier methods' buffers and compiled code stay around. For `--quick`.
    The compiled calls are left in `runs`, keyed by (method, length, backward)."""
    import keras

    backend = keras.backend.backend()
    rows = []
    for backward in passes:
        pass_rows, pass_runs = [], {}
        for method in METHODS:
            for r in measure_lengths(method, args.lengths, args.window, not args.bidirectional,
                                     backward, time_budget_s=args.time_budget,
                                     memory_limit_mib=args.memory_limit, runs=pass_runs):
                r["backend"] = backend
                pass_rows.append(r)
        for length, (methods, rounds) in interleave_plan(pass_rows).items():
            apply_times(pass_rows, length, interleaved_times(
                length, methods, args.window, not args.bidirectional, backward,
                1 if args.quick else rounds, runs=pass_runs))
        if runs is not None:
            runs.update({(m, n, backward): run for (m, n), run in pass_runs.items()})
        rows += pass_rows
    return rows


# === Report ===


def fit_slope(points):
    """Least-squares slope of log(y) against log(n) over the points `(n, y)` with finite
    y > 0; None with fewer than two such lengths.

    Example:
    >>> round(fit_slope([(1000, 1.0), (2000, 4.0), (4000, 16.0)]), 6)
    2.0
    """
    pts = [(math.log(n), math.log(y)) for n, y in points
           if y is not None and math.isfinite(y) and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return (sum((x - mx) * (y - my) for x, y in pts)
            / sum((x - mx) ** 2 for x, _ in pts))


def crossover(lengths, values, full_values):
    """The first length from which `values` stays below `full_values` up to the longest
    length (both dicts length -> number; a missing or NaN method value never counts as below,
    an infinite full value — full attention skipped by a guard — always does). None if there
    is no such length.

    Example:
    >>> crossover([1, 2, 4], {1: 5.0, 2: 3.0, 4: 2.0}, {1: 4.0, 2: 4.0, 4: 8.0})
    2
    """
    first = None
    for n in sorted(lengths):
        v, f = values.get(n), full_values.get(n)
        below = (v is not None and math.isfinite(v) and f is not None
                 and not math.isnan(f) and v < f)
        if below:
            first = n if first is None else first
        else:
            first = None
    return first


def _value(row, field):
    if row is None or field not in row:
        return None
    return row[field]


def full_reference(rows, field):
    """{length: value of full attention}. Where a guard skipped it, infinite time (too slow or
    too large to run) and, when the guard was its memory, infinite memory; missing where it
    failed otherwise.

    Example:
    >>> full_reference([{"method": "full", "length": 8, "skipped": "predicted 9 s per call"}],
    ...                "ms")
    {8: inf}
    """
    out = {}
    for r in rows:
        if r["method"] != "full":
            continue
        reason = r.get("skipped", "")
        too_large = "MiB" in reason
        too_slow = reason.startswith("predicted") and " s per call" in reason
        if field in r:
            out[r["length"]] = r[field]
        elif too_large or (too_slow and field == "ms"):
            out[r["length"]] = math.inf
    return out


def ratio(a, b):
    if a is None or b is None or not math.isfinite(b) or b <= 0:
        return None
    return a / b


def _cell(row, full_row):
    if row is None:
        return "—"
    if "ms" not in row:
        return f"— ({row.get('skipped', 'not run')})"
    t_ratio = ratio(row["ms"], _value(full_row, "ms"))
    m_ratio = ratio(row["extra_mib"], _value(full_row, "extra_mib"))
    star = "*" if row.get("timing") == "single" else ""
    t = f"{row['ms']:.1f}{star} ms" + (f" ({t_ratio:.2f}×)" if t_ratio is not None else "")
    m = f"{row['extra_mib']:.0f} MiB" + (f" ({m_ratio:.2f}×)" if m_ratio is not None else "")
    return f"{t} · {m}"


def _slope_text(s):
    return "—" if s is None else f"{s:.2f}"


def table(rows):
    """Markdown table of one (backend, pass): a line per method, a column per length with
    `ms (ratio to full) · MiB (ratio to full)`, then the log-log slopes of time and memory."""
    lengths = sorted({r["length"] for r in rows})
    by = {(r["method"], r["length"]): r for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    head = ["method", "runs"] + [f"n={n}" for n in lengths] + ["time slope", "memory slope"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        mine = [by.get((m, n)) for n in lengths]
        labels = sorted({r.get("label", "") for r in mine if r is not None and r.get("label")})
        cells = [_cell(by.get((m, n)), by.get(("full", n))) for n in lengths]
        t_slope = fit_slope([(n, _value(r, "ms")) for n, r in zip(lengths, mine)])
        m_slope = fit_slope([(n, _value(r, "extra_mib")) for n, r in zip(lengths, mine)
                             if (_value(r, "extra_mib") or 0) >= 1.0])
        lines.append("| " + " | ".join([m, ", ".join(labels) if m != "strided" else
                                        "stride≈√n"] + cells
                                       + [_slope_text(t_slope), _slope_text(m_slope)]) + " |")
    return "\n".join(lines)


def crossover_lines(rows):
    """One sentence per method (full attention's own excepted): where it becomes faster than
    full attention and where its memory falls below full attention's."""
    lengths = sorted({r["length"] for r in rows})
    full_t, full_m = full_reference(rows, "ms"), full_reference(rows, "extra_mib")
    lines = []
    for m in METHODS:
        if m == "full" or not any(r["method"] == m for r in rows):
            continue
        mine = {r["length"]: r for r in rows if r["method"] == m}
        t = crossover(lengths, {n: _value(r, "ms") for n, r in mine.items()}, full_t)
        mem = crossover(lengths, {n: _value(r, "extra_mib") for n, r in mine.items()}, full_m)

        def where(n):
            return "not within the lengths run" if n is None else f"crosses below full at n = {n}"

        lines.append(f"- {m}: time {where(t)}; memory {where(mem)}")
    return "\n".join(lines)


def report(rows, backends, passes, causal, window):
    out = [f"Long-context attention, B={BATCH} H={HEADS} head_dim={HEAD_DIM}, float32, "
           f"{'causal' if causal else 'bidirectional'}, window {window}; CPU "
           f"({os.cpu_count()} cores). Cells: median ms (ratio to full) · peak extra MiB of "
           "one call (ratio to full); * = one call, not interleaved; slopes: least squares of "
           "log(value) on log(n) over the lengths run."]
    for backend in backends:
        for backward in passes:
            name = "fwd+bwd" if backward else "fwd"
            mine = [r for r in rows if r["backend"] == backend and r["pass"] == name]
            if not mine:
                continue
            out += ["", f"### {backend}, {name}", "", table(mine), "", crossover_lines(mine)]
    return "\n".join(out)


def _lengths(text):
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] <= 0:
        raise ValueError(f"`--lengths` must be positive integers separated by commas; got "
                         f"--lengths={text!r}.")
    return lengths


def parse_args(argv=None):
    """The command line (see the module docstring), checked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-backends", action="store_true")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--passes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S,
                        help="seconds per call above which a method stops (predicted)")
    parser.add_argument("--memory-limit", type=float, default=DEFAULT_MEMORY_LIMIT_MIB,
                        help="MiB above which a method stops (predicted)")
    parser.add_argument("--json", default=None, help="also write the raw rows here")
    parser.add_argument("--quick", action="store_true", help="tiny lengths and window")
    parser.add_argument("--in-process", action="store_true",
                        help="no child processes (memory only indicative)")
    parser.add_argument("--from-json", default=None,
                        help="print the report of rows saved by --json, measuring nothing")
    parser.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-times", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.window is None:
        args.window = QUICK_WINDOW if args.quick else DEFAULT_WINDOW
    if args.window <= 0:
        raise ValueError(f"`--window` must be a positive integer; got --window={args.window}.")
    if args.lengths is None:
        args.lengths = ",".join(map(str, QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS))
    args.lengths = _lengths(args.lengths)
    names = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not names or any(p not in ("fwd", "fwd+bwd") for p in names):
        raise ValueError(f"`--passes` must list 'fwd' and/or 'fwd+bwd'; got "
                         f"--passes={args.passes!r}.")
    args.pass_list = [p == "fwd+bwd" for p in names]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child_memory:
        return _child_memory(args)
    if args.child_times:
        return _child_times(args)
    passes = args.pass_list
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        passes = [p for p in (False, True)
                  if any(r["pass"] == ("fwd+bwd" if p else "fwd") for r in rows)]
        text = report(rows, backends, passes, rows[0]["causal"], rows[0]["window"])
        print(text)
        return text
    if args.in_process:
        import keras

        backends = (keras.backend.backend(),)
        rows = run_in_process(args, passes)
    else:
        backends = ("jax", "torch", "tensorflow") if args.all_backends else (
            os.environ.get("KERAS_BACKEND", "jax"),)
        rows = []
        for backend in backends:
            rows += run_backend(backend, args, passes)
            if args.json:  # what is measured so far survives an interrupted run
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    text = report(rows, backends, passes, not args.bidirectional, args.window)
    print(text)
    return text


if __name__ == "__main__":
    main()
