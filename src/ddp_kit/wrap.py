"""Kept import path: `ddp_kit.wrap` moved to `ddp_kit.parallel.wrap`."""
from .parallel.wrap import *  # noqa: F403 (the old module's names, listed in parallel.wrap.__all__)
from .parallel.wrap import __all__  # noqa: F401 (the same names, declared)
