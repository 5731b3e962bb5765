"""Kept import path: `ddp_kit.wrap` moved to `ddp_kit.parallel.wrap`."""
from .parallel.wrap import *  # noqa: F401,F403
from .parallel.wrap import unwrap, wrap_model  # noqa: F401  (the names the README documents)
