"""Experiment trackers in-process: option parsing and refusals, which tracker run an attempt continues,
the hub's queueing, skipping and bounds (with stand-in trackers), and TensorBoard's purge on its own
event files. The real stores (an MLflow server, W&B's offline files) are in test_trackers.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

from ddp_kit.boundary.policy import Policy
from ddp_kit.boundary.tracking import lineage
from ddp_kit.errors import UserError
from ddp_kit.trackers import hub as hub_module
from ddp_kit.trackers import parse
from ddp_kit.trackers.base import Opening, Tracker, scalars
from ddp_kit.trackers.hub import Hub, TrackerRuns
from ddp_kit.train.config import resolve


def test_trackers_option_takes_a_list_or_a_comma_string_and_refuses_unknown_names(tmp_path):
    assert parse(["TensorBoard", "mlflow", "mlflow"]) == ("tensorboard", "mlflow")
    assert parse("tensorboard, wandb") == ("tensorboard", "wandb")
    assert parse("") == parse("none") == parse(None) == ()
    assert Policy(run_dir=str(tmp_path), trackers="tensorboard,mlflow").trackers == ("tensorboard", "mlflow")
    with pytest.raises(UserError) as err:
        Policy(trackers=["wandbb"])
    assert err.value.line() == ("ddp_kit: error: unknown tracker 'wandbb' (hint: did you mean wandb? known: tensorboard, "
                                "mlflow, wandb)")
    # fire hands `--trackers tensorboard,mlflow` over as a tuple; the config keeps the comma list
    assert resolve(None, {"trackers": ("tensorboard", "mlflow")}).trackers == "tensorboard,mlflow"
    with pytest.raises(UserError, match="unknown tracker 'nope'"):
        resolve(None, {"trackers": "nope"})


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(UserError) as err:
        Policy(trackers=("mlflow",))
    assert err.value.line() == ("ddp_kit: error: tracker mlflow needs the mlflow package, which is not installed "
                                "(hint: pip install 'ddp_kit[mlflow]' (or pip install mlflow), or drop mlflow from trackers)")


def test_tensorboard_needs_a_run_folder():
    with pytest.raises(UserError, match="tracker tensorboard writes into the run folder, and this run has none"):
        Policy(trackers=("tensorboard",))


def test_a_record_becomes_scalars_named_by_its_event():
    record = {"event": "train", "step": 5, "epoch": 0, "loss": 0.5, "lr": 1e-3, "note": "x",
              "ranks": [{"rank": 0, "local_s": 0.002, "peak_mem_mb": 100.0}, {"rank": 1, "local_s": 0.003,
                                                                            "peak_mem_mb": 101.0}]}
    assert scalars(record) == {"train/loss": 0.5, "train/lr": 1e-3, "ranks/local_ms/rank0": 2.0,
                               "ranks/local_ms/rank1": 3.0, "ranks/peak_mem_mb/rank0": 100.0,
                               "ranks/peak_mem_mb/rank1": 101.0}
    assert scalars({"event": "eval", "step": 22, "eval_loss": 0.25}) == {"eval/eval_loss": 0.25}
    assert scalars({"accuracy": 0.9}) == {"train/accuracy": 0.9}  # a script's own record without an event


@pytest.mark.parametrize("saved, here, fresh, same_job, expected", [
    ({}, {}, False, False, (None, None)),  # nothing to continue
    ({"w": {"run_id": "A", "logged_step": 10}}, {}, False, False, ("A", 10)),  # the checkpoint's (resumed elsewhere)
    ({"w": {"run_id": "A", "logged_step": 10}}, {"w": {"run_id": "A", "logged_step": 13}}, False, True, ("A", 13)),
    ({"w": {"run_id": "A", "logged_step": 10}}, {"w": {"run_id": "B", "logged_step": 30}}, False, True, ("A", 10)),
    ({}, {"w": {"run_id": "B", "logged_step": 7}}, False, True, ("B", 7)),  # a restart before any checkpoint
    ({}, {"w": {"run_id": "B", "logged_step": 7}}, False, False, (None, None)),  # a rerun by hand, no checkpoint
    ({"w": {"run_id": "A", "logged_step": 10}}, {"w": {"run_id": "A", "logged_step": 13}}, True, True, (None, None)),
])
def test_which_tracker_run_an_attempt_continues(saved, here, fresh, same_job, expected):
    assert lineage("w", saved, here, fresh=fresh, same_job=same_job) == expected


class Recorder(Tracker):
    """A stand-in tool: remembers what it was told; optionally fails or blocks at a given call."""

    def __init__(self, rewinds=False, fail_at=None, block_at=None):
        self.rewinds, self.fail_at, self.block_at = rewinds, fail_at, block_at
        self.calls: list = []
        self.release = threading.Event()
        self.location = "stand-in"

    def _maybe(self, what):
        self.calls.append(what)
        if what[0] == self.fail_at:
            raise ConnectionError("Connection refused\nsecond line")
        if what[0] == self.block_at:
            self.release.wait(30)

    def open(self, opening):
        self._maybe(("open", opening.run_id, opening.rewind_to))
        return opening.run_id or "new-run"

    def log(self, step, values, wall_time):
        self._maybe(("log", step, values))

    def close(self, exit_code):
        self._maybe(("close", exit_code))


def opened_hub(tmp_path, tools: dict, floors=None, said=None):
    said = [] if said is None else said
    hub = Hub(tuple(tools), active=True, say=said.append)
    openings = {n: Opening(run_dir=tmp_path, name="run", run_id="R" if (floors or {}).get(n) is not None else None,
                           rewind_to=10) for n in tools}
    meta: dict = {}
    ledger = TrackerRuns(tmp_path / "trackers.json", {n: {"run_id": "R", "logged_step": f} for n, f in (floors or {}).items()},
                    mirror=lambda e: meta.__setitem__("trackers", e))
    return hub, openings, ledger, meta, said


def test_the_hub_holds_records_until_open_skips_steps_sent_before_and_keeps_a_ledger(tmp_path):
    skip, rewind = Recorder(), Recorder(rewinds=True)
    hub, openings, ledger, meta, said = opened_hub(tmp_path, {"skip": skip, "rewind": rewind},
                                                   floors={"skip": 13, "rewind": 13})
    hub.log({"event": "recovery", "step": 10, "seconds": 1.0})  # before open: held
    hub.open(openings, {"skip": 13, "rewind": 13}, ledger, make={"skip": skip, "rewind": rewind}.__getitem__)
    for step in (15, 20):
        hub.log({"event": "train", "step": step, "loss": 1.0 / step, "note": "text only"})
    hub.log({"event": "checkpoint", "blocking_s": 0.1})  # no step: the last one seen
    hub.log({"event": "train", "step": 12, "loss": 0.5})  # below the floor: the skipping tool has it already
    hub.close(0)
    assert [c[1] for c in skip.calls if c[0] == "log"] == [15, 20, 20]
    assert [c[1] for c in rewind.calls if c[0] == "log"] == [10, 15, 20, 20, 12]  # TensorBoard-like: everything
    assert skip.calls[0] == ("open", "R", 10) and skip.calls[-1] == ("close", 0)
    written = json.loads((tmp_path / "trackers.json").read_text())
    assert written["skip"] == {"run_id": "R", "logged_step": 20} and meta["trackers"] == written
    assert said == []


def test_a_failing_tracker_is_one_warning_and_the_others_go_on(tmp_path):
    bad, good = Recorder(fail_at="log"), Recorder()
    hub, openings, ledger, _, said = opened_hub(tmp_path, {"bad": bad, "good": good})
    hub.open(openings, {}, ledger, make={"bad": bad, "good": good}.__getitem__)
    for step in range(1, 6):
        hub.log({"step": step, "loss": 1.0})
    hub.close(0)
    assert said == ["ddp_kit: warning: tracker bad (stand-in) failed (ConnectionError: Connection refused); the run "
                    "goes on without it (its records stay in metrics.jsonl)"]
    assert [c[1] for c in good.calls if c[0] == "log"] == [1, 2, 3, 4, 5] and good.calls[-1] == ("close", 0)
    assert ("close", 0) not in bad.calls


def test_a_tracker_that_does_not_answer_is_given_up_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "CALL_TIMEOUT_S", 0.3)
    stuck = Recorder(block_at="open")
    hub, openings, ledger, _, said = opened_hub(tmp_path, {"stuck": stuck})
    hub.open(openings, {}, ledger, make={"stuck": stuck}.__getitem__)
    hub.log({"step": 1, "loss": 1.0})
    took = time.monotonic()
    hub.close(0)  # would wait for the blocked open; gives up after the call's bound instead
    assert time.monotonic() - took < 5
    stuck.release.set()
    assert said == ["ddp_kit: warning: tracker stuck (stand-in) did not answer within 0.3s; the run goes on without it "
                    "(its records stay in metrics.jsonl)"]
    hub.close(0)  # a second close is a no-op
    assert len(said) == 1


def test_the_hub_is_a_no_op_on_the_ranks_that_do_not_log(tmp_path):
    hub = Hub(("tensorboard",), active=False)
    hub.log({"step": 1, "loss": 1.0})
    hub.open({}, {}, TrackerRuns(None, {}))
    hub.close(0)
    assert not hub.opened and not hub.has_pending


def test_tensorboard_purges_what_a_resume_computes_again(tmp_path):
    pytest.importorskip("tensorboard")
    from ddp_kit.trackers.tensorboard import TensorBoard
    from tracker_stores import tb_scalars

    first = TensorBoard()
    assert first.open(Opening(run_dir=tmp_path, name="run", run_id=None, config={"lr": 0.1})) == "tb"
    for step in (5, 10, 15):
        first.log(step, {"train/loss": 1.0 / step}, time.time())
    first.close(137)  # as if killed after step 15; the checkpoint it resumes from is step 10
    again = TensorBoard()
    again.open(Opening(run_dir=tmp_path, name="run", run_id="tb", rewind_to=10))
    for step in (15, 20):
        again.log(step, {"train/loss": 2.0 / step}, time.time())
    again.close(0)
    assert tb_scalars(tmp_path / "tb")["train/loss"] == [(5, pytest.approx(0.2)), (10, pytest.approx(0.1)),
                                                         (15, pytest.approx(2 / 15)), (20, pytest.approx(0.1))]
    fresh = TensorBoard()  # a new tracker run: the old folder goes to the archive, as metrics.jsonl's records do
    fresh.open(Opening(run_dir=tmp_path, name="run", run_id=None))
    fresh.close(0)
    assert [p.name for p in (tmp_path / "archive").glob("*/tb")] == ["tb"]
    assert "train/loss" not in tb_scalars(tmp_path / "tb")
