"""Keras' `Adam` / `AdamW` updates on torch's CPU through torch's fused Adam kernel.

Keras 3.15's torch `Adam` (and `AdamW`, which adds the decay in front) updates the
variables with `torch._foreach_*` calls, and on CPU each of those loops over the tensors
one op at a time: about ten passes over every weight and moment a step, with temporaries.
torch's fused kernel (`torch._fused_adam_`, what `torch.optim.Adam(fused=True)` runs) does
the same update in one vectorised pass per tensor. Measured on the 2-core CPU for GPT of
the peers benchmark (5.3M weights, 68 variables), ms a step: Keras' update 14.0, the fused
kernel 2.0 (`torch.optim.AdamW`'s default 10.8).

The update is Keras' own, written for torch's kernel: Keras adds `epsilon` to `sqrt(v)`
before the bias correction (`var -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) +
eps)`), torch after it (`var -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`);
both are the same with torch's `eps` set to `epsilon / sqrt(1 - b2^t)` at each step. Keras
still runs everything around the update: the gradients' filtering, loss scale, clipping,
accumulation, AdamW's weight decay, EMA, constraints and the step counter (this replaces
only the optimizer's `_backend_update_step`).

Taken when the optimizer is exactly Keras' torch `Adam` / `AdamW` with float `beta_1`,
`beta_2` and `epsilon` and no `amsgrad`, and every variable, moment and gradient is a dense
float32 CPU tensor; anything else (a subclass, a schedule of betas, CUDA, bfloat16
variables, `amsgrad=True`) runs Keras' own update. kzoo's models install it when compiled
(`kzoo.models.base.FunctionalModel.compile`: every backbone and task model); `install(optimizer)` does it for any optimizer.
"""

import math

import keras

_ATTRIBUTE = "_kzoo_fused_adam"


def install(optimizer):
    """On torch, let `optimizer` (Keras' `Adam` / `AdamW`) update through torch's fused kernel
    where it applies (see the module); returns whether it was installed. Other optimizers
    and backends are left alone; installing twice is a no-op."""
    if keras.config.backend() != "torch" or optimizer is None:
        return False
    if getattr(optimizer, _ATTRIBUTE, False):
        return True
    if type(optimizer) not in _keras_torch_adams():
        return False
    original = optimizer._backend_update_step

    def update_step(grads, trainable_variables, learning_rate):
        if not fused_update(optimizer, grads, trainable_variables, learning_rate):
            original(grads, trainable_variables, learning_rate)

    # (plain attributes: Keras' tracking would otherwise see a new attribute)
    object.__setattr__(optimizer, "_backend_update_step", update_step)
    object.__setattr__(optimizer, _ATTRIBUTE, True)
    return True


def _keras_torch_adams():
    try:
        from keras.src.backend.torch.optimizers import torch_adam, torch_adamw
    except ImportError:  # (another Keras layout: Keras' own update everywhere)
        return ()
    return (torch_adam.Adam, torch_adamw.AdamW)


def fused_update(optimizer, grads, trainable_variables, learning_rate):
    """One Keras Adam update of `trainable_variables` by torch's fused kernel; returns False
    (nothing done) where it does not apply (see the module)."""
    import torch

    fused = getattr(torch, "_fused_adam_", None)
    betas = (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon)
    if fused is None or optimizer.amsgrad or not trainable_variables or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
        return False
    index = [optimizer._get_variable_index(v) for v in trainable_variables]
    values = [v.value for v in trainable_variables]
    moments = [optimizer._momentums[i].value for i in index]
    velocities = [optimizer._velocities[i].value for i in index]
    grads = list(grads)
    tensors = values + moments + velocities + grads
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
               and t.dtype == torch.float32 and t.layout == torch.strided for t in tensors):
        return False
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    lr = float(keras.ops.convert_to_numpy(learning_rate))
    step = float(keras.ops.convert_to_numpy(optimizer.iterations)) + 1.0
    beta_1, beta_2, epsilon = (float(b) for b in betas)
    correction = 1.0 - beta_2 ** step
    if not correction > 0.0:  # (beta_2 = 1: Keras' own update and its division by zero)
        return False
    step_tensor = torch.tensor(step, dtype=torch.float32)
    with torch.no_grad():
        fused(values, grads, moments, velocities, [], [step_tensor] * len(values), lr=lr,
              beta1=beta_1, beta2=beta_2, weight_decay=0.0,
              eps=epsilon / math.sqrt(correction), amsgrad=False, maximize=False)
    return True
