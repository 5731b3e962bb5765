"""What `ddp_kit.init()` is given, checked before anything starts: its options as the step boundary's
Policy (unknown ones refused in one line, with "did you mean"), and the script's config as JSON holds it."""
from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .boundary.policy import Policy
from .errors import UserError


def config_as_json(config: dict | None) -> dict | None:
    """The config as a checkpoint's meta.json will hold it (tuples as lists, keys as strings), so that
    a resume compares like with like; refused in one line when it does not fit in JSON."""
    if config is None:
        return None
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError) as exc:
        raise UserError(f"ddp_kit.init(config=...) must be JSON-able (numbers, strings, lists, dicts): {exc}",
                        "pass plain values, e.g. str(path) for a path") from None


def policy_from_options(run_dir: str | Path | None, options: dict[str, Any], prepare_options: Iterable[str],
                        init_options: Iterable[str]) -> Policy:
    """The Policy of `ddp_kit.init(run_dir, **options)`; an unknown option is refused in one line, with
    "did you mean" among `init_options` (init's own keywords) and the policy's, or pointed to
    run.prepare when it is one of `prepare_options`."""
    known = set(Policy.keywords()) - {"run_dir"}
    unknown = sorted(set(options) - known)
    if unknown:
        prepare = sorted(set(unknown) & set(prepare_options))
        if prepare:  # Fabric-style Fabric(strategy=...): here the model's options go where the model does
            raise UserError(f"ddp_kit.init() got {', '.join(prepare)}, which {'is an option' if len(prepare) == 1 else 'are options'} "
                            f"of run.prepare", f"pass it with the model: run.prepare(model, ..., "
                            f"{', '.join(f'{k}=...' for k in prepare)})")
        own = list(init_options)
        everything = sorted(set(own) | known)
        near = [m for k in unknown for m in difflib.get_close_matches(k, everything, n=2, cutoff=0.6)]
        raise UserError(f"ddp_kit.init() got unknown option(s) {', '.join(unknown)}",
                        f"did you mean {' or '.join(dict.fromkeys(near))}? known: {', '.join(everything)}" if near
                        else f"known: {', '.join(everything)}")
    if run_dir is None and (options.get("ckpt_every") or options.get("async_ckpt")):
        raise UserError("checkpoint options were given but no run_dir to write checkpoints into",
                        'pass run_dir to ddp_kit.init(run_dir="runs/my_run", ...)')
    return Policy(run_dir=None if run_dir is None else str(run_dir), **options)


def in_part(policy: Policy, sub: str | None) -> Policy:
    """A launch that is part of a job (DistEnv.part: a replica group of a fault-tolerant run) keeps its
    own run folder and checkpoints, `sub` under the ones given: a job of its own to the run folder's
    lock, its metrics and its commit protocol, and any one part's checkpoints resume the run."""
    if sub is None or policy.run_dir is None:
        return policy
    ckpt = None if policy.ckpt_dir is None else policy.ckpt_dir.rstrip("/") + "/" + sub
    return dataclasses.replace(policy, run_dir=str(Path(policy.run_dir) / sub), ckpt_dir=ckpt)
