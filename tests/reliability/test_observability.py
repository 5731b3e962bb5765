"""Per-rank metrics, the straggler warning (a rank slowed by a test hook), report.png/csv, no trackers unasked."""
import json
import statistics
import sys

import pytest
import torch

from conftest import ok, read_json, run_cmd, torchrun
from ddp_kit.reliability.metrics import StepTimer, StragglerWatch


def _rank(r, local):
    return {"rank": r, "host": "h", "local_s": local, "data_s": 0.0, "forward_s": local, "optimizer_s": 0.0, "other_s": 0.0}


def test_straggler_needs_patience_and_margin():
    w = StragglerWatch(margin=0.2, patience=2)
    assert w.update([_rank(0, 0.010), _rank(1, 0.030), _rank(2, 0.010)]) == []
    lines = w.update([_rank(0, 0.010), _rank(1, 0.030), _rank(2, 0.011)])
    assert len(lines) == 1 and "rank 1" in lines[0]
    assert w.update([_rank(0, 0.010), _rank(1, 0.030), _rank(2, 0.011)]) == []  # once per rank
    assert StragglerWatch().update([_rank(0, 0.010), _rank(1, 0.011)]) == []


def test_step_timer_window():
    t = StepTimer()
    for part in ("data", "forward", "backward", "optimizer", "other"):
        t.mark(part)
    t.steps = 1
    w = t.window()
    assert set(w) >= {"data_s", "forward_s", "backward_s", "optimizer_s", "other_s", "step_s", "local_s"}
    assert w["local_s"] == pytest.approx(w["step_s"] - w["backward_s"])


@pytest.mark.integration
def test_slowed_rank_is_named_and_stands_out_in_report(tmp_path, capsys):
    res = ok(torchrun(["-m", "ddp_kit.train", "--epochs", "3", "--log_every", "5", "--progress", "false",
                       "--run_dir", str(tmp_path), "--inject", "slow:rank=1:step=1:ms=15"], nproc=2))
    warnings = [line for line in res.stdout.splitlines() if "straggler" in line]
    assert len(warnings) == 1 and "rank 1" in warnings[0], res.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    assert all(len(r["ranks"]) == 2 for r in train)
    # Per window, over all of them: the last window holds one step (66 = 13 x 5 + 1), too few to
    # compare on its own on a loaded machine.
    local = {r: [x["local_s"] for w in train for x in w["ranks"] if x["rank"] == r] for r in (0, 1)}
    assert statistics.median(local[1]) > statistics.median(local[0]) + 0.010, local
    late = train[-1]["ranks"]
    assert {"data_s", "forward_s", "backward_s", "optimizer_s", "samples_per_s", "peak_mem_mb", "host"} <= set(late[0])
    # the report in this process (the command's own start is test_report_own's): what it draws from this run
    from ddp_kit.report import main as report
    report(str(tmp_path))
    said = capsys.readouterr().out
    assert (tmp_path / "report.png").stat().st_size > 10_000 and "report.png" in said
    rows = (tmp_path / "report.csv").read_text().splitlines()
    assert rows[0].startswith("step,epoch,rank") and len(rows) == 1 + 2 * len(train)


@pytest.mark.integration
def test_run_without_trackers_is_quiet(tmp_path):
    # tensorboard installed or not: event files are written only when asked for (trackers=["tensorboard"])
    res = ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--progress", "false",
                      "--run_dir", str(tmp_path)]))
    out = (res.stdout + res.stderr).replace(str(tmp_path), "RUN_DIR").lower()
    assert "tensorboard" not in out and "warning" not in out
    assert not (tmp_path / "tb").exists() and read_json(tmp_path / "summary.json")["steps"] == 22


def test_peak_tflops_by_exact_name_and_dtype():
    from ddp_kit.reliability.metrics import peak_for
    assert peak_for("NVIDIA L4", "bf16", True) == 121.0 and peak_for("NVIDIA L40S", "bf16", True) == 362.0
    assert peak_for("NVIDIA H100 80GB HBM3", "bf16", True) == 989.0  # SXM
    assert peak_for("NVIDIA H100 PCIe", "bf16", True) == 756.0
    assert peak_for("NVIDIA H200", "off", True) == 494.0 and peak_for("NVIDIA H200", "off", False) == 67.0
    assert peak_for("NVIDIA H200 NVL", "bf16", True) == 835.0 and peak_for("NVIDIA H200 NVL", "off", False) == 60.0
    assert peak_for("NVIDIA H200", "bf16", True) == 989.0  # SXM
    assert peak_for("NVIDIA GH200 480GB", "bf16", True) != 835.0
    assert peak_for("Tesla V100-SXM2-16GB", "off", True) == 15.7  # no TF32 units
    assert peak_for("NVIDIA GeForce RTX 4090", "bf16", True) is None


def test_flight_recorder_dumps_are_named_as_fr_trace_reads_them(tmp_path):
    """Fake dumps (no NCCL here) under our names, beside the stacks a hang leaves in the same folder:
    torch's fr_trace loader infers the prefix and reads each rank from the name, as `python -m
    torch.distributed.flight_recorder.fr_trace run_dir/hang` does."""
    import argparse
    import pickle

    from torch.distributed.flight_recorder.components import loader

    from ddp_kit.reliability.watchdog import flight_recorder_path

    for r in (0, 1, 10):
        flight_recorder_path(tmp_path, r).write_bytes(pickle.dumps({"entries": [], "version": "2.4", "pg_config": {}}))
        for other in (f"rank{r}.txt", f"rank{r}.crash.txt", f"rank{r}.progress"):
            (tmp_path / other).write_text("")
    details, version = loader.read_dir(argparse.Namespace(trace_dir=str(tmp_path), prefix=None))
    assert sorted(d["rank"] for d in details.values()) == [0, 1, 10] and version == "2.4"
    assert loader.read_dump("nccl_trace_rank_", str(flight_recorder_path(tmp_path, 1)))["rank"] == 1  # --prefix


class _FakeEvent:
    """Stands in for torch.cuda.Event (no GPU here): a recording is a tick of a clock, and an event
    recorded again before its span was read would lose that span."""
    made, clock = [], [0]

    def __init__(self, enable_timing=False):
        self.t, self.unread = None, False
        _FakeEvent.made.append(self)

    def record(self):
        _FakeEvent.clock[0] += 1
        self.t = _FakeEvent.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0  # ms: one tick is a second


def test_gpu_spans_reuse_their_events_after_the_first_window(monkeypatch):
    """The CUDA events behind the GPU spans come back from a pool once read: 3 windows make as many
    events as the first; the spans are measured as before (forward from "forward start" when DDP's
    pre-forward reopens it; comm and other record nothing)."""
    from ddp_kit.reliability.metrics import GpuSpans

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.made.clear()
    timer = StepTimer(gpu=GpuSpans())
    made = []
    for _ in range(3):
        for _ in range(4):
            for part, gpu in (("data", None), ("comm", "forward start"), ("forward", None), ("backward", None),
                              ("optimizer", None), ("other", None)):
                timer.mark(part, gpu)
            timer.steps += 1
        w = timer.window()
        assert w["gpu_forward_s"] == 1.0 and w["gpu_optimizer_s"] == 1.0  # one tick per span, per step
        made.append(len(_FakeEvent.made))
    assert made[0] == made[1] == made[2] <= 4 * 4 + 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_spans_make_no_new_cuda_events_after_the_first_window(monkeypatch):
    from ddp_kit.reliability.metrics import GpuSpans

    made, real = [], torch.cuda.Event

    class Counted(real):
        def __init__(self, *args, **kwargs):
            made.append(1)

    monkeypatch.setattr(torch.cuda, "Event", Counted)
    timer, x, counts = StepTimer(gpu=GpuSpans()), torch.randn(512, 512, device="cuda"), []
    for _ in range(3):
        for _ in range(5):
            timer.mark("data")
            (x @ x).sum()
            timer.mark("forward")
            timer.mark("backward")
            (x @ x).sum()
            timer.mark("optimizer")
            timer.steps += 1
        torch.cuda.synchronize()
        w = timer.window()
        assert w["gpu_forward_s"] > 0 and w["gpu_optimizer_s"] > 0
        counts.append(len(made))
    assert counts[0] == counts[1] == counts[2]


def _clocked_timer(monkeypatch, **kwargs) -> tuple[StepTimer, list[float]]:
    """A StepTimer on a clock the test moves: each mark is charged what the test added since the last."""
    from ddp_kit.reliability import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    timer = StepTimer(**kwargs)
    timer._t = 0.0
    return timer, clock


def test_step_timer_divides_the_unsampled_steps_as_the_sampled_ones(monkeypatch):
    """The forward hooks run on a few steps of a window (sampling); the other steps' stretch from
    the loop's last mark to the end of backward is divided in the sampled steps' proportions, so
    each part's mean per step, and the step's total, are what every step hooked would give."""
    timer, clock = _clocked_timer(monkeypatch)
    timer.sampling = True

    def step(sampled: bool) -> None:
        timer.split = sampled
        for part, seconds, hooked in (("data", 1, False), ("other", 1, True), ("comm", 2, True), ("forward", 3, True),
                                      ("backward", 4, False), ("optimizer", 5, False), ("other", 6, False)):
            clock[0] += seconds
            if hooked and not sampled:
                continue  # no hook on this step: its time runs on into the stretch
            (timer.hooked if hooked else timer.mark)(part)
        timer.steps += 1

    for sampled in (True, False, False, False):
        step(sampled)
    w = timer.window()
    assert w["forward_s"] == pytest.approx(3) and w["comm_s"] == pytest.approx(2) and w["backward_s"] == pytest.approx(4)
    assert w["other_s"] == pytest.approx(7) and w["data_s"] == pytest.approx(1) and w["step_s"] == pytest.approx(22)
    assert w["local_s"] == pytest.approx(22 - 4 - 2)
    for sampled in (False, False):  # a window without a sampled step: the last window's proportions
        step(sampled)
    w = timer.window()
    assert w["forward_s"] == pytest.approx(3) and w["step_s"] == pytest.approx(22)


def test_step_timer_without_any_sample_books_the_stretch_as_backward(monkeypatch):
    timer, clock = _clocked_timer(monkeypatch, sampling=True, split=False)
    for part in ("data", "backward", "optimizer", "other"):
        clock[0] += 1
        timer.mark(part)
    timer.steps = 1
    w = timer.window()
    assert w["backward_s"] == 1 and w["forward_s"] == 0 and w["step_s"] == 4


def test_gpu_spans_are_recorded_and_averaged_on_sampled_steps_only(monkeypatch):
    from ddp_kit.reliability.metrics import GpuSpans

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    timer = StepTimer(gpu=GpuSpans(), sampling=True)
    for sampled in (True, False, True, False):
        timer.split = sampled
        before = _FakeEvent.clock[0]
        timer.mark("data")
        if sampled:
            timer.hooked("forward")
        timer.mark("backward")
        timer.mark("optimizer")
        timer.mark("other")
        timer.steps += 1
        assert (_FakeEvent.clock[0] > before) == sampled  # no CUDA event on an unsampled step
    w = timer.window()
    assert w["gpu_forward_s"] == 1.0 and w["gpu_optimizer_s"] == 1.0  # one tick per span, per sampled step
