"""`python -m ddp_kit.report RUN_DIR`: RUN_DIR/report.png (loss and accuracy, throughput, per-rank step
time, memory) and RUN_DIR/report.csv (one row per rank per log event). Needs matplotlib (pip install 'ddp_kit[report]')."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from .errors import EXIT_USER_ERROR, UserError
from .rundir import RunDir


def load(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise UserError(f"no metrics.jsonl in {str(run_dir)!r}", "pass the run_dir of a ddp_kit run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_csv(records: list[dict], out: Path) -> int:
    rows = []
    for r in records:
        if r.get("event") != "train":
            continue
        for rank in r.get("ranks") or [{"rank": 0}]:
            rows.append({"step": r["step"], "epoch": r["epoch"], "loss": r["loss"], "lr": r["lr"],
                         "global_samples_per_s": r["samples_per_s"], **{k: v for k, v in rank.items()}})
    first = ["step", "epoch", "rank", "host"]
    fields = first + sorted({k for row in rows for k in row} - set(first))
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def plot(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("event") == "train"]
    ev = [r for r in records if r.get("event") == "eval"]
    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    ax = axes[0][0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.set_title("loss and accuracy")
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "s--", color="tab:green", label="eval accuracy")
    ax2.set_ylabel("eval accuracy")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="center right")
    ax = axes[0][1]
    ax.plot([r["step"] for r in train], [r["samples_per_s"] for r in train], label="global")
    ax.set_xlabel("step"), ax.set_ylabel("samples/s"), ax.set_title("throughput")
    ranks = sorted({x["rank"] for r in train for x in r.get("ranks", [])})
    ax = axes[1][0]
    for k in ranks:
        pts = [(r["step"], x) for r in train for x in r.get("ranks", []) if x["rank"] == k]
        ax.plot([s for s, _ in pts], [x["local_s"] * 1e3 for _, x in pts], marker=".", label=f"rank {k} ({pts[0][1]['host']})")
    ax.set_xlabel("step"), ax.set_ylabel("ms per step of own work (no waiting)")
    ax.set_title("per-rank step time: a straggler stands out")
    if ranks:
        ax.legend()
    ax = axes[1][1]
    for k in ranks:
        pts = [(r["step"], x) for r in train for x in r.get("ranks", []) if x["rank"] == k]
        ax.plot([s for s, _ in pts], [x["peak_mem_mb"] for _, x in pts], marker=".", label=f"rank {k}")
    ax.set_xlabel("step"), ax.set_ylabel("peak memory (MiB)"), ax.set_title("memory (CUDA allocator peak or CPU RSS)")
    if ranks:
        ax.legend()
    _model_state(axes[2][0], train)
    axes[2][1].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _model_state(ax, train: list[dict]) -> None:
    """Each rank's parameter, gradient and optimizer bytes at the last record, stacked: under FSDP
    about 1/N of what DDP holds on every rank."""
    last = next((r.get("ranks") for r in reversed(train) if any("param_bytes" in x for x in r.get("ranks") or [])), None)
    ax.set_title("model state per rank at the last record (FSDP: about 1/N of DDP's)")
    if not last:
        ax.text(0.5, 0.5, "no memory figures in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
        return
    ranks = [x["rank"] for x in last]
    bottom = [0.0] * len(last)
    for key, label in (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_bytes", "optimizer state")):
        mib = [x.get(key, 0) / 2**20 for x in last]
        ax.bar(ranks, mib, bottom=bottom, label=label)
        bottom = [b + m for b, m in zip(bottom, mib)]
    ax.set_xlabel("rank"), ax.set_ylabel("MiB"), ax.set_xticks(ranks)
    ax.legend()


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
        summary = RunDir(d).summary
        title = str(d)
        if summary.exists():
            s = json.loads(summary.read_text())
            acc = f", eval accuracy {s['eval_accuracy']:.3f}" if "eval_accuracy" in s else ""
            title += f"  ({s['world_size']} ranks, {s['steps']} steps{acc})"
        plot(records, d / "report.png", title)
        print(f"wrote {d / 'report.png'} and {d / 'report.csv'} ({n} rows)")
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    import fire

    fire.Fire(main)
