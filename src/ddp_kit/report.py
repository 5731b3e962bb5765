"""`python -m ddp_kit.report RUN_DIR`: RUN_DIR/report.png (loss and accuracy, throughput, per-rank step
time, memory, the numbers a script logged itself with run.log_event, and the attempts on a wall-clock
timeline with their lost time by cause) and RUN_DIR/report.csv (one row per rank per log event). Needs
matplotlib (pip install 'ddp_kit[report]').

Only panels with data are drawn: a user's own script may log a few train records and no eval at all,
and an empty panel (or a legend naming series that are not there) reads as a broken run."""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError
from .exit_codes import EXIT_USER_ERROR
from .run_account import CAUSES, LEDGER, RunAccount, account, max_steps_of, read
from .run_folder import RunDir

# Fields of a non-train record that are not metrics: the x axis, the writer's timestamp, and ids.
NOT_METRICS = {"step", "epoch", "time", "rank", "pid", "id"}
# The reference job's eval fields, drawn in the loss panel (eval_samples is a count, not a metric).
EVAL_DRAWN = {"eval_loss", "eval_accuracy", "eval_samples"}
# What strategy ft's step boundary writes (parallel/ft_steps.py): its own panel, not the script's.
REPLICA_EVENTS = {"quorum", "step_discarded", "replica_pause", "recovery", "replica_weights_checked"}
# The timeline's colour for goodput and each badput cause (run_account.CAUSES).
CAUSE_COLORS = {"goodput": "tab:green", "startup": "tab:blue", "checkpoint": "tab:purple", "evaluation": "tab:cyan",
                "replayed": "tab:red", "down": "lightgrey", "hang": "tab:orange", "replica": "tab:olive",
                "other": "darkgrey", "unlogged": "khaki"}


def load(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl. A line that is not a JSON object (the truncated last line of a
    crashed run, a stray print) is skipped with a warning: the rest of the run is still worth a report."""
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise UserError(f"no metrics.jsonl in {str(run_dir)!r}", "pass the run_dir of a ddp_kit run")
    records, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if isinstance(r, dict):
            records.append(r)
        else:
            bad += 1
    if bad:
        print(f"ddp_kit: warning: skipped {bad} line{'s' if bad != 1 else ''} of {path} that "
              f"{'are' if bad != 1 else 'is'} not a JSON object (a truncated last line?)", file=sys.stderr)
    return records


def _num(v) -> bool:
    """A plottable number: int or float, not bool (True is an int to Python) nor NaN/inf, nor an int too big
    for a float (math.isfinite would raise OverflowError on it)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -1e300 < v < 1e300


def _ranks(r: dict) -> list[dict]:
    """A train record's per-rank entries (absent without rank_metrics)."""
    return [x for x in r.get("ranks") or [] if isinstance(x, dict) and "rank" in x]


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def write_csv(records: list[dict], out: Path) -> int:
    # A user's own script may log train records without loss, lr or samples/s: those cells stay empty.
    rows = []
    for r in records:
        if r.get("event") != "train":
            continue
        for rank in _ranks(r) or [{"rank": 0}]:
            rows.append({"step": r.get("step"), "epoch": r.get("epoch"), "loss": r.get("loss"), "lr": r.get("lr"),
                         "global_samples_per_s": r.get("samples_per_s"), **rank})
    first = ["step", "epoch", "rank", "host"]
    fields = first + sorted({k for row in rows for k in row} - set(first))
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return len(rows)


@dataclass
class Panel:
    """One subplot. series: (label, xs, ys, matplotlib style); right: the same on a twin y axis;
    bars: the series are stacked bars over ranks."""
    title: str
    xlabel: str
    ylabel: str
    series: list = field(default_factory=list)
    right: list = field(default_factory=list)
    ylabel2: str = ""
    legend: bool = True
    bars: bool = False
    draw: Any = None  # draws the panel itself on an axis (the timeline), instead of series


def _line(label: str, pts: list, **style) -> list:
    """[the series] if it has a point, else []: a series without data gets no legend entry."""
    return [(label, [s for s, _ in pts], [v for _, v in pts], style)] if pts else []


def _points(recs: list[dict], key: str, scale: float = 1.0) -> list:
    return [(r["step"], r[key] * scale) for r in recs if _num(r.get("step")) and _num(r.get(key))]


def panels(records: list[dict]) -> list[Panel]:
    """What report.png shows: only series with at least one point, only panels with a series."""
    train = [r for r in records if r.get("event") == "train"]
    ev = [r for r in records if r.get("event") == "eval"]
    out = []

    left = _line("train loss", _points(train, "loss")) + _line("eval loss", _points(ev, "eval_loss"), fmt="o-")
    acc = _line("eval accuracy", _points(ev, "eval_accuracy"), fmt="s--", color="tab:green")
    if left:
        title = "loss and accuracy" if acc else "loss"
        out.append(Panel(title, "step", "loss", left, right=acc, ylabel2="eval accuracy"))
    elif acc:  # accuracy alone: on the main axis, not on a twin beside an empty one
        out.append(Panel("eval accuracy", "step", "eval accuracy", acc))

    out.append(Panel("throughput", "step", "samples/s", _line("global", _points(train, "samples_per_s")), legend=False))

    ranks = sorted({x["rank"] for r in train for x in _ranks(r)})
    step_time, memory = [], []
    for k in ranks:
        mine = [(r["step"], x) for r in train if _num(r.get("step")) for x in _ranks(r) if x["rank"] == k]
        host = next((x["host"] for _, x in mine if x.get("host")), None)
        step_time += _line(f"rank {k} ({host})" if host else f"rank {k}",
                           [(s, x["local_s"] * 1e3) for s, x in mine if _num(x.get("local_s"))], marker=".")
        memory += _line(f"rank {k}", [(s, x["peak_mem_mb"]) for s, x in mine if _num(x.get("peak_mem_mb"))], marker=".")
    out.append(Panel("per-rank step time: a straggler stands out", "step", "ms per step of own work (no waiting)", step_time))
    out.append(Panel("memory (CUDA allocator peak or CPU RSS)", "step", "peak memory (MiB)", memory))
    out.append(_model_state(train))
    out.append(_replicas(train, records))

    # What a script logged itself (run.log_event): every numeric field of a non-train record, against
    # its step. The reference job's eval fields are in the loss panel already.
    user: dict[str, list] = {}  # series label ("val val_acc", or the field alone without an event): points
    for r in records:
        event = r.get("event")
        if event == "train" or event in REPLICA_EVENTS or not _num(r.get("step")):
            continue
        for key, v in r.items():
            if key in NOT_METRICS or key.endswith("_id") or key == "event" or (event == "eval" and key in EVAL_DRAWN):
                continue
            if _num(v):
                user.setdefault(f"{event} {key}" if event not in (None, "") else key, []).append((r["step"], v))
    series = [s for label, pts in user.items() for s in _line(label, pts, marker=".")]
    out.append(Panel("logged by the script (run.log_event)", "step", "value", series))
    return [p for p in out if p.series]


def outline(records: list[dict]) -> list[tuple[str, list[str]]]:
    """(panel title, [series labels]) of what report.png will show."""
    return [(p.title, [s[0] for s in p.series + p.right]) for p in panels(records)]


def _replicas(train: list[dict], records: list[dict]) -> Panel:
    """Strategy ft: the replica groups in each step's quorum, and what a lost or returning group cost
    this group (the pauses, the discarded steps, its own live recoveries); empty for other strategies."""
    of = lambda kind: [r for r in records if r.get("event") == kind]
    series = (_line("replica groups in the quorum", _points(train, "participants"), drawstyle="steps-post")
              + _line("discarded step", [(r["step"], 0) for r in of("step_discarded") if _num(r.get("step"))],
                      fmt="x", color="tab:red"))
    right = (_line("pause (s)", _points(of("replica_pause"), "paused_s"), fmt="o", color="tab:orange")
             + _line("live recovery (s)", _points(of("recovery"), "seconds"), fmt="s", color="tab:green"))
    return Panel("replica groups (strategy ft)", "step", "groups", series, right=right, ylabel2="seconds")


def _model_state(train: list[dict]) -> Panel:
    """Each rank's parameter, gradient and optimizer bytes at the last record, stacked: under FSDP
    about 1/N of what DDP holds on every rank."""
    last = next((_ranks(r) for r in reversed(train) if any("param_bytes" in x for x in _ranks(r))), [])
    p = Panel("model state per rank at the last record (FSDP: about 1/N of DDP's)", "rank", "MiB", bars=True)
    for key, label in (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_bytes", "optimizer state")):
        p.series.append((label, [x["rank"] for x in last], [x.get(key, 0) / 2**20 for x in last], {}))
    if not last:
        p.series = []
    return p


def ledger_of(run_dir: Path) -> RunAccount | None:
    """The run's account of its run ledger (ddp_kit/run_account.py), for the timeline panel; None without a
    start line (a run from before the ledger, or a user's script run without a run_dir's attempts)."""
    try:
        records, _ = read(Path(run_dir) / LEDGER)
    except OSError:
        return None
    if not any(r["event"] == "start" for r in records):
        return None
    return account(records, max_steps=max_steps_of(Path(run_dir)))


def timeline(run: RunAccount) -> Panel:
    """Attempts as spans on the wall clock (one row each), green where steps were kept; each
    attempt's lost time coloured by cause where it happened (start-up first; replayed steps, the hang
    and the unexplained rest at the end; checkpoints, evaluation and pauses at their lines' times),
    the down time before it in grey; checkpoints as ticks, an attempt that failed as a cross."""
    unit, name = (3600.0, "h") if run.wall_s > 3 * 3600 else (60.0, "min") if run.wall_s > 300 else (1.0, "s")
    x = lambda t: (t - run.start_t) / unit
    lost = {k: v for k, v in run.badput.items() if v > 0}
    title = f"attempts: goodput {run.goodput_pct:.0f}% of {run.wall_s / unit:.3g} {name} wall (python -m ddp_kit.status)"

    def draw(ax: Any) -> None:
        from matplotlib.patches import Patch

        prev = None
        for a in run.attempts:
            y, sec = a.number, a.seconds
            def bar(t0: float, t1: float, cause: str, y: int = y) -> None:
                ax.broken_barh([(x(t0), max(0.0, t1 - t0) / unit)], (y - 0.35, 0.7), color=CAUSE_COLORS[cause], linewidth=0)

            bar(a.launched_t, a.end_t, "goodput")
            if prev is not None:
                bar(prev, a.launched_t, "down")
            bar(a.launched_t, a.launched_t + sec["startup"], "startup")
            t = a.end_t
            for cause in ("unlogged", "other", "hang", "replayed"):
                bar(t - sec[cause], t, cause)
                t -= sec[cause]
            for at, cause, s in a.marks:
                bar(at - s, at, cause)
            if a.verdict not in ("finished", "running"):
                ax.plot([x(a.end_t)], [y], "x", color="black", markersize=8)
                ax.annotate(a.verdict, (x(a.end_t), y), xytext=(4, 4), textcoords="offset points", fontsize=7)
            prev = a.end_t
        ticks = [(x(c.t), c.attempt) for c in run.checkpoints]
        ax.plot([t for t, _ in ticks], [n for _, n in ticks], "|", color="black", markersize=10)
        ax.set_yticks([a.number for a in run.attempts] if len(run.attempts) <= 20 else [])
        ax.invert_yaxis()
        shown = {"goodput": run.goodput_s, **{k: lost[k] for k in CAUSES if k in lost}}
        ax.legend(handles=[Patch(color=CAUSE_COLORS[k], label=f"{k} {v / unit:.2g} {name}") for k, v in shown.items()],
                  loc="best", fontsize=7)

    return Panel(title, f"wall clock ({name} since the first launch)", "attempt", legend=False, draw=draw)


def plot(records: list[dict], out: Path, title: str, run: RunAccount | None = None) -> None:
    todo = panels(records) + ([timeline(run)] if run is not None else [])
    if not todo:
        raise UserError("nothing to plot: metrics.jsonl has no record with a numeric step and a numeric value",
                        "log records with run.log_event({'step': ..., 'name': number}) or train with run.step(loss)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 1 if len(todo) == 1 else 2
    rows = -(-len(todo) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, p in zip(flat, todo):
        _draw(ax, p)
    for ax in flat[len(todo):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _draw(ax, p: Panel) -> None:
    if p.draw is not None:
        p.draw(ax)
        ax.set_xlabel(p.xlabel), ax.set_ylabel(p.ylabel), ax.set_title(p.title, fontsize=9)
        return
    if p.bars:
        bottom = [0.0] * len(p.series[0][1])
        for label, xs, ys, _ in p.series:
            ax.bar(xs, ys, bottom=bottom, label=label)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_xticks(p.series[0][1])
    else:
        for label, xs, ys, style in p.series:
            style = dict(style)
            ax.plot(xs, ys, style.pop("fmt", "-"), label=label, **style)
    ax.set_xlabel(p.xlabel), ax.set_ylabel(p.ylabel), ax.set_title(p.title)
    lines = ax.get_legend_handles_labels()[0]
    if p.right:
        ax2 = ax.twinx()
        for label, xs, ys, style in p.right:
            style = dict(style)
            ax2.plot(xs, ys, style.pop("fmt", "-"), label=label, **style)
        ax2.set_ylabel(p.ylabel2)
        lines += ax2.get_legend_handles_labels()[0]
    if p.legend:
        ax.legend(lines, [h.get_label() for h in lines], loc="center right" if p.right else "best")


def title_for(run_dir: Path, records: list[dict]) -> str:
    """The run dir and what summary.json says of it. A user's own script writes its own summary (or
    none), so each part is there only when its field is; the rank count falls back to the records."""
    summary, s = RunDir(run_dir).summary, {}
    if summary.exists():
        try:
            s = json.loads(summary.read_text())
        except ValueError:
            pass
    s = s if isinstance(s, dict) else {}
    world = s.get("world_size")
    if not _num(world):
        world = len({x["rank"] for r in records if r.get("event") == "train" for x in _ranks(r)}) or None
    parts = [plural(int(world), "rank")] if world else []
    if _num(s.get("steps")):
        parts.append(plural(int(s["steps"]), "step"))
    if _num(s.get("eval_accuracy")):
        parts.append(f"eval accuracy {s['eval_accuracy']:.3f}")
    return f"{run_dir}  ({', '.join(parts)})" if parts else str(run_dir)


def main(run_dir: str) -> None:
    """Write RUN_DIR/report.png and RUN_DIR/report.csv from RUN_DIR/metrics.jsonl."""
    try:
        d = Path(run_dir)
        records = load(d)
        n = write_csv(records, d / "report.csv")
        try:
            import matplotlib  # noqa: F401  (a clear error before plotting)
        except ImportError:
            raise UserError("matplotlib is not installed, so no report.png (report.csv was written)",
                            "pip install 'ddp_kit[report]'") from None
        plot(records, d / "report.png", title_for(d, records), ledger_of(d))
        print(f"wrote {d / 'report.png'} and {d / 'report.csv'} ({n} rows)")
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    import fire

    fire.Fire(main)
