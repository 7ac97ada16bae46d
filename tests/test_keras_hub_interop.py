"""keras-hub presets in and out (`kzoo.convert.keras_hub`), checked against keras-hub itself.

Each case builds a tiny keras-hub model from its classes (no download), gives every weight a
random value (keras-hub starts biases at zero and norms at one, which would hide a swapped
bias or norm), saves it with `save_to_preset` and loads it with `kzoo.presets.load`; the
outputs must equal keras-hub's to 1e-5. The other way, a randomised kzoo model saved with
`format="keras_hub"` is loaded by `keras_hub.models.<X>.from_preset` and compared the same way.
"""

import json
import os
import sys

import keras_hub
import numpy as np
import pytest

import kzoo
from kzoo.convert import keras_hub as hub_convert
from tests.harness import max_real_diff, to_numpy

ATOL = 1e-5
VOCAB, SEQ, BATCH = 40, 7, 2


def _randomise(model, seed):
    """Every weight of `model` set to normal(0, 0.2) values (norm scales around 1)."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        value = rng.normal(0.0, 0.2, tuple(variable.shape))
        if "gamma" in variable.path or variable.path.endswith("/scale"):
            value += 1.0
        variable.assign(value.astype("float32"))
    return model


def _token_inputs(with_segments):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
    mask = np.ones((BATCH, SEQ), "int32")
    mask[1, SEQ - 3:] = 0  # right padding in the second row
    inputs = {"token_ids": ids, "padding_mask": mask}
    if with_segments:
        inputs["segment_ids"] = rng.integers(0, 2, (BATCH, SEQ)).astype("int32")
    return inputs


def _images():
    return np.random.default_rng(2).normal(size=(BATCH, 8, 8, 3)).astype("float32")


# Each family: the keras-hub backbone and task (tiny), the kzoo config and task, the inputs.
FAMILIES = {
    "bert": dict(
        hub_backbone=lambda: keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=SEQ + 3, num_segments=3),
        hub_task=lambda b: keras_hub.models.BertTextClassifier(
            backbone=b, num_classes=3, preprocessor=None),
        kzoo_family="bert", kzoo_task="classifier", kzoo_task_config={"num_classes": 3},
        kzoo_config=dict(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
                         intermediate_dim=16, max_sequence_length=SEQ + 3, num_segments=3,
                         activation="gelu_tanh", layer_norm_epsilon=1e-12),
        inputs=lambda: _token_inputs(with_segments=True),
    ),
    "gpt2": dict(
        hub_backbone=lambda: keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=SEQ + 3),
        hub_task=lambda b: keras_hub.models.GPT2CausalLM(backbone=b, preprocessor=None),
        kzoo_family="gpt", kzoo_task="causal_lm", kzoo_task_config={},
        kzoo_config=dict(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
                         intermediate_dim=16, max_sequence_length=SEQ + 3),
        inputs=lambda: _token_inputs(with_segments=False),
    ),
    "vit": dict(
        hub_backbone=lambda: keras_hub.models.ViTBackbone(
            image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=8,
            mlp_dim=16, layer_norm_epsilon=1e-6),
        hub_task=lambda b: keras_hub.models.ViTImageClassifier(
            backbone=b, num_classes=3, preprocessor=None),
        kzoo_family="vit", kzoo_task="classifier", kzoo_task_config={"num_classes": 3},
        kzoo_config=dict(image_size=8, patch_size=4, num_layers=2, num_heads=2, hidden_dim=8,
                         intermediate_dim=16, layer_norm_epsilon=1e-6),
        inputs=_images,
    ),
}


def _diff(a, b, inputs):
    """max |a - b| (dict outputs key by key) over the real tokens of `inputs`."""
    mask = inputs.get("padding_mask") if isinstance(inputs, dict) else None
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        return max(max_real_diff(to_numpy(a[k]), to_numpy(b[k]), mask) for k in a)
    return max_real_diff(to_numpy(a), to_numpy(b), mask)


def _check(model_a, model_b, inputs, atol=ATOL):
    """The two models' outputs for `inputs` agree to `atol` on the real tokens (eager calls:
    on JAX, cheaper than compiling a predict step for each of these tiny models)."""
    diff = _diff(model_a(inputs), model_b(inputs), inputs)
    assert diff <= atol, (type(model_a).__name__, type(model_b).__name__, diff)


def _hub_preset(tmp_path, case, task=True, seed=0, hub_backbone=None, hub_task=None):
    backbone = (hub_backbone or case["hub_backbone"])()
    model = (hub_task or case["hub_task"])(backbone) if task else backbone
    _randomise(model, seed)
    path = str(tmp_path / "hub_preset")
    model.save_to_preset(path)
    return model, path


# === keras-hub -> kzoo ===


@pytest.mark.spread
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_load_keras_hub_task_preset_matches_keras_hub(tmp_path, name):
    case = FAMILIES[name]
    hub_model, path = _hub_preset(tmp_path, case)
    model = kzoo.presets.load(path)
    assert kzoo.registry.for_model(model).name == case["kzoo_family"]
    assert kzoo.registry.for_model(model).task_of(model) == case["kzoo_task"]
    inputs = case["inputs"]()
    # The task's output (logits) and the backbone's (BERT: sequence and pooled output), with
    # a right-padded row; per-token outputs are compared on the real tokens.
    _check(model, hub_model, inputs)
    _check(model.backbone, hub_model.backbone, inputs)


def test_load_keras_hub_backbone_preset(tmp_path, monkeypatch):
    """A backbone preset (no task.json) loads as the kzoo backbone; a head can be put on it.
    Reading and writing presets never imports keras_hub (an optional extra)."""
    case = FAMILIES["bert"]
    hub_backbone, path = _hub_preset(tmp_path, case, task=False)
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # `import keras_hub` now fails
    assert hub_convert.is_preset(path)
    backbone = kzoo.presets.load(path)
    kzoo.presets.save(backbone, str(tmp_path / "written"), format="keras_hub")
    monkeypatch.undo()
    assert isinstance(backbone, kzoo.models.bert.BertBackbone)
    inputs = case["inputs"]()
    _check(backbone, hub_backbone, inputs)
    classifier = kzoo.presets.load(path, task="classifier", num_classes=4)
    assert classifier.num_classes == 4
    _check(classifier.backbone, hub_backbone, inputs)


@pytest.mark.spread
def test_vit_without_biases_or_class_token(tmp_path):
    """keras-hub's bias switches load as zero kzoo biases; 'gap' pooling without a class token
    is kzoo's 'mean'; the model is written back while those biases are zero, not after."""
    case = FAMILIES["vit"]
    hub_model, path = _hub_preset(
        tmp_path, case,
        hub_backbone=lambda: keras_hub.models.ViTBackbone(
            image_shape=(8, 12, 3), patch_size=(4, 2), num_layers=1, num_heads=2,
            hidden_dim=8, mlp_dim=16, use_mha_bias=False, use_mlp_bias=False,
            use_patch_bias=False, use_class_token=False, layer_norm_epsilon=1e-5),
        hub_task=lambda b: keras_hub.models.ViTImageClassifier(
            backbone=b, num_classes=3, pooling="gap", preprocessor=None))
    model = kzoo.presets.load(path)
    assert (model.pooling, model.backbone.qkv_bias, model.backbone.use_class_token) == (
        "mean", False, False)
    assert (tuple(model.backbone.image_size), tuple(model.backbone.patch_size)) == ((8, 12), (4, 2))
    images = np.random.default_rng(3).normal(size=(BATCH, 8, 12, 3)).astype("float32")
    _check(model, hub_model, images)

    # At another image size the position table is resampled as torch's bicubic resize does
    # (transformers' interpolate_pos_encoding).
    import torch

    larger = kzoo.presets.load(path, image_size=(16, 24))
    patching = hub_model.backbone.get_layer("vit_patching_and_embedding")
    grid = to_numpy(patching.position_embedding.embeddings)  # (2 * 6 patches, 8)
    grid = torch.from_numpy(grid.reshape(1, 2, 6, 8)).permute(0, 3, 1, 2)
    expected = torch.nn.functional.interpolate(grid, size=(4, 12), mode="bicubic",
                                               align_corners=False)
    expected = expected.permute(0, 2, 3, 1).reshape(48, 8).numpy()
    np.testing.assert_allclose(to_numpy(larger.backbone.embedding.position_embedding),
                               expected, atol=1e-6)

    out = str(tmp_path / "back")
    kzoo.presets.save(model, out, format="keras_hub")
    again = keras_hub.models.ViTImageClassifier.from_preset(out)
    assert again.backbone.use_mlp_bias is True  # kzoo writes its (zero) MLP biases
    _check(again, hub_model, images)

    # The backbone saved over the task preset: the task's files go, it loads as a backbone.
    kzoo.presets.save(model.backbone, out, format="keras_hub")
    assert not os.path.exists(os.path.join(out, "task.json"))
    assert isinstance(kzoo.presets.load(out), kzoo.models.vit.ViTBackbone)

    bias = model.backbone.encoder_layers[0].self_attention.output_dense.bias
    bias.assign(np.ones(tuple(bias.shape), "float32"))
    with pytest.raises(ValueError, match="use_mha_bias=False"):
        kzoo.presets.save(model, str(tmp_path / "refused"), format="keras_hub")


def test_bert_masked_lm_preset_loads_only_its_backbone(tmp_path):
    case = FAMILIES["bert"]
    hub_model, path = _hub_preset(
        tmp_path, case, hub_task=lambda b: keras_hub.models.BertMaskedLM(b, preprocessor=None))
    with pytest.raises(ValueError, match="BertMaskedLM.*exact GELU.*1e-5.*task='backbone'"):
        kzoo.presets.load(path)
    with pytest.raises(ValueError, match="BertMaskedLM"):
        kzoo.presets.load(path, task="masked_lm")
    backbone = kzoo.presets.load(path, task="backbone")
    inputs = case["inputs"]()
    _check(backbone, hub_model.backbone, inputs)


# === kzoo -> keras-hub ===


def _kzoo_model(case, seed=5):
    model = kzoo.presets.build(case["kzoo_family"], case["kzoo_config"], task=case["kzoo_task"],
                               task_config=case["kzoo_task_config"])
    return _randomise(model, seed)


@pytest.mark.spread
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_save_keras_hub_preset_loads_in_keras_hub(tmp_path, name):
    case = FAMILIES[name]
    model = _kzoo_model(case)
    path = str(tmp_path / "kzoo_as_hub")
    assert kzoo.presets.save(model, path, format="keras_hub") == path
    assert hub_convert.is_preset(path)
    task_class = type(case["hub_task"](case["hub_backbone"]()))
    hub_model = task_class.from_preset(path)
    inputs = case["inputs"]()
    _check(hub_model, model, inputs)
    hub_backbone = type(hub_model.backbone).from_preset(path)
    _check(hub_backbone, model.backbone, inputs)
    # And back into kzoo: the same model.
    again = kzoo.presets.load(path)
    _check(again, model, inputs, atol=0.0)
    metadata = json.load(open(os.path.join(path, "metadata.json")))
    assert metadata["parameter_count"] == model.backbone.count_params()


# === Errors ===


def _edit_json(path, name, edit):
    file = os.path.join(path, name)
    data = json.load(open(file))
    edit(data)
    json.dump(data, open(file, "w"))


@pytest.fixture(scope="module")
def gpt2_preset(tmp_path_factory):
    """A small keras-hub GPT-2 backbone preset the error tests copy and break."""
    path = str(tmp_path_factory.mktemp("gpt2") / "preset")
    FAMILIES["gpt2"]["hub_backbone"]().save_to_preset(path)
    return path


def _copy(preset, tmp_path):
    import shutil

    return shutil.copytree(preset, str(tmp_path / "copy"))


def test_unsupported_backbone_class_lists_the_supported_ones(tmp_path, gpt2_preset):
    path = _copy(gpt2_preset, tmp_path)
    _edit_json(path, "config.json", lambda c: c.update(
        class_name="RobertaBackbone", registered_name="keras_hub>RobertaBackbone"))
    assert hub_convert.is_preset(path)
    with pytest.raises(ValueError, match=r"RobertaBackbone.*\['BertBackbone', 'GPT2Backbone', "
                                         r"'ViTBackbone'\]"):
        kzoo.presets.load(path)


def test_unknown_config_field_is_named(tmp_path, gpt2_preset):
    path = _copy(gpt2_preset, tmp_path)
    _edit_json(path, "config.json", lambda c: c["config"].update(rope_max_wavelength=500))
    with pytest.raises(ValueError, match=r"\['rope_max_wavelength'\].*\[500\]"):
        kzoo.presets.load(path)
    path2 = str(tmp_path / "bad_value")
    os.rename(path, path2)
    _edit_json(path2, "config.json", lambda c: (c["config"].pop("rope_max_wavelength"),
                                                c["config"].update(num_heads=3)))
    with pytest.raises(ValueError, match="num_heads"):
        kzoo.presets.load(path2)


def test_bad_files_raise_value_errors(tmp_path, gpt2_preset):
    path = _copy(gpt2_preset, tmp_path)
    with open(os.path.join(path, "model.weights.h5"), "wb") as f:
        f.write(b"not hdf5")
    with pytest.raises(ValueError, match="cannot be read"):
        kzoo.presets.load(path)
    os.remove(os.path.join(path, "model.weights.h5"))
    open(os.path.join(path, "model.weights.json"), "w").write("{}")
    with pytest.raises(ValueError, match="sharded"):
        kzoo.presets.load(path)
    _edit_json(path, "config.json", lambda c: c["config"].update(
        dtype={"module": "keras", "class_name": "DTypePolicyMap", "config": {},
               "registered_name": None}))
    with pytest.raises(ValueError, match="quantized"):
        kzoo.presets.load(path)


def test_weights_of_another_shape_are_named(tmp_path, gpt2_preset):
    path = _copy(gpt2_preset, tmp_path)
    _edit_json(path, "config.json", lambda c: c["config"].update(intermediate_dim=32))
    with pytest.raises(ValueError, match=r"Shape mismatch for 'layers/transformer_decoder/"
                                         r"_feedforward_intermediate_dense/vars/0'"):
        kzoo.presets.load(path)


def test_detection(tmp_path, gpt2_preset):
    assert hub_convert.is_preset(gpt2_preset)
    no_metadata = _copy(gpt2_preset, tmp_path)
    os.remove(os.path.join(no_metadata, "metadata.json"))
    assert not hub_convert.is_preset(no_metadata)
    with pytest.raises(ValueError, match="keras-hub preset"):
        kzoo.presets.load(no_metadata)
    kzoo_dir = str(tmp_path / "kzoo_dir")
    kzoo.presets.save(_kzoo_model(FAMILIES["gpt2"]), kzoo_dir)
    assert not hub_convert.is_preset(kzoo_dir)


@pytest.mark.parametrize("family, config, task, task_config, match", [
    ("gpt", dict(norm="rmsnorm"), "causal_lm", {}, r"norm='rmsnorm'.*\['layernorm'\]"),
    ("gpt", dict(activation="gelu"), "causal_lm", {}, r"activation='gelu'"),
    ("gpt", dict(head_dim=16), "causal_lm", {}, r"head_dim=16 has no keras-hub equivalent"),
    ("gpt", dict(attention="sliding_window", attention_options={"window": 4}), "backbone", {},
     r"attention='sliding_window'.*\['full'\]"),
    ("bert", dict(activation="gelu"), "backbone", {}, r"activation='gelu'.*gelu_tanh"),
    ("bert", dict(activation="gelu_tanh", layer_norm_epsilon=1e-6), "backbone", {},
     r"layer_norm_epsilon=1e-06.*1e-12"),
    ("bert", dict(activation="gelu_tanh", layer_norm_epsilon=1e-12), "masked_lm", {},
     r"BertMaskedLM.*model.backbone"),
    ("vit", dict(activation="gelu_tanh"), "backbone", {}, r"activation='gelu_tanh'"),
    ("vit", {}, "classifier", {"num_classes": 2, "pooling": "mean"}, r"pooling='mean'"),
])
def test_save_refuses_what_keras_hub_cannot_express(tmp_path, family, config, task, task_config,
                                                     match):
    base = {"bert": FAMILIES["bert"], "gpt": FAMILIES["gpt2"], "vit": FAMILIES["vit"]}[family]
    model = kzoo.presets.build(family, {**base["kzoo_config"], **config}, task=task,
                               task_config=task_config)
    path = str(tmp_path / "refused")
    with pytest.raises(ValueError, match=match):
        kzoo.presets.save(model, path, format="keras_hub")
    assert not os.path.exists(os.path.join(path, "config.json"))


def test_save_other_families_and_formats(tmp_path):
    t5 = kzoo.presets.build("t5", dict(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                       hidden_dim=8, intermediate_dim=16, key_value_dim=4))
    with pytest.raises(ValueError, match=r"\['bert', 'gpt', 'vit'\].*'t5'"):
        kzoo.presets.save(t5, str(tmp_path / "t5"), format="keras_hub")
    with pytest.raises(ValueError, match="'keras_hub'.*format='keras-hub'"):
        kzoo.presets.save(t5, str(tmp_path / "t5"), format="keras-hub")


def test_shape_changing_overrides_are_named_and_weights_false_gives_a_fresh_model(
        tmp_path, gpt2_preset):
    """A keras-hub preset loaded with an override that changes the weights' shapes: the
    error names the override and the way out (it named only the first mismatching weight,
    as if the preset were broken); `weights=False` builds a fresh model of the new shape;
    a weights file given as `weights` loads instead of the preset's own."""
    with pytest.raises(ValueError, match=r"\(checkpoint .*\)\. The model was built with "
                                         r"the overrides \['hidden_dim'\].*pass weights=False"):
        kzoo.presets.load(gpt2_preset, hidden_dim=16)
    fresh = kzoo.presets.load(gpt2_preset, weights=False, num_layers=3, hidden_dim=16)
    assert fresh.config.num_layers == 3 and fresh.config.hidden_dim == 16  # (a backbone)
    own = kzoo.presets.load(gpt2_preset)
    other = kzoo.presets.load(gpt2_preset, weights=False)
    assert any(not np.array_equal(a, b) for a, b in zip(own.get_weights(),
                                                          other.get_weights()))
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    again = kzoo.presets.load(gpt2_preset, weights=path)
    for a, b in zip(again.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)
