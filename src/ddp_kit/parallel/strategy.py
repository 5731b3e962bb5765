"""The strategy seam: what the rest of ddp_kit asks about how a model is spread over ranks.

A strategy is one frozen object defined in its own file (ddp.py, fsdp.py) and named in
`STRATEGIES`: adding one is a new file plus one line there. Nothing outside parallel/ compares a
strategy's name; it asks the object (`sharded`, `wrap`, `accumulate`, `state_dicts`, ...). The
name is what a checkpoint's meta.json records.

This module imports no torch: the job's config asks it for names and option rules before torch
is loaded; a strategy's own file (and so torch) is imported when the strategy is first looked up.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..errors import UserError

# name -> the module that defines it as STRATEGY; the first is the default
STRATEGIES: dict[str, str] = {"ddp": "ddp_kit.parallel.ddp", "fsdp": "ddp_kit.parallel.fsdp", "ft": "ddp_kit.parallel.ft"}
NAMES: tuple[str, ...] = tuple(STRATEGIES)
DEFAULT = NAMES[0]
UNRECORDED = "ddp"  # the strategy of a checkpoint whose meta.json names none (written before there was a choice)


@dataclass(frozen=True)
class Strategy:
    """One way to spread a model over ranks. Concrete strategies override the methods."""

    name: str  # as meta.json and summary.json write it
    label: str  # as messages name it ("DDP")
    # State through torch.distributed.checkpoint (each rank its shards), even eval batches (every
    # forward is collective), no per-rank digest comparison (every rank hashes the same gathered
    # weights), and an optimizer over none of the model's parameters is refused, not warned about.
    sharded: bool
    options: tuple[str, ...] = ()  # the keys of its options dict in run.prepare (ddp=..., fsdp=...)
    config_keys: tuple[str, ...] = ()  # the reference job's config keys that only this strategy reads

    def check_options(self, *, sync_bn: bool, amp: str | None = None, cpu_offload: bool = False,
                      device: Any = None, ddp: dict | None = None) -> None:
        """One line and a hint for what does not combine with this strategy, before anything is built."""

    def check_config(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        """The reference job's rules, worded with its --flags (values/defaults: config key -> value)."""

    def prepare_options(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """run.prepare's keyword options from the reference job's values of `config_keys`."""
        return {}

    def wrap(self, model: Any, ctx: Any, **options: Any) -> Any:
        raise NotImplementedError(self.name)

    def holds(self, model: Any) -> bool:
        """`model` is already wrapped (or sharded) by this strategy."""
        raise NotImplementedError(self.name)

    def accumulate(self, model: Any, sync: bool) -> AbstractContextManager:
        """Context for one micro-step: gradients are reduced only when `sync` (the last one). With
        `sync` it must change nothing (a step without accumulation): wrap.sync_gradients returns a
        null context then without asking the strategy."""
        raise NotImplementedError(self.name)

    def state_dicts(self, models: dict[str, Any], optimizers: dict[str, Any]) -> dict[str, Any] | None:
        """{name: state} of the models and optimizers that DCP saves; None where the plain files hold them."""
        return None

    def load_state_dicts(self, models: dict[str, Any], optimizers: dict[str, Any], saved: set[str],
                         read: Callable[[dict], None]) -> None:
        """Fill the models and optimizers from a DCP checkpoint (only a sharded strategy has one)."""

    def settle(self, model: Any, batch: Any, device: Any) -> None:
        """After a resume, before the first step: whatever the wrapper must redo to continue exactly
        as the uninterrupted run (DDP: its rebuilt gradient buckets)."""

    def step_hooks(self, models: list[Any], env: Any, attached: list[Any]) -> list[Any]:
        """What this strategy adds at the step boundary (hooks.StepHooks) for the `models` it just
        prepared, given the hooks `attached` already. A strategy that nothing averages across replica
        groups refuses a process that is one replica group of several."""
        if env.replica_groups > 1 and not any(getattr(h, "across_groups", False) for h in attached):
            raise UserError(f"this process is replica group {env.replica_group} of {env.replica_groups}, and its model "
                            f"was prepared with strategy {self.name}, which nothing averages across the groups: each "
                            f"would train a model of its own on 1/{env.replica_groups} of the data",
                            "pass strategy='ft' to run.prepare (--strategy ft), or launch without python -m ddp_kit.launch ft")
        return []


def strategy(name: str) -> Strategy:
    """The strategy called `name`; an unknown name is one line naming the known ones."""
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy {name!r}", f"choose one of {', '.join(NAMES)}")
    return importlib.import_module(STRATEGIES[name]).STRATEGY


def every_strategy() -> list[Strategy]:
    return [strategy(n) for n in NAMES]


def strategy_of(model: Any) -> Strategy | None:
    """The strategy that wrapped `model`, or None for a plain module. Later entries are asked first:
    they refine earlier ones (ft's wrapper is a DDP too)."""
    return next((s for s in reversed(every_strategy()) if s.holds(model)), None)


def others(name: str) -> list[Strategy]:
    return [s for s in every_strategy() if s.name != name]
