"""keep_best: the best K checkpoints by a metric, kept beside the newest keep_last (services/keep_best.py).

Unit tier: the pure parts (which value a record holds, the ranks' one score, the best set), the service
on a boundary of one rank (its decision into b.meta, taken back at resume), prune on a folder and on two
fsspec URLs through the real backends (the same steps.prune as s3://), the CLI's marks, the one-line
refusals. Integration: two ranks under torchrun with a user's script that reports the metric on rank 0
only, or on every rank with its own value, and a second run that resumes and remembers the best so far."""
import json
import uuid
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from ddp_kit.errors import UserError
from ddp_kit.services.keep_best import KeepBest, agreed, choose, contribution, make, value_of

# ---- the pure parts --------------------------------------------------------------------------------

@pytest.mark.parametrize("record, monitor, want", [
    ({"event": "eval", "eval_loss": 0.25, "eval_accuracy": 0.9}, "eval.loss", 0.25),  # the reference job's naming
    ({"event": "eval", "eval_loss": 0.25, "eval_accuracy": 0.9}, "eval.accuracy", 0.9),
    ({"event": "train", "loss": 1.5, "train_aux": 0.1}, "train.loss", 1.5),
    ({"event": "train", "loss": 1.5, "train_aux": 0.1}, "train.aux", 0.1),
    ({"event": "val", "f1": 3}, "val.f1", 3.0),  # a script's own record
    ({"event": "val", "f1": 0.5}, "f1", 0.5),  # no dot: the key in any record
    ({"event": "train", "loss": 1.5}, "eval.loss", None),  # another event
    ({"event": "eval", "eval_loss": "0.1"}, "eval.loss", None),
    ({"event": "eval", "eval_loss": True}, "eval.loss", None),
])
def test_value_of_a_record(record, monitor, want):
    assert value_of(record, monitor) == want


def test_choose_keeps_the_best_k_best_first_and_an_older_step_on_a_tie():
    scores = {2: 5.0, 4: 1.0, 6: 4.0, 8: 1.0, 10: 9.0}
    assert choose(scores, 2, "min") == [(4, 1.0), (8, 1.0)]
    assert choose(scores, 3, "max") == [(10, 9.0), (2, 5.0), (6, 4.0)]
    assert choose(scores, 1, "min") == [(4, 1.0)]  # a newer equal score does not replace it
    assert choose({}, 2, "min") == []


def _reduced(values):
    """What the one all-reduce gives: every rank's contribution summed, element by element."""
    count, total = (sum(c) for c in zip(*[contribution(v) for v in values]))
    return agreed(count, total)


def test_the_score_is_the_mean_over_the_ranks_that_reported_it():
    assert _reduced([0.5, None, None, None]) == 0.5  # rank 0 only: its value, not a quarter of it
    assert _reduced([None, None, 0.5, None]) == 0.5  # any one rank
    assert _reduced([1.0, 2.0, 3.0, 6.0]) == 3.0  # every rank, each its own value: their mean
    assert _reduced([1.0, None, 3.0, None]) == 2.0
    assert _reduced([None, None]) is None  # nobody reported it: this checkpoint is not a candidate


# ---- the service on one rank -----------------------------------------------------------------------

def _boundary(done=0):
    said = []
    return SimpleNamespace(ctx=SimpleNamespace(world_size=1, is_main=True), steps=SimpleNamespace(done=done, saved=-1),
                           meta={}, say=said.append, said=said, collective=lambda phase: nullcontext())


def test_each_durable_checkpoint_takes_one_decision_into_its_meta():
    b, hook = _boundary(), KeepBest(2, "eval.loss", "min")
    hook.attach(b)
    assert b.meta["keep_best"] == {"monitor": "eval.loss", "mode": "min", "k": 2, "best": []}
    for step, loss in ((10, 0.5), (20, 0.3), (30, 0.4), (40, 0.9)):
        hook.logged(b, {"event": "train", "step": step, "loss": 7.0})
        hook.logged(b, {"event": "eval", "step": step, "eval_loss": loss})
        b.steps.done = step
        hook.saving(b)
        b.steps.saved = step  # the save returned (saving.save), and the core tells the hooks
        hook.saved(b, "durable", 0.1)
    hook.saving(b)  # a checkpoint with no new value: no score, the set stands
    assert b.meta["keep_best"]["best"] == [[20, 0.3], [30, 0.4]]
    assert b.said[1] == "ddp_kit: keep_best: step_20 eval.loss=0.3 is #1 of the best 2 (kept: step_20 0.3, step_10 0.5)"
    assert "step_40 eval.loss=0.9 is not among the best 2" in b.said[3]
    assert hook.summary(b)["keep_best"]["best"] == [[20, 0.3], [30, 0.4]]


def _saving_step_10():
    """A keep_best of 2 (eval.loss, min) that has scored step 10 and is saving it."""
    b, hook = _boundary(), KeepBest(2, "eval.loss", "min")
    hook.attach(b)
    hook.logged(b, {"event": "eval", "step": 10, "eval_loss": 0.1})
    b.steps.done = 10
    hook.saving(b)
    return b, hook


def test_a_step_whose_save_failed_is_never_named_and_the_run_goes_on():
    b, hook = _saving_step_10()
    assert b.meta["keep_best"]["best"] == [[10, 0.1]]  # its own meta names it: the save that makes it exist
    # the save raised (b.steps.saved stays behind) and the script went on: the next step leaves it out
    b.steps.done = 11
    hook.after_step(b)
    assert hook.best == [] and b.meta["keep_best"]["best"] == []
    assert "step_10 was not saved" in b.said[-1]
    hook.logged(b, {"event": "eval", "step": 20, "eval_loss": 0.5})
    b.steps.done = 20
    hook.saving(b)
    b.steps.saved = 20
    hook.saved(b, "durable", 0.1)
    assert hook.best == [(20, 0.5)] and hook.summary(b)["keep_best"]["best"] == [[20, 0.5]]


def test_a_save_made_outside_the_tiers_schedule_counts_at_the_next_decision():
    # run.save(), a stop's and the final checkpoint call no `saved` hook: the step is taken at the next look
    b, hook = _saving_step_10()
    b.steps.saved = 10
    assert hook.summary(b)["keep_best"]["best"] == [[10, 0.1]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_score_that_is_not_finite_is_said_and_never_kept(bad):
    # value_of dropped NaN and inf, so the decision never saw them and the "not finite" warning never fired
    b, hook = _boundary(), KeepBest(2, "eval.loss", "min")
    hook.attach(b)
    hook.logged(b, {"event": "eval", "step": 10, "eval_loss": bad})
    b.steps.done = 10
    hook.saving(b)
    b.steps.saved = 10
    assert "eval.loss at step 10 is not finite: not a candidate" in b.said[-1]
    assert hook.summary(b)["keep_best"]["best"] == [] and b.meta["keep_best"]["best"] == []
    saved = {"keep_best": {"monitor": "eval.loss", "mode": "min", "k": 2, "best": [[5, bad], [8, 0.2]]}}
    hook.resumed(b, saved)
    assert hook.best == [(8, 0.2)]


def test_resume_takes_the_best_back_and_a_changed_monitor_starts_over():
    saved = {"keep_best": {"monitor": "eval.loss", "mode": "min", "k": 3, "best": [[20, 0.3], [30, 0.4], [10, 0.5]]}}
    b, hook = _boundary(done=30), KeepBest(2, "eval.loss", "min")
    hook.resumed(b, saved)
    assert hook.best == [(20, 0.3), (30, 0.4)]  # K lowered from 3 to 2: trimmed at once
    assert b.meta["keep_best"]["best"] == [[20, 0.3], [30, 0.4]]
    assert "the best 2 by eval.loss so far: step_20 0.3, step_30 0.4" in b.said[-1]
    hook.resumed(b, {})  # nothing read (a peer's state): what it holds stands
    assert hook.best == [(20, 0.3), (30, 0.4)]
    other = KeepBest(2, "eval.accuracy", "max")
    other.resumed(b, saved)
    assert other.best == [] and "starting over" in b.said[-1]


def test_a_monitor_that_never_matches_is_said_at_the_end_with_the_names_seen():
    b, hook = _boundary(done=5), KeepBest(1, "eval.los", "min")
    hook.logged(b, {"event": "eval", "step": 5, "eval_loss": 0.3})
    hook.saving(b)
    hook.ending(b, 0)
    assert "no checkpoint got a score" in b.said[-1] and "eval.eval_loss" in b.said[-1]


def test_off_by_default_and_wrong_settings_are_one_line():
    from ddp_kit import service_registry

    defaults = service_registry.settings({}, "runs/x")
    assert (defaults["keep_best"], defaults["monitor"], defaults["mode"]) == (0, "", "min")
    assert make(None, defaults) is None  # nothing attached, nothing on the step path
    for given, run_dir, said in [({"keep_best": 2}, "runs/x", "monitor is empty"),
                                 ({"keep_best": 2, "monitor": "eval.loss", "mode": "avg"}, "runs/x", "must be min or max"),
                                 ({"keep_best": 2, "monitor": "eval.loss"}, None, "no run folder"),
                                 ({"keep_best": -1}, "runs/x", "'keep_best' must be >= 0")]:
        with pytest.raises(UserError) as err:
            service_registry.settings(given, run_dir)
        assert said in err.value.line() and "\n" not in err.value.line()


# ---- prune, on a folder and on URLs --------------------------------------------------------------

def _alone():
    import torch

    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(DistEnv(), torch.device("cpu"), "gloo")


@pytest.fixture(params=["folder", "file", "memory"])
def location(request, tmp_path):
    return {"folder": str(tmp_path / "ck"), "file": f"file://{tmp_path}/ck",
            "memory": f"memory://bucket-{uuid.uuid4().hex[:8]}/run"}[request.param]


def test_prune_keeps_the_best_the_newest_meta_names_on_folders_and_urls(location, capsys):
    import torch

    from ddp_kit.checkpoint import cli, open_backend, steps

    ck = open_backend(location, _alone(), one_writer=False, keep_last=1)
    best = {1: [], 2: [[2, 0.5]], 3: [[2, 0.5], [3, 0.7]], 4: [[4, 0.1], [2, 0.5]], 5: [[4, 0.1], [2, 0.5]]}
    for step, kept in best.items():
        ck.save(step, {"model": {"w": torch.zeros(2)}, "loop": {"step": step}}, {"rng": torch.get_rng_state()},
                {"strategy": "ddp", "keep_best": {"monitor": "eval.loss", "mode": "min", "k": 2, "best": kept}})
        ck.wait()
    assert steps.committed(steps.objects(ck.storage)) == [5, 4, 2]  # 1 and 3 (no longer best) went
    cli.list_(location)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["4"].endswith("best #1 eval.loss=0.1000") and rows["2"].endswith("best #2 eval.loss=0.5000")
    assert rows["5"].endswith("step_5 (latest)")  # the newest, kept as keep_last, not among the best
    ck.close()


def test_prune_deletes_no_committed_step_when_the_newest_meta_cannot_be_read(tmp_path):
    from ddp_kit.checkpoint import layout, steps
    from ddp_kit.checkpoint.storage_folder import FolderStorage

    storage = FolderStorage(tmp_path)
    for step in (1, 2, 3):
        for rel, body in ((layout.META, b"{not json" if step == 3 else b"{}"), (layout.MANIFEST, b"{}")):
            (tmp_path / layout.step_name(step)).mkdir(exist_ok=True)
            (tmp_path / layout.step_name(step) / rel).write_bytes(body)
    assert steps.prune(storage, 3, keep_last=1) == []
    (tmp_path / layout.step_name(3) / layout.META).write_text(json.dumps({"keep_best": {"monitor": "m", "best": [[1, 0.0]]}}))
    assert steps.prune(storage, 3, keep_last=1) == [2]


# ---- two ranks -----------------------------------------------------------------------------------

def _script(run_dir, steps, who):
    from conftest import HELPERS, ok, torchrun

    return ok(torchrun([str(HELPERS / "keep_best_script.py"), str(run_dir), str(steps), who], timeout=120))


def _kept(run_dir):
    from ddp_kit.checkpoint import steps
    from ddp_kit.checkpoint.storage_folder import FolderStorage

    storage = FolderStorage(run_dir / "checkpoints")
    newest = steps.committed(steps.objects(storage))
    meta = json.loads((run_dir / "checkpoints" / f"step_{newest[0]}" / "meta.json").read_text())
    return newest, meta["keep_best"]["best"]


@pytest.mark.integration
def test_a_metric_logged_on_rank_0_only_keeps_the_best_and_a_resume_remembers_them(tmp_path, capsys):
    """Rank 0 alone reports val.score (Lightning#19072's case): the score is its value on both ranks; a
    second run to step 14 resumes from step 8 and still keeps step 4, the best so far, beside step 14."""
    from ddp_kit.checkpoint import cli

    run = tmp_path / "run"
    res = _script(run, 8, "rank0")
    assert _kept(run) == ([8, 6, 4], [[4, 1.0], [6, 4.0]])  # scores 5, 1, 4, 4.5: step 2 went, 6 stays
    assert "ddp_kit: keep_best: step_4 val.score=1 is #1 of the best 2 (kept: step_4 1, step_2 5)" in res.stdout
    res = _script(run, 14, "rank0")
    assert "ddp_kit: keep_best: the best 2 by val.score so far: step_4 1, step_6 4" in res.stdout
    assert _kept(run) == ([14, 4], [[4, 1.0], [14, 2.0]])  # 10 (6.0), 12 (7.0) and 6, evicted by 14, went
    cli.list_(str(run))
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["4"].endswith("best #1 val.score=1.0000") and rows["14"].endswith("(latest)  best #2 val.score=2.0000")


@pytest.mark.integration
def test_a_metric_every_rank_logs_with_its_own_value_is_ranked_by_the_mean(tmp_path):
    """Rank 0's values alone would keep steps 4 and 6; the means (1, 5, 4, 4.5) keep steps 2 and 6."""
    run = tmp_path / "run"
    res = _script(run, 8, "every")
    assert _kept(run) == ([8, 6, 2], [[2, 1.0], [6, 4.0]])
    assert "step_6 val.score=4 is #2 of the best 2 (kept: step_2 1, step_6 4)" in res.stdout  # step 4 (5) evicted
