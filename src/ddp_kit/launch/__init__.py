"""`python -m ddp_kit.launch slurm|k8s|ft ... -- <train args>`: render a launch template and submit it,
or (ft) run a fault-tolerant job's lighthouse and replica groups on this machine (ft.py).

    python -m ddp_kit.launch slurm --nodes 2 --gpus_per_node 4 -- configs/cifar10_resnet18.yaml --epochs 3
    python -m ddp_kit.launch slurm --layout torchrun --nodes 2 --nproc_per_node 2 --dry_run -- --run_dir runs/x
    python -m ddp_kit.launch k8s --engine trainjob --nodes 2 --gpus_per_node 4 --image IMG --pvc ckpt \\
        --run_dir /mnt/ckpt/run --name mnist --dry_run -- configs/mnist_mlp.yaml
    python -m ddp_kit.launch ft --groups 2 --nproc_per_node 2 -- --run_dir runs/ft --max_steps 200

The rendered file is the packaged template (slurm.py: an sbatch script; k8s.py: a Kubernetes manifest) with the
flags and the training arguments embedded, so it can be read, kept and resubmitted as is. --dry_run prints it.
"""
from __future__ import annotations

import sys

from ..errors import UserError
from ..exit_codes import EXIT_USER_ERROR
from .slurm import LAYOUTS, render, slurm, template_path

__all__ = ["LAYOUTS", "render", "slurm", "template_path", "main"]


def _commands():
    from .ft import ft
    from .k8s import k8s  # imported on use: the SLURM path does not need the Kubernetes templates

    return {"slurm": ("ddp_kit.launch slurm", slurm), "k8s": ("ddp_kit.launch k8s", k8s), "ft": ("ddp_kit.launch ft", ft)}


def main() -> None:
    import fire

    argv = sys.argv[1:]
    train_args: list[str] = []
    if "--" in argv:  # everything after -- belongs to the training job, untouched by fire
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    commands = _commands()
    asks = {"--help", "-h", "help"}
    if argv and argv[0] in asks:
        print(__doc__.strip())
        sys.exit(0)
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    name, command = commands[argv[0]]
    if asks & set(argv[1:]):  # fire cannot show a wrapped command's flags: its own signature and docstring
        import inspect
        print(f"python -m ddp_kit.launch {argv[0]} [FLAGS] [-- TRAINING ARGS]\n\n{inspect.getdoc(command) or ''}\n\n"
              f"flags: " + " ".join(f"--{p.name}" + (f"={p.default!r}" if p.default is not inspect.Parameter.empty else "")
                                    for p in inspect.signature(command).parameters.values()
                                    if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD))
        sys.exit(0)
    try:
        fire.Fire(lambda **kw: command(*train_args, **kw), command=argv[1:], name=name)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
