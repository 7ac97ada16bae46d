"""Model families. Each family module defines, besides its classes:

- `FAMILY`: the family name used in preset files ("bert", "gpt", "t5", "vit", "graphormer");
- `BACKBONE`: the backbone class (a functional `keras.Model`; its constructor takes the
  preset's `config` dict as keyword arguments, plus `dtype`);
- `TASKS`: a dict task name -> task model class (constructor `Cls(backbone=..., **task_config)`),
  with `"backbone"` mapped to None (the backbone alone);
- `DEFAULT_TASK`: the task a preset of this family loads by default.

Backbone classes carry `family = FAMILY`; task classes carry `family` and `task_name`, and
keep their backbone as `self.backbone`. `kzoo.presets` relies on exactly these names.
"""

import importlib

FAMILY_MODULES = {
    "bert": "kzoo.models.bert",
    "gpt": "kzoo.models.gpt",
    "t5": "kzoo.models.t5",
    "vit": "kzoo.models.vit",
    "graphormer": "kzoo.models.graphormer",
}


def family_module(family):
    """Import and return the module of `family`."""
    if family not in FAMILY_MODULES:
        raise ValueError(
            f"`family` must be one of {sorted(FAMILY_MODULES)}; got family={family!r}."
        )
    return importlib.import_module(FAMILY_MODULES[family])
