"""Family configs: each field validated once, unknown keys refused, `get_config()` is the
dataclass, every preset validates, and a bad Hugging Face config.json is named.

The expectations here are written out by hand (the allowed values of each field, the
fields of each backbone), never read back from the code under test.
"""

import dataclasses
import glob
import inspect
import json
import os

import keras
import numpy as np
import pytest

import kzoo
from kzoo.models.bert import BertBackbone, BertClassifier, BertConfig, BertMaskedLM
from kzoo.models.gpt import GPTBackbone, GPTCausalLM, GPTConfig
from kzoo.models.graphormer import GraphormerBackbone, GraphormerConfig, GraphormerPredictor
from kzoo.models.t5 import T5Backbone, T5Config, T5Seq2SeqLM
from kzoo.models.vit import ViTBackbone, ViTClassifier, ViTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# family -> (config class, backbone class, a small valid config)
FAMILIES = {
    "gpt": (GPTConfig, GPTBackbone, dict(vocabulary_size=40, num_layers=1, num_heads=4,
                                         hidden_dim=32, intermediate_dim=48,
                                         max_sequence_length=16)),
    "bert": (BertConfig, BertBackbone, dict(vocabulary_size=40, num_layers=1, num_heads=2,
                                            hidden_dim=16, intermediate_dim=32,
                                            max_sequence_length=16)),
    "t5": (T5Config, T5Backbone, dict(vocabulary_size=40, num_layers=1, num_heads=2,
                                      hidden_dim=16, key_value_dim=8, intermediate_dim=32)),
    "vit": (ViTConfig, ViTBackbone, dict(image_size=16, patch_size=8, num_layers=1,
                                         num_heads=2, hidden_dim=16, intermediate_dim=32)),
    "graphormer": (GraphormerConfig, GraphormerBackbone,
                   dict(num_atoms=64, num_in_degree=8, num_out_degree=8, num_edges=16,
                        num_spatial=8, num_edge_dis=8, num_layers=2, hidden_dim=16,
                        intermediate_dim=16, num_heads=2)),
}

# The fields of each family, in order (the backbone's keyword arguments, `dtype` aside).
FIELDS = {
    "gpt": ["vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim",
            "max_sequence_length", "dropout", "layer_norm_epsilon", "activation", "norm",
            "position", "feedforward", "num_kv_heads", "use_bias", "rope_max_wavelength",
            "num_experts", "top_k", "capacity_factor", "expert_type", "tie_embeddings",
            "attention_scale", "initializer_range", "attention", "attention_options",
            "packed_inputs", "remat", "layerdrop", "head_dim", "rope_scaling_type",
            "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
            "rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow",
            "rope_attention_factor", "rope_truncate",
            "attention_scale_by_inverse_layer"],
    "bert": ["vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim",
             "max_sequence_length", "num_segments", "dropout", "attention_dropout",
             "layer_norm_epsilon", "activation", "initializer_range", "attention",
             "attention_options", "packed_inputs", "remat", "layerdrop",
             "position_padding_id"],
    "t5": ["vocabulary_size", "num_layers", "num_decoder_layers", "num_heads", "hidden_dim",
           "key_value_dim", "intermediate_dim", "dropout", "layer_norm_epsilon", "feedforward",
           "relative_attention_num_buckets", "relative_attention_max_distance",
           "tie_embeddings", "kernel", "remat", "layerdrop"],
    "vit": ["image_size", "patch_size", "num_channels", "num_layers", "num_heads", "hidden_dim",
            "intermediate_dim", "dropout", "attention_dropout", "layer_norm_epsilon",
            "activation", "use_class_token", "qkv_bias", "attention", "attention_options",
            "remat", "layerdrop"],
    "graphormer": ["num_atoms", "num_in_degree", "num_out_degree", "num_edges", "num_spatial",
                   "num_edge_dis", "edge_type", "multi_hop_max_dist", "num_layers",
                   "hidden_dim", "intermediate_dim", "num_heads", "dropout",
                   "attention_dropout", "activation_dropout", "activation", "pre_layernorm",
                   "layer_norm_epsilon", "encoder_normalize_before", "embed_scale",
                   "apply_graphormer_init", "use_attention_bias", "num_frozen_layers", "remat",
                   "layerdrop"],
}

# (family, overrides, the field the error must name, the value it must quote)
INVALID = [
    # GPT
    ("gpt", dict(vocabulary_size=0), "vocabulary_size", 0),
    ("gpt", dict(num_layers=2.0), "num_layers", 2.0),
    ("gpt", dict(num_heads=5), "num_heads", 5),
    ("gpt", dict(head_dim=0), "head_dim", 0),
    ("gpt", dict(head_dim=5, position="rotary"), "head_dim", 5),
    ("gpt", dict(rope_scaling_type="dynamic", position="rotary"), "rope_scaling_type",
     "dynamic"),
    ("gpt", dict(rope_scaling_type="llama3", rope_scaling_factor=8.0, position="rotary"),
     "rope_low_freq_factor", None),
    ("gpt", dict(hidden_dim=-32), "hidden_dim", -32),
    ("gpt", dict(intermediate_dim="48"), "intermediate_dim", "48"),
    ("gpt", dict(max_sequence_length=None), "max_sequence_length", None),
    ("gpt", dict(dropout=1.0), "dropout", 1.0),
    ("gpt", dict(dropout=True), "dropout", True),
    ("gpt", dict(layer_norm_epsilon=0.0), "layer_norm_epsilon", 0.0),
    ("gpt", dict(layer_norm_epsilon=float("nan")), "layer_norm_epsilon", float("nan")),
    ("gpt", dict(activation="gelu_fast"), "activation", "gelu_fast"),
    ("gpt", dict(norm="batchnorm"), "norm", "batchnorm"),
    ("gpt", dict(position="alibi"), "position", "alibi"),
    ("gpt", dict(feedforward="dense"), "feedforward", "dense"),
    ("gpt", dict(num_kv_heads=0), "num_kv_heads", 0),
    ("gpt", dict(num_kv_heads=3), "num_kv_heads", 3),
    ("gpt", dict(use_bias="yes"), "use_bias", "yes"),
    ("gpt", dict(rope_max_wavelength=-1), "rope_max_wavelength", -1),
    ("gpt", dict(position="rotary", num_heads=8, hidden_dim=24), "position", "rotary"),
    ("gpt", dict(feedforward="moe"), "num_experts", None),
    ("gpt", dict(feedforward="moe", num_experts=0), "num_experts", 0),
    ("gpt", dict(num_experts=4), "num_experts", 4),
    ("gpt", dict(feedforward="moe", num_experts=2, top_k=3), "top_k", 3),
    ("gpt", dict(top_k=0), "top_k", 0),
    ("gpt", dict(capacity_factor=0.0), "capacity_factor", 0.0),
    ("gpt", dict(expert_type="switch"), "expert_type", "switch"),
    ("gpt", dict(tie_embeddings=1), "tie_embeddings", 1),
    ("gpt", dict(attention_scale=-0.5), "attention_scale", -0.5),
    ("gpt", dict(initializer_range=0), "initializer_range", 0),
    # BERT
    ("bert", dict(vocabulary_size=2.5), "vocabulary_size", 2.5),
    ("bert", dict(num_layers=-1), "num_layers", -1),
    ("bert", dict(num_heads=3), "num_heads", 3),
    ("bert", dict(hidden_dim=0), "hidden_dim", 0),
    ("bert", dict(intermediate_dim=None), "intermediate_dim", None),
    ("bert", dict(max_sequence_length=0), "max_sequence_length", 0),
    ("bert", dict(num_segments=0), "num_segments", 0),
    ("bert", dict(dropout=1.5), "dropout", 1.5),
    ("bert", dict(attention_dropout=-0.1), "attention_dropout", -0.1),
    ("bert", dict(layer_norm_epsilon=0.0), "layer_norm_epsilon", 0.0),
    ("bert", dict(activation="gelu_42"), "activation", "gelu_42"),
    ("bert", dict(initializer_range=-0.02), "initializer_range", -0.02),
    # T5
    ("t5", dict(vocabulary_size=0), "vocabulary_size", 0),
    ("t5", dict(num_layers=0), "num_layers", 0),
    ("t5", dict(num_decoder_layers=0), "num_decoder_layers", 0),
    ("t5", dict(num_heads=0), "num_heads", 0),
    ("t5", dict(hidden_dim=-4), "hidden_dim", -4),
    ("t5", dict(key_value_dim=2.5), "key_value_dim", 2.5),
    ("t5", dict(intermediate_dim=0), "intermediate_dim", 0),
    ("t5", dict(dropout=1.0), "dropout", 1.0),
    ("t5", dict(layer_norm_epsilon=0), "layer_norm_epsilon", 0),
    ("t5", dict(feedforward="swiglu"), "feedforward", "swiglu"),
    ("t5", dict(relative_attention_num_buckets=3), "relative_attention_num_buckets", 3),
    ("t5", dict(relative_attention_num_buckets=32, relative_attention_max_distance=16),
     "relative_attention_max_distance", 16),
    ("t5", dict(tie_embeddings="yes"), "tie_embeddings", "yes"),
    ("t5", dict(kernel="flash"), "kernel", "flash"),
    # ViT
    ("vit", dict(image_size=0), "image_size", 0),
    ("vit", dict(image_size=(16, 16, 3)), "image_size", (16, 16, 3)),
    ("vit", dict(image_size=20), "patch_size", 8),
    ("vit", dict(image_size=(16, 20)), "patch_size", 8),
    ("vit", dict(patch_size=0), "patch_size", 0),
    ("vit", dict(num_channels=0), "num_channels", 0),
    ("vit", dict(num_layers=0), "num_layers", 0),
    ("vit", dict(num_heads=5), "num_heads", 5),
    ("vit", dict(hidden_dim=0), "hidden_dim", 0),
    ("vit", dict(intermediate_dim=-1), "intermediate_dim", -1),
    ("vit", dict(dropout=1.0), "dropout", 1.0),
    ("vit", dict(attention_dropout=-0.1), "attention_dropout", -0.1),
    ("vit", dict(layer_norm_epsilon=0.0), "layer_norm_epsilon", 0.0),
    ("vit", dict(activation="gelu_fast"), "activation", "gelu_fast"),
    ("vit", dict(use_class_token=1), "use_class_token", 1),
    ("vit", dict(qkv_bias="no"), "qkv_bias", "no"),
    # Graphormer
    ("graphormer", dict(num_atoms=0), "num_atoms", 0),
    ("graphormer", dict(num_in_degree=-1), "num_in_degree", -1),
    ("graphormer", dict(num_out_degree=1.5), "num_out_degree", 1.5),
    ("graphormer", dict(num_edges=0), "num_edges", 0),
    ("graphormer", dict(num_spatial=None), "num_spatial", None),
    ("graphormer", dict(num_edge_dis=0), "num_edge_dis", 0),
    ("graphormer", dict(edge_type="two_hop"), "edge_type", "two_hop"),
    ("graphormer", dict(multi_hop_max_dist=-1), "multi_hop_max_dist", -1),
    ("graphormer", dict(num_layers=0), "num_layers", 0),
    ("graphormer", dict(num_heads=5), "num_heads", 5),
    ("graphormer", dict(dropout=1.5), "dropout", 1.5),
    ("graphormer", dict(attention_dropout=2), "attention_dropout", 2),
    ("graphormer", dict(activation_dropout=-0.1), "activation_dropout", -0.1),
    ("graphormer", dict(activation="swiglu"), "activation", "swiglu"),
    ("graphormer", dict(pre_layernorm="yes"), "pre_layernorm", "yes"),
    ("graphormer", dict(layer_norm_epsilon=0.0), "layer_norm_epsilon", 0.0),
    ("graphormer", dict(encoder_normalize_before=0), "encoder_normalize_before", 0),
    ("graphormer", dict(embed_scale="big"), "embed_scale", "big"),
    ("graphormer", dict(apply_graphormer_init=None), "apply_graphormer_init", None),
    ("graphormer", dict(use_attention_bias="no"), "use_attention_bias", "no"),
    ("graphormer", dict(num_frozen_layers=3), "num_frozen_layers", 3),
]


def _case_id(case):
    family, overrides, field, _ = case
    return f"{family}-{field}-" + "-".join(f"{k}={v!r}" for k, v in overrides.items())


def _check_message(error, field, value):
    message = str(error)
    assert f"`{field}`" in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize("case", INVALID, ids=[_case_id(c) for c in INVALID])
def test_invalid_field_raises_one_error_naming_it(case):
    family, overrides, field, value = case
    config_class, backbone_class, base = FAMILIES[family]
    values = {**base, **overrides}
    with pytest.raises(ValueError) as error:
        config_class(**values)
    _check_message(error.value, field, value)
    # The backbone validates through its config: the same error, before any layer exists.
    with pytest.raises(ValueError) as from_backbone:
        backbone_class(**values)
    assert str(from_backbone.value) == str(error.value)
    # ... and a dict read with a source names the source too.
    with pytest.raises(ValueError) as from_dict:
        config_class.from_dict(values, source="presets/my_model.json")
    _check_message(from_dict.value, field, value)
    assert "presets/my_model.json" in str(from_dict.value)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fields_and_defaults_match_the_backbone(family):
    config_class, backbone_class, _ = FAMILIES[family]
    assert [f.name for f in dataclasses.fields(config_class)] == FIELDS[family]
    assert backbone_class.config_class is config_class
    parameters = inspect.signature(backbone_class.__init__).parameters
    assert [n for n in parameters if n not in ("self", "dtype", "kwargs")] == FIELDS[family]
    for field in dataclasses.fields(config_class):
        assert field.default == parameters[field.name].default, field.name
    # Frozen: a config is a value.
    config = config_class()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3
    assert hash(config) == hash(config_class())


def test_numpy_values_are_accepted_and_normalised():
    config = GPTConfig(num_layers=np.int64(2), hidden_dim=np.int32(64), num_heads=4,
                       dropout=np.float32(0.25), use_bias=np.bool_(False))
    assert (config.num_layers, config.hidden_dim, config.dropout) == (2, 64, 0.25)
    assert type(config.num_layers) is int and type(config.hidden_dim) is int
    assert type(config.dropout) is float and config.use_bias is False
    # A pair given as a list is kept as a pair (a tuple); an int stays an int.
    vit = ViTConfig(image_size=[32, 16], patch_size=8)
    assert vit.image_size == (32, 16) and vit.patch_size == 8


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unknown_keys_are_refused(family):
    config_class, _, base = FAMILIES[family]
    with pytest.raises(ValueError) as error:
        config_class.from_dict({**base, "num_layerz": 2, "colour": "red"},
                               source="/tmp/config.json")
    message = str(error.value)
    for expected in ("'num_layerz'", "'colour'", "/tmp/config.json", "num_layers"):
        assert expected in message, message
    for field in FIELDS[family]:
        assert repr(field) in message, (field, message)
    with pytest.raises(ValueError, match="dict"):
        config_class.from_dict([("num_layers", 2)])
    # A known subset of fields is fine; the rest take their defaults.
    config = config_class.from_dict(base)
    for name, value in base.items():
        assert getattr(config, name) == value


def test_source_names_the_hugging_face_key():
    with pytest.raises(ValueError) as error:
        GPTConfig.from_dict({"num_layers": 0}, source="ckpt/config.json",
                            names={"num_layers": "n_layer"})
    message = str(error.value)
    for expected in ("`n_layer`", "ckpt/config.json", "`num_layers`", "num_layers=0"):
        assert expected in message, message


@pytest.mark.spread
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_get_config_is_the_dataclass_and_round_trips(family):
    config_class, backbone_class, base = FAMILIES[family]
    config = config_class(**base)
    backbone = config.build()
    assert isinstance(backbone, backbone_class)
    assert backbone.config == config
    expected = {
        "name": backbone.name,
        "trainable": True,
        "dtype": keras.dtype_policies.serialize(backbone.dtype_policy),
        **{name: getattr(config, name) for name in FIELDS[family]},
    }
    got = backbone.get_config()
    assert got == expected
    assert list(got)[3:] == FIELDS[family]
    for name in FIELDS[family]:
        assert getattr(backbone, name) == getattr(config, name), name
    # Keyword construction gives the same config as building from the dataclass.
    assert backbone_class(**base).config == config
    # from_config(get_config()) rebuilds an identical model.
    clone = backbone_class.from_config(got)
    assert clone.get_config() == got and clone.config == config
    assert [(v.path, tuple(v.shape)) for v in clone.weights] == [
        (v.path, tuple(v.shape)) for v in backbone.weights
    ]
    restored = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(keras.saving.serialize_keras_object(backbone)))
    )
    assert restored.config == config and restored.get_config() == got


def test_build_passes_keras_arguments():
    config = GPTConfig(**FAMILIES["gpt"][2])
    backbone = config.build(dtype="mixed_bfloat16", name="tiny")
    assert backbone.name == "tiny" and backbone.dtype_policy.name == "mixed_bfloat16"
    assert backbone.config == config
    assert config.replace(num_layers=2).num_layers == 2
    with pytest.raises(ValueError, match="num_layers"):
        config.replace(num_layers=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_precision_survives_from_config(family):
    config_class, backbone_class, base = FAMILIES[family]
    backbone = config_class(**base).build(dtype="mixed_bfloat16")
    assert backbone.get_config()["dtype"]["config"]["name"] == "mixed_bfloat16"
    clone = backbone_class.from_config(backbone.get_config())
    assert clone.dtype_policy.name == "mixed_bfloat16"
    policies = {layer.dtype_policy.name for layer in clone.layers if layer.weights}
    assert policies == {"mixed_bfloat16"}, policies


def _preset_files():
    return sorted(glob.glob(os.path.join(ROOT, "kzoo", "presets", "*.json"))
                  + glob.glob(os.path.join(ROOT, "presets", "*.json")))


CONFIG_CLASSES = {family: classes[0] for family, classes in FAMILIES.items()}


def test_every_preset_config_validates():
    files = _preset_files()
    assert len(files) >= 24, files
    for path in files:
        with open(path) as f:
            spec = json.load(f)
        config = CONFIG_CLASSES[spec["family"]].from_dict(spec["config"], source=path)
        for name, value in spec["config"].items():
            got = getattr(config, name)
            assert got == (tuple(value) if isinstance(value, list) else value), (path, name)
    # The same through the public preset API.
    for name in kzoo.presets.list():
        spec = kzoo.presets.info(name)
        CONFIG_CLASSES[spec["family"]].from_dict(spec["config"], source=name)


# (config.json, the kzoo field and the config.json key the error must name)
BAD_HF_CONFIGS = [
    ({"model_type": "gpt2", "n_layer": 0}, "num_layers", "n_layer"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 5}, "num_heads", "n_head"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 3}, "num_kv_heads", "num_key_value_heads"),
    ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 2, "num_local_experts": 2, "num_experts_per_tok": 4},
     "top_k", "num_experts_per_tok"),
    ({"model_type": "bert", "hidden_dropout_prob": 1.5}, "dropout", "hidden_dropout_prob"),
    ({"model_type": "bert", "num_hidden_layers": "twelve"}, "num_layers", "num_hidden_layers"),
    ({"model_type": "t5", "d_kv": 0}, "key_value_dim", "d_kv"),
    ({"model_type": "t5", "relative_attention_num_buckets": 2},
     "relative_attention_num_buckets", "relative_attention_num_buckets"),
    ({"model_type": "vit", "image_size": 30, "patch_size": 8}, "patch_size", "patch_size"),
    ({"model_type": "vit", "qkv_bias": "yes"}, "qkv_bias", "qkv_bias"),
    ({"model_type": "graphormer", "num_hidden_layers": 2, "num_trans_layers_to_freeze": 3},
     "num_frozen_layers", "num_trans_layers_to_freeze"),
    ({"model_type": "graphormer", "embedding_dim": 0}, "hidden_dim", "embedding_dim"),
]


@pytest.mark.parametrize("hf_config, field, hf_key", BAD_HF_CONFIGS,
                         ids=[f"{c['model_type']}-{k}" for c, _, k in BAD_HF_CONFIGS])
def test_bad_hugging_face_config_json_names_field_and_file(hf_config, field, hf_key, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError) as error:
        kzoo.presets.load(str(tmp_path))
    message = str(error.value)
    for expected in (f"`{field}`", f"`{hf_key}`", "config.json"):
        assert expected in message, message
    # Called with the file's path, the converter names that path.
    assert str(tmp_path / "config.json") in message, message
    family = kzoo.registry.for_model_type(hf_config["model_type"])
    path = str(tmp_path / "config.json")
    with pytest.raises(ValueError) as named:
        family.config_from_hf(hf_config, source=path)
    assert path in str(named.value) and f"`{field}`" in str(named.value)


def test_task_arguments_use_the_shared_validators():
    bert = BertBackbone(**FAMILIES["bert"][2])
    vit = ViTBackbone(**FAMILIES["vit"][2])
    cases = [
        (lambda: BertClassifier(bert, num_classes=0), "num_classes", 0),
        (lambda: BertClassifier(bert, num_classes=np.int64(3), dropout=1.0), "dropout", 1.0),
        (lambda: ViTClassifier(vit, pooling="max"), "pooling", "max"),
        (lambda: ViTClassifier(vit, num_classes=2.0), "num_classes", 2.0),
        (lambda: GraphormerPredictor(GraphormerBackbone(**FAMILIES["graphormer"][2]),
                                     num_classes=-1), "num_classes", -1),
    ]
    for build, field, value in cases:
        with pytest.raises(ValueError) as error:
            build()
        _check_message(error.value, field, value)
    for task in (BertMaskedLM, BertClassifier, GPTCausalLM, T5Seq2SeqLM, ViTClassifier,
                 GraphormerPredictor):
        with pytest.raises(ValueError) as error:
            task(bert if task not in (BertMaskedLM, BertClassifier) else vit)
        assert "`backbone`" in str(error.value), task
    classifier = BertClassifier(bert, num_classes=np.int64(3))
    assert type(classifier.get_config()["num_classes"]) is int
