"""A service is one file plus one line in service_registry.SERVICES: its setting is a keyword of
ddp_kit.init, a config key of the reference job (with --help_config), a setting that may change across a
resume, and its hooks take part in every step. The toy service below is written as its own file would be;
the test adds the one registry line (as tests/env/test_env_facts.py does for a launcher)."""
from __future__ import annotations

import importlib
import textwrap

import pytest

TOY = '''
"""A toy service: counts the steps it saw, every `toy_every` of them."""
from ddp_kit.hooks import StepHooks
from ddp_kit.options import Option
from ddp_kit.service_registry import Service

OPTIONS = (Option("toy_every", 0, key="toy_every", resumable=True, help="Steps between the toy's counts (0: off)."),)


class Toy(StepHooks):
    def __init__(self, every):
        self.every, self.seen, self.began = every, [], False

    def started(self, b):
        self.began = True

    def after_step(self, b):
        if b.steps.done % self.every == 0:
            self.seen.append(b.steps.done)


SERVICE = Service("toy", OPTIONS, lambda b, settings: Toy(settings["toy_every"]) if settings["toy_every"] else None)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_service.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    from ddp_kit import service_registry

    monkeypatch.setitem(service_registry.SERVICES, "toy", "toy_service")  # the one line
    yield
    import ddp_kit.train.config as config

    monkeypatch.undo()
    importlib.reload(config)  # the config class again without the toy's key


def test_a_toy_services_setting_is_an_init_keyword_and_a_checked_policy_value(toy):
    from ddp_kit.api import init_options
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.errors import UserError
    from ddp_kit.run_options import policy_from_options

    assert "toy_every" in init_options()
    assert policy_from_options("runs/x", {"toy_every": 3}, (), ()).toy_every == 3
    assert Policy().toy_every == 0  # the declared default
    with pytest.raises(UserError, match="toy_evry") as refused:
        policy_from_options("runs/x", {"toy_evry": 3}, (), ())
    assert "did you mean toy_every" in str(refused.value.hint)


def test_a_toy_services_key_is_in_the_reference_jobs_config_and_help_and_may_change_across_a_resume(toy):
    import ddp_kit.train.config as config
    from ddp_kit.reliability.recipe import NOT_RECIPE, config_hash, recipe_changes

    config = importlib.reload(config)  # the config class is built at import from every declared setting
    assert config.resolve(overrides={"toy_every": "4"}).toy_every == 4
    assert [line for line in config.help_text().splitlines() if line.strip().startswith("toy_every")]
    refused, allowed = recipe_changes({"toy_every": 1, "lr": 0.1}, {"toy_every": 2, "lr": 0.1})
    assert not refused and allowed == {"toy_every": (1, 2)}
    assert "toy_every" in NOT_RECIPE and config_hash({"toy_every": 1}, NOT_RECIPE) == config_hash({"toy_every": 2}, NOT_RECIPE)


def test_a_toy_services_hooks_take_part_in_every_step(toy):
    import torch

    from ddp_kit.api import Run
    from ddp_kit.boundary.core import StepBoundary
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv
    from ddp_kit.reliability.preemption import PreemptFlag
    from ddp_kit.reliability.progress import Progress

    ctx = DistContext(DistEnv(), torch.device("cpu"), "gloo")
    boundary = StepBoundary(ctx, Policy(hang_timeout_s=0, toy_every=2), Progress(), PreemptFlag())
    run = Run(ctx, None, boundary, True, 0)
    boundary.start()
    toy = next(h for h in boundary.hooks if type(h).__name__ == "Toy")
    assert toy.began
    for _ in range(5):
        run.step(0.5)
    assert toy.seen == [2, 4]
