"""The GPU acceptance check: every part judges what it measures against a threshold written beside
it, and prints PASS / FAIL with the figure.

    bash bench/gpu_device.sh                        # the device command (BENCHMARKS.md, "GPU acceptance")
    python bench/gpu_check.py [--out DIR] [--only doctor,checkpoint] [--budget_s 330]

Each part runs in a process of its own under a hard limit; one that hangs, crashes or exits loses
only itself. The limits are cut to fit `--budget_s` in all (the device command must end within 6
minutes, so a rerun still fits in a 15-minute lease). DIR/gpu_results.json (valid JSON after every
part) and DIR/gpu_check.log (every part's output) are written as it goes. Without CUDA every GPU
part says "skipped: no CUDA"; the others still run. Exit 0 unless a part FAILed.

No third-party imports here beyond torch: the GPU machine's Python has no `fire`, and the device
command carries it only for ddp_kit's own commands.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: float  # its hard limit when the budget allows
    cuda: bool  # needs a GPU: "skipped: no CUDA" without one
    threshold: str  # what PASS means, printed beside the figure


# ---- helpers --------------------------------------------------------------------------------------

def _sub(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run `cmd` in its own session; on timeout kill that whole process group (torchrun's workers too)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return {"rc": None, "timed_out": True, "s": round(time.monotonic() - t0, 1), "stdout": out, "stderr": err}
    return {"rc": p.returncode, "timed_out": False, "s": round(time.monotonic() - t0, 1), "stdout": out, "stderr": err}


def _verdict(ok: bool, figure: str, **details) -> dict:
    return {"verdict": "PASS" if ok else "FAIL", "figure": figure, **details}


def _data(n: int):
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def _resnet():
    import torch
    import torchvision
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _step_fn(model, opt, device):
    import torch

    def step(batch):
        x, y = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _timed(step, loader, steps: int, warmup: int) -> tuple[float, float]:
    """(median seconds per step over windows of 10, whole seconds per step) over `steps` steps after
    `warmup`; the whole figure includes every event step (checkpoints, logs), the median does not."""
    import torch
    it, done, windows, t_start, t0 = iter(loader), 0, [], None, None
    while done < warmup + steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        step(batch)
        done += 1
        if done >= warmup and (done - warmup) % 10 == 0:
            torch.cuda.synchronize()
            now = time.perf_counter()
            if t0 is not None:
                windows.append((now - t0) / 10)
            t0 = now
            t_start = now if t_start is None else t_start
    return statistics.median(windows), (t0 - t_start) / steps


def _raw(steps: int, warmup: int, batch: int) -> tuple[float, float]:
    import torch

    from ddp_kit.parallel.wrap import kernel_settings
    dev = torch.device("cuda")
    kernel_settings(dev)  # the TF32 / cudnn.benchmark switches ddp_kit.init sets: like against like
    model = _resnet().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    loader = torch.utils.data.DataLoader(_data(batch * 40), batch_size=batch, shuffle=True, drop_last=True,
                                         pin_memory=True)
    return _timed(_step_fn(model, opt, dev), loader, steps, warmup)


def _kit(steps: int, warmup: int, batch: int, run_dir: str, features: bool, count_syncs: bool = False):
    import torch

    import ddp_kit
    on = dict(ckpt_every=100, async_ckpt=True, log_every=50, sync_check_every=100, preempt_check_every=10)
    off = dict(ckpt_every=0, ckpt_every_s=0, log_every=0, sync_check_every=0, preempt_check_every=0,
               rank_metrics=False, hang_timeout_s=0)
    run = ddp_kit.init(run_dir=run_dir, resume="never", **(on if features else off))
    # one epoch holds every counted step, so no step's owed end-of-epoch work runs outside the count
    n = batch * (warmup + steps + 10)
    model, loader = run.prepare(_resnet(), torch.utils.data.DataLoader(_data(n), batch_size=batch, shuffle=True,
                                                                       drop_last=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    run.resume(optimizer=opt)
    inner = _step_fn(model, opt, run.device)
    syncs: list[tuple[int, int]] = []

    def step(b):
        return run.step(inner(b))

    def counted(b):  # the whole step (copy in, forward, backward, optimizer, boundary), counted
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                done = step(b)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append((done, sum("synchroniz" in str(w.message).lower() for w in caught)))
    try:
        if count_syncs:
            _timed(counted, loader, steps, warmup)
            return syncs
        return _timed(step, loader, steps, warmup)
    finally:
        run.close()


# ---- parts ----------------------------------------------------------------------------------------

def part_doctor() -> dict:
    res = _sub([PY, "-m", "ddp_kit.doctor", "--json", "--memory", "--comm"], 60)
    try:
        report = json.loads(res["stdout"])
    except ValueError:
        return _verdict(False, "stdout is not JSON", stdout=res["stdout"][-1500:], stderr=res["stderr"][-1500:])
    return _verdict(True, f"valid JSON, rc {res['rc']}", report=report)


def part_preflight() -> dict:
    res = _sub([PY, "-m", "ddp_kit.doctor", "--preflight", "--mode", "thorough", "--json", "--run_dir",
                str(Path(tempfile.mkdtemp()) / "run")], 55)
    try:
        report = json.loads(res["stdout"])
    except ValueError:
        return _verdict(False, "stdout is not JSON", stdout=res["stdout"][-1500:], stderr=res["stderr"][-1500:])
    seen = {r["check"]: r for r in report.get("results", [])}
    gpu_read = "gpu_health" in seen and not seen["gpu_health"].get("skipped") and "gpu_matmul" in seen
    figure = f"healthy={report.get('healthy')}, rc {res['rc']}, {report.get('seconds')}s; " + "; ".join(
        f"{r['check']}: {r.get('measured', '')}" for r in report.get("results", []))
    return _verdict(gpu_read and res["rc"] in (0, 2), figure[:600], report=report)


def part_checkpoint() -> dict:
    import torch

    from ddp_kit.checkpoint.checkpointer import Checkpointer
    from ddp_kit.checkpoint.staging import tensors_in
    from ddp_kit.dist import distributed
    dev = torch.device("cuda")
    model = _resnet().to(dev)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(8, 3, 32, 32, device=dev)).sum().backward()
    opt.step()
    shared = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    mib = sum(t.numel() * t.element_size() for t in tensors_in(shared)) / 2**20
    with tempfile.TemporaryDirectory() as d, distributed() as ctx:
        saves, blocks = [], []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.save(shared, f"{d}/plain.pt")
            saves.append(time.perf_counter() - t0)
        ck = Checkpointer(ctx, f"{d}/ckpt", async_save=True)
        for i in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ck.save(i + 1, shared, {"rng": torch.get_rng_state()}, {})
            blocks.append(time.perf_counter() - t0)
            ck.wait()
        # map_location absent, in a process that sees no GPU: the file must hold CPU tensors only
        loaded = _sub([PY, "-c", "import torch,sys; sd=torch.load(sys.argv[1], weights_only=True); "
                       "print(all(t.device.type=='cpu' for t in sd.values()))", f"{d}/ckpt/step_4/model.pt"],
                      60, env={"CUDA_VISIBLE_DEVICES": ""})
    save_ms, block_ms = statistics.median(saves) * 1e3, statistics.median(blocks[1:]) * 1e3
    ratio = block_ms / save_ms
    cpu_ok = loaded["stdout"].strip() == "True"
    return _verdict(ratio <= 0.25 and cpu_ok, f"async blocks {block_ms:.1f} ms vs torch.save {save_ms:.1f} ms "
                    f"(ratio {ratio:.3f}) for {mib:.0f} MiB; model.pt loads on a CPU-only process: {cpu_ok}",
                    ratio=ratio, async_block_ms=block_ms, torch_save_ms=save_ms, first_block_ms=blocks[0] * 1e3,
                    model_pt_loads_without_gpu=cpu_ok, load_stderr=loaded["stderr"][-800:])


def part_host_syncs() -> dict:
    with tempfile.TemporaryDirectory() as d:
        per_step = _kit(100, 10, 256, d, features=True, count_syncs=True)
    # steps 1..10 are warm-up (allocator, cuDNN autotuning); every 10th step carries an event (the
    # preemption check; a log record at 50; a sync check and a checkpoint at 100)
    steady = [n for s, n in per_step if s > 10 and s % 10]
    events = {s: n for s, n in per_step if s > 10 and not s % 10}
    worst = max(steady or [0])
    return _verdict(bool(steady) and worst == 0, f"max {worst} sync(s) over {len(steady)} steady-state steps; "
                    f"at events: {events}", steady_steps=len(steady), steady_syncs_max=worst, syncs_at_events=events)


def part_step_ratio() -> dict:
    raw, bare, full, raw_w, bare_w, full_w = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(3):  # alternated: the order rotates, so warming of the GPU favours no variant
            for v in ("raw", "bare", "full")[r:] + ("raw", "bare", "full")[:r]:
                if v == "raw":
                    m, w = _raw(200, 20, 256)
                    raw.append(m), raw_w.append(w)
                else:
                    m, w = _kit(200, 20, 256, f"{d}/{v}{r}", features=v == "full")
                    (bare if v == "bare" else full).append(m), (bare_w if v == "bare" else full_w).append(w)
    step = statistics.median(b / a for a, b in zip(raw, bare))
    loop = statistics.median(f / a for a, f in zip(raw_w, full_w))
    return _verdict(step <= 1.03 and loop <= 1.10,
                    f"step alone {step:.3f}x raw (median window), whole loop with checkpoints and logs {loop:.3f}x "
                    f"raw (wall time); raw {statistics.median(raw) * 1e3:.2f} ms/step, "
                    f"{256 / statistics.median(raw):.0f} img/s", step_ratio=step, loop_ratio=loop,
                    raw_ms=[x * 1e3 for x in raw], bare_ms=[x * 1e3 for x in bare], full_ms=[x * 1e3 for x in full],
                    raw_wall_ms=[x * 1e3 for x in raw_w], full_wall_ms=[x * 1e3 for x in full_w])


AMP_TOLERANCE = 0.05  # relative difference from fp32 at every logged step after 10


def part_amp() -> dict:
    curves = {}
    for amp in ("off", "bf16", "fp16"):  # fp16 runs under ddp_kit's GradScaler
        with tempfile.TemporaryDirectory() as d:
            res = _sub([PY, "-m", "ddp_kit.train", "--model", "cnn", "--dataset", "synthetic", "--synthetic_size",
                        "4096", "--max_steps", "60", "--log_every", "5", "--amp", amp, "--device", "cuda",
                        "--progress", "false", "--run_dir", d], 60)
            path = Path(d, "metrics.jsonl")
            records = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
        curves[amp] = {r["step"]: r["loss"] for r in records if r.get("event") == "train" and "loss" in r}
        if res["rc"] != 0:
            return _verdict(False, f"amp {amp} failed (rc {res['rc']})", stderr=res["stderr"][-1500:])
    worst = {amp: max(abs(curves[amp][s] - ref) / abs(ref) for s, ref in curves["off"].items() if s > 10 and s in curves[amp])
             for amp in ("bf16", "fp16")}
    return _verdict(all(v <= AMP_TOLERANCE for v in worst.values()),
                    f"largest relative loss difference from fp32: bf16 {worst['bf16']:.3f}, fp16+GradScaler "
                    f"{worst['fp16']:.3f} (tolerance {AMP_TOLERANCE})", curves=curves, worst=worst)


OOM_SCRIPT = ("import sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv[1])); "
              "sys.argv = ['ddp_kit.train'] + sys.argv[2:]; from ddp_kit.train import main; main()")


def part_oom_report() -> dict:
    with tempfile.TemporaryDirectory() as d:
        res = _sub([PY, "-c", OOM_SCRIPT, "0.005", "--model", "resnet18", "--dataset", "synthetic",
                    "--batch_size", "4096", "--max_steps", "3", "--progress", "false", "--run_dir", d], 90)
    err = res["stderr"]
    failed = re.search(r"ddp_kit: error: rank (\d+) failed at step (\d+) in ([a-z /]+): \w*OutOfMemoryError", err)
    report = re.search(r"ddp_kit: \[rank \d+\] out of GPU memory on cuda:\d+: allocated [\d.]+ GiB.*of [\d.]+ GiB", err)
    advice = "try: --grad_accum" in err
    ok = res["rc"] not in (0, None) and bool(failed and report and advice)
    return _verdict(ok, (f"rank {failed.group(1)}, step {failed.group(2)}, phase {failed.group(3)}; " if failed else
                         "no ddp_kit error line naming rank/step/phase; ")
                    + (report.group(0).split("] ", 1)[1] if report else "no ddp_kit memory report"),
                    rc=res["rc"], lines=[ln for ln in err.splitlines() if ln.startswith("ddp_kit:")][:12])


def part_hang() -> dict:
    with tempfile.TemporaryDirectory() as d:
        res = _sub([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "ddp_kit.train",
                    # world 1: a stall gets the startup bound (init_timeout_s), not hang_timeout_s
                    "--epochs", "1", "--progress", "false", "--device", "cuda", "--init_timeout_s", "10",
                    "--run_dir", d, "--inject", "hang:rank=0:step=3"], 60)
        hang = Path(d, "hang")
        traces = sorted(p.name for p in hang.glob("nccl_trace_rank_*")) if hang.is_dir() else []
        read = _sub([PY, "-m", "torch.distributed.flight_recorder.fr_trace", "-p", "nccl_trace_rank_", str(hang)], 60) \
            if traces else {"rc": None, "stdout": "", "stderr": "no trace file"}
    reported = "ddp_kit: hang: no progress for" in res["stderr"]
    ok = reported and bool(traces) and read["rc"] == 0
    return _verdict(ok, f"hang reported: {reported}; flight-recorder files {traces or 'none'}; fr_trace rc {read['rc']}",
                    stderr=res["stderr"][-1500:], fr_trace=(read["stdout"] + read["stderr"])[-1500:])


FIT_GIB = 3.0  # the simulated smaller GPU: below big_model's 6.6 GB of weights + gradients + AdamW state


def part_fsdp_fit() -> dict:
    """bench/big_model.py (415M parameters, 6.6 GB of fp32 weights, gradients and AdamW state) on a GPU
    capped at FIT_GIB: DDP must run out of memory and say so; FSDP with CPU offload must train,
    checkpoint and evaluate."""
    import torch
    fraction = FIT_GIB * 2**30 / torch.cuda.get_device_properties(0).total_memory
    args = ["--model", "big_model:deep_mlp", "--dataset", "synthetic", "--synthetic_size", "256", "--batch_size", "64",
            "--max_steps", "2", "--log_every", "1", "--progress", "false", "--device", "cuda"]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out: dict = {}
    for name, extra, limit in (("ddp", [], 40), ("fsdp", ["--strategy", "fsdp", "--fsdp_cpu_offload", "true"], 110)):
        with tempfile.TemporaryDirectory() as d:
            res = _sub([PY, "-c", OOM_SCRIPT, str(fraction), *args, *extra, "--run_dir", d], limit, env)
            saved = any(Path(d, "checkpoints").glob("step_*/dcp/.metadata"))
        out[name] = {"rc": res["rc"], "oom": "out of GPU memory" in res["stderr"], "s": res["s"],
                     "checkpointed": saved, "tail": res["stderr"][-600:]}
    ok = out["ddp"]["rc"] not in (0, None) and out["ddp"]["oom"] and out["fsdp"]["rc"] == 0 and out["fsdp"]["checkpointed"]
    return _verdict(ok, f"capped at {FIT_GIB:g} GiB: DDP rc {out['ddp']['rc']} (out of memory: {out['ddp']['oom']}); "
                    f"FSDP + CPU offload rc {out['fsdp']['rc']} in {out['fsdp']['s']}s, checkpointed: "
                    f"{out['fsdp']['checkpointed']}", **out)


def part_straggler() -> dict:
    res = _sub([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / "gpu_straggler.py")], 90)
    lines = [ln for ln in res["stdout"].splitlines() + res["stderr"].splitlines() if "straggler" in ln]
    named = [ln for ln in lines if "rank 1" in ln]
    wrong = [ln for ln in lines if "rank 0" in ln and "rank 1" not in ln]
    return _verdict(res["rc"] == 0 and bool(named) and not wrong, named[0] if named else "rank 1 not named",
                    lines=lines, stderr=None if lines else res["stderr"][-1500:])


def part_pytest_cuda() -> dict:
    res = _sub([PY, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"], 120)
    last = (res["stdout"].strip().splitlines() or [""])[-1]
    return _verdict(res["rc"] == 0 and "passed" in last and "failed" not in last, last, tail=res["stdout"][-2500:])


PARTS: dict[str, tuple[Part, Callable[[], dict]]] = {p.name: (p, fn) for p, fn in (
    (Part("doctor", 45, False, "`python -m ddp_kit.doctor --json --memory --comm` prints valid JSON"), part_doctor),
    (Part("preflight", 60, True, "`doctor --preflight --mode thorough --json` reads NVML and runs the checked matmul "
          "on the GPU (healthy or not, said in the figure)"), part_preflight),
    (Part("checkpoint", 45, True, "async save blocks <= 0.25x torch.save of the same state; model.pt loads with no "
          "map_location in a process with no GPU"), part_checkpoint),
    (Part("host_syncs", 45, True, "0 device->host syncs in every steady-state step (after 10 warm-up steps, "
          "event steps apart)"), part_host_syncs),
    (Part("step_ratio", 75, True, "ddp_kit/raw step time <= 1.03 (median window), whole loop with checkpoints "
          "and logs <= 1.10 (wall time); resnet18 bf16 batch 256, world 1, 3 alternated rounds"), part_step_ratio),
    (Part("amp", 60, True, f"bf16 and fp16+GradScaler loss curves within {AMP_TOLERANCE:.0%} of fp32"), part_amp),
    (Part("oom_report", 40, True, "ddp_kit's own report: the error line names rank, step and phase; the memory "
          "line and the advice follow"), part_oom_report),
    (Part("hang", 45, True, "a hang at world 1 under NCCL is reported and leaves a flight-recorder file in "
          "run_dir/hang/ that torch's fr_trace reads"), part_hang),
    (Part("straggler", 60, True, "2 ranks on the GPU, rank 1's GPU slowed: the straggler warning names rank 1 "
          "only"), part_straggler),
    (Part("pytest_cuda", 90, True, "`pytest -m cuda tests` passes"), part_pytest_cuda),
    (Part("fsdp_fit", 110, True, f"a model that OOMs under DDP on a GPU capped at {FIT_GIB:g} GiB trains and "
          "checkpoints under FSDP with CPU offload"), part_fsdp_fit),
)}


# ---- the driver -------------------------------------------------------------------------------------

def versions() -> dict:
    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_build": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))))
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # a build without NCCL
            out["nccl"] = f"unavailable ({exc})"
    smi = _sub(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"], 20) \
        if _which("nvidia-smi") else None
    out["driver"] = smi["stdout"].strip() if smi and smi["rc"] == 0 else "no nvidia-smi"
    return out


def _which(name: str) -> bool:
    return any(Path(d, name).is_file() for d in os.environ.get("PATH", "").split(os.pathsep))


def drive(out_dir: Path, only: list[str], budget_s: float) -> int:
    import torch
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path, log_path = out_dir / "gpu_results.json", out_dir / "gpu_check.log"
    deadline = time.monotonic() + budget_s
    info = versions()
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    results: dict = {"versions": info, "budget_s": budget_s, "parts": {}}
    names = [n for n in PARTS if not only or n in only]
    cuda = torch.cuda.is_available()
    with open(log_path, "w") as log, tempfile.TemporaryDirectory() as work:
        for i, name in enumerate(names):
            part, _ = PARTS[name]
            left = deadline - time.monotonic() - 5 * (len(names) - i - 1)  # a few seconds kept for each later part
            if part.cuda and not cuda:
                r = {"verdict": "skipped", "figure": "no CUDA"}
            elif left < 10:
                r = {"verdict": "skipped", "figure": f"out of time ({budget_s:.0f}s budget)"}
            else:
                limit = min(part.limit_s, left)
                res = _sub([PY, str(Path(__file__).resolve()), "--part", name, "--work", work], limit)
                log.write(f"===== {name} (limit {limit:.0f}s, took {res['s']}s, rc {res['rc']})\n{res['stdout']}\n"
                          f"{res['stderr']}\n")
                log.flush()
                path = Path(work, f"{name}.json")
                if res["timed_out"]:
                    r = {"verdict": "FAIL", "figure": f"timed out after {limit:.0f}s (its hard limit)"}
                elif path.exists():
                    r = json.loads(path.read_text())
                else:
                    tail = (res["stderr"].strip().splitlines() or ["no output"])[-1]
                    r = {"verdict": "FAIL", "figure": f"exited {res['rc']} before reporting: {tail[:300]}"}
                r["seconds"] = res["s"]
            r["threshold"] = part.threshold
            results["parts"][name] = r
            print(f"gpu_check: {name}: {r['verdict']}: {r['figure']}", flush=True)
            results_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table(results))
    return 1 if any(r["verdict"] == "FAIL" for r in results["parts"].values()) else 0


def table(results: dict) -> str:
    """The BENCHMARKS.md table of a results file."""
    out = ["| part | verdict | figure | threshold |", "|---|---|---|---|"]
    for name, r in results.get("parts", {}).items():
        out.append(f"| {name} | {r.get('verdict')} | {str(r.get('figure', '')).replace('|', '/')} | {r.get('threshold', '')} |")
    return "\n".join(out)


def run_part(name: str, work: str) -> None:
    """One part, in this process: its verdict goes to work/<name>.json (a crash leaves none)."""
    _, fn = PARTS[name]
    try:
        r = fn()
    except BaseException as exc:  # SystemExit from the kit too: the verdict is this part's, not the driver's
        r = {"verdict": "FAIL", "figure": f"{type(exc).__name__}: {str(exc)[:400]}"}
    Path(work, f"{name}.json").write_text(json.dumps(r, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "gpu_out"), help="folder for gpu_results.json and gpu_check.log")
    ap.add_argument("--only", default="", help="comma list of parts (default: all): " + ", ".join(PARTS))
    ap.add_argument("--budget_s", type=float, default=330.0, help="all parts together end within this")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        run_part(args.part, args.work)
        return 0
    unknown = [n for n in args.only.split(",") if n and n not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    return drive(Path(args.out), [n for n in args.only.split(",") if n], args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
