"""`python -m ddp_kit.status` on a synthetic 100,000-step run: how long it takes to answer.

    python bench/status_bench.py [--steps 100000] [--attempts 50] [--log_every 10] [--rounds 5]

The run folder is written here (no training): `attempts` attempts, each killed 100 steps past its last
checkpoint (so 100 steps of each are replayed) except the last, which finishes; a progress line every
`log_every` steps (10,000 lines for the defaults), a checkpoint every 500 steps. Times the accounting in
this process (run_account.load, median of rounds) and the whole command as a user runs it (a fresh
interpreter: imports included). The issue asks for under a second."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP_S = 0.1
STARTUP_S = 5.0
CKPT_EVERY = 500
CKPT_BLOCKING_S = 0.5
REPLAYED_PER_KILL = 100


def synthetic_run(run_dir: Path, steps: int = 100_000, attempts: int = 50, log_every: int = 10) -> dict:
    """Write run_dir/attempts.jsonl and config.yaml; returns what the account must say (by construction)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    per = steps // attempts  # steps each attempt keeps
    lines, t = [], 1_700_000_000.0
    killed_before = None
    for i in range(attempts):
        number, resumed, last = i + 1, i * per, i * per + per + (REPLAYED_PER_KILL if i + 1 < attempts else 0)
        launched = t
        start = {"event": "start", "t": launched + 1, "attempt": number, "launched_t": launched,
                 "latest": resumed or None, "restart_count": i, "world_size": 8, "engine": "torchrun",
                 "hosts": [f"node{r // 4}" for r in range(8)]}
        if killed_before:
            start["killed_before"] = killed_before
        lines += [start, {"event": "resume", "t": launched + 2, "attempt": number, "step": resumed,
                          "from": "checkpoint" if resumed else "none"}]
        t = launched + STARTUP_S
        window = 0.0
        for s in range(resumed + 1, last + 1):
            t += STEP_S
            window += STEP_S
            if s == resumed + 1:
                lines.append({"event": "first_step", "t": t, "attempt": number, "step": s})
            if s % log_every == 0:
                lines.append({"event": "progress", "t": t, "attempt": number, "step": s, "window_s": window,
                              "steps": log_every, "slowest_rank": 5 if s % 30 else 2, "slowest_host": "node1"})
                window = 0.0
            if s % CKPT_EVERY == 0:
                t += CKPT_BLOCKING_S
                window += CKPT_BLOCKING_S
                lines.append({"event": "checkpoint", "t": t, "attempt": number, "step": s,
                              "blocking_s": CKPT_BLOCKING_S, "commit_s": 1.0})
        if number == attempts:
            t += 1.0
            lines.append({"event": "end", "t": t, "attempt": number, "exit": 0, "outcome": "done", "step": last,
                          "verdict": "finished", "retryable": False, "rank": 0, "host": "node0", "cause": "", "fix": ""})
        else:
            killed_before = {"step": last + 1, "phase": "data"}  # step last+1 had begun: `last` complete
            t += 30.0  # down: the engine notices, reschedules, relaunches
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "config.yaml").write_text(f"max_steps: {steps}\n")
    return {"lines": len(lines), "step": steps, "replayed_steps": REPLAYED_PER_KILL * (attempts - 1),
            "goodput_s": steps * STEP_S, "attempts": attempts}


def main(steps: int = 100_000, attempts: int = 50, log_every: int = 10, rounds: int = 5) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from ddp_kit.run_account import load

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        truth = synthetic_run(run_dir, steps, attempts, log_every)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            run = load(run_dir)
            times.append(time.perf_counter() - t0)
        assert run.replayed_steps == truth["replayed_steps"] and run.step == truth["step"], (run.replayed_steps, run.step)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ddp_kit.status", str(run_dir), "--json"], check=True,
                       stdout=subprocess.DEVNULL)
        command_s = time.perf_counter() - t0
    print(f"{truth['lines']} ledger lines ({steps} steps, {attempts} attempts): accounting {statistics.median(times) * 1e3:.1f} ms "
          f"(median of {rounds}); `python -m ddp_kit.status --json` {command_s * 1e3:.0f} ms, imports included "
          f"(asked: under 1 s)")


if __name__ == "__main__":
    import fire

    fire.Fire(main)
