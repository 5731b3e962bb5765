"""Start-up begins when the launch did (issue 44 item 11). A shell runs the last command of an `&&` list in
its own process (exec, no fork), so that process's /proc start time is the shell's: `bash -c "sleep 6 &&
python -m ddp_kit.train ..."` (or README's `python3 -m venv .venv && pip install -e . && python -m
ddp_kit.train`) booked the sleep (the pip install) as start-up. Real processes: bash, sleep, the reference job."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, proc_env
from procs import outcome

pytestmark = [pytest.mark.integration]
TRAIN = f"{sys.executable} -m ddp_kit.train --progress false --max_steps 2"


def _start_line(run: Path) -> dict:
    return next(r for r in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if r["event"] == "start")


def _run(shell_line: str) -> float:
    before = time.time()
    p = subprocess.Popen(["bash", "-c", shell_line], cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    rc, out = outcome(p, 180)
    assert rc == 0, out[-3000:]
    return before


def test_an_earlier_command_of_the_shell_is_not_start_up(tmp_path):
    run = tmp_path / "r"
    before = _run(f"sleep 6 && {TRAIN} --run_dir {run}")
    launched = _start_line(run)["launched_t"]
    assert launched >= before + 5.5, launched - before  # after the sleep: the interpreter's own start
    assert launched <= _start_line(run)["t"]


def test_a_process_of_its_own_keeps_its_fork_time(tmp_path):
    run = tmp_path / "r"
    before = _run(f"true; {TRAIN} --run_dir {run}; true")  # bash forks it: /proc's start time is its own
    launched = _start_line(run)["launched_t"]
    assert before - 1.5 <= launched <= before + 2.0, launched - before  # /proc/stat's btime is in whole seconds
