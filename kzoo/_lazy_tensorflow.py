"""Keep Keras from importing TensorFlow on the JAX and torch backends.

Why it is needed: Keras 3 refers to TensorFlow through a lazy module
(`keras.src.utils.module_utils.tensorflow`) whose `available` property *imports*
TensorFlow to find out whether it is installed. Three places ask it on every backend:

- `keras.src.saving.serialization_lib.serialize_keras_object` (and the legacy
  `json_utils`), to test `isinstance(obj, tf.TensorShape | tf.DType | tf.TypeSpec)`: every
  `keras.initializers.serialize`, `get_config` of a layer with an initializer, and every
  save goes through it, so `kzoo.presets.load("gpt_mini")` imported TensorFlow on torch;
- `keras.utils.set_random_seed`, to seed TensorFlow's generator too.

With TensorFlow installed (the full `make test` environment) that costs seconds of start-up,
hundreds of MB, and TensorFlow's C++ start-up lines on the terminal, under a backend that
never uses it.

What this does, on the JAX and torch backends only: those modules' `tf` name is replaced by
a view of the same lazy module whose `available` is True only when TensorFlow *has already
been imported* (by the user, `tf.data`, a preprocessing layer...). For the type checks this
changes nothing: no object can be a TensorFlow type before TensorFlow is imported. For
`set_random_seed` it means TensorFlow's generator is seeded only if TensorFlow is loaded at
that moment (it is whenever the program uses TensorFlow before seeding). Keras' own
preprocessing layers that need TensorFlow (`StringLookup`, `TextVectorization`...) keep
the original lazy module and still import it on demand.

If a Keras version moves these names, nothing is patched and everything works as before
(TensorFlow is merely imported again); `tests/test_import.py` notices.
"""

import sys

# The Keras modules whose `tf` is only used to recognise or seed objects of a loaded
# TensorFlow.
_MODULES = (
    "keras.src.saving.serialization_lib",
    "keras.src.legacy.saving.json_utils",
    "keras.src.utils.rng_utils",
)


class _LoadedTensorFlow:
    """The lazy TensorFlow module of Keras, `available` only once TensorFlow is loaded."""

    def __init__(self, lazy):
        self._lazy = lazy

    @property
    def available(self):
        return "tensorflow" in sys.modules and self._lazy.available

    def __getattr__(self, name):
        return getattr(self._lazy, name)

    def __repr__(self):
        return f"_LoadedTensorFlow({self._lazy!r})"


def install(backend):
    """Patch the modules of `_MODULES` unless `backend` is TensorFlow; return the names of
    the modules patched."""
    if backend == "tensorflow":
        return []
    import importlib

    patched = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        lazy = getattr(module, "tf", None)
        if isinstance(lazy, _LoadedTensorFlow):
            patched.append(name)
            continue
        if lazy is None or type(lazy).__name__ != "LazyModule" or lazy.name != "tensorflow":
            continue
        module.tf = _LoadedTensorFlow(lazy)
        patched.append(name)
    return patched
