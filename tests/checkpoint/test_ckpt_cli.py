"""`python -m ddp_kit.checkpoint` on bad paths and steps: one line, exit 2, nothing half-written (real processes)."""
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ok, run_cmd

pytestmark = pytest.mark.integration  # every test here starts real processes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run with checkpoints at steps 3 and 6; tests that damage it work on a copy."""
    d = tmp_path_factory.mktemp("run")
    ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--max_steps", "6", "--ckpt_every", "3",
                "--progress", "false", "--run_dir", str(d)]))
    return d


def ckpt(*args):
    return run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", *map(str, args)], timeout=120)


def one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    ours = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: error:")]
    assert len(ours) == 1 and "Traceback" not in res.stderr and "hint:" in ours[0], res.stderr
    for n in needles:
        assert n in ours[0]
    return ours[0]


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_out_folder_missing(run_dir, tmp_path):
    out = tmp_path / "missing_dir" / "model.pt"
    line = one_line_error(ckpt("export", run_dir, "--out", out), str(out.parent), "does not exist", "mkdir")
    assert not out.parent.exists(), line


def test_export_out_under_a_file(run_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    one_line_error(ckpt("export", run_dir, "--out", tmp_path / "notes.txt" / "model.pt"), "notes.txt", "not a folder")


def test_export_out_is_a_folder(run_dir, tmp_path):
    one_line_error(ckpt("export", run_dir, "--out", tmp_path), str(tmp_path), "is a folder")


def test_export_out_not_writable(run_dir, tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        (target / "probe").write_bytes(b"")
        target = Path("/sys")  # root writes anywhere by mode; sysfs refuses new files even to root
        (target / "ddp_kit_probe.pt").write_bytes(b"")
        pytest.skip("no unwritable folder available to this user")
    except OSError:  # EACCES, or EROFS where sysfs is mounted read-only
        pass
    one_line_error(ckpt("export", run_dir, "--out", target / "model.pt"), str(target), "cannot write")
    assert not list(target.glob("*model.pt*"))


def test_export_step_latest_is_the_latest_file(run_dir, tmp_path):
    out = tmp_path / "w.pt"
    res = ok(ckpt("export", run_dir, "--out", out, "--step", "latest"))
    assert "step_6" in res.stdout
    assert same_tensors(out, run_dir / "checkpoints" / "step_6" / "model.pt")
    assert not list(tmp_path.glob(".*"))  # no temporary file left beside it


@pytest.mark.parametrize("step", ["3", "step_3"])  # the number, or the folder's name as `list` prints it
def test_export_step_number(run_dir, tmp_path, step):
    out = tmp_path / "w.pt"
    ok(ckpt("export", run_dir, "--out", out, "--step", step))
    assert same_tensors(out, run_dir / "checkpoints" / "step_3" / "model.pt")


def test_export_past_a_damaged_newest_says_so(run_dir, tmp_path):
    """The default (newest valid) skips a damaged newer checkpoint as resume does, and says so; asking
    for the damaged step says why it is refused."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    model = copy / "checkpoints" / "step_6" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    res = ok(ckpt("export", copy, "--out", tmp_path / "w.pt"))
    warned = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: warning:")]
    assert len(warned) == 1 and "step_6" in warned[0] and "truncated" in warned[0] and "step_3" in warned[0], res.stderr
    assert same_tensors(tmp_path / "w.pt", run_dir / "checkpoints" / "step_3" / "model.pt")
    one_line_error(ckpt("export", copy, "--out", tmp_path / "v.pt", "--step", "6"), "step_6", "truncated")


def test_export_another_registered_object(run_dir, tmp_path):
    import torch

    ok(ckpt("export", run_dir, "--out", tmp_path / "o.pt", "--name", "optimizer"))
    saved = torch.load(run_dir / "checkpoints" / "step_6" / "train_state.pt", weights_only=True)["optimizer"]
    assert torch.load(tmp_path / "o.pt", weights_only=True).keys() == saved.keys()
    one_line_error(ckpt("export", run_dir, "--out", tmp_path / "n.pt", "--name", "nope"), "holds no 'nope'", "optimizer")


@pytest.mark.parametrize("step", ["abc", "2.5"])
def test_export_step_not_an_integer(run_dir, tmp_path, step):
    one_line_error(ckpt("export", run_dir, "--out", tmp_path / "w.pt", "--step", step), "--step", step, "latest")
    assert not (tmp_path / "w.pt").exists()


def test_export_step_latest_names_an_invalid_checkpoint(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    model = copy / "checkpoints" / "step_6" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    one_line_error(ckpt("export", copy, "--out", tmp_path / "w.pt", "--step", "latest"), "step_6", "truncated")
    assert not (tmp_path / "w.pt").exists()


def test_export_step_latest_without_latest_file(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoints" / "latest").unlink()
    one_line_error(ckpt("export", copy, "--out", tmp_path / "w.pt", "--step", "latest"), "latest")


@pytest.mark.parametrize("cmd", ["list", "export"])
def test_run_dir_missing(tmp_path, cmd):
    missing = tmp_path / "no_such_run"
    extra = ["--out", tmp_path / "w.pt"] if cmd == "export" else []
    line = one_line_error(ckpt(cmd, missing, *extra), str(missing), "does not exist")
    assert "no checkpoints" not in line and "no valid checkpoint" not in line


def test_list_and_export_a_ckpt_dir_url(tmp_path):
    """A run whose checkpoints went to a URL (file://: the object store code path) is listed and
    exported from the URL, with no process group."""
    url = f"file://{tmp_path}/ck"
    ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--max_steps", "6", "--ckpt_every", "3",
                "--progress", "false", "--run_dir", str(tmp_path / "run"), "--ckpt_dir", url]))
    assert not (tmp_path / "run" / "checkpoints").exists()
    rows = ok(ckpt("list", url)).stdout.splitlines()
    assert rows[1].split()[:2] == ["6", "valid"] and rows[1].endswith(f"{url}/step_6 (latest)") and rows[2].split()[0] == "3"
    res = ok(ckpt("export", url, "--out", tmp_path / "model.pt", "--step", "latest"))
    assert f"from {url}/step_6 to" in res.stdout
    assert same_tensors(tmp_path / "model.pt", tmp_path / "ck" / "step_6" / "model.pt")  # the object as uploaded
    one_line_error(ckpt("list", "gs://bucket/run"), "needs gcsfs", "pip install gcsfs")
