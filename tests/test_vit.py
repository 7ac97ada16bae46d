"""ViT: backbone, classifier, presets and the Hugging Face converter.

References are NumPy formulas written here, `torch.nn.functional.interpolate` (bicubic) and
transformers' `ViTModel` / `ViTForImageClassification`; never kzoo itself.
"""

import json
import math

import keras
import numpy as np
import pytest

import kzoo.presets
from kzoo.layers import TransformerBlock
from kzoo.models.vit import ViTBackbone
from kzoo.models.vit import ViTClassifier
from kzoo.models.vit import ViTEmbedding
from kzoo.models.vit import bicubic_resize_matrix
from tests.harness import (
    assert_close, assert_matches_transformers, check_fit_lowers_loss,
    check_keras_file_round_trip, check_preset_round_trip, hf_checkpoint, hf_state, ref,
    roundtrip_layer, to_numpy,
)

TINY = dict(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32,
            intermediate_dim=64)


def images(batch=2, height=32, width=32, channels=3, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, height, width, channels)).astype(
        "float32"
    )


def torch_bicubic(grid, size):
    """torch's bicubic resize of a (h, w, d) NumPy grid to `size` (the reference)."""
    import torch

    t = torch.tensor(np.asarray(grid, "float32")).permute(2, 0, 1)[None]
    out = torch.nn.functional.interpolate(t, size=size, mode="bicubic", align_corners=False)
    return out[0].permute(1, 2, 0).numpy()


# === Bicubic interpolation and the embedding layer ===


@pytest.mark.parametrize("in_size,out_size", [(4, 6), (4, 4), (7, 3), (14, 24), (2, 9)])
def test_bicubic_matrix_matches_torch(in_size, out_size):
    grid = np.random.default_rng(1).normal(size=(in_size, 1, 5)).astype("float32")
    ours = np.einsum("oi,iwd->owd", bicubic_resize_matrix(in_size, out_size), grid)
    np.testing.assert_allclose(ours, torch_bicubic(grid, (out_size, 1)), atol=2e-6)


def np_embedding(layer, x):
    """NumPy reference of ViTEmbedding: patch matmul + class token + resampled positions."""
    kernel = to_numpy(layer.patch_embedding.projection.kernel)  # (ph, pw, c, d)
    bias = to_numpy(layer.patch_embedding.projection.bias)
    ph, pw, c, d = kernel.shape
    b, h, w, _ = x.shape
    patches = x.reshape(b, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
    tokens = patches.reshape(b, -1, ph * pw * c) @ kernel.reshape(-1, d) + bias
    table = to_numpy(layer.position_embedding)
    prefix = 1 if layer.use_class_token else 0
    gh, gw = layer.grid
    grid = table[prefix:].reshape(gh, gw, d)
    pos = torch_bicubic(grid, (h // ph, w // pw)).reshape(-1, d)
    if prefix:
        cls = np.broadcast_to(to_numpy(layer.class_token), (b, 1, d))
        tokens = np.concatenate([cls, tokens], axis=1)
        pos = np.concatenate([table[:1], pos], axis=0)
    return tokens + pos[None]


@pytest.mark.parametrize(
    "image_size,shape,class_token",
    [(32, (32, 32), True), (32, (48, 48), True), (32, (16, 40), True),
     ((16, 24), (32, 16), True), (32, (40, 24), False)],
)
def test_embedding_matches_numpy_at_any_size(image_size, shape, class_token):
    layer = ViTEmbedding(image_size=image_size, patch_size=8, hidden_dim=16,
                         num_channels=3, use_class_token=class_token)
    layer.build((None, None, None, 3))
    layer.position_embedding.assign(
        np.random.default_rng(3).normal(size=layer.position_embedding.shape).astype("float32"))
    if class_token:
        layer.class_token.assign(np.random.default_rng(4).normal(size=(1, 1, 16)))
    x = images(2, *shape)
    out = layer(x)
    n = (shape[0] // 8) * (shape[1] // 8) + int(class_token)
    assert tuple(out.shape) == (2, n, 16)
    assert_close(out, np_embedding(layer, x), atol=1e-5)


def test_layers_serialize():
    roundtrip_layer(ViTEmbedding(image_size=(16, 24), patch_size=8, hidden_dim=16))
    roundtrip_layer(TransformerBlock(num_heads=2, intermediate_dim=8, qkv_bias=False))


def test_qkv_bias_false_drops_only_qkv_biases():
    layer = TransformerBlock(num_heads=2, intermediate_dim=8, qkv_bias=False)
    layer(np.zeros((1, 3, 4), "float32"))
    names = sorted(w.path.split("/", 1)[1] for w in layer.weights)
    assert not any(n.startswith(("self_attention/query_dense/bias",
                                 "self_attention/key_dense/bias",
                                 "self_attention/value_dense/bias")) for n in names)
    assert "self_attention/output_dense/bias" in names
    assert "feedforward/intermediate_dense/bias" in names
    assert "feedforward/output_dense/bias" in names
    assert len(names) == 13  # q/k/v kernels, output kernel+bias, 2 norms x 2, MLP 2 x 2
    full = TransformerBlock(num_heads=2, intermediate_dim=8)
    full(np.zeros((1, 3, 4), "float32"))
    assert len(full.weights) == len(layer.weights) + 3


# === Backbone and classifier ===


@pytest.mark.spread
def test_forward_shapes_and_dtypes():
    backbone = ViTBackbone(**TINY)
    out = backbone(images())
    assert tuple(out.shape) == (2, 17, 32)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    model = ViTClassifier(backbone, num_classes=5)
    logits = model(images())
    assert tuple(logits.shape) == (2, 5)
    # Other sizes and a non-square configuration.
    assert tuple(backbone(images(1, 48, 24)).shape) == (1, 1 + 6 * 3, 32)
    rect = ViTBackbone(**{**TINY, "image_size": (16, 40)}, use_class_token=False)
    assert tuple(rect(images(1, 16, 40)).shape) == (1, 10, 32)
    mixed = ViTClassifier(ViTBackbone(**TINY, dtype="mixed_bfloat16"), num_classes=3)
    features = mixed.backbone(images())
    assert keras.backend.standardize_dtype(features.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(mixed(images()).dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(mixed.backbone.weights[0].dtype) == "float32"


def test_images_smaller_than_a_patch_are_refused_and_the_model_still_works():
    """An image without a whole patch (0 x 0 pixels gave the class token alone on JAX) is
    refused by name; on JAX a `predict` that failed left Keras' detached weights behind, so
    the next call failed with "'NoneType' object is not callable"."""
    model = ViTClassifier(ViTBackbone(**TINY), num_classes=3)
    good = images(1)
    expected = to_numpy(model(good))
    for height, width, axis in ((0, 0, "height=0"), (4, 32, "height=4"), (32, 4, "width=4")):
        bad = np.zeros((1, height, width, 3), "float32")
        for run in (model, lambda x: model.predict(x, verbose=0)):
            with pytest.raises(ValueError, match=f"Image {axis} is smaller than one patch"):
                run(bad)
    assert_close(model.predict(good, verbose=0), expected, atol=1e-6)


def test_predict_takes_one_image_size_after_another():
    """The documented any-size input through `predict`, size after size (TensorFlow traced
    the second size with unknown height and width, which ViT's patch grid refuses)."""
    model = ViTClassifier(ViTBackbone(**TINY), num_classes=3)
    for height, width in ((32, 32), (48, 24), (16, 16), (32, 32)):
        x = images(2, height, width)
        assert_close(model.predict(x, verbose=0), to_numpy(model(x)), atol=1e-5)
        assert model.backbone.predict(x, verbose=0).shape == (
            2, 1 + (height // 8) * (width // 8), 32)


def test_fit_and_evaluate_take_one_image_size_after_another():
    """`fit`, `evaluate` and `train_on_batch` size after size, one channel (TensorFlow's
    Keras traced the second size with unknown height and width, as for `predict`)."""
    model = ViTClassifier(ViTBackbone(**{**TINY, "num_channels": 1}), num_classes=3)
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    y = np.array([0, 2])
    for height, width in ((32, 32), (48, 24), (16, 16)):
        x = images(2, height, width, channels=1)
        assert np.isfinite(model.fit(x, y, verbose=0).history["loss"][0])
        expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, to_numpy(model(x)))
        assert_close(model.evaluate(x, y, verbose=0), to_numpy(expected), atol=1e-5)
        assert np.isfinite(model.train_on_batch(x, y))


def test_classifier_pooling_matches_numpy():
    backbone = ViTBackbone(**TINY)
    x = images()
    features = to_numpy(backbone(x))
    for pooling, pooled in (("token", features[:, 0]), ("mean", features[:, 1:].mean(1))):
        model = ViTClassifier(backbone, num_classes=4, pooling=pooling)
        kernel = np.random.default_rng(5).normal(size=(32, 4)).astype("float32")
        model.head.kernel.assign(kernel)
        model.head.bias.assign(np.arange(4, dtype="float32"))
        assert_close(model(x), pooled @ kernel + np.arange(4), atol=1e-4)


def test_final_norm_and_block_structure_match_numpy():
    """One-layer backbone against a NumPy pre-LN encoder written here."""
    backbone = ViTBackbone(**{**TINY, "num_layers": 1, "layer_norm_epsilon": 1e-3})
    rng = np.random.default_rng(7)
    for w in backbone.weights:
        w.assign(rng.normal(scale=0.2, size=w.shape).astype("float32"))
    x = images()
    h = np_embedding(backbone.embedding, x)
    layer = backbone.encoder_layers[0]
    att = layer.self_attention
    proj = ref.apply_dense

    y = ref.norm(layer.self_attention_norm, h, 1e-3)
    q, k, v = (proj(d, y).reshape(2, 17, 4, 8) for d in (att.query_dense, att.key_dense,
                                                           att.value_dense))
    o = ref.attention(q, k, v, scale=1 / np.sqrt(8)).reshape(2, 17, 32)
    h = h + proj(att.output_dense, o)
    y = ref.norm(layer.feedforward_norm, h, 1e-3)
    ff = layer.feedforward_layer
    h = h + proj(ff.output_dense, ref.gelu(proj(ff.intermediate_dense, y)))
    expected = ref.norm(backbone.final_norm, h, 1e-3)
    assert_close(backbone(x), expected, atol=1e-4)


def test_initialisation_follows_the_reference_code():
    """Xavier-uniform attention and MLP kernels (std sqrt(2 / (fan_in + fan_out)), bounded
    by sqrt(6 / (fan_in + fan_out))), zero biases, unit LayerNorms; each kernel its own draw."""
    d, f = 64, 256
    backbone = ViTBackbone(image_size=16, patch_size=8, num_layers=2, num_heads=4,
                           hidden_dim=d, intermediate_dim=f)
    fans = {"query_dense": (d, d), "key_dense": (d, d), "value_dense": (d, d),
            "attention/output_dense": (d, d), "intermediate_dense": (d, f),
            "feedforward/output_dense": (f, d)}
    seen = []
    for w in backbone.weights:
        value = to_numpy(w)
        if not w.path.startswith("transformer_layer_"):
            continue
        if w.path.endswith(("bias", "beta")):
            np.testing.assert_array_equal(value, 0.0)
        elif w.path.endswith("gamma"):
            np.testing.assert_array_equal(value, 1.0)
        else:
            fan_in, fan_out = next(v for k, v in fans.items() if k in w.path)
            assert np.abs(value).max() <= math.sqrt(6 / (fan_in + fan_out)) + 1e-7, w.path
            std = math.sqrt(2 / (fan_in + fan_out))
            assert abs(value.std() / std - 1) < 0.05, (w.path, value.std(), std)
            assert abs(value.mean()) < 0.05 * std, w.path
            seen.append(value)
    assert len(seen) == 12
    assert not any(np.allclose(a, b) for i, a in enumerate(seen) for b in seen[:i]
                   if a.shape == b.shape)


def test_batch_independence():
    """Images never influence each other (the ViT analogue of padding invariance)."""
    model = ViTClassifier(ViTBackbone(**TINY), num_classes=3)
    model.head.kernel.assign(np.random.default_rng(0).normal(size=(32, 3)).astype("float32"))
    x = images(3)
    full = to_numpy(model.backbone(x))
    for i in range(3):
        alone = to_numpy(model.backbone(x[i:i + 1]))
        np.testing.assert_allclose(alone[0], full[i], atol=1e-5)
    other = x.copy()
    other[1:] = images(2, seed=9)
    np.testing.assert_allclose(to_numpy(model(other))[0], to_numpy(model(x))[0], atol=1e-5)


def test_keras_file_and_preset_dir_roundtrip(tmp_path):
    model = ViTClassifier(ViTBackbone(**TINY, qkv_bias=False), num_classes=3, pooling="mean")
    model.head.kernel.assign(np.random.default_rng(0).normal(size=(32, 3)).astype("float32"))
    x = images()
    check_keras_file_round_trip(model, x, str(tmp_path / "keras"))
    loaded = check_preset_round_trip(model, x, str(tmp_path / "dir"))
    assert isinstance(loaded, ViTClassifier) and loaded.pooling == "mean"
    backbone = kzoo.presets.load(str(tmp_path / "dir"), task="backbone")
    np.testing.assert_array_equal(to_numpy(backbone(x)), to_numpy(model.backbone(x)))


def test_loading_into_another_image_size_resamples_the_table(tmp_path):
    model = ViTClassifier(ViTBackbone(**TINY), num_classes=3)
    table = np.random.default_rng(2).normal(size=(17, 32)).astype("float32")
    model.backbone.embedding.position_embedding.assign(table)
    kzoo.presets.save(model, str(tmp_path / "dir"))
    big = kzoo.presets.load(str(tmp_path / "dir"), image_size=48)
    assert big.backbone.image_size == 48
    new_table = to_numpy(big.backbone.embedding.position_embedding)
    assert new_table.shape == (37, 32)
    np.testing.assert_array_equal(new_table[0], table[0])
    ref = torch_bicubic(table[1:].reshape(4, 4, 32), (6, 6)).reshape(36, 32)
    np.testing.assert_allclose(new_table[1:], ref, atol=1e-5)
    # The 32-model run on 48-pixel images interpolates the same way at run time.
    x = images(2, 48, 48)
    np.testing.assert_allclose(to_numpy(big(x)), to_numpy(model(x)), atol=1e-5)


@pytest.mark.spread
@pytest.mark.parametrize("pooling", ["token", "mean"])
def test_fit_lowers_loss(pooling):
    model = ViTClassifier(ViTBackbone(**{**TINY, "num_layers": 1}), num_classes=3,
                          pooling=pooling)
    x = images(8)
    y = np.arange(8) % 3
    # jit_compile="auto": XLA on JAX (on TensorFlow only with an accelerator); torch.compile
    # would take minutes
    check_fit_lowers_loss(model, x, y, optimizer=keras.optimizers.Adam(1e-3), epochs=8,
                          evaluate=True, min_drop=0.05, jit_compile="auto")


@pytest.mark.spread
def test_backbone_fit_lowers_loss():
    backbone = ViTBackbone(**{**TINY, "num_layers": 1})
    x = images(4)
    target = np.zeros((4, 17, 32), "float32") + 0.5
    check_fit_lowers_loss(backbone, x, target, loss="mse", optimizer=keras.optimizers.Adam(1e-3),
                          epochs=5, batch_size=4, evaluate=True, min_drop=0.0)


@pytest.mark.parametrize(
    "override,field",
    [
        ({"image_size": 30}, "patch_size"),
        ({"image_size": 0}, "image_size"),
        ({"image_size": (32, 32, 3)}, "image_size"),
        ({"patch_size": 0}, "patch_size"),
        ({"num_heads": 5}, "num_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_channels": 0}, "num_channels"),
        ({"dropout": 1.0}, "dropout"),
        ({"attention_dropout": -0.1}, "attention_dropout"),
        ({"layer_norm_epsilon": 0.0}, "layer_norm_epsilon"),
        ({"activation": "gelu_fast"}, "activation"),
        ({"use_class_token": 1}, "use_class_token"),
        ({"qkv_bias": "no"}, "qkv_bias"),
    ],
)
def test_backbone_config_validation(override, field):
    with pytest.raises(ValueError, match=field):
        ViTBackbone(**{**TINY, **override})


def test_classifier_config_validation():
    backbone = ViTBackbone(**TINY)
    with pytest.raises(ValueError, match="num_classes"):
        ViTClassifier(backbone, num_classes=0)
    with pytest.raises(ValueError, match="pooling"):
        ViTClassifier(backbone, pooling="max")
    with pytest.raises(ValueError, match="dropout"):
        ViTClassifier(backbone, dropout=2.0)
    with pytest.raises(ValueError, match="pooling"):
        ViTClassifier(ViTBackbone(**TINY, use_class_token=False), pooling="token")
    with pytest.raises(ValueError, match="not divisible|multiple"):
        backbone(images(1, 36, 32))
    with pytest.raises(ValueError, match="channels|incompatible"):
        backbone(images(1, 32, 32, 4))


def test_get_config_roundtrip():
    backbone = ViTBackbone(**TINY)
    config = backbone.get_config()
    clone = ViTBackbone.from_config(config)
    assert clone.get_config() == config
    model = ViTClassifier(backbone, num_classes=7, pooling="mean", dropout=0.1)
    clone = ViTClassifier.from_config(json.loads(json.dumps(model.get_config())))
    assert clone.num_classes == 7 and clone.pooling == "mean" and clone.dropout == 0.1
    assert clone.count_params() == model.count_params()


def test_preset_load_with_overrides():
    model = kzoo.presets.load("vit_tiny_patch16_224", num_classes=10, image_size=32,
                             num_layers=1)
    assert isinstance(model, ViTClassifier) and model.num_classes == 10
    assert tuple(model(images(1)).shape) == (1, 10)
    assert "vit_base_patch16_224" in kzoo.presets.list()


def _check_preset_params(name):
    spec = kzoo.presets.info(name)
    model = kzoo.presets.load(name)
    assert isinstance(model, ViTClassifier)
    assert model.count_params() == spec["params"]


@pytest.mark.spread
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_small_patch16_224"])
def test_small_preset_params(name):
    _check_preset_params(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_base_patch16_224", "vit_large_patch16_224"])
def test_large_preset_params(name):
    _check_preset_params(name)
    published = {"vit_base_patch16_224": 86_567_656, "vit_large_patch16_224": 304_326_632}
    assert kzoo.presets.info(name)["params"] == published[name]


# === Hugging Face conversion ===

HF_TINY = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def hf_vit(path, task="classifier", seed=0, **overrides):
    """A randomly initialised (and perturbed) transformers ViT saved to `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.ViTConfig(**{**HF_TINY, **overrides})
    if task == "classifier":
        model = transformers.ViTForImageClassification(config)
    else:
        model = transformers.ViTModel(config)  # with its (dense + tanh) pooler
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.2))
    model.eval()
    hf_checkpoint(str(path), model)
    return model


def hf_kwargs(pixels_nhwc, interpolate=False):
    """kzoo's (batch, height, width, channels) images as transformers' pixel_values."""
    return dict(pixel_values=np.ascontiguousarray(pixels_nhwc.transpose(0, 3, 1, 2)),
                interpolate_pos_encoding=interpolate)


def assert_vit_matches(label, model, hf, x, interpolate=False):
    assert_matches_transformers(model, hf, x, hf_kwargs(x, interpolate), label=label)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # layer_norm_eps=1e-12, the transformers default
        {"layer_norm_eps": 1e-3, "num_labels": 7},
        {"qkv_bias": False, "hidden_act": "gelu_new"},
        {"hidden_act": "gelu_fast"},  # (BERT's and GPT-2's converters took it; ViT's too)
        {"num_channels": 1},
        {"num_channels": 5, "image_size": [32, 24]},
    ],
    ids=["default", "eps1e-3", "no_qkv_bias", "gelu_fast", "1ch", "5ch_rect"],
)
def test_hf_classifier_parity(tmp_path, overrides):
    hf = hf_vit(tmp_path, **overrides)
    model = kzoo.presets.load(str(tmp_path))
    assert isinstance(model, ViTClassifier)
    cfg = hf.config
    assert model.backbone.layer_norm_epsilon == cfg.layer_norm_eps
    assert model.num_classes == cfg.num_labels
    size = overrides.get("image_size", [32, 32])
    x = images(3, size[0], size[1], cfg.num_channels, seed=1)
    assert_vit_matches(f"classifier {overrides}", model, hf, x)


def test_hf_backbone_parity_ignores_pooler(tmp_path):
    hf = hf_vit(tmp_path, task="backbone", layer_norm_eps=1e-5)
    assert "pooler.dense.weight" in dict(hf.named_parameters())
    backbone = kzoo.presets.load(str(tmp_path))
    assert isinstance(backbone, ViTBackbone)
    x = images(2, seed=2)
    assert_vit_matches("ViTModel last_hidden_state", backbone, hf, x)


@pytest.mark.parametrize("size", [(48, 48), (40, 24)])
def test_hf_larger_images_interpolate_like_transformers(tmp_path, size):
    hf = hf_vit(tmp_path)
    x = images(2, *size, seed=3)
    model = kzoo.presets.load(str(tmp_path))  # table for 32x32, interpolated at run time
    assert_vit_matches(f"interpolated positions at {size}", model, hf, x, interpolate=True)
    if size[0] == size[1]:  # built for the new size: the table is resampled on load
        resized = kzoo.presets.load(str(tmp_path), image_size=size[0])
        assert tuple(resized.backbone.embedding.position_embedding.shape) == (
            1 + (size[0] // 8) ** 2, 32)
        assert_vit_matches(f"image_size={size[0]} resampled on load", resized, hf, x,
                           interpolate=True)


@pytest.mark.parametrize("task", ["classifier", "backbone"])
def test_hf_export_roundtrip(tmp_path, task):
    import transformers

    hf = hf_vit(tmp_path / "hf", task=task, qkv_bias=False)
    model = kzoo.presets.load(str(tmp_path / "hf"))
    kzoo.presets.save(model, str(tmp_path / "out"), format="hf")
    original, exported = hf_state(tmp_path / "hf"), hf_state(tmp_path / "out")
    if task == "backbone":  # kzoo has no pooler: everything else is exported
        original = {k: v for k, v in original.items() if not k.startswith("pooler.")}
    assert sorted(original) == sorted(exported)
    for name in original:
        np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
    cls = transformers.ViTForImageClassification if task == "classifier" else \
        transformers.ViTModel
    reloaded = cls.from_pretrained(str(tmp_path / "out")).eval()
    x = images(2, seed=4)
    assert_vit_matches(f"exported {task} reloaded by transformers", model, reloaded, x)


def test_kzoo_model_exports_to_transformers(tmp_path):
    import transformers

    model = ViTClassifier(
        ViTBackbone(**TINY, num_channels=2, layer_norm_epsilon=1e-5, qkv_bias=False,
                    activation="gelu_tanh"),
        num_classes=4,
    )
    rng = np.random.default_rng(0)
    for w in model.weights:
        w.assign(rng.normal(scale=0.1, size=w.shape).astype("float32"))
    kzoo.presets.save(model, str(tmp_path), format="hf")
    hf = transformers.ViTForImageClassification.from_pretrained(str(tmp_path)).eval()
    assert hf.config.layer_norm_eps == 1e-5 and hf.config.qkv_bias is False
    x = images(2, channels=2, seed=5)
    assert_vit_matches("kzoo-built classifier exported", model, hf, x)


def test_hf_errors(tmp_path):
    from safetensors.numpy import save_file

    from kzoo.convert import vit as conv

    hf_vit(tmp_path / "ok")
    config = json.load(open(tmp_path / "ok" / "config.json"))
    with pytest.raises(ValueError, match="hidden_act"):
        conv.config_from_hf({**config, "hidden_act": "gelu_fastest"})
    with pytest.raises(ValueError, match="architectures"):
        conv.config_from_hf({**config, "architectures": ["ViTForMaskedImageModeling"]})
    with pytest.raises(ValueError, match="pruned_heads"):
        conv.config_from_hf({**config, "pruned_heads": {"0": [1]}})
    # encoder_stride is irrelevant to classification: accepted.
    assert conv.config_from_hf({**config, "encoder_stride": 4})[1]["patch_size"] == 8

    def variant(name, config_change=None, state_change=None):
        d = tmp_path / name
        d.mkdir()
        json.dump({**config, **(config_change or {})}, open(d / "config.json", "w"))
        state = hf_state(tmp_path / "ok")
        if state_change:
            state_change(state)
        save_file(state, str(d / "model.safetensors"))
        return str(d)

    with pytest.raises(ValueError, match=r"intermediate.dense.weight.*\(32, 64\).*\(32, 48\)"):
        kzoo.presets.load(variant("shape", {"intermediate_size": 48}))
    missing = variant("missing", state_change=lambda s: s.pop("vit.layernorm.bias"))
    with pytest.raises(ValueError, match="missing weights.*vit.layernorm.bias"):
        kzoo.presets.load(missing)
    extra = variant("extra", state_change=lambda s: s.update(extra_tensor=np.zeros(2, "f4")))
    with pytest.raises(ValueError, match="unexpected weights.*extra_tensor"):
        kzoo.presets.load(extra)
    with pytest.raises(ValueError, match="num_classes"):
        kzoo.presets.load(str(tmp_path / "ok"), num_classes=3)

    mean = ViTClassifier(ViTBackbone(**TINY), num_classes=2, pooling="mean")
    with pytest.raises(ValueError, match="pooling"):
        kzoo.presets.save(mean, str(tmp_path / "mean"), format="hf")
    no_cls = ViTBackbone(**TINY, use_class_token=False)
    with pytest.raises(ValueError, match="use_class_token"):
        kzoo.presets.save(no_cls, str(tmp_path / "nocls"), format="hf")


@pytest.mark.spread
@pytest.mark.parametrize("attention,options", [
    ("sliding_window", {"window": 2}),
    ("linear", None),
])
def test_hf_export_refuses_attention_vit_lacks(attention, options, tmp_path):
    """Found by the parity audit: `save(format="hf")` wrote a ViT with an efficient attention
    as a plain `ViTModel` checkpoint, which transformers loads and runs with full attention
    (max |diff| 2.9 on the last hidden state). It must refuse."""
    import transformers

    backbone = ViTBackbone(**TINY, attention=attention, attention_options=options)
    with pytest.raises(ValueError, match=rf"attention='{attention}'.*allowed: attention='full'"):
        kzoo.presets.save(backbone, str(tmp_path / "refused"), format="hf")
    assert not (tmp_path / "refused").exists()
    # The same model with full attention is written and matches transformers.
    full = ViTBackbone(**TINY)
    kzoo.presets.save(full, str(tmp_path / "full"), format="hf")
    reloaded = transformers.ViTModel.from_pretrained(str(tmp_path / "full")).eval()
    assert_vit_matches("full attention exported", full, reloaded, images(2, seed=5))
