"""Property tests (hypothesis) of the family configs and of whole models' round trips.

Configs: for every family, hypothesis draws a small *valid* configuration (honouring the rules
between fields, with NumPy scalars mixed in where a user might pass them), which must build and
normalise to plain Python values; then it corrupts ONE field with a drawn invalid value (wrong
type, negative, zero, NaN/inf, a bool where an int is expected, an unknown string choice, a
head count that does not divide the width, a bound broken ...) and the config, the backbone
constructor and `from_dict` must raise a `FieldError` (a `ValueError`) whose `.field` is that
field and whose message names it.

The allowed values and rules written here come from the documentation of each config
(docstrings, docs/ARCHITECTURE.md), never read back from the code under test.

Models: hypothesis draws tiny models of each family and checks that each survives a `.keras`
save/load, a `kzoo.presets.save` / `load` directory and a Hugging Face export, which
transformers loads with the same outputs as kzoo and which kzoo imports back with the same
outputs. A longer run of the same property is marked slow.

Examples are derandomized, so CI sees the same cases every run.
"""

import json
import math
import os
import tempfile

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kzoo
from kzoo.layers.utils import FieldError
from kzoo.models.bert import BertBackbone, BertConfig
from kzoo.models.gpt import GPTBackbone, GPTConfig
from kzoo.models.graphormer import GraphormerBackbone, GraphormerConfig
from kzoo.models.t5 import T5Backbone, T5Config
from kzoo.models.vit import ViTBackbone, ViTConfig
from tests.harness import outputs_of, to_numpy, torch_forward

# === The rules, written out from the documentation ===

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_tanh", "linear", "quick_gelu",
               "relu", "sigmoid", "silu", "swish", "tanh")
T5_FEEDFORWARDS = ("relu", "gelu", "gelu_new", "silu", "gated-relu", "gated-gelu",
                   "gated-gelu_new", "gated-silu")
KERNELS = ("auto", "reference", "fused", "chunked")

# The kind of each field: ("pos_int" | "nonneg_int" | "rate" | "pos_float" | "number" |
# "bool" | "int_or_pair", allow_none) or ("choice" | "choice_or_none", allowed values).
POS_INT, NONNEG_INT, RATE, POS_FLOAT, NUMBER, BOOL, PAIR = (
    "pos_int", "nonneg_int", "rate", "pos_float", "number", "bool", "int_or_pair")
CHOICE_OR_NONE = "choice_or_none"  # one of the allowed values, or None
# The efficient attention types (kzoo.layers.efficient_attention's table) and their options:
# a dict, None for "full" (the valid configs here keep "full").
ATTENTION_TYPES = ("full", "sliding_window", "strided", "longformer", "block_sparse",
                   "bigbird", "linear", "performer")
OPTIONS = "attention_options"
ATTENTION_FIELDS = dict(attention=("choice", ATTENTION_TYPES), attention_options=(OPTIONS, True))
# The memory savers every family has (gradient checkpointing, LayerDrop).
SAVERS = dict(remat=(BOOL, False), layerdrop=(RATE, False))

KINDS = {
    "gpt": dict(
        vocabulary_size=(POS_INT, False), num_layers=(POS_INT, False),
        num_heads=(POS_INT, False), hidden_dim=(POS_INT, False),
        intermediate_dim=(POS_INT, False), max_sequence_length=(POS_INT, False),
        dropout=(RATE, False), layer_norm_epsilon=(POS_FLOAT, False),
        activation=("choice", ACTIVATIONS), norm=("choice", ("layernorm", "rmsnorm")),
        position=("choice", ("learned", "rotary")),
        feedforward=("choice", ("plain", "gated", "moe")), num_kv_heads=(POS_INT, True),
        use_bias=(BOOL, False), rope_max_wavelength=(POS_FLOAT, False),
        num_experts=(POS_INT, True), top_k=(POS_INT, False), capacity_factor=(POS_FLOAT, True),
        expert_type=("choice", ("plain", "gated")), tie_embeddings=(BOOL, False),
        attention_scale=(POS_FLOAT, True), initializer_range=(POS_FLOAT, False),
        **ATTENTION_FIELDS, packed_inputs=(BOOL, False), **SAVERS,
        head_dim=(POS_INT, True),  # even with rotary positions (see CROSS)
        rope_scaling_type=(CHOICE_OR_NONE, ("linear", "llama3", "yarn")),  # rotary only
        rope_scaling_factor=(POS_FLOAT, False),  # 1.0 without a scaling type (see CROSS)
        # the llama3 settings: required by it, None otherwise; high > low (see CROSS)
        rope_low_freq_factor=(POS_FLOAT, True), rope_high_freq_factor=(POS_FLOAT, True),
        rope_original_max_position_embeddings=(POS_INT, True),  # llama3 and yarn
        # the other yarn settings: None otherwise; beta_fast > beta_slow (see CROSS)
        rope_beta_fast=(POS_FLOAT, True), rope_beta_slow=(POS_FLOAT, True),
        rope_attention_factor=(POS_FLOAT, True), rope_truncate=(BOOL, True),
        attention_scale_by_inverse_layer=(BOOL, False),
    ),
    "bert": dict(
        vocabulary_size=(POS_INT, False), num_layers=(POS_INT, False),
        num_heads=(POS_INT, False), hidden_dim=(POS_INT, False),
        intermediate_dim=(POS_INT, False), max_sequence_length=(POS_INT, False),
        num_segments=(POS_INT, False), dropout=(RATE, False), attention_dropout=(RATE, True),
        layer_norm_epsilon=(POS_FLOAT, False), activation=("choice", ACTIVATIONS),
        initializer_range=(POS_FLOAT, False), **ATTENTION_FIELDS,
        packed_inputs=(BOOL, False), **SAVERS,
        position_padding_id=(NONNEG_INT, True),  # not with packed_inputs (see CROSS)
    ),
    "t5": dict(
        vocabulary_size=(POS_INT, False), num_layers=(POS_INT, False),
        num_decoder_layers=(POS_INT, True), num_heads=(POS_INT, False),
        hidden_dim=(POS_INT, False), key_value_dim=(POS_INT, False),
        intermediate_dim=(POS_INT, False), dropout=(RATE, False),
        layer_norm_epsilon=(POS_FLOAT, False), feedforward=("choice", T5_FEEDFORWARDS),
        relative_attention_num_buckets=(POS_INT, False),  # and >= 4 (see CROSS)
        relative_attention_max_distance=(POS_INT, False),  # and > buckets // 2 (see CROSS)
        tie_embeddings=(BOOL, False), kernel=("choice", KERNELS), **SAVERS,
    ),
    "vit": dict(
        image_size=(PAIR, False), patch_size=(PAIR, False), num_channels=(POS_INT, False),
        num_layers=(POS_INT, False), num_heads=(POS_INT, False), hidden_dim=(POS_INT, False),
        intermediate_dim=(POS_INT, False), dropout=(RATE, False),
        attention_dropout=(RATE, False), layer_norm_epsilon=(POS_FLOAT, False),
        activation=("choice", ACTIVATIONS), use_class_token=(BOOL, False),
        qkv_bias=(BOOL, False), **ATTENTION_FIELDS, **SAVERS,
    ),
    "graphormer": dict(
        num_atoms=(POS_INT, False), num_in_degree=(POS_INT, False),
        num_out_degree=(POS_INT, False), num_edges=(POS_INT, False),
        num_spatial=(POS_INT, False), num_edge_dis=(POS_INT, False),
        edge_type=("choice", ("multi_hop", "single_hop")),
        multi_hop_max_dist=(NONNEG_INT, False), num_layers=(POS_INT, False),
        hidden_dim=(POS_INT, False), intermediate_dim=(POS_INT, False),
        num_heads=(POS_INT, False), dropout=(RATE, False), attention_dropout=(RATE, False),
        activation_dropout=(RATE, False), activation=("choice", ACTIVATIONS),
        pre_layernorm=(BOOL, False), layer_norm_epsilon=(POS_FLOAT, False),
        encoder_normalize_before=(BOOL, False), embed_scale=(NUMBER, True),
        apply_graphormer_init=(BOOL, False), use_attention_bias=(BOOL, False),
        num_frozen_layers=(NONNEG_INT, False),  # and <= num_layers (see CROSS)
        **SAVERS,
    ),
}

CLASSES = {
    "gpt": (GPTConfig, GPTBackbone), "bert": (BertConfig, BertBackbone),
    "t5": (T5Config, T5Backbone), "vit": (ViTConfig, ViTBackbone),
    "graphormer": (GraphormerConfig, GraphormerBackbone),
}
FAMILIES = sorted(CLASSES)


def test_the_tables_cover_every_field():
    for family, (config_class, _) in CLASSES.items():
        assert sorted(config_class.field_names()) == sorted(KINDS[family]), family


# === Valid configurations ===
#
# Hypothesis tries the simplest draw first (the first entry of each `sampled_from`, the low
# end of each range) and the default suite runs one or two models a family, so the choices
# below are ordered richest first: the first model of each family is a non-trivial one.


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _heads_and_width(draw, even_head=False, max_heads=4):
    heads = draw(st.sampled_from([2, 1, 3, 4][:max_heads]))
    head_size = draw(st.sampled_from([4, 2, 6] if even_head else [3, 2, 4, 5]))
    return heads, heads * head_size


_LAYERS = st.sampled_from([2, 1])
_RATES = st.sampled_from([0.0, 0.1, 0.5, 0.999])
_EPS = st.sampled_from([1e-12, 1e-6, 1e-5, 0.01])
_SCALE = st.sampled_from([0.02, 0.1, 1.0])


@st.composite
def gpt_config(draw, exportable=False):
    if exportable:  # GPT-2, LLaMA or Mixtral (kzoo.convert.gpt.to_hf)
        style = draw(st.sampled_from(["mixtral", "gpt2", "llama"]))
    else:
        style = None
    rotary = style in ("llama", "mixtral") or (style is None and draw(st.booleans()))
    heads, width = draw(_heads_and_width(even_head=rotary))
    if style == "gpt2":
        feedforward, norm, kv_heads = "plain", "layernorm", None
    elif style == "llama":
        feedforward, norm = "gated", "rmsnorm"
        kv_heads = draw(st.sampled_from(_divisors(heads)))
    elif style == "mixtral":
        feedforward, norm = "moe", "rmsnorm"
        kv_heads = draw(st.sampled_from(_divisors(heads)))
    else:
        feedforward = draw(st.sampled_from(["moe", "plain", "gated"]))
        norm = draw(st.sampled_from(["layernorm", "rmsnorm"]))
        kv_heads = draw(st.one_of(st.none(), st.sampled_from(_divisors(heads))))
    num_experts = draw(st.sampled_from([3, 1, 2])) if feedforward == "moe" else None
    config = dict(
        vocabulary_size=draw(st.integers(2, 40)),
        num_layers=draw(_LAYERS),
        num_heads=heads, hidden_dim=width,
        intermediate_dim=draw(st.integers(1, 24)),
        max_sequence_length=draw(st.integers(8, 16)),
        dropout=draw(_RATES),
        layer_norm_epsilon=draw(_EPS),
        activation=draw(st.sampled_from(
            ["gelu", "gelu_tanh", "relu", "silu"] if exportable else ACTIVATIONS)),
        norm=norm,
        position="rotary" if rotary else "learned",
        feedforward=feedforward,
        num_kv_heads=kv_heads,
        use_bias=False if style == "mixtral" else (
            True if style == "gpt2" else draw(st.booleans())),
        rope_max_wavelength=draw(st.sampled_from([10000, 500.0, 1e6])),
        num_experts=num_experts,
        top_k=draw(st.integers(1, num_experts)) if num_experts else draw(st.integers(1, 4)),
        capacity_factor=None if exportable else draw(st.sampled_from([None, 1.0, 2.5])),
        expert_type="gated" if exportable else draw(st.sampled_from(["plain", "gated"])),
        tie_embeddings=draw(st.booleans()),
        attention_scale=None if style != "gpt2" and exportable else draw(
            st.sampled_from([None, 1.0] if exportable else [None, 1.0, 0.3])),
        attention_scale_by_inverse_layer=(
            False if style != "gpt2" and exportable else draw(st.booleans())),
        initializer_range=draw(_SCALE),
    )
    if rotary:  # heads of another size than width / heads, RoPE scaling
        config["head_dim"] = draw(st.sampled_from([None, 2, 6]))
        kind = draw(st.sampled_from([None, "linear", "llama3", "yarn"]))
        if kind is not None:
            config.update(rope_scaling_type=kind,
                          rope_scaling_factor=draw(st.sampled_from([2.0, 8, 0.5])))
        if kind == "llama3":
            config.update(rope_low_freq_factor=draw(st.sampled_from([1.0, 0.5])),
                          rope_high_freq_factor=draw(st.sampled_from([4.0, 2])),
                          rope_original_max_position_embeddings=draw(st.sampled_from([4, 16])))
        if kind == "yarn":
            config.update(rope_original_max_position_embeddings=draw(st.sampled_from([4, 16])),
                          rope_beta_fast=draw(st.sampled_from([None, 32.0, 8])),
                          rope_beta_slow=draw(st.sampled_from([None, 1.0, 2])),
                          rope_attention_factor=draw(st.sampled_from([None, 1.0, 1.5])),
                          rope_truncate=draw(st.sampled_from([None, True, False])))
    return config


@st.composite
def bert_config(draw, exportable=False):
    heads, width = draw(_heads_and_width())
    return dict(
        vocabulary_size=draw(st.integers(2, 40)), num_layers=draw(_LAYERS),
        num_heads=heads, hidden_dim=width, intermediate_dim=draw(st.integers(1, 24)),
        max_sequence_length=draw(st.integers(8, 16)), num_segments=draw(st.integers(1, 3)),
        dropout=draw(_RATES), attention_dropout=draw(st.one_of(st.none(), _RATES)),
        layer_norm_epsilon=draw(_EPS),
        activation=draw(st.sampled_from(
            ["gelu", "gelu_new", "gelu_tanh", "relu", "silu"] if exportable else ACTIVATIONS)),
        initializer_range=draw(_SCALE),
    )


@st.composite
def t5_config(draw, exportable=False):
    buckets = draw(st.integers(4, 12))
    return dict(
        vocabulary_size=draw(st.integers(2, 40)), num_layers=draw(_LAYERS),
        num_decoder_layers=draw(st.one_of(st.none(), st.integers(1, 2))),
        num_heads=draw(st.sampled_from([2, 1, 3])), hidden_dim=draw(st.integers(5, 12)),
        key_value_dim=draw(st.integers(3, 6)), intermediate_dim=draw(st.integers(1, 16)),
        dropout=draw(_RATES), layer_norm_epsilon=draw(_EPS),
        feedforward=draw(st.sampled_from(T5_FEEDFORWARDS[::-1])),  # gated first
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=draw(st.integers(buckets // 2 + 1, 40)),
        tie_embeddings=draw(st.booleans()),
        kernel=draw(st.sampled_from(["auto", "reference"] if exportable else KERNELS)),
    )


@st.composite
def _size_and_patch(draw):
    patch = draw(st.sampled_from([2, 1, 3, 4]))
    size = patch * draw(st.sampled_from([2, 1, 3]))
    return size, patch


@st.composite
def vit_config(draw, exportable=False):
    heads, width = draw(_heads_and_width())
    (h, ph), (w, pw) = draw(_size_and_patch()), draw(_size_and_patch())
    if draw(st.booleans()):  # square: sizes may be one int
        w, pw = h, ph
        image = draw(st.sampled_from([h, (h, h), [h, h]]))
        patch = draw(st.sampled_from([ph, (ph, ph)]))
    else:
        image = draw(st.sampled_from([(h, w), [h, w]]))
        patch = ph if ph == pw and draw(st.booleans()) else (ph, pw)
    return dict(
        image_size=image, patch_size=patch, num_channels=draw(st.integers(1, 3)),
        num_layers=draw(_LAYERS), num_heads=heads, hidden_dim=width,
        intermediate_dim=draw(st.integers(1, 24)), dropout=draw(_RATES),
        attention_dropout=draw(_RATES), layer_norm_epsilon=draw(_EPS),
        activation=draw(st.sampled_from(
            ["gelu", "gelu_new", "relu", "silu"] if exportable else ACTIVATIONS)),
        use_class_token=True if exportable else draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
    )


@st.composite
def graphormer_config(draw, exportable=False):
    heads, width = draw(_heads_and_width())
    edge_dis = draw(st.sampled_from([3, 1, 2, 6]))
    edge_type = draw(st.sampled_from(["multi_hop", "single_hop"]))
    num_layers = draw(_LAYERS)
    return dict(
        # Graph inputs from kzoo.graphs use ids up to 512 * columns + offsets; the tables
        # stay small when the test's graphs use few, small features.
        num_atoms=draw(st.integers(8, 40)), num_in_degree=draw(st.integers(6, 12)),
        num_out_degree=draw(st.integers(6, 12)), num_edges=draw(st.integers(8, 24)),
        num_spatial=draw(st.integers(8, 24)), num_edge_dis=edge_dis, edge_type=edge_type,
        # 0 (no multi-hop cut) is valid; inputs from kzoo.graphs need a positive cut.
        multi_hop_max_dist=draw(st.integers(int(exportable), edge_dis))
        if edge_type == "multi_hop" else draw(st.integers(int(exportable), 10)),
        num_layers=num_layers, hidden_dim=width, intermediate_dim=draw(st.integers(1, 24)),
        num_heads=heads, dropout=draw(_RATES), attention_dropout=draw(_RATES),
        activation_dropout=draw(_RATES),
        activation=draw(st.sampled_from(["gelu", "relu"] if exportable else ACTIVATIONS)),
        pre_layernorm=draw(st.booleans()),
        layer_norm_epsilon=1e-5 if exportable else draw(_EPS),
        encoder_normalize_before=draw(st.booleans()),
        embed_scale=draw(st.sampled_from([None, 0.5, 2.0] + ([] if exportable else [-1.0, 0]))),
        apply_graphormer_init=draw(st.booleans()), use_attention_bias=draw(st.booleans()),
        num_frozen_layers=draw(st.integers(0, num_layers)),
    )


VALID = {"gpt": gpt_config, "bert": bert_config, "t5": t5_config, "vit": vit_config,
         "graphormer": graphormer_config}


def _numpy_scalar(draw, value):
    """`value`, or the same value as a NumPy scalar of a drawn type (what a user computing a
    size with NumPy passes)."""
    if isinstance(value, (bool, np.bool_)):
        return draw(st.sampled_from([value, np.bool_(value)]))
    if isinstance(value, int):
        return draw(st.sampled_from([value, np.int64(value), np.int32(value), np.uint16(value)]))
    if isinstance(value, float):
        return draw(st.sampled_from([value, np.float64(value)]))
    if isinstance(value, str):
        return draw(st.sampled_from([value, np.str_(value)]))
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy_scalar(draw, v) for v in value)
    return value


def _plain(value):
    """What a config must store for a given value: plain Python scalars, pairs as tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


PLAIN_TYPES = (int, float, bool, str, tuple, type(None))

CONFIG_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, print_blob=True,
                           suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.spread
@pytest.mark.parametrize("family", FAMILIES)
def test_valid_configs_build_and_normalise(family):
    config_class, backbone_class = CLASSES[family]

    @CONFIG_SETTINGS
    @given(st.data())
    def check(data):
        plain = data.draw(VALID[family]())
        values = {k: _numpy_scalar(data.draw, v) for k, v in plain.items()}
        config = config_class(**values)
        for name, value in plain.items():
            stored = getattr(config, name)
            assert type(stored) in PLAIN_TYPES, (name, type(stored))
            assert isinstance(stored, bool) == isinstance(_plain(value), bool), name
            assert stored == _plain(value), (name, stored, value)
        # Plain values make configs hashable values that JSON round-trips to an equal one.
        assert hash(config) == hash(config_class(**plain))
        text = json.dumps(config.to_dict())
        assert config_class.from_dict(json.loads(text), source="x.json") == config

    check()


# === One corrupted field ===

_JUNK = st.one_of(
    st.text(max_size=4), st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.just(np.array([1, 2])), st.just(object()), st.just(b"8"),
)
_BAD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, np.float32("nan"),
                               np.float64("inf")])
_BOOLS = st.sampled_from([True, False, np.bool_(True), np.bool_(False)])
_NOT_INTEGRAL = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # 2.0 too: an int field is no float
    st.just(np.float64(4.0)), _BOOLS, _JUNK,
)


def invalid_values(kind, allow_none):
    """A strategy of values no field of this kind accepts (whatever the other fields)."""
    none = st.nothing() if allow_none else st.none()
    if kind == POS_INT:
        return st.one_of(st.integers(max_value=0), st.just(np.int64(-3)), _NOT_INTEGRAL, none)
    if kind == NONNEG_INT:
        return st.one_of(st.integers(max_value=-1), st.just(np.int32(-1)), _NOT_INTEGRAL, none)
    if kind == RATE:
        return st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-300),
                         st.integers(min_value=1), _BAD_FLOATS, _BOOLS, _JUNK, none)
    if kind == POS_FLOAT:
        return st.one_of(st.floats(max_value=0.0), st.integers(max_value=0), _BAD_FLOATS,
                         _BOOLS, _JUNK, none)
    if kind == NUMBER:
        return st.one_of(_BAD_FLOATS, _BOOLS, _JUNK, none)
    if kind == BOOL:
        return st.one_of(st.integers(), st.floats(), st.just(np.int64(1)),
                         st.sampled_from(["True", "false", "yes"]), _JUNK, none)
    if kind == PAIR:
        return st.one_of(
            st.integers(max_value=0), st.floats(), _BOOLS, st.text(max_size=3), none,
            st.lists(st.integers(1, 8), min_size=3, max_size=4),  # not a pair
            st.lists(st.integers(1, 8), max_size=1),
            st.tuples(st.integers(max_value=0), st.integers(1, 8)),
            st.tuples(st.integers(1, 8), st.floats()),
            st.tuples(st.integers(1, 8), _BOOLS),
        )
    if kind == OPTIONS:  # with attention="full", which takes no option
        return st.one_of(
            st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2), _BOOLS,
            st.dictionaries(st.sampled_from(["window", "block_size", "num_features", "x"]),
                            st.integers(-3, 8), min_size=1, max_size=2),
        )
    allowed = allow_none  # ("choice", allowed)
    if kind == CHOICE_OR_NONE:
        none = st.nothing()
    else:
        none = st.none()
    return st.one_of(
        st.text(max_size=12).filter(lambda s: s not in allowed),
        st.sampled_from(allowed).map(str.upper).filter(lambda s: s not in allowed),
        st.sampled_from(allowed).map(lambda s: [s]),     # a list holding a valid name
        st.sampled_from(allowed).map(np.array),          # a 0-d NumPy array of one
        st.just(np.array(list(allowed))),                 # an array of all of them
        st.integers(), st.floats(), _BOOLS, none,
    )


def _not_dividing(n, low=1):
    return st.integers(low, 2 * n + 3).filter(lambda d: n % d != 0)


def cross_field_invalid(family, field, config):
    """A strategy of values of `field` that break a rule tying it to the (valid) other fields
    of `config`, or None when the field has no such rule."""
    c = config
    if family in ("gpt", "bert", "vit", "graphormer") and field == "num_heads" and (
            c.get("head_dim") is None):  # (a GPT head_dim frees num_heads from hidden_dim)
        return _not_dividing(c["hidden_dim"], 2)
    if family == "gpt":
        rotary = c["position"] == "rotary"
        if field == "head_dim" and rotary:
            return st.sampled_from([1, 3, 5])  # odd: RoPE rotates pairs
        if field == "rope_scaling_type" and not rotary:
            return st.sampled_from(["linear", "llama3", "yarn"])
        if field == "rope_scaling_factor" and c.get("rope_scaling_type") is None:
            return st.sampled_from([2.0, 0.5, 8])
        llama3 = c.get("rope_scaling_type") == "llama3"
        if field == "rope_high_freq_factor" and llama3:
            return st.just(c["rope_low_freq_factor"])  # must be greater
        if field in ("rope_low_freq_factor", "rope_high_freq_factor") and not llama3:
            return st.sampled_from([1.0, 4.0])  # (only used by llama3)
        yarn = c.get("rope_scaling_type") == "yarn"
        if field == "rope_original_max_position_embeddings" and not (llama3 or yarn):
            return st.just(8192)
        if field == "rope_beta_fast" and yarn:  # must be greater than beta_slow (default 1)
            return st.just(c.get("rope_beta_slow") or 1.0)
        if field in ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor") and not yarn:
            return st.sampled_from([1.0, 32.0])  # (only used by yarn)
        if field == "rope_truncate" and not yarn:
            return st.booleans()
        if field == "num_kv_heads":
            return _not_dividing(c["num_heads"], 2)
        if field == "num_experts":
            return st.none() if c["feedforward"] == "moe" else st.integers(1, 8)
        if field == "top_k" and c["feedforward"] == "moe":
            return st.integers(c["num_experts"] + 1, 64)
        if field == "position" and (
                c.get("head_dim") or c["hidden_dim"] // c["num_heads"]) % 2:
            return st.just("rotary")  # rotary positions need an even head size
    if family == "t5":
        if field == "relative_attention_num_buckets":
            return st.integers(1, 3)
        if field == "relative_attention_max_distance":
            return st.integers(1, c["relative_attention_num_buckets"] // 2)
    if family == "vit" and field == "patch_size":
        size = c["image_size"]
        height = size if isinstance(size, int) else size[0]
        return _not_dividing(height, 2)
    if family == "graphormer":
        if field == "num_frozen_layers":
            return st.integers(c["num_layers"] + 1, 100)
    return None


def _check_names(error, field, source=None):
    assert isinstance(error, FieldError), (type(error), error)
    assert error.field == field, (error.field, field, str(error))
    assert f"`{field}`" in str(error), str(error)
    if source:
        assert source in str(error), str(error)


FAMILY_FIELDS = [(family, field) for family in FAMILIES for field in sorted(KINDS[family])]


@pytest.mark.spread
@pytest.mark.parametrize("family, field", FAMILY_FIELDS,
                         ids=[f"{family}-{field}" for family, field in FAMILY_FIELDS])
def test_one_invalid_field_is_named(family, field):
    config_class, backbone_class = CLASSES[family]
    kind, extra = KINDS[family][field]

    @settings(CONFIG_SETTINGS, max_examples=20)
    @given(st.data())
    def check(data):
        values = data.draw(VALID[family]())
        cross = cross_field_invalid(family, field, values)
        strategies = [invalid_values(kind, extra)] + ([cross] if cross is not None else [])
        bad = data.draw(st.one_of(*strategies), label="bad value")
        values = {**values, field: bad}
        with pytest.raises(ValueError) as error:
            config_class(**values)
        _check_names(error.value, field)
        # The backbone validates through its config, before any layer exists.
        with pytest.raises(ValueError) as from_backbone:
            backbone_class(**values)
        assert str(from_backbone.value) == str(error.value)
        # Read from a file: the file is named too.
        with pytest.raises(ValueError) as from_dict:
            config_class.from_dict(values, source="some/preset.json")
        _check_names(from_dict.value, field, "some/preset.json")

    check()


# === Random models round-trip: .keras, preset directories, Hugging Face ===

# The tasks of each family (the head first: see "Valid configurations") and the arguments of
# its head besides the backbone.
TASKS = {
    "gpt": {"causal_lm": {}, "backbone": {}},
    "bert": {"masked_lm": {}, "classifier": {"num_classes": 3}, "backbone": {}},
    "t5": {"seq2seq_lm": {}, "backbone": {}},
    "vit": {"classifier": {"num_classes": 3}, "backbone": {}},
    "graphormer": {"predictor": {"num_classes": 2}, "backbone": {}},
}


def _padding_mask(rng, batch, length):
    """Right padding, at least one real token a row."""
    lengths = rng.integers(1, length + 1, size=batch)
    return (np.arange(length)[None, :] < lengths[:, None]).astype("int32")


def _random_graph(rng):
    """A small connected graph (a random tree plus a few extra edges) with one small node
    and edge feature, so that every id stays inside the tiny embedding tables."""
    n = int(rng.integers(1, 6))
    edges = {(int(rng.integers(0, i)), i) for i in range(1, n)}
    for _ in range(int(rng.integers(0, 2))):
        a, b = (int(v) for v in rng.integers(0, n, size=2))
        if a != b:
            edges.add((min(a, b), max(a, b)))
    both = sorted(edges) + [(b, a) for a, b in sorted(edges)]
    edge_index = np.array(both, np.int64).reshape(-1, 2).T
    edge_attr = rng.integers(0, 4, size=(len(both), 1))
    half = len(both) // 2  # the same feature both ways
    edge_attr[half:] = edge_attr[:half]
    return {"num_nodes": n, "edge_index": edge_index, "edge_attr": edge_attr,
            "node_feat": rng.integers(0, 4, size=(n, 1))}


def model_inputs(family, config, seed):
    """(kzoo inputs, transformers keyword arguments, padding mask of the compared axis)."""
    rng = np.random.default_rng(seed)
    batch = 2
    if family == "gpt":
        ids = rng.integers(0, config["vocabulary_size"], (batch, 6)).astype("int32")
        mask = _padding_mask(rng, batch, 6)
        return ({"token_ids": ids, "padding_mask": mask},
                {"input_ids": ids, "attention_mask": mask}, mask)
    if family == "bert":
        ids = rng.integers(0, config["vocabulary_size"], (batch, 6)).astype("int32")
        segments = rng.integers(0, config["num_segments"], (batch, 6)).astype("int32")
        mask = _padding_mask(rng, batch, 6)
        return ({"token_ids": ids, "segment_ids": segments, "padding_mask": mask},
                {"input_ids": ids, "token_type_ids": segments, "attention_mask": mask}, mask)
    if family == "t5":
        vocab = config["vocabulary_size"]
        enc = rng.integers(0, vocab, (batch, 7)).astype("int32")
        dec = rng.integers(0, vocab, (batch, 5)).astype("int32")
        enc_mask, dec_mask = _padding_mask(rng, batch, 7), _padding_mask(rng, batch, 5)
        return ({"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
                 "decoder_token_ids": dec, "decoder_padding_mask": dec_mask},
                {"input_ids": enc, "attention_mask": enc_mask, "decoder_input_ids": dec,
                 "decoder_attention_mask": dec_mask}, dec_mask)
    if family == "vit":
        size = config["image_size"]
        height, width = (size, size) if isinstance(size, int) else size
        images = rng.normal(size=(batch, height, width, config["num_channels"]))
        images = images.astype("float32")
        return images, {"pixel_values": np.ascontiguousarray(images.transpose(0, 3, 1, 2))}, None
    graphs = [_random_graph(rng) for _ in range(batch)]
    x = kzoo.graphs.batch(graphs, multi_hop_max_dist=config["multi_hop_max_dist"])
    return x, dict(x), None


def _hf_output(family, task, out):
    """The transformers output compared with kzoo's (see `_kzoo_output`)."""
    if hasattr(out, "logits"):
        return out.logits
    if family == "graphormer":
        return out.last_hidden_state[:, 0]  # the graph token (padded nodes are not defined)
    return out.last_hidden_state


def _kzoo_output(family, task, out):
    if isinstance(out, dict):
        key = {"bert": "sequence_output", "t5": "decoder_sequence_output"}[family]
        return out[key]
    if family == "graphormer" and task == "backbone":
        return out[:, 0]
    return out


def _randomize(model, seed):
    """Non-trivial weights (norm scales and biases too), small enough for tight tolerances."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        value = to_numpy(variable)
        noise = rng.normal(0.0, 0.1, value.shape)
        variable.assign((value + noise).astype(value.dtype))


def _assert_same(a, b, atol, label):
    a, b = outputs_of(a), outputs_of(b)
    assert len(a) == len(b), label
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=label)


def check_model_round_trips(family, config, task, seed):
    import transformers

    task_config = TASKS[family][task]
    model = kzoo.presets.build(family, config, task=task, task_config=task_config)
    _randomize(model, seed)
    x, hf_kwargs, mask = model_inputs(family, config, seed)
    # Eager calls: on JAX the ops compiled for the first model serve the three copies (a
    # compiled predict step would compile each of the four models anew).
    expected = model(x)
    with tempfile.TemporaryDirectory() as tmp:
        # .keras (Keras' own loader, safe mode on by default).
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        assert type(restored) is type(model)
        _assert_same(restored(x), expected, 1e-6, ".keras")
        # A kzoo preset directory.
        kzoo.presets.save(model, os.path.join(tmp, "preset"))
        restored = kzoo.presets.load(os.path.join(tmp, "preset"))
        assert type(restored) is type(model)
        _assert_same(restored(x), expected, 1e-6, "preset directory")
        # Hugging Face: transformers reads the export and computes the same outputs ...
        hf_dir = os.path.join(tmp, "hf")
        kzoo.presets.save(model, hf_dir, format="hf")
        with open(os.path.join(hf_dir, "config.json")) as f:
            architecture = json.load(f)["architectures"][0]
        kwargs = {"attn_implementation": "eager"} if family == "gpt" else {}
        hf = getattr(transformers, architecture).from_pretrained(hf_dir, **kwargs).eval()
        theirs = to_numpy(_hf_output(family, task, torch_forward(hf, **hf_kwargs)).numpy())
        ours = to_numpy(_kzoo_output(family, task, expected))
        assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
        if mask is not None and ours.shape[:2] == mask.shape:
            real = mask.astype(bool)
            ours, theirs = ours[real], theirs[real]
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0,
                                   err_msg=f"kzoo vs transformers ({architecture})")
        # ... and kzoo imports it back as the same model.
        imported = kzoo.presets.load(hf_dir)
        assert type(imported) is type(model)
        _assert_same(imported(x), expected, 1e-6, "Hugging Face import")


@st.composite
def model_case(draw, family):
    config = draw(VALID[family](exportable=True))
    task = draw(st.sampled_from(list(TASKS[family])))
    return config, task, draw(st.integers(0, 2**16))


# One or two models a family in the default suite (each is built, saved and loaded four
# times; on JAX every copy compiles); the slow variant below draws many more.
MODEL_SETTINGS = settings(max_examples=2 if keras.backend.backend() == "torch" else 1, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=list(HealthCheck))


@pytest.mark.spread
@pytest.mark.parametrize("family", FAMILIES)
def test_random_models_round_trip(family):
    @MODEL_SETTINGS
    @given(model_case(family))
    def check(case):
        check_model_round_trips(family, *case)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_random_models_round_trip_long(family):
    @settings(MODEL_SETTINGS, max_examples=20)
    @given(model_case(family))
    def check(case):
        check_model_round_trips(family, *case)

    check()
