"""kzoo: a Keras 3 transformer model zoo for JAX, PyTorch and TensorFlow.

`import kzoo` makes every public submodule available as an attribute: `kzoo.checkpoints`,
`kzoo.convert`, `kzoo.distribution`, `kzoo.registry`, `kzoo.generation`, `kzoo.inputs`, `kzoo.interpret`,
`kzoo.data`, `kzoo.graphs`, `kzoo.layers`, `kzoo.lora`, `kzoo.losses`, `kzoo.models`,
`kzoo.presets`, `kzoo.quantize`, `kzoo.schedules`. None of them imports a framework that the current backend does not use
(heavy optional packages are imported when first used; see `kzoo._lazy_tensorflow` for
how Keras' own TensorFlow imports are kept off the JAX and torch backends).
"""

__version__ = "0.1.0"

import keras as _keras

from kzoo import _lazy_tensorflow

_lazy_tensorflow.install(_keras.backend.backend())

from kzoo import checkpoints  # noqa: E402
from kzoo import convert  # noqa: E402
from kzoo import data  # noqa: E402
from kzoo import distribution  # noqa: E402
from kzoo import export  # noqa: E402
from kzoo import generation  # noqa: E402
from kzoo import graphs  # noqa: E402
from kzoo import inputs  # noqa: E402
from kzoo import interpret  # noqa: E402
from kzoo import layers  # noqa: E402
from kzoo import lora  # noqa: E402
from kzoo import losses  # noqa: E402
from kzoo import models  # noqa: E402
from kzoo import presets  # noqa: E402
from kzoo import quantize  # noqa: E402
from kzoo import registry  # noqa: E402
from kzoo import schedules  # noqa: E402

# The public submodules (tests/test_import.py checks that every module of the package
# that does not start with "_" is listed here and imported above).
SUBMODULES = (
    "checkpoints", "convert", "data", "generation", "graphs", "inputs", "interpret", "layers",
    "distribution",
    "export",
    "lora",
    "losses",
    "models",
    "presets",
    "quantize",
    "registry",
    "schedules",
)
