import glob
import importlib.util
import os

# Compile tests' XLA programs (JAX, and subprocesses that tests start) with XLA's backend
# optimisation off. Test programs are tiny and compiled once or twice each, so compiling
# dominates: on this 2-core CPU the JAX run of test_bert/t5/vit/graphormer took 248 s of CPU
# with it, 326 s without (TensorFlow: no change), every figure passing as before. Set before
# Keras (and with it JAX) is imported; an XLA_FLAGS of your own wins, and `make test-all`
# runs with XLA's default optimisation (XLA_FLAGS="").
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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

