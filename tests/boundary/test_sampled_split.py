"""The forward hooks of the per-rank time split run on the first steps of each log window only, and
the stop agreement is sent a step ahead and read at the check (unit tier: no process)."""
import signal
from contextlib import nullcontext
from types import SimpleNamespace

from torch import nn

from ddp_kit.boundary import stopping
from ddp_kit.boundary.forward_split import SAMPLED, ForwardSplit
from ddp_kit.reliability.metrics import StepTimer


def test_forward_hooks_are_on_for_the_first_steps_of_each_window_only():
    timer, model = StepTimer(), nn.Linear(2, 2)
    split = ForwardSplit(timer)
    split.add(model)
    hooked = []
    for step in range(1, 3 * SAMPLED + 1):
        hooked.append(bool(model._forward_hooks))
        timer.steps += 1
        if step == 2 * SAMPLED:
            timer.window()  # a log event: a new window starts
        split.after_step()
    assert hooked == [True] * SAMPLED + [False] * SAMPLED + [True] * SAMPLED
    assert timer.sampling and timer.split == split.on
    split.clear()
    assert not model._forward_hooks and not split.models


def _boundary(world_size: int = 2):
    flag = SimpleNamespace(signum=0)
    return SimpleNamespace(ctx=SimpleNamespace(world_size=world_size, is_main=True), flag=flag, stop_ahead=None, hooks=[],
                           state={}, rd=None, policy=SimpleNamespace(ckpt_every_s=0.0), steps=SimpleNamespace(),
                           collective=lambda phase: nullcontext())


def test_the_stop_check_reads_what_was_sent_a_step_ahead(monkeypatch):
    sent, read = [], []

    def later(ctx, flag, also=False):
        sent.append(flag.signum)
        signum = flag.signum
        return lambda: read.append(signum) or (signum, also)

    monkeypatch.setattr(stopping, "agree_stop_later", later)
    monkeypatch.setattr(stopping, "agree_stop", lambda ctx, flag, also=False: (flag.signum, also))
    b = _boundary()
    stopping.start_ahead(b)
    stopping.start_ahead(b)  # one in flight at a time
    assert sent == [0]
    b.flag.signum = signal.SIGTERM  # lands between the send and the check: the next check's
    assert stopping.signalled(b) == (0, False) and b.stop_ahead is None
    assert stopping.signalled(b) == (signal.SIGTERM, False)  # a second check at the step agrees on the spot
    stopping.start_ahead(b)
    assert stopping.signalled(b, fresh=True) == (signal.SIGTERM, False) and read == [0, signal.SIGTERM]
    alone = _boundary(world_size=1)
    stopping.start_ahead(alone)
    assert alone.stop_ahead is None and len(sent) == 2
