"""Gather the facts the doctor reasons about: one plain, JSON-able dict. Nothing here judges.

Every probe is guarded: a missing tool or a broken import becomes a recorded fact (`None` or an
error string), never an exception, because a broken machine is exactly what the doctor is for.
"""
from __future__ import annotations

import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..env import shown_variables

ENV_PREFIXES = ("NCCL_", "MASTER_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_")
# torch's own variables, then what each launcher's and scheduler's file says is worth showing
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", *shown_variables())


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def nvidia_smi() -> dict[str, Any]:
    """Driver version, the CUDA version the driver supports, GPUs as the driver sees them."""
    out: dict[str, Any] = {"present": shutil.which("nvidia-smi") is not None, "driver": None, "driver_cuda": None,
                           "gpus": []}
    head = _run(["nvidia-smi"])
    if head:
        m = re.search(r"CUDA Version:\s*([\d.]+)", head)
        out["driver_cuda"] = m.group(1) if m else None
    q = _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version,compute_cap,uuid,mig.mode.current",
              "--format=csv,noheader,nounits"])
    for line in (q or "").strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 5:
            out["driver"] = parts[3]
            out["gpus"].append({"name": parts[0], "memory_total_mb": _num(parts[1]), "memory_used_mb": _num(parts[2]),
                                "capability": parts[4], "uuid": uuid_key(parts[5]) if len(parts) > 5 else None,
                                "mig": len(parts) > 6 and parts[6].lower() == "enabled"})
    return out


def uuid_key(uuid: str) -> str:
    """nvidia-smi says GPU-<hex>, torch's device properties the bare <hex>: one key for both."""
    return uuid.strip().lower().removeprefix("gpu-")


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def torch_facts(probe_gpus: bool = True) -> dict[str, Any]:
    """What torch sees. Never creates a CUDA context (no per-GPU memory query: that would put one on
    every visible GPU from every rank); `probe_gpus=False` (a training rank that just hit a CUDA
    error) reads no device properties either: free memory and usage come from nvidia-smi."""
    out: dict[str, Any] = {"version": None, "cuda": None, "hip": None, "cudnn": None, "nccl": None,
                           "nccl_available": None, "cuda_available": None, "cuda_error": None, "device_count": 0,
                           "arch_list": [], "gpus": [], "import_error": None, "torchvision": None,
                           "torchvision_error": None}
    try:
        import torch
    except Exception as exc:  # a broken install is a fact
        out["import_error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["version"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["hip"] = getattr(torch.version, "hip", None)
    try:
        import torch.distributed as tdist

        out["nccl_available"] = tdist.is_available() and tdist.is_nccl_available()
    except Exception:
        out["nccl_available"] = False
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        pass
    try:
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            out["device_count"] = torch.cuda.device_count()
            out["arch_list"] = torch.cuda.get_arch_list()
            for i in range(out["device_count"] if probe_gpus else 0):
                p = torch.cuda.get_device_properties(i)
                out["gpus"].append({"name": p.name, "memory_total_mb": p.total_memory / 2**20,
                                    "capability": f"{p.major}.{p.minor}", "bf16": p.major >= 8,
                                    "uuid": uuid_key(str(getattr(p, "uuid", "")))})
        elif out["cuda"]:
            out["arch_list"] = torch.cuda.get_arch_list()
        if out["cuda"] and out["nccl_available"]:  # the bundled NCCL answers without a GPU too
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # a broken install is a fact
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torchvision

        out["torchvision"] = torchvision.__version__
        torchvision.ops.nms  # noqa: B018 - touches the compiled ops, the usual point of failure
    except Exception as exc:  # a broken install is a fact
        out["torchvision_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


def layout(environ) -> dict[str, Any]:
    from ..env import detect
    from ..errors import UserError

    try:
        env = detect(environ)
        return {"launcher": env.launcher, "rank": env.rank, "local_rank": env.local_rank, "world_size": env.world_size,
                "local_world_size": env.local_world_size, "master_addr": env.master_addr, "master_port": env.master_port,
                "rendezvous_by_launcher": env.rendezvous_by_launcher, "error": None}
    except UserError as err:
        return {"error": err.line()}


def allocation(environ) -> dict[str, Any]:
    """What the batch scheduler around this process allocated on this node, as the detected
    environment says it (also when the launcher's variables are refused); {} outside any."""
    from ..env import allocation as around
    from ..errors import UserError

    try:
        env = around(environ)
    except UserError:  # a refused variable of its own: the layout check says which
        return {}
    if env.scheduler is None:
        return {}
    return {"scheduler": env.scheduler, "gpus_on_node": env.gpus_on_node, "gpu_ids": list(env.gpu_ids),
            "tasks_per_node": env.tasks_per_node}


def master_reachability(addr: str | None, port: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"addr": addr, "port": port, "resolves": None, "local": None, "port_in_use": None}
    if not addr:
        return out
    try:
        infos = socket.getaddrinfo(addr, None)
        ips = {i[4][0] for i in infos}
        out["resolves"] = True
        local = {"127.0.0.1", "::1"}
        try:
            local |= {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
        except OSError:
            pass
        out["local"] = bool(ips & local) or any(ip.startswith("127.") for ip in ips)
    except OSError:
        out["resolves"] = False
        return out
    if port and out["local"]:
        s = socket.socket()
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", int(port)))
            out["port_in_use"] = False
        except OSError:
            out["port_in_use"] = True
        finally:
            s.close()
    return out


def gather(run_dir: str = ".", environ=None, probe_gpus: bool = True) -> dict[str, Any]:
    environ = dict(os.environ if environ is None else environ)
    shm = None
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    except OSError:
        pass
    disk = None
    try:
        probe = Path(run_dir)
        while not probe.exists():
            probe = probe.parent
        disk = shutil.disk_usage(probe).free
    except OSError:
        pass
    lay = layout(environ)
    # A launcher that met its peers before starting us (torchrun's agent) holds the master port by
    # design: probing it would report "in use" for a healthy job.
    master = ({"addr": environ.get("MASTER_ADDR"), "skipped": f"running under {lay['launcher']}"}
              if lay.get("rendezvous_by_launcher") else
              master_reachability(environ.get("MASTER_ADDR"), _int_or_none(environ.get("MASTER_PORT"))))
    return {
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "python": sys.version.split()[0],
        "torch": torch_facts(probe_gpus),
        "nvidia": nvidia_smi(),
        "nvidia_device_files": sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*")),
        "env": {k: v for k, v in environ.items() if k in ENV_KEYS or k.startswith(ENV_PREFIXES)},
        "layout": lay,
        "allocation": allocation(environ),
        "master": master,
        "shm_bytes": shm,
        "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "disk_free_bytes": disk,
        "run_dir": str(run_dir),
    }


def _int_or_none(s: str | None) -> int | None:
    try:
        return int(s) if s else None
    except ValueError:
        return None
