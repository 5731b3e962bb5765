"""The profiler service (services/profiler.py): torch.profiler windows aligned to the step count, one Chrome
trace per rank, and the CUDA memory snapshot on an out-of-memory end (GPU only: skipped here without one)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, ok, proc_env, torchrun
from ddp_kit import service_registry
from ddp_kit.errors import UserError
from ddp_kit.services.profiler import WARMUP, first_warmup


@pytest.mark.parametrize("first", [1, 2, 17, 18, 19, 20, 21, 101])
def test_every_window_ends_at_a_multiple_of_profile_every(first):
    every, active = 20, 3
    warm = first_warmup(first, every, active)
    assert first <= warm < first + every
    assert (warm + WARMUP + active - 1) % every == 0  # the window's last step


@pytest.mark.parametrize("every", [1, 2, 3])
def test_a_period_shorter_than_one_window_is_refused_not_stretched(every):
    # It was silently raised to 4 (1 warm-up + 3 active), so no window ended at the multiples of N asked for.
    with pytest.raises(UserError) as err:
        service_registry.settings({"profile_every": every, "profile_active": 3}, "runs/r")
    assert "profile_every >= 4" in err.value.line() and "\n" not in err.value.line()


def test_a_period_of_exactly_one_window_is_taken():
    assert service_registry.settings({"profile_every": 3, "profile_active": 2}, "runs/r")["profile_every"] == 3


@pytest.mark.integration
def test_one_trace_per_rank_per_window_each_with_the_active_steps(tmp_path):
    run = tmp_path / "run"
    res = ok(torchrun(["-m", "ddp_kit.train", "--max_steps", "45", "--profile_every", "20", "--profile_active", "2",
                       "--run_dir", str(run), "--progress", "false"], nproc=2))
    assert "one Chrome trace per rank" in res.stdout, res.stdout[-2000:]
    traces = sorted(p.name for p in (run / "profile").iterdir())
    assert traces == ["step20_rank0.json", "step20_rank1.json", "step40_rank0.json", "step40_rank1.json"], traces
    for name in traces:
        events = json.loads((run / "profile" / name).read_text())["traceEvents"]
        steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert len(steps) == 2, (name, steps)  # the active steps; the warm-up step is not recorded
        assert any("aten::" in str(e.get("name", "")) for e in events), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the allocator history is CUDA's")
def test_an_out_of_memory_end_leaves_a_snapshot_per_rank_named_in_the_report(tmp_path):
    run = tmp_path / "run"
    # The MLP on digits has 74 x hidden weights: a third of the GPU in fp32, so that the weights and their
    # gradients fit and the optimizer's two states do not (an OOM inside the loop, after the services started).
    width = torch.cuda.get_device_properties(0).total_memory // (4 * 74 * 3)
    res = subprocess.run([sys.executable, "-m", "ddp_kit.train", "--max_steps", "5", "--memory_history", "true",
                          "--model_args", json.dumps({"hidden": width}), "--run_dir", str(run), "--progress", "false"],
                         capture_output=True, text=True, env={**proc_env(), "CUDA_VISIBLE_DEVICES": "0"}, cwd=ROOT,
                         timeout=300)
    assert res.returncode != 0, res.stdout[-2000:]
    snaps = list((run / "oom").glob("rank0_step*.pickle"))
    assert snaps and snaps[0].stat().st_size > 0, res.stderr[-3000:]
    assert str(snaps[0]) in res.stderr and "memory_viz" in res.stderr, res.stderr[-3000:]
