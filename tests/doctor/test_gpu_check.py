"""The GPU device command, rehearsed on CPU in an environment that stands in for the GPU machine as
closely as CPU allows: a virtual environment without `fire` (nor termcolor, nor ddp_kit installed),
fire's wheels carried as README/BENCHMARKS say (bench/fetch_wheels.sh, then pip --no-index --target),
no package index. It must reach every part, say "skipped: no CUDA" for each GPU part, write valid
JSON and exit 0. Plus the verdict logic of a part that hangs or crashes (real subprocesses)."""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

HIDDEN = ("fire", "termcolor", "ddp_kit", "__editable__")  # what the GPU machine's Python lacks


def stand_in_venv(where: Path) -> Path:
    """A venv whose site-packages holds this one's packages (links) except HIDDEN: torch and pytest
    are there, as on the GPU machine; fire is not."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = Path(subprocess.run([str(where / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if entry.name.lower().startswith(HIDDEN) or (entry.suffix == ".pth" and "ddp_kit" in entry.read_text()):
            continue
        (site / entry.name).symlink_to(entry)
    return where / "bin" / "python"


@pytest.mark.integration
def test_the_device_command_rehearsed_without_fire_and_without_an_index(tmp_path):
    python = stand_in_venv(tmp_path / "venv")
    lacks = subprocess.run([str(python), "-c", "import fire"], capture_output=True, text=True, cwd=tmp_path)
    assert lacks.returncode != 0, "the stand-in venv must not have fire"
    wheels = tmp_path / "whl"
    got = run_cmd(["bash", str(ROOT / "bench" / "fetch_wheels.sh"), str(wheels)], timeout=120)
    assert got.returncode == 0 and sorted(p.name.split("-")[0] for p in wheels.glob("*.whl")) == ["fire", "termcolor"], \
        f"could not download the wheels (needs the package registry):\n{got.stdout}\n{got.stderr}"
    out = tmp_path / "out"
    env = {"PYTHON": str(python), "WHEELS": str(wheels), "DDP_KIT_SITE": str(tmp_path / "site"), "OUT": str(out),
           "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PYTHONPATH": ""}
    res = run_cmd(["bash", str(ROOT / "bench" / "gpu_device.sh")], timeout=400, env=env)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    assert text.index("gpu_check: python") < text.index("gpu_check: doctor:"), text  # versions first
    results = json.loads((out / "gpu_results.json").read_text())
    assert set(results["parts"]) == set(gpu_check.PARTS), results["parts"].keys()
    for name, (part, _) in gpu_check.PARTS.items():
        line = [ln for ln in res.stdout.splitlines() if ln.startswith(f"gpu_check: {name}: ")]
        assert len(line) == 1, res.stdout
        if part.cuda:
            assert line[0] == f"gpu_check: {name}: skipped: no CUDA", line
    # the doctor runs `python -m ddp_kit.doctor`, which imports fire: only the carried wheel has it
    assert results["parts"]["doctor"]["verdict"] == "PASS", results["parts"]["doctor"]
    assert (out / "gpu_check.log").is_file()


@pytest.mark.integration
def test_a_part_that_hangs_or_crashes_loses_only_itself(tmp_path):
    """Real subprocesses: a part past its limit is killed and FAILs; one that dies before reporting
    FAILs with its last line; the next part still runs; the results file stays valid JSON."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        "import gpu_check\n"
        "def sleeper():\n    time.sleep(60)\n"
        "def crasher():\n    print('about to die', file=sys.stderr); os._exit(7)\n"
        "def fine():\n    return gpu_check._verdict(True, 'fine')\n"
        "gpu_check.PARTS = {n: (gpu_check.Part(n, lim, False, 't'), fn) for n, lim, fn in "
        "(('sleeps', 3, sleeper), ('crashes', 30, crasher), ('fine', 30, fine))}\n"
        "gpu_check.__file__ = __file__  # each part runs as `python driver.py --part NAME`\n"
        "if __name__ == '__main__':\n    sys.exit(gpu_check.main())\n")
    res = run_cmd([sys.executable, str(script), "--out", str(tmp_path / "out"), "--budget_s", "60"], timeout=120)
    results = json.loads((tmp_path / "out" / "gpu_results.json").read_text())["parts"]
    assert results["sleeps"]["verdict"] == "FAIL" and "timed out after 3s" in results["sleeps"]["figure"], results
    assert results["crashes"]["verdict"] == "FAIL" and "exited 7" in results["crashes"]["figure"], results
    assert "about to die" in results["crashes"]["figure"]
    assert results["fine"]["verdict"] == "PASS", results
    assert res.returncode == 1, res.stdout  # a FAIL is the exit code too


def test_table_lists_each_verdict_with_its_figure_and_threshold():
    text = gpu_check.table({"parts": {"checkpoint": {"verdict": "FAIL", "figure": "ratio 0.4", "threshold": "<= 0.25"},
                                      "doctor": {"verdict": "PASS", "figure": "valid JSON", "threshold": "JSON"}}})
    assert "| checkpoint | FAIL | ratio 0.4 | <= 0.25 |" in text and "| doctor | PASS | valid JSON | JSON |" in text
