"""bench/ckpt_interval.py's pure parts: the kill schedule, the expected-loss model and the verdicts (the
bench itself runs the job under kills: minutes, run by hand; BENCHMARKS.md has its numbers)."""
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from ckpt_interval import expected_lost_s, kill_schedule, verdicts, young_s  # noqa: E402


def test_one_seed_gives_every_configuration_the_same_exponential_schedule():
    a, b = kill_schedule(3, 4.0, n=2000), kill_schedule(3, 4.0, n=2000)
    assert a == b and a != kill_schedule(4, 4.0, n=2000)
    assert min(a) > 0 and abs(statistics.mean(a) - 4.0) < 0.3  # mean 4 s; the sd of a mean of 2000 is 0.09 s
    assert abs(statistics.median(a) - 4.0 * math.log(2)) < 0.3  # exponential: the median is mean * ln 2


def test_the_model_is_least_near_youngs_interval():
    cost, mean, work = 0.6, 4.0, 100.0
    grid = [x / 100 for x in range(10, 1000)]
    best = min(grid, key=lambda t: expected_lost_s(t, cost, mean, work))
    assert abs(best - young_s(cost, mean)) / young_s(cost, mean) < 0.25  # Young is first order in cost/mean
    assert expected_lost_s(young_s(cost, mean), cost, mean, work) < 1.05 * expected_lost_s(best, cost, mean, work)
    assert expected_lost_s(1e9, cost, mean, work) == expected_lost_s(work, cost, mean, work)  # one segment at most


def test_auto_within_tolerance_everywhere_and_every_fixed_interval_worse_somewhere():
    lost = {"cheap": {"auto": 1.1, "60": 2.0, "200": 1.0, "600": 1.6, "2000": 9.0},
            "slow": {"auto": 10.5, "60": 40.0, "200": 20.0, "600": 10.0, "2000": 13.0}}
    v = verdicts(lost)
    assert v["cases"]["cheap"]["best_fixed"] == "200" and v["cases"]["slow"]["best_fixed"] == "600"
    assert v["auto_within_everywhere"] and v["every_fixed_worse_somewhere"]
    lost["slow"]["200"] = 11.0  # 200 is now within 15 % of the best in both cases
    assert not verdicts(lost)["every_fixed_worse_somewhere"]
    lost["cheap"]["auto"] = 1.2  # 20 % over the best
    assert not verdicts(lost)["auto_within_everywhere"]


def test_a_censored_run_is_a_lower_bound_never_the_best():
    lost = {"slow": {"auto": 10.0, "auto_prior": 9.0, "60": 5.0, "600": 10.0}}
    v = verdicts(lost, {"slow": {"60": True}})
    assert v["cases"]["slow"]["best_fixed"] == "600"
    assert v["auto_within_everywhere"] and v["auto_prior_within_everywhere"]
    assert not verdicts(lost, {"slow": {"auto": True}})["auto_within_everywhere"]
