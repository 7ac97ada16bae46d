"""The recipes of `python -m training <recipe>`: name -> module.

A recipe module defines `NAME`, `HELP` (one line), `DEFAULTS` (RunConfig defaults:
preset, run length, batch size, learning rate, overrides...), `add_arguments(parser)` for
its own options, and `train(cfg) -> metrics record`.
"""

import importlib

RECIPE_MODULES = {
    "gpt_text": "training.recipes.gpt_text",
    "bert_mlm": "training.recipes.bert_mlm",
    "t5_numbers": "training.recipes.t5_numbers",
    "vit_digits": "training.recipes.vit_digits",
    "graphormer_freesolv": "training.recipes.graphormer_freesolv",
    "demo": "training.recipes.demo",
    "distill_gpt": "training.recipes.distill_gpt",
}

RECIPES = tuple(RECIPE_MODULES)


def recipe_module(name):
    if name not in RECIPE_MODULES:
        raise ValueError(f"Unknown recipe {name!r}; choose one of {list(RECIPES)}.")
    return importlib.import_module(RECIPE_MODULES[name])
