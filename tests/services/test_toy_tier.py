"""A checkpoint tier is one file plus one line in service_registry.SERVICES: a second folder at its own
cadence, written as its own file would be, joins the reference job; a worker killed between two durable
checkpoints resumes from the newest complete step across the tiers (the second folder's), and the
result is the uninterrupted run's, bit for bit."""
from __future__ import annotations

import textwrap

import pytest

from conftest import REFERENCE_2_EPOCHS, ok, read_json, torchrun

pytestmark = pytest.mark.integration  # real processes: torchrun, a SIGKILL

TIER = '''
"""A second folder of checkpoints, every `second_every` steps."""
from ddp_kit.boundary.saving import snapshot
from ddp_kit.checkpoint import Checkpointer, rng_state
from ddp_kit.options import Option
from ddp_kit.service_registry import Service

OPTIONS = (Option("second_every", 0, key="second_every", resumable=True, help="Steps between second-folder copies."),
           Option("second_dir", "", key="second_dir", resumable=True, help="The second folder."))


class SecondFolder:
    name, durable = "second", False

    def __init__(self, b, every, folder):
        self.every, self.ckpt = every, Checkpointer(b.ctx, folder, keep_last=2)

    def due(self, step):
        return step % self.every == 0

    def save(self, b):
        shared, sharded, meta = snapshot(b)
        self.ckpt.save(b.steps.done, shared, {"rng": rng_state()}, meta, sharded=sharded)

    def wait(self):
        self.ckpt.wait()

    def find(self, b, newer_than, warn):
        found = self.ckpt.find("auto", warn=warn)
        return found if found is not None and (newer_than is None or found.step > newer_than) else None

    def load(self, found):
        return self.ckpt.load(found)

    def sharded_keys(self, found):
        return self.ckpt.sharded_keys(found)

    def load_sharded(self, found, template):
        self.ckpt.load_sharded(found, template)

    def clear(self):
        pass

    def continues_from(self, step):
        pass

    def take_blocking(self):
        return {}

    def close(self, clean):
        self.ckpt.close()


def make(b, settings):
    every, folder = settings["second_every"], settings["second_dir"]
    return SecondFolder(b, every, folder) if every and folder else None


SERVICE = Service("second_folder", OPTIONS, make)
'''

JOB = '''
import ddp_kit.service_registry as registry

registry.SERVICES["second_folder"] = "second_folder"  # the one line
from ddp_kit.train.command import main

main()
'''


def test_resume_takes_the_newest_complete_step_across_tiers(tmp_path, reference_summary):
    (tmp_path / "second_folder.py").write_text(textwrap.dedent(TIER))
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    run, second = tmp_path / "run", tmp_path / "second"
    env = {"PYTHONPATH": str(tmp_path)}
    # durable every 10 steps, the second folder every 4: a kill at step 14 finds step 12 there
    args = [str(tmp_path / "job.py"), *REFERENCE_2_EPOCHS, "--ckpt_every", "10", "--second_every", "4",
            "--second_dir", str(second), "--run_dir", str(run)]
    res = torchrun([*args, "--inject", "kill:rank=1:step=14"], env=env)
    assert res.returncode != 0, res.stdout + res.stderr
    assert (second / "step_12").is_dir() and (run / "checkpoints" / "step_10").is_dir(), sorted(p.name for p in second.iterdir())
    res = ok(torchrun(args, env=env))
    assert f"resumed from {second / 'step_12'}" in res.stdout, res.stdout
    summary = read_json(run / "summary.json")
    assert summary["resumed_from_step"] == 12
    assert summary["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]
