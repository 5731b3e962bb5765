"""A memory-tier copy's format (memory_copy.py) and the resume choice (memory_tier._choose), in process:
states round-trip exactly, and a forged or damaged copy is refused without anything being unpickled."""
import json
import math
import os
import pickle

import pytest
import torch

from ddp_kit.checkpoint import memory_copy as mc
from ddp_kit.checkpoint.memory_tier import _choose


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
    m = write(folder, {"w": torch.zeros(len(payload), dtype=torch.uint8)}, seal=False)
    (folder / mc.DATA).write_bytes(payload.ljust(m["nbytes"], b"\0"))  # same size, other bytes: unsealed, so it reads
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
    tier = MemoryTier(one_rank(), "/ckpt/of/this/job", root=tmp_path)
    for step in (3, 6):
        w.add_(1.0)
        tier.save(step, {"shared": {"model": {"w": w}, "loop": {"step": step}}, "per_rank": {"rng": {"n": step}},
                         "sharded": None}, {"strategy": "ddp"}, said.append, later=lambda t: t is w)
    tier.close(clean=False)  # a failed end: the copies stay
    assert len(said) == 1 and "2 copies of" in said[0]
    again = MemoryTier(one_rank(), "/ckpt/of/this/job", root=tmp_path)
    found = again.find(after=None, warn=said.append)
    assert found is not None and found.step == 6 and found.tier == "memory"
    shared, own, meta = again.load(found)
    assert torch.equal(shared["model"]["w"], w) and own == {"rng": {"n": 6}} and meta["world_size"] == 1
    assert again.find(after=6, warn=said.append) is None  # not newer than the durable step: the durable tier
    assert MemoryTier(one_rank(), "/another/job", root=tmp_path).find(after=None, warn=said.append) is None
    again.close(clean=True)
    assert not (tmp_path / again.key).exists()


def test_a_tier_that_does_not_fit_is_refused_in_one_line(tmp_path, monkeypatch):
    import os

    from ddp_kit.checkpoint.memory_tier import MemoryTier
    from ddp_kit.errors import UserError

    tier = MemoryTier(one_rank(), "/ckpt", root=tmp_path)
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((real.f_bsize, 1, 100, 1, 1) + tuple(real)[5:]))
    with pytest.raises(UserError, match="memory tier needs 0.1 MB per node") as err:
        tier.save(1, {"shared": {"w": torch.zeros(16384)}}, {}, lambda msg: None)
    assert "DDP_KIT_MEM_DIR" in err.value.hint and "\n" not in str(err.value)


def test_another_jobs_copies_go_when_no_live_process_owns_them(tmp_path):
    from ddp_kit.checkpoint.memory_tier import MemoryTier

    dead = max(int(open("/proc/sys/kernel/pid_max").read()) - 1, 2)  # no process this high on a test machine
    abandoned, running = tmp_path / "abandoned", tmp_path / "running"
    for folder, pid in ((abandoned, dead), (running, os.getpid())):
        (folder / "own-r0-s0").mkdir(parents=True)
        (folder / f"owner.{pid}").touch()
    MemoryTier(one_rank(), "/this/job", root=tmp_path)
    assert not abandoned.exists() and running.exists()
