"""How often helper threads may poll the rendezvous store, from the job's world size and a budget
the environment may set (DDP_KIT_STORE_OPS_PER_S). Not a launcher fact, but read from the
environment like them, and free of torch, so the threads' modules ask it here."""
from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import UserError

# The whole job's polling of the rendezvous store, per helper thread kind (fail-fast, watchdog), in
# operations per second. A TCPStore is one server thread: measured here it serves some 50,000-90,000
# operations per second, and rendezvous, checkpoint commits and failure posts share it.
STORE_OPS_PER_S = 2000.0


def poll_period(world_size: int, base_s: float, ops_per_poll: int, environ: Mapping[str, str] | None = None) -> float:
    """How often each rank's helper thread may poll the store: `base_s`, or longer once the job's
    `world_size * ops_per_poll / period` would pass DDP_KIT_STORE_OPS_PER_S (default 2000), so the
    store's load stays bounded at any world size (the latencies that depend on it grow instead)."""
    environ = os.environ if environ is None else environ
    try:
        budget = float(environ.get("DDP_KIT_STORE_OPS_PER_S") or STORE_OPS_PER_S)
    except ValueError:
        raise UserError(f"DDP_KIT_STORE_OPS_PER_S={environ.get('DDP_KIT_STORE_OPS_PER_S')!r} is not a number",
                        "set it to the store operations per second the job may spend on polling, e.g. 2000") from None
    return max(base_s, world_size * ops_per_poll / max(budget, 1e-3))
