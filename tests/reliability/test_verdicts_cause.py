"""Failures a restart can cure are classified by cause, not by who posted them (issue 44 item 7): a
communication error another rank posted, a GPU's ECC/Xid error, a host MemoryError, and storage that
refuses, times out or throttles at startup are retryable (lost_peer or infrastructure, naming the host),
and none of them is subject to the repeat rule. Real exception objects: torch's OutOfMemoryError and
botocore's ClientError are built as their libraries build them; the texts posted are what
dist/failfast.py posts for them ("Type: first line")."""
from __future__ import annotations

import errno
import socket

import pytest
import torch

from ddp_kit.errors import Unavailable, UserError
from ddp_kit.exit_codes import EXIT_USER_ERROR
from ddp_kit.reliability.verdicts import REPEATABLE, deterministic, of_failure, repeats


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001 (the exception itself is the subject)
        return caught


GLOO_CLOSED = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
               "[10.0.0.7]:29501")
NCCL_REMOTE = ("DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote process "
               "exited or there was a network error, NCCL version 2.21.5")
ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
XID = "RuntimeError: NCCL watchdog: GPU Xid 79 (fallen off the bus) on device 3"


@pytest.mark.parametrize("error", [GLOO_CLOSED, NCCL_REMOTE, "RuntimeError: Connection reset by peer"])
def test_a_communication_error_another_rank_posted_is_a_lost_peer_not_a_program_error(error):
    posted = {"rank": 3, "host": "node-b", "step": 41, "phase": "forward/backward", "error": error}
    # rank 0, stopped by fail-fast: its own "error" is only the text it read (boundary/core.py _peer_failed)
    v = of_failure(1, RuntimeError(error), posted, 0, "node-a", 40)
    assert (v.name, v.retryable, v.rank, v.host, v.step) == ("lost_peer", True, 3, "node-b", 41), v
    assert "node-b" in v.cause
    assert v.name not in REPEATABLE
    # the same fault at the same step after the restart is not "deterministic": it is retried again
    assert not repeats(v, {"verdict": v.name, "error": v.error, "step": v.step})


@pytest.mark.parametrize("error", [ECC, XID, "RuntimeError: CUDA error: an uncorrectable NVLink error was detected"])
def test_a_gpu_hardware_error_is_infrastructure_naming_the_host(error):
    own = of_failure(1, _raised(RuntimeError(error.split(": ", 1)[1])), None, 2, "gpu-node-7", 12)
    posted = of_failure(1, RuntimeError("closed"), {"rank": 2, "host": "gpu-node-7", "step": 12, "error": error},
                        0, "gpu-node-1", 12)
    for v in (own, posted):
        assert (v.name, v.retryable, v.host) == ("infrastructure", True, "gpu-node-7"), v
        assert "gpu-node-7" in v.cause and not repeats(v, {"verdict": v.name, "error": v.error, "step": 12})


def test_a_host_memory_error_is_infrastructure_and_never_deterministic():
    own = of_failure(1, _raised(MemoryError()), None, 1, "node-c", 7)
    posted = of_failure(1, RuntimeError("closed"), {"rank": 1, "host": "node-c", "step": 7, "error": "MemoryError: "},
                        0, "node-a", 7)
    cpu = of_failure(1, _raised(RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                                             "allocate memory: you tried to allocate 8589934592 bytes. Error code 12 "
                                             "(Cannot allocate memory)")), None, 1, "node-c", 7)
    for v in (own, posted, cpu):
        assert (v.name, v.retryable, v.host) == ("infrastructure", True, "node-c"), v
        assert "node-c" in v.cause
        assert not repeats(v, {"verdict": v.name, "error": v.error, "step": 7})


def test_the_devices_out_of_memory_stays_out_of_memory_and_repeatable():
    oom = _raised(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    v = of_failure(1, oom, None, 0, "h", 9)
    assert (v.name, v.retryable) == ("out_of_memory", True)
    assert repeats(v, {"verdict": "out_of_memory", "error": v.error, "step": 9})
    assert deterministic(v).retryable is False


def test_a_program_error_another_rank_posted_is_still_one():
    posted = {"rank": 3, "host": "node-b", "step": 41, "error": "IndexError: index 7 is out of bounds"}
    assert of_failure(1, RuntimeError("Connection closed by peer"), posted, 0, "node-a", 40).name == "program_error"


def _slow_down() -> BaseException:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    boto = ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                        "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    return translate_boto_error(boto)


def _refused() -> BaseException:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with ends: nothing listens there
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError as exc:
        return exc
    raise AssertionError("a closed port answered")


def _endpoint_down() -> BaseException:
    from botocore.exceptions import EndpointConnectionError

    return EndpointConnectionError(endpoint_url="http://10.0.0.9:9000/bucket/run/.probe")


@pytest.mark.parametrize("make", [_refused, _slow_down, _endpoint_down, lambda: TimeoutError("timed out")])
def test_storage_that_does_not_answer_at_startup_is_retryable_not_a_user_error(make, monkeypatch):
    from ddp_kit.checkpoint.store_fs import refusal

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.0.0.9:9000")
    err = refusal("s3://bucket/run", make(), "written")
    assert isinstance(err, Unavailable) and err.retryable and err.exit_code == 1, err.line()
    line = err.line()
    assert "s3://bucket/run" in line and "10.0.0.9:9000" in line and "(hint: " in line and "\n" not in line
    v = of_failure(err.exit_code, err, None, 0, "node-a", 0)
    assert (v.name, v.retryable, v.host) == ("infrastructure", True, "node-a"), v
    posted = {"rank": 0, "host": "node-a", "step": 0, "error": f"Unavailable: {err.message}"}
    assert of_failure(1, RuntimeError("closed"), posted, 1, "node-b", 0).name == "infrastructure"


def test_what_the_user_must_fix_stays_a_user_error():
    from ddp_kit.checkpoint.store_fs import refusal

    for exc in (FileNotFoundError("NoSuchBucket"), PermissionError("AccessDenied")):
        err = refusal("s3://bucket/run", exc, "written")
        assert type(err) is UserError and err.exit_code == EXIT_USER_ERROR
    assert of_failure(2, UserError("bad lr", "x"), None, 0, "h", 0).name == "user_error"


def test_a_full_disk_is_still_infrastructure():
    assert of_failure(1, _raised(OSError(errno.ENOSPC, "No space left on device")), None, 0, "h", 1).name == \
        "infrastructure"


@pytest.mark.integration
def test_a_posted_network_error_that_recurs_after_a_restart_stays_retryable(tmp_path):
    """Two ranks under torchrun --max-restarts 1; rank 1 meets a broken connection at step 6 on both attempts
    (tests/helpers/comm_fault.py). Rank 0 records the failure rank 1 posted: a lost peer both times,
    retryable, never "deterministic" (it used to be a program error, and exit 2 at the second attempt)."""
    import json
    import subprocess
    import sys

    from conftest import HELPERS, ROOT, proc_env
    from procs import outcome

    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", str(HELPERS / "comm_fault.py"), str(run)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    rc, out = outcome(p, 240)
    records = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    ends = [r for r in records if r["event"] == "end"]
    assert rc == 1 and len(ends) == 2, (rc, records, out[-3000:])
    for end in ends:
        assert (end["verdict"], end["retryable"], end["exit"], end["rank"]) == ("lost_peer", True, 1, 1), end
    assert not [r for r in records if r["event"] == "refused"] and "deterministic" not in out
