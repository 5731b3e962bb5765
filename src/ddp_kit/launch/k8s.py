"""Kubernetes: render a TrainJob (Kubeflow Trainer v2), a PyTorchJob (training operator v1) or a Volcano Job
from templates/k8s/ (package data), and apply it with kubectl (or print it with --dry_run).

Every engine gets the same pod: the ddp_kit entrypoint as PID 1 (templates/k8s/pod.sh: forwards SIGTERM,
maps exit 75, and on PyTorchJob the retryable failures 1 and 3, to the engine's "restart me"), a PVC mounted above run_dir, the GPUs asked for,
terminationGracePeriodSeconds = DDP_KIT_GRACE_PERIOD_S (ddp_kit compares its checkpoint time with it).
Each engine's template says, with the source it was learned from, which environment it sets and how
its restart policy reads the exit codes.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from ..errors import UserError
from ..exit_codes import EXIT_PREEMPTED, EXIT_USER_ERROR  # torch-free: rendering does not import torch

ENGINES = ("trainjob", "pytorchjob", "volcano")
K8S_LAYOUTS = ("torchrun", "process")
# PyTorchJob's ExitCode policy retries only 128-255 (training-operator pkg/util/train IsRetryableExitCode:
# exitCode >= 128); 75 + 128 sits above every 128 + signal number (<= 192), and so do the retryable
# failures 1 (crashed, lost peer, infrastructure) and 3 (hung) moved up by 192: 193 and 195.
PYTORCHJOB_PREEMPTED_EXIT = EXIT_PREEMPTED + 128
PYTORCHJOB_RETRYABLE_OFFSET = 192
GRACE_ENV = "DDP_KIT_GRACE_PERIOD_S"
TRAINJOB_PORT = 29500  # the torch plugin's constants.ContainerTrainerPort: fixed, not configurable
TEMPLATES = Path(__file__).resolve().parent / "templates" / "k8s"
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035 label: pod hostnames are built from it
_QUANTITY = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti)$")  # a binary Kubernetes quantity: what a sizeLimit takes here


@dataclass(frozen=True)
class K8sJob:
    """What the flags ask for, checked: one value for every template."""
    engine: str
    layout: str
    nodes: int
    nproc_per_node: int
    gpus_per_node: int | None
    image: str
    pvc: str
    run_dir: str
    mount_path: str
    grace_period_s: int
    name: str
    namespace: str | None
    port: int
    max_restarts: int
    max_preemptions: int
    train_args: tuple[str, ...]
    shm_size: str = "16Gi"  # the pod's /dev/shm (DataLoader workers, the memory tier): counted in its memory
    launch_id: str = ""  # DDP_KIT_LAUNCH_ID: new for each rendering (a submission), kept by the engine's restarts


def _positive(flag: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"--{flag} {value!r} is not a whole number >= {minimum}", f"pass e.g. --{flag} {max(minimum, 1)}")
    return value


def check(engine: str, layout: str, nodes, nproc_per_node, gpus_per_node, image, pvc, run_dir, mount_path,
          grace_period_s, name, namespace, port, max_restarts, max_preemptions, train_args,
          shm_size: str = "16Gi") -> K8sJob:
    """The flags as a K8sJob, or a UserError naming the first flag at fault."""
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}", f"use --engine {' or '.join(ENGINES)}")
    if layout not in K8S_LAYOUTS:
        raise UserError(f"unknown layout {layout!r}", f"use --layout {' or '.join(K8S_LAYOUTS)}")
    if engine == "trainjob" and layout != "torchrun":
        raise UserError("a TrainJob always runs torchrun in each pod (the runtime's torch plugin)",
                        "drop --layout process, or use --engine pytorchjob or volcano for one process per pod")
    nodes = _positive("nodes", nodes)
    gpus = None if gpus_per_node is None else _positive("gpus_per_node", gpus_per_node)
    nproc = _positive("nproc_per_node", nproc_per_node if nproc_per_node is not None else gpus or 1)
    if layout == "process" and (nproc != 1 or (gpus or 1) != 1):
        raise UserError(f"--layout process runs one rank per pod, but {nproc} ranks / {gpus} GPUs per pod were asked",
                        "use --layout torchrun for several GPUs per pod, or --gpus_per_node 1")
    if gpus is not None and nproc != gpus:
        raise UserError(f"--nproc_per_node {nproc} differs from --gpus_per_node {gpus}: each rank drives one GPU",
                        f"drop --nproc_per_node, or pass --nproc_per_node {gpus}")
    for flag, value in (("image", image), ("pvc", pvc), ("run_dir", run_dir)):
        if not value or not isinstance(value, str):
            raise UserError(f"--{flag} is required", f"pass --{flag} {'/mnt/ckpt/run' if flag == 'run_dir' else '...'}")
    if not _NAME.match(pvc):
        raise UserError(f"--pvc {pvc!r} is not a valid PersistentVolumeClaim name", "use lower-case letters, digits and '-'")
    run = PurePosixPath(run_dir)
    if not run.is_absolute() or ".." in run.parts or "{" in run_dir:
        raise UserError(f"--run_dir {run_dir!r} must be an absolute path in the pod", "pass e.g. --run_dir /mnt/ckpt/run")
    mount = PurePosixPath(mount_path) if mount_path else run.parent
    if not mount.is_absolute() or str(mount) == "/" or (mount != run and mount not in run.parents):
        raise UserError(f"--mount_path {str(mount)!r} must be a folder above --run_dir {run_dir} (not /)",
                        f"pass --mount_path {run.parent if str(run.parent) != '/' else run}")
    grace = _positive("grace_period_s", grace_period_s)
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(f"--name {name!r} is not an RFC 1035 label", "use lower-case letters, digits and '-', starting with a letter")
    # The longest pod hostname the engine derives from the name must still be a DNS label (63 characters).
    suffix = f"-node-0-{nodes - 1}" if engine == "trainjob" else f"-worker-{max(nodes - 2, 0)}"
    if len(name) + len(suffix) > 63:
        raise UserError(f"--name {name!r} is too long: pod hostnames like {name}{suffix} exceed 63 characters",
                        f"use at most {63 - len(suffix)} characters")
    if namespace is not None and (not isinstance(namespace, str) or not _NAME.match(namespace)):
        raise UserError(f"--namespace {namespace!r} is not a valid namespace name", "use lower-case letters, digits and '-'")
    port = _positive("port", port)
    if engine == "trainjob" and port != TRAINJOB_PORT:
        raise UserError(f"--port {port}: a TrainJob's torch plugin always uses port {TRAINJOB_PORT}", "drop --port")
    train_args = tuple(str(a) for a in train_args)
    given = [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--run_dir"]
    given += [a.split("=", 1)[1] for a in train_args if a.startswith("--run_dir=")]
    if any(g != run_dir for g in given):
        raise UserError(f"the training arguments set --run_dir {given[0]}, the launcher --run_dir {run_dir}",
                        "give --run_dir once, before the --")
    if not given:
        train_args += ("--run_dir", run_dir)
    if not isinstance(shm_size, str) or not _QUANTITY.match(shm_size):
        raise UserError(f"--shm_size {shm_size!r} is not a size like 16Gi", "pass e.g. --shm_size 16Gi (Ki, Mi, Gi or Ti)")
    return K8sJob(engine, layout, nodes, nproc, gpus, image, pvc, run_dir, str(mount), grace, name, namespace, port,
                  _positive("max_restarts", max_restarts, 0), _positive("max_preemptions", max_preemptions, 0),
                  train_args, shm_size)


def _script(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        raise UserError(f"the Kubernetes template {name} is missing from the installed package ({path})",
                        "reinstall ddp_kit (pip install --force-reinstall ddp_kit)")
    return path.read_text()


def launcher(job: K8sJob) -> list[str]:
    """What pod.sh runs: ddp_kit.train itself (process layout), or torchrun starting it per rank through rank.sh."""
    train = ["python", "-m", "ddp_kit.train", *job.train_args]
    if job.layout == "process":
        return train
    torchrun = ["python", "-m", "torch.distributed.run"]
    if job.engine == "volcano":
        # Volcano's pytorch plugin sets no PET_* variables; Kubernetes expands $(VAR) in args from the
        # container's environment, which the plugin fills before the pod is created.
        torchrun += ["--nnodes=$(WORLD_SIZE)", "--node_rank=$(RANK)", "--master_addr=$(MASTER_ADDR)",
                     "--master_port=$(MASTER_PORT)", f"--nproc_per_node={job.nproc_per_node}"]
    # TrainJob and PyTorchJob pass nnodes, node_rank, nproc_per_node and the master as PET_* (torchrun reads them).
    return [*torchrun, "--no-python", "sh", "-c", _script("rank.sh"), "ddp_kit-rank", *train]


def preempted_exit(engine: str) -> int:
    return PYTORCHJOB_PREEMPTED_EXIT if engine == "pytorchjob" else EXIT_PREEMPTED


def retryable_offset(engine: str) -> int:
    """What pod.sh adds to the retryable failures 1 and 3: only an engine that retries only codes >= 128 needs it."""
    return PYTORCHJOB_RETRYABLE_OFFSET if engine == "pytorchjob" else 0


def container(job: K8sJob, name: str, with_command: bool = True) -> dict:
    """The training container, the same on every engine but for its name (each operator looks for its own)."""
    env = [{"name": GRACE_ENV, "value": str(job.grace_period_s)}]
    if job.launch_id:
        # A new submission under the same job name is a new launch (dist/launch_token.py): a deterministic
        # failure or a crash loop of the previous one does not refuse it; the engine's restarts keep the id.
        env.append({"name": "DDP_KIT_LAUNCH_ID", "value": job.launch_id})
    if job.layout == "torchrun":
        # torchrun gives its workers 30 s after forwarding SIGTERM, then SIGKILLs them: give them the grace period.
        env.append({"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(job.grace_period_s)})
    out: dict = {"name": name, "image": job.image}
    if with_command:
        out["command"] = ["sh", "-c", _script("pod.sh"), "ddp_kit-pod", str(preempted_exit(job.engine)),
                          str(retryable_offset(job.engine))]
        out["args"] = launcher(job)
    out["env"] = env
    if job.gpus_per_node:
        out["resources"] = gpu_resources(job)
    out["volumeMounts"] = [{"name": "ckpt", "mountPath": job.mount_path},
                           {"name": "dshm", "mountPath": "/dev/shm"}]
    return out


def gpu_resources(job: K8sJob) -> dict:
    # An extended resource's request defaults to its limit, and may not differ from it.
    return {"limits": {"nvidia.com/gpu": str(job.gpus_per_node)}}  # a quantity: a string in the API


def pod_spec(job: K8sJob, containers: list[dict], restart_policy: str | None = "Never") -> dict:
    spec: dict = {}
    if restart_policy:
        # A failed pod must stay failed: the engine decides about restarts from its exit code, not the kubelet.
        spec["restartPolicy"] = restart_policy
    spec["terminationGracePeriodSeconds"] = job.grace_period_s
    spec["containers"] = containers
    spec["volumes"] = [
        # run_dir lives on this claim: every pod, and every restart, sees the same checkpoints.
        {"name": "ckpt", "persistentVolumeClaim": {"claimName": job.pvc}},
        # DataLoader workers pass batches through /dev/shm, which is 64 MiB in a container by default, and the
        # memory tier keeps its copies there. Its pages count against the pod's memory; with a sizeLimit the tmpfs
        # is that size, so the tier's room check sees the limit (without one it sees the node's memory).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
    ]
    return spec


def metadata(job: K8sJob, name: str) -> dict:
    out = {"name": name}
    if job.namespace:
        out["namespace"] = job.namespace
    out["labels"] = {"app.kubernetes.io/name": job.name, "app.kubernetes.io/managed-by": "ddp_kit"}
    return out


def _trainjob_values(job: K8sJob) -> dict:
    runtime = f"{job.name}-runtime"
    pod_failure_policy = {"rules": [
        {"action": "Ignore", "onExitCodes": {"containerName": "node", "operator": "In", "values": [EXIT_PREEMPTED]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": [EXIT_USER_ERROR]}},
    ]}
    # The command and args go in the TrainJob (trainer.command overrides the runtime's); the rest of the pod here.
    node = container(job, "node", with_command=False)
    full = container(job, "node")
    values = {"metadata_runtime": metadata(job, runtime), "runtime_name": runtime,
              "pod_failure_policy": pod_failure_policy, "pod_template": {"spec": pod_spec(job, [node])},
              "metadata": metadata(job, job.name), "nproc_per_node": job.nproc_per_node,
              "image": job.image, "command": full["command"], "args": full["args"],
              "resources_per_node": {"resourcesPerNode": gpu_resources(job)} if job.gpus_per_node else None}
    return values


def _pytorchjob_values(job: K8sJob) -> dict:
    def replica(replicas: int) -> dict:
        c = container(job, "pytorch")  # the operator reads exit codes and ports of the container named pytorch
        c["ports"] = [{"name": "pytorchjob-port", "containerPort": job.port}]
        return {"replicas": replicas, "restartPolicy": "ExitCode",
                "template": {"spec": pod_spec(job, [c], restart_policy=None)}}

    specs = {"Master": replica(1)}
    if job.nodes > 1:
        specs["Worker"] = replica(job.nodes - 1)
    return {"metadata": metadata(job, job.name), "nproc_per_node_str": str(job.nproc_per_node),
            "backoff_limit": job.max_restarts + job.max_preemptions, "replica_specs": specs}


def _volcano_values(job: K8sJob) -> dict:
    def task(name: str, replicas: int) -> dict:
        return {"name": name, "replicas": replicas,
                "template": {"spec": pod_spec(job, [container(job, "ddp-kit")])}}

    tasks = [task("master", 1)] + ([task("worker", job.nodes - 1)] if job.nodes > 1 else [])
    return {"metadata": metadata(job, job.name), "backoff_limit": job.max_restarts + job.max_preemptions,
            "tasks": tasks}


LAYOUT_DOCS = {
    "process": "one process per pod (ddp_kit.train is the rank; RANK and WORLD_SIZE come from the engine).",
    "torchrun": "torchrun in each pod starts the ranks.",
}
_VALUES = {"trainjob": _trainjob_values, "pytorchjob": _pytorchjob_values, "volcano": _volcano_values}


def render_k8s(job: K8sJob, command_line: str) -> str:
    """The manifest for job: templates/k8s/<engine>.yaml with its ${...} filled in."""
    values = {"name": job.name, "nodes": job.nodes, "layout": job.layout, "layout_doc": LAYOUT_DOCS[job.layout],
              "port": job.port, "max_restarts": job.max_restarts, "preempted_exit": preempted_exit(job.engine),
              "command_line": command_line, **_VALUES[job.engine](job)}
    return fill(_script(f"{job.engine}.yaml"), values)


class _Dumper(yaml.SafeDumper):
    """Block style, list items indented under their key, scripts as literal blocks (what kubectl shows back)."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


# Plain scalars that some YAML reader takes for a number, a bool or null. PyYAML quotes what *it* would read so, but
# kubectl's reader (go-yaml) also takes 3e-4 for a float, and an args list holding a number is refused by the API.
_AMBIGUOUS = re.compile(r"[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?|0[xXoO][0-9a-fA-F_]+|[-+]?\.(inf|Inf|INF)"
                        r"|\.(nan|NaN|NAN)|[yYnN~]|yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF"
                        r"|null|Null|NULL|")


def _represent_str(dumper: yaml.SafeDumper, s: str):
    style = "|" if "\n" in s else "'" if _AMBIGUOUS.fullmatch(s) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


_Dumper.add_representer(str, _represent_str)
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def fill(text: str, values: dict) -> str:
    """Replace ${key}: a line that is only `${key}` or `key: ${key}` takes a mapping or list as a YAML block at its
    indentation (None drops the line); anywhere else the value goes in inline, as JSON (which YAML reads)."""
    out = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        body = line.strip()
        whole = re.fullmatch(r"(?:([\w.-]+): )?\$\{(\w+)\}", body)
        if whole and isinstance(values[whole.group(2)], (dict, list, type(None))):
            value = values[whole.group(2)]
            if value is None:
                continue
            if whole.group(1):
                out.append(" " * indent + whole.group(1) + ":")
                indent += 2
            block = yaml.dump(value, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 16)
            out += [(" " * indent + b) if b else b for b in block.rstrip("\n").splitlines()]
            continue
        comment = body.startswith("#")
        out.append(_PLACEHOLDER.sub(lambda m, comment=comment: _inline(values[m.group(1)], comment), line))
    return "\n".join(out) + "\n"


def _inline(value, comment: bool) -> str:
    if comment or isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value)


def k8s(*train_args: str, engine: str = "trainjob", layout: str = "torchrun", nodes: int = 1,
        nproc_per_node: int | None = None, gpus_per_node: int | None = None, image: str | None = None,
        pvc: str | None = None, run_dir: str | None = None, mount_path: str | None = None,
        grace_period_s: int = 120, name: str = "ddp-kit", namespace: str | None = None, port: int = 29500,
        max_restarts: int = 3, max_preemptions: int = 20, shm_size: str = "16Gi", dry_run: bool = False,
        out_dir: str = ".ddp_kit", launch_id: str | None = None) -> None:
    """Render templates/k8s/<engine>.yaml and apply it with kubectl (or print it with --dry_run).
    `launch_id`: this submission's identity (default: a new one each time)."""
    job = check(engine, layout, nodes, nproc_per_node, gpus_per_node, image, pvc, run_dir, mount_path,
                grace_period_s, name, namespace, port, max_restarts, max_preemptions, train_args, shm_size)
    job = dataclasses.replace(job, launch_id=str(launch_id) if launch_id else f"{job.name}-{uuid.uuid4().hex[:12]}")
    manifest = render_k8s(job, command_line(job))
    if dry_run:
        print(manifest, end="")
        return
    path = Path(out_dir) / f"{job.name}.{job.engine}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest)
    apply = ["kubectl", "apply", "-f", str(path)]
    if shutil.which("kubectl") is None:
        print(f"ddp_kit: wrote {path}; kubectl is not on PATH, so apply it where it is: {shlex.join(apply)}")
        return
    res = subprocess.run(apply, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise UserError(f"kubectl refused {path}: {' '.join(res.stderr.split())}",
                        "check the engine's CRDs are installed (kubectl get crd) and the namespace exists")
    print(f"{res.stdout.strip()} ({path})")


def command_line(job: K8sJob) -> str:
    """The launcher command that renders this manifest again (kept in the manifest's first lines)."""
    flags = ["--engine", job.engine, "--layout", job.layout, "--nodes", str(job.nodes),
             "--nproc_per_node", str(job.nproc_per_node)]
    if job.gpus_per_node:
        flags += ["--gpus_per_node", str(job.gpus_per_node)]
    flags += ["--image", job.image, "--pvc", job.pvc, "--run_dir", job.run_dir, "--mount_path", job.mount_path,
              "--grace_period_s", str(job.grace_period_s), "--name", job.name]
    if job.namespace:
        flags += ["--namespace", job.namespace]
    if job.engine != "trainjob":
        flags += ["--port", str(job.port)]
    flags += ["--max_restarts", str(job.max_restarts), "--max_preemptions", str(job.max_preemptions),
              "--shm_size", job.shm_size]
    return shlex.join(["python", "-m", "ddp_kit.launch", "k8s", *flags, "--", *job.train_args])
