import glob
import importlib.util
import os
import shutil
import tempfile

# === Compilation settings for the test session (before keras / jax / tensorflow load) ===
#
# Most of a JAX test's time is XLA compiling tiny programs, not running them: each eager op
# and each random initialiser per new shape, each new model's predict / train step. One
# setting cuts that without changing what runs (XLA's own flags stay the defaults, so the
# tests compile exactly what users' code compiles):
#
# - A persistent JAX compilation cache shared by the whole session: the pytest-xdist
#   workers and the subprocesses some tests start (crash safety, training resume, import
#   probes) read what another process already compiled, and a model rebuilt identically in
#   a later test finds its predict / train step there. The key is the program itself (the
#   HLO without debug names, the jax / jaxlib version, the XLA flags, the device), so a hit
#   runs the executable a fresh compile would have produced. By default the cache is a
#   temporary directory made by the first process of a session and removed at its end, so
#   every run starts cold (as CI does); set JAX_COMPILATION_CACHE_DIR to keep one across
#   runs.
_CACHE_OWNER = "KZOO_TEST_JAX_CACHE_OWNER"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kzoo-jax-cache-")
    os.environ[_CACHE_OWNER] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
if importlib.util.find_spec("filelock") is not None:
    # A size limit turns on jax's file lock: a worker never reads an entry another one is
    # still writing (the limit itself is far above what a session writes, ~100 MB).
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


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


def pytest_unconfigure(config):
    """The process that made the session's compilation cache removes it."""
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
