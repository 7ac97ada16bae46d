"""`custom_gradient`: `keras.ops.custom_gradient` whose TensorFlow graphs can be freed.

TensorFlow's `tf.custom_gradient`, traced in a graph (inside `tf.function`: every
`predict`, `fit` and compiled `generate` of a model), registers the gradient under a new name
("CustomGradient-<uid>") in TensorFlow's global gradient registry and never removes it
(tensorflow/tensorflow#27492, #97697). The registered function closes over the forward pass'
tensors, so it keeps the whole traced graph of the model (its operations, tensors and
concrete functions) alive after the model, its `tf.function`s and `keras.backend.
clear_session()` are gone. kzoo's TensorFlow kernels (attention, layer norm, GELU, the tied
output head, cross-entropy, MoE's dispatch) all use custom gradients, so every trace of every
kzoo model was kept: a loop that built a tiny GPT, ran `predict`, one `fit` step and
`generate`, and deleted it kept 146 more TensorFlow functions and ~53,000 Python objects of
its graphs an iteration, and grew by 63 MiB an iteration (1,014 -> 2,206 MiB over 20).

Here the registry keeps only a weak reference to the gradient function, and the graph that
the op was made in keeps the strong one: the gradient can be looked up exactly as long as
its graph (and with it anything that could ask for it) lives, and the registry's entry goes
with the graph (`tf_custom_gradient`; `custom_gradient` is `keras.ops.custom_gradient` on JAX
and torch). `adopt_custom_gradients` does the same for registrations made by others'
code (TensorFlow's own, in every traced training step), and `fit` of a kzoo model calls it.
"""

import functools
import sys
import weakref

import keras

_PREFIX = "CustomGradient-"
_GRAPH_ATTRIBUTE = "_kzoo_custom_gradients"


def custom_gradient(f):
    """`keras.ops.custom_gradient(f)` (`f(*args) -> (outputs, grad_fn)`); on the TensorFlow
    backend `tf_custom_gradient(f)`.

    >>> @custom_gradient
    ... def clipped(x):
    ...     return x, lambda dy: keras.ops.clip(dy, -1.0, 1.0)
    """
    if keras.backend.backend() != "tensorflow":
        return keras.ops.custom_gradient(f)
    return tf_custom_gradient(f)


def tf_custom_gradient(f):
    """`tf.custom_gradient(f)` with the gradient's registration owned by the graph it is
    traced in (see the module's docstring), whatever the Keras backend (kzoo's TensorFlow
    code also runs in `tf.data` pipelines under JAX and torch)."""
    import tensorflow as tf

    decorated = tf.custom_gradient(f)

    @functools.wraps(f)
    def call(*args, **kwargs):
        registry = _registry()
        if registry is None or tf.executing_eagerly():  # eager: taped, nothing registered
            return decorated(*args, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        before = set(registry)
        result = decorated(*args, **kwargs)
        for name in [name for name in registry if name not in before]:
            if name.startswith(_PREFIX):
                _hand_to_graph(registry, name, graph)
        return result

    return call


def adopt_custom_gradients():
    """Hand every custom-gradient registration that no graph owns yet to the graph it was
    traced in; return how many were handed over. TensorFlow's own code registers some too
    (`tf.distribute`'s `all_reduce`, which Keras' optimizers call in every traced training
    step), and they pin the graph of `fit`'s step as kzoo's did. An entry whose graph cannot
    be found is left as it is. Nothing happens where TensorFlow is not loaded."""
    if "tensorflow" not in sys.modules:
        return 0
    registry = _registry()
    if registry is None:
        return 0
    handed = 0
    for name in [name for name in registry if name.startswith(_PREFIX)]:
        entry = registry.get(name)
        if not isinstance(entry, dict) or isinstance(entry.get("type"), _WeakGradient):
            continue
        graph = _graph_of(entry.get("type"))
        if graph is not None:
            handed += _hand_to_graph(registry, name, graph)
    return handed


def _graph_of(function):
    """The graph of the forward outputs that `tf.custom_gradient`'s registered function
    (`internal_grad_fn`, calling `tape_grad_fn`, which holds `result`) closes over, or
    None."""
    import tensorflow as tf

    def cells(fn):
        code = getattr(fn, "__code__", None)
        return dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}

    tape = cells(function).get("tape_grad_fn")
    result = cells(tape.cell_contents).get("result") if tape is not None else None
    if result is None:
        return None
    try:
        values = tf.nest.flatten(result.cell_contents, expand_composites=True)
    except (ValueError, TypeError):  # an empty cell or an odd structure
        return None
    for value in values:
        graph = getattr(value, "graph", None)
        if isinstance(graph, tf.Graph):
            return graph
    return None


def _registry():
    """TensorFlow's global dict of gradient functions (name -> {"type": fn, ...}), or None
    if a TensorFlow version moved it (then nothing is changed)."""
    try:
        from tensorflow.python.framework import ops

        registry = ops._gradient_registry._registry
    except (ImportError, AttributeError):
        return None
    return registry if isinstance(registry, dict) else None


class _WeakGradient:
    """The registry's entry: calls the gradient function while its graph keeps it alive."""

    def __init__(self, function, on_collected):
        self._function = weakref.ref(function, on_collected)

    def __call__(self, *args, **kwargs):
        function = self._function()
        if function is None:
            raise RuntimeError("The graph of this custom gradient was freed.")
        return function(*args, **kwargs)


def _hand_to_graph(registry, name, graph):
    entry = registry.get(name)
    if not isinstance(entry, dict) or isinstance(entry.get("type"), _WeakGradient):
        return 0
    function = entry["type"]
    owned = getattr(graph, _GRAPH_ATTRIBUTE, None)
    if owned is None:  # (as TensorFlow's `py_function` keeps its functions with the graph)
        owned = []
        setattr(graph, _GRAPH_ATTRIBUTE, owned)
    owned.append(function)
    entry["type"] = _WeakGradient(function, functools.partial(_forget, registry, name))
    return 1


def _forget(registry, name, _):
    registry.pop(name, None)


__all__ = ["adopt_custom_gradients", "custom_gradient", "tf_custom_gradient"]
