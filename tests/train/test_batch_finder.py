"""`find_batch_size` and the reference job's `--batch_size auto`: the search (in-process, out-of-memory
injected: a CPU has no OOM to run into), and one real 2-rank run where only rank 1 "runs out of memory"
and both ranks train with the same batch, which a resume then reads back without searching."""
import math
import random
import sys
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from torch import nn

from conftest import HELPERS, ok, read_json, run_cmd, torchrun
from ddp_kit.api import AUTO, find_batch_size
from ddp_kit.errors import UserError
from ddp_kit.parallel import batch_finder
from ddp_kit.parallel.batch_finder import is_out_of_memory
from ddp_kit.train.auto_batch import first_samples
from ddp_kit.train.command import AUTO_BATCH_META, refuse_changed_recipe
from ddp_kit.train.config import resolve
from ddp_kit.train.inject import Injector, parse


def _fits_up_to(limit: int, tried: list[int] | None = None):
    def try_batch(size: int) -> None:
        if tried is not None:
            tried.append(size)
        if size > limit:
            raise torch.OutOfMemoryError(f"fake: {size} > {limit}")
    return try_batch


def test_finds_the_exact_largest_size_within_the_bound():
    assert not tdist.is_initialized()  # a single process without a process group: nothing to agree with
    start, cap = 8, 1000
    bound = math.ceil(math.log2(cap / start)) + 1 + math.ceil(math.log2(cap))  # growth, then bisection
    for limit in [*range(1, 70), 127, 128, 129, 511, 512, 999]:
        tried: list[int] = []
        found = find_batch_size(_fits_up_to(limit, tried), start=start, cap=cap)
        assert found.batch == limit and found.exact and not found.capped, (limit, tried)
        assert len(tried) == len(found.trials) <= bound
        assert len(set(tried)) == len(tried)  # no size is tried twice
        assert all(fit == (size <= limit) for size, fit in found.trials)


def test_stops_at_the_cap_when_memory_is_not_the_limit():
    found = find_batch_size(_fits_up_to(10**9), start=3, cap=100)
    assert found.batch == 100 and found.capped and found.exact
    assert [s for s, _ in found.trials] == [3, 6, 12, 24, 48, 96, 100]


def test_the_trial_count_is_bounded():
    tried: list[int] = []
    found = find_batch_size(_fits_up_to(700, tried), start=1, cap=4096, max_trials=5)
    assert len(tried) == 5 and not found.exact
    assert found.batch == 16  # 1, 2, 4, 8, 16: the largest that fit when the trials ran out


def test_nothing_fits_is_one_line():
    with pytest.raises(UserError, match=r"no per-rank batch fits in memory: even 1 ran out \(rank 0 first\)") as err:
        find_batch_size(_fits_up_to(0), start=4, cap=64)
    assert err.value.hint and err.value.verdict


def test_other_errors_are_not_out_of_memory():
    def broken(size: int) -> None:
        raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug"):
        find_batch_size(broken, start=2, cap=8)
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."))
    # torch's words for a failed allocation inside cuBLAS and cuDNN (8, and 9's two kinds)
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    for status in ("ALLOC_FAILED", "INTERNAL_ERROR_HOST_ALLOCATION_FAILED", "INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"):
        assert is_out_of_memory(RuntimeError(f"cuDNN error: CUDNN_STATUS_{status}"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _beside_a_peer(monkeypatch, peer_fails_above: int | None, reduced: list[list[int]]) -> None:
    """This process as rank 0 of 2, the all-reduce a stand-in (no second process in a unit test): rank 1 fits
    every size, or fails with a non-OOM error at sizes above `peer_fails_above`."""
    monkeypatch.setattr(batch_finder, "_place", lambda group: (2, 0))

    def max_over_ranks(values: list[int], group) -> list[int]:
        reduced.append(values)
        size = values[1]
        peer = [0, size, -size, 1 if peer_fails_above is not None and size > peer_fails_above else 0]
        return [max(a, b) for a, b in zip(values, peer)]
    monkeypatch.setattr(batch_finder, "_max_over_ranks", max_over_ranks)


def test_an_error_on_another_rank_stops_this_one_at_the_same_trial(monkeypatch):
    reduced: list[list[int]] = []
    _beside_a_peer(monkeypatch, 8, reduced)
    model = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError) as err:
        find_batch_size(_fits_up_to(10**9), start=4, cap=64, model=model)
    assert "rank 1 failed during the batch-size search" in err.value.message and "16" in err.value.message
    assert "\n" not in err.value.line() and [v[1] for v in reduced] == [4, 8, 16]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_error_here_waits_for_the_agreement_then_is_raised_as_itself(monkeypatch):
    # raised at once, it left the other ranks in the all-reduce until the collective timeout
    reduced: list[list[int]] = []
    _beside_a_peer(monkeypatch, None, reduced)

    def broken(size: int) -> None:
        if size > 8:
            raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug"):
        find_batch_size(broken, start=4, cap=64)
    assert [v[1] for v in reduced] == [4, 8, 16] and reduced[-1][3] == 2  # rank 0's failure, told to the others


def test_what_a_trial_held_is_released_before_the_next():
    held: list[weakref.ref] = []
    alive_at_start: list[bool] = []

    def try_batch(size: int) -> None:
        alive_at_start.append(any(r() is not None for r in held))
        activations = torch.ones(size, 16)
        held.append(weakref.ref(activations))
        if size > 20:
            raise torch.OutOfMemoryError("fake")

    assert find_batch_size(try_batch, start=4, cap=64).batch == 20
    assert not any(alive_at_start)  # not the previous trial's tensors (a traceback's frames hold them)


def test_model_optimizer_and_rng_come_back_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states: list[bool] = []

    def try_batch(size: int) -> None:
        states.append(all(optimizer.state.get(p) for p in model.parameters()))  # Adam's moments in memory
        model(torch.randn(size, 4)).square().mean().backward()
        optimizer.step()
        if size > 12:
            raise torch.OutOfMemoryError("fake")

    rng = torch.get_rng_state()
    assert find_batch_size(try_batch, start=2, cap=32, model=model, optimizer=optimizer).batch == 12
    assert all(states)  # from the first trial on, as in every training step but the first
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights and BatchNorm's running statistics
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert not optimizer.state  # a new optimizer stays new: its first real step is step 1


class _RandomlyTransformed(torch.utils.data.Dataset):
    """A dataset whose transform draws from torch's, Python's and numpy's RNG, as augmentations do."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i)) + torch.rand(3) + random.random() + float(np.random.rand())


def test_the_first_samples_are_drawn_without_moving_any_rng():
    # The loader's iterator took its base seed from torch's generator (and a transform draws from all three):
    # a run with --batch_size auto then drew other numbers than a run given the batch found
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    batch = first_samples(_RandomlyTransformed(), 4, torch.device("cpu"))
    assert batch.shape == (4, 3)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="start <= cap"):
        find_batch_size(_fits_up_to(8), start=16, cap=8)


def test_injected_oom_is_per_rank_and_above_a_size():
    (fault,) = parse("oom:rank=1:above=24")
    assert fault.kind == "oom" and fault.rank == 1 and fault.above == 24
    rank1 = Injector((fault,), rank=1, armed=True)
    rank1.batch_trial(24)
    with pytest.raises(torch.OutOfMemoryError, match="rank 1 runs out of memory at a per-rank batch of 25"):
        rank1.batch_trial(25)
    Injector((fault,), rank=0, armed=True).batch_trial(10**6)  # another rank's fault
    rank1.at_step(1)  # not a step fault: nothing happens at its (default) step


def test_config_accepts_auto_and_refuses_it_where_it_cannot_search():
    assert resolve(None, {"batch_size": "auto"}).batch_size == AUTO
    with pytest.raises(UserError, match="'batch_size' must be at least 1"):
        resolve(None, {"batch_size": 0})
    with pytest.raises(UserError, match="batch_size auto cannot search under --strategy fsdp"):
        resolve(None, {"batch_size": "auto", "strategy": "fsdp"})


def test_a_resume_that_settled_on_another_batch_is_refused():
    cfg = resolve(None, {"batch_size": "auto"})
    meta = {"config": cfg.to_dict(), "path": "run/checkpoints/step_6", AUTO_BATCH_META: {"global_batch": 48}}
    check = refuse_changed_recipe(cfg, {"global_batch": 48})
    assert check(meta) is None
    with pytest.raises(UserError, match="trained with a global batch of 48 .* settled on 32"):
        refuse_changed_recipe(cfg, {"global_batch": 32})(meta)


@pytest.mark.integration
def test_two_ranks_agree_train_and_a_resume_reads_the_record(tmp_path):
    """Rank 1 runs out of memory above 24 per rank, rank 0 never: both train with 24 per rank (global
    48), and the run folder records it; a resume keeps it."""
    job = [str(HELPERS / "job.py"), str(tmp_path), "--batch_size", "auto", "--ckpt_every", "3", "--log_every", "3",
           "--eval_every_epoch", "false"]
    first = ok(torchrun([*job, "--max_steps", "6", "--inject", "oom:rank=1:above=24"]))
    lines = [line for line in first.stdout.splitlines() if "batch_size auto:" in line]
    assert len(lines) == 1 and "per-rank 24 x 2 rank(s) x 1 accum = global batch 48" in lines[0], first.stdout
    assert "25 ran out of memory (rank 1 first)" in lines[0] and "lr 3.00e-03 as given" in lines[0]
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in range(2)]
    assert [(s["batch_size"], s["per_rank_batch"], s["steps"]) for s in ranks] == [(48, 24, 6)] * 2
    assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]
    record = read_json(tmp_path / "run" / "batch_size.json")
    assert (record["global_batch"], record["per_rank_batch"], record["world_size"]) == (48, 24, 2)
    assert record["trials"][:2] == [[8, True], [16, True]] and [25, False] in record["trials"]

    # The resume, on 1 rank (the cheaper launch) with a fault that would find 8: the global batch is the
    # recipe and stays 48; the per-rank batch is what 48 is on this world size.
    again = ok(run_cmd([sys.executable, *job, "--max_steps", "9", "--inject", "oom:rank=0:above=8"]))
    assert "global batch 48 as recorded in" in again.stdout and "not searched again" in again.stdout, again.stdout
    assert "trials in" not in again.stdout
    resumed = read_json(tmp_path / "rank0.json")
    assert (resumed["batch_size"], resumed["per_rank_batch"], resumed["resumed_from_step"], resumed["steps"]) == \
        (48, 48, 6, 9)
