"""The health gate as a step-boundary service (services/health_gate.py), unit tier: one process at world size 1
(every collective is the value itself), a real run folder and real folder probes; a stand-in boundary holds
only what the service reads. scontrol is replaced where it is asked (no SLURM in the unit tier: the real one
runs in tests/launch/test_slurm.py)."""
from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import torch

from ddp_kit.dist import DistContext
from ddp_kit.env import DistEnv
from ddp_kit.errors import Unhealthy
from ddp_kit.preflight import leave
from ddp_kit.run_folder import RunDir
from ddp_kit.services.health_gate import HealthGate


def _boundary(tmp_path, ckpt_dir=None, requeue=None, **settings):
    """What the gate reads of a StepBoundary, for one process: the ledger lines it tells land in `told`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    env = DistEnv(rank=0, world_size=1, requeue_command=requeue)
    ctx = DistContext(env, torch.device("cpu"), "gloo")
    policy = SimpleNamespace(ckpt_dir=ckpt_dir, settings={"health_check": "quick", **settings})
    told: list[dict] = []
    return SimpleNamespace(ctx=ctx, rd=RunDir(run_dir, ckpt_dir), policy=policy, tell=told.append, told=told,
                           flag=SimpleNamespace(closing=False), models=[], modules=[], optimizers=[])


def _scontrol(monkeypatch, requeue_rc=0, update_rc=0):
    """scontrol as SLURM answers: `show job` with no ExcNodeList, then the requeue and the update's exit codes."""
    asked: list[tuple[str, ...]] = []

    def run(cmd, **_):
        asked.append(tuple(cmd))
        rc = {"requeue": requeue_rc, "update": update_rc}.get(cmd[1], 0)
        err = "Requested operation is presently disabled" if cmd[1] == "requeue" and rc else "refused" if rc else ""
        return subprocess.CompletedProcess(cmd, rc, "JobId=81 ExcNodeList=(null)" if cmd[1] == "show" else "", err)

    monkeypatch.setattr(leave.subprocess, "run", run)
    return asked


def _failing_ckpt(tmp_path):
    """A checkpoint folder that cannot be made (under a file): refused even by root."""
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "ck")


@pytest.mark.parametrize("requeue_rc, update_rc, said", [
    (0, 0, "requeued the job without "),
    (0, 1, "requeued the job without the exclusion (the ExcNodeList update failed)"),
    (1, 0, "the job was not requeued (scontrol requeue failed)"),
])
def test_the_slurm_line_says_what_the_requeue_did(tmp_path, monkeypatch, capsys, requeue_rc, update_rc, said):
    """A job submitted with --no-requeue (or an salloc session) refuses scontrol requeue; an ExcNodeList update
    may fail after the requeue: the error line said "requeueing the job without X" in every case."""
    asked = _scontrol(monkeypatch, requeue_rc, update_rc)
    b = _boundary(tmp_path, ckpt_dir=_failing_ckpt(tmp_path), requeue=("scontrol", "requeue", "81"))
    with pytest.raises(Unhealthy) as failed:
        HealthGate("quick").started(b)
    host = next(iter(b.told[0]["per_host"]))  # the gate's own name for this host
    assert said in failed.value.message and host in failed.value.message, failed.value.message
    assert "requeueing" not in failed.value.message, failed.value.message
    assert [c[1] for c in asked] == ["show", "requeue", "update"][: 3 if requeue_rc == 0 else 2], asked
    excluded = [r for r in b.told if r.get("event") == "excluded"]
    assert len(excluded) == (1 if requeue_rc == update_rc == 0 else 0), b.told
    if requeue_rc or update_rc:
        assert "fix or drain the host, then rerun" not in failed.value.hint, failed.value.hint
    err = capsys.readouterr().err
    assert ("requeue 81 failed" in err) if requeue_rc else ("requeued" in err), err
    json.dumps(b.told)  # the ledger's lines stay JSON


def test_the_default_checkpoint_folder_is_probed_with_the_room_it_needs(tmp_path, monkeypatch):
    """No ckpt_dir: checkpoints go to run_dir/checkpoints, which was only sized, never probed. Here it cannot
    be made (a file stands there; a read-only per-node mount fails the same probe), and the gate names it."""
    import ddp_kit.services.health_gate as gate

    b = _boundary(tmp_path)
    (b.rd.path / "checkpoints").write_text("not a folder")
    with pytest.raises(Unhealthy) as failed:
        HealthGate("quick").started(b)
    assert "(checkpoints)" in failed.value.message, failed.value.message
    failed_lines = [line for v in b.told[0]["per_host"].values() for line in v["failed"]]
    assert len(failed_lines) == 1 and "checkpoints" in failed_lines[0] and "is not a folder" in failed_lines[0]

    (b.rd.path / "checkpoints").unlink()  # not made yet: probed where it would be made, and nothing is made
    monkeypatch.setattr(gate, "_rank0_facts", lambda b, location: (12345, {}, leave.Launcher()))
    plan, _, _ = gate._plan(b, "quick")
    assert plan.folders == (("run_dir", str(b.rd.path), 0), ("checkpoints", str(b.rd.checkpoints), 12345)), plan
    HealthGate("quick").started(b)
    assert not (b.rd.path / "checkpoints").exists()
    b = _boundary(tmp_path, ckpt_dir=str(tmp_path / "run"))  # ckpt_dir is run_dir itself: one folder, one probe
    assert gate._plan(b, "quick")[0].folders == (("run_dir", str(b.rd.path), 12345),)


def test_the_ledger_the_verdicts_and_the_gate_name_a_host_alike(tmp_path, monkeypatch):
    """Under SLURM the gate names a host by its NodeName (what ExcNodeList takes), while the ledger's start
    line and the verdicts used the host name: node1 beside node1.cluster (or, on the test's 2-node cluster on one
    machine, one host name for both nodes), so a host that failed twice was never matched. One name for all."""
    import dataclasses
    import socket
    import threading

    import torch.distributed as tdist

    from ddp_kit.boundary import attempts, failing
    from ddp_kit.dist import failfast
    from ddp_kit.preflight.peers import layout

    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    monkeypatch.setattr(socket, "gethostname", lambda: "node1.cluster")
    b = _boundary(tmp_path)
    b.policy.max_failed_attempts = 0
    b.ctx = dataclasses.replace(b.ctx, store=tdist.HashStore())  # in-process: where fail-fast posts a failure
    b.checkpointer = lambda: None  # no checkpoint yet (attempts._latest reads None)
    for _ in range(2):  # two attempts, each failing with a GPU hardware error on this host
        b.steps = SimpleNamespace(attempt_started=False, ended=False, failed=False, done=0, exit_code=0)
        b.progress = SimpleNamespace(step=0, phase="startup")
        b.watchdog = SimpleNamespace(aborting=threading.Event())
        b.hang_dir, b.cuda_notes, b.verdict, b.previous_end = None, None, None, None
        b.attempt = attempts.begin(b)
        code = failing.fail(b, RuntimeError("CUDA error: uncorrectable ECC error encountered"))
        attempts.record_end(b, code, b.verdict)
        b.ctx.store.delete_key(failfast.FAILED_KEY)
    records = attempts.read(b.rd.path / attempts.FILE)
    assert [r["hosts"] for r in records if r["event"] == "start"] == [["node1"], ["node1"]], records
    assert [r["host"] for r in records if r["event"] == "end"] == ["node1", "node1"], records
    posted = failfast.post(b.ctx.store, 1, 5, "forward", RuntimeError("CUDA error: an illegal memory access"))
    assert posted is not None and posted["host"] == "node1", posted  # another rank's failure names its host alike
    gate_hosts = layout(b.ctx).hosts
    assert gate_hosts == ("node1",) and list(leave.twice_failed(records, gate_hosts)) == ["node1"], records


def _failed_twice(b, host, monkeypatch):
    """This launch's ledger: two attempts that ended with a GPU hardware error on `host`, and this attempt's start."""
    monkeypatch.setenv("DDP_KIT_LAUNCH_ID", "t1")
    monkeypatch.setenv("SLURMD_NODENAME", host)
    lines = []
    for n in (1, 2):
        lines += [{"event": "start", "t": 1000.0 + n, "attempt": n, "launch": "DDP_KIT_LAUNCH_ID t1", "hosts": [host]},
                  {"event": "end", "t": 1000.5 + n, "attempt": n, "exit": 1, "outcome": "failed", "step": 0,
                   "verdict": "infrastructure", "retryable": True, "host": host, "cause": f"ECC error {n}",
                   "error": "RuntimeError: CUDA error: uncorrectable ECC error encountered"}]
    lines.append({"event": "start", "t": 1003.0, "attempt": 3, "launch": "DDP_KIT_LAUNCH_ID t1", "hosts": [host]})
    (b.rd.path / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.parametrize("elastic, why", [
    (leave.Elastic(1, 2, restarts_left=1), "the job needs 1 node(s) (--nnodes 1:2) and would have 0"),
    (leave.Elastic(1, 2, restarts_left=0), "torchrun has no restart left"),
    (leave.Elastic(1, 3, restarts_left=2, rdzv_host="node1"), "it holds torchrun's rendezvous"),
])
def test_history_alone_warns_and_goes_on_where_the_host_cannot_leave_this_time(tmp_path, monkeypatch, capsys,
                                                                               elastic, why):
    """A host the ledger shows failing twice, which passed the gate, on an elastic job that cannot let it go now
    (below MIN, no restart left, the rendezvous host): the attempt raised every time, though the host may have
    healed. torchrun's agent command line is not there in one process: the launcher's bounds are given."""
    b = _boundary(tmp_path)
    _failed_twice(b, "node1", monkeypatch)
    monkeypatch.setattr(leave, "elastic", lambda: elastic)
    HealthGate("quick").started(b)  # goes on
    warned = [line for line in capsys.readouterr().err.splitlines() if "ended 2 attempts" in line]
    assert len(warned) == 1 and warned[0].startswith("ddp_kit: warning: node1") and why in warned[0], warned
    assert "ECC error 1" in warned[0] and "the attempt goes on" in warned[0], warned
    assert not b.flag.closing and [r["event"] for r in b.told] == ["health"] and "history" not in b.told[0], b.told


@pytest.mark.parametrize("requeue_rc", [1, 0])
def test_history_alone_on_slurm_goes_on_only_when_the_requeue_was_refused(tmp_path, monkeypatch, capsys, requeue_rc):
    """SLURM refuses the requeue (--no-requeue, salloc): the host stays, so the attempt goes on with a warning;
    a requeue that happened ends this attempt, the host left out."""
    asked = _scontrol(monkeypatch, requeue_rc)
    b = _boundary(tmp_path, requeue=("scontrol", "requeue", "81"))
    _failed_twice(b, "node1", monkeypatch)
    if requeue_rc:
        HealthGate("quick").started(b)
        err = capsys.readouterr().err
        assert "scontrol requeue 81 failed" in err and "the attempt goes on" in err, err
        assert "the job was not requeued" in err and not b.flag.closing, err
    else:
        with pytest.raises(Unhealthy) as failed:
            HealthGate("quick").started(b)
        assert "requeued the job without node1" in failed.value.message and failed.value.hosts == ["node1"]
        assert [r["left_out"] for r in b.told if r["event"] == "excluded"] == [{"node1": b.told[0]["history"]["node1"]}]
    assert [c[1] for c in asked][:2] == ["show", "requeue"], asked


def test_at_a_first_start_the_tier_room_is_asked_once_the_state_exists(tmp_path, monkeypatch):
    """No checkpoint yet: the gate (at init, before the model exists) could ask the memory tier's tmpfs for its
    probe's megabyte only. At run.resume the model and optimizer are registered: a node without room for 2 copies
    of them is named there, before step 1. The model lives on the meta device: its size is real, its memory none."""
    monkeypatch.setenv("DDP_KIT_MEM_DIR", str(tmp_path / "shm"))
    b = _boundary(tmp_path, mem_ckpt_every=5)
    gate = HealthGate("quick")
    gate.started(b)  # nothing to size yet: passes
    small = torch.nn.Linear(16, 16)
    b.modules, b.optimizers = [small], [torch.optim.Adam(small.parameters())]
    gate.resumed(b, {})  # room for it: goes on
    assert [r["event"] for r in b.told] == ["health"], b.told

    b = _boundary(tmp_path, mem_ckpt_every=5)
    gate = HealthGate("quick")
    gate.started(b)
    huge = torch.nn.Linear(2**18, 2**18, device="meta")  # 256 GiB of parameters, Adam's moments twice that
    b.modules, b.optimizers = [huge], [torch.optim.Adam(huge.parameters())]
    with pytest.raises(Unhealthy) as failed:
        gate.resumed(b, {})
    assert "(shm)" in failed.value.message, failed.value.message
    shm = [line for v in b.told[-1]["per_host"].values() for line in v["failed"]]
    assert len(shm) == 1 and "memory tier" in shm[0] and "GiB" in shm[0], b.told
    gate.resumed(b, {})  # once: a rollback's resume asks nothing again
