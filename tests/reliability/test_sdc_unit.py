"""sync_fix rollback without processes (docs/sdc.md): the vote over checksum tables, the line it says, the
bit flip the reference job injects, the ledger's account of a rollback, the health gate's memory of it, and a
rollback in process on one rank: from a sync check inside the step boundary to a loop that goes on, explicit
(run.step) and implicit (the loader's next batch), ending on the weights of a run that never rolled back."""
from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_kit.hooks import StepHooks
from ddp_kit.preflight.leave import twice_failed
from ddp_kit.reliability.sdc import Divergence, Vote, vote
from ddp_kit.run_account import CAUSES, account
from ddp_kit.status import render
from ddp_kit.train.inject import Injector, flip_bit, parse

# ---- the vote ---------------------------------------------------------------------------------------


def test_the_odd_table_out_is_the_minority():
    assert vote([b"a", b"a", b"x"]) == Vote((0, 1), (2,))
    assert vote(["x", "a", "a", "a"]) == Vote((1, 2, 3), (0,))  # rank 0 is not the reference by rank
    assert vote(["a", "b", "a", "c", "a"]) == Vote((0, 2, 4), (1, 3))  # two corrupt ranks, each its own table


def test_no_strict_majority_names_nobody():
    assert vote(["a", "b"]) == Vote((), (0, 1))  # 2 replicas: nothing tells which is wrong
    assert vote(["a", "a", "b", "b"]) == Vote((), (0, 1, 2, 3))  # a 2-2 tie
    assert vote(["a", "b", "c"]) == Vote((), (0, 1, 2))
    assert vote(["a", "a", "a"]) == Vote((0, 1, 2), ())  # all agree: nobody is named


def test_the_line_names_rank_host_and_tensors():
    d = Divergence(130, Vote((0, 1, 3), (2,)), 0, {2: ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")},
                   {2: "nodeb"}, 4)
    assert d.who() == "rank 2 (host nodeb) disagrees with ranks 0,1,3 on fc1.weight, fc1.bias, fc2.weight ..."
    two = Divergence(40, Vote((0, 2, 4), (1, 3)), 0, {1: ("a",), 3: ("b",)}, {1: "n1", 3: "n1"}, 5)
    assert two.who() == "ranks 1 (host n1), 3 (host n1) disagree with ranks 0,2,4 (rank 1 on a; rank 3 on b)"
    assert two.suspect_hosts() == ["n1"]
    none = Divergence(20, Vote((), (0, 1)), 0, {1: ("1.weight",)}, {1: "nodea"}, 2)
    assert none.where() == "rank 1 (host nodea): 1.weight" and "2 replicas" in none.no_majority()


# ---- the injected bit flip --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_bitflip_changes_one_element_by_a_power_of_two_once(dtype, capsys):
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(dtype)
    before = model.weight.detach().clone()
    faults = Injector(parse("bitflip:rank=2:step=13"), rank=2, armed=True)
    faults.at_step(12, model)
    assert torch.equal(model.weight, before)
    faults.at_step(13, model)
    changed = (model.weight != before).nonzero().tolist()
    assert changed == [[2, 0]]  # the middle element of the first parameter: element 16 of 32
    ratio = float(model.weight[2, 0].detach()) / float(before[2, 0])
    assert ratio in (2.0, 0.5) and math.isfinite(float(model.weight[2, 0].detach()))
    assert "rank 2 flips bit" in capsys.readouterr().out
    flipped = model.weight.detach().clone()
    faults.at_step(13, model)  # the step trained again after a rollback: no second flip
    assert torch.equal(model.weight, flipped)
    assert not Injector(parse("bitflip:rank=2:step=13"), rank=1, armed=True)  # another rank's fault


def test_bitflip_near_the_top_of_the_range_stays_finite():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(3e38)  # exponent 0xFE: its lowest bit up would make it inf
    flip_bit(model, 0, 1)
    value = float(model.weight.detach())
    assert math.isfinite(value) and value != pytest.approx(3e38)


# ---- the ledger's account and the health gate's memory -----------------------------------------------

ROLLED = [
    {"event": "start", "t": 1000.0, "attempt": 1, "launched_t": 990.0, "latest": None, "restart_count": 0,
     "world_size": 3, "engine": "torchrun", "hosts": ["nodea", "nodeb", "nodec"]},
    {"event": "resume", "t": 1003.0, "attempt": 1, "step": 0, "from": "none"},
    {"event": "first_step", "t": 1005.0, "attempt": 1, "step": 1},
    {"event": "progress", "t": 1014.0, "attempt": 1, "step": 10, "window_s": 10.0, "steps": 10},
    {"event": "checkpoint", "t": 1014.5, "attempt": 1, "step": 10, "blocking_s": 0.5, "commit_s": 0.5},
    {"event": "checkpoint", "t": 1020.0, "attempt": 1, "step": 15, "blocking_s": 0.5, "commit_s": 0.5},
    {"event": "progress", "t": 1025.0, "attempt": 1, "step": 20, "window_s": 10.5, "steps": 10},
    # step 20's check: rank 2 outvoted; back to step 10 (the checkpoint at 15 came after the agreement)
    {"event": "rollback", "t": 1025.5, "attempt": 1, "step": 20, "to": 10, "lost": 10, "agreed": 10, "ranks": [2],
     "hosts": ["nodec"], "majority": [0, 1], "tier": "durable"},
    {"event": "progress", "t": 1036.0, "attempt": 1, "step": 20, "window_s": 10.5, "steps": 10},
    {"event": "checkpoint", "t": 1036.5, "attempt": 1, "step": 20, "blocking_s": 0.5, "commit_s": 0.5},
    {"event": "end", "t": 1040.0, "attempt": 1, "exit": 0, "step": 20, "verdict": "finished", "retryable": False},
]


def test_a_rollback_is_badput_and_the_account_adds_up():
    run = account(ROLLED, now=5000.0)
    assert abs(run.goodput_s + sum(run.badput.values()) - run.wall_s) < 1e-6 and set(run.badput) == set(CAUSES)
    (a,) = run.attempts
    # 30 steps trained (10, then 10 lost, then 10 again), 20 kept; the windows hold 30 steps in 30 s less the
    # 1 s of checkpoints inside them: about 0.97 s a step, 10 of them replayed
    assert (a.steps, a.replayed_steps, run.replayed_steps) == (30, 10, 10)
    assert run.badput["replayed"] == pytest.approx(10 * 29.0 / 30)
    assert [(c.step, c.fate) for c in run.checkpoints] == [(10, ""), (15, "set aside by the rollback at step 20"),
                                                           (20, "newest")]
    text = render(run, "runs/x")
    assert "rollbacks: 1 (10 steps trained again; rank 2 on nodec)" in text, text


def test_a_killed_attempt_after_a_rollback_ends_where_it_trained_since():
    killed = [r for r in ROLLED if r["t"] < 1030]  # killed 4.5 s after the rollback, before its next line
    run = account(killed + [{**ROLLED[0], "t": 1100.0, "attempt": 2, "launched_t": 1095.0}], now=5000.0)
    assert run.attempts[0].last_step == 10  # not step 20 of the steps the rollback threw away


def test_the_health_gate_counts_a_rollback_toward_leaving_a_host_out():
    end = {"event": "end", "attempt": 2, "verdict": "infrastructure", "host": "nodec",
           "error": "Unhealthy: silent data corruption suspected at step 40, a second time on nodec", "cause": "x"}
    assert twice_failed([ROLLED[7]], ["nodea", "nodeb", "nodec"]) == {}
    left = twice_failed([ROLLED[7], end], ["nodea", "nodeb", "nodec"])
    assert list(left) == ["nodec"] and "step 20" in left["nodec"]
    two_ranks = {**ROLLED[7], "ranks": [1, 2], "hosts": ["nodec", "nodec"]}  # one rollback counts once per host
    assert twice_failed([two_ranks], ["nodec"]) == {}


# ---- a rollback in process, on one rank ---------------------------------------------------------------

DATA = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))  # 8 steps an epoch at batch 8


OUTVOTED = Vote((1, 2), (0,))  # rank 0 against ranks 1 and 2


def _train(run_dir, mode: str, rollback_at: int | None, monkeypatch, ckpt_every: int = 5, vote_: Vote = OUTVOTED,
           hook=None, stop_at: int | None = None, **init):
    """3 epochs (24 steps) of a model with dropout (RNG) on a shuffled loader, a sync check every 6 steps; at
    step `rollback_at` the check "finds" rank 0 outvoted (one rank cannot disagree with itself: the vote is
    stood in for, the rollback is the real one). `stop_at`: a stop signal agreed at that step (explicit mode);
    `init`: more (or other) keywords of ddp_kit.init. Returns the final weights and the run's steps."""
    import ddp_kit
    from ddp_kit.boundary import rollback
    from ddp_kit.env import DistEnv

    found: list[int] = []

    def detect(b, done, extra):  # once: the step trained again after the rollback is sound
        if done != rollback_at or found:
            return None
        found.append(done)
        return Divergence(done, vote_, 1, {0: ("0.weight",)}, {0: "here"}, len(vote_.majority + vote_.minority))

    monkeypatch.setattr(rollback, "detect", detect)
    run = ddp_kit.init(**{"run_dir": str(run_dir), "env": DistEnv(), "device": "cpu", "resume": "never", "log_every": 4,
                          "sync_check_every": 6, "ckpt_every": ckpt_every, "hang_timeout_s": 0, "config": {"case": "sdc"},
                          **init})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, loader, opt = run.prepare(model, DataLoader(DATA, batch_size=8, shuffle=True), opt)
    if hook is not None:
        run._boundary.attach(hook)
    with run:  # an error ends the run as a script's would: one line, SystemExit
        run.resume(optimizer=opt)
        for _ in run.epochs(3):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if mode == "explicit":
                    run.step(loss)
                if run.steps_done == stop_at:
                    run._boundary.stop(signal.SIGTERM)  # as the stop check does when every rank saw the signal
        steps = run.steps_done
        weights = {k: v.clone() for k, v in run.unwrap(model).state_dict().items()}
    return weights, steps


@pytest.mark.parametrize("mode,ckpt_every", [("explicit", 6), ("implicit", 5)])
def test_a_rollback_in_process_ends_on_the_uninterrupted_weights(tmp_path, monkeypatch, capsys, mode, ckpt_every):
    expected, steps = _train(tmp_path / "plain", mode, None, monkeypatch, ckpt_every)
    assert steps == 24
    # At step 18 the ranks last agreed at 12: back to 12 (ckpt_every 6), or to 10 (ckpt_every 5: 15 is after the
    # agreement and is set aside) -- in epoch 1, from epoch 2: run.epochs must go back an epoch too.
    got, steps = _train(tmp_path / "rolled", mode, 18, monkeypatch, ckpt_every)
    to = 12 if ckpt_every == 6 else 10
    out = capsys.readouterr().out
    said = [ln for ln in out.splitlines() if "silent data corruption" in ln]
    assert len(said) == 1 and f"rolled back to step {to}" in said[0] and "rank 0 (host here)" in said[0], out
    assert steps == 24 and all(torch.equal(got[k], expected[k]) for k in expected)
    run_dir = tmp_path / "rolled"
    ledger = [json.loads(ln) for ln in (run_dir / "attempts.jsonl").read_text().splitlines()]
    (rb,) = [r for r in ledger if r["event"] == "rollback"]
    assert (rb["step"], rb["to"], rb["lost"], rb["agreed"], rb["ranks"], rb["hosts"]) == (18, to, 18 - to, 12, [0], ["here"])
    if ckpt_every == 5:  # step 15 came after the agreement: moved aside, `latest` names step 10 until 15 is saved again
        assert list((run_dir / "archive").glob("*/step_15"))
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["step"] for r in metrics if r["event"] == "train" and "loss" in r]
    assert train == sorted(train) and len(train) == len(set(train))  # one lineage: the abandoned records moved aside


def test_prune_spares_the_newest_step_at_or_before_the_last_agreed_one(tmp_path):
    from ddp_kit.checkpoint import layout, steps
    from ddp_kit.checkpoint.storage_folder import FolderStorage

    storage = FolderStorage(tmp_path)
    for step in (10, 12, 14, 16):
        (tmp_path / layout.step_name(step)).mkdir()
        (tmp_path / layout.step_name(step) / layout.MANIFEST).write_text("{}")
        (tmp_path / layout.step_name(step) / layout.META).write_text(json.dumps({"agreed": 11}))
    assert steps.prune(storage, 16, keep_last=2) == [12]  # 10: the newest at or before step 11, where a rollback goes
    assert steps.committed(steps.objects(storage)) == [16, 14, 10]


def test_a_rollback_finds_its_step_when_checkpoints_come_often_and_few_are_kept(tmp_path, monkeypatch, capsys):
    # A checkpoint every 2 steps, 2 kept: at step 18 (the ranks agreed at 12) keep_last alone would have left 14
    # and 16 only, nothing to roll back to. Every checkpoint's meta names step 12 (or 6): prune spares it.
    expected, _ = _train(tmp_path / "plain", "explicit", None, monkeypatch, 2, keep_last=2)
    got, steps = _train(tmp_path / "rolled", "explicit", 18, monkeypatch, 2, keep_last=2)
    said = [ln for ln in capsys.readouterr().out.splitlines() if "silent data corruption" in ln]
    assert len(said) == 1 and "rolled back to step 12 (the last step the ranks agreed)" in said[0], said
    assert steps == 24 and all(torch.equal(got[k], expected[k]) for k in expected)
    meta = json.loads((tmp_path / "rolled" / "checkpoints" / "step_22" / "meta.json").read_text())
    assert meta["agreed"] == 18  # step 18's check passed the second time; the final checkpoint's check is its own
    assert sorted(p.name for p in (tmp_path / "rolled" / "checkpoints").glob("step_*")) == ["step_22", "step_24"]


def test_the_final_checkpoint_is_compared_first_and_refused_diverged(tmp_path, monkeypatch, capsys):
    # Sync checks at 10 and 20, and the run ends at 24: nothing compared steps 21-24 before the final checkpoint,
    # which every rank would resume from. The check before it finds the divergence; the loop is over, so it is not
    # saved, and a rerun resumes from step 20 (the last agreed), trains 21-24 again, and ends on the right weights.
    expected, _ = _train(tmp_path / "plain", "explicit", None, monkeypatch, sync_check_every=10)
    with pytest.raises(SystemExit) as stopped:
        _train(tmp_path / "run", "explicit", 24, monkeypatch, sync_check_every=10)
    assert stopped.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ddp_kit: error:")]
    assert line.startswith("ddp_kit: error: parameters diverged across ranks at step 24 (checked before the final "
                           "checkpoint), silent data corruption suspected: rank 0 (host here)"), line
    assert "(hint: a rerun resumes from step 20 and trains the steps after it again" in line, line
    assert not (tmp_path / "run" / "checkpoints" / "step_24").exists() and not (tmp_path / "run" / "summary.json").exists()
    got, steps = _train(tmp_path / "run", "explicit", None, monkeypatch, sync_check_every=10, resume="auto")
    assert steps == 24 and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_stop_compares_the_weights_before_its_checkpoint_and_rolls_back_first(tmp_path, monkeypatch, capsys):
    # A stop at step 22 (sync checks at 10 and 20): its checkpoint is what the requeued job resumes from. The
    # weights differ: every rank rolls back to step 20 in process, and the stop keeps that (durable already).
    with pytest.raises(SystemExit) as stopped:
        _train(tmp_path, "explicit", 22, monkeypatch, stop_at=22, sync_check_every=10)
    assert stopped.value.code == 75  # a stop, as without the divergence: the requeued job resumes from step 20
    captured = capsys.readouterr()
    assert "silent data corruption suspected at step 22: rank 0 (host here)" in captured.out, captured.out
    assert "rolled back to step 20" in captured.out and "after step 20: checkpoint saved" in captured.err, captured
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_20"
    assert not (tmp_path / "checkpoints" / "step_22").exists()


class Told(StepHooks):
    """What the hooks are told of resumes: (step, the checkpoint's (epoch, position)) per call."""

    def __init__(self):
        self.calls = []

    def resumed(self, b, meta):
        self.calls.append((b.steps.done, (meta.get("epoch"), meta.get("position"))))


def test_a_rollback_tells_the_hooks_as_a_resume_does(tmp_path, monkeypatch):
    told = Told()
    _train(tmp_path, "explicit", 18, monkeypatch, 6, hook=told)
    # run.resume at a fresh start ({}: nothing read), then the rollback to step 12 (epoch 1, 32 samples into it)
    assert told.calls == [(0, (None, None)), (12, (1, 32))]


@pytest.mark.parametrize("case", ["no majority", "no checkpoint"])
def test_when_it_cannot_roll_back_it_stops_in_one_line_and_sets_aside_what_came_after(tmp_path, monkeypatch, capsys, case):
    # At step 18 the ranks last agreed at step 12. ckpt_every 4: steps 8, 12 and 16 kept (keep_last 3), and no
    # majority; ckpt_every 13: only step 13, after the agreement. What came after step 12 may hold the corruption:
    # it moves to the archive, so that the rerun resumes where the ranks agreed.
    every, vote_ = (4, Vote((), (0, 1))) if case == "no majority" else (13, OUTVOTED)
    with pytest.raises(SystemExit) as stopped:
        _train(tmp_path, "explicit", 18, monkeypatch, every, vote_)
    assert stopped.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ddp_kit: error:")]
    assert line.startswith("ddp_kit: error: parameters diverged across ranks at step 18 (sync check)"), line
    assert "the checkpoints after step 12 are set aside" in line, line
    if case == "no majority":
        assert "rank 0 (host here): 0.weight; with 2 replicas there is no majority" in line, line
        assert "a rerun resumes from step 12" in line, line
    else:
        assert "no checkpoint at or before step 12" in line and "ckpt_every 6" in line, line
        assert "a rerun starts from the beginning" in line, line
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == (["step_12", "step_8"] if case == "no majority" else [])
    moved = [p.name for p in (tmp_path / "archive").glob("*/step_*")]
    assert moved == (["step_16"] if case == "no majority" else ["step_13"])
    latest = tmp_path / "checkpoints" / "latest"
    assert (latest.read_text().strip() == "step_12") if case == "no majority" else not latest.exists()


@pytest.mark.parametrize("ckpt_every", [6, 4])
def test_a_divergence_at_the_first_sync_check_says_there_is_nothing_agreed_to_go_back_to(tmp_path, monkeypatch, capsys,
                                                                                        ckpt_every):
    # The first check (step 6) runs before step 6's save: the ranks agreed only at the start, which no checkpoint
    # holds, whatever ckpt_every is. With ckpt_every 6 (a divisor already) the hint must not ask for one.
    with pytest.raises(SystemExit):
        _train(tmp_path, "explicit", 6, monkeypatch, ckpt_every)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ddp_kit: error:")]
    assert "this is the run's first sync check: the ranks agreed only at the start" in line, line
    assert "(hint: a rerun starts from the beginning" in line, line
    if ckpt_every == 6:
        assert "divisor" not in line and "a divergence at a later sync check rolls back in process" in line, line
    else:  # step 4 came after the agreement: set aside; and 4 does not divide 6
        assert "the checkpoints after step 0 are set aside" in line and "ckpt_every a divisor" in line, line
        assert [p.name for p in (tmp_path / "archive").glob("*/step_*")] == ["step_4"]


def test_a_stop_drops_the_memory_copies_after_the_agreement_so_the_rerun_resumes_where_the_ranks_agreed(
        tmp_path, monkeypatch, capsys):
    # Memory copies every 4 steps, checkpoints every 6: at step 18 (no majority; the ranks agreed at 12) the newest
    # copies are step 16's, taken after the agreement, each rank its own (the corrupt one's too). Left in node
    # memory, the rerun would resume from them (each rank its own) and meet the divergence again.
    monkeypatch.setenv("DDP_KIT_MEM_DIR", str(tmp_path / "mem"))
    with pytest.raises(SystemExit):
        _train(tmp_path / "run", "explicit", 18, monkeypatch, 6, Vote((), (0, 1)), mem_ckpt_every=4)
    told = Told()
    _, steps = _train(tmp_path / "run", "explicit", None, monkeypatch, 6, hook=told, mem_ckpt_every=4, resume="auto")
    assert told.calls[0][0] == 12 and steps == 24, told.calls


def test_a_divergence_that_follows_the_ranks_to_other_hosts_at_the_same_step_is_the_programs(tmp_path, monkeypatch,
                                                                                          capsys):
    """An earlier attempt's ledger: rank 0 outvoted at step 18 on host "elsewhere" (since left out). Now rank 0
    on host "here" disagrees at step 18 again: a fault follows the hosts, a program follows the ranks. One line,
    exit 2 (not retried as infrastructure); on the same host it would be the host's second time (the test above)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "attempts.jsonl").write_text(json.dumps({"event": "rollback", "t": 1.0, "attempt": 1, "step": 18, "to": 12,
                                                        "ranks": [0], "hosts": ["elsewhere"]}) + "\n")
    with pytest.raises(SystemExit) as ended:
        _train(run_dir, "explicit", 18, monkeypatch, 6)
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if "diverged" in ln]
    assert ended.value.code == 2 and len(lines) == 1, out.err[-3000:]
    assert "as at step 18 of attempt 1 on other hosts" in lines[0] and "is the program's" in lines[0], lines
    assert "silent data corruption" not in out.out  # no rollback this time
