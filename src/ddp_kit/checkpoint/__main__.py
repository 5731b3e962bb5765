"""python -m ddp_kit.checkpoint list|export ..."""
from .cli import main

main()
