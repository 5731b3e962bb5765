"""Config precedence and strictness, and the one-line errors of the CLI (real processes)."""
import os
import sys
from pathlib import Path

import pytest

from conftest import ok, read_json, run_cmd, torchrun
from ddp_kit.errors import UserError
from ddp_kit.train.config import TrainConfig, resolve


def test_precedence_defaults_yaml_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nlr: 3e-4\nbatch_size: 32\n")
    cfg = resolve(str(f), {"batch_size": 16})
    assert cfg.epochs == 3 and cfg.batch_size == 16 and cfg.lr == pytest.approx(3e-4)
    assert cfg.seed == TrainConfig().seed


def test_yaml_scientific_string_is_coerced(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 3e-4\n")  # PyYAML reads this as the string '3e-4'
    assert isinstance(resolve(str(f)).lr, float)


def test_unknown_key_named(tmp_path):
    with pytest.raises(UserError, match="unknown config key 'epoch'"):
        resolve(None, {"epoch": 3})
    f = tmp_path / "c.yaml"
    f.write_text("lrate: 1\n")
    with pytest.raises(UserError, match="'lrate'"):
        resolve(str(f))


@pytest.mark.parametrize("key,value", [("epochs", "three"), ("epochs", 2.5), ("lr", "fast"), ("amp", "fp8"),
                                       ("compile", "maybe"), ("batch_size", True)])
def test_wrong_type_named(key, value):
    with pytest.raises(UserError, match=f"'{key}'"):
        resolve(None, {key: value})


def test_optional_and_bool_strings():
    cfg = resolve(None, {"max_steps": "None", "compile": "false", "download": "true"})
    assert cfg.max_steps is None and cfg.compile is False and cfg.download is True


def test_dash_names_accepted():
    assert resolve(None, {"run-dir": "x"}).run_dir == "x"


def test_hash_changes_with_config():
    assert resolve(None, {}).hash() == resolve(None, {}).hash()
    assert resolve(None, {"lr": 0.1}).hash() != resolve(None, {}).hash()


def test_shipped_configs_resolve():
    from conftest import ROOT

    for f in sorted((ROOT / "configs").glob("*.yaml")):
        resolve(str(f))


def _yaml(tmp_path, text, encoding="utf-8"):
    f = tmp_path / "c.yaml"
    f.write_text(text, encoding=encoding)
    return str(f)


def test_yaml_duplicate_key_names_both_lines(tmp_path):
    with pytest.raises(UserError, match=r"'lr' is given twice in .*c\.yaml' \(lines 2 and 4\)"):
        resolve(_yaml(tmp_path, "epochs: 2\nlr: 0.1\nseed: 1\nlr: 0.2\n"))


def test_yaml_merge_key_override_is_not_a_duplicate(tmp_path):
    cfg = resolve(_yaml(tmp_path, "<<: {epochs: 2, lr: 0.1}\nlr: 0.2\n"))
    assert (cfg.epochs, cfg.lr) == (2, 0.2)


@pytest.mark.parametrize("text", ["amp: off\n", "amp: OFF\n", "amp: no\n"])
def test_yaml_boolean_off_for_a_choice_key(tmp_path, text):
    assert resolve(_yaml(tmp_path, text)).amp == "off"


def test_boolean_maps_to_on_off_only_where_choices_say_so(tmp_path):
    assert resolve(None, {"amp": False}).amp == "off"  # fire turns `--amp False` into a bool
    with pytest.raises(UserError, match="'amp' must be one of off, bf16, fp16; got 'on'"):
        resolve(_yaml(tmp_path, "amp: on\n"))
    with pytest.raises(UserError, match="'run_dir' expects str, got False"):  # YAML's `run_dir: no`
        resolve(_yaml(tmp_path, "run_dir: no\n"))


def test_yaml_non_string_key_named(tmp_path):
    with pytest.raises(UserError, match="unknown config key '1'"):
        resolve(_yaml(tmp_path, "1: 2\n"))


def test_yaml_not_utf8_named(tmp_path):
    path = _yaml(tmp_path, "epochs: 2\n", encoding="utf-16")
    with pytest.raises(UserError, match="not UTF-8 text") as err:
        resolve(path)
    assert path in err.value.message and "UTF-16" in err.value.message and "UTF-8" in err.value.hint


def test_yaml_utf8_bom_accepted(tmp_path):
    assert resolve(_yaml(tmp_path, "epochs: 2\n", encoding="utf-8-sig")).epochs == 2


def test_config_path_is_a_folder(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        resolve(str(tmp_path))


def _unreadable_file(tmp_path):
    f = Path(_yaml(tmp_path, "epochs: 2\n"))
    f.chmod(0)
    try:
        f.read_bytes()
    except PermissionError:
        return f
    proc = Path("/proc/self/clear_refs")  # root reads any mode; this file refuses reads (EINVAL)
    if proc.is_file():
        return proc
    pytest.skip("no unreadable file available to this user")


def test_config_file_unreadable(tmp_path):
    f = _unreadable_file(tmp_path)
    with pytest.raises(UserError, match="cannot be read") as err:
        resolve(str(f))
    assert str(f) in err.value.message


def _train(*args, **kw):
    return run_cmd([sys.executable, "-m", "ddp_kit.train", *args], timeout=120, **kw)


def _one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("ddp_kit: error:")]
    assert len(ours) == 1, res.stderr
    assert "Traceback" not in res.stderr and "hint:" in ours[0]
    for n in needles:
        assert n in ours[0]
    return ours[0]


@pytest.mark.integration
@pytest.mark.parametrize("args,needles", [
    (["--epoch", "3"], ["'epoch'"]),
    (["--epochs", "abc"], ["'epochs'", "int"]),
    (["no/such/file.yaml"], ["no/such/file.yaml"]),
    (["--model", "gpt9"], ["gpt9", "mlp"]),
    (["--dataset", "imagenet"], ["imagenet", "digits"]),
    (["--dataset", "mnist", "--data_root", "/nonexistent/data"], ["/nonexistent/data", "MNIST"]),
    (["--batch_size", "63", "--grad_accum", "2"], ["63", "grad_accum 2"]),
])
def test_cli_bad_input_one_line_exit_2(args, needles, tmp_path):
    _one_line_error(_train(*args, "--run_dir", str(tmp_path / "r")), *needles)


@pytest.mark.integration
def test_torchrun_batch_not_divisible_printed_once(tmp_path):
    # Rank 0 starts 2 s late (a sitecustomize on PYTHONPATH, seen only by the workers: RANK is set for
    # them alone), as on a busy machine: rank 1 reaches the error first, and must not exit before rank 0
    # has said it, or torchrun stops rank 0 and nothing is said (CI, stop 53).
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(2)\n")
    path = os.pathsep.join([str(late), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    res = torchrun(["-m", "ddp_kit.train", "--batch_size", "63", "--run_dir", str(tmp_path / "r")], nproc=2,
                   env={"PYTHONPATH": path})
    assert res.returncode != 0
    ours = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: error:")]
    assert len(ours) == 1 and "world_size 2" in ours[0], res.stderr


@pytest.mark.integration
@pytest.mark.parametrize("case", ["duplicate", "utf16", "folder", "unreadable"])
def test_cli_bad_config_file_one_line_exit_2(case, tmp_path):
    if case == "duplicate":
        path, needles = _yaml(tmp_path, "lr: 0.1\nlr: 0.2\n"), ["'lr'", "lines 1 and 2"]
    elif case == "utf16":
        path, needles = _yaml(tmp_path, "epochs: 2\n", encoding="utf-16"), ["not UTF-8"]
    elif case == "folder":
        path, needles = str(tmp_path), ["is a folder"]
    else:
        path, needles = str(_unreadable_file(tmp_path)), ["cannot be read"]
    _one_line_error(_train(path, "--dry_run", "true", "--run_dir", str(tmp_path / "r")), path, *needles)


@pytest.mark.integration
def test_cli_yaml_amp_off_dry_run(tmp_path):
    res = ok(_train(_yaml(tmp_path, "amp: off\n"), "--dry_run", "true", "--run_dir", str(tmp_path / "r")))
    assert "amp: 'off'" in res.stdout or "amp: off" in res.stdout


@pytest.mark.integration
def test_dry_run_prints_resolved_config(tmp_path):
    res = _train("--dry_run", "--lr", "0.5", "--run_dir", str(tmp_path / "r"))
    assert res.returncode == 0 and "lr: 0.5" in res.stdout and "per-rank micro-batch 64" in res.stdout
    assert not (tmp_path / "r").exists()


@pytest.mark.integration
def test_comma_list_flag_survives_fire(tmp_path):
    """fire turns `--fsdp_blocks Block,Embedding` into a tuple; the key still gets the comma list."""
    res = ok(_train("--dry_run", "--strategy", "fsdp", "--fsdp_blocks", "Linear,ReLU", "--run_dir", str(tmp_path / "r")))
    assert "fsdp_blocks: Linear,ReLU" in res.stdout, res.stdout


@pytest.mark.parametrize("flags,named", [({"fsdp_reshard_after_forward": "false"}, ["--fsdp_reshard_after_forward"]),
                                         ({"fsdp_blocks": "Block"}, ["--fsdp_blocks"]),
                                         ({"fsdp_blocks": "Block", "fsdp_cpu_offload": "true"},
                                          ["--fsdp_blocks", "--fsdp_cpu_offload"])])
def test_fsdp_options_under_ddp_name_what_was_given(flags, named):
    with pytest.raises(UserError, match="FSDP option") as err:
        resolve(None, flags)
    given = [w for w in err.value.message.split() if w.startswith("--fsdp")]
    assert given == named, err.value.message


@pytest.mark.integration
@pytest.mark.parametrize("flag", ["--help", "-h", "--help_config"])
def test_help_lists_every_config_key(flag, tmp_path):
    res = ok(_train(flag, cwd=tmp_path))
    assert res.stdout.startswith("python -m ddp_kit.train"), res.stdout[:500]
    missing = [k for k in TrainConfig.__dataclass_fields__ if f"  {k} " not in res.stdout]
    assert not missing and not res.stderr.strip() and not list(tmp_path.iterdir()), (missing, res.stderr)


# ---- resuming with a changed recipe ----------------------------------------------------------------

def test_recipe_changes_split_refused_and_allowed():
    from ddp_kit.reliability import recipe_changes

    saved = resolve(None, {"inject": "kill:rank=0:step=3"}).to_dict()
    current = resolve(None, {"lr": 0.01, "optimizer": "sgd", "epochs": 30, "log_every": 7, "resume": "never"}).to_dict()
    refused, allowed = recipe_changes(saved, current)
    assert refused == {"lr": (0.003, 0.01), "optimizer": ("adamw", "sgd")}
    # resume and inject differ on every recovery and are never applied to it: not reported
    assert allowed == {"epochs": (20, 30), "log_every": (50, 7)}


def test_recipe_changes_ignores_keys_one_side_lacks():
    from ddp_kit.reliability import recipe_changes

    saved = {k: v for k, v in resolve(None, {}).to_dict().items() if k != "momentum"}
    saved["removed_key"] = 1
    assert recipe_changes(saved, resolve(None, {"momentum": 0.5}).to_dict()) == ({}, {})


def test_resumable_keys_are_config_keys():
    from ddp_kit.reliability import NOT_RECIPE, RESUMABLE
    from ddp_kit.train.config import FIELDS

    assert RESUMABLE <= set(FIELDS) and NOT_RECIPE <= RESUMABLE
    assert not {"lr", "optimizer", "batch_size", "seed", "model", "dataset", "amp", "lr_schedule"} & RESUMABLE


ONE_EPOCH = ["--epochs", "1", "--lr_schedule", "constant", "--ckpt_every", "5", "--log_every", "5", "--progress", "false"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One epoch (22 steps) of adamw at lr 0.003, finished: its last checkpoint is step_22."""
    d = tmp_path_factory.mktemp("finished") / "run"
    ok(_train(*ONE_EPOCH, "--run_dir", str(d)))
    return d


def _rerun(finished_run, tmp_path, *args):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    return d, _train(*ONE_EPOCH, "--run_dir", str(d), *args)


@pytest.mark.integration
@pytest.mark.parametrize("args,needles", [
    (["--lr", "0.01"], ["lr 0.003 -> 0.01"]),
    (["--optimizer", "sgd"], ["optimizer adamw -> sgd"]),  # was KeyError: 'momentum' with a traceback
    (["--lr", "0.01", "--seed", "3", "--batch_size", "32"], ["lr 0.003 -> 0.01", "seed 0 -> 3", "batch_size 64 -> 32"]),
])
def test_resume_with_changed_recipe_refused(finished_run, tmp_path, args, needles):
    d, res = _rerun(finished_run, tmp_path, *args)
    line = _one_line_error(res, "step_22", "--run_dir", "--resume never", *needles)
    assert "epochs" not in line and "run_dir" not in line.split("(hint")[0]
    assert sorted(p.name for p in (d / "checkpoints").glob("step_*")) == ["step_15", "step_20", "step_22"]
    assert (d / "summary.json").read_text() == (finished_run / "summary.json").read_text()


@pytest.mark.integration
def test_resume_with_more_epochs_continues(finished_run, tmp_path):
    d, res = _rerun(finished_run, tmp_path, "--epochs", "2")
    ok(res)
    resumed = [line for line in res.stdout.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "step 22" in resumed[0] and "epochs 1 -> 2" in resumed[0], res.stdout
    summary = read_json(d / "summary.json")
    assert summary["steps"] == 44 and summary["resumed_from_step"] == 22
    # with a constant LR, one epoch then one more is the same computation as two at once
    ref = tmp_path / "ref"
    ok(_train(*ONE_EPOCH, "--epochs", "2", "--run_dir", str(ref)))
    assert summary["param_sha256"] == read_json(ref / "summary.json")["param_sha256"]
