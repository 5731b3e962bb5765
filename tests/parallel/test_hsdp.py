"""The HSDP strategy (FSDP2 over a 2-D mesh, replicate x shard): its mesh-size rules without
processes, and with real ones (torchrun, gloo, CPU, 4 ranks on one host; `--hsdp_shard 2` makes two
shard groups of 2, as two nodes of 2 would by default).

Launches are few, shared by the tests and run concurrently where they do not depend on each other
(the suite's time budget): one uninterrupted 2 x 2 run, one 2 x 2 run stopped by SIGTERM, and three
resumes of that stop (the same command; 2 x 1 on 2 ranks; 1 x 4 on 4). The DDP run compared with is
the session's shared 2-rank reference (conftest.reference_summary).

Tolerance of the loss comparisons: 1e-5 relative, as for FSDP (test_fsdp.py). DDP all-reduces whole
gradients; HSDP reduce-scatters them in a shard group, then all-reduces the shards across groups, so
float32 sums are taken in another order; measured here the losses differ by at most ~1e-7 relative
over the 44 steps, and a mesh that dropped a group's gradients or mixed up shards is off by far more.
The resumes at another mesh share the recipe (the same global batch), not the reduction order:
they are held to the same tolerance, not to bit identity.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from conftest import REFERENCE_2_EPOCHS, ROOT, proc_env, read_json
from procs import wait_step

HSDP = [*REFERENCE_2_EPOCHS, "--strategy", "hsdp"]
MESH_2X2 = ["--hsdp_shard", "2"]  # 4 ranks on one host: 2 replicas of 2 shards


def records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "train"]


def state_bytes(record):
    """Per rank: parameter + gradient + optimizer bytes, from a metrics record."""
    return [x["param_bytes"] + x["grad_bytes"] + x["optim_bytes"] for x in record["ranks"]]


def start(run_dir, nproc, *extra):
    """`python -m ddp_kit.train` under torchrun, in the background (its output in files beside the run)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "ddp_kit.train", *HSDP, "--run_dir", str(run_dir), *extra]
    logs = run_dir.parent / f"{run_dir.name}.out"
    with open(logs, "a") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=out, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    p.logs = logs
    return p


def finish(p, expect_ok=True, timeout=240):
    """What `p` printed, once it has ended (past `timeout` its session is killed and the test fails)."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"timed out after {timeout}s: {p.args}\n{p.logs.read_text()[-4000:]}")
    text = p.logs.read_text()
    assert p.returncode == 0 or not expect_ok, f"exit {p.returncode}\n{text[-4000:]}"
    return text


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_summary):
    """In two waves of concurrent launches (processes that wait on each other leave a core idle):
    the session's DDP reference, the uninterrupted 2 x 2 run, and a 2 x 2 run stopped by SIGTERM
    once step 12 is logged (slowed so that it is still running then; SIGTERM to torchrun's agent:
    the workers finish the step, checkpoint and exit 75); then three resumes of that stop: the same
    command, 2 x 1 on 2 ranks (another world size) and 1 x 4 on 4 (another mesh)."""
    d = tmp_path_factory.mktemp("hsdp")
    failed: list[BaseException] = []

    def ddp_reference():
        try:
            reference_summary.folder(2, REFERENCE_2_EPOCHS)
        except BaseException as exc:  # pytest.fail too: raised again below, in the test's thread
            failed.append(exc)

    reference = threading.Thread(target=ddp_reference)
    reference.start()
    uninterrupted = start(d / "hsdp22", 4, *MESH_2X2)
    stopping = start(d / "stopped", 4, *MESH_2X2, "--inject", "slow:rank=0:step=1:ms=150")
    try:
        wait_step(d / "stopped", 12, stopping, timeout=180)
        os.kill(stopping.pid, signal.SIGTERM)  # the process we started: the torchrun agent
    finally:
        said = finish(stopping, expect_ok=False)
    assert "preempted by SIGTERM" in said and "exiting with 75" in said, said[-3000:]
    saved = sorted(int(s.name[5:]) for s in (d / "stopped" / "checkpoints").glob("step_*"))
    assert saved and 12 <= saved[-1] < 44, saved
    shards = {p.name for p in (d / "stopped" / "checkpoints" / f"step_{saved[-1]}" / "dcp").iterdir()}
    for copy in ("as_2x1", "as_1x4"):
        shutil.copytree(d / "stopped", d / copy)
    resumes = {"stopped": start(d / "stopped", 4, *MESH_2X2),  # the same command, without the slow-down
               "as_2x1": start(d / "as_2x1", 2, "--hsdp_replicate", "2"),  # 2 replicas of 1
               "as_1x4": start(d / "as_1x4", 4)}  # the default on one host: 1 replica of 4 shards
    outs = {name: finish(p) for name, p in resumes.items()}
    finish(uninterrupted)
    reference.join()
    if failed:
        raise failed[0]
    return d, saved[-1], shards, outs


@pytest.mark.integration
def test_hsdp_2x2_trains_to_ddps_losses_holding_half_the_state(runs, reference_summary):
    d, _, _, _ = runs
    ddp_dir = reference_summary.folder(2, REFERENCE_2_EPOCHS)
    ddp, hsdp = records(ddp_dir), records(d / "hsdp22")
    assert [r["step"] for r in ddp] == [r["step"] for r in hsdp] and len(ddp) >= 8
    for a, b in zip(ddp, hsdp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    summary = read_json(d / "hsdp22" / "summary.json")
    assert summary["strategy"] == "hsdp" and summary["param_sha256_all_ranks_equal"] is None
    assert summary["eval_loss"] == pytest.approx(read_json(ddp_dir / "summary.json")["eval_loss"], rel=1e-5)
    # shards of 2: every rank holds half of the model's state (DDP's rank holds all of it)
    ratios = [h / full for h, full in zip(state_bytes(hsdp[-1]), state_bytes(ddp[-1]) * 2)]
    assert all(0.45 <= r <= 0.56 for r in ratios), ratios


@pytest.mark.integration
def test_hsdp_sigterm_then_the_same_command_resumes_bit_identically(runs):
    d, stopped_at, shards, outs = runs
    summary = read_json(d / "stopped" / "summary.json")
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == 44, outs["stopped"][-2000:]
    assert summary["param_sha256"] == read_json(d / "hsdp22" / "summary.json")["param_sha256"]
    assert {f"__{r}_0.distcp" for r in range(4)} | {".metadata"} <= shards  # the stop's own checkpoint


@pytest.mark.integration
@pytest.mark.parametrize("copy,ranks,share", [("as_2x1", 2, 1.0), ("as_1x4", 4, 0.25)])
def test_a_2x2_checkpoint_resumes_on_another_mesh_and_trains_on(runs, copy, ranks, share):
    """The 2 x 2 checkpoint (4 shard files) resharded by DCP onto 2 replicas of 1 rank (a world of 2)
    and onto 1 replica of 4 shards: the data position is kept and training ends as the uninterrupted
    2 x 2 run does, each rank now holding 1/shard of the state."""
    d, stopped_at, _, outs = runs
    summary, ref = read_json(d / copy / "summary.json"), read_json(d / "hsdp22" / "summary.json")
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == ref["steps"] == 44
    assert summary["world_size"] == ranks
    if ranks != 4:
        assert f"written by 4 rank(s), resumed on {ranks}" in outs[copy], outs[copy][-2000:]
    assert summary["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    after = [r for r in records(d / copy) if r["step"] > stopped_at]
    assert after and after[-1]["step"] == 44 and len(after[-1]["ranks"]) == ranks
    for a, b in zip([r for r in records(d / "hsdp22") if r["step"] > stopped_at], after):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    full = 2 * state_bytes(records(d / "hsdp22")[-1])[0]  # a 2 x 2 rank holds half
    assert all(abs(b / full - share) < 0.06 for b in state_bytes(after[-1])), (state_bytes(after[-1]), full)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_export_of_an_hsdp_checkpoint_is_the_plain_model(runs, tmp_path, name):
    """In this process, without a process group: the 2 x 2 run's shards (replicas written once)
    assembled into one file that a plain model loads strictly, with the run's param_sha256."""
    from ddp_kit.checkpoint.cli import export
    from ddp_kit.checkpoint.weights import read_weights
    from ddp_kit.models import REGISTRY
    from ddp_kit.reliability.sync_checks import param_sha256

    d, _, _, _ = runs
    out = tmp_path / name
    export(str(d / "hsdp22"), str(out))
    state = torch.load(out, weights_only=True) if name.endswith(".pt") else read_weights(out)[0]
    model = REGISTRY["mlp"]((1, 8, 8), 10)
    model.load_state_dict(state)  # strict: every key, every shape
    assert param_sha256(model) == read_json(d / "hsdp22" / "summary.json")["param_sha256"]


# ---- the mesh-size rules (no process) -------------------------------------------------------------

def _nodes(per_node, fewest=None, node_major=True):
    from ddp_kit.parallel.hsdp import NodeFacts

    return NodeFacts(fewest=per_node if fewest is None else fewest, most=per_node, node_major=node_major)


def test_the_default_mesh_is_one_shard_group_per_node():
    from ddp_kit.parallel.hsdp import mesh_shape

    assert mesh_shape(32, _nodes(8)) == (4, 8)  # 4 nodes of 8: shard in the node, replicate across
    assert mesh_shape(8, _nodes(8)) == (1, 8)  # one node: FSDP over it
    assert mesh_shape(1, _nodes(1)) == (1, 1)  # one process: the same code path
    assert mesh_shape(32, _nodes(8), replicate=8) == (8, 4)  # groups of 4, two per node
    assert mesh_shape(4, _nodes(4), shard=2) == (2, 2)  # as the tests simulate 2 nodes of 2
    assert mesh_shape(32, _nodes(8), shard=16) == (2, 16)  # a named shard size may span nodes: asked for
    assert mesh_shape(32, _nodes(8), shard=4, replicate=8) == (8, 4)
    assert mesh_shape(6, _nodes(4, fewest=2, node_major=False), shard=3) == (2, 3)  # named: no node rule


@pytest.mark.parametrize("world,nodes,shard,replicate,said", [
    (8, _nodes(4), 3, 2, r"hsdp mesh 2 x 3 \(replicate x shard\) has 6 ranks, and the world has 8"),
    (8, _nodes(4), 3, 0, r"--hsdp_shard 3 does not divide the world size 8"),
    (8, _nodes(4), 0, 3, r"--hsdp_replicate 3 does not divide the world size 8"),
    (32, _nodes(8), 0, 2, r"must stay inside a node unless asked: groups of 16 ranks would span nodes of 8"),
    (6, _nodes(4, fewest=2), 0, 0, r"the nodes run different numbers of ranks \(2 to 4\)"),
    (8, _nodes(4, node_major=False), 0, 0, r"the ranks are not numbered node by node"),
    (8, _nodes(4), -1, 0, r"config key 'hsdp_shard' must be a number of ranks >= 1, or 0"),
])
def test_a_mesh_that_does_not_fit_is_refused_in_one_line(world, nodes, shard, replicate, said):
    from ddp_kit.errors import UserError
    from ddp_kit.parallel.hsdp import mesh_shape

    with pytest.raises(UserError, match=said) as caught:
        mesh_shape(world, nodes, shard=shard, replicate=replicate)
    assert "\n" not in str(caught.value) and caught.value.hint


def test_hsdp_is_one_registry_entry_sharing_fsdps_options():
    from ddp_kit.parallel import fsdp
    from ddp_kit.parallel.strategy import config_options, foreign_keys, strategy

    hsdp = strategy("hsdp")
    assert hsdp.sharded and hsdp.options_keyword == "hsdp"
    assert set(hsdp.config_keys) == {"hsdp_shard", "hsdp_replicate"} | set(strategy("fsdp").config_keys)
    assert all(o in config_options() for o in fsdp.OPTIONS)  # one declaration, one key each
    defaults = {o.key: o.default for o in config_options()}
    assert [k for _, k in foreign_keys("fsdp", {**defaults, "hsdp_shard": 2}, defaults)] == ["hsdp_shard"]
    assert [k for _, k in foreign_keys("hsdp", {**defaults, "fsdp_blocks": "Block"}, defaults)] == []
    assert hsdp.prepare_options({"hsdp_shard": 2, "hsdp_replicate": 0, "fsdp_blocks": "Block",
                                 "fsdp_cpu_offload": False, "fsdp_reshard_after_forward": True}) == {
        "hsdp": {"shard": 2, "replicate": 0, "blocks": ["Block"], "cpu_offload": False, "reshard_after_forward": True}}


def test_fsdp_options_under_strategy_hsdp_go_in_its_own_dict():
    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv
    from ddp_kit.errors import UserError
    from ddp_kit.parallel.strategy import strategy

    ctx = DistContext(DistEnv(), torch.device("cpu"), "gloo")
    with pytest.raises(UserError, match=r"fsdp options \['blocks'\] were given with strategy hsdp") as caught:
        strategy("hsdp").wrap(torch.nn.Linear(2, 2), ctx, fsdp={"blocks": ["Linear"]})
    assert "pass hsdp={...} instead of fsdp={...}" in caught.value.hint
    with pytest.raises(UserError, match=r"hsdp options \['shards'\] not understood"):
        strategy("hsdp").wrap(torch.nn.Linear(2, 2), ctx, hsdp={"shards": 2})
    with pytest.raises(UserError, match="sync_bn does not combine with strategy hsdp"):
        strategy("hsdp").check_options(sync_bn=True)
