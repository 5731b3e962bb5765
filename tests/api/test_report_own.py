"""`python -m ddp_kit.report` on runs of a user's own script: few train records, metrics logged with
run.log_event, no eval, one rank, a truncated last line. metrics.jsonl is written by hand (no training)."""
import csv
import json
import sys

import pytest

from conftest import run_cmd
from ddp_kit.errors import UserError
from ddp_kit.exit_codes import EXIT_USER_ERROR
from ddp_kit.report import _draw, load, main, outline, panels, plot, title_for

USER = "logged by the script (run.log_event)"


def _write(run_dir, records, tail=""):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines) + tail)


def _rank(r, host="h"):
    return {"rank": r, "host": host, "local_s": 0.01 + r / 1000, "peak_mem_mb": 100.0 + r,
            "param_bytes": 2**20, "grad_bytes": 2**20, "optim_bytes": 2**21}


def _reference(ranks=2):
    """Records as the reference job writes them: train with per-rank entries, eval with eval_* fields."""
    train = [{"time": 1.0 + s, "event": "train", "step": s, "epoch": 0, "loss": 1.0 / s, "lr": 0.01,
              "samples_per_s": 500.0, "ranks": [_rank(r) for r in range(ranks)]} for s in (5, 10, 15)]
    ev = {"time": 20.0, "event": "eval", "step": 15, "epoch": 0, "eval_loss": 0.4, "eval_accuracy": 0.8, "eval_samples": 64}
    return train + [ev]


OWN = [  # a user's script: 3 train records without lr or samples/s, its own log_event records
    {"time": 1.0, "event": "train", "step": 10, "epoch": 0, "loss": 0.9},
    {"time": 2.0, "event": "train", "step": 20, "epoch": 0, "loss": 0.7},
    {"time": 3.0, "event": "train", "step": 30, "loss": 0.5},
    {"time": 4.0, "event": "eval", "step": 40, "accuracy": 0.93},
    {"time": 5.0, "event": "val", "step": 40, "val_acc": 0.9, "val_loss": 0.3, "batch_id": 7},
    {"time": 6.0, "step": 40, "lr_scale": 0.5},  # no event at all
    {"time": 7.0, "event": "val", "val_acc": 0.1},  # no step: skipped
    {"time": 8.0, "event": "checkpoint", "step": 40, "saved": True, "path": "/x"},  # bool and text: not metrics
]


def test_own_script_run_plots_its_logged_metrics(tmp_path):
    _write(tmp_path, OWN)
    assert outline(OWN) == [("loss", ["train loss"]), (USER, ["eval accuracy", "val val_acc", "val val_loss", "lr_scale"])]
    user = {label: (xs, ys) for label, xs, ys, _ in panels(OWN)[-1].series}
    assert user["val val_acc"] == ([40], [0.9]) and user["eval accuracy"] == ([40], [0.93])
    main(str(tmp_path))
    assert (tmp_path / "report.png").stat().st_size > 5_000
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert [r["step"] for r in rows] == ["10", "20", "30"]
    assert rows[2]["loss"] == "0.5" and rows[2]["epoch"] == "" and rows[0]["lr"] == "" and rows[0]["global_samples_per_s"] == ""


def test_no_eval_records_draw_no_eval_series_legend_or_twin_axis(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in _reference() if r["event"] == "train"]
    shown = outline(records)
    assert shown[0] == ("loss", ["train loss"])
    assert not [label for _, labels in shown for label in labels if "eval" in label], shown
    fig, ax = plt.subplots()
    _draw(ax, panels(records)[0])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss"] and len(fig.axes) == 1
    plt.close(fig)


def test_reference_job_panels_are_kept_and_its_eval_drawn_once():
    shown = outline(_reference())
    assert shown == [
        ("loss and accuracy", ["train loss", "eval loss", "eval accuracy"]),
        ("throughput", ["global"]),
        ("per-rank step time: a straggler stands out", ["rank 0 (h)", "rank 1 (h)"]),
        ("memory (CUDA allocator peak or CPU RSS)", ["rank 0", "rank 1"]),
        ("model state per rank at the last record (FSDP: about 1/N of DDP's)", ["parameters", "gradients", "optimizer state"]),
    ]  # no panel of logged metrics: eval_loss/eval_accuracy are drawn once, eval_samples is a count


def test_one_rank_run_says_1_rank(tmp_path):
    records = _reference(ranks=1)
    assert title_for(tmp_path, records) == f"{tmp_path}  (1 rank)"  # no summary.json: counted from the records
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 1, "steps": 1, "eval_accuracy": 0.8}))
    assert title_for(tmp_path, records) == f"{tmp_path}  (1 rank, 1 step, eval accuracy 0.800)"
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 2, "steps": 15}))
    assert title_for(tmp_path, records) == f"{tmp_path}  (2 ranks, 15 steps)"
    (tmp_path / "summary.json").write_text(json.dumps({"my_score": 3}))  # a user's own summary
    assert title_for(tmp_path, OWN) == str(tmp_path)


def test_truncated_last_line_and_non_objects_are_skipped(tmp_path, capsys):
    _write(tmp_path, OWN[:3] + ["[1, 2]", "7"], tail='{"event": "train", "step": 40, "lo')
    records = load(tmp_path)
    assert [r["step"] for r in records] == [10, 20, 30]
    assert "skipped 3 lines" in capsys.readouterr().err
    main(str(tmp_path))
    assert (tmp_path / "report.png").is_file() and "3 rows" in capsys.readouterr().out


def test_nothing_drawable_is_one_line_with_a_hint(tmp_path, capsys):
    records = [{"time": 1.0, "event": "start", "host": "h"}, {"time": 2.0, "event": "train", "step": 1, "epoch": 0},
               {"event": "val", "val_acc": 0.5}]
    with pytest.raises(UserError) as err:
        plot(records, tmp_path / "report.png", "t")
    assert err.value.hint and "\n" not in err.value.line()
    _write(tmp_path, records)
    with pytest.raises(SystemExit) as ex:
        main(str(tmp_path))
    lines = capsys.readouterr().err.strip().splitlines()
    assert ex.value.code == EXIT_USER_ERROR and len(lines) == 1 and "nothing to plot" in lines[0] and "hint:" in lines[0]
    assert not (tmp_path / "report.png").exists()


@pytest.mark.integration
def test_command_end_to_end_on_an_own_script_run(tmp_path):
    _write(tmp_path, OWN, tail='{"event": "val", "st')
    res = run_cmd([sys.executable, "-m", "ddp_kit.report", str(tmp_path)], timeout=120)
    assert res.returncode == 0, res.stderr
    assert "report.png" in res.stdout and (tmp_path / "report.png").stat().st_size > 5_000
    assert "Traceback" not in res.stderr and "skipped 1 line" in res.stderr
