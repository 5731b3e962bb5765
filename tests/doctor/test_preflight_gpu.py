"""The health gate's GPU checks (preflight/gpu.py) and their NVML binding (preflight/nvml.py), unit tier.

A GPU driver cannot exist here, so NVML is a stand-in (FakeNvml): an object with libnvidia-ml's function
names, called with the very ctypes arguments the binding passes to the real library, answering as nvml.h
says the driver does (return codes, two-call size protocols, struct fields). Where the checks need CUDA's
view of a device (its UUID), that one function is replaced too. Everything else is real: the matmul runs
on the CPU and is checked against its exact result, the waiting loop runs on a fake clock."""
from __future__ import annotations

import copy
import ctypes
import os

import pytest
import torch

from ddp_kit.preflight import gpu, nvml
from ddp_kit.preflight.results import Result

GIB, MIB = 2**30, 2**20
NOT_SUPPORTED, INVALID_ARGUMENT, DRIVER_NOT_LOADED = 3, 2, 9


class FakeNvml:
    """libnvidia-ml.so.1 as far as the binding uses it, over `gpus`: one dict per GPU in NVML's order.
    A list under "used" is read one entry per query (the last one repeats); "procs" likewise."""

    def __init__(self, gpus: list[dict], missing: tuple[str, ...] = (), init_rc: int = 0):
        self.gpus, self.init_rc, self.open, self.reads = copy.deepcopy(gpus), init_rc, 0, 0
        self.ecc_asked: list[tuple[int, int]] = []
        for name in missing:  # an older driver: the symbol is not there
            setattr(self, name, None)

    def _gpu(self, h) -> dict:
        return self.gpus[h.value - 1]

    @staticmethod
    def _next(g: dict, key: str):
        seq = g[key]
        return seq.pop(0) if len(seq) > 1 else seq[0]

    def nvmlInit_v2(self):
        self.open += self.init_rc == 0
        return self.init_rc

    def nvmlShutdown(self):
        self.open -= 1
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count.contents.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, out):
        if index.value >= len(self.gpus):
            return INVALID_ARGUMENT
        out.contents.value = index.value + 1  # a handle is an opaque non-null pointer
        return 0

    def _text(self, h, buf, size, key):
        assert size.value <= len(buf), "the length passed must be the buffer's"
        buf.value = self._gpu(h)[key].encode()
        return 0

    def nvmlDeviceGetUUID(self, h, buf, size):
        return self._text(h, buf, size, "uuid")

    def nvmlDeviceGetName(self, h, buf, size):
        return self._text(h, buf, size, "name")

    def nvmlDeviceGetPciInfo_v3(self, h, info):
        info.contents.busId = self._gpu(h)["pci"].encode()
        return 0

    def nvmlDeviceGetMemoryInfo_v2(self, h, mem):
        if mem.contents.version != 0x02000028:  # nvml.h: nvmlMemory_v2 = NVML_STRUCT_VERSION(Memory, 2)
            return 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        g = self._gpu(h)
        self.reads += 1
        used = self._next(g, "used")
        mem.contents.total, mem.contents.reserved, mem.contents.used = 80 * GIB, 500 * MIB, used
        mem.contents.free = 80 * GIB - 500 * MIB - used
        return 0

    def nvmlDeviceGetMemoryInfo(self, h, mem):  # v1: `used` counts the driver's reservation
        used = self._next(self._gpu(h), "used")
        mem.contents.total, mem.contents.used, mem.contents.free = 80 * GIB, used + 500 * MIB, 80 * GIB - used - 500 * MIB
        return 0

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h, state):
        pending = self._gpu(h).get("retired_pending")
        if pending is None:
            return NOT_SUPPORTED  # what a GPU from Ampere on answers: it remaps rows instead
        state.contents.value = pending
        return 0

    def nvmlDeviceGetRemappedRows(self, h, corr, unc, pending, failed):
        c, u, p, f = self._gpu(h).get("rows", (0, 0, 0, 0))
        corr.contents.value, unc.contents.value, pending.contents.value, failed.contents.value = c, u, p, f
        return 0

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type, count):
        self.ecc_asked.append((error_type.value, counter_type.value))
        ecc = self._gpu(h).get("ecc")
        if ecc is None:
            return NOT_SUPPORTED  # ECC off
        count.contents.value = ecc.get((error_type.value, counter_type.value), 0)
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, h, mask):
        mask.contents.value = self._gpu(h).get("clocks", 0)
        return 0

    nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons

    def nvmlDeviceGetFieldValues(self, h, n, values):
        for i in range(n.value):
            v = values[i]
            action = self._gpu(h).get("recovery")
            if v.fieldId != 230 or action is None:
                v.nvmlReturn = INVALID_ARGUMENT  # a field this driver does not know: per field, the call succeeds
                continue
            v.nvmlReturn, v.valueType, v.value.uiVal = 0, 1, action
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h, count, procs):
        g = self._gpu(h)
        listed = self._next(g, "procs_seq") if "procs_seq" in g else g.get("procs", [])
        if procs is None or count.contents.value < len(listed):
            count.contents.value = len(listed)
            return 0 if not listed else 7  # NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, used) in enumerate(listed):
            procs[i].pid, procs[i].usedGpuMemory = pid, nvml.NOT_AVAILABLE if used is None else used
        count.contents.value = len(listed)
        return 0

    nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3


H100 = dict(name="NVIDIA H100 80GB HBM3", uuid="GPU-0a0a0a0a-1111-2222-3333-444444444444", pci="00000000:18:00.0",
            used=[0], ecc={(1, 0): 0, (1, 1): 7, (0, 0): 40})


def gpu_like(**changes) -> dict:
    return {**H100, **changes}


@pytest.fixture
def driver(monkeypatch):
    """Installs a FakeNvml as the loaded library; CUDA's UUIDs of the visible devices as given."""
    def install(fake: FakeNvml, cuda_uuids: dict[int, str] | None = None) -> FakeNvml:
        monkeypatch.setattr(nvml, "_load", lambda: fake)
        uuids = cuda_uuids if cuda_uuids is not None else {i: g["uuid"] for i, g in enumerate(fake.gpus)}
        monkeypatch.setattr(gpu, "_cuda_uuids", lambda indices: {i: gpu._key(uuids.get(i, "")) for i in indices})
        return fake
    return install


# --- the binding --------------------------------------------------------------------------------------

def test_struct_layouts_are_nvml_h_s():
    """Sizes as nvml.h lays the structs out on x86-64 (a field missing or mistyped changes them)."""
    assert ctypes.sizeof(nvml.Memory) == 24
    assert ctypes.sizeof(nvml.MemoryV2) == 40
    assert nvml.MEMORY_V2 == 0x02000028
    assert ctypes.sizeof(nvml.ProcessInfo) == 24
    assert ctypes.sizeof(nvml.PciInfo) == 68
    assert ctypes.sizeof(nvml.FieldValue) == 40
    assert nvml.FieldValue.value.offset == 32


def test_no_library_or_a_refusing_driver_reads_as_none(monkeypatch):
    monkeypatch.setattr(nvml, "_load", lambda: None)
    assert nvml.open_nvml() is None
    monkeypatch.setattr(nvml, "_load", lambda: FakeNvml([H100], init_rc=DRIVER_NOT_LOADED))
    assert nvml.open_nvml() is None


def test_a_real_library_without_the_symbols_reads_as_none():
    """A real ctypes library (libc: no NVML symbols) through the same calls."""
    lib = ctypes.CDLL("libc.so.6")
    assert nvml.device_count(lib) is None
    assert nvml.handle(lib, 0) is None
    assert nvml.memory(lib, ctypes.c_void_p(1)) is None
    assert nvml.compute_processes(lib, ctypes.c_void_p(1)) is None


def test_the_queries_read_what_the_driver_wrote():
    fake = FakeNvml([gpu_like(rows=(3, 1, 1, 0), clocks=0x1 | 0x40 | 0x8, recovery=2, retired_pending=1,
                              used=[7 * GIB], procs=[(4242, 5 * GIB), (4243, None)])])
    h = nvml.handle(fake, 0)
    assert h is not None and nvml.handle(fake, 1) is None
    assert (nvml.name(fake, h), nvml.uuid(fake, h), nvml.pci_bus_id(fake, h)) == (
        "NVIDIA H100 80GB HBM3", H100["uuid"], "00000000:18:00.0")
    assert nvml.memory(fake, h) == (7 * GIB, 80 * GIB)
    assert nvml.remapped_rows(fake, h) == (3, 1, True, False)
    assert nvml.retired_pages_pending(fake, h) is True
    assert nvml.uncorrected_ecc_volatile(fake, h) == 0  # not the aggregate (7) nor the corrected (40) count
    assert fake.ecc_asked == [(1, 0)]
    assert nvml.recovery_action(fake, h) == 2 and nvml.RECOVERY_ACTIONS[2] == "NODE_REBOOT"
    assert nvml.bad_clock_reasons(nvml.clock_reasons(fake, h) or 0) == ["HW slowdown", "HW thermal slowdown"]
    assert nvml.compute_processes(fake, h) == [(4242, 5 * GIB), (4243, None)]


def test_benign_clock_reasons_are_not_bad():
    assert nvml.bad_clock_reasons(0x1 | 0x2 | 0x4 | 0x10 | 0x100) == []
    assert nvml.bad_clock_reasons(0x20 | 0x80) == ["SW thermal slowdown", "HW power brake slowdown"]


def test_an_older_driver_falls_back_and_unknowns_read_as_none():
    fake = FakeNvml([gpu_like(used=[GIB], ecc=None)], missing=(
        "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetComputeRunningProcesses_v3"))
    h = nvml.handle(fake, 0)
    assert nvml.memory(fake, h) == (GIB + 500 * MIB, 80 * GIB)  # v1: the driver's reservation included
    assert nvml.clock_reasons(fake, h) == 0  # the "throttle" name of the same query
    assert nvml.compute_processes(fake, h) == []  # _v2
    assert nvml.uncorrected_ecc_volatile(fake, h) is None  # ECC off: unknown, not zero
    assert nvml.retired_pages_pending(fake, h) is None
    assert nvml.recovery_action(fake, h) is None


def test_processes_that_start_between_the_two_calls_still_fit():
    listed = [[(1, GIB)], [(1, GIB), (2, GIB), (3, None)]]  # the size call sees one, the fill call three
    fake = FakeNvml([gpu_like(procs_seq=listed)], missing=("nvmlDeviceGetComputeRunningProcesses_v2",))
    assert nvml.compute_processes(fake, nvml.handle(fake, 0)) == [(1, GIB), (2, GIB), (3, None)]


# --- health ---------------------------------------------------------------------------------------------

def test_health_without_a_gpu_is_one_skipped_result():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for check in (gpu.health([0], "nodea"), gpu.wait_memory_released([0], "nodea")):
        assert len(check) == 1 and check[0].skipped and check[0].ok and check[0].measured == gpu.NO_GPU


def test_health_without_nvml_is_one_skipped_result(monkeypatch, driver):
    driver(FakeNvml([H100]))
    monkeypatch.setattr(nvml, "_load", lambda: None)
    [r] = gpu.health([0], "nodea")
    assert (r.ok, r.skipped, r.measured) == (True, True, "NVML not available (no NVIDIA driver)")


def test_health_names_what_is_wrong_on_the_right_gpu(driver):
    """CUDA's device 0 is NVML's GPU 1 (CUDA_VISIBLE_DEVICES=1,0, or CUDA's order differs from the PCI
    order): the sick GPU's findings land on the CUDA index that names it."""
    sick = gpu_like(uuid="GPU-5ick", pci="00000000:9A:00.0", rows=(0, 2, 1, 0), recovery=1, clocks=0x1 | 0x8 | 0x40,
                    ecc={(1, 0): 3})
    fake = driver(FakeNvml([H100, sick]), cuda_uuids={0: "GPU-5ick", 1: H100["uuid"]})
    bad, good = gpu.health([0, 1], "nodea")
    assert fake.open == 0, "NVML shut down after use"
    assert (bad.check, bad.host, bad.ok, good.ok) == ("gpu_health", "nodea", False, True)
    assert bad.detail == "GPU 0 (GPU-5ick, PCI 00000000:9A:00.0)"
    for words in ("a row remap pending", "3 uncorrected ECC errors", "recovery action GPU_RESET",
                  "HW slowdown", "HW thermal slowdown"):
        assert words in bad.measured
    assert "idle" not in bad.measured.lower()
    assert good.detail.startswith("GPU 1 (GPU-0a0a0a0a") and good.measured.startswith("nothing wrong")
    assert "page retirement" in good.measured  # the H100 stand-in does not report it: said, not hidden


def test_a_failed_row_remap_and_pending_pages_fail(driver):
    driver(FakeNvml([gpu_like(rows=(0, 9, 0, 1), retired_pending=1)]))
    [r] = gpu.health([0], "nodeb")
    assert not r.ok and "a row remap failed" in r.measured and "retired pages pending" in r.measured


def test_a_cuda_device_nvml_does_not_list_is_skipped_by_name(driver):
    driver(FakeNvml([H100]), cuda_uuids={0: H100["uuid"], 1: "MIG-abcd"})
    results = gpu.health([0, 1], "nodea")
    assert [(r.detail.split(" (")[0], r.ok, r.skipped) for r in results] == [("GPU 0", True, False), ("GPU 1", True, True)]
    assert "not found among NVML's GPUs" in results[1].measured


# --- memory held by a previous attempt ------------------------------------------------------------------

class FakeTime:
    def __init__(self):
        self.now, self.slept = 1000.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_memory_released_while_waiting(driver):
    t = FakeTime()
    driver(FakeNvml([gpu_like(used=[30 * GIB, 30 * GIB, 100 * MIB],
                              procs_seq=[[(4242, 30 * GIB)], [(4242, 30 * GIB)], []])]))
    [r] = gpu.wait_memory_released([0], "nodea", sleep=t.sleep, clock=t.clock)
    assert (r.check, r.ok) == ("gpu_memory_held", True)
    assert r.value == pytest.approx(100) and "released after 4 s" in r.measured
    assert t.slept == [2.0, 2.0]


def test_memory_held_throughout_names_mib_and_pids(driver):
    t = FakeTime()
    fake = driver(FakeNvml([gpu_like(used=[30 * GIB], procs=[(4242, 20 * GIB), (4243, None)]), gpu_like(uuid="GPU-b")]))
    held, free = gpu.wait_memory_released([0, 1], "nodea", wait_s=10.0, poll_s=3.0, sleep=t.sleep, clock=t.clock)
    assert not held.ok and free.ok
    assert held.measured == "30720 MiB still held after 10 s, by pids 4242 (20480 MiB), 4243"
    assert held.expected == "under 512 MiB held by other processes within 10 s"
    assert sum(t.slept) == pytest.approx(10.0) and max(t.slept) <= 3.0
    assert fake.reads == 1 + len(t.slept) + 1, "each poll reads only the GPU still held (the free one once)"


def test_this_process_own_memory_is_not_held(driver):
    t = FakeTime()
    driver(FakeNvml([gpu_like(used=[GIB + 100 * MIB], procs=[(os.getpid(), GIB)])]))
    [r] = gpu.wait_memory_released([0], "nodea", sleep=t.sleep, clock=t.clock)
    assert r.ok and r.value == pytest.approx(100) and t.slept == []


def test_memory_nobody_names_still_fails(driver):
    t = FakeTime()
    driver(FakeNvml([gpu_like(used=[2 * GIB], procs=[])]))
    [r] = gpu.wait_memory_released([0], "nodea", wait_s=4.0, sleep=t.sleep, clock=t.clock)
    assert not r.ok and r.measured.endswith("by no process NVML names")


# --- the matmul -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [7, 64, 100, 257])
def test_the_closed_form_is_the_int64_product(n):
    a, b, want = gpu._operands(n, torch.device("cpu"))
    assert a.dtype == torch.float32 and a.abs().max() == 3 and b.abs().max() == 3
    assert torch.equal(a.to(torch.int64) @ b.to(torch.int64), want.to(torch.int64))


def test_fp32_is_exact_in_any_summation_order():
    a, b, want = gpu._operands(256, torch.device("cpu"))
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[:, perm] @ b[perm, :], want)
    halves = a[:, :100] @ b[:100, :] + a[:, 100:] @ b[100:, :]
    assert torch.equal(halves, want)


def test_the_matmul_on_cpu_is_exact_and_timed():
    r = gpu.matmul("cpu", "nodea")
    assert (r.check, r.ok, r.detail) == ("gpu_matmul", True, "cpu"), r.measured
    assert r.value is not None and 0 < r.value < r.seconds < 1.0  # ~0.05 s here; generous for shared cores
    assert "256x256" in r.measured


def test_autocast_around_the_gate_does_not_round_the_result():
    """bf16 outputs round every value above 256: an unguarded matmul would differ in most elements."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = gpu.matmul("cpu", "nodea")
    assert r.ok, r.measured


def test_a_corrupted_element_is_caught(monkeypatch):
    real = torch.matmul

    def one_bit_off(a, b):
        c = real(a, b)
        c[5, 7] = c[5, 7] + 1.0
        return c

    monkeypatch.setattr(torch, "matmul", one_bit_off)
    r = gpu.matmul("cpu", "nodea")
    assert not r.ok and r.value is None
    assert r.measured == "wrong result: 1 of 65536 elements differ (silent data corruption?)"


def test_a_nan_is_caught(monkeypatch):
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: real(a, b).index_fill_(0, torch.tensor([3]), float("nan")))
    r = gpu.matmul("cpu", "nodea")
    assert not r.ok and r.measured.startswith("wrong result: 256 of 65536")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_real_gpu():
    r = gpu.matmul(torch.device("cuda", 0), "here")
    assert r.ok and r.detail.startswith("GPU 0 (") and r.value is not None and r.seconds < 1.0, r
    [h] = gpu.health([0], "here")
    assert h.skipped or h.detail.startswith("GPU 0 (GPU-"), h
    [m] = gpu.wait_memory_released([0], "here", wait_s=0.0)
    assert m.skipped or m.value is not None, m


# --- slow ones ------------------------------------------------------------------------------------------

def timed(host: str, index: int, seconds: float, kind: str = "NVIDIA H100 80GB HBM3") -> Result:
    detail = "cpu" if kind == "cpu" else f"GPU {index} ({kind})"
    return Result("gpu_matmul", host, True, "", detail=detail, value=seconds)


def test_the_slow_gpu_among_its_peers():
    results = [timed(h, i, 0.004) for h in ("nodea", "nodeb") for i in range(4) if (h, i) != ("nodeb", 2)]
    results.append(timed("nodeb", 2, 0.009))
    [slow] = gpu.slow_ones(results)
    assert (slow.check, slow.host, slow.ok, slow.detail) == ("gpu_slow", "nodeb", False, "GPU 2 (NVIDIA H100 80GB HBM3)")
    assert slow.measured == "9 ms per matmul" and slow.expected == "about 4 ms (the median of 8 GPUs)"
    assert slow.value == 0.009


def test_too_few_to_judge_and_the_boundary():
    assert gpu.slow_ones([timed("a", 0, 1.0), timed("b", 0, 5.0)]) == []
    assert gpu.slow_ones([timed("a", 0, 1.0), timed("b", 0, 1.0), timed("c", 0, 1.5)]) == []  # not over 1.5x
    assert [r.host for r in gpu.slow_ones([timed("a", 0, 1.0), timed("b", 0, 1.0), timed("c", 0, 1.51)])] == ["c"]


def test_kinds_are_not_compared_and_failures_are_not_timings():
    cpus = [timed(h, 0, 0.002, "cpu") for h in "abc"]
    gpus = [timed(h, 0, 0.0002) for h in "def"]
    a100s = [timed(h, 0, 0.0009, "NVIDIA A100-SXM4-80GB") for h in "ghi"]
    broken = Result("gpu_matmul", "j", False, "wrong result", detail="GPU 0 (NVIDIA H100 80GB HBM3)", value=9.0)
    assert gpu.slow_ones(cpus + gpus + a100s + [broken]) == []
    [slow] = gpu.slow_ones(cpus + [timed("z", 0, 0.01, "cpu")])
    assert slow.host == "z" and slow.expected == "about 2 ms (the median of 4 hosts)"
