"""A forged checkpoint runs no code: a pickle payload planted in the newest checkpoint (DCP's
.metadata under fsdp, train_state.pt under ddp), with the manifest rewritten to match, never executes
through resume, `checkpoint list` or `checkpoint export`; the checkpoint is named invalid in one line
and the one before it is used (real processes)."""
import hashlib
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ok, run_cmd

BASE = ["-m", "ddp_kit.train", "--epochs", "1", "--max_steps", "10", "--ckpt_every", "5", "--progress", "false",
        "--log_every", "5"]


class Payload:
    """Unpickling this creates `marker`: what an attacker's code would do, made visible."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def rewrite_manifest(step: Path, name: str) -> None:
    """What whoever can write the folder can do: make the manifest vouch for the forged file."""
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


def forge(run_dir: Path, strategy: str, marker: Path) -> None:
    step = run_dir / "checkpoints" / "step_10"
    if strategy == "fsdp":
        # The real metadata, with the payload riding along: torch's plain pickle.load would run it.
        name = "dcp/.metadata"
        real = (step / name).read_bytes()
        (step / name).write_bytes(pickle.dumps((Payload(marker), real)))
    else:
        import torch

        name = "train_state.pt"
        state = torch.load(step / name, weights_only=True)
        state["optimizer"]["evil"] = Payload(marker)
        torch.save(state, step / name)
    rewrite_manifest(step, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("forged")
    for strategy in ("ddp", "fsdp"):
        ok(run_cmd([sys.executable, *BASE, "--strategy", strategy, "--run_dir", str(d / strategy)]))
    return d


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_forged_newest_checkpoint_runs_no_code(runs, tmp_path, strategy):
    run_dir = tmp_path / "run"
    shutil.copytree(runs / strategy, run_dir)
    marker = tmp_path / "pwned"
    forge(run_dir, strategy, marker)

    listed = ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "list", str(run_dir)], timeout=120))
    assert not marker.exists(), f"list ran the payload\n{listed.stdout}"
    assert "not plain checkpoint data" in listed.stdout + listed.stderr, listed.stdout

    out = tmp_path / "model.pt"
    exported = run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "export", str(run_dir), "--out", str(out)],
                       timeout=120)
    assert not marker.exists(), f"export ran the payload\n{exported.stdout}{exported.stderr}"
    ok(exported)
    assert "step_5" in exported.stdout and "step_10" in exported.stderr, (exported.stdout, exported.stderr)

    resumed = ok(run_cmd([sys.executable, *BASE, "--max_steps", "12", "--strategy", strategy,
                          "--run_dir", str(run_dir)]))
    text = resumed.stdout + resumed.stderr
    assert not marker.exists(), f"resume ran the payload\n{text}"
    warned = [line for line in text.splitlines() if "step_10 is not usable" in line]
    assert len(warned) == 1 and "not plain checkpoint data" in warned[0], text
    assert "resumed from" in text and "(step 5," in text, text
    assert "Traceback" not in text


def test_dcp_metadata_of_a_real_save_reads_through_the_allow_list(tmp_path):
    """The allow-list admits everything DCP's own metadata holds (tensors, byte items, nested dicts)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from ddp_kit.checkpoint.safe_load import check_folder, read_dcp_metadata, reader

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "note": {"s": "x", "t": (1, 2)}}
    (tmp_path / "dcp").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), no_dist=True)
        meta = read_dcp_metadata(tmp_path / "dcp")
        assert "model.0.weight" in meta.state_dict_metadata
        assert check_folder(tmp_path) is None
        into = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "note": {"s": "", "t": ()}}
        dcp.load(into, storage_reader=reader(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(into["model"]["0.weight"], model.state_dict()["0.weight"])
    assert into["note"] == {"s": "x", "t": (1, 2)}


def test_a_forged_dcp_byte_item_is_refused_before_it_is_unpickled(tmp_path):
    """A payload in a byte item inside a .distcp file (torch loads those with weights_only=False)."""
    import io
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ddp_kit.checkpoint.safe_load import check_folder, read_dcp_metadata, reader

    marker = tmp_path / "pwned"
    (tmp_path / "dcp").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "note": "x" * 64}, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"),
                 no_dist=True)
    meta = read_dcp_metadata(tmp_path / "dcp")
    index = next(i for i in meta.storage_data if i.fqn == "note")
    info = meta.storage_data[index]
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    shard = tmp_path / "dcp" / info.relative_path
    data = shard.read_bytes()
    # The payload is appended and the item pointed at it; the other items keep their offsets.
    shard.write_bytes(data + buf.getvalue())
    info.offset, info.length = len(data), len(buf.getvalue())
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(meta))

    assert "not plain checkpoint data" in (check_folder(tmp_path) or "")
    # DCP wraps what a reader raises in its CheckpointException (a BaseException)
    with warnings.catch_warnings(), pytest.raises(BaseException) as refused:
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(2), "note": ""}, storage_reader=reader(tmp_path / "dcp"), no_dist=True)
    assert "is not plain checkpoint data" in str(refused.value) + repr(getattr(refused.value, "failures", "")), refused
    assert not marker.exists()
