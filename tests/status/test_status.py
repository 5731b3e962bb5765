"""The run ledger read back (ddp_kit/run_account.py) and `python -m ddp_kit.status` (ddp_kit/status.py), on
ledgers written by hand: a clean run, a SIGKILLed attempt, a preemption, a hang, a crash loop, a ledger
from before verdicts, a running run. Every expected number below is worked out by hand in the comment
beside it, from the lines the test writes; none comes from the code under test."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from ddp_kit.exit_codes import EXIT_USER_ERROR
from ddp_kit.run_account import CAUSES, account, load, read
from ddp_kit.status import main, render

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from status_bench import synthetic_run  # noqa: E402


def _write(run_dir: Path, records, tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


def _adds_up(run):
    assert abs(run.goodput_s + sum(run.badput.values()) - run.wall_s) < 1e-6, (run.goodput_s, run.badput, run.wall_s)
    assert set(run.badput) == set(CAUSES)


def _start(n, t, launched, latest=None, **kw):
    return {"event": "start", "t": t, "attempt": n, "launched_t": launched, "latest": latest, "restart_count": n - 1,
            "world_size": 2, "engine": "torchrun", "hosts": ["h0", "h1"], **kw}


def _end(n, t, step, verdict, exit_code, **kw):
    return {"event": "end", "t": t, "attempt": n, "exit": exit_code, "step": step, "verdict": verdict, **kw}


CLEAN = [
    _start(1, 1000.0, 990.0),
    {"event": "resume", "t": 1003.0, "attempt": 1, "step": 0, "from": "none"},
    {"event": "first_step", "t": 1005.0, "attempt": 1, "step": 1},
    {"event": "progress", "t": 1014.0, "attempt": 1, "step": 10, "window_s": 10.0, "steps": 10, "slowest_rank": 1,
     "slowest_host": "h1"},
    {"event": "checkpoint", "t": 1016.0, "attempt": 1, "step": 10, "blocking_s": 2.0, "commit_s": 0.5},
    # this window holds the 2 s checkpoint after step 10: (10 + 12 - 2) s over 20 steps = 1.0 s a step
    {"event": "progress", "t": 1026.0, "attempt": 1, "step": 20, "window_s": 12.0, "steps": 10, "slowest_rank": 1,
     "slowest_host": "h1"},
    {"event": "eval", "t": 1029.0, "attempt": 1, "step": 20, "seconds": 3.0},
    _end(1, 1030.0, 20, "finished", 0, retryable=False, rank=0, host="h0", cause="", fix=""),
]


def test_a_clean_run_is_mostly_goodput_and_every_second_is_accounted_for(tmp_path):
    run = load(_write(tmp_path, CLEAN), now=5000.0)
    _adds_up(run)
    assert run.state == "finished" and run.step == 20 and run.replayed_steps == 0
    assert run.wall_s == pytest.approx(40.0)  # launched 990 .. end 1030
    assert run.goodput_s == pytest.approx(20.0)  # 20 kept steps x 1.0 s
    assert run.badput["startup"] == pytest.approx(14.0)  # 990 .. first step 1005, less the step's 1 s
    assert run.badput["checkpoint"] == pytest.approx(2.0) and run.badput["evaluation"] == pytest.approx(3.0)
    assert run.badput["other"] == pytest.approx(1.0)  # 40 - 20 - 14 - 2 - 3
    assert run.badput["down"] == run.badput["replayed"] == run.badput["hang"] == run.badput["replica"] == 0
    assert run.goodput_pct == pytest.approx(50.0)
    (a,) = run.attempts
    assert (a.verdict, a.steps, a.step_time_s, a.world_size, a.engine, a.hosts) == ("finished", 20, pytest.approx(1.0), 2,
                                                                                   "torchrun", ("h0", "h1"))
    assert run.slowest.rank == 1 and run.slowest.host == "h1" and (run.slowest.windows, run.slowest.of) == (2, 2)
    assert [(c.step, c.attempt, c.fate) for c in run.checkpoints] == [(10, 1, "newest")]


SIGKILLED = [
    _start(1, 102.0, 100.0),
    {"event": "resume", "t": 104.0, "attempt": 1, "step": 0, "from": "none"},
    {"event": "first_step", "t": 105.0, "attempt": 1, "step": 1},
    {"event": "progress", "t": 114.0, "attempt": 1, "step": 10, "window_s": 10.0, "steps": 10, "slowest_rank": 0},
    {"event": "checkpoint", "t": 115.0, "attempt": 1, "step": 10, "blocking_s": 1.0, "commit_s": 0.2},
    {"event": "progress", "t": 125.0, "attempt": 1, "step": 20, "window_s": 11.0, "steps": 10, "slowest_rank": 1},
    # killed in step 27's forward: 26 steps complete; no end line
    _start(2, 141.0, 140.0, latest=10, killed_before={"step": 27, "phase": "forward/backward"}),
    {"event": "resume", "t": 143.0, "attempt": 2, "step": 10, "from": "checkpoint"},
    {"event": "first_step", "t": 145.0, "attempt": 2, "step": 11},
    {"event": "progress", "t": 154.0, "attempt": 2, "step": 20, "window_s": 10.0, "steps": 10, "slowest_rank": 1},
    {"event": "progress", "t": 164.0, "attempt": 2, "step": 30, "window_s": 10.0, "steps": 10, "slowest_rank": 1},
    _end(2, 165.0, 30, "finished", 0, retryable=False),
]


def test_a_sigkilled_attempt_is_accounted_from_what_it_left_and_its_replayed_steps_are_exact(tmp_path):
    run = load(_write(tmp_path, SIGKILLED, tail='{"event": "progress", "t": 16'), now=5000.0)  # + a cut line
    _adds_up(run)
    assert run.skipped_lines == 1
    assert run.state == "finished" and run.step == 30
    # attempt 1 did steps 1..26; attempt 2 resumed from step 10: steps 11..26 were trained twice
    assert run.replayed_steps == 16
    one, two = run.attempts
    assert (one.verdict, one.retryable, one.last_step, one.steps, one.replayed_steps) == ("killed", True, 26, 26, 16)
    assert one.end_estimated and one.end_t == pytest.approx(131.0)  # last line 125 (step 20) + 6 steps x 1.0 s
    assert run.wall_s == pytest.approx(65.0)  # 100 .. 165
    assert run.badput["replayed"] == pytest.approx(16.0)
    assert run.badput["down"] == pytest.approx(9.0)  # 131 .. 140
    assert run.badput["startup"] == pytest.approx(8.0)  # (105-100-1) + (145-140-1)
    assert run.goodput_s == pytest.approx(30.0)  # 10 kept steps of attempt 1, 20 of attempt 2
    assert run.badput["checkpoint"] == pytest.approx(1.0) and run.badput["other"] == pytest.approx(1.0)
    assert run.checkpoints[0].fate == "resumed by attempt 2"
    assert run.slowest.rank == 1 and run.slowest.windows == 3 and run.slowest.of == 4


def test_a_preempted_run_says_so_and_its_rerun_replays_nothing(tmp_path):
    first = [
        _start(1, 1.0, 0.0),
        {"event": "resume", "t": 2.0, "attempt": 1, "step": 0, "from": "none"},
        {"event": "first_step", "t": 3.0, "attempt": 1, "step": 1},
        {"event": "progress", "t": 12.0, "attempt": 1, "step": 10, "window_s": 10.0, "steps": 10},
        {"event": "checkpoint", "t": 19.0, "attempt": 1, "step": 15, "blocking_s": 2.0},  # saved at the signal
        _end(1, 20.0, 15, "preempted", 75, retryable=True, cause="SIGTERM from the scheduler"),
    ]
    run = load(_write(tmp_path, first), now=5000.0)
    _adds_up(run)
    assert run.state == "preempted" and run.attempts[0].retryable is True and run.step == 15
    # wall 20: startup 3-0-1 = 2, checkpoint 2, 15 steps x 1.0 s, other 1
    assert (run.goodput_s, run.badput["startup"], run.badput["checkpoint"], run.badput["other"]) == \
        pytest.approx((15.0, 2.0, 2.0, 1.0))

    rerun = first + [
        _start(2, 31.0, 30.0, latest=15),
        {"event": "resume", "t": 32.0, "attempt": 2, "step": 15, "from": "checkpoint"},
        {"event": "first_step", "t": 34.0, "attempt": 2, "step": 16},
        {"event": "progress", "t": 43.0, "attempt": 2, "step": 25, "window_s": 10.0, "steps": 10},
        _end(2, 44.0, 25, "finished", 0),
    ]
    run = load(_write(tmp_path, rerun), now=5000.0)
    _adds_up(run)
    assert run.state == "finished" and run.replayed_steps == 0
    # wall 44: goodput 15 + 10, startup 2 + 3, checkpoint 2, down 20 .. 30, other 1 + 1
    assert (run.goodput_s, run.badput["startup"], run.badput["down"], run.badput["other"]) == \
        pytest.approx((25.0, 5.0, 10.0, 2.0))
    assert run.checkpoints[0].fate == "resumed by attempt 2"


def test_a_hang_counts_its_stall_and_a_restart_from_scratch_replays_every_step(tmp_path):
    records = [
        _start(1, 1.0, 0.0),
        {"event": "resume", "t": 2.0, "attempt": 1, "step": 0, "from": "none"},
        {"event": "first_step", "t": 3.0, "attempt": 1, "step": 1},
        {"event": "progress", "t": 12.0, "attempt": 1, "step": 10, "window_s": 10.0, "steps": 10},
        # steps 11, 12 by t=14, then a 30 s stall until the watchdog fired, then 6 s of dumps and teardown
        _end(1, 50.0, 12, "hang", 1, retryable=True, rank=1, host="h1", stalled_s=30.0,
             cause="rank 1 stalled in forward/backward at step 13", fix="see run_dir/hang"),
        _start(2, 61.0, 60.0, latest=None),
        {"event": "resume", "t": 61.5, "attempt": 2, "step": 0, "from": "none"},
        {"event": "first_step", "t": 63.0, "attempt": 2, "step": 1},
        {"event": "progress", "t": 72.0, "attempt": 2, "step": 10, "window_s": 10.0, "steps": 10},
        _end(2, 73.0, 10, "finished", 0),
    ]
    run = load(_write(tmp_path, records), now=5000.0)
    _adds_up(run)
    assert run.replayed_steps == 12  # attempt 2 started from nothing: all of attempt 1's steps
    one = run.attempts[0]
    assert (one.verdict, one.rank, one.host, one.retryable) == ("hang", 1, "h1", True)
    # wall 73: hang 30, replayed 12, startup 2 + 2, down 10, goodput 10, other 6 + 1
    assert run.badput["hang"] == pytest.approx(30.0) and run.badput["replayed"] == pytest.approx(12.0)
    assert (run.goodput_s, run.badput["startup"], run.badput["down"], run.badput["other"]) == \
        pytest.approx((10.0, 4.0, 10.0, 7.0))


def test_a_crash_loop_stop_is_the_state_and_the_refused_start_costs_only_down_time(tmp_path):
    def failing(n, t0):
        # no progress line: the step time is (end - first step) / steps after the first = (6-3)/2 = 1.5 s
        return [_start(n, t0 + 1, t0), {"event": "resume", "t": t0 + 2, "attempt": n, "step": 0, "from": "none"},
                {"event": "first_step", "t": t0 + 3, "attempt": n, "step": 1},
                _end(n, t0 + 6, 3, "program_error", 1, retryable=True, rank=1, host="h1",
                     cause="ValueError: bad batch at step 3", fix="fix the script")]
    refused = _end(3, 20.0, 0, "user_error", 2, retryable=False,
                   cause="crash loop: the last 2 attempts failed without a new checkpoint", fix="fix the error")
    run = load(_write(tmp_path, failing(1, 0.0) + failing(2, 10.0) + [refused]), now=5000.0)
    _adds_up(run)
    assert run.state == "crash loop" and len(run.attempts) == 3
    assert [a.verdict for a in run.attempts] == ["program_error", "program_error", "user_error"]
    assert run.attempts[2].duration_s == 0.0
    # attempt 1's 3 steps were trained again by attempt 2 (it started from nothing); attempt 2's are the last
    assert run.replayed_steps == 3
    # wall 20: startup (3-0-1.5) x 2, replayed 3 x 1.5, goodput 3 x 1.5, down 6..10 and 16..20
    assert (run.goodput_s, run.badput["replayed"], run.badput["startup"], run.badput["down"]) == \
        pytest.approx((4.5, 4.5, 3.0, 8.0))
    assert run.badput["other"] == pytest.approx(0.0, abs=1e-9)


def test_an_old_ledger_with_only_start_and_end_lines(tmp_path):
    records = [
        {"event": "start", "t": 0.0, "latest": None, "restart_count": 0},
        {"event": "end", "t": 100.0, "exit": 1, "outcome": "failed", "step": 50},
        {"event": "start", "t": 110.0, "latest": 40, "restart_count": 1},
        {"event": "end", "t": 170.0, "exit": 0, "outcome": "done", "step": 100},
    ]
    run = load(_write(tmp_path, records), now=5000.0)
    _adds_up(run)
    assert run.state == "finished" and [a.verdict for a in run.attempts] == ["failed", "finished"]
    # attempt 1: 50 steps in 100 s (2 s each), 41..50 retrained by attempt 2 (resumed at 40): 60 steps in 60 s
    assert run.replayed_steps == 10
    assert (run.goodput_s, run.badput["replayed"], run.badput["down"]) == pytest.approx((80.0 + 60.0, 20.0, 10.0))
    assert run.attempts[0].world_size is None and run.attempts[0].engine is None


def test_the_state_word_running_then_killed(tmp_path):
    records = SIGKILLED[:6]  # attempt 1's lines; last one at t=125, log windows 11 s apart
    run = account(records, now=130.0)
    _adds_up(run)
    assert run.state == "running" and run.attempts[0].verdict == "running" and run.end_t == 130.0
    # goodput: 20 steps x 1.0 s; the 5 s since its last line are unlogged (training or stalled: not known yet);
    # startup 4, checkpoint 1
    assert run.goodput_s == pytest.approx(20.0) and run.badput["startup"] == pytest.approx(4.0)
    assert run.badput["unlogged"] == pytest.approx(5.0)
    gone = account(records, now=125.0 + 121.0)  # quiet for longer than 120 s (and 2 log gaps): not running
    assert gone.state == "failed" and gone.attempts[0].verdict == "killed" and gone.end_t == 125.0


def test_eta_from_config_max_steps(tmp_path):
    run_dir = _write(tmp_path, SIGKILLED[:6])
    (run_dir / "config.yaml").write_text("run_dir: x\nmax_steps: 120\n")
    run = load(run_dir, now=130.0)
    assert run.max_steps == 120 and run.steps_per_s == pytest.approx(1.0)
    assert run.eta_s == pytest.approx(100.0)  # 120 - 20 steps at 1.0 s


def test_the_synthetic_100k_step_run_of_the_bench(tmp_path):
    truth = synthetic_run(tmp_path / "run")  # 50 attempts, 49 killed 100 steps past their last checkpoint
    run = load(tmp_path / "run", now=0.0)
    _adds_up(run)
    assert run.state == "finished" and run.step == 100_000 and len(run.attempts) == 50
    assert run.replayed_steps == 49 * 100
    assert run.goodput_s == pytest.approx(100_000 * 0.1)  # 0.1 s a step, by construction
    assert run.badput["down"] == pytest.approx(49 * 30.0) and run.badput["startup"] == pytest.approx(50 * 5.0)
    # a checkpoint every 500 steps: 4 in each attempt's 2,100 steps (none in the 100 replayed), 0.5 s each
    assert run.badput["checkpoint"] == pytest.approx(50 * 4 * 0.5)
    assert truth["replayed_steps"] == 4900 and run.slowest.rank == 5


def test_status_prints_the_table_and_json_parses(tmp_path, capsys):
    run_dir = _write(tmp_path, SIGKILLED)
    main(str(run_dir))
    out = capsys.readouterr().out
    assert f"{run_dir}: finished at step 30" in out and "16 steps replayed" in out
    assert "killed at step 26" in out and "resumed by attempt 2" in out and "slowest rank: 1" in out
    for cause in CAUSES:
        assert f"  {cause} " in out
    assert render(load(run_dir)).count("\n") > 10
    main(str(run_dir), json=True)
    got = json.loads(capsys.readouterr().out)
    assert got["state"] == "finished" and got["replayed_steps"] == 16 and len(got["attempts"]) == 2
    assert abs(got["goodput_s"] + sum(got["badput"].values()) - got["wall_s"]) < 1e-6
    assert got["attempts"][0]["verdict"] == "killed"
    main(str(run_dir), watch=0.01)  # a finished run: one drawing, then it returns
    assert "finished at step 30" in capsys.readouterr().out


def test_a_missing_run_dir_or_ledger_is_one_line_and_exit_2(tmp_path, capsys):
    for where in (tmp_path / "nowhere", tmp_path):
        with pytest.raises(SystemExit) as exc:
            main(str(where))
        assert exc.value.code == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert err.startswith("ddp_kit: error: ") and "(hint: " in err and "\n" not in err


def test_read_skips_cut_lines_and_records_without_time(tmp_path):
    path = _write(tmp_path, [{"event": "start", "t": 1.0}, {"event": "end"}, [1, 2]], tail='{"event": "st') / "attempts.jsonl"
    records, bad = read(path)
    assert records == [{"event": "start", "t": 1.0}] and bad == 3


def _imports(module: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_status_reads_files_only_no_torch_no_run_folder():
    """Its import closure (the conftest imports torch in this process, so it is read from the source):
    run_account.py and status.py import errors.py, exit_codes.py, preflight/leave.py (the hosts left out),
    reliability/cadence.py (the automatic intervals' lines; its package imports its modules lazily) and the
    standard library, never torch nor run_folder (which pulls in the checkpoint package and torch)."""
    src = ROOT / "src" / "ddp_kit"
    seen = set()
    for name in ("status.py", "run_account.py", "run_account_records.py", "errors.py", "exit_codes.py",
                 "preflight/leave.py", "preflight/__init__.py", "reliability/cadence.py", "reliability/__init__.py"):
        for imported in _imports(src / name):
            assert not imported.startswith(("torch", "numpy")), (name, imported)
            if imported.startswith("."):
                seen.add(imported)
    assert seen <= {".errors", ".exit_codes", ".run_account", ".run_account_records", ".preflight.leave",
                    ".reliability.cadence"}, seen


def test_report_draws_the_timeline_only_when_the_ledger_has_a_start(tmp_path):
    from ddp_kit.report import ledger_of, plot, timeline

    assert ledger_of(tmp_path) is None  # no ledger
    _write(tmp_path, [_end(1, 5.0, 0, "user_error", 2)])
    assert ledger_of(tmp_path) is None  # a ledger without a start line
    run_dir = _write(tmp_path, SIGKILLED)
    run = ledger_of(run_dir)
    assert run is not None and run.replayed_steps == 16
    panel = timeline(run)
    assert panel.title.startswith("attempts: goodput 46% of 65 s wall")  # 30 of 65 s
    records = [{"event": "train", "step": s, "loss": 1.0 / s} for s in (10, 20, 30)]
    plot(records, tmp_path / "report.png", "t", run)
    assert (tmp_path / "report.png").stat().st_size > 5_000


@pytest.mark.integration
def test_the_command_answers_without_importing_torch(tmp_path):
    """As a user runs it: a fresh interpreter, -X importtime lists every module it imported."""
    import subprocess

    run_dir = _write(tmp_path, SIGKILLED)
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddp_kit.status", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["replayed_steps"] == 16
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "ddp_kit.run_account" in imported and "torch" not in imported and "ddp_kit.run_folder" not in imported


def test_a_refused_restart_is_the_state_not_an_attempt():
    from ddp_kit.run_account import account

    records = [
        {"event": "start", "t": 100.0, "attempt": 1, "launched_t": 98.0, "latest": None},
        {"event": "first_step", "t": 101.0, "attempt": 1, "step": 1},
        {"event": "end", "t": 110.0, "attempt": 1, "exit": 1, "step": 6, "verdict": "program_error",
         "retryable": True, "error": "RuntimeError: x"},
        {"event": "start", "t": 113.0, "attempt": 2, "launched_t": 112.0, "latest": 4},
        {"event": "resume", "t": 113.5, "attempt": 2, "step": 4, "from": "checkpoint"},
        {"event": "end", "t": 115.0, "attempt": 2, "exit": 2, "step": 6, "verdict": "program_error",
         "retryable": False, "error": "RuntimeError: x"},
        {"event": "refused", "t": 118.0, "why": "deterministic", "cause": "..."},
        {"event": "refused", "t": 121.0, "why": "deterministic", "cause": "..."},
    ]
    run = account(records, now=200.0)
    assert len(run.attempts) == 2 and run.state == "deterministic failure"
    assert run.wall_s == 115.0 - 98.0  # first launch to the last attempt's end; the refusals trained nothing
    records[-1]["why"] = records[-2]["why"] = "crash_loop"
    assert account(records, now=200.0).state == "crash loop"


def test_the_memory_tiers_waits_are_checkpoint_time_not_goodput(tmp_path):
    """CLEAN with the memory tier on: each log window says how long the loop waited for it (mem_s)."""
    records = [dict(r) for r in CLEAN]
    records[3]["mem_s"] = 0.5  # window 1: 10 s, of which 0.5 s the memory tier
    records[5]["mem_s"] = 1.5  # window 2: 12 s, 2 s the durable checkpoint and 1.5 s the memory tier
    run = load(_write(tmp_path, records), now=5000.0)
    _adds_up(run)
    assert run.badput["checkpoint"] == pytest.approx(2.0 + 0.5 + 1.5)
    # steps: (10 - 0.5 + 12 - 2 - 1.5) s over 20 steps = 0.9 s a step: 18 s of goodput, not 20
    assert run.attempts[0].step_time_s == pytest.approx(0.9) and run.goodput_s == pytest.approx(18.0)
