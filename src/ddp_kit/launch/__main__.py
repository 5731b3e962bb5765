"""python -m ddp_kit.launch slurm|k8s ..."""
from . import main

main()
