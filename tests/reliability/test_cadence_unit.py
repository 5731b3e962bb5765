"""The automatic checkpoint interval's arithmetic (reliability/cadence.py), on numbers and on two recorded
ledgers: real runs of the reference job with `--ckpt_every auto` (one also with `--mem_ckpt_every auto`),
one worker SIGKILLed at step 1500 (--inject kill), restarted by torchrun."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddp_kit.reliability import cadence
from ddp_kit.run_account import account
from ddp_kit.run_account_records import read

LEDGERS = Path(__file__).parent.parent / "golden" / "ledgers"


def test_youngs_interval_is_where_the_expected_loss_is_least():
    cost, rate = 2.0, 1.0  # a 2 s save, one failure an hour
    t = cadence.interval_s(cost, rate, 0.0, 1e9)
    assert t == pytest.approx(math.sqrt(2 * cost * 3600 / rate))
    at = cadence.loss_per_h(t, cost, rate)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert cadence.loss_per_h(t * factor, cost, rate) > at
    assert cadence.interval_s(cost, rate, 200.0, 1e9) == 200.0 and cadence.interval_s(cost, rate, 0.0, 60.0) == 60.0


def test_a_costlier_save_or_rarer_failures_give_a_longer_interval():
    base = cadence.interval_s(1.0, 2.0, 0.0, 1e9)
    assert cadence.interval_s(4.0, 2.0, 0.0, 1e9) == pytest.approx(2 * base)
    assert cadence.interval_s(1.0, 0.5, 0.0, 1e9) == pytest.approx(2 * base)


def test_the_prior_holds_until_failures_are_seen_and_then_they_outweigh_it():
    assert cadence.blended_rate(0, 5.0, 0.001) == 0.001
    three_in_an_hour = cadence.blended_rate(3, 1.0, 0.001)
    w = cadence.PRIOR_WEIGHT
    assert three_in_an_hour == pytest.approx((3 * 3 + w * 0.001) / (3 + w))
    assert 2.7 < three_in_an_hour < 3.0


def test_a_preemption_that_saved_is_no_failure_and_a_memory_resume_covers_one():
    def attempt(verdict, replayed=0, tier=None, seconds=1900.0):
        return SimpleNamespace(verdict=verdict, replayed_steps=replayed, resumed_tier=tier, duration_s=seconds,
                               seconds={"startup": 100.0, "goodput": seconds - 100.0})

    seen = [attempt("preempted"), attempt("preempted", replayed=40, tier="durable"), attempt("killed", tier="durable"),
            attempt("lost_peer", tier="memory"), attempt("program_error", tier="memory"), attempt("running", tier="peer")]
    got = cadence.failures_of(seen)
    # Four failures: the preemption that lost 40 steps (its successor resumed from the durable tier: not
    # covered), the kill, the lost peer and the error (each one's successor resumed from a memory copy).
    assert (got.count, got.uncovered, got.hours) == (4, 1, 3.0), got  # hours of training: start-ups left out


@pytest.mark.parametrize("name, uncovered, tiers", [("auto_durable_killed", 1, {"durable"}),
                                                    ("auto_memory_killed", 0, {"durable", "memory"})])
def test_recorded_ledgers_give_the_inputs_and_the_interval(name, uncovered, tiers):
    records, _ = read(LEDGERS / f"{name}.jsonl")
    attempts = account(records).attempts
    failures = cadence.failures_of(attempts)
    assert failures.count == 1 and failures.uncovered == uncovered, failures
    assert failures.hours == pytest.approx(sum(a.duration_s - a.seconds["startup"] for a in attempts) / 3600)
    costs, step_s = cadence.last_costs(records)
    assert set(costs) == tiers and step_s and 0 < step_s < 1, (costs, step_s)
    last_ckpt = [r for r in records if r["event"] == "checkpoint"][-1]
    assert costs["durable"] == last_ckpt["blocking_s"]  # the newest measurement of the durable save
    choice = cadence.choose(costs["durable"], failures.count, failures.hours, 0.001, step_s, 1800.0, 0.0)
    rate = cadence.rate_per_h(1, failures.hours, 0.001)
    assert rate == pytest.approx(1 / failures.hours)  # one failure in the run's hours: the observed rate
    assert choice.every_s == pytest.approx(math.sqrt(2 * costs["durable"] * 3600 / rate))
    assert choice.every_steps == round(choice.every_s / step_s)


def test_before_a_failure_the_rate_is_one_per_the_hours_run_until_the_prior_is_higher():
    """A run trusts no prior for longer than it has run: the interval grows as sqrt(2 C t)."""
    assert cadence.rate_per_h(0, 1.0, 0.001) == 1.0
    assert cadence.rate_per_h(0, 4.0, 0.001) == 0.25
    assert cadence.rate_per_h(0, 5000.0, 0.001) == 0.001  # past the prior's mean: the prior
    assert cadence.rate_per_h(0, 1.0, 0.001, share=0.1) == pytest.approx(0.1)  # the durable tier under memory
    one_h, four_h = (cadence.choose(10.0, 0, h, 0.001, 0.5, 1e9, 0.0).every_s for h in (1.0, 4.0))
    assert four_h == pytest.approx(2 * one_h) and one_h == pytest.approx(math.sqrt(2 * 10.0 * 3600))


def test_a_tier_not_measured_yet_saves_at_once_to_measure_it():
    c = cadence.choose(None, 0, 0.0, 0.001, None, 1800.0, 0.0)
    assert c.every_s == 0.0 and c.cost_s is None and c.loss_s_per_h is None


def test_auto_is_taken_in_any_case_as_the_command_line_takes_it():
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.errors import UserError

    policy = Policy(run_dir="runs/x", ckpt_every="Auto", mem_ckpt_every=" AUTO ")
    assert (policy.ckpt_every, policy.mem_ckpt_every) == ("auto", "auto")  # downstream compares with AUTO exactly
    assert Policy(run_dir="runs/x", ckpt_every=7).ckpt_every == 7
    with pytest.raises(UserError, match="'ckpt_every' must be a count >= 0 or \"auto\"; got 'automatic'"):
        Policy(run_dir="runs/x", ckpt_every="automatic")
