"""`python -m ddp_kit.doctor`: why CUDA, NCCL or multi-GPU training is not working here, on one
screen: facts gathered, judged by pure functions, and measured on request (--comm, --memory)."""
from __future__ import annotations

__all__ = ["describe_oom", "findings_for_error", "oom_report"]


def findings_for_error(err: BaseException, amp: str | None = None) -> list[str]:
    """One line per failing or warning diagnosis, to print beside a CUDA/NCCL/OOM error in training."""
    from .checks import FAIL, WARN, diagnose
    from .facts import gather

    try:
        findings = diagnose(gather(probe_gpus=False), amp)  # after a CUDA error: no new CUDA calls
    except Exception:  # the doctor must never hide the original error
        return []
    return [f"doctor: {f.status}: {f.name}: {f.message} (fix: {f.fix})" for f in findings if f.status in (FAIL, WARN) and f.fix]


def oom_report(device, micro_batch: int, global_batch: int, grad_accum: int, amp: str) -> list[str]:
    """What this rank held when it ran out of GPU memory, and what to change."""
    import torch

    gib = 2**30
    try:
        alloc, reserved = torch.cuda.memory_allocated(device) / gib, torch.cuda.memory_reserved(device) / gib
        peak, total = torch.cuda.max_memory_allocated(device) / gib, torch.cuda.get_device_properties(device).total_memory / gib
    except Exception:  # whatever fails, the diagnosis goes on
        alloc = reserved = peak = total = float("nan")
    fraction = None
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):  # not in every torch that ddp_kit runs on
        try:
            fraction = torch.cuda.get_per_process_memory_fraction(device)
        except Exception:  # the report must never hide the OOM
            pass
    return describe_oom(str(device), alloc, reserved, peak, total, fraction, micro_batch, global_batch, grad_accum, amp)


def describe_oom(device: str, alloc: float, reserved: float, peak: float, total: float, fraction: float | None,
                 micro_batch: int, global_batch: int, grad_accum: int, amp: str) -> list[str]:
    """oom_report's lines from its figures (GiB). `fraction`: torch.cuda.set_per_process_memory_fraction's
    cap, None where this torch cannot tell (then the total is named the card's, a cap unknown)."""
    if fraction is not None and fraction < 1.0:
        limit = f"this process's cap of {total * fraction:.2f} GiB (memory fraction {fraction:g} of the card's {total:.2f} GiB)"
    else:
        limit = f"the card's {total:.2f} GiB"
    advice = [f"--grad_accum {grad_accum * 2} (same global batch {global_batch}, half the per-rank micro-batch)"]
    if amp == "off":
        advice.append("--amp bf16 (or fp16 before Ampere)")
    advice.append(f"a smaller --batch_size than {global_batch}")
    return [f"out of GPU memory on {device}: allocated {alloc:.2f} GiB, reserved {reserved:.2f} GiB, peak {peak:.2f} GiB "
            f"of {limit}; per-rank micro-batch {micro_batch}",
            "try: " + "; or ".join(advice)]
