"""One verdict per attempt: how it ended, whether a restart can help, and the exit code that says so.

    verdict          exit  retryable  what it means
    finished            0  -          the run ended; nothing to restart
    preempted          75  yes        a stop signal (SIGTERM, SIGUSR2): checkpointed, rerun to resume
    interrupted       130  no         Ctrl-C: a person stopped it
    user_error          2  no         a bad config or input (one line with a hint); a restart fails the same way
    program_error       1  yes        an exception in the script (its traceback); retried once: the same
                                      exception at the same step in the next attempt is deterministic,
                                      and that attempt exits 2 (not retryable)
    out_of_memory       1  yes        the device ran out of memory (torch.OutOfMemoryError); the same repeat rule
    lost_peer           1  yes        a collective broke or timed out, or another rank vanished (killed, node or
                                      network lost), whichever rank saw it first and posted it; never "deterministic"
    infrastructure    1/2  1: yes     outside the program, naming the host: storage that refuses, times out or
                                      throttles (503 SlowDown) at start or resume, a GPU ECC/Xid error, the host's
                                      memory (MemoryError: another process may hold it), an I/O error; never under
                                      the repeat rule (a job that cannot fit stops by max_failed_attempts). A full
                                      disk while checkpointing stops the run with 2 (it will not free itself);
                                      a host the pre-flight health gate failed (errors.Unhealthy): 2 only where
                                      an elastic job cannot go on without it
    hang                3  yes        no progress within hang_timeout_s (stacks in run_dir/hang/)
    killed              -  yes        (read, never written) an attempt that left no end: SIGKILL, the OOM killer

Engines act on the exit code alone, so the non-retryable ones share code 2 (EXIT_USER_ERROR), which the
templates map to "do not retry"; a crash loop (max_failed_attempts attempts without a new checkpoint) is
refused at startup with 2 too. What each engine sees (launch/templates; torchrun itself exits 1 for any
failed rank, so under torchrun rank.sh leaves 75 or 2 in a mark that pod.sh reads):

    exit of ddp_kit   SLURM (sbatch)         TrainJob (podFailurePolicy)  PyTorchJob (ExitCode)    Volcano
    0                 done                   done                         0: done                  done
    75  preempted     75, requeued by        75: Ignore, pod recreated,   203 (75+128): retried    RestartJob
                      ddp_kit (scontrol)     not counted
    1   retryable     1: the job fails (no   counted: JobSet restarts,    193 (1+192): retried,    RestartJob
        failures      requeue; torchrun      up to maxRestarts            up to backoffLimit
                      --max-restarts retries)
    3   hang          3: as 1                as 1                         195 (3+192): retried     RestartJob
    2   not retryable 2: the job fails       FailJob                      2: the job fails         TerminateJob
    killed (137)      the job fails          counted; a disruption:       137: retried             RestartJob
                      (node failure: requeued) Ignore

PyTorchJob's ExitCode policy (kubeflow training-operator, IsRetryableExitCode: >= 128) fails the job at once
on 1-127, so the pod entrypoint moves the retryable codes above 192 (no 128 + signal number): see
launch/k8s.py.
"""
from __future__ import annotations

import errno
import re
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import Unavailable, Unhealthy, UserError
from ..exit_codes import EXIT_HANG as EXIT_HANG  # its old home: `from ..reliability.verdicts import` still works
from ..exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USER_ERROR

REPEATABLE = ("program_error", "out_of_memory")  # the same one twice at one step will not heal
_INFRA_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
_INFRA_WORDS = ("disk full", "No space left on device", "Read-only file system", "Input/output error")
_OOM_WORDS = ("OutOfMemoryError", "out of memory")  # the device's (torch.OutOfMemoryError); the host's: below
_HOST_MEMORY_WORDS = ("DefaultCPUAllocator: can't allocate memory", "Cannot allocate memory")
_GPU_WORDS = ("ECC error", "uncorrectable NVLink", "fallen off the bus", "ECC_UNCORRECTABLE", "ECCUncorrectable",
              "GPU is lost", "NVLink error")
_XID = re.compile(r"\bXid\b")
# What a rank posts when a collective broke under it (reliability/peer_loss.COMM_ERRORS, and torch's
# distributed error classes): read from the posted text, since another rank's exception is only its text.
_COMM_WORDS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Timed out", "timed out",
               "remote process exited", "NCCL error", "Broken pipe", "Socket Timeout", "DistNetworkError",
               "DistBackendError", "Connection refused")


@dataclass(frozen=True)
class Verdict:
    name: str
    retryable: bool
    cause: str = ""  # one line: what happened, where
    fix: str = ""  # one line: what to do
    rank: int | None = None  # the rank whose failure it was
    host: str | None = None
    step: int | None = None
    error: str = ""  # "Type: first line" of the exception, for the repeat rule

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, "") and k != "name"}


def of_stop(code: int, step: int) -> Verdict:
    """A clean end or a stop signal."""
    if code == 0:
        return Verdict("finished", False, step=step)
    if code == EXIT_PREEMPTED:
        return Verdict("preempted", True, "a stop signal: checkpointed and stopped", "rerun (or requeue) to resume",
                       step=step)
    if code == EXIT_INTERRUPTED:
        return Verdict("interrupted", False, "Ctrl-C", "rerun the same command to resume", step=step)
    return Verdict("program_error", True, f"exit {code}", "see the error printed above", step=step)


def of_failure(code: int, err: BaseException, posted: dict[str, Any] | None, rank: int, host: str, step: int) -> Verdict:
    """The verdict of a failed attempt, as this rank sees it. `posted`: the failure that stands for the
    job (fail-fast's record: rank, host, step, error), when another rank's came first. Classified by
    cause, whoever saw it first: a communication error posted by another rank is still a lost peer."""
    where = posted if posted and posted.get("rank") != rank else None
    text = str(where["error"]) if where else f"{type(err).__name__}: {_first_line(err)}"
    at = dict(rank=int(where["rank"]), host=str(where.get("host")), step=int(where.get("step") or 0)) if where else \
        dict(rank=rank, host=host, step=step)
    on = f"rank {at['rank']} on {at['host']}"
    if isinstance(err, Unhealthy):  # every rank raised it from the same gate: its hosts are the cause, not the raiser
        return Verdict("infrastructure", err.retryable, err.message, err.hint, host=",".join(err.hosts), step=step,
                       error=f"{Unhealthy.__name__}: {err.message}")
    if code == EXIT_HANG:
        return Verdict("hang", True, f"no progress at step {step}: a hang (stacks in run_dir/hang/)",
                       "read the hang report above; a restart resumes from the last checkpoint", **at, error=text)
    if (where is None and _is_infrastructure(err)) or any(w in text for w in _INFRA_WORDS):
        # A full disk stops the run with exit 2 (it will not free itself); an I/O error may pass.
        return Verdict("infrastructure", code != EXIT_USER_ERROR, text, "free space or fix the storage, then rerun",
                       **at, error=text)
    if (where is None and isinstance(err, Unavailable)) or text.startswith(f"{Unavailable.__name__}:"):
        return Verdict("infrastructure", True, f"{text} (seen by {on})",
                       "a restart retries it; if it persists, check the storage endpoint and the network", **at,
                       error=text)
    if code == EXIT_USER_ERROR or text.startswith(f"{UserError.__name__}:"):
        return Verdict("user_error", False, text, "fix the configuration or input the error names", **at, error=text)
    if any(w in text for w in _GPU_WORDS) or _XID.search(text):
        return Verdict("infrastructure", True, f"a GPU hardware error on {at['host']} (rank {at['rank']}): {text}",
                       f"a restart retries it; if it repeats on {at['host']}, drain that node (nvidia-smi -q -d ECC, "
                       f"Xid lines in its kernel log)", **at, error=text)
    if text.startswith("MemoryError:") or any(w in text for w in _HOST_MEMORY_WORDS) or \
            (where is None and isinstance(err, MemoryError)):
        # Not the repeat rule's: the memory another process on the node holds comes and goes. A job that
        # needs more than the node has fails every attempt without progress: the crash-loop limit stops it.
        return Verdict("infrastructure", True, f"{at['host']} ran out of host memory (rank {at['rank']}): {text}",
                       f"a restart retries it; if it repeats, see what else holds memory on {at['host']}, or use "
                       f"less (fewer DataLoader workers, a dataset not held in memory)", **at, error=text)
    if any(w in text for w in _OOM_WORDS):
        return Verdict("out_of_memory", True, text, "lower the batch size (or use fsdp / amp / grad_accum)", **at,
                       error=text)
    if (where is None and _is_comm(err)) or (where is not None and any(w in text for w in _COMM_WORDS)):
        return Verdict("lost_peer", True, f"{text} (seen first by {on})",
                       "a restart resumes; if it repeats, check the network and the nodes", **at, error=text)
    return Verdict("program_error", True, text, "fix the exception in the script's code (traceback above)", **at,
                   error=text)


def repeats(v: Verdict, previous: dict[str, Any] | None) -> bool:
    """The same failure (exception and step) as the previous attempt's end: it will not heal."""
    return (v.name in REPEATABLE and previous is not None and previous.get("verdict") == v.name
            and previous.get("error") == v.error and previous.get("step") == v.step)


def deterministic(v: Verdict) -> Verdict:
    return Verdict(v.name, False, f"{v.cause} (the same as the previous attempt, at the same step: deterministic)",
                   "fix it before rerunning; a restart fails the same way", v.rank, v.host, v.step, v.error)


def _first_line(err: BaseException) -> str:
    text = getattr(err, "message", None) or str(err)
    return text.splitlines()[0][:300] if text else ""


def _is_infrastructure(err: BaseException) -> bool:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _INFRA_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_comm(err: BaseException) -> bool:
    from .peer_loss import is_comm_error  # torch-free callers (status) never get here

    return bool(is_comm_error(err))
