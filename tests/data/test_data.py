"""Sharding: disjoint per-rank shards covering each global batch, reshuffle per epoch, exact eval, resumable position."""
import json

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import HELPERS, ok, torchrun
from ddp_kit.data import EvalSampler, TrainLoader, per_rank_batch
from ddp_kit.errors import UserError


def _epoch(loader):
    return [[int(i) for i in b] for (b,) in loader]


def _loaders(n, batch, world, accum=1, seed=0):
    ds = TensorDataset(torch.arange(n))
    return [TrainLoader(ds, global_batch=batch, world_size=world, rank=r, grad_accum=accum, seed=seed) for r in range(world)]


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_global_batches_do_not_depend_on_world_size(world, accum):
    """Step k's union over ranks and micro-steps is the same set of samples on any world size."""
    ref = [set(b) for b in _epoch(_loaders(103, 8, 1)[0])]
    per_rank = [_epoch(ld) for ld in _loaders(103, 8, world, accum)]
    steps = len(per_rank[0]) // accum
    assert steps == len(ref) == 103 // 8
    for k in range(steps):
        got = [i for r in range(world) for mb in per_rank[r][k * accum:(k + 1) * accum] for i in mb]
        assert len(got) == len(set(got)) == 8  # disjoint shards
        assert set(got) == ref[k]


def test_reshuffles_each_epoch_and_is_seeded():
    ld = _loaders(64, 8, 1)[0]
    e0, e1 = _epoch(ld), _epoch(ld)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(64))
    assert _epoch(_loaders(64, 8, 1, seed=0)[0]) == e0
    assert _epoch(_loaders(64, 8, 1, seed=1)[0]) != e0


def test_position_resumes_mid_epoch_on_other_world_size():
    full = _loaders(100, 10, 2)
    first = [_epoch(ld) for ld in full]
    # Stop one rank-pair after 3 steps, carry the state to a 1-rank loader.
    src = _loaders(100, 10, 2)
    its = [iter(ld) for ld in src]
    for _ in range(3):
        for it in its:
            next(it)
    state = src[0].state_dict()
    assert state["position"] == 30
    dst = _loaders(100, 10, 1)[0]
    assert dst.load_state_dict(state) is None
    rest = _epoch(dst)
    want = [sorted(first[0][k] + first[1][k]) for k in range(3, 10)]
    assert [sorted(b) for b in rest] == want


def test_position_that_cannot_continue_says_so():
    ld = _loaders(100, 12, 1)[0]
    note = ld.load_state_dict({"epoch": 1, "position": 30, "global_batch": 10, "seed": 0})
    assert note and "restarting epoch 1" in note and ld.position == 0


def test_eval_sampler_exact_on_uneven_sizes():
    for n in (0, 1, 7, 10, 361):
        for world in (1, 2, 3, 4):
            seen = [i for r in range(world) for i in EvalSampler(n, world, r)]
            assert sorted(seen) == list(range(n))


def test_per_rank_batch_refuses_uneven():
    assert per_rank_batch(64, 2, 2) == 16
    with pytest.raises(UserError, match="does not divide"):
        per_rank_batch(30, 4)


@pytest.mark.integration
def test_shards_with_two_real_processes(tmp_path):
    ok(torchrun([str(HELPERS / "shards.py"), str(tmp_path), "101", "37", "10"]))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for e in range(2):
        a, b = ranks[0]["epochs"][e], ranks[1]["epochs"][e]
        assert not set(a) & set(b) and len(a) == len(b) == 50  # disjoint, 10 whole global batches of 10
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # reshuffled
    ev = ranks[0]["eval"] + ranks[1]["eval"]
    assert sorted(ev) == list(range(37)) and ranks[0]["eval_count"] == 37  # exact: no padded duplicates


def test_a_peek_does_not_consume_a_batch():
    """`b_sz = len(next(iter(loader))[0])` at the top of an epoch (the DDP tutorial's Trainer): the
    epoch still yields every batch, also after a mid-epoch resume, so resumed runs stay identical."""
    plain = _epoch(_loaders(100, 10, 1)[0])
    ld = _loaders(100, 10, 1)[0]
    next(iter(ld))
    assert _epoch(ld) == plain and ld.epoch == 1 and ld.position == 0
    mid = _loaders(100, 10, 1)[0]
    it = iter(mid)
    for _ in range(4):
        next(it)
    state = mid.state_dict()  # after 4 batches taken
    again = _loaders(100, 10, 1)[0]
    again.load_state_dict(state)
    next(iter(again))  # the resumed epoch peeks too
    assert _epoch(again) == plain[4:]


def test_device_resident_batches_equal_the_dataloaders_and_resume_alike():
    """device_data indexes the TensorDataset where it lives (here the CPU; on a GPU the device), and a
    plain TensorDataset on the CPU is indexed so unasked: every micro-batch equals the collated one
    (a subclass's, which goes through the DataLoader), over epochs and after a mid-epoch resume on
    another world size."""
    data = TensorDataset(torch.randn(100, 3), torch.arange(100))
    collated = type("Collated", (TensorDataset,), {})(*data.tensors)  # may load its own way: collated

    def batches(resident, world=2, rank=1, state=None, n=30):
        loader = TrainLoader(data if resident else collated, global_batch=8, world_size=world, rank=rank,
                             grad_accum=2, seed=5, resident=torch.device("cpu") if resident == "device" else None)
        assert (loader._tensors is not None) == bool(resident)
        if state:
            loader.load_state_dict(state)
        out = []
        while len(out) < n:
            out.extend(loader)
        return out[:n], loader.state_dict()

    plain, state = batches(False, n=7)
    for resident in ("device", "unasked"):
        kept, state_r = batches(resident, n=7)
        assert state == state_r and isinstance(kept[0], list)
        assert all(torch.equal(a, b) for p, k in zip(plain, kept) for a, b in zip(p, k))
    plain, _ = batches(False, world=1, rank=0, state=state)
    for resident in ("device", "unasked"):
        kept, _ = batches(resident, world=1, rank=0, state=state)
        assert all(torch.equal(a, b) for p, k in zip(plain, kept) for a, b in zip(p, k))
    with pytest.raises(UserError, match="device_data keeps a TensorDataset"):
        TrainLoader(list(range(10)), global_batch=2, world_size=1, rank=0, resident=torch.device("cpu"))


def test_only_a_plain_cpu_tensordataset_loaded_as_collated_is_indexed_unasked():
    data = TensorDataset(torch.randn(16, 3), torch.arange(16))

    def indexed(**kw):
        return TrainLoader(kw.pop("dataset", data), global_batch=4, world_size=1, rank=0, **kw)._tensors is not None

    assert indexed() and indexed(collate_fn=torch.utils.data.default_collate)
    assert not indexed(pin_memory=True)  # a GPU run's batches: pinned by the DataLoader
    assert not indexed(collate_fn=lambda rows: rows)
    assert not indexed(dataset=list(zip(*data.tensors)))
