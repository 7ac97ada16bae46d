"""Files on disk: JSON read with clear errors, file references kept inside their directory,
and Hugging Face checkpoint directories read and written.

This module knows formats, not families: `kzoo.registry` says which family reads which
`model_type`, and `kzoo.presets` / `kzoo.convert` combine the two. Every problem with a file
(missing, empty, truncated, not valid JSON, a reference that leaves its directory) raises
`ValueError` naming the file and what is wrong.

Hugging Face weights come from `model.safetensors` (or a sharded `model.safetensors.index.json`),
read with the `safetensors` NumPy API (no torch needed), or from `pytorch_model.bin` (or a
sharded `pytorch_model.bin.index.json`, what `save_pretrained(safe_serialization=False)` writes
for a large model) when torch is installed.

Files are data, never code: JSON is parsed, safetensors hold raw tensors, `pytorch_model.bin` is
read with `torch.load(weights_only=True)` (a pickle that would build anything but tensors is
refused), nothing is unpickled otherwise. Every file of a checkpoint directory is reached
through `file_in`, which keeps it inside the directory (no absolute paths, no "..", no symbolic
link leading out, except a Hugging Face hub cache's links from `snapshots/<revision>/` into
the same repository's `blobs/`).
"""

import json
import os

import numpy as np

HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_TORCH_WEIGHTS = "pytorch_model.bin"
HF_TORCH_WEIGHTS_INDEX = "pytorch_model.bin.index.json"


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
    """`directory/name`, refusing a `name` that is absolute or leaves `directory` ("../", or
    a symbolic link whose target lies outside it).

    Files named inside a checkpoint (a weights file in a saved config, shards in a safetensors
    index) must stay in the checkpoint's own directory, and so must the files a checkpoint
    has under fixed names (config.json, the weights, tokenizer files). The one exception is
    the layout of the Hugging Face hub cache, where `<repo>/snapshots/<revision>/<file>` is a
    link to `<repo>/blobs/<hash>`: such a link may point into that repository's `blobs/`.
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
    path = os.path.join(os.fspath(directory), norm)
    root, target = os.path.realpath(directory), os.path.realpath(path)
    if not (_inside(target, root) or _in_hub_blobs(target, root)):
        raise ValueError(
            f"The {what} reference {name!r} in {os.fspath(directory)!r} leaves its directory: "
            f"it resolves to {target!r} (through a symbolic link); only files inside the "
            "directory are read."
        )
    return path


def _inside(path, root):
    return os.path.commonpath([path, root]) == root


def _in_hub_blobs(target, root):
    """True when `root` is a hub cache snapshot (`<repo>/snapshots/<revision>`) and `target`
    lies in `<repo>/blobs/`."""
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) != "snapshots":
        return False
    return _inside(target, os.path.join(os.path.dirname(snapshots), "blobs"))


def make_parent_directory(path, cannot_write):
    """Make the directory a file `path` is to be written in, with its missing parents;
    `cannot_write` begins the `ValueError` raised when that is impossible (an existing file on
    the way, or a directory that cannot be made). Writers failed there with their own errors:
    torch's ONNX exporter an INTERNAL ASSERT RuntimeError for a missing directory, NumPy a
    FileNotFoundError, every writer a NotADirectoryError through a file."""
    parent = os.path.dirname(os.path.abspath(path))
    ancestor = parent
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{cannot_write}: {ancestor!r} is a file, not a directory.")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"{cannot_write}: its directory cannot be made ({error.strerror or error})."
        ) from None


def require_file(path, what="file"):
    """`path` if it is an existing file; `ValueError` naming it otherwise."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"The {what} {path!r} is missing.")
    return path


def is_hf_dir(path):
    """True when `path` is a directory with a `config.json` that names a `model_type`."""
    config = file_in(path, HF_CONFIG, "Hugging Face config")
    return os.path.isfile(config) and "model_type" in read_json(config, "Hugging Face config")


def read_hf_config(path):
    """The `config.json` of a Hugging Face checkpoint directory, as a dict.

    A quantized checkpoint (a `quantization_config`: GPTQ, AWQ, bitsandbytes, FP8, ...) raises
    `ValueError`: transformers computes with its quantized weights (packed integers or float8
    with scales), which kzoo does not read."""
    config_path = file_in(path, HF_CONFIG, "Hugging Face config")
    config = read_json(config_path, "Hugging Face config")
    if not isinstance(config.get("model_type"), str):
        raise ValueError(
            f"{config_path!r} has no string `model_type`; got "
            f"model_type={config.get('model_type')!r}."
        )
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"{config_path!r} is a quantized checkpoint (quantization_config with "
            f"quant_method={method!r}); kzoo reads only unquantized checkpoints (no "
            "quantization_config). Load a float checkpoint (or dequantize it with transformers "
            "and save_pretrained), then quantize with kzoo.quantize if needed."
        )
    return config


# `generation_config.json` fields that set a generative task model's `generate` defaults
# (transformers reads them there before config.json).
HF_GENERATION_FIELDS = ("eos_token_id", "decoder_start_token_id", "pad_token_id")


def read_hf_generation_config(path):
    """The fields of `HF_GENERATION_FIELDS` that a checkpoint directory's
    `generation_config.json` sets, as a dict ({} without the file)."""
    file = file_in(path, HF_GENERATION_CONFIG, "generation config")
    if not os.path.isfile(file):
        return {}
    config = read_json(file, "Hugging Face generation config")
    return {key: config[key] for key in HF_GENERATION_FIELDS if key in config}


def hf_token_ids(value, vocabulary_size, field="eos_token_id"):
    """A Hugging Face `eos_token_id` (None, an int or a list of ints) as a list of the ids
    that a model of `vocabulary_size` can produce (an id outside it could never end a row),
    or None when there is none."""
    values = [] if value is None else [value] if not isinstance(value, (list, tuple)) else value
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(
            f"Hugging Face config field `{field}` must be null, an int or a list of ints; "
            f"got {field}={value!r}."
        )
    ids = [v for v in values if 0 <= v < vocabulary_size]
    return ids or None


def _shards(path, index, what):
    """The shard files an index (`model.safetensors.index.json` or
    `pytorch_model.bin.index.json`) names in its `weight_map`, each checked to be a file
    inside `path`."""
    weight_map = read_json(index, what).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(shard, str) for shard in weight_map.values()):
        raise ValueError(
            f"The {what} {index!r} has no `weight_map` object naming the shards."
        )
    return [require_file(file_in(path, shard, "shard"), what.replace("index", "shard"))
            for shard in sorted(set(weight_map.values()))]


def read_hf_state(path):
    """All tensors of a checkpoint directory as a dict name -> NumPy array."""
    path = os.fspath(path)
    single = file_in(path, HF_WEIGHTS, "weights file")
    index = file_in(path, HF_WEIGHTS_INDEX, "safetensors index")
    binary = file_in(path, HF_TORCH_WEIGHTS, "weights file")
    binary_index = file_in(path, HF_TORCH_WEIGHTS_INDEX, "torch weights index")
    if os.path.isfile(single) or os.path.isfile(index):
        from safetensors.numpy import load_file  # optional dependency: kzoo[hf]

        if os.path.isfile(single):
            return dict(_read_weights(load_file, single))
        state = {}
        for shard_path in _shards(path, index, "safetensors index"):
            state.update(_read_weights(load_file, shard_path))
        return state
    if os.path.isfile(binary):
        return _read_torch_weights(binary)
    if os.path.isfile(binary_index):
        state = {}
        for shard_path in _shards(path, binary_index, "torch weights index"):
            state.update(_read_torch_weights(shard_path))
        return state
    raise ValueError(
        f"No weights in {path!r}: expected {HF_WEIGHTS}, {HF_WEIGHTS_INDEX}, {HF_TORCH_WEIGHTS} "
        f"or {HF_TORCH_WEIGHTS_INDEX}."
    )


def _read_torch_weights(binary):
    """The tensors of one `pytorch_model.bin` (or one of its shards) as NumPy arrays."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a test dependency
        raise ValueError(
            f"{binary!r} needs torch to read; install torch or convert the checkpoint "
            "to safetensors."
        ) from e
    try:
        # weights_only: tensors and plain containers only; a pickle that would import
        # or call anything else is refused before it runs.
        raw = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged pickle/zip
        raise ValueError(f"The weights file {binary!r} cannot be read: {e}") from e
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            f"The weights file {binary!r} must hold a non-empty dict name -> tensor (a "
            f"state dict); got {type(raw).__name__}."
        )
    bad = sorted(str(k) for k, v in raw.items()
                 if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(
            f"The weights file {binary!r} must map names to tensors; these entries are "
            f"not: {bad[:10]}."
        )
    return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            for k, v in raw.items()}


def _read_weights(load_file, path):
    if os.path.getsize(path) == 0:
        raise ValueError(f"The weights file {path!r} is empty.")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ValueError(f"The weights file {path!r} cannot be read: {e}") from e


DEFAULT_MAX_SHARD_SIZE = "5GB"
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value, name="max_shard_size"):
    """Bytes of `value`: an int, or a string such as "200MB", "5GB", "2GiB" (decimal KB /
    MB / GB, binary KiB / MiB / GiB, as transformers' `max_shard_size` reads them).

    Example:
    >>> parse_size("200MB"), parse_size("1GiB"), parse_size(1000)
    (200000000, 1073741824, 1000)
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        size = int(value)
    elif isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        unit = next((u for u in sorted(_SIZE_UNITS, key=len, reverse=True)
                     if text.endswith(u)), None)
        try:
            size = int(float(text[: -len(unit)]) * _SIZE_UNITS[unit]) if unit else None
        except ValueError:
            size = None
        if size is None:
            raise ValueError(
                f"`{name}` must be a number of bytes or a size such as '200MB', '5GB' or "
                f"'2GiB' (units {sorted(_SIZE_UNITS)}); got {name}={value!r}."
            )
    else:
        raise TypeError(
            f"`{name}` must be an int (bytes) or a string such as '5GB'; got "
            f"{name}={value!r} of type {type(value).__name__}."
        )
    if size <= 0:
        raise ValueError(f"`{name}` must be positive; got {name}={value!r}.")
    return size


def shard_state(state, max_shard_size):
    """Split `state` (name -> array, in order) into shards of at most `max_shard_size`
    bytes, filled in order; a tensor larger than the limit gets a shard of its own (as
    transformers does). Returns a list of dicts."""
    limit = parse_size(max_shard_size)
    shards, current, size = [], {}, 0
    for name, value in state.items():
        nbytes = int(np.asarray(value).nbytes)
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_name(index, count):
    """Transformers' shard file name, e.g. `model-00001-of-00003.safetensors`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_hf(directory, hf_config, state, tokenizer=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE):
    """Write `config.json` and the weights (and `tokenizer.json`) that transformers loads.

    The weights are one `model.safetensors` when they fit in `max_shard_size` (bytes, or a
    string such as "200MB" / "5GB", as in transformers' `save_pretrained`), else shards
    `model-00001-of-0000N.safetensors` and `model.safetensors.index.json` (`metadata.
    total_size` and the `weight_map` name -> shard). Weight files of an earlier save in
    the directory that this one does not rewrite are removed, so a reader never mixes them.

    Example:
    >>> write_hf("out", hf_config, state, max_shard_size="200MB")
    """
    from safetensors.numpy import save_file  # optional dependency: kzoo[hf]

    shards = shard_state(state, max_shard_size)
    os.makedirs(directory, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}
    names = [HF_WEIGHTS] if len(shards) == 1 else [
        shard_name(i + 1, len(shards)) for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file({k: state[k] for k in shard}, os.path.join(directory, name + ".tmp"),
                  metadata={"format": "pt"})
    # An earlier save's config.json does not describe these weights: removed before they
    # replace its own, a save interrupted before the new config is written leaves no config
    # (`load` says so) instead of the old one over the new weights (a mixed model).
    try:
        os.remove(os.path.join(directory, HF_CONFIG))
    except FileNotFoundError:
        pass
    for name in names:
        os.replace(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))
    index_path = os.path.join(directory, HF_WEIGHTS_INDEX)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": int(sum(v.nbytes for v in state.values()))},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        write_json(index_path, index)
    stale = [HF_WEIGHTS, HF_WEIGHTS_INDEX] + [
        f for f in os.listdir(directory) if f.startswith("model-") and
        f.endswith(".safetensors")]
    for name in stale:
        if name not in names and not (name == HF_WEIGHTS_INDEX and len(shards) > 1):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                os.remove(path)
    write_json(os.path.join(directory, HF_CONFIG), hf_config)
    write_tokenizer(directory, tokenizer)
    return directory


def write_tokenizer(directory, tokenizer):
    """`tokenizer` (a `tokenizers` tokenizer, e.g. a loaded checkpoint's `model.tokenizer`)
    as `directory/tokenizer.json`, written to a temporary name and renamed; nothing for None
    or an object that cannot save itself."""
    if tokenizer is None or not hasattr(tokenizer, "save"):
        return None
    path = os.path.join(directory, "tokenizer.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    tokenizer.save(tmp)
    os.replace(tmp, path)
    return path


def load_tokenizer(path):
    """A `tokenizers.Tokenizer` for a checkpoint directory, or None when it has none."""
    path = os.fspath(path)
    try:
        import tokenizers  # optional dependency: kzoo[hf]
    except ImportError:
        return None
    def tokenizer_file(name):
        return file_in(path, name, "tokenizer file")

    def build(make, *files):
        for file in files:
            if os.path.getsize(file) == 0:
                raise ValueError(f"The tokenizer file {file!r} is empty.")
        try:
            return make()
        except Exception as e:  # tokenizers raises its own error types for bad files
            raise ValueError(
                f"The tokenizer file{'s' if len(files) > 1 else ''} "
                f"{', '.join(repr(f) for f in files)} cannot be read: {e}"
            ) from e

    tok_json = tokenizer_file("tokenizer.json")
    if os.path.isfile(tok_json):
        return build(lambda: tokenizers.Tokenizer.from_file(tok_json), tok_json)
    vocab = tokenizer_file("vocab.txt")
    if os.path.isfile(vocab):
        lower = True
        cfg = tokenizer_file("tokenizer_config.json")
        if os.path.isfile(cfg):
            lower = read_json(cfg, "tokenizer config").get("do_lower_case", True)
        if not isinstance(lower, bool):
            raise ValueError(
                f"`do_lower_case` in {cfg!r} must be true or false; got {lower!r}."
            )
        return build(lambda: tokenizers.BertWordPieceTokenizer(vocab, lowercase=lower), vocab)
    merges, vocab_json = tokenizer_file("merges.txt"), tokenizer_file("vocab.json")
    if os.path.isfile(merges) and os.path.isfile(vocab_json):
        return build(lambda: tokenizers.ByteLevelBPETokenizer(vocab_json, merges),
                     vocab_json, merges)
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
        if value.dtype.kind in "biuc":
            # Every tensor a converter takes is a float weight; integer, boolean or complex
            # values were cast to float32 and loaded as weights, with nothing said.
            raise ValueError(
                f"Checkpoint tensor {name!r} has dtype {value.dtype} (shape "
                f"{tuple(value.shape)}); a weight must be floating-point (float32, float16, "
                "bfloat16 or float64). The checkpoint is damaged, or holds quantized or "
                "other non-weight values under that name."
            )
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
