"""GPU-only paths (NCCL, bf16 on CUDA, the OOM report). Skipped without CUDA; they run on a GPU machine."""
import os
import sys

import pytest
import torch

from conftest import ok, read_json, run_cmd, torchrun

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpus(n=None):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return {"CUDA_VISIBLE_DEVICES": visible if n is None else ",".join(visible.split(",")[:n])}


@pytest.mark.integration
def test_one_gpu_bf16(tmp_path):
    ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "3", "--amp", "bf16", "--device", "cuda",
                "--progress", "false", "--run_dir", str(tmp_path)], env=gpus(1)))
    s = read_json(tmp_path / "summary.json")
    assert s["device"] == "cuda:0" and s["backend"] == "nccl" and s["eval_accuracy"] > 0.9


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl(tmp_path):
    ok(torchrun(["-m", "ddp_kit.train", "--epochs", "3", "--progress", "false", "--run_dir", str(tmp_path)], nproc=2,
                env=gpus(2)))
    s = read_json(tmp_path / "summary.json")
    assert s["backend"] == "nccl" and s["world_size"] == 2 and s["eval_samples"] == 360


@pytest.mark.integration
def test_oom_prints_memory_report_and_advice(tmp_path):
    res = run_cmd([sys.executable, "-m", "ddp_kit.train", "--model", "resnet18", "--dataset", "synthetic",
                   "--synthetic_size", "4096", "--batch_size", "4096", "--epochs", "1", "--device", "cuda",
                   "--progress", "false", "--run_dir", str(tmp_path)], env=gpus(1))
    if res.returncode == 0:
        pytest.skip("this GPU fits the batch; no OOM to report")
    assert "out of GPU memory" in res.stderr and "--grad_accum" in res.stderr


def test_steady_state_steps_make_no_host_sync(tmp_path):
    """torch.cuda.set_sync_debug_mode("error") raises on any device->host sync: none may happen in a
    step that is not a log, check or checkpoint event (fused optimizer, loss kept on the device)."""
    import ddp_kit
    run = ddp_kit.init(run_dir=str(tmp_path), device="cuda", resume="never", log_every=0, sync_check_every=0,
                       preempt_check_every=10, ckpt_every=0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    data = torch.utils.data.TensorDataset(torch.randn(640, 32), torch.randint(0, 4, (640,)))
    model, loader = run.prepare(model, torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    run.resume(optimizer=opt)
    for i, (x, y) in enumerate(loader):
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        steady = 2 <= i and (i + 1) % 10 != 0
        torch.cuda.set_sync_debug_mode("error" if steady else "default")
        try:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.step(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    run.close()


@pytest.mark.integration
def test_checkpoints_written_on_gpu_load_without_one(tmp_path):
    from ddp_kit.checkpoint.checkpointer import Checkpointer
    from ddp_kit.dist import distributed
    model = torch.nn.Linear(8, 4).cuda()
    with distributed(device="cuda") as ctx:
        for async_save in (False, True):
            ck = Checkpointer(ctx, tmp_path / f"async{async_save}", async_save=async_save)
            ck.save(1, {"model": model.state_dict()}, {"rng": torch.get_rng_state()}, {})
            ck.wait()
            res = ok(run_cmd([sys.executable, "-c", "import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
                              "print(sorted({t.device.type for t in sd.values()}))",
                              str(tmp_path / f"async{async_save}" / "step_1" / "model.pt")], env={"CUDA_VISIBLE_DEVICES": ""}))
            assert res.stdout.strip() == "['cpu']", res.stdout
            shared, _, _ = ck.load(ck.find("auto", warn=print))
            assert shared["model"]["weight"].device.type == "cpu"  # copied to the GPU once, by load_state_dict
            assert torch.equal(shared["model"]["weight"], model.weight.detach().cpu())


def test_gpu_spans_see_a_slowed_gpu():
    from ddp_kit.reliability.metrics import GpuSpans, StepTimer
    times = {}
    for cycles in (0, 50_000_000):
        timer = StepTimer(gpu=GpuSpans())
        x = torch.randn(256, 256, device="cuda")
        for _ in range(5):
            timer.mark("data")
            if cycles:
                torch.cuda._sleep(cycles)
            (x @ x).sum()
            timer.mark("forward")
            timer.mark("backward")
            timer.mark("optimizer")
            timer.steps += 1
        torch.cuda.synchronize()
        times[cycles] = timer.window()
    assert times[50_000_000]["gpu_forward_s"] > 5 * times[0]["gpu_forward_s"]
    assert times[50_000_000]["local_s"] >= times[50_000_000]["gpu_forward_s"]


@pytest.mark.integration
def test_straggler_named_from_gpu_time_on_one_gpu():
    from conftest import ROOT
    res = ok(torchrun([str(ROOT / "bench" / "gpu_straggler.py")], nproc=2, env=gpus(1), timeout=240))
    lines = [line for line in res.stdout.splitlines() if line.startswith("ddp_kit: warning: straggler")]
    assert len(lines) == 1 and "rank 1" in lines[0] and "GPU forward" in lines[0], res.stdout


@pytest.mark.integration
def test_fsdp_on_one_gpu_async_sharded_checkpoint_resumes(tmp_path):
    """strategy fsdp at world size 1 on a GPU: DCP checkpoints, async (a gloo group of their own beside
    NCCL), resumed by a second run."""
    args = [sys.executable, "-m", "ddp_kit.train", "--strategy", "fsdp", "--async_ckpt", "true", "--device", "cuda",
            "--ckpt_every", "10", "--progress", "false", "--run_dir", str(tmp_path)]
    ok(run_cmd([*args, "--max_steps", "20"], env=gpus(1)))
    assert (tmp_path / "checkpoints" / "step_20" / "dcp").is_dir()
    res = ok(run_cmd([*args, "--max_steps", "30"], env=gpus(1)))
    assert "resumed from" in res.stdout and read_json(tmp_path / "summary.json")["steps"] == 30


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("offload", ["false", "true"])
def test_fsdp_two_gpus_bf16(tmp_path, offload):
    """NCCL, bf16 mixed precision, optionally the shards and the optimizer step on the CPU; the final
    param_sha256 gathers the (offloaded) shards on the GPU."""
    ok(torchrun(["-m", "ddp_kit.train", "--strategy", "fsdp", "--amp", "bf16", "--fsdp_cpu_offload", offload,
                 "--epochs", "2", "--ckpt_every", "10", "--progress", "false", "--run_dir", str(tmp_path)],
                nproc=2, env=gpus(2)))
    s = read_json(tmp_path / "summary.json")
    assert s["backend"] == "nccl" and s["strategy"] == "fsdp" and s["eval_accuracy"] > 0.8
