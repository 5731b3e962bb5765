"""Diagnoses: each a pure function from the gathered facts to one Finding (ok, warn or fail, with a fix).

No torch here: tests feed fact snapshots of broken machines straight in.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

# Minimum Linux driver for a CUDA runtime. Within a major version, minor-version compatibility lets
# an older driver run newer 12.x/13.x runtimes (PTX JIT aside); below the major's floor nothing works.
MAJOR_FLOOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
TOOLKIT_MIN = {"11.8": "520.61.05", "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03",
               "12.3": "545.23.06", "12.4": "550.54.14", "12.5": "555.42.02", "12.6": "560.28.03",
               "12.8": "570.26", "12.9": "575.51.03", "13.0": "580.65.06"}


@dataclass(frozen=True)
class Finding:
    name: str
    status: str
    message: str
    fix: str = ""


def _ver(v: str | None) -> tuple[int, ...]:
    out = []
    for part in (v or "").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _gpu_present(f: dict) -> bool:
    return bool(f["nvidia"]["gpus"]) or bool(f.get("nvidia_device_files"))


def _visible_count(f: dict) -> int | None:
    """GPUs the process may use: torch's count when CUDA works, else derived from the driver and CUDA_VISIBLE_DEVICES."""
    if f["torch"].get("cuda_available"):
        return f["torch"]["device_count"]
    n = len(f["nvidia"]["gpus"])
    cvd = f["env"].get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return n
    ids = [x for x in cvd.split(",") if x.strip() != ""]
    valid = []
    for x in ids:
        if x.strip().lstrip("-").isdigit() and int(x) < 0:
            break  # CUDA stops at the first invalid entry
        valid.append(x)
    return min(len(valid), n) if n else len(valid)


def cuda_availability(f: dict) -> Finding:
    t = f["torch"]
    name = "CUDA available"
    if t.get("import_error"):
        return Finding(name, FAIL, f"torch does not import: {t['import_error']}", "reinstall torch: pip install --force-reinstall torch")
    if t.get("cuda_available"):
        return Finding(name, OK, f"{t['device_count']} GPU(s) visible to torch {t['version']} (CUDA {t['cuda']})")
    build = f"CUDA {t['cuda']} build" if t.get("cuda") else ("ROCm build" if t.get("hip") else "CPU-only build")
    if not t.get("cuda") and not t.get("hip"):
        if _gpu_present(f):
            return Finding(name, FAIL, f"torch {t['version']} is a CPU-only build, but this machine has an NVIDIA GPU",
                           "install a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu126 (pick the CUDA your driver supports)")
        return Finding(name, WARN, f"torch {t['version']} is a CPU-only build and no NVIDIA GPU is present: runs use the CPU and gloo",
                       "nothing to fix for CPU runs; on a GPU machine install a CUDA build of torch")
    if not _gpu_present(f):
        return Finding(name, WARN, f"torch {t['version']} is a {build}, but no NVIDIA driver or GPU is present (no /dev/nvidia*, "
                       f"{'nvidia-smi finds no GPU' if f['nvidia']['present'] else 'no nvidia-smi'}): torch.cuda.is_available() is False, runs use the CPU and gloo",
                       "nothing to fix for CPU runs; on a GPU machine install the NVIDIA driver and check `nvidia-smi`")
    if _visible_count(f) == 0:
        return Finding(name, FAIL, f"the driver sees {len(f['nvidia']['gpus'])} GPU(s) but CUDA_VISIBLE_DEVICES="
                       f"{f['env'].get('CUDA_VISIBLE_DEVICES')!r} hides them all", "unset CUDA_VISIBLE_DEVICES or list valid GPU indices")
    err = t.get("cuda_error") or "torch.cuda.is_available() is False"
    return Finding(name, FAIL, f"an NVIDIA GPU is present but torch ({build}) cannot use it: {err}",
                   "see the driver and architecture checks below; `nvidia-smi` must work first")


def driver_version(f: dict) -> Finding:
    name = "driver vs CUDA runtime"
    cuda, driver = f["torch"].get("cuda"), f["nvidia"].get("driver")
    if not cuda or not driver:
        return Finding(name, SKIP, "no CUDA build of torch or no NVIDIA driver")
    major = _ver(cuda)[0]
    floor = MAJOR_FLOOR.get(major)
    if floor and _ver(driver) < _ver(floor) and f["torch"].get("cuda_available"):
        return Finding(name, WARN, f"driver {driver} is older than CUDA {cuda}'s floor {floor}, yet CUDA works here: "
                       f"forward compatibility (the cuda-compat package) is in use; it holds only on data-center GPUs "
                       f"and for this exact pairing", f"keep cuda-compat in step with torch's CUDA, or update the driver to >= {floor}")
    if floor and _ver(driver) < _ver(floor):
        return Finding(name, FAIL, f"driver {driver} is too old for torch's CUDA {cuda} runtime (needs >= {floor}; "
                       f"the driver supports CUDA {f['nvidia'].get('driver_cuda') or '?'})",
                       f"update the NVIDIA driver to >= {TOOLKIT_MIN.get('.'.join(map(str, _ver(cuda)[:2])), floor)}, "
                       f"or install a torch build for CUDA {f['nvidia'].get('driver_cuda') or 'your driver'}")
    need = TOOLKIT_MIN.get(".".join(map(str, _ver(cuda)[:2])))
    if need and _ver(driver) < _ver(need):
        return Finding(name, WARN, f"driver {driver} is below CUDA {cuda}'s own minimum {need}; it works through "
                       f"minor-version compatibility, but PTX JIT and some features may fail", f"update the driver to >= {need}")
    return Finding(name, OK, f"driver {driver} supports torch's CUDA {cuda}")


def visible_devices(f: dict) -> Finding:
    name = "CUDA_VISIBLE_DEVICES"
    cvd = f["env"].get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return Finding(name, OK, "not set: every GPU is visible")
    if _gpu_present(f) and _visible_count(f) == 0:
        return Finding(name, FAIL, f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU", "unset it, or list valid GPU indices (e.g. 0,1)")
    return Finding(name, OK, f"CUDA_VISIBLE_DEVICES={cvd!r}")


def _arch_ok(cap: str, arch_list: list[str]) -> bool:
    major, minor = (_ver(cap) + (0, 0))[:2]
    for a in arch_list:
        kind, _, num = a.partition("_")
        if not num[:-1].isdigit():
            continue
        num = num.rstrip("af")  # sm_90a, sm_100f: arch-specific variants
        am, an = int(num[:-1]), int(num[-1])
        if kind == "sm" and am == major and an <= minor:
            return True  # binary compatible within a major version
        if kind == "compute" and (am, an) <= (major, minor):
            return True  # PTX can be JIT-compiled for newer GPUs
    return False


def gpu_arch(f: dict) -> Finding:
    name = "GPU architecture"
    arch = f["torch"].get("arch_list") or []
    gpus = f["torch"].get("gpus") or f["nvidia"]["gpus"]
    if not gpus or not arch:
        return Finding(name, SKIP, "no GPU or no CUDA arch list")
    missing = [g for g in gpus if g.get("capability") and not _arch_ok(g["capability"], arch)]
    if missing:
        g = missing[0]
        sm = "sm_" + g["capability"].replace(".", "")
        return Finding(name, FAIL, f"{g['name']} is {sm}, which torch {f['torch']['version']} was not built for "
                       f"(arch list: {' '.join(arch)}): kernels fail with 'no kernel image is available'",
                       f"install a torch build that includes {sm} (a newer release or CUDA wheel)")
    return Finding(name, OK, f"every GPU's architecture is in torch's list ({' '.join(arch)})")


def nccl(f: dict) -> Finding:
    name = "NCCL"
    t = f["torch"]
    if not t.get("cuda"):
        return Finding(name, SKIP, "not a CUDA build: gloo is used")
    if not t.get("nccl_available"):
        return Finding(name, FAIL, "this CUDA build of torch has no NCCL: multi-GPU runs cannot use the nccl backend",
                       "install the official Linux CUDA wheel of torch (it bundles NCCL), or use --backend gloo")
    return Finding(name, OK, f"NCCL {t.get('nccl') or 'available'}")


def local_rank_fits(f: dict) -> Finding:
    name = "local rank vs GPUs"
    lay = f["layout"]
    if lay.get("error") or not f["torch"].get("cuda_available"):
        return Finding(name, SKIP, "no launcher layout or no CUDA")
    n = _visible_count(f) or 0
    if lay["local_rank"] >= n:
        return Finding(name, FAIL, f"LOCAL_RANK {lay['local_rank']} but only {n} GPU(s) visible",
                       "launch at most one process per visible GPU (--nproc_per_node / --ntasks-per-node / --gpus-per-node)")
    if lay["local_world_size"] > n:
        return Finding(name, WARN, f"{lay['local_world_size']} processes on this node share {n} GPU(s)",
                       "use one process per GPU")
    return Finding(name, OK, f"local rank {lay['local_rank']} of {lay['local_world_size']} on {n} GPU(s)")


def allocated_gpus(f: dict) -> Finding:
    """The GPUs and tasks per node the batch scheduler allocated (facts.allocation, from the detected
    environment) against the GPUs this process sees."""
    alloc = f.get("allocation") or {}
    who = alloc.get("scheduler") or "SLURM"  # outside any scheduler the line keeps the name it always had
    name = f"{who} GPU allocation"
    count = alloc.get("gpus_on_node")
    if count is None and alloc.get("gpu_ids"):
        count = len(alloc["gpu_ids"])
    if not alloc.get("scheduler") or count is None:
        return Finding(name, SKIP, f"not in a {who} job with GPUs")
    visible = _visible_count(f)
    if visible is not None and visible != count:
        return Finding(name, WARN, f"{who} allocated {count} GPU(s) on this node but {visible} are visible",
                       "request GPUs with --gpus-per-node and do not override CUDA_VISIBLE_DEVICES inside the job")
    tasks = alloc.get("tasks_per_node")
    if tasks is not None and tasks != count:
        return Finding(name, WARN, f"{tasks} tasks per node but {count} GPUs per node",
                       "with one task per GPU (srun layout) set --ntasks-per-node equal to --gpus-per-node")
    return Finding(name, OK, f"{count} GPU(s) allocated and visible")


def bf16(f: dict, amp: str | None = None) -> Finding:
    name = "bf16"
    gpus = f["torch"].get("gpus") or []
    if amp != "bf16" or not gpus:
        return Finding(name, SKIP, "bf16 not requested (--amp bf16) or no GPU")
    bad = [g for g in gpus if not g.get("bf16", _ver(g.get("capability"))[0] >= 8)]
    if bad:
        return Finding(name, FAIL, f"amp=bf16 requested but {bad[0]['name']} (sm_{bad[0]['capability'].replace('.', '')}) has no bf16",
                       "use --amp fp16 (with a GradScaler) on pre-Ampere GPUs")
    return Finding(name, OK, "every GPU supports bf16")


def shm(f: dict) -> Finding:
    name = "/dev/shm"
    size = f.get("shm_bytes")
    if size is None:
        return Finding(name, WARN, "/dev/shm is missing", "mount a tmpfs on /dev/shm (docker: --shm-size=8g or --ipc=host)")
    gib = size / 2**30
    if size < 256 * 2**20:
        return Finding(name, FAIL, f"/dev/shm is only {size / 2**20:.0f} MiB: DataLoader workers and NCCL die with 'Bus error'",
                       "docker: --shm-size=8g or --ipc=host; otherwise remount /dev/shm larger")
    if size < 2**30:
        return Finding(name, WARN, f"/dev/shm is {gib:.2f} GiB: tight for several DataLoader workers", "use --shm-size=8g or --num_workers 0")
    return Finding(name, OK, f"{gib:.1f} GiB")


def master(f: dict) -> Finding:
    name = "MASTER_ADDR/PORT"
    m = f.get("master") or {}
    if not m.get("addr"):
        return Finding(name, SKIP, "MASTER_ADDR not set")
    if m.get("skipped"):
        return Finding(name, SKIP, m["skipped"])
    if m.get("resolves") is False:
        return Finding(name, FAIL, f"MASTER_ADDR {m['addr']!r} does not resolve", "use the first node's resolvable host name or IP address")
    if m.get("port_in_use"):
        return Finding(name, WARN, f"port {m['port']} on {m['addr']} is already in use", "pick another MASTER_PORT (or let torchrun --standalone choose)")
    return Finding(name, OK, f"{m['addr']}:{m.get('port')} resolves" + (" and is free" if m.get("port_in_use") is False else ""))


def _visible_smi_gpus(f: dict) -> list[tuple[int, int, dict]]:
    """(CUDA index, nvidia-smi index, nvidia-smi's entry) for each GPU this process may use. Matched by
    UUID when torch could read them (CUDA's order differs from nvidia-smi's PCI order unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID); else by CUDA_VISIBLE_DEVICES (UUIDs, or indices taken in PCI order)."""
    smi = f["nvidia"]["gpus"]
    by_uuid = {g.get("uuid"): (i, g) for i, g in enumerate(smi) if g.get("uuid")}
    torch_uuids = [g.get("uuid") for g in f["torch"].get("gpus") or []]
    if torch_uuids and all(u in by_uuid for u in torch_uuids):
        return [(c, *by_uuid[u]) for c, u in enumerate(torch_uuids)]
    visible = f["env"].get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(i, i, g) for i, g in enumerate(smi)]
    out = []
    for c, item in enumerate(v.strip() for v in visible.split(",") if v.strip()):
        if item.isdigit() and int(item) < len(smi):
            out.append((c, int(item), smi[int(item)]))
        elif item.lower().startswith("gpu-") and item.lower().removeprefix("gpu-") in by_uuid:
            out.append((c, *by_uuid[item.lower().removeprefix("gpu-")]))
        else:
            return None  # a MIG instance or an entry nvidia-smi does not list: the mapping is unknown
    return out


def _mig_visible(f: dict) -> bool:
    return any(v.strip().upper().startswith("MIG-") for v in (f["env"].get("CUDA_VISIBLE_DEVICES") or "").split(","))


def gpu_memory_taken(f: dict) -> Finding:
    name = "GPU memory in use"
    if not f["nvidia"]["gpus"]:
        return Finding(name, SKIP, "no GPU")
    visible = _visible_smi_gpus(f)
    if visible is None:
        return Finding(name, SKIP, f"CUDA_VISIBLE_DEVICES={f['env'].get('CUDA_VISIBLE_DEVICES')!r} names devices "
                       "nvidia-smi does not list as GPUs (MIG instances?): not judged")
    busy = [(c, s, g) for c, s, g in visible
            if g.get("memory_total_mb") and (g.get("memory_used_mb") or 0) > 0.1 * g["memory_total_mb"]]
    if busy:
        c, s, g = busy[0]
        return Finding(name, WARN, f"GPU {c} (nvidia-smi GPU {s}) already has {g['memory_used_mb']:.0f} of "
                       f"{g['memory_total_mb']:.0f} MiB in use by other processes",
                       "stop the other processes (nvidia-smi shows them) or use another GPU")
    return Finding(name, OK, "the visible GPUs are free")


def mig(f: dict) -> Finding:
    name = "MIG"
    if _mig_visible(f):
        return Finding(name, WARN, "CUDA_VISIBLE_DEVICES names MIG instances: a process sees one, and NCCL cannot run "
                       "collectives between instances", "train on one MIG instance per job (world size 1), or ask for whole GPUs")
    on = [(c, s) for c, s, g in _visible_smi_gpus(f) or [] if g.get("mig")]
    if not on:
        return Finding(name, OK if f["nvidia"]["gpus"] else SKIP, "no GPU in MIG mode" if f["nvidia"]["gpus"] else "no GPU")
    c, s = on[0]
    return Finding(name, WARN, f"GPU {c} (nvidia-smi GPU {s}) is in MIG mode: a process sees one MIG instance, and NCCL "
                   f"cannot run collectives between instances", "train on one MIG instance per job (world size 1), "
                   "or ask for whole GPUs (MIG off: nvidia-smi -mig 0, as root, GPU idle)")


def versions(f: dict) -> Finding:
    name = "torch / torchvision"
    t = f["torch"]
    if t.get("torchvision_error"):
        want = ""
        v = _ver(t.get("version"))
        if len(v) >= 2 and v[0] == 2:
            want = f" (torch {v[0]}.{v[1]} pairs with torchvision 0.{v[1] + 15})"
        return Finding(name, FAIL, f"torchvision does not work with torch {t.get('version')}: {t['torchvision_error']}{want}",
                       f"install the matching pair, e.g. pip install torch=={t.get('version', '').split('+')[0]} torchvision==0.{v[1] + 15 if len(v) >= 2 else 'X'}.*")
    if t.get("torchvision"):
        v, tv = _ver(t.get("version")), _ver(t["torchvision"])
        if len(v) >= 2 and len(tv) >= 2 and v[0] == 2 and tv[1] != v[1] + 15:
            return Finding(name, WARN, f"torchvision {t['torchvision']} is not the release paired with torch {t['version']} "
                           f"(expected 0.{v[1] + 15})", f"pip install torchvision==0.{v[1] + 15}.*")
    return Finding(name, OK, f"torch {t.get('version')}, torchvision {t.get('torchvision') or 'not installed'}")


def limits(f: dict) -> Finding:
    name = "open files / disk"
    nofile, disk = f.get("nofile_limit"), f.get("disk_free_bytes")
    if disk is not None and disk < 2**30:
        return Finding(name, FAIL, f"only {disk / 2**30:.2f} GiB free in {f.get('run_dir')}: checkpoints will fail",
                       "free disk space or point --run_dir elsewhere")
    if nofile is not None and nofile < 4096:
        return Finding(name, WARN, f"open-files limit is {nofile}: DataLoader workers can hit 'Too many open files'",
                       "ulimit -n 65536 (or set torch.multiprocessing.set_sharing_strategy('file_system'))")
    free = f"{disk / 2**30:.0f} GiB free" if disk is not None else "disk unknown"
    return Finding(name, OK, f"open files {nofile}, {free}")


def layout_ok(f: dict) -> Finding:
    name = "launcher layout"
    lay = f["layout"]
    if lay.get("error"):
        return Finding(name, FAIL, lay["error"].removeprefix("ddp_kit: error: "), "see the hint")
    return Finding(name, OK, f"{lay['launcher']}: rank {lay['rank']}/{lay['world_size']}, local rank {lay['local_rank']}")


CHECKS: tuple[Callable[..., Finding], ...] = (cuda_availability, driver_version, visible_devices, gpu_arch, nccl,
                                              local_rank_fits, allocated_gpus, shm, master, gpu_memory_taken, mig, versions,
                                              limits, layout_ok)


def diagnose(facts: dict[str, Any], amp: str | None = None) -> list[Finding]:
    return [c(facts) for c in CHECKS] + [bf16(facts, amp)]


def exit_code(findings: list[Finding]) -> int:
    statuses = {f.status for f in findings}
    return 2 if FAIL in statuses else 1 if WARN in statuses else 0
