"""A randomized parity sweep of the T5 and ViT converters against Hugging Face transformers.

Hypothesis draws small transformers configurations over the options kzoo's converters say they
support (`kzoo/convert/t5.py`, `kzoo/convert/vit.py`), builds the transformers model, perturbs
every weight (norm weights and biases away from their ones / zeros), saves it with
`save_pretrained`, loads the directory with `kzoo.presets.load` and compares kzoo's outputs with
transformers' own, in float32, at atol 1e-5, on drawn batch sizes, lengths and padding masks.
The references are always transformers' outputs (and its `generate`), never kzoo itself.

T5 draws: `feed_forward_proj` (v1.0 "relu", v1.1 "gated-gelu" and the other plain / gated
activations the converter maps), `num_layers` != `num_decoder_layers`, `d_kv` unrelated to
`d_model / num_heads`, `relative_attention_num_buckets` (odd ones too) and
`relative_attention_max_distance`, `tie_word_embeddings` (the tied head scales the decoder
output by `d_model ** -0.5`), `layer_norm_epsilon`, `T5ForConditionalGeneration` (logits) or
`T5Model` (encoder and decoder states), older config.json files without the derived keys, right
or scattered padding; greedy generation with encoder padding against transformers' `generate`.

ViT draws: rectangular and square image / patch sizes, 1 or 3 channels, `qkv_bias`,
`hidden_act`, `layer_norm_eps`, `ViTForImageClassification` (any number of labels) or
`ViTModel` with or without its pooler, and (for square tables) inputs of another size against
transformers' `interpolate_pos_encoding=True`.

Options kzoo does not support are refused on load with a `ValueError` naming the option.

Relative-position buckets: kzoo's are transformers' wherever torch's float32 log is correctly
rounded; at the few settings where it is one ulp off and the exact value sits on a bucket
edge, kzoo keeps the correctly rounded log's bucket (Mesh TensorFlow's, every backend's).

Examples are derandomized: every run sees the same cases.

The sweeps (mark `sweep`) run on torch by default and on JAX and TensorFlow too with
`make test-all` (tests/conftest.py).
"""

import json
import math
import os
import tempfile

import keras
import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kzoo.presets
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM
from kzoo.models.vit import ViTBackbone, ViTClassifier
from tests.harness import QUICKER_LOOP, assert_matches_transformers, hf_checkpoint
from tests.test_t5 import _cut_at_stop
from tests.test_t5 import _hf_kwargs as _t5_hf_kwargs

ATOL = 1e-5
BACKEND = keras.backend.backend()
# Examples a parametrized sweep draws: JAX compiles each drawn model (~2 s a T5 on this
# machine), the other backends take a few tenths of a second.
EXAMPLES = 2 if BACKEND == "jax" else 4


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch on one thread while this file runs (then as it was). These matrices are tiny:
    on this 2-core machine under load, a (3, 20, 16) x (16, 24) `linear` took 0.9 ms on
    torch's two threads and 4 us on one, and the torch run of this file spent 15 of its 27 s
    in transformers' and kzoo's `linear` / `matmul`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sweep(examples):
    """Hypothesis settings of a sweep: `examples` cases, reproducible, no deadline (the first
    case of a JAX run compiles)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _perturb(model, seed, matrix_scale=0.05, vector_scale=0.2):
    """Adds noise to every parameter: norm weights leave 1, biases leave 0."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.add_(noise * (matrix_scale if p.ndim > 1 else vector_scale))


def _edit_config(path, drop=(), **changes):
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for key in drop:
        config.pop(key, None)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


# === T5 ===

# `feed_forward_proj` values the converter maps, with kzoo's name for each (transformers:
# "gated-gelu" is the tanh GELU "gelu_new"; plain "gelu" is the exact erf GELU).
T5_FEEDFORWARDS = {
    "relu": "relu",
    "gated-gelu": "gated-gelu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "silu": "silu",
    "swish": "silu",
    "gated-relu": "gated-relu",
    "gated-gelu_new": "gated-gelu",
    "gated-silu": "gated-silu",
    "gated-swish": "gated-silu",
    # transformers' other names of the tanh / exact GELU
    "gelu_pytorch_tanh": "gelu_new",
    "gelu_fast": "gelu_new",
    "gelu_python": "gelu",
    "gated-gelu_pytorch_tanh": "gated-gelu",
    "gated-gelu_fast": "gated-gelu",
}


def _first_then(first, *others):
    """`first`, or one of `others`: hypothesis' first (simplest) example takes `first`, so that
    a run of few examples starts from a typical value rather than the range's minimum."""
    return st.sampled_from((first,) + others)


def _ints(first, low, high):
    """An int in [low, high], `first` in hypothesis' first example (see `_first_then`)."""
    return _first_then(first, *(k for k in range(low, high + 1) if k != first))


# The feed-forwards of a version: v1.0 (ReLU), v1.1 (gated tanh-GELU) and the others the
# converter maps. The tie of the head is drawn too, its version's own tie first.
T5_VERSIONS = {
    "v1_0": (("relu",), True),
    "v1_1": (("gated-gelu",), False),
    "other": (("gated-silu", "gelu", "gelu_new", "gated-relu", "gated-gelu_new", "silu",
               "swish", "gated-swish", "gelu_pytorch_tanh", "gelu_fast", "gelu_python",
               "gated-gelu_pytorch_tanh", "gated-gelu_fast"), True),
}


@st.composite
def t5_cases(draw, version, architectures=("T5ForConditionalGeneration", "T5Model"),
             padded_encoder=False):
    """A transformers T5 config of `version` with batch, masks and seed. `padded_encoder`:
    at least two rows, the first one full and the others right-padded (for `generate`)."""
    feedforwards, tie = T5_VERSIONS[version]
    num_buckets = draw(st.one_of(_first_then(8, 32), st.integers(4, 40)))
    # transformers' bucketing needs more than num_buckets // 2 (the decoder's exact buckets):
    # log(max_distance / max_exact) is its divisor.
    max_distance = draw(st.one_of(st.integers(num_buckets // 2 + 1, 3 * num_buckets),
                                  st.sampled_from([128, 1000])))
    num_layers = draw(_first_then(2, 1, 3))
    config = dict(
        vocab_size=draw(st.integers(64, 128)),
        d_model=draw(_first_then(16, 8, 12, 24, 32, 48)),
        d_kv=draw(_first_then(6, 2, 3, 4, 5, 8, 11, 16)),  # heads * d_kv != d_model
        d_ff=draw(_first_then(24, 4, 7, 16, 33, 64)),
        num_layers=num_layers,
        num_decoder_layers=draw(_first_then(3 if num_layers != 3 else 1, 1, 2, 3)),
        num_heads=draw(_first_then(3, 1, 2, 4)),
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        layer_norm_epsilon=draw(_first_then(1e-6, 1e-5, 1e-3, 0.1)),
        feed_forward_proj=draw(st.sampled_from(feedforwards)),
        tie_word_embeddings=draw(_first_then(tie, not tie)),
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    if padded_encoder:
        batch = draw(_first_then(2, 3))
        enc_len = draw(_first_then(9, 4, 6, 13, 20))
        lengths = [enc_len] + [draw(st.integers(1, enc_len - 1)) for _ in range(batch - 1)]
        enc_mask = (np.arange(enc_len)[None] < np.asarray(lengths)[:, None]).astype("int32")
    else:
        batch = draw(_first_then(2, 1, 3))
        enc_mask = draw(_masks(batch, draw(_first_then(11, 1, 2, 5, 8, 16, 20))))
    dec_len = draw(_first_then(9, 1, 2, 4, 7, 12, 16))
    return dict(
        config=config,
        architecture=draw(st.sampled_from(architectures)),
        # an older config.json: no `dense_act_fn` / `is_gated_act` / `num_decoder_layers`
        # (transformers derives them again from `feed_forward_proj` / `num_layers`)
        legacy_config=draw(st.booleans()),
        batch=batch,
        enc_mask=enc_mask,
        dec_mask=draw(_masks(batch, dec_len)),
        seed=draw(st.integers(0, 2 ** 16)),
    )


@st.composite
def _masks(draw, batch, length):
    """A `(batch, length)` 0/1 padding mask with at least one real token a row: right padding
    (the first row full, the others' real lengths drawn) or scattered padding (any pattern
    with a real token)."""
    if draw(st.booleans()):
        rows = []
        for _ in range(batch):
            row = np.asarray(draw(st.lists(st.booleans(), min_size=length, max_size=length)))
            row[draw(st.integers(0, length - 1))] = True
            rows.append(row)
        return np.stack(rows).astype("int32")
    lengths = [length] + [draw(st.integers(1, length)) for _ in range(batch - 1)]
    return (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype("int32")


def _t5_hf_model(path, case):
    """The transformers T5 of `case`, perturbed and saved to `path` (config.json rewritten as an
    older transformers would have written it when `legacy_config`)."""
    config = transformers.T5Config(**case["config"])
    torch.manual_seed(case["seed"])
    hf = getattr(transformers, case["architecture"])(config).eval()
    _perturb(hf, case["seed"])
    if not config.tie_word_embeddings and hasattr(hf, "lm_head"):
        # transformers initialises an untied head N(0, 1): logits of +-25, where float32 is
        # only good to ~1e-5 itself. A quarter of it keeps them at the scale of the tied head.
        with torch.no_grad():
            hf.lm_head.weight.mul_(0.25)
    hf_checkpoint(path, hf)
    if case["legacy_config"]:
        drop = ["dense_act_fn", "is_gated_act"]
        if config.num_decoder_layers == config.num_layers:
            drop.append("num_decoder_layers")
        _edit_config(path, drop=drop)
    return hf


def _t5_inputs(case, vocab):
    """kzoo's inputs; padded positions hold arbitrary ids (never read)."""
    rng = np.random.default_rng(case["seed"])
    out = {}
    for side in ("encoder", "decoder"):
        mask = case[f"{side[:3]}_mask"]
        ids = rng.integers(2, vocab, mask.shape).astype("int32")
        out[f"{side}_token_ids"], out[f"{side}_padding_mask"] = ids, mask
    return out


def _check_t5_config(model, hf_config):
    backbone = model.backbone if isinstance(model, T5Seq2SeqLM) else model
    assert (backbone.num_layers, len(backbone.decoder_layers), backbone.num_heads,
            backbone.hidden_dim, backbone.key_value_dim, backbone.intermediate_dim) == (
        hf_config.num_layers, hf_config.num_decoder_layers, hf_config.num_heads,
        hf_config.d_model, hf_config.d_kv, hf_config.d_ff)
    assert backbone.relative_attention_num_buckets == hf_config.relative_attention_num_buckets
    assert backbone.relative_attention_max_distance == \
        hf_config.relative_attention_max_distance
    assert backbone.layer_norm_epsilon == hf_config.layer_norm_epsilon
    assert backbone.tie_embeddings == hf_config.tie_word_embeddings
    assert backbone.feedforward == T5_FEEDFORWARDS[hf_config.feed_forward_proj]


@pytest.mark.sweep
@pytest.mark.parametrize("version", sorted(T5_VERSIONS))
@sweep(EXAMPLES)
@given(data=st.data())
def test_t5_outputs_match_transformers(version, data):
    case = data.draw(t5_cases(version), label="case")
    with tempfile.TemporaryDirectory() as path:
        hf = _t5_hf_model(path, case)
        model = kzoo.presets.load(path)
    lm = case["architecture"] == "T5ForConditionalGeneration"
    assert isinstance(model, T5Seq2SeqLM if lm else T5Backbone)
    _check_t5_config(model, hf.config)
    inputs = _t5_inputs(case, hf.config.vocab_size)
    label = f"T5 {case['architecture']} {case['config']}"
    if lm:
        assert_matches_transformers(model, hf, inputs, _t5_hf_kwargs(inputs),
                                    mask=inputs["decoder_padding_mask"], atol=ATOL,
                                    label=label + " logits")
        return
    for side, hf_name in (("encoder", "encoder_last_hidden_state"),
                          ("decoder", "last_hidden_state")):
        assert_matches_transformers(
            model, hf, inputs, _t5_hf_kwargs(inputs), mask=inputs[f"{side}_padding_mask"],
            kzoo_select=lambda out, side=side: out[f"{side}_sequence_output"],
            select=lambda out, name=hf_name: getattr(out, name), atol=ATOL,
            label=f"{label} {side}")


@pytest.mark.sweep
@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
@sweep(EXAMPLES // 2)
@given(data=st.data())
def test_t5_greedy_generation_matches_transformers(version, data):
    """kzoo's `generate(strategy="greedy")` emits transformers' `generate(do_sample=False)`
    tokens, rows with encoder padding included (stop token 1, padding and start token 0)."""
    case = data.draw(t5_cases(version, architectures=("T5ForConditionalGeneration",),
                              padded_encoder=True), label="case")
    max_new_tokens = data.draw(_first_then(8, 3, 5, 10), label="max_new_tokens")
    with tempfile.TemporaryDirectory() as path:
        hf = _t5_hf_model(path, case)
        model = kzoo.presets.load(path)
    inputs = _t5_inputs(case, hf.config.vocab_size)
    ids, mask = inputs["encoder_token_ids"], inputs["encoder_padding_mask"]
    # (use_cache=False: transformers 4.57 sizes its decoder cache by `num_layers`, the encoder's
    # depth, and fails with an IndexError in cache_utils when num_decoder_layers is larger;
    # without a cache it recomputes the whole decoder at every step, the same tokens)
    with torch.no_grad():
        expected = hf.generate(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
            do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=1,
            pad_token_id=0, decoder_start_token_id=0, use_cache=False).numpy()
    assert np.all(expected[:, 0] == 0)
    expected = [_cut_at_stop(row, 1) for row in expected[:, 1:]]
    ours = model.generate({"encoder_token_ids": ids, "encoder_padding_mask": mask},
                          max_new_tokens=max_new_tokens, strategy="greedy",
                          compile=QUICKER_LOOP)
    assert ours == expected, (case["config"], ours, expected)


T5_TINY = dict(vocab_size=64, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_decoder_layers=1,
               num_heads=2, relative_attention_num_buckets=8,
               relative_attention_max_distance=16, dropout_rate=0.0)


@pytest.mark.parametrize(
    "architecture,config,edit,option",
    [
        # activations transformers has and kzoo does not (plain and gated)
        ("T5ForConditionalGeneration", {"feed_forward_proj": "gated-tanh"}, {},
         "feed_forward_proj"),
        ("T5ForConditionalGeneration", {"feed_forward_proj": "tanh"}, {}, "feed_forward_proj"),
        ("T5ForConditionalGeneration", {"feed_forward_proj": "quick_gelu"}, {},
         "feed_forward_proj"),
        ("T5ForConditionalGeneration", {"feed_forward_proj": "gated-gelu_python"}, {},
         "feed_forward_proj"),
        ("T5Model", {"feed_forward_proj": "relu6"}, {}, "feed_forward_proj"),
        # an explicit exact-GELU gate (dense_act_fn overrides feed_forward_proj)
        ("T5ForConditionalGeneration", {"feed_forward_proj": "gated-gelu"},
         {"dense_act_fn": "gelu"}, "dense_act_fn"),
        # task heads kzoo has no model for
        ("T5EncoderModel", {}, {}, "architectures"),
        ("T5ForSequenceClassification", {}, {}, "architectures"),
        ("T5ForQuestionAnswering", {}, {}, "architectures"),
        ("T5ForTokenClassification", {}, {}, "architectures"),
        # encoder and decoder sharing their weights
        ("T5ForConditionalGeneration", {}, {"tie_encoder_decoder": True},
         "tie_encoder_decoder"),
        # bucket settings where transformers divides by log(1) or log(< 1)
        ("T5ForConditionalGeneration", {"relative_attention_num_buckets": 3},
         {}, "relative_attention_num_buckets"),
        ("T5ForConditionalGeneration",
         {"relative_attention_num_buckets": 16, "relative_attention_max_distance": 8}, {},
         "relative_attention_max_distance"),
        ("T5ForConditionalGeneration",
         {"relative_attention_num_buckets": 9, "relative_attention_max_distance": 3}, {},
         "relative_attention_max_distance"),
        # heads pruned from some layers (kzoo's layers all have num_heads heads)
        ("T5ForConditionalGeneration", {}, {"pruned_heads": {"0": [1]}}, "pruned_heads"),
    ],
)
def test_t5_unsupported_options_are_refused(tmp_path, architecture, config, edit, option):
    hf_config = transformers.T5Config(**{**T5_TINY, **config})
    torch.manual_seed(0)
    hf_checkpoint(tmp_path, getattr(transformers, architecture)(hf_config))
    _edit_config(tmp_path, **edit)
    with pytest.raises(ValueError, match=option):
        kzoo.presets.load(tmp_path)


# --- The relative position buckets ---

def _hf_buckets(relative, bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(
        torch.tensor(relative), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance).numpy()


def _kzoo_buckets(relative, bidirectional, num_buckets, max_distance):
    from kzoo.layers.position import relative_position_bucket

    return np.asarray(keras.ops.convert_to_numpy(relative_position_bucket(
        relative, bidirectional, num_buckets, max_distance)))


def _torch_log_is_correctly_rounded(relative, bidirectional, num_buckets):
    """Per relative position: whether torch's float32 log of transformers' ratio
    `distance / max_exact` is the correctly rounded one (True where no log is taken)."""
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = half // 2
    distance = np.abs(relative) if bidirectional else np.maximum(-relative, 0)
    ratio = np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact)
    torch_log = torch.log(torch.from_numpy(ratio)).numpy()
    exact_log = np.log(ratio.astype(np.float64)).astype(np.float32)
    return (distance < max_exact) | (torch_log == exact_log)


def _correctly_rounded_buckets(relative, bidirectional, num_buckets, max_distance):
    """Mesh TensorFlow's T5 bucket formula (the original T5's) in float32 with a correctly
    rounded log (TensorFlow's and XLA's float32 log at these ratios)."""
    offset = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        offset = (relative > 0) * num_buckets
        distance = np.abs(relative)
    else:
        distance = np.maximum(-relative, 0)
    max_exact = num_buckets // 2
    ratio = np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact)
    log = np.log(ratio.astype(np.float64)).astype(np.float32)
    scaled = log / np.float32(math.log(max_distance / max_exact)) * np.float32(
        num_buckets - max_exact)
    large = np.minimum(max_exact + np.trunc(scaled).astype(np.int64), num_buckets - 1)
    return offset + np.where(distance < max_exact, distance, large)


def _assert_buckets(num_buckets, bidirectional, max_distance):
    """kzoo's bucket of every relative position in [-300, 300] is transformers' wherever
    torch's float32 log of the ratio is correctly rounded; where it is one ulp off (torch's
    vectorised log on CPU), kzoo keeps the bucket of the correctly rounded log, as Mesh
    TensorFlow's T5 computes it with TensorFlow's log (and as XLA's log gives), so that its
    buckets are the same on every backend and device."""
    relative = np.arange(-300, 301)
    ours = _kzoo_buckets(relative, bidirectional, num_buckets, max_distance)
    theirs = _hf_buckets(relative, bidirectional, num_buckets, max_distance)
    rounded = _torch_log_is_correctly_rounded(relative, bidirectional, num_buckets)
    np.testing.assert_array_equal(ours[rounded], theirs[rounded])
    np.testing.assert_array_equal(
        ours, _correctly_rounded_buckets(relative, bidirectional, num_buckets, max_distance))


@sweep(30)
@given(num_buckets=st.integers(4, 64), bidirectional=st.booleans(), data=st.data())
def test_relative_position_buckets_match_transformers(num_buckets, bidirectional, data):
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = data.draw(st.one_of(st.integers(max_exact + 1, 4 * num_buckets),
                                       st.sampled_from([128, 256, 1000])))
    _assert_buckets(num_buckets, bidirectional, max_distance)


# Every (num_buckets, bidirectional, max_distance) of the drawn range (num_buckets 4..64,
# max_distance up to 4 * num_buckets, 128, 256, 1000) where some distance's bucket differs
# from transformers' on this CPU: in each, torch's float32 log of the ratio is one ulp off
# where the exact value of log(d / max_exact) / log(max_distance / max_exact) *
# (num_buckets - max_exact) is an integer (e.g. 27 / 8 = 1.5 ** 3 at 17 buckets, distance 12).
EXACT_LOG_RATIO_CASES = [
    (17, False, 27), (19, False, 25), (34, True, 27), (35, True, 27), (36, False, 50),
    (38, True, 25), (39, True, 25), (48, False, 81), (51, False, 81), (54, False, 125),
    (55, False, 75),
]


@pytest.mark.parametrize("num_buckets,bidirectional,max_distance", EXACT_LOG_RATIO_CASES)
def test_relative_position_buckets_where_torchs_log_is_one_ulp_off(num_buckets, bidirectional,
                                                                   max_distance):
    _assert_buckets(num_buckets, bidirectional, max_distance)


# === ViT ===

VIT_ACTIVATIONS = ("gelu", "gelu_python", "gelu_new", "gelu_fast", "gelu_pytorch_tanh",
                   "gelu_python_tanh", "quick_gelu", "relu", "silu", "swish", "tanh", "sigmoid",
                   "linear", "gelu_accurate")


@st.composite
def vit_cases(draw, architecture):
    if draw(_first_then("square", "rectangular")) == "square":
        patch = draw(_first_then(4, 2, 8))
        side = draw(_ints(4 if patch < 8 else 3, 1, 32 // patch))
        image_size, patch_size = patch * side, patch
    else:  # rectangular image and / or patches, given as [height, width] lists
        patch = [draw(_first_then(4, 2, 8)), draw(_first_then(2, 4, 8))]
        image_size = [patch[0] * draw(_ints(3, 1, 32 // patch[0])),
                      patch[1] * draw(_ints(2, 1, 32 // patch[1]))]
        patch_size = patch if patch[0] != patch[1] or draw(st.booleans()) else patch[0]
    num_heads = draw(_first_then(2, 1, 3, 4))
    config = dict(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=draw(_first_then(3, 1)),
        hidden_size=num_heads * draw(_ints(8, 2, 16)),
        num_hidden_layers=draw(_first_then(2, 1, 3)),
        num_attention_heads=num_heads,
        intermediate_size=draw(_ints(24, 4, 64)),
        hidden_act=draw(st.sampled_from(VIT_ACTIVATIONS)),
        layer_norm_eps=draw(_first_then(1e-12, 1e-6, 1e-5, 1e-3, 0.1)),
        qkv_bias=draw(_first_then(True, False)),
        num_labels=draw(_ints(5, 1, 10)),
    )
    # transformers interpolates a square table only (and needs an int patch size): inputs of
    # other sizes are drawn for those (the first example: a 20 x 12 image on a 4 x 4 table)
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    interpolate = isinstance(image_size, int) and draw(_first_then(True, False))
    if interpolate:
        size = (patch * draw(_ints(5, 1, 32 // patch)), patch * draw(_ints(3, 1, 32 // patch)))
    return dict(config=config, architecture=architecture, size=size, interpolate=interpolate,
                batch=draw(_first_then(2, 1, 3)), legacy_config=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 16)))


def _vit_hf_model(path, case):
    config = transformers.ViTConfig(**case["config"])
    torch.manual_seed(case["seed"])
    if case["architecture"] == "ViTForImageClassification":
        hf = transformers.ViTForImageClassification(config)
    else:
        hf = transformers.ViTModel(config,
                                   add_pooling_layer=case["architecture"] == "ViTModel")
    _perturb(hf, case["seed"])
    if hasattr(hf, "classifier"):
        # transformers' N(0, 0.02) head gives logits of ~0.2; a larger one ~2-5, so that the
        # 1e-5 bound says something
        with torch.no_grad():
            hf.classifier.weight.mul_(20.0)
    hf.eval()
    hf_checkpoint(path, hf)
    if case["legacy_config"] and config.qkv_bias:
        _edit_config(path, drop=["qkv_bias"])  # configs older than the field (default True)
    return hf


@pytest.mark.sweep
@pytest.mark.parametrize("architecture", ["ViTForImageClassification", "ViTModel",
                                          "ViTModel-no-pooler"])
@sweep(EXAMPLES)
@given(data=st.data())
def test_vit_outputs_match_transformers(architecture, data):
    case = data.draw(vit_cases(architecture), label="case")
    with tempfile.TemporaryDirectory() as path:
        hf = _vit_hf_model(path, case)
        model = kzoo.presets.load(path)
    cfg = hf.config
    classifier = case["architecture"] == "ViTForImageClassification"
    assert isinstance(model, ViTClassifier if classifier else ViTBackbone)
    backbone = model.backbone if classifier else model
    assert (backbone.num_channels, backbone.num_layers, backbone.num_heads, backbone.hidden_dim,
            backbone.intermediate_dim, backbone.qkv_bias, backbone.layer_norm_epsilon) == (
        cfg.num_channels, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size,
        cfg.intermediate_size, cfg.qkv_bias, cfg.layer_norm_eps)
    if classifier:
        assert model.num_classes == cfg.num_labels
    images = np.random.default_rng(case["seed"]).normal(
        size=(case["batch"], *case["size"], cfg.num_channels)).astype("float32")
    hf_inputs = dict(pixel_values=np.ascontiguousarray(images.transpose(0, 3, 1, 2)),
                     interpolate_pos_encoding=case["interpolate"])
    assert_matches_transformers(model, hf, images, hf_inputs, atol=ATOL,
                                label=f"ViT {case['architecture']} {case['config']} "
                                      f"at {case['size']}")


VIT_TINY = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=12)


@pytest.mark.parametrize(
    "architecture,config,edit,option",
    [
        # image sizes the patches do not divide (transformers drops the last pixels)
        ("ViTForImageClassification", {"image_size": 18}, {}, "patch_size"),
        ("ViTModel", {"image_size": [16, 18]}, {}, "patch_size"),
        ("ViTModel", {"image_size": 16, "patch_size": [4, 3]}, {}, "patch_size"),
        # activations transformers has and kzoo does not
        ("ViTForImageClassification", {"hidden_act": "gelu_10"}, {}, "hidden_act"),
        ("ViTForImageClassification", {"hidden_act": "relu2"}, {}, "hidden_act"),
        ("ViTModel", {"hidden_act": "mish"}, {}, "hidden_act"),
        ("ViTModel", {"hidden_act": "relu6"}, {}, "hidden_act"),
        ("ViTModel", {"hidden_act": "leaky_relu"}, {}, "hidden_act"),
        # a head kzoo has no model for
        ("ViTForMaskedImageModeling", {}, {}, "architectures"),
        # heads pruned from some layers
        ("ViTForImageClassification", {}, {"pruned_heads": {"0": [1]}}, "pruned_heads"),
    ],
)
def test_vit_unsupported_options_are_refused(tmp_path, architecture, config, edit, option):
    hf_config = transformers.ViTConfig(**{**VIT_TINY, **config})
    torch.manual_seed(0)
    hf_checkpoint(tmp_path, getattr(transformers, architecture)(hf_config))
    _edit_config(tmp_path, **edit)
    with pytest.raises(ValueError, match=option):
        kzoo.presets.load(tmp_path)
