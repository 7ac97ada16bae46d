"""Model families, one module a family: its backbone, its task models and what only it needs.

The backbone class is a functional `keras.Model` whose constructor takes the configuration as
keyword arguments (plus `dtype`) and carries `family = "<name>"`; task classes carry `family`
and `task_name`, take `backbone=` and keep it as `self.backbone`. Which families exist, their
tasks, default task, Hugging Face converters and presets are listed once, in `kzoo.registry`.
"""
