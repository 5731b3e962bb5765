"""Registries of built-ins, one file each: a package whose modules `NAME.py` each define a function
`NAME` and open with a one-line docstring (its help text). Adding a built-in is adding its file."""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable


def one_file_each(package: str, path: Iterable[str], signature: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """(name -> function, name -> one-line description) over the modules of `package` (its
    `__path__`), in name order; modules starting with "_" are helpers, not entries."""
    builders, about = {}, {}
    for name in sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_")):
        module = importlib.import_module(f"{package}.{name}")
        if not callable(getattr(module, name, None)):  # a new file's author reads this, not a user
            raise ImportError(f"{module.__file__} must define {name}{signature}")
        builders[name] = getattr(module, name)
        about[name] = ((module.__doc__ or "").strip().splitlines() or [""])[0]
    return builders, about
