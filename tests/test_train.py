"""The reference job end to end with real processes: 1 rank vs 2 ranks, concurrency, accumulation, the 4-line API."""
import difflib
import json
import subprocess
import sys

import pytest
import torch

from conftest import HELPERS, ROOT, ok, proc_env, read_json, run_cmd, torchrun

FAST = ["--epochs", "6"]


def _job(tmp, nproc, *flags):
    if nproc == 1:
        return ok(run_cmd([sys.executable, str(HELPERS / "job.py"), str(tmp), *flags]))
    return ok(torchrun([str(HELPERS / "job.py"), str(tmp), *flags], nproc=nproc))


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    _job(tmp_path / "one", 1, *FAST)
    _job(tmp_path / "two", 2, *FAST)
    one = read_json(tmp_path / "one" / "rank0.json")
    r0, r1 = (read_json(tmp_path / "two" / f"rank{r}.json") for r in range(2))
    assert r0["param_sha256"] == r1["param_sha256"]  # each rank hashed its own weights
    assert r0["eval_samples"] == r1["eval_samples"] == one["eval_samples"] == 360
    assert abs(r0["eval_accuracy"] - one["eval_accuracy"]) <= 0.01
    summary = read_json(tmp_path / "two" / "run" / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == one["steps"]
    lines = (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(line)["event"] == "train" for line in lines)


@pytest.mark.integration
@pytest.mark.slow
def test_grad_accum_equals_bigger_micro_batch(tmp_path):
    flags = ["--epochs", "2", "--batch_size", "64", "--lr_schedule", "constant"]
    _job(tmp_path / "a1", 2, *flags, "--grad_accum", "1")
    _job(tmp_path / "a2", 2, *flags, "--grad_accum", "2")
    p1 = torch.load(tmp_path / "a1" / "params_rank0.pt")
    p2 = torch.load(tmp_path / "a2" / "params_rank0.pt")
    moved = max((p1[k] - torch.load(tmp_path / "a1" / "params_rank1.pt")[k]).abs().max().item() for k in p1)
    assert moved == 0.0
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-4, atol=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_two_concurrent_two_rank_runs(tmp_path):
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ddp_kit.train",
             "--epochs", "3", "--progress", "false", "--run_dir", str(tmp_path / f"r{i}")] for i in range(2)]
    procs = [subprocess.Popen(c, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    for i in range(2):
        assert read_json(tmp_path / f"r{i}" / "summary.json")["eval_samples"] == 360


@pytest.mark.integration
def test_single_process_default_job_learns(tmp_path):
    res = ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--run_dir", str(tmp_path / "r"), "--progress", "false"]))
    summary = read_json(tmp_path / "r" / "summary.json")
    assert summary["eval_accuracy"] >= 0.95 and summary["world_size"] == 1
    assert (tmp_path / "r" / "config.yaml").exists() and "done:" in res.stdout


def test_four_line_api_diff():
    a = (ROOT / "examples" / "single_device.py").read_text().splitlines()
    b = (ROOT / "examples" / "ddp.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++")]
    assert len(changed) <= 4, changed
    assert any("loss.backward()" in line for line in b)


@pytest.mark.integration
@pytest.mark.slow
def test_four_line_api_runs_both_ways():
    single = ok(run_cmd([sys.executable, "examples/single_device.py"]))
    ddp = ok(torchrun(["examples/ddp.py"], nproc=2))
    for out in (single.stdout, ddp.stdout):
        last = float(out.strip().splitlines()[-1].split()[-1])
        assert last < 0.5, out
