"""Regression tests of a hostile review (h57c): each checks kzoo against an independent
reference (transformers' own loading report or outputs, a NumPy formula)."""

import warnings

import numpy as np
import pytest

import kzoo
from tests.harness import hf_checkpoint


def _tiny_llama(cls, tie=False):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        tie_word_embeddings=tie)
    return getattr(transformers, cls)(config).eval()


def _tiny_bert(cls, **extra):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, **extra)
    return getattr(transformers, cls)(config).eval()


def _tiny_vit(cls):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        image_size=8, patch_size=4, num_labels=2)
    return getattr(transformers, cls)(config).eval()


_MAKERS = {"Llama": _tiny_llama, "Bert": _tiny_bert, "ViT": _tiny_vit}


def _make(cls):
    return next(make for prefix, make in _MAKERS.items() if cls.startswith(prefix))(cls)


def _missing_in_transformers(cls, path):
    """The weights transformers reports as newly initialised when `cls` loads `path`."""
    import transformers

    _, info = getattr(transformers, cls).from_pretrained(path, output_loading_info=True)
    return set(info["missing_keys"])


def _fresh_weight_warnings(caught):
    return [str(w.message) for w in caught if "initial values" in str(w.message)
            and "has no weights for" in str(w.message)]


@pytest.mark.parametrize("saved, loaded, task, kwargs", [
    ("LlamaModel", "LlamaForCausalLM", "causal_lm", {}),
    ("BertModel", "BertForMaskedLM", "masked_lm", {}),
    ("BertForMaskedLM", "BertForSequenceClassification", "classifier", {"num_classes": 2}),
    ("ViTModel", "ViTForImageClassification", "classifier", {"num_classes": 2}),
])
def test_a_checkpoint_loaded_with_another_head_names_the_fresh_weights(saved, loaded, task,
                                                                        kwargs, tmp_path):
    """A checkpoint saved without the head of the task asked for: kzoo built that head with
    random weights and said nothing (`generate` of a `LlamaModel` loaded as a causal LM gave
    random tokens). transformers names them; so must kzoo, each of them one transformers
    names too."""
    path = hf_checkpoint(tmp_path / "ckpt", _make(saved))
    expected = _missing_in_transformers(loaded, path)
    assert expected  # (the reference: transformers initialises these afresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kzoo.presets.load(path, task=task, **kwargs)
    messages = _fresh_weight_warnings(caught)
    assert len(messages) == 1, [str(w.message) for w in caught]
    named = {name for name in expected if f"'{name}'" in messages[0]}
    assert named, (messages[0], expected)


@pytest.mark.parametrize("saved, task, kwargs", [
    ("LlamaForCausalLM", "causal_lm", {}),
    ("LlamaForCausalLM", "backbone", {}),
    ("BertForMaskedLM", "masked_lm", {}),
    ("BertForSequenceClassification", "classifier", {"num_classes": 3}),
    ("ViTForImageClassification", "classifier", {"num_classes": 2}),
    ("ViTModel", "backbone", {}),
])
def test_a_checkpoint_with_every_weight_of_the_task_warns_of_none(saved, task, kwargs, tmp_path):
    model = _tiny_bert(saved, num_labels=3) if saved.startswith("BertForSeq") else _make(saved)
    path = hf_checkpoint(tmp_path / "ckpt", model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kzoo.presets.load(path, task=task, **kwargs)
    assert not _fresh_weight_warnings(caught)


def test_a_tied_head_needs_no_weights_of_its_own(tmp_path):
    """A `LlamaModel` with tied embeddings loaded as a causal LM has every weight it needs:
    its logits equal transformers' `LlamaForCausalLM` of the same checkpoint."""
    import torch
    import transformers

    path = hf_checkpoint(tmp_path / "ckpt", _tiny_llama("LlamaModel", tie=True))
    assert not _missing_in_transformers("LlamaForCausalLM", path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = kzoo.presets.load(path, task="causal_lm")
    assert not _fresh_weight_warnings(caught)
    ids = np.array([[3, 9, 27, 1]], dtype="int32")
    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids).long()).logits.numpy()
    from tests.harness import to_numpy

    ours = to_numpy(model({"token_ids": ids}))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("mask", [False, True])
def test_segment_ids_of_another_shape_than_token_ids_are_named(mask):
    """BERT's `segment_ids` of another length than `token_ids`: the error blamed
    `padding_mask`, which the caller had not given (the model made it from `token_ids`)."""
    model = kzoo.presets.load("bert_tiny_uncased", num_layers=1, hidden_dim=16, num_heads=2,
                              intermediate_dim=16, vocabulary_size=32, max_sequence_length=8)
    inputs = {"token_ids": np.ones((1, 4), "int32"), "segment_ids": np.zeros((1, 3), "int32")}
    if mask:
        inputs["padding_mask"] = np.ones((1, 4), "int32")
    with pytest.raises(ValueError, match=r"`segment_ids` .* shape \(1, 3\); it must have the "
                                         r"shape of `token_ids`, \(1, 4\)"):
        model(inputs)
    with pytest.raises(ValueError, match=r"`segment_ids` .* shape \(1, 3\)"):
        model.predict(inputs, verbose=0)


def test_a_keras_hub_backbone_or_kzoo_backbone_loaded_with_a_head_names_the_fresh_weights(
        tmp_path):
    """The same for a keras-hub preset of a backbone and a kzoo directory of a backbone:
    the masked-LM head kzoo builds on them has no saved weights (keras-hub's own
    `BertMaskedLM` of that backbone starts its head afresh too)."""
    import keras_hub

    hub = keras_hub.models.BertBackbone(vocabulary_size=32, num_layers=1, num_heads=2,
                                        hidden_dim=8, intermediate_dim=16,
                                        max_sequence_length=8)
    hub.save_to_preset(str(tmp_path / "hub"))
    ours = kzoo.presets.load("bert_tiny_uncased", task="backbone", num_layers=1, hidden_dim=8,
                             num_heads=2, intermediate_dim=16, vocabulary_size=32,
                             max_sequence_length=8)
    kzoo.presets.save(ours, str(tmp_path / "kzoo"))
    for path in (tmp_path / "hub", tmp_path / "kzoo"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lm = kzoo.presets.load(str(path), task="masked_lm")
            kzoo.presets.load(str(path), task="backbone")
        messages = _fresh_weight_warnings(caught)
        assert len(messages) == 1, [str(w.message) for w in caught]
        head = [v.path for v in lm.weights if v.path.startswith("mlm_")]
        assert head and all(f"'{name}'" in messages[0] for name in head), messages[0]


def _attention_reference(q, k, v, causal):
    """NumPy attention, (batch, seq, heads, head_dim), keys a query may not see left out
    (bottom-right causal alignment); NaN scores stay NaN."""
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    q_len, k_len = q.shape[1], k.shape[1]
    allowed = np.ones((q_len, k_len), bool)
    if causal:
        allowed = np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + k_len - q_len
    out = np.zeros(q.shape, np.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(q_len):
                s = scores[b, h, i, allowed[i]]
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, allowed[i], h]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["reference", "chunked"])
def test_attention_keeps_a_nan_score_nan_in_the_rows_that_see_it(kernel, causal):
    """A NaN (or infinite) score, e.g. from an overflowing float16 product, made the chunked
    kernel's rows zeros (`denom > 0` is False for a NaN sum): a wrong answer in silence,
    where the reference kernel and the formula give NaN. Rows that cannot see the NaN key
    stay finite and equal the formula."""
    from kzoo.layers import dot_product_attention
    from tests.harness import to_numpy

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 2, 4)).astype("float32") for _ in range(3))
    q[0, 1, 0, 0] = np.nan  # query row 1 of head 0
    k[1, 3, 1, 2] = np.nan  # key 3 of head 1 in the second example
    expected = _attention_reference(q.astype("float64"), k.astype("float64"),
                                     v.astype("float64"), causal)
    out = to_numpy(dot_product_attention(q, k, v, is_causal=causal, kernel=kernel))
    nan = np.isnan(expected).any(-1)
    assert nan.any() and np.isnan(out[nan]).all()  # NaN wherever the formula has NaN
    got_nan = np.isnan(out).any(-1)
    if kernel == "chunked" or not causal:
        np.testing.assert_array_equal(got_nan, nan)
    # (the reference kernel on JAX / TensorFlow adds a causal mask as a bias: NaN plus a
    # large negative value reaches the rows before a NaN key too)
    np.testing.assert_allclose(out[~got_nan], expected[~got_nan], atol=1e-5)
