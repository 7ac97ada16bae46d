"""The loss and metric curves of a run as a PNG (matplotlib's Agg canvas, no display)."""

import math
import os

import numpy as np


def plot_history(history, path, title=None):
    """Plot every logged quantity of `history` (a list of per-epoch dicts with `step`).

    One panel per quantity (`loss`, `accuracy`, ...), the training curve and its `val_`
    twin together, against the optimizer step. Written to a temporary name and renamed,
    so the PNG on disk is always a whole picture. Returns `path`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    skip = {"step", "epoch", "learning_rate", "lr", "time_s"}
    names = []
    for row in history:
        for key in row:
            base = key[4:] if key.startswith("val_") else key
            if key not in skip and base not in names:
                names.append(base)
    if "loss" in names:
        names.remove("loss")
        names.insert(0, "loss")
    panels = max(1, len(names))
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    figure = Figure(figsize=(4.5 * cols, 3.4 * rows), dpi=100)
    FigureCanvasAgg(figure)
    steps = np.asarray([row.get("step", i + 1) for i, row in enumerate(history)])
    for index, name in enumerate(names or ["loss"]):
        axes = figure.add_subplot(rows, cols, index + 1)
        for key, style in ((name, "-o"), ("val_" + name, "-s")):
            values = np.asarray([row.get(key, np.nan) for row in history], dtype=np.float64)
            if np.isfinite(values).any():
                axes.plot(steps, values, style, markersize=3,
                          label="validation" if key.startswith("val_") else "train")
        axes.set_title(name)
        axes.set_xlabel("step")
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    figure.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path
