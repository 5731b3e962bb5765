"""Model calls on one rank alone, and evaluation that must be the saved model's (real torchrun, gloo):
main_only() runs a DDP forward locally and refuses torch's own collectives at once; exact eval works
with an empty shard; the reported eval loss is the exported checkpoint's; a hang inside main_only()
names the rank that is in it."""
import re

import pytest
import torch

from conftest import HELPERS, ok, read_json, torchrun

pytestmark = pytest.mark.integration  # every test here starts real processes


def lines(res, prefix):
    return [ln for ln in res.stdout.splitlines() if ln.startswith(prefix)]


@pytest.fixture(scope="module")
def local_and_save(tmp_path_factory):
    """One launch for two tests that only read its output: lone_rank.py's local and save modes, run
    one after the other in the same 2 ranks."""
    out = tmp_path_factory.mktemp("local_save")
    return ok(torchrun([str(HELPERS / "lone_rank.py"), "local+save", str(out)], timeout=120))


def test_main_only_runs_a_ddp_forward_locally_and_refuses_torchs_own_collectives(local_and_save):
    res = local_and_save
    fwd = lines(res, "ddp forward: ")
    assert len(fwd) == 1 and "returned after" in fwd[0], res.stdout + res.stderr[-3000:]
    assert lines(res, "ddp forward is the module's own: True"), res.stdout
    for what, says in (("full_state_dict", "call it on every rank before main_only()"),
                       ("full_tensor", "_c10d_functional")):
        got = lines(res, f"{what}: raised after ")
        assert len(got) == 1 and float(got[0].split("raised after ")[1].split("s:")[0]) < 1.0, res.stdout
        assert says in got[0] and "main_only()" in got[0], got
    assert "rank 0: full_state_dict outside main_only has 4 entries" in res.stdout


def test_exact_eval_with_an_empty_shard_through_the_wrapped_batchnorm_model():
    res = ok(torchrun([str(HELPERS / "lone_rank.py"), "empty"], nproc=3, timeout=120))
    # the three ranks print at once into one pipe: lines may run together
    got = sorted(re.findall(r"rank (\d): (\d+) eval samples in [\d.]+s; buffers agree: (True|False)", res.stdout))
    assert [r for r, _, _ in got] == ["0", "1", "2"], res.stdout + res.stderr[-3000:]
    assert sum(int(n) for _, n, _ in got) == 2 and all(agree == "True" for _, _, agree in got), got


def test_a_hang_inside_main_only_names_the_rank_in_it(tmp_path):
    res = torchrun([str(HELPERS / "lone_rank.py"), "stall", str(tmp_path)], timeout=120)
    assert res.returncode != 0
    report = res.stderr[res.stderr.find("ddp_kit: hang:"):]
    assert "Lagging: rank 0." in report and "rank 0 is inside run.main_only()" in report, res.stderr[-3000:]
    assert "rank 0 (" in report and "main_only, at lone_rank.py" in report, report


def test_reported_eval_is_the_saved_models_under_ddp_with_batchnorm(tmp_path):
    """Each rank's BatchNorm statistics come from its own batches; what the ranks evaluate must be the
    final checkpoint's model, recomputed here in one process from model.pt."""
    res = ok(torchrun([str(HELPERS / "lone_rank.py"), "saved", str(tmp_path)], timeout=120))
    said = float(lines(res, "eval output sum: ")[0].split(": ")[1])
    from torch.utils.data import TensorDataset

    saved = torch.load(tmp_path / "checkpoints" / "step_5" / "model.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(saved)
    model.eval()
    (x,) = TensorDataset(torch.randn(10, 4, generator=torch.Generator().manual_seed(5))).tensors
    with torch.no_grad():
        expected = float(model(x).double().sum())
    assert said == pytest.approx(expected, rel=1e-5, abs=1e-6), (said, expected)


def test_a_test_split_smaller_than_the_world_evaluates(tmp_path):
    """2 test samples on 3 ranks: the rank with none contributes zero counts, between epochs too."""
    res = ok(torchrun(["-m", "ddp_kit.train", "--dataset", "tiny_split:data", "--epochs", "2", "--batch_size", "48", "--progress", "false",
                       "--run_dir", str(tmp_path)], nproc=3, timeout=180, env={"PYTHONPATH": str(HELPERS)}))
    summary = read_json(tmp_path / "summary.json")
    assert summary["eval_samples"] == 2, summary
    assert "eval epoch 0" in res.stdout and "KeyError" not in res.stderr


@pytest.mark.parametrize("where", ["resume", "step"])
def test_an_optimizer_made_before_fsdp_prepare_is_refused_before_step_1(tmp_path, where):
    """Found at run.resume (or, without it, at the first step), not at the final checkpoint."""
    res = torchrun([str(HELPERS / "early_optimizer.py"), str(tmp_path), "fsdp", where], timeout=120)
    assert res.returncode != 0
    said = [ln for ln in res.stdout.splitlines() + res.stderr.splitlines() if ln.startswith("ddp_kit: error:")]
    assert len(said) == 1 and "holds none of the prepared model's parameters" in said[0], res.stderr[-3000:]
    assert "step 1 done" not in res.stdout and "hint: create the optimizer after run.prepare" in said[0]


def test_the_scripts_own_save_of_the_wrapped_model_is_warned_about_once(local_and_save):
    res = local_and_save
    warned = [ln for ln in res.stderr.splitlines() if "model.state_dict() of the DDP-wrapped model" in ln]
    assert len(warned) == 1 and "'module.'" in warned[0] and "run.unwrap(model).state_dict()" in warned[0], res.stderr
    assert "keys: ['module." in res.stdout  # what the warning is about
