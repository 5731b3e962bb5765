"""The strategy seam: what the rest of ddp_kit asks about how a model is spread over ranks.

A strategy is one frozen object defined in its own file (ddp.py, fsdp.py) and named in
`STRATEGIES`: adding one is a new file plus one line there. Nothing outside parallel/ compares a
strategy's name; it asks the object (`sharded`, `wrap`, `accumulate`, `state_dicts`, ...). The
name is what a checkpoint's meta.json records.

A strategy's own options are declared once, in its file, as a tuple of `Option` (ddp_kit/options.py): run.prepare takes
them (in the dict under the strategy's `keyword`), and the reference job's config, --help_config
and the recipe's resume rule (reliability/recipe.py) read their keys, defaults, help and
`resumable` from there (`config_options`, `option_keywords`).

This module imports no torch: the registry's names are known before torch is loaded; a strategy's
own file (and so torch) is imported when the strategy, or every strategy's options, is first asked for.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..options import Option

# name -> the module that defines it as STRATEGY; the first is the default
STRATEGIES: dict[str, str] = {"ddp": "ddp_kit.parallel.ddp", "fsdp": "ddp_kit.parallel.fsdp", "hsdp": "ddp_kit.parallel.hsdp",
                              "ft": "ddp_kit.parallel.ft"}
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
    options: tuple[Option, ...] = ()  # its own options (a strategy may share another's Option objects)
    keyword: str | None = None  # the run.prepare keyword of its options dict (ddp=..., fsdp=...); None: its name

    @property
    def options_keyword(self) -> str:
        return self.keyword or self.name

    @property
    def config_keys(self) -> tuple[str, ...]:
        """The reference job's config keys that this strategy reads."""
        return tuple(o.key for o in self.options if o.key)

    def own_options(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """`given` (its run.prepare dict), refused in one line when it names an option not declared."""
        given = dict(given or {})
        names = [o.name for o in self.options if not o.own_keyword]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise UserError(f"{self.options_keyword} options {unknown} not understood", f"known: {', '.join(names)}")
        return given

    def check_options(self, *, sync_bn: bool, amp: str | None = None, cpu_offload: bool = False,
                      device: Any = None, ddp: dict | None = None) -> None:
        """One line and a hint for what does not combine with this strategy, before anything is built."""

    def check_config(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        """The reference job's rules, worded with its --flags (values/defaults: config key -> value)."""

    def prepare_options(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """run.prepare's keyword options from the reference job's values of `config_keys`: its dict
        of the options that have a config key (an `own_keyword` one the job passes itself)."""
        mine = {o.name: o.parse(values[o.key]) if o.parse else values[o.key]
                for o in self.options if o.key and not o.own_keyword}
        return {self.options_keyword: mine} if mine else {}

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


def foreign_keys(name: str, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[tuple[Strategy, str]]:
    """The config keys that other strategies read and `name` does not, given a value other than their
    default: (the first strategy in the registry that reads it, the key), each key once."""
    own = set(strategy(name).config_keys)
    out: dict[str, Strategy] = {}
    for other in others(name):
        for key in other.config_keys:
            if key not in own and key not in out and values[key] != defaults[key]:
                out[key] = other
    return [(s, key) for key, s in out.items()]


def article(label: str) -> str:
    """'a' or 'an' before a strategy's label as it is read out ("a DDP", "an FSDP")."""
    word = label.split()[0] if label.strip() else label
    spelled = word.isupper()  # an acronym is read letter by letter
    return "an" if (word[:1] in "AEFHILMNORSX" if spelled else word[:1].lower() in "aeiou") else "a"


def config_options() -> list[Option]:
    """Every strategy's options that the reference job's config holds, each key once (strategies may
    share one), in the registry's order. Imports every strategy's file (and torch)."""
    seen: dict[str, Option] = {}
    for s in every_strategy():
        for o in s.options:
            if o.key and seen.setdefault(o.key, o) != o:
                raise ValueError(f"strategy {s.name} declares config key {o.key!r} unlike another strategy does")
    return list(seen.values())


def option_keywords() -> set[str]:
    """The keywords of run.prepare (and wrap_model) that hold a strategy's options dict: ddp, fsdp, ..."""
    return {s.options_keyword for s in every_strategy() if any(not o.own_keyword for o in s.options)}
