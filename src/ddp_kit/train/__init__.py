"""The reference job, `python -m ddp_kit.train`: a client of the public API (ddp_kit.init, Run).

Importing the package loads nothing else (in particular no torch): `ddp_kit.train.config` can be
imported on its own (its unit tests do) without starting the job's imports."""


def main() -> None:
    from .command import main as command

    command()


__all__ = ["main"]
