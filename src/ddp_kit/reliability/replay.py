"""sdc_check_every: every N steps, a step's forward and backward computed again and compared before the
optimizer sees them (docs/sdc.md).

The sync check's vote sees only what a rank keeps (its weights). A fault in one rank's activations or local
gradient is averaged into every rank's update by DDP's all-reduce, and the replicas go on agreeing on wrong
weights. So on a check step the step's forward and backward run a second time on the same batch, from the
same random state and buffers, under no_sync: each rank's own local gradient, no all-reduce. Each rank compares
its loss and its local gradients with the first computation's, bit for bit: the digest of each parameter's
gradient (the integer sum of its elements' bit patterns), taken by tensor hooks as autograd delivers the
gradient, before DDP's reducer averages it. The same kernels on the same inputs give the same bits (on a GPU,
with deterministic algorithms: docs/sdc.md).

Where a rank's two computations differ, every rank computes the step a third time, as the first (with the
all-reduce). On the rank that differed the third agrees with one of the two: the odd one was a transient
fault, named in one line with its rank and host, and the step goes on with the third's gradients. A rank whose
computations do not repeat (the third agrees with neither, or a rank that agreed twice differs the third time)
cannot be trusted: the attempt ends naming its host. Where every rank differs, the step itself is not
repeatable (a non-deterministic kernel): a setting to fix, not a host.

Cost: one forward and backward more every N steps, and one integer reduction per parameter tensor in each
checked computation; at a mismatch, one computation more on every rank."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# What each rank's third computation says about the first two (`judge`): the odd one out, where one is.
SAME, FIRST, SECOND, THIRD, NONE = "same", "first", "second", "third", "none"
GOES_ON = (SAME, FIRST, SECOND)  # the third computation's gradients are right on this rank


@dataclass(frozen=True)
class Computed:
    """One computation of a step on this rank: its loss and the digest of its local gradients (bits)."""
    loss: torch.Tensor
    table: torch.Tensor  # (parameters,) int64: each gradient's digest (_digest)

    def same(self, other: Computed) -> bool:
        return torch.equal(self.table, other.table) and torch.equal(_bits(self.loss), _bits(other.loss))

    def what_differs(self, other: Computed) -> str:
        loss = "its loss and gradients" if not torch.equal(_bits(self.loss), _bits(other.loss)) else "its gradients"
        return loss if not torch.equal(self.table, other.table) else "its loss"


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _digest(g: torch.Tensor) -> torch.Tensor:
    """A gradient's elements read as integers (their bit patterns) and summed in int64: one pass, exact and
    independent of the reduction's order (integer addition), so a kernel's summation order cannot make two
    equal gradients differ, and a flipped bit k of any one element moves the sum by 2**k (modulo 2**64), which
    a float sum could round away. A third of the time of a float64 sum and 1-norm on CPU."""
    flat = g.reshape(-1)
    return flat.view(_AS_INT.get(flat.element_size(), torch.int64)).sum(dtype=torch.int64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's value as bits: NaN equals the NaN the same computation gave (torch.equal's NaN does not)."""
    return t.detach().double().reshape(1).view(torch.int64)


class Digest(AbstractContextManager):
    """Tensor hooks on the parameters that sum each local gradient as autograd delivers it (before DDP's
    reducer sees it: its hooks run after the gradient is accumulated), and leave the gradient as it is."""

    def __init__(self, params: Sequence[nn.Parameter], keep: bool = True):
        self.params = params
        self.keep = keep  # False: each gradient is dropped once digested (the replay's: memory for one copy less)
        self.sums: list[torch.Tensor | None] = [None] * len(params)
        self.handles: list[Any] = []

    def __enter__(self) -> Digest:
        self.handles = [p.register_hook(functools.partial(self._add, i)) for i, p in enumerate(self.params)]
        if not self.keep:
            self.handles += [p.register_post_accumulate_grad_hook(_drop_grad) for p in self.params]
        return self

    def _add(self, i: int, grad: torch.Tensor) -> None:
        s = _digest(grad.coalesce().values() if grad.is_sparse else grad)
        prev = self.sums[i]
        self.sums[i] = s if prev is None else prev + s  # a parameter whose gradient comes in parts

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def table(self, device: torch.device) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.int64, device=device)  # a parameter this batch gave no gradient
        return torch.stack([s if s is not None else zero for s in self.sums])


@dataclass(frozen=True)
class Snapshot:
    """What a computation of the step changes besides the gradients: torch's random state (dropout), the
    buffers (BatchNorm's running statistics), and DDP's note that the next forward broadcasts buffers."""
    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    buffers: tuple[torch.Tensor, ...]
    forward_sync: tuple[Any, ...]  # per model

    @staticmethod
    def take(models: Sequence[nn.Module], device: torch.device) -> Snapshot:
        cuda = device.type == "cuda"
        return Snapshot(torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None,
                        tuple(b.detach().clone() for m in models for b in m.buffers()),
                        tuple(getattr(m, "require_forward_param_sync", None) for m in models))

    def put_back(self, models: Sequence[nn.Module], device: torch.device) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, device)
        with torch.no_grad():
            for b, saved in zip((b for m in models for b in m.buffers()), self.buffers):
                b.copy_(saved)
        for m, sync in zip(models, self.forward_sync):
            if sync is not None:
                m.require_forward_param_sync = sync  # type: ignore[assignment]


def compute_once(params: Sequence[nn.Parameter], compute: Callable[[], torch.Tensor],
                 backward: Callable[[torch.Tensor], None], device: torch.device, keep: bool = True) -> Computed:
    with Digest(params, keep) as d:
        loss = compute()
        backward(loss)
    return Computed(loss, d.table(device))


def judge(first: Computed, second: Computed, third: Computed) -> str:
    """Which of a rank's three computations of one step is the odd one out (SAME: none; NONE: no two agree)."""
    a, b, c = first.same(second), first.same(third), second.same(third)
    if a and b:
        return SAME
    if c:
        return FIRST
    if b:
        return SECOND
    return THIRD if a else NONE


@dataclass(frozen=True)
class Finding:
    """What a check step found, every rank's word on it: `odd[r]` is judge's word for rank r (SAME where its
    first two computations agreed and the third was not needed), `what[r]` what differed, `hosts[r]` its host."""
    step: int
    odd: tuple[str, ...]
    what: tuple[str, ...]
    hosts: tuple[str, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, o in enumerate(self.odd) if o != SAME)

    @property
    def goes_on(self) -> bool:
        return all(o in GOES_ON for o in self.odd)

    def line(self) -> str:
        """The line a transient fault gets (every rank's third computation agreed: `goes_on`)."""
        parts = []
        for r in self.ranks:
            which = {FIRST: "the first", SECOND: "the second (the replay)"}[self.odd[r]]
            other = {FIRST: "second", SECOND: "first"}[self.odd[r]]
            parts.append(f"rank {r} (host {self.hosts[r]}) computed {self.what[r]} differently in {which} of two "
                         f"computations, and a third agreed with the {other}")
        return (f"silent data corruption suspected at step {self.step} (replay check, sdc_check_every): "
                + "; ".join(parts) + "; the step goes on with the third computation's gradients")

    @property
    def bad(self) -> tuple[int, ...]:
        """The ranks whose computations do not repeat (the third agreed with neither, or differed alone)."""
        return tuple(r for r, o in enumerate(self.odd) if o not in GOES_ON)

    @property
    def a_host_to_blame(self) -> bool:
        """Whether another rank repeated the step (the same way each time, or twice of three with one transient
        fault): only then is the step itself repeatable, and the ranks that did not are their hosts' (else a
        kernel or the loss is not deterministic)."""
        return any(o in GOES_ON for o in self.odd)

    def not_repeatable(self) -> str:
        if not self.a_host_to_blame:
            return (f"step {self.step} is not repeatable (replay check, sdc_check_every): computed three times, "
                    f"it gave other gradients on {'every rank' if len(self.odd) > 1 else 'this rank'}, "
                    f"where no rank computed it the same way twice")
        words = {NONE: "with no two of three computations agreeing", THIRD: "the same way twice, then differently"}
        who = "; ".join(f"rank {r} (host {self.hosts[r]}) computed the step {words[self.odd[r]]}" for r in self.bad)
        return f"silent data corruption suspected at step {self.step} (replay check, sdc_check_every): {who}"

    def record(self) -> dict[str, Any]:
        """The run ledger's `replay` line."""
        return {"event": "replay", "step": self.step, "ranks": list(self.ranks),
                "hosts": list(dict.fromkeys(self.hosts[r] for r in self.ranks)),
                "odd": {str(r): self.odd[r] for r in self.ranks}, "went_on": self.goes_on}


def checked(models: Sequence[nn.Module], compute: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None], *,
            step: int, device: torch.device, local: Callable[[], AbstractContextManager],
            agree: Callable[[bool], bool], exchange: Callable[[tuple[str, str, str]], list[tuple[str, str, str]]],
            host: str) -> tuple[torch.Tensor, Finding | None]:
    """The step's forward and backward (`compute`, then `backward` of its loss, in the caller's context:
    synced or a no_sync micro-step), computed again under `local()` (no all-reduce) and compared. `models`:
    every model the loss may reach (their gradients, buffers and DDP state are what a computation changes). `agree`
    (collective, a few bytes): whether every rank's two computations agreed; where one did not, every rank
    computes the step a third time as the first, and `exchange` (collective) gives every rank's (odd, what, host).
    Returns the loss to go on with and what was found (None: every rank's two computations agreed)."""
    params = list({id(p): p for m in models for p in m.parameters() if p.requires_grad}.values())
    # A micro-step's accumulated gradients, if any: their tensors (DDP's bucket views, which its reducer
    # divides in place: a copy in their place would be averaged by another kernel) and their values.
    grads_before = [p.grad for p in params]
    values_before = [None if g is None else g.detach().clone() for g in grads_before]
    before = Snapshot.take(models, device)
    first = compute_once(params, compute, backward, device)
    after, grads_after = Snapshot.take(models, device), [p.grad for p in params]
    before.put_back(models, device)
    for p in params:
        p.grad = None  # the replay's local gradients alone, not added to the first's
    with local():
        second = compute_once(params, compute, backward, device, keep=False)
    after.put_back(models, device)
    for p, g in zip(params, grads_after):
        p.grad = g  # the first computation's gradients (DDP's bucket views, where it made them) again
    if agree(first.same(second)):
        return first.loss, None
    before.put_back(models, device)
    with torch.no_grad():
        for p, g, v in zip(params, grads_before, values_before):
            if g is not None and v is not None:
                g.copy_(v)
            p.grad = g
    third = compute_once(params, compute, backward, device)
    odd = judge(first, second, third)
    words = exchange((odd, "" if odd == SAME else first.what_differs(third if odd == THIRD else second), host))
    return third.loss, Finding(step, tuple(w[0] for w in words), tuple(w[1] for w in words), tuple(w[2] for w in words))
