"""Which committed steps prune spares beyond keep_last: those the newest step's meta.json names (steps.prune
reads it once). Plain functions over a meta.json already read: a meta.json is read, not trusted.

- KEEP_BEST: the best-scoring steps kept (services/keep_best.py).
- AGREED: the last step the ranks agreed on when the step was saved (a sync check passed, or a rollback
  restored one state; not yet named before this attempt's first check: boundary/saving.py). Under sync_fix rollback the newest committed step at or before it is where a
  rollback goes (boundary/rollback.py): frequent saves (ckpt_every auto) with a small keep_last would otherwise
  prune every step old enough, and a divergence could then only stop the run."""
from __future__ import annotations

from typing import Any

KEEP_BEST = "keep_best"  # meta.json: {"monitor", "mode", "k", "best": [[step, score], ...], best first} (services/keep_best.py)
AGREED = "agreed"  # meta.json: the last step the ranks agreed on (boundary/saving.py; only under sync_fix rollback)


def kept_best(meta: Any) -> tuple[str, list[tuple[int, float]]]:
    """(the metric, [(step, score)] best first) that a step's meta names as the best steps kept; ("", [])
    where it names none or its entry is malformed."""
    entry: Any = meta.get(KEEP_BEST) if isinstance(meta, dict) else None
    try:
        return str(entry["monitor"]), [(int(s), float(v)) for s, v in entry["best"]]
    except (TypeError, KeyError, ValueError):
        return "", []


def agreed(meta: Any) -> int | None:
    """The last step the ranks agreed on, as a step's meta names it; None where it names none (or not a step)."""
    value = meta.get(AGREED) if isinstance(meta, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def spared(meta: Any, committed: list[int]) -> set[int]:
    """Of `committed`, the steps `meta` (the newest one's) asks to keep beyond keep_last: the kept-best ones,
    and the newest at or before the last agreed step."""
    out = {s for s, _ in kept_best(meta)[1]}
    last = agreed(meta)
    below = [s for s in committed if last is not None and s <= last]
    if below:
        out.add(max(below))
    return out
