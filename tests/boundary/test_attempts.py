"""A crash loop ends (boundary/attempts.py): attempts that fail without a new checkpoint are counted,
preemptions and attempts that made progress are not; under a restarter the next attempt is refused."""
from __future__ import annotations

import json

import pytest

from conftest import torchrun
from ddp_kit.boundary.attempts import failed_in_a_row


def start(latest):
    return {"event": "start", "latest": latest}


def end(outcome, exit_code=1, step=3):
    return {"event": "end", "outcome": outcome, "exit": exit_code, "step": step}


def test_failures_without_progress_are_counted_and_a_preemption_or_progress_breaks_the_run():
    failed = [start(None), end("failed"), start(None), end("failed"), start(None)]  # the last one was killed
    assert len(failed_in_a_row(failed, latest=None)) == 3
    # the killed attempt committed step 10 before it died: progress, nothing counts
    assert failed_in_a_row(failed, latest=10) == []
    # a preemption in between: only the failures after it
    mixed = [start(None), end("failed"), start(None), end("preempted", 75), start(None), end("failed")]
    assert len(failed_in_a_row(mixed, latest=None)) == 1
    # the second attempt resumed from step 5 (the first committed it): only the attempts since count
    progress = [start(None), end("failed"), start(5), end("failed"), start(5), end("failed")]
    assert len(failed_in_a_row(progress, latest=5)) == 2
    assert failed_in_a_row([start(None), end("done", 0)], latest=None) == []
    assert failed_in_a_row([start(None), end("user error", 2)], latest=None) == []


def test_an_attempt_the_next_one_resumed_further_from_made_progress():
    """The memory tier: no new durable checkpoint, but each attempt resumes further than the one before."""
    def resumed(attempt, step):
        return {"event": "resume", "attempt": attempt, "step": step}

    def begun(attempt):
        return {**start(None), "attempt": attempt}

    advancing = [begun(1), resumed(1, 0), end("failed"), begun(2), resumed(2, 90), end("failed"),
                 begun(3), resumed(3, 190), end("failed")]
    assert len(failed_in_a_row(advancing, latest=None)) == 1  # only the last: its progress shows at the next resume
    stuck = [begun(1), resumed(1, 90), end("failed"), begun(2), resumed(2, 90), end("failed"),
             begun(3), resumed(3, 90), end("failed")]
    assert len(failed_in_a_row(stuck, latest=None)) == 3


@pytest.mark.integration
def test_a_crash_loop_under_torchrun_restarts_is_stopped_after_three_attempts(tmp_path):
    """Rank 1 is SIGKILLed at step 3 of every attempt, before the first checkpoint: torchrun --max-restarts 3
    runs it three times, and the fourth attempt stops at startup with one line and exit 2. (A kill leaves
    no exception to compare: the repeat rule, which stops the same exception at its second attempt, is
    tests/reliability/test_verdicts.py's; this is the count of failures without progress.)"""
    res = torchrun(["-m", "ddp_kit.train", "--epochs", "1", "--progress", "false", "--ckpt_every", "100",
                    "--run_dir", str(tmp_path), "--inject", "kill:rank=1:step=3:always=1"], extra=["--max-restarts", "3"],
                   timeout=300)
    assert res.returncode != 0
    refused = [ln for ln in res.stderr.splitlines() if "failed without a new checkpoint" in ln]
    assert len(refused) == 1 and "the last 3 attempts" in refused[0] and "max_failed_attempts" in refused[0], \
        res.stderr[-4000:]
    records = [json.loads(ln) for ln in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    # Three starts; an end only where rank 0 got to write one (the fail-fast thread ends it at once
    # when another rank failed: no end, which counts as failed, as a kill does).
    assert [r["event"] for r in records].count("start") == 3, records
    assert all(r["outcome"] == "failed" for r in records if r["event"] == "end"), records
