"""The PyTorch decode fast path: one `TransformerBlock` step in plain `torch` calls.

Why: on the torch backend a decode step is dominated by Python, not arithmetic. Measured on
the 2-core CPU for `gpt_mini` at width 256, 4 layers, batch 4 (`benchmarks/peers.py` shape):
a step through the Keras layers took 18-24 ms, of which the matrix products were about 3 ms;
calling each layer's `call` directly (no `Layer.__call__`) still took 12 ms (the `keras.ops`
dispatch), and `torch.compile` took 40-70 s to compile and gave 16-20 ms (Keras' attribute
hooks break its graphs). The same step written in `torch` calls takes about 3 ms.

What it is: `block_step(block, x, ...)` computes exactly what `block(x, ..., cache=...,
cache_index=...)` computes in inference (dropout off), reading the block's own variables
(so training, LoRA-free weight updates and loading are seen at once) and using the same
attention kernel as the Keras path on torch (`kernels_torch.fused`, i.e. SDPA). Rotary
positions (`_rotate`), plain and gated feed-forwards and float32 mixtures of experts
(`_experts`, the compiled step's routing run eagerly) have torch versions; sub-layers it has
none of (a LoRA or quantised `Dense`, a custom norm, experts in another dtype) are called as
Keras layers, so every block configuration works and only the overhead of the rare parts
remains. A sliding-window block's one-token steps run on its rolling cache in torch calls
(`_window_step`); its prompt (several tokens at once) takes the Keras call (`decode_block`).

The first `generate` call of a shape on torch runs this eager loop (the compiled step,
`kzoo.layers.compiled_decode`, comes from the second: `compiled_decode.policy`).
docs/PERFORMANCE.md ("torch: the eager decode loop") has the eager loop's rates at
`benchmarks/decode_families.py`'s size before and after the rotations, untied heads,
experts and window steps in torch calls.

When it runs: only inside `fast_steps()` (the torch decode loop of `kzoo.generation` enters
it), on the torch backend, with autograd off (`torch.no_grad()`), and `training` false. There
the decode loop owns its key/value caches, so the new keys/values are written *in place*
(a static cache: no copy of the cache per step). Everywhere else, and with the environment
variable `KZOO_FAST_DECODE=0`, the Keras layers run as usual.

What it keeps for a loop: what every step would rebuild from the same inputs is made once
per `fast_steps()` block (`memo`): the query/key/value kernels side by side (one matrix
product instead of three), the boolean key masks (and whether they mask anything), the
transposed tied embeddings of `unembed` (on CPU a row-major `E^T` multiplies faster), T5's
relative position bias table with the causal mask folded in. Each is remade when one of
the tensors it comes from is another object or was written in place (its `_version`).

Compiled loops (JAX, TensorFlow) run the Keras layers, but the loop is traced inside
`compiled_loop()`: `loop_constant(tag, make)` values asked for in the prefill are made once
there, before the `while_loop`, and the body reads them (`unembed`'s row-major `E^T`: XLA
on CPU multiplies a step's few rows by it about twice as fast as by `E` transposed in the
product, and does not move that copy out of the loop itself). Interleaved A/B on the T5 and
GPT decode of `benchmarks/peers.py` (2 cores, new tokens/s): JAX T5 2,609 -> 2,806, GPT
3,084 -> 3,624; TensorFlow T5 3,013 -> 3,800, GPT 2,728 -> 3,115.

A step of 2 to 4 sequences (float32, CPU) multiplies the transposed weights, copied once
per loop (`(out, in)` row-major; the tied table is that already), by the rows' transpose:
MKL's path for 2 to 4 rows times an `(in, out)` weight is about half as fast
(`_few_rows`). Interleaved A/B (6 rounds, `benchmarks/peers.py`'s batch of 4): GPT 897 ->
1,310 and T5 778 -> 1,114 new tokens/s, the same tokens.

With a Python int `cache_index` (T5's loop passes one), the new keys/values are written with
one copy and a query attends to the slots written so far only (not the whole static cache).

Measured on `benchmarks/peers.py`'s T5 decode (2 CPU cores, torch.profiler): a step of the
model took 2.5 ms, of which the matrix products 0.8 (the tied output projection, 8192 x 256,
the largest), SDPA 0.2, and some 950 small torch calls (views, copies, norms) most of the
rest; before the per-loop memo and the host index, 4.1 ms and 1,400 calls.

The models call `decode_block(block, x, training=..., **kwargs)`, which picks the path.

Whole-sequence passes take a shorter version of the same idea: inside a model's call on
torch (`predict`, `evaluate`, a `torch.no_grad()` model call, the encoder of a prompt, and
the forward pass of a training step), `TransformerBlock.__call__` runs `block_forward` when
`forward_applies`: the block's sub-layers in torch calls (the biases inside the products;
q/k/v in one product with autograd off) and the same `dot_product_attention` kernel as the
Keras call; mixed precision casts the kernels as Keras' autocast does. In training (or with
autograd on) only for a block that `trains_plainly` (no LayerDrop, rematerialisation or
mixture of experts; dropout is drawn by the block's own layers, the same masks as the Keras
call's); autograd differentiates the torch calls. Measured (2 cores, 8 x 256 tokens, `predict_on_batch`, 14 interleaved rounds):
GPT 13,123 -> 13,483 and BERT 13,099 -> 14,479 tokens/s in inference; training
(`train_on_batch`, 12 interleaved rounds) GPT 5,302 -> 5,480 (+3.4%), BERT 6,978 -> 7,166
(+2.7%); with dropout 0.1 (GPT-2's and BERT's default) GPT 2,950 -> 3,429 (+16%), BERT
4,387 -> 4,578 (+4.4%). On an H100, GPT-2 small in mixed bfloat16 (`benchmarks/gpu.py`), where a torch step
is bound by the host's work per layer call rather than the GPU's: 67,254 -> 112,790
training tokens/s (transformers 117,396 in the same run).
"""

import contextlib
import os
import threading

import keras

from kzoo.layers.taps import active_tap
from kzoo.layers.utils import torch_linear, torch_linear_uses_onednn

_STATE = threading.local()


@contextlib.contextmanager
def fast_steps():
    """Enable the fast path for the calls made inside (the decode loop owns the caches)."""
    previous = getattr(_STATE, "active", False), getattr(_STATE, "memo", None)
    _STATE.active = True
    _STATE.memo = {}
    try:
        yield
    finally:
        _STATE.active, _STATE.memo = previous


def _version(tensor):
    try:
        return tensor._version
    except RuntimeError:  # an inference-mode tensor keeps no version: never reused
        return object()


def memo(tag, sources, make):
    """`make()`, computed once per `fast_steps()` block for `tag` (a hashable key) as long as
    the torch tensors `sources` it is made from are the same objects, unchanged (a tensor
    written in place gets a new `_version`): what every step of a decode loop would
    otherwise recompute from the same inputs (a fused weight, a mask, a bias table).

    Example:
    >>> qkv = memo((layer, "qkv"), [wq, wk, wv], lambda: torch.cat([wq, wk, wv], 1))
    """
    store = getattr(_STATE, "memo", None)
    if store is None:
        return make()
    entry = store.get(tag)
    if entry is not None and len(entry[0]) == len(sources) and all(
        seen is source and version == _version(source)
        for (seen, version), source in zip(entry[0], sources)
    ):
        return entry[1]
    value = make()
    store[tag] = (tuple((source, _version(source)) for source in sources), value)
    return value


@contextlib.contextmanager
def compiled_loop():
    """Trace a compiled decode loop (JAX / TensorFlow) inside: `loop_constant` values made
    before `loop_body()` are made once, outside the `while_loop`, and its body reads them."""
    previous = getattr(_STATE, "hoisted", None)
    _STATE.hoisted = {"values": {}, "body": False}
    try:
        yield
    finally:
        _STATE.hoisted = previous


@contextlib.contextmanager
def loop_body():
    """Trace the body of the `compiled_loop()` being traced inside."""
    scope = getattr(_STATE, "hoisted", None)
    if scope is None:
        yield
        return
    previous, scope["body"] = scope["body"], True
    try:
        yield
    finally:
        scope["body"] = previous


def loop_constant(tag, make):
    """`make()`, made once per `compiled_loop()` for `tag` when first asked for before the
    loop (the prefill): a value every step would recompute from the model's weights (XLA
    does not hoist such work out of a `while_loop` body where it changes a layout). Made in
    place when first asked for inside the body (an outer trace must not see the body's
    values) or outside a compiled loop."""
    scope = getattr(_STATE, "hoisted", None)
    if scope is None:
        return make()
    values = scope["values"]
    if tag in values:
        return values[tag]
    value = make()
    if not scope["body"]:
        values[tag] = value
    return value


def enabled(training=False):
    """Whether `decode_block` takes the torch path now."""
    if not getattr(_STATE, "active", False) or training:
        return False
    if active_tap() is not None:  # a tap must see every attention call of the Keras path
        return False
    if os.environ.get("KZOO_FAST_DECODE", "1") == "0":
        return False
    if keras.backend.backend() != "torch":
        return False
    import torch

    return not torch.is_grad_enabled()


def decode_block(block, x, training=False, causal_bias=False, **kwargs):
    """`block(x, training=training, **kwargs)`, through `block_step` when `enabled()`.
    `causal_bias`: see `block_step` (the Keras call masks the same keys itself)."""
    attention = block.self_attention.attention
    if kwargs.get("cache") is not None and enabled(training) and (
            attention == "full" or (attention == "sliding_window" and x.shape[1] == 1
                                    and not block.cross_attention)):
        return block_step(block, x, causal_bias=causal_bias, **kwargs)
    return block(x, training=training, **kwargs)


# === Whole-sequence forward passes in inference (predict, evaluate, a prompt's encoder) ===

# The keyword arguments of `TransformerBlock.call` that `block_forward` handles.
_FORWARD_KWARGS = frozenset({"padding_mask", "attention_bias", "output_positions",
                             "training"})


def forward_applies(block, inputs, args, kwargs):
    """Whether `TransformerBlock.__call__(inputs, *args, **kwargs)` may run as
    `block_forward`: torch, no tap, `KZOO_FAST_DECODE` not "0", a built block of full
    self-attention without cross-attention, called inside a model's call (the block is not
    the outermost layer) on a torch tensor of its compute dtype, with only `padding_mask`,
    `attention_bias` and `output_positions` (no packed-document mask, cache or position
    index). In inference with
    autograd off, any such block; when training or with autograd on (a training step's
    forward pass), only a block that `trains_plainly`: then autograd differentiates the
    torch calls as it would the Keras layers'."""
    if args or not _FORWARD_KWARGS.issuperset(kwargs):
        return False
    if keras.backend.backend() != "torch" or not block.built or block.cross_attention:
        return False
    import torch

    if (not isinstance(inputs, torch.Tensor) or block.self_attention.attention != "full"
            or os.environ.get("KZOO_FAST_DECODE", "1") == "0" or active_tap() is not None):
        return False
    if _call_context() is None:
        return False
    training = _training_flag(kwargs.get("training"))
    if (training or torch.is_grad_enabled()) and not trains_plainly(block):
        return False
    if inputs.dtype != _torch_dtype(block.compute_dtype):
        return False
    return all(v is None or isinstance(v, torch.Tensor)
               for k, v in kwargs.items() if k != "training")


def _call_context():
    """Keras' context of the model call under way (None outside any layer call)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("current_call_ctx")


def _training_flag(training):
    """`training`, or when None the enclosing call's flag, as Keras' `__call__` resolves it
    (False outside any call)."""
    if training is None:
        context = _call_context()
        training = context is not None and context.get_value("training")
    return bool(training)


def trains_plainly(block):
    """Whether `block`'s training forward pass can run in torch calls: no LayerDrop, no
    rematerialisation (both are branches / recomputations of the whole block in the Keras
    call), no mixture of experts (its router adds losses and routes per call). Dropout runs
    there through the block's own `Dropout` layers and attention kernel, drawing from the
    same seed generators in the same order as the Keras call: the same masks."""
    return not (block.remat or block.layerdrop or block.feedforward == "moe")


def block_forward(block, x, padding_mask=None, attention_bias=None, output_positions=None,
                  training=None):
    """`block(x, padding_mask=..., attention_bias=..., output_positions=...)` in torch calls,
    in inference or a training step of a block that `trains_plainly` (see
    `forward_applies`): the same layers' variables and the same attention kernel
    (`dot_product_attention` with the layer's `kernel`), without the Keras layer call of each
    sub-layer (about 0.2 ms each on this CPU; a GPT/BERT block has a dozen). With
    `output_positions`, the rows the Keras call would compute (see `TransformerBlock`)."""
    from kzoo.layers import kernels_torch
    from kzoo.layers.blocks import _mask_rows
    from kzoo.layers.kernels import dot_product_attention
    from kzoo.layers.masks import normalize_mask
    from kzoo.layers.utils import gather_rows

    rows = output_positions
    if rows is not None and not block._rows_only(attention_bias, None, None, active_tap()):
        out = block_forward(block, x, padding_mask, attention_bias, training=training)
        return gather_rows(out, rows)
    training = _training_flag(training)
    layer = block.self_attention
    batch, length = x.shape[0], x.shape[1]
    mask, causal = normalize_mask(padding_mask, "attention_mask"), block.causal
    if mask is not None and kernels_torch.no_padding(padding_mask):
        mask = None  # (every token real: the layers attend unmasked)
    if rows is not None:
        mask, causal = _mask_rows(mask, rows, length, causal), False

    def attend(h):
        if rows is None:
            q, k, v = _project_qkv(layer, h)
        else:  # (the selected rows ask; every row gives its key and value)
            q = _dense(layer.query_dense, gather_rows(h, rows))
            k, v = _dense(layer.key_dense, h), _dense(layer.value_dense, h)
        q = q.reshape(batch, q.shape[1], layer.num_heads, layer._head_dim)
        k = k.reshape(batch, length, layer._kv_heads, layer._head_dim)
        v = v.reshape(batch, length, layer._kv_heads, layer._head_dim)
        if layer.rotary is not None:
            k = _rotate(layer.rotary, k, 0)
            q = _rotate(layer.rotary, q, 0)
        out = dot_product_attention(
            q, k, v, mask=mask, bias=attention_bias,
            is_causal=causal, scale=layer.scale, kernel=layer.kernel,
            dropout_rate=layer.dropout, training=training, seed_generator=layer.seed_generator)
        if not block.causal:  # (as the Keras call: `TransformerBlock._forward`)
            out = kernels_torch.uniform_empty_rows(out, mask, v)
        out = _dense(layer.output_dense, out.reshape(batch, q.shape[1], layer.num_heads * layer._head_dim))
        return _dropout(block.self_attention_dropout, out, training)

    def feedforward(h):
        if block.feedforward == "moe":  # (routes the real tokens only, as the Keras call)
            return block.feedforward_layer(h, padding_mask=padding_mask, training=False)
        h = _feedforward(block.feedforward_layer, h, training)
        return _dropout(block.feedforward_dropout, h, training)

    x = _sublayer(block, block.self_attention_norm, x, attend, rows)
    return _sublayer(block, block.feedforward_norm, x, feedforward)


def _dropout(layer, x, training):
    """`layer(x, training=True)` for a Keras `Dropout` with a rate when training (the same
    layer, so the same seed generator and masks as the Keras path), else `x` (no call)."""
    return layer(x, training=True) if training and layer.rate else x


def _sublayer(block, norm, x, fn, rows=None):
    """A residual sub-layer of `TransformerBlock._forward`: `x + fn(norm(x))` (pre-LN) or
    `norm(x + fn(x))` (post-LN). When `fn` returns `(h, extra)` (an attention with its
    cache), `(x, extra)`. With `rows` (positions `(batch, n)`), `fn` returns those rows and
    the residual is taken at them."""
    from kzoo.layers.utils import gather_rows

    out = fn(_norm(norm, x) if block.norm_first else x)
    h, extra = out if isinstance(out, tuple) else (out, None)
    x = (x if rows is None else gather_rows(x, rows)) + h
    if not block.norm_first:
        x = _norm(norm, x)
    x = block._clamped(x)
    return (x, extra) if isinstance(out, tuple) else x


# === Pieces (torch tensors in, torch tensors out) ===


def _value(variable):
    # The torch tensor behind a variable (`.value` less its stateless-scope lookup, which
    # costs a tenth of a step here; the decode loop never runs in a stateless scope).
    if isinstance(variable, keras.Variable):
        value = getattr(variable, "_value", None)
        return variable.value if value is None else value
    return variable


def _dense(layer, x):
    """`keras.layers.Dense` in inference (Keras' own call for LoRA, quantised, activation)."""
    if not _plain_dense(layer):
        return layer(x)
    x, kernel, bias = _dense_operands(layer, x)
    if _few_rows(x, kernel):
        weight = memo(("rows_t", id(layer)), [kernel], lambda: kernel.t().contiguous())
        return _few_rows_product(x, weight, bias)
    # (one product with the bias: no second output tensor for the bias add)
    return torch_linear(x, kernel.t(), bias)


def _dense_operands(layer, x):
    """`(x, kernel, bias)` of a plain `Dense` layer in its compute dtype (mixed precision:
    Keras' autocast); bias None without one."""
    dtype = _torch_dtype(layer.compute_dtype)
    kernel = _value(layer._kernel).to(dtype)
    bias = None if layer.bias is None else _value(layer.bias).to(dtype)
    return x.to(dtype), kernel, bias


# Rows of a product that `_few_rows_product` takes (a decode step of 2 to 4 sequences).
_FEW_ROWS = (2, 4)


def _few_rows(x, weight, copied=None):
    """Whether `x @ weight` (`x (..., in)`) takes `_few_rows_product` in this loop: float32 on
    CPU, 2 to 4 rows, inside `fast_steps()` (which keeps the transposed weight for the loop),
    and the bytes `copied` for it (default: the weight's; 0: none) no more than
    `_COPY_LIMIT`.

    Why: MKL (torch 2.13's CPU build) multiplies 2 to 4 rows by a row-major `(in, out)`
    weight through a slow path: measured on the 2-core CPU (AMD EPYC, caches flushed between
    calls, us a product) at rows 4: `(256, 768)` 72-98 against 50-52 for
    `W_t @ x^T` with a row-major `(out, in)` copy of the weight, `(256, 8192)` 814-901
    against 389-429, GPT-2 small's `(768, 3072)` 866 against 346; at 1 row and at 5 or more
    the plain product was as fast or faster (at 8 rows `(256, 8192)` 688 against 620, at 1
    row 291 against 833), and `W @ x^T` with the transposed *view* of the weight was
    slower than both (151-3,927). Transformers' `F.linear(x, W)` took the slow path too
    (998 at rows 4)."""
    import torch

    if getattr(_STATE, "memo", None) is None or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or torch.is_grad_enabled():
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if copied is None:
        copied = weight.numel() * weight.element_size()
    return _FEW_ROWS[0] <= rows <= _FEW_ROWS[1] and copied <= _COPY_LIMIT


def _few_rows_product(x, weight, bias=None):
    """`x @ weight.T + bias` for `x (..., in)` of 2 to 4 rows and a row-major `weight (out,
    in)`, computed as `(weight @ x^T)^T` (see `_few_rows`); a row-major result."""
    import torch

    flat = x.reshape(-1, x.shape[-1]).contiguous()
    # (`flat.t()` is a column-major view: a row-major right operand took MKL's slow path)
    out = (torch.mm(weight, flat.t()) if bias is None
           else torch.addmm(bias[:, None], weight, flat.t()))
    return out.t().contiguous().view(*x.shape[:-1], weight.shape[0])


def _norm(layer, x):
    import torch.nn.functional as F

    from kzoo.layers.norm import RMSNorm

    if isinstance(layer, keras.layers.LayerNormalization) and not layer.rms_scaling and (
        layer.axis in (-1, [-1], (-1,), len(x.shape) - 1, [len(x.shape) - 1])
    ):
        weight = None if layer.gamma is None else _value(layer.gamma)
        bias = None if layer.beta is None else _value(layer.beta)
        dtype = _torch_dtype(layer.compute_dtype)
        if x.dtype == dtype and all(p is None or p.dtype == dtype for p in (weight, bias)):
            # One kernel, also in half precision (a bfloat16 model's decode): torch's layer
            # norm computes in float32 inside and rounds once, as the float32 path below
            # does, without four casts (each a kernel launch on CUDA).
            return F.layer_norm(x, (x.shape[-1],), weight, bias, layer.epsilon)
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
        y = F.layer_norm(x.float(), (x.shape[-1],), weight, bias, layer.epsilon)
        return y.to(dtype)
    if isinstance(layer, RMSNorm):
        import torch

        weight = None if layer.scale is None else _value(layer.scale)
        if x.dtype == torch.float32 and layer.compute_dtype == "float32" and (
                weight is None or weight.dtype == torch.float32):
            # (one kernel; the same float32 formula as below)
            return F.rms_norm(x, (x.shape[-1],), weight, layer.epsilon)
        h = x.float()
        y = h * (h.square().mean(-1, keepdim=True) + layer.epsilon).rsqrt()
        if layer.scale is not None:
            y = y * _value(layer.scale).float()
        return y.to(_torch_dtype(layer.compute_dtype))
    return layer(x)


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


_ACTIVATIONS = {}


def _activation(name):
    """The torch function of a kzoo activation name (keras ops for the rare ones)."""
    if not _ACTIVATIONS:
        import torch
        import torch.nn.functional as F

        from kzoo.layers.feedforward import _torch_gelu_tanh

        _ACTIVATIONS.update({
            "relu": F.relu,
            "gelu": F.gelu,
            "gelu_tanh": _torch_gelu_tanh,
            "gelu_new": _torch_gelu_tanh,
            "gelu_pytorch_tanh": _torch_gelu_tanh,
            "silu": F.silu,
            "swish": F.silu,
            "sigmoid": torch.sigmoid,
            "tanh": torch.tanh,
            "linear": lambda h: h,
        })
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from kzoo.layers.feedforward import get_activation

    return get_activation(name)


def _feedforward(layer, x, training=False):
    from kzoo.layers.feedforward import FeedForward, GatedFeedForward

    if type(layer) is FeedForward:
        h = _dense_activated(layer.intermediate_dense, x, layer.activation)
        if h is None:
            h = _activation(layer.activation)(_dense(layer.intermediate_dense, x))
        return _dense(layer.output_dense, _dropout(layer.dropout_layer, h, training))
    if type(layer) is GatedFeedForward:
        act = _activation(layer.activation)
        h = act(_dense(layer.gate_dense, x)) * _dense(layer.up_dense, x)
        return _dense(layer.output_dense, _dropout(layer.dropout_layer, h, training))
    if enabled(training):  # (torch, inside a decode loop)
        out = _experts(layer, x)
        if out is not None:
            return out
    return layer(x, training=training)  # another kind, or experts it cannot run: Keras' call


def _experts(layer, x):
    """A `MixtureOfExperts` in inference on `x (..., dim)` in torch calls, as its call with no
    padding mask routes the rows (`compiled_decode._experts`, the compiled step's code run
    eagerly: float32 router, top-k, renormalised when asked, the capacity rule), with the
    layer's kernels stacked once per loop (`memo`); None for a layer that step cannot run
    (not float32, LoRA, not a `MixtureOfExperts`). The Keras call was 4.2 of 5.6 s of an
    eager decode of 128 steps (4 rows, 8 SwiGLU experts of 704, top 2, 4 layers)."""
    from kzoo.layers import compiled_decode
    from kzoo.layers.moe import MixtureOfExperts

    if not isinstance(layer, MixtureOfExperts):
        return None
    spec = memo(("experts", id(layer)), [_value(v) for v in layer.weights],
                lambda: compiled_decode._moe_spec(layer))
    if spec is None or spec[0][1] not in compiled_decode._ACTIVATIONS:
        return None
    (config, activation, gated), weights = spec
    plan = compiled_decode._Experts(moe=config, activation=activation, gated=gated)
    rows = x.reshape(-1, x.shape[-1])
    return compiled_decode._experts(plan, weights, rows).reshape(x.shape).to(x.dtype)


# kzoo activation names -> the `torch_linear` activation that computes them.
_ONEDNN_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                       "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _dense_activated(layer, x, activation):
    """`activation(_dense(layer, x))` in one oneDNN product (`torch_linear`'s post-op) where
    `torch_linear` takes oneDNN and the activation is one it applies; otherwise None."""
    name = _ONEDNN_ACTIVATIONS.get(activation)
    if name is None or not _plain_dense(layer):
        return None
    x, kernel, bias = _dense_operands(layer, x)
    if _few_rows(x, kernel) or not torch_linear_uses_onednn(x, kernel.t(), bias):
        return None
    return torch_linear(x, kernel.t(), bias, activation=name)


def _key_mask(mask):
    """A `(batch, k_len)` 0/1 padding mask -> `(boolean (batch, 1, 1, k_len) or None when it
    masks nothing, whether every row keeps a key)`; None stays None. Once per loop for the
    same mask tensor (`memo`)."""
    if mask is None:
        return None, True

    def make():
        import torch

        from kzoo.layers import kernels_torch

        keep = mask if mask.dtype == torch.bool else mask != 0
        if keep.dim() == 2:
            keep = keep[:, None, None, :]
        else:
            from kzoo.layers.masks import normalize_mask

            keep = normalize_mask(keep)
        if kernels_torch._all_true(keep):
            return None, True  # (what `kernels_torch.fused` does with it at every call)
        return keep, keep.device.type == "cpu" and bool(keep.any(-1).all())

    return memo(("key_mask", id(mask)), [mask], make)


def _plain_dense(layer):
    return not (getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None)
                or layer.activation is not keras.activations.linear)


def _project_qkv(layer, x):
    """`(q, k, v)` of `layer` (a `MultiHeadAttention`) for `x`: one matrix product with the
    three kernels side by side (joined once per loop) when they are plain `Dense` layers."""
    import torch

    denses = (layer.query_dense, layer.key_dense, layer.value_dense)
    biases = [d.bias for d in denses]
    if torch.is_grad_enabled() or not all(_plain_dense(d) for d in denses) or (
            any(b is None for b in biases) and any(b is not None for b in biases)):
        # (autograd on, a training step: three products; joining the kernels would copy
        # them, and the join's backward split the gradient, at every call)
        return tuple(_dense(d, x) for d in denses)
    dtype = _torch_dtype(layer.query_dense.compute_dtype)
    kernels = [_value(d._kernel).to(dtype) for d in denses]
    sources = kernels + ([_value(b).to(dtype) for b in biases] if biases[0] is not None else [])

    def joined_bias():
        return None if len(sources) == 3 else torch.cat(sources[3:], 0)

    sizes = [k.shape[1] for k in kernels]
    x = x.to(dtype)
    if _few_rows(x, kernels[0], copied=sum(k.numel() * k.element_size() for k in kernels)):
        # (the joined weight transposed, `(q + k + v, in)` row-major)
        weight, bias = memo(("qkv_rows_t", id(layer)), sources, lambda: (
            torch.cat([k.t() for k in kernels], 0), joined_bias()))
        return _few_rows_product(x, weight, bias).split(sizes, -1)
    kernel, bias = memo(("qkv", id(layer)), sources,
                        lambda: (torch.cat(kernels, 1), joined_bias()))
    y = torch_linear(x, kernel.t(), bias)
    return y.split(sizes, -1)


def _sdpa(q, k, v, mask, bias, scale):
    """`F.scaled_dot_product_attention` of `(batch, heads, len, head_dim)` tensors, for masks
    known to leave every query a key (so `kernels_torch.fused`'s zeroing of fully masked
    rows has nothing to do); grouped heads use `enable_gqa`."""
    import torch
    import torch.nn.functional as F

    attn_mask = mask
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, torch.finfo(attn_mask.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _attention(layer, x, *, mask, bias, cache, cache_index, causal=True, causal_bias=False,
               rows_visible=False):
    """Self-attention of `x (batch, q_len, dim)` writing its keys/values into `cache` in place
    at `cache_index` (with `cache_index=None`: `cache` holds the cross-attention keys and
    values). `mask` is a boolean key mask or None, `rows_visible` whether it leaves every row
    a key; `causal_bias`: `bias` already hides the keys after each query (`causal` then adds
    nothing). Returns `(output, cache)`."""
    import torch

    from kzoo.layers import kernels_torch

    batch, q_len = x.shape[0], x.shape[1]
    heads, kv_heads, head_dim = layer.num_heads, layer._kv_heads, layer._head_dim
    scale = layer.scale if layer.scale is not None else head_dim ** -0.5
    # The cache is `(batch, 2, kv_heads, length, head_dim)` or the pair form `(keys, values)`
    # of `(batch, kv_heads, length, head_dim)` (see `MultiHeadAttention`): views either way.
    k_cache, v_cache = cache if isinstance(cache, (tuple, list)) else (cache[:, 0],
                                                                       cache[:, 1])
    if cache_index is None:  # cross-attention: precomputed keys and values
        q = _dense(layer.query_dense, x).view(batch, q_len, heads, head_dim)
        k, v = k_cache, v_cache
    elif layer.attention == "sliding_window":  # one new token a row (see `decode_block`)
        return _window_step(layer, x, mask, cache, k_cache, v_cache, cache_index, scale)
    elif type(cache_index) is int:
        # A host index: the new keys/values written with one copy each, and only the slots
        # written so far attended to (the others are masked out anyway).
        q, k, v = _project_qkv(layer, x)
        q = q.reshape(batch, q_len, heads, head_dim)
        k = k.reshape(batch, q_len, kv_heads, head_dim)
        v = v.reshape(batch, q_len, kv_heads, head_dim)
        if layer.rotary is not None:
            k = _rotate(layer.rotary, k, cache_index)
            q = _rotate(layer.rotary, q, cache_index)
        end = cache_index + q_len
        k_cache.narrow(2, cache_index, q_len).copy_(k.transpose(1, 2))
        v_cache.narrow(2, cache_index, q_len).copy_(v.transpose(1, 2))
        k, v = ((k_cache.narrow(2, 0, end), v_cache.narrow(2, 0, end))
                if end < k_cache.shape[2] else (k_cache, v_cache))
        if bias is not None and bias.shape[-1] > end:
            bias = bias[..., :end]
        if mask is not None and mask.shape[-1] > end:
            mask = mask[..., :end]
        rows_visible = mask is None  # (with a causal mask each query sees its own slot)
        if causal and not causal_bias and q_len > 1:
            allowed = torch.ones((q_len, end), dtype=torch.bool,
                                 device=x.device).tril(cache_index)[None, None]
            mask = allowed if mask is None else torch.logical_and(mask, allowed)
        # (one query at slot `cache_index` sees every slot written so far)
    else:
        q, k, v = _project_qkv(layer, x)
        q = q.reshape(batch, q_len, heads, head_dim)
        k = k.reshape(batch, q_len, kv_heads, head_dim)
        v = v.reshape(batch, q_len, kv_heads, head_dim)
        index = torch.as_tensor(cache_index, dtype=torch.long, device=x.device)
        if layer.rotary is not None:
            k = _rotate(layer.rotary, k, cache_index)
            q = _rotate(layer.rotary, q, cache_index)
        slots = index + torch.arange(q_len, device=x.device) if q_len > 1 else index.view(1)
        k_cache.index_copy_(2, slots, k.transpose(1, 2).to(k_cache.dtype))
        v_cache.index_copy_(2, slots, v.transpose(1, 2).to(v_cache.dtype))
        k, v = k_cache, v_cache
        if causal and not causal_bias:
            # over the cache: query i (slot index + i) sees the slots <= its own
            allowed = torch.arange(k.shape[2], device=x.device)[None, :] <= slots[:, None]
            allowed = allowed[None, None]
            rows_visible = mask is None  # (each query sees its own slot)
            mask = allowed if mask is None else torch.logical_and(mask, allowed)
        elif causal_bias:
            rows_visible = mask is None
    if rows_visible:
        out = _sdpa(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), mask, bias, scale)
        out = out.transpose(1, 2)
    else:
        out = kernels_torch.fused(q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                  mask, bias, False, scale)
        if cache_index is None:  # cross-attention: as the Keras call (`uniform_empty_rows`)
            out = kernels_torch.uniform_empty_rows(out, mask, v.transpose(1, 2))
    out = _dense(layer.output_dense, out.reshape(batch, q_len, heads * head_dim))
    return out, cache


def _window_step(layer, x, mask, cache, k_cache, v_cache, cache_index, scale):
    """A sliding-window self-attention's decode step (one token a row) on its rolling cache
    (`slots` slots, position `p` in slot `p % slots`), as `MultiHeadAttention._rolling_decode`
    computes it: the new keys/values written in place at `cache_index % slots`, the query
    attending to the slots that hold the last `window` positions (none before the first,
    none of the padding: `mask`, the boolean key mask over positions, or None). The Keras
    call, a copy of the cache included, was most of an eager Mistral-style step."""
    import torch

    from kzoo.layers import compiled_decode

    batch = x.shape[0]
    heads, kv_heads, head_dim = layer.num_heads, layer._kv_heads, layer._head_dim
    q, k, v = _project_qkv(layer, x)
    q = q.reshape(batch, 1, heads, head_dim)
    k = k.reshape(batch, 1, kv_heads, head_dim)
    v = v.reshape(batch, 1, kv_heads, head_dim)
    if layer.rotary is not None:
        k = _rotate(layer.rotary, k, cache_index)
        q = _rotate(layer.rotary, q, cache_index)
    slots = k_cache.shape[2]
    position = (cache_index if type(cache_index) is int
                else torch.as_tensor(cache_index, dtype=torch.long, device=x.device))
    slot = (torch.as_tensor(position % slots, dtype=torch.long, device=x.device)).view(1)
    k_cache.index_copy_(2, slot, k.transpose(1, 2).to(k_cache.dtype))
    v_cache.index_copy_(2, slot, v.transpose(1, 2).to(v_cache.dtype))
    visible = compiled_decode._window_mask(  # (`mask`: the boolean `(batch, 1, 1, length)`)
        layer.attention_options["window"], slots, position,
        None if mask is None else mask[:, 0, 0, :], device=x.device)
    out = _sdpa(q.transpose(1, 2), k_cache.to(q.dtype), v_cache.to(q.dtype), visible, None,
                scale)
    out = _dense(layer.output_dense, out.transpose(1, 2).reshape(batch, 1, heads * head_dim))
    return out, cache


def _rotate(rotary, x, start):
    """`rotary(x, start_index=start)` of a `RotaryEmbedding` in torch calls, for `x (batch,
    seq, heads, head_dim)` and a Python int or scalar tensor `start`: the same operations
    as its `call`, in the same order (float64 frequencies cast to float32, float32 positions
    and angles, the rotation in float32, the result in `x`'s dtype), without the Keras
    layer call, which was half of an eager Llama-style decode step (0.75 of 1.56 s for 128
    steps of 4 rows, width 256, 4 layers). The cosines and sines of a step's position are
    made once for its layers' queries and keys (`_STATE.rotary`). Anything else (a per-row
    or per-token `start`, another rank): the layer's own call."""
    import torch

    from kzoo.layers.compiled_decode import rope_apply, rope_tables

    head_dim = x.shape[-1]
    start_is_int = type(start) is int
    if x.dim() != 4 or head_dim % 2 or not (
            start_is_int or (isinstance(start, torch.Tensor) and start.dim() == 0)):
        return rotary(x, start_index=start)
    seq, half = x.shape[1], head_dim // 2
    key = (float(rotary.max_wavelength), rotary.scaling(), bool(rotary.interleaved),
           head_dim, seq, x.device, start if start_is_int else None)
    keep = start_is_int and _plain_tensor(x)  # (see `_plain_tensor`: not while tracing)
    cached = getattr(_STATE, "rotary", None) if keep else None
    if cached is not None and cached[0] == key:
        cos, sin = cached[1]
    else:
        # (the scaling is in the frequencies, `rope_inverse_frequencies`, and YaRN's factor
        # in the tables)
        inv_freq = torch.as_tensor(rotary.inverse_frequencies(head_dim), device=x.device)
        positions = torch.arange(seq, dtype=torch.int32, device=x.device)
        if not start_is_int:
            positions = positions + start.to(torch.int32)
        elif start:
            positions = positions + start
        positions = positions.to(torch.float32)[None, :]
        angles = (positions[..., None] * inv_freq).reshape(1, seq, 1, half)
        cos, sin = rope_tables(angles, rotary.interleaved, rotary.rotation_scale())
        if keep:
            _STATE.rotary = (key, (cos, sin))
    return rope_apply(x.to(torch.float32), cos, sin, rotary.interleaved).to(x.dtype)


def _plain_tensor(x):
    """Whether `x` is a real torch tensor, made outside any tracing: `torch.export` (the ONNX
    exporter) and `torch.compile` run the model on fake or functional tensor subclasses,
    which a table kept for later eager calls must not hold (the next eager call of the same
    length would compute on a fake tensor and fail in `.numpy()`)."""
    import torch

    return type(x) is torch.Tensor and not torch.compiler.is_compiling()


def block_step(block, x, padding_mask=None, attention_mask=None, attention_bias=None,
               encoder_outputs=None, encoder_padding_mask=None, cross_attention_bias=None,
               cache=None, cache_index=None, cross_cache=None, causal_bias=False):
    """One cached step of `block` (a `TransformerBlock`) in torch calls; see the module
    docstring. Same arguments and results as the block's `call` with a cache (inference).
    `causal_bias=True` says that `attention_bias` already hides every key after its query
    (a large negative value there), so no causal mask is built.
    """
    if encoder_outputs is not None or attention_mask is not None:
        # Not a decode-loop call (those pass caches only): the Keras path.
        return block(x, padding_mask=padding_mask, attention_mask=attention_mask,
                     attention_bias=attention_bias, encoder_outputs=encoder_outputs,
                     encoder_padding_mask=encoder_padding_mask,
                     cross_attention_bias=cross_attention_bias, cache=cache,
                     cache_index=cache_index, cross_cache=cross_cache)
    x, cache = _sublayer(block, block.self_attention_norm, x, lambda h: _attention(
        block.self_attention, h, mask=_key_mask(padding_mask)[0], bias=attention_bias,
        cache=cache, cache_index=cache_index, causal=block.causal,
        causal_bias=causal_bias and block.causal))
    if block.cross_attention:
        if cross_cache is None:
            raise ValueError("A cached decode step of a cross-attention block needs "
                             "`cross_cache`.")
        mask, rows_visible = _key_mask(encoder_padding_mask)
        x, _ = _sublayer(block, block.cross_attention_norm, x, lambda h: _attention(
            block.cross_attention_layer, h, mask=mask, bias=cross_attention_bias,
            cache=cross_cache, cache_index=None, rows_visible=rows_visible))
    x = _sublayer(block, block.feedforward_norm, x,
                  lambda h: _feedforward(block.feedforward_layer, h))
    if cross_cache is None:
        return x, cache
    return x, cache, cross_cache


def norm(layer, x):
    """A norm layer (`LayerNormalization`, `RMSNorm`) in torch calls when `enabled()`."""
    return _norm(layer, x) if enabled() else layer(x)


def dense(layer, x):
    """A `Dense` layer (T5 v1.1's untied `lm_head`) in torch calls when `enabled()` (a few
    rows by its transposed kernel, see `_few_rows`); its own call otherwise."""
    return _dense(layer, x) if enabled() else layer(x)


def embed(layer, ids):
    """`layer(ids)` of a `TokenEmbedding` (ids clipped into the vocabulary, as it does)."""
    if not enabled():
        return layer(ids)
    table = _value(layer.embeddings)
    ids = ids.long().clamp(0, layer.vocabulary_size - 1)
    return table[ids].to(_torch_dtype(layer.compute_dtype))


# Largest tied embedding table (bytes) that `unembed` copies transposed for a decode loop.
_COPY_LIMIT = 256 * 2 ** 20


def unembed(layer, hidden):
    """`layer(hidden, reverse=True)` of a `TokenEmbedding`: the logits."""
    if not enabled():
        if (layer.tie_weights and getattr(_STATE, "hoisted", None) is not None
                and keras.backend.backend() in ("jax", "tensorflow")):
            return _hoisted_unembed(layer, hidden)
        return layer(hidden, reverse=True)
    dtype = _torch_dtype(layer.reverse_dtype or layer.compute_dtype)
    hidden = hidden.to(dtype)
    if layer.tie_weights:
        table = _value(layer.embeddings)
        if _few_rows(hidden, table, copied=0):  # (`E` is `(out, in)` row-major already)
            logits = _few_rows_product(hidden, table)
        elif torch_linear_uses_onednn(hidden, table.to(dtype)):
            # oneDNN reads the row-major table as it is, faster than MKL with the copy
            # below (8192 x 256, us a step: 1 row 136 -> 99, 5 rows 731 -> 367, 8 rows 795
            # -> 448, 16 rows 951 -> 640; 2-4 rows: `_few_rows_product` as fast)
            logits = torch_linear(hidden, table.to(dtype))
        elif table.device.type == "cpu" and table.numel() * table.element_size() <= _COPY_LIMIT:
            # On CPU `h @ E.T` of a row-major table runs at about 60% of the speed of the
            # same product with a row-major `E.T` (MKL, batch 4, 8192 x 256): that copy,
            # made once per loop.
            table = memo(("unembed_t", id(layer), dtype), [table],
                         lambda: table.to(dtype).T.contiguous())
            logits = hidden @ table
        else:
            logits = hidden @ table.to(dtype).T
    else:
        kernel = _value(layer.reverse_embeddings).to(dtype)  # (in, out)
        if _few_rows(hidden, kernel):
            # (MKL's slow path for a few rows by an `(in, out)` weight, see `_few_rows`:
            # 4 x 256 by 256 x 8192 took 1.9 ms of a 12 ms Llama-style step)
            weight = memo(("unembed_rows_t", id(layer), dtype), [kernel],
                          lambda: kernel.t().contiguous())
            logits = _few_rows_product(hidden, weight)
        else:
            logits = hidden @ kernel
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = cap * (logits / cap).tanh()
    return logits


def hoisted_qkv(layer, x):
    """`(q, k, v)` projections of `x (batch, q_len, dim)` by the attention `layer`'s three
    `Dense` layers as one matrix product with their kernels side by side, joined once per
    compiled decode loop (`loop_constant`), or None where that does not apply: outside a
    compiled loop (JAX / TensorFlow), or for kernels that are not plain float `Dense` ones
    (LoRA, quantised, an activation, biases on some only), and on other backends.

    Why: a decode step multiplies a few rows; XLA on CPU runs three `(dim, dim)` products
    as three library calls, each with its own fixed cost (4 rows, width 256, 4 layers in a
    `fori_loop`: 66 against 53 us a step for one product of the joined kernel). Interleaved
    A/B on `benchmarks/peers.py`'s decode (JAX, 6 rounds, new tokens/s): GPT 2,750 -> 2,897,
    T5 2,329 -> 2,431, the same tokens. JAX only: TensorFlow's compiled loop measured no
    gain (GPT 2,793 -> 2,776, T5 2,485 -> 2,355, 4 rounds)."""
    scope = getattr(_STATE, "hoisted", None)
    if scope is None or keras.backend.backend() != "jax":
        return None
    denses = (layer.query_dense, layer.key_dense, layer.value_dense)
    if not all(_plain_dense(d) for d in denses):
        return None
    if len({d.bias is None for d in denses}) != 1 or len({d.compute_dtype for d in denses}) != 1:
        return None
    from keras import ops

    dtype = denses[0].compute_dtype

    def joined():
        kernel = ops.concatenate([ops.cast(d.kernel, dtype) for d in denses], axis=1)
        bias = (None if denses[0].bias is None else
                ops.concatenate([ops.cast(d.bias, dtype) for d in denses], axis=0))
        return kernel, bias

    kernel, bias = loop_constant(("qkv", id(layer), dtype), joined)
    y = ops.matmul(ops.cast(x, dtype), kernel)
    if bias is not None:
        y = y + bias
    sizes = [d.kernel.shape[1] for d in denses]
    return ops.split(y, [sizes[0], sizes[0] + sizes[1]], axis=-1)


def _hoisted_unembed(layer, hidden):
    """The tied logits in a compiled decode loop: `hidden @ E^T` with a row-major `E^T` made
    once before the loop. XLA on CPU runs `h @ E.T` of the row-major table (a transposed
    operand, the matrix-vector shape of a decode step) at about half the speed of the same
    product with `E^T` laid out row-major (batch 4, 8192 x 256: 371 against 247-295 us a
    product in a `while_loop`)."""
    from keras import ops

    dtype = layer.reverse_dtype or layer.compute_dtype
    table = loop_constant(("unembed_t", id(layer), dtype), lambda: ops.transpose(
        ops.cast(layer.embeddings, dtype)))
    # (the layer's call casts its input to the input dtype first, the rounding kept here)
    hidden = ops.cast(ops.cast(hidden, layer.input_dtype), dtype)
    logits = ops.matmul(hidden, table)
    if layer.logit_soft_cap is not None:
        cap = ops.cast(layer.logit_soft_cap, dtype)
        logits = cap * ops.tanh(logits / cap)
    return logits
