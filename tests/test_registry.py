"""The family registry: one entry a family, lookups by name / model_type / model, and no
second list anywhere (presets and convert read the registry, never each other)."""

import ast
import dataclasses
import importlib
import json
import pathlib

import keras
import numpy as np
import pytest

import kzoo
from kzoo import registry
from kzoo.models import bert, gpt, graphormer, t5, vit

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What each family is, written out here independently of the registry's table.
EXPECTED = {
    "bert": (bert.BertBackbone, {"masked_lm": bert.BertMaskedLM,
                                 "classifier": bert.BertClassifier}, "masked_lm",
             {"bert", "longformer"}),
    "gpt": (gpt.GPTBackbone, {"causal_lm": gpt.GPTCausalLM}, "causal_lm",
            {"gpt2", "llama", "mixtral", "mistral"}),
    "t5": (t5.T5Backbone, {"seq2seq_lm": t5.T5Seq2SeqLM}, "seq2seq_lm", {"t5"}),
    "vit": (vit.ViTBackbone, {"classifier": vit.ViTClassifier}, "classifier", {"vit"}),
    "graphormer": (graphormer.GraphormerBackbone,
                   {"predictor": graphormer.GraphormerPredictor}, "predictor", {"graphormer"}),
}

# One small model a family (preset + backbone overrides), to build every task of it.
SMALL = {
    "bert": ("bert_tiny_uncased", dict(num_layers=1, vocabulary_size=50)),
    "gpt": ("gpt_mini", dict(num_layers=1, hidden_dim=32, num_heads=2, intermediate_dim=64)),
    "t5": ("t5_small", dict(num_layers=1, num_decoder_layers=1, hidden_dim=16, num_heads=2,
                            key_value_dim=8, intermediate_dim=32, vocabulary_size=50)),
    "vit": ("vit_tiny_patch16_224", dict(num_layers=1, image_size=32)),
    "graphormer": ("graphormer_slim", dict(num_layers=1)),
}


def test_every_family_is_registered_once_with_its_classes():
    assert [f.name for f in registry.families()] == list(EXPECTED)
    for name, (backbone, tasks, default, model_types) in EXPECTED.items():
        fam = registry.family(name)
        assert fam.name == name and fam.backbone is backbone
        assert dict(fam.tasks) == tasks
        assert fam.task_names == ("backbone", *tasks)
        assert fam.default_task == default
        assert set(fam.model_types) == model_types
        for model_type in model_types:
            assert registry.for_model_type(model_type) is fam
        # The converter module names the same model types and has the three functions.
        conv = importlib.import_module(f"kzoo.convert.{name}")
        assert set(conv.MODEL_TYPES) == model_types
        assert all(callable(getattr(conv, f)) for f in ("config_from_hf", "load_weights", "to_hf"))
        # Model types read by a module of their own (BERT's "longformer").
        for model_type, module in fam.converters.items():
            assert model_type in model_types and module == f"kzoo.convert.{model_type}"
            conv = importlib.import_module(module)
            assert conv.MODEL_TYPES == (model_type,)
            assert all(callable(getattr(conv, f))
                       for f in ("config_from_hf", "load_weights", "to_hf", "handles"))
    assert dict(registry.family("bert").converters) == {"longformer": "kzoo.convert.longformer"}
    with pytest.raises(TypeError):
        registry.family("gpt").tasks["x"] = None  # the table cannot be edited in place


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError,
                       match=r"Unknown family=.gtp.. Did you mean \[.gpt.*Known families: \[.bert"):
        registry.family("gtp")
    # Case and the hub's "-" for "_" do not hide the name meant (it is named as spelt here).
    for typed, meant in (("GPT_MINI", "gpt_mini"), ("bert-base-uncased", "bert_base_uncased"),
                         ("T5-Small", "t5_small")):
        with pytest.raises(ValueError, match=rf"Unknown preset name='{typed}'. Did you mean "
                                             rf"\['{meant}'"):
            kzoo.presets.load(typed)
    with pytest.raises(ValueError, match=r"model_type='roberta'.*'gpt2'.*'llama'"):
        registry.for_model_type("roberta")
    with pytest.raises(ValueError, match=r"`task` must be one of .*'causal_lm'.*got task='mlm'"):
        registry.family("gpt").task_class("mlm")
    with pytest.raises(ValueError, match=r"`model` must be a backbone or task model.*Sequential"):
        registry.for_model(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match=r"Unknown override num_layerz=2.*num_layers"):
        registry.family("gpt").split_overrides("causal_lm", {"num_layerz": 2})
    with pytest.raises(ValueError, match=r"Unknown gpt config field\(s\) \['depth'\] in 'x.json'"):
        registry.family("gpt").build({"depth": 2}, source="x.json")


def test_a_family_entry_must_agree_with_its_classes():
    with pytest.raises(ValueError, match="GPTBackbone.family must be 'bert'"):
        registry.Family("bert", gpt.GPTBackbone, tasks={}, default_task="backbone")
    with pytest.raises(ValueError, match="task_name='lm'"):
        registry.Family("gpt", gpt.GPTBackbone, tasks={"lm": gpt.GPTCausalLM},
                        default_task="lm")
    with pytest.raises(ValueError, match="default_task='mlm'"):
        registry.Family("gpt", gpt.GPTBackbone, tasks={}, default_task="mlm")


@pytest.mark.spread
@pytest.mark.parametrize("name", list(EXPECTED))
def test_build_describe_and_for_model_round_trip(name):
    fam = registry.family(name)
    preset, overrides = SMALL[name]
    spec = kzoo.presets.info(preset)
    assert spec["family"] == name and preset in fam.presets
    for task in fam.task_names:
        config_over, task_over = fam.split_overrides(task, overrides)
        task_config = {**spec["task_config"], **task_over} if task == spec["task"] else task_over
        model = fam.build({**spec["config"], **config_over}, task=task, task_config=task_config)
        assert isinstance(model, fam.task_class(task))
        assert registry.for_model(model) is fam and fam.task_of(model) == task
        described_task, config, described_task_config = fam.describe(model)
        assert described_task == task
        backbone = model if task == "backbone" else model.backbone
        # The described config is the backbone's Keras config less Keras' own entries ...
        keras_config = backbone.get_config()
        assert config == {k: v for k, v in keras_config.items()
                          if k not in ("name", "trainable", "dtype")}
        assert set(config) == set(fam.config_fields)
        assert config["num_layers"] == 1
        # ... and rebuilds a model with the same number of weights of the same shapes.
        again = fam.build(config, task=task, task_config=described_task_config)
        assert [tuple(w.shape) for w in again.weights] == [tuple(w.shape) for w in model.weights]


def test_config_fields_follow_the_config_class_when_the_backbone_has_one():
    for fam in registry.families():
        config_class = getattr(fam.backbone, "config_class", None)
        assert fam.config_class is config_class
        if config_class is not None:
            assert fam.config_fields == tuple(f.name for f in dataclasses.fields(config_class))


def test_presets_of_the_families_are_exactly_the_preset_files():
    by_family = {}
    for path in sorted((ROOT / "presets").glob("*.json")):
        by_family.setdefault(json.loads(path.read_text())["family"], []).append(path.stem)
    assert {f.name: list(f.presets) for f in registry.families()} == by_family
    assert sorted(n for f in registry.families() for n in f.presets) == kzoo.presets.list()


def test_build_with_a_dtype_policy():
    fam = registry.family("gpt")
    preset, overrides = SMALL["gpt"]
    model = fam.build({**kzoo.presets.info(preset)["config"], **overrides}, dtype="bfloat16")
    assert all(w.dtype == "bfloat16" for w in model.backbone.weights)
    ids = np.ones((1, 4), "int32")
    assert tuple(model({"token_ids": ids, "padding_mask": ids}).shape) == (1, 4, 260)


def _imports(path):
    """Every module a file imports, at top level or inside functions."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_presets_and_convert_do_not_import_each_other():
    presets_imports = _imports(ROOT / "kzoo" / "presets.py")
    assert not {m for m in presets_imports if m.startswith("kzoo.convert")}, presets_imports
    for path in (ROOT / "kzoo" / "convert").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("kzoo.presets")}, path
    # Neither does the registry import them (the converter modules are named, imported on use).
    assert not {m for m in _imports(ROOT / "kzoo" / "registry.py")
                if m.startswith(("kzoo.presets", "kzoo.convert"))}


def test_no_second_family_table():
    """The old registration tables and per-module constants are gone."""
    for path in [*(ROOT / "kzoo").rglob("*.py"), *(ROOT / "training").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        names = {t.id for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        stale = names & {"FAMILY_MODULES", "CONVERTER_MODULES", "FAMILY_CONVERTERS", "BACKBONE",
                         "TASKS", "DEFAULT_TASK"}
        assert not stale, (path, stale)
