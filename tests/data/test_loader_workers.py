"""Loader workers (num_workers > 0): their RNG resumes exactly, and a stop signal does not kill them before the rank saves."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import HELPERS, ROOT, ok, proc_env, torchrun
from ddp_kit.data import TrainLoader
from helpers.noisy import Noisy
from procs import ARGS, wait_step


def _batches(loader, epochs=2):
    return [b for _ in range(epochs) for b in loader]


@pytest.mark.integration
def test_augmentation_does_not_depend_on_the_number_of_workers():
    """Each batch is loaded under its own seed: which worker loads it (and what it loaded before) does not matter."""
    def run(workers):
        return _batches(TrainLoader(Noisy(40), global_batch=8, world_size=2, rank=1, seed=3, num_workers=workers))

    one, two = run(1), run(2)
    assert len(one) == 10 and all(torch.equal(a, b) for x, y in zip(one, two) for a, b in zip(x, y))
    assert not torch.equal(one[0][1], one[5][1][:len(one[0][1])])  # and it is noise: epochs differ


def test_loading_without_workers_leaves_the_main_rng_alone():
    """DataLoader draws its workers' base seed from the global RNG at every iter() unless given a generator;
    that draw would shift the model's stream (dropout) and differently on a resume, which calls iter() mid-epoch."""
    torch.manual_seed(0)
    want = torch.rand(1)
    torch.manual_seed(0)
    _batches(TrainLoader(TensorDataset(torch.arange(40)), global_batch=8, world_size=1, rank=0))
    assert torch.equal(torch.rand(1), want)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = open(f"/proc/{pid}/status").read() if os.path.exists(f"/proc/{pid}/status") else ""
    return "State:\tZ" not in status


@pytest.mark.integration
@pytest.mark.parametrize("parallel_before", [False, True])
def test_worker_ignores_stop_signals_except_from_its_rank(parallel_before):
    """parallel_before: the rank computed on 2 intra-op threads before the fork, as a training rank
    has, so the worker starts a thread of torch's before worker_init_fn runs (it once took the
    signal there, and torch's handler ended the worker)."""
    if parallel_before:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        (x @ x).sum()
        torch.set_num_threads(threads)
    loader = TrainLoader(TensorDataset(torch.arange(40)), global_batch=8, world_size=1, rank=0, num_workers=1)
    it = iter(loader)
    next(it)
    (worker,) = loader._loader._iterator._workers
    for sig in ("TERM", "INT", "USR2"):  # sent by another process, as torchrun's killpg or SLURM's signal would be
        subprocess.run(["kill", f"-{sig}", str(worker.pid)], check=True)
    time.sleep(0.5)
    assert _alive(worker.pid) and len(list(it)) == 4  # and it still serves the epoch
    os.kill(worker.pid, signal.SIGTERM)  # from the rank: DataLoader's way to end a stuck worker still works
    worker.join(timeout=10)
    assert worker.exitcode == 0


@pytest.mark.integration
def test_sigterm_to_process_group_with_workers_still_checkpoints(tmp_path):
    """torchrun signals each rank's whole process group, loader workers included: the rank must still save."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *ARGS,
           "--num_workers", "2", "--run_dir", str(run_dir), "--inject", "slow:rank=0:step=1:ms=100"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        wait_step(run_dir, 10, p, timeout=120)
        os.killpg(p.pid, signal.SIGTERM)  # the group of the process we started (torchrun leads it)
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "killed by signal" not in err, err[-3000:]
    assert "preempted by SIGTERM" in err and "exiting with 75" in err, err[-3000:]
    saved = sorted(int(d.name[5:]) for d in (run_dir / "checkpoints").glob("step_*"))
    assert saved and saved[-1] >= 10, saved


def _records(path):
    return torch.load(path, weights_only=False)


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_augmentation_is_bit_identical(tmp_path, workers):
    """Stop mid-epoch, save loader state + RNG, continue in a new process: the same batches and noise as one run."""
    script = str(HELPERS / "noisy.py")
    total, stop = 12, 7  # 5 steps per epoch (44 samples, global batch 8): the stop falls inside epoch 1
    # One launch runs all 12 steps and saves its state at step 7 on the way ("full" and "stopped"), so
    # saving must not disturb the steps after it either; the resume is a new process.
    ok(torchrun([script, str(tmp_path), str(total), str(workers), str(stop), "continue"]))
    ok(torchrun([script, str(tmp_path), str(total), str(workers), "resume"]))
    for r in range(2):
        full = _records(tmp_path / f"full_rank{r}.pt")
        pieced = _records(tmp_path / f"stopped_rank{r}.pt") + _records(tmp_path / f"resumed_rank{r}.pt")
        assert len(full) == len(pieced) == total
        for k, (a, b) in enumerate(zip(full, pieced)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {r} step {k}: {a} != {b}"


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # torch's, at construction: none are started
def test_automatic_workers_fit_the_data_and_the_users_count_is_kept():
    """The reference job's automatic count (8 on a GPU node with CPUs to spare; the GPU stands in as a
    device type only) starts none for an in-memory TensorDataset and never more than an epoch's batches;
    a count set on the user's own DataLoader is kept as set."""
    from torch.utils.data import DataLoader

    from ddp_kit.dist.resources import loader_workers
    from ddp_kit.env import DistEnv
    from procs import runs_without_group

    auto = loader_workers(DistEnv(), torch.device("cuda"), cpus_visible=64)
    assert auto == 8
    run = runs_without_group(world=2)[0]

    def workers(dataset, batch, count):  # the workers each loader would start (none is iterated here)
        train = run.train_loader(DataLoader(dataset, batch_size=batch, num_workers=count, drop_last=True))
        ev = run.eval_loader(DataLoader(dataset, batch_size=batch, num_workers=count))
        return train._loader.num_workers, ev._loader.num_workers

    assert workers(TensorDataset(torch.arange(400)), 8, auto) == (0, 0)
    assert workers(Noisy(40), 8, auto) == (5, 3)  # 5 steps an epoch; this rank's 20 eval samples: 3 batches of 8
    assert workers(Noisy(4000), 8, auto) == (8, 8)
    assert workers(TensorDataset(torch.arange(400)), 8, 2) == (2, 2)  # the user's own choice
    assert workers(Noisy(40), 8, 8) == (8, 8)

