"""The strategy seam (parallel/strategy.py): one object per strategy answers what the rest of
ddp_kit asks, and a name outside the registry is one line. Unit tier: no process group."""
import importlib
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
from torch import nn

from ddp_kit.errors import UserError
from ddp_kit.parallel.strategy import NAMES, Option, Strategy, every_strategy, strategy, strategy_of


def test_registry_names_each_strategy_by_the_name_meta_json_writes():
    assert NAMES == ("ddp", "fsdp", "hsdp", "ft")
    assert [s.name for s in every_strategy()] == list(NAMES)
    assert [strategy(n).sharded for n in NAMES] == [False, True, True, False]


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


# ---- a new strategy is one file plus one line in STRATEGIES ------------------------------------------

@pytest.fixture
def toy(monkeypatch):
    """A strategy `toy` as its own file would define it (one option, --toy_width in the reference job),
    registered by one entry in STRATEGIES; the job's config is rebuilt with it, and without it after."""
    from ddp_kit.parallel import strategy as registry
    from ddp_kit.train import config

    @dataclass(frozen=True)
    class Toy(Strategy):
        def wrap(self, model, ctx, *, toy=None, **_):
            model.toy_options = self.own_options(toy)
            return model

        def holds(self, model):
            return hasattr(model, "toy_options")

        def accumulate(self, model, sync):
            return nullcontext()

    module = types.ModuleType("toy_strategy")
    module.STRATEGY = Toy(name="toy", label="Toy", sharded=False,
                          options=(Option("width", 8, "toy: how wide it is.", key="toy_width", resumable=True),))
    monkeypatch.setitem(sys.modules, "toy_strategy", module)
    monkeypatch.setitem(registry.STRATEGIES, "toy", "toy_strategy")  # the one line
    monkeypatch.setattr(registry, "NAMES", tuple(registry.STRATEGIES))
    importlib.reload(config)
    yield config
    monkeypatch.undo()
    importlib.reload(config)


def test_a_new_strategys_options_reach_the_config_the_help_and_the_resume_rule(toy):
    from ddp_kit.reliability import RESUMABLE

    cfg = toy.resolve(None, {"strategy": "toy", "toy_width": "3"})
    assert cfg.toy_width == 3 and strategy("toy").prepare_options(cfg.to_dict()) == {"toy": {"width": 3}}
    assert "  toy_width          = 8              toy: how wide it is." in toy.help_text().splitlines()
    with pytest.raises(UserError, match="config key 'toy_width' expects int"):
        toy.resolve(None, {"strategy": "toy", "toy_width": "wide"})
    with pytest.raises(UserError, match="--toy_width is a Toy option; this run's strategy is ddp"):
        toy.resolve(None, {"toy_width": 3})
    assert "toy_width" in RESUMABLE


def test_a_new_strategys_options_reach_run_prepare_and_init(toy, monkeypatch):
    import torch
    from torch import nn

    import ddp_kit
    from ddp_kit.api import Run
    from ddp_kit.boundary.core import StepBoundary
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv
    from ddp_kit.reliability.preemption import PreemptFlag
    from ddp_kit.reliability.progress import Progress

    ctx = DistContext(DistEnv(rank=0, world_size=1), torch.device("cpu"), "gloo")
    run = Run(ctx, None, StepBoundary(ctx, Policy(hang_timeout_s=0), Progress(), PreemptFlag()), True, 0)
    assert run.prepare(nn.Linear(2, 2), strategy="toy", toy={"width": 3}).toy_options == {"width": 3}
    with pytest.raises(UserError, match=r"toy options \['depth'\] not understood") as err:
        run.prepare(nn.Linear(2, 2), strategy="toy", toy={"depth": 3})
    assert err.value.hint == "known: width"
    with pytest.raises(TypeError, match="unexpected keyword argument 'toys'"):
        run.prepare(nn.Linear(2, 2), strategy="toy", toys={"width": 3})
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init's, for the errors of joining, stays installed
    with pytest.raises(UserError, match="ddp_kit.init\\(\\) got toy, which is an option of run.prepare"):
        ddp_kit.init(toy={"width": 3}, env=DistEnv(rank=0, world_size=1))
