"""Hugging Face checkpoints in and out: one converter module a family.

A directory whose `config.json` has a `model_type` is a Hugging Face checkpoint;
`kzoo.presets.load(directory)` reads it and `kzoo.presets.save(model, directory, format="hf")`
writes one. `kzoo.registry` says which family reads which `model_type` and which module here
converts it; the files themselves are read and written by `kzoo.checkpoints`. Each converter
module (`kzoo/convert/<family>.py`) defines:

- `MODEL_TYPES`: the Hugging Face `model_type` values it reads (those its registry entry lists);
- `config_from_hf(hf_config: dict) -> (family, backbone_config, task, task_config)`: raises
  `ValueError` naming any field that changes the computation and that kzoo cannot honour;
- `load_weights(model, weights: WeightReader)`: assigns every weight (via `WeightReader.take`);
- `to_hf(model) -> (hf_config: dict, state: dict[str, np.ndarray])`;
- optionally `IGNORED_WEIGHTS`: name suffixes of checkpoint buffers that are not weights.

Example:
>>> model = kzoo.presets.load("/path/to/bert-base-uncased")   # a save_pretrained directory
>>> kzoo.presets.save(model, "/tmp/out", format="hf")
"""

from kzoo.checkpoints import (  # noqa: F401 - the toolkit every converter module uses
    WeightReader,
    assign,
    hf_token_ids,
    load_tokenizer,
    read_hf_config,
    read_hf_state,
)

__all__ = ["WeightReader", "assign", "hf_token_ids", "load_tokenizer", "read_hf_config",
           "read_hf_state"]
