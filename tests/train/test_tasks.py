"""`python -m ddp_kit.train --model m:f --dataset m:g --loss m:h`: a user's own task by import path,
imported from the working directory on every rank; startup mistakes are one line, exit 2."""
import shutil
import sys

import pytest

from conftest import HELPERS, ok, read_json, run_cmd
from procs import errors, workers

TASK = ["--model", "mytask:model", "--dataset", "mytask:data", "--loss", "mytask:loss"]


@pytest.fixture
def cwd(tmp_path):
    shutil.copy(HELPERS / "dict_task.py", tmp_path / "mytask.py")
    return tmp_path


def job(cwd, *args, nproc=2):
    cmd = ["-m", "ddp_kit.train", "--progress", "false", "--epochs", "2", "--log_every", "4", "--run_dir", "run", *args]
    if nproc == 1:
        return run_cmd([sys.executable, *cmd], cwd=cwd)
    return run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd],
                   cwd=cwd)


@pytest.mark.integration
def test_dict_batches_and_a_custom_loss_train_under_torchrun(cwd):
    res = ok(job(cwd, *TASK, "--model_args", '{"hidden": 32}', "--dataset_args", '{"n": 256}', "--batch_size", "32"))
    summary = read_json(cwd / "run" / "summary.json")
    assert summary["steps"] == 2 * 256 // 32 and summary["world_size"] == 2
    assert "eval_mae" in summary and "eval_accuracy" not in summary  # accuracy only where it applies
    assert summary["eval_samples"] == 64
    assert "accuracy" not in res.stdout and "done:" in res.stdout
    records = [r for r in map(__import__("json").loads, (cwd / "run" / "metrics.jsonl").read_text().splitlines())
               if r["event"] == "train"]
    assert records and all("train_mae" in r for r in records)
    assert records[-1]["loss"] < records[0]["loss"]  # it learns


@pytest.mark.integration
@pytest.mark.parametrize("args, says", [
    (["--model", "nosuchmodule:model"], "--model nosuchmodule:model: no module named 'nosuchmodule'"),
    (["--model", "mytask:nope"], "--model mytask:nope: module mytask has no 'nope'"),
    (["--model", "mytask:not_a_model"], "--model mytask:not_a_model returned str; expected a torch.nn.Module"),
    (["--model", "mytask:model", "--model_args", '{"depth": 3}'], "cannot be called with model_args {'depth': 3}"),
    (["--model", "mytask_model"], "unknown model 'mytask_model'"),
    (["--dataset", "mytask:loss"], "--dataset mytask:loss cannot be called"),
    (["--model_args", "{not json"], "config key 'model_args' expects dict"),
])
def test_a_bad_task_is_one_line_and_exit_2(cwd, args, says):
    res = job(cwd, *args, nproc=1)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = errors(res.stderr)
    assert len(lines) == 1 and says in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.integration
def test_a_bad_path_under_torchrun_is_printed_once(cwd):
    res = job(cwd, "--model", "mytask:nope")
    assert res.returncode != 0
    lines = errors(workers(res.stderr))
    assert len(lines) == 1 and "module mytask has no 'nope'" in lines[0], res.stderr[-3000:]


@pytest.mark.integration
def test_default_loss_refuses_dict_batches_in_one_line(cwd):
    res = job(cwd, "--model", "mytask:model", "--dataset", "mytask:data", nproc=1)
    assert res.returncode == 2
    lines = errors(res.stderr)
    assert len(lines) == 1 and "the default loss cross_entropy needs (inputs, targets) batches" in lines[0], res.stderr[-2000:]


@pytest.mark.integration
def test_a_user_task_killed_under_max_restarts_resumes_bit_identical(cwd):
    """A task module by import path gets what the built-in tasks get: SIGKILL of rank 1 under
    --max-restarts=1 resumes from the last checkpoint and ends with the same weights."""
    args = ["--progress", "false", "--epochs", "2", "--log_every", "4", *TASK, "--dataset_args", '{"n": 256}',
            "--batch_size", "32", "--ckpt_every", "4"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ok(run_cmd([*launch, "-m", "ddp_kit.train", *args, "--run_dir", "ref"], cwd=cwd))
    res = ok(run_cmd([*launch, "--max-restarts=1", "-m", "ddp_kit.train", *args, "--run_dir", "run",
                      "--inject", "kill:rank=1:step=11"], cwd=cwd))
    assert "resumed from" in res.stdout and "step 8" in res.stdout, res.stdout[-2000:]
    ref, got = (read_json(cwd / d / "summary.json") for d in ("ref", "run"))
    assert got["resumed_from_step"] == 8 and got["param_sha256"] == ref["param_sha256"]


# ---- the built-in registries: one file per model or dataset ----------------------------------------

def test_each_builtin_model_and_dataset_is_one_file_its_registry_finds():
    from pathlib import Path

    import ddp_kit.datasets as datasets
    import ddp_kit.models as models

    for face in (models, datasets):
        files = sorted(p.stem for p in Path(face.__file__).parent.glob("*.py") if not p.name.startswith("_"))
        assert list(face.REGISTRY) == files and list(face.DESCRIPTIONS) == files
        assert all(face.DESCRIPTIONS.values()), face.DESCRIPTIONS  # the help text's one line
    assert set(models.REGISTRY) >= {"mlp", "resnet18", "tiny", "cnn"}
    assert set(datasets.REGISTRY) >= {"digits", "synthetic", "mnist", "cifar10"}


def test_help_lists_every_builtin_from_the_registries():
    from ddp_kit.datasets import REGISTRY as DATASETS
    from ddp_kit.losses import LOSSES
    from ddp_kit.models import REGISTRY as MODELS
    from ddp_kit.train.config import help_text

    text = help_text()
    missing = [name for name in (*MODELS, *DATASETS, *LOSSES) if f" {name} " not in text]
    assert not missing, missing


def test_the_kept_import_path_tasks_is_the_library_losses():
    from ddp_kit.losses import LOSSES
    from ddp_kit.tasks import LOSSES as OLD

    assert OLD is LOSSES and "cross_entropy" in LOSSES


@pytest.mark.integration
def test_importing_the_datasets_loads_neither_sklearn_nor_torchvision():
    code = ("import sys, ddp_kit.datasets\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy', 'torchvision')))")
    assert ok(run_cmd([sys.executable, "-c", code])).stdout.strip() == "[]"


@pytest.mark.integration
def test_the_run_answers_the_micro_batch_and_the_loader_workers():
    code = ("import ddp_kit\n"
            "from ddp_kit.errors import UserError\n"
            "with ddp_kit.init() as run:\n"
            "    print(run.micro_batch(64, 2), run.loader_workers)\n"
            "    try:\n"
            "        run.micro_batch(63, 2)\n"
            "    except UserError as err:\n"
            "        print(err.message)\n")
    *_, answers, refusal = ok(run_cmd([sys.executable, "-c", code])).stdout.splitlines()
    assert answers.split() == ["32", "0"]  # one rank on CPU: no loader workers
    assert "batch_size 63 (global) does not divide into world_size 1 x grad_accum 2" in refusal
