"""The object store checkpoint backend in this process (world size 1), on fsspec's own stores: an
in-process `memory://` and the local `file://` (the same code path as s3://, without a server; the
S3-protocol server tests are test_ckpt_s3.py's). The commit protocol is checked by what it leaves on
the store: every object, then `latest`, then the manifest; damage is made by writing
the damaged object, and failed uploads by a step prefix that cannot be written (a file in its way)."""
import hashlib
import json
import uuid

import pytest


def _alone():
    import torch

    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(DistEnv(), torch.device("cpu"), "gloo")


def _url(tmp_path=None):
    return f"file://{tmp_path}/ck" if tmp_path is not None else f"memory://bucket-{uuid.uuid4().hex[:8]}/run"


def _save(ck, step, value=None):
    import torch

    value = float(step) if value is None else value
    ck.save(step, {"model": {"w": torch.full((4,), value)}, "loop": {"step": step}},
            {"rng": torch.get_rng_state()}, {"strategy": "ddp"})


def _objects(ck):
    from ddp_kit.checkpoint import steps

    return steps.objects(ck.store)


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    return _url(tmp_path if request.param == "file" else None)


def test_commit_uploads_every_object_then_latest_then_the_manifest(url):
    import fsspec.implementations.memory as memory

    from ddp_kit.checkpoint import layout, open_backend
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer
    from ddp_kit.checkpoint.store_fs import Store

    class Recording(memory.MemoryFileSystem):  # the real in-memory store, remembering the order of writes
        order: list = []

        def put_file(self, lpath, rpath, *a, **k):
            Recording.order.append(rpath.rsplit("/", 1)[-1])
            return super().put_file(lpath, rpath, *a, **k)

        def pipe_file(self, path, value, *a, **k):
            Recording.order.append(path.rsplit("/", 1)[-1])
            return super().pipe_file(path, value, *a, **k)

    fs = Recording()
    ck = ObjectStoreCheckpointer(_alone(), Store(fs, "/rec/run", "memory://rec/run"))
    _save(ck, 5)
    ck.wait()
    names = [n for n in Recording.order if not n.startswith((layout.PROBE_PREFIX, layout.LEASE_PREFIX))]
    assert names[-2:] == ["latest", "manifest.json"], names
    assert set(names[:-2]) == {"model.pt", "train_state.pt", "meta.json", "rank0.pt"}
    manifest = json.loads(fs.cat_file("/rec/run/step_5/manifest.json"))
    for name, want in manifest["files"].items():  # the manifest vouches for exactly the bytes on the store
        data = fs.cat_file(f"/rec/run/step_5/{name}")
        assert want == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert fs.cat_file("/rec/run/latest").decode().strip() == "step_5" and ck.latest() == 5
    (timing,) = ck.take_timings()
    assert timing["step"] == 5 and 0 <= timing["blocking_s"] <= timing["commit_s"]
    ck.close()
    # and through the registry, on both stores
    ck = open_backend(url, _alone())
    _save(ck, 1)
    ck.wait()
    assert sorted(_objects(ck)) == ["latest", "step_1/manifest.json", "step_1/meta.json", "step_1/model.pt",
                                    "step_1/rank0.pt", "step_1/train_state.pt"]
    ck.close()


def test_resume_reads_the_newest_committed_step_back_from_a_fresh_backend(url):
    from ddp_kit.checkpoint import open_backend

    ck = open_backend(url, _alone(), keep_last=3)
    for step in (1, 2, 3):
        _save(ck, step)
    ck.close()
    again = open_backend(url, _alone())
    found = again.find("auto", warn=pytest.fail)
    assert found.path == f"{url}/step_3" and found.step == 3 and again.owns(found)
    shared, own, meta = again.load(found)
    assert shared["model"]["w"].tolist() == [3.0] * 4 and "rng" in own and meta["world_size"] == 1
    assert again.find("never", warn=pytest.fail) is None
    named = again.find(f"{url}/step_2", warn=pytest.fail)
    assert named.step == 2 and again.load(named)[0]["loop"]["step"] == 2
    again.close()


@pytest.mark.parametrize("damage,said", [("truncate", "model.pt is truncated ("), ("flip", "model.pt is corrupt (checksum mismatch)"),
                                         ("delete", "model.pt is missing"), ("manifest", "no manifest (save did not finish)")])
def test_find_falls_back_past_a_damaged_newest_step_in_one_line(url, damage, said):
    from ddp_kit.checkpoint import open_backend

    ck = open_backend(url, _alone())
    for step in (1, 2):
        _save(ck, step)
    ck.wait()
    fs, obj = ck.store.fs, ck.store.path("step_2", "manifest.json" if damage == "manifest" else "model.pt")
    data = fs.cat_file(obj)
    if damage == "truncate":
        fs.pipe_file(obj, data[: len(data) // 2])
    elif damage == "flip":
        fs.pipe_file(obj, data[:-1] + bytes([data[-1] ^ 1]))
    else:
        fs.rm_file(obj)
    lines = []
    found = ck.find("auto", warn=lines.append)
    assert found.step == 1 and ck.load(found)[0]["model"]["w"].tolist() == [1.0] * 4
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {url}/step_2 is not usable ({said}")
    assert lines[0].endswith("falling back to an older one")
    ck.close()


def test_a_crash_leaves_only_objects_no_manifest_vouches_for_and_the_next_save_removes_them(url):
    from ddp_kit.checkpoint import layout, open_backend, steps

    ck = open_backend(url, _alone(), keep_last=2)
    for step in (1, 2, 3, 4):
        _save(ck, step)
    ck.wait()
    fs, path = ck.store.fs, ck.store.path
    # what killed saves leave: a step's objects without its manifest (below and above `latest`: above
    # it, it may be another writer's upload in flight, so it stays), an object of an earlier attempt
    # inside a committed step, a startup probe
    for orphan in (9, 0):
        fs.pipe_file(path(f"step_{orphan}", "rank0.pt"), b"half")
    fs.pipe_file(path("step_4", "rank7.pt"), b"an earlier attempt's")
    fs.pipe_file(path(layout.PROBE_PREFIX + "dead"), b"x")
    assert ck.find("auto", warn=pytest.fail).step == 4  # orphans are never read
    _save(ck, 5)
    ck.wait()
    objects = _objects(ck)
    assert sorted({r.split("/")[0] for r in objects}) == ["latest", "step_4", "step_5", "step_9"]  # keep_last 2
    assert "step_4/rank7.pt" not in objects and list(steps.by_step(objects)[9]) == ["step_9/rank0.pt"]
    # a save killed between `latest` and the manifest: `latest` names an incomplete step; resume falls
    # back to the one before, and the next save of that step replaces it
    _save(ck, 6)
    ck.wait()
    fs.rm_file(path("step_6", "manifest.json"))
    lines = []
    assert ck.find("auto", warn=lines.append).step == 5 and "step_6 is not usable (no manifest" in lines[0]
    _save(ck, 6)
    ck.wait()
    assert ck.find("auto", warn=pytest.fail).step == 6
    ck.close()


def test_keep_last_zero_keeps_every_committed_step(url):
    from ddp_kit.checkpoint import open_backend

    ck = open_backend(url, _alone(), keep_last=0)
    for step in (1, 2, 3):
        _save(ck, step)
    ck.wait()
    assert sorted({r.split("/")[0] for r in _objects(ck)}) == ["latest", "step_1", "step_2", "step_3"]
    ck.close()


def test_archive_copies_the_abandoned_steps_under_the_url_and_points_latest_first(url):
    from ddp_kit.boundary.checkpoint_io import archive_folder
    from ddp_kit.checkpoint import open_backend, steps
    from ddp_kit.run_folder import RunDir

    ck = open_backend(url, _alone(), keep_last=0)
    for step in (1, 2, 3):
        _save(ck, step)
    ck.wait()
    into = archive_folder(ck, RunDir(__import__("pathlib").Path("/nonexistent")))
    assert into == f"{url}/archive"
    assert ck.archive(1, into) == [2, 3] and ck.latest() == 1
    archived = ck.store.fs.find(ck.store.path("archive"))
    assert len(archived) == 10 and all("/archive/20" in a for a in archived)  # <url>/archive/<time>/step_N/...
    assert sorted({r.split("/")[0] for r in _objects(ck)}) == ["latest", "step_1"]
    assert ck.find("auto", warn=pytest.fail).step == 1
    assert ck.archive(None, into) == [1] and ck.latest() is None and steps.committed(_objects(ck)) == []
    ck.close()


def test_a_failed_upload_is_retried_said_and_given_up_and_training_goes_on(tmp_path, monkeypatch, capsys):
    from ddp_kit.checkpoint import object_store, open_backend

    monkeypatch.setattr(object_store, "BACKOFF_S", 0.01)
    url = _url(tmp_path)
    ck = open_backend(url, _alone(), keep_last=2)
    _save(ck, 1)
    ck.wait()
    (tmp_path / "ck" / "step_2").write_text("a file where the step's prefix goes: every upload into it fails")
    _save(ck, 2)
    ck.wait()  # not raised: the run goes on
    err = capsys.readouterr().err
    retries = [line for line in err.splitlines() if "retrying in" in line]
    assert len(retries) == 3 * 4 and f"upload of {url}/step_2/" in retries[0] and "(try 2 of 4)" in retries[0]
    given_up = [line for line in err.splitlines() if "was not committed" in line]
    assert len(given_up) == 1 and given_up[0].startswith(f"ddp_kit: warning: checkpoint step_2 was not committed to {url}: ")
    assert "failed 4 times" in given_up[0] and "ckpt_upload_timeout_s 1800s" in given_up[0] and "last committed: step_1" in given_up[0]
    assert ck.latest() == 1 and [t["step"] for t in ck.take_timings()] == [1]  # the failed save has no commit time
    _save(ck, 3)
    ck.wait()
    assert ck.latest() == 3
    ck.close()


def test_the_run_stops_in_one_line_when_nothing_has_committed_for_ckpt_upload_timeout_s(tmp_path, monkeypatch):
    from ddp_kit.checkpoint import object_store, open_backend
    from ddp_kit.errors import UserError

    monkeypatch.setattr(object_store, "BACKOFF_S", 0.01)
    url = _url(tmp_path)
    ck = open_backend(url, _alone(), upload_timeout_s=0.05)
    _save(ck, 1)
    ck.wait()
    (tmp_path / "ck" / "step_2").write_text("in the way")
    _save(ck, 2)
    with pytest.raises(UserError) as err:
        ck.wait()
    line = err.value.line()
    assert f"no checkpoint has committed to {url} for " in line and "(ckpt_upload_timeout_s 0.05)" in line
    assert "raise ckpt_upload_timeout_s" in line and "last committed: step_1" in line and "\n" not in line
    ck.close()


def test_write_delay_slows_every_upload_and_the_loop_waits_only_for_the_local_files(tmp_path):
    import time

    from ddp_kit.checkpoint import open_backend

    ck = open_backend(_url(tmp_path), _alone(), write_delay_s=0.2)
    began = time.monotonic()
    _save(ck, 1)  # the staging write sleeps too (model.pt and rank0.pt, side by side): ~0.2 s
    returned = time.monotonic() - began
    assert ck.latest() is None  # five objects at 0.2 s each, four at once: the upload is not done yet
    ck.wait()
    (timing,) = ck.take_timings()
    assert ck.latest() == 1 and timing["blocking_s"] <= returned + 0.01 and timing["commit_s"] >= timing["blocking_s"] + 0.35
    ck.close()


def test_async_saves_go_through_the_same_commit(url):
    from ddp_kit.checkpoint import open_backend

    ck = open_backend(url, _alone(), keep_last=2, async_save=True)
    for step in (1, 2, 3):
        _save(ck, step)
    ck.close()
    again = open_backend(url, _alone())
    found = again.find("auto", warn=pytest.fail)
    assert found.step == 3 and again.load(found)[0]["model"]["w"].tolist() == [3.0] * 4
    assert sorted({r.split("/")[0] for r in _objects(again)}) == ["latest", "step_2", "step_3"]
    again.close()


# ---- bad input: one line naming the URL and the fix --------------------------------------------------

def _probed(location):
    """Open a backend and make the first collective call, as resume does before step 1 (opening
    alone is local: a rank may open it by itself to read `latest`)."""
    from ddp_kit.checkpoint import open_backend

    ck = open_backend(location, _alone())
    try:
        ck.find("auto", warn=pytest.fail)
    finally:
        ck.close()

@pytest.mark.parametrize("location,said,fix", [
    ("gs://bucket/run", "'gs://bucket/run' needs gcsfs, which is not installed here", "pip install gcsfs"),
    ("az://container/run", "'az://container/run' needs adlfs, which is not installed here", "pip install adlfs"),
])
def test_a_scheme_whose_client_is_not_installed_is_one_line(location, said, fix):
    pytest.importorskip("fsspec")
    from ddp_kit.errors import UserError

    try:
        __import__({"gs": "gcsfs", "az": "adlfs"}[location[:2]])
        pytest.skip("the client is installed here")
    except ImportError:
        pass
    with pytest.raises(UserError) as err:
        _probed(location)
    line = err.value.line()
    assert said in line and f"(hint: {fix})" in line and "\n" not in line


def test_a_location_that_cannot_be_written_is_refused_at_open(tmp_path):
    from ddp_kit.errors import UserError

    (tmp_path / "plain_file").write_text("x")
    with pytest.raises(UserError) as err:
        _probed(f"file://{tmp_path}/plain_file/ck")
    line = err.value.line()
    assert f"checkpoint location 'file://{tmp_path}/plain_file/ck' cannot be written (" in line and "hint: " in line


@pytest.mark.parametrize("value,said", [("{not json", "DDP_KIT_STORAGE_OPTIONS is not valid JSON"),
                                        ('["a"]', "DDP_KIT_STORAGE_OPTIONS must be a JSON object")])
def test_bad_storage_options_are_one_line(monkeypatch, value, said):
    from ddp_kit.errors import UserError

    monkeypatch.setenv("DDP_KIT_STORAGE_OPTIONS", value)
    with pytest.raises(UserError) as err:
        _probed("memory://b/run")
    assert said in err.value.line() and "hint: " in err.value.line()


def test_refusal_names_missing_bucket_credentials_and_permission():
    from ddp_kit.checkpoint.store_fs import refusal

    class NoCredentialsError(Exception):  # botocore's name for it; botocore itself is optional
        pass

    url = "s3://b/run"
    assert "the bucket of checkpoint location 's3://b/run' does not exist" in refusal(url, FileNotFoundError("NoSuchBucket"), "written").line()
    assert "no credentials for checkpoint location 's3://b/run'" in refusal(url, NoCredentialsError("Unable to locate credentials"), "written").line()
    line = refusal(url, PermissionError("AccessDenied"), "written").line()
    assert "cannot be written: access denied" in line and "read-only bucket" in line


def test_a_url_as_run_dir_and_a_ckpt_dir_without_run_dir_are_one_line():
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.errors import UserError

    with pytest.raises(UserError) as err:
        Policy(run_dir="s3://bucket/run")
    assert "run_dir 's3://bucket/run' is a URL" in err.value.line() and "pass ckpt_dir='s3://bucket/run'" in err.value.line()
    with pytest.raises(UserError) as err:
        Policy(ckpt_dir="s3://bucket/run")
    assert "without a run_dir" in err.value.line()
    assert Policy(run_dir="runs/x", ckpt_dir="s3://bucket/run").ckpt_dir == "s3://bucket/run"


# ---- the CLI on a URL (in this process: memory:// lives in it) ---------------------------------------

def test_cli_lists_and_exports_from_a_url(url, tmp_path, capsys):
    import torch

    from ddp_kit.checkpoint import cli, open_backend

    ck = open_backend(url, _alone(), keep_last=0)
    for step in (1, 2, 3):
        _save(ck, step)
    ck.wait()
    fs = ck.store.fs
    data = fs.cat_file(ck.store.path("step_3", "model.pt"))
    fs.pipe_file(ck.store.path("step_3", "model.pt"), data[:100])
    cli.list_(url)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["step", "status", "world", "size", "url"]
    assert out[1].split()[:3] == ["3", "INVALID", "?"] and f"{url}/step_3 (latest)" in out[1] and "model.pt is truncated (100 of" in out[1]
    assert out[2].split()[:3] == ["2", "valid", "1"] and out[2].endswith(f"{url}/step_2")
    cli.export(url, tmp_path / "model.pt")
    captured = capsys.readouterr()
    assert "checkpoint step_3 is not usable (model.pt is truncated" in captured.err and "exporting step_2 instead" in captured.err
    assert f"from {url}/step_2 to" in captured.out
    assert torch.load(tmp_path / "model.pt", weights_only=True)["w"].tolist() == [2.0] * 4
    cli.export(url, tmp_path / "one.pt", step=1)
    assert torch.load(tmp_path / "one.pt", weights_only=True)["w"].tolist() == [1.0] * 4
    ck.close()


def test_cli_on_a_url_with_nothing_or_a_bad_step_is_one_line(url, tmp_path):
    from ddp_kit.checkpoint import cli
    from ddp_kit.errors import UserError

    with pytest.raises(UserError) as err:
        cli.list_(url)
    assert f"no checkpoints under {url!r}" in err.value.line()
    with pytest.raises(UserError) as err:
        cli.export(url, tmp_path / "m.pt", step="latest")
    assert "there is no 'latest' object" in err.value.line()
    with pytest.raises(UserError) as err:
        cli.export(url, tmp_path / "m.pt", step=4)
    assert "no valid checkpoint at step 4" in err.value.line()


@pytest.mark.parametrize("async_save", [False, True])
def test_sharded_state_goes_through_dcp_into_staging_and_back_from_the_store(url, one_rank_group, async_save):
    import torch

    from ddp_kit.checkpoint import open_backend

    ck = open_backend(url, _alone(), async_save=async_save)
    for step in (1, 2):
        ck.save(step, {"loop": {"step": step}}, {"rng": torch.get_rng_state()}, {"strategy": "fsdp"},
                sharded={"model": {"w": torch.full((1000,), float(step))}})
    ck.close()
    objects = _objects(ck)
    assert "step_2/dcp/.metadata" in objects and any(r.startswith("step_2/dcp/__0_") for r in objects)
    manifest = json.loads(ck.store.fs.cat_file(ck.store.path("step_2", "manifest.json")))
    assert {n for n in manifest["files"] if n.startswith("dcp/")} == {r[len("step_2/"):] for r in objects if r.startswith("step_2/dcp/")}
    again = open_backend(url, _alone())
    found = again.find("auto", warn=pytest.fail)
    assert found.step == 2 and again.sharded_keys(found) == {"model.w"}
    template = {"model": {"w": torch.zeros(1000)}}
    again.load_sharded(found, template)
    assert template["model"]["w"].eq(2.0).all()
    again.close()


# ---- 2 ranks (torchrun), file:// ---------------------------------------------------------------------

@pytest.mark.integration
def test_two_ranks_killed_after_a_commit_resume_from_the_store_bit_identically(tmp_path):
    """Every rank uploads its own rank<R>.pt; a rank SIGKILLed at step 6 (step_4 committed) leaves
    the job to resume from step_4 on the same URL, to the weights of a run that was never killed."""
    from conftest import ok, read_json, torchrun

    common = ["-m", "ddp_kit.train", "--epochs", "1", "--max_steps", "8", "--ckpt_every", "4", "--progress", "false",
              "--peer_timeout_s", "10"]
    ok(torchrun([*common, "--run_dir", str(tmp_path / "ref"), "--ckpt_dir", f"file://{tmp_path}/ref_ck"]))
    url = f"file://{tmp_path}/ck"
    killed = torchrun([*common, "--run_dir", str(tmp_path / "run"), "--ckpt_dir", url, "--inject", "kill:rank=1:step=6"])
    assert killed.returncode != 0
    manifest = read_json(tmp_path / "ck" / "step_4" / "manifest.json")
    assert {"rank0.pt", "rank1.pt", "model.pt"} <= set(manifest["files"]) and manifest["world_size"] == 2
    res = ok(torchrun([*common, "--run_dir", str(tmp_path / "run"), "--ckpt_dir", url]))
    assert f"resumed from {url}/step_4 (step 4" in res.stdout
    assert read_json(tmp_path / "run" / "summary.json")["param_sha256"] == read_json(tmp_path / "ref" / "summary.json")["param_sha256"]
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert [n for n in names if not n.startswith(".lease.")] == ["latest", "step_4", "step_8"], names


def test_run_dir_checks_say_where_local_outputs_stay_and_check_a_ckpt_dir_folder(tmp_path, capsys):
    from ddp_kit.boundary.run_dir_checks import prepare_run_dir
    from ddp_kit.errors import UserError
    from ddp_kit.run_folder import RunDir

    lock, run = prepare_run_dir(_alone(), RunDir(tmp_path / "run", "s3://bucket/run"))
    lock.release()
    # the run's identity is made once and kept in its folder: the same on the next start
    assert len(run) == 32 and prepare_run_dir(_alone(), RunDir(tmp_path / "run", "s3://bucket/run"))[1] == run
    out = capsys.readouterr().out
    assert "ddp_kit: checkpoints go to s3://bucket/run (ckpt_dir); metrics.jsonl, summary.json and hang reports stay in" in out
    assert str(tmp_path / "run") in out
    (tmp_path / "plain_file").write_text("x")
    with pytest.raises(UserError) as err:  # a ckpt_dir folder is checked as run_dir is
        prepare_run_dir(_alone(), RunDir(tmp_path / "run2", str(tmp_path / "plain_file" / "ck")))
    assert f"ckpt_dir '{tmp_path / 'plain_file' / 'ck'}' is under a regular file" in err.value.line()


# ---- a bucket (or folder) that names files outside the step --------------------------------------

FORGED_NAMES = ["../../escaped.pt", "../../../../../../../../../../../../tmp/escaped-up.pt", "/tmp/escaped-abs.pt",
                "dcp/../../escaped.pt", "a/b/escaped.pt", "..", "",
                # names a reader's own files would collide with, or the disk cannot hold
                "dcp", "manifest.json", ".lock", ".verified", "model.pt.part", "escaped" * 40 + ".pt"]


def _forge(fs, step_path: str, name: str) -> None:
    """What whoever can write the bucket can do: a manifest that vouches for a file under any name."""
    manifest = json.loads(fs.cat_file(f"{step_path}/manifest.json"))
    data = b"payload"
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    fs.pipe_file(f"{step_path}/manifest.json", json.dumps(manifest).encode())
    if name and not name.startswith("/"):
        fs.pipe_file(f"{step_path}/{name}", data)  # the object itself too, so sizes and checksums agree


@pytest.mark.parametrize("name", FORGED_NAMES)
def test_a_manifest_naming_a_file_outside_the_step_is_invalid_and_nothing_is_written_outside(tmp_path, name, monkeypatch):
    import tempfile
    from pathlib import Path

    from ddp_kit.checkpoint import cli, open_backend

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the node-local cache lives under it
    (tmp_path / "tmp").mkdir()
    (tmp_path / "out").mkdir()
    outside = [Path("/tmp/escaped-abs.pt"), Path("/tmp/escaped-up.pt")]
    for p in outside:
        p.unlink(missing_ok=True)
    url = _url()
    ck = open_backend(url, _alone(), keep_last=0)
    for step in (1, 2):
        _save(ck, step)
    ck.wait()
    _forge(ck.store.fs, ck.store.path("step_2"), name)
    before = {p for p in tmp_path.rglob("*")}
    lines = []
    found = ck.find("auto", warn=lines.append)
    assert found.step == 1, lines  # the forged step is not accepted; the one before it is
    assert len(lines) == 1 and "step_2 is not usable (" in lines[0] and "falling back" in lines[0], lines
    assert "manifest" in lines[0], lines
    cli.export(url, tmp_path / "out" / "model.pt")
    escaped = [p for p in outside if p.exists()] + list(tmp_path.rglob("*escaped*"))
    assert escaped == [], escaped  # not beside the cache, not anywhere up the tree
    new = {p for p in tmp_path.rglob("*") if p not in before}
    assert all(p.is_relative_to(tmp_path / "tmp") or p.is_relative_to(tmp_path / "out") for p in new), new
    ck.close()


@pytest.mark.parametrize("name", ["../escaped.pt", "/etc/hostname"])
def test_a_folder_checkpoint_whose_manifest_names_a_file_outside_is_invalid(tmp_path, name):
    from ddp_kit.checkpoint import open_backend, open_storage, steps

    ck = open_backend(tmp_path / "ck", _alone(), keep_last=0)
    for step in (1, 2):
        _save(ck, step)
    ck.wait()
    step2 = tmp_path / "ck" / "step_2"
    target = (step2 / name) if not name.startswith("/") else None
    if target is not None:
        target.write_bytes(b"payload")
    manifest = json.loads((step2 / "manifest.json").read_text())
    data = target.read_bytes() if target is not None else open(name, "rb").read()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    where = open_storage(step2.parent)
    assert "unsafe manifest" in steps.validate(where, "step_2", where.listing("step_2"), None)[0]
    lines = []
    assert ck.find("auto", warn=lines.append).step == 1 and "unsafe manifest" in lines[0]
    ck.close()


# ---- one writer per location: the lease ------------------------------------------------------------

def _other_job(host="node-b", pid=4242, job_id="other", renewed_ago=0.0, ttl_s=60.0, restart_count=0, launch=None):
    import time

    return {"host": host, "pid": pid, "job_id": job_id, "batch_job_id": None, "generation": 1, "token": "theirs",
            "restart_count": restart_count, "renewed": time.time() - renewed_ago, "ttl_s": ttl_s, "launch": launch}


def test_a_second_job_on_one_url_is_refused_in_one_line_before_it_writes_anything(url):
    from ddp_kit.checkpoint import open_backend
    from ddp_kit.errors import UserError

    first = open_backend(url, _alone(), keep_last=0, lease_ttl_s=1.2)  # renewed every 0.2 s
    _save(first, 1)
    first.wait()
    before = _objects(first)
    # the same command on another machine: another host, its own job id (torchrun's is random per job)
    second = open_backend(url, _alone())
    import ddp_kit.checkpoint.lease as lease
    me = lease.identity("job-b", None)
    with pytest.raises(UserError) as err:
        lease.acquire(second.store, {**me, "host": "node-b"})
    line = err.value.line()
    assert f"checkpoint location {url!r} is in use by another job (host " in line and "pid" in line, line
    assert "give this job its own ckpt_dir" in line and "\n" not in line
    assert _objects(first) == before  # refused before it wrote a thing
    # the first job still commits, and at its end releases the location (marked, not deleted)
    _save(first, 2)
    first.close()
    held, record = lease.newest(second.store)
    assert record.get("released") is True
    assert lease.acquire(second.store, {**me, "host": "node-b"})[0] == held + 1
    second.close()


HERE = "this host's boot and pid namespace"


@pytest.mark.parametrize("holder,renews,taken", [
    (dict(renewed_ago=120.0, ttl_s=2.0), False, True),  # stopped renewing: its record stays as it is for its ttl
    (dict(renewed_ago=0.5, ttl_s=2.0), True, False),  # alive elsewhere: it renews while we watch
    (dict(renewed_ago=0.5, ttl_s=2.0), False, True),  # died elsewhere just now (an evicted pod): its ttl runs out
    (dict(host=HERE, pid=2**22 + 12345, renewed_ago=1.0), False, True),  # a dead process on this host
    (dict(host=HERE, start="1", renewed_ago=1.0), False, True),  # our own pid number, another process (a recreated pod)
    (dict(launch="torchrun 1f2e", renewed_ago=1.0), False, True),  # an earlier attempt of this launch (its token)
    (dict(job_id="mine", restart_count=1, renewed_ago=0.5, ttl_s=2.0), True, False),  # same job id, not earlier: a twin
    # the same rdzv_id with a lower restart count, another launch token: a second job, alive (issue 44)
    (dict(job_id="mine", restart_count=0, renewed_ago=0.5, ttl_s=2.0), True, False),
])
def test_a_lease_whose_holder_is_gone_is_taken_over_and_a_live_one_is_not(holder, renews, taken):
    import threading
    import time

    from ddp_kit.checkpoint import lease, store_fs
    from ddp_kit.errors import UserError

    where = store_fs.open_store(_url())
    me, said = lease.identity("mine", None, restart_count=1, launch="torchrun 1f2e"), []
    if holder.get("host") == HERE:
        record = {**_other_job(), **{k: me[k] for k in ("host", "pid", "boot_id", "pidns", "start")},
                  **{k: v for k, v in holder.items() if k in ("pid", "start")}}
    else:
        record = _other_job(**holder)
    where.fs.pipe_file(where.path(lease.lease_name(1)), json.dumps(record).encode())
    stop = threading.Event()

    def holder_renews():  # what the other job's keeper does
        while not stop.wait(0.2):
            where.fs.pipe_file(where.path(lease.lease_name(1)), json.dumps({**record, "renewed": time.time()}).encode())

    keeper = threading.Thread(target=holder_renews, daemon=True)
    if renews:
        keeper.start()
    try:
        if taken:
            assert lease.acquire(where, me, say=said.append)[0] == 2
            assert lease.newest(where)[1]["pid"] == me["pid"]
            assert not where.fs.exists(where.path(lease.lease_name(1)))
        else:
            with pytest.raises(UserError, match="is in use by another job"):
                lease.acquire(where, me, say=said.append)
    finally:
        stop.set()
    if holder.get("ttl_s"):  # not on this host, renewed lately: watched before the verdict
        assert "waiting up to" in said[0] and "node-b" in said[0], said


def test_two_jobs_racing_for_one_generation_leave_exactly_one_holder():
    from concurrent.futures import ThreadPoolExecutor

    from ddp_kit.checkpoint import lease, store_fs
    from ddp_kit.errors import UserError

    where = store_fs.open_store(_url())

    def try_(i):  # live processes on this host: a loser is refused at once
        try:
            return lease.acquire(where, lease.identity(f"job{i}", None))
        except UserError:
            return None

    with ThreadPoolExecutor(8) as pool:
        won = [g for g in pool.map(try_, range(8)) if g is not None]
    assert [g for g, _ in won] == [1], won


@pytest.mark.parametrize("taker_done", [False, True])
def test_a_job_taken_over_stops_at_its_next_commit_without_writing_it(url, taker_done):
    from ddp_kit.checkpoint import lease, open_backend
    from ddp_kit.errors import UserError

    ck = open_backend(url, _alone(), keep_last=0)
    _save(ck, 1)
    ck.wait()
    # another job took the location after this one stopped renewing (a frozen node), and may even
    # have finished and released it since: this one is still not the holder
    ck.store.fs.pipe_file(ck.store.path(lease.lease_name(ck._lease.generation + 1)),
                          json.dumps({**_other_job(), "released": taker_done}).encode())
    with pytest.raises(UserError) as err:
        _save(ck, 2)
        ck.wait()
    assert "another job took over checkpoint location" in err.value.line() and "node-b" in err.value.line()
    assert ck.latest() == 1 and not [r for r in _objects(ck) if r.startswith("step_2/manifest")]
    ck.close()
    assert ck.store.fs.exists(ck.store.path(lease.lease_name(2)))  # not ours to release


def test_prune_leaves_every_step_above_its_own_latest_alone(url):
    from ddp_kit.checkpoint import open_backend, steps

    ck = open_backend(url, _alone(), keep_last=1)
    for step in (1, 2):
        _save(ck, step)
    ck.wait()
    # another writer's upload in flight above this job's latest, and a complete step above it
    ck.store.fs.pipe_file(ck.store.path("step_9", "model.pt"), b"uploading")
    steps.prune(ck.store, 2, 1)
    assert "step_9/model.pt" in _objects(ck)
    ck.close()


# ---- resume at scale: one download per node, only the shards a rank reads --------------------------

class _Counting:
    """Wraps the real in-memory store, counting each object fetched (get_file) by its name in the step."""

    def __init__(self):
        import fsspec.implementations.memory as memory

        counts: dict = {}

        class Fs(memory.MemoryFileSystem):
            def get_file(self, rpath, lpath, *a, **k):
                name = rpath.split("/step_", 1)[-1].split("/", 1)[-1]  # the file's name inside its step
                counts[name] = counts.get(name, 0) + 1
                return super().get_file(rpath, lpath, *a, **k)

        self.fs, self.counts = Fs(), counts


def _rank(rank: int, world: int):
    """A DistContext for rank `rank` of `world` on this node, without a process group: what load and
    _local use (no collective)."""
    import torch

    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world), torch.device("cpu"), "gloo")


def test_the_ranks_of_a_node_download_each_object_once(tmp_path, monkeypatch):
    import tempfile

    from ddp_kit.checkpoint.backend import Found
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer
    from ddp_kit.checkpoint.store_fs import Store

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    counting = _Counting()
    name = f"node-{uuid.uuid4().hex[:6]}"
    where = Store(counting.fs, f"/{name}/run", f"memory://{name}/run")
    # a step written by 4 ranks: shared files once, a rank file each (rank 0 writes here; the others' by hand)
    ck = ObjectStoreCheckpointer(_alone(), where)
    _save(ck, 3)
    ck.close()
    manifest = json.loads(counting.fs.cat_file(where.path("step_3", "manifest.json")))
    for r in (1, 2, 3):
        body = counting.fs.cat_file(where.path("step_3", "rank0.pt"))
        counting.fs.pipe_file(where.path("step_3", f"rank{r}.pt"), body)
        manifest["files"][f"rank{r}.pt"] = manifest["files"]["rank0.pt"]
    counting.fs.pipe_file(where.path("step_3", "manifest.json"), json.dumps(manifest).encode())
    found = Found(where.url_of("step_3"), 3)
    # rank 1 and rank 2 of one node load: the shared files come once, each its own rank file
    for r in (1, 2):
        rank = ObjectStoreCheckpointer(_rank(r, 4), where)
        shared, own, _ = rank.load(found)
        assert shared["model"]["w"].tolist() == [3.0] * 4 and own is not None
    assert counting.counts == {"model.pt": 1, "train_state.pt": 1, "meta.json": 1, "rank1.pt": 1, "rank2.pt": 1}, counting.counts
    assert sorted(p.name for p in tmp_path.rglob("rank*.pt")) == ["rank1.pt", "rank2.pt"]  # one node-wide copy
    rank.close()
    assert not list(tmp_path.rglob("*.pt"))  # the node's cache goes with the run


def test_a_rank_downloads_only_the_dcp_shards_its_load_plan_reads(tmp_path, monkeypatch, one_rank_group):
    """One rank's sharded state in two DCP files (a writer with two threads, as a rank of a larger job
    holds parts of several); a load of one key fetches the file that holds it, not the other."""
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp

    from ddp_kit.checkpoint import layout
    from ddp_kit.checkpoint.backend import Found
    from ddp_kit.checkpoint.durable import file_digest
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer
    from ddp_kit.checkpoint.store_fs import Store

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    counting = _Counting()
    name = f"dcp-{uuid.uuid4().hex[:6]}"
    where = Store(counting.fs, f"/{name}/run", f"memory://{name}/run")
    ck = ObjectStoreCheckpointer(_alone(), where)
    ck.save(4, {"loop": {"step": 4}}, {"rng": torch.get_rng_state()}, {"strategy": "fsdp"},
            sharded={"model": {"w": torch.full((1000,), 4.0)}})
    ck.close()
    # the same step's dcp/ rewritten by a writer with two threads: two shard files
    local = tmp_path / "written"
    dcp.save({"model": {"w": torch.full((1000,), 4.0), "v": torch.full((1000,), 5.0)}},
             storage_writer=dcp.FileSystemWriter(local, thread_count=2, single_file_per_rank=False))
    manifest = json.loads(counting.fs.cat_file(where.path("step_4", "manifest.json")))
    manifest["files"] = {n: f for n, f in manifest["files"].items() if not n.startswith("dcp/")}
    for f in local.iterdir():
        counting.fs.put_file(str(f), where.path("step_4", "dcp", f.name))
        manifest["files"][layout.dcp_file(f.name)] = file_digest(f)
    counting.fs.pipe_file(where.path("step_4", "manifest.json"), json.dumps(manifest).encode())
    shards = sorted(f.name for f in local.glob("*.distcp"))
    assert len(shards) == 2, shards
    rank = ObjectStoreCheckpointer(_alone(), where)
    found = Found(where.url_of("step_4"), 4)
    assert rank.sharded_keys(found) == {"model.w", "model.v"}
    template = {"model": {"v": torch.zeros(1000)}}
    rank.load_sharded(found, template)
    assert template["model"]["v"].eq(5.0).all()
    fetched = sorted(n for n in counting.counts if n.startswith("dcp/__"))
    assert len(fetched) == 1 and fetched[0][len("dcp/"):] in shards, counting.counts
    assert counting.counts["dcp/.metadata"] == 1
    rank.close()


def test_a_cached_file_is_vouched_for_only_once_its_new_bytes_are_verified(tmp_path, monkeypatch):
    """The node's cache holds step 3 as first saved; the step is saved again (other bytes) and its new
    model.pt then goes missing from the store: the fetch says so, and the old bytes in the cache are
    not vouched for under the new checksum (a later fetch must not trust them)."""
    import shutil
    import tempfile

    from ddp_kit.checkpoint import layout, steps
    from ddp_kit.checkpoint.backend import Found
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = _url()
    ck = ObjectStoreCheckpointer(_alone(), url)
    _save(ck, 3, value=1.0)
    ck.wait()
    found = Found(f"{url}/step_3", 3)
    assert ck.load(found)[0]["model"]["w"].tolist() == [1.0] * 4  # now in the node's cache
    cached = next(tmp_path.rglob("model.pt"))
    left = tmp_path / "left"
    shutil.copytree(cached.parent, left)  # what a killed attempt leaves in the cache
    _save(ck, 3, value=2.0)  # the same step number, other bytes (a resume from an older step)
    ck.wait()
    shutil.rmtree(cached.parent, ignore_errors=True)
    shutil.copytree(left, cached.parent)
    ck.store.fs.rm_file(ck.store.path("step_3", layout.MODEL))
    manifest = steps.read_manifest(ck.store, "step_3")
    said = steps.fetch(ck.store, "step_3", cached.parent, manifest)
    assert said == "model.pt is missing", said
    assert not cached.exists() or steps._read_verified(cached.parent).get("model.pt") != manifest["files"]["model.pt"]["sha256"]
    assert steps.fetch(ck.store, "step_3", cached.parent, manifest) == "model.pt is missing"
    ck.close()


def test_a_store_that_does_not_answer_during_a_download_is_not_a_damaged_step(tmp_path, monkeypatch):
    """A download that times out (or is refused, or throttled) says nothing about the step: fetch raises
    it for the caller's verdict (retryable at resume) instead of calling the step unusable, which would
    send the resume to an older step."""
    import tempfile

    from ddp_kit.checkpoint import steps
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ck = ObjectStoreCheckpointer(_alone(), _url())
    _save(ck, 3, value=1.0)
    ck.wait()
    manifest = steps.read_manifest(ck.store, "step_3")

    def slow(*_):
        raise OSError(110, "Read timed out")  # ETIMEDOUT, as a client reports it

    monkeypatch.setattr(type(ck.store), "get", slow)
    with pytest.raises(OSError, match="timed out"):
        steps.fetch(ck.store, "step_3", tmp_path / "cache" / "step_3", manifest)

    def full(*_):
        raise OSError(28, "No space left on device")  # the local disk: this step is not usable here

    monkeypatch.setattr(type(ck.store), "get", full)
    said = steps.fetch(ck.store, "step_3", tmp_path / "cache" / "step_3", manifest)
    assert said is not None and "cannot be downloaded" in said
    ck.close()


def test_an_exited_holder_whose_torchrun_agent_lives_is_not_taken_at_once():
    """Between two attempts of a torchrun job its workers are gone but its agent lives and will restart them:
    a second job on this host must watch that lease (the restart renews it), not take it at once."""
    import os

    from ddp_kit.checkpoint.lease import _start_time, gone_why, identity

    me = identity(None, None, launch="torchrun other")
    dead = max(int(open("/proc/sys/kernel/pid_max").read()) - 1, 2)  # no process this high on a test machine
    holder = {**identity(None, None, launch="torchrun abc"), "pid": dead, "start": "1"}
    holder.update(parent=os.getpid(), parent_start=_start_time(os.getpid()))  # the agent: alive
    assert gone_why(holder, me) is None
    holder.update(parent=dead, parent_start="1")  # the agent gone too: nothing will restart it
    assert "which has exited" in (gone_why(holder, me) or "")
    plain = {**holder, "launch": "process x", "parent": os.getpid(), "parent_start": _start_time(os.getpid())}
    assert "which has exited" in (gone_why(plain, me) or "")  # a plain process has no restarter


def test_a_resume_whose_download_times_out_is_retryable_not_a_changed_checkpoint(tmp_path, monkeypatch):
    """Loading a chosen step, the store stops answering: one line naming the endpoint, exit 1 (retryable),
    not 'changed while the ranks read it' and not a program error the repeat rule would make final."""
    import tempfile

    from ddp_kit.checkpoint import steps
    from ddp_kit.checkpoint.backend import Found
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer
    from ddp_kit.errors import Unavailable

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = _url()
    ck = ObjectStoreCheckpointer(_alone(), url)
    _save(ck, 3, value=1.0)
    ck.wait()

    def timed_out(*_, **__):
        raise OSError(110, "Read timed out")

    monkeypatch.setattr(steps, "fetch", timed_out)
    with pytest.raises(Unavailable) as err:
        ck.load(Found(f"{url}/step_3", 3))
    assert err.value.exit_code == 1 and "did not answer" in err.value.line()
    ck.close()
