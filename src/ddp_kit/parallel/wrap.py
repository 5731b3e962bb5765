"""Model wrapping: device placement, DDP (world size > 1 only), no_sync accumulation, AMP, SyncBN, compile."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..dist import DistContext
from ..errors import UserError
from .fsdp import FSDP_OPTIONS, accumulate, check_strategy, is_sharded, shard


def wrap_model(model: nn.Module, ctx: DistContext, *, sync_bn: bool = False, compile: bool = False,
               channels_last: bool = False, find_unused_parameters: bool = False,
               ddp: dict[str, Any] | None = None, strategy: str = "ddp", fsdp: dict[str, Any] | None = None,
               amp: str = "off") -> nn.Module:
    """Move `model` to the context's device and wrap it in DDP when there is more than one rank
    (strategy "ddp"), or shard it with FSDP2 over every rank, one included (strategy "fsdp", fsdp.py).

    `ddp`: DDP's own options (bucket_cap_mb, static_graph, gradient_as_bucket_view, ...). By default
    gradients are views into DDP's buckets (gradient_as_bucket_view): one gradient copy less in memory
    and no copy into the buckets each step. `fsdp`: fsdp.shard's options (blocks, cpu_offload,
    reshard_after_forward); `amp` "bf16" gives FSDP its mixed-precision policy."""
    fsdp = dict(fsdp or {})
    check_strategy(strategy, sync_bn=sync_bn, amp=amp, cpu_offload=bool(fsdp.get("cpu_offload")), device=ctx.device,
                   ddp={**(ddp or {}), "find_unused_parameters": find_unused_parameters})
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if strategy == "fsdp":
        # Not moved whole: fully_shard moves one unit at a time to the device and keeps only its
        # shard there (or in host memory under cpu_offload), so the whole model never has to fit on
        # one GPU. Sharded at world 1 too (a mesh of one): the debug run takes the code path of N
        # ranks, and cpu_offload lets one GPU train a model whose state does not fit on it.
        unknown = sorted(set(fsdp) - set(FSDP_OPTIONS))
        if unknown:
            raise UserError(f"fsdp options {unknown} not understood", f"known: {', '.join(FSDP_OPTIONS)}")
        model = shard(model, ctx.device, ctx.world_size, amp=amp, **fsdp)
        return torch.compile(model) if compile else model
    model = model.to(ctx.device)
    if sync_bn and ctx.world_size > 1:
        if ctx.device.type == "cpu":  # torch's SyncBatchNorm raises on CPU tensors at the first forward
            raise UserError("sync_bn needs GPUs: torch's SyncBatchNorm does not run on CPU with more than one rank",
                            "drop sync_bn on CPU (each rank keeps its own BatchNorm statistics)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if ctx.world_size > 1:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        options = {"gradient_as_bucket_view": True, "find_unused_parameters": find_unused_parameters, **(ddp or {})}
        try:
            model = DDP(model, device_ids=device_ids, **options)
        except TypeError as exc:
            raise UserError(f"DDP refused the options {sorted(ddp or {})}: {exc}",
                            "see torch.nn.parallel.DistributedDataParallel for the options it takes") from None
    if compile:
        model = torch.compile(model)
    return model


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


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module under any DDP / torch.compile wrappers (FSDP2 shards the module in place)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def sync_gradients(model: nn.Module, sync: bool):
    """Context for one micro-step: skip DDP's all-reduce (FSDP's reduce-scatter and reshard) unless
    `sync` (the last micro-step)."""
    if is_sharded(model):
        return accumulate(unwrap(model), sync)
    inner = unwrap_ddp(model)
    if sync or inner is None:
        return nullcontext()
    return inner.no_sync()


def unwrap_ddp(model: nn.Module) -> DDP | None:
    while not isinstance(model, DDP):
        if not hasattr(model, "_orig_mod"):
            return None
        model = model._orig_mod
    return model


def sync_ddp_buffers(model: nn.Module) -> None:
    """Every rank gets rank 0's buffers (BatchNorm's running statistics) now, as DDP itself would at
    the next training forward; collective. Each rank updates its statistics from its own batches, so
    without this an eval (or a checkpoint) would see N different models. DDP is then told its
    buffers are in sync, so no forward until the next training one broadcasts them: an eval forward
    on the wrapped model is local, and a rank with an empty eval shard leaves no one waiting."""
    ddp = unwrap_ddp(model)
    if ddp is None or not getattr(ddp, "broadcast_buffers", False) or not getattr(ddp, "modules_buffers", None):
        return
    if hasattr(ddp, "_assign_modules_buffers"):
        ddp._assign_modules_buffers()  # as DDP's own sync does first: a module may have reassigned a buffer
    # As DDP's own sync: an in-place copy into a buffer a saved graph holds is not a modification to it.
    keep = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    with torch.no_grad(), (keep(tuple(ddp.modules_buffers)) if keep else nullcontext()):
        buffers = [b.detach() for b in ddp.modules_buffers]
        # one coalesced broadcast per call, as DDP's own buffer sync; a bucket of 256 MiB
        tdist._broadcast_coalesced(ddp.process_group, buffers, 256 * 2**20, 0)
    ddp_local_forward(model)


def ddp_local_forward(model: nn.Module) -> None:
    """The next forward of a DDP model skips DDP's buffer broadcast (its buffers agree already)."""
    ddp = unwrap_ddp(model)
    if ddp is not None:
        ddp.require_forward_param_sync = False


def check_amp(amp: str, device: torch.device, is_main: bool = True) -> None:
    """Refuse what cannot run; say once (on the main rank) that bf16 would be emulated."""
    if amp == "fp16" and device.type != "cuda":
        raise UserError("amp=fp16 needs a CUDA device (GradScaler); this run is on cpu", "use amp bf16 or off")
    if amp == "bf16" and device.type == "cuda":
        warning = bf16_warning(*_bf16_facts(device))
        if warning and is_main:
            print(f"ddp_kit: warning: {warning}", file=sys.stderr, flush=True)


def bf16_warning(name: str, capability: tuple[int, int], native: bool | None, supported: bool) -> str | None:
    """None where bf16 is native; a line where it would be emulated (torch.cuda.is_bf16_supported()
    says yes on a T4 or V100 too: bf16 tensors work there, without bf16 tensor cores, slowly);
    UserError where it does not work at all. `native`: is_bf16_supported(including_emulation=False),
    None for a torch without that keyword (then compute capability 8.0 decides)."""
    if not supported:
        raise UserError(f"amp=bf16 but {name} has no bf16 support", "use amp fp16 on this GPU")
    if native is None:
        native = tuple(capability) >= (8, 0)
    if native:
        return None
    return (f"amp=bf16 on {name} (sm_{capability[0]}{capability[1]}) is emulated: no bf16 tensor cores below compute "
            f"capability 8.0, so it runs slowly (hint: use amp fp16 on this GPU, or amp off)")


def _bf16_facts(device: torch.device) -> tuple[str, tuple[int, int], bool | None, bool]:
    """(name, capability, native, supported) of `device`, for bf16_warning."""
    with torch.cuda.device(device):  # is_bf16_supported asks about the current device
        supported = torch.cuda.is_bf16_supported()
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # a torch without the keyword
            native = None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), native, supported


@contextmanager
def autocast(amp: str, device: torch.device) -> Iterator[None]:
    if amp == "off":
        yield
        return
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active for fp16 only; for bf16 and fp32 it passes through."""
    return torch.amp.GradScaler(device.type, enabled=(amp == "fp16"))


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


def settle_ddp_buckets(model: nn.Module, batch, device: torch.device) -> bool:
    """Run one throw-away forward/backward so that DDP rebuilds its gradient buckets now.

    DDP lays gradients out in buckets by parameter order for the first iteration, then rebuilds
    them in the order gradients became ready. With more than 2 ranks the ring all-reduce's sum
    order depends on that layout, so a resumed run must use the rebuilt layout from its first real
    step, as the uninterrupted run does, to stay bit-identical. The ready order depends on the
    graph, not on the loss, so the sum of the outputs serves. How the model takes a batch is not
    known here: the calls a training loop would make are tried first without gradients on the
    plain module (a failed try leaves DDP untouched); when none fits, nothing is done (False).
    Eval mode keeps BatchNorm statistics untouched; the gradients are discarded.
    """
    ddp = unwrap_ddp(model)
    if ddp is None:
        return False
    module = unwrap(model)
    was_training = module.training
    module.eval()
    try:
        batch = to_device(batch, device)
        for call in _calls(batch):
            try:
                with torch.no_grad():
                    if _output_sum(call(module)) is None:
                        continue
            except Exception:
                continue
            total = _output_sum(call(model))
            if total.requires_grad:
                total.backward()
            return True
        return False
    finally:
        module.train(was_training)
        for p in module.parameters():
            p.grad = None


def _calls(batch):
    """Ways a loop feeds a batch to a model: inputs first of a tuple, the whole thing, or a dict's keys."""
    if isinstance(batch, (list, tuple)) and batch:
        yield lambda m: m(batch[0])
        yield lambda m: m(*batch)
    if isinstance(batch, dict):
        yield lambda m: m(**batch)
    yield lambda m: m(batch)


def _output_sum(out) -> torch.Tensor | None:
    """The sum of every floating tensor in a model's output (tensor, tuple, dict, dataclass-like)."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else None
    if isinstance(out, dict):
        parts = list(out.values())
    elif isinstance(out, (list, tuple)):
        parts = list(out)
    else:
        parts = list(vars(out).values()) if hasattr(out, "__dict__") else []
    sums = [s for s in (_output_sum(p) for p in parts) if s is not None]
    return torch.stack(sums).sum() if sums else None
