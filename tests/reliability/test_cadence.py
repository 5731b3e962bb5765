"""`ckpt_every auto` and `mem_ckpt_every auto` in a real run: torchrun, 2 ranks (gloo), rank 1 SIGKILLed at a
known step and the workers restarted by torchrun. Every checkpoint file write slowed by 20 ms, so that the
durable save costs clearly more than the memory copy."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ok, proc_env, torchrun

pytestmark = pytest.mark.integration


def test_auto_measures_each_tier_then_saves_more_often_after_a_failure(tmp_path):
    run = tmp_path / "run"
    args = ["-m", "ddp_kit.train", "--max_steps", "2000", "--epochs", "1000", "--eval_every_epoch", "false",
            "--ckpt_every", "auto", "--mem_ckpt_every", "auto", "--log_every", "50", "--progress", "false",
            "--run_dir", str(run), "--debug_ckpt_delay_s", "0.02", "--inject", "kill:rank=1:step=1200"]
    res = ok(torchrun(args, extra=["--max-restarts=1"], timeout=240))
    records = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    shown = "\n".join(json.dumps(r)[:400] for r in records if r["event"] in ("cadence", "resume", "end", "checkpoint"))
    ends = [r for r in records if r["event"] == "end"]
    assert [e["verdict"] for e in ends] == ["lost_peer", "finished"], shown + res.stderr[-2000:]

    lines = [r for r in records if r["event"] == "cadence"]
    first, second = ([r for r in lines if r["attempt"] == n] for n in (1, 2))
    # Attempt 1: neither cost known, both tiers save at the first stop check, then each has its own cost and
    # an interval from the prior alone (no failure yet): long, the durable one bounding the memory tier's.
    assert first[0]["tiers"]["durable"]["cost_s"] is None and first[0]["tiers"]["memory"]["cost_s"] is None, shown
    measured = [r["tiers"] for r in first if r["tiers"]["durable"]["cost_s"] and r["tiers"]["memory"]["cost_s"]]
    assert measured, shown
    durable, memory = measured[-1]["durable"], measured[-1]["memory"]
    assert durable["cost_s"] >= 0.02 > memory["cost_s"], shown  # each tier's own cost, measured
    # No failure yet: one per the time run (seconds here), the durable tier's a tenth of it under the memory
    # tier; Young's interval for each: sqrt(2 C t), and sqrt(2 C t / 0.1).
    for tier, share in ((memory, 1.0), (durable, 0.1)):  # at least a step (a busy machine's step may be longer)
        young = math.sqrt(2 * tier["cost_s"] * tier["hours"] * 3600 / share)
        assert tier["every_s"] == pytest.approx(max(young, tier["step_s"] or 0.0), rel=0.02), shown
    assert durable["every_s"] > memory["every_s"], shown
    # The kill at step 1200 was covered by a copy taken moments before: few steps trained again (a prior of
    # 1000 h alone would have put the copies 30 min apart: back to step 20). Usually the memory tier's; in the
    # moments after a durable save (which resets the memory tier's clock) the durable one is the newest.
    resumed = [r for r in records if r["event"] == "resume" and r["attempt"] == 2]
    assert resumed and resumed[0]["tier"] in ("memory", "durable") and 1200 - resumed[0]["step"] < 200, shown
    after = second[0]["tiers"]
    # Attempt 2 counts the kill for the memory tier; for the durable tier only if the memory tier did not cover it.
    uncovered = int(resumed[0]["tier"] == "durable")
    assert after["memory"]["failures"] == 1 and after["durable"]["failures"] == uncovered, shown
    assert after["memory"]["rate_per_h"] == pytest.approx(1 / after["memory"]["hours"], rel=0.02), shown
    assert after["memory"]["loss_s_per_h"] <= after["memory"]["fixed_loss_s_per_h"], shown

    status = subprocess.run([sys.executable, "-m", "ddp_kit.status", str(run)], capture_output=True, text=True,
                            env=proc_env(), timeout=60)
    assert "checkpoint interval (auto;" in status.stdout and "1 failure" in status.stdout, status.stdout + status.stderr
