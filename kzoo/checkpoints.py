"""Files on disk: JSON read with clear errors, file references kept inside their directory,
and Hugging Face checkpoint directories read and written.

This module knows formats, not families: `kzoo.registry` says which family reads which
`model_type`, and `kzoo.presets` / `kzoo.convert` combine the two. Every problem with a file
(missing, empty, truncated, not valid JSON, a reference that leaves its directory) raises
`ValueError` naming the file and what is wrong.

Hugging Face weights come from `model.safetensors` (or a sharded `model.safetensors.index.json`),
read with the `safetensors` NumPy API (no torch needed), or from `pytorch_model.bin` when torch
is installed.
"""

import json
import os

import numpy as np

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_TORCH_WEIGHTS = "pytorch_model.bin"


def read_json(path, what="JSON file"):
    """The JSON object (a dict) in `path`; `ValueError` naming the file if it is unusable.

    Example:
    >>> read_json("runs/my_gpt/kzoo_config.json", "saved kzoo config")["family"]
    'gpt'
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"The {what} {path!r} does not exist.") from None
    except OSError as e:
        raise ValueError(f"The {what} {path!r} cannot be read: {e}.") from e
    return parse_json(data, path, what)


def parse_json(data, source, what="JSON file"):
    """The JSON object (a dict) in `data` (bytes or str) read from `source` (named in errors)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise ValueError(f"The {what} {source!r} is not UTF-8 text: {e}.") from None
    if not text.strip():
        raise ValueError(f"The {what} {source!r} is empty; expected a JSON object.")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"The {what} {source!r} is not valid JSON (truncated or corrupt?): {e.msg} at line "
            f"{e.lineno}, column {e.colno}."
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"The {what} {source!r} must hold a JSON object; got a {type(value).__name__}."
        )
    return value


def write_json(path, value, default=None):
    """Write `value` to `path` through a temporary file, so a crash never leaves half a file."""
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, default=default)
    os.replace(tmp, path)


def file_in(directory, name, what="file"):
    """`directory/name`, refusing a `name` that is absolute or leaves `directory` ("../").

    Files named inside a checkpoint (a weights file in a saved config, shards in a safetensors
    index) must stay in the checkpoint's own directory.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"The {what} reference in {os.fspath(directory)!r} must be a non-empty file name; "
            f"got {name!r}."
        )
    norm = os.path.normpath(name)
    if (os.path.isabs(name) or name.startswith(("/", "\\")) or os.path.splitdrive(name)[0]
            or norm.replace("\\", "/").split("/")[0] == ".."):
        raise ValueError(
            f"The {what} reference {name!r} in {os.fspath(directory)!r} leaves its directory; "
            "only a relative path inside the directory is allowed."
        )
    return os.path.join(os.fspath(directory), norm)


def require_file(path, what="file"):
    """`path` if it is an existing file; `ValueError` naming it otherwise."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"The {what} {path!r} is missing.")
    return path


def is_hf_dir(path):
    """True when `path` is a directory with a `config.json` that names a `model_type`."""
    config = os.path.join(os.fspath(path), HF_CONFIG)
    return os.path.isfile(config) and "model_type" in read_json(config, "Hugging Face config")


def read_hf_config(path):
    """The `config.json` of a Hugging Face checkpoint directory, as a dict."""
    config = read_json(os.path.join(os.fspath(path), HF_CONFIG), "Hugging Face config")
    if not isinstance(config.get("model_type"), str):
        raise ValueError(
            f"{os.path.join(os.fspath(path), HF_CONFIG)!r} has no string `model_type`; got "
            f"model_type={config.get('model_type')!r}."
        )
    return config


def read_hf_state(path):
    """All tensors of a checkpoint directory as a dict name -> NumPy array."""
    path = os.fspath(path)
    single = os.path.join(path, HF_WEIGHTS)
    index = os.path.join(path, HF_WEIGHTS_INDEX)
    binary = os.path.join(path, HF_TORCH_WEIGHTS)
    if os.path.isfile(single) or os.path.isfile(index):
        from safetensors.numpy import load_file  # optional dependency: kzoo[hf]

        if os.path.isfile(single):
            return dict(_read_weights(load_file, single))
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"The safetensors index {index!r} has no `weight_map` object naming the shards."
            )
        state = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = require_file(file_in(path, shard, "shard"), "safetensors shard")
            state.update(_read_weights(load_file, shard_path))
        return state
    if os.path.isfile(binary):
        try:
            import torch
        except ImportError as e:  # pragma: no cover - torch is a test dependency
            raise ValueError(
                f"{binary!r} needs torch to read; install torch or convert the checkpoint "
                "to safetensors."
            ) from e
        try:
            raw = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a damaged pickle/zip
            raise ValueError(f"The weights file {binary!r} cannot be read: {e}") from e
        return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                for k, v in raw.items()}
    raise ValueError(
        f"No weights in {path!r}: expected {HF_WEIGHTS}, {HF_WEIGHTS_INDEX} or {HF_TORCH_WEIGHTS}."
    )


def _read_weights(load_file, path):
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ValueError(f"The weights file {path!r} cannot be read: {e}") from e


def write_hf(directory, hf_config, state, tokenizer=None):
    """Write `config.json`, `model.safetensors` (and `tokenizer.json`) that transformers loads."""
    from safetensors.numpy import save_file  # optional dependency: kzoo[hf]

    os.makedirs(directory, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}
    tmp = os.path.join(directory, HF_WEIGHTS + ".tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, HF_WEIGHTS))
    write_json(os.path.join(directory, HF_CONFIG), hf_config)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return directory


def load_tokenizer(path):
    """A `tokenizers.Tokenizer` for a checkpoint directory, or None when it has none."""
    path = os.fspath(path)
    try:
        import tokenizers  # optional dependency: kzoo[hf]
    except ImportError:
        return None
    tok_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok_json):
        try:
            return tokenizers.Tokenizer.from_file(tok_json)
        except Exception as e:  # tokenizers raises its own error type for bad JSON
            raise ValueError(f"The tokenizer file {tok_json!r} cannot be read: {e}") from e
    vocab = os.path.join(path, "vocab.txt")
    if os.path.isfile(vocab):
        lower = True
        cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg):
            lower = read_json(cfg, "tokenizer config").get("do_lower_case", True)
        return tokenizers.BertWordPieceTokenizer(vocab, lowercase=lower)
    merges, vocab_json = os.path.join(path, "merges.txt"), os.path.join(path, "vocab.json")
    if os.path.isfile(merges) and os.path.isfile(vocab_json):
        return tokenizers.ByteLevelBPETokenizer(vocab_json, merges)
    return None


class WeightReader:
    """Hands out checkpoint tensors by name and reports what was missing or left over.

    `take(name)` returns the array (and records the name as used); `finish()` raises one
    `ValueError` listing missing and unexpected names.
    """

    def __init__(self, state, ignore=()):
        self.state = state
        self.used = set()
        self.missing = []
        self.ignore = tuple(ignore)

    def has(self, name):
        return name in self.state

    def take(self, name, transpose=False):
        if name not in self.state:
            self.missing.append(name)
            return None
        self.used.add(name)
        value = np.asarray(self.state[name])
        if value.dtype not in (np.float32, np.float64, np.int64, np.int32):
            value = value.astype(np.float32)
        return value.T if transpose else value

    def finish(self):
        unexpected = sorted(
            k for k in self.state
            if k not in self.used and not any(k.endswith(s) or k == s for s in self.ignore)
        )
        problems = []
        if self.missing:
            problems.append(f"missing weights: {self.missing}")
        if unexpected:
            problems.append(f"unexpected weights: {unexpected}")
        if problems:
            raise ValueError("Checkpoint does not match the model: " + "; ".join(problems))


def assign(variable, value, name):
    """Assign `value` to a Keras variable, naming both shapes on mismatch."""
    if value is None:
        return
    if tuple(variable.shape) != tuple(value.shape):
        raise ValueError(
            f"Shape mismatch for {name!r}: checkpoint has {tuple(value.shape)}, model "
            f"variable {variable.path!r} has {tuple(variable.shape)}."
        )
    variable.assign(value.astype(variable.dtype if isinstance(variable.dtype, str)
                                 else "float32"))
