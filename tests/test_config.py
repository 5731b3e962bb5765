"""Config precedence and strictness, and the one-line errors of the CLI (real processes)."""
import sys

import pytest

from conftest import run_cmd, torchrun
from ddp_kit.config import TrainConfig, resolve
from ddp_kit.errors import UserError


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


@pytest.mark.slow
def test_torchrun_batch_not_divisible_printed_once(tmp_path):
    res = torchrun(["-m", "ddp_kit.train", "--batch_size", "63", "--run_dir", str(tmp_path / "r")], nproc=2)
    assert res.returncode != 0
    ours = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: error:")]
    assert len(ours) == 1 and "world_size 2" in ours[0], res.stderr


def test_dry_run_prints_resolved_config(tmp_path):
    res = _train("--dry_run", "--lr", "0.5", "--run_dir", str(tmp_path / "r"))
    assert res.returncode == 0 and "lr: 0.5" in res.stdout and "per-rank micro-batch 64" in res.stdout
    assert not (tmp_path / "r").exists()
