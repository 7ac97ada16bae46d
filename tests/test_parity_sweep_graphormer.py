"""A randomized parity sweep of the Graphormer converter against Hugging Face transformers.

Hypothesis draws a batch of random graphs and a small transformers `GraphormerConfig` over every
field `kzoo/convert/graphormer.py` says it honours, builds `GraphormerForGraphClassification`
or `GraphormerModel`, perturbs every weight with a seeded generator, saves it with
`save_pretrained`, loads the directory with `kzoo.presets.load` and compares kzoo's float32
output with transformers' own at atol 1e-5 (the logits; the hidden states of `GraphormerModel`
at the real tokens). The inputs are made by transformers' own `preprocess_item` and
`GraphormerDataCollator` (its Cython Floyd-Warshall), which kzoo reads unchanged; kzoo's
`graphs.batch` of the same raw graphs must give those arrays exactly, and with
`multi_hop_max_dist` hops only, the same output. The loaded model, exported again with
`kzoo.presets.save(format="hf")`, must give transformers the original model's output.

Graphs: 1-9 nodes each (1-node graphs, no edges, random spanning trees for long shortest
paths, disconnected graphs with the 510 "unreachable" distance, directed or undirected edges,
self-loops, repeated edges whose features differ, where the last one wins in both pipelines),
0-3 node-feature and 0-2 edge-feature columns (0: the graph has no `node_feat` / `edge_attr`,
transformers gives each node and edge the feature 1), padded to the batch's largest graph;
the collator's `spatial_pos_max` drawn (1 masks every node pair, a node and itself too, and
kzoo's `graphs.batch` refuses it by name; 2 masks all but a node and itself; 1024 masks
nothing, not even unreachable pairs).

Config fields drawn: num_hidden_layers, num_attention_heads, embedding_dim (= heads * head
size), ffn_embedding_dim, num_classes, edge_type ("multi_hop", "single_hop" or any other string,
which transformers treats as single hop), multi_hop_max_dist (negative and 0: no cut; a cut
shorter or longer than the batch's paths), num_edge_dis, num_atoms / num_edges / num_in_degree
/ num_out_degree / num_spatial (from exactly the batch's largest id up, and the defaults),
pre_layernorm (its unused `final_layer_norm` perturbed too), encoder_normalize_before,
apply_graphormer_init, activation_fn (every name the converter documents), embed_scale, bias,
pad_token_id 0 or None, kdim / vdim equal to the width, and the fields that do nothing in
evaluation (dropouts, layerdrop, num_trans_layers_to_freeze, traceable, qn_block_size, max_nodes,
spatial_pos_max); some config.json files leave out every key at its default. The padding rows
(id 0) of the node, degree and spatial tables are perturbed too: kzoo reads them as zero and
transformers reads them only for padded nodes. The edge table's row 0 stays zero (transformers
reads it for "no edge"; the converter refuses a checkpoint where it is not, see
tests/test_graphormer.py).

Two transformers quirks, measured on 4.57 and tested as they are:
- `GraphormerDataCollator` reads the number of edge features from the first graph's
  `input_edges[0][0][0]`, which does not exist when that graph has one node (no hops): an
  IndexError. The sweep puts a graph of two or more nodes first.
- transformers' multi-hop encoding cannot run on a batch of 1-node graphs (0 hops: a reshape of
  0 elements with -1 fails); kzoo gives the output transformers gives with one all-padding hop.

Every option the converter refuses raises a `ValueError` naming the config.json key.

kzoo bug found by this sweep (fixed in kzoo/models/graphormer.py, `id_inputs`): a single-hop
model checked the ids of `input_edges`, which it never reads, and so refused batches whose
largest edge id is `num_edges` (those ids are one higher there); transformers runs them.

Examples are derandomized (the same cases every run), fewer on JAX, which compiles every drawn
model and shape.

The sweeps (mark `sweep`) run on torch by default and on JAX and TensorFlow too with
`make test-all` (tests/conftest.py).
"""

import copy
import json
import os
import tempfile

import keras
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.deprecated.graphormer.collating_graphormer import (  # compiles .pyx
    GraphormerDataCollator,
    preprocess_item,
)

import kzoo.presets
from kzoo import graphs
from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor
from tests.harness import assert_matches_transformers, hf_checkpoint
from tests.test_graphormer import _numpy
from tests.test_parity_sweep_t5_vit import (  # noqa: F401 (_one_torch_thread: autouse fixture)
    _edit_config,
    _first_then,
    _ints,
    _one_torch_thread,
    _perturb,
    sweep,
)

ATOL = 1e-5
BACKEND = keras.backend.backend()
# JAX compiles each drawn model (~5 s), TensorFlow traces it (~0.3 s), torch runs it (~0.1 s):
# the first 4 / 30 / 80 of the same derandomized draws.
EXAMPLES = {"jax": 4, "tensorflow": 30}.get(BACKEND, 80)

# `activation_fn` values the converter documents (kzoo/convert/graphormer.py), written out here.
ACTIVATIONS = ("gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
               "gelu_accurate", "quick_gelu", "relu", "silu", "swish", "tanh", "sigmoid",
               "linear")
CLASSIFIER = "GraphormerForGraphClassification"
EDGE_TABLE = "graph_attn_bias.edge_encoder.weight"


# === Graphs ===


def _random_graph(rng, num_nodes, node_columns, edge_columns, trees, density, directed,
                  self_loops, repeats, node_max, edge_max):
    """A graph dict in the OGB / `datasets` format (what `preprocess_item` reads): a random
    spanning tree (long shortest paths; "mixed": half of the graphs) and edges of `density`
    on top."""
    pairs = []
    if trees == "all" or (trees == "mixed" and rng.random() < 0.5):
        pairs = [(int(rng.integers(v)), v) for v in range(1, num_nodes)]
    pairs += [(u, v) for u in range(num_nodes) for v in range(num_nodes)
              if u != v and (directed or u < v) and (u, v) not in pairs
              and rng.random() < density]
    if self_loops:
        pairs += [(u, u) for u in range(num_nodes) if rng.random() < 0.5]
    attrs = [rng.integers(0, edge_max + 1, max(edge_columns, 1)) for _ in pairs]
    if not directed:  # both directions, the same features
        pairs, attrs = pairs + [(v, u) for u, v in pairs if u != v], attrs + [
            a for (u, v), a in zip(pairs, attrs) if u != v]
    for _ in range(repeats if pairs else 0):  # the same edge again, other features
        pairs.append(pairs[rng.integers(len(pairs))])
        attrs.append(rng.integers(0, edge_max + 1, max(edge_columns, 1)))
    order = rng.permutation(len(pairs))
    graph = {"num_nodes": num_nodes, "y": [0.0],
             "edge_index": np.array([pairs[i] for i in order], np.int64).reshape(-1, 2).T}
    if node_columns:
        graph["node_feat"] = rng.integers(0, node_max + 1, (num_nodes, node_columns))
    if edge_columns:
        graph["edge_attr"] = np.array([attrs[i] for i in order], np.int64).reshape(
            -1, edge_columns)
    return graph


@st.composite
def graph_batches(draw):
    """(raw graphs, the collator's spatial_pos_max). The first example: four graphs of 5, 1, 7
    and 3 nodes, two node-feature columns, one edge-feature column."""
    sizes = [draw(_ints(5, 2, 9), label="nodes[0]")]  # (the collator needs hops in graph 0)
    for default in (1, 7, 3)[: draw(_first_then(3, 0, 1, 2), label="more graphs")]:
        sizes.append(draw(_ints(default, 1, 9)))
    shape = dict(
        node_columns=draw(_first_then(2, 0, 1, 3), label="node feature columns"),
        edge_columns=draw(_first_then(1, 0, 2), label="edge feature columns"),
        trees=draw(_first_then("mixed", "all", "none"), label="spanning trees"),
        density=draw(_first_then(0.15, 0.0, 0.35, 0.6, 1.0), label="edge density"),
        directed=draw(_first_then(False, True), label="directed"),
        self_loops=draw(_first_then(False, True), label="self-loops"),
        repeats=draw(_first_then(1, 0, 3), label="repeated edges"),
        node_max=draw(_first_then(20, 0, 3, 511), label="largest node feature"),
        edge_max=draw(_first_then(4, 0, 511), label="largest edge feature"),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16), label="graph seed"))
    raw = [_random_graph(rng, n, **shape) for n in sizes]
    spatial_pos_max = draw(_first_then(20, 1, 2, 2.5, 3, 4, 1024), label="spatial_pos_max")
    return raw, spatial_pos_max


def _collate(raw, spatial_pos_max):
    """transformers' batch (torch tensors, no labels) of the raw graphs."""
    items = [preprocess_item(copy.deepcopy(g)) for g in raw]
    batch = GraphormerDataCollator(spatial_pos_max=spatial_pos_max)(items)
    batch.pop("labels")
    return batch


# === Configs ===


def _edge_ids_read(batch, edge_type):
    """The largest edge id of `batch` that the model reads (so the smallest `num_edges`):
    `input_edges`' for the multi-hop encoding, `attn_edge_type`'s (one less) for the
    single-hop one (each model checks only the one it reads, as transformers reads only
    that one: a self-loop's features are in `attn_edge_type` alone, on no path). At least 1:
    kzoo refuses a table of padding only (a batch without edges)."""
    key = "input_edges" if edge_type == "multi_hop" else "attn_edge_type"
    return max(int(batch[key].max()), 1)


@st.composite
def graphormer_configs(draw, batch):
    """A transformers `GraphormerConfig` dict whose tables fit `batch` (the collator's output)
    and no more than that, some of the time: transformers looks every id up."""
    hops = batch["input_edges"].shape[3]
    heads = draw(_first_then(2, 1, 3, 4), label="num_attention_heads")
    width = heads * draw(_first_then(4, 2, 8), label="head size")
    layers = draw(_first_then(2, 1, 3), label="num_hidden_layers")
    edge_type = draw(_first_then("multi_hop", "single_hop", "spatial"), label="edge_type")
    cut = draw(_first_then(5, -1, 0, 1, 2, 3, 20), label="multi_hop_max_dist")
    # Hop matrices transformers multiplies: the cut's, or every hop of the batch without one;
    # kzoo also needs one for every hop of the cut.
    needed_dis = max(cut, 1) if cut > 0 else max(hops, 1)

    def rows(needed, label, default):
        slack = draw(_first_then(0, 1, 7, None), label=label)
        return max(needed, default) if slack is None else needed + slack

    config = dict(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        embedding_dim=width,
        ffn_embedding_dim=draw(_first_then(24, 4, 7, 16, 33), label="ffn_embedding_dim"),
        num_classes=draw(_ints(3, 1, 5), label="num_classes"),
        edge_type=edge_type,
        multi_hop_max_dist=cut,
        num_edge_dis=rows(needed_dis, "num_edge_dis slack", 128),
        # ids: input_nodes <= num_atoms, degrees < num_*_degree, spatial_pos < num_spatial,
        # edge ids <= num_edges
        num_atoms=rows(int(batch["input_nodes"].max()), "num_atoms slack", 512 * 9),
        num_in_degree=rows(int(batch["in_degree"].max()) + 1, "num_in_degree slack", 512),
        num_out_degree=rows(int(batch["out_degree"].max()) + 1, "num_out_degree slack", 512),
        num_spatial=rows(int(batch["spatial_pos"].max()) + 1, "num_spatial slack", 512),
        num_edges=rows(_edge_ids_read(batch, edge_type), "num_edges slack", 512 * 3),
        pre_layernorm=draw(st.booleans(), label="pre_layernorm"),
        encoder_normalize_before=draw(st.booleans(), label="encoder_normalize_before"),
        apply_graphormer_init=draw(st.booleans(), label="apply_graphormer_init"),
        activation_fn=draw(st.sampled_from(ACTIVATIONS), label="activation_fn"),
        embed_scale=draw(_first_then(None, 0.5, 2.0, 3), label="embed_scale"),
        bias=draw(_first_then(True, False), label="bias"),
        pad_token_id=draw(_first_then(0, None), label="pad_token_id"),
        kdim=draw(_first_then(None, width), label="kdim"),
        vdim=draw(_first_then(None, width), label="vdim"),
        # no effect on transformers' forward pass in evaluation
        dropout=draw(_first_then(0.1, 0.0, 0.5)),
        attention_dropout=draw(_first_then(0.1, 0.0, 0.5)),
        activation_dropout=draw(_first_then(0.1, 0.0, 0.5)),
        layerdrop=draw(_first_then(0.0, 0.3)),
        num_trans_layers_to_freeze=draw(st.integers(0, layers)),
        traceable=draw(st.booleans()),
        qn_block_size=draw(_first_then(8, 4)),
        max_nodes=draw(_first_then(512, 7)),
        spatial_pos_max=draw(_first_then(1024, 20)),
    )
    return config


def _hf_model(path, config, architecture, seed, legacy_config):
    """The transformers model, perturbed (every parameter but the edge table's row 0) and
    saved to `path`; `legacy_config`: config.json without the keys at their defaults."""
    torch.manual_seed(seed)
    hf = getattr(transformers, architecture)(transformers.GraphormerConfig(**config)).eval()
    _perturb(hf, seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(EDGE_TABLE):
                param[0].zero_()
        if architecture == CLASSIFIER:
            # N(0, 0.02) + noise gives logits of ~0.2; larger ones make the bound say more
            hf.classifier.classifier.weight.mul_(10.0)
    hf_checkpoint(path, hf)
    if legacy_config:
        defaults = transformers.GraphormerConfig().to_dict()
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        drop = [k for k, v in saved.items()
                if k in defaults and k not in ("model_type", "hidden_size")
                and v == defaults[k]]
        _edit_config(path, drop=drop)
    return hf


def _check_config(model, hf_config):
    """The loaded model's architecture is the checkpoint's."""
    predictor = isinstance(model, GraphormerPredictor)
    backbone = model.backbone if predictor else model
    c = backbone.config
    assert (c.num_layers, c.num_heads, c.hidden_dim, c.intermediate_dim) == (
        hf_config.num_hidden_layers, hf_config.num_attention_heads, hf_config.embedding_dim,
        hf_config.ffn_embedding_dim)
    assert (c.num_atoms, c.num_edges, c.num_in_degree, c.num_out_degree, c.num_spatial,
            c.num_edge_dis) == (
        hf_config.num_atoms, hf_config.num_edges, hf_config.num_in_degree,
        hf_config.num_out_degree, hf_config.num_spatial, hf_config.num_edge_dis)
    assert c.edge_type == ("multi_hop" if hf_config.edge_type == "multi_hop" else "single_hop")
    assert c.multi_hop_max_dist == max(hf_config.multi_hop_max_dist, 0)
    assert (c.pre_layernorm, c.encoder_normalize_before, c.use_attention_bias,
            c.apply_graphormer_init, c.embed_scale, c.num_frozen_layers) == (
        hf_config.pre_layernorm, hf_config.encoder_normalize_before, hf_config.bias,
        hf_config.apply_graphormer_init, hf_config.embed_scale,
        hf_config.num_trans_layers_to_freeze)
    if predictor:
        assert model.num_classes == hf_config.num_classes


def _real_tokens(batch):
    """(B, N + 1) bool: the graph token and the real nodes."""
    nodes = np.asarray(batch["input_nodes"])
    return np.concatenate([np.ones((len(nodes), 1), bool), nodes[:, :, 0] != 0], axis=1)


def _assert_matches(model, hf, inputs, hf_inputs, label):
    if isinstance(model, GraphormerPredictor):
        return assert_matches_transformers(model, hf, inputs, hf_inputs, atol=ATOL,
                                           label=label + " logits")
    return assert_matches_transformers(model, hf, inputs, hf_inputs, atol=ATOL,
                                       mask=_real_tokens(inputs),
                                       label=label + " hidden states")


# === The sweep ===


@pytest.mark.sweep
@sweep(EXAMPLES)
@given(data=st.data())
def test_graphormer_outputs_match_transformers(data):
    raw, spatial_pos_max = data.draw(graph_batches(), label="graphs")
    batch = _collate(raw, spatial_pos_max)
    config = data.draw(graphormer_configs(batch), label="config")
    architecture = data.draw(_first_then(CLASSIFIER, "GraphormerModel"), label="architecture")
    legacy = data.draw(st.booleans(), label="legacy config.json")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    with tempfile.TemporaryDirectory() as path:
        hf = _hf_model(path, config, architecture, seed, legacy)
        model = kzoo.presets.load(path)
    assert isinstance(model, GraphormerPredictor if architecture == CLASSIFIER
                      else GraphormerBackbone)
    _check_config(model, hf.config)
    inputs = _numpy(batch)

    # kzoo's featurisation of the raw graphs is the collator's, array for array (it refuses
    # spatial_pos_max=1, which masks every node pair, a node and itself too).
    if spatial_pos_max <= 1:
        with pytest.raises(ValueError, match="spatial_pos_max"):
            graphs.batch(raw, multi_hop_max_dist=None, spatial_pos_max=spatial_pos_max)
    else:
        ours = graphs.batch(raw, multi_hop_max_dist=None, spatial_pos_max=spatial_pos_max)
        ours.pop("labels")
        assert sorted(ours) == sorted(inputs)
        for key, expected in inputs.items():
            assert ours[key].dtype == expected.dtype, key
            np.testing.assert_array_equal(ours[key], expected, err_msg=key)

    label = f"{architecture} {config} on {[g['num_nodes'] for g in raw]} nodes"
    _assert_matches(model, hf, inputs, batch, label)

    # Exported back (kzoo.presets.save(format="hf")), transformers computes the same.
    with tempfile.TemporaryDirectory() as path:
        kzoo.presets.save(model, path, format="hf")
        exported = getattr(transformers, architecture).from_pretrained(path).eval()
    with torch.no_grad():
        before, after = hf(**batch), exported(**batch)
    if architecture == CLASSIFIER:
        before, after = before.logits.numpy(), after.logits.numpy()
    else:
        real = _real_tokens(inputs)
        before, after = before.last_hidden_state.numpy()[real], \
            after.last_hidden_state.numpy()[real]
    np.testing.assert_allclose(after, before, atol=ATOL, rtol=0, err_msg=label + " exported")

    cut = config["multi_hop_max_dist"]
    if BACKEND != "jax" and config["edge_type"] == "multi_hop" and cut > 0 \
            and spatial_pos_max > 1:
        # kzoo's batch cut to the hops the model reads gives the same output (JAX would
        # compile another shape).
        short = graphs.batch(raw, multi_hop_max_dist=cut, spatial_pos_max=spatial_pos_max)
        short.pop("labels")
        assert short["input_edges"].shape[3] == min(cut, inputs["input_edges"].shape[3])
        _assert_matches(model, hf, short, batch, label + ", kzoo's batch cut")


# === transformers' quirks with 1-node graphs ===


def test_transformers_collator_needs_hops_in_the_first_graph():
    """`GraphormerDataCollator` reads the edge-feature count from the first graph's
    `input_edges[0][0][0]`: with a 1-node graph first it raises an IndexError; the same graphs
    in another order collate (so the sweep draws graph 0 with two or more nodes)."""
    single = {"num_nodes": 1, "edge_index": np.zeros((2, 0), np.int64), "y": [0.0]}
    pair = {"num_nodes": 2, "edge_index": np.array([[0, 1], [1, 0]]), "y": [0.0]}
    with pytest.raises(IndexError):
        _collate([single, pair], 20)
    batch = _collate([pair, single], 20)
    assert tuple(batch["input_edges"].shape) == (2, 2, 2, 1, 1)
    # kzoo's batch takes either order
    ours = graphs.batch([single, pair], multi_hop_max_dist=None)
    np.testing.assert_array_equal(ours["input_edges"], batch["input_edges"].numpy()[::-1])


SMALL_CONFIG = dict(num_hidden_layers=2, embedding_dim=8, ffn_embedding_dim=12,
                          num_attention_heads=2, num_atoms=600, num_edges=8, num_in_degree=4,
                          num_out_degree=4, num_spatial=4, num_edge_dis=5, num_classes=2)


@pytest.mark.spread
@pytest.mark.parametrize("edge_type", ["multi_hop", "single_hop"])
def test_batches_of_single_node_graphs(tmp_path, edge_type):
    """A batch of 1-node graphs has 0 hops. transformers' single-hop model runs on it;
    its multi-hop model fails (a reshape of 0 elements with -1), and kzoo's gives what it
    gives with one hop of padding (edge id 0), which adds nothing."""
    raw = [{"num_nodes": 1, "node_feat": [[k, 2 * k]], "edge_index": np.zeros((2, 0), np.int64)}
           for k in (1, 4, 9)]
    inputs = graphs.batch(raw, multi_hop_max_dist=None)
    assert inputs["input_edges"].shape == (3, 1, 1, 0, 1)
    hf = _hf_model(str(tmp_path), dict(SMALL_CONFIG, edge_type=edge_type), CLASSIFIER,
                   seed=3, legacy_config=False)
    model = kzoo.presets.load(str(tmp_path))
    hf_inputs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    padded_hop = dict(hf_inputs, input_edges=torch.zeros((3, 1, 1, 1, 1), dtype=torch.long))
    if edge_type == "multi_hop":
        with pytest.raises(RuntimeError, match="0 elements"), torch.no_grad():
            hf(**hf_inputs)
    else:
        _assert_matches(model, hf, inputs, hf_inputs, "1-node graphs, 0 hops")
    _assert_matches(model, hf, inputs, padded_hop, "1-node graphs vs one padding hop")


def test_single_hop_model_does_not_check_input_edges(tmp_path):
    """A single-hop model reads `attn_edge_type` and never `input_edges`, whose ids are one
    higher: with `num_edges` the batch's largest `attn_edge_type` id transformers runs, and
    so does kzoo (it refused the batch: "`input_edges` ... holds id 7 ...; ids must lie in
    [0, 7)"). A multi-hop model does read them: there the same table is refused by name
    (transformers fails with an IndexError)."""
    raw = [{"num_nodes": 3, "y": [0.0], "edge_index": np.array([[0, 1, 1, 2], [1, 0, 2, 1]]),
            "edge_attr": np.array([[4], [4], [2], [2]])},
           {"num_nodes": 2, "y": [0.0], "edge_index": np.array([[0, 1], [1, 0]]),
            "edge_attr": np.array([[1], [1]])}]
    batch = _collate(raw, 20)
    num_edges = int(batch["attn_edge_type"].max())
    assert int(batch["input_edges"].max()) == num_edges + 1
    for edge_type in ("single_hop", "multi_hop"):
        path = str(tmp_path / edge_type)
        hf = _hf_model(path, dict(SMALL_CONFIG, edge_type=edge_type, num_edges=num_edges),
                       CLASSIFIER, seed=5, legacy_config=False)
        model = kzoo.presets.load(path)
        if edge_type == "single_hop":
            _assert_matches(model, hf, _numpy(batch), batch, "single hop, smallest edge table")
            continue
        with pytest.raises(IndexError), torch.no_grad():
            hf(**batch)
        with pytest.raises(ValueError, match=r"`input_edges`.*num_edges \+ 1"):
            model.predict_on_batch(_numpy(batch))


def test_more_hops_than_hop_matrices(tmp_path):
    """`multi_hop_max_dist` (5) may exceed `num_edge_dis` (2): transformers runs batches whose
    paths have at most 2 hops, and so does kzoo, with the same output. A path of 3 hops has no
    hop matrix: transformers fails in a matrix product, kzoo names `num_edge_dis`."""
    def path_graph(n):
        edges = np.array([[i for i in range(n - 1)] + [i + 1 for i in range(n - 1)],
                          [i + 1 for i in range(n - 1)] + [i for i in range(n - 1)]])
        return {"num_nodes": n, "y": [0.0], "edge_index": edges,
                "edge_attr": np.arange(1, edges.shape[1] + 1)[:, None] % 4 + 1}
    short = _collate([path_graph(3), path_graph(2)], 20)  # at most 2 hops
    long = _collate([path_graph(4), path_graph(2)], 20)  # 3 hops
    assert short["input_edges"].shape[3] == 2 and long["input_edges"].shape[3] == 3
    config = dict(SMALL_CONFIG, num_edge_dis=2, multi_hop_max_dist=5, num_spatial=8)
    hf = _hf_model(str(tmp_path), config, CLASSIFIER, seed=7, legacy_config=False)
    model = kzoo.presets.load(str(tmp_path))
    assert (model.backbone.config.num_edge_dis,
            model.backbone.config.multi_hop_max_dist) == (2, 5)
    _assert_matches(model, hf, _numpy(short), short, "2 hops, 2 hop matrices")
    with pytest.raises(RuntimeError), torch.no_grad():
        hf(**long)
    with pytest.raises(ValueError, match=r"3 hops .*num_edge_dis=2"):
        model.predict_on_batch(_numpy(long))


# === Refused options ===

TINY = dict(num_hidden_layers=2, embedding_dim=16, ffn_embedding_dim=24, num_attention_heads=4,
            num_atoms=64, num_edges=64, num_in_degree=16, num_out_degree=16, num_spatial=16,
            num_edge_dis=8)

REFUSED = [
    # fields the converter names as unsupported
    ({"q_noise": 0.1}, "q_noise"),
    ({"freeze_embeddings": True}, "freeze_embeddings"),
    ({"share_input_output_embed": True}, "share_input_output_embed"),
    ({"kdim": 8}, "kdim"),
    ({"vdim": 32}, "vdim"),
    ({"pad_token_id": 1}, "pad_token_id"),
    # activations transformers has and kzoo does not
    ({"activation_fn": "mish"}, "activation_fn"),
    ({"activation_fn": "relu6"}, "activation_fn"),
    ({"activation_fn": "relu2"}, "activation_fn"),
    ({"activation_fn": "gelu_10"}, "activation_fn"),
    ({"activation_fn": "leaky_relu"}, "activation_fn"),
    ({"activation_fn": "laplace"}, "activation_fn"),
    # a head kzoo has no model for
    ({"architectures": ["GraphormerForNodeClassification"]}, "architectures"),
    # values kzoo's GraphormerConfig rejects, named by their config.json key
    ({"num_attention_heads": 3}, "num_attention_heads"),  # does not divide 16
    ({"multi_hop_max_dist": 2.5}, "multi_hop_max_dist"),
    ({"num_trans_layers_to_freeze": 3}, "num_trans_layers_to_freeze"),  # 2 layers
    ({"dropout": 1.5}, "dropout"),
    ({"attention_dropout": -0.1}, "attention_dropout"),
    ({"activation_dropout": 2.0}, "activation_dropout"),
    ({"layerdrop": 1.5}, "layerdrop"),
    ({"pre_layernorm": "yes"}, "pre_layernorm"),
    ({"encoder_normalize_before": "no"}, "encoder_normalize_before"),
    ({"apply_graphormer_init": "no"}, "apply_graphormer_init"),
    ({"bias": "no"}, "bias"),
    ({"embed_scale": "big"}, "embed_scale"),
    ({"num_atoms": 0}, "num_atoms"),
    ({"num_edges": -1}, "num_edges"),
    ({"num_in_degree": 0}, "num_in_degree"),
    ({"num_out_degree": 0}, "num_out_degree"),
    ({"num_spatial": 0}, "num_spatial"),
    ({"num_edge_dis": 0, "edge_type": "single_hop"}, "num_edge_dis"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"ffn_embedding_dim": 0}, "ffn_embedding_dim"),
    ({"embedding_dim": 0, "hidden_size": 0}, "embedding_dim"),
]


@pytest.mark.parametrize("edit,field", REFUSED,
                         ids=[f"{f}={list(e.values())[0]!r}" for e, f in REFUSED])
def test_refused_options_name_the_field(tmp_path, edit, field):
    """The configuration is refused before any weight is read: config.json alone."""
    config = transformers.GraphormerConfig(**TINY)
    config.architectures = [CLASSIFIER]
    config.save_pretrained(tmp_path)
    _edit_config(str(tmp_path), **edit)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):  # (not attention_dropout's)
        kzoo.presets.load(str(tmp_path))
