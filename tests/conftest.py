import ctypes
import glob
import importlib.util
import os
import zlib

# JAX tests compile hundreds of small XLA programs (eager ops, one a shape) and spend most of
# their time compiling. XLA's CPU backend at optimisation level 1 instead of its default cut
# the JAX tests' CPU time by 12% (tests/test_bert.py + test_vit.py + the chunked-kernel
# gradient tests: 167 -> 147 s of CPU) with the same results; TensorFlow gained 3%, so it is
# left alone. Level 0 cut a quarter but made the JAX chunked kernel's gradients NaN in
# tests/test_attention.py (test_chunked_multi_block_forward_and_gradients[head_bias_broadcast,
# key_bias_broadcast]): a NaN that the optimised program does not compute, so level 0 is not
# used.
# XLA's newer CPU fusion emitters (`--xla_cpu_use_fusion_emitters`, on by default in jaxlib
# 0.10) take longer to compile a small program than the older ones: turning them off cut the
# compile work of 40 eager programs from 12.8 to 8.3 CPU-s, test_bert.py's CPU from 49.7 to
# 41.9 s, and the first 267 tests of the JAX suite from 176 to 142 CPU-s, with the same results.
# A profile of test_bert.py (jax_log_compiles) showed where the rest goes: 87% of its CPU is
# XLA compiling, 40% of that the per-shape programs of the weight initializers (normal or
# uniform numbers, then scale and shift: three programs for each new weight shape), 23% whole
# train/predict steps, the rest eager ops of new shapes.
# Set here, before JAX starts, so that subprocesses started by tests inherit them too.
_JAX_TEST_FLAGS = {"xla_backend_optimization_level": "1", "xla_cpu_use_fusion_emitters": "false"}
if os.environ.get("KERAS_BACKEND") == "jax":
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_flags] + [f"--{name}={value}" for name, value in _JAX_TEST_FLAGS.items()
                    if name not in _flags]).strip()

# One compute thread per pytest-xdist worker. `make test` runs five workers (three backends)
# on the machine's cores at once; left at their defaults, torch's OpenMP threads and
# TensorFlow's intra-op pool spin while they wait for cores that the other workers hold. With
# one thread each, the same subsets of the suite (test_bert + test_vit + test_blocks +
# test_training; test_t5 + test_generation + test_presets), all three backends at once as
# `make test` runs them, took 230 -> 206 s and 289 -> 254 s of wall time (442 -> 397 and
# 552 -> 484 CPU-s). XLA's own thread pool is left alone: turning it off
# (`--xla_cpu_multi_thread_eigen=false`) made the JAX run slower. A value the user set wins;
# subprocesses started by tests inherit these. Not applied outside xdist (one pytest process
# has the cores to itself).
_ONE_THREAD_PER_WORKER = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                          "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name, _value in _ONE_THREAD_PER_WORKER.items():
        os.environ.setdefault(_name, _value)

# The torch decode loop's compiled step (`kzoo.layers.compiled_decode`) costs 4-15 s of
# compilation per model shape; the suite's many small models would pay it over and over, so
# it runs off here except in tests/test_compiled_decode.py, which turns it on and checks it
# against the eager loop and the full forward pass.
os.environ.setdefault("KZOO_COMPILED_DECODE", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _release_memory():
    """Keras' global state, the backend's caches of compiled programs and the freed heap back to
    the system after each test file. Without it a worker's memory only grows (kzoo's allocator
    keeps freed memory for reuse, `kzoo.allocator`, and only fit/evaluate/predict give it back):
    in a `make test` run the five workers held 5.3, 5.7 (JAX), 7.0, 4.7 (TensorFlow) and 2.5
    (torch) GB after 50 minutes, the machine's 24 GB were full, the kernel dropped the page
    cache (the frameworks' own code) 7 million pages a minute, and the run took 3,303 s
    instead of ~1,800 with a test's subprocess past its 600 s timeout. Five JAX test files in
    one process (bert, efficient_hostile, attention_float16, moe, lora): peak 3,923 -> 1,884
    MiB, 3,920 -> 778 MiB at the end, CPU 203 -> 194 s."""
    # TensorFlow: the traced graphs of the file's models (and of plain Keras models trained
    # in it) go with them; `tf.custom_gradient` registrations would keep them
    # (kzoo.layers.gradients). A plain 3-layer Keras model built, fit, predicted and deleted
    # in a loop: +1.1 MiB an iteration without this, +0.24 with it.
    from kzoo.layers.gradients import adopt_custom_gradients

    adopt_custom_gradients()
    keras.backend.clear_session(free_memory=True)
    if keras.backend.backend() == "jax":
        import jax

        jax.clear_caches()  # compiled programs; JAX_COMPILATION_CACHE_DIR keeps them on disk
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True, scope="module")
def _memory_released_after_each_file():
    yield
    _release_memory()


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    yield
    keras.config.set_dtype_policy("float32")


def _graphormer_extension_built():
    """Whether pyximport's build of transformers' Graphormer module is there and newer than
    its source (then importing it builds nothing, and the ~5 s import of transformers in the
    main process can be skipped)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return True  # no transformers: nothing to build
    source = os.path.join(os.path.dirname(spec.origin), "models", "deprecated", "graphormer",
                          "algos_graphormer.pyx")
    if not os.path.exists(source):
        return True
    built = glob.glob(os.path.join(os.path.expanduser("~"), ".pyxbld", "lib*", "transformers",
                                   "models", "deprecated", "graphormer", "algos_graphormer*"))
    return any(os.path.getmtime(path) >= os.path.getmtime(source) for path in built)


# Files whose few tests do much work (training subprocesses, hypothesis searches): by test
# count they would come last, and one of them left a worker running alone at the end.
HEAVY_FILES = ("test_crash_safety.py", "test_properties.py", "test_training.py",
               "test_distribution.py", "test_presets.py", "test_demo.py", "test_inputs.py",
               "test_multihost.py", "test_distribution_cli.py")


# The order in which `spread` test cases are dealt to the backends: torch five times in seven,
# TensorFlow once, JAX once. A case costs JAX (compiling XLA programs for each new shape)
# several times what it costs torch: in `make test` of a13bec1 the JAX run spent 1,563 CPU-s,
# TensorFlow 968 and torch 337; dealt torch 3, TensorFlow 1, JAX 1 in 5 (790858a), JAX 1,360
# (301 of them spread cases), TensorFlow 789, torch 317, and JAX still ended last (tests done
# at 1,368 s; TensorFlow 1,081, torch 885). By Dec 3 TensorFlow's cases cost about what JAX's
# do (its tf.functions traced for each new shape, XLA for its decode loops): a per-test CPU
# log of `make test` (KZOO_TEST_CPU_LOG, a3abcba) had JAX 2,266 CPU-s over 2,267 tests,
# TensorFlow 2,027 over 2,338 and torch 593 over 2,538, so TensorFlow's second place in the
# deal went to torch (estimated from that log: TensorFlow -360 CPU-s, torch +100).
SPREAD_DEAL = ("torch", "tensorflow", "torch", "jax", "torch", "torch", "torch")
SPREAD_BACKENDS = ("jax", "torch", "tensorflow")


def _explicit_test_ids(config):
    """Whether the command line names single tests (`path::test` or `path::test[param]`):
    then what it names runs here, spread or not."""
    return any("::" in str(arg) for arg in config.args)


def spread_here(items, backend):
    """The `spread` tests (items) that run on `backend` in the default suite, as a set of node
    ids: a test function's items are dealt to the backends in the order of `SPREAD_DEAL`, in
    collection order, starting at a place in that order picked by a checksum of the
    function's name (so the functions with one item do not all land on the same backend).
    Cases marked `slow` themselves are not dealt. Every other item runs on one backend by
    default and on all three with `-m ""` (`make test-all`)."""
    by_function = {}
    for item in items:
        if (item.get_closest_marker("spread") is not None
                and item.get_closest_marker("slow") is None):  # a slow case stays slow
            by_function.setdefault(item.nodeid.split("[")[0], []).append(item)
    here = set()
    for function, function_items in by_function.items():
        start = zlib.crc32(function.encode())
        for index, item in enumerate(function_items):
            if SPREAD_DEAL[(start + index) % len(SPREAD_DEAL)] == backend:
                here.add(item.nodeid)
    return here


# Marks of tests that run on torch alone by default (`slow` on JAX and TensorFlow; `make
# test-all` runs them there too). `torch_path`: a path only PyTorch's loop takes (the compiled
# decode step, CUDA graphs, the decode fast path's own forms); on the other backends one
# unmarked test of its file checks that the path is not taken, and the marked ones would only
# run the Keras calls other tests check. `sweep`: a randomized parity sweep against
# transformers or keras-hub, whose converters and model code are the same on every backend: a
# drawn model costs JAX seconds of compiling and torch a tenth of one (each backend's numerics
# are checked against the same peers by the families' own parity tests, on all three).
TORCH_ONLY_MARKS = ("torch_path", "sweep")


def slow_off_torch_items(items, backend):
    """The items marked with one of `TORCH_ONLY_MARKS` that are `slow` on `backend`: all of
    them on JAX and TensorFlow, none on torch."""
    if backend == "torch":
        return []
    return [item for item in items
            if any(item.get_closest_marker(mark) is not None for mark in TORCH_ONLY_MARKS)]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`spread` tests dealt to another backend get the `slow` mark (so `-m "not slow"`, the
    default, leaves them out here), and so do `torch_path` and `sweep` tests on JAX and
    TensorFlow, before pytest's own hook selects by mark; then the items are put in
    `_order_heavy_first`'s order."""
    backend = keras.backend.backend()
    explicit = _explicit_test_ids(config)
    if not explicit:
        for item in slow_off_torch_items(items, backend):
            item.add_marker(pytest.mark.slow)
    deal = os.environ.get("KZOO_SPREAD", "1") != "0"  # KZOO_SPREAD=0: every case here
    if deal and backend in SPREAD_BACKENDS and not explicit:
        here = spread_here(items, backend)
        for item in items:
            if item.get_closest_marker("spread") is not None and item.nodeid not in here:
                item.add_marker(pytest.mark.slow)
    _order_heavy_first(items)


def pytest_report_header(config):
    return ("kzoo: tests marked `spread` run each of their cases on one backend by default "
            f"(dealt in the order {', '.join(SPREAD_DEAL)}); `make test-all` or `-m \"\"` "
            "runs them on all three")


def _order_heavy_first(items):
    """The heavy files above first, then the others by size, biggest first (a stable sort by
    file, so a file's tests stay together and in order): the longest work starts first.
    `make test` hands JAX's workers whole files in this order (tests/run_backends.py:
    `--dist loadfile --no-loadscope-reorder`), so the run no longer ends on a big file that one
    worker runs alone while the other has nothing left."""
    keys = {}

    def key(item):
        path = str(item.path)
        if path not in keys:
            keys[path] = (os.path.basename(path) not in HEAVY_FILES, -os.path.getsize(path))
        return keys[path]

    items.sort(key=key)


def pytest_configure(config):
    """Build transformers' Graphormer Cython module (pyximport) once, in the main process,
    before pytest-xdist starts its workers: two workers compiling it at the same time into the
    shared ~/.pyxbld delete each other's temporary files."""
    if hasattr(config, "workerinput") or _graphormer_extension_built():
        return
    try:
        import transformers.models.deprecated.graphormer.collating_graphormer  # noqa: F401
    except Exception:  # the tests that need it report the failure themselves
        pass


_CPU_LOG = os.environ.get("KZOO_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With KZOO_TEST_CPU_LOG=path, append each test's CPU seconds (this process' threads, plus
    the subprocesses it waited for), its id, the backend and the process' memory after it
    (MiB) to that file: a profile of the
    suite's work that, unlike `--durations`, does not change with the machine's load."""
    if not _CPU_LOG:
        yield
        return
    before = os.times()
    yield
    after = os.times()
    own = (after.user - before.user) + (after.system - before.system)
    children = ((after.children_user - before.children_user)
                + (after.children_system - before.children_system))
    with open(_CPU_LOG, "a") as log:
        log.write(f"{own + children:.3f}\t{own:.3f}\t{children:.3f}\t{item.nodeid}"
                  f"\t{keras.backend.backend()}\t{_rss_mib()}\n")


def _rss_mib():
    """This process' resident memory in MiB (Linux), or -1."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return -1
