"""Run an unchanged training script with a fault injected from outside, as a test harness would.

    python tests/helpers/inject.py SPEC[,SPEC...] script.py [script args...]     (also under torchrun)

SPEC, acting after the N-th optimizer step of this process (a global optimizer step hook):
    kill:rank=R:step=N       SIGKILL this rank (first torchrun attempt only: the restart recovers)
    raise:rank=R:step=N      raise RuntimeError on this rank
    stall:rank=R:step=N      sleep for an hour on this rank (in this file: "own code", not torch)
    slow:ms=M                sleep M ms after every optimizer step on every rank (a slower run to signal)
    init:KEY=VALUE           pass KEY=VALUE to ddp_kit.init (e.g. init:hang_timeout_s=8)
"""
import os
import runpy
import signal
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook


def parse(spec: str) -> list[tuple[str, dict[str, str]]]:
    out = []
    for part in spec.split(","):
        kind, *fields = part.split(":")
        out.append((kind, dict(f.split("=", 1) for f in fields)))
    return out


def main() -> None:
    faults = parse(sys.argv[1])
    script, args = sys.argv[2], sys.argv[3:]
    rank = int(os.environ.get("RANK", "0"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    steps = [0]

    def after_step(optimizer, a, kw):
        steps[0] += 1
        for kind, f in faults:
            if kind == "slow":
                time.sleep(float(f["ms"]) / 1000)
            if "step" not in f or int(f["step"]) != steps[0] or int(f.get("rank", rank)) != rank:
                continue
            if kind == "kill" and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "raise":
                raise RuntimeError(f"injected failure on rank {rank} after step {steps[0]}")
            elif kind == "stall":
                time.sleep(3600)

    register_optimizer_step_post_hook(after_step)
    options = {k: float(v) if "." in v or v.isdigit() else v for kind, f in faults if kind == "init" for k, v in f.items()}
    if options:
        import ddp_kit.api

        real_init = ddp_kit.api.init
        ddp_kit.api.init = lambda *a, **kw: real_init(*a, **{**options, **kw})
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
