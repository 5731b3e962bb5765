"""Built-in datasets, one file each: `datasets/NAME.py` opens with a one-line docstring (the help
text) and defines `NAME(data_root, download, seed, synthetic_size) -> DataSpec`. Adding a dataset
is adding its file; this face finds every such module (not those starting with "_"), in name order.

Importing this package stays cheap: scikit-learn and torchvision are imported by the builders
that need them, when they are called.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from ..errors import UserError
from ._spec import DataSpec


def _discover() -> tuple[dict[str, Callable[..., DataSpec]], dict[str, str]]:
    builders, about = {}, {}
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
        module = importlib.import_module(f"{__name__}.{name}")
        if not callable(getattr(module, name, None)):  # a new file's author reads this, not a user
            raise ImportError(f"{module.__file__} must define {name}(data_root, download, seed, synthetic_size)")
        builders[name] = getattr(module, name)
        about[name] = ((module.__doc__ or "").strip().splitlines() or [""])[0]
    return builders, about


# One registry: name -> builder(data_root, download, seed, synthetic_size, **dataset_args);
# DESCRIPTIONS: name -> one line.
REGISTRY, DESCRIPTIONS = _discover()
DATASETS = tuple(REGISTRY)


def build_dataset(name: str, data_root: str = "./data", download: bool = False, seed: int = 0,
                  synthetic_size: int = 4096) -> DataSpec:
    if name not in REGISTRY:
        raise UserError(f"unknown dataset {name!r}", f"choose one of {', '.join(DATASETS)}, or pkg.module:function")
    return REGISTRY[name](data_root, download, seed, synthetic_size)


__all__ = ["DATASETS", "DESCRIPTIONS", "DataSpec", "REGISTRY", "build_dataset"]
