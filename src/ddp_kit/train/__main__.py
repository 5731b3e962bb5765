"""python -m ddp_kit.train: the reference job."""
from .command import main

main()
