"""Memory savers (issue #18, item 4): rematerialisation per block (`remat`), LayerDrop
(`layerdrop`), mixed precision on every family, gradient accumulation (`--accumulate`).

The references are independent of the code under test: the same model without the saver
(gradients, weights after training), the float32 NumPy formula of a norm, counts of a
Bernoulli draw against its probability.
"""

import json

import keras
import numpy as np
import pytest

import kzoo
from kzoo import graphs
from kzoo.layers.blocks import TransformerBlock
from kzoo.layers.norm import RMSNorm
from kzoo.layers.taps import Tap
from kzoo.layers.utils import FieldError
from kzoo.models.bert import BertBackbone, BertClassifier, BertConfig
from kzoo.models.gpt import GPTBackbone, GPTCausalLM, GPTConfig
from kzoo.models.graphormer import GraphormerBackbone, GraphormerConfig, GraphormerPredictor
from kzoo.models.t5 import T5Backbone, T5Config, T5Seq2SeqLM
from kzoo.models.vit import ViTBackbone, ViTClassifier, ViTConfig
from tests.helpers import to_numpy

FAMILIES = ("gpt", "bert", "t5", "vit", "graphormer")
CONFIGS = {"gpt": GPTConfig, "bert": BertConfig, "t5": T5Config, "vit": ViTConfig,
           "graphormer": GraphormerConfig}


# === Tiny models of every family ===


def build(family, dropout=0.1, dtype=None, **fields):
    """A tiny task model of `family` with one block (T5: an encoder and a decoder block),
    `dropout` on every dropout the family has, and `fields` (remat, layerdrop)."""
    keras.utils.set_random_seed(0)
    if family == "gpt":
        return GPTCausalLM(GPTBackbone(
            vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
            max_sequence_length=16, dropout=dropout, dtype=dtype, **fields))
    if family == "bert":
        return BertClassifier(BertBackbone(
            vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
            max_sequence_length=16, dropout=dropout, dtype=dtype, **fields),
            num_classes=3, dropout=0.0)
    if family == "t5":
        return T5Seq2SeqLM(T5Backbone(
            vocabulary_size=40, num_layers=1, num_decoder_layers=1, num_heads=2,
            hidden_dim=16, key_value_dim=8, intermediate_dim=24, dropout=dropout,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feedforward="gated-gelu", tie_embeddings=False, dtype=dtype, **fields))
    if family == "vit":
        model = ViTClassifier(ViTBackbone(
            image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=24, dropout=dropout, attention_dropout=dropout, dtype=dtype,
            **fields), num_classes=3)
        # ViT's head starts at zeros (no gradient would reach the blocks): seeded noise
        for v in model.trainable_variables:
            if v.path.endswith("kernel") and not np.any(to_numpy(v)):
                v.assign(np.random.default_rng(1).normal(0, 0.3, v.shape).astype("float32"))
        return model
    if family == "graphormer":
        return GraphormerPredictor(GraphormerBackbone(
            num_layers=1, hidden_dim=16, intermediate_dim=24, num_heads=2, dropout=dropout,
            attention_dropout=dropout, activation_dropout=dropout, dtype=dtype, **fields),
            num_classes=1)
    raise AssertionError(family)


def inputs_of(family, seed=0):
    r = np.random.default_rng(seed)
    if family == "gpt":
        return {"token_ids": r.integers(1, 40, (4, 8)).astype("int32"),
                "padding_mask": np.ones((4, 8), "int32")}
    if family == "bert":
        mask = np.ones((4, 8), "int32")
        mask[1, 5:] = 0
        return {"token_ids": (r.integers(1, 40, (4, 8)) * mask).astype("int32"),
                "segment_ids": np.zeros((4, 8), "int32"), "padding_mask": mask}
    if family == "t5":
        return {"encoder_token_ids": r.integers(2, 40, (4, 7)).astype("int32"),
                "encoder_padding_mask": np.ones((4, 7), "int32"),
                "decoder_token_ids": r.integers(2, 40, (4, 5)).astype("int32"),
                "decoder_padding_mask": np.ones((4, 5), "int32")}
    if family == "vit":
        return r.normal(size=(4, 16, 16, 3)).astype("float32")
    if family == "graphormer":
        x = graphs.batch([graphs.from_smiles(s) for s in ("CCO", "c1ccccc1", "CC(=O)O", "CN")])
        x.pop("labels", None)
        return x
    raise AssertionError(family)


def targets_of(model, x, seed=1):
    """Random regression targets of the model's output shape (a mean squared error on
    them reaches every weight)."""
    shape = tuple(model(x).shape)
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def blocks_of(model):
    return [layer for layer in model._flatten_layers() if isinstance(layer, TransformerBlock)]


def copy_variables(source, target):
    """Every variable (weights and seed-generator states) of `source` into `target`."""
    assert [(v.shape, v.dtype) for v in source.variables] == \
        [(v.shape, v.dtype) for v in target.variables]
    for a, b in zip(source.variables, target.variables):
        b.assign(np.array(to_numpy(a)))


def weights(model):
    return [np.array(to_numpy(v), np.float64) for v in model.trainable_variables]


def gradients(model, x, y, scale=1.0):
    """`(loss, gradients)` of `scale * mean((model(x, training=True) - y) ** 2)` with respect
    to the trainable variables, in each backend's own autodiff (JAX through
    `stateless_call`, as Keras' JAX trainer runs a model), dropout masks from a fixed seed."""
    backend = keras.backend.backend()
    keras.utils.set_random_seed(7)  # torch draws unseeded dropout from its global generator
    target = keras.ops.convert_to_tensor(y)

    def loss_of(out):
        out = keras.ops.cast(out, "float32")
        return keras.ops.mean((out - target) ** 2) * scale

    if backend == "jax":
        import jax

        others = [v.value for v in model.non_trainable_variables]

        def loss(values):
            out, _ = model.stateless_call(values, others, x, training=True)
            return loss_of(out)

        value, grads = jax.jit(jax.value_and_grad(loss))(
            [v.value for v in model.trainable_variables])
    elif backend == "torch":
        for v in model.trainable_variables:
            v.value.grad = None
        value = loss_of(model(x, training=True))
        value.backward()
        grads = [v.value.grad for v in model.trainable_variables]
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_of(model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
    return float(to_numpy(value)), [np.array(to_numpy(g), np.float64) for g in grads]


# === Rematerialisation ===


@pytest.mark.spread
@pytest.mark.parametrize("family", FAMILIES)
def test_remat_gives_the_same_gradients(family):
    """The gradients (dropout 0.1 everywhere) with remat == without, at 1e-5: the
    recomputation replays the forward pass' dropout masks. (`fit` with remat is
    `test_layerdrop_trains_inside_compiled_fit[True]`.)"""
    x = inputs_of(family)
    plain = build(family)
    remat = build(family, remat=True)
    assert all(block.remat for block in blocks_of(remat))
    assert not any(block.remat for block in blocks_of(plain))
    copy_variables(plain, remat)
    y = targets_of(plain, x)
    loss_plain, grads_plain = gradients(plain, x, y)
    loss_remat, grads_remat = gradients(remat, x, y)
    assert np.isfinite(loss_plain)
    np.testing.assert_allclose(loss_remat, loss_plain, rtol=1e-5)
    scale = max(np.abs(g).max() for g in grads_plain)
    assert scale > 1e-3  # the step moved the weights
    diff = max(np.abs(a - b).max() for a, b in zip(grads_plain, grads_remat))
    print(f"{family}: max |grad(remat) - grad| = {diff:.2e} (max |grad| {scale:.2e})")
    assert diff <= 1e-5 * max(1.0, scale)


def test_remat_recomputes_the_block_in_the_backward_pass():
    """The block really is rematerialised: torch and TensorFlow run (trace) the block's
    forward a second time for the gradient; JAX's gradient holds a `checkpoint` (remat)
    primitive around it."""
    backend = keras.backend.backend()
    block = TransformerBlock(num_heads=2, intermediate_dim=16, remat=True)
    x = np.random.default_rng(0).normal(size=(2, 4, 8)).astype("float32")
    block(x)
    calls = []
    forward = block._forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    block._forward = counted
    if backend == "jax":
        import jax

        trainable = [v.value for v in block.trainable_variables]
        others = [v.value for v in block.non_trainable_variables]

        def loss(values):
            out, _ = block.stateless_call(values, others, x, training=True)
            return (out ** 2).sum()

        text = str(jax.make_jaxpr(jax.grad(loss))(trainable))
        assert "checkpoint" in text or "remat" in text
    elif backend == "torch":
        import torch

        out = block(torch.tensor(x), training=True)
        assert len(calls) == 1
        (out ** 2).sum().backward()
        assert len(calls) == 2
    else:
        import tensorflow as tf

        @tf.function
        def grads(inputs):
            with tf.GradientTape() as tape:
                out = block(inputs, training=True)
                loss = tf.reduce_sum(out ** 2)
            return tape.gradient(loss, block.trainable_variables)

        grads(tf.constant(x))
        assert len(calls) == 2  # the forward trace and the recomputation in the gradient


def test_remat_and_layerdrop_round_trip_through_config():
    block = TransformerBlock(num_heads=2, intermediate_dim=16, remat=True, layerdrop=0.25)
    config = block.get_config()
    assert config["remat"] is True and config["layerdrop"] == 0.25
    again = TransformerBlock.from_config(config)
    assert again.remat is True and again.layerdrop == 0.25
    assert again.get_config() == config
    defaults = TransformerBlock(num_heads=2, intermediate_dim=16).get_config()
    assert defaults["remat"] is False and defaults["layerdrop"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_family_config_fields_reach_every_block(family):
    model = build(family, remat=True, layerdrop=0.2)
    backbone = model.backbone
    assert backbone.config.remat is True and backbone.config.layerdrop == 0.2
    blocks = blocks_of(model)
    assert blocks and all(b.remat and b.layerdrop == 0.2 for b in blocks)
    config = backbone.get_config()
    assert config["remat"] is True and config["layerdrop"] == 0.2
    rebuilt = type(backbone).from_config(config)
    assert rebuilt.config == backbone.config


def test_presets_default_to_no_memory_savers_and_take_them_as_overrides():
    """Preset files written before the fields existed still validate (the fields default
    to off), and `load(..., remat=True, layerdrop=...)` switches them on."""
    import glob
    import os

    files = glob.glob(os.path.join(os.path.dirname(kzoo.__file__), "..", "presets", "*.json"))
    assert files
    for path in files:
        with open(path) as f:
            preset = json.load(f)
        assert "remat" not in preset["config"] and "layerdrop" not in preset["config"]
        config = CONFIGS[preset["family"]].from_dict(preset["config"], source=path)
        assert config.remat is False and config.layerdrop == 0.0
    model = kzoo.presets.load("gpt_mini", remat=True, layerdrop=0.1)
    assert all(b.remat and b.layerdrop == 0.1 for b in blocks_of(model))


# === LayerDrop ===


def _block_pair(layerdrop, dropout=0.0):
    """A LayerDrop block and a twin without LayerDrop holding the same weights."""
    kwargs = dict(num_heads=2, intermediate_dim=16, dropout=dropout)
    dropped = TransformerBlock(layerdrop=layerdrop, **kwargs)
    plain = TransformerBlock(**kwargs)
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")
    dropped(x)
    plain(x)
    for a, b in zip(plain.weights, dropped.weights):
        b.assign(np.array(to_numpy(a)))
    return dropped, plain, x


def test_layerdrop_zero_adds_nothing():
    dropped, plain, x = _block_pair(0.0)
    assert dropped.layerdrop_seed is None
    assert len(dropped.variables) == len(plain.variables)
    np.testing.assert_array_equal(to_numpy(dropped(x, training=True)),
                                  to_numpy(plain(x, training=True)))


def test_layerdrop_never_drops_in_inference():
    dropped, plain, x = _block_pair(0.9)
    expected = to_numpy(plain(x, training=False))
    for _ in range(5):
        np.testing.assert_array_equal(to_numpy(dropped(x, training=False)), expected)
        np.testing.assert_array_equal(to_numpy(dropped(x)), expected)


def test_layerdrop_skips_whole_blocks_at_its_rate():
    """In training each call is either the identity (the whole batch) or the full block,
    and the block is skipped with probability `layerdrop`."""
    p = 0.3
    dropped, plain, x = _block_pair(p)
    full = to_numpy(plain(x, training=True))
    assert np.abs(full - x).max() > 1e-2
    seen = set()
    for _ in range(16):
        out = to_numpy(dropped(x, training=True))
        if np.array_equal(out, x):
            seen.add("skipped")
        else:
            np.testing.assert_allclose(out, full, atol=1e-6)
            seen.add("full")
    assert seen == {"skipped", "full"}  # P(one kind only in 16 calls) < 0.4%
    # the per-call draw the block makes: Binomial(400, 0.3), mean 120, standard deviation
    # 9.2; 4 standard deviations either way
    draws = 400
    skipped = sum(not bool(to_numpy(dropped._layerdrop_keep())) for _ in range(draws))
    assert abs(skipped - p * draws) <= 4 * np.sqrt(draws * p * (1 - p)), skipped


@pytest.mark.spread
@pytest.mark.parametrize("remat", [False, True])
def test_layerdrop_trains_inside_compiled_fit(remat):
    """`fit` (compiled on every backend) with LayerDrop (and dropout) trains: finite loss,
    and every weight moves over the 8 steps (a block is skipped in all 8 with probability
    0.3 ** 8 < 1e-4; the draws are seeded)."""
    model = build("gpt", dropout=0.1, remat=remat, layerdrop=0.3)
    x = inputs_of("gpt")
    y = targets_of(model, x)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = weights(model)
    history = model.fit(x, y, batch_size=2, epochs=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    moved = [np.abs(a - b).max() > 0 for a, b in zip(weights(model), before)]
    assert all(moved)


def test_layerdrop_with_a_tap_stays_in_the_trace():
    """With a Tap active (interpretation, distillation) the block is computed and a skipped
    block's output replaced by its input; the tap sees every block."""
    dropped, plain, x = _block_pair(0.5)
    full = to_numpy(plain(x, training=True))
    seen = set()
    for _ in range(16):
        with Tap(record_blocks=True) as tap:
            out = to_numpy(dropped(x, training=True))
        assert len(tap.block_records) == 1
        seen.add("skipped" if np.array_equal(out, x) else "full")
        if not np.array_equal(out, x):
            np.testing.assert_allclose(out, full, atol=1e-6)
    assert seen == {"skipped", "full"}


def test_graphormer_converter_maps_layerdrop():
    from kzoo.convert import graphormer as convert

    hf = {"model_type": "graphormer", "num_hidden_layers": 2, "embedding_dim": 16,
          "ffn_embedding_dim": 24, "num_attention_heads": 2, "layerdrop": 0.2}
    _, config, _, _ = convert.config_from_hf(hf)
    assert config["layerdrop"] == 0.2
    model = build("graphormer", layerdrop=0.2)
    hf_config, _ = convert.to_hf(model)
    assert hf_config["layerdrop"] == 0.2
    with pytest.raises(ValueError, match="layerdrop"):
        convert.config_from_hf({**hf, "layerdrop": 1.5})


# === Validation ===


@pytest.mark.parametrize("field,value,allowed", [
    ("remat", "yes", "True or False"),
    ("remat", 1, "True or False"),
    ("layerdrop", 1.5, r"\[0, 1\)"),
    ("layerdrop", -0.1, r"\[0, 1\)"),
    ("layerdrop", "0.1", r"\[0, 1\)"),
])
def test_bad_values_are_named(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field}.*{allowed}.*{field}={value!r}"):
        TransformerBlock(num_heads=2, intermediate_dim=16, **{field: value})
    for family in FAMILIES:
        with pytest.raises(FieldError, match=f"{field}.*{allowed}") as error:
            CONFIGS[family](**{field: value})
        assert error.value.field == field


def test_cli_flags(capsys):
    from training.cli import build_parser, config_from_args

    parser = build_parser()
    cfg = config_from_args(parser.parse_args(
        ["gpt_text", "--remat", "--accumulate", "4", "--mixed-precision", "float16",
         "--batch-size", "8"]))
    assert cfg.overrides["remat"] is True
    assert cfg.accumulate == 4 and cfg.batch_size == 8
    assert cfg.dtype == "mixed_float16"
    bare = config_from_args(parser.parse_args(["gpt_text", "--mixed-precision"]))
    assert bare.dtype == "mixed_bfloat16"
    plain = config_from_args(parser.parse_args(["gpt_text"]))
    assert plain.dtype == "float32" and plain.accumulate == 1 and "remat" not in plain.overrides
    # the fingerprint of old runs (bare flag, no accumulation) is unchanged
    assert bare.fingerprint()["mixed_precision"] is True
    assert "accumulate" not in bare.fingerprint() and cfg.fingerprint()["accumulate"] == 4
    for argv, message in [(["--accumulate", "0"], "--accumulate must be a positive integer"),
                          (["--accumulate", "two"], "--accumulate must be a positive integer"),
                          (["--mixed-precision", "float8"], "--mixed-precision must be one of")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["gpt_text", *argv])
        assert message in capsys.readouterr().err
    help_text = parser._subparsers._group_actions[0].choices["gpt_text"].format_help()
    assert "effective" in help_text and "--accumulate" in help_text


def test_run_config_refuses_bad_accumulate_and_precision():
    from training.loop import RunConfig

    with pytest.raises(ValueError, match=r"accumulate.*positive integer.*accumulate=0"):
        RunConfig(recipe="gpt_text", out="x", accumulate=0)
    with pytest.raises(ValueError, match=r"mixed_precision.*'float16'.*mixed_precision='fp8'"):
        RunConfig(recipe="gpt_text", out="x", mixed_precision="fp8")


# === Gradient accumulation ===


@pytest.mark.spread
def test_accumulation_equals_the_larger_batch():
    """`N` batches of `b` with `--accumulate N` (the CLI's AdamW, warmup schedule, clipping,
    weight decay) == one batch of `N * b` without, for two updates, at 1e-5."""
    from training.loop import RunConfig, make_optimizer

    n, b, updates = 3, 2, 2
    r = np.random.default_rng(0)
    x = {"token_ids": r.integers(1, 40, (n * b * updates, 8)).astype("int32"),
         "padding_mask": np.ones((n * b * updates, 8), "int32")}
    y = r.integers(0, 40, (n * b * updates, 8)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = []
    for accumulate, batch_size in ((n, b), (1, n * b)):
        model = build("gpt", dropout=0.0)
        cfg = RunConfig(recipe="gpt_text", out="unused", learning_rate=1e-3, warmup_steps=2,
                        clipnorm=0.5, weight_decay=0.01, accumulate=accumulate)
        model.compile(optimizer=make_optimizer(cfg), loss=loss)
        start = weights(model)
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        assert int(to_numpy(model.optimizer.iterations)) == updates
        results.append((start, weights(model)))
    (start_a, end_a), (start_b, end_b) = results
    for a, c in zip(start_a, start_b):
        np.testing.assert_array_equal(a, c)
    moved = max(np.abs(e - s).max() for e, s in zip(end_b, start_b))
    assert moved > 1e-4
    diff = max(np.abs(e - f).max() for e, f in zip(end_a, end_b))
    print(f"accumulate {n} x {b} vs batch {n * b}: max |weight diff| {diff:.2e} "
          f"(max change {moved:.2e})")
    assert diff <= 1e-5


# === Mixed precision on every family ===


def _np_layer_norm(x, gamma, beta, epsilon):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def _np_rms_norm(x, scale, epsilon):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + epsilon) * scale


@pytest.mark.spread
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_precision_on_every_family(family, policy):
    compute = policy.split("_")[1]
    model = build(family, dropout=0.1, dtype=policy)
    x = inputs_of(family)
    # float32 variables, low-precision activations (every block's output)
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    with Tap(record_attention=True, record_blocks=True) as tap:
        model(x)
    assert tap.block_records and tap.attention_records
    for record in tap.block_records:
        assert keras.backend.standardize_dtype(record.output.dtype) == compute
    # softmax in float32: the probabilities (the exact formula a tap sees) are float32 and
    # their rows sum to 1 at float32 precision (half-precision probabilities miss by ~1e-3)
    for record in tap.attention_records:
        assert keras.backend.standardize_dtype(record.weights.dtype) == "float32"
        sums = to_numpy(keras.ops.sum(record.weights, axis=-1))
        real = sums > 0.5  # rows of padded queries may be all zero
        np.testing.assert_allclose(sums[real], 1.0, atol=1e-5)
    # norm statistics in float32: inputs ~1000 + 5 N(0,1), where half-precision means and
    # variances are off by whole standard deviations (bf16's spacing at 1000 is 8;
    # float16 sums overflow at 65504); compare with the float32 formula on the same
    # low-precision input, within the output's rounding.
    norms = [layer for layer in model._flatten_layers()
             if isinstance(layer, (keras.layers.LayerNormalization, RMSNorm))]
    assert norms
    raw = (1000.0 + 5.0 * np.random.default_rng(3).normal(size=(2, 3, 16))).astype("float32")
    low = to_numpy(keras.ops.cast(keras.ops.cast(raw, compute), "float32"))
    for norm in norms:
        out = norm(keras.ops.cast(raw, compute))
        assert keras.backend.standardize_dtype(out.dtype) == compute
        out = to_numpy(keras.ops.cast(out, "float32"))
        if isinstance(norm, RMSNorm):
            expected = _np_rms_norm(low, to_numpy(norm.scale), norm.epsilon)
        else:
            expected = _np_layer_norm(low, to_numpy(norm.gamma), to_numpy(norm.beta),
                                      norm.epsilon)
        np.testing.assert_allclose(out, expected, atol=4e-2, rtol=1e-2, err_msg=norm.name)
    # gradients: finite, float32, reaching every weight (float16 with a loss scale of
    # 1024, as the loss-scale optimizer starts with 2 ** 15 and halves on overflow)
    y = targets_of(model, x)
    loss, grads = gradients(model, x, y, scale=1024.0 if compute == "float16" else 1.0)
    assert np.isfinite(loss)
    assert all(np.isfinite(g).all() for g in grads)
    assert sum(bool(np.abs(g).max() > 0) for g in grads) >= 0.9 * len(grads)


FIT_FAMILIES = [family if family == "gpt" else pytest.param(family, marks=pytest.mark.slow)
                for family in FAMILIES]


@pytest.mark.spread
@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", FIT_FAMILIES)
def test_mixed_precision_compiled_training_step(family, policy):
    """Eight compiled steps with the training CLI's optimizer (`training.loop.make_optimizer`):
    finite loss, finite float32 weights that moved; float16 trains through Keras'
    `LossScaleOptimizer`. GPT by default, the other families in the slow run."""
    from training.loop import RunConfig, make_optimizer

    model = build(family, dropout=0.1, dtype=f"mixed_{policy}")
    x = inputs_of(family)
    y = targets_of(model, x)
    cfg = RunConfig(recipe="gpt_text", out="unused", mixed_precision=policy,
                    learning_rate=1e-3, warmup_steps=1)
    model.compile(optimizer=make_optimizer(cfg), loss="mse")
    is_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert is_scaled == (policy == "float16")
    before = weights(model)
    # (float16: a step whose scaled gradients overflow is skipped and the scale halved, from
    # 2 ** 15, so the first steps may leave the weights alone)
    losses = [float(model.train_on_batch(x, y)) for _ in range(8)]
    assert np.isfinite(losses).all(), losses
    after = weights(model)
    assert all(np.isfinite(w).all() for w in after)
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) > 0


@pytest.mark.slow
def test_accumulation_resumes_mid_update_from_a_checkpoint(tmp_path):
    """A run stopped after 4 batches of `--accumulate 3` (one batch into the second update:
    the checkpoint holds the accumulated gradient and the optimizer's batch counter) and
    resumed to 8 ends with the weights of an uninterrupted 8-batch run."""
    import os
    import subprocess
    import sys

    args = ["gpt_text", "--batch-size", "4", "--accumulate", "3", "--remat", "--seq-len",
            "32", "--max-chars", "20000", "--override", "num_layers=1", "--override",
            "layerdrop=0.3", "--verbose", "0", "--sample-tokens", "2", "--save-every", "2",
            "--max-epoch-steps", "4"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())

    def train(out, steps):
        subprocess.run([sys.executable, "-m", "training", *args, "--steps", str(steps),
                        "--out", str(out)], env=env, check=True, capture_output=True)

    train(tmp_path / "full", 8)
    train(tmp_path / "resumed", 4)
    train(tmp_path / "resumed", 8)
    with open(tmp_path / "resumed" / "metrics.json") as f:
        run = json.load(f)["run"]
    assert run["resumed_from_step"] == 4 and run["accumulate"] == 3
    assert run["effective_batch_size"] == 12
    full = kzoo.presets.load(str(tmp_path / "full" / "model"))
    resumed = kzoo.presets.load(str(tmp_path / "resumed" / "model"))
    for a, b in zip(full.weights, resumed.weights):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
