"""kzoo: a Keras 3 transformer model zoo for JAX, PyTorch and TensorFlow.

`import kzoo` makes every public submodule available as an attribute: `kzoo.allocator`,
`kzoo.checkpoints`, `kzoo.convert`, `kzoo.distribution`, `kzoo.fused_adam`, `kzoo.registry`,
`kzoo.generation`, `kzoo.inputs`, `kzoo.interpret`, `kzoo.data`, `kzoo.graphs`,
`kzoo.layers`, `kzoo.lora`, `kzoo.losses`, `kzoo.models`, `kzoo.presets`, `kzoo.quantize`,
`kzoo.schedules`. None of them
imports a framework that the current backend does not use (heavy optional packages are
imported when first used; see `kzoo._lazy_tensorflow` for how Keras' own TensorFlow imports
are kept off the JAX and torch backends). On Linux, `import kzoo` asks glibc's malloc to keep
freed memory for reuse (`kzoo.allocator`; `KZOO_KEEP_FREED_MEMORY=0` leaves it alone).
"""

__version__ = "0.1.0"

import keras as _keras

from kzoo import _lazy_tensorflow

_lazy_tensorflow.install(_keras.backend.backend())

from kzoo import allocator  # noqa: E402

allocator.apply_at_import()  # freed memory kept for reuse (glibc; see kzoo.allocator)

from kzoo import checkpoints  # noqa: E402
from kzoo import convert  # noqa: E402
from kzoo import data  # noqa: E402
from kzoo import distribution  # noqa: E402
from kzoo import export  # noqa: E402
from kzoo import fused_adam  # noqa: E402
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
    "allocator", "checkpoints", "convert", "data", "generation", "graphs", "inputs", "interpret",
    "layers",
    "distribution",
    "export",
    "fused_adam",
    "lora",
    "losses",
    "models",
    "presets",
    "quantize",
    "registry",
    "schedules",
)
