"""Where the work runs: batches copied to the device, and the process's kernel switches (TF32,
cuDNN autotuning, determinism)."""
from __future__ import annotations

import os

import torch


def kernel_settings(device: torch.device, *, tf32: bool = True, cudnn_benchmark: bool = True,
                    deterministic: bool = False, environ: dict | None = None) -> None:
    """Speed and determinism switches, for the whole process.

    `deterministic` wins over speed: cuDNN's deterministic algorithms without autotuning, torch's
    deterministic implementations (an op without one raises, naming itself), and a fixed cuBLAS
    workspace (CUBLAS_WORKSPACE_CONFIG, unless set: read at the first cuBLAS call, so set here
    before any model runs). TF32 is left as asked: it is deterministic, only less precise."""
    environ = os.environ if environ is None else environ
    if deterministic:
        environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark and not deterministic
    torch.backends.cudnn.deterministic = deterministic


def to_device(batch, device: torch.device):
    """Copy a batch (tensor, or tuple/list/dict of them) to `device`; non-blocking from pinned memory."""
    non_blocking = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
