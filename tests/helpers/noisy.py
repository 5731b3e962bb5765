"""A randomly augmented dataset, and a run that can stop at a step and continue in a new process.

    python noisy.py OUT_DIR TOTAL_STEPS NUM_WORKERS [STOP_STEP [continue] | resume]     (plain, or under torchrun)

Writes OUT_DIR/<tag>_rank<R>.pt: per step, the sample indices, their noise (drawn in the loader's
worker or main process) and one draw from the main process's RNG (standing in for dropout).
With `continue` the run saves its state at STOP_STEP and goes on to TOTAL_STEPS in the same process:
it writes both "stopped" (its first STOP_STEP steps) and "full" (all of them), one launch for two.
"""
import random
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    """Sample i is (i, noise): the noise comes from torch's and Python's global RNGs, as augmentations' does."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return i, torch.cat([torch.rand(2), torch.tensor([random.random()])])


def main(out: Path, total: int, workers: int, stop: str | None, go_on: bool = False) -> None:
    import ddp_kit
    from ddp_kit.checkpoint.checkpointer import rng_state, set_rng_state

    run = ddp_kit.init()
    torch.manual_seed(100 + run.rank)
    random.seed(100 + run.rank)
    loader = run.prepare(DataLoader(Noisy(44), batch_size=8, shuffle=True, num_workers=workers))
    tag, step, records = "full", 0, []
    if stop == "resume":
        state = torch.load(out / f"state_rank{run.rank}.pt", weights_only=False)
        loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        tag, step = "resumed", state["step"]
    elif stop is not None:
        tag = "stopped"
    while step < total:
        for idx, noise in loader:
            records.append((idx, noise, torch.rand(1)))
            step += 1
            if stop not in (None, "resume") and step == int(stop):
                torch.save({"loader": loader.state_dict(), "rng": rng_state(), "step": step}, out / f"state_rank{run.rank}.pt")
                if go_on:
                    torch.save(list(records), out / f"stopped_rank{run.rank}.pt")
                    tag = "full"
                else:
                    total = step
            if step == total:
                break
    torch.save(records, out / f"{tag}_rank{run.rank}.pt")
    run.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None,
         len(sys.argv) > 5 and sys.argv[5] == "continue")
