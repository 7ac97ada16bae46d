"""The attention *type* of a layer: full softmax attention or one of the efficient variants.

`MultiHeadAttention(attention=..., attention_options={...})`, `TransformerBlock` and the
BERT, GPT and ViT configs (`attention`, `attention_options` fields; `kzoo.presets.load(name,
attention="sliding_window", window=256)`) all take the same two values, checked here once:

| `attention`      | options (required in bold)                                   | cost            |
|------------------|--------------------------------------------------------------|-----------------|
| "full"           | —                                                            | O(n^2)          |
| "sliding_window" | **window**, block_size                                       | O(n * window)   |
| "strided"        | **stride**                                                   | O(n * (stride + n / stride)) |
| "longformer"     | **window**, global_tokens (default 1: the first token), block_size, global_projections=False, max_global | O(n * (window + G)) |
| "block_sparse"   | **block_size**, **layout** (`(heads or 1, n_blocks, n_blocks)` booleans) | O(n * active blocks * block_size) |
| "bigbird"        | **block_size**, window_blocks=3, global_blocks=1, random_blocks=2, seed=0 | O(n * blocks * block_size) |
| "linear"         | feature_map="elu" ("elu", "fourier", "favor"), num_features, seed=0 | O(n * features) |
| "performer"      | num_features=128, seed=0 (linear attention with FAVOR+ features) | O(n * features) |

A query row that sees no key (a padding query whose window holds only padding) gives zeros;
with `uniform_empty_rows=True` (what `TransformerBlock` passes for non-causal layers) it
reads the mean of every value, as full attention with the pattern merged into its mask does.

"bigbird" on a sequence too short for `random_blocks` (a query block has fewer blocks left
outside its window and the global blocks) attends to every block and warns, as transformers'
BigBird falls back to full attention (see `sparse_attention.bigbird_layout`).

The kernels are those of `kzoo.layers.sparse_attention` and `kzoo.layers.linear_attention`
(their docstrings give the exact patterns; `window` follows `kzoo.layers.sliding_window_mask`:
query `i` sees key `j` when `|i - j| < window`, causal `0 <= i - j < window`). Every variant is
self-attention with at most a key padding mask; additive biases (ALiBi, T5's relative bias,
Graphormer's) and general `(q, k)` masks need "full". The efficient variants never build the
probability matrix, so attention-probability dropout does not apply to them (residual and
feed-forward dropout still do).

"longformer" with `global_projections=True` is Hugging Face's Longformer (Beltagy et al. 2020):
the rows of the global tokens use their own query / key / value projections
(`MultiHeadAttention`'s `query_global_dense`, `key_global_dense`, `value_global_dense`) and
attend to every key with them, recomputed densely in O(G * n) (`longformer_global_rows`);
every other row attends its window and the global keys with the normal projections.

A `global_attention_mask` given at call time replaces `global_tokens`. Eagerly its count of
global tokens sets G. Inside a compiled function (`fit`, `jax.jit`, `tf.function`) the count is
not known, so G is `max_global` when set (the first `max_global` global tokens of each row are
kept) and otherwise every position, which makes the global part O(n^2): set `max_global` for
compiled training with a global mask. Eagerly, a row with more than `max_global` global tokens
raises a `ValueError`. A causal call leaves out the `global_tokens` positions at or past the end
of its sequence (no query sees them yet), so it is the prefix of a longer causal sequence;
a non-causal call refuses them.

Decoding (see `MultiHeadAttention`): "sliding_window" keeps a rolling cache of `window` key /
value slots (`rolling_cache_length`), so a cache's memory does not grow with the length;
"linear" and "performer" keep the O(1) recurrent state `(S, z)` of
`kzoo.layers.linear_attention_state`. The other sparse variants decode on a full key/value
cache with their pattern as a dense mask of the cached keys (`dense_pattern`); "longformer"
decodes with the global tokens of its `global_tokens` option (a call-time
`global_attention_mask` is refused with a cache, which keeps no record of it).

Example:
>>> check_attention("sliding_window", {"window": 128})
('sliding_window', {'window': 128})
>>> check_attention("sliding_window", {"window": 0})
ValueError: `window` must be a positive integer; got window=0.
"""

import keras
import numpy as np
from keras import ops

from kzoo.layers import linear_attention as linear_mod
from kzoo.layers import sparse_attention as sparse_mod
from kzoo.layers.kernels import reference_attention
from kzoo.layers.kernels import uniform_empty_rows as _uniform_empty_rows
from kzoo.layers.utils import (
    check_bool,
    check_choice,
    check_non_negative_int,
    check_positive_int,
)

ATTENTION_TYPES = (
    "full", "sliding_window", "strided", "longformer", "block_sparse", "bigbird", "linear",
    "performer",
)
# Option -> default (a `_REQUIRED` default must be given) for each type.
_REQUIRED = object()
ATTENTION_OPTIONS = {
    "full": {},
    "sliding_window": {"window": _REQUIRED, "block_size": None},
    "strided": {"stride": _REQUIRED},
    "longformer": {"window": _REQUIRED, "global_tokens": 1, "block_size": None,
                   "global_projections": False, "max_global": None},
    "block_sparse": {"block_size": _REQUIRED, "layout": _REQUIRED},
    "bigbird": {"block_size": _REQUIRED, "window_blocks": 3, "global_blocks": 1,
                "random_blocks": 2, "seed": 0},
    "linear": {"feature_map": "elu", "num_features": None, "seed": 0},
    "performer": {"num_features": linear_mod.DEFAULT_NUM_FEATURES, "seed": 0},
}
# Every option name any type takes (what `kzoo.presets.load` folds into `attention_options`).
OPTION_NAMES = tuple(sorted({name for opts in ATTENTION_OPTIONS.values() for name in opts}))
LINEAR_TYPES = ("linear", "performer")


def _check_global_tokens(value):
    """A count of leading global tokens (int >= 0) or a list of positions -> int or tuple."""
    if isinstance(value, (list, tuple, np.ndarray)):
        positions = tuple(check_non_negative_int("global_tokens", int(p))
                          if isinstance(p, (int, np.integer)) and not isinstance(p, bool)
                          else _bad_global(value) for p in value)
        return positions
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _bad_global(value)
    return check_non_negative_int("global_tokens", int(value))


def _bad_global(value):
    raise ValueError(
        "`global_tokens` must be a count of leading global tokens (an int >= 0) or a list of "
        f"token positions; got global_tokens={value!r}."
    )


def _check_layout(value):
    try:
        layout = np.asarray(value)
    except Exception as error:  # ragged lists
        raise ValueError(
            "`layout` must be a boolean array (heads or 1, n_blocks, n_blocks); got "
            f"layout={value!r}."
        ) from error
    if layout.ndim == 2:
        layout = layout[None]
    if (layout.ndim != 3 or layout.shape[1] != layout.shape[2] or layout.shape[1] == 0
            or layout.dtype.kind not in "bi"):
        raise ValueError(
            "`layout` must be a boolean array (heads or 1, n_blocks, n_blocks); got an array "
            f"of shape {layout.shape} and dtype {layout.dtype}."
        )
    layout = layout.astype(bool)
    sparse_mod.check_layout_rows(layout)
    return layout.tolist()


_OPTION_CHECKS = {
    "window": lambda v: check_positive_int("window", v),
    "stride": lambda v: check_positive_int("stride", v),
    "block_size": lambda v: None if v is None else check_positive_int("block_size", v),
    "global_tokens": _check_global_tokens,
    "layout": _check_layout,
    "window_blocks": lambda v: check_positive_int("window_blocks", v),
    "global_blocks": lambda v: check_non_negative_int("global_blocks", v),
    "random_blocks": lambda v: check_non_negative_int("random_blocks", v),
    "seed": lambda v: check_non_negative_int("seed", v),
    "feature_map": lambda v: check_choice("feature_map", v, linear_mod.FEATURE_MAPS),
    "num_features": lambda v: None if v is None else check_positive_int("num_features", v),
    "global_projections": lambda v: check_bool("global_projections", v),
    "max_global": lambda v: None if v is None else check_positive_int("max_global", v),
}


class AttentionOptions(dict):
    """The checked options of an attention type: a plain dict (JSON, `get_config`) that is
    read-only and hashable, so the frozen family configs holding one stay values."""

    def __hash__(self):
        return hash(repr(sorted(self.items())))

    def _read_only(self, *args, **kwargs):
        raise TypeError("attention options are read-only; build new ones with "
                        "check_attention(attention, {**options, ...}).")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only

    def __reduce__(self):
        return (AttentionOptions, (dict(self),))


def check_attention(attention, options=None, *, num_heads=None):
    """Validate an attention type and its options -> `(attention, options with defaults)`.

    Raises `ValueError` naming the type or option, its value and what is allowed: an unknown
    type, an option the type does not take, a missing required option, or a bad value
    (`window <= 0`, `num_features <= 0`, a block `layout` with a query block that attends to
    no block, or, given the layer's `num_heads`, a layout with neither 1 nor `num_heads`
    heads ...).

    Example:
    >>> check_attention("performer")
    ('performer', {'num_features': 128, 'seed': 0})
    """
    check_choice("attention", attention, ATTENTION_TYPES)
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ValueError(
            f"`attention_options` must be a dict of option values or None; got "
            f"attention_options={options!r}."
        )
    allowed = ATTENTION_OPTIONS[attention]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        owners = {name: [t for t, opts in ATTENTION_OPTIONS.items() if name in opts]
                  for name in unknown}
        hint = "".join(f" {name!r} is an option of attention={types}." for name, types in
                       owners.items() if types)
        if "seed" in unknown:
            hint += (" (The initial weights follow keras.utils.set_random_seed(...), called "
                     "before the model is built.)")
        raise ValueError(
            f"attention={attention!r} takes the options {sorted(allowed) or 'none'}; got "
            f"unknown option(s) {unknown} in attention_options={options!r}.{hint}"
        )
    checked = {}
    for name, default in allowed.items():
        if name not in options or options[name] is None and default is _REQUIRED:
            if default is _REQUIRED:
                raise ValueError(
                    f"attention={attention!r} needs the option `{name}` (e.g. "
                    f"kzoo.presets.load(..., attention={attention!r}, {name}=...)); got "
                    f"attention_options={options!r}."
                )
            value = default
        else:
            value = options[name]
        checked[name] = _OPTION_CHECKS[name](value) if value is not None else None
    if attention == "linear" and checked["feature_map"] == "elu" and checked["num_features"]:
        raise ValueError(
            "`num_features` applies to the random feature maps ('fourier', 'favor') only; got "
            f"feature_map='elu' with num_features={checked['num_features']}."
        )
    if attention == "block_sparse" and num_heads is not None:
        layout_heads = len(checked["layout"])
        if layout_heads not in (1, num_heads):
            raise ValueError(
                f"`layout` must have 1 head (shared) or num_heads={num_heads} heads in its "
                f"first axis; got a layout of shape {np.shape(checked['layout'])} "
                f"({layout_heads} heads)."
            )
    if attention == "sliding_window" or attention == "longformer":
        block = checked["block_size"]
        if block is not None and block < checked["window"]:
            raise ValueError(
                f"`block_size` must be >= window={checked['window']}; got "
                f"block_size={block}."
            )
    return attention, AttentionOptions(checked)


def feature_count(attention, options, head_dim):
    """The number of features `F` of a linear type's recurrent state `(S, z)`."""
    if attention == "performer":
        return options["num_features"]
    fmap = options["feature_map"]
    if fmap == "elu":
        return head_dim
    m = options["num_features"] or linear_mod.DEFAULT_NUM_FEATURES
    return 2 * m if fmap == "fourier" else m


def projection(attention, options, head_dim):
    """The fixed random matrix `(num_features, head_dim)` of a random feature map (NumPy), or
    None for "elu". Drawn once from `seed`, so a layer uses the same features every call."""
    fmap = "favor" if attention == "performer" else options["feature_map"]
    if fmap == "elu":
        return None
    m = options["num_features"] or linear_mod.DEFAULT_NUM_FEATURES
    return linear_mod.random_projection(m, head_dim, fmap, options["seed"])


def _global_arg(options, n, global_mask, causal=False):
    """The global tokens of a call on `n` tokens. Causal, the option's positions at or past
    `n` are dropped: no query of the sequence sees them yet (its prefix of a longer causal
    sequence, as decoding on a cache gives it); otherwise they are refused."""
    if global_mask is not None:
        return global_mask
    g = options["global_tokens"]
    if isinstance(g, tuple):
        positions = np.asarray(g, dtype="int32")
        return positions[positions < n] if causal else positions
    if causal:
        g = min(g, n)
    if g > n:
        raise ValueError(
            f"`global_tokens`={g} asks for more global tokens than the sequence has "
            f"({n} tokens; a causal layer takes the first {n} of them)."
        )
    # An int array, also when empty (`global_tokens=0`: no global token).
    return np.arange(g, dtype="int32")


def _layout_for(options, n):
    """The layout cut to the blocks a sequence of `n` tokens has (a model's layout covers
    its longest input; shorter inputs use its leading blocks)."""
    layout = np.asarray(options["layout"], bool)
    blocks = -(-n // options["block_size"])
    if blocks > layout.shape[1]:
        raise ValueError(
            f"`layout` covers {layout.shape[1]} blocks of block_size={options['block_size']} "
            f"({layout.shape[1] * options['block_size']} tokens); got a sequence of {n} "
            f"tokens ({blocks} blocks)."
        )
    return layout[:, :blocks, :blocks]


def efficient_attention(query, key, value, attention, options, *, causal=False, mask=None,
                        scale=None, global_mask=None, projection_matrix=None,
                        uniform_empty_rows=False):
    """Self-attention of type `attention` (not "full") on `(batch, seq, heads, head_dim)`.

    Args:
        query, key, value: as `kzoo.layers.dot_product_attention` (GQA allowed).
        attention, options: a checked pair from `check_attention`.
        causal: causal self-attention.
        mask: key padding mask `(batch, seq)` or `(batch, 1, 1, seq)`, True = real token.
        scale: score scale (None: `head_dim ** -0.5`).
        global_mask: "longformer" only: `(batch, seq)` booleans marking global tokens,
            replacing the `global_tokens` option (Hugging Face's `global_attention_mask`).
        projection_matrix: linear types: the fixed random matrix (see `projection`).
        uniform_empty_rows: a query row that sees no key (its pattern holds only keys the
            padding `mask` hides, e.g. a padding query whose window is all padding) reads the
            mean of every value, as full attention with the pattern merged into its mask
            gives under `kzoo.layers.kernels.uniform_empty_rows`; False: such a row gives
            zeros. Non-causal only (a ValueError with `causal=True`). See `visible_rows`.

    Example:
    >>> x = keras.random.normal((1, 64, 2, 8))
    >>> efficient_attention(x, x, x, *check_attention("sliding_window", {"window": 8}),
    ...                     causal=True).shape
    (1, 64, 2, 8)
    """
    if uniform_empty_rows and causal:
        raise ValueError(
            "`uniform_empty_rows=True` is for non-causal attention; got it with causal=True, "
            "where a row without a visible key would read the mean of later values too.")
    out = _dispatch(query, key, value, attention, options, causal, mask, scale, global_mask,
                    projection_matrix)
    if uniform_empty_rows and mask is not None:
        seen = visible_rows(attention, options, query.shape[1], mask, global_mask=global_mask)
        out = uniform_empty_rows_fill(out, seen, value)
    return out


def _dispatch(query, key, value, attention, options, causal, mask, scale, global_mask,
              projection_matrix):
    n = query.shape[1]
    if attention == "sliding_window":
        return sparse_mod.sliding_window_attention(
            query, key, value, options["window"], causal=causal, mask=mask, scale=scale,
            block_size=options["block_size"])
    if attention == "strided":
        return sparse_mod.strided_attention(query, key, value, options["stride"],
                                            causal=causal, mask=mask, scale=scale)
    if attention == "longformer":
        return sparse_mod.longformer_attention(
            query, key, value, options["window"], _global_arg(options, n, global_mask, causal),
            causal=causal, mask=mask, scale=scale, block_size=options["block_size"],
            max_global=_max_global(options, n, global_mask))
    if attention == "block_sparse":
        return sparse_mod.block_sparse_attention(
            query, key, value, _layout_for(options, n), options["block_size"], causal=causal,
            mask=mask, scale=scale)
    if attention == "bigbird":
        return sparse_mod.bigbird_attention(
            query, key, value, options["block_size"], window_blocks=options["window_blocks"],
            global_blocks=options["global_blocks"], random_blocks=options["random_blocks"],
            seed=options["seed"], causal=causal, mask=mask, scale=scale)
    if attention in LINEAR_TYPES:
        fmap = "favor" if attention == "performer" else options["feature_map"]
        return linear_mod.linear_attention(
            query, key, value, feature_map=fmap, causal=causal, mask=_key_mask(mask),
            projection=projection_matrix, scale=scale)
    raise ValueError(f"efficient_attention got attention={attention!r}; use the full kernels.")


def visible_rows(attention, options, n, mask, *, global_mask=None):
    """Whether each query row of a non-causal `attention` call sees at least one key: a
    boolean `(batch|1, heads|1, n)`, True where the type's pattern holds a key the padding
    `mask` (`(batch, n)` or `(batch, 1, 1, n)`, True = real token) leaves.

    Computed from the mask alone in O(n) (prefix counts of real keys for the bands, one flag
    per residue for "strided", per block for the block layouts), never an `n x n` pattern.
    The linear types see every real key: a row sees none only when the whole row of `mask`
    is padding.

    Example:
    >>> visible_rows("sliding_window", {"window": 2, "block_size": None}, 5,
    ...              np.array([[True, True, False, False, False]]))[0, 0]
    [True, True, True, False, False]
    """
    valid = ops.cast(_key_mask(mask), "bool")  # (b, n)
    if attention in LINEAR_TYPES:
        return ops.any(valid, axis=1)[:, None, None]
    positions = np.arange(n)
    if attention in ("sliding_window", "strided", "longformer"):
        real_before = ops.concatenate(  # real keys before each position: (b, n + 1)
            [ops.zeros((ops.shape(valid)[0], 1), "int32"),
             ops.cumsum(ops.cast(valid, "int32"), axis=1)], axis=1)

        def band(width):  # a real key j with |i - j| < width
            hi = np.minimum(positions + width, n)
            lo = np.maximum(positions - width + 1, 0)
            return ops.take(real_before, hi, axis=1) > ops.take(real_before, lo, axis=1)

    if attention == "sliding_window":
        seen = band(options["window"])
    elif attention == "strided":
        stride = options["stride"]
        blocks = -(-n // stride)
        padded = ops.pad(valid, [[0, 0], [0, blocks * stride - n]], constant_values=False)
        residue = ops.any(ops.reshape(padded, (-1, blocks, stride)), axis=1)  # (b, stride)
        seen = ops.logical_or(band(stride), ops.take(residue, positions % stride, axis=1))
    elif attention == "longformer":
        flags, onehot, slot_valid, _ = longformer_slots(options, n, 1, global_mask)
        seen = band(options["window"])
        if onehot.shape[1]:
            # A real global key (every row sees it); a global row sees every real key.
            real_global = ops.any(ops.logical_and(
                ops.logical_and(ops.cast(onehot, "bool"), slot_valid[:, :, None]),
                valid[:, None, :]), axis=(1, 2))  # (b,)
            global_row = ops.logical_and(ops.cast(flags, "bool"),
                                         ops.any(valid, axis=1, keepdims=True))
            seen = ops.logical_or(ops.logical_or(seen, real_global[:, None]), global_row)
    elif attention in ("block_sparse", "bigbird"):
        block = options["block_size"]
        layout = _block_layout(attention, options, n)  # (heads|1, nb, nb)
        blocks = layout.shape[1]
        padded = ops.pad(valid, [[0, 0], [0, blocks * block - n]], constant_values=False)
        real_block = ops.cast(ops.any(ops.reshape(padded, (-1, blocks, block)), axis=2),
                              "float32")  # (b, nb)
        hits = ops.einsum("hac,bc->bha", ops.convert_to_tensor(layout.astype("float32")),
                          real_block)
        return ops.take(hits > 0.5, positions // block, axis=2)  # (b, heads|1, n)
    else:
        raise ValueError(f"visible_rows got attention={attention!r}; use the full kernels.")
    return seen[:, None, :]


def uniform_empty_rows_fill(out, seen, value):
    """`out` `(batch, n, heads, head_dim)` whose rows `seen` (`visible_rows`) marks False
    read the mean of every value (`kzoo.layers.kernels.uniform_empty_rows`)."""
    return _uniform_empty_rows(out, ops.expand_dims(seen, -1), ops.convert_to_tensor(value))


def _block_layout(attention, options, n):
    """The block layout a "block_sparse" / "bigbird" call on `n` tokens uses (NumPy)."""
    if attention == "block_sparse":
        return _layout_for(options, n)
    return sparse_mod.bigbird_layout(
        -(-n // options["block_size"]), window_blocks=options["window_blocks"],
        global_blocks=options["global_blocks"], random_blocks=options["random_blocks"],
        num_heads=1, seed=options["seed"])


def longformer_slots(options, n, batch, global_mask=None, causal=False):
    """The global tokens of a "longformer" call: `(flags (b|1, n) bool, one_hot (b|1, G, n)
    float32, slot_valid (b|1, G) bool, positions (b|1, G) int32)`, G the most global tokens
    a row has (padded slots are not valid). `global_mask` `(batch, seq)` replaces the
    `global_tokens` option, as in `efficient_attention`; `causal`: the option's positions
    past the sequence are left out, as there.

    Example:
    >>> flags, one_hot, valid, positions = longformer_slots(
    ...     check_attention("longformer", {"window": 4})[1], 16, 2)
    >>> positions
    [[0]]
    """
    return sparse_mod._global_slots(
        _global_arg(options, n, global_mask, causal), n, batch,
        _max_global(options, n, global_mask))


def longformer_global_rows(query_global, key_global, value_global, slots, out, *, mask=None,
                           causal=False, scale=None):
    """`out` `(batch, seq, heads, head_dim)` with the rows of the global tokens replaced by
    their attention over every key under the global projections (Hugging Face Longformer).

    Dense `(G, n)`: each global query attends to every key the padding `mask` leaves
    (`causal`: and none after it), never an `n x n` product.

    Args:
        query_global: `(batch, G, heads, head_dim)`, the global queries of the G slots of
            `slots` (see `longformer_slots`; rows of invalid slots are ignored).
        key_global, value_global: `(batch, seq, kv_heads, head_dim)`, every token's key and
            value under the global projections.
        slots: `longformer_slots(...)` of the call.
        out: the attention output of the call (every row), whose global rows are replaced.
        mask: key padding mask `(batch, seq)` or `(batch, 1, 1, seq)`, True = real token.
        causal, scale: as `efficient_attention`.

    Example:
    >>> slots = longformer_slots(options, n, batch, global_mask)   # G slots
    >>> out = longformer_global_rows(q_global, k_global, v_global, slots, out, mask=padding)
    """
    flags, onehot, slot_valid, positions = slots
    n = key_global.shape[1]
    allowed = _key_mask(mask)
    allowed = None if allowed is None else ops.cast(allowed, "bool")[:, None, None, :]
    if causal:
        before = (ops.arange(n, dtype="int32")[None, None, :]
                  <= ops.cast(positions, "int32")[:, :, None])[:, None]
        allowed = before if allowed is None else ops.logical_and(allowed, before)
    query_global = ops.convert_to_tensor(query_global)
    if scale is None:
        scale = query_global.shape[-1] ** -0.5
    if scale < 1.0 and keras.backend.standardize_dtype(query_global.dtype) == "float16":
        # (float16 products overflow before the scale comes: scale the queries first, as
        # `sparse_attention` does)
        query_global, scale = query_global * ops.cast(scale, query_global.dtype), 1.0
    rows = reference_attention(query_global, key_global, value_global, mask=allowed,
                               scale=scale)  # (b, G, h, d)
    scatter = ops.cast(onehot, rows.dtype) * ops.cast(slot_valid, rows.dtype)[:, :, None]
    if scatter.shape[0] == 1:
        rows = ops.einsum("gn,bghd->bnhd", scatter[0], rows)
    else:
        rows = ops.einsum("bgn,bghd->bnhd", scatter, rows)
    return ops.where(flags[:, :, None, None], ops.cast(rows, out.dtype), out)


def _max_global(options, n, global_mask):
    """The static bound on global tokens per row of a call-time mask (None without one): its
    count when concrete (checked against the `max_global` option), else that option, else
    every position (the kernel then pads)."""
    if global_mask is None:
        return None
    bound = options["max_global"]
    try:
        count = int(np.max(np.sum(
            np.asarray(ops.convert_to_numpy(global_mask)).astype(bool), axis=1)))
    except Exception:  # traced
        return n if bound is None else min(bound, n)
    if bound is not None and count > bound:
        raise ValueError(
            f"`global_attention_mask` marks {count} global tokens in a row, more than the "
            f"longformer option max_global={bound}; raise `max_global` or mark fewer tokens."
        )
    return count


def _key_mask(mask):
    if mask is None:
        return None
    if len(mask.shape) == 4:
        if mask.shape[1] != 1 or mask.shape[2] != 1:
            raise ValueError(
                "linear attention takes a key padding mask (batch, seq) or (batch, 1, 1, seq); "
                f"got a mask of shape {tuple(mask.shape)}."
            )
        mask = ops.reshape(mask, (-1, mask.shape[3]))
    return mask


def dense_pattern(attention, options, n, *, causal=False, global_mask=None, heads=1,
                  offset=0, k_len=None, shift=None):
    """The boolean `(batch|1, heads|1, q, k)` mask equal to a sparse type's pattern, for the
    exact formula (taps, decoding on a full cache): query `i` sits at position `offset + i`,
    key `j` at position `j`. Not for the linear types (they are not a mask).

    `shift` (int `(batch,)`, or None): row `b`'s slots hold the positions `slot - shift[b]`
    (a left-padded prompt in decoding: `shift` is its number of pad slots), so the global
    tokens and blocks of a row's pattern sit where they would without its padding. Slots
    before the row's first position (its padding) count as position 0 (they are masked
    out as keys anyway). Sliding-window and strided patterns depend on `i - j` only.

    Example:
    >>> dense_pattern("sliding_window", {"window": 2, "block_size": None}, 3, causal=True)[0, 0]
    [[True, False, False], [True, True, False], [False, True, True]]
    """
    k_len = n if k_len is None else k_len
    qpos = ops.arange(n, dtype="int32")[:, None] + ops.cast(offset, "int32")
    kpos = ops.arange(k_len, dtype="int32")[None, :]
    diff = qpos - kpos
    if attention == "sliding_window":
        allowed = ops.abs(diff) < options["window"]
    elif attention == "strided":
        stride = options["stride"]
        allowed = ops.logical_or(ops.abs(diff) < stride, ops.equal(diff % stride, 0))
    elif attention == "longformer":
        band = ops.abs(diff) < options["window"]
        if global_mask is None and shift is not None:
            g = options["global_tokens"]
            positions = np.asarray(list(g) if isinstance(g, tuple) else range(g), "int32")
            allowed = band[None]
            if positions.size:
                q_at, k_at = _shifted(qpos[:, 0], shift), _shifted(kpos[0], shift)  # (b, n|k)
                marks = ops.convert_to_tensor(positions)[None, None, :]
                k_flags = ops.any(ops.equal(k_at[:, :, None], marks), axis=-1)  # (b, k)
                q_flags = ops.any(ops.equal(q_at[:, :, None], marks), axis=-1)  # (b, n)
                allowed = ops.logical_or(allowed, k_flags[:, None, :])
                allowed = ops.logical_or(allowed, q_flags[:, :, None])
            allowed = allowed[:, None]
            if causal:
                allowed = ops.logical_and(allowed, (diff >= 0)[None, None])
            return allowed
        if global_mask is not None:
            flags = ops.cast(ops.convert_to_tensor(global_mask), "bool")  # (b, k_len)
        else:
            g = options["global_tokens"]
            positions = list(g) if isinstance(g, tuple) else list(range(g))
            flags_np = np.zeros((1, k_len), bool)
            flags_np[0, [p for p in positions if p < k_len]] = True
            flags = ops.convert_to_tensor(flags_np)
        q_flags = ops.take(flags, ops.clip(qpos[:, 0], 0, k_len - 1), axis=1)  # (b, n)
        allowed = ops.logical_or(band[None], flags[:, None, :])
        allowed = ops.logical_or(allowed, q_flags[:, :, None])
        allowed = allowed[:, None]
        if causal:
            allowed = ops.logical_and(allowed, (diff >= 0)[None, None])
        return allowed
    elif attention in ("block_sparse", "bigbird"):
        block = options["block_size"]
        blocks = -(-max(k_len, n) // block)
        if attention == "bigbird":
            layout = sparse_mod.bigbird_layout(
                blocks, window_blocks=options["window_blocks"],
                global_blocks=options["global_blocks"], random_blocks=options["random_blocks"],
                num_heads=1, seed=options["seed"], causal=causal)
        else:
            if shift is not None:
                # (the slots of a left-padded row run past its last position; positions past
                # the layout are refused by `generate`, which knows the prompts' lengths)
                blocks = min(blocks, len(options["layout"][0]))
            layout = _layout_for(options, blocks * block if shift is not None
                                 else max(k_len, n))
        layout = ops.convert_to_tensor(np.asarray(layout, bool))
        if shift is None:
            qb = ops.clip(qpos[:, 0] // block, 0, blocks - 1)
            kb = kpos[0] // block
            allowed = ops.take(ops.take(layout, qb, axis=1), kb, axis=2)  # (h, n, k)
            allowed = allowed[None]
        else:
            qb = ops.clip(_shifted(qpos[:, 0], shift) // block, 0, blocks - 1)  # (b, n)
            kb = ops.clip(_shifted(kpos[0], shift) // block, 0, blocks - 1)  # (b, k)
            flat = ops.reshape(layout, (layout.shape[0], blocks * blocks))
            allowed = ops.take(flat, qb[:, :, None] * blocks + kb[:, None, :], axis=1)
            allowed = ops.transpose(allowed, (1, 0, 2, 3))  # (b, h, n, k)
        if causal:
            allowed = ops.logical_and(allowed, (diff >= 0)[None, None])
        return allowed
    else:
        raise ValueError(f"dense_pattern has no mask for attention={attention!r}.")
    if causal:
        allowed = ops.logical_and(allowed, diff >= 0)
    return allowed[None, None]


def _shifted(slots, shift):
    """Positions `(batch, len)` of the slots `(len,)` of rows shifted by `shift` `(batch,)`
    (see `dense_pattern`); before a row's first position: 0."""
    shift = ops.reshape(ops.cast(shift, "int32"), (-1, 1))
    return ops.maximum(ops.cast(slots, "int32")[None, :] - shift, 0)


def rolling_cache_length(options, max_length):
    """The slots of a sliding-window decoding cache: `min(window, max_length)`."""
    return min(options["window"], max_length)
