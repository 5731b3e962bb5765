"""How a model is spread over ranks: one file per strategy, each defining a `Strategy` and its own
options (the registry is strategy.py's), the entry `wrap.wrap_model`, and the precision and device
helpers around them."""

# The public names, each imported from its module on first use (so that the config can ask
# parallel.strategy without loading torch).
# "module:name" where the face's name differs (`strategy` is also the submodule's name).
_PUBLIC = {"autocast": "precision", "check_amp": "precision", "grad_scaler": "precision", "to_device": "device",
           "STRATEGY_NAMES": "strategy:NAMES", "find_strategy": "strategy:strategy",
           "strategy_config_options": "strategy:config_options"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        module, _, attr = _PUBLIC[name].partition(":")
        return getattr(importlib.import_module(f".{module}", __name__), attr or name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
