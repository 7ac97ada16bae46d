"""Public API entry points given hostile input (a second round after `test_hostile_utils.py`
and `test_hostile_layers.py`): a ValueError that names the argument, its value and what is
allowed, instead of a silently wrong result or an error from deep inside NumPy / a backend."""

import numpy as np
import pytest

from kzoo import graphs

# === graphs.batch ===

_GRAPH = {"num_nodes": 3, "edge_index": [[0, 1], [1, 2]], "node_feat": [[1], [2], [3]],
          "edge_attr": [[1], [1]], "y": [1]}


def test_batch_checks_preprocessed_graphs_it_stacks():
    item = graphs.preprocess(_GRAPH)
    expected = graphs.batch([_GRAPH])
    # Valid preprocessed graphs (arrays or lists, whole-valued floats) stack as before ...
    as_lists = {key: np.asarray(value).tolist() for key, value in item.items()}
    as_floats = dict(item, input_nodes=item["input_nodes"].astype("float32"))
    for given in (item, as_lists, as_floats):
        got = graphs.batch([given])
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    # ... fractional ids were truncated to int64 in silence ...
    with pytest.raises(ValueError, match=r"graphs\[1\] \(preprocessed\): `input_nodes` must "
                                         r"hold integers.*\[4\.5, 5\.5, 6\.5\]"):
        graphs.batch([item, dict(item, input_nodes=item["input_nodes"] + 0.5)])
    # ... and a tensor of another node count failed in NumPy's broadcasting, naming no key.
    with pytest.raises(ValueError, match=r"graphs\[0\] \(preprocessed\): `spatial_pos` must "
                                         r"have shape \(3, 3\) .*got spatial_pos with shape "
                                         r"\(2, 2\)"):
        graphs.batch([dict(item, spatial_pos=np.ones((2, 2), "int64"))])
    with pytest.raises(ValueError, match=r"`attn_bias` must have shape \(4, 4\)"):
        graphs.batch([dict(item, attn_bias=np.zeros((3, 3), "float32"))])
    with pytest.raises(ValueError, match=r"`input_edges` must have rank 4"):
        graphs.batch([dict(item, input_edges=item["input_edges"][..., 0])])


@pytest.mark.parametrize("label", ["a", {"a": 1}, [[1], [1, 2]], None])
def test_batch_refuses_labels_that_are_not_numbers(label):
    # Strings and dicts became a batch of str / object labels, ragged ones NumPy's
    # "inhomogeneous shape" error naming no graph.
    if label is None:  # a graph without a label: no labels at all, as before
        assert "labels" not in graphs.batch([dict(_GRAPH, y=None)])
        return
    with pytest.raises(ValueError, match=r"graphs\[1\]: the labels \(`y` or `labels`\) must "
                                         r"be a number or a rectangular array of numbers"):
        graphs.batch([_GRAPH, dict(_GRAPH, y=label)])


def test_batch_return_node_mask_must_be_a_bool():
    assert "node_mask" in graphs.batch([_GRAPH], return_node_mask=np.bool_(True))
    with pytest.raises(ValueError, match=r"`return_node_mask` must be True or False; got "
                                         r"return_node_mask='no'"):
        graphs.batch([_GRAPH], return_node_mask="no")
