"""The process group and what lives beside it: group.py (device binding, backend, store, timeouts,
one path for a group made here or adopted, teardown), adopt.py (a group someone else made), reach.py
(the quiet wait for the rendezvous host), failfast.py (a failed rank stops the others),
collectives.py (the control plane's small collectives), resources.py (threads, malloc, workers)."""
from .failfast import announce
from .group import (FR_PREFIX, DistContext, check_layout, choose_backend, choose_device, client_store, distributed,
                    hosts_store, nccl_defaults, teardown)

__all__ = ["FR_PREFIX", "DistContext", "announce", "check_layout", "choose_backend", "choose_device", "client_store",
           "distributed", "hosts_store", "nccl_defaults", "teardown"]
