"""Public API entry points given hostile input (a second round after `test_hostile_utils.py`
and `test_hostile_layers.py`): a ValueError that names the argument, its value and what is
allowed, instead of a silently wrong result or an error from deep inside NumPy / a backend."""

import re

import numpy as np
import pytest

from kzoo import graphs

# === graphs.batch ===

_GRAPH = {"num_nodes": 3, "edge_index": [[0, 1], [1, 2]], "node_feat": [[1], [2], [3]],
          "edge_attr": [[1], [1]], "y": [1]}


def test_batch_checks_preprocessed_graphs_it_stacks():
    item = graphs.preprocess(_GRAPH)
    expected = graphs.batch([_GRAPH])
    # Valid preprocessed graphs (arrays or lists, whole-valued floats) stack as before ...
    as_lists = {key: np.asarray(value).tolist() for key, value in item.items()}
    as_floats = dict(item, input_nodes=item["input_nodes"].astype("float32"))
    for given in (item, as_lists, as_floats):
        got = graphs.batch([given])
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    # ... fractional ids were truncated to int64 in silence ...
    with pytest.raises(ValueError, match=r"graphs\[1\] \(preprocessed\): `input_nodes` must "
                                         r"hold integers.*\[4\.5, 5\.5, 6\.5\]"):
        graphs.batch([item, dict(item, input_nodes=item["input_nodes"] + 0.5)])
    # ... and a tensor of another node count failed in NumPy's broadcasting, naming no key.
    with pytest.raises(ValueError, match=r"graphs\[0\] \(preprocessed\): `spatial_pos` must "
                                         r"have shape \(3, 3\) .*got spatial_pos with shape "
                                         r"\(2, 2\)"):
        graphs.batch([dict(item, spatial_pos=np.ones((2, 2), "int64"))])
    with pytest.raises(ValueError, match=r"`attn_bias` must have shape \(4, 4\)"):
        graphs.batch([dict(item, attn_bias=np.zeros((3, 3), "float32"))])
    with pytest.raises(ValueError, match=r"`input_edges` must have rank 4"):
        graphs.batch([dict(item, input_edges=item["input_edges"][..., 0])])


@pytest.mark.parametrize("label", ["a", {"a": 1}, [[1], [1, 2]], None])
def test_batch_refuses_labels_that_are_not_numbers(label):
    # Strings and dicts became a batch of str / object labels, ragged ones NumPy's
    # "inhomogeneous shape" error naming no graph.
    if label is None:  # a graph without a label: no labels at all, as before
        assert "labels" not in graphs.batch([dict(_GRAPH, y=None)])
        return
    with pytest.raises(ValueError, match=r"graphs\[1\]: the labels \(`y` or `labels`\) must "
                                         r"be a number or a rectangular array of numbers"):
        graphs.batch([_GRAPH, dict(_GRAPH, y=label)])


def test_batch_return_node_mask_must_be_a_bool():
    assert "node_mask" in graphs.batch([_GRAPH], return_node_mask=np.bool_(True))
    with pytest.raises(ValueError, match=r"`return_node_mask` must be True or False; got "
                                         r"return_node_mask='no'"):
        graphs.batch([_GRAPH], return_node_mask="no")


# === Learning-rate schedules ===

from kzoo.schedules import WarmupCosineDecay, WarmupInverseSqrt, WarmupLinearDecay  # noqa: E402


@pytest.mark.parametrize("make, given", [
    (lambda: WarmupCosineDecay(1e39, 10, 10), "peak_learning_rate=1e+39"),
    (lambda: WarmupLinearDecay(1e-39, 10, 10), "peak_learning_rate=1e-39"),
    (lambda: WarmupInverseSqrt(peak_learning_rate=1e-3, scale=1e300), "scale=1e+300"),
    (lambda: WarmupInverseSqrt(d_model=512, scale=1e300), "d_model=512, warmup_steps=4000"),
])
def test_a_peak_float32_cannot_hold_is_refused(make, given):
    # The learning rate was inf (NaN weights after one update) or 0, in silence.
    with pytest.raises(ValueError, match=r"peak learning rate must be a normal float32 .*"
                                         + given.replace("+", r"\+")):
        make()


@pytest.mark.parametrize("make, name", [
    (lambda: WarmupInverseSqrt(d_model=10**400, warmup_steps=10), "d_model"),
    (lambda: WarmupInverseSqrt(peak_learning_rate=1e-3, warmup_steps=2**63), "warmup_steps"),
    (lambda: WarmupLinearDecay(1e-3, 10, 10**400), "decay_steps"),
    (lambda: WarmupCosineDecay(1e-3, 2**64, 10), "warmup_steps"),
])
def test_counts_past_int64_are_refused_by_name(make, name):
    # Were an OverflowError ("int too large to convert to float") at the first call.
    with pytest.raises(ValueError, match=rf"`{name}` must be a positive integer of at most "
                                         r"2\*\*63 - 1"):
        make()


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    import json

    # np.float32 alpha / end_learning_rate were refused (np.float64 was accepted); NumPy
    # integer counts were stored as given, so get_config was not JSON.
    cosine = WarmupCosineDecay(np.float32(1e-3), np.int64(10), np.int32(20),
                               alpha=np.float32(0.5))
    linear = WarmupLinearDecay(1e-3, 10, 20, end_learning_rate=np.float32(1e-4))
    paper = WarmupInverseSqrt(d_model=np.int64(512), warmup_steps=np.int64(10))
    for schedule in (cosine, linear, paper):
        config = json.loads(json.dumps(schedule.get_config()))
        assert float(type(schedule).from_config(config)(5)) == pytest.approx(
            float(schedule(5)))
    assert cosine.alpha == 0.5 and type(cosine.warmup_steps) is int
    assert type(paper.d_model) is int


# === fit / evaluate / train_on_batch: sample weights ===


def _tiny_lm():
    import kzoo

    model = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                              intermediate_dim=32, max_sequence_length=16)
    model.compile(optimizer="sgd")
    return model


@pytest.mark.spread
def test_sample_weights_of_another_shape_or_not_finite_are_refused_by_name():
    # Another shape failed inside the step with each backend's broadcasting error (torch a
    # RuntimeError, TensorFlow an InvalidArgumentError; (batch, seq, 1) only on TensorFlow);
    # a NaN or infinite weight made the loss NaN in silence.
    model = _tiny_lm()
    x = {"token_ids": np.ones((4, 6), "int32"), "padding_mask": np.ones((4, 6), "int32")}
    y = np.ones((4, 6), "int32")
    weights = model.get_weights()
    for shape in ((4,), (4, 7), (4, 6, 2)):
        with pytest.raises(ValueError, match=rf"`sample_weight` \(fit's sample_weight\) has "
                                             rf"shape {re.escape(str(shape))}; .* shape "
                                             r"\(4, 6\): give weights of that shape or "
                                             r"\(4, 1\)"):
            model.fit(x, y, sample_weight=np.ones(shape, "float32"), verbose=0)
    with pytest.raises(ValueError, match=r"\(train_on_batch's sample_weight\) holds nan at "
                                         r"index \(0, 0\); weights must be finite"):
        model.train_on_batch(x, y, sample_weight=np.full((4, 6), np.nan, "float32"))
    with pytest.raises(ValueError, match=r"\(fit's validation_data weights\) holds inf"):
        model.fit(x, y, validation_data=(x, y, np.full((4, 6), np.inf)), verbose=0)
    with pytest.raises(ValueError, match=r"\(evaluate's sample_weight\) has shape \(4, 5\)"):
        model.evaluate(x, y, sample_weight=np.ones((4, 5)), verbose=0)
    for got, want in zip(model.get_weights(), weights):  # nothing was trained
        np.testing.assert_array_equal(got, want)
    # The shapes that broadcast train, (batch, seq, 1) now on TensorFlow too.
    for shape in ((4, 6), (4, 1), (4, 6, 1)):
        loss = model.fit(x, y, sample_weight=np.ones(shape, "float32"), verbose=0)
        assert np.isfinite(loss.history["loss"][-1])


# === presets.save / load ===


def test_save_refuses_a_directory_that_is_not_a_path_or_cannot_be_made(tmp_path):
    import kzoo

    model = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                              intermediate_dim=32, max_sequence_length=16)
    # Were os.fspath's TypeError naming no argument, and a NotADirectoryError from
    # os.makedirs for a path through a file.
    for directory in (None, 5):
        with pytest.raises(ValueError, match=rf"`directory` must be the path .*got "
                                             rf"directory={directory!r}\."):
            kzoo.presets.save(model, directory)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`directory` must be a directory that can be made "
                                         r"or written in; .*file' is a file, not a directory"):
        kzoo.presets.save(model, tmp_path / "file" / "sub" / "deeper")
    assert kzoo.presets.save(model, tmp_path / "new" / "sub") == str(tmp_path / "new" / "sub")
    # A directory no file can be made in, whoever runs the test (os.access says yes to root):
    # was a FileNotFoundError from os.makedirs.
    with pytest.raises(ValueError, match=r"`directory` must be a directory that can be made "
                                         r"or written in; .*'/proc/self' is not writable"):
        kzoo.presets.save(model, "/proc/self/kzoo_out")


def test_a_bad_field_value_in_a_saved_config_names_the_file(tmp_path):
    import json

    import kzoo

    model = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                              intermediate_dim=32, max_sequence_length=16)
    kzoo.presets.save(model, tmp_path)
    path = tmp_path / "kzoo_config.json"
    meta = json.loads(path.read_text())
    meta["config"]["num_layers"] = -1
    path.write_text(json.dumps(meta))
    # The message named the field alone, as if the caller had passed it ...
    with pytest.raises(ValueError, match=r"`num_layers` must be a positive integer; got "
                                         r"num_layers=-1 \(read from '.*kzoo_config\.json'\)"):
        kzoo.presets.load(tmp_path)
    # ... while an override is the caller's own (no file named), and fixes the stored value.
    with pytest.raises(ValueError, match=r"got num_layers=0\.$"):
        kzoo.presets.load(tmp_path, num_layers=0, weights=False)
    assert kzoo.presets.load(tmp_path, num_layers=1).count_params() == model.count_params()


# === Model calls ===


def _t5():
    import kzoo

    return kzoo.presets.load("t5_small", num_layers=1, num_decoder_layers=1, hidden_dim=16,
                             num_heads=2, key_value_dim=8, intermediate_dim=32,
                             vocabulary_size=50)


def test_rows_of_no_tokens_are_refused_by_name():
    import kzoo

    # JAX failed with a ZeroDivisionError from a reshape inside MultiHeadAttention; torch
    # and TensorFlow with attention's message about `query`.
    gpt = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                            intermediate_dim=32, max_sequence_length=16)
    empty = np.ones((2, 0), "int32")
    with pytest.raises(ValueError, match=r"`token_ids` \(input of gpt_causal_lm\w*\) has no "
                                         r"tokens \(shape \(2, 0\)\); every row needs at least"):
        gpt({"token_ids": empty, "padding_mask": empty})
    ids = np.ones((2, 3), "int32")
    with pytest.raises(ValueError, match=r"`encoder_token_ids` .* has no tokens"):
        _t5()({"encoder_token_ids": empty, "encoder_padding_mask": empty,
               "decoder_token_ids": ids, "decoder_padding_mask": ids})
    # An empty batch (rows of tokens, no rows) still gives an empty output.
    assert tuple(gpt({"token_ids": ids[:0], "padding_mask": ids[:0]}).shape) == (0, 3, 260)


def test_t5_encoder_and_decoder_inputs_of_two_batch_sizes_are_refused_by_name():
    # Failed inside cross-attention, naming `query` and `key` (and on TensorFlow in a
    # graph) rather than the inputs.
    model = _t5()
    enc, dec = np.ones((2, 5), "int32"), np.ones((1, 4), "int32")
    with pytest.raises(ValueError, match=r"`decoder_token_ids` \(input of t5_seq2_seq_lm\w*\) "
                                         r"has a batch of 1 and `encoder_token_ids` a batch "
                                         r"of 2"):
        model({"encoder_token_ids": enc, "encoder_padding_mask": enc,
               "decoder_token_ids": dec, "decoder_padding_mask": dec})


# === Training CLI ===


@pytest.mark.parametrize("flag, allowed", [("--learning-rate", r"\(0, inf\)"),
                                           ("--weight-decay", r"\[0, inf\)")])
def test_cli_refuses_an_infinite_learning_rate_or_weight_decay(flag, allowed, capsys):
    from training.cli import build_parser

    # inf passed the parser: a FieldError traceback from the schedule once the run had
    # started (--learning-rate), NaN weights after the first update (--weight-decay).
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["gpt_text", flag, "inf"])
    assert exit_info.value.code == 2
    assert re.search(rf"{flag} must be in {allowed}; got 'inf'", capsys.readouterr().err)


def test_cli_refuses_a_preset_directory_load_cannot_read(tmp_path, capsys):
    from training.cli import main

    # Was a ValueError traceback (exit 1) once the recipe had loaded its data.
    (tmp_path / "empty").mkdir()
    code = main(["gpt_text", "--steps", "1", "--preset", str(tmp_path / "empty"),
                 "--out", str(tmp_path / "out")])
    assert code == 2
    assert re.search(r"error: --preset '.*empty' is neither a kzoo preset directory",
                     capsys.readouterr().err)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "kzoo_config.json").write_text("{not json")
    assert main(["gpt_text", "--steps", "1", "--preset", str(tmp_path / "broken"),
                 "--out", str(tmp_path / "out")]) == 2
    assert re.search(r"kzoo_config\.json.* not valid JSON", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # nothing written


def test_cli_refuses_a_preset_whose_weights_are_truncated(tmp_path, capsys):
    import kzoo.presets
    from training.cli import main

    # Was a ValueError traceback (exit 1) after the recipe had loaded its data and built
    # the model.
    model = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                              intermediate_dim=32, vocabulary_size=64)
    directory = tmp_path / "saved"
    kzoo.presets.save(model, str(directory))
    weights = directory / kzoo.presets.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code = main(["gpt_text", "--steps", "1", "--preset", str(directory),
                 "--out", str(tmp_path / "out")])
    assert code == 2
    assert re.search(r"error: --preset '.*saved': the weights file '.*model\.weights\.h5' "
                     r"cannot be read \(truncated or not HDF5\)", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_out_directory_no_file_can_be_made_in(tmp_path, capsys):
    from training.cli import main

    # Was a FileNotFoundError traceback from os.makedirs.
    assert main(["gpt_text", "--steps", "1", "--out", "/proc/self/kzoo_out"]) == 2
    assert re.search(r"error: --out must be a directory that can be made or written in; got "
                     r"--out='/proc/self/kzoo_out': '/proc/self' is not writable",
                     capsys.readouterr().err)


# === generate: prompts as a list of rows ===


def _gpt():
    import kzoo

    return kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                             intermediate_dim=32, max_sequence_length=16)


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_generate_takes_rows_of_backend_tensors_of_any_lengths(family):
    """A list of 1-D torch / TensorFlow / JAX tensors of different lengths (one a prompt, as
    a tokenizer gives them row by row) is a list of rows, as NumPy rows are: it failed with
    NumPy's "setting an array element with a sequence ... inhomogeneous shape" ValueError,
    which names no argument."""
    import jax.numpy as jnp
    import tensorflow as tf
    import torch

    model = _gpt() if family == "gpt" else _t5()
    expected = model.generate([[5, 6, 7], [8, 9]], max_new_tokens=2, stop_token_ids=None)
    for make in (torch.tensor, tf.constant, jnp.array):
        rows = [make([5, 6, 7]), make([8, 9])]
        assert model.generate(rows, max_new_tokens=2, stop_token_ids=None) == expected
    with pytest.raises(ValueError, match=r"`prompts` must hold integer token ids; got "
                                         r"np\.float32\(5\.0\) \(of type float32\)"):
        model.generate([torch.tensor([5.0, 6.0]), torch.tensor([7.0])], max_new_tokens=1)


# Prompt checks in Python, the same on every backend: each case on one backend (`spread`).
@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_generate_prompt_rows_that_are_not_1d_or_mixed_are_refused(family):
    model = _gpt() if family == "gpt" else _t5()
    # GPT and T5 both failed with NumPy's "inhomogeneous shape" error for rows mixed with
    # single ids (and T5 for a ragged nested row); T5 flattened a nested row or a 2-D array
    # row into one prompt in silence.
    with pytest.raises(ValueError, match=r"`prompts` mixes token id lists and single values: "
                                         r"prompt 1 is 3 \(of type int\)"):
        model.generate([[1, 2], 3], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"`prompts` must hold 1-D token id rows; prompt 0 is "
                                         r"an array of shape \(2, 2\)"):
        model.generate([np.ones((2, 2), "int32")], max_new_tokens=1)
    for nested in ([[[1, 2]]], [[[1], [2, 3]]]):
        with pytest.raises(ValueError, match=r"`prompts` must hold integer token ids; got "
                                             r"\[1.*\] \(of type list\) at prompt 0, token 0"):
            model.generate(nested, max_new_tokens=1)
    # Rows given as 1-D arrays of any lengths are rows, as lists are (GPT failed in NumPy
    # for ragged ones).
    rows = [np.array([5, 6, 7]), np.array([8, 9], "int64")]
    got = model.generate(rows, max_new_tokens=2, stop_token_ids=None)
    assert got == model.generate([[5, 6, 7], [8, 9]], max_new_tokens=2, stop_token_ids=None)
    with pytest.raises(ValueError, match=r"`prompts` must hold integer token ids; got "
                                         r"np\.float64\(1\.5\) \(of type float64\)"):
        model.generate([np.array([1.5, 2.0])], max_new_tokens=1)
    for empty in ([], ()):
        with pytest.raises(ValueError, match=r"`prompts` is empty: give at least one prompt"):
            model.generate(empty, max_new_tokens=1)
    # One-pass iterators and sets (NumPy made them a 0-d object array: "dtype object and
    # shape ()"), by name.
    for one_pass, kind in (((r for r in [[1, 2]]), "generator"), (iter([[1, 2]]),
                                                                  "list_iterator"),
                           ({1, 2}, "set")):
        with pytest.raises(ValueError, match=r"`prompts` must be a list, tuple or array of "
                                             rf"token ids \(or token id lists\); got a {kind}: "
                                             r"make it a list first"):
            model.generate(one_pass, max_new_tokens=1)


# === kzoo.interpret ===


def _maps(seed=0, layers=2, batch=1, seq=4):
    rng = np.random.default_rng(seed)
    maps = rng.random((layers, batch, 2, seq, seq)).astype("float32")
    return {"self": list(maps / maps.sum(-1, keepdims=True))}


def test_interpret_flags_must_be_booleans():
    from kzoo.interpret import attention_flow, attention_rollout

    maps = _maps()
    # A string was truthy: residual="no" modelled the residual, return_all="False" returned
    # every layer, in silence.
    for call, name in ((lambda: attention_rollout(maps, residual="no"), "residual"),
                       (lambda: attention_rollout(maps, return_all="False"), "return_all"),
                       (lambda: attention_flow(maps, residual="no"), "residual"),
                       (lambda: attention_flow(maps, normalize=None), "normalize")):
        with pytest.raises(ValueError, match=rf"`{name}` must be True or False; got {name}="):
            call()
    np.testing.assert_array_equal(attention_rollout(maps, residual=np.bool_(False))["self"],
                                  attention_rollout(maps, residual=False)["self"])
    # A NumPy integer max_tokens was refused as not "a positive integer".
    np.testing.assert_allclose(attention_flow(maps, max_tokens=np.int64(8))["self"],
                               attention_flow(maps)["self"])


def test_logit_lens_log_probs_and_integrated_gradients_steps_are_checked():
    from kzoo.interpret import integrated_gradients, logit_lens

    model = _gpt()
    inputs = {"token_ids": np.array([[1, 2, 3]]), "padding_mask": np.ones((1, 3), "int32")}
    with pytest.raises(ValueError, match=r"`log_probs` must be True or False; got "
                                         r"log_probs='no'"):
        logit_lens(model, inputs, log_probs="no")
    # steps=10**9 allocated its quadrature and interpolation path until the OS killed the
    # process; now refused before the first pass, naming steps and internal_batch_size.
    with pytest.raises(ValueError, match=r"`steps` is too large: steps=1000000000000 with "
                                         r"internal_batch_size=4 needs at least .* GiB"):
        integrated_gradients(model, inputs, steps=10 ** 12, internal_batch_size=4)
    with pytest.raises(ValueError, match=r"`steps` is too large: steps=1000000000000 with "
                                         r"internal_batch_size=None"):
        integrated_gradients(model, inputs, steps=10 ** 12)
    ig = integrated_gradients(model, inputs, steps=np.int64(4))
    assert ig.attributions.shape == (1, 3)


# === kzoo.data ===


@pytest.mark.parametrize("key, value, message", [
    ("token_ids", [[1.5, 2.5, 3.0]], r"`token_ids` of `packed` must hold integers; got an "
                                     r"array of dtype float64"),
    ("token_ids", [[2 ** 40, 2, 3]], r"`token_ids` of `packed` must hold integers in "
                                     r"\[0, 2\*\*31\); got 1099511627776 at \(0, 0\)"),
    ("token_ids", [["a", "b", "c"]], r"`token_ids` of `packed` must hold integers; got .*<U1"),
    ("document_ids", [[1.0, 1.5, 2.0]], r"`document_ids` of `packed` must hold integers"),
    ("document_ids", [[1, -1, -1]], r"`document_ids` of `packed` must hold integers in "
                                    r"\[0, 2\*\*31\); got -1 at \(0, 1\)"),
    ("padding_mask", [[1, 1]], r"`packed\['padding_mask'\]` must be an int32 array of the "
                               r"shape of `token_ids` \(1, 3\); got an array of shape \(1, 2\)"),
    ("extra", "bar", r"`packed\['extra'\]` must be an int32 array"),
])
def test_next_token_targets_refuses_ids_that_are_not_int32(key, value, message):
    from kzoo import data

    # Float ids were truncated, ids past int32 wrapped (2**40 became 0), negative document
    # ids counted as a document, in silence; text and extra keys failed inside NumPy.
    packed = {"token_ids": np.array([[5, 6, 7]]), "padding_mask": np.ones((1, 3), "int32"),
              "document_ids": np.array([[1, 1, 2]])}
    with pytest.raises(ValueError, match=message):
        data.next_token_targets(dict(packed, **{key: np.asarray(value)}))
    # Any integer types and a boolean mask are fine, as before.
    x, y, w = data.next_token_targets(dict(packed, token_ids=packed["token_ids"].astype(
        "uint16"), padding_mask=np.ones((1, 3), bool)))
    assert y.tolist() == [[6, 0, 0]] and w.tolist() == [[1, 0, 0]]
    assert x["padding_mask"].dtype == np.int32


def test_byte_tokenizer_is_special_checks_its_ids():
    from kzoo.data import ByteTokenizer

    tokenizer = ByteTokenizer()
    # An id past the vocabulary was "special" (True), a string a NumPy ufunc error.
    with pytest.raises(ValueError, match=r"`ids` must be integers in \[0, 260\); got values "
                                         r"from .*1000"):
        tokenizer.is_special([1, 1000])
    with pytest.raises(ValueError, match=r"`ids` must be integer token ids in \[0, 260\); got "
                                         r"a str, 'a'"):
        tokenizer.is_special("a")
    with pytest.raises(ValueError, match=r"dtype float64"):
        tokenizer.is_special([256.0])
    assert tokenizer.is_special(np.array([[1, 256]], "int64")).tolist() == [[False, True]]
    assert tokenizer.is_special(np.int32(259)) and tokenizer.is_special([]).shape == (0,)


def test_head_view_html_checks_path_and_layers(tmp_path):
    from kzoo.interpret import head_view_html

    maps, tokens = _maps(), list("abcd")
    # An int path was opened as a file descriptor (and written to); a directory or a
    # missing parent failed in `open` (IsADirectoryError, FileNotFoundError).
    with pytest.raises(ValueError, match=r"`path` must be None or a file path; got path=5"):
        head_view_html(maps, tokens, 5)
    with pytest.raises(ValueError, match=r"`path` must be a file path; '.*' is a directory"):
        head_view_html(maps, tokens, tmp_path)
    with pytest.raises(ValueError, match=r"`path` must be in an existing directory; .*no' "
                                         r"does not exist"):
        head_view_html(maps, tokens, tmp_path / "no" / "a.html")
    assert not (tmp_path / "no").exists()
    # An int `layers` was "'int' object is not iterable".
    with pytest.raises(ValueError, match=r"`layers` must be None or a sequence of layer "
                                         r"indices \(e\.g\. \[1\]\); got layers=1"):
        head_view_html(maps, tokens, layers=1)
    page = head_view_html(maps, tokens, tmp_path / "a.html", layers=[np.int64(1)],
                          decimals=np.int64(3))
    assert (tmp_path / "a.html").read_text(encoding="utf-8") == page


def test_head_importance_refuses_a_loss_that_is_not_callable():
    from kzoo.interpret import head_importance

    inputs = {"token_ids": np.array([[1, 2, 3]]), "padding_mask": np.ones((1, 3), "int32")}
    # Was "'str' object is not callable" from inside the first batch's gradient.
    with pytest.raises(ValueError, match=r"`loss` must be None, a Keras loss or a callable "
                                         r"loss\(y_true, y_pred\); got loss='mse' \(for a "
                                         r"Keras loss by name: keras\.losses\.get\('mse'\)\)"):
        head_importance(_gpt(), [(inputs, np.array([[2, 3, 4]]))], loss="mse")


# === export ===


def test_export_checks_filepath_shapes_and_sequence_before_tracing(tmp_path):
    model = _gpt()  # learned positions, max_sequence_length=16
    # Were os.fspath's TypeError and dict()'s errors, naming no argument.
    for filepath in (None, 5):
        with pytest.raises(ValueError, match=rf"`filepath` must be a path \(str or "
                                             rf"os\.PathLike\); got filepath={filepath}\."):
            model.export(filepath, format="onnx")
    for shapes in (5, "batch", [1, 2]):
        given = re.escape(repr(shapes))
        with pytest.raises(ValueError, match=r"`shapes` must be None or a dict \{axis name: "
                                             rf"size or None\}}.*got shapes={given}"):
            model.export(str(tmp_path / "m.onnx"), format="onnx", shapes=shapes)
    # (was "object of type 'int' has no len()" from inside Keras' export)
    for signature in (5, "x"):
        with pytest.raises(ValueError, match=r"`input_signature` must be a structure \(dict, "
                                             rf"list or tuple\) of input specs .*got "
                                             rf"input_signature={re.escape(repr(signature))}\."):
            model.export(str(tmp_path / "m.onnx"), format="onnx", input_signature=signature)
    # A fixed sequence past the position table failed inside the trace (torch: a
    # RuntimeError from PositionEmbedding's slice).
    with pytest.raises(ValueError, match=r"`shapes\['sequence'\]`=17 exceeds "
                                         r"max_sequence_length=16 of 'gpt_causal_lm\w*' \(its "
                                         r"learned position table\); give at most 16"):
        model.export(str(tmp_path / "m.onnx"), format="onnx",
                     shapes={"batch": 1, "sequence": 17})
    # A directory through a file was a NotADirectoryError from the exporter.
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(ValueError, match=r"cannot write filepath='.*file/sub/m\.onnx': "
                                         r"'.*file' is a file, not a directory"):
        model.export(str(tmp_path / "file" / "sub" / "m.onnx"), format="onnx",
                     shapes={"batch": 1, "sequence": 4})
    assert (tmp_path / "file").read_text() == "keep me"
    assert not list(tmp_path.glob("*.onnx"))  # nothing was written


@pytest.mark.spread
def test_export_makes_a_missing_directory(tmp_path):
    # torch's ONNX exporter failed with an INTERNAL ASSERT RuntimeError for a missing
    # directory.
    path = tmp_path / "new" / "sub" / "m.onnx"
    assert _gpt().export(path, format="onnx", shapes={"batch": 1, "sequence": 4}) == str(path)
    assert path.stat().st_size > 0


# === LoRA weights files ===


def test_save_lora_weights_checks_its_path(tmp_path):
    model = _gpt()
    model.enable_lora(2)
    # None was os.fspath's TypeError; a directory an IsADirectoryError from os.replace that
    # left the temporary file behind; a missing directory a FileNotFoundError.
    for call in (model.save_lora_weights, model.load_lora_weights):
        with pytest.raises(ValueError, match=r"`path` must be a path to a \.npz file; got "
                                             r"path=None"):
            call(None)
    (tmp_path / "dir.npz").mkdir()
    with pytest.raises(ValueError, match=r"`path` must be a file path; '.*dir\.npz' is a "
                                         r"directory"):
        model.save_lora_weights(tmp_path / "dir.npz")
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(ValueError, match=r"`path` cannot be written \(path='.*a\.npz'\): "
                                         r"'.*file' is a file, not a directory"):
        model.save_lora_weights(tmp_path / "file" / "a.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.npz", "file"]
    path = tmp_path / "new" / "a.npz"
    assert model.save_lora_weights(path) == str(path)
    _gpt().load_lora_weights(path)


def test_mask_tokens_checks_special_ids_and_seed():
    from kzoo.data import mask_tokens

    ids = np.arange(5, 25).reshape(2, 10)
    # Float special ids were truncated to other ids (1.5 kept id 1 unmasked) in silence; a
    # string failed in int(), nested lists in NumPy, a negative seed in NumPy naming no
    # argument.
    for special in ([1.5], "ab", [[1]], [True], 3):
        with pytest.raises(ValueError, match=r"`special_ids` must be a sequence of integer "
                                             r"token ids; got special_ids="):
            mask_tokens(ids, 1, 30, rng=0, special_ids=special)
    with pytest.raises(ValueError, match=r"`rng` must be None, a non-negative integer seed .*"
                                         r"got rng=-1\."):
        mask_tokens(ids, 1, 30, rng=-1)
    got = mask_tokens(ids, 1, 30, rng=np.int64(0), special_ids=(i for i in np.array([5, 6])))
    want = mask_tokens(ids, 1, 30, rng=0, special_ids=(5, 6))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_char_tokenizer_refuses_text_where_ids_or_texts_go():
    from kzoo.data import CharTokenizer

    tokenizer = CharTokenizer("abc")
    # batch_encode("ab") encoded one text a character in silence.
    with pytest.raises(ValueError, match=r"`texts` must be a sequence of strings; got the "
                                         r"string 'ab'"):
        tokenizer.batch_encode("ab", 4)
    # decode("ab") was a TypeError from a comparison; 1.5 "outside [0, 7)"; True read as 1.
    for ids, given in (("ab", r"a str, 'ab'"), ([4.0], r"an array of dtype float64"),
                       ([True], r"an array of dtype bool")):
        with pytest.raises(ValueError, match=rf"`ids` must be integer token ids in \[0, 7\); "
                                             rf"got {given}"):
            tokenizer.decode(ids)
    with pytest.raises(ValueError, match=r"`characters` must be .*got characters=5\."):
        CharTokenizer(5)
    assert tokenizer.decode(np.array(tokenizer.encode("cab"), "uint8")) == "cab"
    assert tokenizer.decode([]) == ""


@pytest.mark.parametrize("dtype, mode", [("int8_from_float32", "int8"),
                                         ("float8_from_float32", "float8")])
def test_presets_load_refuses_a_quantized_dtype_policy(dtype, mode):
    import kzoo

    # Built the model, then failed in `quantize`: "no float Dense/Embedding layer left to
    # quantize ... (already quantized?)".
    with pytest.raises(ValueError, match=rf"`dtype` must be a floating-point dtype policy; "
                                         rf"got dtype='{dtype}', a quantized one: build the "
                                         rf"model in float32 and call `model\.quantize\("
                                         rf"'{mode}'\)`"):
        kzoo.presets.load("gpt_mini", dtype=dtype, num_layers=1, hidden_dim=16,
                          num_heads=2, intermediate_dim=32)


@pytest.mark.parametrize("call", ["quantize", "enable_lora", "merge_lora", "save_lora_weights",
                                  "load_lora_weights"])
def test_quantize_and_lora_functions_refuse_what_is_not_a_model(call, tmp_path):
    import kzoo.lora
    import kzoo.quantize

    # Were AttributeErrors from inside ("'NoneType' object has no attribute 'built'",
    # "'str' object has no attribute '_flatten_layers'").
    function = getattr(kzoo.quantize if call == "quantize" else kzoo.lora, call)
    args = {"quantize": ("int8",), "enable_lora": (2,), "merge_lora": (),
            "save_lora_weights": (str(tmp_path / "a.npz"),),
            "load_lora_weights": (str(tmp_path / "a.npz"),)}[call]
    for model in (None, "gpt_mini"):
        with pytest.raises(ValueError, match=r"`model` must be a Keras model \(a kzoo "
                                             rf"backbone or task model\); got "
                                             rf"{type(model).__name__}\."):
            function(model, *args)


def test_load_of_a_path_that_does_not_exist_says_so(tmp_path):
    import kzoo

    # Was "`name` must be a preset name (no path separators ...)", as if the path were a name.
    for path in (tmp_path / "missing.keras", tmp_path / "no" / "dir", "./no_such_dir",
                 "missing.keras"):
        with pytest.raises(ValueError, match=r"`name_or_path` '.*' does not exist \(no such "
                                             r"file or directory\)"):
            kzoo.presets.load(path)
    with pytest.raises(ValueError, match=r"Unknown preset name='gpt_minii'. Did you mean"):
        kzoo.presets.load("gpt_minii")  # (a name stays a name)


# A warning made in Python before decoding, the same on every backend: each case on one.
@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_generate_warns_that_greedy_ignores_sampling_controls(family):
    import warnings

    model = _gpt() if family == "gpt" else _t5()
    prompts = [[3, 4, 5]]
    # (ignored in silence before; transformers warns the same way)
    with pytest.warns(UserWarning, match=r"temperature=0\.5, top_k=3: temperature, top_k and "
                                         r"top_p apply only to strategy='sample'; "
                                         r"strategy='greedy' ignores them"):
        greedy = model.generate(prompts, max_new_tokens=2, temperature=0.5, top_k=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # no such warning for the defaults
        assert model.generate(prompts, max_new_tokens=2) == greedy
    assert not [w for w in caught if "apply only to strategy" in str(w.message)]


def test_make_sampler_warns_only_where_sampling_controls_are_ignored():
    import warnings

    from kzoo.generation import make_sampler

    with pytest.warns(UserWarning, match=r"top_p=0\.9: .*strategy='beam' ignores them"):
        make_sampler("beam", top_p=0.9, num_beams=2)
    with pytest.warns(UserWarning, match=r"top_k=5: .*strategy='greedy' ignores them"):
        make_sampler("greedy", top_k=5, num_beams=3)  # (beam search by num_beams)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_sampler("sample", 0.5, 3, 0.9)
        make_sampler("greedy")
        make_sampler("beam", num_beams=2)
    assert not [w for w in caught if "apply only to strategy" in str(w.message)]


# === generate: sampling controls, beams and lengths at their limits ===


def test_generate_top_k_at_or_above_the_vocabulary_keeps_every_token():
    from kzoo.generation import filter_logits

    # Accepted and the same on every backend (transformers clamps top_k to the vocabulary
    # the same way): no top_k of more entries than there are is asked of the backend.
    model = _gpt()
    vocab = model.backbone.vocabulary_size
    options = dict(max_new_tokens=3, strategy="sample", seed=0, stop_token_ids=None,
                   compile=False)
    every = model.generate([[3, 4, 5]], **options)
    assert all(0 <= token < vocab for token in every[0])
    for top_k in (vocab, vocab + 1, 2 ** 40, np.int64(vocab + 7)):
        assert model.generate([[3, 4, 5]], top_k=top_k, **options) == every, top_k
    logits = np.array([[1.0, 3.0, 2.0]], "float32")
    np.testing.assert_array_equal(np.asarray(filter_logits(logits, top_k=4)), logits)


@pytest.mark.parametrize("name, value, message", [
    ("top_k", 0, "`top_k` must be None or a positive integer; got top_k=0."),
    ("top_k", -1, "`top_k` must be None or a positive integer; got top_k=-1."),
    ("top_k", 2.0, "`top_k` must be None or a positive integer; got top_k=2.0."),
    ("top_k", True, "`top_k` must be None or a positive integer; got top_k=True."),
    ("top_p", 0, "`top_p` must be None or a number in (0, 1]; got top_p=0."),
    ("top_p", 1.5, "`top_p` must be None or a number in (0, 1]; got top_p=1.5."),
    ("top_p", float("nan"), "`top_p` must be None or a number in (0, 1]; got top_p=nan."),
    ("top_p", "0.5", "`top_p` must be None or a number in (0, 1]; got top_p='0.5'."),
    ("temperature", 0, "`temperature` must be a positive finite number; got temperature=0."),
    ("temperature", -1.0, "`temperature` must be a positive finite number; got "
                          "temperature=-1.0."),
    ("temperature", float("inf"), "`temperature` must be a positive finite number; got "
                                  "temperature=inf."),
    ("temperature", "1", "`temperature` must be a positive finite number; got "
                         "temperature='1'."),
    ("num_beams", 0, "`num_beams` must be a positive integer; got num_beams=0."),
    ("num_beams", 2.0, "`num_beams` must be a positive integer; got num_beams=2.0."),
    ("num_beams", True, "`num_beams` must be a positive integer; got num_beams=True."),
    ("max_new_tokens", 0, "`max_new_tokens` must be a positive integer; got max_new_tokens=0."),
    ("max_new_tokens", -3, "`max_new_tokens` must be a positive integer; got "
                           "max_new_tokens=-3."),
    ("max_new_tokens", 2.0, "`max_new_tokens` must be a positive integer; got "
                            "max_new_tokens=2.0."),
    ("max_new_tokens", "3", "`max_new_tokens` must be a positive integer; got "
                            "max_new_tokens='3'."),
])
def test_generate_refuses_sampling_controls_beams_and_lengths_out_of_range(name, value,
                                                                           message):
    # (already refused before any decoding; kept so that it stays so)
    strategy = "beam" if name == "num_beams" else "sample"
    options = {"strategy": strategy, "max_new_tokens": 2, name: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        _gpt().generate([[3, 4, 5]], **options)


def test_generate_refuses_beams_past_int32_or_memory(monkeypatch):
    from kzoo import generation

    model = _gpt()  # vocabulary_size=260
    # Beam search ranks num_beams * vocabulary_size candidates with int32 indices; past
    # 2**31 the ids would wrap around.
    with pytest.raises(ValueError, match=r"`num_beams` is too large: num_beams=8259553 beams "
                                         r"x vocabulary_size=260 tokens is 2,147,483,780 "
                                         r"candidates a step.* give at most "
                                         r"num_beams=8259552\."):
        model.generate([[3, 4, 5]], num_beams=2 ** 31 // 260 + 1, max_new_tokens=2)
    # The cache *and* the step logits of batch x num_beams rows are counted against the
    # machine's memory (10**6 beams were accepted and allocated for seconds; the message
    # named max_new_tokens alone).
    monkeypatch.setattr(generation, "_memory_bytes", lambda: 2 ** 20)
    with pytest.raises(ValueError, match=r"`max_new_tokens` / `num_beams` are too large for "
                                         r"this batch: max_new_tokens=2 and num_beams=1000 "
                                         r"for 1 prompt\(s\) need 5\.2 MiB \(a key/value "
                                         r"cache of 1\.2 MiB for 10 positions x 1000 rows, "
                                         r"and 4\.0 MiB of step logits\), more than this "
                                         r"machine's memory \(1\.0 MiB\)"):
        model.generate([[3, 4, 5]], num_beams=1000, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`max_new_tokens` / `num_beams` are too large .* "
                                         r"num_beams=1000 for 2 prompt\(s\)"):
        _t5().generate([[3, 4], [5]], num_beams=1000, max_new_tokens=2)
    monkeypatch.setattr(generation, "_memory_bytes", lambda: 2 ** 10)
    with pytest.raises(ValueError, match=r"^`max_new_tokens` is too large for this batch: "
                                         r"max_new_tokens=2 for 1 prompt\(s\)"):
        model.generate([[3, 4, 5]], max_new_tokens=2)


def test_beam_search_with_more_beams_or_stop_ids_than_tokens():
    import kzoo

    model = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                              intermediate_dim=32, max_sequence_length=16,
                              vocabulary_size=16)
    prompt = [3, 4, 5]
    # A stop id for every token (some repeated) asked each backend's top_k for more
    # candidates than num_beams x vocabulary: JAX's and TensorFlow's top_k failed, torch's
    # with "selected index k out of range". Now every candidate stops at once: the best
    # first token, as greedy decoding finds it.
    stops = list(range(16)) + [3] * 20
    greedy = model.generate([prompt], max_new_tokens=1, stop_token_ids=None)
    assert model.generate([prompt], max_new_tokens=2, num_beams=2,
                          stop_token_ids=stops) == greedy
    # More beams than tokens (allowed, as in transformers): every prefix is kept, so two
    # steps are an exhaustive search; the result scores as the best of the 16 x 16.
    got = model.generate([prompt], max_new_tokens=2, num_beams=17, stop_token_ids=None)[0]
    ids = np.array([prompt + [t] for t in range(16)], "int32")
    logits = np.asarray(model.predict_on_batch(
        {"token_ids": ids, "padding_mask": np.ones_like(ids)}), "float64")
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    scores = log_probs[0, -2][:, None] + log_probs[:, -1]  # first token x second token
    assert got[0] in range(16) and got[1] in range(16)
    np.testing.assert_allclose(scores[got[0], got[1]], scores.max(), atol=1e-5)


# === generate: prompts as a dict ===


# Prompt checks in Python, the same on every backend: each case on one backend (`spread`).
@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_generate_dict_prompts_take_the_model_input_names_only(family):
    model = _gpt() if family == "gpt" else _t5()
    ids_key, mask_key = (("token_ids", "padding_mask") if family == "gpt"
                         else ("encoder_token_ids", "encoder_padding_mask"))
    ids, mask = np.array([[3, 4, 5, 6]], "int32"), np.array([[1, 1, 1, 0]], "int32")
    allowed = re.escape(f"`prompts` as a dict takes the keys {[ids_key, mask_key]} (the "
                        "second optional); got unknown key(s) ")
    # T5 ignored unknown keys in silence (a misspelled mask: every token taken as real);
    # GPT refused every dict with "must hold integer token ids; got an array of dtype
    # object and shape ()". Both now take their model's own input names and no other.
    with pytest.raises(ValueError, match=allowed + r"\['foo'\]\.$"):
        model.generate({ids_key: ids, "foo": 1}, max_new_tokens=1)
    with pytest.raises(ValueError, match=allowed + rf"\['{mask_key[:-1]}'\]"):
        model.generate({ids_key: ids, mask_key[:-1]: mask}, max_new_tokens=1)
    if family == "t5":
        with pytest.raises(ValueError, match=allowed + r"\['decoder_token_ids'\] \(generate "
                                                       r"makes the decoder's inputs itself: it "
                                                       r"starts from `decoder_start_token_id`"):
            model.generate({ids_key: ids, "decoder_token_ids": ids}, max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"`prompts` as a dict needs '{ids_key}' \(and "
                                         rf"optionally '{mask_key}'\); got keys \['{mask_key}'"):
        model.generate({mask_key: mask}, max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"Give the padding mask once: `padding_mask` or the "
                                         rf"dict's '{mask_key}', not both"):
        model.generate({ids_key: ids, mask_key: mask}, padding_mask=mask, max_new_tokens=1)
    # The allowed keys give what the array and its padding_mask give.
    options = dict(max_new_tokens=2, stop_token_ids=None)
    assert (model.generate({ids_key: ids, mask_key: mask}, **options)
            == model.generate(ids, padding_mask=mask, **options))
    assert model.generate({ids_key: ids}, **options) == model.generate(ids, **options)


# === export: keyword options ===


def test_export_refuses_options_the_format_does_not_read(tmp_path):
    from kzoo.export import export_formats, export_options

    model = _gpt()
    # Keras' exporters pass what they do not read on to nothing (torch's ONNX and
    # TensorFlow's SavedModel / ONNX ignored a misspelled option in silence) or to a
    # converter that failed late.
    for format in export_formats():
        path = str(tmp_path / ("m" + {"onnx": ".onnx", "litert": ".tflite"}.get(format, "")))
        options = export_options(format)
        assert options is None or isinstance(options, tuple)
        takes = (rf"takes the options \[.*'{options[0]}'.*\]" if options
                 else "takes no options")
        with pytest.raises(ValueError, match=rf"Unknown export option\(s\) \['opset_versoin'\] "
                                             rf"for format='{format}' on the \w+ backend, "
                                             rf"which {takes} besides filepath"):
            model.export(path, format=format, opset_versoin=17)
    assert export_options("onnx") == ("opset_version",)
    for opset in ("17", 0, 17.0, True):
        with pytest.raises(ValueError, match=r"`opset_version` must be None or a positive int "
                                             rf"\(an ONNX opset\); got "
                                             rf"opset_version={re.escape(repr(opset))}\."):
            model.export(str(tmp_path / "m.onnx"), format="onnx", opset_version=opset)
    if "jax2tf_kwargs" in export_options("tf_saved_model"):  # JAX
        with pytest.raises(ValueError, match=r"`jax2tf_kwargs` must be None or a dict of "
                                             r"`jax2tf.convert` arguments; got "
                                             r"jax2tf_kwargs=\['x'\]\."):
            model.export(str(tmp_path / "saved"), jax2tf_kwargs=["x"])
        with pytest.raises(ValueError, match=r"`is_static` must be True or False; got "
                                             r"is_static='no'\."):
            model.export(str(tmp_path / "saved"), is_static="no")
    if "litert" in export_formats():
        assert "optimizations" in export_options("litert")
        with pytest.raises(ValueError, match=r"Unknown export option\(s\) \['optimisations'\]"):
            model.export(str(tmp_path / "m.tflite"), format="litert", optimisations=[])
    assert not list(tmp_path.iterdir())  # nothing was written


# === BERT: the pooler under the masked-LM head ===


def test_masked_lm_fit_leaves_the_unused_pooler_alone_and_a_classifier_trains_it():
    import warnings

    import keras

    from kzoo.models.bert import BertBackbone, BertClassifier, BertMaskedLM

    backbone = BertBackbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
                            intermediate_dim=16, max_sequence_length=8)
    mlm = BertMaskedLM(backbone)
    classifier = BertClassifier(backbone, num_classes=2)  # the same backbone
    pooler = backbone.pooler_dense
    pooler_ids = {id(w) for w in pooler.weights}

    def pooler_values():
        return [keras.ops.convert_to_numpy(w).copy() for w in pooler.weights]

    x = {"token_ids": np.array([[5, 6, 7, 8], [9, 10, 11, 12]], "int32"),
         "segment_ids": np.zeros((2, 4), "int32"), "padding_mask": np.ones((2, 4), "int32")}
    # torch and TensorFlow warned "Gradients do not exist for variables ['pooler_dense/
    # kernel', 'pooler_dense/bias']" at every MLM fit; JAX gave them a zero gradient, which
    # AdamW's weight decay applied (the pooler drifted).
    before = pooler_values()
    count = len(mlm.weights)
    mlm.compile(keras.optimizers.AdamW(1e-2, weight_decay=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mlm.fit(x, np.ones((2, 4), "int32"), batch_size=2, epochs=1, verbose=0)
    assert not [w for w in caught if "Gradients do not exist" in str(w.message)]
    for old, new in zip(before, pooler_values()):
        np.testing.assert_array_equal(old, new)
    assert not pooler_ids & {id(w) for w in mlm.trainable_weights + mlm.trainable_variables}
    assert pooler_ids <= {id(w) for w in mlm.non_trainable_weights}
    assert pooler_ids <= {id(w) for w in mlm.non_trainable_variables}
    assert len(mlm.weights) == count  # still saved with the model
    # A classifier on the same backbone (and the backbone itself) still trains the pooler.
    assert pooler_ids <= {id(w) for w in classifier.trainable_weights}
    assert pooler_ids <= {id(w) for w in backbone.trainable_weights}
    classifier.compile(keras.optimizers.Adam(1e-2),
                       keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        classifier.fit(x, np.array([0, 1]), batch_size=2, epochs=1, verbose=0)
    assert not [w for w in caught if "Gradients do not exist" in str(w.message)]
    for old, new in zip(before, pooler_values()):
        assert not np.array_equal(old, new)


# === Training entry points: no examples, default losses ===

import keras  # noqa: E402

import kzoo.presets  # noqa: E402


@pytest.mark.parametrize("method", ["fit", "evaluate", "train_on_batch", "test_on_batch"])
def test_training_and_evaluating_on_no_examples_is_refused(method):
    """A batch of 0 rows: torch's data adapter had said "num_samples should be a positive
    integer", JAX a bare StopIteration, TensorFlow nothing (no step, a warning)."""
    lm = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                           intermediate_dim=32, max_sequence_length=16)
    lm.compile(optimizer="sgd")
    ids = np.zeros((0, 8), "int32")
    with pytest.raises(ValueError, match=f"{method}'s x has no rows \\(a batch of 0"):
        getattr(lm, method)({"token_ids": ids, "padding_mask": np.ones_like(ids)}, ids)
    assert lm.predict({"token_ids": ids}, verbose=0).shape == (0, 8, lm.backbone.vocabulary_size)


def test_classifiers_and_predictors_have_a_default_loss():
    """`compile(optimizer)` alone, as for the token models: transformers' choice of loss for
    its heads (JAX had trained on a loss of 0 without one, the other backends said "No loss
    to compute" at `fit`)."""
    from kzoo.models.graphormer import GraphormerPredictor

    bert = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=16,
                vocabulary_size=50, max_sequence_length=8)
    x = {"token_ids": np.arange(16, dtype="int32").reshape(2, 8)}
    clf = kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=3, **bert)
    clf.compile(optimizer="adamw")
    assert isinstance(clf.loss, keras.losses.SparseCategoricalCrossentropy)
    assert clf.loss.get_config()["from_logits"]
    loss = clf.fit(x, np.array([0, 2]), verbose=0).history["loss"][0]
    assert np.isfinite(loss) and loss > 0.1  # ~ln 3 for a fresh head
    with pytest.raises(ValueError, match="holds 5"):
        clf.fit(x, np.array([0, 5]), verbose=0)
    one = kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=1, **bert)
    one.compile(optimizer="adamw")
    assert isinstance(one.loss, keras.losses.MeanSquaredError)
    vit = kzoo.presets.load("vit_tiny_patch16_224", num_classes=4, image_size=32,
                            num_layers=1)
    vit.compile(optimizer="adamw")
    assert isinstance(vit.loss, keras.losses.SparseCategoricalCrossentropy)
    from kzoo.models.graphormer import GraphormerBackbone

    backbone = GraphormerBackbone(num_layers=1, hidden_dim=8, intermediate_dim=8,
                                  num_heads=2)
    for classes, kind in ((1, keras.losses.MeanSquaredError),
                          (3, keras.losses.SparseCategoricalCrossentropy)):
        predictor = GraphormerPredictor(backbone, num_classes=classes)
        predictor.compile(optimizer="adam")
        assert isinstance(predictor.loss, kind)


def test_images_graph_biases_and_unbatched_inputs_are_checked_at_the_model():
    """Model-level wiring of `kzoo.inputs`' rank and float checks: a NaN pixel had made
    every ViT output NaN and `fit` every weight NaN; a NaN or +inf in Graphormer's
    `attn_bias` had been read as -inf (never attend), and one of the wrong shape failed in
    each backend's own words; one example without its batch axis got Keras' input-spec
    error naming the filled-in `padding_mask`."""
    vit = kzoo.presets.load("vit_tiny_patch16_224", num_classes=3, image_size=32,
                            num_layers=1)
    vit.compile(optimizer="sgd")
    images = np.zeros((2, 32, 32, 3), "float32")
    bad = images.copy()
    bad[1, 5, 6, 2] = np.nan
    for call in (lambda: vit.predict(bad, verbose=0), lambda: vit(bad),
                 lambda: vit.fit(bad, np.array([0, 1]), verbose=0)):
        with pytest.raises(ValueError, match=r"`images` \(.*\) holds nan at image 1, row 5, "
                                             r"column 6, channel 2"):
            call()
    with pytest.raises(ValueError, match=r"`images` .* must have 4 axes .*one example "
                                         r"without its batch axis"):
        vit.predict(images[0], verbose=0)
    graph = kzoo.presets.load("graphormer_slim", num_layers=1)
    x = graphs.batch([dict(_GRAPH, y=None)])
    masked = dict(x, attn_bias=x["attn_bias"].copy())
    masked["attn_bias"][0, 0, 1] = -np.inf  # allowed: a pair that must not attend
    graph.predict(masked, verbose=0)
    for value in (np.nan, np.inf):
        bad = dict(x, attn_bias=x["attn_bias"].copy())
        bad["attn_bias"][0, 0, 1] = value
        with pytest.raises(ValueError, match=rf"`attn_bias` .* holds {value} at graph 0"):
            graph.predict(bad, verbose=0)
    with pytest.raises(ValueError, match=r"`attn_bias` .* must have shape \(batch, n \+ 1, "
                                         r"n \+ 1\) = \(1, 4, 4\)"):
        graph.predict(dict(x, attn_bias=x["attn_bias"][:, :3, :3]), verbose=0)
    lm = kzoo.presets.load("gpt_mini", num_layers=1, hidden_dim=16, num_heads=2,
                           intermediate_dim=32, max_sequence_length=16)
    with pytest.raises(ValueError, match=r"`token_ids` .* must have 2 axes \(batch row, "
                                         r"token\); got shape \(3,\)\. It looks like one"):
        lm.predict({"token_ids": np.array([1, 2, 3])}, verbose=0)
