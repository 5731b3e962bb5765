"""A slow tracker at SIGTERM must not cost the end line or exit 75 (issue 44 item 11): the end line is written
before the trackers close, and closing them fits what is left of the grace period. Real process, real
SIGTERM, and the engine's SIGKILL when the grace period (DDP_KIT_GRACE_PERIOD_S=8) is over."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import HELPERS, ROOT, proc_env

pytestmark = [pytest.mark.integration]
GRACE_S = 8


def test_a_slow_tracker_at_sigterm_leaves_the_end_line_and_exit_75_within_the_grace_period(tmp_path):
    run = tmp_path / "r"
    p = subprocess.Popen([sys.executable, str(HELPERS / "slow_tracker.py"), str(run)], cwd=ROOT,
                         env=proc_env({"DDP_KIT_GRACE_PERIOD_S": str(GRACE_S)}), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while "ready" not in (line := p.stdout.readline()):
            assert line, "the script ended before it trained"
        p.send_signal(signal.SIGTERM)  # the eviction
        sent = time.monotonic()
        try:
            p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the kubelet, when the grace period is over
            p.wait()
        took = time.monotonic() - sent
        out, err = p.communicate()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    ends = [r for r in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if r["event"] == "end"]
    assert [(e["verdict"], e["exit"]) for e in ends] == [("preempted", 75)], (ends, err[-3000:])
    assert p.returncode == 75 and took < GRACE_S, (p.returncode, took, err[-3000:])
    assert "tracker slow (http://tracker.example:5000)" in err  # its one warning: given up, not waited for
