"""The reference job end to end with real processes: 1 rank vs 2 ranks, concurrency, accumulation, the 4-line API."""
import difflib
import json
import subprocess
import sys

import pytest
import torch

from conftest import HELPERS, ROOT, ok, proc_env, read_json, run_cmd, torchrun

# 2 epochs of the default global batch (64) at a constant LR: the job both tests below compare, shared
# through `runs` so that the 2-rank run with no accumulation is launched once for both of them.
FLAGS = ["--epochs", "2", "--batch_size", "64", "--lr_schedule", "constant"]


def _job(tmp, nproc, *flags):
    if nproc == 1:
        return ok(run_cmd([sys.executable, str(HELPERS / "job.py"), str(tmp), *flags]))
    return ok(torchrun([str(HELPERS / "job.py"), str(tmp), *flags], nproc=nproc))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`runs[name]`: the folder of one job.py run of FLAGS, launched when a test first asks for it:
    "one" on 1 rank, "a1" on 2 ranks, "a2" on 2 ranks with 2 micro-steps per step."""
    d = tmp_path_factory.mktemp("train")
    how = {"one": (1, ()), "a1": (2, ("--grad_accum", "1")), "a2": (2, ("--grad_accum", "2"))}

    class Runs(dict):
        def __missing__(self, name):
            nproc, extra = how[name]
            _job(d / name, nproc, *FLAGS, *extra)
            self[name] = d / name
            return self[name]

    return Runs()


@pytest.mark.integration
def test_two_ranks_match_one_rank(runs):
    one = read_json(runs["one"] / "rank0.json")
    two = runs["a1"]
    r0, r1 = (read_json(two / f"rank{r}.json") for r in range(2))
    assert r0["param_sha256"] == r1["param_sha256"]  # each rank hashed its own weights
    assert r0["eval_samples"] == r1["eval_samples"] == one["eval_samples"] == 360
    assert abs(r0["eval_accuracy"] - one["eval_accuracy"]) <= 0.01
    summary = read_json(two / "run" / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == one["steps"]
    lines = (two / "run" / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(line)["event"] == "train" for line in lines)


@pytest.mark.integration
def test_grad_accum_equals_bigger_micro_batch(runs):
    a1, a2 = runs["a1"], runs["a2"]
    p1 = torch.load(a1 / "params_rank0.pt")
    p2 = torch.load(a2 / "params_rank0.pt")
    moved = max((p1[k] - torch.load(a1 / "params_rank1.pt")[k]).abs().max().item() for k in p1)
    assert moved == 0.0
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-4, atol=1e-5)


@pytest.mark.integration
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
    # One recipe hash per run: the summary, every metrics record and the last checkpoint's meta agree.
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    hashes = {r["config_hash"] for r in records if "config_hash" in r}
    latest = (tmp_path / "r" / "checkpoints" / "latest").read_text().strip()
    hashes.add(read_json(tmp_path / "r" / "checkpoints" / latest / "meta.json")["config_hash"])
    assert hashes == {summary["config_hash"]}, hashes


def test_four_line_api_diff():
    a = (ROOT / "examples" / "single_device.py").read_text().splitlines()
    b = (ROOT / "examples" / "ddp.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++")]
    assert len(changed) <= 4, changed
    assert any("loss.backward()" in line for line in b)


@pytest.mark.integration
def test_four_line_api_runs_both_ways():
    single = ok(run_cmd([sys.executable, "examples/single_device.py"]))
    ddp = ok(torchrun(["examples/ddp.py"], nproc=2))
    for out in (single.stdout, ddp.stdout):
        last = float(out.strip().splitlines()[-1].split()[-1])
        assert last < 0.5, out
