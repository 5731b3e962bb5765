"""Rank 0's trackers at run time: one thread per tracker fed from a queue, so the training loop
only ever enqueues; the tracker runs (TrackerRuns: run_dir/trackers.json, mirrored into every checkpoint's
meta) with each tracker's run id and the last step sent to it; and the bounds that keep a tool from failing
or stalling the run.

- A tracker that raises (a server down at start or gone mid-run, a refused request) is given up
  for this attempt with one warning; the run goes on, its records stay in metrics.jsonl.
- No call is waited on for long: one that has not returned after CALL_TIMEOUT_S is given up the
  same way (its thread is a daemon, left behind), and at the end the records still queued get
  CLOSE_TIMEOUT_S in all. The tools' own timeouts shorten this (MLFLOW_HTTP_REQUEST_TIMEOUT and
  MLFLOW_HTTP_REQUEST_MAX_RETRIES; W&B's init_timeout); none of them is needed for the bound.
- Steps logged at most once: trackers.json records a step before it is sent, so a step a killed
  attempt may have sent is never sent again by the next one (trackers that cannot rewind skip
  every step up to it); a kill between the two loses that step instead.
"""
from __future__ import annotations

import importlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import tracker_class
from .base import Opening, Tracker, scalars

CALL_TIMEOUT_S = 30.0  # one call to a tool that has not returned after this long: the tracker is given up
CLOSE_TIMEOUT_S = 60.0  # at the end of an attempt: what is still queued gets this long in all
PENDING_MAX = 10_000  # records held before the trackers open (an attempt's first records, normally none)
_CLOSE = "close"
_IMPORTING = threading.Lock()  # one tool imported at a time: two threads importing shared modules can see them half-made


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class TrackerRuns:
    """Each tracker's run id and the last step sent to it: run_dir/trackers.json, and `mirror(entries)`
    (the checkpoint meta), so that the next attempt, here or elsewhere, continues the same runs."""

    def __init__(self, path: Path | None, entries: dict[str, dict[str, Any]],
                 mirror: Callable[[dict], None] | None = None):
        self.path, self.entries, self.mirror = path, dict(entries), mirror
        self._lock = threading.Lock()

    @staticmethod
    def read(path: Path | None) -> dict[str, dict[str, Any]]:
        """The tracker runs a run folder holds ({} when none, or when unreadable: a new tracker run is no harm)."""
        try:
            data = json.loads(path.read_text()) if path is not None else {}
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}

    def update(self, name: str, **fields: Any) -> None:
        # Entries are replaced, never changed in place: a checkpoint being written holds the old ones.
        with self._lock:
            self.entries = {**self.entries, name: {**self.entries.get(name, {}), **fields}}
            self._write()

    def write(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        if self.path is not None:
            tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        if self.mirror is not None:
            self.mirror(self.entries)


class Hub:
    """The trackers of one attempt, on the rank that logs (`active`); a no-op everywhere else."""

    def __init__(self, names: tuple[str, ...], active: bool, say: Callable[[str], None] = _stderr):
        self.names = tuple(names) if active else ()
        self.say = say
        self.opened = False
        self.closed = False
        self._pending: list[tuple[int, dict[str, float], float]] = []
        self._workers: list[_Worker] = []
        self._last_step = 0
        self._lock = threading.Lock()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def open(self, openings: dict[str, Opening], floors: dict[str, int | None], runs: TrackerRuns,
             make: Callable[[str], Tracker] | None = None) -> None:
        """Start every tracker's thread (each opens its tool there), then hand over what was held."""
        if self.opened or self.closed or not self.names:
            return
        self.opened = True
        make = make or (lambda name: tracker_class(name)())
        for name in self.names:
            tracker = make(name)
            worker = _Worker(self, name, tracker, openings[name], None if tracker.rewinds else floors.get(name), runs)
            self._workers.append(worker)
            worker.start()
        for item in self._pending:
            self._send(item)
        self._pending.clear()

    def log(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record, sent to every tracker at its step (a record without one: the last step seen)."""
        if not self.names or self.closed:
            return
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self._last_step = step
        values = scalars(record)
        if not values:
            return
        item = (self._last_step, values, time.time())
        if not self.opened:
            if len(self._pending) < PENDING_MAX:
                self._pending.append(item)
            return
        self._send(item)

    def _send(self, item: tuple) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.gone:
                continue
            if w.stuck(now):
                self.give_up(w, f"did not answer within {CALL_TIMEOUT_S:g}s")
                continue
            w.queue.put(item)

    def close(self, exit_code: int, within_s: float = CLOSE_TIMEOUT_S) -> None:
        """The attempt ends with `exit_code`: what is queued is sent and each tool told, within the bounds
        (`within_s` in all: less when a stop signal's grace period has less left; boundary/grace_period.py)."""
        if self.closed:
            return
        self.closed = True
        for w in self._workers:
            if not w.gone:
                w.queue.put((_CLOSE, exit_code))
        deadline = time.monotonic() + within_s
        for w in self._workers:
            while w.is_alive() and not w.gone:
                w.join(0.05)
                now = time.monotonic()
                if w.stuck(now):
                    self.give_up(w, f"did not answer within {CALL_TIMEOUT_S:g}s")
                elif now > deadline:
                    self.give_up(w, f"did not take the last records within {within_s:.3g}s")
        self._workers.clear()

    def give_up(self, w: _Worker, why: str) -> None:
        """The one warning of a tracker that failed: the run goes on without it."""
        with self._lock:
            if w.gone:
                return
            w.gone = True
        where = w.tracker.location  # an attribute, not a call: the tool may be what is stuck
        self.say(f"ddp_kit: warning: tracker {w.name}{f' ({where})' if where else ''} {why}; the run goes on "
                 f"without it (its records stay in metrics.jsonl)")


class _Worker(threading.Thread):
    """One tracker's thread: opens the tool, then sends each queued record (past the floor) in order."""

    def __init__(self, hub: Hub, name: str, tracker: Tracker, opening: Opening, floor: int | None, runs: TrackerRuns):
        super().__init__(name=f"ddp_kit-tracker-{name}", daemon=True)
        self.hub, self.name, self.tracker, self.opening, self.floor, self.runs = hub, name, tracker, opening, floor, runs
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.gone = False  # given up: nothing more is sent, and what it still does is ignored
        self._busy_since: float | None = None
        self._sent = runs.entries.get(name, {}).get("logged_step", -1)

    def stuck(self, now: float) -> bool:
        since = self._busy_since
        return since is not None and now - since > CALL_TIMEOUT_S

    def _call(self, fn: Callable, *args: Any) -> Any:
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._busy_since = None

    def run(self) -> None:
        try:
            if self.tracker.package:  # before the clock starts: importing a tool is slow, not stuck
                with _IMPORTING:
                    importlib.import_module(self.tracker.package)
            chosen = self.tracker.new_run_id() if self.opening.run_id is None else None
            if chosen is not None:
                self.runs.update(self.name, run_id=chosen, logged_step=self._sent)
            run_id = self._call(self.tracker.open, self.opening)
            if self.gone:
                return
            self.runs.update(self.name, run_id=run_id, logged_step=self._sent)
            while True:
                item = self.queue.get()
                if self.gone:
                    return
                if item[0] == _CLOSE:
                    self._call(self.tracker.close, item[1])
                    return
                step, values, wall_time = item
                if self.floor is not None and step <= self.floor:
                    continue  # an earlier attempt sent this step: a tool that keeps every point would hold it twice
                if step > self._sent:
                    self._sent = step
                    self.runs.update(self.name, logged_step=step)  # before sending: at most once
                self._call(self.tracker.log, step, values, wall_time)
        except Exception as err:
            text = (str(err).strip().splitlines() or [""])[0]
            self.hub.give_up(self, f"failed ({type(err).__name__}{': ' + text[:300] if text else ''})")
