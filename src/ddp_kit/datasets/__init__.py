"""Built-in datasets, one file each: `datasets/NAME.py` opens with a one-line docstring (the help
text) and defines `NAME(data_root, download, seed, synthetic_size) -> DataSpec`. Adding a dataset
is adding its file; this face finds every such module (not those starting with "_"), in name order.

Importing this package stays cheap: scikit-learn and torchvision are imported by the builders
that need them, when they are called.
"""
from __future__ import annotations

from ..errors import UserError
from ..registry import one_file_each
from ._spec import DataSpec

# One registry: name -> builder(data_root, download, seed, synthetic_size, **dataset_args);
# DESCRIPTIONS: name -> one line.
REGISTRY, DESCRIPTIONS = one_file_each(__name__, __path__, "(data_root, download, seed, synthetic_size)")
DATASETS = tuple(REGISTRY)


def build_dataset(name: str, data_root: str = "./data", download: bool = False, seed: int = 0,
                  synthetic_size: int = 4096) -> DataSpec:
    if name not in REGISTRY:
        raise UserError(f"unknown dataset {name!r}", f"choose one of {', '.join(DATASETS)}, or pkg.module:function")
    return REGISTRY[name](data_root, download, seed, synthetic_size)


__all__ = ["DATASETS", "DESCRIPTIONS", "DataSpec", "REGISTRY", "build_dataset"]
