"""`demo` (what `make demo` runs): a few minutes of `gpt_mini` on the pydoc text.

Trains kzoo's `gpt_mini` preset on the standard library's `pydoc_data.topics` with
byte-level tokens (the `gpt_text` recipe with a short default run, about three minutes on
a 2-core CPU with the default backend), showing Keras' progress bar, then prints a sample
from `generate` and where the model, the CSV log and the plot were written
(`runs/demo/...` by default). Nothing is downloaded; running it again resumes from or
re-uses its checkpoints (`--fresh` starts over).
"""

import os

from training.recipes import gpt_text

NAME = "demo"
HELP = "what `make demo` runs: ~3 minutes of gpt_mini on the pydoc text, then a sample."
# ~0.35 s a step for gpt_mini at batch 32 x 128 bytes on an idle 2-core CPU (TensorFlow).
DEFAULTS = dict(gpt_text.DEFAULTS, steps=500, warmup_steps=100, save_every=100)


def add_arguments(parser):
    gpt_text.add_arguments(parser)


def report(model, task, metrics):
    gpt_text.report(model, task, metrics)


def _show(path):
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def train(cfg):
    record = gpt_text.train(cfg, report_fn=report)
    files = record["files"]
    print("Where things are:")
    print(f"  model (kzoo.presets.load):  {_show(files['model'])}")
    print(f"  best model:                 {_show(files['best'])}")
    print(f"  CSV log:                    {_show(files['csv'])}")
    print(f"  loss/metric curves:         {_show(files['plot'])}")
    print(f"  metrics:                    {_show(files['metrics'])}")
    print(f"  checkpoints:                {_show(files['checkpoints'])}")
    print(f"Reload it with: kzoo.presets.load({_show(files['model'])!r})")
    return record
