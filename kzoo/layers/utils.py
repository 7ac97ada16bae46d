"""Small shared helpers: argument validation, dtype handling, and two JAX performance
helpers (`project` for Dense layers, the residual stream's `gradient_boundary`).

These are the one set of validators every layer, family config and task uses: each raises a
`ValueError` that names the argument, its value and what is allowed.
"""

import math
import numbers

import keras
import numpy as np
from keras import ops


class FieldError(ValueError):
    """The `ValueError` every validator here raises: one argument or config field is bad.

    `field` names it (None when the message is about no single field), so that a caller
    that knows the field under another name (a Hugging Face `config.json` key) can say so.
    """

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


def _is_int(value):
    """True for Python and NumPy integers, never for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value):
    """True for Python and NumPy real numbers, never for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_bool(name, value, allow_none=False):
    """Raise unless `value` is True or False (or None when allowed); NumPy bools become bools."""
    if value is None and allow_none:
        return value
    if not isinstance(value, (bool, np.bool_)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise FieldError(f"`{name}` must be {allowed}; got {name}={value!r}.", name)
    return bool(value)


def check_keras_model(model):
    """`ValueError` unless `model` is a Keras model (the model-level functions of
    `kzoo.lora` and `kzoo.quantize` failed with an AttributeError from inside, e.g.
    "'NoneType' object has no attribute 'built'")."""
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a Keras model (a kzoo backbone or task model); got "
            f"{type(model).__name__}."
        )


def check_positive_int(name, value, allow_none=False):
    """Raise unless `value` is a positive integer (or None when allowed).

    NumPy integers are accepted and returned as Python ints.
    """
    if value is None and allow_none:
        return value
    if not _is_int(value) or value <= 0:
        allowed = "a positive integer or None" if allow_none else "a positive integer"
        raise FieldError(f"`{name}` must be {allowed}; got {name}={value!r}.", name)
    return int(value)


def check_non_negative_int(name, value):
    if not _is_int(value) or value < 0:
        raise FieldError(
            f"`{name}` must be a non-negative integer; got {name}={value!r}.", name
        )
    return int(value)


def check_int_at_least(name, value, minimum, why=""):
    """Raise unless `value` is an integer >= `minimum` (`why` explains the bound)."""
    if not _is_int(value) or value < minimum:
        raise FieldError(
            f"`{name}` must be an integer >= {minimum}{why}; got {name}={value!r}.", name
        )
    return int(value)


def check_rate(name, value, allow_none=False):
    """A probability in [0, 1) (or None when allowed), returned as a float."""
    if value is None and allow_none:
        return value
    if not _is_real(value) or not 0.0 <= value < 1.0:
        allowed = "a float in [0, 1) or None" if allow_none else "a float in [0, 1)"
        raise FieldError(f"`{name}` must be {allowed}; got {name}={value!r}.", name)
    return float(value)


def check_positive_float(name, value, allow_none=False):
    """A finite number > 0 (or None when allowed), returned as a float."""
    if value is None and allow_none:
        return value
    if not _is_real(value) or not 0 < value < math.inf:
        allowed = "a positive number or None" if allow_none else "a positive number"
        raise FieldError(f"`{name}` must be {allowed}; got {name}={value!r}.", name)
    return float(value)


def check_number(name, value, allow_none=False):
    """A finite real number (or None when allowed), returned as a float."""
    if value is None and allow_none:
        return value
    if not _is_real(value) or not math.isfinite(value):
        allowed = "a finite number or None" if allow_none else "a finite number"
        raise FieldError(f"`{name}` must be {allowed}; got {name}={value!r}.", name)
    return float(value)


def check_choice(name, value, allowed):
    """Raise unless `value` is one of `allowed`; a NumPy scalar (e.g. `np.str_`) is returned
    as its Python value. Arrays are refused, even 0-d ones holding an allowed value."""
    if isinstance(value, np.generic):
        value = value.item()
    try:
        # An array is no choice: `array in allowed` compares element-wise.
        ok = not isinstance(value, np.ndarray) and value in allowed
    except TypeError:  # e.g. an unhashable value against a set or dict
        ok = False
    if not ok:
        raise FieldError(
            f"`{name}` must be one of {sorted(allowed)}; got {name}={value!r}.", name
        )
    return value


def check_int_pair(name, value):
    """A positive int or a pair `(height, width)` of positive ints -> the pair, a tuple."""
    pair = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if len(pair) != 2 or not all(_is_int(v) and v > 0 for v in pair):
        raise FieldError(
            f"`{name}` must be a positive int or a pair (height, width) of positive ints; "
            f"got {name}={value!r}.",
            name,
        )
    return tuple(int(v) for v in pair)


def check_int_or_pair(name, value):
    """A positive int (returned as an int) or a pair of positive ints (returned as a tuple)."""
    pair = check_int_pair(name, value)
    return pair if isinstance(value, (list, tuple)) else pair[0]


def check_divides(name, value, other_name, other):
    """Raise unless `value` (the field `name`) divides `other` (the field `other_name`)."""
    if other % value != 0:
        raise FieldError(
            f"`{name}` must divide {other_name}={other}; got {name}={value} "
            f"({other_name} % {name} = {other % value}).",
            name,
        )
    return value


def check_at_most(name, value, other_name, other):
    """Raise unless `value` (the field `name`) is at most `other` (the field `other_name`)."""
    if value > other:
        raise FieldError(
            f"`{name}` must be at most {other_name}={other}; got {name}={value}.", name
        )
    return value


def check_instance(name, value, cls):
    """Raise unless `value` is an instance of `cls` (e.g. the backbone of a task model)."""
    if not isinstance(value, cls):
        raise FieldError(
            f"`{name}` must be a {cls.__name__}; got {name} of type {type(value).__name__}.",
            name,
        )
    return value


def check_rank(name, tensor, ranks):
    """Raise unless the static rank of `tensor` is one of `ranks`."""
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    rank = len(tensor.shape)
    if rank not in ranks:
        allowed = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"`{name}` must have rank {allowed}; got {name} with shape {tuple(tensor.shape)} "
            f"(rank {rank})."
        )


def clip(x, low, high):
    """`ops.clip(x, low, high)` for bounds that are Python numbers. On torch it is
    `Tensor.clamp`, which takes them as numbers: Keras' torch `clip` turns each bound into a
    device tensor, a copy from the host that waits for the GPU on CUDA (two host syncs a
    call, e.g. in every training step's token embedding) and that a CUDA graph cannot
    capture (a decode step's positions)."""
    if keras.backend.backend() == "torch":
        return ops.convert_to_tensor(x).clamp(low, high)
    return ops.clip(x, low, high)


def compute_float32(x):
    """Cast to float32 for numerically sensitive statistics (softmax, norms)."""
    return ops.cast(x, "float32")


def serialize_initializer(initializer, name=None):
    """The config of `initializer` (a Keras initializer, its name or its config). With
    `name` (the argument it was given as) a value Keras cannot read raises a `FieldError`
    naming that argument, its value and what is allowed (Keras' own message, "Could not
    interpret initializer identifier: ...", named neither)."""
    try:
        return keras.initializers.serialize(keras.initializers.get(initializer))
    except (ValueError, TypeError) as error:
        if name is None:
            raise
        raise FieldError(
            f"`{name}` must be a Keras initializer, its name (e.g. \"glorot_uniform\") or "
            f"its config; got {name}={initializer!r:.200}.", name) from error


def last_axis_size(layer_name, input_shape):
    """The size of the last axis of `input_shape`; a clear error when it is unknown."""
    dim = input_shape[-1]
    if dim is None:
        raise ValueError(
            f"The last axis of the input to {layer_name} must be known; got input shape "
            f"{tuple(input_shape)}."
        )
    return dim


def _static(shape):
    """Whether every size in `shape` is a known integer (not None, not a symbolic size)."""
    return all(_is_int(size) for size in shape)


def project(dense, x):
    """`dense(x)` for a Dense layer; on JAX, over the flattened leading axes of `x`.

    Keras' `Dense` multiplies a `(batch, seq, dim)` input by its kernel as one 3-D product,
    so JAX's derivative of the kernel contracts two axes at once (batch and sequence), which
    XLA on CPU runs as a transposing copy of each operand and a generic dot outside its
    matrix library. On `(batch * seq, dim)` the same derivative is one plain matrix product.
    Measured on the 2-core CPU (interleaved, one process, 8 x 256 tokens): GPT training
    3,878 -> 4,223 and BERT 4,398 -> 5,096 tokens/s, forward unchanged. The result is
    reshaped back, so values and shapes are those of `dense(x)`; other backends (whose own
    Dense already multiplies 2-D matrices, or lost 9% flattened on TensorFlow) call
    `dense(x)` unchanged.
    """
    return over_rows(dense, x)


def over_rows(fn, x):
    """`fn(x)` for a `fn` acting on the last axis; on JAX with static sizes, `fn` of the
    flattened leading axes `(rows, features)`, reshaped back (see `project`). Elsewhere, or
    with symbolic sizes (an ONNX export), `fn(x)` itself."""
    if keras.backend.backend() != "jax" or len(x.shape) <= 2 or not _static(x.shape):
        return fn(x)
    lead = tuple(x.shape[:-1])
    y = fn(ops.reshape(x, (-1, x.shape[-1])))
    return ops.reshape(y, lead + (y.shape[-1],))


@keras.saving.register_keras_serializable(package="kzoo")
class RowDense(keras.layers.Dense):
    """A `keras.layers.Dense` that on JAX multiplies the flattened leading axes of its input,
    as `project` does for the Dense layers inside the blocks, for a Dense called directly in
    a functional model (T5 v1.1's untied `lm_head`): the kernel's derivative is then one
    plain matrix product. Its weights, config and values are `Dense`'s; other backends,
    symbolic shapes and quantised calls run `Dense` unchanged. T5 v1.1 training on JAX (8 x
    256 tokens, vocabulary 8192, 2-core CPU, interleaved in one process, the same losses):
    1,566 -> 1,765 decoder tokens/s."""

    def call(self, inputs, training=None):
        dense = super().call
        return over_rows(lambda rows: dense(rows, training=training), inputs)


_JAX_CPU_FUNCTIONS = {}


def _jax_cpu_function(make):
    """`make()` (a JAX function with a hand-written gradient) built once per process where
    JAX runs on CPU, else None (GPU / TPU keep the plain op)."""
    if make not in _JAX_CPU_FUNCTIONS:
        import jax

        _JAX_CPU_FUNCTIONS[make] = make() if jax.default_backend() == "cpu" else None
    return _JAX_CPU_FUNCTIONS[make]


def gradient_boundary(x):
    """`x` itself; on JAX on CPU, its gradient is written to memory once before use.

    The residual stream's gradient is a chain of element-wise sums, one link per sub-layer.
    XLA's CPU fusion copies cheap element-wise producers into every consumer, so each
    transposing copy feeding a weight gradient recomputed the whole chain from the last
    layer down: 52 such fusions took 96-104 ms of a 600 ms GPT step (4 layers, 8 x 256
    tokens; `jax.profiler`), the deepest layer's 18 ms; interleaved A/B, 3,507 -> 4,124
    tokens/s. `project` since removed most of those copies; on top of it the boundary
    still measured +3.8-4.8% (GPT) and +1.3% (BERT). `lax.optimization_barrier` does not
    stop it (the CPU compiler removes barriers before fusing); a `lax.cond` does, as XLA
    never fuses across one. Its predicate `(bits | 1) & 1 == 1` holds for every value but
    is not constant to the compiler, and both branches return the gradient exactly (the
    second multiplies by that same computed 1.0), so the values are those of `x` itself.
    Elsewhere (other backends, JAX on GPU/TPU, where a conditional may cost a device-host
    round trip) `x` is returned untouched. Reverse-mode only: under `jax.jvp` it raises.
    """
    if keras.backend.backend() != "jax" or not _static(x.shape) or 0 in tuple(x.shape):
        return x
    boundary = _jax_cpu_function(_jax_boundary)
    return boundary(x) if boundary else x


def _jax_boundary():
    import jax
    import jax.numpy as jnp
    from jax import lax

    @jax.custom_vjp
    def boundary(x):
        return x

    def forward(x):
        return x, None

    def backward(_, d):
        bits = lax.bitcast_convert_type(d.reshape(-1)[0].astype(jnp.float32), jnp.int32)
        one = (bits | 1) & 1
        scale = one.astype(d.dtype)
        same = lax.cond(one == 1, lambda t, s: t, lambda t, s: t * s, d, scale)
        return (same,)

    boundary.defvjp(forward, backward)
    return boundary


def broadcast_leading(x, shape):
    """`ops.broadcast_to(x, shape)` for `x` of the trailing shape `shape[k:]` (new leading
    axes only); on JAX on CPU its gradient sums the leading axes as one matrix product by a
    row of ones.

    Reverse-mode autodiff of a broadcast is a `reduce_sum` over the new axes, and XLA's CPU
    backend (jax 0.10, its YNNPACK reduce) runs a sum over the major axis ~30 times slower
    than the same sum as a product: `(8, 256, 256) -> (256, 256)` 2.65 ms against 0.08 (2
    cores), 3.75 ms of a GPT training step for the learned positions' gradient (jax.profiler).
    The product accumulates in float32 (`preferred_element_type`). Elsewhere, with symbolic
    sizes, or with nothing to broadcast, `ops.broadcast_to` unchanged. Reverse-mode only:
    under `jax.jvp` it raises.
    """
    shape = tuple(shape)
    lead = shape[:len(shape) - len(x.shape)]
    if keras.backend.backend() == "jax" and lead and not _static(shape):
        # A symbolic batch on JAX (an export): the new axes made size-1 axes of `x` first.
        # jax2onnx (0.17) gave a new leading axis of a broadcast the size of the operand's
        # own first axis when that operand came out of a slice (the learned positions'
        # rows), so an ONNX file served only a batch equal to the sequence length.
        x = ops.reshape(x, (1,) * len(lead) + tuple(ops.shape(x)))
        return ops.broadcast_to(x, shape)
    if (keras.backend.backend() != "jax" or not lead or not _static(shape)
            or tuple(x.shape) != shape[len(lead):] or 0 in shape):
        return ops.broadcast_to(x, shape)
    broadcast = _jax_cpu_function(_jax_broadcast_leading)
    return broadcast(x, shape, len(lead)) if broadcast else ops.broadcast_to(x, shape)


def _jax_broadcast_leading():
    import functools

    import jax
    import jax.numpy as jnp

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def broadcast(x, shape, lead):
        return jnp.broadcast_to(x, shape)

    def forward(x, shape, lead):
        return jnp.broadcast_to(x, shape), None

    def backward(shape, lead, _, g):
        rows = math.prod(shape[:lead])
        ones = jnp.ones((1, rows), g.dtype)
        total = jax.lax.dot(ones, g.reshape(rows, -1), preferred_element_type=jnp.float32)
        return (total.reshape(shape[lead:]).astype(g.dtype),)

    broadcast.defvjp(forward, backward)
    return broadcast


def gather_rows(x, positions):
    """`x[b, positions[b, p]]`: the rows of `x` `(batch, seq, ...)` at `positions`
    `(batch, num_positions)`, per example -> `(batch, num_positions, ...)`."""
    index = ops.cast(positions, "int32")
    index = ops.reshape(index, tuple(ops.shape(index)) + (1,) * (len(x.shape) - 2))
    return ops.take_along_axis(x, index, axis=1)


_ONEDNN_LINEAR = []  # [the op] once it was found usable, [None] where it is not


# Activations that `torch_linear` applies inside oneDNN's product (a post-op): kzoo's name ->
# (oneDNN's attribute, its algorithm, the torch function elsewhere).
_TORCH_LINEAR_ACTIVATIONS = {
    "gelu": ("gelu", "none", lambda F, h: F.gelu(h)),
    "gelu_tanh": ("gelu", "tanh", lambda F, h: F.gelu(h, approximate="tanh")),
    "relu": ("relu", "", lambda F, h: F.relu(h)),
}


def torch_linear(x, weight, bias=None, activation=None):
    """`torch.nn.functional.linear(x, weight, bias)` (`weight (out, in)`); on CPU, in float32
    and outside autograd, through oneDNN's linear kernel (`torch.ops.mkldnn._linear_pointwise`,
    the op torch's own compiler emits for CPU linear layers) instead of MKL's.

    torch 2.13's CPU build multiplies with MKL, which on this project's AMD EPYC machines
    runs below the core's speed; oneDNN picks its kernel by the instruction set. Measured on
    the 2-core CPU, 2048 rows, float32, ms a product (F.linear -> oneDNN): the tied logits
    `(256 -> 8192)` 49.6-51.3 -> 42.1-44.2, `(256 -> 1024)` 5.5-5.8 -> 5.2-5.3,
    `(1024 -> 256)` 5.4-5.7 -> 4.9-5.1, `(256 -> 768)` 4.1-4.2 -> 3.8-4.1; from 1 to 512
    rows as fast or faster (1 row of `(256 -> 8192)`: 0.21 -> 0.11). The values differ from
    MKL's by rounding only (both against float64: largest error 2-7e-6 at these sizes).

    The op has no derivative of its own. Where autograd records (grad mode on and an operand
    that requires a gradient: a training step) and `x` has at least `ONEDNN_TRAIN_ROWS` rows,
    an autograd function runs the product and the input's gradient `g @ W` through oneDNN
    and the weight's gradient through `torch.mm` (MKL measured faster there at these
    shapes), its layout matching the weight's (a Dense kernel's `.t()` gets a gradient whose
    transpose is row-major, so the kernel's gradient needs no copy). Under `create_graph`
    its backward is made of differentiable torch ops (a second derivative works). Smaller
    products under autograd, other devices and dtypes, torch builds without oneDNN, code
    being compiled by `torch.compile` and `torch.backends.mkldnn.enabled = False` (torch's
    own switch, also `with torch.backends.mkldnn.flags(enabled=False):`) take `F.linear`.
    In a GPT / BERT training step (benchmarks.peers' sizes, interleaved in one process, 8
    rounds, the tied table's row-major gradient in both arms) the fused bias and the faster
    products gave 4,333 -> 4,498 and 7,014 -> 7,282 tokens/s with the same losses to all
    printed digits.

    `activation` ("gelu", "gelu_tanh", "relu" or None) is applied to the result. On oneDNN's
    path either inside the product (oneDNN's post-op) or after it as torch ops (ReLU in
    place, the tanh GELU as `kzoo.layers.feedforward`'s four passes from 8192 elements, the
    exact GELU by `F.gelu`): which one is faster depends on the CPU, so by default
    (`set_onednn_activation("auto")`) the first product of each activation and shape with
    `ACTIVATION_TIMING_ROWS` rows or more times both on its own rows and the faster serves
    the rest of the process (fewer rows, and code that `torch.compile` or `torch.export`
    traces, take the post-op). A feed-forward's first product at 2048 rows, 256 -> 1024, ms:
    on one machine of this project (the product 5.2) the post-op won (tanh GELU 6.9 -> 5.9,
    exact GELU 6.0 -> 5.7, ReLU 5.5 -> 5.1, against `F.linear` then torch's function); on an
    AMD EPYC with AVX2 only (family 25 model 1; the product 7.6) it lost, medians of 8 rounds
    of 6 inputs: tanh GELU 13.7 fused against 10.4 after, exact GELU 10.8 against 8.9, ReLU
    7.6 against 8.0; there GPT's forward pass (benchmarks.peers' size, interleaved in one
    process, 8 rounds) went 8,409 -> 9,154 tokens/s and BERT's 8,492 -> 8,824. Both ways give
    the same largest error against float64 as the product and then the torch function."""
    import torch.nn.functional as F

    post = None if activation is None else _TORCH_LINEAR_ACTIVATIONS.get(activation)
    if activation is not None and post is None:
        raise ValueError(f"`activation` must be one of {sorted(_TORCH_LINEAR_ACTIVATIONS)} "
                         f"or None; got activation={activation!r}.")
    if not torch_linear_uses_onednn(x, weight, bias):
        if _onednn_trains(x, weight, bias):
            y = _onednn_linear_function().apply(x, weight, bias)
        else:
            y = F.linear(x, weight, bias)
        return y if post is None else post[2](F, y)
    if post is None:
        return _ONEDNN_LINEAR[0](x, weight, bias, "none", [], "")
    if _post_op_wins(activation, x, weight, bias):
        return _ONEDNN_LINEAR[0](x, weight, bias, post[0], [], post[1])
    return _activation_after(activation, _ONEDNN_LINEAR[0](x, weight, bias, "none", [], ""))


# `torch_linear`'s activations on oneDNN's path (see there): "auto" times the post-op against
# the torch ops after the product, "fused" always takes the post-op, "separate" never.
ONEDNN_ACTIVATION_MODES = ("auto", "fused", "separate")
_ACTIVATION_MODE = ["auto"]
# (activation, in features, out features, has bias) -> whether the post-op was faster.
_ACTIVATION_CHOICE = {}
# Products with fewer rows take the post-op untimed; the timing runs on at most
# `2 * ACTIVATION_TIMING_ROWS` rows of the product that asks, each way 1 + 3 times.
ACTIVATION_TIMING_ROWS = 256
_ACTIVATION_TIMING_CALLS = 3


def set_onednn_activation(mode):
    """How `torch_linear` applies its activation on oneDNN's path, for the rest of the
    process: "auto" (the default: time both ways once per activation and shape, keep the
    faster), "fused" (oneDNN's post-op inside the product) or "separate" (torch ops after
    it). Returns the previous mode. The ways differ by rounding only; "fused" or "separate"
    make a process' choice independent of timing."""
    if mode not in ONEDNN_ACTIVATION_MODES:
        raise ValueError(f"`mode` must be one of {list(ONEDNN_ACTIVATION_MODES)}; got "
                         f"mode={mode!r}.")
    previous = _ACTIVATION_MODE[0]
    _ACTIVATION_MODE[0] = mode
    _ACTIVATION_CHOICE.clear()
    return previous


def _activation_after(activation, y):
    """`activation` of a product's fresh output `y` (no autograd) as torch ops."""
    import torch.nn.functional as F

    if activation == "relu":
        return y.relu_()
    if activation == "gelu_tanh":
        from kzoo.layers import feedforward

        if y.numel() < feedforward._TORCH_GELU_PASSES_FROM:
            return F.gelu(y, approximate="tanh")
        return feedforward._torch_gelu_tanh_sigmoid(y).mul_(y)
    return F.gelu(y)


def _post_op_wins(activation, x, weight, bias):
    """Whether `torch_linear` applies `activation` as oneDNN's post-op for this product."""
    import torch

    mode = _ACTIVATION_MODE[0]
    if mode != "auto":
        return mode == "fused"
    rows = x.reshape(-1, x.shape[-1])
    if (rows.shape[0] < ACTIVATION_TIMING_ROWS or type(x) is not torch.Tensor
            or torch.compiler.is_compiling()):  # (nothing to time on a traced tensor)
        return True
    key = (activation, int(weight.shape[1]), int(weight.shape[0]), bias is not None)
    won = _ACTIVATION_CHOICE.get(key)
    if won is None:
        won = _ACTIVATION_CHOICE[key] = _time_post_op(activation, rows, weight, bias)
    return won


def fastest_way(ways, calls, clock, margin=1.0):
    """The key of the fastest of `ways` ({key: function}; the first is the default): each
    runs 1 + `calls` times, the ways alternating, the first run of each untimed; another way
    wins only when its median time is below `margin` times the first's (`margin=1.0`: a tie
    to the first). `clock`: the timer."""
    import statistics

    seconds = {key: [] for key in ways}
    for _ in range(1 + calls):
        for key, way in ways.items():
            start = clock()
            way()
            seconds[key].append(clock() - start)
    medians = {key: statistics.median(times[1:]) for key, times in seconds.items()}
    first = next(iter(ways))
    best = min(medians, key=medians.get)
    return best if medians[best] < margin * medians[first] else first


def _time_post_op(activation, rows, weight, bias, clock=None):
    """Whether oneDNN's post-op computed `activation(rows @ weight^T + bias)` faster than the
    product then `_activation_after`, on up to `2 * ACTIVATION_TIMING_ROWS` of `rows`: the
    two ways alternate, each 1 + `_ACTIVATION_TIMING_CALLS` times (the first untimed), and
    their medians compare. `clock`: the timer (`time.perf_counter`)."""
    import time

    clock = clock or time.perf_counter
    op = _ONEDNN_LINEAR[0]
    attr, algorithm = _TORCH_LINEAR_ACTIVATIONS[activation][:2]
    sample = rows[:2 * ACTIVATION_TIMING_ROWS]
    ways = {True: lambda: op(sample, weight, bias, attr, [], algorithm),
            False: lambda: _activation_after(activation, op(sample, weight, bias, "none", [],
                                                            ""))}
    return fastest_way(ways, _ACTIVATION_TIMING_CALLS, clock)  # (a tie to the post-op)


def torch_linear_uses_onednn(x, weight, bias=None):
    """Whether `torch_linear(x, weight, bias)` takes oneDNN's kernel (see there)."""
    import torch

    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32) or x.dim() < 2
            or x.numel() == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
                bias is not None and bias.requires_grad)))):
        return False
    if torch.compiler.is_compiling():
        # (Inductor lowers the op only for the packed weights its own passes make: a model
        # compiled with `jit_compile=True` failed its first `predict` with a
        # LoweringException; traced, `F.linear` is Inductor's to lower)
        return False
    if x.numel() == x.shape[-1] and not weight.is_contiguous():
        # One row times a weight that is not row-major `(out, in)` (a Dense kernel's `.t()`):
        # oneDNN reorders the weight at every call, slower than MKL (us: `(256 -> 1024)`
        # 24 -> 46); from 4 rows on it was faster (4 rows 74 -> 53, 128 rows 499 -> 343)
        return False
    return onednn_linear_available()


# Rows from which `torch_linear` runs a product that autograd records through oneDNN (a
# training step's products have batch x length rows; a handful of rows keeps `F.linear`).
ONEDNN_TRAIN_ROWS = 64


def _onednn_trains(x, weight, bias):
    """Whether `torch_linear` takes its autograd function (oneDNN forward and input gradient):
    autograd records the product, CPU, float32, at least `ONEDNN_TRAIN_ROWS` rows, not while
    `torch.compile` traces, oneDNN usable."""
    import torch

    operands = (x, weight) if bias is None else (x, weight, bias)
    return (torch.is_grad_enabled() and any(t.requires_grad for t in operands)
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in operands)
            and x.dim() >= 2 and x.numel() >= ONEDNN_TRAIN_ROWS * max(x.shape[-1], 1) > 0
            and not torch.compiler.is_compiling() and onednn_linear_available())


_ONEDNN_FUNCTION = []  # the autograd function of `torch_linear` in training, made once


def _onednn_linear_function():
    """`apply(x (..., in), weight (out, in), bias (out,) or None)` -> `x @ weight^T + bias`
    by oneDNN's op, with its gradients (see `torch_linear`)."""
    if _ONEDNN_FUNCTION:
        return _ONEDNN_FUNCTION[0]
    import torch

    class OneDnnLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            ctx.has_bias = bias is not None
            return _ONEDNN_LINEAR[0](x, weight, bias, "none", [], "")

        @staticmethod
        def backward(ctx, g):
            x, weight = ctx.saved_tensors
            need_x, need_w, need_b = ctx.needs_input_grad
            g2 = g.reshape(-1, g.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            d_x = d_w = d_b = None
            if torch.is_grad_enabled():  # (create_graph: differentiable ops)
                if need_x:
                    d_x = (g2 @ weight).reshape(x.shape)
                if need_w:
                    d_w = g2.t() @ x2
            else:
                if need_x:  # (`weight.t()` is a Dense kernel itself: row-major)
                    d_x = _ONEDNN_LINEAR[0](g2, weight.t(), None, "none", [], "").reshape(
                        x.shape)
                if need_w:
                    d_w = (torch.mm(g2.t(), x2) if weight.is_contiguous()
                           else torch.mm(x2.t(), g2).t())
            if need_b and ctx.has_bias:
                d_b = g2.sum(0)
            return d_x, d_w, d_b

    _ONEDNN_FUNCTION.append(OneDnnLinear)
    return OneDnnLinear


def onednn_linear_available():
    """Whether oneDNN's linear op can be taken at all: this torch build has it, it computed
    a small product right (checked once), and `torch.backends.mkldnn.enabled` is on."""
    import torch

    if not torch.backends.mkldnn.enabled:
        return False
    if not _ONEDNN_LINEAR:
        _ONEDNN_LINEAR.append(_onednn_linear_op())
    return _ONEDNN_LINEAR[0] is not None


def _onednn_linear_op():
    """oneDNN's linear op when this torch build has it and it computes a small product
    right (checked once against `F.linear`); otherwise None."""
    import torch
    import torch.nn.functional as F

    try:
        if not torch.backends.mkldnn.is_available():
            return None
        op = torch.ops.mkldnn._linear_pointwise
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
        w = torch.arange(20, dtype=torch.float32).reshape(5, 4) / 11 - 1
        b = torch.arange(5, dtype=torch.float32)
        with torch.no_grad():
            ok = torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5)
        return op if ok else None
    except (AttributeError, RuntimeError):
        return None
