"""Hugging Face Longformer checkpoints -> kzoo BERT with attention="longformer": the
outputs equal transformers' (global attention, padding, a sequence longer than the window
and not a multiple of it), and back (`to_hf`)."""

import os

import keras
import numpy as np
import pytest

# transformers would otherwise import TensorFlow too (seconds); only its torch models are used.
os.environ.setdefault("USE_TF", "0")

import kzoo.presets
from kzoo import registry
from kzoo.convert import longformer as convert
from kzoo.layers.taps import Tap
from tests.harness import assert_matches_transformers, forward, hf_checkpoint, rng, to_numpy

PAD = 1
HF_TINY = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=48, max_position_embeddings=40, type_vocab_size=2,
               attention_window=4, pad_token_id=PAD, layer_norm_eps=1e-7,
               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
LENGTHS = (13, 9)  # right padding; 13 tokens: > attention_window 4, not a multiple of it
SEQ = 13


def hf_model(cls_name, seed=0, padding_row=0.0):
    """A tiny randomly initialised transformers Longformer, every weight of scale ~0.2 (the
    global projections too, so they differ from the normal ones), but the position table's
    row of `pad_token_id` `padding_row` (zeros in RoBERTa-style checkpoints: `padding_idx`
    initialises it so and its gradient is zero)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(transformers.LongformerConfig(**HF_TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2)
            if "LayerNorm.weight" in name or "layer_norm.weight" in name:
                p.add_(1.0)
            if name.endswith("position_embeddings.weight"):
                p[PAD] = padding_row
    return model


def make_inputs(global_positions=None):
    """kzoo inputs (ids >= 3 on real tokens, so none is the pad id; pad id on padding);
    `global_positions`: per example, the positions with global attention."""
    r = rng(3)
    padding_mask = np.zeros((len(LENGTHS), SEQ), "int32")
    for i, n in enumerate(LENGTHS):
        padding_mask[i, :n] = 1
    token_ids = np.where(padding_mask == 1, r.integers(3, HF_TINY["vocab_size"],
                                                       size=padding_mask.shape), PAD)
    segment_ids = np.where(padding_mask == 1, r.integers(0, 2, size=padding_mask.shape), 0)
    inputs = {"token_ids": token_ids.astype("int32"), "segment_ids": segment_ids.astype("int32"),
              "padding_mask": padding_mask}
    if global_positions is not None:
        flags = np.zeros_like(padding_mask)
        for i, positions in enumerate(global_positions):
            flags[i, list(positions)] = 1
        inputs["global_attention_mask"] = flags
    return inputs


def hf_kwargs(inputs):
    kwargs = dict(input_ids=inputs["token_ids"], token_type_ids=inputs["segment_ids"],
                  attention_mask=inputs["padding_mask"])
    if "global_attention_mask" in inputs:
        kwargs["global_attention_mask"] = inputs["global_attention_mask"]
    return kwargs


# Global attention: two tokens in the first example (one past the window of the first),
# one in the second (so the examples have different counts); or none.
GLOBAL = {"global": [(0, 7), (4,)], "none": None}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{task: (transformers model, kzoo model loaded from its save_pretrained directory)}."""
    out = {}
    for cls_name, task in (("LongformerModel", "backbone"),
                           ("LongformerForMaskedLM", "masked_lm")):
        reference = hf_model(cls_name, seed=len(task))
        path = hf_checkpoint(str(tmp_path_factory.mktemp("hf") / cls_name), reference)
        out[task] = (reference, kzoo.presets.load(path), path)
    return out


def _assert_backbone_matches(model, reference, inputs, label=""):
    mask = inputs["padding_mask"]
    for ours, theirs in (("sequence_output", "last_hidden_state"),
                         ("pooled_output", "pooler_output")):
        assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                    select=lambda o, t=theirs: getattr(o, t),
                                    kzoo_select=lambda o, k=ours: o[k], mask=mask,
                                    label=f"{label} {ours}")


def test_config_maps_the_window_and_positions(checkpoints):
    _, model, path = checkpoints["masked_lm"]
    backbone = model.backbone
    assert backbone.attention == "longformer"
    # attention_window=4: two tokens each side, kzoo's window counts the token itself.
    assert dict(backbone.attention_options) == {"window": 3, "global_tokens": 0,
                                                "block_size": None,
                                                "global_projections": True,
                                                "max_global": None}
    assert backbone.max_sequence_length == HF_TINY["max_position_embeddings"] - PAD - 1
    assert backbone.config.position_padding_id == PAD
    assert registry.for_model_type("longformer") is registry.family("bert")
    assert "global_attention_mask" in backbone.input


@pytest.mark.parametrize("case", list(GLOBAL))
def test_backbone_matches_transformers(checkpoints, case):
    reference, model, _ = checkpoints["backbone"]
    _assert_backbone_matches(model, reference, make_inputs(GLOBAL[case]), label=case)


@pytest.mark.parametrize("case", list(GLOBAL))
def test_masked_lm_matches_transformers(checkpoints, case):
    reference, model, _ = checkpoints["masked_lm"]
    inputs = make_inputs(GLOBAL[case])
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                mask=inputs["padding_mask"], label=f"masked_lm {case}")


def np_roberta_positions(token_ids, pad):
    """Hugging Face's `create_position_ids_from_input_ids`, in NumPy: the running count of
    the tokens whose id is not `pad`, `pad` on those tokens, plus `pad`."""
    real = (np.asarray(token_ids) != pad).astype(np.int64)
    return np.cumsum(real, axis=1) * real + pad


@pytest.mark.parametrize("case", ["left padded", "padding id inside", "no padding id"])
def test_positions_count_the_tokens_that_are_not_padding(checkpoints, case):
    """transformers numbers RoBERTa-style positions over the tokens whose id is not
    `pad_token_id`, whatever the attention mask: left padding shifts every real position,
    and a real token with the padding id (mask 1) takes the padding row and no count."""
    from kzoo.models.bert import NonPaddingPositions

    inputs = make_inputs(GLOBAL["global"])
    ids, mask = inputs["token_ids"].copy(), inputs["padding_mask"].copy()
    if case == "left padded":  # the same rows, their padding moved to the front
        for i, n in enumerate(LENGTHS):
            ids[i] = np.roll(ids[i], SEQ - n)
            mask[i] = np.roll(mask[i], SEQ - n)
        inputs["global_attention_mask"] = np.roll(inputs["global_attention_mask"][:, :],
                                                  0, axis=1) * mask
    elif case == "padding id inside":
        ids[0, [2, 5]] = PAD  # real tokens (mask 1) with the padding id
    inputs.update(token_ids=ids, padding_mask=mask)
    # the layer against transformers' formula (kzoo's table starts at its row PAD + 1)
    theirs = np_roberta_positions(ids, PAD)
    ours = to_numpy(NonPaddingPositions(PAD)(ids))
    real = ids != PAD
    np.testing.assert_array_equal(ours[real], theirs[real] - PAD - 1)
    reference, model, _ = checkpoints["backbone"]
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                select=lambda o: o.last_hidden_state,
                                kzoo_select=lambda o: o["sequence_output"], mask=mask,
                                label=f"{case} sequence_output")
    # the pooled output of every row, and every position's output: a left-padded row pools a
    # padding token, whose attention transformers zeroes (kzoo's was 6.5e-3 apart there)
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                select=lambda o: o.pooler_output,
                                kzoo_select=lambda o: o["pooled_output"],
                                label=f"{case} pooled_output")
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                select=lambda o: o.last_hidden_state,
                                kzoo_select=lambda o: o["sequence_output"],
                                label=f"{case} sequence_output, padding included")


def test_a_nonzero_padding_row_warns(tmp_path):
    reference = hf_model("LongformerModel", padding_row=0.5)
    path = hf_checkpoint(str(tmp_path / "hf"), reference)
    with pytest.warns(UserWarning, match="row of pad_token_id is not zero"):
        kzoo.presets.load(path)


def test_global_mask_given_as_zeros_equals_left_out(checkpoints):
    _, model, _ = checkpoints["masked_lm"]
    inputs = make_inputs()
    zeros = {**inputs, "global_attention_mask": np.zeros_like(inputs["padding_mask"])}
    np.testing.assert_allclose(to_numpy(forward(model, zeros)), to_numpy(forward(model, inputs)),
                               atol=1e-6)


def test_global_rows_use_the_global_projections(checkpoints):
    """With the normal projections in place of the global ones, the outputs move far from
    transformers' (so the parity above could not pass without them), and the global
    tokens' own rows are where it starts."""
    reference, model, _ = checkpoints["masked_lm"]
    inputs = make_inputs(GLOBAL["global"])
    attentions = [b.self_attention for b in model.backbone.transformer_layers]
    saved = [[keras.ops.convert_to_numpy(w) for w in a.weights] for a in attentions]
    try:
        for att in attentions:
            for name in ("query", "key", "value"):
                normal, glob = getattr(att, name + "_dense"), getattr(att, name + "_global_dense")
                glob.kernel.assign(keras.ops.convert_to_numpy(normal.kernel))
                glob.bias.assign(keras.ops.convert_to_numpy(normal.bias))
        with pytest.raises(AssertionError, match="max .diff"):
            assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                        atol=1e-2, mask=inputs["padding_mask"],
                                        label="normal projections as global ones")
    finally:
        for att, values in zip(attentions, saved):
            for w, v in zip(att.weights, values):
                w.assign(v)
    assert_matches_transformers(model, reference, inputs, hf_kwargs(inputs),
                                mask=inputs["padding_mask"], label="restored")


def test_tap_path_equals_the_kernel_path():
    """Under a Tap the layer takes the explicit formula (global rows with their own
    weights and values): the same output as the kernel path (checked against
    transformers above), rows that sum to 1 and Longformer's pattern."""
    from kzoo.layers import MultiHeadAttention

    layer = MultiHeadAttention(num_heads=2, attention="longformer", attention_options={
        "window": 3, "global_tokens": 0, "global_projections": True})
    r = rng(5)
    x = r.normal(size=(len(LENGTHS), SEQ, 16)).astype("float32")
    inputs = make_inputs(GLOBAL["global"])
    padding, flags = inputs["padding_mask"], inputs["global_attention_mask"]
    # The kernel path as a compiled model (JAX: one compilation, not one per eager op).
    symbolic = [keras.Input((SEQ, 16)), keras.Input((SEQ,), dtype="int32"),
                keras.Input((SEQ,), dtype="int32")]
    model = keras.Model(symbolic, layer(symbolic[0], attention_mask=symbolic[1],
                                        global_attention_mask=symbolic[2]))
    for w in layer.weights:  # every projection non-trivial, biases included
        w.assign(r.normal(0.0, 0.3, size=tuple(w.shape)).astype("float32"))
    fast = to_numpy(forward(model, [x, padding, flags]))
    with Tap() as tap:
        tapped = to_numpy(layer(x, attention_mask=padding, global_attention_mask=flags))
    real = padding.astype(bool)
    np.testing.assert_allclose(tapped[real], fast[real], atol=1e-5)
    weights = to_numpy(tap.attention_records[0].weights)
    assert weights.shape == (len(LENGTHS), 2, SEQ, SEQ)
    np.testing.assert_allclose(weights.sum(-1)[real[:, None, :].repeat(2, 1)], 1.0,
                               atol=1e-5)
    # Global token 7 of example 0 sees every real key; token 3 its window and the globals.
    assert (weights[0, :, 7] > 0).all()
    seen = weights[0, :, 3] > 0
    assert seen[:, [0, 1, 2, 3, 4, 5, 7]].all() and not seen[:, [6, 8, 9, 10, 11, 12]].any()
    # Example 1 (9 real tokens, global token 4): padded keys are never seen.
    assert (weights[1, :, :, LENGTHS[1]:] == 0).all()
    assert (weights[1, :, 4, :LENGTHS[1]] > 0).all()


def test_export_reads_back_in_transformers(checkpoints, tmp_path):
    import transformers

    for task, cls_name in (("masked_lm", "LongformerForMaskedLM"),
                           ("backbone", "LongformerModel")):
        reference, model, _ = checkpoints[task]
        out = str(tmp_path / task)
        kzoo.presets.save(model, out, format="hf")
        exported = getattr(transformers, cls_name).from_pretrained(out).eval()
        inputs = make_inputs(GLOBAL["global"])
        if task == "backbone":
            _assert_backbone_matches(model, exported, inputs, label="export")
        else:
            assert_matches_transformers(model, exported, inputs, hf_kwargs(inputs),
                                        mask=inputs["padding_mask"], label="export")


@pytest.mark.spread
def test_kzoo_save_load_and_fit(checkpoints, tmp_path):
    """A longformer BERT saves and loads (kzoo format) with the same outputs, and trains
    with or without the global mask in the input dict."""
    _, model, _ = checkpoints["masked_lm"]
    inputs = make_inputs(GLOBAL["global"])
    kzoo.presets.save(model, str(tmp_path))
    loaded = kzoo.presets.load(str(tmp_path))
    # The same configuration (optional input and global projections included) and weights:
    # the same function (a compiled forward pass of it would cost JAX seconds).
    assert loaded.backbone.config == model.backbone.config
    assert "global_attention_mask" in loaded.input
    assert [w.path for w in loaded.weights] == [w.path for w in model.weights]
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    plain = {k: v for k, v in inputs.items() if k != "global_attention_mask"}
    loaded.compile(optimizer=keras.optimizers.SGD(0.01))
    labels = inputs["token_ids"]
    # One step with the global mask left out of the dict (the model fills it in).
    history = loaded.fit(plain, labels, epochs=1, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    with pytest.raises(ValueError, match="token_ids"):
        loaded.predict({**plain, "token_ids": plain["token_ids"] + 100}, verbose=0)


def test_bad_configs_and_inputs_raise(checkpoints):
    hf = {"model_type": "longformer", **HF_TINY, "architectures": ["LongformerModel"]}
    convert.config_from_hf(hf)  # the tiny config itself is fine
    for window, match in ((5, r"attention_window=5"), (0, r"attention_window=0"),
                          ([4, 6], r"Different windows per layer.*attention_window=\[4, 6\]"),
                          ([4], r"one window a layer")):
        with pytest.raises(ValueError, match=match):
            convert.config_from_hf({**hf, "attention_window": window})
    with pytest.raises(ValueError, match="architectures"):
        convert.config_from_hf({**hf, "architectures": ["LongformerForQuestionAnswering"]})
    with pytest.raises(ValueError, match="hidden_act='relu'.*LongformerForMaskedLM"):
        convert.config_from_hf({**hf, "hidden_act": "relu",
                                "architectures": ["LongformerForMaskedLM"]})
    from kzoo.models.bert import BertConfig

    with pytest.raises(ValueError, match="`position_padding_id`.*packed_inputs"):
        BertConfig(position_padding_id=1, packed_inputs=True)
    with pytest.raises(ValueError, match="`position_padding_id` must be a non-negative"):
        BertConfig(position_padding_id=-1)
    _, model, _ = checkpoints["masked_lm"]
    inputs = make_inputs()
    bad = {**inputs, "global_attention_mask": np.zeros((len(LENGTHS), SEQ - 1), "int32")}
    with pytest.raises(ValueError, match=r"global_attention_mask.*\(batch, seq\)"):
        model(bad)


def test_bert_export_refuses_roberta_positions(tmp_path):
    from kzoo.models.bert import BertBackbone

    backbone = BertBackbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8,
                            intermediate_dim=8, max_sequence_length=8, position_padding_id=1)
    with pytest.raises(ValueError, match="position_padding_id=1 has no Hugging Face BERT"):
        kzoo.presets.save(backbone, str(tmp_path / "hf"), format="hf")
    tanh = BertBackbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8,
                        intermediate_dim=8, max_sequence_length=8, position_padding_id=1,
                        activation="gelu_tanh")  # (keras-hub's BERT activation)
    with pytest.raises(ValueError, match="position_padding_id=1 has no keras-hub"):
        kzoo.presets.save(tanh, str(tmp_path / "hub"), format="keras_hub")
