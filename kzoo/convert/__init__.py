"""Hugging Face checkpoints in and out.

A directory whose `config.json` has a `model_type` is a Hugging Face checkpoint. Weights come
from `model.safetensors` (or a sharded `model.safetensors.index.json`), read with the
`safetensors` NumPy API (no torch needed), or from `pytorch_model.bin` when torch is
installed. Each family has a converter module here (`kzoo/convert/<family>.py`) defining:

- `MODEL_TYPES`: the Hugging Face `model_type` values it reads;
- `config_from_hf(hf_config: dict) -> (family, backbone_config, task, task_config)`: raises
  `ValueError` naming any field that changes the computation and that kzoo cannot honour;
- `load_weights(model, weights: WeightReader)`: assigns every weight (via `WeightReader.take`);
- `to_hf(model) -> (hf_config: dict, state: dict[str, np.ndarray])`.

Example:
>>> model = kzoo.presets.load("/path/to/bert-base-uncased")   # a save_pretrained directory
>>> kzoo.presets.save(model, "/tmp/out", format="hf")
"""

import importlib
import json
import os

import numpy as np

CONVERTER_MODULES = {
    "bert": "kzoo.convert.bert",
    "gpt2": "kzoo.convert.gpt",
    "llama": "kzoo.convert.gpt",  # the modern GPT configuration (RMSNorm, RoPE, SwiGLU, GQA)
    "mixtral": "kzoo.convert.gpt",  # ... with a mixture-of-experts feed-forward
    "t5": "kzoo.convert.t5",
    "vit": "kzoo.convert.vit",
    "graphormer": "kzoo.convert.graphormer",
}


def _converter(model_type):
    if model_type not in CONVERTER_MODULES:
        raise ValueError(
            f"Unsupported Hugging Face model_type={model_type!r}. Supported: "
            f"{sorted(CONVERTER_MODULES)}."
        )
    return importlib.import_module(CONVERTER_MODULES[model_type])


FAMILY_CONVERTERS = {
    "bert": "kzoo.convert.bert",
    "gpt": "kzoo.convert.gpt",
    "t5": "kzoo.convert.t5",
    "vit": "kzoo.convert.vit",
    "graphormer": "kzoo.convert.graphormer",
}


def _family_converter(family):
    if family not in FAMILY_CONVERTERS:
        raise ValueError(
            f"No Hugging Face converter for family={family!r}; families with one: "
            f"{sorted(FAMILY_CONVERTERS)}."
        )
    return importlib.import_module(FAMILY_CONVERTERS[family])


def read_hf_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def read_hf_state(path):
    """All tensors of a checkpoint directory as a dict name -> NumPy array."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(single) or os.path.isfile(index):
        from safetensors.numpy import load_file

        if os.path.isfile(single):
            return dict(load_file(single))
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(os.path.join(path, shard)))
        return state
    if os.path.isfile(binary):
        try:
            import torch
        except ImportError as e:  # pragma: no cover - torch is a test dependency
            raise ValueError(
                f"{binary!r} needs torch to read; install torch or convert the checkpoint "
                "to safetensors."
            ) from e
        raw = torch.load(binary, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                for k, v in raw.items()}
    raise ValueError(
        f"No weights in {path!r}: expected model.safetensors, model.safetensors.index.json "
        "or pytorch_model.bin."
    )


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


def load_hf(path, task=None, dtype=None, **overrides):
    """Build the kzoo model matching a Hugging Face checkpoint directory and load its weights."""
    from kzoo import presets

    hf_config = read_hf_config(path)
    conv = _converter(hf_config["model_type"])
    family, config, hf_task, task_config = conv.config_from_hf(hf_config)
    task = hf_task if task is None else task
    if task != hf_task:
        task_config = {}
    module = importlib.import_module(f"kzoo.models.{family}")
    config_over, task_over = presets._split_overrides(module, task, overrides)
    config.update(config_over)
    task_config.update(task_over)
    model = presets.build(family, config, task=task, task_config=task_config, dtype=dtype)
    reader = WeightReader(read_hf_state(path), ignore=getattr(conv, "IGNORED_WEIGHTS", ()))
    conv.load_weights(model, reader)
    reader.finish() if task == hf_task else None
    tokenizer = load_tokenizer(path)
    if tokenizer is not None:
        model.tokenizer = tokenizer
    return model


def load_hf_weights_into(model, path):
    conv = _converter(read_hf_config(path)["model_type"])
    reader = WeightReader(read_hf_state(path), ignore=getattr(conv, "IGNORED_WEIGHTS", ()))
    conv.load_weights(model, reader)
    reader.finish()


def save_hf(model, directory):
    """Write `config.json` and `model.safetensors` that transformers loads."""
    from safetensors.numpy import save_file

    conv = _family_converter(getattr(model, "family", None))
    hf_config, state = conv.to_hf(model)
    os.makedirs(directory, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}
    tmp = os.path.join(directory, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return directory


def load_tokenizer(path):
    """A `tokenizers.Tokenizer` for a checkpoint directory, or None when it has none."""
    tok_json = os.path.join(path, "tokenizer.json")
    try:
        import tokenizers
    except ImportError:
        return None
    if os.path.isfile(tok_json):
        return tokenizers.Tokenizer.from_file(tok_json)
    vocab = os.path.join(path, "vocab.txt")
    if os.path.isfile(vocab):
        lower = True
        cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                lower = json.load(f).get("do_lower_case", True)
        return tokenizers.BertWordPieceTokenizer(vocab, lowercase=lower)
    merges, vocab_json = os.path.join(path, "merges.txt"), os.path.join(path, "vocab.json")
    if os.path.isfile(merges) and os.path.isfile(vocab_json):
        return tokenizers.ByteLevelBPETokenizer(vocab_json, merges)
    return None
