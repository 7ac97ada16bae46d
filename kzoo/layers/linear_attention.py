"""Linear attention `phi(Q) (phi(K)^T V)`, normalised, in O(n) time and memory.

Softmax attention weighs value `j` for query `i` by `exp(q_i . k_j * scale)`. Linear attention
replaces that kernel by a dot product of feature maps, `phi(q_i) . phi(k_j)`, so the sums over
keys can be taken once, before the queries: out_i = phi(q_i) S / phi(q_i) . z with
`S = sum_j phi(k_j) v_j^T` (features x head_dim) and `z = sum_j phi(k_j)`. No `(n, n)` matrix is
ever built. Feature maps (`feature_map=`):

- ``"elu"``: `elu(x) + 1` (Katharopoulos et al. 2020, "Transformers are RNNs"); a different
  kernel from softmax, deterministic, `head_dim` features. `scale` is not used.
- ``"fourier"``: random Fourier features `[cos(W x), sin(W x)]` (Rahimi & Recht 2007) with
  Gaussian rows `W`, times `exp(|x|^2 / 2) / sqrt(m)` so that the expected dot product is the
  softmax kernel `exp(q . k)` (Performer's "trigonometric" estimator; x = input *
  `scale ** 0.5`). 2 * num_features features. Unbiased but signed: the normaliser can come
  near zero, so outputs are noisy for few features.
- ``"favor"``: Performer's FAVOR+ positive random features `exp(W x - |x|^2 / 2) / sqrt(m)`
  (Choromanski et al. 2021) with orthogonal rows (blocks of `head_dim` orthonormal rows
  rescaled to Gaussian norms), also an unbiased estimate of `exp(q . k)`, always positive.

Random projections come from `random_projection(num_features, head_dim, kind, seed)` (NumPy,
so the same on every backend and deterministic for a seed) or are passed as `projection=`
(a model keeps them as a non-trainable weight).

`causal=True` takes prefix sums chunk by chunk: inside a chunk of `chunk_size` queries the
`(chunk, chunk)` form is used, across chunks the running `(S, z)` state; memory is
O(n * (chunk + features * head_dim / chunk)). `linear_attention_step` is the same recurrence
for decoding, one token at a time with a constant-size state.
"""

import math

import numpy as np
from keras import ops

from kzoo.layers.utils import check_bool, check_positive_int

FEATURE_MAPS = ("elu", "fourier", "favor")
DEFAULT_NUM_FEATURES = 128
DEFAULT_CHUNK_SIZE = 64


# === Random projections and feature maps ===


def random_projection(num_features, head_dim, kind="favor", seed=0):
    """The random matrix `W` `(num_features, head_dim)` of a random feature map, as NumPy.

    `kind="favor"`: orthogonal random features — blocks of `head_dim` orthonormal rows (QR of
    a Gaussian matrix), each row rescaled to the norm of an independent Gaussian vector, so
    every row is marginally N(0, I). `kind="fourier"`: i.i.d. N(0, 1) entries.

    Example:
    >>> random_projection(64, 16, "favor", seed=0).shape
    (64, 16)
    """
    num_features = check_positive_int("num_features", num_features)
    head_dim = check_positive_int("head_dim", head_dim)
    if kind not in ("favor", "fourier"):
        raise ValueError(f"`kind` must be 'favor' or 'fourier'; got kind={kind!r}.")
    rng = np.random.default_rng(seed)
    if kind == "fourier":
        return rng.standard_normal((num_features, head_dim)).astype("float32")
    blocks = []
    for _ in range(-(-num_features // head_dim)):
        q, _ = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))
        blocks.append(q.T)
    rows = np.concatenate(blocks, axis=0)[:num_features]
    norms = np.linalg.norm(rng.standard_normal((num_features, head_dim)), axis=1)
    return (rows * norms[:, None]).astype("float32")


def _check_feature_map(feature_map):
    if feature_map not in FEATURE_MAPS:
        raise ValueError(
            f"`feature_map` must be one of {list(FEATURE_MAPS)}; got feature_map={feature_map!r}."
        )


def _projection(feature_map, projection, num_features, seed, head_dim):
    if feature_map == "elu":
        if num_features is not None or projection is not None:
            raise ValueError(
                "`num_features` and `projection` apply to the random feature maps "
                f"('fourier', 'favor') only; got feature_map='elu' with "
                f"num_features={num_features!r} and a projection={projection is not None}."
            )
        return None
    if projection is None:
        num_features = check_positive_int(
            "num_features", DEFAULT_NUM_FEATURES if num_features is None else num_features)
        return ops.convert_to_tensor(random_projection(num_features, head_dim, feature_map, seed))
    projection = ops.cast(ops.convert_to_tensor(projection), "float32")
    if len(projection.shape) != 2 or projection.shape[1] != head_dim:
        raise ValueError(
            f"`projection` must have shape (num_features, head_dim={head_dim}); got shape "
            f"{tuple(projection.shape)}."
        )
    if num_features is not None and num_features != projection.shape[0]:
        raise ValueError(
            f"`num_features`={num_features!r} disagrees with `projection` of shape "
            f"{tuple(projection.shape)}."
        )
    return projection


def feature_map_features(x, feature_map, projection=None, scale=None, *, is_query=False):
    """`phi(x)` for `x (..., head_dim)`, in float32: `(..., features)`.

    For "favor" the query features are divided by their row maximum of `exp(W x)` and the key
    features by the maximum over the sequence axis (axis 1) — constants that cancel in the
    normalised output — so that `exp` cannot overflow. Pass `is_query=None` for no such
    stabilisation (decoding steps).

    Example:
    >>> feature_map_features(keras.ops.ones((2, 5, 4, 16)), "elu").shape
    (2, 5, 4, 16)
    """
    _check_feature_map(feature_map)
    x = ops.cast(x, "float32")
    if feature_map == "elu":
        return ops.elu(x) + 1.0
    dim = x.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    x = x * math.sqrt(scale)
    m = projection.shape[0]
    # matmul, not einsum: TensorFlow's einsum gradient builds (m, d, ...) outer products.
    wx = ops.matmul(x, ops.transpose(projection))
    half_sq = 0.5 * ops.sum(x * x, axis=-1, keepdims=True)
    if feature_map == "fourier":
        amp = ops.exp(half_sq) / math.sqrt(m)
        return ops.concatenate([ops.cos(wx) * amp, ops.sin(wx) * amp], axis=-1)
    logits = wx - half_sq
    if is_query is True:
        logits = logits - ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True))
    elif is_query is False:
        logits = logits - ops.stop_gradient(
            ops.max(logits, axis=(1, len(logits.shape) - 1), keepdims=True))
    return ops.exp(logits) / math.sqrt(m)


# === Attention ===


def _check_qkv(query, key, value, scale):
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    for name, t in (("query", query), ("key", key), ("value", value)):
        if len(t.shape) != 4:
            raise ValueError(
                f"`{name}` must have rank 4 (batch, seq, heads, head_dim); got {name} with "
                f"shape {tuple(t.shape)}."
            )
    if tuple(key.shape[:3]) != tuple(value.shape[:3]):
        raise ValueError(
            f"`key` and `value` must agree on (batch, seq, heads); got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}."
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"`query` and `key` must have the same head_dim; got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
    if query.shape[2] % key.shape[2] != 0:
        raise ValueError(
            f"the number of query heads ({query.shape[2]}) must be a multiple of the number "
            f"of key/value heads ({key.shape[2]})."
        )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"`scale` must be a Python number or None; got scale={scale!r}.")
    return query, key, value


def _safe_divide(num, den):
    return num / ops.where(den == 0, 1.0, den)


def linear_attention(query, key, value, *, feature_map="elu", causal=False, mask=None,
                     num_features=None, seed=0, projection=None, scale=None, chunk_size=None,
                     initial_state=None, return_state=False):
    """Normalised linear attention `phi(q_i) . sum_j phi(k_j) v_j / phi(q_i) . sum_j phi(k_j)`.

    Args:
        query: `(batch, q_len, heads, head_dim)`.
        key, value: `(batch, k_len, kv_heads, head_dim|value_dim)`, `heads % kv_heads == 0`.
        feature_map: "elu", "fourier" or "favor" (see the module docstring).
        causal: query `i` sums keys `j <= i` only (needs `q_len == k_len`), by chunked prefix
            sums; `initial_state` then holds the keys before this call.
        mask: key padding mask `(batch, k_len)` (True = real token); hidden keys add nothing.
        num_features: random features (default 128; "fourier" gives twice as many outputs).
        seed: seed of the random projection when `projection` is not given.
        projection: the `(num_features, head_dim)` random matrix to use (e.g. a model weight).
        scale: softmax temperature the random maps estimate (`exp(q . k * scale)`), default
            `head_dim ** -0.5`.
        chunk_size: causal chunk length (default 64).
        initial_state, return_state: the recurrent state `(S, z)`, `S (batch, kv_heads,
            features, value_dim)`, `z (batch, kv_heads, features)`, float32 (causal only).

    Returns:
        `(batch, q_len, heads, value_dim)` in the query's dtype, and the state after the last
        key when `return_state`. A query whose normaliser is 0 (no visible key) gives zeros.

    Example:
    >>> x = keras.random.normal((2, 100, 4, 16))
    >>> linear_attention(x, x, x, feature_map="favor", causal=True, num_features=32).shape
    (2, 100, 4, 16)
    """
    query, key, value = _check_qkv(query, key, value, scale)
    _check_feature_map(feature_map)
    causal = check_bool("causal", causal)
    proj = _projection(feature_map, projection, num_features, seed, query.shape[-1])
    n, heads, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, vdim = key.shape[2], value.shape[3]
    g = heads // kv_heads
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("`initial_state` and `return_state` need causal=True.")
    stabilise = initial_state is None and not return_state
    fq = feature_map_features(query, feature_map, proj, scale,
                              is_query=True if stabilise else None)
    fk = feature_map_features(key, feature_map, proj, scale,
                              is_query=False if stabilise else None)
    if mask is not None:
        mask = ops.convert_to_tensor(mask)
        if len(mask.shape) != 2 or mask.shape[1] != key.shape[1]:
            raise ValueError(
                f"`mask` must be a key padding mask of shape (batch, {key.shape[1]}); got "
                f"mask with shape {tuple(mask.shape)}."
            )
        fk = fk * ops.cast(mask, "float32")[:, :, None, None]
    m = fk.shape[-1]
    fq = ops.reshape(fq, (-1, n, kv_heads, g, m))
    v32 = ops.cast(value, "float32")
    if not causal:
        s = ops.einsum("bnkm,bnkd->bkmd", fk, v32)
        z = ops.sum(fk, axis=1)
        num = ops.einsum("bnkgm,bkmd->bnkgd", fq, s)
        den = ops.einsum("bnkgm,bkm->bnkg", fq, z)[..., None]
        out = _safe_divide(num, den)
        return ops.cast(ops.reshape(out, (-1, n, heads, vdim)), query.dtype)
    if key.shape[1] != n:
        raise ValueError(
            f"causal linear attention needs q_len == k_len; got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
    chunk = check_positive_int(
        "chunk_size", DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size)
    chunk = min(chunk, n)
    nc = -(-n // chunk)
    pad = nc * chunk - n
    if pad:
        fq = ops.pad(fq, [[0, 0], [0, pad], [0, 0], [0, 0], [0, 0]])
        fk = ops.pad(fk, [[0, 0], [0, pad], [0, 0], [0, 0]])
        v32 = ops.pad(v32, [[0, 0], [0, pad], [0, 0], [0, 0]])
    fq = ops.reshape(fq, (-1, nc, chunk, kv_heads, g, m))
    fk = ops.reshape(fk, (-1, nc, chunk, kv_heads, m))
    vc = ops.reshape(v32, (-1, nc, chunk, kv_heads, vdim))
    # Inside each chunk: the (chunk, chunk) lower-triangular form.
    tri = ops.convert_to_tensor(np.tril(np.ones((chunk, chunk), "float32")))
    a = ops.einsum("bcikgm,bcjkm->bckgij", fq, fk) * tri
    num = ops.einsum("bckgij,bcjkd->bcikgd", a, vc)
    den = ops.einsum("bckgij->bcikg", a)
    # Across chunks: exclusive prefix sums of the per-chunk states.
    s_c = ops.einsum("bcjkm,bcjkd->bckmd", fk, vc)
    z_c = ops.sum(fk, axis=2)  # (b, nc, hk, m)
    s_prev = ops.cumsum(s_c, axis=1) - s_c
    z_prev = ops.cumsum(z_c, axis=1) - z_c
    if initial_state is not None:
        s0, z0 = (ops.cast(ops.convert_to_tensor(t), "float32") for t in initial_state)
        if tuple(s0.shape[1:]) != (kv_heads, m, vdim) or tuple(z0.shape[1:]) != (kv_heads, m):
            raise ValueError(
                f"`initial_state` must be (S (batch, {kv_heads}, {m}, {vdim}), z (batch, "
                f"{kv_heads}, {m})); got shapes {tuple(s0.shape)} and {tuple(z0.shape)}."
            )
        s_prev = s_prev + s0[:, None]
        z_prev = z_prev + z0[:, None]
    num = num + ops.einsum("bcikgm,bckmd->bcikgd", fq, s_prev)
    den = den + ops.einsum("bcikgm,bckm->bcikg", fq, z_prev)
    out = _safe_divide(num, den[..., None])
    out = ops.reshape(out, (-1, nc * chunk, heads, vdim))[:, :n]
    out = ops.cast(out, query.dtype)
    if not return_state:
        return out
    s_last = s_prev[:, -1] + s_c[:, -1]
    z_last = z_prev[:, -1] + z_c[:, -1]
    return out, (s_last, z_last)


def linear_attention_state(batch_size, kv_heads, num_features, value_dim):
    """An empty recurrent state `(S, z)` for `linear_attention_step` (float32 zeros).

    `num_features` is the feature count of the map: `head_dim` for "elu", `2 * m` for
    "fourier", `m` for "favor".

    Example:
    >>> s, z = linear_attention_state(2, 4, 32, 16)
    >>> s.shape, z.shape
    ((2, 4, 32, 16), (2, 4, 32))
    """
    for name, value in (("batch_size", batch_size), ("kv_heads", kv_heads),
                        ("num_features", num_features), ("value_dim", value_dim)):
        check_positive_int(name, value)
    return (ops.zeros((batch_size, kv_heads, num_features, value_dim), "float32"),
            ops.zeros((batch_size, kv_heads, num_features), "float32"))


def linear_attention_step(query, key, value, state, *, feature_map="elu", projection=None,
                          num_features=None, seed=0, scale=None):
    """One decoding step of causal linear attention: O(1) time and memory in the length.

    Adds the new keys/values to the state `(S, z)` and attends the new queries (one token,
    or a few, causally) with it; the same numbers as `linear_attention(causal=True)` over the
    whole sequence.

    Args:
        query: `(batch, t, heads, head_dim)` (usually t = 1).
        key, value: `(batch, t, kv_heads, head_dim|value_dim)`.
        state: `(S, z)` from `linear_attention_state` or the previous step.
        feature_map, projection, num_features, seed, scale: as `linear_attention` (use the
            same projection every step).

    Returns:
        `(output (batch, t, heads, value_dim), new_state)`.

    Example:
    >>> x = keras.random.normal((2, 1, 4, 16))
    >>> state = linear_attention_state(2, 4, 16, 16)
    >>> out, state = linear_attention_step(x, x, x, state)
    >>> out.shape
    (2, 1, 4, 16)
    """
    return linear_attention(query, key, value, feature_map=feature_map, causal=True,
                            num_features=num_features, seed=seed, projection=projection,
                            scale=scale, initial_state=state, return_state=True)
