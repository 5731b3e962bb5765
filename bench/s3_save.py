"""Loop blocking time of a checkpoint save to an S3-protocol store against torch.save of the same state
to local disk; and the upload's time to commit.

    python bench/s3_save.py [--mb 100] [--repeats 9] [--dir /tmp/ddp_kit_s3_bench] [--out bench/s3_results.json]
    python bench/s3_save.py --endpoint https://s3.example.com --bucket mine   # a store of your own

Without --endpoint it starts moto's standalone S3 server (`moto[server]`, the test extra) on loopback
and stops it (by its PID) at the end; the save goes through the same client stack a user's S3 does
(s3fs -> aiobotocore -> HTTP), configured by the standard AWS_* variables.

State: ckpt_bench.py's MLP plus its AdamW moments, about `mb` MB. Each round times, in turn, a plain
torch.save to local disk (no fsync, as most scripts do) and ddp_kit's save to the store, twice: with
async_ckpt false (the loop waits for the write into a node-local staging folder) and true (it waits
only for the copy into reused host buffers). For each, the time the loop is blocked (`save`
returning), then the time until the upload is committed (every object, the manifest and `latest`
on the store; `wait`). Rounds alternate so that machine drift
hits both; figures are medians with min..max over rounds, ratios against the plain torch.save.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import fire
import torch
from ckpt_bench import make_state

from ddp_kit.checkpoint.backend import open_backend
from ddp_kit.dist import distributed
from ddp_kit.env import DistEnv

VARIANTS = ("staged", "async")


def start_moto(log: Path) -> tuple[subprocess.Popen, str]:
    """moto's server on 127.0.0.1 and a free port, answering."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
            return p, endpoint
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit(f"moto's server did not start (log: {log})")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main(mb: float = 100, repeats: int = 9, dir: str = "/tmp/ddp_kit_s3_bench", endpoint: str | None = None,
         bucket: str | None = None, out: str | None = None):
    root = Path(dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    server = None
    if endpoint is None:
        server, endpoint = start_moto(root / "moto.log")
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_EC2_METADATA_DISABLED": "true"})
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        import boto3

        if bucket is None:
            bucket = f"ddpkit-bench-{uuid.uuid4().hex[:12]}"
            boto3.client("s3").create_bucket(Bucket=bucket)
        location = f"s3://{bucket}/bench-{uuid.uuid4().hex[:8]}"
        model, opt = make_state(mb)
        shared = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
        times: dict[str, list[float]] = {"torch_save": []}
        with distributed(DistEnv(), device="cpu") as ctx:
            # staged: the loop waits for the node-local staging write (async_ckpt false, the default);
            # async: only for the copy into host memory (async_ckpt true). Both upload in the background.
            stores = {mode: open_backend(f"{location}/{mode}", ctx, keep_last=1, async_save=(mode == "async"))
                      for mode in VARIANTS}
            for mode, store in stores.items():
                times.update({f"{mode}_blocking": [], f"{mode}_commit": []})
                store.save(0, shared, {"rng": torch.get_rng_state()}, {})  # warm-up: connections, host buffers
                store.wait()
            for i in range(1, repeats + 1):
                t = time.perf_counter()
                torch.save(shared, root / "plain.pt")
                times["torch_save"].append(time.perf_counter() - t)
                for mode, store in stores.items():
                    t = time.perf_counter()
                    store.save(i, shared, {"rng": torch.get_rng_state()}, {})
                    times[f"{mode}_blocking"].append(time.perf_counter() - t)
                    store.wait()
                    times[f"{mode}_commit"].append(time.perf_counter() - t)
            for store in stores.values():
                store.close()
        stats = {k: spread(v) for k, v in times.items()}
        base = statistics.median(times["torch_save"])
        ratios = {k: round(v["median"] / base, 3) for k, v in stats.items()}
        for mode in VARIANTS:  # per round: the save against the torch.save just before it
            ratios[f"{mode}_blocking_per_round"] = spread([b / s for b, s in zip(times[f"{mode}_blocking"], times["torch_save"])])
        report = {"state_mb": round(size_mb, 1), "repeats": repeats, "server": "moto (loopback)" if server else endpoint,
                  "seconds": stats, "ratio_to_torch_save": ratios, "versions": {"torch": torch.__version__, **_versions()}}
        print(json.dumps(report, indent=2))
        if out:
            Path(out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)  # the process we started, by its PID
            server.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("s3fs", "botocore", "moto"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    fire.Fire(main)
