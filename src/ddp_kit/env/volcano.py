"""Volcano Jobs (batch.volcano.sh), with or without the `pytorch` plugin: one pod per task replica.

What Volcano sets, from volcano-sh/volcano pkg/controllers/job/plugins:
  - env/env.go, env/const.go: VC_TASK_INDEX (and the older VK_TASK_INDEX), the pod's index in its task;
  - svc/svc.go, svc/const.go: each pod's hostname, its own name `<job>-<task>-<i>` (helpers.MakePodName)
    unless the task template sets one, and for every task T of the job VC_<T>_HOSTS (the pods'
    `hostname.subdomain` names, comma-joined, `<job>-<task>-<i>.<job>` by default; a template's hostname
    only once, whatever the replicas, and every pod of that task has it) and VC_<T>_NUM (how many names),
    T upper-cased with - as _;
  - distributed-framework/pytorch/pytorch.go: MASTER_ADDR (`<job>-master-0.<job>`), MASTER_PORT
    (23456 by default), WORLD_SIZE (master + worker replicas) and RANK (master 0, worker i is i + 1).
    The admission webhook adds the svc plugin to a job with the pytorch plugin.
The marks are VC_TASK_INDEX / VK_TASK_INDEX or a VC_<T>_HOSTS variable.

With the plugin, one process per pod: local rank 0 of 1, node rank = RANK. Without it, the ranks
are derived from the host lists every pod sees alike: tasks in a fixed order (a task named master
first, then by name), their hosts in order, rank = this pod's place in that list, found by HOSTNAME
(the pod's hostname, which the svc plugin set) or, in a job of one task, by VC_TASK_INDEX (the env
plugin's); rank 0's host the master, MASTER_PORT or the plugin's 23456 the port. What cannot be
derived (a task whose template sets a hostname, a HOSTNAME in no list and, with one task, no
VC_TASK_INDEX) is refused in one line, naming the plugin that would tell. Under torchrun in each pod,
torchrun's variables win and `around` names the engine.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from .base import DistEnv, int_var
from .pod import one_process_per_pod

NAME = "volcano"
ENGINE = "Volcano"
PLUGIN_PORT = 23456  # the pytorch plugin's default MASTER_PORT

_HOSTS = re.compile(r"VC_(.+)_HOSTS")
_HINT = ('add the pytorch plugin to the Volcano Job (`plugins: {pytorch: ["--master=master", "--worker=worker"]}`), '
         "or start the command under torchrun")
_ENV_HINT = ("add the `env` plugin to the Volcano Job (`plugins: {env: [], svc: []}`), which sets VC_TASK_INDEX, "
             "or the pytorch plugin, or start the command under torchrun")
_TEMPLATE_HINT = ("remove `hostname` from the task template (the svc plugin then lists every pod by its own name), "
                  "or add the pytorch plugin, or start the command under torchrun")


def _marked(environ: Mapping[str, str]) -> bool:
    return "VC_TASK_INDEX" in environ or "VK_TASK_INDEX" in environ or any(_HOSTS.fullmatch(k) for k in environ)


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This pod's place when its command runs without torchrun, else None."""
    if not _marked(environ) or "TORCHELASTIC_RUN_ID" in environ or "LOCAL_RANK" in environ:
        return None
    if "RANK" in environ and "WORLD_SIZE" in environ:  # the pytorch plugin
        return one_process_per_pod(int_var(environ, "RANK"), int_var(environ, "WORLD_SIZE"), environ.get("MASTER_ADDR"),
                                   int_var(environ, "MASTER_PORT", PLUGIN_PORT), NAME, ENGINE)
    tasks = _tasks(environ)
    index = _task_index(environ)
    if not tasks:
        if index:  # a replica beyond the first, with nothing that says who the others are
            raise UserError(f"this Volcano pod (task index {index}) has no VC_<task>_HOSTS to derive its rank from",
                            _HINT)
        return None  # one pod, say nothing: a single process
    _refuse_template_hostnames(tasks)
    hosts = [host for _, names in tasks for host in names]
    if len(hosts) == 1 and not index:
        return None  # one pod: a single process
    rank = _own_place(environ, tasks, index)
    return one_process_per_pod(rank, len(hosts), hosts[0], int_var(environ, "MASTER_PORT", PLUGIN_PORT), NAME, ENGINE)


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """Name the engine whatever started the ranks (torchrun in the pod, or a single process)."""
    return replace(env, engine=ENGINE, restarted_by_engine=True) if _marked(environ) else env


def _tasks(environ: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """Every task's hosts, the master task first and then by name; refuses a list shorter than its count."""
    tasks = []
    for key, value in environ.items():
        match = _HOSTS.fullmatch(key)
        if not match:
            continue
        task, names = match.group(1), [h for h in value.split(",") if h]
        count = int_var(environ, f"VC_{task}_NUM", len(names))
        if count != len(names):
            raise UserError(f"Volcano lists {len(names)} host(s) in {key} but VC_{task}_NUM={count}, so the ranks cannot "
                            "be derived", _HINT)
        tasks.append((task, names))
    return sorted(tasks, key=lambda t: (t[0] != "MASTER", t[0]))


def _task_index(environ: Mapping[str, str]) -> int | None:
    """The env plugin's index of this pod in its task; None without the env plugin."""
    for key in ("VC_TASK_INDEX", "VK_TASK_INDEX"):
        if environ.get(key):
            return int_var(environ, key)
    return None


def _task_name(key_part: str) -> str:
    return key_part.lower().replace("_", "-")  # task names are DNS labels: the svc plugin wrote - as _


def _refuse_template_hostnames(tasks: list[tuple[str, list[str]]]) -> None:
    """A task whose template sets `hostname` is listed once (GenerateHosts stops after the first), and all
    its pods carry that hostname: neither the count nor a pod's place can be read, pod 0's included."""
    for task, names in tasks:
        first = names[0].split(".")[0] if names else ""
        if len(names) == 1 and not first.endswith(f"-{_task_name(task)}-0"):  # not `<job>-<task>-0`
            raise UserError(f"Volcano task {_task_name(task)} sets hostname {first!r} in its template, so the svc "
                            f"plugin lists one host for all its pods (VC_{task}_HOSTS={names[0]}) and no pod's rank "
                            "can be derived", _TEMPLATE_HINT)


def _own_place(environ: Mapping[str, str], tasks: list[tuple[str, list[str]]], index: int | None) -> int:
    """This pod's place in the tasks' host lists: in a job of one task its index there when the env
    plugin says it, else the place of its hostname (the svc plugin's, the pod's own name)."""
    if len(tasks) == 1 and index is not None:
        if not 0 <= index < len(tasks[0][1]):
            raise UserError(f"VC_TASK_INDEX={index} is outside the {len(tasks[0][1])} host(s) of task "
                            f"{_task_name(tasks[0][0])}", _HINT)
        return index
    me = environ.get("HOSTNAME", "").split(".")[0]
    place = 0
    for _, names in tasks:
        for name in names:
            if me and name.split(".")[0] == me:
                return place
            place += 1
    if len(tasks) == 1:  # without the env plugin: every pod would take index 0 and host its own store
        raise UserError(f"this Volcano pod (HOSTNAME={me or 'unset'}) is not in VC_{tasks[0][0]}_HOSTS and has no "
                        "VC_TASK_INDEX, so its rank cannot be derived", _ENV_HINT)
    raise UserError(f"this Volcano pod (HOSTNAME={me or 'unset'}) is not in the host lists of tasks "
                    f"{', '.join(_task_name(t) for t, _ in tasks)}, so its rank cannot be derived", _HINT)
