"""Every task model trains correctly under `fit` on every backend.

Regression for a torch-only defect: the family models' variables were not registered as
torch parameters, so Keras' per-step `zero_grad` cleared nothing and every step applied
the sum of all previous gradients (losses went up after a few hundred steps). The checks
here do not trust the trainer: a second step taken by a trained model must equal one step
taken by a fresh model that starts from the same weights with a fresh optimizer.
"""

import re

import keras
import numpy as np
import pytest

from kzoo import graphs
from kzoo.models.bert import BertBackbone, BertClassifier, BertMaskedLM
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM
from kzoo.models.vit import ViTBackbone, ViTClassifier
from tests.helpers import backend, to_numpy

VOCAB = 40
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _tokens(r, batch=4, length=8):
    ids = r.integers(1, VOCAB, (batch, length)).astype("int32")
    return ids, np.ones_like(ids)


def _bert_backbone():
    return BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
                        intermediate_dim=32, max_sequence_length=16, dropout=0.0)


def _gpt(**config):
    return GPTCausalLM(GPTBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                   hidden_dim=16, intermediate_dim=32,
                                   max_sequence_length=16, dropout=0.0, **config))


def _bert_data(r):
    ids, mask = _tokens(r)
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}


def _lm_data(r):
    ids, mask = _tokens(r, length=9)
    return {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}, ids[:, 1:]


def _t5_data(r):
    enc, enc_mask = _tokens(r)
    dec, dec_mask = _tokens(r, length=7)
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
         "decoder_token_ids": dec, "decoder_padding_mask": dec_mask}
    return x, r.integers(1, VOCAB, dec.shape).astype("int32")


def _graph_data(r):
    x = graphs.batch([graphs.from_smiles(s) for s in ["CCO", "c1ccccc1", "CC(=O)O", "C"]],
                     pad_to_nodes=7)
    x.pop("labels", None)
    return x, r.normal(size=(4, 1)).astype("float32")


# name -> (model builder, loss, batch maker (rng -> (x, y)))
CASES = {
    "bert_masked_lm": (
        lambda: BertMaskedLM(_bert_backbone()), CE,
        lambda r: (_bert_data(r), r.integers(0, VOCAB, (4, 8)).astype("int32")),
    ),
    "bert_classifier": (
        lambda: BertClassifier(_bert_backbone(), num_classes=3, dropout=0.0), CE,
        lambda r: (_bert_data(r), r.integers(0, 3, (4,)).astype("int32")),
    ),
    "gpt_causal_lm": (_gpt, CE, _lm_data),
    "gpt_modern_causal_lm": (
        lambda: _gpt(norm="rmsnorm", position="rotary", feedforward="gated",
                     activation="silu", num_kv_heads=1, use_bias=False),
        CE, _lm_data,
    ),
    "t5_seq2seq_lm": (
        lambda: T5Seq2SeqLM(T5Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                       hidden_dim=16, key_value_dim=8, intermediate_dim=32,
                                       dropout=0.0)),
        CE, _t5_data,
    ),
    "vit_classifier": (
        lambda: ViTClassifier(ViTBackbone(image_size=16, patch_size=8, num_layers=1,
                                          num_heads=2, hidden_dim=16, intermediate_dim=32),
                              num_classes=3),
        CE,
        lambda r: (r.normal(size=(4, 16, 16, 3)).astype("float32"),
                   r.integers(0, 3, (4,)).astype("int32")),
    ),
    "graphormer_predictor": (
        lambda: GraphormerPredictor(GraphormerBackbone(
            num_layers=1, hidden_dim=16, intermediate_dim=16, num_heads=2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0)),
        "mse", _graph_data,
    ),
}


def _weights(model):
    return [to_numpy(v).copy() for v in model.weights]


def _fresh(build, loss, weights, learning_rate):
    keras.utils.set_random_seed(0)
    model = build()
    model.set_weights(weights)
    model.compile(keras.optimizers.SGD(learning_rate), loss)
    return model


@pytest.mark.spread
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_step_uses_only_its_own_gradients(name):
    build, loss, data = CASES[name]
    r = np.random.default_rng(0)
    (xa, ya), (xb, yb) = data(r), data(r)
    keras.utils.set_random_seed(0)
    w0 = _weights(build())
    lr = 0.5

    # Two steps in one model: A then B.
    model = _fresh(build, loss, w0, lr)
    model.train_on_batch(xa, ya)
    w1 = _weights(model)
    model.train_on_batch(xb, yb)
    w2 = _weights(model)

    # Step B alone, from the weights after A, in a model that has never seen a gradient.
    reference = _fresh(build, loss, w1, lr)
    reference.train_on_batch(xb, yb)
    expected = _weights(reference)

    moved = max(float(np.abs(a - b).max()) for a, b in zip(w1, w2))
    assert moved > 1e-4, "step B did not change the weights"
    for v, got, want in zip(model.weights, w2, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=v.path)
    if backend() == "torch":
        # The root cause, checked directly: `zero_grad` only clears registered parameters.
        params = {id(p) for p in model.parameters()}
        assert [v.path for v in model.variables if id(v.value) not in params] == []


@pytest.mark.spread
@pytest.mark.parametrize("name", ["bert_masked_lm", "t5_seq2seq_lm", "graphormer_predictor"])
def test_one_adam_step_is_adam_of_the_summed_gradient(name):
    """Tables looked up with repeated ids (BERT's segment embedding, T5's relative bias,
    Graphormer's tables) get Adam's update of the gradient summed over the repeats. The
    gradient comes from one SGD step (w0 - w1 at learning rate 1: SGD is linear, so sparse
    and dense gradients agree); the Adam step is the formula in NumPy. Keras 3.15 on
    TensorFlow squared each repeat separately (kzoo sums them first)."""
    build, loss, data = CASES[name]
    x, y = data(np.random.default_rng(0))
    keras.utils.set_random_seed(0)
    w0 = _weights(build())
    sgd = _fresh(build, loss, w0, 1.0)
    sgd.train_on_batch(x, y)
    gradients = [a - b for a, b in zip(w0, _weights(sgd))]
    lr, beta_1, beta_2, eps = 1e-2, 0.9, 0.999, 1e-7
    keras.utils.set_random_seed(0)
    model = build()
    model.set_weights(w0)
    model.compile(keras.optimizers.Adam(lr, beta_1=beta_1, beta_2=beta_2, epsilon=eps), loss)
    model.train_on_batch(x, y)
    checked = 0
    for variable, w, g, after in zip(model.weights, w0, gradients, _weights(model)):
        if not variable.trainable:
            continue
        g64 = g.astype("float64")
        m, v = (1 - beta_1) * g64, (1 - beta_2) * g64 ** 2
        step = lr * np.sqrt(1 - beta_2) / (1 - beta_1) * m / (np.sqrt(v) + eps)
        # Where w0 - w1 resolves the gradient (float32 weights hold ~7 digits; an entry near
        # eps would measure rounding, not Adam).
        known = np.abs(g64) > 1e-4
        checked += int(known.sum())
        np.testing.assert_allclose(after[known], (w - step)[known], atol=2e-5, rtol=0,
                                   err_msg=variable.path)
    assert checked > 100


def test_predict_on_batch_returns_each_call_its_own_array():
    """`predict_on_batch` (kzoo's hands out a large output's memory without a copy) returns
    NumPy arrays equal to the model's own call; each call's array is its own (writing to one
    changes neither the next call's result nor the model), for small and large outputs
    (copied / shared) and for a dict of outputs."""
    r = np.random.default_rng(3)
    for vocab, shared in ((VOCAB, False), (8192, True)):  # logits of 4 x 8 x 8192: 1 MiB
        lm = GPTCausalLM(GPTBackbone(vocabulary_size=vocab, num_layers=1, num_heads=2,
                                     hidden_dim=16, intermediate_dim=32,
                                     max_sequence_length=16, dropout=0.0))
        x, _ = _lm_data(r)
        weights = [to_numpy(w).copy() for w in lm.weights]
        reference = to_numpy(lm(x, training=False))
        first = lm.predict_on_batch(x)
        assert isinstance(first, np.ndarray) and first.dtype == np.float32
        assert first.flags.writeable
        assert first.flags.owndata is not shared, (vocab, first.flags.owndata)
        np.testing.assert_allclose(first, reference, rtol=1e-6, atol=1e-6)
        first[...] = 7.0  # the caller owns it
        second = lm.predict_on_batch(x)
        np.testing.assert_allclose(second, reference, rtol=1e-6, atol=1e-6)
        assert not np.shares_memory(first, second)
        for w, before in zip(lm.weights, weights):
            np.testing.assert_array_equal(to_numpy(w), before)

    backbone = _bert_backbone()
    data = _bert_data(r)
    outputs = backbone.predict_on_batch(data)
    expected = backbone(data, training=False)
    assert isinstance(outputs, dict) and set(outputs) == set(expected)
    for key, value in outputs.items():
        assert isinstance(value, np.ndarray)
        np.testing.assert_allclose(value, to_numpy(expected[key]), rtol=1e-6, atol=1e-6)


class _PassThrough(keras.layers.Layer):
    """Returns its input unchanged, its (large) weight, and twice its input twice."""

    def build(self, shape):
        self.table = self.add_weight(shape=(512, 1024), initializer="ones", name="table")

    def call(self, x):
        doubled = x * 2.0
        return x, keras.ops.convert_to_tensor(self.table), doubled, doubled


def test_predict_on_batch_copies_outputs_that_share_memory():
    """Outputs of 2 MiB and more that are an input, a variable or another output (a compiled
    function may forward them unchanged) come back as copies: writing to them changes
    neither the caller's input, nor the weight, nor each other."""
    from kzoo.models.base import FunctionalModel

    inputs = keras.Input((512, 1024))
    model = FunctionalModel(inputs=inputs, outputs=list(_PassThrough()(inputs)))
    z = np.random.default_rng(4).standard_normal((1, 512, 1024)).astype("float32")
    kept = z.copy()
    same, table, doubled, again = model.predict_on_batch(z)
    np.testing.assert_array_equal(same, kept)
    np.testing.assert_array_equal(table, np.ones((512, 1024), "float32"))
    np.testing.assert_array_equal(doubled, 2 * kept)
    np.testing.assert_array_equal(again, 2 * kept)
    for out in (same, table, doubled, again):
        assert out.flags.writeable
        out[...] = -3.0
    np.testing.assert_array_equal(z, kept)
    np.testing.assert_array_equal(to_numpy(model.weights[0]), np.ones((512, 1024), "float32"))
    assert not np.shares_memory(doubled, again)
    np.testing.assert_array_equal(model.predict_on_batch(z)[1], np.ones((512, 1024), "float32"))


def _predict_jit_flags(model, x, monkeypatch):
    """Run `model.predict_on_batch(x)` with a fresh predict function; return (its output,
    the `jit_compile` arguments of the `tf.function`s Keras' trainer made for its step
    meanwhile: TensorFlow only; kernels' own functions are not counted)."""
    flags = []
    if backend() == "tensorflow":
        import tensorflow as tf

        original = tf.function

        def recording(*args, **kwargs):
            if args and getattr(args[0], "__name__", "") == "one_step_on_data":
                flags.append(bool(kwargs.get("jit_compile")))
            return original(*args, **kwargs)

        monkeypatch.setattr(tf, "function", recording)
    model.predict_function = None
    out = model.predict_on_batch(x)
    monkeypatch.undo()
    return out, flags


# (on JAX and torch, where the check is that Keras' choice stands, one family)
@pytest.mark.parametrize("name", sorted(CASES) if backend() == "tensorflow"
                         else ["gpt_causal_lm"])
def test_prediction_compiles_with_xla_on_tensorflow_under_auto(name, monkeypatch):
    """On TensorFlow, `jit_compile="auto"` (and a model never compiled) predicts through an
    XLA-compiled step even where Keras' own "auto" is no XLA (no accelerator), with outputs
    equal to the model's eager call; `compile(jit_compile=False)` and `run_eagerly=True` keep
    Keras' graph / eager prediction. Every family compiles under XLA. Other backends: Keras'
    choice (`xla_prediction` is False)."""
    build, loss, batch = CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    x, _ = batch(np.random.default_rng(5))
    expected = keras.tree.map_structure(to_numpy, model(x, training=False))
    on_tf = backend() == "tensorflow"

    out, flags = _predict_jit_flags(model, x, monkeypatch)  # never compiled: "auto"
    assert model.xla_prediction == (on_tf and not model.jit_compile)
    assert (True in flags) == on_tf
    for got, want in zip(keras.tree.flatten(out), keras.tree.flatten(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    model.compile(optimizer="sgd", loss=loss)  # "auto"
    assert model.xla_prediction == (on_tf and not model.jit_compile)

    model.compile(optimizer="sgd", loss=loss, jit_compile=False)
    assert not model.xla_prediction
    out, flags = _predict_jit_flags(model, x, monkeypatch)
    assert True not in flags
    for got, want in zip(keras.tree.flatten(out), keras.tree.flatten(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    model.compile(optimizer="sgd", loss=loss, run_eagerly=True)
    assert not model.xla_prediction


def test_train_on_batch_builds_once_on_torch(monkeypatch):
    """Keras builds (and on torch re-tracks every variable) at each `train_on_batch`; kzoo's
    models skip that on torch once nothing is left to build, and build again when something
    is (a metric compiled later). Losses and metrics are those of Keras' own path; on JAX
    and TensorFlow Keras' build runs as often as without kzoo's models."""
    from kzoo.models import base

    builds = []
    keras_build = keras.Model._symbolic_build

    def counted(self, *args, **kwargs):
        builds.append(1)
        return keras_build(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "_symbolic_build", counted)
    r = np.random.default_rng(3)
    ids, mask = _tokens(r)
    x, y = {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1)

    def run():
        keras.utils.set_random_seed(1)
        model = _gpt()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=CE)
        logs = [model.train_on_batch(x, y, return_dict=True) for _ in range(3)]
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=CE, metrics=["accuracy"])
        logs += [model.train_on_batch(x, y, return_dict=True) for _ in range(2)]
        return logs, len(builds)

    with monkeypatch.context() as keras_path:  # Keras' build at every call
        keras_path.setattr(base.FunctionalModel, "_symbolic_build", counted)
        expected, keras_builds = run()
    builds.clear()
    got, kzoo_builds = run()
    assert kzoo_builds == (2 if backend() == "torch" else keras_builds)
    if backend() == "torch":
        assert keras_builds == 5
    assert set(got[-1]) == {"loss", "accuracy"}
    for mine, want in zip(got, expected):
        assert set(mine) == set(want)
        for key in mine:
            np.testing.assert_allclose(mine[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.spread
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_empty_batch_predicts_empty_outputs(name):
    """A batch of no rows gives outputs of no rows (Keras' `predict` loop failed with an
    UnboundLocalError; torch's fast block path and TensorFlow's patch embedding could not
    reshape an empty batch)."""
    build, _, data = CASES[name]
    x, _ = data(np.random.default_rng(0))
    empty = keras.tree.map_structure(lambda a: a[:0], x)
    keras.utils.set_random_seed(0)
    model = build()
    full = model.predict(x, verbose=0)
    for out in (model.predict(empty, verbose=0), model.predict_on_batch(empty),
                to_numpy(model(empty))):
        assert out.shape == (0,) + full.shape[1:]


def test_float64_holds_float64_or_is_refused_on_jax_without_x64():
    """dtype="float64" gives float64 weights and outputs; on JAX with 64-bit floats off
    (its default) it is refused by name, where the model held float32 values silently."""
    import kzoo.presets

    shape = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32,
                 vocabulary_size=VOCAB)
    builds = (lambda: kzoo.presets.load("gpt_mini", dtype="float64", **shape),
              lambda: _gpt(dtype="float64"))
    if backend() == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            for build in builds:
                with pytest.raises(ValueError, match="dtype='float64' needs 64-bit floats"):
                    build()
            return
    ids, mask = _tokens(np.random.default_rng(0))
    for build in builds:
        model = build()
        assert {keras.backend.standardize_dtype(w.dtype) for w in model.weights} == {"float64"}
        out = model.predict({"token_ids": ids, "padding_mask": mask}, verbose=0)
        assert out.dtype == np.float64


def test_input_dicts_with_unknown_or_missing_keys_are_refused_by_name():
    """A misspelt key was run on JAX with a warning (its ids unchecked, the logits of
    another input); torch and TensorFlow said "Missing data for input" or ignored it."""
    r = np.random.default_rng(0)
    model = _gpt()
    model.compile(keras.optimizers.SGD(0.1))
    (x, y) = _lm_data(r)
    bad = {"tokens": x["token_ids"] + 5000, "padding_mask": x["padding_mask"]}
    expected = r"must be a dict with the keys \['padding_mask', 'token_ids'\]"
    for run in (model, lambda v: model.predict(v, verbose=0), lambda v: model.fit(v, y),
                lambda v: model.evaluate(v, y, verbose=0), lambda v: model.train_on_batch(v, y),
                lambda v: model.fit(x, y, validation_data=(v, y), verbose=0)):
        with pytest.raises(ValueError, match=expected + r".*unknown key\(s\) \['tokens'\] and "
                                                        r"no \['token_ids'\]"):
            run(bad)
    with pytest.raises(ValueError, match=expected + r".*got no \['token_ids'\]"):
        model.predict({"padding_mask": x["padding_mask"]}, verbose=0)
    # BERT: segment_ids and padding_mask may be left out, a misspelling may not
    bert = BertMaskedLM(_bert_backbone())
    ids = _bert_data(r)["token_ids"]
    assert bert.predict({"token_ids": ids}, verbose=0).shape == ids.shape + (VOCAB,)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['segment'\]"):
        bert.predict({"token_ids": ids, "segment": 0 * ids}, verbose=0)


@pytest.mark.spread
@pytest.mark.parametrize("name", ["bert_masked_lm", "gpt_causal_lm", "t5_seq2seq_lm"])
def test_left_out_padding_masks_mean_every_token_is_real(name):
    """Padding masks (and BERT's segment ids) may be left out of the input dict, as in
    Hugging Face's models: they run as ones (zeros). GPT and T5 refused the dict before."""
    build, loss, data = CASES[name]
    x, y = data(np.random.default_rng(0))
    x = {k: (np.ones_like(v) if "padding_mask" in k else v) for k, v in x.items()}
    short = {k: v for k, v in x.items() if "padding_mask" not in k and k != "segment_ids"}
    model = build()
    full = to_numpy(model.predict_on_batch(x))
    np.testing.assert_array_equal(to_numpy(model(short)), to_numpy(model(x)))
    np.testing.assert_array_equal(to_numpy(model.predict_on_batch(short)), full)
    np.testing.assert_allclose(model.predict(short, verbose=0), full, atol=1e-6)
    model.compile(keras.optimizers.SGD(0.1), loss)
    before = model.get_weights()
    loss_full = model.train_on_batch(x, y)
    model.set_weights(before)
    np.testing.assert_allclose(model.train_on_batch(short, y), loss_full, rtol=1e-6)
    assert np.isfinite(model.fit(short, y, verbose=0).history["loss"][0])
    assert np.isfinite(model.evaluate(short, y, verbose=0))


def _target_entry_points(model, x, y):
    """Every way targets reach the loss, each as `run(targets)`."""
    return (lambda t: model.fit(x, t, verbose=0), lambda t: model.evaluate(x, t, verbose=0),
            lambda t: model.train_on_batch(x, t), lambda t: model.test_on_batch(x, t),
            lambda t: model.fit(x, y, validation_data=(x, t), verbose=0))


@pytest.mark.spread
@pytest.mark.parametrize("name", ["bert_masked_lm", "bert_classifier", "gpt_causal_lm",
                                  "t5_seq2seq_lm", "vit_classifier"])
def test_targets_of_another_shape_or_none_are_refused(name):
    """A sparse cross-entropy's targets must have the logits' shape without the class axis
    (or with it as 1), and be given: a sequence one longer, another batch, one-hot targets or
    y=None failed inside the step with broadcasting or indexing errors naming neither."""
    build, loss, data = CASES[name]
    x, y = data(np.random.default_rng(0))
    model = build()
    model.compile(keras.optimizers.SGD(0.1), loss)
    logits = tuple(to_numpy(model.predict_on_batch(x)).shape)
    wanted = re.escape(str(logits[:-1]))
    longer = np.concatenate([y, y[:, :1]], axis=1) if y.ndim == 2 else y[:, None][:, [0, 0]]
    for bad in (longer, np.concatenate([y, y]), y[..., None] * np.ones(3, y.dtype)):
        pattern = (rf"`y` \(.*\) has shape {re.escape(str(bad.shape))}; the logits for these "
                   rf"inputs have shape {re.escape(str(logits))}, .* class ids of shape {wanted}")
        for run in _target_entry_points(model, x, y):
            with pytest.raises(ValueError, match=pattern):
                run(bad)
    for run in (lambda: model.fit(x, verbose=0), lambda: model.train_on_batch(x),
                lambda: model.evaluate(x, verbose=0)):
        with pytest.raises(ValueError, match=rf"is missing: .* targets of shape {wanted}"):
            run()
    assert np.isfinite(model.train_on_batch(x, y[..., None]))  # a trailing axis of 1: fine
    assert np.isfinite(model.fit(x, y, verbose=0).history["loss"][0])


@pytest.mark.spread
@pytest.mark.parametrize("name", ["bert_classifier", "gpt_causal_lm", "t5_seq2seq_lm",
                                  "vit_classifier"])
def test_class_id_targets_out_of_range_are_refused(name):
    """A sparse cross-entropy's targets must be whole ids below the logits' last axis: out
    of range, JAX's loss was 0.0 (silently) while torch and TensorFlow failed inside the
    step; fractions were truncated everywhere."""
    build, loss, data = CASES[name]
    x, y = data(np.random.default_rng(0))
    model = build()
    model.compile(keras.optimizers.SGD(0.1), loss)
    classes = model.outputs[0].shape[-1]
    for bad, shown in ((y + classes, str(int(y.reshape(-1)[0]) + classes)), (y * 0 - 1, "-1"),
                       (y + 0.5, str(float(y.reshape(-1)[0]) + 0.5))):
        pattern = rf"holds {re.escape(shown)} at index .*whole class ids in \[0, {classes}\)"
        for run in _target_entry_points(model, x, y):
            with pytest.raises(ValueError, match=pattern):
                run(bad)
    assert np.isfinite(model.train_on_batch(x, y.astype("float32")))  # whole floats: fine


def test_train_step_walks_trainable_weights_once_and_sees_freezing(monkeypatch):
    """On torch one training step lists the trainable weights once (Keras' step asks three
    times; each is a walk over every layer), and the list is the step's own: a layer frozen
    between two steps (then compiled again, as JAX and TensorFlow need) keeps its weights,
    the others move. Outside a step the property answers afresh."""
    from kzoo.models import base

    walks = []
    original = base.TaskModel._without_unused

    def counted(self, trainable, non_trainable):
        walks.append(1)
        return original(self, trainable, non_trainable)

    monkeypatch.setattr(base.TaskModel, "_without_unused", counted)
    r = np.random.default_rng(4)
    ids, mask = _tokens(r)
    x, y = {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1)
    model = _gpt()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=CE)
    model.train_on_batch(x, y)  # (builds)
    walks.clear()
    model.train_on_batch(x, y)
    if backend() == "torch":
        assert len(walks) == 1
    frozen = model.backbone.token_embedding
    frozen.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=CE)
    before = {v.path: to_numpy(v) for v in model.weights}
    model.train_on_batch(x, y)
    frozen_paths = {v.path for v in frozen.weights}
    assert frozen_paths and not frozen_paths & {v.path for v in model.trainable_weights}
    for v in model.weights:
        moved = not np.array_equal(to_numpy(v), before[v.path])
        assert moved == (v.path not in frozen_paths and v.trainable), v.path


def test_batches_go_to_the_device_first_where_copies_wait(monkeypatch):
    """torch, where a copy from the host waits for the device (CUDA; here the CPU put in
    its place, `base.WAITING_DEVICES`): the batch's arrays become tensors before the step
    (the loss gets its targets as a tensor, not NumPy), the loss tracker gets the batch
    size as a tensor, and the losses and weights after three steps equal those of Keras'
    own path. Other backends: Keras' path, the same on both runs."""
    from kzoo.models import base

    r = np.random.default_rng(6)
    ids, mask = _tokens(r)
    x, y = {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1)
    seen = {"y": [], "weights": []}
    keras_compute_loss = keras.Model._compute_loss

    def spied_loss(self, *args, **kwargs):
        seen["y"].append(type(kwargs.get("y")).__module__.split(".")[0])
        return keras_compute_loss(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "_compute_loss", spied_loss)

    def run():
        keras.utils.set_random_seed(2)
        model = _gpt()
        model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=CE)
        model.train_on_batch(x, y)  # (builds)
        tracker_update = type(model._loss_tracker).update_state

        def spied_update(tracker, values, sample_weight=None):
            seen["weights"].append(type(sample_weight).__name__)
            return tracker_update(tracker, values, sample_weight=sample_weight)

        with monkeypatch.context() as m:
            m.setattr(type(model._loss_tracker), "update_state", spied_update)
            seen["y"].clear()
            losses = [model.train_on_batch(x, y) for _ in range(3)]
        assert "update_state" not in vars(model._loss_tracker)
        return losses, [to_numpy(v) for v in model.weights]

    keras_losses, keras_weights = run()
    keras_seen = dict(y=list(seen["y"]), weights=list(seen["weights"]))
    seen["weights"].clear()
    with monkeypatch.context() as m:
        m.setattr(base, "WAITING_DEVICES", ("cpu", "cuda"))
        losses, weights = run()
    torch_path = backend() == "torch"
    assert seen["y"] == (["torch"] * 3 if torch_path else keras_seen["y"])
    assert seen["weights"] == (["Tensor"] * 3 if torch_path else keras_seen["weights"])
    if torch_path:
        assert keras_seen == {"y": ["numpy"] * 3, "weights": ["int"] * 3}
    np.testing.assert_allclose(losses, keras_losses, rtol=1e-6, atol=1e-6)
    for got, want in zip(weights, keras_weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_compile_config_loads_on_every_backend():
    """The saved compile config names the public optimizer class and "auto" where compile
    was given "auto" (or nothing). Keras saved torch's own subclass
    (`keras.src.backend.torch.optimizers.torch_adamw`, which JAX and TensorFlow built and
    failed in) and the `jit_compile` that "auto" resolved to here (True on JAX: torch.compile
    once loaded on torch)."""
    model = _gpt()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3))
    config = model.get_compile_config()
    assert config["jit_compile"] == "auto"
    assert (config["optimizer"]["module"], config["optimizer"]["class_name"]) == (
        "keras.optimizers", "AdamW")
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                  jit_compile=False)
    config = model.get_compile_config()
    assert config["jit_compile"] is False
    inner = config["optimizer"]["config"]["inner_optimizer"]
    assert (inner["module"], inner["class_name"]) == ("keras.optimizers", "SGD")
    restored = keras.saving.deserialize_keras_object(config["optimizer"])
    assert isinstance(restored.inner_optimizer, keras.optimizers.SGD)


def _backbone_case(name):
    """(backbone builder, loss, metrics, batch maker) for the bare backbone of CASES[name]:
    regression of its outputs (a dict of outputs: one loss and metric each)."""
    build, _, data = CASES[name]

    def batch(r):
        x, _ = data(r)
        outputs = build().backbone(x)
        y = keras.tree.map_structure(
            lambda t: r.normal(size=tuple(t.shape)).astype("float32"), outputs)
        return x, y

    probe = keras.tree.map_structure(lambda t: None, build().backbone(data(
        np.random.default_rng(0))[0]))
    if isinstance(probe, dict):
        return (lambda: build().backbone, {k: "mse" for k in probe},
                {k: ["mae"] for k in probe}, batch)
    return lambda: build().backbone, "mse", ["mae"], batch


COMPILED_SAVE_CASES = sorted(CASES) + [f"{n}:backbone" for n in (
    "bert_classifier", "gpt_causal_lm", "t5_seq2seq_lm", "vit_classifier",
    "graphormer_predictor")]


@pytest.mark.spread
@pytest.mark.parametrize("name", COMPILED_SAVE_CASES)
def test_keras_file_restores_the_compiled_state(name, tmp_path):
    """A compiled model (each family's task models and bare backbones) trained one step and
    saved as `.keras` comes back compiled as it was: the same optimizer (AdamW with its
    settings and its step count and moments), loss, metrics and `jit_compile`, and its next
    step gives the original's loss, metrics and weights. Backbones came back without
    optimizer, loss or metrics (Keras skips `compile_from_config` for a custom `compile`,
    warning "`compile()` was not called as part of model loading"), so `fit` failed."""
    import warnings

    if name.endswith(":backbone"):
        build, loss, metrics, data = _backbone_case(name.split(":")[0])
    else:
        build, loss, data = CASES[name]
        metrics = ["mae"] if loss == "mse" else ["sparse_categorical_accuracy"]
    x, y = data(np.random.default_rng(0))
    keras.utils.set_random_seed(0)
    model = build()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=3e-3, weight_decay=0.01),
                  loss=loss, metrics=metrics, jit_compile=False)
    model.train_on_batch(x, y)
    path = tmp_path / "m.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compile.* was not called")
        loaded = keras.saving.load_model(path)
    assert loaded.get_compile_config() == model.get_compile_config()
    assert isinstance(loaded.optimizer, keras.optimizers.AdamW)
    assert loaded.jit_compile is False
    opt = loaded.optimizer
    assert int(to_numpy(opt.iterations)) == 1
    np.testing.assert_allclose(float(to_numpy(opt.learning_rate)), 3e-3, rtol=1e-6)
    assert opt.weight_decay == pytest.approx(0.01)
    for v in loaded.trainable_variables:
        original = model.trainable_variables[[w.path for w in model.trainable_variables]
                                             .index(v.path)]
        np.testing.assert_array_equal(
            to_numpy(opt._momentums[opt._get_variable_index(v)]),
            to_numpy(model.optimizer._momentums[model.optimizer._get_variable_index(original)]),
            err_msg=v.path)
    want = model.train_on_batch(x, y, return_dict=True)
    got = loaded.train_on_batch(x, y, return_dict=True)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(float(to_numpy(got[key])), float(to_numpy(want[key])),
                                   rtol=1e-6, err_msg=key)
    for a, b in zip(_weights(loaded), _weights(model)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.slow  # (Inductor compiles the torch steps for minutes on two cores)
def test_jit_compile_true_predicts_and_trains_as_uncompiled():
    """`compile(jit_compile=True)` on torch (`torch.compile` of Keras' steps): its first
    `predict` failed in Inductor's lowering of oneDNN's linear op, and `fit` in Dynamo
    ("expected len(self.block_stack) == 1") on the train step's eager-only context managers.
    Both now run and give the uncompiled model's numbers (JAX and TensorFlow: XLA)."""
    x = {"token_ids": np.arange(16).reshape(2, 8).astype("int32") % 50,
         "padding_mask": np.array([[1] * 8, [0, 0] + [1] * 6], "int32")}
    y = (x["token_ids"] + 1) % 50
    results = []
    for jit_compile in (False, True):
        keras.utils.set_random_seed(0)
        model = GPTCausalLM(GPTBackbone(vocabulary_size=50, num_layers=1, num_heads=2,
                                        hidden_dim=32, intermediate_dim=64,
                                        max_sequence_length=16, dropout=0.0))
        model.compile(optimizer="adamw", jit_compile=jit_compile)
        predictions = model.predict(x, verbose=0)
        losses = model.fit(x, y, epochs=2, verbose=0).history["loss"]
        results.append((predictions, losses, model.evaluate(x, y, verbose=0)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5)
    np.testing.assert_allclose(results[1][2], results[0][2], rtol=1e-5)
