"""kzoo.interpret maps: attention maps and head masking against transformers.

The maps of tiny random transformers checkpoints (BERT, GPT-2, T5, ViT) imported with
`kzoo.presets.load` must equal transformers' `output_attentions=True` (eager attention) to
1e-5 on the real (unpadded) query rows, and BERT's and T5's head masks must match
transformers' `head_mask` / `decoder_head_mask` / `cross_attn_head_mask`.
"""

import os

import keras
import numpy as np
import pytest

import kzoo.presets
from kzoo import graphs
from kzoo.interpret import attention_maps, masked_heads
from kzoo.layers import set_attention_kernel
from kzoo.layers.attention import MultiHeadAttention
from kzoo.layers.taps import Tap, active_tap
from tests.harness import backend, forward, hf_checkpoint, to_numpy, torch_forward

ATOL = 1e-5


# === Checkpoints (one per family and module) ===


def _perturbed(model, scale=0.1):
    """Non-trivial norms and biases (transformers starts them at 1 and 0)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * scale)
    return model.eval()


def _load(tmp_path_factory, name, hf):
    path = hf_checkpoint(str(tmp_path_factory.mktemp(name)), hf)
    return kzoo.presets.load(path)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=16, type_vocab_size=2,
        attn_implementation="eager")
    hf = transformers.BertForMaskedLM(config)
    with torch.no_grad():  # sharper attention than the 0.02 initialisation
        for name, p in hf.named_parameters():
            if "query" in name or "key" in name:
                p.mul_(20.0)
    hf = _perturbed(hf)
    lengths = np.array([9, 6])
    ids = np.random.default_rng(1).integers(1, 61, (2, 9)).astype("int32")
    mask = (np.arange(9)[None] < lengths[:, None]).astype("int32")
    ids[mask == 0] = 0
    segments = (np.arange(9)[None] >= 4).astype("int32") * mask
    x = {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}
    hf_x = dict(input_ids=ids, token_type_ids=segments, attention_mask=mask)
    return _load(tmp_path_factory, "bert", hf), hf, x, hf_x, mask


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=53, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3, attn_implementation="eager")
    hf = _perturbed(transformers.GPT2LMHeadModel(config))
    ids = np.random.default_rng(2).integers(1, 53, (2, 8)).astype("int32")
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    ids[mask == 0] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    return _load(tmp_path_factory, "gpt2", hf), hf, x, dict(input_ids=ids, attention_mask=mask), mask


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=41, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2,
        num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        feed_forward_proj="relu", tie_word_embeddings=True, attn_implementation="eager")
    hf = _perturbed(transformers.T5ForConditionalGeneration(config))
    r = np.random.default_rng(3)
    enc, dec = r.integers(2, 41, (2, 7)).astype("int32"), r.integers(2, 41, (2, 5)).astype("int32")
    enc_mask = (np.arange(7)[None] < np.array([[7], [4]])).astype("int32")
    dec_mask = (np.arange(5)[None] < np.array([[3], [5]])).astype("int32")
    enc[enc_mask == 0] = 0
    dec[dec_mask == 0] = 0
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
         "decoder_token_ids": dec, "decoder_padding_mask": dec_mask}
    hf_x = dict(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                decoder_attention_mask=dec_mask)
    return _load(tmp_path_factory, "t5", hf), hf, x, hf_x


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=24, attn_implementation="eager")
    hf = transformers.ViTForImageClassification(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.1))
    hf = hf.eval()
    images = np.random.default_rng(4).normal(size=(2, 16, 16, 3)).astype("float32")
    hf_x = dict(pixel_values=np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
    return _load(tmp_path_factory, "vit", hf), hf, images, hf_x


def _hf(hf, hf_x, **kwargs):
    return torch_forward(hf, **hf_x, output_attentions=True, **kwargs)


def assert_maps_match(ours, theirs, query_mask=None, label=""):
    """Each layer's `(batch, heads, query, key)` maps agree to ATOL on the real query rows."""
    assert len(ours) == len(theirs), (label, len(ours), len(theirs))
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        b = b.numpy() if hasattr(b, "numpy") else np.asarray(b)
        assert a.shape == b.shape, (label, layer, a.shape, b.shape)
        rows = np.ones(a.shape[:1] + a.shape[2:3], bool) if query_mask is None else \
            np.asarray(query_mask).astype(bool)
        diff = np.abs(a - b).transpose(0, 2, 1, 3)[rows].max()
        print(f"[{backend()}] {label} layer {layer}: max |diff| {diff:.2e}")
        assert diff <= ATOL, (label, layer, diff)


# === Parity with transformers ===


def test_bert_maps_and_head_mask_match_transformers(bert):
    import torch

    model, hf, x, hf_x, mask = bert
    head_mask = np.ones((2, 4), "float32")
    head_mask[0, 1] = 0.0   # remove a head
    head_mask[1, 3] = 0.5   # halve another
    expected = _hf(hf, hf_x, head_mask=torch.tensor(head_mask))
    maps = attention_maps(model, x, head_mask=head_mask)
    assert sorted(maps) == ["self"]
    assert_maps_match(maps["self"], expected.attentions, mask, "BERT head-masked maps")
    assert np.all(maps["self"][0][:, 1] == 0.0)

    with masked_heads(model, head_mask):   # the mask applies to the model's own calls
        logits = to_numpy(forward(model, x))
    diff = np.abs(logits - expected.logits.numpy())[mask.astype(bool)].max()
    print(f"[{backend()}] BERT head-masked logits: max |diff| {diff:.2e}")
    assert diff <= ATOL
    plain = torch_forward(hf, **hf_x).logits.numpy()
    assert np.abs(logits - plain)[mask.astype(bool)].max() > 1e-3  # the mask matters


def test_gpt2_maps_match_transformers_under_any_kernel(gpt2):
    model, hf, x, hf_x, mask = gpt2
    expected = _hf(hf, hf_x).attentions
    maps = attention_maps(model, x)
    assert sorted(maps) == ["self"] and maps["self"][0].shape == (2, 2, 8, 8)
    assert_maps_match(maps["self"], expected, mask, "GPT-2")
    try:
        set_attention_kernel("fused")
        fused = attention_maps(model, x)
    finally:
        set_attention_kernel(None)
    assert_maps_match(fused["self"], expected, mask, "GPT-2 (fused kernel selected)")


def test_t5_maps_and_head_masks_match_transformers(t5):
    import torch

    model, hf, x, hf_x = t5
    head_mask = {"encoder": np.ones((2, 3), "float32"), "cross": np.ones((2, 3), "float32")}
    head_mask["encoder"][1, 2] = 0.0
    head_mask["cross"][0, 0] = 0.0
    # (transformers 4.57 fails on `head_mask` without `decoder_head_mask`: pass ones)
    expected = _hf(hf, hf_x, head_mask=torch.tensor(head_mask["encoder"]),
                   decoder_head_mask=torch.ones(2, 3),
                   cross_attn_head_mask=torch.tensor(head_mask["cross"]))
    maps = attention_maps(model, x, head_mask=head_mask)
    assert sorted(maps) == ["cross", "decoder", "encoder"]
    assert maps["cross"][0].shape == (2, 3, 5, 7)
    assert_maps_match(maps["encoder"], expected.encoder_attentions,
                      x["encoder_padding_mask"], "T5 encoder")
    assert_maps_match(maps["decoder"], expected.decoder_attentions,
                      x["decoder_padding_mask"], "T5 decoder")
    assert_maps_match(maps["cross"], expected.cross_attentions,
                      x["decoder_padding_mask"], "T5 cross")
    assert np.all(maps["cross"][0][:, 0] == 0.0) and np.all(maps["encoder"][1][:, 2] == 0.0)


def test_vit_maps_match_transformers(vit):
    model, hf, images, hf_x = vit
    maps = attention_maps(model, images)
    assert maps["self"][0].shape == (2, 2, 5, 5)  # class token + 2x2 patches
    assert_maps_match(maps["self"], _hf(hf, hf_x).attentions, None, "ViT")


# === A pass without a tap is unchanged ===


def test_forward_without_tap_is_untouched(gpt2, monkeypatch):
    model, _, x, _, mask = gpt2
    before = to_numpy(forward(model, x))
    attention_maps(model, x)
    with masked_heads(model, np.ones((2, 2))):
        tapped = to_numpy(forward(model, x))   # the exact formula, same numbers
    assert active_tap() is None

    def refuse(*args, **kwargs):
        raise AssertionError("the tapped attention path ran without a tap")

    monkeypatch.setattr(MultiHeadAttention, "_tapped_attention", refuse)
    after = to_numpy(forward(model, x))  # (Keras' predict function compiled again)
    np.testing.assert_array_equal(before, after)
    real = mask.astype(bool)
    assert np.abs(tapped - before)[real].max() <= 1e-5


# === Graphormer ===


def test_graphormer_maps_are_distributions_over_real_nodes():
    from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor

    model = GraphormerPredictor(GraphormerBackbone(  # test_graphormer's TINY
        num_layers=2, hidden_dim=16, intermediate_dim=24, num_heads=4, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))
    x = graphs.batch([graphs.from_smiles(s) for s in ["CCO", "c1ccccc1"]])
    x.pop("labels", None)
    maps = attention_maps(model, x)["self"]
    nodes = x["input_nodes"].shape[1]
    assert len(maps) == 2 and maps[0].shape == (2, 4, nodes + 1, nodes + 1)
    real = np.concatenate([np.ones((2, 1), bool), x["input_nodes"].any(-1)], axis=1)
    for m in maps:
        rows = m.transpose(0, 2, 1, 3)[real]                # (real queries, heads, keys)
        np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
        padded_keys = np.broadcast_to(~real[:, None, None, :], m.shape)
        assert np.all(m[padded_keys & real[:, None, :, None]] == 0.0)


# === Errors ===


def test_errors_name_the_argument(bert, t5, vit):
    model, _, x, _, _ = bert
    with pytest.raises(ValueError, match="`model` must be a kzoo model"):
        attention_maps(keras.Sequential([keras.layers.Dense(2)]), x)
    # (the inputs BERT fills in itself, its padding mask and segment ids, are optional)
    with pytest.raises(ValueError, match=r"`inputs` must have the keys \['token_ids'\] "
                                         r"\(optional: \['mask_positions', 'padding_mask', "
                                         r"'segment_ids'\]\).*missing \['token_ids'\]"):
        attention_maps(model, {k: v for k, v in x.items() if k != "token_ids"})
    with pytest.raises(ValueError, match=r"`inputs\['token_ids'\]` must have shape "
                                         r"\(batch, any\).*\(2, 9, 1\)"):
        attention_maps(model, {**x, "token_ids": x["token_ids"][..., None]})
    with pytest.raises(ValueError, match="same batch size"):
        attention_maps(model, {**x, "segment_ids": x["segment_ids"][:1]})
    with pytest.raises(ValueError, match=r"`inputs` must be one array"):
        attention_maps(vit[0], {"images": vit[2]})
    with pytest.raises(ValueError, match=r"`inputs` must have shape \(batch, any, any, 3\)"):
        attention_maps(vit[0], vit[2][..., :2])
    with pytest.raises(ValueError, match=r"`head_mask` must have shape \(layers, heads\) = "
                                         r"\(2, 4\).*got shape \(3, 4\)"):
        masked_heads(model, np.ones((3, 4)))
    with pytest.raises(ValueError, match="`head_mask` must hold finite numbers"):
        masked_heads(model, np.full((2, 4), np.nan))
    with pytest.raises(ValueError, match="`head_mask` of a T5 model must be a dict"):
        masked_heads(t5[0], np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"unknown keys \['self'\]"):
        masked_heads(t5[0], {"self": np.ones((2, 3))})
    with pytest.raises(ValueError, match=r"`head_mask\['decoder'\]` must have shape"):
        masked_heads(t5[0], {"decoder": np.ones((2, 4))})


def test_left_out_segment_ids_are_zeros_as_in_the_model(bert):
    """BERT fills in a left-out `segment_ids` as zeros; `attention_maps` took only inputs
    with it. Without it the maps are those of all-zero segment ids."""
    model, _, x, _, _ = bert
    bare = {k: v for k, v in x.items() if k != "segment_ids"}
    assert np.any(x["segment_ids"] != 0)  # (the fixture's differ from zeros)
    zeros = attention_maps(model, {**bare, "segment_ids": np.zeros_like(x["token_ids"])})
    for got, expected in zip(attention_maps(model, bare)["self"], zeros["self"]):
        np.testing.assert_array_equal(got, expected)


def test_a_head_mask_that_is_not_an_array_is_named_with_its_value():
    # (a string or a scalar read "got shape ()", without saying what had been passed)
    model = kzoo.presets.load("gpt_mini", num_layers=2, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, vocabulary_size=50, max_sequence_length=16)
    for bad in ("abc", 3):
        with pytest.raises(ValueError, match=r"`head_mask` must have shape \(layers, heads\) = "
                                             rf"\(2, 2\).*got head_mask={bad!r} \(shape \(\)\)"):
            masked_heads(model, bad)
    with pytest.raises(ValueError, match=r"got shape \(1, 2\)"):
        masked_heads(model, [[1, 0]])


# === Nested head masks ===


def _real_diff(ours, theirs, mask):
    return np.abs(ours - np.asarray(theirs)).max(-1)[np.asarray(mask).astype(bool)].max()


def test_nested_masked_heads_combine_and_restore_against_transformers(bert):
    # (the inner mask replaced the outer one: a head the outer context removed ran again
    # inside the inner one; nested vs the combined mask differed by 1e-2 in the logits)
    import torch

    model, hf, x, hf_x, mask = bert
    outer = np.ones((2, 4), "float32")
    outer[0, 1] = 0.0   # removed by the outer context only
    outer[1, 3] = 0.5
    inner = np.ones((2, 4), "float32")
    inner[0, 2] = 0.0   # removed by the inner context only
    inner[1, 3] = 0.5   # halved by both: 0.25 inside both

    def hf_logits(head_mask):
        out = _hf(hf, hf_x, head_mask=torch.tensor(head_mask))
        return out.logits.numpy(), out.attentions

    plain = torch_forward(hf, **hf_x).logits.numpy()
    outer_only, _ = hf_logits(outer)
    combined = outer * inner  # what the nested contexts must run (a NumPy product)
    both, both_maps = hf_logits(combined)
    assert _real_diff(both, outer_only, mask) > 1e-3  # the inner mask matters

    with masked_heads(model, outer):
        with masked_heads(model, inner):
            nested = to_numpy(forward(model, x))
            maps = attention_maps(model, x)
            # an explicit head_mask inside the contexts is one more factor
            extra = np.ones((2, 4), "float32")
            extra[1, 0] = 0.0
            extra_maps = attention_maps(model, x, head_mask=extra)
        after_inner = to_numpy(forward(model, x))
        try:
            with masked_heads(model, inner):
                raise KeyError("inside the inner block")
        except KeyError:
            pass
        after_raise = to_numpy(forward(model, x))
    after_outer = to_numpy(forward(model, x))
    assert active_tap() is None

    diffs = {"nested": _real_diff(nested, both, mask),
             "after inner": _real_diff(after_inner, outer_only, mask),
             "after a raising inner": _real_diff(after_raise, outer_only, mask),
             "after outer": _real_diff(after_outer, plain, mask)}
    print(f"[{backend()}] nested masks vs transformers: {diffs}")
    assert max(diffs.values()) <= ATOL, diffs
    assert_maps_match(maps["self"], both_maps, mask, "BERT nested masks")
    assert np.all(maps["self"][0][:, 1] == 0.0) and np.all(maps["self"][0][:, 2] == 0.0)
    _, extra_expected = hf_logits(combined * extra)
    assert_maps_match(extra_maps["self"], extra_expected, mask, "BERT nested + head_mask")


def test_nested_t5_masks_combine_key_by_key(t5):
    import torch

    model, hf, x, hf_x = t5
    encoder = np.ones((2, 3), "float32")
    encoder[1, 2] = 0.0
    cross = np.ones((2, 3), "float32")
    cross[0, 0] = 0.0
    decoder = np.ones((2, 3), "float32")
    decoder[1, 1] = 0.0
    expected = _hf(hf, hf_x, head_mask=torch.tensor(encoder),
                   decoder_head_mask=torch.tensor(decoder),
                   cross_attn_head_mask=torch.tensor(cross))
    with masked_heads(model, {"encoder": encoder, "cross": np.ones((2, 3))}):
        with masked_heads(model, {"cross": cross, "decoder": decoder}):
            logits = to_numpy(forward(model, x))
            maps = attention_maps(model, x)
    real = x["decoder_padding_mask"]
    diff = _real_diff(logits, expected.logits.numpy(), real)
    print(f"[{backend()}] T5 nested masks logits: max |diff| {diff:.2e}")
    assert diff <= ATOL
    assert_maps_match(maps["encoder"], expected.encoder_attentions,
                      x["encoder_padding_mask"], "T5 nested encoder")
    assert_maps_match(maps["decoder"], expected.decoder_attentions, real, "T5 nested decoder")
    assert_maps_match(maps["cross"], expected.cross_attentions, real, "T5 nested cross")


def test_masked_heads_refuses_to_hide_another_tap(bert, gpt2):
    with Tap():
        with pytest.raises(RuntimeError, match=r"`masked_heads` cannot be entered inside "
                                               r"another active tap \(Tap\)"):
            with masked_heads(bert[0], np.ones((2, 4))):
                pass
    with masked_heads(gpt2[0], np.ones((2, 2))):
        with pytest.raises(RuntimeError, match="inside `masked_heads` of another model"):
            with masked_heads(bert[0], np.ones((2, 4))):
                pass
    assert active_tap() is None


class _HalveHeads(Tap):
    """A user tap of its own: halves head 0 of every layer (a head scale)."""

    def head_scale(self, layer, index):
        return np.array([0.5, 1.0, 1.0, 1.0], "float32")


def test_a_tap_inside_masked_heads_sees_the_masked_model(bert, gpt2):
    # (a plain Tap entered inside masked_heads became the only active tap: the model ran
    # unmasked under it and the tap recorded the unmasked maps)
    import torch

    model, hf, x, hf_x, mask = bert
    head_mask = np.ones((2, 4), "float32")
    head_mask[0, 1] = 0.0   # remove a head
    head_mask[1, 3] = 0.5   # halve another
    expected = _hf(hf, hf_x, head_mask=torch.tensor(head_mask))
    halved = head_mask * np.array([0.5, 1.0, 1.0, 1.0], "float32")  # NumPy product
    expected_halved = _hf(hf, hf_x, head_mask=torch.tensor(halved)).logits.numpy()
    with masked_heads(model, head_mask):
        alone = to_numpy(model(x))
        with Tap() as tap:
            tapped = to_numpy(model(x))
        with Tap() as outer, Tap() as inner:   # taps inside taps see the same pass
            to_numpy(model(x))
        with _HalveHeads():
            scaled = to_numpy(model(x))
        with Tap() as other_tap:   # another model (a distillation student) is left alone
            other = to_numpy(gpt2[0](gpt2[2]))
        after = to_numpy(model(x))
    assert active_tap() is None
    plain = to_numpy(model(x))
    diffs = {name: _real_diff(value, expected.logits.numpy(), mask)
             for name, value in [("alone", alone), ("under a Tap", tapped),
                                 ("after the Tap", after)]}
    diffs["under a head-scaling Tap"] = _real_diff(scaled, expected_halved, mask)
    print(f"[{backend()}] a Tap inside masked_heads vs transformers' head_mask: {diffs}")
    assert max(diffs.values()) <= ATOL, diffs
    assert _real_diff(plain, expected.logits.numpy(), mask) > 1e-3  # the mask matters
    maps = [to_numpy(record.weights) for record in tap.attention_records]
    assert_maps_match(maps, expected.attentions, mask, "maps a Tap records in masked_heads")
    assert np.all(maps[0][:, 1] == 0.0)
    for taps in (outer, inner):
        assert_maps_match([to_numpy(r.weights) for r in taps.attention_records],
                          expected.attentions, mask, "nested Taps in masked_heads")
    other_expected = _hf(gpt2[1], gpt2[3])
    assert _real_diff(other, other_expected.logits.numpy(), gpt2[4]) <= ATOL
    assert_maps_match([to_numpy(r.weights) for r in other_tap.attention_records],
                      other_expected.attentions, gpt2[4], "another model in masked_heads")


class _ZeroBlocks(Tap):
    """A user tap that replaces every block's output with zeros."""

    def block(self, layer, index, output):
        return output * 0.0


def test_a_tap_sees_a_predict_compiled_before_it():
    """`predict` reuses the function Keras compiled at its first call (JAX, TensorFlow), a
    trace of the taps active then: a `Tap` entered after a `predict` compiled inside
    `masked_heads` (or outside any tap) recorded nothing and altered nothing, and the
    function compiled under a tap would have kept it after. Reference: with every block's
    output zero, GPT's logits are its final LayerNorm's offset `beta` (the norm of zeros)
    through the tied embedding `E`, `beta @ E^T` at every position (NumPy)."""
    from kzoo.models.gpt import GPTBackbone, GPTCausalLM

    lm = GPTCausalLM(GPTBackbone(vocabulary_size=24, num_layers=1, num_heads=2,
                                 hidden_dim=16, intermediate_dim=32, max_sequence_length=8,
                                 dropout=0.0))
    rng = np.random.default_rng(6)
    lm.backbone.final_norm.beta.assign(rng.normal(size=(16,)).astype("float32"))
    ids = rng.integers(0, 24, (2, 5)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    beta = to_numpy(lm.backbone.final_norm.beta).astype("float64")
    table = to_numpy(lm.backbone.token_embedding.embeddings).astype("float64")
    zeroed = np.broadcast_to(beta @ table.T, (2, 5, 24))

    def predict():
        return to_numpy(lm.predict(x, batch_size=2, verbose=0))

    plain = predict()
    assert np.abs(plain - zeroed).max() > 1e-2
    with masked_heads(lm, np.ones((1, 2))):
        np.testing.assert_allclose(predict(), plain, atol=ATOL)  # (compiled in here)
        with _ZeroBlocks() as tap:
            inside = predict()
        assert tap.attention_records  # (it recorded nothing)
        np.testing.assert_allclose(inside, zeroed, atol=ATOL)
    np.testing.assert_allclose(predict(), plain, atol=ATOL)
    with _ZeroBlocks() as tap:
        outside = predict()
    assert tap.attention_records
    np.testing.assert_allclose(outside, zeroed, atol=ATOL)
    np.testing.assert_allclose(predict(), plain, atol=ATOL)  # (left: not zeroed any more)


def _hf_greedy(hf, ids, steps, head_mask=None):
    """Greedy continuation of `ids` by transformers' forward pass (with `head_mask`)."""
    import torch

    ids = torch.tensor(ids, dtype=torch.long)
    mask = None if head_mask is None else torch.tensor(head_mask)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(input_ids=ids, head_mask=mask).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, -steps:].numpy()


def _greedy_tail(model, prompt, steps):
    """The `steps` tokens kzoo's greedy `generate` appends to `prompt` (NumPy)."""
    out = model.generate({"token_ids": prompt, "padding_mask": np.ones_like(prompt)},
                         max_new_tokens=steps, strategy="greedy")
    out = out["token_ids"] if isinstance(out, dict) else out
    return np.asarray(to_numpy(out))[:, -steps:]


class _SecondHeadOff(Tap):
    """A user's tap that alters the pass: every attention layer's second head scaled to 0."""

    def __init__(self):
        super().__init__(record_attention=False)

    def head_scale(self, layer, index):
        return np.array([1.0, 0.0], "float32")


@pytest.mark.parametrize("context", ["masked_heads", "tap"])
def test_generate_inside_a_context_that_alters_the_pass_uses_it(gpt2, context):
    # (JAX and TensorFlow: generate reused the decode loop it had compiled before the
    # context, so inside it the unaltered model's tokens came out: first inside
    # `masked_heads`, then, after `masked_heads` dropped the loops itself, inside a user's
    # `Tap` that scales heads, whose loop compiled inside also kept the scaling after it)
    model, hf, x, _, _ = gpt2
    prompt = x["token_ids"][:1, :5]
    steps = 6
    if context == "masked_heads":
        head_mask = np.ones((2, 2), "float32")
        head_mask[0, 0] = head_mask[1, 1] = 0.0
        altering = masked_heads(model, head_mask)
    else:
        head_mask = np.array([[1.0, 0.0], [1.0, 0.0]], "float32")
        altering = _SecondHeadOff()
    plain = _hf_greedy(hf, prompt, steps)
    altered = _hf_greedy(hf, prompt, steps, head_mask)
    assert not np.array_equal(plain, altered)  # the heads' change changes the tokens
    before = _greedy_tail(model, prompt, steps)  # (compiles the decode loop outside)
    with altering:
        inside = _greedy_tail(model, prompt, steps)
    after = _greedy_tail(model, prompt, steps)
    print(f"[{backend()}] greedy tokens ({context}): transformers {plain} / altered {altered}; "
          f"kzoo {before} / inside {inside} / after {after}")
    np.testing.assert_array_equal(before, plain)
    np.testing.assert_array_equal(inside, altered)
    np.testing.assert_array_equal(after, plain)


def test_a_mask_on_the_backbone_reaches_the_task_models_compiled_functions(gpt2):
    # (`masked_heads(lm.backbone, ...)`: the task model's predict function and decode loops,
    # compiled before around the backbone, kept the unmasked trace on JAX: logits 1.58 off)
    import torch

    model, hf, x, hf_inputs, mask = gpt2
    head_mask = np.ones((2, 2), "float32")
    head_mask[0, 1] = head_mask[1, 0] = 0.0
    with torch.no_grad():
        plain = hf(**{k: torch.tensor(v, dtype=torch.long) for k, v in hf_inputs.items()})
        masked = hf(**{k: torch.tensor(v, dtype=torch.long) for k, v in hf_inputs.items()},
                    head_mask=torch.tensor(head_mask))
    real = mask.astype(bool)

    def logits():
        return np.asarray(to_numpy(model.predict_on_batch(x)))[real]

    prompt = x["token_ids"][:1, :5]
    steps = 5

    def generate():
        return _greedy_tail(model, prompt, steps)

    np.testing.assert_allclose(logits(), plain.logits.numpy()[real], atol=1e-5)
    before = generate()  # (compiles the decode loop without a mask)
    with masked_heads(model.backbone, head_mask):
        inside, inside_tokens = logits(), generate()
    np.testing.assert_allclose(inside, masked.logits.numpy()[real], atol=1e-5)
    np.testing.assert_array_equal(inside_tokens, _hf_greedy(hf, prompt, steps, head_mask))
    np.testing.assert_allclose(logits(), plain.logits.numpy()[real], atol=1e-5)
    np.testing.assert_array_equal(generate(), before)
