"""The distributed context: process-group setup and teardown, backend and device choice, rank helpers.

`distributed()` is the one way in. It binds the device before init, picks the backend, creates
the process group from the detected launcher (world size 1 included: an in-memory store, no port,
so two debug runs never collide) and always destroys it, on success and on error.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch.torch_version import TorchVersion

from .adopt import adopt, forget_ours, group_backend, leave, mark_ours, say_joined
from ..env import DistEnv, check_gpus, detect
from ..errors import UserError
from ..exit_codes import EXIT_USER_ERROR
from .failfast import LINGER_S, FailFast, announce, post
from .reach import wait_for_master
from .rounds import round_prefix
from .resources import apply_cpu_settings

# NCCL's flight recorder dumps are named <prefix><rank>, torch's own naming (its dump on timeout
# writes there too, see nccl_defaults), which fr_trace parses: it infers the prefix from names
# ending in the rank, and reads the rank as int(name[len(prefix):]).
# The watchdog reads the same files.
FR_PREFIX = "nccl_trace_rank_"


@dataclass(frozen=True)
class DistContext:
    """What every library function needs to know about this process; passed explicitly."""

    env: DistEnv
    device: torch.device
    backend: str
    # The rendezvous store: lives outside the process group, so it answers while a collective hangs.
    # None at world size 1 (nothing to tell anyone).
    store: Any = field(default=None, compare=False)
    timeout_s: float = 600.0
    failfast: Any = field(default=None, compare=False)  # FailFast: `quiet()` it before handling a failure
    # ddp_kit's own collectives (agreement, preemption flag, log numbers, rank metrics, sync-check
    # tables) run on this CPU (gloo) group beside an NCCL default group: small tensors in host memory,
    # so they never queue behind the GPU's work nor make the host wait for it. None: the default group.
    control_group: Any = field(default=None, compare=False)
    # Set by whoever handles this process's failure: the teardown then aborts NCCL's communicators
    # (destroying them waits for work a failed collective never finishes).
    failing: threading.Event = field(default_factory=threading.Event, compare=False)
    # The prefix of this rendezvous round's keys in the store (rounds.py), for helper connections.
    store_prefix: str = field(default="", compare=False)

    def store_client(self) -> tdist.Store | None:
        """A connection of its own to the rendezvous store, for a helper thread: a TCPStore client
        serves one request at a time, so a thread sharing the main thread's connection would wait
        behind its blocking `wait()`s (a checkpoint commit, a rendezvous)."""
        return client_store(self.env, self.timeout_s, self.store_prefix)

    @property
    def control_device(self) -> torch.device:
        """Where small control tensors go for a collective: host memory, except on an NCCL default
        group without a CPU side group (NCCL only moves GPU tensors)."""
        return self.device if self.backend == "nccl" and self.control_group is None else torch.device("cpu")

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def choose_device(env: DistEnv, device: str = "auto", bound: bool = False) -> torch.device:
    """cuda:<local_rank> when CUDA is there (or asked for), else cpu. "cuda:<i>" puts every rank of the
    node on GPU i (with backend gloo: NCCL refuses two ranks on one GPU), e.g. to test on one GPU.
    `bound`: whoever created the process group may have bound this process to its GPU already
    (torch.cuda.set_device, as Ray Train does): that GPU is kept."""
    if device == "cpu":
        return torch.device("cpu")
    hint = env.device_hint or ""
    if device in ("auto", "cuda") and hint.startswith("cuda:") and hint[5:].isdigit() and torch.cuda.is_available():
        if int(hint[5:]) < torch.cuda.device_count():  # the engine's own assignment (env.device_hint)
            return torch.device(hint)
    if bound and device in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    if device.startswith("cuda:") and device[5:].isdigit():
        if not torch.cuda.is_available() or int(device[5:]) >= torch.cuda.device_count():
            raise UserError(f"device={device} was asked for but only {torch.cuda.device_count()} GPU(s) are visible",
                            "use device auto, or run `python -m ddp_kit.doctor` to see why", local=True)
        return torch.device(device)
    if device in ("auto", "cuda"):
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if count == 1 and env.local_world_size > 1 and env.scheduler_binds_gpus:
                return torch.device("cuda", 0)  # the scheduler bound one GPU to each task (--gpu-bind=single:1)
            if env.local_rank >= count:
                raise UserError(
                    f"local rank {env.local_rank} has no GPU: only {count} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                    "launch at most one process per GPU (--nproc_per_node / --ntasks-per-node)", rank=env.rank)
            return torch.device("cuda", env.local_rank)
        if device == "cuda":
            raise UserError("device=cuda was asked for but torch.cuda.is_available() is False",
                            "run `python -m ddp_kit.doctor` to see why, or use device cpu", local=True)
        return torch.device("cpu")
    raise UserError(f"unknown device {device!r}", "use auto, cpu or cuda")


def check_layout(env: DistEnv, device: torch.device, environ=None) -> None:
    """Refuse GPU layouts that would mis-assign GPUs, before any rendezvous; warn about waste.
    (Whether the master host can be reached is reach.wait_for_master's: a bounded wait, not a check.)"""
    environ = os.environ if environ is None else environ
    if device.type != "cuda":
        return
    for warning in check_gpus(env, torch.cuda.device_count(), environ):  # the launcher's own layout rules
        print(f"ddp_kit: warning: {warning}", file=sys.stderr, flush=True)


def choose_backend(device: torch.device, backend: str = "auto", shared_gpu: bool = False) -> str:
    """`shared_gpu`: every rank of the node was put on one GPU (device="cuda:<i>"), which NCCL refuses."""
    if shared_gpu and backend == "nccl":
        raise UserError(f"device={device} puts several ranks on one GPU, which NCCL refuses",
                        "use backend gloo (or auto) with a shared GPU, or device auto for one GPU per rank", local=True)
    if backend == "auto":
        return "nccl" if device.type == "cuda" and not shared_gpu else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("backend nccl needs CUDA devices but this run is on cpu", "use backend gloo (or auto)",
                        local=True)
    return backend


def client_store(env: DistEnv, timeout_s: float, prefix: str) -> tdist.Store | None:
    """A new client connection to the job's store, seeing the keys under `prefix` (this round's:
    DistContext.store_prefix); None at world size 1."""
    if env.world_size == 1:
        return None
    store = tdist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                           timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return tdist.PrefixStore(prefix, store)


def hosts_store(env: DistEnv) -> bool:
    """True for the process whose exit takes the store down: rank 0, unless the launcher's agent hosts it."""
    return env.world_size > 1 and env.rank == 0 and not env.agent_store


def _make_store(env: DistEnv, timeout: timedelta, owned: bool = True) -> tuple[tdist.Store, str]:
    """The rendezvous store for the default group (a client of it for an adopted group), seen under
    the prefix of this rendezvous round, and that prefix.

    Under torchrun the agent shares its own rendezvous TCPStore with the workers, and it outlives a
    round: restarted workers would read the previous round's gloo addresses from it and hang
    (pytorch#135712). A prefix per round gives each round fresh keys; the ranks agree on it through
    the store (rounds.py), since the restart count each is told is its own agent's (pytorch#108158).
    """
    if env.world_size == 1:
        return tdist.HashStore(), ""
    host = owned and hosts_store(env)
    store = tdist.TCPStore(
        host_name=env.master_addr,
        port=env.master_port,
        world_size=env.world_size,
        is_master=host,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=host,
    )
    prefix = round_prefix(store, env.rank, env.world_size, timeout.total_seconds())
    return tdist.PrefixStore(prefix, store), prefix


@contextmanager
def distributed(env: DistEnv | None = None, backend: str = "auto", device: str = "auto",
                timeout_s: float = 600.0, dump_dir: str | None = None,
                side_group: bool | None = None, fail_fast: bool = False) -> Iterator[DistContext]:
    """Set up this process's place in the job; tear it down on the way out, whatever happens.

    `dump_dir`: where NCCL's flight recorder writes its trace when a collective times out.
    `side_group`: run ddp_kit's control collectives on a CPU gloo group of their own (None: exactly
    when the default group is NCCL, where a control collective would otherwise cost device syncs).
    `fail_fast`: end this process (exit code 1, after one line naming the rank at fault) as soon as
    another rank posts a failure in the rendezvous store, and post this rank's own rendezvous failure
    there; a thread polls the store from before the rendezvous until teardown (failfast.py).
    Off by default, since it may end the caller's process from a thread: `ddp_kit.init` turns it on.

    A default group that already exists (Ray Train's, or the caller's own init_process_group) is
    adopted rather than refused (adopt.py): its rank, world size and backend stand, ddp_kit adds
    its side group and its store traffic, and leaves the group itself to its owner at exit.
    """
    env = detect() if env is None else env
    _say_notes(env)
    owned = not tdist.is_initialized()  # else Ray Train, a framework or the user's own script made it
    env = env if owned else adopt(env)
    dev = choose_device(env, device, bound=not owned)
    be = _backend(env, dev, backend, device, owned)
    check_layout(env, dev)
    timeout_s = _startup_budget(env, timeout_s, owned)
    _prepare_process(env, dev, be, dump_dir)
    with _group(env, dev, be, timeout_s, side_group, fail_fast, owned) as ctx:
        yield ctx


def _say_notes(env: DistEnv) -> None:
    if env.rank == 0:
        for note in env.notes:  # what detection wants said once (e.g. an interactive srun shell)
            print(f"ddp_kit: warning: {note}", file=sys.stderr, flush=True)


def _backend(env: DistEnv, dev: torch.device, backend: str, device: str, owned: bool) -> str:
    """The backend asked for (auto: by the device); an adopted group's own backend stands."""
    # A scheduler's per-task binding shows each task only its own GPU: cuda:0 is then not shared
    own_gpu = env.scheduler_binds_gpus and dev.type == "cuda" and torch.cuda.device_count() == 1
    be = choose_backend(dev, backend, shared_gpu=device.startswith("cuda:") and env.local_world_size > 1 and not own_gpu)
    return be if owned else group_backend(be, dev)


def _startup_budget(env: DistEnv, timeout_s: float, owned: bool) -> float:
    """The rendezvous timeout left once the master answers. Its name and store may appear seconds
    after this process (a Kubernetes pod's DNS record): wait for them, quietly and bounded, out of
    the same budget, unless the group's members (or the launcher's agents) met already."""
    if not owned or env.rendezvous_by_launcher:
        return timeout_s
    return max(1.0, timeout_s - wait_for_master(env, timeout_s, connects=not hosts_store(env)))


def _prepare_process(env: DistEnv, dev: torch.device, be: str, dump_dir: str | None) -> None:
    if be == "nccl":
        nccl_defaults(dump_dir)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before init, so NCCL never touches GPU 0 from every rank
    apply_cpu_settings(env, dev)


@contextmanager
def _group(env: DistEnv, dev: torch.device, be: str, timeout_s: float, side_group: bool | None,
           fail_fast: bool, owned: bool) -> Iterator[DistContext]:
    """One path for a default group made here (`owned`) or adopted: ddp_kit's store, fail-fast and
    side group beside it, the context, and the teardown its owner flag decides: a group made here is
    destroyed (aborted after an NCCL failure); an adopted one is left to its creator (adopt.leave)."""
    timeout = timedelta(seconds=timeout_s)
    with _rendezvous(env, timeout_s, fail_fast, owned) as joining:
        # Made here: the group's own store. Adopted: a connection of ddp_kit's own to the group's store.
        joining.store, prefix = _make_store(env, timeout, owned)
        if fail_fast:
            joining.failfast = FailFast(lambda: client_store(env, timeout_s, prefix), env.rank, env.world_size,
                                        linger_s=LINGER_S if hosts_store(env) else 0.0).start()
        if owned:
            _init_process_group(env, dev, be, joining.store, timeout)
        control = _side_group(env, be, timeout, side_group)
    ctx = DistContext(env=env, device=dev, backend=be, store=joining.store if env.world_size > 1 else None,
                      timeout_s=timeout_s, failfast=joining.failfast, control_group=control, store_prefix=prefix)
    if not owned:
        say_joined(env, be)
    failed = True
    try:
        yield ctx
        failed = False
    finally:
        if ctx.failfast:
            ctx.failfast.stop()
        if owned:
            teardown(abort=(failed or ctx.failing.is_set()) and be == "nccl")
        else:
            leave(control, failed)


@dataclass
class _Joining:
    """What a rendezvous made so far: its failure is posted to the store, and fail-fast quieted."""

    store: Any = None
    failfast: FailFast | None = None


@contextmanager
def _rendezvous(env: DistEnv, timeout_s: float, fail_fast: bool, owned: bool) -> Iterator[_Joining]:
    """Bound a rendezvous made here and turn its failure into one line (posted for the others with
    `fail_fast`). Every wait is bounded: a client connected to a foreign program on the port (or
    waiting for a rank that never comes) would otherwise wait with no end and no word. An adopted
    group's members met already: nothing to bound."""
    joining = _Joining()
    if not owned:
        yield joining
        return
    deadline = threading.Timer(timeout_s, _rendezvous_timed_out, args=(env, timeout_s))
    deadline.daemon = True
    deadline.start()
    try:
        yield joining
    except UserError:
        raise
    except Exception as exc:  # rendezvous failures are user-fixable far more often than not
        raise _join_failed(env, exc, joining, fail_fast) from exc
    finally:
        deadline.cancel()


def _init_process_group(env: DistEnv, dev: torch.device, be: str, store: tdist.Store, timeout: timedelta) -> None:
    kwargs: dict[str, Any] = {}
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    tdist.init_process_group(be, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    mark_ours()


def _side_group(env: DistEnv, be: str, timeout: timedelta, side_group: bool | None) -> Any:
    """ddp_kit's CPU (gloo) group for its control collectives, or None (the default group serves)."""
    side = (be == "nccl") if side_group is None else side_group
    return tdist.new_group(backend="gloo", timeout=timeout) if side and env.world_size > 1 else None


def _join_failed(env: DistEnv, exc: Exception, joining: _Joining, fail_fast: bool) -> UserError:
    err = UserError(
        f"could not join the process group at {env.master_addr}:{env.master_port} as rank {env.rank}/{env.world_size}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
        "check that every rank can reach MASTER_ADDR:MASTER_PORT, or run `python -m ddp_kit.doctor`",
        rank=env.rank)
    if joining.failfast:
        joining.failfast.quiet()
    if fail_fast:  # the others' fail-fast threads read why, and stop
        post(joining.store, env.rank, 0, "startup", err)
        err.posted = True  # the CLI need not announce it again
        if hosts_store(env):
            time.sleep(LINGER_S)  # keep the store up until the others have read why
    return err


def _rendezvous_timed_out(env: DistEnv, timeout_s: float) -> None:
    print(UserError(f"the rendezvous at {env.master_addr}:{env.master_port} did not complete within init_timeout_s "
                    f"{timeout_s:g}s as rank {env.rank}/{env.world_size}",
                    "another program may hold that port (a stale job?) or a rank never started; use a free "
                    "MASTER_PORT/--rdzv_endpoint port and check that every rank was launched",
                    rank=env.rank).at(env.rank).line(), file=sys.stderr, flush=True)
    os._exit(EXIT_USER_ERROR)


def nccl_defaults(dump_dir: str | None, environ=None, torch_version=None) -> dict[str, str]:
    """The flight recorder on by default (a user's own setting wins); returns what was set.
    TORCH_NCCL_ASYNC_ERROR_HANDLING keeps torch's own default (3: tear down without aborting the
    communicator, since an abort can itself hang); the hang watchdog writes the trace to run_dir/hang
    itself (watchdog.py), named as NCCL's own dump on timeout names it there.

    From torch 2.11 on the recorder keeps 2000 entries unless told otherwise, and reads its settings
    as TORCH_FR_*: the old TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE still work
    but print a deprecation warning on every rank, so there only the dump folder is set, under its
    new name. An older torch gets the old names, which it reads (and a buffer, which it may lack).

    These are read by the NCCL process group of this process when it is created, so they are set
    in our own environment just before init; nothing else here writes the environment."""
    environ = os.environ if environ is None else environ
    fr_names = TorchVersion(torch.__version__ if torch_version is None else torch_version) >= "2.11.0a0"
    defaults = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if not fr_names and "TORCH_FR_BUFFER_SIZE" not in environ:
        defaults["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"
    temp_file = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    # the folder is made after run_dir is checked (a read-only run_dir is one line, not a traceback)
    if dump_dir and not any(k in environ for k in temp_file):
        defaults[temp_file[0] if fr_names else temp_file[1]] = os.path.join(os.path.abspath(dump_dir), FR_PREFIX)
    out = {k: v for k, v in defaults.items() if k not in environ}
    environ.update(out)
    return out


def teardown(abort: bool = False) -> None:
    """Destroy the default group. Collecting garbage first frees DDP's reducer before the group
    goes, which avoids a SIGABRT at exit seen with some torch releases (pytorch#190489).

    `abort` (an NCCL job leaving on an error): abort the communicators instead. Destroying waits for
    their pending work, which after a failed or hung collective never finishes."""
    gc.collect()
    if tdist.is_available() and tdist.is_initialized():
        forget_ours()
        try:
            if abort:
                tdist.distributed_c10d._abort_process_group()
                return
            tdist.destroy_process_group()
        except Exception as exc:  # a broken group must not hide the error that broke it
            print(f"ddp_kit: warning: destroying the process group failed: {exc}", file=sys.stderr)
