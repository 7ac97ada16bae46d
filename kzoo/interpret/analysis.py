"""Numbers computed from attention maps: entropy, rollout and flow.

Every function here takes attention maps as `kzoo.interpret.attention_maps` returns them: a
dict `{"self": [layer_0, layer_1, ...]}` (T5: `"encoder"`, `"decoder"`, `"cross"`), each
layer an array `(batch, heads, query, key)` of post-softmax probabilities whose rows sum to 1
for real queries, with masked keys exactly 0 and the rows of fully masked queries all 0. A
plain list of such arrays (one stack of layers) is accepted too. A dict in gives a dict out
(one entry a stack); a list in gives the result of that one stack.

Everything is NumPy (float64 inside): the maps have already left the backend, so the same
numbers come out whichever backend produced them.

Example:
>>> maps = kzoo.interpret.attention_maps(model, inputs)
>>> entropy = attention_entropy(maps, padding_mask=inputs["padding_mask"])
>>> entropy["self"].per_head          # (layers, heads), nats
>>> rollout = attention_rollout(maps)["self"]   # (batch, query, key)
"""

import dataclasses

import numpy as np

HEAD_FUSIONS = ("mean", "max", "min")
# attention_flow runs one max-flow problem per (output token, input token) pair on a graph of
# (layers + 1) * tokens nodes and layers * tokens**2 edges: fine for a sentence, hopeless for
# an image. Above this many tokens it refuses unless `max_tokens` is raised.
MAX_FLOW_TOKENS = 32
SELF_STACKS = ("self", "encoder", "decoder")  # square maps: rollout and flow apply
STACKS = SELF_STACKS + ("cross",)


# === Input checks ===

def _as_stack(layers, name="maps"):
    """A list of 4-D float64 arrays of one shape, or ValueError naming `name`."""
    if isinstance(layers, np.ndarray) and layers.ndim == 4:
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(
            f"`{name}` must be a dict of attention maps (as attention_maps returns), or a "
            f"non-empty list of arrays (batch, heads, query, key); got {type(layers).__name__}"
            + (" (empty)" if isinstance(layers, (list, tuple)) else "") + ".")
    out = []
    for i, layer in enumerate(layers):
        array = np.asarray(_to_numpy(layer), dtype=np.float64)
        if array.ndim != 4:
            raise ValueError(
                f"`{name}`[{i}] must have rank 4 (batch, heads, query, key); got shape "
                f"{array.shape} (rank {array.ndim}).")
        if out and array.shape != out[0].shape:
            raise ValueError(
                f"`{name}`[{i}] has shape {array.shape} but layer 0 has {out[0].shape}: every "
                "layer of one stack must have the same (batch, heads, query, key).")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"`{name}`[{i}] holds NaN or infinite values.")
        out.append(array)
    return out


def _to_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    try:  # a backend tensor (e.g. straight from a Tap record)
        import keras

        return keras.ops.convert_to_numpy(x)
    except Exception:
        return np.asarray(x)


def _check_dict(maps, allowed=STACKS):
    unknown = sorted(set(maps) - set(allowed))
    if unknown:
        raise ValueError(
            f"`maps` has unknown key(s) {unknown}; allowed keys are {list(allowed)} "
            "(as attention_maps returns them).")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not one of {list(allowed)}.")


def _check_flag(name, value):
    # (a string such as "no" or "False" was truthy: the option was on in silence)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False; got {name}={value!r}.")


def _check_square(stack, name):
    _, _, q, k = stack[0].shape
    if q != k:
        raise ValueError(
            f"`{name}` holds maps of {q} queries x {k} keys: rollout and flow compose "
            "self-attention maps, which are square (cross-attention maps are not).")


# === Entropy ===

@dataclasses.dataclass
class AttentionEntropy:
    """Entropy of the attention distributions of one stack of layers, in nats.

    Attributes:
        per_query: `(layers, batch, heads, query)`: H = -sum_j A_ij log A_ij over the real
            keys j of each query i (0 log 0 = 0), rows normalised to sum to 1. NaN at padded
            queries (those marked False in the query mask, and those whose attention row is
            all zero in every head: fully masked), and where one head's row is all zero (a
            head removed by a head mask).
        per_head: `(layers, heads)`: the mean of `per_query` over the batch and the real
            queries, NaN left out (NaN where a head has no row with a distribution).
        query_mask: `(batch, query)` bool, the queries that count.
    """

    per_query: np.ndarray
    per_head: np.ndarray
    query_mask: np.ndarray


def _mask_array(mask, name, batch, length):
    mask = np.asarray(_to_numpy(mask))
    if mask.shape != (batch, length):
        raise ValueError(
            f"`{name}` must have shape (batch, length) = {(batch, length)} to match the maps; "
            f"got {mask.shape}.")
    return mask.astype(bool)


def _entropy_stack(stack, query_mask, key_mask):
    weights = np.stack(stack)  # (layers, batch, heads, query, key)
    _, batch, _, q, k = weights.shape
    if key_mask is not None:
        weights = weights * key_mask[None, :, None, None, :]
    # Each row as the distribution it is proportional to (as scipy.stats.entropy reads it):
    # a head scaled by a head mask (`attention_maps(..., head_mask=...)`) keeps the entropy
    # of its distribution, and a row that is all zero in one head (a head the mask removed)
    # has none: NaN. (Both were read as they stood: a removed head had 0 nats, "one token
    # only", and a halved one 0.5 H + 0.5 log 2.)
    sums = weights.sum(-1)  # (layers, batch, heads, query)
    live = sums > 0
    p = np.divide(weights, sums[..., None], out=np.zeros_like(weights),
                  where=live[..., None])
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    entropy = -terms.sum(-1)  # (layers, batch, heads, query)
    real = np.ones((batch, q), bool) if query_mask is None else query_mask.copy()
    # A query whose row is all zero in every layer and head was fully masked: not a real query.
    real &= sums.max(axis=(0, 2)) > 0
    entropy = np.where(real[None, :, None, :] & live, entropy, np.nan)
    counts = np.sum(~np.isnan(entropy), axis=(1, 3))  # (layers, heads)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_head = np.where(counts > 0, np.nansum(entropy, axis=(1, 3)) / counts, np.nan)
    return AttentionEntropy(per_query=entropy, per_head=per_head, query_mask=real)


def attention_entropy(maps, padding_mask=None):
    """Entropy of every attention distribution, per layer, head and query, in nats.

    H(A_i) = -sum_j A_ij log A_ij over the keys j that query i may see (0 log 0 = 0): 0 when a
    head looks at one token only, log(n) when it spreads evenly over n tokens. Each row is
    read as the distribution it is proportional to (`A_i / sum_j A_ij`, as
    `scipy.stats.entropy`): a head scaled by a head mask has the entropy of its
    distribution, and a head whose row is all zero (removed by a head mask) has none: NaN,
    left out of `per_head`.

    Masked keys and padded queries are left out: keys marked False in the padding mask do not
    enter the sum, and padded queries (False in the mask, or whose attention row is all zero)
    get NaN in `per_query` and do not count in `per_head`.

    Args:
        maps: a dict of attention maps (`attention_maps`' output) or one list of arrays
            `(batch, heads, query, key)`.
        padding_mask: None (every query real; fully masked rows still drop out), or for a
            list of square maps a `(batch, seq)` bool array (True = real token), or a pair
            `(query_mask, key_mask)`. For a dict of maps: an array (applied to every square
            stack; BERT/GPT/ViT), or a dict with the model's own mask names or stack names:
            `{"encoder_padding_mask": ..., "decoder_padding_mask": ...}` (T5; "cross" then
            uses the decoder mask for queries and the encoder mask for keys).

    Returns:
        an `AttentionEntropy` (`per_query` `(layers, batch, heads, query)`, `per_head`
        `(layers, heads)`, `query_mask` `(batch, query)`) for a list; a dict of them, one a
        stack, for a dict.

    Example:
    >>> result = attention_entropy([weights_layer0, weights_layer1], padding_mask=mask)
    >>> result.per_head.shape
    (2, 4)
    """
    if isinstance(maps, dict):
        _check_dict(maps)
        masks = _dict_masks(padding_mask, maps)
        out = {}
        for key, layers in maps.items():
            stack = _as_stack(layers, f"maps[{key!r}]")
            batch, _, q, k = stack[0].shape
            qm, km = masks.get(key, (None, None))
            qm = None if qm is None else _mask_array(qm, f"padding_mask for {key!r} queries", batch, q)
            km = None if km is None else _mask_array(km, f"padding_mask for {key!r} keys", batch, k)
            out[key] = _entropy_stack(stack, qm, km)
        return out
    stack = _as_stack(maps)
    batch, _, q, k = stack[0].shape
    if padding_mask is None:
        return _entropy_stack(stack, None, None)
    if isinstance(padding_mask, (tuple, list)) and len(padding_mask) == 2:
        qm, km = padding_mask
        return _entropy_stack(
            stack,
            None if qm is None else _mask_array(qm, "padding_mask[0] (queries)", batch, q),
            None if km is None else _mask_array(km, "padding_mask[1] (keys)", batch, k))
    if q != k:
        raise ValueError(
            f"`padding_mask` is one array but the maps are {q} queries x {k} keys; pass a "
            "pair (query_mask, key_mask) for cross-attention maps.")
    mask = _mask_array(padding_mask, "padding_mask", batch, q)
    return _entropy_stack(stack, mask, mask)


def _dict_masks(padding_mask, maps):
    """Stack name -> (query_mask, key_mask) from the forms `attention_entropy` accepts."""
    if padding_mask is None:
        return {}
    if not isinstance(padding_mask, dict):
        square = [key for key in maps if key != "cross"]
        if "cross" in maps:
            raise ValueError(
                "`padding_mask` is one array but the maps have a 'cross' stack: pass a dict "
                "{'encoder_padding_mask': ..., 'decoder_padding_mask': ...}.")
        return {key: (padding_mask, padding_mask) for key in square}
    aliases = {"encoder_padding_mask": "encoder", "decoder_padding_mask": "decoder",
               "padding_mask": "self"}
    named = {}
    for name, mask in padding_mask.items():
        stack = aliases.get(name, name)
        if stack not in SELF_STACKS:
            raise ValueError(
                f"`padding_mask` has unknown key {name!r}; allowed: "
                f"{sorted(aliases) + list(SELF_STACKS)}.")
        named[stack] = mask
    out = {key: (mask, mask) for key, mask in named.items()}
    if "cross" in maps:
        out["cross"] = (named.get("decoder"), named.get("encoder"))
    return out


# === Rollout and flow ===

def _fuse(stack, head_fusion):
    """(layers, batch, seq, seq): the heads of each layer fused."""
    weights = np.stack(stack)
    return getattr(np, head_fusion)(weights, axis=2)


def _residual(fused, residual):
    """Add the identity (when `residual`) and renormalise rows (zero rows stay zero)."""
    if residual:
        eye = np.eye(fused.shape[-1])
        fused = 0.5 * fused + 0.5 * eye
    sums = fused.sum(-1, keepdims=True)
    return np.divide(fused, sums, out=np.zeros_like(fused), where=sums > 0)


def attention_rollout(maps, head_fusion="mean", residual=True, return_all=False):
    """Attention rollout (Abnar & Zuidema 2020): how much each output position draws on each
    input token, through every layer.

    Per layer the heads are fused (`head_fusion`: mean, max or min over heads) into F; with
    `residual` the skip connection is modelled as `A = 0.5 F + 0.5 I`, otherwise `A = F`; the
    rows of A are renormalised to sum to 1 (a zero row, from a fully masked query, stays zero
    without `residual` and becomes the identity row with it). Then the layers are multiplied
    bottom to top: `R_1 = A_1`, `R_l = A_l @ R_{l-1}`. Causal maps give a lower-triangular
    rollout (a decoder token never draws on a later one).

    Args:
        maps: a dict of attention maps or one list of arrays `(batch, heads, seq, seq)`.
            Cross-attention maps are not square; a dict's "cross" entry is left out.
        head_fusion: "mean", "max" or "min".
        residual: model the residual connection (add the identity) before renormalising.
        return_all: also return every layer's partial rollout.

    Returns:
        `(batch, seq, seq)`: row i is output position i's share of each input token (rows sum
        to 1 for real queries); with `return_all`, `(layers, batch, seq, seq)` where entry l is
        the rollout up to layer l. For a dict: a dict of those, one a self-attention stack.

    Example:
    >>> rollout = attention_rollout(maps)["self"]
    >>> rollout[0, 0, 1:]          # ViT: the class token's share of each patch
    """
    _check_choice("head_fusion", head_fusion, HEAD_FUSIONS)
    _check_flag("residual", residual)
    _check_flag("return_all", return_all)
    if isinstance(maps, dict):
        _check_dict(maps)
        return {key: attention_rollout(layers, head_fusion, residual, return_all)
                for key, layers in maps.items() if key != "cross"}
    stack = _as_stack(maps)
    _check_square(stack, "maps")
    layers = _residual(_fuse(stack, head_fusion), residual)
    partial = []
    rollout = layers[0]
    partial.append(rollout)
    for a in layers[1:]:
        rollout = a @ rollout
        partial.append(rollout)
    return np.stack(partial) if return_all else rollout


def attention_flow(maps, head_fusion="mean", residual=True, normalize=True, max_tokens=None):
    """Attention flow (Abnar & Zuidema 2020): the maximum flow from each output position down
    to each input token through the graph of all layers.

    The graph has one node a (layer boundary, position): inputs at level 0, the output of
    layer l at level l. Node (l, i) has an edge to node (l - 1, j) with capacity `A_l[i, j]`,
    where `A_l` is layer l's head-fused, residual-adjusted, row-renormalised map (the same as
    in `attention_rollout`). The flow of output i to input j is the maximum flow from (L, i)
    to (0, j). Unlike rollout, it counts each path's bottleneck instead of multiplying
    weights. Causal maps give a lower-triangular result.

    One max-flow problem per (output, input) pair and batch entry (networkx's Edmonds-Karp),
    so this is for short inputs: more than `max_tokens` tokens (default `MAX_FLOW_TOKENS` =
    32) raises ValueError.

    Args:
        maps: a dict of attention maps or one list of arrays `(batch, heads, seq, seq)`.
        head_fusion: "mean", "max" or "min".
        residual: add the identity (the residual connection) before renormalising.
        normalize: divide each output position's flows by their sum (as the paper's code
            does), so that rows sum to 1 like a rollout; rows with no flow stay zero.
        max_tokens: raise the size limit (at your own cost in time).

    Returns:
        `(batch, seq, seq)` flow values (row = output position, column = input token); a dict
        of them for a dict of maps ("cross" left out).

    Example:
    >>> flow = attention_flow([weights_layer0, weights_layer1])
    >>> flow.shape
    (1, 6, 6)
    """
    _check_choice("head_fusion", head_fusion, HEAD_FUSIONS)
    _check_flag("residual", residual)
    _check_flag("normalize", normalize)
    if max_tokens is None:
        max_tokens = MAX_FLOW_TOKENS
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
            or max_tokens < 1:
        raise ValueError(f"`max_tokens`={max_tokens!r} must be a positive integer.")
    max_tokens = int(max_tokens)
    if isinstance(maps, dict):
        _check_dict(maps)
        return {key: attention_flow(layers, head_fusion, residual, normalize, max_tokens)
                for key, layers in maps.items() if key != "cross"}
    stack = _as_stack(maps)
    _check_square(stack, "maps")
    seq = stack[0].shape[-1]
    if seq > max_tokens:
        raise ValueError(
            f"attention_flow: the maps have {seq} tokens, more than `max_tokens`={max_tokens} "
            f"(one max-flow problem per token pair on a graph of {len(stack)} x {seq}**2 "
            "edges); use attention_rollout, or pass a larger max_tokens.")
    try:
        import networkx as nx
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "attention_flow needs networkx: pip install 'kzoo[interpret]' (or networkx>=3)."
        ) from error
    from networkx.algorithms.flow import edmonds_karp

    layers = _residual(_fuse(stack, head_fusion), residual)  # (L, batch, seq, seq)
    num_layers, batch = layers.shape[:2]
    out = np.zeros((batch, seq, seq))
    for b in range(batch):
        graph = nx.DiGraph()
        for level in range(1, num_layers + 1):
            a = layers[level - 1, b]
            for i, j in zip(*np.nonzero(a > 0)):
                graph.add_edge((level, int(i)), (level - 1, int(j)), capacity=float(a[i, j]))
        for i in range(seq):
            source = (num_layers, i)
            if source not in graph:
                continue
            for j in range(seq):
                sink = (0, j)
                if sink in graph and nx.has_path(graph, source, sink):
                    out[b, i, j] = nx.maximum_flow_value(graph, source, sink,
                                                         flow_func=edmonds_karp)
    if normalize:
        sums = out.sum(-1, keepdims=True)
        out = np.divide(out, sums, out=np.zeros_like(out), where=sums > 0)
    return out
