"""`python -m ddp_kit.status` on a damaged ledger, and a running attempt's quiet time (issue 44 item 11).

A damaged line (a number too big for a float, a time in the year 30000, a field of the wrong type) is
skipped and counted, whatever it holds: never a traceback. A running attempt's time since its last line
is not known to be training: it is booked as "unlogged", so a stall shows as growing unlogged time, not
as rising goodput."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_kit.run_account import account, load
from ddp_kit.status import main

GOOD = [
    {"event": "start", "t": 102.0, "attempt": 1, "launched_t": 100.0, "latest": None, "restart_count": 0,
     "world_size": 2, "engine": "torchrun", "hosts": ["h0", "h1"]},
    {"event": "resume", "t": 104.0, "attempt": 1, "step": 0, "from": "none"},
    {"event": "first_step", "t": 105.0, "attempt": 1, "step": 1},
    {"event": "progress", "t": 114.0, "attempt": 1, "step": 10, "window_s": 10.0, "steps": 10, "slowest_rank": 1},
    {"event": "checkpoint", "t": 116.0, "attempt": 1, "step": 10, "blocking_s": 1.0, "commit_s": 0.5},
    {"event": "progress", "t": 125.0, "attempt": 1, "step": 20, "window_s": 11.0, "steps": 10, "slowest_rank": 1},
    {"event": "end", "t": 126.0, "attempt": 1, "exit": 0, "step": 20, "verdict": "finished", "retryable": False},
]
HUGE = 10 ** 400  # json writes it, and reads it back as an int no float can hold

# (line index, field, value): each makes that one line damaged
DAMAGE = [(i, k, v) for i, r in enumerate(GOOD) for k in r if k != "event"
          for v in (HUGE, -HUGE, 1e308, "x", [1], {"a": 1}, None, True)
          if not (k in ("latest", "retryable") and v in (None, True))]  # values those fields may hold


def _write(d: Path, records) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


@pytest.mark.parametrize("where,field,value", DAMAGE)
def test_a_damaged_line_is_skipped_and_counted_whatever_it_holds(tmp_path, capsys, where, field, value):
    records = [dict(r) for r in GOOD]
    records[where][field] = value
    run_dir = _write(tmp_path / "r", records)
    main(str(run_dir))  # no traceback
    main(str(run_dir), json=True)
    out = capsys.readouterr().out
    got = json.loads(out.splitlines()[-1])
    assert got["skipped_lines"] in (0, 1)  # a value the field may hold (a string host) is no damage
    if got["skipped_lines"]:
        assert "1 ledger line skipped" in out


def test_a_huge_step_is_one_skipped_line(tmp_path, capsys):
    records = [dict(r) for r in GOOD]
    records[3]["step"] = HUGE
    run = load(_write(tmp_path / "r", records), now=5000.0)
    assert run.skipped_lines == 1 and run.state == "finished"


def test_a_stall_is_unlogged_time_not_goodput():
    running = GOOD[:6]  # last line at t=125; log windows 11 s apart
    before = account(running, now=126.0)
    stalled = account(running, now=125.0 + 100.0)  # quiet for 100 s: still "running" (under 120 s)
    assert stalled.state == "running"
    assert stalled.goodput_s == before.goodput_s == pytest.approx(20.0)  # 20 steps x 1 s; the quiet time is not goodput
    assert stalled.badput["unlogged"] == pytest.approx(100.0)
    assert abs(stalled.goodput_s + sum(stalled.badput.values()) - stalled.wall_s) < 1e-6
