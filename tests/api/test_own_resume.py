"""Your own script (real processes, one rank): rerun with a changed recipe, a config passed to
ddp_kit.init is held to the reference job's rules (refused, or applied and said), and without a
config the resume line names the optimizer settings the checkpoint overrides; a clean end writes
summary.json and the last record; a finished run rerun says so; an error after optimizer.step()
names that phase."""
import sys

import pytest

from conftest import HELPERS, ok, run_cmd

pytestmark = pytest.mark.integration  # every test here starts real processes

SCRIPT = str(HELPERS / "recipe_script.py")


def script(run_dir, lr, with_config, steps):
    return run_cmd([sys.executable, SCRIPT, str(run_dir), str(lr), "1" if with_config else "0", str(steps)], timeout=120)


def resumed_line(res):
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ddp_kit: resumed from")]
    assert len(lines) == 1, res.stdout + res.stderr
    return lines[0]


def test_without_config_the_resume_line_names_the_restored_lr(tmp_path):
    ok(script(tmp_path, 0.01, False, 4))
    line = resumed_line(ok(script(tmp_path, 0.003, False, 6)))
    assert "optimizer lr 0.003 in the script, 0.01 restored" in line, line
    # the same lr again: nothing to say (momentum and the scheduler's moving lr are not changes)
    line = resumed_line(ok(script(tmp_path, 0.01, False, 8)))
    assert "in the script" not in line, line


def test_a_config_passed_to_init_is_held_to_the_reference_jobs_rules(tmp_path):
    ok(script(tmp_path, 0.01, True, 4))
    line = resumed_line(ok(script(tmp_path, 0.01, True, 6)))
    assert "changed since that checkpoint and applied: max_steps 4 -> 6" in line, line
    res = script(tmp_path, 0.003, True, 8)
    assert res.returncode == 2, res.stdout + res.stderr
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("ddp_kit: error:")]
    assert len(said) == 1 and "the recipe changed since it was saved (lr 0.01 -> 0.003)" in said[0], res.stderr
    assert "Traceback" not in res.stderr


def test_an_error_in_scheduler_step_names_the_phase_after_the_optimizer_step():
    res = run_cmd([sys.executable, str(HELPERS / "raise_in_scheduler.py")], timeout=120)
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("ddp_kit: error:")]
    assert res.returncode != 0 and len(said) == 1, res.stderr
    assert "failed at step 2 in after step: RuntimeError: scheduler broke" in said[0], said


def test_a_clean_end_writes_the_summary_and_the_last_record_and_a_finished_run_says_so(tmp_path):
    import json

    ok(script(tmp_path, 0.01, False, 7))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 7 and summary["world_size"] == 1 and summary["param_sha256_all_ranks_equal"] is True
    assert len(summary["param_sha256"]) == 64 and summary["resumed_from_step"] is None
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "train"][-1] == 7  # the picture ends where the run did
    again = ok(script(tmp_path, 0.01, False, 7))
    said = [ln for ln in again.stdout.splitlines() if ln.startswith("ddp_kit: nothing left to train")]
    assert len(said) == 1 and "resumed at step 7" in said[0] and "resume='never'" in said[0], again.stdout


def test_an_indivisible_batch_is_refused_alone_before_the_skipped_samples_note():
    code = ("import torch, ddp_kit\n"
            "from torch.utils.data import DataLoader, TensorDataset\n"
            "run = ddp_kit.init()\n"
            "run.prepare(DataLoader(TensorDataset(torch.randn(25, 2)), batch_size=10), grad_accum=3)\n")
    res = run_cmd([sys.executable, "-c", code], timeout=120)
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("ddp_kit:") and "intra-op" not in ln]
    assert res.returncode == 2 and len(ours) == 1, res.stderr
    assert "does not divide into world_size 1 x grad_accum 3" in ours[0], ours
