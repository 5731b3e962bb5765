"""One declared setting of an extension: a strategy's, a service's or a checkpoint tier's. Each is
declared once, in the extension's own file, as an `Option`; `ddp_kit.init`'s keywords (or run.prepare's
options dict, for a strategy), the reference job's config keys, `--help_config` and the recipe rule
(which settings may change across a resume: reliability/recipe.py) are built from these declarations,
so that a new extension lists its settings nowhere else. Plain data: no torch."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One setting, declared in its owner's file."""

    name: str  # its keyword: ddp_kit.init's (a service's), or in the strategy's run.prepare dict (fsdp={"cpu_offload": True})
    default: Any  # the config key's default (the keyword's, through `parse`); its type is the key's unless `type` says
    help: str = ""  # the config key's line in --help_config
    key: str | None = None  # the reference job's config key; None: the keyword only
    resumable: bool = False  # may differ between a checkpoint and the run resuming it (reliability/recipe.py)
    type: Any = None  # the config key's type where the default does not say it (float | None)
    choices: tuple[Any, ...] | None = None  # the config values allowed
    parse: Callable[[Any], Any] | None = None  # config value -> the keyword's value ("Block, Head" -> ["Block", "Head"])
    # A keyword of run.prepare itself (sync_bn), passed by the job under every strategy, not in the dict:
    # listed here as the config key that only this strategy reads.
    own_keyword: bool = False
    # Refuses a value in one line (UserError) before anything starts; given the parsed value.
    check: Callable[[Any], None] | None = None
    auto: bool = False  # a count that also takes "auto" (its value then chosen at run time: a checkpoint interval)

    @property
    def config_type(self) -> Any:
        return self.type if self.type is not None else type(self.default)

    def value(self, given: Any) -> Any:
        """The keyword's value from what a caller passed (a config value or the keyword's own form), checked."""
        out = self.parse(given) if self.parse is not None else given
        if self.auto:
            out = auto_or(out)
        if self.check is not None:
            self.check(out)
        return out


AUTO = "auto"  # an interval ddp_kit chooses from what the run measures (services/cadence.py)


def auto_or(value: Any) -> Any:
    """AUTO for "auto" in any case ("Auto" from a script: the CLI lowercases, a keyword is passed as typed);
    anything else as given. Every comparison with AUTO downstream can then be exact."""
    return AUTO if isinstance(value, str) and value.strip().lower() == AUTO else value


def every_or_auto(name: str) -> Callable[[Any], None]:
    """A check: `name` is a count where 0 means off, or "auto"."""
    def check(value: Any) -> None:
        from .errors import UserError

        if auto_or(value) == AUTO:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"config key '{name}' must be a count >= 0 or \"auto\"; got {value!r}",
                            f"e.g. --{name} 100, or --{name} auto to let ddp_kit choose from the save cost and the "
                            f"failure rate")
    return check


def above(name: str, low: float, example: str, strict: bool = False) -> Callable[[Any], None]:
    """A check: `name` is at least `low` (above it, `strict`)."""
    def check(value: Any) -> None:
        from .errors import UserError

        if value < low or (strict and value == low):
            raise UserError(f"config key '{name}' must be {'>' if strict else 'at least'} {low:g}; got {value!r}",
                            f"e.g. --{name} {example}")
    return check


def at_least_zero(name: str) -> Callable[[Any], None]:
    """A check: `name` is a count where 0 means off."""
    def check(value: Any) -> None:
        from .errors import UserError

        if value < 0:
            raise UserError(f"config key '{name}' must be >= 0; got {value}", f"e.g. --{name} 0")
    return check
