"""The loader `run.eval_loader` returns: each batch a heartbeat, and the prepared DDP models' buffers
made to agree before the first batch, so that an eval sees (and a checkpoint saves) one model."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from ..errors import UserError
from ..parallel.ddp import ddp_local_forward, sync_ddp_buffers
from ..reliability.sync_checks import in_main_only


class EvalLoader:
    """A DataLoader whose every batch is a heartbeat (long evals are progress too), and before whose
    first batch every prepared DDP model takes rank 0's buffers: the evaluated model is the one a
    checkpoint saves, the same on every rank, and its forwards start no collective (a rank with an
    empty shard may call none). Else the same loader. Every rank iterates it, empty shard or not."""

    def __init__(self, loader: DataLoader[Any], beat: Callable[[], None], models: list[nn.Module],
                 done: Callable[[float], None] | None = None):
        self._loader, self._beat, self._models, self._done = loader, beat, models, done

    def __iter__(self) -> Iterator[Any]:
        if in_main_only():
            raise UserError("run.eval_loader was iterated inside main_only(): it holds only this rank's share of the "
                            "data, and making it agree on the model's buffers needs every rank",
                            "iterate it on every rank and combine the sums with run.sum(...), or use a plain "
                            "DataLoader over the whole set inside main_only()")
        self._beat()
        started = time.monotonic()
        for model in self._models:
            sync_ddp_buffers(model)
        for batch in self._loader:
            self._beat()
            for model in self._models:  # an eval forward with gradients on would arm the broadcast again
                ddp_local_forward(model)
            yield batch
        if self._done is not None:  # a whole pass (the run ledger counts its time)
            self._done(time.monotonic() - started)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
