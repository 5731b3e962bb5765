"""The checkpoint backend seam and the layout names, in this process (no launcher, world size 1)."""
import pytest


def _alone():
    import torch

    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(DistEnv(), torch.device("cpu"), "gloo")


def test_layout_step_names_round_trip():
    from ddp_kit.checkpoint import layout

    for step in (0, 1, 7, 10, 123456789):
        assert layout.step_of(layout.step_name(step)) == step
    assert layout.step_name(12) == "step_12"  # the names on disk never change
    for name in ("step_", "step_1a", "step_-1", "step_\u00b2", "latest", "Step_3", ".tmp_step_3", "step_3.tmp"):
        assert layout.step_of(name) is None, name
    assert (layout.tmp_name(4), layout.trash_name(4), layout.rank_file(2)) == (".tmp_step_4", ".trash_step_4", "rank2.pt")
    assert (layout.MANIFEST, layout.META, layout.MODEL, layout.TRAIN_STATE, layout.LATEST) == \
        ("manifest.json", "meta.json", "model.pt", "train_state.pt", "latest")
    assert layout.dcp_file(".metadata") == "dcp/.metadata"


def test_open_backend_takes_a_plain_path_as_a_folder_and_a_file_url_as_a_store(tmp_path):
    from ddp_kit.checkpoint import BACKENDS, CheckpointBackend, Checkpointer, open_backend
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer

    assert {"", "file", "s3", "gs", "az", "memory"} <= set(BACKENDS)
    for location in (tmp_path, str(tmp_path)):
        ck = open_backend(location, _alone(), keep_last=2)
        assert isinstance(ck, Checkpointer) and not isinstance(ck, ObjectStoreCheckpointer) and isinstance(ck, CheckpointBackend)
        assert ck.root == tmp_path and ck.keep_last == 2
    # file:// takes the object store's code path (no rename), so that it is testable without a server
    for location in (f"file://{tmp_path}/ck", f"FILE://localhost{tmp_path}/ck/"):
        ck = open_backend(location, _alone(), keep_last=2, upload_timeout_s=60)
        assert isinstance(ck, ObjectStoreCheckpointer) and isinstance(ck, CheckpointBackend)
        assert ck.store.root == f"{tmp_path}/ck" and ck.keep_last == 2 and ck.upload_timeout_s == 60
        assert ck.find("auto", warn=print) is None  # the first collective call probes the store
        ck.close()
    left = [p.name for p in (tmp_path / "ck").iterdir()]
    assert all(n.startswith(".lease.") for n in left), left  # the startup probe is deleted again; the lease stays, released


@pytest.mark.parametrize("location,said", [
    ("ftpx://bucket/run", "unknown checkpoint location scheme 'ftpx' in 'ftpx://bucket/run'"),
    ("file://elsewhere/run", "names the host 'elsewhere'"),
    ("s3:///run", "names no bucket"),
])
def test_open_backend_refuses_what_it_cannot_store_to_in_one_line(location, said):
    from ddp_kit.checkpoint import open_backend
    from ddp_kit.errors import UserError

    with pytest.raises(UserError) as err:  # at open, or (a store) at the first collective call, before step 1
        open_backend(location, _alone()).find("auto", warn=print)
    line = err.value.line()
    assert said in line and "(hint: " in line and "\n" not in line


def test_a_backend_saves_finds_prunes_and_archives_through_the_interface(tmp_path):
    import torch

    from ddp_kit.checkpoint import open_backend

    root, ctx = tmp_path / "checkpoints", _alone()
    ck = open_backend(root, ctx, keep_last=2)
    assert ck.latest() is None and ck.latest_name() == "none yet" and ck.find("auto", warn=print) is None
    for step in (1, 2, 3):
        ck.save(step, {"model": {"w": torch.full((2,), float(step))}, "loop": {"step": step}},
                {"rng": torch.get_rng_state()}, {"strategy": "ddp"})
    ck.wait()
    # keep_last, on disk as ever (a pruned step is renamed to .trash_step_<N>, then deleted in the background)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_2", "step_3"]
    assert (root / "latest").read_text().strip() == "step_3" and (root / "step_3" / "manifest.json").is_file()
    found = ck.find("auto", warn=print)
    assert (found.step, ck.latest(), ck.owns(found)) == (3, 3, True)
    shared, own, meta = ck.load(found)
    assert shared["model"]["w"].tolist() == [3.0, 3.0] and "rng" in own and meta["step"] == 3
    assert ck.archive(2, tmp_path / "archive") == [3]  # a resume from step 2 abandons step 3
    assert ck.latest() == 2 and [p.name for p in (tmp_path / "archive").iterdir()][0][:2] == "20"
    other = open_backend(tmp_path / "elsewhere", ctx)
    assert not other.owns(found)
    ck.close()
