"""ddp_kit: one PyTorch training script from a single-process debug run to N GPUs on M nodes.

Importing the package is cheap and has no side effects; torch is imported by the modules that use it.
"""
from .version import __version__

__all__ = ["__version__", "init", "Run"]


def __getattr__(name):
    # Lazy: `import ddp_kit` stays free of torch until the API is used.
    if name in ("init", "Run"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ddp_kit' has no attribute {name!r}")
