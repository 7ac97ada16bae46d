"""Graphormer (Ying et al., 2021, "Do Transformers Really Perform Bad for Graph
Representation?", https://arxiv.org/abs/2106.05234): backbone and graph-level predictor.

A graph of `N` nodes becomes `N + 1` tokens: a virtual graph token followed by the nodes.
Graph structure enters the Transformer in three ways:

- centrality encoding: a node's token is the sum of the embeddings of its (offset) integer
  features plus learned in-degree and out-degree embeddings;
- spatial encoding: a learned per-head bias `b(spatial_pos[i, j])` added to the attention
  score of every node pair (shortest-path distance); the graph token has its own learned
  per-head "virtual distance" bias to and from every node;
- edge encoding: for `edge_type="multi_hop"`, the per-head bias of a pair is the average
  over the hops of the shortest path of `mean_f(edge_emb(features)) @ W_hop`; for
  `"single_hop"`, the mean edge-feature embedding of the direct edge.

The inputs are the dict that `kzoo.graphs.batch(graphs)` returns (exactly what transformers'
`GraphormerDataCollator` returns): `input_nodes` `(B, N, F)`, `attn_bias` `(B, N+1, N+1)`,
`attn_edge_type` `(B, N, N, F_e)`, `spatial_pos` `(B, N, N)`, `in_degree`, `out_degree`
`(B, N)`, `input_edges` `(B, N, N, hops, F_e)`; `N`, `F` and the hops may differ between
batches.

The computation follows transformers' `GraphormerModel` (models/deprecated/graphormer, the
port of the fairseq-based reference code) exactly:

- padded nodes are recognised by `input_nodes[:, :, 0] == 0` and may not be attended to;
- `attn_bias` from the collator holds 0 or `-inf` (pairs farther apart than
  `spatial_pos_max`); transformers adds it to the bias twice, and so does this model for its
  finite entries, while its `-inf` entries become a boolean mask (so a row whose keys are
  all masked gives finite output instead of NaN);
- embedding ids 0 are padding: as with torch's `padding_idx=0` (whose row is zero in every
  checkpoint), they look up a zero vector; here row 0 is multiplied by 0 before the lookup,
  so its stored value never matters and it gets no gradient;
- the output of the last encoder layer goes through `LayerNorm(act(Dense(x)))`
  (`lm_head_transform_weight`, the activation, `layer_norm` of transformers'
  `GraphormerModel`); that is the backbone's output, `GraphormerModel`'s
  `last_hidden_state`. With `pre_layernorm=True`, like transformers and the reference code,
  no final LayerNorm follows the encoder layers.

Example:
>>> from kzoo import graphs
>>> backbone = GraphormerBackbone(num_layers=2, hidden_dim=32, intermediate_dim=32,
...                               num_heads=4)
>>> model = GraphormerPredictor(backbone, num_classes=1)
>>> inputs = graphs.batch([graphs.from_smiles("CCO"), graphs.from_smiles("c1ccccc1")])
>>> model(inputs).shape
(2, 1)
"""

import dataclasses
from typing import Optional

import keras
from keras import ops

from kzoo.layers.blocks import TransformerBlock
from kzoo.layers.feedforward import ACTIVATION_NAMES
from kzoo.layers.norm import LayerNorm
from kzoo.layers.taps import active_tap
from kzoo.layers.utils import (
    check_at_most,
    check_bool,
    check_choice,
    clip,
    check_divides,
    check_instance,
    check_non_negative_int,
    check_number,
    check_positive_float,
    check_positive_int,
    check_rate,
    serialize_initializer,
)
from kzoo.models.base import (Backbone, FamilyConfig, FloatInput, HeadTransform, IdInput,
                              TaskModel,
                              class_loss)

FAMILY = "graphormer"
EDGE_TYPES = ("multi_hop", "single_hop")
INPUT_KEYS = (
    "input_nodes",
    "attn_bias",
    "attn_edge_type",
    "spatial_pos",
    "in_degree",
    "out_degree",
    "input_edges",
)


def graphormer_initializer(stddev=0.02):
    """Graphormer's initialiser: normal(0, 0.02) for embeddings and (with
    `apply_graphormer_init`) every dense kernel.

    Example:
    >>> keras.layers.Dense(8, kernel_initializer=graphormer_initializer())
    """
    return keras.initializers.RandomNormal(stddev=stddev)


def _table(table, padding, dtype):
    """`table` in `dtype`; with `padding`, row 0 multiplied by 0 (torch's `padding_idx=0`:
    id 0 looks up a zero vector, and the row gets no gradient)."""
    table = ops.cast(table, dtype)
    if padding:
        keep = ops.cast(ops.arange(table.shape[0]) > 0, dtype)
        table = table * ops.expand_dims(keep, -1)
    return table


def _take(table, ids):
    """Rows of `table` for integer `ids`, clipped into range as `TokenEmbedding` does."""
    if "int" not in keras.backend.standardize_dtype(ids.dtype):
        ids = ops.cast(ids, "int32")
    ids = clip(ids, 0, table.shape[0] - 1)
    return ops.take(table, ids, axis=0)


def _lookup(table, ids, padding, dtype):
    return _take(_table(table, padding, dtype), ids)


def _lookup_reduce(table, ids, padding, dtype, mean):
    """`sum` (or `mean`) over the last axis of `ids` of `lookup(table, ids)`: the summed
    (mean) embedding of the feature columns. Accumulated one column at a time when their
    number is static, so that the `(..., columns, dim)` lookup, the largest tensor of the
    node features and of the multi-hop edge encoding, never exists at once."""
    table = _table(table, padding, dtype)
    columns = ids.shape[-1]
    if columns is None:
        rows = _take(table, ids)
        return ops.mean(rows, axis=-2) if mean else ops.sum(rows, axis=-2)
    total = _take(table, ids[..., 0])
    for column in range(1, columns):
        total = total + _take(table, ids[..., column])
    return total / columns if mean else total


# === Layers ===


@keras.saving.register_keras_serializable(package="kzoo")
class GraphormerNodeFeature(keras.layers.Layer):
    """Centrality encoding and the virtual graph token (transformers'
    `GraphormerGraphNodeFeature`).

    Node `i` of a graph gets `sum_f atom[input_nodes[i, f]] + in_deg[in_degree[i]] +
    out_deg[out_degree[i]]`; a learned graph token is prepended. Id 0 of the three tables is
    padding (zero vector).

    Args:
        num_atoms: the node-feature table has `num_atoms + 1` rows.
        num_in_degree, num_out_degree: rows of the degree tables.
        hidden_dim: embedding width.
        embeddings_initializer: initialiser of all four weights (normal 0.02 in the paper).

    Call args:
        input_nodes: `(B, N, F)` integer ids; in_degree, out_degree: `(B, N)`.

    Returns:
        `(B, N + 1, hidden_dim)`, the graph token first.

    Example:
    >>> layer = GraphormerNodeFeature(num_atoms=64, num_in_degree=8, num_out_degree=8,
    ...                               hidden_dim=16)
    >>> layer(np.ones((2, 5, 3), "int32"), np.ones((2, 5), "int32"),
    ...       np.ones((2, 5), "int32")).shape
    (2, 6, 16)
    """

    def __init__(self, num_atoms, num_in_degree, num_out_degree, hidden_dim,
                 embeddings_initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.num_atoms = check_positive_int("num_atoms", num_atoms)
        self.num_in_degree = check_positive_int("num_in_degree", num_in_degree)
        self.num_out_degree = check_positive_int("num_out_degree", num_out_degree)
        self.hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        self.embeddings_initializer = serialize_initializer(
            embeddings_initializer or graphormer_initializer()
        )

    def build(self, *args, **kwargs):
        init = keras.initializers.get(self.embeddings_initializer)
        self.atom_embeddings = self.add_weight(
            name="atom_embeddings", shape=(self.num_atoms + 1, self.hidden_dim),
            initializer=init,
        )
        self.in_degree_embeddings = self.add_weight(
            name="in_degree_embeddings", shape=(self.num_in_degree, self.hidden_dim),
            initializer=init,
        )
        self.out_degree_embeddings = self.add_weight(
            name="out_degree_embeddings", shape=(self.num_out_degree, self.hidden_dim),
            initializer=init,
        )
        self.graph_token = self.add_weight(
            name="graph_token", shape=(1, self.hidden_dim), initializer=init
        )
        self.built = True

    def call(self, input_nodes, in_degree, out_degree):
        dtype = self.compute_dtype
        nodes = _lookup_reduce(self.atom_embeddings, input_nodes, True, dtype, mean=False)
        nodes = nodes + _lookup(self.in_degree_embeddings, in_degree, True, dtype)
        nodes = nodes + _lookup(self.out_degree_embeddings, out_degree, True, dtype)
        tap = active_tap()  # interpretation (kzoo.layers.taps): None in a plain pass
        if tap is not None:
            nodes = tap._on_embedding(self, nodes)
        token = ops.cast(self.graph_token, dtype)[None]  # (1, 1, hidden)
        token = ops.broadcast_to(token, (ops.shape(nodes)[0], 1, self.hidden_dim))
        return ops.concatenate([token, nodes], axis=1)

    def compute_output_spec(self, input_nodes, in_degree, out_degree):
        n = input_nodes.shape[1]
        return keras.KerasTensor(
            (input_nodes.shape[0], None if n is None else n + 1, self.hidden_dim),
            dtype=self.compute_dtype,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_atoms": self.num_atoms,
                "num_in_degree": self.num_in_degree,
                "num_out_degree": self.num_out_degree,
                "hidden_dim": self.hidden_dim,
                "embeddings_initializer": self.embeddings_initializer,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="kzoo")
class GraphormerAttentionBias(keras.layers.Layer):
    """Spatial and edge encodings as a per-head attention bias, plus the attention mask
    (transformers' `GraphormerGraphAttnBias` and the padding mask of its graph encoder).

    For node pairs (rows/columns 1..N) the bias is `spatial[spatial_pos] + edge`, with, for
    `edge_type="multi_hop"` and `D = min(hops, multi_hop_max_dist)` hops,

        edge[i, j] = sum_{d < D} (mean_f edge_emb[input_edges[i, j, d, f]]) @ W[d]
                     / clip(max(spatial_pos[i, j] - 1, 1), 0, multi_hop_max_dist)

    (`spatial_pos` 0, i.e. padding, counts as 1; `multi_hop_max_dist=0` means no cut), and
    for `"single_hop"` `edge[i, j] = mean_f edge_emb[attn_edge_type[i, j, f]]`. Row 0 and
    column 0 (the graph token) get the learned virtual distance `t` (once at `[0, 0]`).
    Finally the finite entries of `attn_bias` are added twice (as transformers does: once
    as the starting value, once as its "reset"); its `-inf` entries are returned as False in
    the mask instead, together with the key padding (`input_nodes[:, :, 0] == 0`).

    Args:
        num_heads: attention heads.
        num_edges: the edge-feature table has `num_edges + 1` rows (id 0 = padding).
        num_spatial: rows of the spatial table (id 0 = padding).
        num_edge_dis: number of per-hop `(heads, heads)` matrices `W` (multi-hop only).
        edge_type: "multi_hop" or "single_hop".
        multi_hop_max_dist: hops used by the multi-hop encoding (0 = all).
        embeddings_initializer: initialiser of every weight (normal 0.02).

    Call args:
        input_nodes `(B, N, F)`, attn_bias `(B, N+1, N+1)`, spatial_pos `(B, N, N)`,
        input_edges `(B, N, N, hops, F_e)`, attn_edge_type `(B, N, N, F_e)`.

    Returns:
        `(bias, mask)`: bias `(B, heads, N+1, N+1)` (finite), mask `(B, 1, N+1, N+1)` bool.

    Example:
    >>> layer = GraphormerAttentionBias(num_heads=4, num_edges=64, num_spatial=16,
    ...                                 num_edge_dis=8)
    >>> from kzoo import graphs
    >>> x = graphs.batch([graphs.from_smiles("CCO")])
    >>> bias, mask = layer(x["input_nodes"], x["attn_bias"], x["spatial_pos"],
    ...                    x["input_edges"], x["attn_edge_type"])
    >>> bias.shape, mask.shape
    ((1, 4, 4, 4), (1, 1, 4, 4))
    """

    def __init__(self, num_heads, num_edges, num_spatial, num_edge_dis, edge_type="multi_hop",
                 multi_hop_max_dist=5, embeddings_initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.num_edges = check_positive_int("num_edges", num_edges)
        self.num_spatial = check_positive_int("num_spatial", num_spatial)
        self.num_edge_dis = check_positive_int("num_edge_dis", num_edge_dis)
        self.edge_type = check_choice("edge_type", edge_type, EDGE_TYPES)
        self.multi_hop_max_dist = check_non_negative_int("multi_hop_max_dist",
                                                         multi_hop_max_dist)
        self.embeddings_initializer = serialize_initializer(
            embeddings_initializer or graphormer_initializer()
        )

    def build(self, *args, **kwargs):
        init = keras.initializers.get(self.embeddings_initializer)
        heads = self.num_heads
        self.edge_embeddings = self.add_weight(
            name="edge_embeddings", shape=(self.num_edges + 1, heads), initializer=init
        )
        self.edge_distance_weights = None
        if self.edge_type == "multi_hop":
            self.edge_distance_weights = self.add_weight(
                name="edge_distance_weights", shape=(self.num_edge_dis, heads, heads),
                initializer=init,
            )
        self.spatial_embeddings = self.add_weight(
            name="spatial_embeddings", shape=(self.num_spatial, heads), initializer=init
        )
        self.virtual_distance = self.add_weight(
            name="virtual_distance", shape=(1, heads), initializer=init
        )
        self.built = True

    def _edge_bias(self, spatial_pos, input_edges, attn_edge_type, dtype):
        """(B, N, N, heads)."""
        if self.edge_type == "single_hop":
            return _lookup_reduce(self.edge_embeddings, attn_edge_type, True, dtype, mean=True)
        hops = ops.where(ops.equal(spatial_pos, 0), 1, spatial_pos)
        hops = ops.where(ops.greater(hops, 1), hops - 1, hops)
        if self.multi_hop_max_dist > 0:
            hops = clip(hops, 0, self.multi_hop_max_dist)
            input_edges = input_edges[:, :, :, : self.multi_hop_max_dist, :]
        edges = _lookup_reduce(self.edge_embeddings, input_edges, True, dtype, mean=True)
        num_hops = edges.shape[3] if edges.shape[3] is not None else ops.shape(edges)[3]
        if isinstance(num_hops, int) and num_hops > self.num_edge_dis:
            cut = (f"after the cut at multi_hop_max_dist={self.multi_hop_max_dist}"
                   if self.multi_hop_max_dist else "multi_hop_max_dist=0: no cut")
            raise ValueError(
                f"`input_edges` has {num_hops} hops ({cut}) but the model has only num_edge_dis="
                f"{self.num_edge_dis} hop matrices; batch the graphs with "
                f"kzoo.graphs.batch(..., multi_hop_max_dist=k) for some k <= "
                f"{self.num_edge_dis}, or use a model with more."
            )
        weights = ops.cast(self.edge_distance_weights, dtype)[:num_hops]
        edges = ops.einsum("bijdh,dhk->bijk", edges, weights)
        return edges / ops.cast(hops, dtype)[..., None]

    def call(self, input_nodes, attn_bias, spatial_pos, input_edges, attn_edge_type):
        dtype = self.compute_dtype
        batch = ops.shape(spatial_pos)[0]
        n = ops.shape(spatial_pos)[1]
        pair = _lookup(self.spatial_embeddings, spatial_pos, True, dtype)
        pair = pair + self._edge_bias(spatial_pos, input_edges, attn_edge_type, dtype)
        pair = ops.transpose(pair, (0, 3, 1, 2))  # (B, heads, N, N)
        t = ops.reshape(ops.cast(self.virtual_distance, dtype), (1, self.num_heads, 1, 1))
        column = ops.broadcast_to(t, (batch, self.num_heads, n, 1))
        row = ops.broadcast_to(t, (batch, self.num_heads, 1, n + 1))
        bias = ops.concatenate([row, ops.concatenate([column, pair], axis=3)], axis=2)

        attn_bias = ops.cast(attn_bias, dtype)
        finite = ops.isfinite(attn_bias)
        base = ops.where(finite, attn_bias, ops.zeros_like(attn_bias))
        bias = bias + 2 * base[:, None]

        real = ops.not_equal(input_nodes[:, :, 0], 0)
        keys = ops.concatenate([ops.ones((batch, 1), dtype="bool"), real], axis=1)
        mask = ops.logical_and(finite, keys[:, None, :])[:, None]
        return bias, mask

    def compute_output_spec(self, input_nodes, attn_bias, spatial_pos, input_edges,
                            attn_edge_type):
        b, n = attn_bias.shape[0], attn_bias.shape[1]
        return (
            keras.KerasTensor((b, self.num_heads, n, n), dtype=self.compute_dtype),
            keras.KerasTensor((b, 1, n, n), dtype="bool"),
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "num_edges": self.num_edges,
                "num_spatial": self.num_spatial,
                "num_edge_dis": self.num_edge_dis,
                "edge_type": self.edge_type,
                "multi_hop_max_dist": self.multi_hop_max_dist,
                "embeddings_initializer": self.embeddings_initializer,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="kzoo")
class GraphormerHeadTransform(HeadTransform):
    """`LayerNorm(act(Dense(x)))` on every token (transformers' `lm_head_transform_weight`,
    `activation_fn` and `layer_norm` of `GraphormerModel`).

    Args:
        activation: activation name (see `kzoo.layers.get_activation`).
        layer_norm_epsilon: epsilon of the LayerNorm.
        kernel_initializer: initialiser of the dense kernel (normal 0.02).

    Example:
    >>> GraphormerHeadTransform()(keras.random.normal((2, 6, 32))).shape
    (2, 6, 32)
    """

    def __init__(self, activation="gelu", layer_norm_epsilon=1e-5, kernel_initializer=None,
                 **kwargs):
        super().__init__(activation, layer_norm_epsilon,
                         kernel_initializer or graphormer_initializer(), **kwargs)


@keras.saving.register_keras_serializable(package="kzoo")
class GraphormerDecoderHead(keras.layers.Layer):
    """`x @ W + b` with a bias-free kernel `W (hidden, num_classes)` and one learned scalar
    bias shared by all outputs (transformers' `GraphormerDecoderHead`: `classifier` and
    `lm_output_learned_bias`).

    Args:
        num_classes: outputs per graph.
        kernel_initializer: initialiser of `W` (normal 0.02); the bias starts at 0.

    Example:
    >>> GraphormerDecoderHead(3)(keras.random.normal((2, 32))).shape
    (2, 3)
    """

    def __init__(self, num_classes, kernel_initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.kernel_initializer = serialize_initializer(
            kernel_initializer or graphormer_initializer()
        )

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel", shape=(input_shape[-1], self.num_classes),
            initializer=keras.initializers.get(self.kernel_initializer),
        )
        self.bias = self.add_weight(name="bias", shape=(1,), initializer="zeros")
        self.built = True

    def call(self, inputs):
        return ops.matmul(inputs, self.kernel) + self.bias

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.num_classes,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {"num_classes": self.num_classes, "kernel_initializer": self.kernel_initializer}
        )
        return config


# === Functional Model ===


# === Config ===


@dataclasses.dataclass(frozen=True)
class GraphormerConfig(FamilyConfig):
    """The configuration of a `GraphormerBackbone`, validated once on construction.

    Its fields are `GraphormerBackbone`'s arguments (see there for their meaning), with the
    same defaults (transformers' `GraphormerConfig`). Rules between fields: `num_heads`
    divides `hidden_dim`; `num_frozen_layers` is at most `num_layers`. `multi_hop_max_dist`
    may exceed `num_edge_dis` (transformers allows it too); the model then refuses, by name,
    batches whose `input_edges` have more than `num_edge_dis` hops.

    Example:
    >>> config = GraphormerConfig(num_layers=2, hidden_dim=32, intermediate_dim=32,
    ...                           num_heads=4)
    >>> backbone = config.build()      # the same as GraphormerBackbone(**config.to_dict())
    """

    num_atoms: int = 512 * 9
    num_in_degree: int = 512
    num_out_degree: int = 512
    num_edges: int = 512 * 3
    num_spatial: int = 512
    num_edge_dis: int = 128
    edge_type: str = "multi_hop"
    multi_hop_max_dist: int = 5
    num_layers: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 768
    num_heads: int = 32
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.1
    activation: str = "gelu"
    pre_layernorm: bool = False
    layer_norm_epsilon: float = 1e-5
    encoder_normalize_before: bool = False
    embed_scale: Optional[float] = None
    apply_graphormer_init: bool = False
    use_attention_bias: bool = True
    num_frozen_layers: int = 0
    remat: bool = False
    layerdrop: float = 0.0

    def __post_init__(self):
        check = self._check
        check("remat", check_bool)
        check("layerdrop", check_rate)
        for name in ("num_atoms", "num_in_degree", "num_out_degree", "num_edges",
                     "num_spatial", "num_edge_dis"):
            check(name, check_positive_int)
        check("edge_type", check_choice, EDGE_TYPES)
        # `multi_hop_max_dist` may exceed `num_edge_dis`, as in transformers: a batch runs
        # as long as its paths have at most `num_edge_dis` hops (checked at call time).
        check("multi_hop_max_dist", check_non_negative_int)
        for name in ("num_layers", "hidden_dim", "intermediate_dim", "num_heads"):
            check(name, check_positive_int)
        check("num_heads", check_divides, "hidden_dim", self.hidden_dim)
        check("dropout", check_rate)
        check("attention_dropout", check_rate)
        check("activation_dropout", check_rate)
        check("activation", check_choice, ACTIVATION_NAMES)
        check("pre_layernorm", check_bool)
        check("layer_norm_epsilon", check_positive_float)
        check("encoder_normalize_before", check_bool)
        check("embed_scale", check_number, allow_none=True)
        check("apply_graphormer_init", check_bool)
        check("use_attention_bias", check_bool)
        check("num_frozen_layers", check_non_negative_int)
        check("num_frozen_layers", check_at_most, "num_layers", self.num_layers)


# === Backbone ===


@keras.saving.register_keras_serializable(package="kzoo")
class GraphormerBackbone(Backbone):
    """Graphormer encoder (Ying et al., 2021, arXiv:2106.05234), as transformers'
    `GraphormerModel`.

    inputs -> `GraphormerNodeFeature` (centrality encoding + graph token) -> `* embed_scale`
    -> LayerNorm if `encoder_normalize_before` -> dropout -> `num_layers`
    `TransformerBlock`s attending with the `GraphormerAttentionBias` (spatial + edge
    encoding, graph-token distance, `attn_bias`) and its mask -> `GraphormerHeadTransform`
    (`LayerNorm(act(Dense(x)))`).

    The defaults are transformers' `GraphormerConfig` defaults (vocabularies sized for OGB's
    9 atom and 3 bond features offset by 512 per column, see `kzoo.graphs`). The published
    models were trained with `encoder_normalize_before=True`, `apply_graphormer_init=True`,
    `dropout=0.0`, `attention_dropout=0.1`, `activation_dropout=0.1` (the presets).

    Args:
        num_atoms: node-feature ids `0..num_atoms` (`num_atoms + 1` rows; 0 = padding).
        num_in_degree, num_out_degree: degree ids `0..num - 1` (0 = padding).
        num_edges: edge-feature ids `0..num_edges` (0 = padding / no edge).
        num_spatial: `spatial_pos` ids `0..num_spatial - 1` (0 = padding).
        num_edge_dis: per-hop matrices of the multi-hop edge encoding.
        edge_type: "multi_hop" (edge features along the shortest path) or "single_hop"
            (features of the direct edge, `attn_edge_type`).
        multi_hop_max_dist: hops used by the multi-hop encoding (0 = all). A batch may
            have at most `num_edge_dis` hops after this cut.
        num_layers, hidden_dim, intermediate_dim, num_heads: encoder sizes.
        dropout: dropout on the embeddings and after each attention/feed-forward sub-layer.
        attention_dropout: dropout on attention probabilities.
        activation_dropout: dropout on the feed-forward's hidden activations.
        activation: feed-forward and head-transform activation (see `get_activation`).
        pre_layernorm: pre-LN layers (True) or post-LN (False, the paper's PCQM4M/ZINC models).
        layer_norm_epsilon: epsilon of every LayerNorm (1e-5 as torch's default).
        encoder_normalize_before: LayerNorm on the embeddings before the first layer.
        embed_scale: optional factor multiplying the embeddings (None = 1).
        apply_graphormer_init: initialise every dense kernel with normal(0.02) (the reference
            code's `init_graphormer_params`); if False, transformers' default: Xavier-uniform
            (gain 1/sqrt(2)) query/key/value, Xavier-uniform attention output, normal(0.02)
            feed-forward and head. Embeddings are normal(0.02) either way.
        use_attention_bias: biases in the query/key/value/output projections (transformers'
            `bias`).
        num_frozen_layers: the first this-many encoder layers are not trainable
            (transformers' `num_trans_layers_to_freeze`).
        remat: recompute each block's activations in the backward pass instead of
            keeping them (gradient checkpointing per block: less memory, one more forward
            pass of compute; the gradients are the same).
        layerdrop: LayerDrop rate (Fan et al. 2019): in training, each block is skipped
            (is the identity) with this probability, one draw per block and batch; in
            inference every block runs.
        dtype: dtype policy of every layer.

    The arguments (all but `dtype` and Keras' own) are the fields of `GraphormerConfig`,
    which validates them: `GraphormerBackbone(**fields)` and
    `GraphormerConfig(**fields).build()` are the same model, and `backbone.config` is that
    `GraphormerConfig`.

    Call args:
        a dict with the keys of `INPUT_KEYS` (the output of `kzoo.graphs.batch` without
        `labels`).

    Returns:
        `(B, N + 1, hidden_dim)`: the graph token first, then the nodes.

    Example:

    ```python
    from kzoo import graphs
    backbone = GraphormerBackbone(num_layers=2, hidden_dim=32, intermediate_dim=32,
                                  num_heads=4)
    inputs = graphs.batch([graphs.from_smiles("CCO"), graphs.from_smiles("c1ccccc1")])
    tokens = backbone({k: v for k, v in inputs.items() if k != "labels"})  # (2, 7, 32)
    ```
    """

    family = FAMILY
    config_class = GraphormerConfig

    def __init__(
        self,
        num_atoms=512 * 9,
        num_in_degree=512,
        num_out_degree=512,
        num_edges=512 * 3,
        num_spatial=512,
        num_edge_dis=128,
        edge_type="multi_hop",
        multi_hop_max_dist=5,
        num_layers=12,
        hidden_dim=768,
        intermediate_dim=768,
        num_heads=32,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        activation="gelu",
        pre_layernorm=False,
        layer_norm_epsilon=1e-5,
        encoder_normalize_before=False,
        embed_scale=None,
        apply_graphormer_init=False,
        use_attention_bias=True,
        num_frozen_layers=0,
        remat=False,
        layerdrop=0.0,
        dtype=None,
        **kwargs,
    ):
        # === Config ===
        config = GraphormerConfig(
            num_atoms=num_atoms,
            num_in_degree=num_in_degree,
            num_out_degree=num_out_degree,
            num_edges=num_edges,
            num_spatial=num_spatial,
            num_edge_dis=num_edge_dis,
            edge_type=edge_type,
            multi_hop_max_dist=multi_hop_max_dist,
            num_layers=num_layers,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            num_heads=num_heads,
            dropout=dropout,
            attention_dropout=attention_dropout,
            activation_dropout=activation_dropout,
            activation=activation,
            pre_layernorm=pre_layernorm,
            layer_norm_epsilon=layer_norm_epsilon,
            encoder_normalize_before=encoder_normalize_before,
            embed_scale=embed_scale,
            apply_graphormer_init=apply_graphormer_init,
            use_attention_bias=use_attention_bias,
            num_frozen_layers=num_frozen_layers,
            remat=remat,
            layerdrop=layerdrop,
        )

        normal = graphormer_initializer()
        if apply_graphormer_init:
            qkv_init, out_init = normal, normal
        else:
            qkv_init = keras.initializers.VarianceScaling(
                scale=0.5, mode="fan_avg", distribution="uniform"
            )
            out_init = keras.initializers.GlorotUniform()

        # === Layers ===
        node_feature = GraphormerNodeFeature(
            num_atoms=num_atoms, num_in_degree=num_in_degree, num_out_degree=num_out_degree,
            hidden_dim=hidden_dim, embeddings_initializer=normal, dtype=dtype,
            name="node_feature",
        )
        attention_bias = GraphormerAttentionBias(
            num_heads=num_heads, num_edges=num_edges, num_spatial=num_spatial,
            num_edge_dis=num_edge_dis, edge_type=edge_type,
            multi_hop_max_dist=multi_hop_max_dist, embeddings_initializer=normal,
            dtype=dtype, name="attention_bias",
        )
        embedding_norm = None
        if encoder_normalize_before:
            embedding_norm = LayerNorm(
                epsilon=layer_norm_epsilon, dtype=dtype, name="embedding_norm"
            )
        embedding_dropout = keras.layers.Dropout(dropout, dtype=dtype,
                                                 name="embedding_dropout")
        # Graphormer's `use_attention_bias` switches the attention biases only (its
        # feed-forward is always biased); the feed-forward's hidden activations have their own
        # dropout rate (fairseq's `act_dropout`).
        encoder_layers = [
            TransformerBlock(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                norm_first=pre_layernorm,
                layer_norm_epsilon=layer_norm_epsilon,
                activation=activation,
                use_bias=use_attention_bias,
                feedforward_bias=True,
                dropout=dropout,
                attention_dropout=attention_dropout,
                activation_dropout=activation_dropout,
                kernel_initializer=normal,
                query_initializer=qkv_init,
                key_value_initializer=qkv_init,
                attention_output_initializer=out_init,
                dtype=dtype,
                remat=config.remat,
                layerdrop=config.layerdrop,
                name=f"transformer_layer_{i}",
            )
            for i in range(num_layers)
        ]
        head_transform = GraphormerHeadTransform(
            activation=activation, layer_norm_epsilon=layer_norm_epsilon,
            kernel_initializer=normal, dtype=dtype, name="head_transform",
        )

        # === Functional Model ===
        inputs = {
            "input_nodes": keras.Input(shape=(None, None), dtype="int32", name="input_nodes"),
            "attn_bias": keras.Input(shape=(None, None), dtype="float32", name="attn_bias"),
            "attn_edge_type": keras.Input(shape=(None, None, None), dtype="int32",
                                          name="attn_edge_type"),
            "spatial_pos": keras.Input(shape=(None, None), dtype="int32", name="spatial_pos"),
            "in_degree": keras.Input(shape=(None,), dtype="int32", name="in_degree"),
            "out_degree": keras.Input(shape=(None,), dtype="int32", name="out_degree"),
            "input_edges": keras.Input(shape=(None, None, None, None), dtype="int32",
                                       name="input_edges"),
        }
        bias, mask = attention_bias(
            inputs["input_nodes"], inputs["attn_bias"], inputs["spatial_pos"],
            inputs["input_edges"], inputs["attn_edge_type"],
        )
        x = node_feature(inputs["input_nodes"], inputs["in_degree"], inputs["out_degree"])
        if embed_scale is not None:
            x = x * embed_scale
        if embedding_norm is not None:
            x = embedding_norm(x)
        x = embedding_dropout(x)
        for layer in encoder_layers:
            x = layer(x, attention_mask=mask, attention_bias=bias)
        outputs = head_transform(x)
        kwargs.setdefault("name", "graphormer_backbone")
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)
        for layer in encoder_layers[:num_frozen_layers]:
            layer.trainable = False

        self._store_config(config)
        self.node_feature = node_feature
        self.attention_bias = attention_bias
        self.embedding_norm = embedding_norm
        self.encoder_layers = encoder_layers
        self.head_transform = head_transform

    def id_inputs(self):
        """The ids of every embedding table the model reads, checked at every entry point
        (`kzoo.inputs`): node features in `[0, num_atoms]`, degrees below `num_in_degree` /
        `num_out_degree`, `spatial_pos` below `num_spatial`, and the edge features in
        `[0, num_edges]`: `input_edges` (the edges along each shortest path) with
        `edge_type="multi_hop"`, `attn_edge_type` (the direct edge) with "single_hop".
        Padding is id 0 everywhere, so there is no mask. The edge input a model does not
        read is not checked, as transformers' Graphormer does not read it: `input_edges`'
        ids are `attn_edge_type`'s + 1, so checking both refused a single-hop batch whose
        largest edge id is `num_edges`; and a self-loop's features appear only in
        `attn_edge_type`, so a multi-hop model refused batches it runs."""
        c = self.config
        pair = ("graph", "from node", "to node")
        ids = (
            IdInput("input_nodes", c.num_atoms + 1, "num_atoms + 1",
                    axes=("graph", "node", "feature")),
            IdInput("in_degree", c.num_in_degree, "num_in_degree", axes=("graph", "node")),
            IdInput("out_degree", c.num_out_degree, "num_out_degree", axes=("graph", "node")),
            IdInput("spatial_pos", c.num_spatial, "num_spatial", axes=pair),
        )
        # the additive attention bias over the graph token and the nodes: 0 or -inf from
        # the collator; a NaN or +inf had been read as -inf (never attend) in silence
        ids += (FloatInput("attn_bias", axes=("graph", "from token", "to token"),
                           negative_infinity=True, pair_of="input_nodes"),)
        if c.edge_type == "multi_hop":
            return ids + (IdInput("input_edges", c.num_edges + 1, "num_edges + 1",
                                  axes=pair + ("hop", "feature")),)
        return ids + (IdInput("attn_edge_type", c.num_edges + 1, "num_edges + 1",
                              axes=pair + ("feature",)),)


@keras.saving.register_keras_serializable(package="kzoo")
class GraphormerPredictor(TaskModel):
    """Graph-level regression or classification from the graph token of a
    `GraphormerBackbone` (transformers' `GraphormerForGraphClassification`).

    `logits = backbone(inputs)[:, 0] @ W + b`, with a bias-free `W (hidden, num_classes)`
    (normal 0.02) and one learned scalar `b` (zero-initialised) shared by all outputs
    (`GraphormerDecoderHead`). `num_classes=1` is regression (one value per graph, e.g. with
    an MSE or MAE loss); `num_classes=C` gives logits for `C` classes or `C` binary tasks.

    Args:
        backbone: a `GraphormerBackbone`.
        num_classes: outputs per graph.
        dtype: dtype policy of the head (defaults to the backbone's).

    Returns:
        `(B, num_classes)`.

    Example:

    ```python
    from kzoo import graphs
    backbone = GraphormerBackbone(num_layers=2, hidden_dim=32, intermediate_dim=32,
                                  num_heads=4)
    model = GraphormerPredictor(backbone, num_classes=1)
    model.compile("adam", "mae")
    # pad_to_nodes: every batch has the same shapes (one compiled graph, and TensorFlow's
    # dataset adapter needs a fixed number of hops).
    data = graphs.smiles_dataset(["CCO", "c1ccccc1", "CC(=O)O"], [-5.0, -0.9, -6.7],
                                 batch_size=2, pad_to_nodes=8)
    model.fit(data, epochs=2)
    ```
    """

    family = FAMILY
    task_name = "predictor"

    def default_loss(self):
        """`compile`'s loss when given none: `kzoo.models.base.class_loss` (mean squared
        error with one output, a regression; sparse categorical cross-entropy on the
        logits with more; several binary tasks a graph need
        `keras.losses.BinaryCrossentropy(from_logits=True)` given to `compile`)."""
        return class_loss(self.num_classes)

    def __init__(self, backbone, num_classes=1, dtype=None, **kwargs):
        check_instance("backbone", backbone, GraphormerBackbone)
        num_classes = check_positive_int("num_classes", num_classes)
        dtype = dtype if dtype is not None else backbone.dtype_policy

        # === Layers ===
        head = GraphormerDecoderHead(num_classes, dtype=dtype, name="classifier")

        # === Functional Model ===
        inputs = backbone.input
        x = backbone(inputs)
        outputs = head(x[:, 0, :])
        kwargs.setdefault("name", "graphormer_predictor")
        super().__init__(inputs=inputs, outputs=outputs, dtype=dtype, **kwargs)

        # === Config ===
        self.backbone = backbone
        self.num_classes = num_classes
        self.head = head

    def _task_config(self):
        return {
            "num_classes": self.num_classes,
        }


GraphormerConfig.backbone_class = GraphormerBackbone

