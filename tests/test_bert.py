"""BERT family: models against a NumPy reference written here, and against transformers."""

import json
import math
import os

import keras
import numpy as np
import pytest

# transformers would otherwise import TensorFlow too (seconds); only its torch models are used.
os.environ.setdefault("USE_TF", "0")

import kzoo.presets
from kzoo import registry
from kzoo.models import bert as bert_module
from kzoo.models.bert import BertBackbone, BertClassifier, BertMaskedLM
from tests.harness import (
    assert_close, assert_matches_transformers, assert_same_hf_tensors,
    check_config_round_trip, check_fit_lowers_loss, check_keras_file_round_trip,
    check_preset_round_trip, forward, hf_checkpoint, hf_state, max_real_diff, ref, rng,
    to_numpy, torch_forward,
)

TINY = dict(
    vocabulary_size=61,
    num_layers=2,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=40,
    max_sequence_length=24,
    num_segments=2,
)


def tiny_backbone(**overrides):
    return BertBackbone(**{**TINY, **overrides})


def make_inputs(batch=3, seq=9, vocab=61, lengths=(9, 6, 3), seed=0):
    r = rng(seed)
    token_ids = r.integers(1, vocab, size=(batch, seq)).astype("int32")
    segment_ids = np.zeros((batch, seq), "int32")
    segment_ids[:, seq // 2:] = 1
    padding_mask = np.zeros((batch, seq), "int32")
    for i, n in enumerate(lengths):
        padding_mask[i, :n] = 1
    token_ids = np.where(padding_mask == 1, token_ids, 0).astype("int32")
    segment_ids = np.where(padding_mask == 1, segment_ids, 0).astype("int32")
    return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}


def randomize(model, seed=1, scale=0.2):
    """Give every weight a random value (norm scales around 1) so no term hides at init."""
    r = rng(seed)
    for w in model.weights:
        value = r.normal(0.0, scale, size=tuple(w.shape))
        if w.path.endswith("gamma"):
            value = 1.0 + value
        w.assign(value.astype("float32"))


# --- NumPy reference (Devlin et al. 2019; independent of kzoo's code) -------------------


def np_bert(backbone, inputs):
    """Float64 BERT forward from the backbone's weights; returns (sequence, pooled)."""
    w = ref.w
    eps = backbone.layer_norm_epsilon
    ids, seg, mask = inputs["token_ids"], inputs["segment_ids"], inputs["padding_mask"]
    seq = ids.shape[1]
    x = (w(backbone.token_embedding.embeddings)[ids]
         + w(backbone.position_embedding.embeddings)[:seq][None]
         + w(backbone.segment_embedding.embeddings)[seg])
    x = ref.norm(backbone.embeddings_layer_norm, x, eps)
    heads = backbone.num_heads
    d = backbone.hidden_dim // heads
    for block in backbone.transformer_layers:
        att = block.self_attention

        proj = ref.apply_dense
        q = proj(att.query_dense, x).reshape(x.shape[0], seq, heads, d)
        k = proj(att.key_dense, x).reshape(x.shape[0], seq, heads, d)
        v = proj(att.value_dense, x).reshape(x.shape[0], seq, heads, d)
        ctx = ref.attention(q, k, v, mask=mask[:, None, None, :] == 1, scale=1 / math.sqrt(d))
        ctx = ctx.reshape(x.shape[0], seq, heads * d)
        x = ref.norm(block.self_attention_norm, x + proj(att.output_dense, ctx), eps)
        ffn = block.feedforward_layer
        h = ref.gelu(proj(ffn.intermediate_dense, x))
        x = ref.norm(block.feedforward_norm, x + proj(ffn.output_dense, h), eps)
    pooled = np.tanh(x[:, 0] @ w(backbone.pooler_dense.kernel) + w(backbone.pooler_dense.bias))
    return x, pooled


def real(mask):
    return np.asarray(mask).astype(bool)


# --- Models -----------------------------------------------------------------------------


@pytest.mark.spread
def test_forward_shapes_and_dtypes():
    inputs = make_inputs()
    backbone = tiny_backbone()
    out = backbone(inputs)
    assert set(out) == {"sequence_output", "pooled_output"}
    assert tuple(out["sequence_output"].shape) == (3, 9, 16)
    assert tuple(out["pooled_output"].shape) == (3, 16)
    assert keras.backend.standardize_dtype(out["sequence_output"].dtype) == "float32"
    mlm = BertMaskedLM(backbone)
    logits = mlm(inputs)
    assert tuple(logits.shape) == (3, 9, 61)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    clf = BertClassifier(backbone, num_classes=5)
    assert tuple(clf(inputs).shape) == (3, 5)
    assert mlm.backbone is backbone and clf.backbone is backbone
    assert (mlm.family, mlm.task_name, clf.task_name) == ("bert", "masked_lm", "classifier")
    assert BertBackbone.family == "bert"


def test_family_contract():
    assert bert_module.FAMILY == "bert"
    bert = registry.family("bert")
    assert bert.backbone is BertBackbone
    assert dict(bert.tasks) == {"masked_lm": BertMaskedLM, "classifier": BertClassifier}
    assert bert.task_names == ("backbone", "masked_lm", "classifier")
    assert bert.task_class("backbone") is BertBackbone
    assert bert.default_task == "masked_lm"


def test_backbone_and_mlm_match_numpy_reference():
    inputs = make_inputs()
    mlm = BertMaskedLM(tiny_backbone())
    randomize(mlm)
    backbone = mlm.backbone
    seq_ref, pooled_ref = np_bert(backbone, inputs)
    out = backbone(inputs)
    m = real(inputs["padding_mask"])
    got_seq = to_numpy(out["sequence_output"])
    print("backbone max |diff| vs NumPy:", np.abs(got_seq[m] - seq_ref[m]).max())
    assert_close(got_seq[m], seq_ref[m], atol=2e-5)
    assert_close(out["pooled_output"], pooled_ref, atol=2e-5)
    # Masked-LM head: LN(gelu(Dense(h))) @ E^T + b.
    w = ref.w
    h = ref.gelu(ref.apply_dense(mlm.transform.dense, seq_ref))
    h = ref.norm(mlm.transform.layer_norm, h, backbone.layer_norm_epsilon)
    logits_ref = h @ w(backbone.token_embedding.embeddings).T + w(mlm.output_bias.bias)
    assert_close(to_numpy(mlm(inputs))[m], logits_ref[m], atol=5e-5, rtol=1e-4)


@pytest.mark.spread
def test_segment_ids_and_padding_mask_may_be_left_out_as_in_hugging_face():
    """Like transformers' BERT (token_type_ids zeros, attention_mask ones when not given):
    the ids alone give the NumPy reference of segment 0, every token real, through the
    call, `predict` and training (it was Keras' "Missing data for input" or, on JAX, "not
    connected to `inputs`")."""
    inputs = make_inputs(lengths=(9, 9, 9))
    explicit = {**inputs, "segment_ids": np.zeros_like(inputs["token_ids"])}
    mlm = BertMaskedLM(tiny_backbone(dropout=0.0))
    randomize(mlm)
    seq_ref, pooled_ref = np_bert(mlm.backbone, explicit)
    ids = inputs["token_ids"]
    for given in ({"token_ids": ids}, {"token_ids": ids, "padding_mask": np.ones_like(ids)},
                  {"token_ids": ids, "segment_ids": np.zeros_like(ids)}):
        out = mlm.backbone(given)
        assert_close(out["sequence_output"], seq_ref, atol=2e-5)
        assert_close(out["pooled_output"], pooled_ref, atol=2e-5)
        backend_ids = keras.ops.convert_to_tensor(ids)
        assert_close(mlm.backbone({"token_ids": backend_ids})["sequence_output"], seq_ref,
                     atol=2e-5)
        assert_close(mlm.predict(given, verbose=0), mlm.predict(explicit, verbose=0),
                     atol=1e-6)
    labels = rng(3).integers(0, 61, size=ids.shape).astype("int32")
    losses = []
    for x in ({"token_ids": ids}, explicit):
        keras.utils.set_random_seed(0)
        model = BertMaskedLM(tiny_backbone(dropout=0.0))
        randomize(model)
        model.compile(keras.optimizers.SGD(0.1))
        losses.append([float(model.train_on_batch(x, labels)) for _ in range(2)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert losses[0][1] != losses[0][0]


def test_backbone_output_positions_match_numpy_reference():
    """`output_positions`: `sequence_output` at those rows only (the last block computes
    them and the [CLS] row alone), `pooled_output` unchanged; no rows at all (a
    classifier's call) leaves the pooled output alone; positions out of range are
    refused."""
    inputs = make_inputs()
    backbone = tiny_backbone()
    randomize(backbone)
    seq_ref, pooled_ref = np_bert(backbone, inputs)
    positions = np.array([[8, 0, 3], [5, 5, 1], [2, 0, 1]], "int32")  # real tokens, repeats
    out = backbone({**inputs, "output_positions": positions})
    assert_close(out["sequence_output"], np.take_along_axis(seq_ref, positions[..., None], 1),
                 atol=2e-5)
    assert_close(out["pooled_output"], pooled_ref, atol=2e-5)
    none = backbone({**inputs, "output_positions": np.zeros((3, 0), "int32")})
    assert tuple(none["sequence_output"].shape) == (3, 0, 16)
    assert_close(none["pooled_output"], pooled_ref, atol=2e-5)
    with pytest.raises(ValueError, match=r"`output_positions`.*holds position 9.*\[0, 9\)"):
        backbone({**inputs, "output_positions": positions + 1})


def test_classifier_matches_numpy_reference():
    inputs = make_inputs()
    clf = BertClassifier(tiny_backbone(), num_classes=3)
    randomize(clf)
    _, pooled = np_bert(clf.backbone, inputs)
    dense = clf.classifier_dense
    ref = pooled @ to_numpy(dense.kernel) + to_numpy(dense.bias)
    assert_close(clf(inputs), ref, atol=2e-5)


def test_padding_invariance():
    mlm = BertMaskedLM(tiny_backbone())
    randomize(mlm, seed=3)
    inputs = make_inputs(lengths=(9, 5, 2))
    full = to_numpy(mlm(inputs))
    # Garbage in the padded positions changes nothing at real positions (nor the pooler).
    noisy = dict(inputs)
    pad = inputs["padding_mask"] == 0
    noisy["token_ids"] = np.where(pad, 7, inputs["token_ids"]).astype("int32")
    noisy["segment_ids"] = np.where(pad, 1, inputs["segment_ids"]).astype("int32")
    clean_out, noisy_out = mlm.backbone(inputs), mlm.backbone(noisy)
    np.testing.assert_allclose(to_numpy(noisy_out["sequence_output"])[~pad],
                               to_numpy(clean_out["sequence_output"])[~pad], atol=1e-5)
    np.testing.assert_allclose(to_numpy(noisy_out["pooled_output"]),
                               to_numpy(clean_out["pooled_output"]), atol=1e-5)
    # An example alone, unpadded, gives the same logits as in the padded batch.
    alone = {k: v[1:2, :5] for k, v in inputs.items()}
    np.testing.assert_allclose(to_numpy(mlm(alone))[0], full[1, :5], atol=1e-5)


def test_encoder_is_bidirectional_and_uses_segments():
    backbone = tiny_backbone()
    randomize(backbone, seed=4)
    inputs = make_inputs(lengths=(9, 9, 9))
    base = to_numpy(backbone(inputs)["sequence_output"])
    changed = dict(inputs)
    changed["token_ids"] = inputs["token_ids"].copy()
    changed["token_ids"][:, -1] = (inputs["token_ids"][:, -1] % 60) + 1
    # A later token changes earlier positions (no causal mask in BERT).
    assert np.abs(to_numpy(backbone(changed)["sequence_output"])[:, 0] - base[:, 0]).max() > 1e-4
    flipped = dict(inputs)
    flipped["segment_ids"] = 1 - inputs["segment_ids"]
    assert np.abs(to_numpy(backbone(flipped)["sequence_output"]) - base).max() > 1e-4


def test_dropout_only_in_training():
    backbone = tiny_backbone(dropout=0.5)
    inputs = make_inputs()
    a = to_numpy(backbone(inputs)["sequence_output"])
    b = to_numpy(backbone(inputs)["sequence_output"])
    np.testing.assert_array_equal(a, b)
    c = to_numpy(backbone(inputs, training=True)["sequence_output"])
    assert np.abs(a - c).max() > 1e-3


def test_feedforward_has_no_inner_dropout():
    block = tiny_backbone(dropout=0.3).transformer_layers[0]
    assert block.feedforward_layer.dropout == 0.0
    assert block.dropout == 0.3


def test_initialisation_is_bert_normal():
    backbone = BertBackbone(vocabulary_size=2000, num_layers=1, num_heads=2, hidden_dim=64,
                            intermediate_dim=256, max_sequence_length=64)
    for w in (backbone.token_embedding.embeddings, backbone.position_embedding.embeddings,
              backbone.transformer_layers[0].self_attention.query_dense.kernel,
              backbone.transformer_layers[0].feedforward_layer.intermediate_dense.kernel):
        values = to_numpy(w)
        assert abs(values.mean()) < 3e-3
        assert abs(values.std() - 0.02) < 1.5e-3, (w.path, values.std())
    np.testing.assert_array_equal(to_numpy(backbone.pooler_dense.bias), 0.0)
    np.testing.assert_array_equal(to_numpy(backbone.embeddings_layer_norm.gamma), 1.0)


@pytest.mark.spread
@pytest.mark.parametrize("task", ["backbone", "masked_lm", "classifier"])
def test_keras_file_round_trip(task, tmp_path):
    backbone = tiny_backbone(attention_dropout=0.05, activation="gelu_new",
                             layer_norm_epsilon=1e-6)
    model = {"backbone": lambda: backbone, "masked_lm": lambda: BertMaskedLM(backbone),
             "classifier": lambda: BertClassifier(backbone, num_classes=4, dropout=0.2)}[task]()
    randomize(model, seed=5)
    check_keras_file_round_trip(model, make_inputs(), tmp_path)
    check_config_round_trip(model, make_inputs())


def test_get_config_is_exactly_the_arguments():
    backbone = tiny_backbone(dropout=0.2)
    config = backbone.get_config()
    expected = {**TINY, "dropout": 0.2, "attention_dropout": None, "layer_norm_epsilon": 1e-12,
                "activation": "gelu", "initializer_range": 0.02, "attention": "full",
                "attention_options": None, "packed_inputs": False, "remat": False,
                "layerdrop": 0.0, "position_padding_id": None}
    assert {k: v for k, v in config.items() if k not in ("name", "trainable", "dtype")} \
        == expected
    clone = BertBackbone.from_config(config)
    assert clone.get_config() == config
    clf = BertClassifier(backbone, num_classes=4, dropout=0.3)
    clf_config = clf.get_config()
    assert clf_config["num_classes"] == 4 and clf_config["dropout"] == 0.3
    assert BertClassifier.from_config(clf_config).get_config() == clf_config


@pytest.mark.parametrize("hidden_dropout", [0.0, 0.1, 0.25])
def test_classifier_dropout_follows_the_backbone_as_in_transformers(hidden_dropout):
    """Left unset, the head's dropout is the backbone's, as transformers' classifier takes
    `hidden_dropout_prob` when `classifier_dropout` is None (it was 0.1 whatever the
    backbone's: `load(..., task="classifier", dropout=0.0)` kept a dropout in the head)."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=61, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, hidden_dropout_prob=hidden_dropout, num_labels=3))
    clf = kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=3,
                            dropout=hidden_dropout, vocabulary_size=61, max_sequence_length=16)
    assert clf.classifier_dropout.rate == reference.dropout.p == hidden_dropout
    assert clf.get_config()["dropout"] == hidden_dropout
    assert BertClassifier(clf.backbone, num_classes=3, dropout=0.4).classifier_dropout.rate == 0.4
    assert BertClassifier(clf.backbone, num_classes=3, dropout=0.0).classifier_dropout.rate == 0.0


@pytest.mark.parametrize("task", ["masked_lm", "classifier", "backbone"])
def test_presets_save_load_directory(task, tmp_path):
    backbone = tiny_backbone(activation="relu")
    model = {"backbone": lambda: backbone, "masked_lm": lambda: BertMaskedLM(backbone),
             "classifier": lambda: BertClassifier(backbone, num_classes=3)}[task]()
    randomize(model, seed=6)
    check_preset_round_trip(model, make_inputs(), tmp_path)


def test_preset_load_overrides_and_task_switch(tmp_path):
    mlm = kzoo.presets.load("bert_tiny_uncased", vocabulary_size=61, max_sequence_length=16)
    assert isinstance(mlm, BertMaskedLM)
    assert mlm.backbone.num_layers == 2 and mlm.backbone.hidden_dim == 128
    assert mlm.backbone.vocabulary_size == 61
    clf = kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=3,
                            vocabulary_size=61, max_sequence_length=16)
    assert isinstance(clf, BertClassifier) and clf.num_classes == 3
    randomize(mlm, seed=7, scale=0.05)
    kzoo.presets.save(mlm, tmp_path)
    clf = kzoo.presets.load(tmp_path, task="classifier", num_classes=3)
    assert isinstance(clf, BertClassifier) and clf.num_classes == 3
    inputs = make_inputs()
    np.testing.assert_array_equal(to_numpy(clf.backbone(inputs)["sequence_output"]),
                                  to_numpy(mlm.backbone(inputs)["sequence_output"]))
    with pytest.raises(ValueError, match="num_clases"):
        kzoo.presets.load("bert_tiny_uncased", task="classifier", num_clases=3)


@pytest.mark.spread
def test_fit_masked_lm_lowers_loss():
    inputs = make_inputs(batch=8, lengths=(9, 8, 7, 6, 9, 5, 4, 9))
    labels = rng(8).integers(0, 61, size=(8, 9)).astype("int32")
    check_fit_lowers_loss(BertMaskedLM(tiny_backbone(dropout=0.0)), inputs, labels)


@pytest.mark.spread
def test_fit_classifier_lowers_loss():
    inputs = make_inputs(batch=8, lengths=(9, 8, 7, 6, 9, 5, 4, 9))
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1], "int32")
    check_fit_lowers_loss(
        BertClassifier(tiny_backbone(dropout=0.0), num_classes=3, dropout=0.0), inputs, labels)


def test_mixed_precision():
    backbone = tiny_backbone(dtype="mixed_bfloat16")
    mlm = BertMaskedLM(backbone)
    assert mlm.dtype_policy.name == "mixed_bfloat16"
    logits = mlm(make_inputs())
    assert keras.backend.standardize_dtype(logits.dtype) == "bfloat16"
    assert backbone.token_embedding.embeddings.dtype == "float32"
    assert np.all(np.isfinite(to_numpy(keras.ops.cast(logits, "float32"))))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(num_heads=3), "num_heads"),
        (dict(hidden_dim=0), "hidden_dim"),
        (dict(num_layers=-1), "num_layers"),
        (dict(vocabulary_size=2.5), "vocabulary_size"),
        (dict(dropout=1.5), "dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
        (dict(activation="gelu_42"), "activation"),
        (dict(num_segments=0), "num_segments"),
        (dict(max_sequence_length=None), "max_sequence_length"),
    ],
)
def test_config_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        tiny_backbone(**kwargs)


def test_task_validation():
    backbone = tiny_backbone()
    with pytest.raises(ValueError, match="num_classes"):
        BertClassifier(backbone, num_classes=0)
    with pytest.raises(ValueError, match="dropout"):
        BertClassifier(backbone, dropout=1.0)
    with pytest.raises(ValueError, match="backbone"):
        BertMaskedLM(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="sequence_length"):
        backbone(make_inputs(batch=1, seq=30, lengths=(30,)))


# --- Presets ----------------------------------------------------------------------------

SMALL_PRESETS = ["bert_tiny_uncased", "bert_mini_uncased"]
LARGE_PRESETS = ["bert_small_uncased", "bert_medium_uncased", "bert_base_uncased",
                 "bert_large_uncased"]
SHAPES = {"bert_tiny_uncased": (2, 128, 2), "bert_mini_uncased": (4, 256, 4),
          "bert_small_uncased": (4, 512, 8), "bert_medium_uncased": (8, 512, 8),
          "bert_base_uncased": (12, 768, 12), "bert_large_uncased": (24, 1024, 16)}


def _hf_counts(layers, hidden, heads):
    """Parameter counts of transformers' BertModel (with pooler) and BertForMaskedLM."""
    import torch
    import transformers

    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden,
                                     num_attention_heads=heads, intermediate_size=4 * hidden)
    with torch.device("meta"):
        model = transformers.BertModel(config)
        mlm = transformers.BertForMaskedLM(config)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return count(model), count(mlm)


def _check_preset(name):
    spec = kzoo.presets.info(name)
    assert spec["family"] == "bert" and spec["task"] == "masked_lm"
    assert {"name", "config", "task_config", "description", "paper", "params",
            "hf_reference"} <= set(spec)
    assert spec["name"] == name and "arxiv.org/abs/" in spec["paper"]
    layers, hidden, heads = SHAPES[name]
    config = spec["config"]
    assert (config["num_layers"], config["hidden_dim"], config["num_heads"]) == SHAPES[name]
    assert config["intermediate_dim"] == 4 * hidden and config["vocabulary_size"] == 30522
    model = kzoo.presets.load(name)
    assert isinstance(model, BertMaskedLM)
    assert model.count_params() == spec["params"]
    assert model.backbone.count_params() == spec["params_backbone"]
    hf_backbone, hf_mlm = _hf_counts(layers, hidden, heads)
    pooler = hidden * hidden + hidden
    assert spec["params_backbone"] == hf_backbone
    assert spec["params"] == hf_mlm + pooler
    # Published figures: within 1%, except BERT-Large's rounded "340M" (1.1%).
    tolerance = 0.012 if name == "bert_large_uncased" else 0.01
    assert abs(spec["params"] - spec["published_params"]) / spec["published_params"] < tolerance


@pytest.mark.parametrize("name", SMALL_PRESETS)
def test_small_preset_param_counts(name):
    _check_preset(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE_PRESETS)
def test_large_preset_param_counts(name):
    _check_preset(name)


def test_presets_are_listed():
    names = kzoo.presets.list()
    for name in SMALL_PRESETS + LARGE_PRESETS:
        assert name in names


# --- Hugging Face conversion ------------------------------------------------------------

HF_TINY = dict(vocab_size=67, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=37, max_position_embeddings=40, type_vocab_size=3,
               layer_norm_eps=1e-7, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.05)


def hf_model(cls_name, seed=0, **config):
    """A tiny randomly initialised transformers BERT, every weight of scale ~0.2."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.BertConfig(**{**HF_TINY, **config})
    model = getattr(transformers, cls_name)(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2)
            if "LayerNorm.weight" in name:
                p.add_(1.0)
    return model


def hf_inputs(lengths=(11, 7, 4), seq=11, vocab=67, segments=3):
    inputs = make_inputs(batch=len(lengths), seq=seq, vocab=vocab, lengths=lengths, seed=11)
    r = rng(12)
    inputs["segment_ids"] = np.where(inputs["padding_mask"] == 1,
                                     r.integers(0, segments, size=(len(lengths), seq)),
                                     0).astype("int32")
    return inputs


def hf_kwargs(inputs):
    """kzoo's BERT inputs under transformers' names."""
    return dict(input_ids=inputs["token_ids"], token_type_ids=inputs["segment_ids"],
                attention_mask=inputs["padding_mask"])


def hf_forward(model, inputs):
    return torch_forward(model, **hf_kwargs(inputs))


def hf_outputs(model, inputs):
    """The tensors to compare, as NumPy: logits, or (sequence, pooled) for BertModel."""
    out = hf_forward(model, inputs)
    if hasattr(out, "logits"):
        return [out.logits.numpy()]
    if hasattr(out, "prediction_logits"):
        return [out.prediction_logits.numpy()]
    return [out.last_hidden_state.numpy(), out.pooler_output.numpy()]


# (kzoo output, transformers output) pairs compared for each task
PARITY = {
    "backbone": [(lambda o: o["sequence_output"], lambda o: o.last_hidden_state),
                 (lambda o: o["pooled_output"], lambda o: o.pooler_output)],
    "masked_lm": [(None, lambda o: o.logits)],
    "classifier": [(None, lambda o: o.logits)],
}


def assert_bert_matches(model, reference, inputs, task, atol=1e-5, label=""):
    for kzoo_select, hf_select in PARITY[task]:
        assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs), atol=atol,
                                    select=hf_select, kzoo_select=kzoo_select,
                                    mask=inputs["padding_mask"], label=label)


@pytest.mark.parametrize(
    "cls_name, task, config",
    [
        ("BertForMaskedLM", "masked_lm", {}),
        ("BertForMaskedLM", "masked_lm", {"hidden_act": "gelu_new"}),
        ("BertForSequenceClassification", "classifier", {"num_labels": 3,
                                                         "classifier_dropout": 0.2}),
        ("BertModel", "backbone", {"hidden_act": "relu"}),
        ("BertModel", "backbone", {"hidden_act": "gelu_python_tanh"}),
    ],
)
def test_hf_parity_and_round_trip(cls_name, task, config, tmp_path):
    import transformers

    reference = hf_model(cls_name, **config)
    src = hf_checkpoint(os.path.join(tmp_path, "hf"), reference)
    inputs = hf_inputs()
    expected = hf_outputs(reference, inputs)

    model = kzoo.presets.load(src)
    assert (getattr(model, "task_name", None) or "backbone") == task
    backbone = model.backbone if task != "backbone" else model
    assert backbone.layer_norm_epsilon == 1e-7 and backbone.num_segments == 3
    assert backbone.intermediate_dim == 37 and backbone.max_sequence_length == 40
    assert backbone.attention_dropout == 0.05
    if "hidden_act" in config:  # the name kept, or its kzoo alias for the same function
        assert backbone.activation == {"gelu_python_tanh": "gelu_pytorch_tanh"}.get(
            config["hidden_act"], config["hidden_act"])
    if task == "classifier":
        assert model.num_classes == 3 and model.dropout == 0.2
    assert_bert_matches(model, reference, inputs, task, label=f"{cls_name} {config}")

    # kzoo -> HF: transformers reads the export and computes the same outputs.
    out = os.path.join(tmp_path, "export")
    kzoo.presets.save(model, out, format="hf")
    exported = getattr(transformers, cls_name).from_pretrained(out).eval()
    for g, e in zip(hf_outputs(exported, inputs), expected):
        assert max_real_diff(g, e, inputs["padding_mask"]) <= 1e-5
    # HF -> kzoo -> HF: identical tensors under identical names.
    assert_same_hf_tensors(src, out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [cls_name]


def test_hf_pretraining_checkpoint_loads_as_masked_lm(tmp_path):
    """Google's original layout: pooler + next-sentence head, decoder stored untied-looking."""
    reference = hf_model("BertForPreTraining")
    hf_checkpoint(tmp_path, reference)
    inputs = hf_inputs()
    model = kzoo.presets.load(tmp_path)
    assert isinstance(model, BertMaskedLM)
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                select=lambda o: o.prediction_logits,
                                mask=inputs["padding_mask"])
    # Its pooler was loaded too: the backbone's pooled output matches BertModel's.
    pooled = to_numpy(model.backbone(inputs)["pooled_output"])
    expected = hf_forward(reference.bert, inputs).pooler_output.numpy()
    np.testing.assert_allclose(pooled, expected, atol=1e-5)


def test_hf_masked_lm_as_backbone_and_classifier(tmp_path):
    reference = hf_model("BertForMaskedLM")
    hf_checkpoint(tmp_path, reference)
    inputs = hf_inputs()
    expected = hf_forward(reference.bert, inputs).last_hidden_state.numpy()
    with pytest.warns(UserWarning, match="pooler"):
        backbone = kzoo.presets.load(tmp_path, task="backbone")
    got = to_numpy(backbone(inputs)["sequence_output"])
    assert max_real_diff(got, expected, inputs["padding_mask"]) <= 1e-5
    clf = kzoo.presets.load(tmp_path, task="classifier", num_classes=4)
    assert isinstance(clf, BertClassifier) and tuple(clf(inputs).shape) == (3, 4)


def _write_hf(tmp_path, config, state):
    from safetensors.numpy import save_file

    os.makedirs(tmp_path, exist_ok=True)
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def hf_mlm_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_mlm")
    hf_checkpoint(path, hf_model("BertForMaskedLM"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config, hf_state(path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("position_embedding_type", "relative_key"),
        ("position_embedding_type", "relative_key_query"),
        ("hidden_act", "mish"),
        ("is_decoder", True),
        ("add_cross_attention", True),
        ("tie_word_embeddings", False),
        ("architectures", ["BertForQuestionAnswering"]),
    ],
)
def test_hf_unsupported_fields_raise(field, value, hf_mlm_files, tmp_path):
    config, state = hf_mlm_files
    _write_hf(tmp_path, {**config, field: value}, state)
    with pytest.raises(ValueError, match=field):
        kzoo.presets.load(tmp_path)


def test_hf_missing_unexpected_and_mismatched_weights(hf_mlm_files, tmp_path):
    config, state = hf_mlm_files
    missing = dict(state)
    del missing["bert.encoder.layer.1.output.dense.bias"]
    missing["bert.encoder.layer.9.output.dense.bias"] = state["cls.predictions.bias"]
    _write_hf(os.path.join(tmp_path, "a"), config, missing)
    with pytest.raises(ValueError) as info:
        kzoo.presets.load(os.path.join(tmp_path, "a"))
    assert "bert.encoder.layer.1.output.dense.bias" in str(info.value)
    assert "bert.encoder.layer.9.output.dense.bias" in str(info.value)
    wrong = dict(state)
    wrong["bert.embeddings.position_embeddings.weight"] = np.zeros((39, 32), np.float32)
    _write_hf(os.path.join(tmp_path, "b"), config, wrong)
    with pytest.raises(ValueError, match=r"\(39, 32\).*\(40, 32\)"):
        kzoo.presets.load(os.path.join(tmp_path, "b"))
    untied = dict(state)
    untied["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"] + 1
    _write_hf(os.path.join(tmp_path, "c"), config, untied)
    with pytest.raises(ValueError, match="tie"):
        kzoo.presets.load(os.path.join(tmp_path, "c"))


def test_hf_legacy_layer_norm_names(hf_mlm_files, tmp_path):
    """TF-era checkpoints name layer norms gamma/beta; transformers renames them, so do we."""
    config, state = hf_mlm_files
    legacy = {}
    for name, value in state.items():
        if "LayerNorm" in name:
            name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
        legacy[name] = value
    _write_hf(tmp_path, config, legacy)
    model = kzoo.presets.load(tmp_path)
    np.testing.assert_array_equal(
        to_numpy(model.backbone.embeddings_layer_norm.gamma),
        state["bert.embeddings.LayerNorm.weight"])


def test_hf_load_weights_into_preset(tmp_path):
    """`load(preset, weights=hf_dir)`: a preset-shaped model gets a checkpoint's weights."""
    reference = hf_model("BertForMaskedLM", vocab_size=30522, hidden_size=128,
                         num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                         max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12)
    hf_checkpoint(tmp_path, reference)
    model = kzoo.presets.load("bert_tiny_uncased", weights=tmp_path)
    inputs = make_inputs(vocab=30522)
    assert_bert_matches(model, reference, inputs, "masked_lm", atol=1e-4)


# --- Tokenizer --------------------------------------------------------------------------

WORDPIECE_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on",
                   "mat", "##s", "dog", "##gy", "a", ",", "."]


def test_wordpiece_tokenizer_is_attached(tmp_path):
    import transformers

    hf_checkpoint(tmp_path, hf_model("BertForMaskedLM", vocab_size=len(WORDPIECE_VOCAB)))
    with open(os.path.join(tmp_path, "vocab.txt"), "w") as f:
        f.write("\n".join(WORDPIECE_VOCAB) + "\n")
    model = kzoo.presets.load(tmp_path)
    text = "The cats sat on a doggy mat, purring."
    ids = model.tokenizer.encode(text).ids
    # [CLS] the cat ##s sat on a dog ##gy mat , [UNK] . [SEP]
    expected = [2, 5, 6, 10, 7, 8, 13, 11, 12, 9, 14, 1, 15, 3]
    assert ids == expected
    reference = transformers.BertTokenizer(os.path.join(tmp_path, "vocab.txt"))
    assert reference(text)["input_ids"] == expected
    # The ids run through the model; the HF export carries the tokenizer along.
    logits = model({"token_ids": np.array([ids], "int32"),
                    "segment_ids": np.zeros((1, len(ids)), "int32"),
                    "padding_mask": np.ones((1, len(ids)), "int32")})
    assert tuple(logits.shape) == (1, len(ids), len(WORDPIECE_VOCAB))
    out = os.path.join(tmp_path, "export")
    kzoo.presets.save(model, out, format="hf")
    assert kzoo.presets.load(out).tokenizer.encode(text).ids == expected


# --- mask_positions: the masked-LM head at given positions only ---------------------------


def test_mask_positions_match_transformers_logits_at_those_positions(tmp_path):
    reference = hf_model("BertForMaskedLM")
    model = kzoo.presets.load(hf_checkpoint(os.path.join(tmp_path, "hf"), reference))
    inputs = hf_inputs()
    expected = hf_outputs(reference, inputs)[0]  # (batch, seq, vocab), every position
    positions = np.array([[0, 5, 10], [6, 1, 1], [3, 2, 0]], "int32")  # real tokens, repeats
    got = to_numpy(model({**inputs, "mask_positions": positions}))
    assert got.shape == positions.shape + (expected.shape[-1],)
    want = np.take_along_axis(expected, positions[..., None], axis=1)
    print("mask_positions max |diff| vs transformers:", np.abs(got - want).max())
    assert_close(got, want, atol=1e-5)
    # Left out, the head runs at every position (the dict needs no None entry).
    assert to_numpy(model(inputs)).shape == expected.shape
    assert model.predict({**inputs, "mask_positions": positions}, verbose=0).shape == got.shape


@pytest.mark.spread
def test_mask_positions_training_equals_weighted_every_position():
    """One SGD step with targets at `mask_positions` equals one with targets everywhere and
    the loss weighted to those positions (the same loss up to the normalisation, which the
    weights' sum fixes: Keras divides a weighted loss by the number of entries)."""
    inputs = make_inputs(batch=4, lengths=(9, 9, 9, 9))
    positions = np.array([[1, 4], [0, 8], [2, 3], [7, 5]], "int32")
    labels = rng(3).integers(0, 61, size=(4, 9)).astype("int32")
    weights = np.zeros((4, 9), "float32")
    np.put_along_axis(weights, positions, 1.0, axis=1)
    grads = []
    for x, y, w in (({**inputs, "mask_positions": positions},
                     np.take_along_axis(labels, positions, axis=1), None),
                    (inputs, labels, weights * (9 / 2))):  # mean over 9 vs over 2 entries
        model = BertMaskedLM(tiny_backbone(dropout=0.0, attention_dropout=0.0))
        randomize(model)
        model.compile(keras.optimizers.SGD(learning_rate=1.0), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = [to_numpy(v) for v in model.trainable_variables]
        model.train_on_batch(x, y, sample_weight=w)
        grads.append([b - to_numpy(v) for b, v in zip(before, model.trainable_variables)])
    moved = max(np.abs(g).max() for g in grads[0])
    assert moved > 1e-3
    for a, b in zip(*grads):
        assert_close(a, b, atol=2e-6)


@pytest.mark.parametrize("positions, fragment", [
    (np.array([[0, 9], [1, 2], [3, 4]], "int32"), "holds position 9 at batch row 0, entry 1"),
    (np.array([[0, 1], [-1, 2], [3, 4]], "int32"), "holds position -1 at batch row 1"),
    (np.array([[0.0, 1.0], [1, 2], [3, 4]]), "must hold integer ids"),
    (np.array([[0], [1]], "int32"), "must have shape (batch, n) with the batch of `token_ids`"),
])
def test_mask_positions_refused_with_a_clear_error(positions, fragment):
    model = BertMaskedLM(tiny_backbone())
    inputs = make_inputs()
    for run in (lambda x: model(x), lambda x: model.predict(x, verbose=0)):
        with pytest.raises(ValueError, match="mask_positions") as info:
            run({**inputs, "mask_positions": positions})
        assert fragment in str(info.value)


@pytest.mark.spread
@pytest.mark.parametrize("attention,options", [
    ("sliding_window", {"window": 3}),
    ("linear", None),
    ("longformer", {"window": 3, "global_tokens": 1}),  # (no global projections)
])
def test_hf_export_refuses_attention_bert_lacks(attention, options, tmp_path):
    """Found by the parity audit: `save(format="hf")` wrote a BERT with an efficient attention
    as a plain `BertModel` checkpoint, which transformers loads and runs with full attention
    (max |diff| 2.6e-4 on a sliding window of 2, more with larger weights). It must refuse."""
    import transformers

    backbone = tiny_backbone(attention=attention, attention_options=options)
    with pytest.raises(ValueError, match=rf"attention='{attention}'.*allowed: attention='full'"):
        kzoo.presets.save(BertMaskedLM(backbone), str(tmp_path / "refused"), format="hf")
    assert not os.path.exists(tmp_path / "refused")
    # The same model with full attention is written and matches transformers.
    full = BertMaskedLM(tiny_backbone())
    kzoo.presets.save(full, str(tmp_path / "full"), format="hf")
    hf = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "full")).eval()
    ids = rng(0).integers(0, TINY["vocabulary_size"], (2, 9)).astype("int32")
    inputs = {"token_ids": ids, "segment_ids": np.zeros_like(ids),
              "padding_mask": np.ones_like(ids)}
    assert_matches_transformers(full, hf, inputs, dict(input_ids=ids,
                                                       token_type_ids=inputs["segment_ids"],
                                                       attention_mask=inputs["padding_mask"]))


@pytest.mark.spread
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_all_padding_row_matches_transformers(attn_implementation, tmp_path):
    """Found by the parity audit: a row whose padding_mask is all zeros gave kzoo's zeros
    from every attention layer, where transformers' BERT (eager and SDPA alike) adds the
    float32 minimum to the masked scores and so attends uniformly to every key (max |diff|
    0.32 on that row's sequence output, 0.11 on its pooled output). Compared everywhere,
    padding included, in a batch with a full row and a right-padded one; the masked LM's
    `output_positions` path (the last block computing only the masked rows) too."""
    reference = hf_model("BertForMaskedLM", attn_implementation=attn_implementation)
    hf_checkpoint(tmp_path, reference)
    model = kzoo.presets.load(tmp_path)
    inputs = hf_inputs(lengths=(11, 0, 4))
    assert not inputs["padding_mask"][1].any()
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                label=f"all-padding row ({attn_implementation})")
    backbone_ref = hf_model("BertModel", seed=1, attn_implementation=attn_implementation)
    backbone = kzoo.presets.load(hf_checkpoint(tmp_path / "backbone", backbone_ref))
    for ours, theirs in (("sequence_output", "last_hidden_state"),
                         ("pooled_output", "pooler_output")):
        assert_matches_transformers(backbone, backbone_ref, inputs, hf_kwargs(inputs),
                                    select=lambda o, t=theirs: getattr(o, t),
                                    kzoo_select=lambda o, k=ours: o[k], label=ours)
    positions = np.array([[0, 3], [1, 5], [2, 9]], "int32")
    logits = to_numpy(forward(model, {**inputs, "mask_positions": positions}))
    expected = hf_forward(reference, inputs).logits.numpy()
    np.testing.assert_allclose(logits, np.take_along_axis(expected, positions[..., None], 1),
                               atol=1e-5, rtol=0)
