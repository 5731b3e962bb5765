"""The fault-tolerant strategy's in-process parts (unit tier: no process, no torchft Manager, no
lighthouse): replica group detection, the per-group run folder, the Replica's commit gate and
counters, the strategy's refusals, the manager's startup errors, the loader's live move, and the
launcher's restart policy over fake group processes. tests/parallel/test_ft.py runs the real thing."""
from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_kit.boundary.policy import Policy
from ddp_kit.data.train_loader import TrainLoader
from ddp_kit.env import DistEnv, detect
from ddp_kit.errors import UserError
from ddp_kit.launch import ft as launch_ft
from ddp_kit.parallel import ft
from ddp_kit.parallel.strategy import strategy, strategy_of
from ddp_kit.run_options import in_part

# What torchrun puts into a worker's environment (rank 1 of a 2-rank group on one node).
TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}
FT = {"DDP_KIT_REPLICA_GROUP": "1", "DDP_KIT_REPLICA_GROUPS": "3", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510"}


def one_line(err: UserError) -> None:
    assert "\n" not in err.message and "\n" not in err.hint and err.hint


# ---- env/replicas.around ------------------------------------------------------------------------

def test_a_group_of_a_fault_tolerant_launch_is_detected_under_torchrun():
    env = detect({**TORCHRUN, **FT, "DDP_KIT_GROUP_RESTARTS": "4"})
    assert (env.replica_group, env.replica_groups, env.lighthouse) == (1, 3, "http://127.0.0.1:29510")
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")  # the group's own layout, untouched
    assert env.restart_count == 4  # the launcher's restarts of the group, above torchrun's own


def test_group_restarts_never_lower_torchruns_restart_count():
    assert detect({**TORCHRUN, **FT, "DDP_KIT_GROUP_RESTARTS": "0"}).restart_count == 1
    assert detect({**TORCHRUN, **FT}).restart_count == 1


def test_torchfts_own_names_are_read_too():
    env = detect({**TORCHRUN, "REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "4"})
    assert (env.replica_group, env.replica_groups, env.lighthouse) == (2, 4, None)
    # ours win where both are set
    env = detect({**TORCHRUN, **FT, "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "5"})
    assert (env.replica_group, env.replica_groups) == (1, 3)


def test_nothing_set_is_one_group_without_a_lighthouse():
    for environ in ({}, TORCHRUN, {**TORCHRUN, "DDP_KIT_GROUP_RESTARTS": "2"}):
        env = detect(environ)
        assert (env.replica_group, env.replica_groups, env.lighthouse) == (0, 1, None)
    assert detect({"TORCHFT_LIGHTHOUSE": "http://h:1"}).replica_groups == 1  # a lighthouse alone: one group


@pytest.mark.parametrize("group, groups", [("3", "3"), ("0", "0"), ("5", None)])
def test_a_group_outside_the_groups_is_one_line(group, groups):
    environ = {**TORCHRUN, "DDP_KIT_REPLICA_GROUP": group}
    if groups is not None:
        environ["DDP_KIT_REPLICA_GROUPS"] = groups
    with pytest.raises(UserError, match="outside") as err:
        detect(environ)
    one_line(err.value)


@pytest.mark.parametrize("key", ["DDP_KIT_REPLICA_GROUP", "DDP_KIT_REPLICA_GROUPS", "DDP_KIT_GROUP_RESTARTS",
                                 "REPLICA_GROUP_ID"])
@pytest.mark.parametrize("raw", ["one", "-1", "1.5"])
def test_a_count_that_is_no_whole_number_is_one_line_naming_it(key, raw):
    with pytest.raises(UserError) as err:
        detect({**TORCHRUN, "TORCHFT_LIGHTHOUSE": "http://h:1", key: raw})
    assert key in err.value.message and repr(raw) in err.value.message
    one_line(err.value)


# ---- run_options.in_part, DistEnv.part -------------------------------------------------------------------

@pytest.mark.parametrize("ckpt, expected", [("s3://b/p", "s3://b/p/replica_2"), ("s3://b/p/", "s3://b/p/replica_2"),
                                            ("/mnt/ckpt", "/mnt/ckpt/replica_2"), (None, None)])
def test_each_group_gets_its_own_run_folder_and_checkpoints(ckpt, expected):
    part = DistEnv(replica_group=2, replica_groups=3).part
    policy = in_part(Policy(run_dir="runs/ft", ckpt_dir=ckpt, ckpt_every=5), part)
    assert Path(policy.run_dir) == Path("runs/ft/replica_2")
    assert policy.ckpt_dir == expected
    assert policy.ckpt_every == 5  # the rest is the run's


def test_one_group_or_no_run_folder_is_unchanged():
    policy = Policy(run_dir="runs/ft", ckpt_dir="s3://b/p")
    assert in_part(policy, DistEnv(replica_group=0, replica_groups=1).part) == policy
    assert in_part(Policy(), DistEnv(replica_group=1, replica_groups=2).part) == Policy()


# ---- parallel.ft.Replica ------------------------------------------------------------------------

class FakeWork:
    def __init__(self, ok: bool):
        self.ok = ok

    def wait(self) -> bool:
        return self.ok


class FakeManager:
    """Stands in for torchft's Manager (its quorum and commit calls, scripted); the real Manager's
    behaviour across processes is what tests/parallel/test_ft.py covers with real lighthouses and groups."""

    def __init__(self, commits=(), participants=(1,), peer_values=None, allreduce_ok=True):
        self.commits = list(commits)
        self.participants = list(participants)
        self.peer_values = peer_values  # what the other groups hold, for agree_max's all-reduce
        self.allreduce_ok = allreduce_ok
        self.calls: list[str] = []
        self.steps = 0

    def start_quorum(self, timeout=None) -> None:
        self.calls.append("start_quorum")
        if len(self.participants) > 1:
            self.participants.pop(0)

    def num_participants(self) -> int:
        return self.participants[0]

    def should_commit(self) -> bool:
        self.calls.append("should_commit")
        decision = self.commits.pop(0)
        self.steps += bool(decision)
        return decision

    def current_step(self) -> int:
        return self.steps

    def allreduce(self, tensor, reduce_op=None):
        self.calls.append("allreduce")
        if self.peer_values is not None and self.allreduce_ok:
            tensor.copy_(torch.maximum(tensor, torch.tensor(self.peer_values, dtype=tensor.dtype)))
        return FakeWork(self.allreduce_ok)

    def errored(self):
        return None

    def load_state_dict(self, state) -> None:
        self.steps = state["step"]

    def participating_rank(self) -> int:
        return 0

    def shutdown(self, wait=True) -> None:
        self.calls.append("shutdown")


def replica(manager: FakeManager, groups: int = 2) -> ft.Replica:
    return ft.Replica(manager=manager, group=0, groups=groups, group_size=1)


def model_and_optimizer(lr: float = 0.1):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def backward(model: nn.Module) -> None:
    model.zero_grad()
    model(torch.ones(4, 3)).pow(2).sum().backward()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_gated_step_is_a_no_op_unless_the_quorum_commits():
    model, opt = model_and_optimizer()
    r = replica(FakeManager(commits=[False, True]))
    r.gate(opt)
    before = params(model)

    r.begin_step()
    backward(model)
    assert opt.step() is None
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))  # discarded: nothing moved
    assert r.end_step() is False and r.discarded == 1

    r.begin_step()
    backward(model)
    opt.step()
    after = params(model)
    assert not any(torch.equal(a, b) for a, b in zip(before, after))  # committed: a real SGD step
    assert r.end_step() is True and r.discarded == 1 and r.step() == 1


def test_a_committed_step_is_the_optimizers_own():
    model, opt = model_and_optimizer()
    twin, twin_opt = model_and_optimizer()
    r = replica(FakeManager(commits=[True]))
    r.gate(opt)
    r.begin_step()
    for m, o in ((model, opt), (twin, twin_opt)):
        backward(m)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(twin)))


def test_two_optimizers_ask_the_quorum_once_per_step():
    model, opt = model_and_optimizer()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = FakeManager(commits=[True, False])
    r = replica(manager)
    r.gate(opt)
    r.gate(other)
    r.gate(opt)  # gating twice wraps once
    assert len(r.gated) == 2
    for _ in range(2):
        r.begin_step()
        backward(model)
        opt.step()
        other.step()
        r.end_step()
    assert manager.calls == ["start_quorum", "should_commit"] * 2
    assert r.discarded == 1


def test_end_step_resets_and_a_step_without_a_quorum_forms_one():
    manager = FakeManager(commits=[True, True])
    r = replica(manager)
    assert r.end_step() is True and manager.calls == []  # no step under way: nothing to agree on
    assert r.commit() is True  # an optimizer step with no forward: a quorum first
    assert manager.calls == ["start_quorum", "should_commit"]
    assert r.end_step() is True
    assert (r.in_step, r.decision) == (False, None)
    r.begin_step()
    assert manager.calls[-1] == "start_quorum" and r.in_step and r.decision is None


def test_begin_step_forms_one_quorum_per_step_and_records_a_change_of_participants():
    manager = FakeManager(commits=[True] * 3, participants=[0, 2, 2, 1])
    r = replica(manager)
    for _ in range(3):
        r.begin_step()
        r.begin_step()  # the second fetch of a step (another loader, grad_accum): same quorum
        r.end_step()
    assert manager.calls.count("start_quorum") == 3
    assert r.participants == 1
    assert [(e["event"], e["participants"], e["was"]) for e in r.events] == [("quorum", 1, 2)]


def test_agree_max_with_one_group_asks_nobody():
    manager = FakeManager()
    assert replica(manager, groups=1).agree_max(3, 7) == [3, 7]
    assert manager.calls == []


def test_agree_max_takes_the_largest_over_the_groups_or_its_own_when_a_group_is_lost():
    assert replica(FakeManager(peer_values=[5, 2])).agree_max(3, 7) == [5, 7]
    assert replica(FakeManager(peer_values=[5, 2], allreduce_ok=False)).agree_max(3, 7) == [3, 7]


def _scheduler_warnings(opt: torch.optim.Optimizer, sched) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
        sched.step()
    return [str(w.message) for w in seen]


def test_a_scheduler_made_before_the_gate_does_not_warn_and_still_steps():
    model, opt = model_and_optimizer(lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    r = replica(FakeManager(commits=[True]))
    r.gate(opt)
    r.begin_step()
    backward(model)
    before = params(model)
    seen = _scheduler_warnings(opt, sched)
    assert not [m for m in seen if "overridden" in m or "before `optimizer.step()`" in m], seen
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert not torch.equal(before[0], params(model)[0])


def test_the_scheduler_warning_is_what_a_plain_replacement_of_step_gives():
    # The control for the test above: the capture does see torch's warning when the mark is lost.
    _, opt = model_and_optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    original = opt.step
    opt.step = lambda *a, **k: original(*a, **k)
    assert any("overridden" in m for m in _scheduler_warnings(opt, sched))


def test_a_scheduler_made_after_the_gate_steps_too():
    # torch's LRScheduler.__init__ wraps the optimizer's step through step_fn.__func__: a bound method's
    model, opt = model_and_optimizer(lr=0.4)
    r = replica(FakeManager(commits=[True]))
    r.gate(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    r.begin_step()
    backward(model)
    assert not [m for m in _scheduler_warnings(opt, sched) if "overridden" in m]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_a_discarded_step_does_not_move_a_gated_schedule_and_an_epochs_end_does():
    model, opt = model_and_optimizer(lr=1.0)
    r = replica(FakeManager(commits=[True, False, True, False]))
    r.gate(opt)
    per_step = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    r.gate_schedule(per_step)
    for _ in range(4):
        r.begin_step()
        backward(model)
        opt.step()
        per_step.step()
        r.end_step()
    assert (r.discarded, per_step.last_epoch) == (2, 2)  # the schedule counts committed steps only
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / 3)
    assert type(per_step).__name__ == "LambdaLR" and "step" not in per_step.state_dict()  # a checkpoint as before
    r.epoch_ended()  # the loader ran out after the discarded step: a per-epoch schedule still steps
    per_step.step()
    assert per_step.last_epoch == 3


def _ft_run(tmp_path, commits, manager=None):
    """A one-process Run whose model is a replica group member with a scripted quorum (FakeManager)."""
    import ddp_kit
    from ddp_kit.parallel import ft_steps

    run = ddp_kit.init(run_dir=str(tmp_path), env=DistEnv(), device="cpu", resume="never", log_every=0,
                       sync_check_every=0, ckpt_every=0, ckpt_every_s=0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(64, 3), torch.randn(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, loader, opt = run.prepare(model, torch.utils.data.DataLoader(data, batch_size=4), opt)
    r = replica(manager or FakeManager(commits=commits, participants=[2]))
    run._boundary.attach(ft_steps.FtHooks(r))
    return run, model, loader, opt, r


def test_a_discarded_ft_step_leaves_the_registered_schedule_where_the_steps_done_are(tmp_path):
    commits = [True, False, True, False, False, True]
    run, model, loader, opt, r = _ft_run(tmp_path, commits)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    run.resume(scheduler=schedule)
    batches = iter(loader)
    for _ in commits:  # the reference job's order: optimizer, scheduler, then the boundary
        x, y = next(batches)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        run.step()
    assert (run.steps_done, r.discarded) == (3, 3)
    assert schedule.last_epoch == run.steps_done
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / 4)
    run.save()
    saved = torch.load(tmp_path / "checkpoints" / "step_3" / "train_state.pt", weights_only=False)
    assert saved["scheduler"]["last_epoch"] == 3
    run.close()


def test_a_group_behind_after_a_split_commit_decision_is_healed_and_says_why(tmp_path, capsys):
    """should_commit is each group's own vote: this group discards step 2, which the other group
    commits; the next quorum they share heals this one from the other (torchft), and it is said."""
    runs: list = []

    class Split(FakeManager):
        def start_quorum(self, timeout=None):
            super().start_quorum(timeout)
            if self.calls.count("start_quorum") == 4:  # join, steps 1 and 2, then step 3's quorum
                b = runs[0]._boundary
                self.steps = 2
                next(h for h in b.hooks if hasattr(h, "replica")).replica._load_state_dict({"ddp_kit": {"objects": b.state.state_dict(), "done": 2}, "group": 1})

    run, model, loader, opt, r = _ft_run(tmp_path, [True, False, True],
                                         manager=Split(commits=[True, False, True], participants=[2]))
    runs.append(run)
    run.resume()
    batches = iter(loader)
    for _ in range(3):
        x, y = next(batches)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        run.step()
    out = capsys.readouterr().out
    assert "replica group 0 recovered live from group 1 at step 2" in out, out
    assert "it discarded or missed a step the others committed" in out, out
    assert run.steps_done == 3 and r.discarded == 1
    assert next(h for h in run._boundary.hooks if hasattr(h, "check_next")).check_next  # and the groups compare weights at the next stop check
    run.close()


def test_live_state_goes_through_the_boundarys_functions():
    taken = []
    r = replica(FakeManager())
    r.state_fn, r.load_fn = (lambda: {"done": 7}), taken.append
    sent = r._state_dict()
    assert sent == {"ddp_kit": {"done": 7}, "group": 0}
    r._load_state_dict({**sent, "group": 1})
    assert taken == [{"done": 7}]
    assert r.recoveries[0]["source_group"] == 1 and r.recoveries[0]["seconds"] >= 0


def test_a_manager_server_that_does_not_answer_names_the_group():
    class Gone(FakeManager):
        def start_quorum(self, timeout=None):
            raise ConnectionError("tcp connect error: Connection refused\n  at some/rust/frame.rs:12")

    r = ft.Replica(manager=Gone(), group=1, groups=2, group_size=1)
    with pytest.raises(RuntimeError, match="replica group 1's manager server") as err:
        r.begin_step()
    assert "\n" not in str(err.value) and "Connection refused" in str(err.value)


def test_a_lost_lighthouse_is_named_as_such_not_as_the_groups_manager_server(monkeypatch):
    class Lost(FakeManager):
        def start_quorum(self, timeout=None):
            raise RuntimeError("status: Internal, message: \"lighthouse quorum failed after 60 retries.\"")

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    with pytest.raises(RuntimeError, match="cannot reach torchft's lighthouse \\(http://127.0.0.1:29510\\)"):
        ft.Replica(manager=Lost(), group=1, groups=2, group_size=1).begin_step()


def test_a_quorum_timeout_names_the_timeout_it_had():
    class Slow(FakeManager):
        def start_quorum(self, timeout=None):
            raise TimeoutError("status: Cancelled, message: \"Timeout expired\"")

    with pytest.raises(RuntimeError, match=r"got no quorum in time \(600s\)"):
        ft.Replica(manager=Slow(), group=1, groups=2, group_size=1).begin_step(timeout_s=600)


def test_the_comm_hook_leaves_a_lost_groups_all_reduce_to_the_commit_decision():
    buf = torch.tensor([1.0, 2.0])
    bucket = SimpleNamespace(buffer=lambda: buf)
    hook = ft._comm_hook(replica(FakeManager(allreduce_ok=False)), group=None)
    fut = hook(None, bucket)
    assert fut.done() and fut.value() is buf


class FakeClient:
    """torchft's ManagerClient, scripted: each _quorum returns the next (lighthouse id, members, step)."""

    def __init__(self, quorums):
        self.quorums = list(quorums)

    def _quorum(self, **_):
        quorum_id, members, step = self.quorums.pop(0)
        return SimpleNamespace(quorum_id=quorum_id, replica_ids=list(members), max_step=step, heal=False)

    def should_commit(self, *args, **kwargs):
        return True


def test_quorum_ids_stay_unique_across_a_restarted_lighthouse():
    """A restarted lighthouse numbers its quorums from 1 again: the ids a group acts on (its process group
    is reconfigured when they change, under a store prefix they name) must not repeat an earlier one."""
    ab, abc = ("group0:x", "group1:y"), ("group0:x", "group1:y", "group2:z")
    client = ft._EraQuorums(FakeClient([(1, abc, 0), (1, abc, 1), (2, ab, 5), (2, ab, 6),  # the first lighthouse
                                        (1, ab, 7), (1, ab, 8), (2, abc, 9)]))  # a new one, from 1 again
    ids = [client._quorum().quorum_id for _ in range(7)]
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[4] == ids[5]  # unchanged quorum: no reconfiguration
    assert len({ids[0], ids[2], ids[4], ids[6]}) == 4  # the new lighthouse's 1 and 2 are not the old ones
    assert client.should_commit() is True and client._quorum.__self__ is client  # the rest is torchft's own
    # A group that joins in the new lighthouse's quorum 2 has another history, and the same id
    assert ft._EraQuorums(FakeClient([(2, abc, 9)]))._quorum().quorum_id == ids[6]


def test_timeouts_read_from_the_environment():
    assert ft.Timeouts.from_environ({}) == ft.Timeouts()
    t = ft.Timeouts.from_environ({"DDP_KIT_FT_TIMEOUT_S": "2.5", "DDP_KIT_FT_QUORUM_TIMEOUT_S": ""})
    assert (t.collective_s, t.quorum_s, t.connect_s) == (2.5, ft.Timeouts.quorum_s, ft.Timeouts.connect_s)


# ---- the strategy -------------------------------------------------------------------------------

def test_ft_is_found_by_name_and_a_plain_module_has_no_strategy():
    s = strategy("ft")
    assert s is ft.STRATEGY and isinstance(s, ft.FaultTolerant) and not s.sharded
    assert strategy_of(nn.Linear(2, 2)) is None
    assert ft.replica_of(nn.Linear(2, 2)) is None
    assert s.step_hooks([nn.Linear(2, 2)], DistEnv(), []) == []  # a plain module has no quorum to join


@pytest.mark.parametrize("options, word", [({"sync_bn": True}, "sync_bn"),
                                           ({"sync_bn": False, "ddp": {"static_graph": True}}, "static_graph"),
                                           ({"sync_bn": False, "cpu_offload": True}, "cpu_offload")])
def test_options_that_do_not_combine_with_ft_are_one_line(options, word):
    with pytest.raises(UserError) as err:
        strategy("ft").check_options(**options)
    assert word in err.value.message
    one_line(err.value)


def test_plain_options_pass():
    strategy("ft").check_options(sync_bn=False, ddp={"bucket_cap_mb": 25, "static_graph": False})


# ---- parallel.ft._manager's startup errors ------------------------------------------------------

def ctx(env: DistEnv) -> SimpleNamespace:
    return SimpleNamespace(env=env, device=torch.device("cpu"), rank=env.rank, world_size=env.world_size)


@pytest.fixture
def rust_log(monkeypatch):
    monkeypatch.setenv("RUST_LOG", "warn")  # _manager sets a default into os.environ: keep it from leaking


def test_no_torchft_is_one_line_naming_the_install(monkeypatch, rust_log):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    env = DistEnv(lighthouse="http://127.0.0.1:1", master_addr="127.0.0.1", master_port=2)
    with pytest.raises(UserError, match="torchft") as err:
        ft._manager(ctx(env), ft.Timeouts(), replica(FakeManager()))
    assert err.value.hint == ft.INSTALL and "pip install" in err.value.hint
    one_line(err.value)


def test_no_lighthouse_is_one_line_naming_its_variable(rust_log):
    pytest.importorskip("torchft")
    env = DistEnv(master_addr="127.0.0.1", master_port=2)
    with pytest.raises(UserError, match="TORCHFT_LIGHTHOUSE") as err:
        ft._manager(ctx(env), ft.Timeouts(), replica(FakeManager()))
    assert "ddp_kit.launch ft" in err.value.hint
    one_line(err.value)


def test_no_rendezvous_store_is_one_line(rust_log):
    pytest.importorskip("torchft")
    with pytest.raises(UserError, match="MASTER_ADDR") as err:
        ft._manager(ctx(DistEnv(lighthouse="http://127.0.0.1:1")), ft.Timeouts(), replica(FakeManager()))
    one_line(err.value)


# ---- TrainLoader: a live move from the fetch hook -----------------------------------------------

N, B = 12, 2  # 6 steps per epoch


def loader(shuffle: bool) -> TrainLoader:
    data = TensorDataset(torch.arange(N) * 10)
    return TrainLoader(data, global_batch=B, world_size=1, rank=0, shuffle=shuffle, seed=3, num_workers=0)


def values(batches) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def later_state(shuffle: bool) -> dict:
    """A loader's state two epochs and three batches in."""
    other = loader(shuffle)
    for _ in range(2):
        for _ in other:
            pass
    it = iter(other)
    for _ in range(3):
        next(it)
    state = other.state_dict()
    assert (state["epoch"], state["position"]) == (2, 3 * B)
    return state


def test_without_a_move_an_epoch_is_the_dataset_in_order():
    lo = loader(shuffle=False)
    fetches = []
    lo.on_fetch = lambda: fetches.append(lo.position)
    assert values(lo) == [[10 * i, 10 * i + 10] for i in range(0, N, B)]
    assert fetches == list(range(0, N, B))  # before each batch, at the position it starts at
    assert (lo.epoch, lo.position) == (1, 0)
    assert values(lo) == [[10 * i, 10 * i + 10] for i in range(0, N, B)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("at_call", [1, 2, 4])
def test_a_move_in_the_fetch_hook_continues_from_the_new_position(shuffle, at_call):
    state = later_state(shuffle)
    fresh = loader(shuffle)
    fresh.load_state_dict(state)
    expected = values(fresh)
    plain = values(loader(shuffle))

    lo = loader(shuffle)
    calls = [0]

    def on_fetch():
        calls[0] += 1
        if calls[0] == at_call:
            lo.load_state_dict(state)  # a peer's live state, taken at this step's quorum
    lo.on_fetch = on_fetch
    got = values(lo)
    assert got == plain[:at_call - 1] + expected
    assert lo.state_dict() == fresh.state_dict() and (lo.epoch, lo.position) == (3, 0)
    if shuffle:
        assert expected != plain[3:]  # epoch 2's order is its own: the move did not stay in epoch 0


# ---- launch.ft.supervise ------------------------------------------------------------------------

class FakeProc:
    """A group's torchrun: running for `polls` polls, then exited with `code`."""

    def __init__(self, pid: int, polls: int, code: int):
        self.pid, self.polls, self.code, self.returncode = pid, polls, code, None

    def poll(self):
        if self.polls > 0:
            self.polls -= 1
            return None
        self.returncode = self.code
        return self.code


class Launches:
    """The launcher's start(group), scripted: each group's attempts as (polls, exit code), and a record
    of every start as (group, its restart count then)."""

    def __init__(self, tmp_path: Path, attempts: dict[int, list[tuple[int, int]]], stop_marks: dict | None = None,
                 mark_text: str = ""):
        self.mark_text = mark_text  # what the shim writes: launch/ft.py's SHIM its code, templates/k8s/rank.sh nothing
        self.attempts = {g: list(a) for g, a in attempts.items()}
        self.stop_marks = stop_marks or {}  # group -> the attempt after whose start its shim writes the mark
        self.started: list[tuple[int, int]] = []
        self.members = [launch_ft.Group(g, mark=tmp_path / f"group{g}.stopped") for g in sorted(attempts)]

    def __call__(self, group: launch_ft.Group) -> None:
        polls, code = self.attempts[group.index].pop(0)
        self.started.append((group.index, group.restarts))
        if self.stop_marks.get(group.index) == group.restarts:
            group.mark.write_text(self.mark_text)
        group.proc = FakeProc(1000 + len(self.started), polls, code)


@pytest.fixture
def fast(monkeypatch):
    """supervise on a clock of its own: each sleep moves it on, and no real time passes."""
    ended = []
    slept = [0]
    clock = [0.0]

    def sleep(s):
        slept[0] += 1
        clock[0] += s
        assert slept[0] < 10_000, "supervise never ended"
    monkeypatch.setattr(launch_ft, "_end_group", ended.append)  # no real processes to kill
    monkeypatch.setattr(launch_ft.time, "sleep", sleep)
    monkeypatch.setattr(launch_ft.time, "monotonic", lambda: clock[0])
    return ended


def supervise(launches: Launches, stopping=(), max_restarts: int = 2) -> int:
    for group in launches.members:
        launches(group)
    return launch_ft.supervise(launches.members, launches, list(stopping), max_restarts, 1.0)


def test_a_failing_group_is_restarted_up_to_the_limit_then_left_out(tmp_path, fast, capsys):
    launches = Launches(tmp_path, {0: [(1, 1), (2, 1), (1, 7)], 1: [(30, 0)]})
    assert supervise(launches, max_restarts=2) == 7
    assert [s for s in launches.started if s[0] == 0] == [(0, 0), (0, 1), (0, 2)]
    assert [s for s in launches.started if s[0] == 1] == [(1, 0)]
    assert [g.code for g in launches.members] == [7, 0]
    assert len(fast) == 4  # each ended start was cleaned up
    assert "left out" in capsys.readouterr().err


def test_a_group_that_recovers_after_a_restart_finishes_with_the_others(tmp_path, fast):
    launches = Launches(tmp_path, {0: [(1, -9), (5, 0)], 1: [(40, 0)]})
    assert supervise(launches, max_restarts=2) == 0
    assert launches.started == [(0, 0), (1, 0), (0, 1)]


def test_a_group_that_exits_0_is_not_restarted(tmp_path, fast):
    launches = Launches(tmp_path, {0: [(0, 0)], 1: [(3, 0)]})
    assert supervise(launches) == 0
    assert launches.started == [(0, 0), (1, 0)]


def test_no_restart_while_stopping(tmp_path, fast):
    launches = Launches(tmp_path, {0: [(1, 1), (1, 1)], 1: [(3, 0)]})
    assert supervise(launches, stopping=[signal.SIGTERM]) == 1
    assert launches.started == [(0, 0), (1, 0)]


def test_a_group_stopped_on_a_signal_is_75_and_so_is_the_launch(tmp_path, fast):
    launches = Launches(tmp_path, {0: [(1, 1)], 1: [(3, 1)]}, stop_marks={0: 0, 1: 0})
    assert supervise(launches, stopping=[signal.SIGTERM]) == 75
    assert [g.code for g in launches.members] == [75, 75]
    assert launches.started == [(0, 0), (1, 0)]


def test_a_stop_mark_without_a_signal_to_the_launcher_is_75_not_a_restart(tmp_path, fast):
    launches = Launches(tmp_path, {0: [(1, 1), (1, 0)], 1: [(2, 0)]}, stop_marks={0: 0})
    assert supervise(launches) == 75
    assert [g.code for g in launches.members] == [75, 0]
    assert launches.started == [(0, 0), (1, 0)]


def test_ctrl_c_is_130(tmp_path, fast):
    launches = Launches(tmp_path, {0: [(1, 1)], 1: [(1, 1)]}, stop_marks={0: 0, 1: 0}, mark_text="130\n")
    assert supervise(launches, stopping=[signal.SIGINT]) == 130


def test_no_group_is_restarted_once_another_finished_the_job_and_the_line_names_who_holds_it(tmp_path, fast, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "group1.json").write_text('{"group": 1, "step": 60, "param_sha256": "ab"}')
    # group 0 fails, and group 1 finishes during its restart delay (10 polls); group 2 fails after that
    launches = Launches(tmp_path, {0: [(3, 1)], 1: [(6, 0)], 2: [(20, 1)]})
    for group in launches.members:
        launches(group)
    code = launch_ft.supervise(launches.members, launches, [], 3, 1.0, results=results)
    assert code == 0 and launches.started == [(0, 0), (1, 0), (2, 0)]
    err = capsys.readouterr().err
    assert "replica group 0 is not restarted: the job was finished meanwhile" in err
    assert "replica group 2 failed (exit 1) after the job was finished: not restarted; it holds no result" in err
    assert ("the job was finished by replica group 1 at step 60: the result is in run_dir/replica_<g> of that group; "
            "replica group 0, 2 holds no result") in err


def test_the_join_timeout_is_half_the_groups_quorum_timeout_and_never_above_it():
    assert launch_ft.join_timeout(None, {}) == 30_000
    assert launch_ft.join_timeout(None, {"DDP_KIT_FT_QUORUM_TIMEOUT_S": "300"}) == 150_000
    assert launch_ft.join_timeout(5000, {}) == 5000
    with pytest.raises(UserError, match="not below the groups' quorum timeout") as err:
        launch_ft.join_timeout(60_000, {})
    one_line(err.value)
    with pytest.raises(UserError, match="DDP_KIT_FT_QUORUM_TIMEOUT_S='soon'"):
        launch_ft.join_timeout(None, {"DDP_KIT_FT_QUORUM_TIMEOUT_S": "soon"})
    assert ft.Timeouts.from_environ({"DDP_KIT_FT_JOIN_TIMEOUT_S": "30"}).join_s == 30.0


class FakeHouse(launch_ft.Lighthouse):
    """The lighthouse, scripted: it exits (with -9) at the polls in `dies_at`; `fails` starts fail."""

    def __init__(self, dies_at=(), fails: int = 0):
        super().__init__([], {}, 1, "http://127.0.0.1:1", Path("/nonexistent"))
        self.proc = FakeProc(0, 10**9, 0)
        self.polls, self.dies_at, self.fails, self.started, self.ended = 0, set(dies_at), fails, 0, 0

    def exited(self):
        self.polls += 1
        return -9 if self.polls in self.dies_at else None

    def start(self):
        self.started += 1
        if self.fails:
            self.fails -= 1
            raise UserError("torchft's lighthouse did not listen on port 1 within 10s", "hint")

    def end(self):
        self.ended += 1


def test_a_lighthouse_that_dies_is_started_again_and_the_groups_go_on(tmp_path, fast, capsys):
    launches = Launches(tmp_path, {0: [(30, 0)], 1: [(30, 0)]})
    house, stopped = FakeHouse(dies_at={3, 10}), []
    for group in launches.members:
        launches(group)
    code = launch_ft.supervise(launches.members, launches, [], 2, 1.0, house=house, stop=lambda: stopped.append(1))
    assert code == 0 and house.started == 2 and not stopped
    said = [line for line in capsys.readouterr().err.splitlines() if "lighthouse" in line]
    assert len(said) == 2 and all("exited (-9 (SIGKILL)): restarted it on the same port" in line for line in said), said


def test_a_lighthouse_that_cannot_be_brought_back_stops_the_groups_with_one_line(tmp_path, fast, capsys):
    launches = Launches(tmp_path, {0: [(30, 0)], 1: [(30, 0)]})
    house, stopped = FakeHouse(dies_at={3}, fails=1), []
    for group in launches.members:
        launches(group)
    launch_ft.supervise(launches.members, launches, [], 2, 1.0, house=house, stop=lambda: stopped.append(1))
    assert stopped == [1] and house.ended == 1 and house.proc is None
    said = [line for line in capsys.readouterr().err.splitlines() if "lighthouse" in line]
    assert len(said) == 1 and "could not be started again" in said[0] and "stopping the replica groups" in said[0], said


def test_the_report_draws_the_replica_groups_apart_from_what_the_script_logged():
    from ddp_kit.report import outline

    records = [{"event": "train", "step": s, "loss": 1.0 / s, "participants": 2 if s < 20 or s > 40 else 1}
               for s in range(5, 60, 5)]
    records += [{"event": "step_discarded", "step": 21, "participants": 2},
                {"event": "quorum", "step": 21, "participants": 1, "was": 2, "quorum_s": 0.4},
                {"event": "replica_pause", "step": 21, "paused_s": 0.5, "participants": 1, "discarded_total": 1},
                {"event": "recovery", "step": 41, "source_group": 0, "seconds": 0.04},
                {"event": "replica_weights_checked", "step": 50, "equal": True, "participants": 2}]
    drawn = dict(outline(records))
    assert drawn["replica groups (strategy ft)"] == ["replica groups in the quorum", "discarded step", "pause (s)",
                                                     "live recovery (s)"]
    assert "logged by the script (run.log_event)" not in drawn  # the replica events are not the script's
    plain = [{"event": "train", "step": s, "loss": 1.0 / s} for s in range(5, 60, 5)]  # strategy ddp: no panel
    assert "replica groups (strategy ft)" not in dict(outline(plain))
