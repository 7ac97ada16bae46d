"""Position-wise feed-forward blocks: the plain two-layer MLP and the gated (GLU) variants.

`get_activation(name)` is the one name -> function table of the zoo; model families look
their activations up here so that "gelu" means the same function everywhere.
"""

import contextlib
import math

import keras
from keras import ops

from kzoo.layers.gradients import tf_custom_gradient
from kzoo.layers.utils import check_bool
from kzoo.layers.utils import check_positive_int
from kzoo.layers.utils import check_rate
from kzoo.layers.utils import last_axis_size
from kzoo.layers.utils import project
from kzoo.layers.utils import serialize_initializer


def _gelu_exact(x):
    if keras.backend.backend() == "jax" and not _PORTABLE:
        return _jax_gelu_exact(x)
    if keras.backend.backend() == "tensorflow":
        return _tf_gelu_exact(x)
    return ops.gelu(x, approximate=False)


_PORTABLE = []  # non-empty while `portable_activations()` is active


@contextlib.contextmanager
def portable_activations():
    """Trace the activations in their most portable form: the exact GELU on JAX through
    `erfc` (`jax.nn.gelu`) rather than `erf`, which JAX lowers to a StableHLO composite that
    older deserialisers (TensorFlow's XLA in a jax2tf SavedModel) refuse. `kzoo.export`
    traces under it."""
    _PORTABLE.append(True)
    try:
        yield
    finally:
        _PORTABLE.pop()


def _jax_gelu_exact(x):
    """The exact GELU on JAX as `0.5 x (1 + erf(x / sqrt 2))` (torch's formula), its
    gradient by JAX. `jax.nn.gelu(approximate=False)` takes `erfc`, which XLA on CPU lowers to
    branches of two polynomials and an exponential: measured on the 2-core CPU at (8, 256,
    1024) float32, forward 1.5-2.0 -> 0.6 ms, forward + backward 1.6 -> 1.3 ms; the largest
    difference from float64 over |x| < 15 is 1.1e-6 (erfc: 3.8e-7). Not while exporting
    (`portable_activations`)."""
    import jax

    return 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))


_SQRT_HALF = 1.0 / math.sqrt(2.0)


def _tf_gelu_exact(x):
    """The exact GELU on TensorFlow as `0.5 x (1 + erf(x / sqrt 2))`, the formula of torch
    and of `_jax_gelu_exact`, its gradient by TensorFlow. `tf.nn.gelu` takes `erfc`, slower
    on the 2-core CPU at (2048, 1024) float32 after a product: forward under XLA +1.3-1.7 ->
    +0.5-1.0 ms over the product alone, forward + backward in a graph 17.8 -> 16.5 ms, in
    XLA 13.5 -> 12.9 ms; the largest difference from float64 over |x| < 15 is 1.9e-6
    (erfc: 3.8e-7)."""
    import tensorflow as tf

    return 0.5 * x * (1.0 + tf.math.erf(x * _SQRT_HALF))


def _gelu_tanh(x):
    if keras.backend.backend() == "tensorflow":
        return _tf_gelu_tanh(x)
    if keras.backend.backend() == "torch":
        return _torch_gelu_tanh(x)
    return ops.gelu(x, approximate=True)


# 0.5 x (1 + tanh(u)) = x sigmoid(2u) with u = sqrt(2 / pi) (x + 0.044715 x^3): the
# argument of the sigmoid is x (_K1 + _K2 x^2).
_K1 = 2.0 * math.sqrt(2.0 / math.pi)
_K2 = _K1 * 0.044715


def _tf_gelu_tanh(x):
    """The tanh GELU on TensorFlow as `x * sigmoid(x (k1 + k2 x^2))` with a hand-written
    gradient `s + x s (1 - s) (k1 + 3 k2 x^2)` (`s` the sigmoid, kept from the forward pass).
    TensorFlow's own `gelu` is eight element-wise ops, each a tensor of the input's size,
    and its derivative about fourteen more, several of them kept for the backward pass.
    Measured on the 2-core CPU, GPT of `benchmarks/peers.py`'s size: training +2.5% / +3.6%
    and forward +2.8% / +4.4% (two interleaved A/Bs), peak training memory 655-679 -> 563-570
    MiB (fresh processes)."""
    import tensorflow as tf

    @tf_custom_gradient
    def gelu(x):
        s = tf.sigmoid(x * (_K1 + _K2 * tf.square(x)))

        def grad(g):
            slope = _K1 + (3.0 * _K2) * tf.square(x)
            # s (1 - s) x slope as TensorFlow's one `SigmoidGrad` op, not three products
            return g * (s + tf.raw_ops.SigmoidGrad(y=s, dy=x * slope))

        return x * s, grad

    return gelu(x)


def _torch_gelu_tanh(x):
    """The tanh GELU on torch, for CPU float32 tensors, as `x * sigmoid(x (k1 + k2 x^2))`
    in four passes over the tensor (`addcmul`, then in place), with a hand-written gradient
    `g (s + x s (1 - s) (k1 + 3 k2 x^2))` that recomputes the sigmoid `s` from the kept
    input (so training keeps what autograd's own `gelu` keeps: the input). torch's
    `gelu(approximate="tanh")` and its backward evaluate `tanh` per element, slow on this
    CPU build (`torch.tanh` of a (8, 256, 1024) float32 tensor: 2.8 ms, `sigmoid` 0.5).
    Measured on the 2-core CPU at that size, inputs rotating through 12 tensors (192 MiB,
    out of cache), ms: forward 1.78-1.83 -> 1.04-1.52, backward 2.01-2.07 -> 1.62-1.72; in
    a GPT training step (benchmarks.peers' size, interleaved in one process, 8 rounds, each
    faster) 4,369 -> 4,452 tokens/s, the same losses to all printed digits (keeping `s`
    from the forward pass instead: 4,466, one more tensor kept a layer). Largest errors against
    float64 for |x| up to 9: forward 5.2e-7 (torch's 4.3e-7), gradient 6.4e-6 (3.8e-6); the
    same results as torch's for infinities, NaN and +-0. Other devices and
    dtypes, tensors of fewer than `_TORCH_GELU_PASSES_FROM` elements (a decode step's few
    rows: there the passes' fixed cost wins, us: 4,096 elements 8.1 -> 11.5, 16,384 28.4 ->
    19.0) and code that `torch.compile` traces take `F.gelu(approximate="tanh")`."""
    import torch

    if (not isinstance(x, torch.Tensor) or x.device.type != "cpu"
            or x.dtype != torch.float32 or x.numel() < _TORCH_GELU_PASSES_FROM
            or torch.compiler.is_compiling()):
        return ops.gelu(x, approximate=True)
    if torch.is_grad_enabled() and x.requires_grad:
        return _torch_gelu_tanh_function().apply(x)
    return _torch_gelu_tanh_sigmoid(x).mul_(x)


_TORCH_GELU_PASSES_FROM = 8192


def _torch_gelu_tanh_sigmoid(x):
    """`sigmoid(x (k1 + k2 x^2))`, a new tensor, in three passes."""
    import torch

    return torch.addcmul(_torch_constant(_K1), x, x, value=_K2).mul_(x).sigmoid_()


def _torch_constant(value):
    import torch

    return torch.tensor(value, dtype=torch.float32)


_TORCH_GELU_FUNCTION = []  # the autograd function of `_torch_gelu_tanh`, made once


def _torch_gelu_tanh_function():
    if _TORCH_GELU_FUNCTION:
        return _TORCH_GELU_FUNCTION[0]
    import torch

    class GeluTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return _torch_gelu_tanh_sigmoid(x).mul_(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            if torch.is_grad_enabled():  # (create_graph: differentiable ops)
                s = torch.sigmoid(x * (_K1 + _K2 * x * x))
                return g * (s + x * s * (1.0 - s) * (_K1 + 3.0 * _K2 * x * x))
            s = _torch_gelu_tanh_sigmoid(x)
            d = torch.addcmul(_torch_constant(_K1), x, x, value=3.0 * _K2).mul_(x)
            d.addcmul_(d, s, value=-1.0)  # x (k1 + 3 k2 x^2) (1 - s)
            torch.addcmul(s, d, s, out=d)  # s + s x (k1 + 3 k2 x^2) (1 - s)
            return d.mul_(g)

    _TORCH_GELU_FUNCTION.append(GeluTanh)
    return GeluTanh


def _quick_gelu(x):
    # x * sigmoid(1.702 x) (CLIP's QuickGELU).
    return x * ops.sigmoid(ops.cast(1.702, x.dtype) * x)


def _linear(x):
    return x


# name -> function. Aliases are listed explicitly so that Hugging Face `hidden_act`
# strings can be passed through unchanged.
_ACTIVATIONS = {
    "relu": ops.relu,
    "gelu": _gelu_exact,
    "gelu_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "silu": ops.silu,
    "swish": ops.silu,
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
    "linear": _linear,
}

ACTIVATION_NAMES = tuple(sorted(_ACTIVATIONS))


def get_activation(name):
    """Return the element-wise activation function called `name`.

    Known names:

    - `"relu"`: max(x, 0).
    - `"gelu"`: exact GELU, x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2))) (BERT, ViT).
    - `"gelu_tanh"`, `"gelu_new"`, `"gelu_pytorch_tanh"`: the tanh approximation
      0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (GPT-2's "gelu_new", T5 v1.1).
    - `"quick_gelu"`: x * sigmoid(1.702 x) (CLIP).
    - `"silu"`, `"swish"`: x * sigmoid(x).
    - `"tanh"`, `"sigmoid"`, `"linear"` (identity).

    Args:
        name: one of the names above (a string).

    Returns:
        A function tensor -> tensor built from `keras.ops`.

    Raises:
        ValueError: for an unknown name.

    Example:

    ```python
    act = kzoo.layers.feedforward.get_activation("gelu_new")
    y = act(keras.ops.linspace(-3.0, 3.0, 7))
    ```
    """
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {list(ACTIVATION_NAMES)}; got activation={name!r}."
        )
    return _ACTIVATIONS[name]


def _ffn_config(layer):
    return {
        "intermediate_dim": layer.intermediate_dim,
        "activation": layer.activation,
        "use_bias": layer.use_bias,
        "dropout": layer.dropout,
        "output_dim": layer.output_dim,
        "kernel_initializer": layer.kernel_initializer,
        "bias_initializer": layer.bias_initializer,
        "output_kernel_initializer": layer.output_kernel_initializer,
    }


def _dense(layer, units, name, initializer=None):
    return keras.layers.Dense(
        units,
        use_bias=layer.use_bias,
        kernel_initializer=keras.initializers.get(initializer or layer.kernel_initializer),
        bias_initializer=keras.initializers.get(layer.bias_initializer),
        dtype=layer.dtype_policy,
        name=name,
    )


class _FeedForwardBase(keras.layers.Layer):
    """What FeedForward and GatedFeedForward share: argument checks, the output projection,
    the output shape and the config."""

    def __init__(self, intermediate_dim, activation, use_bias, dropout, output_dim,
                 kernel_initializer, bias_initializer, output_kernel_initializer, **kwargs):
        super().__init__(**kwargs)
        self.intermediate_dim = check_positive_int("intermediate_dim", intermediate_dim)
        get_activation(activation)
        self.activation = activation
        self.use_bias = check_bool("use_bias", use_bias)
        self.dropout = check_rate("dropout", dropout)
        self.output_dim = check_positive_int("output_dim", output_dim, allow_none=True)
        self.kernel_initializer = serialize_initializer(kernel_initializer, "kernel_initializer")
        self.bias_initializer = serialize_initializer(bias_initializer, "bias_initializer")
        self.output_kernel_initializer = (
            None if output_kernel_initializer is None
            else serialize_initializer(output_kernel_initializer, "output_kernel_initializer")
        )
        self._activation_fn = get_activation(activation)
        self.dropout_layer = keras.layers.Dropout(
            self.dropout, dtype=self.dtype_policy, name="dropout"
        )
        self.output_dense = None

    def _build_output(self, input_shape):
        """Create the output projection for inputs of `input_shape`; returns nothing."""
        dim = last_axis_size(self.__class__.__name__, input_shape)
        self.output_dense = _dense(
            self, self.output_dim or dim, "output_dense", self.output_kernel_initializer
        )

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.output_dim or input_shape[-1],)

    def get_config(self):
        config = super().get_config()
        config.update(_ffn_config(self))
        return config


@keras.saving.register_keras_serializable(package="kzoo")
class FeedForward(_FeedForwardBase):
    """Position-wise feed-forward network of the Transformer (Vaswani et al., 2017).

    `y = W_out(dropout(act(W_in x + b_in))) + b_out`, applied to the last axis.

    Args:
        intermediate_dim: width of the hidden layer (positive int).
        activation: activation name understood by `get_activation` (default `"gelu"`,
            the exact erf form).
        use_bias: whether both projections have a bias.
        dropout: dropout rate on the hidden activations, in [0, 1).
        output_dim: width of the output; `None` keeps the input width.
        kernel_initializer: initializer of the kernels (of the input one only when
            `output_kernel_initializer` is given).
        bias_initializer: initializer of both biases.
        output_kernel_initializer: initializer of the output kernel (None:
            `kernel_initializer`; GPT-2 and T5 draw it with their own std).
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Sublayers: `intermediate_dense` (kernel `(dim, intermediate_dim)`, bias) and
    `output_dense` (kernel `(intermediate_dim, output_dim)`, bias), both `keras.layers.Dense`.

    Call args:
        inputs: tensor `(..., dim)`.
        training: enables dropout.

    Returns:
        Tensor `(..., output_dim or dim)`.

    Example:

    ```python
    ffn = kzoo.layers.feedforward.FeedForward(intermediate_dim=3072, activation="gelu")
    y = ffn(keras.random.normal((2, 16, 768)))  # (2, 16, 768)
    ```
    """

    def __init__(
        self,
        intermediate_dim,
        activation="gelu",
        use_bias=True,
        dropout=0.0,
        output_dim=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        output_kernel_initializer=None,
        **kwargs,
    ):
        super().__init__(
            intermediate_dim, activation, use_bias, dropout, output_dim, kernel_initializer,
            bias_initializer, output_kernel_initializer, **kwargs,
        )

        # === Layers ===
        self.intermediate_dense = _dense(self, intermediate_dim, "intermediate_dense")

    def build(self, input_shape):
        self._build_output(input_shape)
        self.intermediate_dense.build(input_shape)
        hidden_shape = tuple(input_shape[:-1]) + (self.intermediate_dim,)
        self.output_dense.build(hidden_shape)
        self.built = True

    def call(self, inputs, training=None):
        h = self._activation_fn(project(self.intermediate_dense, inputs))
        h = self.dropout_layer(h, training=training)
        return project(self.output_dense, h)


@keras.saving.register_keras_serializable(package="kzoo")
class GatedFeedForward(_FeedForwardBase):
    """Gated linear unit feed-forward (Shazeer, 2020, "GLU Variants Improve Transformer").

    `y = W_o(dropout(act(x W_gate) * (x W_up)))`. The activation picks the variant:

    - `"sigmoid"`: GLU (Dauphin et al., 2017).
    - `"relu"`: ReGLU.
    - `"gelu"`: GEGLU with the exact erf GELU.
    - `"gelu_tanh"` (alias `"gelu_new"`): GEGLU with the tanh GELU (T5 v1.1 "gated-gelu").
    - `"silu"` (alias `"swish"`): SwiGLU (LLaMA, Mixtral).
    - `"linear"`: bilinear.

    Any other name of `get_activation` is accepted as well.

    Args:
        intermediate_dim: width of the gated hidden layer (positive int).
        activation: activation of the gate branch (default `"silu"`, SwiGLU).
        use_bias: whether the three projections have biases (default False, as in the paper).
        dropout: dropout rate on the gated hidden activations, in [0, 1).
        output_dim: width of the output; `None` keeps the input width.
        kernel_initializer: initializer of the kernels (of the gate and up ones only when
            `output_kernel_initializer` is given).
        bias_initializer: initializer of the biases.
        output_kernel_initializer: initializer of the output kernel (None:
            `kernel_initializer`).
        **kwargs: base `keras.layers.Layer` arguments.

    Sublayers: `gate_dense`, `up_dense` (kernels `(dim, intermediate_dim)`) and
    `output_dense` (kernel `(intermediate_dim, output_dim)`), all `keras.layers.Dense`.

    Call args:
        inputs: tensor `(..., dim)`.
        training: enables dropout.

    Returns:
        Tensor `(..., output_dim or dim)`.

    Example:

    ```python
    swiglu = kzoo.layers.feedforward.GatedFeedForward(intermediate_dim=1408)
    y = swiglu(keras.random.normal((2, 16, 512)))  # (2, 16, 512)
    ```
    """

    def __init__(
        self,
        intermediate_dim,
        activation="silu",
        use_bias=False,
        dropout=0.0,
        output_dim=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        output_kernel_initializer=None,
        **kwargs,
    ):
        super().__init__(
            intermediate_dim, activation, use_bias, dropout, output_dim, kernel_initializer,
            bias_initializer, output_kernel_initializer, **kwargs,
        )

        # === Layers ===
        self.gate_dense = _dense(self, intermediate_dim, "gate_dense")
        self.up_dense = _dense(self, intermediate_dim, "up_dense")

    def build(self, input_shape):
        self._build_output(input_shape)
        self.gate_dense.build(input_shape)
        self.up_dense.build(input_shape)
        self.output_dense.build(tuple(input_shape[:-1]) + (self.intermediate_dim,))
        self.built = True

    def call(self, inputs, training=None):
        gate = self._activation_fn(project(self.gate_dense, inputs))
        h = gate * project(self.up_dense, inputs)
        h = self.dropout_layer(h, training=training)
        return project(self.output_dense, h)

