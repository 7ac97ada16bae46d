import os

import keras
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    yield
    keras.config.set_dtype_policy("float32")


def pytest_configure(config):
    """Build transformers' Graphormer Cython module (pyximport) once, in the main process,
    before pytest-xdist starts its workers: two workers compiling it at the same time into the
    shared ~/.pyxbld delete each other's temporary files."""
    if hasattr(config, "workerinput"):
        return
    try:
        import transformers.models.deprecated.graphormer.collating_graphormer  # noqa: F401
    except Exception:  # the tests that need it report the failure themselves
        pass
