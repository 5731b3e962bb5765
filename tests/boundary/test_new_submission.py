"""A deterministic failure or a crash loop refuses only a restart of the same launch (issue 44, item 6):
the same SLURM job requeued is refused, a new SLURM job (the fixed script, resubmitted) starts and says
in one line what failed before. Each start record names its launch."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import run_cmd


def test_the_launch_is_the_batch_job_then_the_engine_then_torchruns_store_then_this_process():
    from ddp_kit.dist.launch_token import Launch, launch_of, store_token
    from ddp_kit.env import DistEnv

    assert launch_of(DistEnv(batch_job_id="7", restart_count=2), {}) == Launch("batch job 7", True)
    assert launch_of(DistEnv(batch_job_id="7"), {"DDP_KIT_LAUNCH_ID": "abc"}) == Launch("DDP_KIT_LAUNCH_ID abc", True)
    pod = launch_of(DistEnv(restarted_by_engine=True, engine="PyTorchJob", job_id="none"), {})
    assert pod.id.startswith("PyTorchJob pod ") and not pod.unique  # a same-named new job looks the same

    class Store(dict):  # TCPStore's compare_set: the first value stands
        def compare_set(self, key, expected, desired):
            return self.setdefault(key, desired).encode()

    agent, other = Store(), Store()
    torchrun = DistEnv(agent_store=True, master_addr="h", master_port=1, rendezvous_by_launcher=True, job_id="fixed")
    first = launch_of(torchrun, {}, store=agent)
    assert first.unique and launch_of(torchrun, {}, store=agent) == first  # every restart reads the same token
    assert launch_of(torchrun, {}, store=other) != first  # a second torchrun with the same rdzv_id: its own
    assert store_token("h", 1, agent) == first.id.split()[-1]
    no_store = DistEnv(rendezvous_by_launcher=True)
    err = "/tmp/torchelastic_x/fixed_ab12/attempt_{}/0/error.json"
    assert launch_of(no_store, {"TORCHELASTIC_ERROR_FILE": err.format(0)}) == \
        launch_of(no_store, {"TORCHELASTIC_ERROR_FILE": err.format(3)})
    assert launch_of(DistEnv(), {}).id.startswith("process ")


def test_only_the_trailing_attempts_of_this_launch_count():
    from ddp_kit.boundary.attempts import this_launch

    records = [{"event": "start", "launch": "batch job 1"}, {"event": "end", "outcome": "failed"},
               {"event": "start", "launch": "batch job 2"}, {"event": "end", "outcome": "failed"},
               {"event": "start", "launch": "batch job 2"}, {"event": "refused"}]
    assert this_launch(records, "batch job 2") == records[2:]
    assert this_launch(records, "batch job 3") == []
    assert this_launch([{"event": "start"}, {"event": "end"}], "batch job 1") == []  # written before launches were


def _slurm(job: str) -> dict[str, str]:
    """One task of an srun step of SLURM job `job` (a requeue keeps the id, a new sbatch gets a new one)."""
    return {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1"}


def _records(run) -> list[dict]:
    return [json.loads(ln) for ln in (run / "attempts.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_a_new_slurm_job_after_a_deterministic_failure_starts_and_a_requeue_is_refused(tmp_path):
    run = tmp_path / "r"
    train = [sys.executable, "-m", "ddp_kit.train", "--progress", "false", "--log_every", "5", "--run_dir", str(run),
             "--max_steps", "12", "--ckpt_every", "4"]
    broken = [*train, "--inject", "raise:rank=0:step=6:always=1"]
    first = run_cmd(broken, env=_slurm("101"), timeout=180)
    again = run_cmd(broken, env=_slurm("101"), timeout=180)  # the same job, requeued: the repeat is deterministic
    assert (first.returncode, again.returncode) == (1, 2), (first.stderr[-2000:], again.stderr[-2000:])
    requeued = run_cmd(broken, env=_slurm("101"), timeout=180)
    assert requeued.returncode == 2 and "deterministic failure" in requeued.stderr, requeued.stderr[-2000:]
    # the fixed script, submitted as a new job: it starts, says what failed before, and finishes
    fixed = run_cmd(train, env=_slurm("102"), timeout=180)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    said = [ln for ln in fixed.stderr.splitlines() if "this is a new submission" in ln]
    assert len(said) == 1 and "deterministic failure" in said[0] and "batch job 101" in said[0], fixed.stderr[-3000:]
    starts = [r for r in _records(run) if r["event"] == "start"]
    assert [r["launch"] for r in starts] == ["batch job 101", "batch job 101", "batch job 102"], starts
    refused = [r for r in _records(run) if r["event"] == "refused"]
    assert len(refused) == 1 and refused[0]["why"] == "deterministic", refused
