"""Preset registry: names, errors, directory round trips, and saves that cross backends."""

import json
import os
import pathlib
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import keras
import numpy as np
import pytest

import kzoo
from tests.helpers import backend, to_numpy

REQUIRED = [
    "bert_tiny_uncased", "bert_mini_uncased", "bert_small_uncased", "bert_medium_uncased",
    "bert_base_uncased", "bert_large_uncased",
    "gpt_mini", "gpt2", "gpt2_medium", "gpt2_large", "gpt2_xl", "gpt_modern_mini", "gpt_moe_mini",
    "gpt_long_mini",
    "t5_small", "t5_base", "t5_large", "t5_v1_1_small", "t5_v1_1_base",
    "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
    "vit_large_patch16_224",
    "graphormer_slim", "graphormer_base",
]

# Published parameter counts (the papers / model cards) that each preset must match within 1%.
PUBLISHED = {
    "bert_base_uncased": 110e6, "bert_large_uncased": 340e6,
    "gpt2": 124e6, "gpt2_medium": 355e6, "gpt2_large": 774e6, "gpt2_xl": 1558e6,
    "t5_small": 60.5e6, "t5_base": 223e6, "t5_large": 738e6,
    "vit_base_patch16_224": 86.6e6, "vit_large_patch16_224": 304e6,
}

# Small models, shrunk further with overrides, that every backend saves and loads.
SMALL = {
    "gpt_mini": dict(num_layers=1, hidden_dim=32, num_heads=2, intermediate_dim=64),
    "bert_tiny_uncased": dict(num_layers=1, vocabulary_size=100),
    "gpt_modern_mini": dict(num_layers=1),
}


def _inputs(family, model):
    r = np.random.default_rng(0)
    if family == "bert":
        ids = r.integers(0, 100, size=(2, 8)).astype("int32")
        return {"token_ids": ids, "segment_ids": np.zeros_like(ids),
                "padding_mask": np.ones_like(ids)}
    ids = r.integers(0, 50, size=(2, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}


def test_required_presets_exist_and_describe_themselves():
    names = kzoo.presets.list()
    missing = [n for n in REQUIRED if n not in names]
    assert not missing, f"missing presets: {missing}"
    for name in names:
        spec = kzoo.presets.info(name)
        for field in ("family", "task", "config", "paper", "params", "description"):
            assert field in spec, f"{name} lacks {field}"
        assert spec["name"] == name
    for name, published in PUBLISHED.items():
        params = kzoo.presets.info(name)["params"]
        # BERT-Large's "340M" is the paper's rounding: the architecture has 335.1M in the
        # encoder (transformers' BertModel agrees), 336.2M with the MLM head.
        tolerance = 0.012 if name == "bert_large_uncased" else 0.01
        assert abs(params - published) / published < tolerance, (name, params, published)


def test_unknown_names_and_bad_overrides_are_explained():
    with pytest.raises(ValueError, match="gpt2") as err:
        kzoo.presets.load("gtp2")
    assert "Known presets" in str(err.value)
    with pytest.raises(ValueError, match="num_layerz"):
        kzoo.presets.load("gpt_mini", num_layerz=2)
    with pytest.raises(ValueError, match="task"):
        kzoo.presets.load("gpt_mini", task="translation")
    with pytest.raises(ValueError, match="neither"):
        kzoo.presets.load(os.path.dirname(__file__))


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_file_of_the_presets_directory_is_a_listed_preset():
    names = kzoo.presets.list()
    assert len(names) == 25 and sorted(REQUIRED) == names
    files = sorted(p.name for p in (ROOT / "presets").iterdir())
    assert files == [n + ".json" for n in names]
    for name in names:  # each file parses to the preset of its name
        assert json.loads((ROOT / "presets" / f"{name}.json").read_text())["name"] == name


def test_presets_ship_inside_the_package():
    # In this checkout the presets come from the top-level presets/ directory ...
    assert pathlib.Path(str(kzoo.registry.preset_dir())) == ROOT / "presets"
    assert kzoo.registry.preset_dir().joinpath("gpt2.json").is_file()
    # ... which a wheel installs as the data package kzoo.preset_files, with every package of
    # the source tree (the list in pyproject.toml is written out, so check it is complete).
    with open(ROOT / "pyproject.toml", "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    assert setup["package-dir"] == {"kzoo.preset_files": "presets"}
    assert setup["package-data"] == {"kzoo.preset_files": ["*.json"]}
    on_disk = sorted(
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("kzoo", "training") for init in (ROOT / top).rglob("__init__.py")
    )
    assert sorted(setup["packages"]) == sorted(on_disk + ["kzoo.preset_files"])


@pytest.mark.spread
@pytest.mark.parametrize("name", sorted(SMALL))
def test_save_directory_round_trip(name, tmp_path):
    model = kzoo.presets.load(name, **SMALL[name])
    family = kzoo.presets.info(name)["family"]
    x = _inputs(family, model)
    expected = to_numpy(model.predict(x, verbose=0))
    kzoo.presets.save(model, tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "kzoo_config.json").read_text())
    assert meta["family"] == family and meta["saved_with_backend"] == backend()
    loaded = kzoo.presets.load(tmp_path / "m")
    np.testing.assert_allclose(to_numpy(loaded.predict(x, verbose=0)), expected, atol=1e-5)
    # The same directory as a backbone only.
    bb = kzoo.presets.load(tmp_path / "m", task="backbone")
    assert getattr(bb, "task_name", None) is None


def test_saved_directory_keeps_the_tokenizer_for_text_prompts(tmp_path):
    """A model with a tokenizer (e.g. loaded from a Hugging Face directory) saved in kzoo's
    format keeps it (`tokenizer.json`), and a kzoo directory holding one (the training
    recipes', the demo's) loads with it: `generate` takes text after `load`, as the demo's
    "Reload it with kzoo.presets.load(...)" promises. Before, it refused text prompts."""
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(50)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    model = kzoo.presets.load("gpt_mini", **SMALL["gpt_mini"], vocabulary_size=50)
    model.tokenizer = tok
    kzoo.presets.save(model, tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert not [f for f in os.listdir(tmp_path / "m") if ".tmp" in f]
    ids = model.generate([[3, 4]], max_new_tokens=3, stop_token_ids=None)[0]
    expected = " ".join(words[i] for i in [3, 4] + ids)
    for loaded in (kzoo.presets.load(tmp_path / "m"),
                   kzoo.presets.load(tmp_path / "m", weights=False)):
        assert loaded.tokenizer.get_vocab() == tok.get_vocab()
    loaded = kzoo.presets.load(tmp_path / "m")
    assert loaded.generate("w3 w4", max_new_tokens=3, stop_token_ids=None) == expected
    # A model without one writes none (and a directory without one loads without one).
    bare = kzoo.presets.load("gpt_mini", **SMALL["gpt_mini"])
    kzoo.presets.save(bare, tmp_path / "bare")
    assert not (tmp_path / "bare" / "tokenizer.json").exists()
    assert getattr(kzoo.presets.load(tmp_path / "bare"), "tokenizer", None) is None


_LOAD_SCRIPT = r"""
import sys, numpy as np, kzoo
for model_dir, inputs, out in zip(*[iter(sys.argv[1:])] * 3):
    model = kzoo.presets.load(model_dir)
    x = dict(np.load(inputs))
    np.save(out, np.asarray(model.predict(x, verbose=0)))
"""


@pytest.mark.spread
def test_saved_on_this_backend_loads_on_the_others(tmp_path):
    """GPT and BERT presets saved here give the same outputs loaded on the other two backends
    (one process a backend loads both: a process' start, importing its framework, is most of
    the cost)."""
    expected = {}
    for name in ("gpt_mini", "bert_tiny_uncased"):
        model = kzoo.presets.load(name, **SMALL[name])
        x = _inputs(kzoo.presets.info(name)["family"], model)
        expected[name] = to_numpy(model.predict(x, verbose=0))
        kzoo.presets.save(model, tmp_path / name)
        np.savez(tmp_path / f"{name}.npz", **x)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for other in ("jax", "torch", "tensorflow"):
        if other == backend():
            continue
        args = []
        for name in expected:
            args += [str(tmp_path / name), str(tmp_path / f"{name}.npz"),
                     str(tmp_path / f"{name}-{other}.npy")]
        env = dict(os.environ, KERAS_BACKEND=other, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        for name, want in expected.items():
            np.testing.assert_allclose(np.load(tmp_path / f"{name}-{other}.npy"), want,
                                       atol=1e-5, err_msg=f"{name} saved on {backend()}, "
                                                          f"loaded on {other}")


_RESUME_SCRIPT = r"""
import sys, numpy as np, keras, kzoo
path, data, out = sys.argv[1:]
model = keras.saving.load_model(path)
z = dict(np.load(data))
x = {k[2:]: z[k] for k in z if k.startswith("x_")}
opt = model.optimizer
moments = {"m_" + v.path: np.asarray(opt._momentums[opt._get_variable_index(v)])
           for v in model.trainable_variables}
loss = float(np.asarray(model.train_on_batch(x, z["y"])))
np.savez(out, loss=loss, after=np.asarray(model.predict(x, verbose=0)),
         iterations=int(np.asarray(opt.iterations)), **moments)
"""


def _t5_tiny():
    return kzoo.presets.load("t5_small", num_layers=1, num_decoder_layers=1, hidden_dim=16,
                             num_heads=2, key_value_dim=8, intermediate_dim=32,
                             vocabulary_size=50, dropout=0.0)


def _check_resumes_on_other_backends(model, path, moments, x, y, tmp_path, *, iterations,
                                     loss_rtol, atol):
    """Train `model` (saved at `path` with Adam `moments` by variable path) one step here,
    then load `path` on each other backend (`_RESUME_SCRIPT` in a subprocess) and check
    its step count, every moment (bit for bit), the next step's loss and the outputs."""
    loss = float(to_numpy(model.train_on_batch(x, y)))
    after = to_numpy(model.predict(x, verbose=0))
    np.savez(tmp_path / "data.npz", y=y, **{"x_" + k: np.asarray(v) for k, v in x.items()})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for other in ("jax", "torch", "tensorflow"):
        if other == backend():
            continue
        out = tmp_path / f"{other}.npz"
        env = dict(os.environ, KERAS_BACKEND=other, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run([sys.executable, "-c", _RESUME_SCRIPT, str(path),
                               str(tmp_path / "data.npz"), str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"loaded on {other}: {proc.stderr[-3000:]}"
        got = np.load(out)
        assert int(got["iterations"]) == iterations
        for name, moment in moments.items():
            np.testing.assert_array_equal(got["m_" + name], moment,
                                          err_msg=f"{name}'s moment loaded on {other}")
        np.testing.assert_allclose(float(got["loss"]), loss, rtol=loss_rtol,
                                   err_msg=f"loaded on {other}")
        np.testing.assert_allclose(got["after"], after, atol=atol, err_msg=f"on {other}")


@pytest.mark.spread
def test_compiled_keras_file_resumes_training_on_the_other_backends(tmp_path):
    """A T5 compiled with AdamW, trained two steps and saved as `.keras` here continues on
    the other two backends: each variable's Adam moment is the one it had here (found by
    its path, not by its position) and the next step's loss and outputs are this backend's.
    Before: torch listed T5's variables in another order (the optimizer's moments failed to
    load: "The shape of the target variable ... must match"), a file saved on torch named
    torch's AdamW class (JAX / TensorFlow failed in its update) and one saved on JAX
    asked for `jit_compile=True` (torch.compile, which failed on torch)."""
    model = _t5_tiny()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-2))
    r = np.random.default_rng(0)
    x = {"encoder_token_ids": r.integers(1, 50, (2, 7)).astype("int32"),
         "encoder_padding_mask": np.array([[1] * 5 + [0] * 2, [1] * 7], "int32"),
         "decoder_token_ids": r.integers(1, 50, (2, 5)).astype("int32"),
         "decoder_padding_mask": np.ones((2, 5), "int32")}
    y = r.integers(0, 50, (2, 5)).astype("int32")
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    path = tmp_path / "t5.keras"
    model.save(path)
    opt = model.optimizer
    moments = {v.path: to_numpy(opt._momentums[opt._get_variable_index(v)])
               for v in model.trainable_variables}
    _check_resumes_on_other_backends(model, path, moments, x, y, tmp_path, iterations=3,
                                     loss_rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # (two other backends' processes: ~40 s)
def test_graphormer_keras_file_resumes_adamw_on_the_other_backends(tmp_path):
    """A Graphormer trained one AdamW step and saved as `.keras` here continues on the other
    two backends: its step count and every moment (by variable path) load bit for bit, the
    next step's loss (at the loaded weights) is this backend's to float32 rounding, and the
    outputs after that step agree to float32 noise as Adam amplifies it (measured, Dec 2026:
    loss 2.4e-7 apart, outputs up to 1.1e-5 on values of 0.5; the largest differences of
    the update are in the attention's key biases, whose gradient is zero in exact
    arithmetic, and any float32 residue of it becomes an update of lr * g / epsilon)."""
    from kzoo import graphs
    from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor

    keras.utils.set_random_seed(0)
    model = GraphormerPredictor(GraphormerBackbone(
        num_layers=2, hidden_dim=16, intermediate_dim=24, num_heads=4, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-2), loss="mse")
    x = graphs.batch([graphs.from_smiles(s) for s in
                      ["CCO", "c1ccccc1", "Cn1c(=O)c2c(ncn2C)n(C)c1=O", "CC(=O)[O-].[Na+]"]])
    x.pop("labels", None)
    y = np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    model.train_on_batch(x, y)
    path = tmp_path / "g.keras"
    model.save(path)
    opt = model.optimizer
    moments = {v.path: to_numpy(opt._momentums[opt._get_variable_index(v)])
               for v in model.trainable_variables}
    _check_resumes_on_other_backends(model, path, moments, x, y, tmp_path, iterations=2,
                                     loss_rtol=1e-6, atol=5e-5)


def test_keras_file_round_trip(tmp_path):
    model = kzoo.presets.load("gpt_mini", **SMALL["gpt_mini"])
    x = _inputs("gpt", model)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded.predict(x, verbose=0)),
                               to_numpy(model.predict(x, verbose=0)), atol=1e-5)


# -- damaged files, path traversal and old directories ------------------------------------------


def _saved_gpt(directory):
    model = kzoo.presets.load("gpt_mini", **SMALL["gpt_mini"])
    kzoo.presets.save(model, directory)
    return model


@pytest.mark.parametrize("content, problem", [
    (b"", "is empty"),
    (b"  \n", "is empty"),
    (b'{"family": "gpt", "config": {"num_la', "not valid JSON"),
    (b"\x00\x01garbage", "not valid JSON"),
    (b"[1, 2]", "must hold a JSON object"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_damaged_saved_config_names_the_file(tmp_path, content, problem):
    _saved_gpt(tmp_path / "m")
    (tmp_path / "m" / "kzoo_config.json").write_bytes(content)
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(tmp_path / "m")
    assert str(tmp_path / "m" / "kzoo_config.json") in str(err.value)


@pytest.mark.parametrize("edit, problem", [
    ({"family": "gtp"}, "Unknown family='gtp'.*Known families"),
    ({"task": "translation"}, "task='translation'"),
    ({"config": [1, 2]}, "`config` must be a JSON object"),
    ({"task_config": 3}, "`task_config` must be a JSON object"),
    ({"config": {"num_layerz": 2}}, "num_layerz"),
])
def test_wrong_entries_of_a_saved_config_name_the_file(tmp_path, edit, problem):
    _saved_gpt(tmp_path / "m")
    path = tmp_path / "m" / "kzoo_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(tmp_path / "m")
    assert str(path) in str(err.value)


def test_missing_or_damaged_weights_file_names_the_file(tmp_path):
    _saved_gpt(tmp_path / "m")
    weights = tmp_path / "m" / "model.weights.h5"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot be read") as err:
        kzoo.presets.load(tmp_path / "m")
    assert str(weights) in str(err.value)
    weights.unlink()
    with pytest.raises(ValueError, match="is missing") as err:
        kzoo.presets.load(tmp_path / "m")
    assert str(weights) in str(err.value)
    # Without weights the configuration alone still builds.
    assert kzoo.presets.load(tmp_path / "m", weights=False).count_params() > 0


@pytest.mark.parametrize("reference", [
    "../model.weights.h5", "sub/../../model.weights.h5", "/etc/passwd", "", 3,
])
def test_saved_config_cannot_point_outside_its_directory(tmp_path, reference):
    _saved_gpt(tmp_path / "m")
    outside = tmp_path / "model.weights.h5"  # a real file one level up: must not be read
    outside.write_bytes((tmp_path / "m" / "model.weights.h5").read_bytes())
    path = tmp_path / "m" / "kzoo_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "weights": reference}))
    with pytest.raises(ValueError, match="leaves its directory|non-empty file name"):
        kzoo.presets.load(tmp_path / "m")


def test_directory_saved_before_the_weights_entry_still_loads(tmp_path):
    # kzoo_config.json as the code before the registry wrote it: no "weights" entry.
    model = _saved_gpt(tmp_path / "m")
    path = tmp_path / "m" / "kzoo_config.json"
    meta = json.loads(path.read_text())
    assert meta.pop("weights") == "model.weights.h5"
    path.write_text(json.dumps(meta))
    x = _inputs("gpt", model)
    np.testing.assert_allclose(to_numpy(kzoo.presets.load(tmp_path / "m").predict(x, verbose=0)),
                               to_numpy(model.predict(x, verbose=0)), atol=1e-6)


@pytest.mark.parametrize("name", [
    "../presets/gpt2", "presets/gpt2", "/etc/passwd", ".gpt2", "gpt2/..", "C:gpt2", "gpt2\\..\\x",
])
def test_preset_names_cannot_be_paths(name):
    with pytest.raises(ValueError, match="must be a preset name") as err:
        kzoo.presets.load(name)
    assert "gpt2" in str(err.value)  # the known presets are listed
    with pytest.raises(ValueError, match="must be a preset name"):
        kzoo.presets.info(name)


@pytest.mark.parametrize("content, problem", [
    (b"", "is empty"),
    (b'{"name": "broken", "family": "gpt", "config": {', "not valid JSON"),
    (b'{"name": "broken", "family": "gtp", "config": {}}', "family='gtp'"),
    (b'{"name": "broken", "family": "gpt", "config": 7}', "`config` must be a JSON object"),
    (b'{"name": "broken", "family": "gpt", "task": "x", "config": {}}', "task='x'"),
])
def test_damaged_preset_file_names_the_file(tmp_path, monkeypatch, content, problem):
    (tmp_path / "broken.json").write_bytes(content)
    monkeypatch.setattr(kzoo.registry, "preset_dir", lambda: tmp_path)
    assert kzoo.presets.list() == ["broken"]
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load("broken")
    assert str(tmp_path / "broken.json") in str(err.value)


def _hf_gpt(directory):
    model = kzoo.presets.load("gpt_mini", **SMALL["gpt_mini"])
    kzoo.presets.save(model, directory, format="hf")
    return model


@pytest.mark.parametrize("content, problem", [
    (b"", "is empty"),
    (b'{"model_type": "gpt2", "n_embd": 3', "not valid JSON"),
    (b'{"model_type": 7}', "no string `model_type`"),
])
def test_damaged_hf_config_names_the_file(tmp_path, content, problem):
    _hf_gpt(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(tmp_path / "hf")
    assert str(tmp_path / "hf" / "config.json") in str(err.value)


def test_quantized_hf_checkpoint_is_refused_by_name(tmp_path):
    """transformers computes a checkpoint with a `quantization_config` from its quantized
    weights; kzoo read the config as a float one (its float tensors, if any, silently;
    GPTQ's `qweight` / `scales` ended in a missing-weights error that named no field)."""
    _hf_gpt(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    config_path.write_text(json.dumps(config))
    for load in (lambda: kzoo.presets.load(tmp_path / "hf"),
                 lambda: kzoo.presets.load("gpt_mini", **SMALL["gpt_mini"],
                                           weights=tmp_path / "hf")):
        with pytest.raises(ValueError, match="quantization_config.*'gptq'") as err:
            load()
        assert str(config_path) in str(err.value)


def test_hf_checkpoint_weights_problems_name_the_file(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = _hf_gpt(tmp_path / "hf")
    single = tmp_path / "hf" / "model.safetensors"
    state = load_file(single)
    data = single.read_bytes()
    single.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot be read") as err:
        kzoo.presets.load(tmp_path / "hf")
    assert str(single) in str(err.value)
    single.unlink()
    with pytest.raises(ValueError, match="No weights"):
        kzoo.presets.load(tmp_path / "hf")

    # A sharded checkpoint: two shards named by an index; it loads, then each damage is named.
    names = sorted(state)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / "hf" / shard))
    index = tmp_path / "hf" / "model.safetensors.index.json"

    def write_index(weight_map):
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    write_index({k: s for s, keys in shards.items() for k in keys})
    x = _inputs("gpt", model)
    np.testing.assert_allclose(
        to_numpy(kzoo.presets.load(tmp_path / "hf").predict(x, verbose=0)),
        to_numpy(model.predict(x, verbose=0)), atol=1e-5)
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "hf" / "a.safetensors").read_bytes())
    for shard in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        write_index({k: shard if s == "a.safetensors" else s
                     for s, keys in shards.items() for k in keys})
        with pytest.raises(ValueError, match="leaves its directory"):
            kzoo.presets.load(tmp_path / "hf")
    write_index({k: s.replace("b.", "c.") for s, keys in shards.items() for k in keys})
    with pytest.raises(ValueError, match="is missing") as err:
        kzoo.presets.load(tmp_path / "hf")
    assert str(tmp_path / "hf" / "c.safetensors") in str(err.value)
    index.write_text('{"weight_map": {"wte.weight": "a.safe')
    with pytest.raises(ValueError, match="not valid JSON") as err:
        kzoo.presets.load(tmp_path / "hf")
    assert str(index) in str(err.value)
    write_index({})
    with pytest.raises(ValueError, match="no `weight_map`"):
        kzoo.presets.load(tmp_path / "hf")


@pytest.mark.parametrize("format", ["kzoo", "hf"])
def test_interrupted_overwrite_never_loads_a_mixed_model(format, tmp_path, monkeypatch):
    """A save over an earlier checkpoint that stops after writing its weights, before its
    config (killed, disk full), left the old config beside the new weights: `load` built
    the old model (GELU) with the new one's weights (trained with ReLU) and said nothing
    (logits 0.06-0.6 from either). The old config is removed before the weights are
    replaced: such a directory is refused as having no config."""
    small = dict(SMALL["gpt_mini"], vocabulary_size=50)
    first = kzoo.presets.load("gpt_mini", **small)
    second = kzoo.presets.load("gpt_mini", **dict(small, activation="relu"))
    kzoo.presets.save(first, tmp_path / "m", format=format)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("killed while saving")

    with monkeypatch.context() as patch:
        patch.setattr(kzoo.checkpoints, "write_json", interrupted)
        with pytest.raises(KeyboardInterrupt):
            kzoo.presets.save(second, tmp_path / "m", format=format)
    with pytest.raises(ValueError, match="is neither a kzoo preset directory"):
        kzoo.presets.load(tmp_path / "m")
    kzoo.presets.save(second, tmp_path / "m", format=format)  # a save run to its end
    assert kzoo.presets.load(tmp_path / "m").backbone.activation == "relu"


@pytest.mark.spread
@pytest.mark.parametrize("format", ["kzoo", "hf", "keras_hub"])
def test_save_with_overwrite_false_refuses_an_existing_checkpoint(format, tmp_path):
    """`overwrite=False` refuses a directory that holds a checkpoint of the format (before
    anything is written: the first model's files stay), `overwrite=True` replaces it, and
    a path that is a file or a non-bool `overwrite` are refused by name."""
    if format == "keras_hub":
        pytest.importorskip("keras_hub")
    def classifier():  # (a task that all three formats write)
        return kzoo.presets.load("bert_tiny_uncased", task="classifier", num_classes=3,
                                 num_layers=1, vocabulary_size=100, activation="gelu_tanh")

    first, second = classifier(), classifier()
    directory = str(tmp_path / "model")
    kzoo.presets.save(first, directory, format=format)
    files = {name: (tmp_path / "model" / name).read_bytes()
             for name in os.listdir(directory)}
    with pytest.raises(ValueError, match="exists and overwrite=False"):
        kzoo.presets.save(second, directory, format=format, overwrite=False)
    assert {name: (tmp_path / "model" / name).read_bytes()
            for name in os.listdir(directory)} == files
    x = _inputs("bert", first)
    kept = kzoo.presets.load(directory)
    np.testing.assert_array_equal(to_numpy(kept(x)), to_numpy(first(x)))
    kzoo.presets.save(second, directory, format=format, overwrite=True)
    np.testing.assert_array_equal(to_numpy(kzoo.presets.load(directory)(x)),
                                  to_numpy(second(x)))
    with pytest.raises(ValueError, match="`overwrite` must be True or False"):
        kzoo.presets.save(second, str(tmp_path / "other"), format=format, overwrite="no")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match="is a file"):
        kzoo.presets.save(second, str(a_file), format=format)


@pytest.mark.spread
def test_overrides_that_reshape_the_weights_of_a_saved_directory_are_explained(tmp_path):
    """Loading a saved directory with an override that changes the weights (more layers)
    names the override and the way out, instead of Keras' count of unloaded objects; with
    `weights=False` the new shape builds. A saved directory is also a `weights` source for
    a preset of its shape, and bad `name_or_path` / `weights` values are named."""
    directory = str(tmp_path / "gpt")
    model = _saved_gpt(directory)
    deeper = SMALL["gpt_mini"]["num_layers"] + 1
    with pytest.raises(ValueError, match=r"overrides \['num_layers'\].*weights=False"):
        kzoo.presets.load(directory, num_layers=deeper)
    fresh = kzoo.presets.load(directory, num_layers=deeper, weights=False)
    assert len(fresh.backbone.transformer_layers) == deeper
    x = _inputs("gpt", model)
    again = kzoo.presets.load("gpt_mini", weights=directory, **SMALL["gpt_mini"])
    np.testing.assert_array_equal(to_numpy(again(x)), to_numpy(model(x)))
    for bad in (None, 3):
        with pytest.raises(ValueError, match="`name_or_path` must be"):
            kzoo.presets.load(bad)
    with pytest.raises(ValueError, match="`weights` must be None, False"):
        kzoo.presets.load("gpt_mini", weights=True, **SMALL["gpt_mini"])
    with pytest.raises(ValueError, match="a directory of neither kind"):
        kzoo.presets.load("gpt_mini", weights=str(tmp_path), **SMALL["gpt_mini"])


@pytest.mark.spread
@pytest.mark.parametrize("dtype", ["mixed_bfloat16", "bfloat16"])
def test_a_saved_directory_loads_with_the_dtype_it_was_saved_with(dtype, tmp_path):
    """A task model built with a dtype policy reports it (Keras' functional constructor
    dropped it: the model said float32), a saved directory and a .keras file load with it,
    the outputs are the same, and `dtype=` still picks another; bad dtypes are named."""
    model = kzoo.presets.load("gpt_mini", dtype=dtype, **SMALL["gpt_mini"])
    assert model.dtype_policy.name == model.backbone.dtype_policy.name == dtype
    directory = str(tmp_path / "saved")
    kzoo.presets.save(model, directory)
    again = kzoo.presets.load(directory)
    assert again.dtype_policy.name == again.backbone.dtype_policy.name == dtype
    x = _inputs("gpt", model)
    np.testing.assert_array_equal(to_numpy(again(x)).astype("float32"),
                                  to_numpy(model(x)).astype("float32"))
    keras_file = str(tmp_path / "lm.keras")
    model.save(keras_file)
    assert kzoo.presets.load(keras_file).dtype_policy.name == dtype
    assert kzoo.presets.load(directory, dtype="float32").backbone.dtype_policy.name == "float32"
    for bad in ("int32", "float8", "fp32"):
        with pytest.raises(ValueError, match=r"`dtype` must be a floating-point"):
            kzoo.presets.load("gpt_mini", dtype=bad, **SMALL["gpt_mini"])


@pytest.mark.spread
@pytest.mark.parametrize("dtype, stored, code", [
    ("bfloat16", "bfloat16", "BF16"), ("float16", "float16", "F16"),
    ("mixed_bfloat16", "float32", "F32"),  # (mixed: the variables are float32)
])
def test_hf_save_keeps_the_variables_dtype(dtype, stored, code, tmp_path):
    """A bfloat16 / float16 model is written in its own dtype, as `save_pretrained` writes
    one (it had been float32 with `torch_dtype: float32`): exact, and read by transformers
    in that dtype with `dtype="auto"`."""
    import json

    import torch
    import transformers
    from safetensors import safe_open

    model = kzoo.presets.load("gpt_modern_mini", num_layers=1, dtype=dtype)
    kzoo.presets.save(model, tmp_path, format="hf")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == stored
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {code}
    again = kzoo.presets.load(tmp_path)
    for ours, back in zip(model.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(np.asarray(ours, np.float32), back)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert hf.dtype == getattr(torch, stored)
    table = hf.model.embed_tokens.weight.detach().float().numpy()
    ours = keras.ops.cast(model.backbone.token_embedding.embeddings, "float32")
    np.testing.assert_array_equal(table, keras.ops.convert_to_numpy(ours))


def test_hf_dir_with_shape_changing_overrides_names_them_and_weights_false_or_a_file(
        tmp_path):
    """A Hugging Face checkpoint loaded with overrides that change the weights (more
    layers, a wider model): the error names the overrides and the way out (it named only the
    first missing or mismatching weight, as if the checkpoint were broken); `weights=False`
    builds a fresh model of the new shape; a weights file given as `weights` loads instead
    of the checkpoint's (the argument was ignored for such directories)."""
    source = _hf_gpt(tmp_path / "hf")
    layers = SMALL["gpt_mini"].get("num_layers", 2)
    for override, needle in (({"num_layers": layers + 1}, r"missing weights"),
                             ({"hidden_dim": 48}, r"Shape mismatch")):
        with pytest.raises(ValueError, match=rf"{needle}.*\(checkpoint .*\)\. The model "
                                             rf"was built with the overrides "
                                             rf"\['{next(iter(override))}'\].*pass "
                                             r"weights=False"):
            kzoo.presets.load(tmp_path / "hf", **override)
    fresh = kzoo.presets.load(tmp_path / "hf", weights=False, num_layers=layers + 1)
    assert fresh.backbone.config.num_layers == layers + 1
    other = kzoo.presets.load(tmp_path / "hf", weights=False)
    assert any(not np.array_equal(a, b) for a, b in zip(source.get_weights(),
                                                          other.get_weights()))
    other.save_weights(str(tmp_path / "other.weights.h5"))
    again = kzoo.presets.load(tmp_path / "hf", weights=tmp_path / "other.weights.h5")
    for a, b in zip(again.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(kzoo.presets.load(tmp_path / "hf").get_weights(), source.get_weights()):
        np.testing.assert_array_equal(a, b)
