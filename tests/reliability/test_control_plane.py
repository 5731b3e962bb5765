"""The control plane at world size 1 (no collective, no device tensor) and the flight recorder's settings."""
import pytest
import torch
import torch.distributed as tdist
from torch.torch_version import TorchVersion

from ddp_kit.dist import DistContext, nccl_defaults
from ddp_kit.dist.collectives import all_reduce_sum, all_same, all_true, rank0_verdict
from ddp_kit.env import DistEnv
from ddp_kit.errors import UserError
from ddp_kit.reliability.numerics import NonFiniteLoss


@pytest.fixture
def alone(monkeypatch):
    """A world-size-1 NCCL context whose device is "meta", standing in for the GPU (none here): a
    control tensor put there cannot be read back (.item() / .tolist() raise), and every collective
    raises, so a helper that still sends something fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective at world size 1")

    for name in ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object", "barrier"):
        monkeypatch.setattr(tdist, name, refuse)
    ctx = DistContext(DistEnv(rank=0, world_size=1), torch.device("meta"), "nccl")
    assert ctx.control_device.type == "meta"  # what the helpers would use if they made a tensor
    return ctx


def test_helpers_at_world_size_one_send_nothing(alone):
    assert all_reduce_sum(alone, [3, 2.5, torch.tensor(4)]) == [3.0, 2.5, 4.0]
    assert all_true(alone, True) is True and all_true(alone, False) is False
    assert all_same(alone, b"anything")
    assert rank0_verdict(alone, lambda: ("step_4", 4)) == ("step_4", 4)

    def refused():
        raise UserError("bad checkpoint", "fix it")

    with pytest.raises(UserError, match="bad checkpoint"):
        rank0_verdict(alone, refused)


def test_nonfinite_loss_check_at_world_size_one_reads_only_the_loss(alone):
    """The loss lives on the CPU here (it would be on the GPU): its one read is the only host sync."""
    watch = NonFiniteLoss()
    for step, value in enumerate([1.0, 0.5, float("nan"), float("inf")], start=1):
        watch.update(torch.tensor(value), step)
        if step == 2:
            watch.check(alone)  # all finite so far: nothing raised, nothing sent
    with pytest.raises(UserError, match="non-finite .* at step 3 on rank"):
        watch.check(alone)


def test_flight_recorder_settings_follow_the_installed_torch(tmp_path):
    """torch 2.11 and 2.14 keep 2000 entries by default and read TORCH_FR_*; their old names
    (TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE) print a deprecation warning per rank."""
    for version in ("2.11.0", "2.14.1+cu130"):
        env = {}
        assert nccl_defaults(str(tmp_path), env, TorchVersion(version)) == env == {
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/nccl_trace_rank_"}
    older = {}
    nccl_defaults(str(tmp_path), older, TorchVersion("2.6.0"))  # the names it reads, and a buffer
    assert older == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/nccl_trace_rank_"}
    # a user's own setting wins, under either name (the new one would override the old in torch)
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert nccl_defaults(str(tmp_path), mine, TorchVersion("2.14.1")) == {}
    assert mine == {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert nccl_defaults(None, {}, TorchVersion("2.14.1")) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
