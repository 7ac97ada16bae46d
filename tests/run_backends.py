"""`make test`: the suite on JAX, PyTorch and TensorFlow at the same time.

Run one after another, the three backends left a core idle for much of the time: each pytest
run starts by importing three frameworks, waits on the subprocesses of its training and
crash-safety tests, and ends on its slowest worker. Here the three runs start together, each in
its own `pytest` process with its own pytest-xdist workers and its own temporary directory, all
at the same priority, so the machine's cores stay busy until the last one ends. JAX's workers
take whole files (`--dist loadfile`): most of a JAX test's CPU is XLA compiling programs for the
shapes of its file's models, and a worker that runs the whole file compiles each of them once
instead of both workers compiling them. Each run's output goes to `.test-logs/<backend>.log`; a line every minute says how far
each has got, and at the end each run's summary (and, for a failed run, its failures) is
printed. The exit status is non-zero if any run failed.

Usage: python tests/run_backends.py [--workers jax=2,torch=1,tensorflow=2] [pytest args...]
"""

import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("jax", "tensorflow", "torch")
# TensorFlow with one worker spends less CPU (test_gpt + test_t5: 226 against 268 CPU-s, the
# second worker's imports and fixtures saved) but cannot use the second core once the other
# runs end: in a whole run it had reached 18% of its tests after 19 minutes; not used.
DEFAULT_WORKERS = {"jax": 2, "tensorflow": 2, "torch": 1}
# How pytest-xdist hands tests to the workers. JAX: whole files, which cut the CPU of
# test_bert + test_blocks + test_t5 from 142 to 129 s on a quiet machine, the compilation cache
# below on in both (the eager ops and initializers of a file's models compile once, in one
# worker). TensorFlow and torch compile nothing per shape: one test
# at a time, which balances the workers best.
DIST = {"jax": "loadfile", "tensorflow": "load", "torch": "load"}
# Whole files in the order tests/conftest.py sorts them (heavy ones first), not xdist's order
# by number of tests.
DIST_OPTIONS = {"loadfile": ("--no-loadscope-reorder",)}
# The slowest tests of each run, listed at the end of its log (where time goes, run to run).
DURATIONS = 25
LOG_DIR = os.path.join(ROOT, ".test-logs")
HEARTBEAT_S = 60
# JAX's persistent compilation cache, new for each run and shared by its workers and by the
# training subprocesses its tests start, so that a program compiled in one process is not
# compiled again in another (every size of program: the thresholds are 0). It cut the CPU of
# test_crash_safety.py + test_training.py from 82 to 67 s, most of it in the subprocesses
# (31 -> 18 s), which compile the same training step each time they are started.
JAX_CACHE_DIR = os.path.join(LOG_DIR, "jax-compilation-cache")
JAX_CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": JAX_CACHE_DIR,
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
PROGRESS = re.compile(r"\[\s*(\d+)%\]")
RESULT = re.compile(r"\d+ (passed|failed|error)")


def parse_workers(text):
    """`"jax=2,torch=1"` -> {"jax": 2, "torch": 1} (backends left out keep their default)."""
    workers = dict(DEFAULT_WORKERS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        if name not in BACKENDS or not count.isdigit() or int(count) < 1:
            raise SystemExit(
                f"--workers: each item must be BACKEND=N with BACKEND in {list(BACKENDS)} and "
                f"N >= 1; got {item!r}.")
        workers[name] = int(count)
    return workers


def progress(log_path):
    """The last `[ NN%]` pytest -q printed to a log, or None."""
    try:
        with open(log_path, errors="replace") as f:
            found = PROGRESS.findall(f.read()[-4000:])
    except OSError:
        return None
    return int(found[-1]) if found else None


def summary(log_path, failed):
    """The lines to print for one finished run: its failures (when it failed) and summary."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    if failed:
        start = text.find("= FAILURES =")
        start = text.rfind("\n", 0, start) + 1 if start >= 0 else max(0, len(text) - 6000)
        return text[start:].rstrip()
    # pytest's last line ("N passed ... in T s"); TensorFlow may log after it.
    results = [line for line in text.splitlines() if RESULT.search(line)]
    if results:
        return results[-1]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def prebuild_graphormer_extension():
    """Build transformers' Graphormer Cython module once, before three pytest runs could
    compile it into ~/.pyxbld at the same time (see tests/conftest.py)."""
    subprocess.run([sys.executable, "-c",
                    "import transformers.models.deprecated.graphormer.collating_graphormer"],
                   cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    workers = dict(DEFAULT_WORKERS)
    if argv[:1] == ["--workers"]:
        workers = parse_workers(argv[1])
        argv = argv[2:]
    os.makedirs(LOG_DIR, exist_ok=True)
    shutil.rmtree(JAX_CACHE_DIR, ignore_errors=True)  # nothing carried over from a past run
    prebuild_graphormer_extension()
    runs = {}
    started = time.time()
    for backend in BACKENDS:
        log_path = os.path.join(LOG_DIR, f"{backend}.log")
        command = [sys.executable, "-m", "pytest", "-q", "-n", str(workers[backend]),
                   "--dist", DIST[backend], *DIST_OPTIONS.get(DIST[backend], ()),
                   f"--durations={DURATIONS}",
                   "--basetemp", os.path.join(LOG_DIR, f"tmp-{backend}"), *argv]
        env = dict(os.environ, KERAS_BACKEND=backend)
        if backend == "jax":
            env.update(JAX_CACHE_ENV)
        log = open(log_path, "w")
        runs[backend] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT), log, log_path)
        print(f"=== KERAS_BACKEND={backend}: pytest -n {workers[backend]} -> {log_path}",
              flush=True)
    codes, ended = {}, {}
    last_beat = time.time()
    while len(codes) < len(runs):
        time.sleep(1)
        for backend, (proc, log, log_path) in runs.items():
            if backend not in codes and proc.poll() is not None:
                codes[backend], ended[backend] = proc.returncode, time.time() - started
                log.close()
                state = "passed" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
                print(f"=== KERAS_BACKEND={backend} {state} after {ended[backend]:.0f} s",
                      flush=True)
        if time.time() - last_beat >= HEARTBEAT_S and len(codes) < len(runs):
            last_beat = time.time()
            parts = []
            for backend, (_, _, log_path) in runs.items():
                if backend in codes:
                    parts.append(f"{backend} done")
                else:
                    done = progress(log_path)
                    parts.append(f"{backend} {'starting' if done is None else f'{done}%'}")
            print(f"... {time.time() - started:.0f} s: " + ", ".join(parts), flush=True)
    for backend, (_, _, log_path) in runs.items():
        print(f"\n=== KERAS_BACKEND={backend} ({ended[backend]:.0f} s)")
        print(summary(log_path, codes[backend] != 0))
    failed = [b for b, code in codes.items() if code != 0]
    print(f"\n=== all three backends in {time.time() - started:.0f} s: "
          + ("passed" if not failed else f"FAILED on {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
