"""Mixed precision: which AMP mode can run on this device (and whether bf16 would be emulated),
autocast around the forward, and the GradScaler that fp16 needs."""
from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext

import torch

from ..errors import UserError


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


_OFF = nullcontext()  # reusable: amp off costs the step no new object


def autocast(amp: str, device: torch.device) -> AbstractContextManager[object]:
    """The context around a forward: torch.autocast in the AMP dtype, nothing with amp off (entered
    every micro-step, so it is built without a generator)."""
    if amp == "off":
        return _OFF
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active for fp16 only; for bf16 and fp32 it passes through."""
    return torch.amp.GradScaler(device.type, enabled=(amp == "fp16"))
