"""ddp_kit's reference job on the same work as raw_ddp.py, with a timestamp taken at each step end.

Run under torchrun. Extra flags go to the job's config (e.g. --sync_check_every 0).
"""
import json
import os
import resource
import time

import fire

from ddp_kit.train import loop
from ddp_kit.train.command import run
from ddp_kit.train.config import resolve


def main(out: str, steps: int = 300, batch_size: int = 128, lr: float = 3e-3, seed: int = 0, size: int = 4096, **flags):
    ends: list[float] = []
    faults: list[int] = []
    stimes: list[float] = []
    utimes: list[float] = []
    first = {}
    step_fn = loop.train_step

    def timed(job, micro):
        loss = step_fn(job, micro)
        ends.append(time.perf_counter())
        ru = resource.getrusage(resource.RUSAGE_SELF)  # ~1 us; page faults and CPU time per step
        faults.append(ru.ru_minflt)
        stimes.append(ru.ru_stime)
        utimes.append(ru.ru_utime)
        if len(ends) == 1:
            first["wall"] = time.time()
        return loss

    loop.train_step = timed
    cfg = resolve(None, {"model": "mlp", "dataset": "synthetic", "synthetic_size": size, "batch_size": batch_size,
                         "lr": lr, "seed": seed, "max_steps": steps, "epochs": 10_000, "progress": False,
                         "eval_every_epoch": False, "ckpt_every": 0, "resume": "never",
                         "run_dir": os.path.join(os.path.dirname(out), "kit_run"), **flags})
    summary = run(cfg)
    if summary["world_size"] and int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"ends": ends, "first_step_after_launch_s": first["wall"] - float(os.environ["BENCH_LAUNCH_T"]),
                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                       "param_sha256": summary["param_sha256"], "minflt": faults, "stime": stimes, "utime": utimes}, f)


if __name__ == "__main__":
    fire.Fire(main)
