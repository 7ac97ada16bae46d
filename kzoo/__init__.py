"""kzoo: a Keras 3 transformer model zoo for JAX, PyTorch and TensorFlow."""

__version__ = "0.1.0"

from kzoo import layers, presets, registry, schedules  # noqa: F401,E402
