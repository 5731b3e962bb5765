"""The GPU acceptance check: one command on one CUDA machine, under 8 minutes on an H200.

    python bench/gpu_check.py [--out bench/gpu_results.json] [--steps 200] [--rounds 3]

Each part runs on its own, with its own time limit; a part that fails is recorded as failed with
its reason and the others still run. Parts:
  pytest_cuda   `pytest -m cuda tests` (the GPU-only tests)
  step_ratio    resnet18 on CIFAR-shaped data, bf16, batch 256: the ddp_kit API loop (run.step,
                checkpoints, sync checks, preemption checks, per-rank metrics on) against the bare loop,
                alternated round by round; median step time, ratio and its min..max, images/s
  host_syncs    device->host syncs per step of that API loop (torch.cuda.set_sync_debug_mode), in
                steady-state steps and at log / sync-check events
  checkpoint    the training thread's blocking time of ddp_kit's async save against torch.save
  oom_report    `python -m ddp_kit.train` under a memory-fraction cap: the OOM report is printed
  fsdp_fit      a model that does not fit without FSDP: bench/big_model.py (6.6 GB of weights,
                gradients and AdamW state) on the GPU capped at 3 GiB; DDP runs out of memory,
                --strategy fsdp --fsdp_cpu_offload true trains, checkpoints and evaluates
  doctor        `python -m ddp_kit.doctor --json --memory --comm`
  straggler     2 ranks on the one GPU (gloo), rank 1's GPU slowed with torch.cuda._sleep
                (bench/gpu_straggler.py): the straggler warning names rank 1

Without CUDA it says so and exits 0. Writes the JSON report and prints the BENCHMARKS.md table.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import fire

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _sub(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "why": f"timed out after {timeout}s", "tail": str(exc.stdout or "")[-2000:]}
    return {"ok": res.returncode == 0, "rc": res.returncode, "s": round(time.monotonic() - t0, 1),
            "stdout": res.stdout[-3000:], "stderr": res.stderr[-3000:]}


def pytest_cuda() -> dict:
    out = _sub([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"], 240)
    last = (out.get("stdout") or "").strip().splitlines()[-1:] or [""]
    return {"ok": out["ok"], "summary": last[0], "tail": out.get("stdout", "")[-1500:]}


def _data(n: int, device):
    import torch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _model():
    import torch
    import torchvision
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _timed_loop(step_fn, loader, steps: int, skip: int) -> float:
    """Median seconds per step over `steps` steps after `skip`, in windows of 10 steps timed between
    two cuda synchronize calls (so the loop itself never waits for the GPU inside a window)."""
    import torch
    times, it, done = [], iter(loader), 0
    t0 = None
    while done < steps + skip:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        step_fn(batch)
        done += 1
        if done == skip or (done > skip and (done - skip) % 10 == 0):
            torch.cuda.synchronize()
            now = time.perf_counter()
            if t0 is not None:
                times.append((now - t0) / 10)
            t0 = now
    return statistics.median(times)


def _raw_variant(steps: int, skip: int, batch: int) -> float:
    import torch

    from ddp_kit.wrap import kernel_settings
    dev = torch.device("cuda")
    kernel_settings(dev)  # the same TF32 / cudnn.benchmark switches ddp_kit.init sets: like against like
    model = _model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    loader = torch.utils.data.DataLoader(_data(batch * 40, dev), batch_size=batch, shuffle=True, drop_last=True,
                                         pin_memory=True)

    def step(b):
        x, y = (t.to(dev, non_blocking=True) for t in b)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _timed_loop(step, loader, steps, skip)


def _api_variant(steps: int, skip: int, batch: int, run_dir: str, count_syncs: bool = False):
    import torch

    import ddp_kit
    run = ddp_kit.init(run_dir=run_dir, resume="never", ckpt_every=100, async_ckpt=True, log_every=50,
                       sync_check_every=100, preempt_check_every=10)
    # Counting: one epoch holds every counted step, so no step's owed end-of-epoch checks run inside
    # the loader's fetch, outside the count.
    n = batch * (120 if count_syncs else 40)
    model, loader = run.prepare(_model(), torch.utils.data.DataLoader(_data(n, run.device), batch_size=batch,
                                                                       shuffle=True, drop_last=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    run.resume(optimizer=opt)
    syncs: list[tuple[int, int]] = []

    def step(b):
        x, y = (t.to(run.device, non_blocking=True) for t in b)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return run.step(loss)

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
            _timed_loop(counted, loader, 100, 10)
            return syncs
        return _timed_loop(step, loader, steps, skip)
    finally:
        run.close()


def step_ratio(steps: int, rounds: int, batch: int = 256) -> dict:
    raw, api = [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            order = ("raw", "api") if r % 2 == 0 else ("api", "raw")
            for v in order:
                if v == "raw":
                    raw.append(_raw_variant(steps, 20, batch))
                else:
                    api.append(_api_variant(steps, 20, batch, f"{d}/api{r}"))
    ratios = [a / b for a, b in zip(api, raw)]
    return {"ok": True, "batch": batch, "raw_ms": statistics.median(raw) * 1e3, "api_ms": statistics.median(api) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "raw_img_s": batch / statistics.median(raw), "api_img_s": batch / statistics.median(api)}


def host_syncs(batch: int = 256) -> dict:
    with tempfile.TemporaryDirectory() as d:
        per_step = _api_variant(0, 0, batch, d, count_syncs=True)
    # every 10th step carries an event: the preemption check (10), a log record (50), a sync check
    # and a checkpoint (100); the other steps are the steady state
    steady = [n for s, n in per_step if s % 10]
    at_events = {s: n for s, n in per_step if not s % 10}
    return {"ok": True, "steady_steps": len(steady), "steady_syncs_max": max(steady or [0]),
            "steady_syncs_total": sum(steady), "syncs_at_events": at_events}


def checkpoint() -> dict:
    import torch

    from ddp_kit.checkpoint import Checkpointer
    from ddp_kit.staging import tensors_in
    from ddp_kit.dist import distributed
    dev = torch.device("cuda")
    model = _model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(8, 3, 32, 32, device=dev)).sum().backward()
    opt.step()
    shared = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    out: dict = {"ok": True, "state_mb": sum(t.numel() * t.element_size() for t in tensors_in(shared)) / 2**20}
    with tempfile.TemporaryDirectory() as d, distributed() as ctx:
        saves, blocks = [], []
        for i in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.save(shared, f"{d}/plain.pt")
            saves.append(time.perf_counter() - t0)
        ck = Checkpointer(ctx, f"{d}/ckpt", async_save=True)
        for i in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ck.save(i + 1, shared, {"rng": torch.get_rng_state()}, {})
            blocks.append(time.perf_counter() - t0)
            ck.wait()
        loaded = subprocess.run([sys.executable, "-c", "import torch,sys; sd=torch.load(sys.argv[1], weights_only=True); "
                                 "print(all(t.device.type=='cpu' for t in sd.values()))", f"{d}/ckpt/step_5/model.pt"],
                                capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    out.update(torch_save_ms=statistics.median(saves) * 1e3, async_block_ms=statistics.median(blocks[1:]) * 1e3,
               first_async_block_ms=blocks[0] * 1e3, model_pt_loads_without_gpu=loaded.stdout.strip() == "True")
    out["ratio"] = out["async_block_ms"] / out["torch_save_ms"]
    return out


OOM_SCRIPT = ("import sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv[1])); "
              "sys.argv = ['ddp_kit.train'] + sys.argv[2:]; from ddp_kit.train import main; main()")


def oom_report() -> dict:
    with tempfile.TemporaryDirectory() as d:
        res = _sub([sys.executable, "-c", OOM_SCRIPT, "0.005", "--model", "resnet18", "--dataset", "synthetic",
                    "--batch_size", "4096", "--max_steps", "3", "--progress", "false", "--run_dir", d], 180)
    text = res.get("stderr", "")
    lines = [line for line in text.splitlines() if line.startswith("ddp_kit:") or line.startswith("  ")]
    named = any("out of memory" in line.lower() for line in lines)
    return {"ok": res.get("rc") not in (0, None) and named, "rc": res.get("rc"), "lines": lines[:12]}


FIT_GIB = 3.0  # the simulated smaller GPU: below big_model's 6.6 GB of weights + gradients + AdamW state


def fsdp_fit(steps: int = 4) -> dict:
    """A model that does not fit without FSDP: bench/big_model.py (415M parameters, 6.6 GB of fp32
    weights, gradients and AdamW state) on a GPU capped at FIT_GIB (set_per_process_memory_fraction,
    a smaller GPU simulated on the one we have). DDP must run out of memory and say so; FSDP with
    --fsdp_cpu_offload (world 1: the shards and the optimizer step live in host memory, one block's
    weights at a time on the GPU) must train, checkpoint (DCP, from host memory) and evaluate."""
    import torch
    fraction = FIT_GIB * 2**30 / torch.cuda.get_device_properties(0).total_memory
    args = ["--model", "big_model:deep_mlp", "--dataset", "synthetic", "--synthetic_size", "1024",
            "--batch_size", "64", "--max_steps", str(steps), "--log_every", "1", "--progress", "false"]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out: dict = {"cap_gib": FIT_GIB}
    for name, extra in (("ddp", []), ("fsdp", ["--strategy", "fsdp", "--fsdp_cpu_offload", "true"])):
        with tempfile.TemporaryDirectory() as d:
            res = _sub([sys.executable, "-c", OOM_SCRIPT, str(fraction), *args, *extra, "--run_dir", d], 480, env)
            records = [json.loads(line) for line in Path(d, "metrics.jsonl").read_text().splitlines()] \
                if Path(d, "metrics.jsonl").exists() else []
        ranks = [r["ranks"][0] for r in records if r.get("event") == "train" and "ranks" in r]
        oom = "out of memory" in res.get("stderr", "").lower()
        out[name] = {"rc": res.get("rc"), "oom": oom, "s": res.get("s"),
                     "peak_mem_mb": max((r["peak_mem_mb"] for r in ranks), default=None),
                     "step_s": ranks[-1]["step_s"] if ranks else None,
                     "state_bytes": (ranks[-1].get("param_bytes", 0) + ranks[-1].get("grad_bytes", 0)
                                     + ranks[-1].get("optim_bytes", 0)) if ranks else None,
                     "tail": res.get("stderr", "")[-600:]}
    out["ok"] = out["ddp"]["rc"] not in (0, None) and out["ddp"]["oom"] and out["fsdp"]["rc"] == 0
    return out


def straggler() -> dict:
    res = _sub([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(HERE / "gpu_straggler.py")], 240)
    lines = [line for line in res.get("stdout", "").splitlines() if "straggler" in line]
    return {"ok": res.get("ok", False) and any("rank 1" in line for line in lines), "lines": lines,
            "stderr": None if lines else res.get("stderr")}


def doctor() -> dict:
    res = _sub([sys.executable, "-m", "ddp_kit.doctor", "--json", "--memory", "--comm"], 120)
    try:
        report = json.loads(res.get("stdout", ""))
    except ValueError:
        report = None
    return {"ok": report is not None, "rc": res.get("rc"), "report": report,
            "stderr": None if report is not None else res.get("stderr")}


ROWS = {  # a passed part's row in BENCHMARKS.md: (what, result)
    "step_ratio": lambda r: (f"step time, resnet18 bf16 batch {r['batch']} (world 1)",
                             f"raw {r['raw_ms']:.2f} ms, ddp_kit {r['api_ms']:.2f} ms: ratio {r['ratio']:.3f} "
                             f"({r['ratio_min']:.3f}..{r['ratio_max']:.3f}); {r['api_img_s']:.0f} img/s"),
    "host_syncs": lambda h: ("host syncs per steady-state step",
                             f"max {h['steady_syncs_max']} over {h['steady_steps']} steps; at events: {h['syncs_at_events']}"),
    "checkpoint": lambda c: (f"checkpoint blocking ({c['state_mb']:.0f} MiB)",
                             f"async {c['async_block_ms']:.1f} ms vs torch.save {c['torch_save_ms']:.1f} ms (ratio "
                             f"{c['ratio']:.3f}); model.pt loads without a GPU: {c['model_pt_loads_without_gpu']}"),
    "straggler": lambda s: ("straggler on the GPU (rank 1 slowed)", f"named: {s['lines'][0]}"),
    "fsdp_fit": lambda f: (f"415M-parameter model (6.6 GB of state) on a GPU capped at {f['cap_gib']:.0f} GiB",
                           f"DDP: out of memory (rc {f['ddp']['rc']}); FSDP + CPU offload: trains, peak GPU "
                           f"{f['fsdp']['peak_mem_mb']} MB, {f['fsdp']['step_s']} s/step"),
}


def table(results: dict) -> str:
    out = ["| check | result |", "|---|---|"]
    for name, v in results.items():
        if not isinstance(v, dict):
            continue
        if v.get("ok") and name in ROWS:
            what, result = ROWS[name](v)
        else:
            what, result = name, f"ok {v.get('summary', '')}" if v.get("ok") else f"FAILED {v.get('why', '')}"
        out.append(f"| {what} | {result.strip()} |")
    return "\n".join(out)


def main(out: str = str(HERE / "gpu_results.json"), steps: int = 200, rounds: int = 3, only: str = ""):
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to measure; "
              "run it on a GPU machine (python -m ddp_kit.doctor says why CUDA is missing)")
        return
    parts = {"pytest_cuda": pytest_cuda, "step_ratio": lambda: step_ratio(steps, rounds),
             "host_syncs": host_syncs, "checkpoint": checkpoint, "straggler": straggler, "oom_report": oom_report,
             "fsdp_fit": fsdp_fit, "doctor": doctor}
    wanted = [p for p in (only.split(",") if only else parts) if p]
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in wanted:
        t0 = time.monotonic()
        try:
            results[name] = parts[name]()
        except Exception as exc:  # one broken part must not hide the others' figures
            results[name] = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"gpu_check: {name}: {'ok' if results[name].get('ok') else 'FAILED'} ({results[name]['seconds']}s)",
              flush=True)
        Path(out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table(results))


if __name__ == "__main__":
    fire.Fire(main)
