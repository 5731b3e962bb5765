"""Checkpoints with real processes: exact resume after kills, corrupt and partial checkpoints, elastic world size."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REFERENCE_2_EPOCHS, ROOT, ok, proc_env, read_json, run_cmd, torchrun

# 2 epochs of 22 steps: a checkpoint every 5 steps puts resumes mid-epoch. The shared reference job's
# flags (conftest), so that its uninterrupted runs are the ones test_preempt compares against too.
BASE = [*REFERENCE_2_EPOCHS]


def train_args(run_dir, *extra):
    return ["-m", "ddp_kit.train", *BASE, "--run_dir", str(run_dir), *extra]


def job(run_dir, nproc, *extra, restarts=0, expect_ok=True):
    if nproc == 1:
        res = run_cmd([sys.executable, *train_args(run_dir, *extra)])
    else:
        res = torchrun(train_args(run_dir, *extra), nproc=nproc, extra=[f"--max-restarts={restarts}"])
    return ok(res) if expect_ok else res


@pytest.fixture(scope="module")
def reference(reference_summary):
    """Uninterrupted runs at world sizes 1, 2 and 4: the param_sha256 every recovery must reproduce.
    `reference[n]` is the session's shared run of BASE on n ranks (conftest.reference_summary), run
    when a test first asks for that world size."""

    class Runs(dict):
        def __missing__(self, nproc):
            self[nproc] = reference_summary(nproc, BASE)
            return self[nproc]

    return Runs()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """`crashed(into, *extra)`: the run folder a 1-rank job of BASE + extra left when killed by its
    --inject, copied into `into`. Each such job runs once per module; the tests that start from the
    same crash (then damage or resume it each their own way) get their own copy of it."""
    made = {}

    def get(into, *extra):
        if extra not in made:
            d = tmp_path_factory.mktemp("crashed") / "run"
            job(d, 1, *extra, expect_ok=False)
            made[extra] = d
        shutil.copytree(made[extra], into, dirs_exist_ok=True)
        return into

    return get


@pytest.mark.integration
@pytest.mark.parametrize("nproc", [1, 2, 4])  # 4: the ring all-reduce's sum order depends on DDP's bucket layout
def test_kill_whole_job_then_rerun_is_bit_identical(tmp_path, reference, nproc):
    res = job(tmp_path, nproc, "--inject", "kill:rank=0:step=13", expect_ok=False)
    assert res.returncode != 0
    assert (tmp_path / "checkpoints" / "step_10").is_dir() and not (tmp_path / "summary.json").exists()
    res = job(tmp_path, nproc)
    assert "resumed from" in res.stdout and "step 10" in res.stdout
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 10
    assert summary["param_sha256"] == reference[nproc]["param_sha256"]


@pytest.mark.integration
def test_kill_one_worker_torchrun_restarts_and_matches(tmp_path, reference):
    res = job(tmp_path, 2, "--inject", "kill:rank=1:step=13", restarts=1)
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 10, res.stdout
    assert summary["param_sha256"] == reference[2]["param_sha256"]


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_newest_falls_back(tmp_path, reference, crashed, damage):
    crashed(tmp_path, "--inject", "kill:rank=0:step=21")
    newest = tmp_path / "checkpoints" / "step_20" / "model.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    else:
        newest.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    res = job(tmp_path, 1)
    warnings = [line for line in (res.stdout + res.stderr).splitlines() if "step_20 is not usable" in line]
    assert len(warnings) == 1, res.stdout
    assert "resumed from" in res.stdout and "step 15" in res.stdout
    assert read_json(tmp_path / "summary.json")["param_sha256"] == reference[1]["param_sha256"]


@pytest.mark.integration
def test_kill_during_save_never_picks_partial(tmp_path, reference):
    """Saving is slowed so that a SIGKILL lands inside a save; the half-written folder is ignored."""
    cmd = [sys.executable, *train_args(tmp_path, "--debug_ckpt_delay_s", "1.5")]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    deadline = time.time() + 60
    ckpts = tmp_path / "checkpoints"
    try:
        while time.time() < deadline:  # wait for the second save to be in flight
            if (ckpts / "step_5").is_dir() and (ckpts / ".tmp_step_10").is_dir():
                break
            time.sleep(0.05)
        else:
            pytest.fail("never saw the save of step 10 in flight")
        time.sleep(0.3)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert not (ckpts / "step_10").exists()
    res = job(tmp_path, 1)
    assert "step 5" in res.stdout and "resumed from" in res.stdout
    assert read_json(tmp_path / "summary.json")["param_sha256"] == reference[1]["param_sha256"]


@pytest.mark.integration
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_change_world_size(tmp_path, reference, before, after):
    job(tmp_path, before, "--inject", "kill:rank=0:step=16", expect_ok=False)
    res = job(tmp_path, after)
    assert f"written by {before} rank(s), resumed on {after}" in res.stdout
    summary = read_json(tmp_path / "summary.json")
    assert summary["steps"] == reference[after]["steps"] and summary["world_size"] == after
    assert summary["eval_samples"] == 360
    assert abs(summary["eval_accuracy"] - reference[after]["eval_accuracy"]) <= 0.02


@pytest.mark.integration
def test_async_save_same_result_and_retention(tmp_path, reference):
    job(tmp_path, 2, "--async_ckpt", "true", "--keep_last", "2")
    summary = read_json(tmp_path / "summary.json")
    assert summary["param_sha256"] == reference[2]["param_sha256"]
    steps = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert steps == [40, 44]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_44"


@pytest.mark.integration
def test_resume_never_and_explicit_path(tmp_path, reference):
    job(tmp_path, 1, "--inject", "kill:rank=0:step=11", expect_ok=False)
    res = job(tmp_path, 1, "--resume", str(tmp_path / "checkpoints" / "step_5"))
    assert "resumed from" in res.stdout and "step 5" in res.stdout
    res = job(tmp_path, 1, "--resume", "never")
    assert "resumed" not in res.stdout
    assert read_json(tmp_path / "summary.json")["param_sha256"] == reference[1]["param_sha256"]
    bad = run_cmd([sys.executable, *train_args(tmp_path, "--resume", str(tmp_path / "nope"))])
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    half = tmp_path / "checkpoints" / "half"
    half.mkdir()
    bad = run_cmd([sys.executable, *train_args(tmp_path, "--resume", str(half))])
    assert bad.returncode == 2 and "cannot be resumed: no manifest" in bad.stderr and "Traceback" not in bad.stderr


# A constant LR: a resume that changes max_steps then computes exactly what an uninterrupted run does.
CONST = ("--keep_last", "0", "--lr_schedule", "constant")


@pytest.fixture(scope="module")
def constant_lr_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("const")
    job(d, 1, *CONST)
    return read_json(d / "summary.json")


@pytest.mark.integration
@pytest.mark.parametrize("restart", ["never", "older"])
def test_auto_resume_follows_latest_not_the_highest_step(tmp_path, constant_lr_reference, crashed, restart):
    """A run abandoned at step 20 (by --resume never, or by resuming from its step 5) must not be
    picked up again by the next crash's auto-resume: `latest` wins, higher steps are archived."""
    const = CONST
    run = tmp_path / "run"
    crashed(run, *const, "--inject", "kill:rank=0:step=21")  # leaves step_5 .. step_20
    if restart == "never":  # a fresh start that crashes at step 13
        job(run, 1, *const, "--resume", "never", "--inject", "kill:rank=0:step=13", expect_ok=False)
        own = 10
    else:  # a resume from step_10 that stops at step 17 (faults do not fire in a resumed run)
        job(run, 1, *const, "--resume", str(run / "checkpoints" / "step_10"), "--max_steps", "17")
        own = 17
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{own}"
    assert not (ckpts / "step_20").exists() and list((run / "archive").glob("*/step_20")), \
        sorted(p.name for p in ckpts.iterdir())
    res = job(run, 1, *const)  # auto: continues the restarted run, not the abandoned step 20
    assert f"checkpoints/step_{own} " in res.stdout, res.stdout
    assert read_json(run / "summary.json")["param_sha256"] == constant_lr_reference["param_sha256"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "train"]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats steps after a resume: {steps}"


@pytest.mark.integration
def test_checkpoint_cli_list_and_export(tmp_path):
    ok(run_cmd([sys.executable, *train_args(tmp_path, "--max_steps", "10")]))
    (tmp_path / "checkpoints" / "step_10" / "rank0.pt").write_bytes(b"junk")
    res = ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "list", str(tmp_path)]))
    lines = res.stdout.splitlines()
    assert "INVALID" in lines[1] and "step_10" in lines[1] and "valid" in lines[2] and "step_5" in lines[2]
    out = tmp_path / "weights.pt"
    ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "export", str(tmp_path), "--out", str(out)]))
    import torch

    state = torch.load(out, weights_only=True)
    assert set(state) == {"1.weight", "1.bias", "3.weight", "3.bias"}


# ---- in-process: the host side of a save (no launcher, world size 1) ----------------------------------

def _alone():
    import torch

    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(DistEnv(), torch.device("cpu"), "gloo")


def test_nonfinite_check_before_a_save_reads_once_however_many_tensors(monkeypatch):
    """Every read of a tensor's value by the host (on a GPU, a sync) is counted: one for the whole
    state, also when it names the bad tensors."""
    import torch

    from ddp_kit.checkpoint.checkpointer import nonfinite_tensors

    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=getattr(torch.Tensor, name), _n=name:  # noqa: B008 (bound now, per name)
                            (reads.append(_n), _f(self, *a))[1])
    state = {f"layer{i}.weight": torch.randn(4, 4) for i in range(50)}
    state.update({"steps": torch.tensor(3), "empty": torch.empty(0), "note": "not a tensor"})
    assert nonfinite_tensors(state) == [] and len(reads) == 1
    state["layer7.weight"][1, 2] = float("nan")
    state["layer30.weight"][0, 0] = float("-inf")
    reads.clear()
    assert nonfinite_tensors(state) == ["layer7.weight", "layer30.weight"] and len(reads) == 1


class _FakeHostBuffer:
    """Stands in for staging.HostBuffer, which registers page-locked memory with CUDA (GPU-only)."""
    nbytes = 1 << 20
    released = False

    def release(self):
        self.released = True


def test_close_frees_the_host_buffers_an_async_save_keeps(tmp_path):
    import torch

    from ddp_kit.checkpoint.checkpointer import Checkpointer

    ck = Checkpointer(_alone(), tmp_path, async_save=True)
    hosts = {kind: _FakeHostBuffer() for kind in ("model", "state", "rank")}
    ck._hosts.update(hosts)  # as a GPU save leaves them, for the next save to copy into
    ck.save(1, {"model": {"w": torch.ones(3)}, "loop": {"step": 1}}, {"rng": torch.get_rng_state()}, {})
    assert ck._hosts == hosts and ck._buffers  # kept between saves
    ck.close()
    assert all(h.released for h in hosts.values()) and not ck._hosts and ck._buffers is None
    assert (tmp_path / "step_1" / "manifest.json").exists()  # waited for the commit first


def test_run_close_frees_the_checkpointers_host_buffers(tmp_path):
    import torch

    import ddp_kit
    from ddp_kit.env import DistEnv

    run = ddp_kit.init(run_dir=str(tmp_path), env=DistEnv(), device="cpu", resume="never", async_ckpt=True,
                       log_every=0, sync_check_every=0, ckpt_every=0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.resume(model=model, optimizer=opt)
    host = _FakeHostBuffer()
    run._boundary.checkpointer()._hosts["rank"] = host
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    run.step()
    run.close()  # the final checkpoint, then the teardown
    assert host.released and (tmp_path / "checkpoints" / "step_1" / "manifest.json").exists()


def test_stager_probe_keeps_todays_path_where_copies_are_not_kept():
    """torch 2.11's DefaultStager drops its copies after each save: reusing it would copy into fresh
    memory (page-locked anew on a GPU) every time, so DCP's own staging stays."""
    import torch

    from ddp_kit.checkpoint.checkpointer import _stager_reuses

    class Forgetful:  # as torch 2.11's: a fresh copy at every stage()
        def __init__(self, options):
            pass

        def stage(self, state):
            return {k: v.clone() for k, v in state.items()}

        def close(self):
            pass

    assert _stager_reuses(Forgetful, lambda **_: None) is False
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.torch_version import TorchVersion
    if TorchVersion(torch.__version__) >= "2.14":
        assert _stager_reuses(DefaultStager, StagingOptions)


def _staged_pointers(monkeypatch):
    from torch.distributed.checkpoint.staging import DefaultStager

    seen = []
    stage = DefaultStager.stage

    def spy(self, state, **kw):
        out = stage(self, state, **kw)
        if "model" in out:  # not the probe's
            seen.append((id(self), out["model"]["w"].data_ptr(), out["model"]["w"].is_pinned()))
        return out

    monkeypatch.setattr(DefaultStager, "stage", spy)
    return seen


def _sharded_saves(tmp_path, ctx, w):
    from ddp_kit.checkpoint.checkpointer import Checkpointer, Found

    ck = Checkpointer(ctx, tmp_path, async_save=True)
    for step in (1, 2):
        w.fill_(step)
        ck.save(step, {}, {"step": step}, {}, sharded={"model": {"w": w}})
    stager = ck._stager
    ck.close()
    for step in (1, 2):  # the second save refilled the copy only once the first was on disk
        template = {"model": {"w": w.new_zeros(w.shape)}}
        ck.load_sharded(Found(tmp_path / f"step_{step}", step), template)
        assert bool((template["model"]["w"] == step).all())
    return ck, stager


def test_async_sharded_saves_copy_into_one_kept_stager(tmp_path, one_rank_group, monkeypatch):
    import torch

    from ddp_kit.checkpoint.checkpointer import reusable_stager

    if reusable_stager(torch.device("cpu")) is None:
        pytest.skip(f"torch {torch.__version__}'s stager keeps no copies: DCP stages as before")
    seen = _staged_pointers(monkeypatch)
    ck, stager = _sharded_saves(tmp_path, _alone(), torch.zeros(1000))
    assert len(seen) == 2 and seen[0][:2] == seen[1][:2]  # one stager, the same host copy both times
    assert stager is not None and ck._stager is None  # closed with the checkpointer


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_async_sharded_saves_stage_into_kept_page_locked_copies_on_gpu(tmp_path, one_rank_group, monkeypatch):
    import torch

    from ddp_kit.checkpoint.checkpointer import reusable_stager
    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    if reusable_stager(torch.device("cuda")) is None:
        pytest.skip(f"torch {torch.__version__}'s stager keeps no copies: DCP stages as before")
    seen = _staged_pointers(monkeypatch)
    ctx = DistContext(DistEnv(), torch.device("cuda", 0), "gloo")
    _sharded_saves(tmp_path, ctx, torch.zeros(1 << 20, device="cuda"))
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][2]  # same page-locked copy both times
