"""Does `ckpt_every auto` lose as little time as the best fixed interval? The reference job (one process, CPU)
under failures injected from outside, for a sweep of fixed `--ckpt_every` intervals and `auto`, under a cheap
save and a slow one (`--debug_ckpt_delay_s`).

    python bench/ckpt_interval.py [--seeds 0,1] [--mean_s 2] [--scale 0.6] [--launch fork|exec] [--quick]
                                  [--keep DIR]

This script is the restarter: it launches the job, SIGKILLs it (its own child's process group, by its id)
when the kill schedule says, and launches it again with the same arguments (the job resumes from its newest
checkpoint) until the job finishes. The schedule is seeded exponential draws of mean `mean_s`, each counted
from the attempt's first step (its `first_step` line in run_dir/attempts.jsonl). Counted from the launch, the
start-up (5-8 s of imports under `exec` on this loaded machine) would shift each kill against the training
it cuts by its jitter, and add that jitter to the replay. Counted from the first step, a kill lands the same
seconds into training for every configuration. Every configuration of a seed sees the same schedule, so they
differ only by their interval (and by the machine's load while they ran: other jobs share it).

Launch `fork` (the default) starts each attempt as a child of this process, which imported torch and ddp_kit
once: the same entry point (`runpy` of ddp_kit.train) and arguments, ~0.3 s to the first step instead of 5-8
s. Start-up is not lost time here, but the failures per minute of the bench's wall are what bound its noise:
fork gives about 3x more of them. `exec` starts a fresh `python -m ddp_kit.train`, as a scheduler would.

Lost time per run = the `checkpoint` (loop blocked by saves) and `replayed` (steps trained again) badput of
`python -m ddp_kit.status RUN_DIR --json`. Configurations per case: the fixed SWEEP, `auto` (the default prior,
node_mtbf_h 1000: what a user gets) and `auto_prior` (node_mtbf_h set to the injected mean: the prior is
right). A fixed interval whose lost time passes `censor` times the best fixed one's so far is stopped there
(its lost time is then a lower bound, marked); so is a run that the schedule runs out on. Verdicts: auto
within TOLERANCE of the best fixed interval in every case; every fixed interval more than TOLERANCE over the
best in at least one case. Next to each measured lost time, a model's (expected_lost_s at the run's interval,
the case's median save cost and step time, failures at the injected rate): it compares the intervals free of
the luck of where the kills fell, and without auto's learning (its interval is the last one it chose).
Writes bench/ckpt_interval_results.json.
"""
from __future__ import annotations

import json
import math
import os
import random
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import fire

from ddp_kit.run_account import load  # no torch: the launch mode "exec" keeps this process light

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARGS = ["--epochs", "100000", "--eval_every_epoch", "false", "--log_every", "50", "--progress", "false",
        "--health_check", "off",  # start-up is not what is measured: the gate would only add to it
        # 8 ms of sleep in every step: a step of 10-14 ms whatever other jobs do, not 1.2-6 ms (3-5x under the
        # load this shared machine sees): a fixed interval in steps then stays about one in seconds
        "--inject", "slow:rank=0:step=1:ms=8:always=1"]
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
SWEEP = (10, 30, 100, 300)  # fixed --ckpt_every; brackets both cases' optimum (see BENCHMARKS.md)


@dataclass(frozen=True)
class Case:
    delay_s: float  # --debug_ckpt_delay_s: each save writes 2 files, so a save blocks 2x this longer
    max_steps: int  # the slow case loses more than half its time: half the steps keep its runs as long
    guess: int  # the fixed interval expected best (Young's, at ~10 ms a step): run first, it sets the bar


CASES = {"cheap save": Case(0.0, 3000, 30), "slow save": Case(0.3, 1400, 100)}
AUTOS = ("auto", "auto_prior")
TOLERANCE = 0.15
KILLS = 200  # schedule length: a run still unfinished after this many kills is stopped (censored)
POLL_S = 0.005


def kill_schedule(seed: int, mean_s: float, n: int = KILLS) -> list[float]:
    """Seconds after each attempt's first step at which it is killed: exponential draws of mean `mean_s`.
    A seed gives the same list to every configuration."""
    rng = random.Random(seed)
    return [rng.expovariate(1.0 / mean_s) for _ in range(n)]


def young_s(cost_s: float, mean_s: float) -> float:
    """Young's interval (training seconds between saves) for a save of `cost_s` and failures `mean_s` apart."""
    return math.sqrt(2.0 * cost_s * mean_s)


def verdicts(lost: dict[str, dict[str, float]], censored: dict[str, dict[str, bool]] | None = None,
             tolerance: float = TOLERANCE) -> dict[str, Any]:
    """From {case: {config: lost seconds}} (configs: str(steps) for the fixed ones, and AUTOS): the best fixed
    interval per case, each auto's ratio to it, and whether every fixed interval is worse than the tolerance
    over the best in at least one case. A censored run's lost time is a lower bound: it is never the best."""
    censored = censored or {}
    out: dict[str, Any] = {"tolerance": tolerance, "cases": {}}
    fixed_names = sorted({c for row in lost.values() for c in row if c not in AUTOS}, key=int)
    worse_somewhere = dict.fromkeys(fixed_names, False)
    for case, row in lost.items():
        done = {c: v for c, v in row.items() if c not in AUTOS and not censored.get(case, {}).get(c)}
        best = min(done, key=lambda c: done[c])
        per = {"best_fixed": best, "best_fixed_lost_s": row[best]}
        for a in AUTOS:
            if a in row:
                per[f"{a}_ratio"] = row[a] / row[best]
                per[f"{a}_within"] = (row[a] <= (1.0 + tolerance) * row[best]
                                      and not censored.get(case, {}).get(a, False))
        per["fixed_ratio"] = {c: row[c] / row[best] for c in fixed_names if c in row}
        for c in fixed_names:
            worse_somewhere[c] |= c in row and row[c] > (1.0 + tolerance) * row[best]
        out["cases"][case] = per
    for a in AUTOS:
        if all(f"{a}_within" in per for per in out["cases"].values()):
            out[f"{a}_within_everywhere"] = all(per[f"{a}_within"] for per in out["cases"].values())
    out["fixed_worse_somewhere"] = worse_somewhere
    out["every_fixed_worse_somewhere"] = all(worse_somewhere.values())
    return out


@dataclass(frozen=True)
class Outcome:
    """One configuration's run: its lost time (seconds) and what it is made of."""
    lost_s: float
    checkpoint_s: float
    replayed_s: float
    replayed_steps: int
    first_replayed_s: float  # the first attempt's replay: auto's, before any failure told it the rate
    kills: int
    attempts: int
    saves: int
    wall_s: float
    censored: bool
    badput: dict[str, float]
    kill_lag_ms: float  # median lateness of the kills against the schedule
    step_s: float  # median of the attempts' step times
    cost_s: float  # median save blocking time
    every_s: float  # training seconds between saves: ckpt_every x step_s, or auto's last choice
    cadence: dict[str, Any] | None  # auto: the last cadence line's durable tier


def _status(run_dir: Path) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-m", "ddp_kit.status", str(run_dir), "--json"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    if res.returncode != 0:
        raise SystemExit(f"status of {run_dir} failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout)


def _lost(account: dict[str, Any]) -> float:
    return account["badput"]["checkpoint"] + account["badput"]["replayed"]


class Ledger:
    """Reads run_dir/attempts.jsonl as the job appends it (complete lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.tail = path, 0, b""

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.tail + data).split(b"\n")
        self.tail = lines.pop()
        return [r for r in map(_record, lines) if r]


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except ValueError:
        return None  # a line cut by a kill (the next attempt's first line may follow it on the same line)


class Forked:
    """`python -m ddp_kit.train ARGS` as a child forked from this process, which has imported torch and
    ddp_kit already (prewarm): the same entry point and arguments, without the 5-8 s of imports. Has the
    pid, poll and wait of subprocess.Popen; the child leads its own process group, as Popen's would."""

    def __init__(self, args: list[str], log: Path):
        sys.stdout.flush()
        sys.stderr.flush()  # or the child would print this process's buffered lines again
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            _child(args, log)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _child(args: list[str], log: Path) -> NoReturn:
    code = 1
    try:
        os.setsid()
        os.chdir(ROOT)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = ["ddp_kit.train", *args]
        runpy.run_module("ddp_kit.train", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never back into the bench's own loop


def prewarm() -> None:
    """Import what the job imports (torch, ddp_kit, the modules it imports lazily), once, before forking."""
    os.environ.update(ENV)  # before torch's first import: its thread pools are sized then
    import torch._dynamo  # noqa: F401  (the optimizer's constructor imports it)
    import torch.distributed.fsdp  # noqa: F401  (the checkpoint code asks whether a state is sharded)

    import ddp_kit.train.command  # noqa: F401


def _start(launch: str, args: list[str], log: Path) -> Forked | subprocess.Popen:
    if launch == "fork":
        return Forked(args, log)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ddp_kit.train", *args], env={**os.environ, **ENV}, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: Forked | subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's group, by its id
    except ProcessLookupError:
        pass  # it has just exited
    proc.wait()


def _attempt(launch: str, args: list[str], ledger: Ledger, seen: int, kill_after_s: float,
             log: Path) -> tuple[str, float, int]:
    """Launch one attempt and kill it `kill_after_s` after its first step. Returns (how it ended: "killed" or
    "finished", the kill's lateness in seconds, the newest attempt number seen in the ledger)."""
    proc = _start(launch, args, log)
    kill_at = None
    try:
        while proc.poll() is None:
            for r in ledger.new_records():
                if r.get("event") == "first_step" and int(r.get("attempt", 0)) > seen:
                    seen, kill_at = int(r["attempt"]), float(r["t"]) + kill_after_s
                elif r.get("event") == "end" and r.get("attempt") == seen:
                    kill_at = math.inf  # it has finished and is exiting: a kill now would only cost a restart
            if kill_at is not None and time.time() >= kill_at:
                _kill(proc)
                return "killed", time.time() - kill_at, seen
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            _kill(proc)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed (exit {proc.returncode}); its output: {log}\n"
                         + log.read_text(errors="replace")[-2000:])
    return "finished", 0.0, seen


def run_config(config: str, delay_s: float, schedule: list[float], run_dir: Path, max_steps: int,
               mean_s: float, cap_s: float, launch: str) -> Outcome:
    """One configuration to the end (or until its lost time passes cap_s: censored)."""
    every = "auto" if config in AUTOS else config
    args = [*ARGS, "--max_steps", str(max_steps), "--run_dir", str(run_dir), "--ckpt_every", every,
            "--debug_ckpt_delay_s", str(delay_s)]
    if config == "auto_prior":
        args += ["--node_mtbf_h", repr(mean_s / 3600.0)]
    ledger, seen, lags, censored = Ledger(run_dir / "attempts.jsonl"), 0, [], False
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    for after_s in schedule:
        ended, lag, seen = _attempt(launch, args, ledger, seen, after_s, run_dir.parent / f"{run_dir.name}.log")
        if ended == "finished":
            break
        lags.append(lag)
        if _lost(load(run_dir).as_dict()) > cap_s:  # what status --json says, without its interpreter's start
            censored = True
            break
    else:
        censored = True  # the schedule ran out before the job finished
    wall = time.monotonic() - t0
    acc = _status(run_dir)
    tier = (((acc.get("cadence") or {}).get("tiers") or {}).get("durable")) if config in AUTOS else None
    step_s = statistics.median(a["step_time_s"] for a in acc["attempts"] if a["step_time_s"])
    costs = [c["blocking_s"] for c in acc["checkpoints"]]
    cost_s = statistics.median(costs) if costs else math.nan  # a run censored before its first save
    every_s = float(tier["every_s"]) if tier else int(config) * step_s
    return Outcome(lost_s=_lost(acc), checkpoint_s=acc["badput"]["checkpoint"], replayed_s=acc["badput"]["replayed"],
                   replayed_steps=acc["replayed_steps"], first_replayed_s=acc["attempts"][0]["seconds"]["replayed"],
                   kills=len(lags), attempts=len(acc["attempts"]),
                   saves=len(acc["checkpoints"]), wall_s=wall, censored=censored,
                   badput={k: round(v, 3) for k, v in acc["badput"].items()},
                   kill_lag_ms=1e3 * statistics.median(lags) if lags else 0.0, step_s=step_s, cost_s=cost_s,
                   every_s=every_s, cadence=tier)


def expected_lost_s(every_s: float, cost_s: float, mean_s: float, work_s: float) -> float:
    """Seconds lost (saves and replay) to complete `work_s` of training that saves after every `every_s` of it,
    a save taking `cost_s`, under failures `mean_s` apart in training time (exponential): each segment of
    every_s + cost_s takes (e^((every_s + cost_s)/mean_s) - 1) * mean_s on average, restarts excluded."""
    every_s = min(every_s, work_s)  # an interval longer than the work: one segment, the final save
    segment = (math.exp((every_s + cost_s) / mean_s) - 1.0) * mean_s
    return work_s * (segment / every_s - 1.0)


def _order(sweep: tuple[int, ...], guess: int) -> list[str]:
    """Autos first (never censored), then the fixed intervals from the one nearest the expected optimum
    outwards: a poor interval runs after a good one has set the bar, and is stopped early."""
    return [*AUTOS, *sorted((str(n) for n in sweep), key=lambda n: abs(math.log(int(n) / guess)))]


def run_case(name: str, case: Case, seed: int, root: Path, sweep: tuple[int, ...], scale: float, mean_s: float,
             censor: float, launch: str) -> list[dict[str, Any]]:
    schedule = kill_schedule(seed, mean_s)
    got: dict[str, Outcome] = {}
    max_steps = max(1, round(case.max_steps * scale))
    for config in _order(sweep, case.guess):
        done = [o.lost_s for c, o in got.items() if c not in AUTOS and not o.censored]  # the best fixed so far
        cap = censor * min(done) if done and config not in AUTOS else math.inf
        tag = f"s{seed}-{name.split()[0]}-{config}"
        got[config] = o = run_config(config, case.delay_s, schedule, root / tag, max_steps, mean_s, cap, launch)
        print(f"[{name}, seed {seed}] {config:>10}: lost {o.lost_s:6.2f} s (checkpoint {o.checkpoint_s:.2f}, "
              f"replayed {o.replayed_s:.2f}){' CENSORED' if o.censored else ''}, {o.kills} kills, {o.saves} saves, "
              f"every {o.every_s:.2f} s, wall {o.wall_s:.0f} s", flush=True)
    return [{"seed": seed, "case": name, "config": c, "max_steps": max_steps, **asdict(o)} for c, o in got.items()]


def _sum(runs: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in runs)


def _ratio(verdict: dict[str, Any], case: str, config: str) -> float:
    per = verdict["cases"][case]
    return per["fixed_ratio"].get(config, per.get(f"{config}_ratio", math.nan))


def _table(runs: list[dict[str, Any]], verdict: dict[str, Any], model: dict[str, Any], configs: list[str]) -> str:
    """Per case: lost time summed over seeds (x the best fixed interval's; >= a censored run's lower bound),
    each seed's, the model's expectation (x the best fixed one's), kills, and the interval in seconds."""
    cases = list(verdict["cases"])
    cols = ("lost s (x best)", "per seed", "model s (x best)", "kills", "every s")
    lines = ["| ckpt_every | " + " | ".join(f"{c}: {h}" for c in cases for h in cols) + " |",
             "|" + "---|" * (1 + len(cols) * len(cases))]
    for config in configs:
        cells = []
        for c in cases:
            mine = [r for r in runs if r["case"] == c and r["config"] == config]
            mark = ">= " if any(r["censored"] for r in mine) else ""
            cells += [f"{mark}{_sum(mine, 'lost_s'):.2f} ({_ratio(verdict, c, config):.2f})",
                      " / ".join(f"{r['lost_s']:.2f}" for r in mine),
                      f"{_sum(mine, 'expected_lost_s'):.2f} ({_ratio(model, c, config):.2f})",
                      str(_sum(mine, "kills")), f"{statistics.mean(r['every_s'] for r in mine):.2f}"]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _summary(runs: list[dict[str, Any]], mean_s: float, configs: list[str]) -> tuple[dict, dict, dict, dict]:
    """Per case and config, summed over seeds: lost time, censored (in any seed), the model's expected lost
    time (expected_lost_s at the run's interval, with the case's median save cost and step time); and per
    case: those, Young's interval at the injected rate, auto's rate estimate and interval at the end, and its
    first attempt's replay. Sets each run's every_s (the case's step time) and expected_lost_s."""
    lost: dict[str, dict[str, float]] = {}
    censored: dict[str, dict[str, bool]] = {}
    model: dict[str, dict[str, float]] = {}
    facts: dict[str, dict[str, Any]] = {}
    for c in dict.fromkeys(r["case"] for r in runs):
        mine = [r for r in runs if r["case"] == c]
        cost = statistics.median(r["cost_s"] for r in mine if not math.isnan(r["cost_s"]))
        step = statistics.median(r["step_s"] for r in mine)
        for r in mine:  # one save cost and step time for the case: the model compares intervals, nothing else
            r["every_s"] = r["cadence"]["every_s"] if r["cadence"] else int(r["config"]) * step
            r["expected_lost_s"] = expected_lost_s(r["every_s"], cost, mean_s, r["max_steps"] * step)
        lost[c] = {k: _sum([r for r in mine if r["config"] == k], "lost_s") for k in configs}
        censored[c] = {k: any(r["censored"] for r in mine if r["config"] == k) for k in configs}
        model[c] = {k: _sum([r for r in mine if r["config"] == k], "expected_lost_s") for k in configs}
        facts[c] = {"save_s": round(cost, 4), "step_s": round(step, 5), "young_every_s": round(young_s(cost, mean_s), 3),
                    "injected_rate_per_h": round(3600.0 / mean_s, 1)}
        for a in AUTOS:
            ends = [r for r in mine if r["config"] == a]
            facts[c][a] = {"rate_per_h": [round(r["cadence"]["rate_per_h"], 1) for r in ends if r["cadence"]],
                           "every_s": [round(r["every_s"], 3) for r in ends],
                           "first_replayed_s": [round(r["first_replayed_s"], 2) for r in ends]}
    return lost, censored, model, facts


def _plain(obj: Any) -> Any:
    """JSON without NaN or Infinity (a run that never saved has no cost, and no model): null instead."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def main(seeds: Any = "0,1", mean_s: float = 2.0, scale: float = 0.6, censor: float = 2.0, launch: str = "fork",
         quick: bool = False, keep: str = "", out: str = str(HERE / "ckpt_interval_results.json")) -> None:
    """seeds: e.g. 0 or 0,1 (one kill schedule each); mean_s: the mean time between kills, in training seconds;
    scale: the cases' max_steps times this; censor: stop a fixed interval once it lost this times the least;
    launch: fork (a child of this process, imports done: a restart costs ~0.3 s) or exec (a fresh
    `python -m ddp_kit.train`, as a scheduler restarts it: 5-8 s of imports per restart here);
    quick: the first seed, 2 fixed intervals and 40 % of the steps (a smoke run, ~2 minutes); keep: a folder for
    the run folders (by default they go with a temporary folder)."""
    if launch not in ("fork", "exec"):
        raise SystemExit(f"--launch {launch!r} is not a launch mode; pass fork or exec")
    if launch == "fork":
        prewarm()
    seed_list = [int(x) for x in (seeds if isinstance(seeds, (tuple, list)) else str(seeds).split(",")) if str(x)]
    sweep, scale, seed_list = ((30, 100), scale * 0.4, seed_list[:1]) if quick else (SWEEP, scale, seed_list)
    configs = [*AUTOS, *map(str, sweep)]
    t0, load0 = time.monotonic(), os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckpt_interval.") as d:
        if keep:
            d = keep  # the run folders stay, for `python -m ddp_kit.status` and their ledgers
            Path(d).mkdir(parents=True, exist_ok=True)
        for seed in seed_list:
            for name, case in CASES.items():
                runs += run_case(name, case, seed, Path(d), sweep, scale, mean_s, censor, launch)
    per_seed = {s: verdicts(*_summary([r for r in runs if r["seed"] == s], mean_s, configs)[:2]) for s in seed_list}
    lost, censored, model, facts = _summary(runs, mean_s, configs)  # last: the runs keep its every_s and model
    verdict, model_verdict = verdicts(lost, censored), verdicts(model)
    table = _table(runs, verdict, model_verdict, configs)
    result = {"machine": "2 shared cores, CPU; other jobs ran at the same time (load averages)",
              "load_avg_start": load0, "load_avg_end": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1),
              "params": {"seeds": seed_list, "mean_s": mean_s, "scale": scale, "censor": censor, "sweep": list(sweep),
                         "cases": {n: asdict(c) for n, c in CASES.items()}, "launch": launch,
                         "job": ["python", "-m", "ddp_kit.train", *ARGS]},
              "cases": facts, "lost_s": lost, "censored": censored, "verdicts": verdict,
              "per_seed_verdicts": per_seed, "model_lost_s": model, "model_verdicts": model_verdict, "table": table,
              "runs": runs}
    Path(out).write_text(json.dumps(_plain(result), indent=1) + "\n")
    print(table)
    print(json.dumps(facts))
    for name, said in (("measured", verdict), ("model", model_verdict)):
        print(name, json.dumps({k: v for k, v in said.items() if k != "cases"}))
    print(f"wall {result['wall_s']} s", flush=True)


if __name__ == "__main__":
    fire.Fire(main)
