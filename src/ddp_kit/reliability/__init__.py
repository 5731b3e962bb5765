"""The services the step boundary schedules, each with plain arguments: the failure policy, the hang
watchdog, peer loss, preemption, sync checks, numerics, metrics and progress; and the recipe's rules
(what may change at a resume)."""

# The public names, each imported from its module on first use: the reference job's config check
# asks for config_hash, and importing every module here would load torch for it.
_PUBLIC = {
    "param_sha256": "sync_checks",
    "NOT_RECIPE": "recipe", "RESUMABLE": "recipe", "config_hash": "recipe", "describe_changes": "recipe", "not_recipe": "recipe",
    "recipe_changes": "recipe", "refuse_changed": "recipe",
    "model_flops_per_sample": "metrics", "peak_tflops": "metrics",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
