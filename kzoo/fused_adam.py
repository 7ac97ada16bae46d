"""Keras' `Adam` / `AdamW` updates through the backend's fused Adam kernel (torch on CPU,
TensorFlow).

torch: Keras 3.15's torch `Adam` (and `AdamW`, which adds the decay in front) updates the
variables with `torch._foreach_*` calls, and on CPU each of those loops over the tensors
one op at a time: about ten passes over every weight and moment a step, with temporaries.
torch's fused kernel (`torch._fused_adam_`, what `torch.optim.Adam(fused=True)` runs) does
the same update in one vectorised pass per tensor. Measured on the 2-core CPU for GPT of
the peers benchmark (5.3M weights, 68 variables), ms a step: Keras' update 14.0, the fused
kernel 2.0 (`torch.optim.AdamW`'s default 10.8). Keras adds `epsilon` to `sqrt(v)` before
the bias correction (`var -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`),
torch after it (`var -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`); both are
the same with torch's `eps` set to `epsilon / sqrt(1 - b2^t)` at each step. This replaces
the optimizer's `_backend_update_step` where every variable, moment and gradient is a
dense float32 tensor on one CPU or CUDA device (bfloat16 variables: Keras' own update).
On CUDA the learning rate stays on the device; the step count is read once a step. There,
on an H200 (GPT-2 small, mixed bfloat16, 148 variables), Keras' update is ~15 `foreach`
launches over every tensor and a host-side cost that left the GPU waiting (the step is
bound by the host: 84 ms a step for 45 ms of kernels); the fused kernel is one.

TensorFlow: Keras' `update_step` of each variable is half a dozen graph ops with their
temporaries; TensorFlow's `ResourceApplyAdam` computes Keras' very formula in one kernel.
The same GPT variables in a `tf.function`, ms a step: Keras' update (with AdamW's decay)
13.8-17.0, `ResourceApplyAdam` (without) 6.0. This replaces the optimizer's
`update_step` for dense float32 gradients outside `tf.distribute` strategies.

Both keep everything else Keras does around the update: the gradients' filtering, loss
scale, clipping, accumulation, AdamW's weight decay, EMA, constraints and the step counter.
Taken for exactly Keras' `Adam` / `AdamW` with plain-number `beta_1`, `beta_2` and
`epsilon` and no `amsgrad`; anything else (a subclass, `amsgrad=True`, another optimizer)
runs Keras' own update. kzoo's models install it when compiled
(`kzoo.models.base.FunctionalModel.compile`: every backbone and task model);
`install(optimizer)` does it for any optimizer. JAX compiles Keras' update into the
training step with XLA, which fuses it already: nothing is installed there.
"""

import math

import keras

_ATTRIBUTE = "_kzoo_fused_adam"


def install(optimizer):
    """On torch and TensorFlow, let `optimizer` (Keras' `Adam` / `AdamW`) update through the
    backend's fused kernel where it applies (see the module); returns whether it was
    installed. Other optimizers and backends are left alone; installing twice is a no-op."""
    backend = keras.config.backend()
    if backend not in ("torch", "tensorflow") or optimizer is None:
        return False
    if getattr(optimizer, _ATTRIBUTE, False):
        return True
    if type(optimizer) not in _keras_adams(backend):
        return False
    if backend == "torch":
        original = optimizer._backend_update_step

        def backend_update_step(grads, trainable_variables, learning_rate):
            if not fused_update(optimizer, grads, trainable_variables, learning_rate):
                original(grads, trainable_variables, learning_rate)

        # (plain attributes: Keras' tracking would otherwise see a new attribute)
        object.__setattr__(optimizer, "_backend_update_step", backend_update_step)
    else:
        original = optimizer.update_step

        def update_step(gradient, variable, learning_rate):
            if not tf_fused_update(optimizer, gradient, variable, learning_rate):
                original(gradient, variable, learning_rate)

        object.__setattr__(optimizer, "update_step", update_step)
    object.__setattr__(optimizer, _ATTRIBUTE, True)
    return True


def _keras_adams(backend):
    if backend == "tensorflow":  # (Keras' own classes, on TensorFlow's optimizer base)
        return (keras.optimizers.Adam, keras.optimizers.AdamW)
    try:
        from keras.src.backend.torch.optimizers import torch_adam, torch_adamw
    except ImportError:  # (another Keras layout: Keras' own update everywhere)
        return ()
    return (torch_adam.Adam, torch_adamw.AdamW)


def _float_betas(optimizer):
    """`(beta_1, beta_2, epsilon)` as floats, or None where one is not a plain number."""
    betas = (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon)
    if optimizer.amsgrad or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                    for b in betas):
        return None
    return tuple(float(b) for b in betas)


def fused_update(optimizer, grads, trainable_variables, learning_rate):
    """One Keras Adam update of `trainable_variables` by torch's fused kernel; returns False
    (nothing done) where it does not apply (see the module)."""
    import torch

    fused = getattr(torch, "_fused_adam_", None)
    betas = _float_betas(optimizer)
    if fused is None or betas is None or not trainable_variables or _compiling(torch):
        return False
    index = [optimizer._get_variable_index(v) for v in trainable_variables]
    values = [v.value for v in trainable_variables]
    moments = [optimizer._momentums[i].value for i in index]
    velocities = [optimizer._velocities[i].value for i in index]
    grads = list(grads)
    tensors = values + moments + velocities + grads
    device = values[0].device
    if device.type not in ("cpu", "cuda") or not all(
            isinstance(t, torch.Tensor) and t.device == device and t.dtype == torch.float32
            and t.layout == torch.strided for t in tensors):
        return False
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    beta_1, beta_2, epsilon = betas
    # The step count is read on the host (the kernel's `eps` depends on it: one read of the
    # device a step on CUDA, where Keras' own counter update waits for the device anyway).
    step = float(keras.ops.convert_to_numpy(optimizer.iterations)) + 1.0
    correction = 1.0 - beta_2 ** step
    if not correction > 0.0:  # (beta_2 = 1: Keras' own update and its division by zero)
        return False
    if device.type in LR_ON_DEVICE:  # the learning rate (a variable, or a schedule's
        lr = _device_scalar(torch, learning_rate, device)  # tensor) stays on the device
    else:  # (reading a CPU value costs nothing)
        lr = float(keras.ops.convert_to_numpy(learning_rate))
    step_tensor = torch.full((), step, dtype=torch.float32, device=device)
    with torch.no_grad():
        fused(values, grads, moments, velocities, [], [step_tensor] * len(values), lr=lr,
              beta1=beta_1, beta2=beta_2, weight_decay=0.0,
              eps=epsilon / math.sqrt(correction), amsgrad=False, maximize=False)
    return True


# Device types whose learning rate reaches the kernel as a tensor on the device, never read
# on the host (a read would wait for the device's queued work).
LR_ON_DEVICE = ("cuda",)


def _device_scalar(torch, value, device):
    """`value` (a Keras variable or a tensor) as a float32 0-d tensor on `device`; a Python
    number stays a float (the kernel takes either)."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, keras.Variable):
        value = value.value
    value = torch.as_tensor(value)
    return value.to(device=device, dtype=torch.float32).reshape(())


def _compiling(torch):
    """Whether torch.compile is tracing this call (`compile(jit_compile=True)` on torch):
    the fused kernel's host-side step and learning rate cannot be traced there, and Keras'
    own update compiles into the step."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def tf_fused_update(optimizer, gradient, variable, learning_rate):
    """Keras' Adam `update_step` of one variable as TensorFlow's `ResourceApplyAdam` (one
    Eigen kernel computing Keras' very formula: `alpha = lr sqrt(1 - b2^t) / (1 - b1^t)`, the
    moments, `var -= alpha m / (sqrt(v) + eps)`); returns False (nothing done) under a
    `tf.distribute` strategy, for a sparse gradient, a variable that is not float32, or
    where the betas are not plain numbers."""
    import tensorflow as tf

    betas = _float_betas(optimizer)
    target = variable.value if isinstance(variable, keras.Variable) else variable
    if (betas is None or tf.distribute.has_strategy() or isinstance(gradient, tf.IndexedSlices)
            or target.dtype != tf.float32 or not hasattr(target, "handle")):
        return False
    index = optimizer._get_variable_index(variable)
    moment, velocity = (slots[index].value for slots in (optimizer._momentums,
                                                          optimizer._velocities))
    beta_1, beta_2, epsilon = (tf.constant(b, tf.float32) for b in betas)
    step = tf.cast(optimizer.iterations + 1, tf.float32)
    tf.raw_ops.ResourceApplyAdam(
        var=target.handle, m=moment.handle, v=velocity.handle,
        beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
        lr=tf.cast(learning_rate, tf.float32), beta1=beta_1, beta2=beta_2, epsilon=epsilon,
        grad=tf.cast(gradient, tf.float32))
    return True
