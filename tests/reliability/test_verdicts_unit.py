"""The verdict of a failure, from the exception and what fail-fast posted (reliability/verdicts.py),
and the repeat rule. Real exceptions; out of memory on a GPU is torch.OutOfMemoryError, built here as
torch builds it (a host's MemoryError is infrastructure: tests/reliability/test_verdicts_cause.py)."""
from __future__ import annotations

import errno

import torch

from ddp_kit.errors import UserError
from ddp_kit.reliability.verdicts import deterministic, of_failure, of_stop, repeats


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001 (the exception itself is the subject)
        return caught


def test_each_failure_gets_its_class_and_retry():
    cases = [
        (1, _raised(RuntimeError("boom")), "program_error", True),
        (2, UserError("bad lr", "pass a positive lr"), "user_error", False),
        (1, _raised(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")), "out_of_memory", True),
        (1, _raised(OSError(errno.ENOSPC, "No space left on device")), "infrastructure", True),
        (3, _raised(RuntimeError("echo of the hang")), "hang", True),
    ]
    got = [(of_failure(code, err, None, 0, "h", 5).name, of_failure(code, err, None, 0, "h", 5).retryable)
           for code, err, _, _ in cases]
    assert got == [(name, retry) for _, _, name, retry in cases]


def test_a_disk_full_under_a_wrapping_error_is_still_infrastructure():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as err:
        assert of_failure(1, err, None, 0, "h", 3).name == "infrastructure"


def test_another_ranks_posted_failure_is_the_verdict_with_its_rank_and_step():
    posted = {"rank": 3, "host": "node-b", "step": 41, "phase": "forward/backward",
              "error": "RuntimeError: index out of range"}
    v = of_failure(1, RuntimeError("Connection closed by peer"), posted, 0, "node-a", 40)
    assert (v.name, v.rank, v.host, v.step, v.error) == ("program_error", 3, "node-b", 41,
                                                         "RuntimeError: index out of range")
    posted_user = {**posted, "error": "UserError: data_root '/x' does not exist"}
    assert of_failure(1, RuntimeError("closed"), posted_user, 0, "node-a", 40).name == "user_error"


def test_the_same_failure_at_the_same_step_repeats_and_becomes_not_retryable():
    v = of_failure(1, _raised(RuntimeError("boom")), None, 1, "h", 6)
    before = {"verdict": "program_error", "error": "RuntimeError: boom", "step": 6}
    assert repeats(v, before)
    assert not repeats(v, {**before, "step": 7})  # another step: may be data-dependent, retried
    assert not repeats(v, {**before, "error": "RuntimeError: other"})
    assert not repeats(v, None)
    user = of_failure(2, UserError("x", "y"), None, 0, "h", 6)
    assert not repeats(user, {"verdict": "user_error", "error": user.error, "step": 6})  # already not retried
    d = deterministic(v)
    assert (d.name, d.retryable, d.step) == ("program_error", False, 6) and "deterministic" in d.cause


def test_stops_and_clean_ends():
    assert [(of_stop(c, 9).name, of_stop(c, 9).retryable) for c in (0, 75, 130)] == \
        [("finished", False), ("preempted", True), ("interrupted", False)]


def test_a_full_disk_while_checkpointing_is_infrastructure_not_retried():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise UserError("disk full while writing checkpoint step_6 to 'runs/a/checkpoints'", "free space") from None
    except UserError as err:
        v = of_failure(2, err, None, 0, "h", 6)
    assert (v.name, v.retryable) == ("infrastructure", False)
    posted = {"rank": 1, "host": "b", "step": 6, "error": "UserError: disk full while writing checkpoint step_6"}
    assert of_failure(1, RuntimeError("closed"), posted, 0, "a", 6).name == "infrastructure"
