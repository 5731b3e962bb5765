"""The health gate's decisions without processes: which host a set of timed links names, what a Report
says per host, the ledger's rules for leaving a host out, the elastic job's bounds from torchrun's command
line, and the node-local checks against real folders."""
from __future__ import annotations

import json
import os
import stat

import pytest

from ddp_kit.preflight import leave, local
from ddp_kit.preflight.peers import judge_clocks, judge_links
from ddp_kit.preflight.results import Report, Result

MB = 2**20


def _ring(fast_s: float, slow: dict[tuple[str, str], float], hosts=("nodea", "nodeb", "nodec")) -> dict:
    links = {(a, b): fast_s for a in hosts for b in hosts if a != b}
    return {**links, **slow}


def test_a_host_that_sends_slowly_to_every_peer_is_named_alone():
    got = judge_links(_ring(0.003, {("nodec", "nodea"): 0.5, ("nodec", "nodeb"): 0.6}), 2 * MB)
    failed = [r for r in got if not r.ok]
    assert [r.host for r in failed] == ["nodec"], got
    assert "sends at" in failed[0].measured and "nodea" in failed[0].measured and "median" in failed[0].expected


def test_a_single_slow_link_names_both_ends():
    got = judge_links(_ring(0.003, {("nodea", "nodeb"): 0.4}), 2 * MB)
    failed = [r for r in got if not r.ok]
    assert sorted(r.host for r in failed) == ["nodea", "nodeb"], got
    assert all(r.detail == "nodea -> nodeb" for r in failed)


def test_noise_below_the_floor_names_nobody():
    """Millisecond transfers vary several-fold on a busy machine: under LINK_FLOOR_S nothing is slow."""
    got = judge_links(_ring(0.001, {("nodec", "nodea"): 0.009, ("nodec", "nodeb"): 0.009}), 2 * MB)
    assert all(r.ok for r in got), got
    assert {r.host for r in got} == {"nodea", "nodeb", "nodec"}


def test_a_stall_on_the_last_pair_after_a_host_is_named_names_nobody_else():
    """CI's failure (stop 52): nodec's sends shaped, its receives slow with them (an exchange is one batch), and
    a 25 ms stall on nodeb -> nodea on a busy machine. The pair left is two links: too few to call one slow."""
    slow = {k: 0.4 for k in [("nodec", "nodea"), ("nodec", "nodeb"), ("nodea", "nodec"), ("nodeb", "nodec")]}
    got = judge_links(_ring(0.002, {**slow, ("nodeb", "nodea"): 0.025}), 2 * MB)
    assert [r.host for r in got if not r.ok] == ["nodec"], got


def test_two_hosts_one_slow_direction():
    got = judge_links({("nodea", "nodeb"): 0.002, ("nodeb", "nodea"): 0.3}, 2 * MB)
    assert [r.host for r in got if not r.ok] == ["nodeb"], got


def test_a_host_slow_both_ways_is_named_though_it_drags_the_median_down():
    """Four of six links touch nodec: their median is slow; each host is judged against the links apart from it."""
    slow = {("nodec", "nodea"): 0.3, ("nodec", "nodeb"): 0.25, ("nodea", "nodec"): 0.28, ("nodeb", "nodec"): 0.3}
    got = judge_links(_ring(0.003, slow), 2 * MB)
    assert [r.host for r in got if not r.ok] == ["nodec"], got


def test_the_odd_clock_out_is_named_also_on_rank_0s_host():
    got = judge_clocks({"nodea": 0.0, "nodeb": -90.0, "nodec": -90.2})  # nodea (rank 0's) is 90 s ahead
    assert [(r.host, r.ok) for r in got] == [("nodea", False), ("nodeb", True), ("nodec", True)], got
    assert "ahead of the median host's" in got[0].measured
    two = judge_clocks({"nodea": 0.0, "nodeb": 5.0})
    assert len(two) == 1 and not two[0].ok and "either may be the one off" in two[0].measured, two
    assert judge_clocks({"nodea": 0.0}) == []


def test_report_per_host_and_bad_hosts_in_job_order():
    results = (Result("storage", "nodeb", True), Result("clock", "nodec", False, "60.0 s ahead of nodea's", "within 2 s"),
               Result("shm", "nodeb", False, "0.1 MiB free", "room for 1.0 MiB"))
    report = Report("quick", results, 0.5, ("nodea", "nodea", "nodeb", "nodec"))
    assert report.bad_hosts == ["nodeb", "nodec"]
    per = report.per_host()
    assert per["nodea"] == {"ok": True, "failed": []}
    assert per["nodec"]["failed"] == ["health check failed on nodec: clock: 60.0 s ahead of nodea's (expected within 2 s)"]
    assert report.as_dict()["healthy"] is False


def _end(attempt: int, verdict: str, host: str | None, cause: str = "x", error: str = "") -> dict:
    return {"event": "end", "attempt": attempt, "verdict": verdict, **({"host": host} if host else {}), "cause": cause,
            "error": error}


def test_twice_failed_counts_verdicts_that_name_their_host_as_the_cause():
    records = [_end(1, "infrastructure", "nodeb", "ECC", "RuntimeError: uncorrectable ECC error"),
               _end(2, "lost_peer", "nodea"), _end(3, "lost_peer", "nodea"),
               _end(4, "infrastructure", "nodeb,nodec", "gate", "Unhealthy: the health gate failed on nodeb, nodec"),
               _end(5, "infrastructure", "noded", "x", "Unhealthy: x"), _end(6, "infrastructure", "noded", "x", "Unhealthy: x"),
               _end(7, "infrastructure", "nodea", "503", "Unavailable: SlowDown"),
               _end(8, "infrastructure", "nodea", "503", "Unavailable: SlowDown")]
    got = leave.twice_failed(records, ["nodea", "nodeb", "nodec"])
    # lost_peer and a store's refusal name the rank that saw it; noded is not in this job; nodec failed once
    assert list(got) == ["nodeb"], got
    assert "attempt 1: ECC" in got["nodeb"] and "attempt 4: gate" in got["nodeb"]


def test_left_out_reads_the_excluded_lines():
    records = [{"event": "excluded", "left_out": {"nodec": "health gate: network"}, "t": 1.0},
               {"event": "excluded", "left_out": {"noded": "twice"}, "t": 2.0}]
    assert leave.left_out(records) == {"nodec": "health gate: network", "noded": "twice"}


def test_slurm_job_only_from_a_slurm_requeue_command():
    assert leave.slurm_job(("scontrol", "requeue", "123_4")) == "123_4"
    assert leave.slurm_job(None) is None
    assert leave.slurm_job(("kubectl", "delete", "pod")) is None


@pytest.mark.parametrize("argv,env,want", [
    (["/usr/bin/python", "-m", "torch.distributed.run", "--nnodes=2:3", "--max-restarts=2", "--rdzv_endpoint=nodea:29500",
      "-m", "ddp_kit.train"],
     {"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"}, (2, 3, 1, "nodea")),
    (["/venv/bin/torchrun", "--nnodes", "1:4", "x.py"], {"TORCHELASTIC_RUN_ID": "j"}, (1, 4, 0, None)),
    (["/venv/bin/torchrun", "x.py"], {"TORCHELASTIC_RUN_ID": "j", "PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "10.0.0.1:29400"},
     (2, 4, 0, "10.0.0.1")),  # Kubeflow's elastic jobs pass torchrun's flags as PET_* variables
    (["/venv/bin/torchrun", "--nnodes=3", "x.py"], {"TORCHELASTIC_RUN_ID": "j"}, None),  # not elastic
    (["/venv/bin/torchrun", "--nnodes=2:2", "x.py"], {"TORCHELASTIC_RUN_ID": "j"}, None),
    (["/bin/bash", "run.sh", "--nnodes=1:4"], {"TORCHELASTIC_RUN_ID": "j"}, None),  # not torchrun's agent
])
def test_elastic_bounds_from_the_agents_command_line(argv, env, want):
    got = leave.elastic(env, leave._agent_argv_words(argv))
    assert (None if got is None else (got.min_nodes, got.max_nodes, got.restarts_left, got.rdzv_host)) == want


def test_folder_check_writes_and_names_a_folder_that_refuses(tmp_path):
    ok = local.folder("checkpoints", tmp_path / "ck" / "deeper", "nodea", need_bytes=1000)
    assert ok.ok and ok.value and ok.value > 0 and ok.detail == str(tmp_path / "ck" / "deeper")
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())  # nothing made, the probe gone
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = local.folder("checkpoints", blocker / "ck", "nodea")  # a path under a file cannot be made, even by root
    assert not bad.ok and "is not a folder" in bad.measured and bad.host == "nodea"


def test_folder_check_wants_room_for_the_last_checkpoint(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    bad = local.folder("checkpoints", tmp_path, "nodea", need_bytes=free * 2)
    assert not bad.ok and "free" in bad.measured and "last checkpoint" in bad.expected


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only-mode folder anyway")
def test_folder_check_names_a_folder_without_write_permission(tmp_path):
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        bad = local.folder("run_dir", tmp_path, "nodea")
    finally:
        tmp_path.chmod(stat.S_IRWXU)
    assert not bad.ok and "not writable" in bad.measured


def test_tmpfs_room_against_a_real_folder(tmp_path):
    assert local.tmpfs_room("nodea", 1000, tmp_path).ok
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    bad = local.tmpfs_room("nodea", free * 2, tmp_path)
    assert not bad.ok and "memory tier" in bad.expected and bad.check == "shm"


def test_the_rendezvous_host_is_recognised_by_name_or_address():
    from ddp_kit.services.health_gate import _same_host

    assert _same_host("node1", "node1.cluster.local") and _same_host("127.0.0.1", "127.0.0.1")
    assert not _same_host("10.232.0.3", "10.232.0.1") and not _same_host("nodec", None)


def test_a_result_keeps_zero_numbers_and_drops_only_unset_fields():
    """The median host's clock offset is 0.0 and a check may cost 0 s: 0.0 == False, and both were dropped."""
    got = Result("clock", "nodeb", True, "0.0 s ahead of the median host's", "within 2 s", value=0.0, seconds=0.0).as_dict()
    assert got["value"] == 0.0 and got["seconds"] == 0.0 and got["ok"] is True, got
    assert "detail" not in got and "skipped" not in got and "shared" not in got, got
    assert Result("shm", "nodea", False, skipped=False).as_dict()["ok"] is False


def test_doctor_preflight_probes_run_dir_only_when_given(tmp_path, monkeypatch, capsys):
    """An init container's working folder may be read-only: without --run_dir the table says run_dir was not
    checked (it probed "." before); with it, the folder given is probed."""
    from ddp_kit.doctor.__main__ import main

    monkeypatch.chdir(tmp_path)
    for env in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(env, raising=False)
    for given in (None, str(tmp_path / "run")):
        with pytest.raises(SystemExit) as done:
            main(preflight=True, json_out=True, run_dir=given)
        assert done.value.code == 0
        rows = [r for r in json.loads(capsys.readouterr().out)["results"] if r["check"] == "run_dir"]
        if given is None:
            assert len(rows) == 1 and rows[0]["skipped"] and "not checked" in rows[0]["measured"], rows
        else:
            assert len(rows) == 1 and rows[0]["detail"] == given and "writable" in rows[0]["measured"], rows


def test_the_tier_state_estimate_counts_moments_an_optimizer_makes_at_its_first_step():
    """Before the first step Adam holds no state: its two moments are counted from the parameters; after it,
    what it holds. SGD without momentum keeps none; an optimizer not listed counts only what it holds."""
    import torch

    from ddp_kit.preflight import tier_room

    model = torch.nn.Linear(64, 32)  # 64*32 + 32 floats
    params = (64 * 32 + 32) * 4
    adam = torch.optim.Adam(model.parameters())
    assert tier_room.state_bytes([model], [adam]) == 3 * params
    model(torch.ones(2, 64)).sum().backward()
    adam.step()
    assert tier_room.state_bytes([model], [adam]) >= 3 * params  # the moments, and each parameter's step count
    assert tier_room.state_bytes([model], [torch.optim.SGD(model.parameters(), lr=0.1)]) == params
    assert tier_room.state_bytes([model], [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]) == 2 * params
    assert tier_room.state_bytes([model, model], [torch.optim.LBFGS(model.parameters())]) == params  # counted once


def test_the_tier_room_per_node_is_a_lower_bound():
    from ddp_kit.preflight.tier_room import COPIES, from_checkpoint, from_state

    hosts = ("nodea", "nodea", "nodeb", "nodeb")
    assert from_state([10, 12, 30, 40], hosts, "nodea", num_nodes=2) == COPIES * (10 + 12 + 2 * 10)
    assert from_state([10, 12], hosts[:2], "nodea", num_nodes=1) == COPIES * 22  # one node: no peer's copies
    assert from_checkpoint(400, world_size=4, local_world_size=2, num_nodes=2) == COPIES * 2 * 2 * 100
