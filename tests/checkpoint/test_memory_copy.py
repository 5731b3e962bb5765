"""A memory-tier copy's format (memory_copy.py) and the resume choice (memory_tier._choose), in process:
states round-trip exactly, and a forged or damaged copy is refused without anything being unpickled."""
import json
import math
import os
import pickle
import time

import pytest
import torch

from ddp_kit.checkpoint import memory_copy as mc
from ddp_kit.checkpoint.memory_resume import _choose


def write(folder, state, seal=True):
    """A copy of `state` in `folder` the way MemoryTier.save writes one."""
    tree, tensors, nbytes = mc.plan(state)
    folder.mkdir(parents=True, exist_ok=True)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    entries = mc.table(tensors)
    mc.fill(buf, tensors, entries)
    (folder / mc.DATA).write_bytes(buf.numpy().tobytes())
    manifest = {"format": mc.FORMAT, "step": 7, "rank": 0, "world_size": 1, "nbytes": nbytes, "tensors": entries,
                "tree": tree, "sha256": mc.checksum(buf) if seal else None}
    mc.write_manifest(folder, manifest)
    return manifest


def read(folder):
    m = mc.manifest_of(folder)
    return mc.decode(m, mc.read_data(folder, m))


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_round_trip_keeps_types_keys_and_bits(tmp_path):
    opt = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt.zero_grad()
    sum(p.sum() for p in opt.param_groups[0]["params"]).backward()
    opt.step()
    state = {"optimizer": opt.state_dict(),  # int keys, a float step tensor, param_groups of numbers and tuples
             "rng": {"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state()},
             "odd": {"bf16": torch.randn(5, dtype=torch.bfloat16), "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5),
                     "nan": float("nan"), "inf": float("inf"), "flag": True, "none": None, "s": "x"}}
    write(tmp_path / "c", state)
    back = read(tmp_path / "c")
    assert same(state, back)
    # Each tensor is its own copy, not a view of the data buffer (an optimizer keeps what it loads).
    views = [v for v in back["optimizer"]["state"][0].values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    assert views and all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in views)


def test_what_it_cannot_hold_is_named():
    with pytest.raises(mc.NotStorable, match=r"state.sched.fn \(a function\)"):
        mc.plan({"sched": {"fn": lambda: 0}})


def test_a_pickle_in_the_data_file_is_only_bytes(tmp_path):
    """Whatever data.bin holds, it is read as raw bytes into tensors: a pickle there never runs."""
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('executed')",))

    payload = pickle.dumps(Boom())
    folder = tmp_path / "c"
    m = write(folder, {"w": torch.zeros(len(payload), dtype=torch.uint8)})
    forged = payload.ljust(m["nbytes"], b"\0")  # same size, other bytes, and a checksum to match them
    (folder / mc.DATA).write_bytes(forged)
    mc.write_manifest(folder, {**m, "sha256": mc.checksum(torch.frombuffer(bytearray(forged), dtype=torch.uint8))})
    back = mc.decode(m, mc.read_data(folder, mc.manifest_of(folder)))
    assert bytes(back["w"].numpy()) == payload


@pytest.mark.parametrize("damage, why", [
    ("truncate", "truncated"),
    ("flip", "sha256"),
    ("outside", "outside the data file"),
    ("dtype", "malformed tensor entry"),
    ("tree", "malformed node"),
    ("not_json", "unreadable"),
    ("format", "not a ddp_kit memory-tier manifest"),
    ("unsealed", "not sealed"),
    ("linked", "unreadable"),
])
def test_forged_or_damaged_copies_are_refused(tmp_path, damage, why):
    folder = tmp_path / "c"
    m = write(folder, {"a": torch.arange(100, dtype=torch.float32), "b": [torch.ones(3), 1]})
    data = (folder / mc.DATA).read_bytes()
    if damage == "truncate":
        (folder / mc.DATA).write_bytes(data[:-10])
    elif damage == "flip":
        (folder / mc.DATA).write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    elif damage == "outside":
        m["tensors"][0][2] = m["nbytes"]  # offset past the end
        mc.write_manifest(folder, m)
    elif damage == "dtype":
        m["tensors"][0][0] = "object"
        mc.write_manifest(folder, m)
    elif damage == "tree":
        m["tree"] = {"d": [["a", {"exec": "print(1)"}]]}
        mc.write_manifest(folder, m)
    elif damage == "not_json":
        (folder / mc.MANIFEST).write_bytes(pickle.dumps({"step": 1}))
    elif damage == "format":
        mc.write_manifest(folder, {**m, "format": "pickle"})
    elif damage == "unsealed":  # its writer was killed before the checksum: never used, whatever it holds
        mc.write_manifest(folder, {**m, "sha256": None})
    elif damage == "linked":  # a manifest that is a link to another file is not read through
        (tmp_path / "elsewhere.json").write_text(json.dumps(m))
        (folder / mc.MANIFEST).unlink()
        (folder / mc.MANIFEST).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(mc.Unusable, match=why):
        read(folder)


def test_fill_template_copies_into_the_templates_tensors():
    target = torch.zeros(3)
    template = {"m": {"w": target}, "groups": [{"lr": 0.0, "params": ["w"]}]}
    saved = {"m": {"w": torch.tensor([1.0, 2.0, 3.0])}, "groups": [{"lr": 0.5, "params": ["w"]}]}
    out = mc.fill_template(template, saved, lambda dst, src: dst.copy_(src))
    assert out["m"]["w"] is target and target.tolist() == [1.0, 2.0, 3.0] and out["groups"][0]["lr"] == 0.5
    assert mc.flat_keys(saved) == {"m.w", "groups"}


def entry(state_rank, step, node, holder, kind="own"):
    return {"state_rank": state_rank, "step": step, "node": node, "holder": holder, "kind": kind,
            "folder": f"{node}/{kind}-r{state_rank}-{step}", "node_rank": 0 if node == "A" else 1}


def test_choose_takes_the_newest_step_every_rank_has_and_prefers_its_own_node():
    nodes = ["A", "B"]  # rank 0 on node A, rank 1 on node B
    usable = [entry(0, 12, "A", 0), entry(1, 12, "A", 0, "peer"), entry(1, 12, "B", 1),
              entry(0, 15, "A", 0)]  # step 15: only rank 0's copy finished before the kill
    step, sources = _choose(usable, nodes, 2)
    assert step == 12 and [s["node"] for s in sources] == ["A", "B"] and sources[1]["kind"] == "own"
    # Node B lost: rank 1 (on a fresh node B) gets the copy node A holds for it.
    step, sources = _choose([e for e in usable if e["node"] != "B"], nodes, 2)
    assert step == 12 and sources[1]["node"] == "A" and sources[1]["kind"] == "peer"
    assert _choose([entry(0, 12, "A", 0)], nodes, 2) is None  # rank 1's state nowhere: the durable tier
    assert json.dumps(sources)  # what the ranks exchange is plain data


def one_rank():
    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv

    return DistContext(env=DistEnv(), device=torch.device("cpu"), backend="gloo")


def test_a_restarted_process_finds_and_loads_its_copy(tmp_path):
    """One process: save twice, "restart" (a new tier on the same folder), resume the newer copy."""
    from ddp_kit.checkpoint.memory_tier import MemoryTier

    said = []
    w = torch.randn(4, 4)
    tier = MemoryTier(one_rank(), "/ckpt/of/this/job", "run-a", root=tmp_path)
    for step in (3, 6):
        w.add_(1.0)
        tier.save(step, {"shared": {"model": {"w": w}, "loop": {"step": step}}, "per_rank": {"rng": {"n": step}},
                         "sharded": None}, {"strategy": "ddp"}, said.append, later=lambda t: t is w)
    tier.close(clean=False)  # a failed end: the copies stay
    assert len(said) == 1 and "2 copies of" in said[0]
    again = MemoryTier(one_rank(), "/ckpt/of/this/job", "run-a", root=tmp_path)
    found = again.find(after=None, warn=said.append)
    assert found is not None and found.step == 6 and found.tier == "memory"
    shared, own, meta = again.load(found)
    assert torch.equal(shared["model"]["w"], w) and own == {"rng": {"n": 6}} and meta["world_size"] == 1
    assert again.find(after=6, warn=said.append) is None  # not newer than the durable step: the durable tier
    assert MemoryTier(one_rank(), "/another/job", "run-a", root=tmp_path).find(after=None, warn=said.append) is None
    # The same location, another run (its run folder deleted and made anew): never the old run's copies.
    assert MemoryTier(one_rank(), "/ckpt/of/this/job", "run-b", root=tmp_path).find(after=None, warn=said.append) is None
    again.close(clean=True)
    assert not (tmp_path / again.key).exists()


def test_a_copy_of_another_run_or_lineage_is_never_used(tmp_path):
    """A manifest naming another run (copied into this run's folder) is refused by name; two attempts'
    copies of one step are never paired across ranks."""
    from ddp_kit.checkpoint.memory_tier import MemoryTier

    said = []
    tier = MemoryTier(one_rank(), "/ckpt", "run-a", root=tmp_path)
    tier.save(3, {"shared": {"w": torch.ones(2)}}, {}, said.append)
    tier.close(clean=False)
    folder = next((tmp_path / tier.key).glob("own-r0-*"))
    m = mc.manifest_of(folder)
    mc.write_manifest(folder, {**m, "run": "someone-else"})
    again = MemoryTier(one_rank(), "/ckpt", "run-a", root=tmp_path)
    assert again.find(after=None, warn=said.append) is None
    assert any("belongs to another run" in s for s in said), said
    nodes = ["A", "B"]
    mixed = [{**entry(0, 12, "A", 0), "lineage": "attempt-1"}, {**entry(1, 12, "B", 1), "lineage": "attempt-2"},
             {**entry(0, 9, "A", 0), "lineage": "attempt-1"}, {**entry(1, 9, "B", 1), "lineage": "attempt-1"}]
    step, sources = _choose(mixed, nodes, 2)
    assert step == 9 and {s["lineage"] for s in sources} == {"attempt-1"}


def test_a_tier_that_does_not_fit_is_refused_in_one_line(tmp_path, monkeypatch):
    import os

    from ddp_kit.checkpoint.memory_tier import MemoryTier
    from ddp_kit.errors import UserError

    tier = MemoryTier(one_rank(), "/ckpt", "run", root=tmp_path)
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((real.f_bsize, 1, 100, 1, 1) + tuple(real)[5:]))
    with pytest.raises(UserError, match="memory tier needs 0.1 MB per node") as err:
        tier.save(1, {"shared": {"w": torch.zeros(16384)}}, {}, lambda msg: None)
    assert "DDP_KIT_MEM_DIR" in err.value.hint and "\n" not in str(err.value)


def test_a_copy_that_no_longer_fits_is_one_warning_and_the_last_copy_stands(tmp_path, monkeypatch, capsys):
    """The tmpfs full for a moment (other traffic): that copy is lost, said once, and training goes on."""
    from ddp_kit.checkpoint import memory_tier as mt

    tier = mt.MemoryTier(one_rank(), "/ckpt", "run", root=tmp_path)
    state = lambda v: {"shared": {"w": torch.full((4096,), float(v))}}
    tier.save(3, state(3), {}, lambda msg: None)
    monkeypatch.setattr(mt, "_room", lambda folder: 0)
    tier.save(6, state(6), {}, lambda msg: None)
    tier.save(9, state(9), {}, lambda msg: None)
    monkeypatch.undo()
    tier.wait()
    lost = [line for line in capsys.readouterr().out.splitlines() if "lost its copy" in line]
    assert len(lost) == 1 and "step 6" in lost[0] and "less than" in lost[0], lost
    tier.close(clean=False)
    found = mt.MemoryTier(one_rank(), "/ckpt", "run", root=tmp_path).find(after=None, warn=print)
    assert found is not None and found.step == 3


def test_another_jobs_copies_go_only_when_no_process_holds_them_for_a_while(tmp_path):
    """Liveness is a lock (it holds across pid namespaces), and an unheld folder is kept for KEEP_S (a
    job between two attempts); an earlier run's folder at this location goes at once."""
    from ddp_kit.checkpoint import memory_root as mr
    from ddp_kit.checkpoint.memory_tier import MemoryTier

    running = MemoryTier(one_rank(), "/running/job", "r1", root=tmp_path)
    between = MemoryTier(one_rank(), "/restarting/job", "r1", root=tmp_path)
    between.close(clean=False)  # its next attempt has not started yet
    gone = MemoryTier(one_rank(), "/abandoned/job", "r1", root=tmp_path)
    gone.close(clean=False)
    old = time.time() - mr.KEEP_S - 1
    for tier in (running, gone):
        os.utime(tier.dir / mr.ALIVE, (old, old))
    earlier = MemoryTier(one_rank(), "/this/job", "old-run", root=tmp_path)
    earlier.close(clean=False)
    MemoryTier(one_rank(), "/this/job", "new-run", root=tmp_path)
    assert running.dir.exists() and between.dir.exists()
    assert not gone.dir.exists() and not earlier.dir.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
@pytest.mark.parametrize("planted", ["other_owner", "world_writable", "others_link"])
def test_a_root_another_user_can_write_into_is_refused(tmp_path, planted):
    from ddp_kit.checkpoint.memory_tier import MemoryTier
    from ddp_kit.errors import UserError

    root = tmp_path / "shm"
    if planted == "others_link":
        (tmp_path / "theirs").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "theirs")
        os.lchown(root, 65534, 65534)
    else:
        root.mkdir(mode=0o700)
        if planted == "other_owner":
            os.chown(root, 65534, 65534)
        else:
            os.chmod(root, 0o1777)
    with pytest.raises(UserError, match="is not yours alone") as err:
        MemoryTier(one_rank(), "/ckpt", "run", root=root)
    assert "DDP_KIT_MEM_DIR" in err.value.hint


def test_the_default_root_is_private_to_its_user(tmp_path, monkeypatch):
    from ddp_kit.checkpoint import memory_root as mr

    monkeypatch.delenv(mr.ENV_DIR, raising=False)
    assert mr.root_dir().name == f"ddp_kit-{os.geteuid()}"
    root = tmp_path / "fresh"
    mr.make_private(root)
    assert oct(os.stat(root).st_mode & 0o777) == oct(0o700)


def test_a_planted_link_is_replaced_never_written_through(tmp_path):
    """A link where a copy's files go: the write replaces the link, the file it points to is untouched."""
    from ddp_kit.checkpoint.memory_slot import _mapped

    victim = tmp_path / "victim"
    victim.write_text("keep")
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in (mc.MANIFEST, mc.DATA):
        (folder / name).symlink_to(victim)
    mc.write_manifest(folder, {"format": mc.FORMAT})
    _mapped(folder / mc.DATA, 128)
    assert victim.read_text() == "keep"
    assert not (folder / mc.MANIFEST).is_symlink() and not (folder / mc.DATA).is_symlink()


def test_room_counts_a_containers_memory_limit(tmp_path):
    """A pod's tmpfs pages count against its memory limit, which statvfs does not show: the room is the
    smaller of the two (cgroup v2's memory.max less memory.current)."""
    from ddp_kit.checkpoint.memory_slot import _room

    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("1073741824\n")
    (cgroup / "memory.current").write_text("1000000000\n")
    assert _room(tmp_path, cgroup) == 1073741824 - 1000000000
    # 500 MB of it page cache (given back under pressure), 100 MB of that the tmpfs's (shmem: never)
    (cgroup / "memory.stat").write_text("anon 400000000\nfile 500000000\nshmem 100000000\n")
    assert _room(tmp_path, cgroup) == 1073741824 - 1000000000 + 400000000
    (cgroup / "memory.max").write_text("max\n")  # no limit: the tmpfs's own free space
    st = os.statvfs(tmp_path)
    assert abs(_room(tmp_path, cgroup) - st.f_bavail * st.f_frsize) < 1 << 26


def test_a_folder_removed_under_the_job_is_made_again_at_the_next_save(tmp_path, capsys):
    """A cleanup (systemd's RemoveIPC, a hand rm -rf) removes the job's folder while it trains: the save after
    it makes the folder again and copies, instead of failing or "saving" into files that no longer exist."""
    import shutil

    from ddp_kit.checkpoint.memory_tier import MemoryTier

    tier = MemoryTier(one_rank(), "/ckpt", "run", root=tmp_path)
    tier.save(3, {"shared": {"w": torch.ones(8)}}, {}, lambda msg: None)
    tier.wait()
    shutil.rmtree(tier.dir)
    tier.save(6, {"shared": {"w": torch.full((8,), 6.0)}}, {}, lambda msg: None)
    tier.close(clean=False)
    found = MemoryTier(one_rank(), "/ckpt", "run", root=tmp_path).find(after=None, warn=print)
    assert found is not None and found.step == 6, capsys.readouterr().out
