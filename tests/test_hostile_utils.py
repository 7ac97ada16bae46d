"""Public utilities given hostile input refuse it with a ValueError / TypeError that names the
argument, its value and what is allowed, the same on every backend (before: raw backend
errors, or a silently wrong result).

Each test covers one item: next-token selection (`filter_logits`, `select_next_token`), the
learning-rate schedules and `plot_schedule`, the data helpers (`random_split`,
`ByteTokenizer.decode`, `pack`), `graphs.shortest_paths`, LoRA (`enable_lora`,
`load_lora_weights`) and the training CLI's `--sample-tokens`.
"""

import os

import keras
import numpy as np
import pytest

import kzoo
from kzoo import graphs
from kzoo.data import ByteTokenizer, pack, random_split
from kzoo.generation import filter_logits, select_next_token
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.schedules import (WarmupCosineDecay, WarmupInverseSqrt, WarmupLinearDecay,
                            plot_schedule)
from tests.helpers import to_numpy
from training.cli import build_parser

# === Next-token selection ===


def test_logits_of_another_rank_are_refused_and_lists_are_converted():
    # 1-D: an IndexError inside top-k (or a 1-D result without it); 3-D: a broadcasting
    # error inside top-k, or top-p applied along the last axis as if it were 2-D.
    one_row = keras.ops.convert_to_tensor(np.array([1.0, 3.0, 2.0], "float32"))
    cube = keras.ops.ones((2, 3, 4))
    for call in (lambda x: filter_logits(x), lambda x: filter_logits(x, top_k=2),
                 lambda x: filter_logits(x, top_p=0.5), lambda x: select_next_token(x),
                 lambda x: select_next_token(x, strategy="sample", seed=0)):
        with pytest.raises(ValueError, match=r"`logits` must have shape \(batch, vocab\) "
                                             r"\(one row .*logits\[None\]`\); got shape \(3,\)"):
            call(one_row)
        with pytest.raises(ValueError, match=r"`logits` must have shape \(batch, vocab\); "
                                             r"got shape \(2, 3, 4\)"):
            call(cube)
        with pytest.raises(ValueError, match=r"got shape \(\)"):
            call(keras.ops.convert_to_tensor(1.0))
    # A nested list is a (batch, vocab) array like any other (select_next_token: an
    # AttributeError before); a ragged or non-numeric one is named.
    rows = [[0.1, 2.0, 0.3], [1.0, 0.0, -1.0]]
    np.testing.assert_array_equal(to_numpy(select_next_token(rows)), [1, 0])
    np.testing.assert_array_equal(
        to_numpy(select_next_token(rows, strategy="sample", top_k=1, seed=0)), [1, 0])
    np.testing.assert_array_equal(to_numpy(filter_logits([[1.0, 3.0, 2.0]], top_k=2)),
                                  np.array([[-1e30, 3.0, 2.0]], "float32"))
    for bad in ([[1.0, 2.0], [3.0]], [["a", "b"]]):
        with pytest.raises(ValueError, match="`logits` must be a .*nested list of numbers"):
            select_next_token(bad)


# === Schedules ===


@pytest.mark.parametrize("schedule", [
    WarmupInverseSqrt(peak_learning_rate=1e-3, warmup_steps=10),
    WarmupLinearDecay(1e-3, 10, 10),
    WarmupCosineDecay(1e-3, 10, 10),
], ids=["inverse_sqrt", "linear", "cosine"])
def test_schedules_refuse_a_step_that_is_not_a_number(schedule):
    # JAX read "10" as 10; torch: "Invalid dtype: str64"; TensorFlow: "Cast string to float
    # is not supported".
    for step in ("10", b"10", np.array(["10"]), None):
        with pytest.raises(TypeError, match=r"`step` must be a number or an integer or float "
                                            r"tensor .*got step="):
            schedule(step)
    # numbers and numeric arrays / tensors still work, with one value
    expected = float(to_numpy(schedule(10)))
    for step in (10, 10.0, np.int64(10), np.array(10), keras.ops.convert_to_tensor(10),
                 keras.Variable(10, dtype="int32", trainable=False)):
        assert float(to_numpy(schedule(step))) == pytest.approx(expected)


def test_plot_schedule_refuses_a_directory(tmp_path):
    schedule = WarmupInverseSqrt(d_model=16, warmup_steps=5)
    for path in (str(tmp_path), tmp_path):  # was IsADirectoryError from matplotlib
        with pytest.raises(ValueError, match=r"`path` must be the PNG file to write; got "
                                             r"path=.*an existing directory"):
            plot_schedule(schedule, 10, path)
    assert os.listdir(tmp_path) == []
    out = plot_schedule(schedule, 10, os.path.join(tmp_path, "lr.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# === Data ===


def test_random_split_refuses_nan_and_infinite_fractions():
    # NaN passed both checks: "cannot convert float NaN to integer" from `round`, or, as the
    # last fraction, a silently empty last part.
    for fractions in ((0.5, float("nan"), 0.5), (0.5, 0.5, float("nan")),
                      (float("nan"),), (0.5, float("inf"))):
        with pytest.raises(ValueError, match=r"`fractions` must be positive finite numbers "
                                             r"summing to 1; got fractions="):
            random_split(10, fractions)
    assert [len(p) for p in random_split(10, (0.5, 0.3, 0.2))] == [5, 3, 2]


def test_byte_tokenizer_decode_refuses_text():
    tok = ByteTokenizer()
    # was numpy's UFuncTypeError ("ufunc 'minimum' did not contain a loop ...")
    for text in ("hello", b"hello", ""):
        with pytest.raises(ValueError, match=r"`ids` must be a sequence of integer token ids "
                                             r"in \[0, 260\); got a (str|bytes).*`encode`"):
            tok.decode(text)
    with pytest.raises(ValueError, match=r"`ids` must be .*got an array of dtype <U1"):
        tok.decode(["h", "i"])
    with pytest.raises(ValueError, match=r"got an array of dtype float64"):
        tok.decode([104.0, 105.5])
    assert tok.decode(tok.encode("hi")) == "hi"
    assert tok.decode([]) == ""


def test_pack_refuses_token_ids_outside_int32():
    # A negative id was packed as is; 2**31 wrapped around to -2**31 in the int32 rows.
    with pytest.raises(ValueError, match=r"`documents` must hold token ids in \[0, 2\*\*31\); "
                                         r"document 1 has id -2 at position 1"):
        pack([[1, 2], [3, -2, 4]], 4)
    with pytest.raises(ValueError, match=r"document 0 has id 2147483648 at position 2"):
        pack([np.array([1, 2, 2 ** 31], np.int64)], 4)
    for pad_id in (-1, 2 ** 31):
        with pytest.raises(ValueError, match=r"`pad_id` must be an integer in \[0, 2\*\*31\); "
                                             rf"got pad_id={pad_id}"):
            pack([[1, 2, 3]], 4, pad_id=pad_id)
    assert pack([[1, 2, 3], [0]], 4, pad_id=7)["token_ids"].tolist() == [[1, 2, 3, 0]]


# === Graphs ===


def test_shortest_paths_float_and_boolean_edge_index():
    expected, _ = graphs.shortest_paths(3, np.array([[0, 1], [1, 2]]))
    # Whole-valued floats are the integers they hold (as for node_feat / edge_attr) ...
    dist, _ = graphs.shortest_paths(3, np.array([[0.0, 1.0], [1.0, 2.0]], "float32"))
    np.testing.assert_array_equal(dist, expected)
    dist, _ = graphs.shortest_paths(3, keras.ops.convert_to_tensor([[0.0, 1.0], [1.0, 2.0]]))
    np.testing.assert_array_equal(dist, expected)
    # ... other floats are refused naming them (the message named no value before) ...
    with pytest.raises(ValueError, match=r"`edge_index` must hold integers \(floats only with "
                                         r"whole values.*got edge_index values \[0\.5\]"):
        graphs.shortest_paths(3, [[0.5, 1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match=r"got edge_index values \[nan\]"):
        graphs.shortest_paths(3, [[np.nan, 1.0], [1.0, 2.0]])
    # ... and booleans are refused (True / False were read as nodes 1 / 0).
    with pytest.raises(ValueError, match="`edge_index` must hold integer node ids .*boolean"):
        graphs.shortest_paths(3, np.array([[True, False], [False, True]]))


# === LoRA ===


def _tiny_gpt(hidden_dim):
    keras.utils.set_random_seed(0)
    model = GPTCausalLM(GPTBackbone(
        vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=hidden_dim,
        intermediate_dim=24, max_sequence_length=16, dropout=0.0))
    model({"token_ids": np.ones((1, 4), "int32"), "padding_mask": np.ones((1, 4), "int32")})
    return model


def test_lora_rank_above_the_kernel_dimensions_is_refused():
    model = _tiny_gpt(16)
    trainable = len(model.trainable_weights)
    # the query / value kernels are (16, 16): a rank above 16 adds nothing but memory
    for rank in (10 ** 6, 17):
        with pytest.raises(ValueError, match=r"`rank` must be at most min\(in, out\) = 16 of "
                                             r"the smallest targeted kernel \(.*query_dense, "
                                             rf"\(16, 16\)\); got rank={rank}\."):
            model.enable_lora(rank)
    # the feed-forward kernels are (16, 24) and (24, 16): the bound is their smaller side
    with pytest.raises(ValueError, match=r"= 16 of the smallest .*got rank=20\."):
        model.enable_lora(20, targets=("feedforward_in", "feedforward_out"))
    assert len(model.trainable_weights) == trainable  # nothing was frozen
    assert not kzoo.lora.lora_layers(model)
    model.enable_lora(16)  # min(in, out) itself is allowed
    assert len(kzoo.lora.lora_layers(model)) == 2


def test_load_lora_weights_of_another_width_is_refused_and_changes_nothing(tmp_path):
    source = _tiny_gpt(16)
    source.enable_lora(2)
    path = str(tmp_path / "adapters.lora.npz")
    source.save_lora_weights(path)
    narrow = _tiny_gpt(8)
    trainable = len(narrow.trainable_weights)
    # was Keras' "shape of the target variable ... must match" from `assign`, after LoRA
    # had been enabled and the whole model frozen
    with pytest.raises(ValueError, match=r"do not fit .*layer transformer_layer_0/"
                                         r"self_attention/query_dense has a kernel of shape "
                                         r"\(8, 8\), so its rank-2 adapter lora_kernel_a must "
                                         r"have shape \(8, 2\); the file's has shape \(16, 2\)"):
        narrow.load_lora_weights(path)
    assert not kzoo.lora.lora_layers(narrow)
    assert len(narrow.trainable_weights) == trainable
    # the same with adapters of the right settings already enabled
    narrow.enable_lora(2)
    with pytest.raises(ValueError, match=r"query_dense has a kernel of shape \(8, 8\)"):
        narrow.load_lora_weights(path)
    # a model of the saved width still loads it
    fresh = _tiny_gpt(16)
    fresh.load_lora_weights(path)
    for a, b in zip(kzoo.lora.lora_layers(source), kzoo.lora.lora_layers(fresh)):
        np.testing.assert_array_equal(to_numpy(a.lora_kernel_a), to_numpy(b.lora_kernel_a))


# === Training CLI ===


@pytest.mark.parametrize("recipe", ["gpt_text", "demo"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_sample_tokens_must_be_positive(recipe, value, capsys):
    # -3 sized the model's positions to --seq-len - 3 (a traceback once training had
    # started); 0 silently generated one token. Now argparse's usage error (exit 2), like
    # --steps. (The parser only: a value it let through would start a whole run.)
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([recipe, "--sample-tokens", value])
    assert exit_info.value.code == 2
    assert f"--sample-tokens must be a positive integer; got '{value}'" in \
        capsys.readouterr().err
    assert parser.parse_args([recipe, "--sample-tokens", "1"]).sample_tokens == 1
