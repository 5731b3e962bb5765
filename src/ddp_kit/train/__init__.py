"""The reference job, `python -m ddp_kit.train`: a client of the public API (ddp_kit.init, Run).

Importing the package loads nothing else, so that its config (config.py, no torch) can refuse a bad
config before torch is loaded."""


def main() -> None:
    from .command import main as command

    command()


__all__ = ["main"]
