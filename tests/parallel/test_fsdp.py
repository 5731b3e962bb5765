"""The FSDP2 strategy with real processes (torchrun, gloo, CPU): the same job as DDP, sharded state,
sharded (DCP) checkpoints that survive a SIGKILL, resume on another world size and export whole.

Tolerance of the loss comparison with DDP: 1e-5 relative. DDP all-reduces the gradients and FSDP
reduce-scatters them; with gloo the sums may be taken in another order, which moves float32
results in the last bits, and 30 steps of AdamW do not grow that past 1e-5 on this model.
"""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import HELPERS, ROOT, ok, proc_env, read_json, run_cmd, torchrun
from procs import wait_step

# 2 epochs of 22 steps (digits, global batch 64); a checkpoint every 5 steps puts resumes mid-epoch.
BASE = ["-m", "ddp_kit.train", "--epochs", "2", "--ckpt_every", "5", "--progress", "false", "--log_every", "5",
        "--sync_check_every", "5"]


def train(run_dir, nproc, *extra, restarts=0, expect_ok=True):
    args = [*BASE, "--run_dir", str(run_dir), *extra]
    res = (run_cmd([sys.executable, *args]) if nproc == 1
           else torchrun(args, nproc=nproc, timeout=240, extra=[f"--max-restarts={restarts}"]))
    return ok(res) if expect_ok else res


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


def state_bytes(record):
    """Per rank: parameter + gradient + optimizer bytes, from a metrics record."""
    return [x["param_bytes"] + x["grad_bytes"] + x["optim_bytes"] for x in record["ranks"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted runs, the same seed and global batch: ddp and fsdp at 2 ranks, fsdp at 4 (with 2
    micro-steps per step)."""
    d = tmp_path_factory.mktemp("fsdp")
    train(d / "ddp2", 2)
    train(d / "fsdp2", 2, "--strategy", "fsdp")
    train(d / "fsdp4", 4, "--strategy", "fsdp", "--grad_accum", "2")  # micro-steps without reduce or reshard
    return d


@pytest.mark.integration
def test_fsdp_loss_matches_ddp_and_each_rank_holds_half_the_state(runs):
    ddp, fsdp = records(runs / "ddp2"), records(runs / "fsdp2")
    assert [r["step"] for r in ddp] == [r["step"] for r in fsdp] and len(ddp) >= 8
    for a, b in zip(ddp, fsdp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    ratios = [f / d for f, d in zip(state_bytes(fsdp[-1]), state_bytes(ddp[-1]))]
    print(f"per-rank state bytes, fsdp/ddp at 2 ranks: {ratios}")
    assert all(0.45 <= r <= 0.55 for r in ratios), ratios
    summary = read_json(runs / "fsdp2" / "summary.json")
    assert summary["strategy"] == "fsdp"
    assert summary["eval_loss"] == pytest.approx(read_json(runs / "ddp2" / "summary.json")["eval_loss"], rel=1e-5)


@pytest.mark.integration
def test_fsdp_at_4_ranks_holds_a_quarter_and_matches_2_ranks(runs):
    four, two = records(runs / "fsdp4"), records(runs / "fsdp2")
    assert [r["step"] for r in four] == [r["step"] for r in two]
    for a, b in zip(two, four):  # the same global batch: the same recipe on any world size
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    full = sum(state_bytes(records(runs / "ddp2")[-1])) / 2
    ratios = [b / full for b in state_bytes(four[-1])]
    print(f"per-rank state bytes, fsdp at 4 ranks / ddp: {ratios}")
    assert all(0.22 <= r <= 0.30 for r in ratios), ratios  # 1/4, plus padding of the small biases


@pytest.mark.integration
def test_fsdp_sigkill_under_max_restarts_resumes_to_the_same_weights(tmp_path, runs):
    """Async sharded saves, rank 1 SIGKILLed at step 13: torchrun restarts both ranks, they resume
    from the latest committed DCP checkpoint and end with the uninterrupted run's weights, bit for bit."""
    res = train(tmp_path, 2, "--strategy", "fsdp", "--async_ckpt", "true", "--inject", "kill:rank=1:step=13",
                restarts=1)
    summary = read_json(tmp_path / "summary.json")
    # Step 10's async save is normally committed by step 13; on a slow disk it may not be, and then
    # step 5 is the latest good one. Either way the weights must end bit-identical.
    assert summary["resumed_from_step"] in (5, 10), res.stdout
    assert summary["param_sha256"] == read_json(runs / "fsdp2" / "summary.json")["param_sha256"]
    step = tmp_path / "checkpoints" / "step_40"
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= set(manifest)
    assert not (step / "model.pt").exists()  # the weights live in the shards only


@pytest.mark.integration
def test_fsdp_preemption_of_one_process_checkpoints_shards_that_2_ranks_resume(tmp_path, runs):
    """`python -m ddp_kit.train --strategy fsdp` (one process, a mesh of one) gets SIGTERM (by PID)
    mid-epoch: it finishes its step, writes a sharded (DCP) checkpoint and exits 75. 2 ranks resume
    it, keep the data position and end as the uninterrupted 2-rank run does (the same global batch:
    the same recipe, so the losses agree within the tolerance above)."""
    p = subprocess.Popen([sys.executable, *BASE, "--run_dir", str(tmp_path), "--strategy", "fsdp", "--ckpt_every",
                          "100", "--inject", "slow:rank=0:step=1:ms=200"], cwd=ROOT, env=proc_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_step(tmp_path, 8, p)
        os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 75 and "preempted by SIGTERM" in err, err[-2000:]
    saved = sorted(int(d.name[5:]) for d in (tmp_path / "checkpoints").glob("step_*"))
    assert saved and 8 <= saved[-1] < 44, saved  # mid-run: the last step is 44 (2 epochs of 22)
    assert (tmp_path / "checkpoints" / f"step_{saved[-1]}" / "dcp" / "__0_0.distcp").exists()
    res = train(tmp_path, 2, "--strategy", "fsdp")
    assert "written by 1 rank(s), resumed on 2" in res.stdout, res.stdout[-2000:]
    summary, ref = read_json(tmp_path / "summary.json"), read_json(runs / "fsdp2" / "summary.json")
    assert summary["resumed_from_step"] == saved[-1] and summary["steps"] == ref["steps"]
    assert summary["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


@pytest.mark.integration
def test_fsdp_hang_is_diagnosed_by_the_watchdog(tmp_path):
    """Rank 1 stops at step 7; rank 0 waits in FSDP's next all-gather. The watchdog names rank 1 and
    where it was, and every process exits non-zero."""
    res = torchrun([*BASE, "--run_dir", str(tmp_path), "--strategy", "fsdp", "--inject", "hang:rank=1:step=7",
                    "--hang_timeout_s", "8", "--collective_timeout_s", "60"], timeout=150)
    lines = [line for line in res.stderr.splitlines() if line.startswith(("ddp_kit:", "  rank"))]
    assert res.returncode != 0, res.stderr[-2000:]
    assert any("hang: no progress" in line and "Lagging: rank 1" in line for line in lines), lines
    assert any(line.strip().startswith("rank 1") and "after step" in line for line in lines), lines


@pytest.mark.integration
def test_fsdp_with_torch_compile_follows_the_eager_loss(tmp_path, runs):
    """--compile true under FSDP (the model is compiled after fully_shard): the same losses as eager
    FSDP within 1e-5 relative, which a wrong wrap order or a graph break that skipped a collective
    would not give."""
    train(tmp_path, 2, "--strategy", "fsdp", "--compile", "true")
    eager, compiled = records(runs / "fsdp2"), records(tmp_path)
    assert [r["step"] for r in eager] == [r["step"] for r in compiled]
    for a, b in zip(eager, compiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])


@pytest.mark.integration
def test_a_4_rank_checkpoint_resumes_on_2_ranks_past_a_damaged_shard(tmp_path, runs):
    """4 ranks die at step 17; step_15's rank-3 shard is then damaged: 2 ranks fall back to step_10,
    reshard its weights and optimizer state, keep the data position, and end as the 2-rank run does."""
    res = train(tmp_path, 4, "--strategy", "fsdp", "--inject", "kill:rank=0:step=17", expect_ok=False)
    assert res.returncode != 0 and (tmp_path / "checkpoints" / "step_15").is_dir()
    shard = tmp_path / "checkpoints" / "step_15" / "dcp" / "__3_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = train(tmp_path, 2, "--strategy", "fsdp")
    assert "step_15 is not usable" in res.stdout + res.stderr
    assert "written by 4 rank(s), resumed on 2" in res.stdout
    summary, ref = read_json(tmp_path / "summary.json"), read_json(runs / "fsdp2" / "summary.json")
    assert summary["resumed_from_step"] == 10 and summary["steps"] == ref["steps"]
    assert summary["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


@pytest.mark.integration
def test_export_of_a_sharded_checkpoint_loads_into_a_plain_model(tmp_path, runs):
    """One process, no process group: the consolidated file is the 4-rank run's final weights."""
    out = tmp_path / "model.pt"
    ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "export", str(runs / "fsdp4"), "--out", str(out)]))
    from ddp_kit.models import REGISTRY
    from ddp_kit.reliability.sync_checks import param_sha256

    model = REGISTRY["mlp"]((1, 8, 8), 10)
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, every shape
    assert param_sha256(model) == read_json(runs / "fsdp4" / "summary.json")["param_sha256"]


@pytest.mark.integration
def test_a_sharded_checkpoint_is_not_resumed_as_ddp(tmp_path, runs):
    res = run_cmd([sys.executable, *BASE, "--run_dir", str(runs / "fsdp2"), "--epochs", "3"])
    assert res.returncode == 2 and "strategy fsdp -> ddp" in res.stderr, res.stderr


@pytest.mark.integration
def test_eval_loader_made_before_fsdp_prepare_is_refused(tmp_path):
    """Its batches were split for DDP (17 and 16 samples: 5 and 4 batches), which would leave rank 0
    waiting in an all-gather; the right order's even counts are test_even_eval_batches' subject."""
    res = torchrun([str(HELPERS / "fsdp_eval_order.py"), str(tmp_path)], timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: error:")]
    assert res.returncode != 0 and len(errors) == 1 and "run.eval_loader was called before" in errors[0], res.stderr


@pytest.mark.integration
def test_sync_check_under_fsdp_compares_buffers_and_optimizer_step(tmp_path):
    ok(torchrun([str(HELPERS / "fsdp_sync.py"), str(tmp_path)], nproc=2))
    for rank in (0, 1):
        seen = read_json(tmp_path / f"rank{rank}.json")
        assert seen["clean"] == "same" and seen["own_shard_changed"] == "same"  # a shard has one owner
        assert "rank 1: scale" in seen["buffer_changed"]
        assert "rank 1: optimizer.step" in seen["optimizer_step_changed"]
        assert seen["accumulated_grads_reduced"]  # the bare last micro-step reduce-scattered
    # the gathered state_dict is the plain model's, whole, loadable without ddp_kit or DTensor
    full, before = (torch.load(tmp_path / f, weights_only=True) for f in ("full.pt", "before.pt"))
    assert list(full) == list(before) and all(torch.equal(full[k], before[k]) for k in before), (full, before)


@pytest.mark.integration
@pytest.mark.parametrize("flags,said", [
    (["--sync_bn", "true"], "--sync_bn True is a DDP option"),
    (["--amp", "fp16"], "--amp fp16 does not combine with --strategy fsdp"),
    (["--static_graph", "true"], "--static_graph True is a DDP option"),
])
def test_what_does_not_combine_with_fsdp_is_one_line(tmp_path, flags, said):
    res = run_cmd([sys.executable, "-m", "ddp_kit.train", "--strategy", "fsdp", *flags, "--run_dir", str(tmp_path),
                   "--dry_run"])
    assert res.returncode == 2 and said in res.stderr
    assert len([line for line in res.stderr.splitlines() if "error" in line]) == 1, res.stderr


def test_library_refuses_sync_bn_and_ddp_options_with_fsdp():
    from ddp_kit.errors import UserError
    from ddp_kit.parallel.fsdp import check_strategy

    with pytest.raises(UserError, match="sync_bn does not combine with strategy fsdp"):
        check_strategy("fsdp", sync_bn=True)
    with pytest.raises(UserError, match=r"DDP options \['static_graph'\] do not apply"):
        check_strategy("fsdp", sync_bn=False, ddp={"static_graph": True, "find_unused_parameters": False})
    with pytest.raises(UserError, match="unknown strategy 'zero'"):
        check_strategy("zero", sync_bn=False)
    check_strategy("fsdp", sync_bn=False, ddp={"find_unused_parameters": False})


def test_default_block_policy():
    from torch import nn

    from ddp_kit.parallel.fsdp import _chosen, default_blocks

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
            self.head = nn.Linear(4, 2)

    tower = Tower()
    assert default_blocks(tower) == list(tower.blocks)  # the transformer-style block list
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert default_blocks(mlp) == [mlp[1], mlp[3]]  # else each child with parameters
    assert _chosen(tower, ["Embedding"]) == [tower.embed]
    from ddp_kit.errors import UserError
    with pytest.raises(UserError, match=r"fsdp blocks \['Block'\] name no module class"):
        _chosen(tower, ["Block"])


def test_tied_weights_stay_in_one_unit():
    """A parameter used by two modules must not be split between two units (FSDP would hand one of
    them a shard): the default policy leaves those modules to the root, explicit blocks are refused."""
    sys.path.insert(0, str(HELPERS))
    try:
        from tied_task import SharedHead
    finally:
        sys.path.remove(str(HELPERS))
    from torch import nn

    from ddp_kit.errors import UserError
    from ddp_kit.parallel.fsdp import _units

    m = SharedHead()
    assert _units(m, None) == [m.mid, m.head]  # embed and out share a weight: both stay in the root
    assert _units(m, ["Sequential"]) == [m.mid]
    with pytest.raises(UserError, match=r"split tied weights: (embed|out)\.weight is also used as (out|embed)\.weight"):
        _units(m, ["Linear"])

    class Reused(nn.Module):  # one module under two names is one unit, not a split
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(3)])
            self.last = self.blocks[-1]

    r = Reused()
    assert _units(r, None) == list(r.blocks) and _units(r, ["Sequential"]) == list(r.blocks)


@pytest.mark.integration
def test_a_model_with_tied_weights_trains_under_fsdp_as_under_ddp(tmp_path):
    env = {"PYTHONPATH": str(HELPERS)}
    for strategy in ("ddp", "fsdp"):
        ok(torchrun([*BASE, "--run_dir", str(tmp_path / strategy), "--model", "tied_task:shared_head", "--max_steps", "10",
                     "--strategy", strategy], env=env, timeout=240))
    ddp, fsdp = records(tmp_path / "ddp"), records(tmp_path / "fsdp")
    assert len(ddp) >= 2 and [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in ddp], rel=1e-5)


@pytest.mark.parametrize("length,world,batch", [(360, 4, 256), (359, 4, 32), (7, 2, 3), (12, 3, 1), (100, 8, 7)])
def test_even_eval_batches_cover_every_sample_once_in_equal_counts(length, world, batch):
    from ddp_kit.data import EvenBatches

    shards = [list(EvenBatches(length, world, r, batch)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank makes the same number of forward calls
    seen = sorted(i for s in shards for b in s for i in b)
    assert seen == list(range(length))  # exact: each sample once, no padding
    assert all(0 < len(b) <= batch for s in shards for b in s)


def test_even_eval_batches_refuse_what_cannot_be_split():
    from ddp_kit.data import EvenBatches
    from ddp_kit.errors import UserError

    for rank in range(2):  # every rank reaches the same verdict: none goes on to wait for the others
        with pytest.raises(UserError, match="cannot be split into 2 non-empty batches"):
            EvenBatches(3, 2, rank, 1)
    for rank in range(4):
        with pytest.raises(UserError, match="cannot be split"):
            EvenBatches(3, 4, rank, 8)
