"""Graph preprocessing for Graphormer (Ying et al. 2021, "Do Transformers Really Perform
Bad for Graph Representation?").

Everything here is plain, vectorised NumPy: it runs outside the model (in the input
pipeline), once per graph, and gives the model the integer tensors it embeds.

A *graph* is a dict in the OGB / Hugging Face `datasets` format:

- `num_nodes`: int, the number of nodes `n`;
- `node_feat`: `(n, F_node)` integer node features (optional: one feature `1` per node, as
  in transformers);
- `edge_index`: `(2, E)` integer source / target node ids (an undirected graph stores each
  edge in both directions);
- `edge_attr`: `(E, F_edge)` integer edge features (optional: one feature `1` per edge;
  OGB's own name `edge_feat` is read too);
- `y` or `labels`: optional targets.

`preprocess(graph)` turns one graph into the tensors of Hugging Face transformers'
`preprocess_item` (Graphormer, `models/deprecated/graphormer`), and `batch(graphs)` pads a
list of graphs like its `GraphormerDataCollator`; the values, dtypes and key names are the
same, so a kzoo Graphormer and `GraphormerForGraphClassification` can be fed identical
inputs. The per-graph tensors are, with `n` nodes:

- `input_nodes` `(n, F_node)` int64: `node_feat + 512 * column + 3` (one embedding table for
  all columns; 0 is padding);
- `attn_bias` `(n + 1, n + 1)` float32: zeros (row/column 0 is the virtual graph token);
  `batch` puts `-inf` where `spatial_pos >= spatial_pos_max`;
- `attn_edge_type` `(n, n, F_edge)` int64: `edge_attr + 512 * column + 2` at `[src, dst]`,
  0 where there is no edge;
- `spatial_pos` `(n, n)` int64: shortest-path distance + 1 (1 on the diagonal);
  unreachable pairs get `UNREACHABLE_DISTANCE + 1 = 511`;
- `in_degree`, `out_degree` `(n,)` int64: number of edges leaving a node + 1 (transformers
  uses the row sums of the adjacency matrix for both);
- `input_edges` `(n, n, hops, F_edge)` int32 (int64 after `batch`): the edge features along
  one shortest path from `i` to `j`, hop by hop, `attn_edge_type + 1`; 0 past the end of
  the path, on the diagonal and for unreachable pairs. `hops` is the largest distance in
  the graph (510 if a pair is unreachable, as in transformers) or `multi_hop_max_dist`,
  whichever is smaller;
- `labels`: `labels` or `y` of the graph, when it has one.

Shortest paths are those that transformers' Floyd-Warshall (`algos_graphormer.pyx`) picks:
for a pair `(i, j)` at distance >= 2 it stores the *pivot* `k` = the smallest possible
largest interior node over all shortest `i -> j` paths (the last `k` of the Floyd-Warshall
loop that strictly shortened `(i, j)`), and the path is `path(i, k) + path(k, j)`.
`shortest_paths` computes the distances by breadth-first search (one boolean matrix product
per BFS level) and the same pivots by dynamic programming over the BFS levels, so where a
graph has several shortest paths the edge features along them are the ones transformers
uses. Two corner cases of transformers are not reproduced: graphs with more than 510 nodes,
where it mistakes the pivot node 510 for its "unreachable" sentinel, and distances of 510
and more, which it calls unreachable (here too, so only the first case differs).
"""

import math

import keras
import numpy as np

# transformers' sentinel for "no path" (`UNREACHABLE_NODE_DISTANCE` in algos_graphormer.pyx).
UNREACHABLE_DISTANCE = 510
# Each feature column gets its own block of this many ids in one shared embedding table.
FEATURE_OFFSET = 512

# OGB's integer featurisation of RDKit atoms and bonds (ogb.utils.features, 1.3.x): every
# feature is the index of the RDKit value in its list; a value not in the list maps to the
# last entry ("misc").
ATOM_FEATURE_VOCABULARIES = (
    ("atomic_num", tuple(range(1, 119)) + ("misc",)),
    ("chirality", ("CHI_UNSPECIFIED", "CHI_TETRAHEDRAL_CW", "CHI_TETRAHEDRAL_CCW", "CHI_OTHER",
                   "misc")),
    ("degree", tuple(range(11)) + ("misc",)),
    ("formal_charge", tuple(range(-5, 6)) + ("misc",)),
    ("num_hs", tuple(range(9)) + ("misc",)),
    ("num_radical_electrons", tuple(range(5)) + ("misc",)),
    ("hybridization", ("SP", "SP2", "SP3", "SP3D", "SP3D2", "misc")),
    ("is_aromatic", (False, True)),
    ("is_in_ring", (False, True)),
)
BOND_FEATURE_VOCABULARIES = (
    ("bond_type", ("SINGLE", "DOUBLE", "TRIPLE", "AROMATIC", "misc")),
    ("stereo", ("STEREONONE", "STEREOZ", "STEREOE", "STEREOCIS", "STEREOTRANS", "STEREOANY")),
    ("is_conjugated", (False, True)),
)

BATCH_KEYS = (
    "input_nodes",
    "attn_bias",
    "attn_edge_type",
    "spatial_pos",
    "in_degree",
    "out_degree",
    "input_edges",
)

_LOOKUPS = {
    name: {value: index for index, value in enumerate(values)}
    for name, values in ATOM_FEATURE_VOCABULARIES + BOND_FEATURE_VOCABULARIES
}


# === Validation helpers ===


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_optional_positive_int(name, value):
    if value is None:
        return None
    if not _is_int(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer or None; got {name}={value!r}.")
    return int(value)


def _integer_array(name, value, ndim):
    """`value` as an int64 array of rank `ndim` (a rank-1 array gets a trailing axis when
    `ndim` is 2), or a ValueError naming `name`."""
    try:
        array = np.asarray(value)
    except Exception as error:  # ragged lists and the like
        raise ValueError(f"`{name}` must be a rectangular integer array; got {value!r}.") from error
    if array.size == 0 and array.dtype.kind not in "iub":
        array = array.astype(np.int64)
    if array.dtype.kind == "f":
        # Whole-valued floats (e.g. a float tensor of ids) are accepted as the integers they
        # hold; the first few other values are named.
        bad = array[~np.isfinite(array) | (array != np.round(array))]
        if bad.size:
            raise ValueError(
                f"`{name}` must hold integers (floats only with whole values, such as 2.0); "
                f"got {name} values {np.unique(bad)[:5].tolist()}."
            )
    elif array.dtype.kind not in "iub":
        raise ValueError(f"`{name}` must hold integers; got dtype {array.dtype} for {name}.")
    if ndim == 2 and array.ndim == 1:
        array = array[:, None]
    if array.ndim != ndim:
        raise ValueError(f"`{name}` must have rank {ndim}; got {name} with shape {array.shape}.")
    return array.astype(np.int64)


def _check_num_nodes(num_nodes):
    if not _is_int(num_nodes) or num_nodes <= 0:
        raise ValueError(f"`num_nodes` must be a positive integer; got num_nodes={num_nodes!r}.")
    return int(num_nodes)


def _check_edge_index(num_nodes, edge_index):
    edge_index = np.asarray(edge_index)
    if edge_index.dtype == np.bool_:
        # (True / False were read as nodes 1 / 0: booleans are flags, never node ids)
        raise ValueError(
            "`edge_index` must hold integer node ids (floats only with whole values); got "
            "a boolean array."
        )
    if edge_index.size == 0:
        edge_index = edge_index.reshape(2, 0)
    edge_index = _integer_array("edge_index", edge_index, 2)
    if edge_index.shape[0] != 2:
        raise ValueError(
            "`edge_index` must have shape (2, num_edges); "
            f"got edge_index with shape {edge_index.shape}."
        )
    if edge_index.size and (edge_index.min() < 0 or edge_index.max() >= num_nodes):
        bad = edge_index[(edge_index < 0) | (edge_index >= num_nodes)]
        raise ValueError(
            f"`edge_index` must hold node ids in [0, num_nodes={num_nodes}); got edge_index "
            f"values {sorted(set(bad.tolist()))[:10]}."
        )
    return edge_index


def _check_features(name, features, rows, rows_name):
    features = _integer_array(name, features, 2)
    if features.shape[0] != rows:
        raise ValueError(
            f"`{name}` must have one row per {rows_name} ({rows}); got {name} with shape "
            f"{features.shape}."
        )
    if features.size and (features.min() < 0 or features.max() >= FEATURE_OFFSET):
        raise ValueError(
            f"`{name}` values must lie in [0, {FEATURE_OFFSET}) so that feature columns do "
            f"not share embedding ids; got values in [{features.min()}, {features.max()}]."
        )
    return features


def _read_graph(graph):
    """Validated `(num_nodes, node_feat, edge_index, edge_attr)` of a graph dict."""
    if not isinstance(graph, dict):
        raise ValueError(
            "`graph` must be a dict with `num_nodes`, `edge_index` and optionally `node_feat`, "
            f"`edge_attr`, `y`; got {type(graph).__name__}."
        )
    if "edge_index" not in graph:
        raise ValueError(f"`graph` must have an `edge_index` entry; got keys {sorted(graph)}.")
    if "num_nodes" in graph:
        num_nodes = graph["num_nodes"]
    elif graph.get("node_feat") is not None:
        num_nodes = len(graph["node_feat"])
    else:
        raise ValueError(f"`graph` must have a `num_nodes` entry; got keys {sorted(graph)}.")
    num_nodes = _check_num_nodes(num_nodes)
    edge_index = _check_edge_index(num_nodes, graph["edge_index"])
    num_edges = edge_index.shape[1]
    if graph.get("node_feat") is not None:
        node_feat = _check_features("node_feat", graph["node_feat"], num_nodes, "node")
    else:
        node_feat = np.ones((num_nodes, 1), dtype=np.int64)  # as transformers: all alike
    edge_attr = graph.get("edge_attr", graph.get("edge_feat"))
    if edge_attr is not None:
        edge_attr = np.asarray(edge_attr)
        if edge_attr.size == 0:
            edge_attr = edge_attr.reshape(0, edge_attr.shape[-1] if edge_attr.ndim == 2 else 1)
        edge_attr = _check_features("edge_attr", edge_attr, num_edges, "edge")
    else:
        edge_attr = np.ones((num_edges, 1), dtype=np.int64)
    return num_nodes, node_feat, edge_index, edge_attr


# === Featurisation ===


def _lookup(name, value):
    table = _LOOKUPS[name]
    return table.get(value, len(table) - 1)


def atom_features(atom):
    """OGB's 9 integer features of an RDKit atom (`ogb.utils.features.atom_to_feature_vector`).

    The features are, in order: atomic number (1..118 -> 0..117), chirality tag, total degree
    (0..10), formal charge (-5..5 -> 0..10), total number of hydrogens (0..8), number of
    radical electrons (0..4), hybridization (SP, SP2, SP3, SP3D, SP3D2), is aromatic, is in a
    ring; the vocabularies are `ATOM_FEATURE_VOCABULARIES`, and anything outside a vocabulary
    maps to its last ("misc") entry. (OGB does the same, so RDKit's newer chirality tags such
    as `CHI_TETRAHEDRAL` become "misc".)

    Args:
        atom: an `rdkit.Chem.Atom`.

    Returns:
        A list of 9 ints.

    Example:

    >>> from rdkit import Chem
    >>> atom_features(Chem.MolFromSmiles("CO").GetAtomWithIdx(1))
    [7, 0, 2, 5, 1, 0, 2, 0, 0]
    """
    return [
        _lookup("atomic_num", atom.GetAtomicNum()),
        _lookup("chirality", str(atom.GetChiralTag())),
        _lookup("degree", atom.GetTotalDegree()),
        _lookup("formal_charge", atom.GetFormalCharge()),
        _lookup("num_hs", atom.GetTotalNumHs()),
        _lookup("num_radical_electrons", atom.GetNumRadicalElectrons()),
        _lookup("hybridization", str(atom.GetHybridization())),
        _lookup("is_aromatic", bool(atom.GetIsAromatic())),
        _lookup("is_in_ring", bool(atom.IsInRing())),
    ]


def bond_features(bond):
    """OGB's 3 integer features of an RDKit bond (`ogb.utils.features.bond_to_feature_vector`).

    The features are bond type (SINGLE, DOUBLE, TRIPLE, AROMATIC, misc), stereo (STEREONONE,
    STEREOZ, STEREOE, STEREOCIS, STEREOTRANS, STEREOANY) and is conjugated. OGB raises on a
    stereo value outside its list (RDKit's newer atropisomer tags); here it maps to the last
    entry, as every other feature does.

    Args:
        bond: an `rdkit.Chem.Bond`.

    Returns:
        A list of 3 ints.

    Example:

    >>> from rdkit import Chem
    >>> bond_features(Chem.MolFromSmiles("C=O").GetBondWithIdx(0))
    [1, 0, 0]
    """
    return [
        _lookup("bond_type", str(bond.GetBondType())),
        _lookup("stereo", str(bond.GetStereo())),
        _lookup("is_conjugated", bool(bond.GetIsConjugated())),
    ]


def from_rdkit(mol, y=None):
    """An RDKit molecule as a graph dict with OGB's featurisation (`ogb.utils.smiles2graph`).

    Atoms become nodes with `atom_features`, each bond becomes two directed edges
    `(begin, end)` and `(end, begin)`, stored next to each other in bond order, both with
    `bond_features`. Hydrogens are nodes only if they are explicit atoms of `mol`.

    Args:
        mol: an `rdkit.Chem.Mol` with at least one atom.
        y: optional target(s), stored under `"y"`.

    Returns:
        `{"num_nodes": n, "node_feat": (n, 9) int64, "edge_index": (2, 2 * bonds) int64,
        "edge_attr": (2 * bonds, 3) int64}` (+ `"y"`).

    Example:

    >>> from rdkit import Chem
    >>> graph = from_rdkit(Chem.MolFromSmiles("CCO"))
    >>> graph["edge_index"].tolist()
    [[0, 1, 1, 2], [1, 0, 2, 1]]
    """
    if mol is None or not hasattr(mol, "GetAtoms"):
        raise ValueError(f"`mol` must be an rdkit.Chem.Mol; got mol={mol!r}.")
    if mol.GetNumAtoms() == 0:
        raise ValueError("`mol` must have at least one atom; got a molecule with 0 atoms.")
    node_feat = np.array([atom_features(atom) for atom in mol.GetAtoms()], dtype=np.int64)
    bonds = list(mol.GetBonds())
    ends = np.array(
        [(bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()) for bond in bonds], dtype=np.int64
    ).reshape(-1, 2)
    feats = np.array([bond_features(bond) for bond in bonds], dtype=np.int64).reshape(-1, 3)
    # (begin, end) then (end, begin) for every bond, interleaved as OGB stores them.
    edge_index = np.stack([ends, ends[:, ::-1]], axis=1).reshape(-1, 2).T.copy()
    edge_attr = np.repeat(feats, 2, axis=0)
    graph = {
        "num_nodes": int(mol.GetNumAtoms()),
        "node_feat": node_feat,
        "edge_index": edge_index,
        "edge_attr": edge_attr,
    }
    if y is not None:
        graph["y"] = y
    return graph


def from_smiles(smiles, y=None, add_hydrogens=False):
    """A SMILES string as a graph dict with OGB's featurisation (see `from_rdkit`).

    Args:
        smiles: a SMILES string.
        y: optional target(s), stored under `"y"`.
        add_hydrogens: add explicit hydrogen atoms (OGB's `removeHs=False`).

    Returns:
        The graph dict of `from_rdkit`.

    Example:

    >>> graph = from_smiles("CC(=O)O", y=[4.76])
    >>> graph["num_nodes"], graph["node_feat"].shape, graph["edge_attr"].shape
    (4, (4, 9), (6, 3))
    """
    from rdkit import Chem

    if not isinstance(smiles, str) or not smiles:
        raise ValueError(f"`smiles` must be a non-empty string; got smiles={smiles!r}.")
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        raise ValueError(f"`smiles` is not a valid SMILES string: smiles={smiles!r}.")
    if add_hydrogens:
        mol = Chem.AddHs(mol)
    return from_rdkit(mol, y=y)


def from_networkx(G, node_attr="feat", edge_attr="feat", y=None):
    """A networkx graph as a graph dict.

    Nodes are numbered in `G.nodes` order. An undirected graph stores each edge in both
    directions (`(u, v)` then `(v, u)`, a self-loop once); a directed graph stores its edges
    as they are.

    Args:
        G: a `networkx.Graph`, `DiGraph`, `MultiGraph` or `MultiDiGraph` with >= 1 node.
        node_attr: name of the node attribute holding an int or a list of ints, or None.
            If None, or if no node has it, the graph gets no `node_feat`.
        edge_attr: name of the edge attribute holding an int or a list of ints, or None.
            If None, or if no edge has it, the graph gets no `edge_attr`.
        y: optional target(s), stored under `"y"`.

    Returns:
        `{"num_nodes", "edge_index"}` plus `"node_feat"`, `"edge_attr"`, `"y"` where present.

    Example:

    >>> import networkx as nx
    >>> G = nx.path_graph(3)
    >>> nx.set_edge_attributes(G, 1, "feat")
    >>> from_networkx(G)["edge_index"].tolist()
    [[0, 1, 1, 2], [1, 0, 2, 1]]
    """
    if not hasattr(G, "nodes") or not hasattr(G, "edges") or not hasattr(G, "is_directed"):
        raise ValueError(f"`G` must be a networkx graph; got {type(G).__name__}.")
    nodes = list(G.nodes)
    if not nodes:
        raise ValueError("`G` must have at least one node; got an empty graph.")
    position = {node: index for index, node in enumerate(nodes)}
    pairs, attrs = [], []
    for u, v, data in G.edges(data=True):
        i, j = position[u], position[v]
        value = None if edge_attr is None else data.get(edge_attr)
        copies = [(i, j)] if G.is_directed() or i == j else [(i, j), (j, i)]
        pairs.extend(copies)
        attrs.extend([value] * len(copies))
    graph = {
        "num_nodes": len(nodes),
        "edge_index": np.array(pairs, dtype=np.int64).reshape(-1, 2).T.copy(),
    }
    if node_attr is not None:
        values = [G.nodes[node].get(node_attr) for node in nodes]
        if any(value is not None for value in values):
            missing = [node for node, value in zip(nodes, values) if value is None]
            if missing:
                raise ValueError(
                    f"`node_attr`={node_attr!r} is missing on nodes {missing[:10]}; every node "
                    "needs it, or none."
                )
            graph["node_feat"] = _integer_array("node_feat", values, 2)
    if edge_attr is not None and any(value is not None for value in attrs):
        if any(value is None for value in attrs):
            raise ValueError(
                f"`edge_attr`={edge_attr!r} is missing on some edges; every edge needs it, or none."
            )
        graph["edge_attr"] = _integer_array("edge_attr", attrs, 2)
    if y is not None:
        graph["y"] = y
    return graph


# === Shortest paths ===


def shortest_paths(num_nodes, edge_index, max_dist=None):
    """All-pairs shortest path lengths and Floyd-Warshall pivots of an unweighted graph.

    Distances come from a breadth-first search run from every node at once: the frontier
    of BFS level `d` is one boolean `(n, n)` matrix, and level `d + 1` is the boolean matrix
    product `frontier @ adjacency` (computed edge-wise, `O(E * n)` per level) minus what was
    reached before. The pivots are the intermediate
    nodes that transformers' Floyd-Warshall (`algos_graphormer.floyd_warshall`) records:
    for `dist[i, j] >= 2`, `via[i, j]` is the smallest possible largest interior node of a
    shortest `i -> j` path, found level by level from
    `via[i, j] = min over edges i -> k with dist[k, j] = dist[i, j] - 1 of max(k, via[k, j])`.
    `shortest_path_nodes(dist, via)` turns them into paths.

    Edges are directed `edge_index[0] -> edge_index[1]`; self-loops and repeated edges
    change nothing.

    Args:
        num_nodes: number of nodes `n` (> 0).
        edge_index: `(2, E)` integer array of edges; floats are accepted when they are
            whole numbers (as everywhere in this module), other floats and booleans raise
            `ValueError`.
        max_dist: optional positive int; pairs farther apart count as unreachable.

    Returns:
        `(dist, via)`, two `(n, n)` int64 arrays: `dist[i, j]` is the number of edges of a
        shortest `i -> j` path (0 on the diagonal, -1 if unreachable) and `via[i, j]` the
        pivot node (-1 where `dist[i, j] < 2`).

    Example:

    >>> dist, via = shortest_paths(4, [[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    >>> dist[0].tolist(), via[0].tolist()
    ([0, 1, 2, 3], [-1, -1, 1, 2])
    """
    n = _check_num_nodes(num_nodes)
    edge_index = _check_edge_index(n, edge_index)
    if max_dist is not None and (not _is_int(max_dist) or max_dist < 0):
        raise ValueError(
            f"`max_dist` must be a non-negative integer or None; got max_dist={max_dist!r}."
        )
    limit = n - 1 if max_dist is None else min(int(max_dist), n - 1)

    adjacency = np.zeros((n, n), dtype=bool)
    adjacency[edge_index[0], edge_index[1]] = True
    np.fill_diagonal(adjacency, False)
    # Distinct edges sorted by source node (np.nonzero is row-major) for the pivots, and
    # sorted by target node for the BFS: per-group reductions with ufunc.reduceat.
    src, dst = np.nonzero(adjacency)
    starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]]) if src.size else src
    sources = src[starts]
    dst_t, src_t = np.nonzero(adjacency.T)
    starts_t = np.flatnonzero(np.r_[True, dst_t[1:] != dst_t[:-1]]) if dst_t.size else dst_t
    targets = dst_t[starts_t]

    dist = np.full((n, n), -1, dtype=np.int64)
    np.fill_diagonal(dist, 0)
    via = np.full((n, n), -1, dtype=np.int64)
    index = np.arange(n)
    # reached[k, i] / frontier[k, i]: node k is within / at the current distance of source i
    # (transposed, so that one gather of rows follows all edges into a node).
    reached = np.eye(n, dtype=bool)
    frontier = reached.copy()
    # Keep each (edges x columns) block to about 4M entries.
    block = max(1, (1 << 22) // max(1, src.size))
    for level in range(1, limit + 1):
        new = np.zeros((n, n), dtype=bool)
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            new[targets, lo:hi] = np.logical_or.reduceat(frontier[src_t, lo:hi], starts_t, axis=0)
        new &= ~reached
        if not new.any():
            break
        reached |= new
        frontier = new
        new = new.T
        dist[new] = level
        if level < 2:
            continue
        # key[k, j] = max(k, via[k, j]) where k -> ... -> j is one level shorter, else n:
        # a pair (i, j) of this level takes the smallest key over the edges i -> k.
        key = np.where(dist == level - 1, np.maximum(index[:, None], via), n).astype(np.int32)
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            best = np.minimum.reduceat(key[dst, lo:hi], starts, axis=0)
            part = via[sources, lo:hi]
            via[sources, lo:hi] = np.where(new[sources, lo:hi], best, part)
    return dist, via


def shortest_path_nodes(dist, via, max_hops=None):
    """The node sequences of the shortest paths that `shortest_paths` describes.

    The path `i -> j` is `[i, j]` for an edge and `path(i, k) + path(k, j)` (without `k`
    twice) for the pivot `k = via[i, j]`, as transformers' `get_all_edges` builds it. Built
    level by level over the distances, all pairs at once.

    Args:
        dist: `(n, n)` distances from `shortest_paths` (-1 = unreachable).
        via: `(n, n)` pivots from `shortest_paths`.
        max_hops: optional non-negative int: keep only the first `max_hops` edges (the first
            `max_hops + 1` nodes) of every path. Default: the largest distance.

    Returns:
        `(n, n, hops + 1)` int64: `nodes[i, j, t]` is the `t`-th node of the path from `i` to
        `j` (`nodes[i, j, 0] = i`), -1 past its end and for unreachable pairs.

    Example:

    >>> dist, via = shortest_paths(3, [[0, 1, 1, 2], [1, 0, 2, 1]])
    >>> shortest_path_nodes(dist, via)[0, 2].tolist()
    [0, 1, 2]
    """
    dist = np.asarray(dist)
    via = np.asarray(via)
    if dist.ndim != 2 or dist.shape[0] != dist.shape[1] or via.shape != dist.shape:
        raise ValueError(
            "`dist` and `via` must be square (n, n) arrays of the same shape; got "
            f"dist with shape {dist.shape} and via with shape {via.shape}."
        )
    n = dist.shape[0]
    longest = int(dist.max()) if dist.size else 0
    if max_hops is None:
        hops = longest
    elif not _is_int(max_hops) or max_hops < 0:
        raise ValueError(
            f"`max_hops` must be a non-negative integer or None; got max_hops={max_hops!r}."
        )
    else:
        hops = int(max_hops)
    nodes = np.full((n, n, hops + 1), -1, dtype=np.int64)
    index = np.arange(n)
    nodes[index, index, 0] = index
    i, j = np.nonzero(dist == 1)
    nodes[i, j, 0] = i
    if hops >= 1:
        nodes[i, j, 1] = j
    steps = np.arange(hops + 1)
    for level in range(2, longest + 1):
        i, j = np.nonzero(dist == level)
        if i.size == 0:
            continue
        k = via[i, j]
        if np.any(k < 0):
            raise ValueError("`via` has no pivot for a pair at distance >= 2; pass the `via` "
                             "that `shortest_paths` returned with `dist`.")
        split = dist[i, k][:, None]  # the pivot's position on the path
        left = nodes[i, k]
        right = np.take_along_axis(nodes[k, j], np.clip(steps - split, 0, hops), axis=1)
        path = np.where(steps <= split, left, right)
        nodes[i, j] = np.where(steps <= level, path, -1)
    return nodes


# === Graphormer tensors ===


def preprocess(graph, multi_hop_max_dist=5):
    """One graph's Graphormer tensors, as transformers' `preprocess_item` makes them.

    See the module docstring for every tensor. With `multi_hop_max_dist=None` the output
    equals `preprocess_item(graph)`'s exactly (values and dtypes); with an int `h`,
    `input_edges` keeps only its first `h` hops (Graphormer's `multi_hop_max_dist`: the model
    reads no more than that, and disconnected graphs otherwise get 510 hops).

    Args:
        graph: a graph dict (`num_nodes`, `edge_index`, optional `node_feat`, `edge_attr`,
            `y` / `labels`). Feature values must lie in [0, 512).
        multi_hop_max_dist: positive int or None: hops of `input_edges` to keep.

    Returns:
        A dict of NumPy arrays with keys `input_nodes`, `attn_bias`, `attn_edge_type`,
        `spatial_pos`, `in_degree`, `out_degree`, `input_edges` and `labels` (if the graph
        has `labels` or `y`).

    Example:

    >>> item = preprocess(from_smiles("CCO"))
    >>> item["spatial_pos"].tolist()
    [[1, 2, 3], [2, 1, 2], [3, 2, 1]]
    >>> item["input_edges"].shape
    (3, 3, 2, 3)
    """
    multi_hop_max_dist = _check_optional_positive_int("multi_hop_max_dist", multi_hop_max_dist)
    n, node_feat, edge_index, edge_attr = _read_graph(graph)
    node_columns = FEATURE_OFFSET * np.arange(node_feat.shape[1], dtype=np.int64)
    edge_columns = FEATURE_OFFSET * np.arange(edge_attr.shape[1], dtype=np.int64)

    attn_edge_type = np.zeros((n, n, edge_attr.shape[1]), dtype=np.int64)
    attn_edge_type[edge_index[0], edge_index[1]] = edge_attr + edge_columns + 2
    adjacency = np.zeros((n, n), dtype=bool)
    adjacency[edge_index[0], edge_index[1]] = True
    in_degree = adjacency.sum(axis=1).astype(np.int64) + 1

    dist, via = shortest_paths(n, edge_index, max_dist=UNREACHABLE_DISTANCE - 1)
    longest = int(dist.max())
    spatial = np.where(dist < 0, UNREACHABLE_DISTANCE, dist)
    # transformers sizes input_edges by the largest entry of its distance matrix, the
    # "unreachable" sentinel included.
    hops = int(spatial.max())
    if multi_hop_max_dist is not None:
        hops = min(hops, multi_hop_max_dist)
    walked = min(hops, longest)
    nodes = shortest_path_nodes(dist, via, max_hops=walked)
    heads, tails = nodes[:, :, :-1], nodes[:, :, 1:]
    on_path = (tails >= 0)[..., None]
    edges = attn_edge_type[np.maximum(heads, 0), np.maximum(tails, 0)]
    input_edges = np.zeros((n, n, hops, edge_attr.shape[1]), dtype=np.int32)
    input_edges[:, :, :walked] = np.where(on_path, edges + 1, 0)

    item = {
        "input_nodes": node_feat + node_columns + 3,
        "attn_bias": np.zeros((n + 1, n + 1), dtype=np.float32),
        "attn_edge_type": attn_edge_type,
        "spatial_pos": spatial.astype(np.int64) + 1,
        "in_degree": in_degree,
        "out_degree": in_degree.copy(),
        "input_edges": input_edges,
    }
    labels = graph.get("labels", graph.get("y"))
    if labels is not None:
        item["labels"] = labels
    return item


def _as_item(index, graph, multi_hop_max_dist):
    """A preprocessed graph, or a ValueError that says which graph was bad."""
    if isinstance(graph, dict) and "input_nodes" in graph:
        missing = [key for key in BATCH_KEYS if key not in graph]
        if missing:
            raise ValueError(
                f"graphs[{index}] looks preprocessed (it has `input_nodes`) but lacks {missing}."
            )
        try:
            return _check_item(graph)
        except ValueError as error:
            raise ValueError(f"graphs[{index}] (preprocessed): {error}") from None
    try:
        return preprocess(graph, multi_hop_max_dist=multi_hop_max_dist)
    except ValueError as error:
        raise ValueError(f"graphs[{index}]: {error}") from None


def _check_item(item):
    """A preprocessed graph (`preprocess`'s or transformers' `preprocess_item`'s dict) with
    its tensors checked against one another, as int64 / float32 arrays.

    (Such a dict was stacked as given: fractional ids were truncated to int64 in silence,
    and a tensor of another node count failed in NumPy's broadcasting, naming no key.)"""
    nodes = _integer_array("input_nodes", item["input_nodes"], 2)
    n = nodes.shape[0]
    if n == 0:
        raise ValueError(
            f"`input_nodes` must have one row per node (at least one); got shape {nodes.shape}.")
    expected = {"attn_edge_type": (n, n, None), "spatial_pos": (n, n), "in_degree": (n,),
                "out_degree": (n,), "input_edges": (n, n, None, None)}
    checked = dict(item, input_nodes=nodes)
    for key, shape in expected.items():
        array = _integer_array(key, item[key], len(shape))
        if any(want is not None and got != want for got, want in zip(array.shape, shape)):
            raise ValueError(
                f"`{key}` must have shape {tuple('?' if d is None else d for d in shape)} for "
                f"a graph of {n} nodes (the rows of `input_nodes`); got {key} with shape "
                f"{array.shape}."
            )
        checked[key] = array
    try:
        bias = np.asarray(item["attn_bias"])
    except Exception as error:  # ragged lists and the like
        raise ValueError(f"`attn_bias` must be a rectangular float array; got {error}") from None
    if bias.dtype.kind not in "iuf":
        raise ValueError(f"`attn_bias` must hold numbers; got dtype {bias.dtype}.")
    if bias.shape != (n + 1, n + 1):
        raise ValueError(
            f"`attn_bias` must have shape {(n + 1, n + 1)} for a graph of {n} nodes (one "
            f"row and column more for the graph token); got attn_bias with shape "
            f"{bias.shape}."
        )
    checked["attn_bias"] = bias.astype(np.float32)
    return checked


def _check_graph_list(graphs):
    if isinstance(graphs, (dict, str)) or not hasattr(graphs, "__len__"):
        raise ValueError(
            f"`graphs` must be a non-empty list of graph dicts; got {type(graphs).__name__} "
            "(wrap a single graph in a list)."
        )
    if len(graphs) == 0:
        raise ValueError(
            f"`graphs` must be a non-empty list of graph dicts; got graphs={graphs!r}."
        )


def _stack_labels(items):
    has = [item.get("labels") is not None for item in items]
    if not any(has):
        return None
    if not all(has):
        raise ValueError(
            "`graphs` must all have labels (`y` or `labels`) or none; graphs "
            f"{[i for i, h in enumerate(has) if not h][:10]} have none."
        )
    labels = []
    for index, item in enumerate(items):
        # (strings and dicts became a batch of str / object labels, ragged ones NumPy's
        # "inhomogeneous shape" error, naming no graph)
        try:
            label = np.asarray(item["labels"])
        except ValueError:
            label = None
        if label is None or label.dtype.kind not in "biuf":
            raise ValueError(
                f"graphs[{index}]: the labels (`y` or `labels`) must be a number or a "
                f"rectangular array of numbers; got {item['labels']!r:.80}."
            )
        labels.append(label)
    labels = [label.reshape(1) if label.ndim == 0 else label for label in labels]
    shapes = [label.shape for label in labels]
    odd = [i for i, shape in enumerate(shapes) if shape != shapes[0]]
    if odd:
        raise ValueError(
            "`graphs` must all have labels of one shape (the same number of targets); got "
            f"labels of shape {shapes[0]} in graphs[0] and {shapes[odd[0]]} in "
            f"graphs[{odd[0]}]."
        )
    # GraphormerDataCollator: one target per graph -> concatenate, several -> stack.
    if len(labels[0]) == 1:
        return np.concatenate(labels)
    return np.stack(labels, axis=0)


def batch(graphs, multi_hop_max_dist=5, spatial_pos_max=20, pad_to_nodes=None,
          return_node_mask=False):
    """Pad a list of graphs into one Graphormer batch, as `GraphormerDataCollator` does.

    Every per-graph tensor of `preprocess` is zero-padded to the largest graph (`N` nodes)
    and stacked; `attn_bias` gets `-inf` where `spatial_pos >= spatial_pos_max` (real node
    pairs only). A padded node is recognisable by `input_nodes[b, i, 0] == 0` (what
    transformers' model uses as its padding mask), or by `node_mask` when asked for.

    With `multi_hop_max_dist=None` and `pad_to_nodes=None` the output equals
    `GraphormerDataCollator(spatial_pos_max)([preprocess_item(g) for g in graphs])` exactly,
    key by key (as NumPy arrays). With an int `h` (the default 5, Graphormer's
    `multi_hop_max_dist`), `input_edges` is that collator's `input_edges[..., :h, :]`, which
    gives the model the same inputs at a fraction of the memory.

    Args:
        graphs: a non-empty list of graph dicts, raw or already `preprocess`ed (with the same
            numbers of node and edge features).
        multi_hop_max_dist: positive int or None: hops of `input_edges` to keep.
        spatial_pos_max: pairs at `spatial_pos >= spatial_pos_max` (i.e. distance
            `>= spatial_pos_max - 1`, or unreachable) may not attend to each other.
        pad_to_nodes: optional int: pad to this many nodes instead of the largest graph's,
            and `input_edges` to exactly `multi_hop_max_dist` hops (when it is an int), so
            that every batch has the same shape (no retracing under `jit`); zero-padded hops
            add nothing in Graphormer. Graphs must not be larger.
        return_node_mask: also return `node_mask`, `(B, N)` bool, True for real nodes.

    Returns:
        A dict of NumPy arrays, with `B = len(graphs)`, `N` nodes, `H` hops:
        `input_nodes` `(B, N, F_node)` int64, `attn_bias` `(B, N + 1, N + 1)` float32,
        `attn_edge_type` `(B, N, N, F_edge)` int64, `spatial_pos` `(B, N, N)` int64,
        `in_degree` and `out_degree` `(B, N)` int64, `input_edges` `(B, N, N, H, F_edge)`
        int64, and `labels` when the graphs have targets: `(B,)` (or `(B, ...)`) for one
        target per graph, `(B, T)` for `T` targets (the labels' own dtype, e.g. int64 or
        float64); plus `node_mask` if asked for.

    Example:

    >>> inputs = batch([from_smiles("CCO", y=[1]), from_smiles("c1ccccc1", y=[0])])
    >>> inputs["input_nodes"].shape, inputs["input_edges"].shape, inputs["labels"].tolist()
    ((2, 6, 9), (2, 6, 6, 3, 3), [1, 0])
    """
    _check_graph_list(graphs)
    multi_hop_max_dist = _check_optional_positive_int("multi_hop_max_dist", multi_hop_max_dist)
    if isinstance(spatial_pos_max, (bool, np.bool_)) or not isinstance(
            spatial_pos_max, (int, float, np.integer, np.floating)):
        raise ValueError(
            f"`spatial_pos_max` must be a number; got spatial_pos_max={spatial_pos_max!r}."
        )
    if not spatial_pos_max > 1:  # (NaN too: it would cut nothing, silently)
        raise ValueError(
            "`spatial_pos_max` must be a number above 1 (a node's distance code to itself "
            "is 1: a limit of 1 or less cuts every pair of nodes off), or inf for no limit; "
            f"got spatial_pos_max={spatial_pos_max!r}."
        )
    pad_to_nodes = _check_optional_positive_int("pad_to_nodes", pad_to_nodes)
    if not isinstance(return_node_mask, (bool, np.bool_)):
        raise ValueError(
            f"`return_node_mask` must be True or False; got return_node_mask="
            f"{return_node_mask!r}."
        )

    items = [_as_item(index, graph, multi_hop_max_dist) for index, graph in enumerate(graphs)]
    sizes = [len(item["input_nodes"]) for item in items]
    shapes = {
        "input_nodes": [np.shape(item["input_nodes"])[-1] for item in items],
        "attn_edge_type": [np.shape(item["attn_edge_type"])[-1] for item in items],
        "input_edges": [np.shape(item["input_edges"])[-1] for item in items],
    }
    for key, widths in shapes.items():
        odd = [index for index, width in enumerate(widths) if width != widths[0]]
        if odd:
            raise ValueError(
                f"`graphs` must all have the same number of features; got {key} with "
                f"{widths[0]} features in graphs[0] and {widths[odd[0]]} in graphs[{odd[0]}]."
            )
    n_max = max(sizes)
    hops = max(np.shape(item["input_edges"])[2] for item in items)
    if multi_hop_max_dist is not None:
        hops = min(hops, multi_hop_max_dist)
    if pad_to_nodes is not None:
        if pad_to_nodes < n_max:
            raise ValueError(
                f"`pad_to_nodes`={pad_to_nodes} is smaller than the largest graph "
                f"(graphs[{sizes.index(n_max)}] has {n_max} nodes)."
            )
        n_max = pad_to_nodes
        if multi_hop_max_dist is not None:
            hops = multi_hop_max_dist
    size = len(items)
    f_node = shapes["input_nodes"][0]
    f_edge = shapes["attn_edge_type"][0]
    f_hop = shapes["input_edges"][0]

    out = {
        "input_nodes": np.zeros((size, n_max, f_node), dtype=np.int64),
        "attn_bias": np.zeros((size, n_max + 1, n_max + 1), dtype=np.float32),
        "attn_edge_type": np.zeros((size, n_max, n_max, f_edge), dtype=np.int64),
        "spatial_pos": np.zeros((size, n_max, n_max), dtype=np.int64),
        "in_degree": np.zeros((size, n_max), dtype=np.int64),
        "input_edges": np.zeros((size, n_max, n_max, hops, f_hop), dtype=np.int64),
    }
    for b, (item, n) in enumerate(zip(items, sizes)):
        out["input_nodes"][b, :n] = item["input_nodes"]
        out["attn_bias"][b, : n + 1, : n + 1] = item["attn_bias"]
        out["attn_edge_type"][b, :n, :n] = item["attn_edge_type"]
        out["spatial_pos"][b, :n, :n] = item["spatial_pos"]
        out["in_degree"][b, :n] = item["in_degree"]
        edges = np.asarray(item["input_edges"])[:, :, :hops]
        out["input_edges"][b, :n, :n, : edges.shape[2]] = edges
    # Padded pairs have spatial_pos 0, so only real pairs can be cut off.
    far = out["spatial_pos"] >= spatial_pos_max
    out["attn_bias"][:, 1:, 1:][far] = -np.inf
    out["out_degree"] = out["in_degree"].copy()
    labels = _stack_labels(items)
    if labels is not None:
        out["labels"] = labels
    if return_node_mask:
        out["node_mask"] = np.arange(n_max)[None, :] < np.asarray(sizes)[:, None]
    return out


# === Datasets ===


class GraphDataset(keras.utils.PyDataset):
    """Batches of graphs for `model.fit` / `evaluate` / `predict`.

    Yields `(inputs, labels)` per batch, where `inputs` is the dict of `batch` without
    `labels`; or only `inputs` when there are no labels. Graphs are preprocessed once, when
    first used, and cached.

    Args:
        graphs: list of graph dicts (raw or preprocessed).
        labels: optional array with one entry per graph; if None, the graphs' own `y` /
            `labels` are used (if they have them).
        batch_size: graphs per batch.
        shuffle: reshuffle the order at the start of every epoch.
        seed: seed of the shuffling.
        multi_hop_max_dist, spatial_pos_max, pad_to_nodes: as in `batch`.
        **kwargs: `workers`, `use_multiprocessing`, `max_queue_size` of `PyDataset`.

    Example:

    >>> data = GraphDataset([from_smiles(s) for s in ["C", "CC", "CCO"]], labels=[0, 1, 1],
    ...                     batch_size=2)
    >>> inputs, y = data[0]
    >>> len(data), inputs["spatial_pos"].shape, y.tolist()
    (2, (2, 2, 2), [0, 1])
    """

    def __init__(self, graphs, labels=None, batch_size=32, shuffle=False, seed=None,
                 multi_hop_max_dist=5, spatial_pos_max=20, pad_to_nodes=None, **kwargs):
        super().__init__(**kwargs)
        _check_graph_list(graphs)
        if not _is_int(batch_size) or batch_size <= 0:
            raise ValueError(
                f"`batch_size` must be a positive integer; got batch_size={batch_size!r}."
            )
        self.graphs = list(graphs)
        if labels is not None:
            labels = np.asarray(labels)
            if labels.ndim == 0 or len(labels) != len(self.graphs):
                raise ValueError(
                    f"`labels` must have one entry per graph ({len(self.graphs)}); got labels "
                    f"with shape {labels.shape}."
                )
        self.labels = labels
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.multi_hop_max_dist = _check_optional_positive_int("multi_hop_max_dist",
                                                               multi_hop_max_dist)
        self.spatial_pos_max = spatial_pos_max
        self.pad_to_nodes = _check_optional_positive_int("pad_to_nodes", pad_to_nodes)
        self._rng = np.random.default_rng(seed)
        self._cache = [None] * len(self.graphs)
        self._order = np.arange(len(self.graphs))
        if self.shuffle:
            self._rng.shuffle(self._order)

    def __len__(self):
        return math.ceil(len(self.graphs) / self.batch_size)

    def _item(self, index):
        if self._cache[index] is None:
            self._cache[index] = _as_item(index, self.graphs[index], self.multi_hop_max_dist)
        return self._cache[index]

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches.")
        chosen = self._order[index * self.batch_size : (index + 1) * self.batch_size]
        inputs = batch(
            [self._item(int(i)) for i in chosen],
            multi_hop_max_dist=self.multi_hop_max_dist,
            spatial_pos_max=self.spatial_pos_max,
            pad_to_nodes=self.pad_to_nodes,
        )
        labels = inputs.pop("labels", None)
        if self.labels is not None:
            labels = self.labels[chosen]
        return inputs if labels is None else (inputs, labels)

    def on_epoch_end(self):
        if self.shuffle:
            self._rng.shuffle(self._order)


def smiles_dataset(smiles, targets=None, batch_size=32, shuffle=False, seed=None, **kwargs):
    """A `GraphDataset` of molecules given as SMILES strings (OGB featurisation).

    Args:
        smiles: list of SMILES strings.
        targets: optional array with one target (or row of targets) per molecule.
        batch_size, shuffle, seed, **kwargs: as in `GraphDataset`.

    Example:

    >>> data = smiles_dataset(["CCO", "c1ccccc1", "CC(=O)O"], [0.1, 0.2, 0.3], batch_size=2)
    >>> inputs, y = data[1]
    >>> inputs["input_nodes"].shape, y.tolist()
    ((1, 4, 9), [0.3])
    """
    if isinstance(smiles, str) or not hasattr(smiles, "__len__") or len(smiles) == 0:
        raise ValueError(f"`smiles` must be a non-empty list of SMILES strings; got {smiles!r}.")
    graphs = []
    for index, text in enumerate(smiles):
        try:
            graphs.append(from_smiles(text))
        except ValueError as error:
            raise ValueError(f"smiles[{index}]: {error}") from None
    return GraphDataset(graphs, labels=targets, batch_size=batch_size, shuffle=shuffle,
                        seed=seed, **kwargs)
