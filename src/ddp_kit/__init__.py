"""ddp_kit: one PyTorch training script from a single-process debug run to N GPUs on M nodes.

Importing the package is cheap and has no side effects; torch is imported by the modules that use it.
"""
import time as _time

from .version import __version__

# When this interpreter imported ddp_kit (unix time) and the CPU seconds it had spent by then: what
# boundary/attempts.launched_at tells an interpreter's own start by, when a shell exec'd it (`a && python ...`).
IMPORTED = (_time.time(), _time.process_time())

__all__ = ["__version__", "init", "Run"]


def __getattr__(name):
    # Lazy: `import ddp_kit` stays free of torch until the API is used.
    if name in ("init", "Run"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ddp_kit' has no attribute {name!r}")
