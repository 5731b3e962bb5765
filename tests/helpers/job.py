"""Run the reference job through the library API and write what each rank ended with.

    python job.py OUT_DIR [--key value ...]     (plain, or under torchrun)

Writes OUT_DIR/rank<R>.json (the summary as this rank sees it) and OUT_DIR/params_rank<R>.pt.
"""
import json
from pathlib import Path

import fire
import torch

from ddp_kit.env import detect
from ddp_kit.train import command as train_mod
from ddp_kit.train.config import resolve


def main(out_dir: str, **flags):
    env = detect()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flags.setdefault("run_dir", str(out / "run"))
    flags.setdefault("progress", False)
    cfg = resolve(None, flags)
    captured = {}
    orig_train = train_mod.train

    def train(job):
        result = orig_train(job)
        captured["params"] = {k: v.detach().cpu().clone() for k, v in job.run.unwrap(job.model).state_dict().items()}
        return result

    train_mod.train = train
    summary = train_mod.run(cfg, env)
    (out / f"rank{env.rank}.json").write_text(json.dumps(summary))
    torch.save(captured["params"], out / f"params_rank{env.rank}.pt")


if __name__ == "__main__":
    fire.Fire(main)
