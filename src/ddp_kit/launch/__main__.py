"""python -m ddp_kit.launch slurm ..."""
from . import main

main()
