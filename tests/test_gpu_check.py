"""bench/gpu_check.py, the GPU acceptance script: what runs without a GPU (it must say so and exit 0),
and its table from a report."""
import sys

from conftest import ROOT, ok, run_cmd

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_without_cuda_it_says_so_and_exits_cleanly():
    res = ok(run_cmd([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", "/dev/null"], timeout=120))
    assert "no CUDA device here" in res.stdout, res.stdout


def test_table_reports_failed_parts():
    text = gpu_check.table({"step_ratio": {"ok": True, "batch": 256, "raw_ms": 10.0, "api_ms": 10.1, "ratio": 1.01,
                                           "ratio_min": 1.0, "ratio_max": 1.02, "api_img_s": 25346.5},
                            "doctor": {"ok": False}})
    assert "ratio 1.010 (1.000..1.020)" in text and "25346 img/s" in text
    assert "| doctor | FAILED" in text
