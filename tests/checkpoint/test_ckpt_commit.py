"""The one commit protocol (checkpoint/steps.py) survives a kill between any two writes, on both
storages: a folder (rename) and a file:// URL through fsspec (no rename).

A forked process saves step 2 over a location holding a complete step 1, through the real storage
with one hook: at its k-th write (a stream opened for write, an atomic write, an upload, a rename,
a removal) it logs the write and exits at once (os._exit: no cleanup, no flush, as a kill). For
every k up to the number of writes a whole commit makes, a fresh backend then resumes: it must
find step 1 before the write that commits step 2 (the rename into place, or on a store the
manifest), step 2 from then on, each loading the state that step saved, and a next save and
resume must still work over whatever the kill left."""
import multiprocessing
import os
import tempfile
import threading
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.integration  # forks a process per kill point

KILLED = 77
_PLAN: dict = {"kill_at": None, "done": 0, "log": None}


_ONE_AT_A_TIME = threading.Lock()  # uploads run in threads: the count and the exit are one step


def _write(op: str, what: str) -> None:
    """Called before each write: log it, then die when it is the planned one (holding the lock, so
    that no later write starts; one already under way in another thread may be cut short, as a
    kill does)."""
    with _ONE_AT_A_TIME:
        _PLAN["done"] += 1
        with open(_PLAN["log"], "a") as fh:
            fh.write(f"{op} {what}\n")
        if _PLAN["done"] == _PLAN["kill_at"]:
            os._exit(KILLED)


def _hooked(base):
    """A subclass of a real storage whose every write first passes _write."""

    class Hooked(base):
        def open_write(self, rel):
            _write("write", rel)
            return super().open_write(rel)

        def write_bytes(self, rel, data):
            _write("write", rel)
            return super().write_bytes(rel, data)

        def put(self, local, rel):
            _write("write", rel)
            return super().put(local, rel)

        def remove(self, rels):
            if rels:
                _write("remove", ",".join(rels))
            return super().remove(rels)

        def rename(self, src, dst):
            _write("rename", f"{src}>{dst}")
            return super().rename(src, dst)

        def move_to(self, rel, other, dst):
            _write("move", rel)
            return super().move_to(rel, other, dst)

    return Hooked


def _alone():
    import torch

    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(DistEnv(), torch.device("cpu"), "gloo")


def _save(ck, step):
    import torch

    ck.save(step, {"model": {"w": torch.full((4,), float(step))}, "loop": {"step": step}},
            {"rng": torch.get_rng_state()}, {"strategy": "ddp"})


def _hooked_backend(kind, location):
    """The backend open_backend builds for `location`, on the hooked storage."""
    from ddp_kit.checkpoint.checkpointer import Checkpointer
    from ddp_kit.checkpoint.object_store import ObjectStoreCheckpointer
    from ddp_kit.checkpoint.storage_folder import FolderStorage
    from ddp_kit.checkpoint.store_fs import Store, open_store

    if kind == "folder":
        return Checkpointer(_alone(), _hooked(FolderStorage)(location), keep_last=1)
    where = open_store(location)
    HookedStore = dataclass(frozen=True)(_hooked(Store))
    return ObjectStoreCheckpointer(_alone(), HookedStore(where.fs, where.root, where.url), keep_last=1)


def _child(kind, location, kill_at, log):
    _PLAN.update(kill_at=kill_at, done=0, log=log)
    ck = _hooked_backend(kind, location)
    _save(ck, 2)
    ck.wait()
    ck.close()
    os._exit(0)


def _committed(writes: list[str], can_rename: bool) -> bool:
    """Whether the writes done (all but the last logged, which the kill stopped) include the one that
    makes step 2 complete: its rename into place, or on a storage without rename its manifest."""
    return ("rename .tmp_step_2>step_2" if can_rename else "write step_2/manifest.json") in writes[:-1]


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_kill_between_any_two_writes_of_a_commit_never_loses_or_picks_a_step(tmp_path, monkeypatch, kind):
    from ddp_kit.checkpoint import open_backend, steps

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the object store's node-local staging
    (tmp_path / "tmp").mkdir()
    fork = multiprocessing.get_context("fork")
    total, k, seen = None, 0, []
    while total is None or k < total:
        k += 1
        root = tmp_path / f"k{k}"
        location = str(root) if kind == "folder" else f"file://{root}"
        first = open_backend(location, _alone(), keep_last=1)
        _save(first, 1)
        first.close()
        log = tmp_path / f"k{k}.log"
        log.touch()
        child = fork.Process(target=_child, args=(kind, location, k, str(log)))
        child.start()
        child.join(120)
        writes = log.read_text().splitlines()
        if child.exitcode == 0:  # every write of the commit done: k is past the last one
            total = len(writes)
            assert k == total + 1, (k, writes)
        else:
            assert child.exitcode == KILLED and len(writes) == k, (child.exitcode, writes)
        again = open_backend(location, _alone(), keep_last=1)
        warned = []
        found = again.find("auto", warn=warned.append)
        assert found is not None, (k, writes)  # a complete step is never lost
        committed = _committed(writes, again.storage.can_rename) if child.exitcode != 0 else True
        assert found.step == (2 if committed else 1), (k, writes, warned)
        shared, own, meta = again.load(found)  # and the step chosen is whole: what that step saved
        assert shared["model"]["w"].tolist() == [float(found.step)] * 4 and meta["step"] == found.step and own
        # the next save goes through over whatever the kill left, and resume takes it
        _save(again, 3)
        again.wait()
        assert again.find("auto", warn=pytest.fail).step == 3
        left = sorted({r.split("/")[0] for r in steps.objects(again.storage)})
        assert [n for n in left if not n.startswith(".")] == ["latest", "step_3"], left  # .trash_: deleted in the background
        again.close()
        seen.append((k, found.step, writes[-1] if child.exitcode != 0 else "-"))
    assert total is not None and total >= 6, seen  # four files, `latest`, the manifest at least
    assert [s for _, s, _ in seen][0] == 1 and [s for _, s, _ in seen][-1] == 2, seen
