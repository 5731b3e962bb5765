"""`examples/ddp.py` under Ray Train: the same converted script, run by `TorchTrainer` on N workers.

Ray starts the workers and creates their process group; `ddp_kit.init` adopts it. Checkpoints are
ddp_kit's own, in run_dir (storage every worker sees). When a worker dies, Ray starts the worker
group again (`FailureConfig(max_failures=...)`) and the function resumes from run_dir's newest
checkpoint, bit-identically. Rank 0 writes the final weights' digest (param_sha256) into
run_dir/summary.json, and the driver prints it.

    pip install 'ddp_kit[ray]'
    python examples/ray/train_ray.py --run_dir /shared/runs/digits-ray            # a local Ray
    RAY_ADDRESS=head:6379 python examples/ray/train_ray.py --run_dir /shared/runs/digits-ray

`TRAIN_RAY_KILL=rank=R:step=S` (in the driver's environment) makes rank R SIGKILL itself after
optimizer step S, in a run that started from scratch only (the restarted workers resume past it):
the test's fault.
"""
import argparse
import json
import os
import signal
import sys
from pathlib import Path

import ddp_kit

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def kill_at(spec: str) -> tuple[int, int] | None:
    """`rank=R:step=S` -> (R, S)."""
    if not spec:
        return None
    fields = dict(f.split("=", 1) for f in spec.split(":"))
    return int(fields["rank"]), int(fields["step"])


def train_fn(config: dict) -> None:
    """What each Ray worker runs: examples/ddp.py's lines, with run_dir, resume and run.step."""
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    dataset = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
    # `with`: a Ray worker outlives this function, so the final checkpoint and summary.json come at
    # the block's end, not at interpreter exit.
    with ddp_kit.init(config["run_dir"], ckpt_every=config["ckpt_every"], log_every=config["log_every"]) as run:
        device = run.device
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
        train_loader = DataLoader(dataset, batch_size=64, shuffle=True, drop_last=True)
        model, train_loader = run.prepare(model, train_loader)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        start = run.resume(optimizer=optimizer)
        fault = kill_at(config["kill"]) if start == 0 else None
        for epoch in run.epochs(config["epochs"]):
            for data, target in train_loader:
                data, target = data.to(device), target.to(device)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                done = run.step(loss)
                if fault and fault == (run.rank, done):
                    os.kill(os.getpid(), signal.SIGKILL)
            run.print(f"epoch {epoch} loss {loss.item():.4f}")


def reported_log(path: Path):
    """A Ray Train callback (it runs in Ray's controller) appending what the workers reported with
    `ray.train.report` (ddp_kit's metrics records: its integrations/ray.py) to `path`, one line per
    report: rank 0's record and how many workers reported it. Where a Tune or W&B callback would go."""
    from ray.train import UserCallback

    class ReportedLog(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(path, "a") as f:
                f.write(json.dumps({"workers": len(metrics), **metrics[0]}) + "\n")

    return ReportedLog()


def main(argv: list[str] | None = None, train=train_fn) -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser(description="digits under Ray Train, with ddp_kit's checkpoints")
    parser.add_argument("--run_dir", required=True, help="on storage every worker sees (made absolute here)")
    parser.add_argument("--storage_path", default=None, help="Ray's own results (default: beside run_dir)")
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--use_gpu", action="store_true")
    parser.add_argument("--max_failures", type=int, default=3, help="worker group restarts Ray may make")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt_every", type=int, default=10)
    parser.add_argument("--log_every", type=int, default=5)
    args = parser.parse_args(argv)
    # The workers' working directory is Ray's (per node): a relative run_dir would land there.
    run_dir = Path(args.run_dir).resolve()
    storage = Path(args.storage_path).resolve() if args.storage_path else run_dir.parent
    # The workers inherit the Ray node's environment, not this one's: the fault travels in the config.
    config = {"run_dir": str(run_dir), "epochs": args.epochs, "ckpt_every": args.ckpt_every,
              "log_every": args.log_every, "kill": os.environ.get("TRAIN_RAY_KILL", "")}

    ray.init()  # RAY_ADDRESS names a running cluster; without it, a local one
    trainer = TorchTrainer(
        train, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=RunConfig(name=f"{run_dir.name}-ray", storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=args.max_failures),
                             callbacks=[reported_log(storage / f"{run_dir.name}-ray.reported.jsonl")]))
    try:
        result = trainer.fit()
    except Exception as err:  # Ray's TrainingFailedError: the workers printed ddp_kit's line above
        print(f"train_ray: training failed: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"train_ray: steps {summary['steps']} param_sha256 {summary['param_sha256']} (Ray's result: {result.path})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
