"""SLURM: render slurm/<layout>.sbatch (package data) with the layout's #SBATCH lines and the training arguments
embedded, and submit it with sbatch (or print it with --dry_run)."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from ..errors import UserError

LAYOUTS = ("srun", "torchrun", "ft")


def template_path(layout: str) -> Path:
    """The packaged template (slurm/<layout>.sbatch in a checkout links to the same file)."""
    path = Path(__file__).resolve().parent / "templates" / f"{layout}.sbatch"
    if not path.is_file():
        raise UserError(f"the {layout} template is missing from the installed package ({path})",
                        "reinstall ddp_kit (pip install --force-reinstall ddp_kit)")
    return path


def render(layout: str, train_args: list[str], nodes: int = 1, nproc_per_node: int | None = None,
           gpus_per_node: int | None = None, time: str = "01:00:00", partition: str | None = None,
           account: str | None = None, job_name: str = "ddp_kit") -> str:
    if layout not in LAYOUTS:
        raise UserError(f"unknown layout {layout!r}", f"use one of {', '.join(LAYOUTS)}")
    ranks_per_node = nproc_per_node or gpus_per_node or 1
    settings = {"--job-name": job_name, "--nodes": str(nodes), "--time": time,
                "--ntasks-per-node": str(ranks_per_node if layout == "srun" else 1)}
    extra = [("--gpus-per-node", gpus_per_node), ("--partition", partition), ("--account", account)]
    out, inserted = [], False
    for line in template_path(layout).read_text().splitlines():
        if line.startswith("#SBATCH "):
            key = line.split()[1].split("=")[0]
            if key in settings:
                line = f"#SBATCH {key}={settings[key]}"
        elif line.startswith("##SBATCH") and not inserted:
            out += [f"#SBATCH {k}={v}" for k, v in extra if v is not None]
            inserted = True
            continue
        elif line.startswith("##SBATCH"):
            continue
        out.append(line)
        if line == "set -euo pipefail":
            out.append(f"# Rendered by: python -m ddp_kit.launch slurm --layout {layout} ...")
            if nproc_per_node:
                out.append(f"export NPROC_PER_NODE=${{NPROC_PER_NODE:-{nproc_per_node}}}")
            if train_args:
                out.append(f"[ $# -gt 0 ] || set -- {shlex.join(train_args)}")
    return "\n".join(out) + "\n"


def slurm(*train_args: str, layout: str = "srun", nodes: int = 1, nproc_per_node: int | None = None,
          gpus_per_node: int | None = None, time: str = "01:00:00", partition: str | None = None,
          account: str | None = None, job_name: str = "ddp_kit", dry_run: bool = False, out_dir: str = ".ddp_kit") -> None:
    """Render slurm/<layout>.sbatch for this layout and submit it with sbatch (or print it with --dry_run)."""
    script = render(layout, [str(a) for a in train_args], nodes, nproc_per_node, gpus_per_node, time, partition,
                    account, job_name)
    if dry_run:
        print(script, end="")
        return
    path = Path(out_dir) / f"{job_name}.{layout}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    try:
        res = subprocess.run(["sbatch", str(path)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UserError("sbatch is not on PATH", f"run this on a SLURM login node; the script is in {path}") from None
    if res.returncode != 0:
        raise UserError(f"sbatch refused {path}: {res.stderr.strip()}", "fix the flags (partition, account, limits) and retry")
    print(f"{res.stdout.strip()} ({path})")
