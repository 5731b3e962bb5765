"""scikit-learn's 8x8 digits, bundled with it (the default: real data, no download)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ._spec import DataSpec


def _load_digits():
    """scikit-learn's bundled 8x8 digits as (x float64 [1797, 64], y int64), read from the file it
    ships: importing sklearn costs 1-2 s of every process's startup (scipy comes with it), more than
    the whole default job trains. load_digits is the fallback should a release move the file."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise UserError("the default dataset (digits) ships with scikit-learn, which is not installed",
                        "pip install scikit-learn, or choose --dataset synthetic")
    for root in spec.submodule_search_locations or ():
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def digits(data_root: str, download: bool, seed: int, synthetic_size: int) -> DataSpec:
    x, y = _load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(y, dtype=torch.long)
    # A fixed split (seed 0 regardless of the run's seed) so every run evaluates on the same 360 images.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    test_idx, train_idx = perm[:360], perm[360:]
    ds = torch.utils.data.TensorDataset
    return DataSpec(ds(x[train_idx], y[train_idx]), ds(x[test_idx], y[test_idx]), (1, 8, 8), 10)
