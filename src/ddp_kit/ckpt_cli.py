"""`python -m ddp_kit.checkpoint`: list a run's checkpoints with their validity; export model weights.

    python -m ddp_kit.checkpoint list RUN_DIR
    python -m ddp_kit.checkpoint export RUN_DIR --out model.pt [--step N]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .checkpoint import list_checkpoints, validate
from .errors import EXIT_USER_ERROR, UserError


def _root(run_dir: str) -> Path:
    p = Path(run_dir)
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def list_(run_dir: str) -> None:
    """Print every checkpoint of RUN_DIR, newest first, with its validity."""
    root = _root(run_dir)
    rows = list_checkpoints(root)
    if not rows:
        raise UserError(f"no checkpoints under {str(root)!r}", "pass the run_dir of a run that saved some")
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    print(f"{'step':>8}  {'status':<7} {'world':>5}  {'size':>10}  path")
    for step, path, reason in rows:
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        world = json.loads((path / "meta.json").read_text()).get("world_size", "?") if reason is None else "?"
        mark = " (latest)" if path.name == latest else ""
        print(f"{step:>8}  {'valid' if reason is None else 'INVALID':<7} {world:>5}  {size:>10}  {path}{mark}"
              + (f"  -- {reason}" if reason else ""))


def export(run_dir: str, out: str, step: int | None = None) -> None:
    """Write the model weights of checkpoint STEP (default: newest valid) as a plain state_dict file."""
    import torch

    root = Path(run_dir)
    if (root / "manifest.json").exists() or (root / "model.pt").exists():
        path = root
    else:
        rows = [(s, p) for s, p, reason in list_checkpoints(_root(run_dir)) if reason is None]
        rows = [(s, p) for s, p in rows if step is None or s == int(step)]
        if not rows:
            raise UserError(f"no valid checkpoint{'' if step is None else f' at step {step}'} under {run_dir!r}",
                            "see `python -m ddp_kit.checkpoint list RUN_DIR`")
        path = rows[0][1]
    reason = validate(path)
    if reason:
        raise UserError(f"checkpoint {str(path)!r} is not valid: {reason}", "export another step")
    state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    torch.save(state, out)
    print(f"exported {len(state)} tensors from {path} to {out}")


def main() -> None:
    import fire

    try:
        fire.Fire({"list": list_, "export": export})
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
