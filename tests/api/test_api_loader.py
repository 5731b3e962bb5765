"""run.train_loader / run.eval_loader: a user's DataLoader is sharded as it samples, or refused in one line; never changed silently."""
import sys

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from conftest import HELPERS, run_cmd, torchrun
from ddp_kit.errors import UserError
from procs import runs_without_group

DS = TensorDataset(torch.arange(40))


def _steps(loaders, epochs=1):
    """Per optimizer step, the samples all ranks loaded (rank 0's then rank 1's), for `epochs` epochs."""
    out = []
    for _ in range(epochs):
        per_rank = [[[int(i) for i in b] for (b,) in ld] for ld in loaders]
        out += [sum((per_rank[r][k] for r in range(len(loaders))), []) for k in range(len(per_rank[0]))]
    return out


def test_sequential_loader_becomes_an_unshuffled_shard():
    steps = _steps([run.train_loader(DataLoader(DS, batch_size=8)) for run in runs_without_group()], epochs=2)
    assert [sorted(s) for s in steps] == [list(range(k * 8, k * 8 + 8)) for k in range(5)] * 2


def test_shuffle_is_seeded_by_the_loaders_generator_else_run_seed():
    def order(seed=0, gen=None, sampler_gen=None):
        ld = (DataLoader(DS, batch_size=8, sampler=RandomSampler(DS, generator=sampler_gen)) if sampler_gen else
              DataLoader(DS, batch_size=8, shuffle=True, generator=gen))
        loaders = [run.train_loader(ld) for run in runs_without_group(seed=seed)]
        return loaders[0].state_dict()["seed"], _steps(loaders, epochs=2)

    seed, steps = order(gen=torch.Generator().manual_seed(7))
    assert seed == 7 and sorted(sum(steps[:5], [])) == list(range(40)) and steps[:5] != steps[5:]  # reshuffled
    assert order(sampler_gen=torch.Generator().manual_seed(7)) == (seed, steps)
    assert order(seed=7) == (7, steps)  # no generator: init(seed=...)
    assert order(seed=0)[1] != steps


def test_subset_random_sampler_shards_the_subset():
    subset = list(range(3, 40, 3))  # 13 indices
    ld = DataLoader(DS, batch_size=4, sampler=SubsetRandomSampler(subset), drop_last=True)
    steps = _steps([run.train_loader(ld) for run in runs_without_group()], epochs=2)
    assert len(steps) == 6 and all(len(s) == len(set(s)) == 4 for s in steps)
    assert all(set(sum(steps[e * 3:e * 3 + 3], [])) <= set(subset) for e in (0, 1))
    assert steps[:3] != steps[3:]


class Mine(Sampler):
    def __iter__(self):
        return iter(range(40))

    def __len__(self):
        return 40


@pytest.mark.parametrize("make,needles", [
    (lambda: DataLoader(DS, batch_size=8, sampler=WeightedRandomSampler([1.0] * 40, 40)), ["WeightedRandomSampler", "by weight, with replacement"]),
    (lambda: DataLoader(DS, batch_size=8, sampler=RandomSampler(DS, replacement=True)), ["RandomSampler(replacement=True)"]),
    (lambda: DataLoader(DS, batch_size=8, sampler=RandomSampler(DS, num_samples=20)), ["RandomSampler(num_samples=20)"]),
    (lambda: DataLoader(DS, batch_size=8, sampler=DistributedSampler(DS, 2, 0)), ["DistributedSampler", "ddp_kit shards it"]),
    (lambda: DataLoader(DS, batch_size=8, sampler=Mine()), ["Mine"]),
    (lambda: DataLoader(DS, batch_sampler=[[0, 1], [2, 3]]), ["batch_sampler"]),
    (lambda: DataLoader(DS, batch_size=None), ["batch_size=None"]),
])
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_refused_in_one_line_with_a_hint(make, needles, kind):
    run = runs_without_group()[0]
    with pytest.raises(UserError) as err:
        (run.train_loader if kind == "train" else run.eval_loader)(make())
    assert err.value.hint and "\n" not in err.value.line()
    for n in needles:
        assert n in err.value.line()


def test_drop_last_false_says_the_tail_is_skipped(capsys):
    rank0, rank1 = runs_without_group()
    rank0.train_loader(DataLoader(DS, batch_size=16))  # 40 = 2 x 16 + 8
    rank1.train_loader(DataLoader(DS, batch_size=16))
    err = capsys.readouterr().err
    assert err.count("ddp_kit: note:") == 1 and "8 of 40 samples" in err  # once, from rank 0
    rank0.train_loader(DataLoader(DS, batch_size=16, drop_last=True))  # asked for: nothing to say
    rank0.train_loader(DataLoader(DS, batch_size=8))  # nothing skipped
    assert capsys.readouterr().err == ""


def _mark_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.marked = True  # the worker's own copy


class Marked(torch.utils.data.Dataset):
    marked = False

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor(self.marked)


@pytest.mark.integration
def test_worker_init_fn_is_kept():
    loader = runs_without_group(1)[0].train_loader(DataLoader(Marked(), batch_size=4, num_workers=1, worker_init_fn=_mark_worker))
    assert all(bool(b.all()) for b in loader)


@pytest.mark.parametrize("sampler", [None, "random", "subset"])
def test_eval_loader_covers_each_sample_once(sampler):
    subset = list(range(0, 40, 3))
    s = {None: None, "random": RandomSampler(DS), "subset": SubsetRandomSampler(subset)}[sampler]
    seen = [int(i) for run in runs_without_group(3) for (b,) in run.eval_loader(DataLoader(DS, batch_size=5, sampler=s)) for i in b]
    assert sorted(seen) == (subset if sampler == "subset" else list(range(40)))


def test_eval_loader_refuses_drop_last():
    with pytest.raises(UserError, match="drop_last=True"):
        runs_without_group()[0].eval_loader(DataLoader(DS, batch_size=16, drop_last=True))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_iterable_dataset_refused_by_the_loaders():
    for kind in ("train", "eval"):
        run = runs_without_group()[0]
        with pytest.raises(UserError, match="unsized IterableDataset"):
            (run.train_loader if kind == "train" else run.eval_loader)(DataLoader(Stream(), batch_size=2))


def _one_line(res, *needles):
    ours = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: error:")]
    assert len(ours) == 1 and "NOT REFUSED" not in res.stdout, res.stderr
    assert "hint:" in ours[0] and all(n in ours[0] for n in needles), ours[0]
    return ours[0]


@pytest.mark.integration
def test_unsized_iterable_dataset_through_the_api_is_one_line():
    res = torchrun([str(HELPERS / "api_refuse.py"), "iterable"])
    _one_line(res, "Stream is an unsized IterableDataset", "get_worker_info()")
    # Each rank exits 2 without a traceback; the only one left is torchrun's own report of the failure.
    assert "exitcode  : 2" in res.stderr and "api_refuse.py\", line" not in res.stderr, res.stderr


@pytest.mark.integration
def test_refused_sampler_in_a_plain_process_is_one_line():
    res = run_cmd([sys.executable, str(HELPERS / "api_refuse.py"), "weighted"])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    _one_line(res, "WeightedRandomSampler")


@pytest.mark.integration
def test_a_prepare_option_given_to_init_is_one_line_for_the_job():
    """ddp_kit.init(strategy=...) as Fabric(strategy=...) would take it: one line from the whole job
    (it was once per rank), pointing to run.prepare."""
    res = torchrun([str(HELPERS / "api_refuse.py"), "init_option"])
    _one_line(res, "strategy", "run.prepare(model, ..., strategy=...)")


@pytest.mark.integration
@pytest.mark.parametrize("case,needle", [("init_twice", "process group already exists"),
                                         ("prepare_twice", "already prepared")])
def test_api_called_twice_is_one_line(case, needle):
    res = run_cmd([sys.executable, str(HELPERS / "api_refuse.py"), case])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    _one_line(res, needle)
