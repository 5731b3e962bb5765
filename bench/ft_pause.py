"""What a lost worker costs: today's restart path (torchrun --max_restarts) against the fault-tolerant
path (strategy ft, `python -m ddp_kit.launch ft`), on the same reference job, in one run.

    python bench/ft_pause.py [--steps 800] [--kill_at 225] [--repeats 3] [--out bench/ft_results.json]

(a) restart: `torchrun --standalone --nproc_per_node=2 --max_restarts=1 -m ddp_kit.train --ckpt_every 50`;
    rank 1's worker is SIGKILLed once the run has logged step --kill_at. torchrun stops rank 0, starts
    both again, and they resume from the last checkpoint. Time lost = from the kill until the first
    step after the restart completes, plus the replayed steps (last checkpoint .. kill) at the
    step time measured before the kill. Cross-check from the records alone: from the kill until the
    restarted run logs again the last step it had reached before it.
(b) ft: `python -m ddp_kit.launch ft --groups 2 --nproc_per_node 1`; group 1's worker is SIGKILLed at the
    same step. Group 0 (the survivor) pauses until the lighthouse drops group 1 (heartbeat timeout) and
    again, briefly, when the restarted group 1 joins and takes its state live. Its pause is read from
    its own replica_pause events and, independently, from the gaps between its train records (the
    largest gap at the kill and at the rejoin, each minus the median gap).

Both paths run `--inject slow:rank=0:step=1:ms=20:always=1` by default: every step sleeps 20 ms on
rank 0 (of every group in (b)), on every attempt (`always`: a restarted worker too), so steps take a
stable time and the kill lands mid-run. The workers are found by their environment (/proc/<pid>/environ:
a marker this bench sets, plus DDP_KIT_REPLICA_GROUP and the launcher's group token in (b)) and killed
by PID. Rounds alternate (a), (b); figures are medians over rounds. Writes the JSON with --out and
prints a markdown table (`--render FILE` redoes both from a saved JSON's rounds).

The kill lands at a quarter of the run by default: on 2 cores the restarted group needs ~7-12 s to
rejoin, and a group restarted after the survivor has finished does not recover live; it resumes from
its own last checkpoint and waits at the lighthouse for the finished groups (up to the startup
timeout), which a run then shows as exit null / left_running.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fire

MARK = "DDP_KIT_FT_BENCH_MARK"  # in the environment of every process a run of this bench starts
TOKEN = "DDP_KIT_FT_GROUP_TOKEN"  # the ft launcher's mark of one start of one group (launch/ft.py)
EPOCHS = 10_000  # the job's default (20 epochs of 22 steps on digits) would cap --max_steps at 440


# ---- processes ------------------------------------------------------------------------------------

def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def cmdline_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def marked(mark: str) -> list[int]:
    """PIDs of the processes carrying this run's mark (this user's: the ones we started and their children)."""
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and environ_of(int(p.name)).get(MARK) == mark]


def is_worker(pid: int) -> bool:
    """A training worker: the python running ddp_kit.train, not torchrun's agent nor the rank shim (sh)."""
    argv = cmdline_of(pid)
    return bool(argv) and "ddp_kit.train" in argv and "torch.distributed.run" not in argv \
        and Path(argv[0]).name.startswith("python")


def find_worker(mark: str, match, timeout_s: float = 30.0) -> int:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = [pid for pid in marked(mark) if is_worker(pid) and match(environ_of(pid))]
        if len(found) == 1:
            return found[0]
        time.sleep(0.05)
    raise SystemExit(f"no single worker of run {mark} matched within {timeout_s:.0f}s (found {found})")


def reap(mark: str) -> list[int]:
    """SIGKILL what is left of one run (by PID, marked processes only): nothing should be."""
    left = marked(mark)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


# ---- records --------------------------------------------------------------------------------------

class Tail:
    """The records appended to a metrics.jsonl, read incrementally (whole lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.last_step = path, 0, 0
        self.train: list[dict] = []  # kept: a resume rewinds metrics.jsonl to its checkpoint

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.last_step
        whole = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            rec = json.loads(line)
            if rec.get("event") == "train":
                self.last_step = max(self.last_step, rec["step"])
                self.train.append({"time": rec["time"], "step": rec["step"]})
        return self.last_step


def wait_step(tail: Tail, step: int, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while tail.poll() < step:
        if proc.poll() is not None:
            raise SystemExit(f"the run exited ({proc.returncode}) before step {step} (last {tail.last_step})")
        if time.monotonic() > end:
            raise SystemExit(f"step {step} not reached within {timeout_s:.0f}s (last {tail.last_step})")
        time.sleep(0.01)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def trains(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "train"]


def median_gap(train: list[dict], skip: int = 5) -> float:
    times = [r["time"] for r in train[skip:]]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def largest_gap(train: list[dict], after: float, before: float) -> float:
    """The largest gap between consecutive train records that ends after `after` and starts before `before`."""
    times = [r["time"] for r in train]
    return max((b - a for a, b in zip(times, times[1:]) if b > after and a < before), default=0.0)


def notable(stderr: str, needles: tuple[str, ...], limit: int = 12) -> list[str]:
    lines = [line.strip() for line in stderr.splitlines() if any(n in line for n in needles)]
    return [line[:400] for line in lines[:limit]]


def environment(mark: str) -> dict[str, str]:
    return {**os.environ, MARK: mark, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def finish(proc: subprocess.Popen, mark: str, timeout_s: float, left: list) -> int | None:
    """The run's exit code; None if it did not end within timeout_s (then `left` lists what was still
    running, and every process of the run is killed)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        left.extend(" ".join(cmdline_of(pid))[:300] for pid in marked(mark) if is_worker(pid))
        return None
    finally:
        reap(mark)


# ---- (a) restart ----------------------------------------------------------------------------------

def restart_path(root: Path, steps: int, kill_at: int, ckpt_every: int, inject: str, timeout_s: float) -> dict:
    run_dir, err = root / "run", root / "stderr.log"
    mark = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
           "-m", "ddp_kit.train", "--run_dir", str(run_dir), "--max_steps", str(steps), "--epochs", str(EPOCHS),
           "--ckpt_every", str(ckpt_every), "--log_every", "1", "--inject", inject]
    proc = subprocess.Popen(cmd, env=environment(mark), stdout=open(root / "stdout.log", "wb"), stderr=open(err, "wb"),
                            start_new_session=True)
    try:
        tail = Tail(run_dir / "metrics.jsonl")
        wait_step(tail, kill_at, proc, timeout_s)
        victim = find_worker(mark, lambda env: env.get("LOCAL_RANK") == "1")
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 60
        while len(jsonl(run_dir / "attempts.jsonl")) < 2 and time.monotonic() < end:  # attempt 0 has ended
            tail.poll()
            time.sleep(0.01)
        tail.poll()
    except BaseException:
        reap(mark)
        raise
    left: list[str] = []
    rc = finish(proc, mark, timeout_s, left)
    records = jsonl(run_dir / "metrics.jsonl")
    attempts = jsonl(run_dir / "attempts.jsonl")
    starts = [a for a in attempts if a.get("event") == "start"]
    if len(starts) < 2:
        raise SystemExit(f"(a) the run was not restarted (attempts: {attempts}, exit {rc}; stderr: {err})")
    t_restart = starts[1]["t"]  # the restarted workers' start
    first = [r for r in tail.train if r["time"] < t_restart]  # attempt 0, as logged before the rewind
    second = [r for r in trains(records) if r["time"] >= t_restart]
    ended = next((a for a in attempts if a.get("event") == "end"), {})
    reached = ended.get("step") or first[-1]["step"]  # the step count attempt 0 had when it failed
    resumed = second[0]["step"] - 1
    ckpts = [r["step"] for r in records if r.get("event") == "checkpoint" and r["time"] <= t_kill]
    step_s = median_gap(first)
    replayed = reached - resumed
    restart_s = second[0]["time"] - t_kill
    back = next((r for r in second if r["step"] >= reached), None)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {
        "exit": rc, "left_running": left, "killed_pid": victim, "kill_step": kill_at, "reached_step": reached,
        "last_logged_before_kill": max((r["step"] for r in first if r["time"] <= t_kill), default=None),
        "last_checkpoint": max(ckpts, default=0), "resumed_from": resumed,
        "steps_replayed": replayed, "steps_discarded": replayed,  # every step since the checkpoint is thrown away, then redone
        "step_s": round(step_s, 4),
        "kill_to_restart_start_s": round(t_restart - t_kill, 3),
        "restart_start_to_first_step_s": round(second[0]["time"] - t_restart, 3),
        "kill_to_first_step_s": round(restart_s, 3),
        "replay_s": round(replayed * step_s, 3),
        "pause_s": round(restart_s + replayed * step_s, 3),
        "back_to_reached_step_s": round(back["time"] - t_kill, 3) if back else None,  # the records' own view
        "recovery_s": round(restart_s, 3),
        "final_steps": summary.get("steps"), "param_sha256": summary.get("param_sha256"),
        "final_weights_equal": summary.get("param_sha256_all_ranks_equal"),  # the 2 ranks of the one run
        "launcher_stderr": notable(err.read_text(errors="replace"),
                                   ("failed", "Restarting", "restart", "SIGKILL", "exitcode", "Signal 9")),
    }


# ---- (b) ft ---------------------------------------------------------------------------------------

def ft_path(root: Path, steps: int, kill_at: int, inject: str, timeout_s: float) -> dict:
    run_dir, err = root / "run", root / "stderr.log"
    mark = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "ddp_kit.launch", "ft", "--groups", "2", "--nproc_per_node", "1", "--",
           "--run_dir", str(run_dir), "--max_steps", str(steps), "--epochs", str(EPOCHS), "--log_every", "1",
           "--inject", inject]
    proc = subprocess.Popen(cmd, env=environment(mark), stdout=open(root / "stdout.log", "wb"), stderr=open(err, "wb"),
                            start_new_session=True)
    try:
        wait_step(Tail(run_dir / "replica_0" / "metrics.jsonl"), kill_at, proc, timeout_s)
        victim = find_worker(mark, lambda env: env.get("DDP_KIT_REPLICA_GROUP") == "1"
                             and env.get(TOKEN, "").startswith(f"{proc.pid}-"))
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        reap(mark)
        raise
    left: list[str] = []
    rc = finish(proc, mark, timeout_s, left)
    r0, r1 = jsonl(run_dir / "replica_0" / "metrics.jsonl"), jsonl(run_dir / "replica_1" / "metrics.jsonl")
    train0 = trains(r0)
    step_numbers = [r["step"] for r in train0]
    replayed = sum(1 for prev, cur in zip(step_numbers, step_numbers[1:]) if cur <= prev)
    recoveries = [r for r in r1 if r.get("event") == "recovery" and r["time"] > t_kill]
    recovery = recoveries[0] if recoveries else {}
    t_rejoin = recovery.get("time")
    pauses = [r for r in r0 if r.get("event") == "replica_pause" and r["time"] > t_kill]
    at_kill = [p for p in pauses if t_rejoin is None or p["time"] < t_rejoin - 2]
    at_rejoin = [p for p in pauses if p not in at_kill]
    usual = median_gap(train0)
    gap_kill = largest_gap(train0, t_kill, t_kill + 5) - usual
    gap_rejoin = largest_gap(train0, t_rejoin - 2, t_rejoin + 2) - usual if t_rejoin else 0.0
    summaries = [json.loads(p.read_text()) if p.exists() else {}
                 for p in (run_dir / "replica_0" / "summary.json", run_dir / "replica_1" / "summary.json")]
    shas = [s.get("param_sha256") for s in summaries]
    t_done = next((r["time"] for r in reversed(r0) if r.get("event") == "checkpoint"), None)
    return {
        "exit": rc, "left_running": left, "killed_pid": victim, "kill_step": kill_at,
        "rejoined_before_survivor_finished": bool(t_rejoin and t_done and t_rejoin < t_done),
        "survivor_steps": step_numbers[-1] if step_numbers else None, "survivor_final_steps": summaries[0].get("steps"),
        "step_s": round(usual, 4),
        "pause_events": [{k: p.get(k) for k in ("step", "paused_s", "participants")} for p in pauses],
        "pause_at_loss_s": round(sum(p["paused_s"] for p in at_kill), 3),
        "pause_at_rejoin_s": round(sum(p["paused_s"] for p in at_rejoin), 3),
        "pause_s": round(sum(p["paused_s"] for p in pauses), 3),
        "gap_pause_at_loss_s": round(gap_kill, 3), "gap_pause_at_rejoin_s": round(gap_rejoin, 3),
        "gap_pause_s": round(gap_kill + gap_rejoin, 3),
        "steps_discarded_events": sum(1 for r in r0 if r.get("event") == "step_discarded"),
        "steps_discarded": summaries[0].get("steps_discarded"),
        "steps_replayed": replayed, "survivor_steps_monotonic": replayed == 0,
        "recovery": {k: recovery.get(k) for k in ("step", "seconds", "source_group")} if recovery else None,
        "recovery_s": recovery.get("seconds"),
        "rejoin_after_kill_s": round(t_rejoin - t_kill, 3) if t_rejoin else None,
        "param_sha256": shas, "final_weights_equal": shas[0] is not None and shas[0] == shas[1],
        "launcher_stderr": notable(err.read_text(errors="replace"),
                                   ("ddp_kit: launch ft", "recovered live", "replica group", "Error", "error:")),
        "job_stdout": notable((root / "stdout.log").read_text(errors="replace"),
                              ("recovered live", "waiting for the other", "warning", "done:")),
    }


# ---- report ---------------------------------------------------------------------------------------

def numbers(rounds: list[dict], key: str) -> list[float]:
    return [r[key] for r in rounds if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def summarize(rounds: list[dict], keys: tuple[str, ...]) -> dict:
    out = {k: round(statistics.median(v), 3) if (v := numbers(rounds, k)) else None for k in keys}
    out["min_max"] = {k: [min(v), max(v)] for k in keys if (v := numbers(rounds, k))}
    out["final_weights_equal"] = all(r.get("final_weights_equal") is True for r in rounds)
    out["all_exit_0"] = all(r.get("exit") == 0 for r in rounds)
    return out


A_KEYS = ("pause_s", "kill_to_first_step_s", "kill_to_restart_start_s", "restart_start_to_first_step_s", "replay_s",
          "back_to_reached_step_s", "steps_discarded", "steps_replayed", "recovery_s", "step_s")
B_KEYS = ("pause_s", "pause_at_loss_s", "pause_at_rejoin_s", "gap_pause_s", "gap_pause_at_loss_s",
          "gap_pause_at_rejoin_s", "steps_discarded", "steps_discarded_events", "steps_replayed", "recovery_s",
          "rejoin_after_kill_s", "step_s")


def table(a: dict, b: dict) -> str:
    def cell(v):
        return "—" if v is None else (f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))

    def span(d, k):
        low, high = d["min_max"].get(k, (None, None))
        return f"{cell(d[k])} [{cell(low)}..{cell(high)}]"

    rows = [
        "| path | pause per failure (s) | from record times (s) | steps discarded | steps replayed | recovery (s) "
        "| final weights equal |",
        "|---|---|---|---|---|---|---|",
        f"| (a) torchrun restart, resume from checkpoint | {span(a, 'pause_s')} (restart {cell(a['kill_to_first_step_s'])}"
        f" + replay {cell(a['replay_s'])}) | {cell(a['back_to_reached_step_s'])} | {cell(a['steps_discarded'])} "
        f"(all redone) | {cell(a['steps_replayed'])} | {span(a, 'recovery_s')} | {cell(a['final_weights_equal'])} "
        f"(between the 2 ranks) |",
        f"| (b) ft, survivor group 0 | {span(b, 'pause_s')} (loss {cell(b['pause_at_loss_s'])} + rejoin "
        f"{cell(b['pause_at_rejoin_s'])}) | {cell(b['gap_pause_s'])} (loss {cell(b['gap_pause_at_loss_s'])} + rejoin "
        f"{cell(b['gap_pause_at_rejoin_s'])}) | {span(b, 'steps_discarded')} | {cell(b['steps_replayed'])} | "
        f"{span(b, 'recovery_s')} (live, group 1) | {cell(b['final_weights_equal'])} (group 0 = group 1) |",
    ]
    return "\n".join(rows)


def main(steps: int = 800, kill_at: int | None = None, repeats: int = 3, ckpt_every: int = 50,
         inject: str = "slow:rank=0:step=1:ms=20:always=1", dir: str = "/tmp/ddp_kit_ft_bench",
         out: str | None = None, timeout_s: float = 180, keep: bool = False, render: str | None = None):
    """`kill_at`: the step after which the worker is killed (default: halfway between two checkpoints
    near a quarter of the run, so that (a) replays half a checkpoint interval and, in (b), the
    restarted group has time to start (several seconds on 2 cores) and join before the survivor ends).
    `timeout_s`: per run; a run still going then is recorded (exit null, left_running) and killed.
    `render`: a results JSON of this bench: recompute its medians and table from its rounds, measure nothing."""
    if render:
        report = json.loads(Path(render).read_text())
        report["median"] = {"restart": summarize(report["rounds"]["restart"], A_KEYS),
                            "ft": summarize(report["rounds"]["ft"], B_KEYS)}
        return publish(report, out)
    if kill_at is None:
        kill_at = (steps // 4 // ckpt_every) * ckpt_every + ckpt_every // 2
    root = Path(dir)
    shutil.rmtree(root, ignore_errors=True)
    rounds: dict[str, list[dict]] = {"restart": [], "ft": []}
    for i in range(repeats):
        for path in ("restart", "ft"):
            where = root / f"{path}_{i}"
            where.mkdir(parents=True)
            t = time.monotonic()
            res = restart_path(where, steps, kill_at, ckpt_every, inject, timeout_s) if path == "restart" \
                else ft_path(where, steps, kill_at, inject, timeout_s)
            res["wall_s"] = round(time.monotonic() - t, 1)
            rounds[path].append(res)
            print(f"round {i + 1}/{repeats} {path}: pause {res['pause_s']}s, replayed {res['steps_replayed']}, "
                  f"exit {res['exit']}, {res['wall_s']}s", file=sys.stderr, flush=True)
    a, b = summarize(rounds["restart"], A_KEYS), summarize(rounds["ft"], B_KEYS)
    from importlib.metadata import version
    from inspect import signature

    import torch

    from ddp_kit.launch.ft import ft as launch_ft
    from ddp_kit.parallel.ft import Timeouts

    report = {"steps": steps, "kill_at": kill_at, "repeats": repeats, "ckpt_every": ckpt_every, "inject": inject,
              "machine": {"cpus": os.cpu_count(), "device": "cpu", "backend": "gloo"},
              "timeouts": {"lighthouse_heartbeat_ms": signature(launch_ft).parameters["heartbeat_timeout_ms"].default,
                           "ft_collective_s": Timeouts.from_environ(os.environ).collective_s,
                           "ft_quorum_s": Timeouts.from_environ(os.environ).quorum_s},
              "versions": {"torch": torch.__version__, "torchft-nightly": version("torchft-nightly")},
              "median": {"restart": a, "ft": b}, "rounds": rounds}
    publish(report, out)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


def publish(report: dict, out: str | None) -> None:
    print(json.dumps(report["median"], indent=2))
    print(table(report["median"]["restart"], report["median"]["ft"]))
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
