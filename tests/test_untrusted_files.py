"""Untrusted files: loading a preset directory, a `.keras` file or a Hugging Face directory
never runs code from it, never reads outside it, and a damaged file is named.

- `.keras` archives whose config names a `Lambda` layer (a serialised Python lambda), a class or
  function outside Keras and kzoo, or Keras' own `enable_unsafe_deserialization` are refused
  by `kzoo.presets.load`, and the code they carry (writing a canary file) never runs; safe mode
  stays on even after the process called `keras.config.enable_unsafe_deserialization()`.
- A `pytorch_model.bin` whose pickle would run code is refused (`torch.load(weights_only=True)`)
  with an error naming the file; the canary file does not appear.
- No loader in kzoo or training unpickles: every `np.load` passes `allow_pickle=False`, every
  `torch.load` `weights_only=True`, every Keras `load_model` `safe_mode=True` (read from the
  source with `ast`).
- File references and fixed file names cannot leave their directory: `..`, absolute paths and
  symbolic links out of the directory are refused (the Hugging Face hub cache's
  `snapshots/ -> blobs/` links still load).
- Empty, truncated and corrupt files (weights, tokenizer files, `.keras` archives), a missing
  tensor or a tensor of the wrong shape raise `ValueError` naming the file or the tensor.

(The cases of tests/test_presets.py — damaged JSON, `../` weights and shard references,
preset names that are paths — are not repeated here.)
"""

import ast
import json
import os
import pathlib
import pickle
import shutil
import zipfile

import keras
import numpy as np
import pytest

import kzoo
from tests.helpers import to_numpy

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY_GPT = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32,
                vocabulary_size=50, max_sequence_length=16)


def _gpt():
    return kzoo.presets.load("gpt_mini", **TINY_GPT)


def _inputs(seed=0):
    ids = np.random.default_rng(seed).integers(0, 50, (2, 6)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}


def _same_outputs(a, b):
    x = _inputs()
    np.testing.assert_allclose(to_numpy(a(x)), to_numpy(b(x)), atol=1e-6)


@pytest.fixture
def canary(tmp_path):
    """A path that the malicious payloads of these tests write; it must never exist."""
    path = tmp_path / "canary"
    yield path
    assert not path.exists(), "code from an untrusted file ran"


def _writes(canary):
    """Python source that creates the canary file."""
    return f"open({str(canary)!r}, 'w').write('ran')"


# === .keras files ===


def test_keras_file_loads_through_presets_load(tmp_path):
    model = _gpt()
    model.save(tmp_path / "m.keras")
    restored = kzoo.presets.load(tmp_path / "m.keras")
    assert type(restored) is type(model)
    _same_outputs(model, restored)
    with pytest.raises(ValueError, match="loads as it was saved") as err:
        kzoo.presets.load(tmp_path / "m.keras", dtype="bfloat16", num_layers=2)
    assert "m.keras" in str(err.value)


def _lambda_model_file(path, canary):
    inputs = keras.Input((4,))
    payload = eval(f"lambda x: ({_writes(canary)}, x)[1]")  # noqa: S307 - the test's payload
    model = keras.Model(inputs, keras.layers.Lambda(payload)(inputs))
    model.save(path)
    os.remove(canary)  # building the model ran the lambda once; loading must not
    return path


@pytest.fixture
def unsafe_deserialization_enabled():
    """`keras.config.enable_unsafe_deserialization()` for one test, then the state before."""
    from keras.src.backend.common import global_state

    before = global_state.get_global_attribute("safe_mode_saving")
    keras.config.enable_unsafe_deserialization()
    yield
    global_state.set_global_attribute("safe_mode_saving", before)


def test_keras_file_with_a_lambda_runs_nothing(tmp_path, canary):
    path = _lambda_model_file(tmp_path / "lambda.keras", canary)
    with pytest.raises(ValueError, match="Lambda") as err:
        kzoo.presets.load(path)
    assert str(path) in str(err.value)
    assert not canary.exists()


def test_safe_mode_cannot_be_turned_off_from_outside(tmp_path, canary, monkeypatch,
                                                     unsafe_deserialization_enabled):
    path = _lambda_model_file(tmp_path / "lambda.keras", canary)
    # The config check refuses the file first ...
    with pytest.raises(ValueError, match="Lambda"):
        kzoo.presets.load(path)
    # ... and without it, Keras' safe mode (passed explicitly) still refuses the lambda,
    # although the process enabled unsafe deserialization globally.
    monkeypatch.setattr(kzoo.presets, "_check_keras_config", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="cannot be loaded") as err:
        kzoo.presets.load(path)
    assert "lambda" in str(err.value).lower() and str(path) in str(err.value)
    assert not canary.exists()


def _edited_keras_file(source, path, edit):
    """A copy of the .keras archive `source` whose config.json is `edit(config)`."""
    with zipfile.ZipFile(source) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(files["config.json"])
    edit(config)
    files["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def _payloads(canary):
    """name -> an edit of a kzoo model's .keras config that smuggles code in."""
    command = f"touch {canary}"

    def top(module, class_name, config):
        def edit(c):
            c.update(module=module, class_name=class_name, registered_name=None, config=config)
        return edit

    def backbone(obj):
        def edit(c):
            c["config"]["backbone"] = obj
        return edit

    def activation(obj):
        def edit(c):
            c["config"]["backbone"]["config"]["activation"] = obj
        return edit

    function = dict(class_name="function", registered_name="function")
    return {
        "os.system": top("os", "system", {"command": command}),
        "subprocess.Popen": backbone(dict(module="subprocess", class_name="Popen",
                                          config={"args": ["touch", str(canary)]},
                                          registered_name=None)),
        "builtins.exec": activation(dict(function, module="builtins", config="exec")),
        "enable_unsafe_deserialization": backbone(
            dict(function, module="keras.config", config="enable_unsafe_deserialization")),
        "__lambda__": activation({"class_name": "__lambda__", "config": {
            "code": "", "defaults": None, "closure": None}}),
        "TorchModuleWrapper": backbone(dict(module="keras.layers", class_name="TorchModuleWrapper",
                                            config={"module": ""}, registered_name=None)),
        "a user's module": backbone(dict(module="my_package.layers", class_name="Backdoor",
                                         config={}, registered_name="my_package>Backdoor")),
    }


@pytest.mark.parametrize("payload", sorted(_payloads(pathlib.Path("x"))))
def test_keras_file_naming_code_outside_keras_and_kzoo_is_refused(tmp_path, canary, payload):
    source = tmp_path / "m.keras"
    _gpt().save(source)
    path = _edited_keras_file(source, tmp_path / "evil.keras", _payloads(canary)[payload])
    with pytest.raises(ValueError, match="only Keras and kzoo classes") as err:
        kzoo.presets.load(path)
    assert str(path) in str(err.value)
    assert not canary.exists()


@pytest.mark.parametrize("damage, problem", [
    (lambda data: b"", "cannot be read"),
    (lambda data: data[: len(data) // 3], "cannot be read"),
    (lambda data: b"PK\x03\x04 not really a zip", "cannot be read"),
])
def test_damaged_keras_file_names_the_file(tmp_path, damage, problem):
    path = tmp_path / "m.keras"
    _gpt().save(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(path)
    assert str(path) in str(err.value)


def test_keras_file_without_or_with_broken_config_names_the_file(tmp_path):
    source = tmp_path / "m.keras"
    _gpt().save(source)
    with zipfile.ZipFile(source) as archive:
        files = {n: archive.read(n) for n in archive.namelist()}
    for name, config, problem in [("no_config.keras", None, "has no config.json"),
                                  ("truncated.keras", b'{"module": "kzoo.mo', "not valid JSON")]:
        with zipfile.ZipFile(tmp_path / name, "w") as archive:
            for file, data in files.items():
                if file != "config.json":
                    archive.writestr(file, data)
            if config is not None:
                archive.writestr("config.json", config)
        with pytest.raises(ValueError, match=problem) as err:
            kzoo.presets.load(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)


# === pytorch_model.bin: weights only ===


class _Payload:
    """Unpickling this object would call `exec(source)`."""

    def __init__(self, source):
        self.source = source

    def __reduce__(self):
        return exec, (self.source,)


def _hf_gpt(directory):
    model = _gpt()
    kzoo.presets.save(model, directory, format="hf")
    return model


def _as_torch_bin(directory, state=None):
    """Replace model.safetensors by pytorch_model.bin holding `state` (default: its tensors)."""
    import torch
    from safetensors.numpy import load_file

    single = os.path.join(directory, "model.safetensors")
    if state is None:
        state = {k: torch.from_numpy(v.copy()) for k, v in load_file(single).items()}
    os.remove(single)
    path = os.path.join(directory, "pytorch_model.bin")
    torch.save(state, path)
    return path


def test_pytorch_bin_loads_tensors(tmp_path):
    model = _hf_gpt(tmp_path)
    _as_torch_bin(tmp_path)
    _same_outputs(model, kzoo.presets.load(tmp_path))


@pytest.mark.parametrize("how", ["torch.save", "plain pickle"])
def test_pytorch_bin_that_would_run_code_is_refused(tmp_path, canary, how):
    import torch
    from safetensors.numpy import load_file

    _hf_gpt(tmp_path)
    state = {k: torch.from_numpy(v.copy())
             for k, v in load_file(tmp_path / "model.safetensors").items()}
    state["payload"] = _Payload(_writes(canary))
    if how == "torch.save":
        path = _as_torch_bin(tmp_path, state)
    else:
        os.remove(tmp_path / "model.safetensors")
        path = tmp_path / "pytorch_model.bin"
        path.write_bytes(pickle.dumps(state))
    with pytest.raises(ValueError, match="cannot be read") as err:
        kzoo.presets.load(tmp_path)
    assert str(path) in str(err.value)
    assert not canary.exists()


@pytest.mark.parametrize("content, problem", [
    ({}, "non-empty dict"),
    ([1, 2], "non-empty dict"),
    ({"transformer.wte.weight": 3}, "not: \\['transformer.wte.weight'\\]"),
])
def test_pytorch_bin_must_hold_a_state_dict(tmp_path, content, problem):
    _hf_gpt(tmp_path)
    path = _as_torch_bin(tmp_path, content)
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(tmp_path)
    assert path in str(err.value)


@pytest.mark.parametrize("damage", [lambda d: b"", lambda d: d[: len(d) // 2],
                                    lambda d: b"\x80\x04garbage"])
def test_damaged_pytorch_bin_names_the_file(tmp_path, damage):
    _hf_gpt(tmp_path)
    path = pathlib.Path(_as_torch_bin(tmp_path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match="cannot be read") as err:
        kzoo.presets.load(tmp_path)
    assert str(path) in str(err.value)


def _sharded_torch_bin(directory):
    """A GPT-2 checkpoint written by transformers as `pytorch_model-0000k-of-0000n.bin`
    shards with `pytorch_model.bin.index.json` (`save_pretrained(safe_serialization=False)`
    with a small `max_shard_size`, as many older Hub checkpoints are); returns the model."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)).eval()
    hf.save_pretrained(directory, safe_serialization=False, max_shard_size="20KB")
    return hf


def test_sharded_pytorch_bin_loads_and_matches_transformers(tmp_path):
    import torch

    hf = _sharded_torch_bin(tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("pytorch_model-*.bin"))
    assert len(shards) >= 2 and (tmp_path / "pytorch_model.bin.index.json").is_file()
    model = kzoo.presets.load(tmp_path)
    ids = np.random.default_rng(0).integers(0, 64, (2, 9)).astype("int32")
    ours = to_numpy(model({"token_ids": ids, "padding_mask": np.ones_like(ids)}))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_sharded_pytorch_bin_problems_are_named(tmp_path, canary):
    import torch

    _sharded_torch_bin(tmp_path)
    index_path = tmp_path / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    # a shard that would run code when unpickled
    state = torch.load(tmp_path / first, weights_only=True)
    torch.save({**state, "payload": _Payload(_writes(canary))}, tmp_path / first)
    with pytest.raises(ValueError, match="cannot be read") as err:
        kzoo.presets.load(tmp_path)
    assert first in str(err.value) and not canary.exists()
    # a shard outside the directory, a missing shard, an index without a weight map
    for weight_map, problem in (
            ({k: "../outside.bin" for k in index["weight_map"]}, r"\.\."),
            ({k: "nope.bin" for k in index["weight_map"]}, "torch weights shard.*missing"),
            ({}, "no `weight_map`")):
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(ValueError, match=problem):
            kzoo.presets.load(tmp_path)


# === No unpickling anywhere: read from the source ===


def _calls(attribute, owners):
    """(file:line, keyword arguments) of every call `<owner>.<attribute>(...)` in kzoo/ and
    training/."""
    found = []
    for top in ("kzoo", "training"):
        for file in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(file.read_text(), filename=str(file))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == attribute
                        and (owners is None or isinstance(node.func.value, ast.Name)
                             and node.func.value.id in owners)):
                    keywords = {k.arg: k.value for k in node.keywords}
                    found.append((f"{file.relative_to(ROOT)}:{node.lineno}", keywords))
    return found


def _is_constant(node, value):
    return isinstance(node, ast.Constant) and node.value is value


@pytest.mark.spread
def test_no_loader_unpickles_or_runs_unsafe_code():
    rules = [("load", ("np", "numpy"), "allow_pickle", False),
             ("load", ("torch",), "weights_only", True),
             ("load_model", None, "safe_mode", True)]
    seen = {}
    for attribute, owners, keyword, value in rules:
        calls = _calls(attribute, owners)
        seen[(attribute, keyword)] = len(calls)
        for where, keywords in calls:
            assert _is_constant(keywords.get(keyword), value), (
                f"{where}: {attribute}(...) must pass {keyword}={value}")
    # The scan finds the loaders that exist (it is not looking at nothing).
    assert seen[("load", "allow_pickle")] >= 1 and seen[("load", "weights_only")] >= 1
    assert seen[("load_model", "safe_mode")] >= 1
    for top in ("kzoo", "training"):
        for file in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(file.read_text())
            imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                        if isinstance(node, (ast.Import, ast.ImportFrom))
                        for alias in (node.names if isinstance(node, ast.Import)
                                      else [ast.alias(node.module or "")])}
            assert not imported & {"pickle", "dill", "cloudpickle", "joblib", "marshal"}, file


# === Nothing is read from outside the directory ===


def _outside_copy(tmp_path, inside):
    """A copy of `inside` one level above the checkpoint directory."""
    outside = tmp_path / ("outside_" + inside.name)
    shutil.copyfile(inside, outside)
    return outside


def _link_out(tmp_path, inside):
    """Replace the file `inside` by a symbolic link to an identical file outside."""
    outside = _outside_copy(tmp_path, inside)
    inside.unlink()
    inside.symlink_to(outside)


@pytest.mark.parametrize("name", ["model.weights.h5", "kzoo_config.json"])
def test_symlink_out_of_a_preset_directory_is_refused(tmp_path, name):
    _gpt_dir = tmp_path / "m"
    kzoo.presets.save(_gpt(), _gpt_dir)
    _link_out(tmp_path, _gpt_dir / name)
    with pytest.raises(ValueError, match="leaves its directory") as err:
        kzoo.presets.load(_gpt_dir)
    assert repr(name) in str(err.value)


def test_symlink_to_a_weights_file_inside_the_directory_loads(tmp_path):
    model = _gpt()
    kzoo.presets.save(model, tmp_path / "m")
    (tmp_path / "m" / "sub").mkdir()
    (tmp_path / "m" / "model.weights.h5").rename(tmp_path / "m" / "sub" / "w.weights.h5")
    (tmp_path / "m" / "model.weights.h5").symlink_to("sub/w.weights.h5")
    _same_outputs(model, kzoo.presets.load(tmp_path / "m"))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json",
                                  "a.safetensors"])
def test_symlink_out_of_a_hugging_face_directory_is_refused(tmp_path, name):
    import tokenizers
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    _hf_gpt(hf)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    tokenizer.save(str(hf / "tokenizer.json"))
    if name == "a.safetensors":  # a sharded checkpoint: the shard is the link
        state = load_file(hf / "model.safetensors")
        save_file(state, str(hf / "a.safetensors"))
        (hf / "model.safetensors").unlink()
        (hf / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {k: "a.safetensors" for k in state}}))
    _link_out(tmp_path, hf / name)
    with pytest.raises(ValueError, match="leaves its directory") as err:
        kzoo.presets.load(hf)
    assert repr(name) in str(err.value)


def test_hugging_face_hub_cache_layout_loads(tmp_path):
    """`snapshots/<revision>/<file>` links to `../../blobs/<hash>`, as huggingface_hub
    stores downloads: the one kind of link out of the directory that is followed."""
    model = _gpt()
    repo = tmp_path / "models--kzoo--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    kzoo.presets.save(model, snapshot, format="hf")
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(snapshot.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        file.rename(blob)
        file.symlink_to(os.path.join("..", "..", "blobs", blob.name))
    _same_outputs(model, kzoo.presets.load(snapshot))
    # A link from the snapshot to anywhere else is still refused.
    _link_out(tmp_path, snapshot / "config.json")
    with pytest.raises(ValueError, match="leaves its directory"):
        kzoo.presets.load(snapshot)


# === Damaged files are named ===


@pytest.mark.parametrize("content, problem", [
    (b"", "is empty"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":", "cannot be read"),  # header cut short
    (b"\xff" * 64, "cannot be read"),
])
def test_damaged_safetensors_names_the_file(tmp_path, content, problem):
    _hf_gpt(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(err.value)


def test_empty_or_garbage_weights_h5_names_the_file(tmp_path):
    kzoo.presets.save(_gpt(), tmp_path / "m")
    weights = tmp_path / "m" / "model.weights.h5"
    for content in (b"", b"not an HDF5 file at all" * 10):
        weights.write_bytes(content)
        with pytest.raises(ValueError, match="cannot be read") as err:
            kzoo.presets.load(tmp_path / "m")
        assert str(weights) in str(err.value)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    _hf_gpt(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    name = "transformer.h.0.mlp.c_fc.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(path))
    with pytest.raises(ValueError, match="missing weights") as err:
        kzoo.presets.load(tmp_path)
    assert name in str(err.value)
    save_file({**state, name: state[name][:, :-1].copy()}, str(path))
    with pytest.raises(ValueError, match="Shape mismatch") as err:
        kzoo.presets.load(tmp_path)
    assert name in str(err.value)


@pytest.mark.spread
@pytest.mark.parametrize("dtype", ["int32", "int8", "uint8", "bool"])
def test_integer_or_boolean_tensor_for_a_weight_is_refused(tmp_path, dtype):
    """A safetensors file whose weight holds integers or booleans (damaged, or quantized
    codes under a float weight's name) was cast to float32 and loaded as that weight: the
    model gave other outputs, with nothing said. The tensor is refused, named with its
    dtype; the same weights as float16 still load (to float16's rounding)."""
    from safetensors.numpy import load_file, save_file

    model = _hf_gpt(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    name = "transformer.h.0.mlp.c_fc.weight"
    save_file({**state, name: (state[name] * 100).astype(dtype)}, str(path))
    with pytest.raises(ValueError, match=f"{name}.*dtype {dtype}.*floating-point"):
        kzoo.presets.load(tmp_path)
    save_file({k: v.astype("float16") for k, v in state.items()}, str(path))
    x = {"token_ids": np.array([[1, 2, 3]], "int32"), "padding_mask": np.ones((1, 3), "int32")}
    want = model.predict(x, verbose=0)
    np.testing.assert_allclose(to_numpy(kzoo.presets.load(tmp_path).predict(x, verbose=0)),
                               to_numpy(want), atol=2e-2)


def _bert_hf_dir(directory):
    from kzoo.models.bert import BertBackbone, BertMaskedLM

    model = BertMaskedLM(BertBackbone(vocabulary_size=30, num_layers=1, num_heads=2,
                                      hidden_dim=8, intermediate_dim=16))
    kzoo.presets.save(model, directory, format="hf")
    return model


@pytest.mark.spread
@pytest.mark.parametrize("files, problem, named", [
    ({"tokenizer.json": b""}, "is empty", "tokenizer.json"),
    ({"tokenizer.json": b'{"version": "1.0", "model": {'}, "cannot be read", "tokenizer.json"),
    ({"vocab.txt": b""}, "is empty", "vocab.txt"),
    ({"vocab.txt": b"[PAD]\n[UNK]\n", "tokenizer_config.json": b'{"do_lower_case": tr'},
     "not valid JSON", "tokenizer_config.json"),
    ({"vocab.txt": b"[PAD]\n[UNK]\n", "tokenizer_config.json": b'{"do_lower_case": "no"}'},
     "do_lower_case", "tokenizer_config.json"),
    ({"vocab.json": b'{"a": 0, "b', "merges.txt": b"#version: 0.2\na b\n"}, "cannot be read",
     "vocab.json"),
    ({"vocab.json": b'{"a": 0, "b": 1}', "merges.txt": b""}, "is empty", "merges.txt"),
])
def test_damaged_tokenizer_files_are_named(tmp_path, files, problem, named):
    _bert_hf_dir(tmp_path)
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=problem) as err:
        kzoo.presets.load(tmp_path)
    assert str(tmp_path / named) in str(err.value)
