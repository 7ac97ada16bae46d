"""The one place where `kzoo.interpret` runs a model and differentiates, per backend.

`run(model, body, inputs, arrays, static, grad)` calls
`body(model, call, inputs, tensors, static) -> (scalar, aux)`, where `call(inputs)` is the
model's forward pass in inference mode and `tensors` are backend tensors made from
`arrays`. With `grad=True` it also returns the gradients of the scalar with respect to each
of `tensors`: `jax.value_and_grad` on JAX, `torch.autograd.grad` on PyTorch, a
`tf.GradientTape` on TensorFlow. `body` typically runs `call` inside a
`kzoo.layers.taps.Tap` that adds `tensors` to (or multiplies them into) attention
probabilities, embeddings or heads, so that they become inputs of the gradient without a
second model.

On JAX the whole body is one `jax.jit` in a `keras.StatelessScope` (the variables are
arguments, so a trained model needs no recompilation); it is compiled once per model, body,
`static` value and input shapes, and cached. An op-by-op eager pass on JAX compiles every
operation separately, which is several times slower than one compiled function even for a
two-layer model. `body` must therefore be a module-level function whose trace depends only on
`static` (hashable) and the shapes of `inputs` and `arrays`, never on their values.

Example:
>>> def body(model, call, inputs, tensors, static):
...     logits = call(inputs)
...     return keras.ops.sum(logits * tensors[0]), [logits]
>>> grads, (logits,) = run(model, body, inputs, [weights], grad=True)
"""

import weakref

import keras
import numpy as np

from kzoo import inputs as input_checks

_JAX_CACHE = {}  # (id(model), body, static, grad) -> (weakref to model, jitted function)


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _aux_numpy(aux):
    """Nested lists of tensors as nested lists of NumPy arrays."""
    if isinstance(aux, (list, tuple)):
        return [_aux_numpy(a) for a in aux]
    return _numpy(aux)


def _call(model):
    def call(x):
        return model(x, training=False)

    return call


def _detached(aux):
    if isinstance(aux, (list, tuple)):
        return [_detached(a) for a in aux]
    return aux.detach() if hasattr(aux, "detach") else aux


def _jax_function(model, body, static, grad):
    import jax

    key = (id(model), body, static, grad)
    cached = _JAX_CACHE.get(key)
    if cached is not None and cached[0]() is model:
        return cached[1]
    ref = weakref.ref(model)

    def pure(trainable, non_trainable, inputs, tensors):
        model = ref()
        mapping = list(zip(model.trainable_variables, trainable)) + list(
            zip(model.non_trainable_variables, non_trainable))
        # Like `model.stateless_call`, with the layers `body` calls besides the model (a
        # norm and head for the logit lens) reading the same traced variables.
        with keras.StatelessScope(state_mapping=mapping):
            value, aux = body(model, _call(model), inputs, tensors, static)
        return value, list(aux)

    if grad:
        function = jax.jit(jax.value_and_grad(pure, argnums=3, has_aux=True))
    else:
        function = jax.jit(pure)
    for stale in [k for k, (r, _) in _JAX_CACHE.items() if r() is None]:
        del _JAX_CACHE[stale]
    _JAX_CACHE[key] = (ref, function)
    return function


def run(model, body, inputs, arrays=(), static=None, grad=False):
    """Run `body` on `model` (see the module docstring) and return `(grads, aux)`.

    Args:
        model: a Keras model.
        body: `body(model, call, inputs, tensors, static) -> (scalar, aux)`; `call(x)` is the
            model's inference forward pass; `aux` a list of tensors. With `grad=False` the
            scalar may be None.
        inputs: the model's inputs (NumPy arrays, or a dict of them).
        arrays: NumPy arrays made into float32 tensors for `body` (the points at which to
            differentiate when `grad`).
        static: a hashable value passed to `body` unchanged (part of the JAX cache key).
        grad: also differentiate the scalar with respect to `tensors`.

    Returns:
        `(grads, aux)`: a list of float32 NumPy gradients shaped like `arrays` (zeros where
        the scalar does not depend on one; None without `grad`) and the NumPy aux values.

    The model's id checks (`kzoo.inputs`) are suspended while `body` runs: check `inputs`
    first (`kzoo.interpret.maps._check_inputs` does), as the JAX path cannot.
    """
    # The callers check the model's id inputs once, at their entry (`maps._check_inputs`):
    # on JAX the model only ever sees traced values here, which it cannot check itself.
    with input_checks.suspend_checks():
        return _run(model, body, inputs, arrays, static, grad)


def _run(model, body, inputs, arrays, static, grad):
    arrays = [np.asarray(a, dtype="float32") for a in arrays]
    backend = keras.backend.backend()
    grads = None
    if backend == "jax":
        import jax.numpy as jnp

        function = _jax_function(model, body, static, grad)
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        tensors = [jnp.asarray(a) for a in arrays]
        if grad:
            (_, aux), grads = function(trainable, non_trainable, inputs, tensors)
        else:
            _, aux = function(trainable, non_trainable, inputs, tensors)
    else:
        call = _call(model)
        if backend == "torch":
            import torch

            tensors = [keras.ops.convert_to_tensor(a) for a in arrays]
            if grad:
                tensors = [t.detach().requires_grad_(True) for t in tensors]
                with torch.enable_grad():
                    value, aux = body(model, call, inputs, tensors, static)
                    grads = torch.autograd.grad(value, tensors, allow_unused=True)
            else:
                with torch.no_grad():
                    _, aux = body(model, call, inputs, tensors, static)
            aux = _detached(aux)
        elif backend == "tensorflow":
            import tensorflow as tf

            tensors = [tf.convert_to_tensor(a) for a in arrays]
            if grad:
                with tf.GradientTape() as tape:
                    tape.watch(tensors)
                    value, aux = body(model, call, inputs, tensors, static)
                grads = tape.gradient(value, tensors)
            else:
                _, aux = body(model, call, inputs, tensors, static)
        else:  # pragma: no cover - kzoo supports these three backends only
            raise ValueError(
                "kzoo.interpret runs on the jax, torch and tensorflow backends; got "
                f"KERAS_BACKEND={backend!r}."
            )
    if grad:
        grads = [np.zeros_like(a) if g is None else _numpy(g).astype("float32")
                 for a, g in zip(arrays, grads)]
    return grads, _aux_numpy(aux)
