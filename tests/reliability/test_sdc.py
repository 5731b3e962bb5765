"""Silent data corruption with real processes (torchrun, gloo on CPU; docs/sdc.md): one rank's parameter gets a
flipped bit (--inject bitflip), the next sync check's vote names that rank and its host in one line, and every
rank rolls back to the last checkpoint the ranks agreed on and goes on, ending on the weights of a run that never
flipped a bit. Two ranks cannot outvote each other: they stop, keeping the checkpoint the ranks agreed on and
dropping the memory copies taken after it, so that the rerun ends right. A host outvoted twice ends
the attempt as infrastructure, which the health gate's ledger memory leaves out."""
from __future__ import annotations

import json
import os
import socket
import sys

import pytest

from conftest import ok, read_json, run_cmd, torchrun
from ddp_kit.preflight.leave import twice_failed
from procs import errors

pytestmark = pytest.mark.integration

# 3 ranks (a global batch of 48), a sync check and a checkpoint every 10 steps; 20 steps, so that the check that
# finds the flip of step 13 is the run's last step: the loop must go on after it.
COMMON = ("--progress", "false", "--log_every", "5", "--sync_check_every", "10")
ARGS = (*COMMON, "--max_steps", "20", "--batch_size", "48", "--ckpt_every", "10")
HOST = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # as preflight.peers.host_name names it


def train(run_dir, *extra, nproc=3, args=ARGS):
    return torchrun(["-m", "ddp_kit.train", *args, "--run_dir", str(run_dir), *extra], nproc=nproc, timeout=180)


def ledger(run_dir):
    return [json.loads(ln) for ln in (run_dir / "attempts.jsonl").read_text().splitlines()]


def test_a_flipped_bit_is_outvoted_rolled_back_and_trained_again_to_the_same_weights(tmp_path, reference_summary):
    res = ok(train(tmp_path, "--inject", "bitflip:rank=2:step=13"))
    said = [ln for ln in res.stdout.splitlines() if "silent data corruption" in ln]
    assert len(said) == 1, res.stdout[-3000:]
    assert said[0].startswith(f"ddp_kit: silent data corruption suspected at step 20: rank 2 (host {HOST}) disagrees "
                              f"with ranks 0,1 on 1.weight; rolled back to step 10 (the last step the ranks agreed)"), said
    summary = read_json(tmp_path / "summary.json")
    assert summary["steps"] == 20
    assert summary["param_sha256"] == reference_summary(3, ARGS)["param_sha256"]  # as if no bit had flipped
    (rb,) = [r for r in ledger(tmp_path) if r["event"] == "rollback"]
    assert (rb["step"], rb["to"], rb["lost"], rb["ranks"], rb["hosts"], rb["tier"]) == (20, 10, 10, [2], [HOST], "durable")
    status = ok(run_cmd([sys.executable, "-m", "ddp_kit.status", str(tmp_path)], timeout=60)).stdout
    assert f"rollbacks: 1 (10 steps trained again; rank 2 on {HOST})" in status, status
    assert "10 steps replayed" in status, status


def test_two_ranks_cannot_tell_which_is_wrong_and_stop_keeping_the_checkpoint(tmp_path):
    res = train(tmp_path, "--inject", "bitflip:rank=1:step=13", nproc=2,
                args=(*COMMON, "--max_steps", "20", "--ckpt_every", "10"))
    assert res.returncode != 0
    lines = errors(res.stderr)
    assert len(lines) == 1 and "diverged across ranks at step 20" in lines[0] and "no majority" in lines[0], res.stderr[-3000:]
    assert f"rank 1 (host {HOST}): 1.weight" in lines[0]
    assert (tmp_path / "checkpoints" / "step_10").is_dir()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_10"
    assert not [r for r in ledger(tmp_path) if r["event"] == "rollback"]


def test_two_ranks_that_stop_drop_their_memory_copies_after_the_agreement_and_the_rerun_ends_right(tmp_path,
                                                                                                  reference_summary):
    """Memory copies every 5 steps: at the stop (step 20, the ranks agreed at 10) each rank holds its own copy of
    step 15, rank 1's with the flipped bit. Left there, the rerun resumed from them and met the divergence again."""
    args = (*COMMON, "--max_steps", "20", "--ckpt_every", "10", "--mem_ckpt_every", "5")
    res = train(tmp_path, "--inject", "bitflip:rank=1:step=13", nproc=2, args=args)
    lines = errors(res.stderr)
    assert res.returncode != 0 and len(lines) == 1 and "no majority" in lines[0], res.stderr[-3000:]
    assert "the checkpoints after step 10 are set aside" in lines[0] and "a rerun resumes from step 10" in lines[0], lines
    again = ok(train(tmp_path, nproc=2, args=args))
    assert "(step 10, epoch" in again.stdout and "diverged" not in again.stderr, again.stdout[-3000:]
    summary = read_json(tmp_path / "summary.json")
    assert summary["steps"] == 20 and summary["param_sha256"] == reference_summary(2, args)["param_sha256"]


def test_a_host_outvoted_twice_ends_the_attempt_as_infrastructure(tmp_path):
    """The first flip rolls back to the memory tier's copy (no durable checkpoint by step); the second, on the
    same host, ends the attempt naming it, and the ledger then leaves it out at the next start."""
    res = train(tmp_path, "--inject", "bitflip:rank=2:step=13,bitflip:rank=2:step=22",
                args=(*COMMON, "--max_steps", "30", "--batch_size", "48", "--ckpt_every", "0", "--mem_ckpt_every", "10"))
    assert res.returncode != 0
    assert "rolled back to step 10" in res.stdout and "from the memory tier" in res.stdout, res.stdout[-3000:]
    lines = errors(res.stderr)
    assert len(lines) == 1 and f"silent data corruption suspected at step 30, a second time on {HOST}" in lines[0], \
        res.stderr[-3000:]
    records = ledger(tmp_path)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert (rb["step"], rb["to"], rb["tier"]) == (20, 10, "memory")
    (end,) = [r for r in records if r["event"] == "end"]
    assert (end["verdict"], end["host"], end["retryable"]) == ("infrastructure", HOST, True), end
    assert list(twice_failed(records, [HOST])) == [HOST]


def test_a_flipped_gradient_bit_is_found_by_the_replay_check_and_the_step_computed_again(tmp_path, reference_summary):
    """A bit of rank 1's local gradient flips in step 6's backward (--inject gradflip), before DDP averages it:
    every replica takes the same wrong step, and the sync check sees nothing (the unchecked run ends on other
    weights with no word). With sdc_check_every 3 the replay check names rank 1 and its host, the step is computed
    a third time, and the run ends on the weights of a run without the fault."""
    args = (*COMMON, "--max_steps", "12")
    fault = ("--inject", "gradflip:rank=1:step=6")
    unchecked = ok(train(tmp_path / "unchecked", *fault, nproc=2, args=args))
    assert "flips bit" in unchecked.stdout and "silent data corruption" not in unchecked.stdout, unchecked.stdout[-3000:]
    clean = reference_summary(2, args)["param_sha256"]
    assert read_json(tmp_path / "unchecked" / "summary.json")["param_sha256"] != clean  # the fault is real
    res = ok(train(tmp_path / "checked", *fault, "--sdc_check_every", "3", nproc=2, args=args))
    said = [ln for ln in res.stdout.splitlines() if "replay check" in ln]
    assert len(said) == 1 and said[0].startswith(
        f"ddp_kit: silent data corruption suspected at step 6 (replay check, sdc_check_every): rank 1 (host {HOST}) "
        f"computed its gradients differently in the first of two computations, and a third agreed with the second"), \
        res.stdout[-3000:]
    assert read_json(tmp_path / "checked" / "summary.json")["param_sha256"] == clean
    (line,) = [r for r in ledger(tmp_path / "checked") if r["event"] == "replay"]
    assert (line["step"], line["ranks"], line["hosts"], line["went_on"]) == (6, [1], [HOST], True)
