"""QLoRA-style saves: a model quantized to int8 / int4 with LoRA adapters saves
(`model.save`, `kzoo.presets.save`) and loads (`keras.saving.load_model`,
`kzoo.presets.load`) with its integer kernels and scales unchanged and its adapters kept
apart, trainable, the rest frozen (see `kzoo.lora`).

References: one adapted layer against `x @ dequantized W + (alpha / rank) x A B` written
here in NumPy (int8: with Keras' per-row abs-max activation quantization; int4: unpacked
nibbles, per-group zero points and scales), before and after the round trip; the reloaded
models against the saved model's own outputs and variables, byte for byte; a training step
of the reloaded `.keras` model against the same step of the saved one.
"""

import json
import os

import keras
import numpy as np
import pytest

import kzoo
from tests.harness import to_numpy
from tests.test_quantize import build_model, model_inputs, run

TARGETS = ("query", "value")


def _model(family):
    """test_quantize's tiny GPT; its BERT without dropout (a training step of the reloaded
    model is compared with the saved model's)."""
    if family == "bert":
        from kzoo.models.bert import BertBackbone, BertMaskedLM

        keras.utils.set_random_seed(0)
        return BertMaskedLM(BertBackbone(
            vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
            max_sequence_length=16, num_segments=2, dropout=0.0))
    return build_model(family)


def _targets(x):
    """Next-token targets (GPT) / the tokens themselves (BERT's masked LM)."""
    return np.roll(x["token_ids"], -1, axis=1)


def _unpack_int4(packed, units):
    """`(in, ceil(units / 2))` int8 bytes -> `(in, units)` signed nibbles: the low nibble
    holds the even column, the high one the odd column."""
    packed = packed.astype(np.int8)
    low = (packed << 4).astype(np.int8) >> 4  # (arithmetic shifts: sign-extended)
    high = packed >> 4
    both = np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)
    return both[:, :units].astype(np.float64)


def _reference(arrays, mode, x, alpha, rank):
    """The adapted quantized Dense (no activation: an attention projection) on `x`, in NumPy
    from its saved arrays."""
    x = x.astype(np.float64)
    a, b = arrays["lora_kernel_a"].astype(np.float64), arrays["lora_kernel_b"].astype(np.float64)
    scale = arrays["kernel_scale"].astype(np.float64)
    if mode == "int8":  # activations quantized per row (abs-max), weights per column
        x_scale = 127.0 / (np.abs(x).max(-1, keepdims=True) + 1e-7)
        x_q = np.clip(np.round(x * x_scale), -127, 127)
        base = (x_q @ arrays["kernel"].astype(np.float64)) / (x_scale * scale)
    else:  # int4 by groups of inputs: (q - zero[g]) * scale[g]; float activations
        q = _unpack_int4(arrays["kernel"], scale.shape[-1])
        groups = arrays["g_idx"].astype(np.int64)
        w = (q - arrays["kernel_zero"].astype(np.float64)[groups]) * scale[groups]
        base = x @ w
    bias = arrays["bias"].astype(np.float64) if "bias" in arrays else 0.0
    return base + (alpha / rank) * (x @ a @ b) + bias


def _layer_arrays(layer):
    return {name: to_numpy(getattr(layer, "_kernel" if name == "kernel" else name))
            for name in ("kernel", "bias", "kernel_scale", "kernel_zero", "g_idx",
                         "lora_kernel_a", "lora_kernel_b")
            if getattr(layer, "_kernel" if name == "kernel" else name, None) is not None}


def _check_layer_against_numpy(model, path, arrays, mode):
    layer = {layer.path: layer for layer in kzoo.lora.lora_layers(model)}[path]
    assert layer.quantization_mode == mode and layer.activation in (None, keras.activations.linear)
    x = np.random.default_rng(3).normal(size=(5, arrays["lora_kernel_a"].shape[0]))
    expected = _reference(arrays, mode, x, alpha=4.0, rank=2)
    np.testing.assert_allclose(to_numpy(layer(x.astype("float32"))), expected,
                               rtol=1e-4, atol=1e-5)


def _values(model):
    return {v.path: to_numpy(v) for v in model.weights}


def _check_same_model(again, model, saved, out, x):
    """`again` (reloaded) is `model` as it was saved: outputs, every variable, adapters
    trainable and nothing else."""
    np.testing.assert_array_equal(run(again, x), out)
    assert kzoo.lora.lora_settings(again) == {"rank": 2, "alpha": 4.0, "targets": list(TARGETS)}
    assert kzoo.quantize.quantization_map(again) == kzoo.quantize.quantization_map(model)
    got = _values(again)
    assert sorted(got) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    trainable = sorted(v.path for v in again.trainable_weights)
    assert trainable == sorted(v.path for v in model.trainable_weights)
    assert trainable and all("lora_kernel" in name for name in trainable)


def _step_changes_only_adapters(model, x, fit=False):
    """One training step (`fit` of one batch, or `train_on_batch`: the same step, without
    fit's per-call setup) moves the adapters and nothing else."""
    before = _values(model)
    y = _targets(x)
    if fit:
        model.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
    else:
        model.train_on_batch(x, y)
    after = _values(model)
    changed = sorted(name for name in before if not np.array_equal(before[name], after[name]))
    assert changed and all("lora_kernel" in name for name in changed), changed
    assert any("lora_kernel_a" in name for name in changed)  # (B is nonzero: A moves too)


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "bert"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_with_adapters_saves_loads_and_keeps_training(mode, family, tmp_path):
    model = _model(family)
    x = model_inputs(family)
    model.quantize(mode)
    integer = {v.path: to_numpy(v) for v in model.weights if "kernel" in v.path}
    model.enable_lora(2, targets=TARGETS, alpha=4)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.train_on_batch(x, _targets(x))  # B leaves zero
    layers = kzoo.lora.lora_layers(model)
    assert all(np.abs(to_numpy(layer.lora_kernel_b)).max() > 0 for layer in layers)
    out, saved = run(model, x), _values(model)
    for name, value in integer.items():  # training moved nothing but the adapters
        np.testing.assert_array_equal(saved[name], value)
    probe = layers[0].path
    arrays = _layer_arrays(layers[0])
    _check_layer_against_numpy(model, probe, arrays, mode)

    keras_path = str(tmp_path / "m.keras")
    model.save(keras_path)
    preset = str(tmp_path / "preset")
    kzoo.presets.save(model, preset)
    with open(os.path.join(preset, "kzoo_config.json")) as f:
        assert json.load(f)["lora"] == {"rank": 2, "alpha": 4.0, "targets": list(TARGETS)}

    from_keras = keras.saving.load_model(keras_path)
    from_preset = kzoo.presets.load(preset)
    for again in (from_keras, from_preset):
        _check_same_model(again, model, saved, out, x)
        _check_layer_against_numpy(again, probe, arrays, mode)

    # `.keras` holds the optimizer state of the adapters: the next step is the saved
    # model's next step.
    assert int(to_numpy(from_keras.optimizer.iterations)) == 1
    _step_changes_only_adapters(from_keras, x)
    model.train_on_batch(x, _targets(x))
    for got, want in zip(from_keras.weights, model.weights):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=0, atol=1e-6,
                                   err_msg=got.path)
    # A preset directory holds weights only: compiled anew, it trains the adapters alone.
    from_preset.compile(optimizer=keras.optimizers.Adam(1e-2))
    _step_changes_only_adapters(from_preset, x, fit=True)


@pytest.mark.spread
def test_config_weights_files_and_merge_of_a_quantized_model_with_adapters(tmp_path):
    model = build_model("gpt")
    x = model_inputs("gpt")
    model.quantize("int4")
    model.enable_lora(2, targets=TARGETS, alpha=4)
    rng = np.random.default_rng(0)
    for layer in kzoo.lora.lora_layers(model):
        layer.lora_kernel_b.assign(rng.normal(0, 0.5, layer.lora_kernel_b.shape))
    out, saved = run(model, x), _values(model)
    # The config records the settings; `from_config` gives the adapters back (zeros until
    # loaded), on the quantized layers.
    config = model.get_config()
    assert config["lora"] == {"rank": 2, "alpha": 4.0, "targets": list(TARGETS)}
    clone = type(model).from_config(config)
    assert [v.path for v in clone.trainable_weights] == \
        [v.path for v in model.trainable_weights]
    # `save_weights` / `load_weights` keep them too.
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    clone.load_weights(path)
    _check_same_model(clone, model, saved, out, x)
    # The quantized model saved before `enable_lora` loads into a model with adapters
    # as Keras' Dense does: the adapters zeroed, the outputs the saved model's.
    plain = build_model("gpt")
    plain.quantize("int4")
    plain_path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_path)
    clone.load_weights(plain_path)
    np.testing.assert_array_equal(run(clone, x), run(plain, x))
    assert all(not np.any(to_numpy(layer.lora_kernel_b))
               for layer in kzoo.lora.lora_layers(clone))
    # A saved directory with adapters loads with its own task only.
    preset = str(tmp_path / "preset")
    kzoo.presets.save(model, preset)
    with pytest.raises(ValueError, match=r"LoRA adapters on quantized layers .*task='backbone'"):
        kzoo.presets.load(preset, task="backbone")
    # `merge_lora` still folds and requantizes: saved, the merged model has no adapters
    # and its own (moved) outputs.
    model.merge_lora()
    assert "lora" not in model.get_config()
    merged_out = run(model, x)
    assert not np.array_equal(merged_out, out)
    model.save(str(tmp_path / "merged.keras"))
    merged = keras.saving.load_model(str(tmp_path / "merged.keras"))
    assert not kzoo.lora.lora_layers(merged)
    np.testing.assert_array_equal(run(merged, x), merged_out)
