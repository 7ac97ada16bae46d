"""The model card (README.md) that `kzoo.presets.save` writes in every saved directory, in
both formats: family, task, configuration, parameter count, dtype / quantization,
versions, how to load, metrics when given; bad metrics refused."""

import os
import re

import keras
import numpy as np
import pytest

import kzoo
from tests.test_export import hf_gpt
from tests.test_quantize import build_model


def hf_inputs():
    ids = np.arange(12, dtype="int32").reshape(2, 6) % 40
    return {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}


def read_card(directory):
    with open(os.path.join(directory, "README.md"), encoding="utf-8") as f:
        return f.read()


def table(card, section):
    """`{first column: second column}` of the markdown table under `## section`."""
    part = card.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in part.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): cells[1].strip() for cells in rows[1:]}


@pytest.mark.parametrize("format", ["kzoo", "hf", "keras_hub"])
def test_card_in_every_saved_directory(format, tmp_path):  # noqa: A002
    model = hf_gpt()
    path = str(tmp_path / format)
    kzoo.presets.save(model, path, format=format, metrics={"val_loss": 2.5, "accuracy": 0.75})
    card = read_card(path)
    library = "transformers" if format == "hf" else "keras"
    assert card.startswith(f"---\nlibrary_name: {library}\ntags: [kzoo, keras, gpt, causal_lm]")
    params = sum(int(np.prod(v.shape)) for v in model.weights)
    assert f"| parameters | {params:,} |" in card
    assert "| family | gpt |" in card and "| task | causal_lm |" in card
    assert "| dtype | float32 |" in card and "| quantization | none |" in card
    assert f"| keras | {keras.__version__} ({keras.backend.backend()} backend) |" in card
    config = table(card, "Configuration")
    backbone = model.backbone.get_config()
    for field in ("num_layers", "hidden_dim", "num_heads", "vocabulary_size", "norm", "position"):
        assert config[field] == f"`{backbone[field]}`", field
    assert table(card, "Metrics") == {"val_loss": "2.5", "accuracy": "0.75"}
    assert 'kzoo.presets.load("path/to/this/directory")' in card
    assert ("AutoModel.from_pretrained" in card) == (format == "hf")
    assert ("keras_hub.models.Backbone.from_preset" in card) == (format == "keras_hub")
    # the card is no obstacle to loading the directory back
    again = kzoo.presets.load(path)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(again(hf_inputs())),
        keras.ops.convert_to_numpy(model(hf_inputs())), atol=1e-5, rtol=1e-5)
    if format == "kzoo":  # the metrics are kept with the config too
        meta = kzoo.checkpoints.read_json(os.path.join(path, "kzoo_config.json"))
        assert meta["metrics"] == {"val_loss": 2.5, "accuracy": 0.75}


@pytest.mark.spread
def test_card_without_metrics_and_quantized(tmp_path):
    model = build_model("gpt")
    model.quantize("int8")
    quantized = len(kzoo.quantize.quantization_map(model))
    assert quantized > 0
    kzoo.presets.save(model, str(tmp_path))
    card = read_card(str(tmp_path))
    assert "## Metrics" not in card
    assert f"| quantization | int8 ({quantized} layers) |" in card


def test_card_of_a_backbone_and_other_families(tmp_path):
    model = build_model("vit")
    kzoo.presets.save(model.backbone, str(tmp_path / "b"))
    card = read_card(str(tmp_path / "b"))
    assert "| family | vit |" in card and "| task | backbone |" in card
    assert table(card, "Configuration")["image_size"] == "`16`"


def test_card_metrics_are_checked(tmp_path):
    model = build_model("gpt")
    with pytest.raises(ValueError, match=re.escape("`metrics['acc']` must be a number; got 'high'")):
        kzoo.presets.save(model, str(tmp_path), metrics={"acc": "high"})
    with pytest.raises(TypeError, match=r"metrics=\[0.5\]"):
        kzoo.presets.save(model, str(tmp_path), metrics=[0.5])
    with pytest.raises(ValueError, match="must be a number; got nan"):
        kzoo.presets.save(model, str(tmp_path), metrics={"loss": float("nan")})
    path = kzoo.presets.write_model_card(model, str(tmp_path), metrics={"loss": np.float32(1.25),
                                                                       "bleu": None})
    assert table(read_card(str(tmp_path)), "Metrics") == {"loss": "1.25", "bleu": "n/a"}
    assert path == os.path.join(str(tmp_path), "README.md")
