"""A minimal NVML binding (ctypes over the driver's libnvidia-ml.so.1): the few facts per GPU that the health
gate reads. No package dependency: the library comes with the NVIDIA driver, and where there is no driver
there is nothing to ask.

Every function returns plain Python values and never raises: a missing library, a missing symbol (an older
driver) or a query the GPU does not support (NVML_ERROR_NOT_SUPPORTED, ...) reads as None, "unknown". The
loaded library (or a stand-in with the same function names, in tests) is passed as `lib`. Struct layouts
follow nvml.h (as NVIDIA's own nvidia-ml-py declares them)."""
from __future__ import annotations

import ctypes
from ctypes import c_char, c_double, c_int, c_int64, c_longlong, c_uint, c_ulong, c_ulonglong, c_void_p, pointer
from typing import Any

LIBRARY = "libnvidia-ml.so.1"
SUCCESS = 0
ERROR_INSUFFICIENT_SIZE = 7
NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long: a process's memory unknown
MEMORY_ERROR_UNCORRECTED = 1  # nvmlMemoryErrorType_t
VOLATILE_ECC = 0  # nvmlEccCounterType_t: since the driver loaded (the aggregate one counts the GPU's lifetime)
FI_DEV_GET_GPU_RECOVERY_ACTION = 230  # an nvmlFieldValue_t field id (recent drivers; older ones refuse it)
RECOVERY_ACTIONS = {0: "NONE", 1: "GPU_RESET", 2: "NODE_REBOOT", 3: "DRAIN_P2P", 4: "DRAIN_AND_RESET"}
# Clock event ("throttle") reasons that mean the hardware is hurting: a GPU held there computes slower than
# its peers. Idle (0x1), application clocks (0x2), the software power cap (0x4), sync boost (0x10) and the
# display clock (0x100) are normal operation.
BAD_CLOCK_REASONS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                     0x80: "HW power brake slowdown"}
_TEXT = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE and NVML_DEVICE_UUID_V2_BUFFER_SIZE


class Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class MemoryV2(ctypes.Structure):  # nvmlMemory_v2_t: `used` without the driver's reservation
    _fields_ = [("version", c_uint), ("total", c_ulonglong), ("reserved", c_ulonglong), ("free", c_ulonglong),
                ("used", c_ulonglong)]


MEMORY_V2 = ctypes.sizeof(MemoryV2) | 2 << 24  # NVML_STRUCT_VERSION(Memory, 2): 0x02000028


class ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_v2_t, also what the _v3 query fills
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint)]


class PciInfo(ctypes.Structure):  # nvmlPciInfo_t (the _v3 query)
    _fields_ = [("busIdLegacy", c_char * 16), ("domain", c_uint), ("bus", c_uint), ("device", c_uint),
                ("pciDeviceId", c_uint), ("pciSubSystemId", c_uint), ("busId", c_char * 32)]


class Value(ctypes.Union):  # nvmlValue_t
    _fields_ = [("dVal", c_double), ("uiVal", c_uint), ("ulVal", c_ulong), ("ullVal", c_ulonglong),
                ("sllVal", c_longlong), ("siVal", c_int)]


class FieldValue(ctypes.Structure):  # nvmlFieldValue_t
    _fields_ = [("fieldId", c_uint), ("scopeId", c_uint), ("timestamp", c_int64), ("latencyUsec", c_int64),
                ("valueType", c_uint), ("nvmlReturn", c_uint), ("value", Value)]


_VALUE_FIELD = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}  # by nvmlValueType_t


def _load() -> Any | None:
    try:
        return ctypes.CDLL(LIBRARY)
    except OSError:  # no driver here (or no library in this container)
        return None


def _rc(lib: Any, name: str, *args: Any) -> int | None:
    """The return code of `name`, or None where this library lacks the symbol (an older driver)."""
    fn = getattr(lib, name, None)
    if fn is None:
        return None
    try:
        return int(fn(*args))
    except (ctypes.ArgumentError, OSError, TypeError, ValueError):
        return None


def _ok(lib: Any, name: str, *args: Any) -> bool:
    return _rc(lib, name, *args) == SUCCESS


def open_nvml() -> Any | None:
    """The library, initialised (nvmlInit_v2 counts its callers: torch's own use is unaffected); None where
    there is no driver or it refuses. Pair with `close`."""
    lib = _load()
    return lib if lib is not None and _ok(lib, "nvmlInit_v2") else None


def close(lib: Any) -> None:
    _rc(lib, "nvmlShutdown")


def device_count(lib: Any) -> int | None:
    n = c_uint(0)
    return int(n.value) if _ok(lib, "nvmlDeviceGetCount_v2", pointer(n)) else None


def handle(lib: Any, index: int) -> c_void_p | None:
    """NVML's handle of its GPU `index` (NVML's order is the PCI bus order, not necessarily CUDA's)."""
    out = c_void_p()
    return out if _ok(lib, "nvmlDeviceGetHandleByIndex_v2", c_uint(index), pointer(out)) and out.value else None


def _text(lib: Any, name: str, h: c_void_p) -> str | None:
    buf = ctypes.create_string_buffer(_TEXT)
    return buf.value.decode(errors="replace") if _ok(lib, name, h, buf, c_uint(_TEXT)) else None


def name(lib: Any, h: c_void_p) -> str | None:
    return _text(lib, "nvmlDeviceGetName", h)


def uuid(lib: Any, h: c_void_p) -> str | None:
    """"GPU-8f1d...": what CUDA_VISIBLE_DEVICES and nvidia-smi call it."""
    return _text(lib, "nvmlDeviceGetUUID", h)


def pci_bus_id(lib: Any, h: c_void_p) -> str | None:
    info = PciInfo()
    if not _ok(lib, "nvmlDeviceGetPciInfo_v3", h, pointer(info)):
        return None
    return info.busId.decode(errors="replace") or None


def memory(lib: Any, h: c_void_p) -> tuple[int, int] | None:
    """(used, total) bytes. The v2 query first: the v1 `used` includes what the driver reserves for itself
    (several hundred MiB on an idle A100/H100), which no process frees."""
    v2 = MemoryV2(version=MEMORY_V2)
    if _ok(lib, "nvmlDeviceGetMemoryInfo_v2", h, pointer(v2)):
        return int(v2.used), int(v2.total)
    v1 = Memory()
    return (int(v1.used), int(v1.total)) if _ok(lib, "nvmlDeviceGetMemoryInfo", h, pointer(v1)) else None


def retired_pages_pending(lib: Any, h: c_void_p) -> bool | None:
    """Pages marked for retirement that take effect at the next GPU reset (GPUs before Ampere; later ones
    remap rows instead and answer NOT_SUPPORTED: None)."""
    state = c_uint(0)
    return bool(state.value) if _ok(lib, "nvmlDeviceGetRetiredPagesPendingStatus", h, pointer(state)) else None


def remapped_rows(lib: Any, h: c_void_p) -> tuple[int, int, bool, bool] | None:
    """(rows remapped for correctable errors, for uncorrectable ones, a remap pending a reset, a remap
    failed) on GPUs from Ampere on."""
    corr, unc, pending, failed = c_uint(0), c_uint(0), c_uint(0), c_uint(0)
    if not _ok(lib, "nvmlDeviceGetRemappedRows", h, pointer(corr), pointer(unc), pointer(pending), pointer(failed)):
        return None
    return int(corr.value), int(unc.value), bool(pending.value), bool(failed.value)


def uncorrected_ecc_volatile(lib: Any, h: c_void_p) -> int | None:
    """Uncorrected ECC errors since the driver loaded; None where ECC is off or not reported."""
    count = c_ulonglong(0)
    ok = _ok(lib, "nvmlDeviceGetTotalEccErrors", h, c_uint(MEMORY_ERROR_UNCORRECTED), c_uint(VOLATILE_ECC),
             pointer(count))
    return int(count.value) if ok else None


def clock_reasons(lib: Any, h: c_void_p) -> int | None:
    """The bit mask of why the clocks are below their maximum now (the newer "event" query, else the older
    "throttle" one: the same bits)."""
    mask = c_ulonglong(0)
    for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if _ok(lib, fn, h, pointer(mask)):
            return int(mask.value)
    return None


def bad_clock_reasons(mask: int) -> list[str]:
    return [words for bit, words in BAD_CLOCK_REASONS.items() if mask & bit]


def recovery_action(lib: Any, h: c_void_p) -> int | None:
    """What the driver asks the operator to do with this GPU (RECOVERY_ACTIONS; 0: nothing). None on drivers
    that do not know the field."""
    values = (FieldValue * 1)()
    values[0].fieldId = FI_DEV_GET_GPU_RECOVERY_ACTION
    if not _ok(lib, "nvmlDeviceGetFieldValues", h, c_int(1), values) or values[0].nvmlReturn != SUCCESS:
        return None
    return int(getattr(values[0].value, _VALUE_FIELD.get(values[0].valueType, "uiVal")))


def compute_processes(lib: Any, h: c_void_p) -> list[tuple[int, int | None]] | None:
    """[(pid, bytes used or None)] of the compute processes on this GPU. The pids are as the driver sees them:
    the host's, where this process runs in a container with its own pid namespace (drivers differ)."""
    for fn in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
        count = c_uint(0)
        rc = _rc(lib, fn, h, pointer(count), None)
        if rc == SUCCESS:
            return []
        if rc != ERROR_INSUFFICIENT_SIZE:
            continue
        count.value = count.value * 2 + 4  # room for processes that start between the two calls
        procs = (ProcessInfo * count.value)()
        if not _ok(lib, fn, h, pointer(count), procs):
            continue
        return [(int(p.pid), None if p.usedGpuMemory == NOT_AVAILABLE else int(p.usedGpuMemory))
                for p in procs[: count.value]]
    return None
