"""The strategy seam (parallel/strategy.py): one object per strategy answers what the rest of
ddp_kit asks, and a name outside the registry is one line. Unit tier: no process group."""
import pytest
from torch import nn

from ddp_kit.errors import UserError
from ddp_kit.parallel.strategy import NAMES, every_strategy, strategy, strategy_of


def test_registry_names_each_strategy_by_the_name_meta_json_writes():
    assert NAMES == ("ddp", "fsdp", "ft")
    assert [s.name for s in every_strategy()] == list(NAMES)
    assert (strategy("ddp").sharded, strategy("fsdp").sharded, strategy("ft").sharded) == (False, True, False)


def test_unknown_strategy_is_one_line_naming_the_known_ones():
    with pytest.raises(UserError, match="unknown strategy 'zero'") as err:
        strategy("zero")
    assert "ddp, fsdp" in err.value.hint


def test_a_plain_module_is_held_by_no_strategy():
    assert strategy_of(nn.Linear(2, 2)) is None


def test_each_strategy_reads_only_its_own_config_keys():
    ddp, fsdp = strategy("ddp"), strategy("fsdp")
    assert not set(ddp.config_keys) & set(fsdp.config_keys)
    assert fsdp.prepare_options({"fsdp_blocks": "Block, Head", "fsdp_cpu_offload": False,
                                 "fsdp_reshard_after_forward": True}) == {
        "fsdp": {"blocks": ["Block", "Head"], "cpu_offload": False, "reshard_after_forward": True}}
    assert ddp.prepare_options({"bucket_cap_mb": 25.0, "static_graph": False, "sync_bn": False}) == {
        "ddp": {"bucket_cap_mb": 25.0, "static_graph": False}}


def test_ddp_state_goes_through_the_plain_files():
    assert strategy("ddp").state_dicts({}, {}) is None
