"""Id checks at every user entry point (`kzoo.inputs`, wired in `kzoo.models.base`).

For each family with ids (GPT, BERT, T5, Graphormer) a tiny task model gets a batch with one
id out of its table, too large or negative, at a known position, through `model(x)`,
`predict`, `fit`, `evaluate`, `train_on_batch`, `test_on_batch`, `predict_on_batch`, a
`tf.data.Dataset`, a Python generator and a `keras.utils.PyDataset`: each raises a
`ValueError` whose message names the input, the id and its position. The table sizes and
positions are the test's own (read from the config fields it sets, not from the checker).
Valid ids (NumPy int32 / int64, backend tensors, -1 fillers under a padding mask) still run
and give the same outputs; float and bool ids are refused; symbolic and traced calls are
not checked.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kzoo
from kzoo import graphs
from kzoo.inputs import IdInput, check_inputs, is_symbolic
from kzoo.models.bert import BertBackbone, BertClassifier, BertMaskedLM
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM
from tests.harness import QUICKER_LOOP

# Keras' own note that `shuffle` does not apply to datasets and generators.
pytestmark = pytest.mark.filterwarnings("ignore:`shuffle=True` was passed:UserWarning")

BACKEND = keras.backend.backend()
VOCAB = 40
BATCH, SEQ = 4, 6


# === The families: a tiny task model, valid data, and where each id input's table ends ===


def _tokens(rng, shape, high=VOCAB):
    return rng.integers(1, high, size=shape).astype("int32")


def _gpt():
    model = GPTCausalLM(GPTBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                    hidden_dim=8, intermediate_dim=16, max_sequence_length=16))
    rng = np.random.default_rng(0)
    x = {"token_ids": _tokens(rng, (BATCH, SEQ)), "padding_mask": np.ones((BATCH, SEQ), "int32")}
    y = _tokens(rng, (BATCH, SEQ))
    return model, x, y, {"token_ids": VOCAB}


def _bert():
    backbone = BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                            intermediate_dim=16, max_sequence_length=16, num_segments=3)
    model = BertClassifier(backbone, num_classes=2, dropout=0.0)
    rng = np.random.default_rng(1)
    x = {"token_ids": _tokens(rng, (BATCH, SEQ)),
         "segment_ids": rng.integers(0, 3, size=(BATCH, SEQ)).astype("int32"),
         "padding_mask": np.ones((BATCH, SEQ), "int32")}
    y = rng.integers(0, 2, size=(BATCH,)).astype("int32")
    return model, x, y, {"token_ids": VOCAB, "segment_ids": 3}


def _t5():
    model = T5Seq2SeqLM(T5Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                   hidden_dim=8, key_value_dim=4, intermediate_dim=16,
                                   dropout=0.0))
    rng = np.random.default_rng(2)
    ones = np.ones((BATCH, SEQ), "int32")
    x = {"encoder_token_ids": _tokens(rng, (BATCH, SEQ)), "encoder_padding_mask": ones,
         "decoder_token_ids": _tokens(rng, (BATCH, SEQ)), "decoder_padding_mask": ones}
    y = _tokens(rng, (BATCH, SEQ))
    return model, x, y, {"encoder_token_ids": VOCAB, "decoder_token_ids": VOCAB}


GRAPHORMER_TABLES = dict(num_atoms=20, num_in_degree=6, num_out_degree=7, num_edges=12,
                         num_spatial=9)


def _graph(n, feature):
    src = np.arange(n - 1)
    edge_index = np.stack([np.r_[src, src + 1], np.r_[src + 1, src]])  # a path
    return {"num_nodes": n, "edge_index": edge_index,
            "node_feat": np.full((n, 1), feature), "edge_attr": np.ones((2 * (n - 1), 1),
                                                                        "int64")}


def _graphormer(edge_type="multi_hop"):
    backbone = GraphormerBackbone(**GRAPHORMER_TABLES, num_edge_dis=4, multi_hop_max_dist=2,
                                  edge_type=edge_type,
                                  num_layers=1, hidden_dim=8, intermediate_dim=8,
                                  num_heads=2, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    model = GraphormerPredictor(backbone, num_classes=1)
    x = graphs.batch([_graph(n, f) for n, f in ((3, 1), (5, 2), (4, 3), (2, 4))],
                     multi_hop_max_dist=2)
    t = GRAPHORMER_TABLES
    sizes = {"input_nodes": t["num_atoms"] + 1, "in_degree": t["num_in_degree"],
             "out_degree": t["num_out_degree"], "spatial_pos": t["num_spatial"],
             "attn_edge_type": t["num_edges"] + 1, "input_edges": t["num_edges"] + 1}
    for key, size in sizes.items():  # the valid batch really is valid
        assert 0 <= x[key].min() and x[key].max() < size, key
    y = np.arange(BATCH, dtype="float32")[:, None]
    return model, x, y, sizes


FAMILIES = {"gpt": _gpt, "bert": _bert, "t5": _t5, "graphormer": _graphormer}
# A Graphormer reads one of its two edge inputs: `input_edges` (multi-hop, the one above) or
# `attn_edge_type` (single-hop, this one); only the one it reads is checked.
OTHER_MODELS = {"graphormer_single_hop": lambda: _graphormer("single_hop")}
LOSSES = {
    "gpt": lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "bert": lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "t5": lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "graphormer": lambda: "mse",
    "graphormer_single_hop": lambda: "mse",
}
# How a position reads in the message, by input (the axes of each array).
AXES = {
    "token_ids": ("batch row", "token"), "segment_ids": ("batch row", "token"),
    "encoder_token_ids": ("batch row", "token"), "decoder_token_ids": ("batch row", "token"),
    "input_nodes": ("graph", "node", "feature"), "in_degree": ("graph", "node"),
    "out_degree": ("graph", "node"), "spatial_pos": ("graph", "from node", "to node"),
    "attn_edge_type": ("graph", "from node", "to node", "feature"),
    "input_edges": ("graph", "from node", "to node", "hop", "feature"),
}

_BUILT = {}


def _family(name):
    """The family's (model, x, y, sizes), built once per test module and compiled."""
    if name not in _BUILT:
        model, x, y, sizes = {**FAMILIES, **OTHER_MODELS}[name]()
        model.compile(optimizer="sgd", loss=LOSSES[name]())
        _BUILT[name] = model, x, y, sizes
    return _BUILT[name]


def _bad(x, key, value, row=1):
    """A copy of `x` with `value` at (row, 2, 0, 0, ...) of `x[key]`; that position."""
    bad = {k: np.array(v, copy=True) for k, v in x.items()}
    index = (row, 2) + (0,) * (bad[key].ndim - 2)
    bad[key][index] = value
    return bad, index


def _message(key, value, index, source=None):
    """The pattern of the error: the input, where the data came from, the id, its position."""
    where = ", ".join(f"{axis} {i}" for axis, i in zip(AXES[key], index))
    source = ".*" if source is None else re.escape(source)
    return rf"`{key}` \({source}\) holds id {value} at {re.escape(where)}\b"


BAD_CASES = [(family, key, kind) for family, build in
             (("gpt", ["token_ids"]), ("bert", ["token_ids", "segment_ids"]),
              ("t5", ["encoder_token_ids", "decoder_token_ids"]),
              ("graphormer", ["input_nodes", "in_degree", "out_degree", "spatial_pos",
                              "input_edges"]),
              ("graphormer_single_hop", ["attn_edge_type"]))
             for key in build for kind in ("too_large", "negative")]


def _bad_value(sizes, key, kind):
    return sizes[key] if kind == "too_large" else -1


# === Out-of-range ids at every entry point that takes arrays ===


@pytest.mark.spread
@pytest.mark.parametrize("family,key,kind", BAD_CASES)
def test_out_of_range_id_is_refused_by_every_array_entry_point(family, key, kind):
    model, x, y, sizes = _family(family)
    value = _bad_value(sizes, key, kind)
    bad, index = _bad(x, key, value)
    message = _message(key, value, index)
    calls = {
        "call": lambda: model(bad),
        "predict": lambda: model.predict(bad, verbose=0),
        "fit": lambda: model.fit(bad, y, epochs=1, verbose=0),
        "evaluate": lambda: model.evaluate(bad, y, verbose=0),
        "train_on_batch": lambda: model.train_on_batch(bad, y),
        "test_on_batch": lambda: model.test_on_batch(bad, y),
        "predict_on_batch": lambda: model.predict_on_batch(bad),
        "fit validation_data": lambda: model.fit(x, y, validation_data=(bad, y), verbose=0),
        "backbone call": lambda: model.backbone(bad),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
    # The messages name the entry point and the allowed range.
    with pytest.raises(ValueError, match=rf"fit's validation_data.*\[0, {sizes[key]}\)"):
        calls["fit validation_data"]()


@pytest.mark.spread
@pytest.mark.parametrize("family, unread", [("graphormer", "attn_edge_type"),
                                             ("graphormer_single_hop", "input_edges")])
def test_graphormer_edge_input_it_does_not_read_is_not_checked(family, unread):
    """A multi-hop Graphormer reads `input_edges`, a single-hop one `attn_edge_type`, as
    transformers' does: ids past the table in the other one are neither refused nor read
    (each was refused: a single-hop batch whose largest edge id is `num_edges` has that id
    + 1 in `input_edges`; a self-loop's features are only in `attn_edge_type`)."""
    model, x, _, sizes = _family(family)
    bad, _ = _bad(x, unread, sizes[unread] + 5)
    np.testing.assert_array_equal(_outputs(model, bad), _outputs(model, x))
    np.testing.assert_allclose(model.predict(bad, verbose=0), model.predict(x, verbose=0),
                               rtol=0, atol=0)


@pytest.mark.spread
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_out_of_range_id_is_refused_in_datasets_and_generators(family):
    model, x, y, sizes = _family(family)
    key = next(iter(sizes))
    value = sizes[key] + 3
    bad, index = _bad(x, key, value)
    message = _message(key, value, index)

    def generator():
        yield bad, y

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return (bad, y) if i == 0 else (x, y)

    before = _outputs(model, x)
    dataset = tf.data.Dataset.from_tensors((bad, y))
    with pytest.raises(ValueError, match=message):
        model.fit(dataset, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=message):
        model.fit(generator(), epochs=1, steps_per_epoch=1, verbose=0)
    with pytest.raises(ValueError, match=_message(key, value, index, "batch 0 of predict's x")):
        model.predict(Batches(), verbose=0)
    with pytest.raises(ValueError, match=message):
        model.evaluate(tf.data.Dataset.from_tensors((bad, y)), verbose=0)
    # No step ran on the bad batch, and the model is intact (JAX's trainer detaches the
    # weights while its loop runs; kzoo reattaches them when the loop stops on an error).
    np.testing.assert_array_equal(_outputs(model, x), before)


@pytest.mark.spread
def test_a_bad_batch_after_good_ones_is_caught_when_it_is_produced():
    model, x, y, sizes = _family("gpt")
    bad, index = _bad(x, "token_ids", -7, row=3)
    message = _message("token_ids", -7, index)
    seen = []

    def generator():
        for batch in ((x, y), (x, y), (bad, y)):
            seen.append(len(seen))
            yield batch

    with pytest.raises(ValueError, match=_message("token_ids", -7, index, "batch 2 of fit's x")):
        model.fit(generator(), epochs=1, steps_per_epoch=3, verbose=0)
    assert seen == [0, 1, 2]
    dataset = tf.data.Dataset.from_tensors((x, y)).concatenate(
        tf.data.Dataset.from_tensors((bad, y)))
    with pytest.raises(ValueError, match=message):
        model.fit(dataset, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, validation_data=dataset, epochs=1, verbose=0)

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return (bad, y) if i == 2 else (x, y)

    with pytest.raises(ValueError, match=_message("token_ids", -7, index,
                                                  "batch 2 of evaluate's x")):
        model.evaluate(Batches(), verbose=0)
    with pytest.raises(ValueError, match=message):
        model.evaluate(dataset, verbose=0)
    before = _outputs(model, x)
    model.train_on_batch(x, y)  # the model still trains after all these errors
    assert not np.array_equal(_outputs(model, x), before)


# === Non-integer ids ===


@pytest.mark.spread
@pytest.mark.parametrize("dtype", ["float32", "float64", "bool"])
def test_non_integer_ids_are_refused_not_truncated(dtype):
    model, x, y, _ = _family("bert")
    for key in ("token_ids", "segment_ids"):
        bad = dict(x, **{key: x[key].astype(dtype)})
        message = rf"`{key}`.*dtype {dtype}.*shape \({BATCH}, {SEQ}\)"
        for call in (lambda: model(bad), lambda: model.predict(bad, verbose=0),
                     lambda: model.fit(bad, y, verbose=0),
                     lambda: model.fit(tf.data.Dataset.from_tensors((bad, y)), verbose=0)):
            with pytest.raises(ValueError, match=message):
                call()
    floats = keras.ops.convert_to_tensor(x["token_ids"].astype("float32"))
    with pytest.raises(ValueError, match=r"`token_ids`.*float32"):
        model(dict(x, token_ids=floats))


# === Valid ids still work ===


def _outputs(model, x):
    return keras.ops.convert_to_numpy(model(x))


@pytest.mark.spread
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_valid_ids_of_any_integer_type_give_the_same_outputs(family):
    model, x, y, sizes = _family(family)
    reference = _outputs(model, x)
    as64 = {k: (v.astype("int64") if v.dtype.kind == "i" else v) for k, v in x.items()}
    as_tensors = {k: keras.ops.convert_to_tensor(v) for k, v in x.items()}
    np.testing.assert_array_equal(_outputs(model, as64), reference)
    np.testing.assert_allclose(_outputs(model, as_tensors), reference, rtol=1e-6, atol=1e-6)
    # the largest and smallest ids of every table are allowed
    edge = dict(x)
    for key, size in sizes.items():
        edge[key] = np.array(x[key], copy=True)
        edge[key][0, 0] = size - 1
        edge[key][1, 0] = 0
    assert np.all(np.isfinite(_outputs(model, edge)))
    np.testing.assert_allclose(model.predict_on_batch(as64), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_a_dict_of_python_lists_is_an_input_and_is_checked(family):
    # Keras flattened each nested list into inputs of their own ("expects 2 named input(s)
    # ... but it received 6 input tensors")
    model, x, _, sizes = _family(family)
    as_lists = {k: np.asarray(v).tolist() for k, v in x.items()}
    np.testing.assert_allclose(_outputs(model, as_lists), _outputs(model, x), rtol=1e-6,
                               atol=1e-6)
    key, size = sorted(sizes.items())[0]
    as_lists[key][0][0] = size  # one past the table
    with pytest.raises(ValueError, match=rf"{key}.*{size}"):
        model(as_lists)


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_fit_evaluate_and_predict_take_python_lists(family):
    # Keras' data adapters refused them: "Unrecognized data type: x={'token_ids': [[...]]}"
    model, x, y, _ = _family(family)
    as_lists = {k: np.asarray(v).tolist() for k, v in x.items()}
    y_list = np.asarray(y).tolist()
    np.testing.assert_allclose(model.predict(as_lists, verbose=0), _outputs(model, x),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(as_lists, y_list, verbose=0),
                               model.evaluate(x, y, verbose=0), rtol=1e-6)
    history = model.fit(as_lists, y_list, validation_data=(as_lists, y_list), epochs=1,
                        verbose=0).history
    assert np.isfinite(history["loss"][0]) and np.isfinite(history["val_loss"][0])


@pytest.mark.parametrize("bad", ["array", "list"])
def test_one_array_for_a_model_of_named_inputs_names_the_keys(bad):
    # (Keras said "The structure of `inputs` doesn't match" on JAX and "expects 2 named
    # input(s)" on torch and TensorFlow)
    model, x, _, _ = _family("gpt")
    ids = np.asarray(x["token_ids"]) if bad == "array" else np.asarray(x["token_ids"]).tolist()
    pattern = r"must be a dict with the keys \['padding_mask', 'token_ids'\].*'token_ids'"
    for run in (lambda: model(ids), lambda: model.predict(ids, verbose=0)):
        with pytest.raises(ValueError, match=pattern):
            run()


def test_padding_may_hold_any_id_where_the_mask_says_padding():
    model, x, y, _ = _family("gpt")
    mask = np.ones((BATCH, SEQ), "int32")
    mask[:, -2:] = 0
    zeros = dict(token_ids=np.where(mask > 0, x["token_ids"], 0), padding_mask=mask)
    fillers = dict(token_ids=np.where(mask > 0, x["token_ids"], -1), padding_mask=mask)
    large = dict(token_ids=np.where(mask > 0, x["token_ids"], VOCAB + 5), padding_mask=mask)
    real = _outputs(model, zeros)[:, :-2]
    for inputs in (fillers, large):
        np.testing.assert_allclose(_outputs(model, inputs)[:, :-2], real, rtol=1e-5,
                                   atol=1e-6)
    model.fit(fillers, y, epochs=1, verbose=0)
    # ...but not where it marks a token
    unmasked = dict(fillers, padding_mask=np.ones((BATCH, SEQ), "int32"))
    with pytest.raises(ValueError, match=r"id -1 at batch row 0, token 4"):
        model(unmasked)


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_a_padding_mask_holds_only_0_and_1(family):
    """0.5, -1, 2 or NaN in a mask were read as padding on one backend and as a token on
    another; they are refused by name (bool and 0 / 1 of any number type are fine)."""
    model, x, y, _ = _family(family)
    key = "padding_mask" if family == "gpt" else "encoder_padding_mask"
    ids = "token_ids" if family == "gpt" else "encoder_token_ids"
    reference = _outputs(model, x)
    for good in (x[key] > 0, x[key].astype("float32"), x[key].astype("uint8")):
        np.testing.assert_allclose(_outputs(model, dict(x, **{key: good})), reference,
                                   rtol=1e-6, atol=1e-6)
    for value in (0.5, -1, 2, np.nan):
        bad = x[key].astype("float32")
        bad[0, 1] = value
        pattern = rf"`{key}` \(.*\) must hold only 1 / True \(a token\) and 0 / False"
        for run in (model, lambda v: model.predict(v, verbose=0), lambda v: model.fit(v, y)):
            with pytest.raises(ValueError, match=pattern):
                run(dict(x, **{key: bad}))
        with pytest.raises(ValueError, match=r"`padding_mask` \(generate's argument\)"):
            model.generate(x[ids], padding_mask=bad, max_new_tokens=2)


def test_fit_on_valid_datasets_and_generators_trains():
    model, x, y, _ = _family("gpt")
    weights = [np.array(w) for w in model.get_weights()]

    def generator():
        while True:
            yield x, y

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return x, y

    dataset = tf.data.Dataset.from_tensors((x, y)).repeat(2)
    history = model.fit(dataset, validation_data=dataset, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0]) and np.isfinite(history["val_loss"][0])
    model.fit(generator(), steps_per_epoch=2, epochs=1, verbose=0)
    model.fit(Batches(), validation_data=Batches(), epochs=2, verbose=0)
    assert model.predict(Batches(), verbose=0).shape == (2 * BATCH, SEQ, VOCAB)
    assert any(not np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


def test_masked_lm_positions_in_a_dataset_train_and_are_checked():
    """A BERT masked LM's `mask_positions` (positions, not ids) in a `tf.data.Dataset`:
    valid batches train; a position past the sequence is refused as the batch is
    produced, with the input named."""
    backbone = BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                            intermediate_dim=16, max_sequence_length=16)
    model = BertMaskedLM(backbone)
    model.compile(optimizer="sgd")
    rng = np.random.default_rng(2)
    x = {"token_ids": _tokens(rng, (BATCH, SEQ)), "segment_ids": np.zeros((BATCH, SEQ), "int32"),
         "padding_mask": np.ones((BATCH, SEQ), "int32"),
         "mask_positions": rng.integers(0, SEQ, size=(BATCH, 2)).astype("int32")}
    y = _tokens(rng, (BATCH, 2))
    history = model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(2), epochs=1,
                        verbose=0).history
    assert np.isfinite(history["loss"][0])
    bad = {**x, "mask_positions": x["mask_positions"] + SEQ}
    with pytest.raises(ValueError, match=rf"`mask_positions`.*must lie in \[0, {SEQ}\)"):
        model.fit(tf.data.Dataset.from_tensors((bad, y)), epochs=1, verbose=0)


# === What is not checked: symbolic and traced inputs ===


def test_symbolic_construction_and_traced_calls_are_not_checked():
    model, x, y, _ = _family("gpt")
    inputs = {k: keras.Input(shape=(None,), dtype="int32", name=k) for k in x}
    assert all(is_symbolic(t) for t in inputs.values())
    wrapper = keras.Model(inputs, model(inputs))  # functional construction works
    np.testing.assert_allclose(_outputs(wrapper, x), _outputs(model, x), rtol=1e-6)
    # an eager call of the plain Keras wrapper still reaches the kzoo model's check
    bad, index = _bad(x, "token_ids", VOCAB)
    with pytest.raises(ValueError, match=_message("token_ids", VOCAB, index)):
        wrapper(bad)
    if BACKEND == "jax":
        import jax

        traced = jax.jit(lambda t: model(t))(x)
        np.testing.assert_allclose(np.asarray(traced), _outputs(model, x), rtol=1e-5, atol=1e-6)
        seen = []
        jax.jit(lambda t: seen.append(is_symbolic(t)) or t)(x["token_ids"])
        assert seen == [True]
    elif BACKEND == "tensorflow":
        traced = tf.function(lambda t: model(t))(x)
        np.testing.assert_allclose(traced.numpy(), _outputs(model, x), rtol=1e-5, atol=1e-6)
        seen = []
        tf.function(lambda t: seen.append(is_symbolic(t)) or t)(tf.constant([1]))
        assert seen == [True]
    else:
        import torch

        assert is_symbolic(torch.empty((2, 3), dtype=torch.int32, device="meta"))
        assert not is_symbolic(torch.zeros((2, 3), dtype=torch.int32))


# === The checker on its own ===


def test_check_inputs_reports_the_first_bad_id_and_respects_masks():
    spec = (IdInput("ids", 10, "vocabulary_size", mask="mask"),)
    ids = np.array([[1, 2, 3], [4, 11, -2]])
    with pytest.raises(ValueError, match=r"id 11 at batch row 1, token 1; ids must lie in "
                                         r"\[0, 10\) \(vocabulary_size=10\)"):
        check_inputs({"ids": ids, "mask": np.ones_like(ids)}, spec)
    with pytest.raises(ValueError, match=r"id -2 at batch row 1, token 2"):
        check_inputs({"ids": ids, "mask": np.array([[1, 1, 1], [1, 0, 1]])}, spec)
    check_inputs({"ids": ids, "mask": np.array([[1, 1, 1], [1, 0, 0]], bool)}, spec)
    with pytest.raises(ValueError, match="id 11"):  # one array: the first id input
        check_inputs(ids, spec)
    with pytest.raises(ValueError, match=r"dtype float64 and shape \(2, 3\)"):
        check_inputs([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], spec)
    check_inputs({"ids": np.zeros((0, 3), "int32")}, spec)  # empty: nothing to check
    check_inputs({"other": ids}, spec)  # not an id input
    check_inputs({"ids": np.array([[0, 9]], "uint8")}, spec)
    with pytest.raises(ValueError, match=r"must have 2 axes \(batch row, token\); got "
                                         r"shape \(1, 1, 2\)\.$"):  # other ranks
        check_inputs({"ids": np.array([[[0, 200]]], "uint8")}, spec)
    with pytest.raises(ValueError, match=r"shape \(3,\)\. It looks like one example without "
                                         r"its batch axis"):
        check_inputs({"ids": np.array([1, 2, 3])}, spec)


def test_float_inputs_are_numbers_of_their_rank_and_finite():
    from kzoo.inputs import FloatInput

    images = (FloatInput("images", axes=("image", "row", "column", "channel")),)
    x = np.zeros((2, 4, 4, 3), "float32")
    check_inputs(x, images)
    check_inputs(x.astype("uint8"), images)  # integer pixels: nothing to be infinite
    check_inputs(np.zeros((0, 4, 4, 3), "float32"), images)
    for bad, match in (
            (x[0], r"must have 4 axes .*shape \(4, 4, 3\)\. It looks like one example"),
            (x.astype(bool), "must hold real numbers; got an array of dtype bool"),
            (x.astype(complex), "must hold real numbers; got an array of dtype complex128"),
            (np.where(np.arange(96).reshape(x.shape) == 50, np.nan, x),
             r"holds nan at image 0, row 0, column 4|holds nan at image 1"),
            (np.where(np.arange(96).reshape(x.shape) == 95, -np.inf, x),
             r"holds -inf at image 1, row 3, column 3, channel 2; it must hold finite numbers")):
        with pytest.raises(ValueError, match=match):
            check_inputs(bad, images)
    # an additive mask: -inf allowed, NaN and +inf not; its shape from another input's
    bias = (FloatInput("attn_bias", axes=("graph", "from", "to"), negative_infinity=True,
                       pair_of="nodes"),)
    nodes = np.zeros((2, 3, 1), "int32")
    good = np.zeros((2, 4, 4), "float32")
    good[1, :, 3] = -np.inf
    check_inputs({"nodes": nodes, "attn_bias": good}, bias)
    for value in (np.nan, np.inf):
        bad = good.copy()
        bad[0, 2, 1] = value
        with pytest.raises(ValueError, match=rf"holds {value} at graph 0, from 2, to 1; it "
                                             "must hold finite numbers, or -inf"):
            check_inputs({"nodes": nodes, "attn_bias": bad}, bias)
    with pytest.raises(ValueError, match=r"must have shape \(batch, n \+ 1, n \+ 1\) = "
                                         r"\(2, 4, 4\) .*got shape \(2, 3, 3\)"):
        check_inputs({"nodes": nodes, "attn_bias": good[:, :3, :3]}, bias)


@pytest.mark.parametrize("family", ["gpt", "bert", "t5"])
def test_a_padding_mask_of_another_shape_is_refused(family):
    """A mask with another batch (it would broadcast silently: the model answered for
    every row) or another length (it failed deep inside the attention) is refused by name
    at `model(x)` and `predict`; BERT's `segment_ids` of batch 1 too."""
    model, x, _, _ = _family(family)
    masks = [key for key in x if key.endswith("padding_mask")]
    for key in masks:
        for shape in [(1, SEQ), (BATCH, SEQ - 1)]:
            bad = {**x, key: np.ones(shape, "int32")}
            with pytest.raises(ValueError, match=rf"`{key}` \(.*\) has shape "
                                                 + re.escape(str(shape))):
                model(bad)
            with pytest.raises(ValueError, match=rf"`{key}` .*must have the shape of"):
                model.predict(bad, verbose=0)
    if family == "bert":
        with pytest.raises(ValueError, match=r"`segment_ids` .*shape of `token_ids`"):
            model({**x, "segment_ids": x["segment_ids"][:1]})
    model(x)  # the right shapes still run


# === Counts given as NumPy integers ===


@pytest.mark.spread
def test_generate_accepts_numpy_integer_counts():
    lm, x, _, _ = _family("gpt")
    prompts = [[3, 4, 5], [6]]
    # beam search (the quicker loop on this backend, see tests/harness.py)...
    plain = lm.generate(prompts, max_new_tokens=4, strategy="beam", num_beams=2,
                        compile=QUICKER_LOOP)
    numpy = lm.generate(prompts, max_new_tokens=np.int64(4), strategy="beam",
                        num_beams=np.int32(2), compile=QUICKER_LOOP)
    assert numpy == plain and all(1 <= len(row) <= 4 for row in plain)
    # ...and the compiled loop, with a NumPy count
    eager = lm.generate(prompts, max_new_tokens=3, compile=False)
    assert lm.generate(prompts, max_new_tokens=np.int64(3)) == eager
    t5, _, _, _ = _family("t5")
    plain = t5.generate(np.array([[5, 6, 7, 1]]), max_new_tokens=3, compile=QUICKER_LOOP)
    numpy = t5.generate(np.array([[5, 6, 7, 1]], "int64"), max_new_tokens=np.int32(3),
                        num_beams=np.int64(1), compile=QUICKER_LOOP)
    assert numpy == plain
    with pytest.raises(ValueError, match=r"id 40 at prompt 0, token 1"):
        lm.generate(np.array([[3, VOCAB]]), max_new_tokens=np.int64(2))
    with pytest.raises(ValueError, match="float32"):
        lm.generate(np.array([[3.0, 4.0]], "float32"), max_new_tokens=2)
    assert kzoo.inputs is not None and "inputs" in kzoo.SUBMODULES


def test_a_failing_on_batch_call_leaves_the_model_intact():
    """`*_on_batch` keep the variables attached on every backend (only the looping methods
    detach them on JAX), so a call that fails inside its step changes nothing."""
    model, x, y, sizes = _family("gpt")
    before = _outputs(model, x)
    wrong_targets = np.zeros((3, 1, 1), "int32")  # batch 3 against the inputs' batch
    with pytest.raises(Exception):
        model.train_on_batch(x, wrong_targets)
    with pytest.raises(Exception):
        model.test_on_batch(x, wrong_targets)
    np.testing.assert_array_equal(_outputs(model, x), before)
    model.train_on_batch(x, y)  # still trains
    assert not np.array_equal(_outputs(model, x), before)


def test_a_sequence_longer_than_the_position_table_is_refused_by_name():
    """Learned positions hold `max_sequence_length` rows: a longer input is refused at the
    entry point on every backend (TensorFlow's graph failed with a slicing error); rotary
    positions have no table, and packed rows restart their positions at each document."""
    model, x, y, _ = _family("gpt")
    limit = model.backbone.max_sequence_length
    long = {"token_ids": np.ones((2, limit + 3), "int32"),
            "padding_mask": np.ones((2, limit + 3), "int32")}
    pattern = rf"`token_ids` \(.*\) has {limit + 3} tokens a row; .*max_sequence_length={limit}"
    for run in (model, lambda v: model.predict(v, verbose=0),
                lambda v: model.fit(v, np.ones((2, limit + 3), "int32"), verbose=0)):
        with pytest.raises(ValueError, match=pattern):
            run(long)
    rotary = GPTCausalLM(GPTBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                     hidden_dim=8, intermediate_dim=16,
                                     max_sequence_length=limit, position="rotary"))
    assert rotary.predict(long, verbose=0).shape == (2, limit + 3, VOCAB)
