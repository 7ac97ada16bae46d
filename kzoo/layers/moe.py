"""Sparse mixture-of-experts feed-forward layer (Shazeer et al. 2017; GShard; Switch; Mixtral).

How tokens reach their experts (no Python loop over experts, static shapes, `jit`-safe):

1. The router (a float32 `Dense(num_experts, use_bias=False)`) scores every token; softmax
   probabilities; `top_k` experts per token (equal probabilities: the lowest expert id
   first, on every backend).
2. The `tokens * top_k` (token, expert) assignments are laid out "choice-major": all top-1
   choices in token order, then all top-2 choices, ... A running count per expert (a cumsum
   over the one-hot expert ids) gives every assignment its position inside its expert, so
   earlier choices and earlier tokens are served first (GShard's priority rule).
3. Assignments with `position < capacity` are gathered into a buffer
   `(num_experts, capacity, dim)`; the experts run as batched matmuls against the stacked
   weights `(num_experts, dim, intermediate_dim)`; the results are gathered back per
   assignment, weighted by the router and summed over the `top_k` choices.

Compute is therefore `num_experts * capacity` rows, i.e. proportional to
`tokens * top_k * capacity_factor`, not to `tokens * num_experts`.

Capacity:

- `capacity_factor=c`: `capacity = ceil(c * tokens * top_k / num_experts)` (capped at
  `tokens`). Assignments past an expert's capacity are dropped: that expert contributes zero
  to that token (the residual connection around the layer is the caller's job).
- `capacity_factor=None` (default): nothing is ever dropped.
  * Compiled (`jit`, `tf.function`): the layer picks, at run time, the smallest of a few
    static capacities (`NO_DROP_CAPACITY_FACTORS` times the balanced load
    `tokens * top_k / num_experts`, rounded up to a multiple of 8, and finally `tokens`,
    which always suffices) that holds the busiest expert, with `keras.ops.switch`. Every
    branch has static shapes; only the chosen one runs. A balanced router costs ~1.25x the
    ideal `top_k` FLOPs; a collapsed router (all tokens to one expert) falls back to
    capacity = tokens, `num_experts / top_k` times the ideal, and is still exact.
  * Eager PyTorch (its default) and eager TensorFlow: shapes may follow the data, so the
    kept rows are gathered expert after expert and each expert multiplies exactly its own
    rows (one matmul per expert, no padding): compute is exactly `top_k` dense layers.
  * Eager JAX (outside `jit`) compiles every op per shape, so there the capacity is the
    busiest expert's load rounded up to 1/16 of the balanced load.

Gradients of the two gathers (tokens -> slots, slots -> assignments) are written by hand as
gathers the other way round, so the backward pass has no scatter-add.
"""

import contextlib
import functools
from fractions import Fraction

import keras
from keras import ops

from kzoo.layers.feedforward import get_activation
from kzoo.layers.gradients import custom_gradient
from kzoo.layers.utils import check_bool
from kzoo.layers.utils import check_choice
from kzoo.layers.utils import check_positive_float
from kzoo.layers.utils import check_positive_int
from kzoo.layers.utils import check_rate
from kzoo.layers.utils import last_axis_size
from kzoo.layers.utils import serialize_initializer

# Capacities tried, in order, when `capacity_factor is None` (multiples of the balanced load
# tokens * top_k / num_experts); the last resort is capacity = tokens.
NO_DROP_CAPACITY_FACTORS = (1.25, 1.5, 2.0, 3.0)


# True while `kzoo.export` traces a model (see `exporting`).
_EXPORTING = [False]


@contextlib.contextmanager
def exporting():
    """Route for an exported graph: the largest static capacity only (no `switch` over
    capacities, which tf2onnx writes as TensorFlow's `_SwitchN`/`Merge` that onnxruntime
    rejects and jax2onnx cannot read with more than two branches), and one-hot masks as an
    equality against `arange` (onnxruntime has no int32 `OneHot`). The same numbers: the
    largest capacity holds every assignment the chosen smaller one would."""
    previous = _EXPORTING[0]
    _EXPORTING[0] = True
    try:
        yield
    finally:
        _EXPORTING[0] = previous


def _one_hot(indices, depth, dtype):
    if not _EXPORTING[0]:
        return ops.one_hot(indices, depth, dtype=dtype)
    return ops.cast(ops.expand_dims(indices, -1) == ops.arange(depth, dtype=indices.dtype),
                    dtype)


def _factor_fraction(factor, top_k, num_experts):
    """`(p, q)` with p / q the capacity factor as written in decimal (1.1 is 11 / 10, not
    the binary float just above it), so that a capacity is an exact integer formula;
    `(1, 0)` when the factor gives every token a slot anyway (factor * top_k >=
    num_experts). p * q * num_experts stays below 2**31 (int32 arithmetic in graphs): a
    factor with more digits than that allows is read as the nearest fraction that fits
    (within ~1e-8 of it)."""
    exact = Fraction(repr(float(factor)))
    if exact * top_k >= num_experts:
        return 1, 0
    fraction, limit = exact, exact.denominator
    while fraction.numerator * fraction.denominator * num_experts >= 2**31:
        limit //= 2
        fraction = exact.limit_denominator(limit)
    return fraction.numerator, fraction.denominator


def _TRACKERS_SUPPORTED():
    return keras.backend.backend() != "jax"


def _RAGGED_EAGER():
    return keras.backend.backend() in ("torch", "tensorflow")


def _concrete_int(value):
    """`int(value)` for an eager tensor, None for a traced/symbolic one (jit, tf.function)."""
    try:
        return int(value)
    except Exception:  # tracers and graph tensors refuse conversion to a Python int
        return None


def _check_non_negative_float(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"`{name}` must be a non-negative number; got {name}={value!r}.")
    return float(value)


def _stacked_initializer(initializer, num_experts):
    """An initializer for a `(num_experts, fan_in, fan_out)` stack of expert kernels.

    Keras' variance-scaling initializers count the leading axis as a receptive field and
    would shrink the variance by `num_experts`; scaling `scale` by `num_experts` gives each
    expert exactly the variance of a `(fan_in, fan_out)` kernel. Shape-free initializers
    (normal, uniform, constants) are used unchanged.
    """
    init = keras.initializers.get(initializer)
    if isinstance(init, keras.initializers.VarianceScaling):
        return keras.initializers.VarianceScaling(
            scale=init.scale * num_experts,
            mode=init.mode,
            distribution=init.distribution,
            seed=init.seed,
        )
    return init


def _top_k_lowest_first(probs, k):
    """`(values, indices)` of the `k` largest entries of each row of `probs` (tokens, E),
    descending; equal probabilities are taken lowest expert id first, on every backend.

    `keras.ops.top_k` is `torch.topk` on torch, which breaks ties in no set order: with
    every router logit equal (a zero router kernel, or an all-zero token) it picked experts
    6 and 5 of 8 where JAX and TensorFlow pick 0 and 1, and the layer's output was up to
    1.4 apart from theirs (and from the NumPy reference). `k` rounds of "largest value,
    then its smallest index" (a max and a min per row) pick the same experts everywhere.
    """
    e = ops.shape(probs)[-1]
    ids = ops.arange(e, dtype="int32")[None, :]
    masked, chosen = probs, []
    for _ in range(k):  # k is small (1 or 2 in practice)
        best = ops.max(masked, axis=-1, keepdims=True)
        index = ops.min(ops.where(masked == best, ids, e), axis=-1)
        index = ops.minimum(index, e - 1)  # (a NaN row matches nothing: keep it in range)
        chosen.append(index)
        masked = ops.where(ids == index[:, None], -1.0, masked)  # probabilities are >= 0
    top_idx = ops.stack(chosen, axis=-1)
    return ops.take_along_axis(probs, top_idx, axis=-1), top_idx


def _check_padding_mask(padding_mask, inputs):
    """`padding_mask` must have the shape of `inputs` without its last axis (the axes
    not known statically are not compared). It is flattened beside the tokens, so a mask of
    another shape with as many entries, e.g. `(seq, batch)` for inputs `(batch, seq, dim)`,
    was read in silence for other tokens, and one with a different count failed in a
    backend broadcast (TypeError on JAX, RuntimeError on torch, InvalidArgumentError on
    TensorFlow)."""
    got = tuple(getattr(padding_mask, "shape", None) or ops.shape(padding_mask))
    want = tuple(inputs.shape)[:-1]
    # (symbolic sizes, a JAX export's "batch", are not compared either: `int` refuses them)
    sizes = [(_concrete_int(a) if a is not None else None,
              _concrete_int(b) if b is not None else None) for a, b in zip(got, want)]
    if len(got) != len(want) or any(
            a is not None and b is not None and a != b for a, b in sizes):
        raise ValueError(
            f"`padding_mask` must have the shape of `inputs` without its last axis, "
            f"{want} (one entry a token); got padding_mask with shape {got}."
        )


# --- gather-only dispatch and combine ---------------------------------------------------
# Moving rows between token order and the (experts * capacity) slot grid is a gather in
# both directions: the gradient of "gather by slot_token" is "gather by slot" summed over
# the top-k choices, and vice versa. Writing these gradients by hand keeps scatter-adds
# (slow on CPU, and IndexedSlices that TensorFlow's XLA cannot densify inside a `cond`
# branch when the batch size is dynamic) out of the backward pass.


def _upstream(args, upstream):
    # TF/JAX call grad(upstream); Keras' torch backend calls grad(*inputs, upstream=...).
    return args[0] if upstream is None else upstream


def _sum_choices(rows, num_tokens, top_k):
    """(k * tokens, dim), choice-major -> (tokens, dim) summed over the k choices."""
    total = rows[:num_tokens]
    for j in range(1, top_k):  # k slices; cheaper than a reduction over a leading axis
        total = total + rows[j * num_tokens:(j + 1) * num_tokens]
    return total


def _dispatch(x, slot_token, slot, top_k):
    """x (tokens, dim) -> (slots, dim): row s is token slot_token[s].

    Empty slots hold an arbitrary token: their expert outputs are never read by `_combine`,
    so they get no gradient either. `slot` (k * tokens,) is the slot of each assignment, or
    one past the last slot for dropped / padded assignments.
    """

    @custom_gradient
    def dispatch(x, slot_token, slot):
        out = ops.take(x, slot_token, axis=0)

        def grad(*args, upstream=None):
            g = _upstream(args, upstream)
            g_pad = ops.concatenate([g, ops.zeros((1, ops.shape(g)[1]), g.dtype)], axis=0)
            per_assignment = ops.take(g_pad, slot, axis=0)  # (k * tokens, dim)
            return _sum_choices(per_assignment, ops.shape(x)[0], top_k), None, None

        return out, grad

    return dispatch(x, slot_token, slot)


@custom_gradient
def _combine(ye, slot, slot_assignment):
    """ye (slots, dim) -> (k * tokens, dim): row a is the output of assignment a's slot.

    Dropped assignments read the last slot; the caller zeroes their router weight.
    `slot_assignment` (slots,) holds 1 + the assignment of each slot, 0 for empty slots.
    """
    num_slots = ops.shape(ye)[0]
    out = ops.take(ye, ops.minimum(slot, num_slots - 1), axis=0)

    def grad(*args, upstream=None):
        g = _upstream(args, upstream)
        g_pad = ops.concatenate([ops.zeros((1, ops.shape(g)[1]), g.dtype), g], axis=0)
        return ops.take(g_pad, slot_assignment, axis=0), None, None

    return out, grad


@keras.saving.register_keras_serializable(package="kzoo")
class MixtureOfExperts(keras.layers.Layer):
    """Top-k routed mixture of feed-forward experts.

    Each token is routed to its `top_k` most probable experts (Shazeer et al., 2017) and the
    output is the router-weighted sum of those experts' feed-forward outputs. With
    `top_k=1, normalize_top_k=False` this is the Switch Transformer layer (Fedus et al.,
    2021); with `top_k=2, expert_type="gated", normalize_top_k=True` it is Mixtral's sparse
    MoE block. See the module docstring for the dispatch and the capacity rule.

    Experts: `expert_type="plain"` is `act(x W_in + b_in) W_out + b_out` (like
    `FeedForward`); `"gated"` is `(act(x W_gate) * (x W_up)) W_out` (like
    `GatedFeedForward`). Weights are stacked per expert: variables `intermediate_kernel`
    `(num_experts, dim, intermediate_dim)`, `intermediate_bias` `(num_experts,
    intermediate_dim)`, `output_kernel` `(num_experts, intermediate_dim, dim)`, `output_bias`
    `(num_experts, dim)` for plain experts; `gate_kernel`, `up_kernel` (+ `gate_bias`,
    `up_bias`) and `output_kernel` (+ `output_bias`) for gated ones. The router is the
    sublayer `router` (a `Dense` with kernel `(dim, num_experts)`, no bias) whose weights
    and arithmetic are always float32 (Switch's "selective precision"), whatever the layer's
    dtype policy.

    Auxiliary losses (computed over non-padded tokens, before any capacity dropping):

    - load balancing (Switch, eq. 4): `num_experts * sum_e f_e * P_e`, where `f_e` is the
      fraction of tokens whose top-1 choice is expert `e` (the Switch/GShard convention,
      also for `top_k > 1`; Hugging Face's Mixtral loss counts every top-k choice instead,
      which is `top_k` times larger at balance) and `P_e` the mean router probability of
      `e`. Equals 1 for a perfectly balanced router.
    - router z-loss (ST-MoE, Zoph et al., 2022): mean over tokens of
      `logsumexp(router_logits)^2`.

    Where to find them:

    - `training=True` adds `load_balance_loss_weight * lb` and `router_z_loss_weight * z`
      to `layer.losses` / `model.losses` (a weight of 0 adds nothing), so `model.fit`
      minimises them.
    - With `training` set (True or False, i.e. inside `fit`, `evaluate`, `predict`) two
      `keras.metrics.Mean` trackers record the *unweighted* values, and the logs show them
      as `"<layer name>_load_balance_loss"` and `"<layer name>_router_z_loss"` (plus
      `val_...` with validation data). TensorFlow and PyTorch only: Keras' JAX trainer
      runs the forward pass in a stateless scope that carries no metric state, so on JAX
      the trackers are not reported (use `return_aux_losses=True`).
    - `call(..., return_aux_losses=True)` returns the unweighted values functionally
      (works under `jit` on every backend).
    - `layer.last_load_balance_loss` / `layer.last_router_z_loss` keep the unweighted
      values of the latest call that computed them (any call with `training` set or
      `return_aux_losses=True`; plain inference calls skip the computation). Meaningful
      after eager calls; under `jit` they hold traced values.

    Args:
        num_experts: number of experts (positive int).
        intermediate_dim: hidden width of each expert.
        top_k: experts per token, `1 <= top_k <= num_experts`.
        expert_type: `"plain"` or `"gated"`.
        activation: a `get_activation` name; `None` means `"gelu"` (plain) / `"silu"`
            (gated, i.e. SwiGLU experts).
        use_bias: biases in the experts; `None` means True (plain) / False (gated).
        capacity_factor: `None` (never drop; see the module docstring) or a positive float.
        normalize_top_k: renormalise the top-k probabilities to sum to 1 (Mixtral); False
            keeps the raw softmax probabilities (Switch, GShard).
        load_balance_loss_weight: non-negative weight of the load-balancing loss.
        router_z_loss_weight: non-negative weight of the router z-loss.
        dropout: dropout rate on the experts' hidden activations, in [0, 1).
        kernel_initializer: initializer of every expert kernel, applied per expert.
        bias_initializer: initializer of the expert biases.
        router_initializer: initializer of the router kernel.
        output_kernel_initializer: initializer of the experts' output kernels, applied per
            expert (None: `kernel_initializer`; GPT-2-style models scale it down with depth).
        seed: `None` or an int seeding the dropout.
        **kwargs: base `keras.layers.Layer` arguments.

    Call args:
        inputs: `(batch, seq, dim)` (or any `(..., dim)`).
        padding_mask: optional boolean `(batch, seq)` (i.e. `inputs.shape[:-1]`); False
            tokens are not routed (their output is zero), take no capacity and are left out
            of the auxiliary losses.
        training: True adds the losses and enables dropout; True or False updates the
            trackers.
        return_aux_losses: also return `{"load_balance_loss", "router_z_loss"}` (unweighted
            float32 scalars).

    Returns:
        `(..., dim)`, or `(outputs, aux_losses)` with `return_aux_losses=True`.

    Example:

    ```python
    moe = kzoo.layers.moe.MixtureOfExperts(
        num_experts=8, intermediate_dim=1024, top_k=2, expert_type="gated"
    )
    y = moe(keras.random.normal((2, 16, 256)), training=True)  # (2, 16, 256)
    aux = moe.losses  # [0.01 * load balance loss, 0.001 * router z-loss]
    ```
    """

    def __init__(
        self,
        num_experts,
        intermediate_dim,
        top_k=2,
        expert_type="plain",
        activation=None,
        use_bias=None,
        capacity_factor=None,
        normalize_top_k=True,
        load_balance_loss_weight=0.01,
        router_z_loss_weight=0.001,
        dropout=0.0,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        router_initializer="glorot_uniform",
        output_kernel_initializer=None,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.intermediate_dim = check_positive_int("intermediate_dim", intermediate_dim)
        self.top_k = check_positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(
                f"`top_k` must be at most num_experts={num_experts}; got top_k={top_k}."
            )
        self.expert_type = check_choice("expert_type", expert_type, ("plain", "gated"))
        if activation is not None:
            get_activation(activation)
        self.activation = activation
        self.use_bias = check_bool("use_bias", use_bias, allow_none=True)
        if capacity_factor is not None:
            capacity_factor = check_positive_float("capacity_factor", capacity_factor)
        self.capacity_factor = capacity_factor
        self.normalize_top_k = check_bool("normalize_top_k", normalize_top_k)
        self.load_balance_loss_weight = _check_non_negative_float(
            "load_balance_loss_weight", load_balance_loss_weight
        )
        self.router_z_loss_weight = _check_non_negative_float(
            "router_z_loss_weight", router_z_loss_weight
        )
        self.dropout = check_rate("dropout", dropout)
        self.kernel_initializer = serialize_initializer(kernel_initializer, "kernel_initializer")
        self.bias_initializer = serialize_initializer(bias_initializer, "bias_initializer")
        self.router_initializer = serialize_initializer(router_initializer, "router_initializer")
        self.output_kernel_initializer = (
            None if output_kernel_initializer is None
            else serialize_initializer(output_kernel_initializer, "output_kernel_initializer")
        )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be None or an int; got seed={seed!r}.")
        self.seed = seed

        gated = expert_type == "gated"
        self._activation_name = activation or ("silu" if gated else "gelu")
        self._activation_fn = get_activation(self._activation_name)
        self._use_bias = (not gated) if use_bias is None else use_bias

        # === Layers ===
        self.router = keras.layers.Dense(
            num_experts,
            use_bias=False,
            kernel_initializer=keras.initializers.get(self.router_initializer),
            dtype="float32",
            name="router",
        )
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.load_balance_loss_tracker = keras.metrics.Mean(
            name=f"{self.name}_load_balance_loss"
        )
        self.router_z_loss_tracker = keras.metrics.Mean(name=f"{self.name}_router_z_loss")
        self.last_load_balance_loss = None
        self.last_router_z_loss = None

    # === Weights ===

    def _kernel(self, name, shape, initializer=None):
        initializer = initializer or self.kernel_initializer
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=_stacked_initializer(initializer, self.num_experts),
        )

    def _bias(self, name, shape):
        if not self._use_bias:
            return None
        return self.add_weight(
            name=name, shape=shape, initializer=keras.initializers.get(self.bias_initializer)
        )

    def build(self, input_shape):
        dim = last_axis_size("MixtureOfExperts", input_shape)
        e, i = self.num_experts, self.intermediate_dim
        self.router.build((None, dim))
        if self.expert_type == "gated":
            self.gate_kernel = self._kernel("gate_kernel", (e, dim, i))
            self.gate_bias = self._bias("gate_bias", (e, i))
            self.up_kernel = self._kernel("up_kernel", (e, dim, i))
            self.up_bias = self._bias("up_bias", (e, i))
        else:
            self.intermediate_kernel = self._kernel("intermediate_kernel", (e, dim, i))
            self.intermediate_bias = self._bias("intermediate_bias", (e, i))
        self.output_kernel = self._kernel(
            "output_kernel", (e, i, dim), self.output_kernel_initializer
        )
        self.output_bias = self._bias("output_bias", (e, dim))
        self.built = True

    # === Routing ===

    def _capacities(self, num_tokens):
        """The static capacities to try, ascending; the last one never drops.

        Each is `ceil(factor * tokens * top_k / num_experts)` in exact integer arithmetic
        (the factor read as the decimal it is written as, see `_factor_fraction`), the same
        for a Python int token count (eager, static shapes) and for a traced one (a graph
        with an unknown batch size, an export with a dynamic batch). The float arithmetic
        this replaced rounded differently in the two: capacity_factor=1.2 with 25 tokens,
        top_k=2 and 4 experts gave 15 eagerly (float64) and 16 in a TensorFlow graph with a
        dynamic batch (float32), so an exported model dropped other assignments than Keras.
        """
        e, k = self.num_experts, self.top_k
        if self.capacity_factor is not None:
            factors, round_to, exact = (self.capacity_factor,), 1, False
        else:
            factors, round_to, exact = NO_DROP_CAPACITY_FACTORS, 8, True
        if isinstance(num_tokens, int):
            caps = []
            for f in factors:
                p, q = _factor_fraction(f, k, e)
                c = num_tokens if q == 0 else max(1, -(-p * num_tokens * k // (q * e)))
                c = min(num_tokens, -(-c // round_to) * round_to)
                if c not in caps:
                    caps.append(c)
            if exact and caps[-1] != num_tokens:
                caps.append(num_tokens)
            return caps
        # Traced token count: int32 tensors, the products kept below 2**31 by
        # `_factor_fraction` (ceil(p * a / d) = (a // d) * p + ceil((a % d) * p / d)).
        n = ops.cast(ops.convert_to_tensor(num_tokens), "int32")
        assignments = n * k
        caps = []
        for f in factors:
            p, q = _factor_fraction(f, k, e)
            if q == 0:
                c = n
            else:
                d = q * e
                c = (assignments // d) * p + ((assignments % d) * p + d - 1) // d
                c = ops.maximum(c, 1)
                c = ops.minimum(n, ((c + round_to - 1) // round_to) * round_to)
            caps.append(c)
        if exact:
            caps.append(n)
        return caps

    def _expert_weights(self):
        if self.expert_type == "gated":
            first = (self.gate_kernel, self.gate_bias, self.up_kernel, self.up_bias)
        else:
            first = (self.intermediate_kernel, self.intermediate_bias)
        # Reading the variables here (outside any `cond` branch) gives plain tensors,
        # autocast to the compute dtype under mixed precision.
        first = tuple(None if w is None else ops.convert_to_tensor(w) for w in first)
        out_k = ops.convert_to_tensor(self.output_kernel)
        out_b = None if self.output_bias is None else ops.convert_to_tensor(self.output_bias)
        return first, out_k, out_b

    def _experts(self, xe, weights, hidden_mask, counts=None):
        """Expert FFNs: xe (E, C, dim) -> (E, C, dim) as batched matmuls or, with `counts`
        (rows per expert, Python ints), xe (sum(counts), dim) -> (sum(counts), dim) with
        one matmul per expert on its own rows (no padding)."""
        if counts is not None:
            first, out_k, out_b = weights
            outputs, start = [], 0
            for expert, count in enumerate(counts):
                if count == 0:
                    continue
                rows = slice(start, start + count)
                expert_weights = (
                    tuple(None if w is None else w[expert:expert + 1] for w in first),
                    out_k[expert:expert + 1],
                    None if out_b is None else out_b[expert:expert + 1],
                )
                mask = None if hidden_mask is None else hidden_mask[None, rows]
                outputs.append(self._experts(xe[None, rows], expert_weights, mask)[0])
                start += count
            return ops.concatenate(outputs, axis=0)
        first, out_k, out_b = weights
        if self.expert_type == "gated":
            gate_k, gate_b, up_k, up_b = first
            gate = ops.matmul(xe, gate_k)
            up = ops.matmul(xe, up_k)
            if gate_b is not None:
                gate = gate + gate_b[:, None, :]
                up = up + up_b[:, None, :]
            h = self._activation_fn(gate) * up
        else:
            in_k, in_b = first
            h = ops.matmul(xe, in_k)
            if in_b is not None:
                h = h + in_b[:, None, :]
            h = self._activation_fn(h)
        if hidden_mask is not None:
            h = h * hidden_mask
        y = ops.matmul(h, out_k)
        if out_b is not None:
            y = y + out_b[:, None, :]
        return y

    def _dispatch_and_run(self, capacity, x, expert_flat, position, weight_flat, weights,
                          dropout_mask, counts=None, limit=None):
        """Run the experts on a grid of `capacity` rows per expert or, with `counts`
        (eager only: Python ints, kept rows per expert), on exactly those rows. `limit`
        (a tensor, at most `capacity`): keep only the assignments at positions below it
        (None: below `capacity`)."""
        e, k = self.num_experts, self.top_k
        num_tokens = ops.shape(x)[0]
        if counts is None:
            slots = e * capacity
            keep = ops.logical_and(position >= 0,
                                   position < (capacity if limit is None else limit))
            # assignment -> slot (dropped and padded ones -> the extra, discarded slot)
            slot = ops.where(keep, expert_flat * capacity + position, slots)
        else:
            slots = sum(counts)
            if slots == 0:
                return ops.zeros_like(x)
            starts = ops.convert_to_tensor([sum(counts[:i]) for i in range(e)], "int32")
            kept = ops.take(ops.convert_to_tensor(list(counts), "int32"), expert_flat)
            keep = ops.logical_and(position >= 0, position < kept)
            slot = ops.where(keep, ops.take(starts, expert_flat) + position, slots)
        # slot -> 1 + assignment index (0 = empty slot). Kept slots are unique, so a scatter
        # *update* is exact; all dropped assignments land on the extra slot, cut off here.
        slot_assignment = ops.scatter_update(
            ops.zeros((slots + 1,), "int32"),
            ops.expand_dims(slot, -1),
            ops.arange(1, k * num_tokens + 1, dtype="int32"),
        )[:slots]
        # assignment a is token a mod tokens (choice-major layout); empty slots -> token 0
        assignment_of_slot = ops.maximum(slot_assignment - 1, 0)
        slot_token = assignment_of_slot % num_tokens
        xe = _dispatch(x, slot_token, slot, k)
        hidden_mask = None
        if dropout_mask is not None:
            # Each (token, expert) assignment has its own mask row; route it like the token.
            hidden_mask = ops.take(dropout_mask, assignment_of_slot, axis=0)
        if counts is None:
            xe = ops.reshape(xe, (e, capacity, ops.shape(x)[1]))
            if hidden_mask is not None:
                hidden_mask = ops.reshape(hidden_mask, (e, capacity, self.intermediate_dim))
        ye = self._experts(xe, weights, hidden_mask, counts)
        out_dim = ops.shape(ye)[-1]
        y = _combine(ops.reshape(ye, (slots, out_dim)), slot, slot_assignment)
        weight = ops.where(keep, weight_flat, 0.0)
        y = y * ops.expand_dims(ops.cast(weight, ye.dtype), -1)
        return _sum_choices(y, num_tokens, k)

    def call(self, inputs, padding_mask=None, training=None, return_aux_losses=False):
        e, k = self.num_experts, self.top_k
        in_shape = ops.shape(inputs)
        dim = in_shape[-1]
        if padding_mask is not None:
            _check_padding_mask(padding_mask, inputs)
        x = ops.reshape(inputs, (-1, dim))
        num_tokens = ops.shape(x)[0]
        if isinstance(num_tokens, int) and num_tokens == 0:
            # No token to route (an empty batch or sequence; a Mixtral GPT given a batch of
            # none): the routing takes maxima over no rows, which raised IndexError on JAX,
            # ValueError on torch and InvalidArgumentError on TensorFlow. The losses are
            # those of the formulas over no valid token (means over max(count, 1)): zero.
            outputs = ops.zeros(tuple(in_shape), self.compute_dtype)
            if return_aux_losses:
                zero = ops.zeros((), "float32")
                return outputs, {"load_balance_loss": zero, "router_z_loss": zero}
            return outputs

        # --- router (float32) ---
        logits = ops.cast(self.router(x), "float32")
        probs = ops.softmax(logits, axis=-1)
        top_p, top_idx = _top_k_lowest_first(probs, k)
        top_idx = ops.cast(top_idx, "int32")
        if self.normalize_top_k:
            top_p = top_p / ops.sum(top_p, axis=-1, keepdims=True)

        if padding_mask is not None:
            valid = ops.reshape(ops.cast(padding_mask, "bool"), (-1,))
            valid_f = ops.cast(valid, "float32")
        else:
            valid = None
            valid_f = ops.ones((num_tokens,), "float32")

        # --- auxiliary losses (valid tokens only, before dropping) ---
        # Skipped in plain inference calls (training=None), where nothing would read them.
        # (Not in an exported graph: it would update the trackers' variables on every call.)
        track = training is not None and _TRACKERS_SUPPORTED() and not _EXPORTING[0]
        if training or track or return_aux_losses:
            n_valid = ops.maximum(ops.sum(valid_f), 1.0)
            top1 = _one_hot(top_idx[:, 0], e, dtype="float32")
            frac = ops.sum(top1 * valid_f[:, None], axis=0) / n_valid
            mean_prob = ops.sum(probs * valid_f[:, None], axis=0) / n_valid
            load_balance = e * ops.sum(frac * mean_prob)
            lse = ops.logsumexp(logits, axis=-1)
            z_loss = ops.sum(ops.square(lse) * valid_f) / n_valid
            self.last_load_balance_loss = load_balance
            self.last_router_z_loss = z_loss
            if training:
                if self.load_balance_loss_weight > 0:
                    self.add_loss(self.load_balance_loss_weight * load_balance)
                if self.router_z_loss_weight > 0:
                    self.add_loss(self.router_z_loss_weight * z_loss)
            if track:
                self.load_balance_loss_tracker.update_state(load_balance)
                self.router_z_loss_tracker.update_state(z_loss)

        # --- assignments in priority order: choice-major, then token order ---
        expert_flat = ops.reshape(ops.transpose(top_idx), (-1,))
        weight_flat = ops.reshape(ops.transpose(top_p), (-1,))
        onehot = _one_hot(expert_flat, e, dtype="int32")
        if valid is not None:
            valid_flat = ops.tile(valid, (k,))
            onehot = onehot * ops.cast(valid_flat, "int32")[:, None]
        # running count per expert; an assignment's position is its expert's count so far
        running = ops.cumsum(onehot, axis=0)
        position = ops.take_along_axis(running, expert_flat[:, None], axis=1)[:, 0] - 1
        if valid is not None:
            position = ops.where(valid_flat, position, -1)  # padded tokens: never kept
        max_count = ops.max(running[-1])

        dropout_mask = None
        if training and self.dropout > 0:
            dropout_mask = keras.random.dropout(
                ops.ones((k * num_tokens, self.intermediate_dim), x.dtype),
                self.dropout,
                seed=self.seed_generator,
            )
        weights = self._expert_weights()

        def run_with(capacity):
            return self._dispatch_and_run(
                capacity, x, expert_flat, position, weight_flat, weights, dropout_mask,
            )

        def run(tier):
            # The capacity is recomputed from the token count inside the branch so that it
            # stays a compile-time constant for XLA when the batch size is dynamic (TF).
            return run_with(self._capacities(ops.shape(x)[0])[tier])

        capacities = self._capacities(num_tokens)
        busiest = _concrete_int(max_count)
        eager = busiest is not None and isinstance(num_tokens, int)
        if eager and _RAGGED_EAGER():
            # Eager torch / TensorFlow: shapes may follow the data and small ops are cheap,
            # so each expert runs on exactly its kept rows (no padding to a capacity).
            limit = num_tokens if self.capacity_factor is None else capacities[0]
            counts = [min(int(c), limit) for c in ops.convert_to_numpy(running[-1])]
            y = self._dispatch_and_run(
                None, x, expert_flat, position, weight_flat, weights, dropout_mask,
                counts=counts,
            )
        elif len(capacities) == 1 and (isinstance(num_tokens, int)
                                       or keras.backend.backend() != "jax"):
            y = run(0)
        elif len(capacities) == 1:
            # JAX with a symbolic token count (an export with a dynamic batch): the capacity
            # is a traced value there, which cannot size the slot grid (it failed: "Shapes
            # must be 1D sequences of concrete values"). The grid holds every token and the
            # assignments at or past the capacity are dropped as a grid of that size would.
            y = self._dispatch_and_run(
                num_tokens, x, expert_flat, position, weight_flat, weights, dropout_mask,
                limit=capacities[0],
            )
        elif _EXPORTING[0]:
            # (see `exporting`) capacity = tokens, the last one; the token count itself,
            # which on JAX may be a symbolic size (a dynamic batch), where the tensor of
            # `_capacities` cannot size an array.
            y = run_with(ops.shape(x)[0])
        elif eager:
            # Eager JAX compiles every op per shape: round the busiest expert's load up to
            # 1/16 of the balanced load (at least 8 rows), which wastes <= ~6% and keeps
            # the set of shapes small.
            step = max(8, -(-num_tokens * k // (16 * e)))
            y = run_with(min(num_tokens, max(step, -(-busiest // step) * step)))
        else:
            # index of the smallest static capacity that holds the busiest expert
            tier = ops.sum(
                ops.stack([ops.cast(max_count > c, "int32") for c in capacities[:-1]])
            )
            y = ops.switch(tier, [functools.partial(run, t) for t in range(len(capacities))])
        outputs = ops.reshape(y, tuple(in_shape[:-1]) + (ops.shape(y)[-1],))
        if return_aux_losses:
            return outputs, {"load_balance_loss": load_balance, "router_z_loss": z_loss}
        return outputs

    @property
    def metrics(self):
        # Keras' JAX trainer runs the forward pass in a stateless scope that carries only
        # trainable and non-trainable variables, so metric state updated inside `call`
        # cannot reach `fit` logs there: the trackers are reported on TF and torch only.
        return super().metrics if _TRACKERS_SUPPORTED() else []

    def compute_output_spec(self, inputs, padding_mask=None, training=None,
                            return_aux_losses=False):
        out = keras.KerasTensor(tuple(inputs.shape), dtype=self.compute_dtype)
        if return_aux_losses:
            scalar = keras.KerasTensor((), dtype="float32")
            return out, {"load_balance_loss": scalar, "router_z_loss": scalar}
        return out

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_experts": self.num_experts,
                "intermediate_dim": self.intermediate_dim,
                "top_k": self.top_k,
                "expert_type": self.expert_type,
                "activation": self.activation,
                "use_bias": self.use_bias,
                "capacity_factor": self.capacity_factor,
                "normalize_top_k": self.normalize_top_k,
                "load_balance_loss_weight": self.load_balance_loss_weight,
                "router_z_loss_weight": self.router_z_loss_weight,
                "dropout": self.dropout,
                "kernel_initializer": self.kernel_initializer,
                "bias_initializer": self.bias_initializer,
                "router_initializer": self.router_initializer,
                "output_kernel_initializer": self.output_kernel_initializer,
                "seed": self.seed,
            }
        )
        return config
