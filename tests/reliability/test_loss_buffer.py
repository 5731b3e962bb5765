"""LossBuffer: the device loss window (issue 48), exercised on CPU tensors (the same ops a GPU runs)."""
import math

import pytest
import torch

from ddp_kit.dist import DistContext
from ddp_kit.env import DistEnv
from ddp_kit.errors import UserError
from ddp_kit.reliability.numerics import _NONE, LossBuffer, NonFiniteLoss


def test_window_sum_and_first_bad_step_without_a_fold():
    buf = LossBuffer(8)
    for step, v in enumerate([1.0, 2.0, float("nan"), 4.0, float("inf")], start=11):
        buf.put(torch.tensor(v, dtype=torch.bfloat16 if step == 11 else torch.float32), step)
    assert buf.first_bad() == 13
    total, n = buf.take()
    assert n == 5 and math.isnan(total)
    assert buf.first_bad() == _NONE and buf.take() == (0.0, 0)


def test_a_full_buffer_folds_on_the_device_and_keeps_the_first_bad_step():
    buf = LossBuffer(3)
    values = [0.5, 1.5, 2.5, 3.5, float("nan"), 5.5, 6.5, float("nan")]
    for step, v in enumerate(values, start=1):
        buf.put(torch.tensor([v]), step)  # a (1,)-shaped loss is a scalar's slot too
    assert buf.folded is not None and buf.first_bad() == 5
    buf = LossBuffer(3)
    for step, v in enumerate(values[:4] + [7.0] * 4, start=1):
        buf.put(torch.tensor(v), step)
    assert buf.first_bad() == _NONE
    assert buf.take() == (sum(values[:4]) + 28.0, 8)


def test_the_check_reads_a_watched_buffer_and_names_the_first_bad_step():
    ctx = DistContext(DistEnv(rank=0, world_size=1), torch.device("cpu"), "gloo")
    watch, buf = NonFiniteLoss(), LossBuffer(2)
    watch.watch(buf)
    for step, v in enumerate([1.0, 2.0, 3.0], start=1):
        buf.put(torch.tensor(v), step)
    watch.check(ctx)  # all finite (one of them folded): nothing raised
    buf.put(torch.tensor(float("inf")), 4)
    buf.put(torch.tensor(float("nan")), 5)  # a fold: the first bad step is kept on the device
    with pytest.raises(UserError, match="non-finite .* at step 4 on rank"):
        watch.check(ctx)
