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
