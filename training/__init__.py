"""Training entry points for kzoo: `python -m training <recipe> [options]`.

Recipes (see `training.recipes`): `gpt_text`, `bert_mlm`, `t5_numbers`, `vit_digits`,
`graphormer_freesolv`, `demo`. Each trains with `model.fit` on real data that ships inside
Python packages, with AdamW on a `kzoo.schedules.WarmupInverseSqrt` schedule and gradient
clipping, and writes into `--out` a CSV log, a PNG of the curves, `metrics.json`, exact
resumable checkpoints, the best model and the final model as a preset directory.

From Python:
>>> from training.cli import main
>>> main(["vit_digits", "--epochs", "2", "--out", "runs/vit"])
"""

from training.recipes import RECIPES

__all__ = ["RECIPES", "main"]


def main(argv=None):
    from training.cli import main as _main

    return _main(argv)
