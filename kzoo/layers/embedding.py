"""Input embeddings: token ids (with a tied or untied output projection) and image patches."""

import keras
from keras import ops

from kzoo.layers.gradients import tf_custom_gradient
from kzoo.layers.taps import active_tap
from kzoo.layers.utils import check_bool
from kzoo.layers.utils import clip
from kzoo.layers.utils import fastest_way
from kzoo.layers.utils import over_rows
from kzoo.layers.utils import check_positive_float
from kzoo.layers.utils import check_positive_int
from kzoo.layers.utils import serialize_initializer


_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@keras.saving.register_keras_serializable(package="kzoo")
class TokenEmbedding(keras.layers.Layer):
    """Token embedding that can also project hidden states back to vocabulary logits.

    `call(ids)` looks rows of the `embeddings` matrix `(vocabulary_size, embedding_dim)` up.
    `call(hidden, reverse=True)` returns logits `hidden @ embeddings.T` when `tie_weights`
    (Press & Wolf, 2017; BERT, GPT-2, T5 v1.0) or `hidden @ reverse_embeddings` with a
    separate `(embedding_dim, vocabulary_size)` matrix when `tie_weights=False` (T5 v1.1).
    With `logit_soft_cap=c` the logits are `c * tanh(logits / c)` (Gemma 2).

    Ids outside `[0, vocabulary_size)`: they are clipped into the range (negative ids read
    row 0, too-large ids the last row) on every backend, eagerly and under `jit`. The
    backends disagree otherwise (JAX fills NaN, PyTorch raises, TensorFlow raises on CPU and
    returns zeros on GPU), so clipping is the one behaviour that is the same everywhere;
    check your tokenizer's vocabulary size against `vocabulary_size` when building a model.

    Precision: the lookup returns the compute dtype. The reverse projection runs in the
    compute dtype too (bfloat16 logits under `"mixed_bfloat16"`) unless `reverse_dtype` is
    given, e.g. `reverse_dtype="float32"` casts the hidden states and the (float32) weight
    variable to float32 so that the logits and the softmax over a large vocabulary are
    computed in full precision.

    Args:
        vocabulary_size: number of token ids (positive int).
        embedding_dim: width of each embedding (positive int).
        tie_weights: reuse `embeddings` for the output projection (default True).
        embeddings_initializer: initializer of `embeddings` (and of `reverse_embeddings`).
        logit_soft_cap: `None` or a positive float; soft-caps the reverse logits.
        reverse_dtype: `None` (compute dtype) or a float dtype name for the reverse logits.
        **kwargs: base `keras.layers.Layer` arguments.

    Call args:
        inputs: integer ids `(batch, seq)` (any shape) or, with `reverse=True`, hidden
            states `(..., embedding_dim)`.
        reverse: project to logits instead of looking up.

    Returns:
        `(..., embedding_dim)` embeddings or `(..., vocabulary_size)` logits.

    Example:

    ```python
    embed = kzoo.layers.embedding.TokenEmbedding(vocabulary_size=32000, embedding_dim=512)
    hidden = embed(keras.ops.ones((2, 8), "int32"))  # (2, 8, 512)
    logits = embed(hidden, reverse=True)             # (2, 8, 32000)
    ```
    """

    def __init__(
        self,
        vocabulary_size,
        embedding_dim,
        tie_weights=True,
        embeddings_initializer="uniform",
        logit_soft_cap=None,
        reverse_dtype=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = check_positive_int("vocabulary_size", vocabulary_size)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self.tie_weights = check_bool("tie_weights", tie_weights)
        self.embeddings_initializer = serialize_initializer(embeddings_initializer,
                                                            "embeddings_initializer")
        if logit_soft_cap is not None:
            logit_soft_cap = check_positive_float("logit_soft_cap", logit_soft_cap)
        self.logit_soft_cap = logit_soft_cap
        if reverse_dtype is not None and reverse_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"`reverse_dtype` must be None or one of {list(_FLOAT_DTYPES)}; got "
                f"reverse_dtype={reverse_dtype!r}."
            )
        self.reverse_dtype = reverse_dtype

    def build(self, input_shape=None):
        # The weights do not depend on the input shape; autocast is off so that the
        # reverse projection can read the full-precision variable (see `reverse_dtype`).
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocabulary_size, self.embedding_dim),
            initializer=keras.initializers.get(self.embeddings_initializer),
            autocast=False,
        )
        if not self.tie_weights:
            self.reverse_embeddings = self.add_weight(
                name="reverse_embeddings",
                shape=(self.embedding_dim, self.vocabulary_size),
                initializer=keras.initializers.get(self.embeddings_initializer),
                autocast=False,
            )
        else:
            self.reverse_embeddings = None
        self.built = True

    def call(self, inputs, reverse=False):
        if reverse:
            return self._reverse(inputs)
        ids = inputs
        if "int" not in keras.backend.standardize_dtype(ids.dtype):
            ids = ops.cast(ids, "int32")
        ids = clip(ids, 0, self.vocabulary_size - 1)
        table = ops.cast(self.embeddings, self.compute_dtype)
        x = ops.take(table, ids, axis=0)
        tap = active_tap()  # interpretation (kzoo.layers.taps): None in a plain pass
        return x if tap is None else tap._on_embedding(self, x)

    def _reverse(self, hidden):
        return self.reverse_logits(hidden)

    def reverse_logits(self, hidden, bias=None):
        """The logits of `call(hidden, reverse=True)`, plus `bias` `(vocabulary_size,)` when
        given (added after the soft cap), e.g. BERT's output bias (`OutputBias`).

        On torch a tied table without a soft cap takes one `F.linear` (an `addmm` with the
        bias): the `(tokens, vocabulary)` logits are written once instead of a product and
        then a second full-size tensor for the bias (measured: the separate add and the
        page faults of its 64 MiB output cost a third of BERT's forward at 8 x 256 tokens);
        in a training step that releases the logits to the loss, into memory kept from one
        step to the next (`kzoo.losses.tied_logits_into`).
        On JAX and TensorFlow the bias is a column of the tied product
        (`_jax_tied_logits_with_bias`, `_tf_tied_logits`).
        """
        dtype = self.reverse_dtype or self.compute_dtype
        hidden = ops.cast(hidden, dtype)
        if bias is not None:
            bias = ops.cast(bias, dtype)
        if (self.tie_weights and self.logit_soft_cap is None
                and keras.backend.backend() == "torch"):
            from kzoo.losses import tied_logits_into

            return tied_logits_into(self, hidden, ops.cast(self.embeddings, dtype), bias)
        if self.tie_weights and keras.backend.backend() == "jax":
            table = ops.convert_to_tensor(ops.cast(self.embeddings, dtype))
            if bias is not None and self.logit_soft_cap is None:
                return _jax_tied_logits_with_bias()(hidden, table, bias)
            logits = _jax_tied_logits()(hidden, table)
        elif self.tie_weights and keras.backend.backend() == "tensorflow":
            table = ops.cast(self.embeddings, dtype)
            if bias is not None and self.logit_soft_cap is None:
                return _tf_tied_logits(hidden, table, bias)
            logits = _tf_tied_logits(hidden, table)
        elif self.tie_weights:
            logits = ops.matmul(hidden, ops.transpose(ops.cast(self.embeddings, dtype)))
        else:
            logits = _untied_logits(hidden, ops.cast(self.reverse_embeddings, dtype))
        if self.logit_soft_cap is not None:
            cap = ops.cast(self.logit_soft_cap, dtype)
            logits = cap * ops.tanh(logits / cap)
        return logits if bias is None else logits + bias

    def compute_output_spec(self, inputs, reverse=False):
        shape = tuple(inputs.shape)
        if reverse:
            return keras.KerasTensor(
                shape[:-1] + (self.vocabulary_size,),
                dtype=self.reverse_dtype or self.compute_dtype,
            )
        return keras.KerasTensor(shape + (self.embedding_dim,), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "embedding_dim": self.embedding_dim,
                "tie_weights": self.tie_weights,
                "embeddings_initializer": self.embeddings_initializer,
                "logit_soft_cap": self.logit_soft_cap,
                "reverse_dtype": self.reverse_dtype,
            }
        )
        return config


_JAX_TIED = []


def _untied_logits(hidden, kernel):
    """`hidden @ kernel` for the `(dim, vocab)` output kernel; on JAX over the flattened
    leading axes of `hidden` (as `kzoo.layers.utils.project` multiplies a Dense), so the
    kernel's gradient is one plain matrix product. Differentiated as a 3-D product, XLA on
    CPU contracted batch and sequence at once with transposing copies and a generic dot: a
    GPT with an untied head (Llama-style presets), 8 x 256 tokens, vocabulary 8192, trained
    at 3,415 -> 4,348 tokens/s (interleaved in one process, 12 pairs, median speed-up per
    pair 1.28x, the same losses; the tied head's 4,475). A hand-written backward pass on top
    (as `_jax_tied_logits`) measured 1.005-1.015x more, within the noise: not kept."""
    return over_rows(lambda rows: ops.matmul(rows, kernel), hidden)


def _jax_tied_logits():
    """`f(hidden (..., dim), table (vocab, dim)) = hidden @ table.T` with a hand-written
    backward pass (JAX only; made once): `d_hidden = d @ table` and
    `d_table = (hidden^T @ d)^T`. Differentiated by JAX itself, XLA on CPU computed
    `d_table = d^T @ hidden` by first writing the whole `(tokens, vocab)` logits gradient
    transposed: a 64 MiB strided copy that took 59 ms of a 780 ms GPT step at 8 x 256
    tokens, vocabulary 8192 (jax.profiler). Here the large operand `d` is read in its own
    row-major layout and only `(dim, vocab)` is transposed: the step measured 2,829 ->
    3,070 tokens/s (interleaved, quiet machine)."""
    if _JAX_TIED:
        return _JAX_TIED[0]
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def tied_logits(hidden, table):
        return jnp.einsum("...d,vd->...v", hidden, table)

    def forward(hidden, table):
        return tied_logits(hidden, table), (hidden, table)

    def backward(saved, d):
        return _jax_tied_gradients(*saved, d)

    tied_logits.defvjp(forward, backward)
    _JAX_TIED.append(tied_logits)
    return tied_logits


def _jax_tied_gradients(hidden, table, d):
    """`(d_hidden, d_table)` of `hidden @ table.T` for the output gradient `d`: `d @ table`
    and `(hidden^T @ d)^T` (see `_jax_tied_logits`).

    `hidden^T` is written out row-major before the product and the product before its
    transpose (`lax.optimization_barrier` around each): left to itself, XLA on CPU gave the
    `(dim, vocab)` product a transposed output layout and ran it as a slower dot. At 2048
    tokens, width 256, vocabulary 8192 (2-core CPU, freed memory kept): 65 -> 44 ms;
    GPT training interleaved in one process, 6 rounds: 3,797 -> 3,991 tokens/s."""
    import jax.numpy as jnp
    from jax import lax

    d_hidden = jnp.einsum("...v,vd->...d", d, table)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    d_table = lax.optimization_barrier(
        lax.optimization_barrier(flat_h.T) @ d.reshape(-1, d.shape[-1])).T
    return d_hidden.astype(hidden.dtype), d_table.astype(table.dtype)


def _jax_tied_logits_with_bias():
    """`f(hidden, table, bias) = hidden @ table.T + bias` on JAX, the bias inside the product:
    `[hidden, 1] @ [table, bias].T`. XLA on CPU adds a bias to a 3-D product's output in a
    separate pass over the `(batch, seq, vocab)` logits (BERT's masked-LM head at every
    position of 8 x 256 tokens, vocabulary 8192: 65-77 ms against 50-60 without the bias);
    one more column of the contraction costs 54-65 ms (2-core CPU). The backward pass is
    `_jax_tied_logits`' with `d_bias`, the column sums of `d`. Made once."""
    if _JAX_TIED_BIAS:
        return _JAX_TIED_BIAS[0]
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def tied_logits(hidden, table, bias):
        ones = jnp.ones(hidden.shape[:-1] + (1,), hidden.dtype)
        return jnp.einsum("...d,vd->...v", jnp.concatenate([hidden, ones], axis=-1),
                          jnp.concatenate([table, bias[:, None].astype(table.dtype)], axis=1))

    def forward(hidden, table, bias):
        return tied_logits(hidden, table, bias), (hidden, table, bias)

    def backward(saved, d):
        hidden, table, bias = saved
        d_bias = jnp.sum(d.reshape(-1, d.shape[-1]), axis=0)
        return _jax_tied_gradients(hidden, table, d) + (d_bias.astype(bias.dtype),)

    tied_logits.defvjp(forward, backward)
    _JAX_TIED_BIAS.append(tied_logits)
    return tied_logits


_JAX_TIED_BIAS = []


# === TensorFlow's tied head: the forms of its two large products, per machine and shape ===

# How `_tf_tied_logits` multiplies: "auto" (time the forms once per shape, keep the fastest)
# or "fixed" (the forms given to `set_tf_head_products`).
TF_HEAD_MODES = ("auto", "fixed")
# The two forms of the table's gradient `(vocab, dim)` from the logits' gradient `d`
# `(rows, vocab)` and the hidden states `h` `(rows, dim)`: `(h^T @ d)^T` (`d` read
# row-major, the small product transposed) or `d^T @ h` (TensorFlow's `transpose_a` of `d`).
TF_TABLE_GRADIENTS = ("product_transposed", "d_transposed")
_TF_HEAD = {"mode": "auto", "fixed": (1, "product_transposed")}
# (rows, dim, vocab, dtype) -> (forward chunks, table gradient form), timed once a process.
_TF_HEAD_CHOICE = {}
# Heads with fewer `rows * vocab` logits take the plain forms untimed (a product of a few
# milliseconds); larger ones are timed on at most `TF_HEAD_TIMING_ROWS` rows (the forms
# ranked alike at 512, 1024 and 2048 rows); the forward pass may split the table into this
# many slices.
TF_HEAD_TIMING_LOGITS = 1 << 22
TF_HEAD_TIMING_ROWS = 1024
TF_HEAD_CHUNKS = (1, 32)
_TF_HEAD_TIMING_CALLS = 3
# A form other than the first (one product; `product_transposed`) is kept only when its
# median is below this fraction of the first's: timing noise does not change the graph.
_TF_HEAD_MARGIN = 0.95


def set_tf_head_products(mode="auto", forward_chunks=1, table_gradient="product_transposed"):
    """How TensorFlow's tied output projection (`TokenEmbedding.reverse_logits`) multiplies
    in graphs not compiled by XLA, for the rest of the process: `mode="auto"` (the default)
    times its forms once per shape and keeps the fastest (see `_tf_tied_logits`);
    `mode="fixed"` takes `forward_chunks` (the table split into that many slices for the
    logits, 1: one product) and `table_gradient` (one of `TF_TABLE_GRADIENTS`). The forms
    differ by rounding only. Returns the previous `(mode, forward_chunks, table_gradient)`."""
    if mode not in TF_HEAD_MODES:
        raise ValueError(f"`mode` must be one of {list(TF_HEAD_MODES)}; got mode={mode!r}.")
    if isinstance(forward_chunks, bool) or not isinstance(forward_chunks, int) \
            or forward_chunks < 1:
        raise ValueError("`forward_chunks` must be a positive int (1: one product); got "
                         f"forward_chunks={forward_chunks!r}.")
    if table_gradient not in TF_TABLE_GRADIENTS:
        raise ValueError(f"`table_gradient` must be one of {list(TF_TABLE_GRADIENTS)}; got "
                         f"table_gradient={table_gradient!r}.")
    previous = (_TF_HEAD["mode"],) + _TF_HEAD["fixed"]
    _TF_HEAD["mode"], _TF_HEAD["fixed"] = mode, (forward_chunks, table_gradient)
    _TF_HEAD_CHOICE.clear()
    return previous


def _tf_slices(table, chunks):
    """`table` split into `chunks` row slices of near-equal sizes (at most its row count)."""
    import tensorflow as tf

    rows = table.shape[0]
    chunks = max(1, min(chunks, rows))
    sizes = [rows // chunks + (i < rows % chunks) for i in range(chunks)]
    return tf.split(table, sizes, axis=0)


def _tf_head_logits(flat, table, chunks):
    """`flat @ table^T`, as one product or `chunks` products over slices of the table's
    rows, concatenated."""
    import tensorflow as tf

    if chunks <= 1 or table.shape[0] is None:
        return tf.matmul(flat, table, transpose_b=True)
    return tf.concat([tf.matmul(flat, part, transpose_b=True)
                      for part in _tf_slices(table, chunks)], axis=1)


def _tf_table_gradient(flat, flat_d, form):
    import tensorflow as tf

    if form == "d_transposed":
        return tf.matmul(flat_d, flat, transpose_a=True)
    return tf.transpose(tf.matmul(flat, flat_d, transpose_a=True))


def _tf_head_forms(rows, dim, vocab, dtype):
    """(forward chunks, table gradient form) of `_tf_tied_logits` for a `(rows, dim)` by
    `(vocab, dim)` product: the fixed forms, the plain ones for small or unknown shapes and
    inside XLA, else the fastest measured (once per shape and dtype)."""
    if _TF_HEAD["mode"] == "fixed":
        return _TF_HEAD["fixed"]
    plain = (1, "product_transposed")
    if rows is None or dim is None or vocab is None or rows * vocab < TF_HEAD_TIMING_LOGITS:
        return plain
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()):
        return plain  # (XLA emits its own products)
    key = (rows, dim, vocab, dtype)
    if key not in _TF_HEAD_CHOICE:
        _TF_HEAD_CHOICE[key] = _time_tf_head(rows, dim, vocab, dtype)
    return _TF_HEAD_CHOICE[key]


def _fastest(ways, calls, clock):
    """`fastest_way` with `_TF_HEAD_MARGIN`: a way other than the first (the old form) must
    be clearly faster to change the graph."""
    return fastest_way(ways, calls, clock, _TF_HEAD_MARGIN)


def _time_tf_head(rows, dim, vocab, dtype, clock=None):
    """Time `_tf_tied_logits`' forms eagerly (outside any graph being traced) on random
    operands of the head's shape (at most `TF_HEAD_TIMING_ROWS` rows), as `tf.function`s:
    the logits as one product or over `TF_HEAD_CHUNKS` slices of the table, and the table's
    gradient in both `TF_TABLE_GRADIENTS` forms. `clock`: the timer (`time.perf_counter`)."""
    import time

    import numpy as np
    import tensorflow as tf

    clock = clock or time.perf_counter
    rows = min(rows, TF_HEAD_TIMING_ROWS)
    with tf.init_scope():
        generator = np.random.default_rng(0)
        flat, table, d = (tf.constant(generator.standard_normal(shape), dtype=dtype)
                          for shape in ((rows, dim), (vocab, dim), (rows, vocab)))

        def run(function):
            return lambda: function().numpy()[:1]  # (waits for the result)

        logits = {n: run(tf.function(lambda n=n: _tf_head_logits(flat, table, n)[:1, :1]))
                  for n in TF_HEAD_CHUNKS if vocab // n >= 128}
        gradients = {form: run(tf.function(
            lambda form=form: _tf_table_gradient(flat, d, form)[:1, :1]))
            for form in TF_TABLE_GRADIENTS}
        return (_fastest(logits, _TF_HEAD_TIMING_CALLS, clock),
                _fastest(gradients, _TF_HEAD_TIMING_CALLS, clock))


def _tf_tied_logits(hidden, table, bias=None):
    """`hidden @ table.T (+ bias)` on TensorFlow with a hand-written backward pass:
    `d_hidden = d @ table`, `d_table` as `d^T @ hidden` or `(hidden^T @ d)^T`, and `d_bias`
    the column sums of `d`.

    The logits' product and the table's gradient are the two largest products of a language
    model's training step, and Eigen's speed on them depends on the machine and the form:
    on the 2-core CPU at 2048 tokens, width 256, vocabulary 8192 (medians in a graph), one
    machine ran `d_table` in 26 ms as `(hidden^T @ d)^T` against 33 as `d^T @ hidden`;
    another (an AMD EPYC with AVX2) 116 against 92 ms, and the logits in 136-160 ms as one
    product against 80-85 over 8 to 64 slices of the table, concatenated. So in a graph not
    compiled by XLA, a head of `TF_HEAD_TIMING_LOGITS` logits or more times the forms once
    per shape at its first trace (`_time_tf_head`: 1.2-2.1 s at that size) and keeps the
    fastest (GPT training there, interleaved: 2,333 -> 2,559 tokens/s);
    `set_tf_head_products` fixes them.

    A bias is a column of the product, `[hidden, 1] @ [table, bias].T` (as on JAX,
    `_jax_tied_logits_with_bias`), not a second pass over the logits: at those sizes
    47.2-50.2 -> 45.1-45.8 ms in a graph, 49.8-50.2 -> 49.2-49.5 ms under XLA."""
    import tensorflow as tf

    def logits_of(h, table, bias):
        flat = tf.reshape(h, [-1, tf.shape(h)[-1]])
        extended, full = flat, table
        if bias is not None:  # (the bias' gradient is then the last column of the table's)
            ones = tf.ones(tf.stack([tf.shape(flat)[0], 1]), flat.dtype)
            extended, full = tf.concat([flat, ones], 1), tf.concat([table, bias[:, None]], 1)
        chunks, table_gradient = _tf_head_forms(
            h.shape[:-1].num_elements(), full.shape[1], full.shape[0], flat.dtype.name)
        logits = _tf_head_logits(extended, full, chunks)

        def grad(d):
            flat_d = tf.reshape(d, [-1, tf.shape(d)[-1]])
            d_hidden = tf.reshape(tf.matmul(flat_d, table), tf.shape(h))
            d_table = _tf_table_gradient(extended, flat_d, table_gradient)
            if bias is None:
                return d_hidden, d_table
            return d_hidden, d_table[:, :-1], d_table[:, -1]

        out = tf.reshape(logits, tf.concat([tf.shape(h)[:-1], tf.shape(table)[:1]], 0))
        out.set_shape(h.shape[:-1].concatenate(table.shape[:1]))  # (the static shape)
        return out, grad

    h, table = tf.convert_to_tensor(hidden), tf.convert_to_tensor(table)
    if bias is None:
        return tf_custom_gradient(lambda h, table: logits_of(h, table, None))(h, table)
    return tf_custom_gradient(lambda h, table, bias: logits_of(h, table, bias))(
        h, table, tf.convert_to_tensor(bias))


def _patch_pair(patch_size):
    if isinstance(patch_size, (list, tuple)):
        if len(patch_size) != 2:
            raise ValueError(
                "`patch_size` must be a positive int or a pair (height, width) of positive "
                f"ints; got patch_size={patch_size!r}."
            )
        pair = tuple(patch_size)
    else:
        pair = (patch_size, patch_size)
    for p in pair:
        if isinstance(p, bool) or not isinstance(p, int) or p <= 0:
            raise ValueError(
                "`patch_size` must be a positive int or a pair (height, width) of positive "
                f"ints; got patch_size={patch_size!r}."
            )
    return pair


@keras.saving.register_keras_serializable(package="kzoo")
class PatchEmbedding(keras.layers.Layer):
    """Split images into non-overlapping patches and embed each (ViT, Dosovitskiy et al., 2021).

    A `Conv2D` with kernel = stride = `patch_size` and valid padding (sublayer `projection`,
    kernel `(patch_h, patch_w, channels, hidden_dim)`), i.e. a linear map of each flattened
    patch, then reshaped to a sequence of `(H / patch_h) * (W / patch_w)` patch tokens in
    row-major (top-left first) order.

    Args:
        patch_size: int or `(patch_h, patch_w)`.
        hidden_dim: width of each patch embedding.
        num_channels: expected number of input channels (`None` takes it from the input).
        use_bias: whether the projection has a bias.
        kernel_initializer, bias_initializer: initializers of the projection.
        **kwargs: base `keras.layers.Layer` arguments.

    Call args:
        inputs: images `(batch, height, width, channels)` (channels last). Height and width
            must be multiples of the patch size; when they are known statically a
            `ValueError` says so, otherwise the conv's valid padding drops the remainder.

    Returns:
        `(batch, num_patches, hidden_dim)`.

    Example:

    ```python
    patches = kzoo.layers.embedding.PatchEmbedding(patch_size=16, hidden_dim=768)
    tokens = patches(keras.random.normal((2, 224, 224, 3)))  # (2, 196, 768)
    ```
    """

    def __init__(
        self,
        patch_size,
        hidden_dim,
        num_channels=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self._patch = _patch_pair(patch_size)
        self.patch_size = patch_size if isinstance(patch_size, int) else list(patch_size)
        self.hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        self.num_channels = check_positive_int("num_channels", num_channels, allow_none=True)
        self.use_bias = check_bool("use_bias", use_bias)
        self.kernel_initializer = serialize_initializer(kernel_initializer, "kernel_initializer")
        self.bias_initializer = serialize_initializer(bias_initializer, "bias_initializer")

        # === Layers ===
        self.projection = keras.layers.Conv2D(
            filters=hidden_dim,
            kernel_size=self._patch,
            strides=self._patch,
            padding="valid",
            data_format="channels_last",
            use_bias=use_bias,
            kernel_initializer=keras.initializers.get(self.kernel_initializer),
            bias_initializer=keras.initializers.get(self.bias_initializer),
            dtype=self.dtype_policy,
            name="projection",
        )

    def _check_shape(self, shape):
        if len(shape) != 4:
            raise ValueError(
                "PatchEmbedding expects images of shape (batch, height, width, channels); "
                f"got shape {tuple(shape)}."
            )
        for axis, size, p in (("height", shape[1], self._patch[0]), ("width", shape[2], self._patch[1])):
            if size is not None and size < p:
                raise ValueError(
                    f"Image {axis}={size} is smaller than one patch ({axis} {p}, "
                    f"patch_size={self.patch_size!r}): no patch to embed; got image shape "
                    f"{tuple(shape)}."
                )
            if size is not None and size % p != 0:
                raise ValueError(
                    f"Image {axis}={size} is not divisible by the patch {axis} {p} "
                    f"(patch_size={self.patch_size!r}); got image shape {tuple(shape)}."
                )
        channels = shape[3]
        if self.num_channels is not None and channels is not None and channels != self.num_channels:
            raise ValueError(
                f"PatchEmbedding was configured with num_channels={self.num_channels} but got "
                f"images with {channels} channels (shape {tuple(shape)})."
            )

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        self._check_shape(input_shape)
        channels = input_shape[3] if input_shape[3] is not None else self.num_channels
        if channels is None:
            raise ValueError(
                "The channel axis of the images must be known or `num_channels` given; got "
                f"input shape {input_shape}."
            )
        self.projection.build(input_shape[:3] + (channels,))
        self.built = True

    def call(self, inputs):
        self._check_shape(tuple(inputs.shape))
        x = self.projection(inputs)
        # The grid from the images, not from the convolution's output: TensorFlow's
        # convolution of an empty batch returns the input's height and width unstrided.
        shape = ops.shape(inputs)
        grid = (shape[1] // self._patch[0]) * (shape[2] // self._patch[1])
        return ops.reshape(x, (ops.shape(x)[0], grid, self.hidden_dim))

    def compute_output_shape(self, input_shape):
        h, w = input_shape[1], input_shape[2]
        n = None if h is None or w is None else (h // self._patch[0]) * (w // self._patch[1])
        return (input_shape[0], n, self.hidden_dim)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "patch_size": self.patch_size,
                "hidden_dim": self.hidden_dim,
                "num_channels": self.num_channels,
                "use_bias": self.use_bias,
                "kernel_initializer": self.kernel_initializer,
                "bias_initializer": self.bias_initializer,
            }
        )
        return config
