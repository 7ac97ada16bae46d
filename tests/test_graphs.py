"""kzoo.graphs against networkx (distances, paths), OGB's published featurisation and
Hugging Face transformers' Graphormer preprocessing (`preprocess_item`, the Floyd-Warshall of
`algos_graphormer` and `GraphormerDataCollator`)."""

import copy

import keras
import networkx as nx
import numpy as np
import pytest
from rdkit import Chem
from transformers.models.deprecated.graphormer.collating_graphormer import (  # compiles the .pyx
    GraphormerDataCollator,
    preprocess_item,
)
from transformers.models.deprecated.graphormer import algos_graphormer

from kzoo import graphs

# Different sizes; rings with several shortest paths between opposite atoms (benzene,
# naphthalene, cubane, a 12-ring, and cyclohexadiene and a bicycle where the alternative paths
# cross different bond types, so the path choice shows in input_edges); a disconnected salt
# (unreachable pairs, 510 sentinel); a single atom (no edges); caffeine.
MOLECULES = [
    "CCO",
    "c1ccccc1",
    "Cn1c(=O)c2c(ncn2C)n(C)c1=O",
    "CC(=O)[O-].[Na+]",
    "C",
    "C12C3C4C1C5C2C3C45",
    "c1ccc2ccccc2c1",
    "C1CCCCCCCCCCC1",
    "CC(C)Cc1ccc(cc1)C(C)C(=O)O",
    "C1=CC=CCC1",
    "O=C1C=CC2(CC1)C=CC(=O)N2",
]


def _edge_index(G):
    """Both directions of every edge of an undirected networkx graph (or the edges of a
    directed one), written here independently of kzoo."""
    pairs = list(G.edges())
    if not G.is_directed():
        pairs = pairs + [(v, u) for u, v in pairs]
    return np.array(pairs, dtype=np.int64).reshape(-1, 2).T


def _random_graphs():
    yield nx.connected_watts_strogatz_graph(30, 4, 0.2, seed=1)  # connected
    yield nx.gnp_random_graph(40, 0.04, seed=2)  # several components
    yield nx.disjoint_union(nx.cycle_graph(7), nx.grid_2d_graph(3, 4))  # two components
    yield nx.gnp_random_graph(25, 0.08, seed=3, directed=True)  # directed
    yield nx.empty_graph(5)  # no edges


def _as_int_graph(G):
    return nx.convert_node_labels_to_integers(G)


def _hf_collate(molecule_graphs, spatial_pos_max=20):
    items = [preprocess_item(copy.deepcopy(g)) for g in molecule_graphs]
    out = GraphormerDataCollator(spatial_pos_max=spatial_pos_max)(items)
    return {key: value.numpy() for key, value in out.items()}


def _assert_same(expected, actual, keys):
    for key in keys:
        e, a = np.asarray(expected[key]), np.asarray(actual[key])
        assert a.dtype == e.dtype, (key, a.dtype, e.dtype)
        assert a.shape == e.shape, (key, a.shape, e.shape)
        np.testing.assert_array_equal(a, e, err_msg=key)


# === Shortest paths ===


def test_shortest_path_lengths_match_networkx():
    for G in _random_graphs():
        G = _as_int_graph(G)
        n = G.number_of_nodes()
        dist, via = graphs.shortest_paths(n, _edge_index(G))
        expected = np.full((n, n), -1)
        for i, lengths in nx.all_pairs_shortest_path_length(G):
            for j, d in lengths.items():
                expected[i, j] = d
        np.testing.assert_array_equal(dist, expected)
        assert dist.dtype == np.int64 and via.shape == (n, n)
        assert np.all(via[dist < 2] == -1) and np.all(via[dist >= 2] >= 0)


def test_max_dist_counts_farther_pairs_as_unreachable():
    G = _as_int_graph(nx.disjoint_union(nx.path_graph(6), nx.cycle_graph(5)))
    dist, _ = graphs.shortest_paths(11, _edge_index(G), max_dist=2)
    expected = np.full((11, 11), -1)
    for i, lengths in nx.all_pairs_shortest_path_length(G, cutoff=2):
        for j, d in lengths.items():
            expected[i, j] = d
    np.testing.assert_array_equal(dist, expected)


def test_paths_are_shortest_paths_in_networkx():
    for G in [nx.grid_2d_graph(4, 5), nx.gnp_random_graph(20, 0.15, seed=4, directed=True),
              nx.gnp_random_graph(30, 0.06, seed=5)]:
        G = _as_int_graph(G)
        n = G.number_of_nodes()
        dist, via = graphs.shortest_paths(n, _edge_index(G))
        nodes = graphs.shortest_path_nodes(dist, via)
        lengths = dict(nx.all_pairs_shortest_path_length(G))
        assert nodes.shape == (n, n, dist.max() + 1)
        for i in range(n):
            for j in range(n):
                path = [int(v) for v in nodes[i, j] if v >= 0]
                if j not in lengths[i]:
                    assert path == []
                    continue
                assert len(path) == lengths[i][j] + 1
                assert path[0] == i and path[-1] == j
                assert all(G.has_edge(u, v) for u, v in zip(path, path[1:]))


def _hf_path(path, i, j):
    """transformers' recursive path reconstruction (algos_graphormer.get_all_edges)."""
    return [i] + algos_graphormer.get_all_edges(path, i, j) + [j]


@pytest.mark.parametrize("hops", [None, 2])
def test_paths_are_the_ones_transformers_floyd_warshall_picks(hops):
    # Grids, cycles and a hypercube have many shortest paths between most pairs.
    for G in [nx.grid_2d_graph(4, 4), nx.cycle_graph(8), nx.hypercube_graph(4),
              nx.gnp_random_graph(18, 0.2, seed=6, directed=True)]:
        G = _as_int_graph(G)
        n = G.number_of_nodes()
        edge_index = _edge_index(G)
        adjacency = np.zeros((n, n), dtype=bool)
        adjacency[edge_index[0], edge_index[1]] = True
        hf_dist, hf_path = algos_graphormer.floyd_warshall(adjacency)
        dist, via = graphs.shortest_paths(n, edge_index)
        reachable = hf_dist < algos_graphormer.UNREACHABLE_NODE_DISTANCE
        np.testing.assert_array_equal(dist[reachable], hf_dist[reachable])
        np.testing.assert_array_equal(via[reachable], hf_path[reachable])
        nodes = graphs.shortest_path_nodes(dist, via, max_hops=hops)
        for i, j in zip(*np.nonzero(reachable)):
            expected = _hf_path(hf_path, int(i), int(j)) if i != j else [int(i)]
            if hops is not None:
                expected = expected[: hops + 1]
            assert [int(v) for v in nodes[i, j] if v >= 0] == expected, (i, j)


# === Featurisation (OGB) ===

# Hand-checked OGB features: [atomic_num - 1, chirality, total degree, formal charge + 5,
# total Hs, radical electrons, hybridization (SP=0, SP2=1, SP3=2), aromatic, in ring] and
# bonds [type (SINGLE=0, DOUBLE=1, TRIPLE=2, AROMATIC=3), stereo, conjugated].
METHYL = [5, 0, 4, 5, 3, 0, 2, 0, 0]


def test_featurise_ethanol():
    g = graphs.from_smiles("CCO")
    assert g["num_nodes"] == 3
    np.testing.assert_array_equal(
        g["node_feat"], [METHYL, [5, 0, 4, 5, 2, 0, 2, 0, 0], [7, 0, 2, 5, 1, 0, 2, 0, 0]]
    )
    np.testing.assert_array_equal(g["edge_index"], [[0, 1, 1, 2], [1, 0, 2, 1]])
    np.testing.assert_array_equal(g["edge_attr"], np.zeros((4, 3)))
    assert g["node_feat"].dtype == g["edge_index"].dtype == g["edge_attr"].dtype == np.int64


def test_featurise_acetic_acid_and_acetate():
    acid = graphs.from_smiles("CC(=O)O")
    # The carbonyl carbon: 3 neighbours, no H, sp2; C=O and C-O are conjugated.
    np.testing.assert_array_equal(acid["node_feat"][1], [5, 0, 3, 5, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(acid["node_feat"][2], [7, 0, 1, 5, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(acid["edge_attr"][::2], [[0, 0, 0], [1, 0, 1], [0, 0, 1]])
    acetate = graphs.from_smiles("CC(=O)[O-]", y=[1.5])
    # The charged oxygen: formal charge -1 -> index 4, no hydrogen.
    np.testing.assert_array_equal(acetate["node_feat"][3], [7, 0, 1, 4, 0, 0, 1, 0, 0])
    assert acetate["y"] == [1.5]


def test_featurise_benzene_caffeine_ammonium_nitrile():
    benzene = graphs.from_smiles("c1ccccc1")
    np.testing.assert_array_equal(benzene["node_feat"], [[5, 0, 3, 5, 1, 0, 1, 1, 1]] * 6)
    np.testing.assert_array_equal(benzene["edge_attr"], [[3, 0, 1]] * 12)
    assert benzene["edge_index"].shape == (2, 12)

    caffeine = graphs.from_smiles("Cn1c(=O)c2c(ncn2C)n(C)c1=O")
    assert caffeine["num_nodes"] == 14 and caffeine["edge_index"].shape == (2, 30)
    np.testing.assert_array_equal(caffeine["node_feat"][0], METHYL)
    np.testing.assert_array_equal(caffeine["node_feat"][1], [6, 0, 3, 5, 0, 0, 1, 1, 1])  # ring N
    np.testing.assert_array_equal(caffeine["node_feat"][3], [7, 0, 1, 5, 0, 0, 1, 0, 0])  # =O
    np.testing.assert_array_equal(caffeine["node_feat"][7], [5, 0, 3, 5, 1, 0, 1, 1, 1])  # CH
    np.testing.assert_array_equal(caffeine["edge_attr"][[0, 4]], [[0, 0, 0], [1, 0, 1]])

    ammonium = graphs.from_smiles("[NH4+]")
    np.testing.assert_array_equal(ammonium["node_feat"], [[6, 0, 4, 6, 4, 0, 2, 0, 0]])
    assert ammonium["edge_index"].shape == (2, 0) and ammonium["edge_attr"].shape == (0, 3)

    nitrile = graphs.from_smiles("C#N")
    np.testing.assert_array_equal(nitrile["node_feat"][1], [6, 0, 1, 5, 0, 0, 0, 0, 0])  # sp N
    np.testing.assert_array_equal(nitrile["edge_attr"], [[2, 0, 0]] * 2)


def test_featurise_stereo_matches_ogb_docstring_example():
    # The example that ogb/utils/features.py documents next to its featurisation.
    mol = Chem.MolFromSmiles("Cl[C@H](/C=C/C)Br")
    assert graphs.atom_features(mol.GetAtomWithIdx(1)) == [5, 2, 4, 5, 1, 0, 2, 0, 0]
    assert graphs.bond_features(mol.GetBondWithIdx(2)) == [1, 2, 0]
    g = graphs.from_rdkit(mol)
    np.testing.assert_array_equal(g["edge_attr"][4], [1, 2, 0])
    np.testing.assert_array_equal(g["edge_index"][:, 4:6], [[2, 3], [3, 2]])
    hydrogens = graphs.from_smiles("C", add_hydrogens=True)
    assert hydrogens["num_nodes"] == 5 and hydrogens["edge_index"].shape == (2, 8)


def test_from_networkx():
    G = nx.Graph()
    G.add_node("a", feat=[1, 2])
    G.add_node("b", feat=[3, 4])
    G.add_node("c", feat=[5, 6])
    G.add_edge("a", "b", feat=[7])
    G.add_edge("b", "c", feat=[8])
    g = graphs.from_networkx(G, y=[0])
    assert g["num_nodes"] == 3 and g["y"] == [0]
    np.testing.assert_array_equal(g["node_feat"], [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(g["edge_index"], [[0, 1, 1, 2], [1, 0, 2, 1]])
    np.testing.assert_array_equal(g["edge_attr"], [[7], [7], [8], [8]])

    D = nx.DiGraph([(0, 1), (1, 2)])
    d = graphs.from_networkx(D)
    np.testing.assert_array_equal(d["edge_index"], [[0, 1], [1, 2]])
    assert "node_feat" not in d and "edge_attr" not in d
    G.add_node("d")
    with pytest.raises(ValueError, match="node_attr"):
        graphs.from_networkx(G)


# === Graphormer tensors vs transformers ===


def test_preprocess_matches_transformers_preprocess_item():
    for smiles in MOLECULES:
        g = graphs.from_smiles(smiles, y=[0.5])
        expected = preprocess_item(copy.deepcopy(g))
        actual = graphs.preprocess(g, multi_hop_max_dist=None)
        _assert_same(expected, actual, graphs.BATCH_KEYS)
        assert actual["labels"] == [0.5]


@pytest.mark.parametrize("spatial_pos_max", [20, 4])
def test_batch_matches_transformers_collator(spatial_pos_max):
    molecules = [graphs.from_smiles(s, y=[float(i)]) for i, s in enumerate(MOLECULES)]
    expected = _hf_collate(molecules, spatial_pos_max)
    actual = graphs.batch(molecules, multi_hop_max_dist=None, spatial_pos_max=spatial_pos_max)
    assert set(actual) == set(expected)
    _assert_same(expected, actual, expected)
    assert np.isneginf(actual["attn_bias"]).any()  # the salt's unreachable pairs (511 >= 4, 20)

    # Keeping 5 hops: transformers' model slices input_edges[..., :5, :] itself.
    short = graphs.batch(molecules, spatial_pos_max=spatial_pos_max)
    cut = dict(expected, input_edges=expected["input_edges"][..., :5, :])
    _assert_same(cut, short, expected)


def test_batch_of_preprocessed_graphs_labels_and_padding():
    molecules = [graphs.from_smiles(s) for s in ["CCO", "c1ccccc1", "CC(=O)O"]]
    for labels in ([[1], [0], [1]], [[0.5, np.nan], [1.0, 2.0], [3.0, 4.0]]):  # 1 / 2 tasks
        for g, y in zip(molecules, labels):
            g["y"] = y
        expected = _hf_collate(molecules)
        pre = [graphs.preprocess(g) for g in molecules]
        actual = graphs.batch(pre, return_node_mask=True)
        _assert_same(expected, actual, expected)
        np.testing.assert_array_equal(actual["node_mask"], expected["input_nodes"][..., 0] != 0)

    padded = graphs.batch(molecules, pad_to_nodes=8)
    for key in graphs.BATCH_KEYS:
        e, a = expected[key], padded[key]
        assert a.shape[1] == (9 if key == "attn_bias" else 8)
        if key == "input_edges":
            assert a.shape[3] == 5
        window = tuple(slice(0, s) for s in e.shape)
        np.testing.assert_array_equal(a[window], e, err_msg=key)
        rest = a.copy()
        rest[window] = 0
        assert not rest.any(), key  # padding is zero


def test_graph_without_features_matches_transformers():
    # No node_feat / edge_attr: transformers gives every node and edge the feature 1.
    g = {"num_nodes": 4, "edge_index": [[0, 1, 1, 2], [1, 0, 2, 1]], "y": [1]}
    expected = _hf_collate([g, dict(g, num_nodes=2, edge_index=[[0], [1]])])
    actual = graphs.batch([g, dict(g, num_nodes=2, edge_index=[[0], [1]])], multi_hop_max_dist=None)
    _assert_same(expected, actual, expected)


# === Bad input ===


def test_bad_inputs_raise_value_error():
    good = graphs.from_smiles("CCO")
    with pytest.raises(ValueError, match="edge_index.*num_nodes=3"):
        graphs.preprocess(dict(good, edge_index=[[0, 1], [1, 3]], edge_attr=[[0], [0]]))
    with pytest.raises(ValueError, match="edge_index.*num_nodes"):
        graphs.shortest_paths(3, [[0, -1], [1, 0]])
    with pytest.raises(ValueError, match=r"edge_index.*shape \(2, num_edges\)"):
        graphs.shortest_paths(3, [[0, 1], [1, 2], [2, 0]])
    with pytest.raises(ValueError, match="edge_attr.*one row per edge"):
        graphs.preprocess(dict(good, edge_attr=good["edge_attr"][:3]))
    with pytest.raises(ValueError, match="node_feat.*one row per node"):
        graphs.preprocess(dict(good, node_feat=good["node_feat"][:2]))
    with pytest.raises(ValueError, match="node_feat.*integers"):
        graphs.preprocess(dict(good, node_feat=good["node_feat"] + 0.5))
    with pytest.raises(ValueError, match=r"node_feat.*\[0, 512\)"):
        graphs.preprocess(dict(good, node_feat=good["node_feat"] - 6))
    with pytest.raises(ValueError, match="num_nodes"):
        graphs.preprocess(dict(good, num_nodes=0))
    with pytest.raises(ValueError, match="multi_hop_max_dist"):
        graphs.preprocess(good, multi_hop_max_dist=0)
    with pytest.raises(ValueError, match="graphs.*non-empty"):
        graphs.batch([])
    with pytest.raises(ValueError, match="single"):
        graphs.batch(good)
    with pytest.raises(ValueError, match=r"graphs\[1\].*edge_index"):
        graphs.batch([good, dict(good, edge_index=[[0, 5], [5, 0]])])
    with pytest.raises(ValueError, match=r"same number of features.*graphs\[1\]"):
        graphs.batch([good, dict(good, node_feat=good["node_feat"][:, :4])])
    with pytest.raises(ValueError, match="pad_to_nodes"):
        graphs.batch([good], pad_to_nodes=2)
    with pytest.raises(ValueError, match="labels"):
        graphs.batch([dict(good, y=[1]), good])
    with pytest.raises(ValueError, match=r"labels of one shape.*\(2,\) in graphs\[0\] and "
                                         r"\(1,\) in graphs\[1\]"):
        graphs.batch([dict(good, y=[1, 2]), dict(good, y=[3])])
    for limit in (float("nan"), 1, 0, -5):
        with pytest.raises(ValueError, match=f"spatial_pos_max={limit!r}"):
            graphs.batch([good], spatial_pos_max=limit)
    # inf: no pair is cut off
    assert graphs.batch([good], spatial_pos_max=float("inf"))["attn_bias"].min() == 0
    with pytest.raises(ValueError, match="smiles"):
        graphs.from_smiles("C1CC(")
    with pytest.raises(ValueError, match=r"smiles\[1\]"):
        graphs.smiles_dataset(["CC", "not a smiles"], [1, 2])
    with pytest.raises(ValueError, match="labels.*one entry per graph"):
        graphs.GraphDataset([good, good], labels=[1, 2, 3])


# === Dataset ===


def test_graph_dataset_batches_and_fit():
    smiles = ["C", "CC", "CCO", "c1ccccc1", "CC(=O)O", "CCN", "O"]
    targets = np.arange(len(smiles), dtype="float32")
    data = graphs.smiles_dataset(smiles, targets, batch_size=3, shuffle=True, seed=0,
                                 pad_to_nodes=6)
    assert len(data) == 3
    seen = []
    for epoch in range(2):
        for index in range(len(data)):
            inputs, y = data[index]
            assert set(inputs) == set(graphs.BATCH_KEYS)
            assert inputs["input_nodes"].shape[1:] == (6, 9)
            sizes = (inputs["input_nodes"][..., 0] > 0).sum(axis=1)
            # Each target is the index of its SMILES: its atom count must match.
            expected = [Chem.MolFromSmiles(smiles[int(t)]).GetNumAtoms() for t in y]
            np.testing.assert_array_equal(sizes, expected)
            seen.extend(y.tolist())
        data.on_epoch_end()
    assert sorted(seen) == sorted(targets.tolist() * 2)
    assert seen[:7] != seen[7:]  # reshuffled

    class Tiny(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(9 * 512 + 3, 4)
            self.head = keras.layers.Dense(1)

        def call(self, inputs):
            ids = inputs["input_nodes"]
            x = keras.ops.sum(self.embed(ids), axis=2)
            mask = keras.ops.cast(ids[..., :1] > 0, x.dtype)
            x = keras.ops.sum(x * mask, axis=1) / keras.ops.sum(mask, axis=1)
            return self.head(x)

    model = Tiny()
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(data, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
