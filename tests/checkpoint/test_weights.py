"""Weights as safetensors (checkpoint/weights.py, `export --format safetensors`, run.load_weights): the
whole model of a replicated or sharded checkpoint, its header, tied weights, refusals in one line, and
nothing unpickled to read it. In-process (world size 1) first; then real 2-rank DDP and FSDP runs."""
import json
import pickle
import struct
import sys

import pytest
import torch
from torch import nn

from conftest import HELPERS, ok, read_json, run_cmd, torchrun
from ddp_kit.checkpoint import cli, load_weights, read_weights, save_weights
from ddp_kit.errors import UserError
from ddp_kit.models import REGISTRY

X = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(7))


def mlp():
    return REGISTRY["mlp"]((1, 8, 8), 10)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Every way Python and torch unpickle raises while the fixture is active: `with no_unpickling():`."""
    import contextlib

    @contextlib.contextmanager
    def active():
        def refuse(*a, **k):
            raise AssertionError("something was unpickled")

        with monkeypatch.context() as m:
            for name in ("Unpickler", "load", "loads"):
                m.setattr(pickle, name, refuse)
            m.setattr(torch, "load", refuse)
            m.setattr(torch.serialization, "load", refuse)
            m.setattr(torch._weights_only_unpickler, "Unpickler", refuse)
            yield

    return active


def header_of(path) -> dict:
    """The JSON header at the front of a safetensors file, read by hand: 8 bytes of length, then JSON."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))["__metadata__"]


def one_step_run(run_dir, strategy):
    """A world-size-1 run of one optimizer step under `strategy`, closed (its final checkpoint: step 1)."""
    import ddp_kit
    from ddp_kit.env import DistEnv

    run = ddp_kit.init(run_dir=str(run_dir), env=DistEnv(), device="cpu", resume="never", log_every=0,
                       sync_check_every=0, ckpt_every=0, config={"lr": 0.1})
    torch.manual_seed(0)
    model = run.prepare(mlp(), strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.resume(optimizer=opt)
    model(X).sum().backward()
    opt.step()
    run.step()
    run.close()
    return run_dir / "checkpoints" / "step_1"


def fresh_run(run_dir):
    import ddp_kit
    from ddp_kit.env import DistEnv

    return ddp_kit.init(run_dir=str(run_dir), env=DistEnv(), device="cpu", resume="never", log_every=0,
                        sync_check_every=0, ckpt_every=0)


# ---- in-process (unit tier) ------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_export_of_a_checkpoint_loads_into_a_fresh_model_without_unpickling(tmp_path, strategy, no_unpickling, capsys):
    step = one_step_run(tmp_path / "run", strategy)
    expected = cli._read_object(step, "model")  # model.pt, or the DCP shards assembled
    out = tmp_path / "model.safetensors"
    cli.export(str(tmp_path / "run"), str(out))  # the suffix picks the format
    assert "safetensors, step 1" in capsys.readouterr().out
    meta = read_json(step / "meta.json")
    with no_unpickling():
        state, head = read_weights(out)
        model = mlp()
        assert load_weights(model, out) == head
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    reference = mlp()
    reference.load_state_dict(expected)
    assert torch.equal(model(X), reference(X))
    assert head == header_of(out)  # in the file's own header, as strings
    assert head == {"format": "pt", "name": "model", "step": "1", "world_size": "1", "strategy": strategy,
                    "config_hash": meta["config_hash"], "ddp_kit": meta["ddp_kit"], "torch": meta["torch"]}
    assert not list(tmp_path.glob(".*"))  # no temporary file left beside it


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_run_load_weights_into_a_prepared_model(tmp_path, strategy, no_unpickling):
    torch.manual_seed(3)
    source = mlp()
    save_weights(source.state_dict(), tmp_path / "w.safetensors", {"step": 5})
    run = fresh_run(tmp_path / "run")
    try:
        model = run.prepare(mlp(), strategy=strategy)
        with no_unpickling():
            head = run.load_weights(model, tmp_path / "w.safetensors")
        assert head["step"] == "5"
        full = run.full_state_dict(model)
        assert all(torch.equal(full[k], v) for k, v in source.state_dict().items())
        assert torch.equal(model(X), source(X))
    finally:
        run.close()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.out = nn.Linear(6, 12, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, idx):
        return self.out(self.embed(idx))


def test_tied_weights_are_each_written_whole_and_load_strictly(tmp_path, no_unpickling):
    torch.manual_seed(1)
    model = Tied()
    head = save_weights(model.state_dict(), tmp_path / "t.safetensors")
    assert json.loads(head["shared"]) == {"out.weight": "embed.weight"}
    with no_unpickling():
        state, _ = read_weights(tmp_path / "t.safetensors")
        fresh = Tied()
        load_weights(fresh, tmp_path / "t.safetensors")  # strict: both names are in the file
    assert set(state) == {"embed.weight", "out.weight"} and torch.equal(state["embed.weight"], state["out.weight"])
    assert fresh.out.weight is fresh.embed.weight  # still tied
    idx = torch.arange(12)
    assert torch.equal(fresh(idx), model(idx))


def test_a_non_tensor_entry_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError) as err:
        save_weights({"w": torch.ones(2), "_extra_state": {"scale": 1.0}}, tmp_path / "x.safetensors")
    assert "'_extra_state' is a dict, not a tensor" in err.value.line() and "--format pt" in err.value.hint
    assert not list(tmp_path.iterdir())


def test_export_of_an_optimizer_as_safetensors_is_refused(tmp_path):
    one_step_run(tmp_path / "run", "ddp")
    with pytest.raises(UserError) as err:
        cli.export(str(tmp_path / "run"), str(tmp_path / "opt.safetensors"), name="optimizer")
    assert "'optimizer' of step_1 entry 'state' is a dict, not a tensor" in str(err.value)
    assert not (tmp_path / "opt.safetensors").exists()


def test_a_pickle_is_not_read_as_safetensors(tmp_path, no_unpickling):
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with no_unpickling(), pytest.raises(AssertionError, match="unpickled"):  # the guard the other tests rely on
        torch.load(tmp_path / "model.pt", weights_only=True)
    with no_unpickling(), pytest.raises(UserError) as err:
        load_weights(nn.Linear(2, 1), tmp_path / "model.pt")
    assert "is not a readable safetensors file" in str(err.value) and "weights_only=True" in err.value.hint
    with pytest.raises(UserError, match="does not exist"):
        read_weights(tmp_path / "missing.safetensors")


def test_a_file_that_does_not_fit_the_model_is_one_line(tmp_path):
    save_weights(nn.Linear(4, 2).state_dict(), tmp_path / "w.safetensors")
    with pytest.raises(UserError, match=r"shapes differ for 1 tensor\(s\) \(file vs model: weight \(2, 4\) vs \(3, 4\)"):
        load_weights(nn.Linear(4, 3, bias=False), tmp_path / "w.safetensors", strict=False)
    with pytest.raises(UserError, match=r"missing 2 key\(s\): 1.bias, 1.weight; unexpected 2 key\(s\): bias, weight"):
        load_weights(nn.Sequential(nn.Identity(), nn.Linear(4, 2)), tmp_path / "w.safetensors")
    model = nn.Linear(4, 2, bias=False)
    load_weights(model, tmp_path / "w.safetensors", strict=False)  # the bias is left out


def test_format_refusals(tmp_path):
    one_step_run(tmp_path / "run", "ddp")
    with pytest.raises(UserError, match="--format expects pt or safetensors; got 'onnx'"):
        cli.export(str(tmp_path / "run"), str(tmp_path / "m.onnx"), format="onnx")
    with pytest.raises(UserError, match="--format pt does not match --out") as err:
        cli.export(str(tmp_path / "run"), str(tmp_path / "m.safetensors"), format="pt")
    assert "m.pt" in err.value.hint
    with pytest.raises(UserError, match="--format safetensors does not match --out"):
        cli.export(str(tmp_path / "run"), str(tmp_path / "m.pt"), format="safetensors")
    cli.export(str(tmp_path / "run"), str(tmp_path / "weights"), format="safetensors")  # no suffix: as told
    assert read_weights(tmp_path / "weights")[1]["step"] == "1"


def test_without_the_package_one_line_names_the_extra(tmp_path, monkeypatch):
    one_step_run(tmp_path / "run", "ddp")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UserError) as err:
        cli.export(str(tmp_path / "run"), str(tmp_path / "m.safetensors"))
    assert "safetensors package is not installed" in str(err.value) and "ddp_kit[safetensors]" in err.value.hint
    cli.export(str(tmp_path / "run"), str(tmp_path / "m.pt"))  # the pickle format needs nothing more


# ---- real processes: 2-rank DDP and FSDP runs ------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    for strategy in ("ddp", "fsdp"):
        ok(torchrun(["-m", "ddp_kit.train", "--max_steps", "10", "--ckpt_every", "5", "--progress", "false",
                     "--strategy", strategy, "--run_dir", str(d / strategy)], timeout=240))
    return d


def export(*args):
    return ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "export", *map(str, args)], timeout=120))


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_safetensors_of_a_2_rank_run_gives_the_checkpoints_outputs(runs, tmp_path, strategy, no_unpickling):
    from ddp_kit.reliability.sync_checks import param_sha256

    run_dir, step = runs / strategy, runs / strategy / "checkpoints" / "step_10"
    out = tmp_path / "model.safetensors"
    res = export(run_dir, "--out", out, "--format", "safetensors")
    assert "safetensors, step 10" in res.stdout
    if strategy == "ddp":
        assert not (step / "dcp").exists()
        expected = torch.load(step / "model.pt", weights_only=True)
    else:
        assert not (step / "model.pt").exists() and (step / "dcp").is_dir()
        export(run_dir, "--out", tmp_path / "model.pt")  # the DCP shards assembled, as torch.save
        expected = torch.load(tmp_path / "model.pt", weights_only=True)
    with no_unpickling():
        model = mlp()
        head = load_weights(model, out)
    reference = mlp()
    reference.load_state_dict(expected)
    assert torch.equal(model(X), reference(X))
    assert param_sha256(model) == read_json(run_dir / "summary.json")["param_sha256"]  # the run's final weights
    meta = read_json(step / "meta.json")
    assert head["strategy"] == strategy and head["world_size"] == "2" and head["config_hash"] == meta["config_hash"]
    # From the ckpt_dir as a URL: downloaded, checksums verified, the same bytes of weights.
    url_out = tmp_path / "from_url.safetensors"
    export(f"file://{run_dir / 'checkpoints'}", "--out", url_out)
    with no_unpickling():
        again, _ = read_weights(url_out)
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_run_load_weights_on_2_ranks(runs, tmp_path, strategy):
    """The 2-rank FSDP run's export loaded by run.load_weights into a model prepared over 2 ranks (each
    rank started from other random weights): the gathered weights and every rank's outputs are the file's."""
    out = tmp_path / "model.safetensors"
    export(runs / "fsdp", "--out", out)
    res = ok(torchrun([str(HELPERS / "load_weights.py"), str(out), strategy, str(tmp_path / "run")], timeout=180))
    assert res.stdout.count("loaded: same weights, same outputs") == 2, res.stdout
