"""A randomized parity sweep of the keras-hub converter (`kzoo/convert/keras_hub.py`) against
keras-hub itself.

keras-hub -> kzoo: hypothesis draws small keras-hub models over every field the converter
says it reads, builds them from keras-hub's classes (no download), sets every weight to a
seeded random value (keras-hub starts biases at 0 and norm scales at 1, which would hide a
swapped or dropped bias or scale), writes them with `save_to_preset`, loads the directory with
`kzoo.presets.load` and compares kzoo's float32 outputs with keras-hub's own
(`assert_allclose`, atol = rtol = 1e-5) on drawn batches, lengths and padding masks.

kzoo -> keras-hub: a drawn, randomised kzoo model written with
`kzoo.presets.save(model, dir, format="keras_hub")` is loaded with keras-hub's
`<Class>.from_preset(dir)` (the task class and the backbone class) and compared the same way.

Drawn option space:
- `BertBackbone` / `BertTextClassifier`: vocabulary_size, num_layers 1-3, num_heads 1-4,
  hidden_dim = heads * head_dim, intermediate_dim, max_sequence_length (sequences up to it),
  num_segments 1-3 (segment ids using all of them), dropout; the classifier's num_classes,
  dropout and activation None / "linear". kzoo side: the three tanh-GELU names.
- `GPT2Backbone` / `GPT2CausalLM`: the same sizes (no segments).
- `ViTBackbone` / `ViTImageClassifier`: square and rectangular image_shape and patch_size
  (an int or a pair), 1 or 3 channels, num_layers, num_heads, hidden_dim, mlp_dim,
  layer_norm_epsilon, use_class_token, use_mha_bias, use_mlp_bias, use_patch_bias,
  dropout_rate, attention_dropout; the classifier's num_classes, dropout, activation and
  pooling ("token" with a class token, "gap" without).
- Padding: full rows, right-, left- and scattered padding (at least one real token a row).

Per-token outputs are compared at the real tokens (`padding_mask` 1). keras-hub and kzoo give
the same values at the padded positions too (measured: below 1e-6 on JAX and torch), but that
is no contract of either. Per-sequence outputs (BERT's pooled output and classifier logits,
which read the first token) are compared on every row: the drawn BERT masks keep the first
token ([CLS]) real.

What the converter refuses (its module docstring) is drawn too, on both sides, and must raise
a `ValueError` naming the field, writing nothing when saving.

Examples are derandomized (the same cases every run); `KZOO_SWEEP_EXAMPLES=n` multiplies the
number of examples of each sweep by n for a longer search.

The sweeps (mark `sweep`) run on torch by default and on JAX and TensorFlow too with
`make test-all` (tests/conftest.py).
"""

import json
import os
import shutil
import tempfile
import warnings

import keras
import keras_hub
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kzoo
from kzoo.convert import keras_hub as hub_convert
from tests.harness import to_numpy

ATOL = RTOL = 1e-5
BACKEND = keras.backend.backend()
_MORE = int(os.environ.get("KZOO_SWEEP_EXAMPLES", "1"))
# keras-hub's three tanh-GELU spellings kzoo writes as keras-hub's BERT / GPT-2 activation.
TANH_GELUS = ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch on one thread while this file runs (then as it was): these matrices are tiny, and
    on this 2-core machine under load torch's second thread only costs (see
    test_parity_sweep_t5_vit)."""
    if BACKEND != "torch":
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sweep(examples, jax_examples=1):
    """Hypothesis settings of a sweep: `examples` cases on torch and TensorFlow,
    `jax_examples` on JAX (times KZOO_SWEEP_EXAMPLES), reproducible, no deadline. JAX
    compiles the initializers and eager ops of each new shape: a drawn model costs it ~5 s on
    this machine, against ~0.3 s on torch. The draws are derandomized: JAX's are the first of
    the others'."""
    if BACKEND == "jax":
        examples = min(examples, jax_examples)
    return settings(max_examples=examples * _MORE, deadline=None, derandomize=True,
                    print_blob=True, suppress_health_check=list(HealthCheck))


def _first_then(first, *others):
    """`first`, or one of `others`: hypothesis' first (simplest) example takes `first`."""
    return st.sampled_from((first,) + others)


def _preset_dir(tmp_path):
    """A fresh directory under pytest's tmp_path for one hypothesis example."""
    return os.path.join(tempfile.mkdtemp(dir=tmp_path), "preset")


def _randomise(model, seed):
    """Every float weight of `model` (keras-hub's or kzoo's) set from a seeded NumPy rng:
    normal(0, 0.2), norm scales 1 + normal(0, 0.2), so no bias is 0 and no scale 1. (Integer
    variables, e.g. dropout seed states, are left alone.)"""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        if not str(variable.dtype).startswith(("float", "bfloat")):
            continue
        value = rng.normal(0.0, 0.2, tuple(variable.shape))
        if variable.path.endswith(("gamma", "/scale")):
            value += 1.0
        variable.assign(value.astype("float32"))
    return model


def _assert_close(ours, theirs, label, mask=None):
    """`ours` and `theirs` (arrays or dicts of arrays) agree to atol = rtol = 1e-5; a
    `(batch, seq)` mask selects the real tokens of per-token outputs."""
    if isinstance(theirs, dict):
        assert sorted(ours) == sorted(theirs), (label, sorted(ours), sorted(theirs))
        for key in theirs:
            _assert_close(ours[key], theirs[key], f"{label} [{key}]",
                          mask if key == "sequence_output" else None)
        return
    ours = np.asarray(to_numpy(ours), np.float64)
    theirs = np.asarray(to_numpy(theirs), np.float64)
    assert ours.shape == theirs.shape, (label, ours.shape, theirs.shape)
    assert np.all(np.isfinite(theirs)), label
    if mask is not None:
        assert ours.shape[:2] == mask.shape, (label, ours.shape, mask.shape)
        real = np.asarray(mask).astype(bool)
        ours, theirs = ours[real], theirs[real]
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=RTOL, err_msg=label)


# === Inputs ===


@st.composite
def padding_masks(draw, batch, seq, first_real=False):
    """A `(batch, seq)` 0/1 mask with a real token in every row: full, right-, left- or
    scattered padding (`first_real`: the first token of each row is real)."""
    kind = draw(_first_then("right", "full", "left", "scattered"), label="padding")
    if kind == "full":
        return np.ones((batch, seq), "int32")
    if kind == "scattered":
        mask = np.asarray(draw(st.lists(st.booleans(), min_size=batch * seq,
                                        max_size=batch * seq))).reshape(batch, seq)
        for row in mask:
            row[draw(st.integers(0, seq - 1))] = True
    else:
        lengths = [seq] + [draw(st.integers(1, seq)) for _ in range(batch - 1)]
        mask = np.arange(seq)[None, :] < np.asarray(lengths)[:, None]
        if kind == "left":
            mask = mask[:, ::-1]
    mask = mask.astype("int32")
    if first_real:
        mask[:, 0] = 1
    return mask


@st.composite
def token_inputs(draw, vocab, max_len, num_segments=None):
    """kzoo's and keras-hub's token inputs (the same dict): ids, padding mask and, for BERT
    (`num_segments`), segment ids covering every segment the table has."""
    batch = draw(_first_then(2, 1, 3), label="batch")
    seq = draw(st.one_of(st.just(max_len), st.integers(1, max_len)), label="seq")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="input seed"))
    mask = draw(padding_masks(batch, seq, first_real=num_segments is not None))
    inputs = {"token_ids": rng.integers(0, vocab, (batch, seq)).astype("int32"),
              "padding_mask": mask}
    if num_segments is not None:
        segments = rng.integers(0, num_segments, (batch, seq))
        segments[0, -1] = num_segments - 1  # the last segment is used (row 0's last token)
        inputs["segment_ids"] = segments.astype("int32")
    return inputs


def _images(seed, batch, height, width, channels):
    return np.random.default_rng(seed).normal(
        size=(batch, height, width, channels)).astype("float32")


# === keras-hub -> kzoo ===


@st.composite
def text_sizes(draw):
    """The sizes BertBackbone and GPT2Backbone share."""
    heads = draw(_first_then(2, 1, 3, 4), label="num_heads")
    return dict(
        vocabulary_size=draw(st.integers(16, 80), label="vocabulary_size"),
        num_layers=draw(_first_then(2, 1, 3), label="num_layers"),
        num_heads=heads,
        hidden_dim=heads * draw(_first_then(4, 2, 8), label="head_dim"),
        intermediate_dim=draw(st.one_of(st.just(16), st.integers(3, 40)),
                              label="intermediate_dim"),
        # (sequences are drawn up to it, often exactly: every position used)
        max_sequence_length=draw(st.one_of(st.just(9), st.integers(1, 16)),
                                 label="max_sequence_length"),
        dropout=draw(_first_then(0.1, 0.0, 0.3), label="dropout"),
    )


def _check_text_config(backbone, hub_config):
    """kzoo's backbone has the keras-hub config's sizes."""
    for key in ("vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim",
                "max_sequence_length", "dropout", "num_segments"):
        if key in hub_config:
            assert getattr(backbone, key) == hub_config[key], (key, hub_config)


def _hub_round_trip(data, hub_backbone, task, head, tmp_path):
    """`hub_backbone`, or `task(hub_backbone, **head)` when `task` is given, randomised, saved
    with keras-hub's `save_to_preset` and loaded by kzoo: `(keras-hub model, kzoo model, kzoo
    backbone)`."""
    hub_model = hub_backbone if task is None else task(hub_backbone, preprocessor=None, **head)
    _randomise(hub_model, data.draw(st.integers(0, 2**16), label="seed"))
    path = _preset_dir(tmp_path)
    hub_model.save_to_preset(path)
    model = kzoo.presets.load(path)
    return hub_model, model, (model if task is None else model.backbone)


@pytest.mark.sweep
@sweep(8)
@given(data=st.data())
def test_keras_hub_bert_preset_matches_keras_hub(data, tmp_path):
    config = data.draw(text_sizes(), label="BertBackbone config")
    config["num_segments"] = data.draw(_first_then(2, 1, 3), label="num_segments")
    classifier = data.draw(_first_then(True, False), label="BertTextClassifier")
    hub_backbone = keras_hub.models.BertBackbone(**config)
    head = None
    if classifier:
        head = dict(num_classes=data.draw(_first_then(3, 1, 2, 5), label="num_classes"),
                    dropout=data.draw(_first_then(0.1, 0.0, 0.4), label="head dropout"),
                    activation=data.draw(_first_then(None, "linear"), label="activation"))
    hub_model, model, backbone = _hub_round_trip(
        data, hub_backbone, keras_hub.models.BertTextClassifier if classifier else None, head,
        tmp_path)
    assert isinstance(backbone, kzoo.models.bert.BertBackbone)
    assert (backbone.activation, backbone.layer_norm_epsilon) == ("gelu_tanh", 1e-12)
    _check_text_config(backbone, config)
    if classifier:
        assert isinstance(model, kzoo.models.bert.BertClassifier)
        assert (model.num_classes, model.dropout) == (head["num_classes"], head["dropout"])

    inputs = data.draw(token_inputs(config["vocabulary_size"], config["max_sequence_length"],
                                    config["num_segments"]), label="inputs")
    label = f"BertBackbone {config}"
    if classifier:
        _assert_close(model(inputs), hub_model(inputs), f"BertTextClassifier {head} on {label}")
    _assert_close(backbone(inputs), hub_backbone(inputs), label, mask=inputs["padding_mask"])


@pytest.mark.sweep
@sweep(8)
@given(data=st.data())
def test_keras_hub_gpt2_preset_matches_keras_hub(data, tmp_path):
    config = data.draw(text_sizes(), label="GPT2Backbone config")
    causal_lm = data.draw(_first_then(True, False), label="GPT2CausalLM")
    hub_backbone = keras_hub.models.GPT2Backbone(**config)
    hub_model, model, backbone = _hub_round_trip(
        data, hub_backbone, keras_hub.models.GPT2CausalLM if causal_lm else None, {}, tmp_path)
    assert isinstance(backbone, kzoo.models.gpt.GPTBackbone)
    assert (backbone.activation, backbone.layer_norm_epsilon, backbone.position,
            backbone.tie_embeddings) == ("gelu_tanh", 1e-5, "learned", True)
    _check_text_config(backbone, config)
    assert isinstance(model, kzoo.models.gpt.GPTCausalLM) == causal_lm

    inputs = data.draw(token_inputs(config["vocabulary_size"], config["max_sequence_length"]),
                       label="inputs")
    mask = inputs["padding_mask"]
    label = f"GPT2Backbone {config}"
    if causal_lm:
        _assert_close(model(inputs), hub_model(inputs), f"GPT2CausalLM on {label}", mask=mask)
    _assert_close(backbone(inputs), hub_backbone(inputs), label, mask=mask)


@st.composite
def vit_hub_configs(draw):
    """A ViTBackbone config: square or rectangular images and patches, every bias switch."""
    if draw(_first_then("square", "rectangular"), label="shape") == "square":
        patch = draw(_first_then(4, 2, 3), label="patch_size")
        grid = draw(_first_then(2, 1, 3), label="grid")
        size, patch_size = (patch * grid, patch * grid), draw(
            _first_then(patch, (patch, patch)), label="patch as")
    else:
        patch = (draw(_first_then(4, 2, 3)), draw(_first_then(2, 1, 4)))
        grid = (draw(_first_then(2, 1, 3)), draw(_first_then(3, 1, 2)))
        size, patch_size = (patch[0] * grid[0], patch[1] * grid[1]), patch
    heads = draw(_first_then(2, 1, 3, 4), label="num_heads")
    return dict(
        image_shape=(*size, draw(_first_then(3, 1), label="channels")),
        patch_size=patch_size,
        num_layers=draw(_first_then(2, 1, 3), label="num_layers"),
        num_heads=heads,
        hidden_dim=heads * draw(_first_then(4, 2, 8), label="head_dim"),
        mlp_dim=draw(st.one_of(st.just(16), st.integers(3, 40)), label="mlp_dim"),
        dropout_rate=draw(_first_then(0.0, 0.1), label="dropout_rate"),
        attention_dropout=draw(_first_then(0.0, 0.2), label="attention_dropout"),
        layer_norm_epsilon=draw(_first_then(1e-6, 1e-12, 1e-5, 1e-3, 0.1),
                                label="layer_norm_epsilon"),
        use_class_token=draw(_first_then(True, False), label="use_class_token"),
        use_mha_bias=draw(_first_then(True, False), label="use_mha_bias"),
        use_mlp_bias=draw(_first_then(True, False), label="use_mlp_bias"),
        use_patch_bias=draw(_first_then(True, False), label="use_patch_bias"),
    )


def _pair(value):
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


@pytest.mark.sweep
@sweep(8)
@given(data=st.data())
def test_keras_hub_vit_preset_matches_keras_hub(data, tmp_path):
    config = data.draw(vit_hub_configs(), label="ViTBackbone config")
    classifier = data.draw(_first_then(True, False), label="ViTImageClassifier")
    hub_backbone = keras_hub.models.ViTBackbone(**config)
    head = None
    if classifier:
        # "token" reads the class token; without one keras-hub's "token" reads the first
        # patch, which kzoo refuses (test_keras_hub_presets_kzoo_refuses), and "gap" averages
        # the patches, kzoo's "mean".
        head = dict(num_classes=data.draw(_first_then(3, 1, 2, 5), label="num_classes"),
                    pooling="token" if config["use_class_token"] else "gap",
                    dropout=data.draw(_first_then(0.0, 0.3), label="head dropout"),
                    activation=data.draw(_first_then(None, "linear"), label="activation"))
    hub_model, model, backbone = _hub_round_trip(
        data, hub_backbone, keras_hub.models.ViTImageClassifier if classifier else None, head,
        tmp_path)
    assert isinstance(backbone, kzoo.models.vit.ViTBackbone)
    height, width, channels = config["image_shape"]
    assert _pair(backbone.image_size) == (height, width)
    assert _pair(backbone.patch_size) == _pair(config["patch_size"])
    assert (backbone.num_channels, backbone.num_layers, backbone.num_heads, backbone.hidden_dim,
            backbone.intermediate_dim, backbone.dropout, backbone.attention_dropout,
            backbone.layer_norm_epsilon, backbone.use_class_token, backbone.qkv_bias,
            backbone.activation) == (
        channels, config["num_layers"], config["num_heads"], config["hidden_dim"],
        config["mlp_dim"], config["dropout_rate"], config["attention_dropout"],
        config["layer_norm_epsilon"], config["use_class_token"], config["use_mha_bias"],
        "gelu")
    if classifier:
        assert (model.num_classes, model.dropout, model.pooling) == (
            head["num_classes"], head["dropout"],
            {"token": "token", "gap": "mean"}[head["pooling"]])

    images = _images(data.draw(st.integers(0, 2**16), label="image seed"),
                     data.draw(_first_then(2, 1, 3), label="batch"), height, width, channels)
    label = f"ViTBackbone {config}"
    if classifier:
        _assert_close(model(images), hub_model(images), f"ViTImageClassifier {head} on {label}")
    _assert_close(backbone(images), hub_backbone(images), label)


# === kzoo -> keras-hub ===


def _hub_from_preset(path, hub_task, hub_backbone):
    """keras-hub's task model (or None) and backbone loaded from `path` by their classes."""
    task = None if hub_task is None else getattr(keras_hub.models, hub_task).from_preset(path)
    return task, getattr(keras_hub.models, hub_backbone).from_preset(path)


def _saved_as_keras_hub(model, tmp_path):
    path = _preset_dir(tmp_path)
    assert kzoo.presets.save(model, path, format="keras_hub") == path
    assert hub_convert.is_preset(path)
    return path


@pytest.mark.sweep
@sweep(6, jax_examples=1)
@given(data=st.data())
def test_kzoo_bert_saved_as_keras_hub_matches(data, tmp_path):
    config = data.draw(text_sizes(), label="sizes")
    config.update(num_segments=data.draw(_first_then(2, 1, 3), label="num_segments"),
                  activation=data.draw(st.sampled_from(TANH_GELUS), label="activation"),
                  layer_norm_epsilon=1e-12)
    classifier = data.draw(_first_then(True, False), label="classifier")
    task_config = {}
    if classifier:
        task_config = dict(num_classes=data.draw(_first_then(3, 1, 2, 5), label="num_classes"),
                           dropout=data.draw(_first_then(0.1, 0.0, 0.4), label="head dropout"))
    model = kzoo.presets.build("bert", config, task="classifier" if classifier else "backbone",
                               task_config=task_config)
    _randomise(model, data.draw(st.integers(0, 2**16), label="seed"))
    path = _saved_as_keras_hub(model, tmp_path)

    hub_model, hub_backbone = _hub_from_preset(
        path, "BertTextClassifier" if classifier else None, "BertBackbone")
    backbone = model.backbone if classifier else model
    _check_text_config(backbone, hub_backbone.get_config())
    inputs = data.draw(token_inputs(config["vocabulary_size"], config["max_sequence_length"],
                                    config["num_segments"]), label="inputs")
    label = f"kzoo bert {config}"
    if classifier:
        assert (hub_model.num_classes, hub_model.dropout) == (
            task_config["num_classes"], task_config["dropout"])
        _assert_close(model(inputs), hub_model(inputs), f"{label} classifier {task_config}")
        _assert_close(backbone(inputs), hub_model.backbone(inputs), label,
                      mask=inputs["padding_mask"])
    _assert_close(backbone(inputs), hub_backbone(inputs), label, mask=inputs["padding_mask"])


@pytest.mark.sweep
@sweep(6, jax_examples=1)
@given(data=st.data())
def test_kzoo_gpt_saved_as_keras_hub_matches(data, tmp_path):
    config = data.draw(text_sizes(), label="sizes")
    # The GPT-2 configuration keras-hub's GPT2Backbone is: kzoo's GPT defaults, drawn
    # explicitly here (num_kv_heads = num_heads is plain multi-head attention too).
    config.update(activation=data.draw(st.sampled_from(TANH_GELUS), label="activation"),
                  layer_norm_epsilon=1e-5, norm="layernorm", position="learned",
                  feedforward="plain", use_bias=True, tie_embeddings=True,
                  num_kv_heads=data.draw(_first_then(None, config["num_heads"]),
                                         label="num_kv_heads"),
                  attention_scale=data.draw(
                      _first_then(None, (config["hidden_dim"] // config["num_heads"]) ** -0.5),
                      label="attention_scale"))
    causal_lm = data.draw(_first_then(True, False), label="causal_lm")
    model = kzoo.presets.build("gpt", config, task="causal_lm" if causal_lm else "backbone")
    _randomise(model, data.draw(st.integers(0, 2**16), label="seed"))
    path = _saved_as_keras_hub(model, tmp_path)

    hub_model, hub_backbone = _hub_from_preset(
        path, "GPT2CausalLM" if causal_lm else None, "GPT2Backbone")
    backbone = model.backbone if causal_lm else model
    _check_text_config(backbone, hub_backbone.get_config())
    inputs = data.draw(token_inputs(config["vocabulary_size"], config["max_sequence_length"]),
                       label="inputs")
    mask = inputs["padding_mask"]
    label = f"kzoo gpt {config}"
    if causal_lm:
        _assert_close(model(inputs), hub_model(inputs), f"{label} causal_lm", mask=mask)
    _assert_close(backbone(inputs), hub_backbone(inputs), label, mask=mask)


@pytest.mark.spread
@pytest.mark.parametrize("head_dim", [2, 8])
def test_kzoo_gpt_with_explicit_default_attention_scale_is_written(head_dim, tmp_path):
    """Found by the sweep: `attention_scale=head_dim ** -0.5` (kzoo's documented meaning of
    None) was refused when it differs from `1 / math.sqrt(head_dim)` in the last bit (head
    dims 2, 3, 6, 8, 12, 32, 128, ...): "attention_scale=0.7071067811865476 has no keras-hub
    equivalent; allowed: [None, 0.7071067811865475]". keras-hub's attention scales by
    1 / sqrt(head_dim) in float32, the same number."""
    config = dict(_SIZES, hidden_dim=2 * head_dim, attention_scale=head_dim ** -0.5)
    model = _randomise(kzoo.presets.build("gpt", config, task="causal_lm"), seed=head_dim)
    path = _saved_as_keras_hub(model, tmp_path)
    hub_model = keras_hub.models.GPT2CausalLM.from_preset(path)
    inputs = {"token_ids": np.arange(16, dtype="int32").reshape(2, 8) % 20,
              "padding_mask": np.ones((2, 8), "int32")}
    _assert_close(model(inputs), hub_model(inputs), f"attention_scale={head_dim}**-0.5")


@pytest.mark.sweep
@sweep(6, jax_examples=1)
@given(data=st.data())
def test_kzoo_vit_saved_as_keras_hub_matches(data, tmp_path):
    hub = data.draw(vit_hub_configs(), label="sizes")
    height, width, channels = hub["image_shape"]
    patch = _pair(hub["patch_size"])
    config = dict(
        image_size=data.draw(_first_then((height, width), [height, width]))
        if height != width else height,
        patch_size=patch if patch[0] != patch[1] else patch[0],
        num_channels=channels, num_layers=hub["num_layers"], num_heads=hub["num_heads"],
        hidden_dim=hub["hidden_dim"], intermediate_dim=hub["mlp_dim"],
        dropout=hub["dropout_rate"], attention_dropout=hub["attention_dropout"],
        layer_norm_epsilon=hub["layer_norm_epsilon"], use_class_token=hub["use_class_token"],
        qkv_bias=hub["use_mha_bias"], activation="gelu")
    classifier = data.draw(_first_then(True, False), label="classifier")
    task_config = {}
    if classifier:
        task_config = dict(num_classes=data.draw(_first_then(3, 1, 2, 5), label="num_classes"),
                           dropout=data.draw(_first_then(0.0, 0.3), label="head dropout"),
                           pooling="token" if config["use_class_token"] else "mean")
    model = kzoo.presets.build("vit", config, task="classifier" if classifier else "backbone",
                               task_config=task_config)
    _randomise(model, data.draw(st.integers(0, 2**16), label="seed"))
    backbone = model.backbone if classifier else model
    if not config["qkv_bias"]:
        # keras-hub's use_mha_bias=False has no attention output bias either: kzoo writes
        # its output bias only while it is zero (test_kzoo_save_refuses_what_keras_hub_lacks)
        for block in backbone.encoder_layers:
            bias = block.self_attention.output_dense.bias
            bias.assign(np.zeros(tuple(bias.shape), "float32"))
    path = _saved_as_keras_hub(model, tmp_path)

    hub_model, hub_backbone = _hub_from_preset(
        path, "ViTImageClassifier" if classifier else None, "ViTBackbone")
    written = hub_backbone.get_config()
    assert (tuple(written["image_shape"]), _pair(written["patch_size"]),
            written["use_class_token"], written["use_mha_bias"],
            written["layer_norm_epsilon"], written["dropout_rate"],
            written["attention_dropout"]) == (
        (height, width, channels), patch, config["use_class_token"], config["qkv_bias"],
        config["layer_norm_epsilon"], config["dropout"], config["attention_dropout"])
    images = _images(data.draw(st.integers(0, 2**16), label="image seed"),
                     data.draw(_first_then(2, 1, 3), label="batch"), height, width, channels)
    label = f"kzoo vit {config}"
    if classifier:
        assert (hub_model.num_classes, hub_model.pooling, hub_model.dropout) == (
            task_config["num_classes"], {"token": "token", "mean": "gap"}[model.pooling],
            task_config["dropout"])
        _assert_close(model(images), hub_model(images), f"{label} classifier {task_config}")
    _assert_close(backbone(images), hub_backbone(images), label)


# === Refused: keras-hub presets kzoo cannot express ===


def _tiny_bert():
    return keras_hub.models.BertBackbone(vocabulary_size=20, num_layers=1, num_heads=2,
                                         hidden_dim=8, intermediate_dim=12,
                                         max_sequence_length=8)


def _tiny_gpt2():
    return keras_hub.models.GPT2Backbone(vocabulary_size=20, num_layers=1, num_heads=2,
                                         hidden_dim=8, intermediate_dim=12,
                                         max_sequence_length=8)


def _tiny_vit(**options):
    return keras_hub.models.ViTBackbone(**{**dict(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
        mlp_dim=12), **options})


def _vit_classifier(backbone_options=None, **options):
    return keras_hub.models.ViTImageClassifier(_tiny_vit(**(backbone_options or {})),
                                               num_classes=3, preprocessor=None, **options)


def _quantized_bert():
    backbone = _tiny_bert()
    with warnings.catch_warnings():  # "Layer Add does not have a `quantize` method", ...
        warnings.simplefilter("ignore", UserWarning)
        backbone.quantize("int8")
    return backbone


def _edit(file, edit):
    with open(file) as f:
        data = json.load(f)
    edit(data)
    with open(file, "w") as f:
        json.dump(data, f)


# (keras-hub model, save_to_preset kwargs, edit of the written directory, the field named)
REFUSED_PRESETS = {
    "ViTImageClassifier gap pooling with a class token": (
        lambda: _vit_classifier(pooling="gap"), {}, None, "pooling"),
    "ViTImageClassifier token pooling without a class token": (
        # keras-hub reads the first patch token; kzoo's "token" pooling needs a class token
        # (refused by the converter itself, not by ViTClassifier's constructor, whose message
        # suggested pooling='mean', another function)
        lambda: _vit_classifier({"use_class_token": False}, pooling="token"), {}, None,
        "In .*pooling='token' on a backbone with use_class_token=False"),
    "ViTImageClassifier pre-logits intermediate_dim": (
        lambda: _vit_classifier(intermediate_dim=6), {}, None, "intermediate_dim"),
    "ViTImageClassifier softmax activation": (
        lambda: _vit_classifier(activation="softmax"), {}, None, "activation"),
    "BertTextClassifier softmax activation": (
        lambda: keras_hub.models.BertTextClassifier(_tiny_bert(), num_classes=2,
                                                    activation="softmax", preprocessor=None),
        {}, None, "activation"),
    "BertMaskedLM (exact-GELU head)": (
        lambda: keras_hub.models.BertMaskedLM(_tiny_bert(), preprocessor=None), {}, None,
        "BertMaskedLM"),
    "RobertaBackbone (another backbone class)": (
        lambda: keras_hub.models.RobertaBackbone(vocabulary_size=20, num_layers=1, num_heads=2,
                                                 hidden_dim=8, intermediate_dim=12,
                                                 max_sequence_length=8),
        {}, None, "RobertaBackbone"),
    "another task class": (
        lambda: keras_hub.models.GPT2CausalLM(_tiny_gpt2(), preprocessor=None), {},
        lambda path: _edit(os.path.join(path, "task.json"),
                           lambda c: c.update(class_name="GPT2Seq2SeqLM")),
        "GPT2Seq2SeqLM"),
    "a GPT2Backbone field kzoo does not know": (
        _tiny_gpt2, {},
        lambda path: _edit(os.path.join(path, "config.json"),
                           lambda c: c["config"].update(layer_norm_epsilon=1e-6)),
        "layer_norm_epsilon"),
    "a BertBackbone field kzoo does not know": (
        _tiny_bert, {},
        lambda path: _edit(os.path.join(path, "config.json"),
                           lambda c: c["config"].update(rope_max_wavelength=500)),
        "rope_max_wavelength"),
    "a ViTBackbone field kzoo does not know": (
        _tiny_vit, {},
        lambda path: _edit(os.path.join(path, "config.json"),
                           lambda c: c["config"].update(use_rotary_positions=True)),
        "use_rotary_positions"),
    "a quantized (int8) backbone": (_quantized_bert, {}, None, "dtype"),
    "sharded weights": (_tiny_gpt2, {"max_shard_size": 1e-6}, None, "sharded"),
}


# The refusals read a preset's JSON and HDF5 files, the same code on every backend: each case
# runs on one backend in the default suite (`spread`; on all three in `make test-all`).
@pytest.mark.spread
@pytest.mark.parametrize("case", list(REFUSED_PRESETS))
def test_keras_hub_presets_kzoo_refuses(case, tmp_path):
    build, save_kwargs, edit, field = REFUSED_PRESETS[case]
    path = str(tmp_path / "preset")
    build().save_to_preset(path, **save_kwargs)
    if edit is not None:
        edit(path)
    with pytest.raises(ValueError, match=field):
        kzoo.presets.load(path)


# === Refused: kzoo models keras-hub cannot express ===

_SIZES = dict(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=12,
              max_sequence_length=8)
_BERT_BASE = dict(_SIZES, activation="gelu_tanh", layer_norm_epsilon=1e-12)
_VIT_BASE = dict(image_size=8, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
                 intermediate_dim=12)


def _other_than(allowed, choices):
    return st.sampled_from([c for c in choices if c not in allowed])


# field -> (family, base config, task, strategy of the {override} / task config drawn)
REFUSED_SAVES = {
    "bert activation": ("bert", _BERT_BASE, "backbone", st.fixed_dictionaries(
        {"activation": _other_than(TANH_GELUS, ("gelu", "relu", "silu", "tanh"))})),
    "bert layer_norm_epsilon": ("bert", _BERT_BASE, "backbone", st.fixed_dictionaries(
        {"layer_norm_epsilon": st.sampled_from([1e-5, 1e-6, 1e-11, 1e-3])})),
    "bert attention": ("bert", _BERT_BASE, "backbone", st.fixed_dictionaries(
        {"attention": st.just("sliding_window"),
         "attention_options": st.builds(lambda w: {"window": w}, st.integers(1, 6))})),
    "bert BertMaskedLM": ("bert", _BERT_BASE, "masked_lm", st.just({})),
    "gpt activation": ("gpt", _SIZES, "causal_lm", st.fixed_dictionaries(
        {"activation": _other_than(TANH_GELUS, ("gelu", "relu", "silu"))})),
    "gpt layer_norm_epsilon": ("gpt", _SIZES, "causal_lm", st.fixed_dictionaries(
        {"layer_norm_epsilon": st.sampled_from([1e-6, 1e-12, 1e-3])})),
    "gpt norm": ("gpt", _SIZES, "causal_lm", st.just({"norm": "rmsnorm"})),
    "gpt position": ("gpt", _SIZES, "backbone", st.just({"position": "rotary"})),
    "gpt feedforward": ("gpt", _SIZES, "causal_lm", st.just({"feedforward": "gated"})),
    "gpt num_kv_heads": ("gpt", _SIZES, "causal_lm", st.just({"num_kv_heads": 1})),
    "gpt use_bias": ("gpt", _SIZES, "backbone", st.just({"use_bias": False})),
    "gpt tie_embeddings": ("gpt", _SIZES, "causal_lm", st.just({"tie_embeddings": False})),
    "gpt attention_scale": ("gpt", _SIZES, "causal_lm", st.fixed_dictionaries(
        {"attention_scale": st.sampled_from([1.0, 0.25, 0.1])})),
    "gpt attention": ("gpt", _SIZES, "backbone", st.fixed_dictionaries(
        {"attention": st.just("strided"),
         "attention_options": st.builds(lambda s: {"stride": s}, st.integers(2, 4))})),
    "vit activation": ("vit", _VIT_BASE, "backbone", st.fixed_dictionaries(
        {"activation": st.sampled_from(["gelu_tanh", "relu", "silu"])})),
    "vit pooling": ("vit", _VIT_BASE, "classifier", st.just(
        {"task_config": {"num_classes": 3, "pooling": "mean"}})),
    # a kzoo ViT with qkv_bias=False keeps an attention output bias keras-hub lacks
    "vit use_mha_bias": ("vit", dict(_VIT_BASE, qkv_bias=False), "backbone", st.just({})),
}


@pytest.mark.spread
@pytest.mark.parametrize("case", list(REFUSED_SAVES))
@sweep(2, jax_examples=1)
@given(data=st.data())
def test_kzoo_save_refuses_what_keras_hub_lacks(case, data, tmp_path):
    family, base, task, overrides = REFUSED_SAVES[case]
    overrides = dict(data.draw(overrides, label="overrides"))
    task_config = overrides.pop("task_config", {})
    model = kzoo.presets.build(family, {**base, **overrides}, task=task,
                               task_config=task_config)
    _randomise(model, data.draw(st.integers(0, 2**16), label="seed"))
    path = _preset_dir(tmp_path)
    field = case.split(" ", 1)[1]
    with pytest.raises(ValueError, match=field):
        kzoo.presets.save(model, path, format="keras_hub")
    assert not os.path.exists(path) or os.listdir(path) == [], os.listdir(path)
    shutil.rmtree(os.path.dirname(path))
