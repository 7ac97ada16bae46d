"""Post-training quantization of every family (`model.quantize`, `kzoo.quantize`).

References: an int8 Dense against the abs-max formula written here in NumPy (weights per
output channel, activations per row); whole models against their float outputs (relative
error bounds measured on these tiny models, with margin); round trips against the
quantized model itself (identical outputs after `.keras` and preset save/load).
"""

import warnings

import keras
import numpy as np
import pytest

import kzoo
from kzoo import graphs
from kzoo.models.bert import BertBackbone, BertMaskedLM
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM
from kzoo.models.vit import ViTBackbone, ViTClassifier
from tests.harness import forward, to_numpy

FAMILIES = ("gpt", "bert", "t5", "vit", "graphormer")


def family_params(default):
    """The families as test parameters: `default` in the default suite, the others behind
    `-m slow` (every family runs every check there)."""
    return [family if family in default else pytest.param(family, marks=pytest.mark.slow)
            for family in FAMILIES]


# Per-family quantization checks: GPT by default (T5 is covered by the config round trip).
FAMILY_PARAMS = family_params(("gpt",))


def build_model(family):
    """A tiny task model of `family` (seeded), exercising the layers each family adds;
    kernels initialised to zeros (the ViT head) get seeded noise, so outputs are not 0."""
    model = _build_model(family)
    r = np.random.default_rng(1)
    for v in model.weights:
        if v.path.endswith("kernel") and not np.any(to_numpy(v)):
            v.assign(r.normal(0, 0.3, v.shape).astype("float32"))
    return model


def _build_model(family):
    keras.utils.set_random_seed(0)
    if family == "gpt":  # plain feed-forward, rotary, GQA, untied head
        return GPTCausalLM(GPTBackbone(
            vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
            max_sequence_length=16, norm="rmsnorm", position="rotary", feedforward="plain",
            activation="silu", num_kv_heads=1, use_bias=False, tie_embeddings=False,
            initializer_range=0.3, dropout=0.0))
    if family == "bert":  # plain feed-forward, segment Embedding, pooler, MLM transform
        return BertMaskedLM(BertBackbone(
            vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
            max_sequence_length=16, num_segments=2))
    if family == "t5":  # encoder-decoder, cross-attention, gated, untied lm_head
        return T5Seq2SeqLM(T5Backbone(
            vocabulary_size=40, num_layers=1, num_decoder_layers=1, num_heads=2,
            hidden_dim=16, key_value_dim=8, intermediate_dim=24, dropout=0.0,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feedforward="gated-gelu", tie_embeddings=False))
    if family == "vit":
        return ViTClassifier(ViTBackbone(
            image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=24), num_classes=3)
    if family == "graphormer":
        return GraphormerPredictor(GraphormerBackbone(
            num_layers=1, hidden_dim=16, intermediate_dim=24, num_heads=2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0), num_classes=1)
    raise AssertionError(family)


def model_inputs(family, seed=0):
    r = np.random.default_rng(seed)
    if family == "gpt":
        return {"token_ids": r.integers(1, 40, (2, 8)).astype("int32"),
                "padding_mask": np.ones((2, 8), "int32")}
    if family == "bert":
        mask = np.ones((2, 8), "int32")
        mask[1, 5:] = 0
        return {"token_ids": (r.integers(1, 40, (2, 8)) * mask).astype("int32"),
                "segment_ids": np.zeros((2, 8), "int32"), "padding_mask": mask}
    if family == "t5":
        return {"encoder_token_ids": r.integers(2, 40, (2, 7)).astype("int32"),
                "encoder_padding_mask": np.ones((2, 7), "int32"),
                "decoder_token_ids": r.integers(2, 40, (2, 5)).astype("int32"),
                "decoder_padding_mask": np.ones((2, 5), "int32")}
    if family == "vit":
        return r.normal(size=(2, 16, 16, 3)).astype("float32")
    if family == "graphormer":
        x = graphs.batch([graphs.from_smiles(s) for s in ("CCO", "c1ccccc1")])
        x.pop("labels", None)
        return x
    raise AssertionError(family)


def run(model, x):
    return to_numpy(forward(model, x)).astype(np.float64)


def relative_error(actual, expected):
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


class _Lazy(dict):
    """family -> value, built on first use (a deselected family is never built)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, family):
        self[family] = self.make(family)
        return self[family]


@pytest.fixture(scope="module")
def int8_models():
    """family -> (float outputs, int8 model, inputs)."""
    def make(family):
        model = build_model(family)
        x = model_inputs(family)
        expected = run(model, x)
        model.quantize("int8")
        return expected, model, x

    return _Lazy(make)


def _dense_layers(model):
    return [layer for layer in model._flatten_layers() if type(layer) is keras.layers.Dense]


# === Bad arguments ===


@pytest.mark.spread
def test_bad_modes_and_calls_are_refused():
    model = build_model("vit")
    for mode in ("int3", None, "gptq"):
        with pytest.raises(ValueError, match=r"`mode` must be one of \['int8', 'int4', "
                                             r"'float8'\]; got mode="):
            model.quantize(mode)
    with pytest.raises(ValueError, match="config"):
        model.quantize("int8", config=object())
    assert kzoo.quantize.quantization_map(model) == {}
    model.enable_lora(2)
    with pytest.raises(ValueError, match="merge_lora"):
        model.quantize("int8")
    model.merge_lora()
    model.quantize("int4")
    with pytest.raises(ValueError, match="no float"):
        model.quantize("int8")


def test_int8_on_a_float16_model_is_refused_with_what_to_do_instead():
    """Keras refuses int8 in float16 with "doesn't work well with compute_dtype='float16'.
    Consider ... 'mixed_float16'" (the policy the model has). kzoo names the mode, the
    model's policy and what works: another dtype, or int4 / float8, which do run there."""
    x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype("float32")
    keras.config.set_dtype_policy("mixed_float16")
    try:
        half = build_model("vit")
    finally:
        keras.config.set_dtype_policy("float32")
    half(x)
    with pytest.raises(ValueError) as error:
        half.quantize("int8")
    message = str(error.value)
    for needle in ("mode='int8'", "'mixed_float16'", "mixed_bfloat16", "int4", "float8"):
        assert needle in message, message
    assert "Consider" not in message
    assert kzoo.quantize.quantization_map(half) == {}  # nothing was changed
    half.quantize("int4")  # (runs in float16)
    assert np.isfinite(to_numpy(keras.ops.cast(half(x), "float32"))).all()


# === Which layers ===


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_every_dense_is_quantized_and_the_rest_stays_float(int8_models, family):
    expected, model, x = int8_models[family]
    mapping = kzoo.quantize.quantization_map(model)
    dense = [layer for layer in _dense_layers(model) if layer.name != "router"]
    assert dense and all(layer.path in mapping for layer in dense)
    assert all(name.startswith("int8_from_") for name in mapping.values())
    for layer in dense:
        assert keras.backend.standardize_dtype(layer._kernel.dtype) == "int8"
    # Documented as kept in float: token tables, norms.
    for layer in model._flatten_layers():
        if isinstance(layer, kzoo.layers.embedding.TokenEmbedding):
            assert layer.quantization_mode is None
            assert keras.backend.standardize_dtype(layer.embeddings.dtype) == "float32"
    # Close to float: relative error of the outputs (measured <= 2% on these models).
    assert relative_error(run(model, x), expected) < 0.05


def test_int8_dense_matches_the_abs_max_formula(int8_models):
    _, model, _ = int8_models["gpt"]
    layer = _dense_layers(model)[-1]
    float_model = build_model("gpt")  # same seed: the float kernel before quantization
    twin = {lay.path: lay for lay in _dense_layers(float_model)}[layer.path]
    w = to_numpy(twin.kernel).astype(np.float64)
    b = 0.0 if twin.bias is None else to_numpy(twin.bias).astype(np.float64)
    x = np.random.default_rng(3).normal(size=(5, w.shape[0])).astype("float32")
    eps = 1e-7
    w_scale = 127.0 / (np.abs(w).max(0, keepdims=True) + eps)
    w_q = np.clip(np.round(w * w_scale), -127, 127)
    x64 = x.astype(np.float64)
    x_scale = 127.0 / (np.abs(x64).max(-1, keepdims=True) + eps)
    x_q = np.clip(np.round(x64 * x_scale), -127, 127)
    reference = (x_q @ w_q) / (x_scale * w_scale) + b
    np.testing.assert_allclose(to_numpy(layer(x)), reference, rtol=1e-4, atol=1e-5)
    assert relative_error(reference, x64 @ w + b) < 0.05  # and the formula is close to float


# === Save / load ===


@pytest.mark.spread
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_int8_keras_file_and_preset_round_trip(int8_models, family, tmp_path):
    _, model, x = int8_models[family]
    ours = run(model, x)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = kzoo.presets.load(path)
    assert kzoo.quantize.quantization_map(loaded) == kzoo.quantize.quantization_map(model)
    np.testing.assert_array_equal(run(loaded, x), ours)
    if family in ("gpt", "vit"):  # the preset directory (same code path for every family)
        kzoo.presets.save(model, str(tmp_path / "preset"))
        again = kzoo.presets.load(str(tmp_path / "preset"))
        assert kzoo.quantize.quantization_map(again) == kzoo.quantize.quantization_map(model)
        np.testing.assert_array_equal(run(again, x), ours)


@pytest.mark.spread
@pytest.mark.parametrize("format", ["hf", "keras_hub"])
def test_quantized_models_are_not_written_as_float_checkpoints(int8_models, format, tmp_path):
    # transformers' and keras-hub's files hold float kernels: the int8 codes (up to 127)
    # were written as weights, and transformers computed another model, in silence.
    _, model, _ = int8_models["gpt"]
    target = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"`format='{format}'` writes float weights, and "
                                         r"this model is quantized \(int8: \d+ layers"):
        kzoo.presets.save(model, str(target), format=format)
    assert not target.exists()  # (refused before anything is written)


@pytest.mark.spread
def test_config_round_trip_keeps_the_quantized_policies(int8_models):
    _, model, x = int8_models["t5"]
    config = model.get_config()
    assert config["dtype"]["class_name"] == "DTypePolicyMap"
    clone = type(model).from_config(config)
    assert kzoo.quantize.quantization_map(clone) == kzoo.quantize.quantization_map(model)
    clone.set_weights(model.get_weights())
    np.testing.assert_array_equal(run(clone, x), run(model, x))


@pytest.mark.spread
@pytest.mark.parametrize("mode,bound", [
    ("int4", 0.5), pytest.param("float8", 0.3, marks=pytest.mark.slow)])
def test_int4_and_float8_close_to_float_and_round_trip(mode, bound, tmp_path):
    model = build_model("gpt")
    x = model_inputs("gpt")
    expected = run(model, x)
    model.quantize(mode)
    ours = run(model, x)
    assert relative_error(ours, expected) < bound
    assert not np.array_equal(ours, expected)
    kzoo.presets.save(model, str(tmp_path / "preset"))
    again = kzoo.presets.load(str(tmp_path / "preset"))
    names = set(kzoo.quantize.quantization_map(again).values())
    assert names == set(kzoo.quantize.quantization_map(model).values())
    assert {keras.dtype_policies.get(name).quantization_mode for name in names} == {mode}
    np.testing.assert_array_equal(run(again, x), ours)


# === Generation ===


def compiled_generation():
    """`compile=` for `generate` in these tests: on JAX compiled (eager JAX compiles every
    op), elsewhere eager (a tiny model's few steps are faster than the tracing)."""
    return keras.backend.backend() == "jax"


def test_quantized_gpt_generates_its_greedy_argmax(int8_models):
    _, gpt, _ = int8_models["gpt"]
    prompt = np.array([[3, 4, 5], [9, 8, 7]], "int32")
    tokens = np.asarray(gpt.generate(prompt, max_new_tokens=4, compile=compiled_generation()))
    assert tokens.shape == (2, 4)
    # Greedy decoding with the cache (the torch fast path steps aside for quantized Dense)
    # equals the argmax of one causal forward pass over prompt + generated tokens.
    seq = np.concatenate([prompt, tokens], 1).astype("int32")
    logits = run(gpt, {"token_ids": seq, "padding_mask": np.ones_like(seq)})
    np.testing.assert_array_equal(logits[:, 2:-1].argmax(-1), tokens)


@pytest.mark.slow
def test_quantized_t5_generates_its_greedy_argmax(int8_models):
    _, t5, _ = int8_models["t5"]
    encoder = np.array([[5, 6, 7, 8]], "int32")
    tokens = np.asarray(t5.generate(encoder, max_new_tokens=3, stop_token_ids=(),
                                    compile=compiled_generation())).reshape(1, -1)[:, -3:]
    decoder = np.concatenate([[[0]], tokens], 1).astype("int32")  # start token 0
    logits = run(t5, {"encoder_token_ids": encoder, "encoder_padding_mask": np.ones_like(encoder),
                      "decoder_token_ids": decoder, "decoder_padding_mask": np.ones_like(decoder)})
    np.testing.assert_array_equal(logits[:, :-1].argmax(-1), tokens)
