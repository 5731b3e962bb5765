"""Injected faults under real 2-rank torchrun (gloo): each is detected, named, and every process exits non-zero."""
import pytest

from conftest import HELPERS, ok, since_ranks_met, torchrun

pytestmark = pytest.mark.integration  # every test here starts real processes

HANG = 8
# The collective timeout (120 s) is what would end a hang the watchdog missed: the bounds below stay well
# under it while leaving a loaded 2-core machine ~30 s more than an idle one needs.
COMMON = ["--epochs", "2", "--progress", "false", "--hang_timeout_s", str(HANG), "--collective_timeout_s", "120",
          "--sync_check_every", "5"]


def faulty(tmp_path, spec):
    """The job's result, and the seconds from the ranks' meeting to the end of every process."""
    # 180: past the collective timeout, so that a missed hang fails on the bound, not on this kill
    res = torchrun(["-m", "ddp_kit.train", *COMMON, "--run_dir", str(tmp_path), "--inject", spec], timeout=180)
    took = since_ranks_met(tmp_path, res)
    print(f"{spec}: exit {res.returncode}, {took:.1f}s after the ranks met")
    return res, took


def ours(res):
    return [line for line in res.stderr.splitlines() if line.startswith(("ddp_kit:", "  rank"))]


def assert_failed_everywhere(res):
    assert res.returncode != 0
    # torchrun reports each worker's exit code; none of ours may be 0
    codes = [line for line in res.stderr.splitlines() if "exitcode" in line]
    assert codes and all("exitcode  : 0" not in c for c in codes), res.stderr[-2000:]


def test_a_extra_collective(tmp_path):
    res, took = faulty(tmp_path, "extra_collective:rank=1:step=5")
    assert_failed_everywhere(res)
    text = "\n".join(ours(res))
    # gloo either aborts rank 1 (size mismatch) or the ranks hang; both must name rank 1 and where it was
    assert ("rank 1 crashed" in text and "after step" in text) or ("Lagging: rank 1" in text and "after step" in text), text
    # Model build and 5 steps, the hang timeout, the poll and the teardown: well under the collective
    # timeout (120 s), which is what would end a hang the watchdog missed.
    assert took < HANG + 55, took


def test_b_hang(tmp_path):
    res, took = faulty(tmp_path, "hang:rank=1:step=5")
    assert_failed_everywhere(res)
    lines = ours(res)
    assert any("hang: no progress" in line and "Lagging: rank 1" in line for line in lines), lines
    assert any(line.strip().startswith("rank 1") and "after step" in line for line in lines), lines
    assert (tmp_path / "hang" / "rank0.txt").exists() and (tmp_path / "hang" / "rank1.txt").exists()
    assert "inject.py" in (tmp_path / "hang" / "rank1.txt").read_text()
    assert took < HANG + 55, took  # 15 s on an idle machine; a missed hang: the 120 s collective timeout


def test_c_raise(tmp_path):
    res, took = faulty(tmp_path, "raise:rank=1:step=5")
    assert_failed_everywhere(res)
    lines = ours(res)
    originals = [line for line in lines if line.startswith("ddp_kit: error: rank 1 failed at step 5 in after step")]
    assert len(originals) == 1, lines
    assert res.stderr.count("injected fault: rank 1 raises") >= 1
    assert took < 30, took  # fail-fast: 3 s on an idle machine, not the 120 s collective timeout


def test_d_perturbed_parameters(tmp_path):
    res, took = faulty(tmp_path, "perturb:rank=1:step=5")
    assert_failed_everywhere(res)
    lines = [line for line in ours(res) if "diverged" in line]
    assert len(lines) == 1 and "rank 1" in lines[0] and "sync check" in lines[0] and "1.weight" in lines[0], ours(res)


def test_d_perturbed_parameters_broadcast_fix(tmp_path):
    res = ok(torchrun(["-m", "ddp_kit.train", *COMMON, "--run_dir", str(tmp_path), "--inject", "perturb:rank=1:step=5",
                       "--sync_fix", "broadcast"], timeout=120))
    assert "re-broadcast from rank 0" in res.stdout


def test_e_different_config(tmp_path):
    res, _ = faulty(tmp_path, "config:rank=1")
    assert_failed_everywhere(res)
    lines = [line for line in ours(res) if "disagree" in line]
    assert len(lines) == 1 and "before step 1" in lines[0] and "rank 1" in lines[0] and "seed" in lines[0], ours(res)
    assert not (tmp_path / "checkpoints").exists()


def test_f_collective_inside_main_only_raises(tmp_path):
    res = ok(torchrun([str(HELPERS / "main_only.py")], timeout=120))
    for what in ("all_reduce", "fsdp forward"):
        line = [ln for ln in res.stdout.splitlines() if ln.startswith(f"{what}: raised after")]
        assert len(line) == 1 and float(line[0].split(": raised after ")[1].split("s:")[0]) < 1.0, res.stdout
        assert "main_only()" in line[0]
    assert "run.full_state_dict(model)" in line[0]  # the FSDP case says how to evaluate on rank 0 alone


# The startup bound of test_g: far enough above the hang timeout (5 s) that the report said at the hang
# timeout (asserted under 15 s) cannot be the end of the job; each second here is a second of the test.
STARTUP = 20


def test_g_a_hang_in_step_1_is_reported_at_the_hang_timeout_and_ends_at_the_startup_bound(tmp_path):
    """Step 1 may be slow (compile), so it is not ended at the hang timeout; but where each rank is
    is said then, not after the whole startup bound in silence."""
    res = torchrun(["-m", "ddp_kit.train", "--epochs", "1", "--progress", "false", "--hang_timeout_s", "5",
                    "--init_timeout_s", str(STARTUP), "--run_dir", str(tmp_path), "--inject", "hang:rank=1:step=1"], timeout=120)
    assert_failed_everywhere(res)
    early = [ln for ln in res.stderr.splitlines() if "step 1 is taking long" in ln]
    assert len(early) == 1 and f"startup bound ({STARTUP}s" in early[0], res.stderr[-3000:]
    assert 5 <= int(early[0].split("no progress for ")[1].split("s")[0]) < 15, early  # at the hang timeout, once
    after = res.stderr[res.stderr.index(early[0]):]
    assert "rank 1 (" in after and "at inject.py" in after  # where each rank is, the stalled one included
    assert after.index("rank 1 (") < after.index("ddp_kit: hang: no progress for ")  # said first, ended later


def test_h_a_single_rank_job_under_torchrun_that_hangs_is_reported_and_ends(tmp_path):
    """World size 1 under a launcher: the watchdog runs too (a store in the process), so a stuck
    single-GPU job leaves its stacks (and NCCL's flight recorder) and frees its allocation, at the
    startup bound (init_timeout_s), not the hang timeout."""
    # A single rank's stall is its own work (no peer waits for it): it gets the startup bound.
    res = torchrun(["-m", "ddp_kit.train", "--epochs", "1", "--progress", "false", "--hang_timeout_s", "4",
                    "--init_timeout_s", "8", "--run_dir", str(tmp_path), "--inject", "hang:rank=0:step=3"],
                   nproc=1, timeout=120)
    assert "exitcode  : 3" in res.stderr, res.stderr[-3000:]
    assert "ddp_kit: hang: no progress for" in res.stderr and "The job's only rank is stuck." in res.stderr
    assert (tmp_path / "hang" / "rank0.txt").is_file()
