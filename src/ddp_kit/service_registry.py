"""The registry of the services every run has: what takes part in the step boundary beside the loop
and the strategy.

A service is declared in its own file (services/) as `SERVICE`, a `Service`: its name, its settings (options.Option,
each a keyword of `ddp_kit.init` and, with a `key`, a config key of the reference job) and a factory
that returns what the service adds to this run, or None where it is off: a hooks.StepHooks (it takes
part in every step), a hooks.Tier (a checkpoint tier: it saves at its own cadence, and resume takes the
newest complete step across tiers), or a tuple of them. Adding a service is a new
file plus one line in `SERVICES`; the step boundary names none of them.

The order of `SERVICES` is the order they are attached, and so the order their hooks run in: the run
ledger writes an attempt's end line before the trackers close (a tracker slow to close must not cost it), and
its start line (the crash-loop rule) before the health gate runs, which comes before anything else starts.

This module imports no torch: the settings are known before torch is loaded (config help, the recipe
rule); a service's own file imports what it runs inside its factory.
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import UserError
from .options import Option

# name -> the module that defines it as SERVICE, in the order they are attached
SERVICES: dict[str, str] = {
    "ledger": "ddp_kit.services.run_ledger",
    "health": "ddp_kit.services.health_gate",
    "trackers": "ddp_kit.services.trackers",
    "memory_tier": "ddp_kit.services.memory_tier",
    "cadence": "ddp_kit.services.cadence",
    "profiler": "ddp_kit.services.profiler",
    "keep_best": "ddp_kit.services.keep_best",
}


@dataclass(frozen=True)
class Service:
    """One service, declared in its own file (see the module docstring)."""

    name: str
    options: tuple[Option, ...] = ()
    # (the boundary, {option name: value}) -> its StepHooks and/or Tier for this run, or None: off
    make: Callable[[Any, Mapping[str, Any]], Any] = lambda b, settings: None
    # {option name: value} and run_dir -> raises a UserError where the settings cannot work together
    check: Callable[[Mapping[str, Any], str | None], None] | None = None


def service(name: str) -> Service:
    return importlib.import_module(SERVICES[name]).SERVICE  # type: ignore[no-any-return]


def every_service() -> list[Service]:
    return [service(n) for n in SERVICES]


def options() -> list[Option]:
    """Every service's settings, in the registry's order; a name declared twice is a bug."""
    seen: dict[str, Option] = {}
    for s in every_service():
        for o in s.options:
            if seen.setdefault(o.name, o) is not o:
                raise ValueError(f"service {s.name} declares setting {o.name!r}, which another service declares")
    return list(seen.values())


def settings(given: Mapping[str, Any], run_dir: str | None) -> dict[str, Any]:
    """{setting: value} of every service, from `given` (ddp_kit.init's keywords, or the job's config
    values) over the declared defaults, each parsed and checked; a name no service declares is refused."""
    declared = {o.name: o for o in options()}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        near = [m for k in unknown for m in difflib.get_close_matches(k, declared, n=2, cutoff=0.6)]
        raise UserError(f"unknown service setting(s) {', '.join(unknown)}",
                        f"did you mean {' or '.join(dict.fromkeys(near))}?" if near else f"known: {', '.join(declared)}")
    out = {name: o.value(given[name] if name in given else o.default) for name, o in declared.items()}
    for s in every_service():
        if s.check is not None:
            s.check({o.name: out[o.name] for o in s.options}, run_dir)
    return out


def start(b: Any, values: Mapping[str, Any]) -> list[Any]:
    """What every service adds to this run (the boundary `b`), in the registry's order; the ones off left out."""
    out: list[Any] = []
    for s in every_service():
        made = s.make(b, {o.name: values[o.name] for o in s.options})
        out += [m for m in (made if isinstance(made, tuple) else (made,)) if m is not None]
    return out
