"""Rank 0's fail-fast thread sees rank 1's posted failure while rank 0's main thread is still on its way
to the same verdict (as under load after a sync check). argv[1]: `verdict` (a UserError every rank
raises together), `local` (one rank's own problem) or `plain` (printed once for the job, but not known
to be raised on every rank: the bf16 check on one node's GPUs). Real TCPStore on loopback, real thread, real os._exit.

Exits 2 when this rank's main thread got to handle the failure itself, 1 when the thread stopped it."""
import sys
import time
from datetime import timedelta

import torch.distributed as tdist

from ddp_kit.dist.failfast import FailFast, post
from ddp_kit.errors import UserError

kind = sys.argv[1]
store = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
port = store.port
err = UserError("parameters diverged across ranks (late_verdict)", local=kind == "local", verdict=kind == "verdict")
post(store, 1, 5, "sync check", err)  # rank 1 got there first


def connect():
    return tdist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10))


ff = FailFast(connect, rank=0, world_size=2, poll_s=0.1).start()
time.sleep(2.0)  # the main thread is late by many polls
ff.quiet()
print("rank 0: handled the failure itself", flush=True)
sys.exit(2)
