"""The reference job's metrics are computed only on a step a log line shows (issue 48)."""
import functools

import torch
from torch import nn

from ddp_kit.losses import cross_entropy
from ddp_kit.train.loop import _takes_metrics


def test_cross_entropy_leaves_accuracy_out_when_not_asked():
    model = nn.Linear(4, 3)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    loss, parts = cross_entropy(model, batch)
    quiet, none = cross_entropy(model, batch, metrics=False)
    assert torch.equal(loss, quiet) and none == {} and set(parts) == {"accuracy"}


def test_only_a_loss_with_a_metrics_keyword_is_asked_to_leave_them_out():
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, model, batch, metrics=True):
            return model(batch)

    assert _takes_metrics(cross_entropy) and _takes_metrics(functools.partial(cross_entropy))
    assert not _takes_metrics(lambda model, batch: model(batch)) and not _takes_metrics(Unhashable())
