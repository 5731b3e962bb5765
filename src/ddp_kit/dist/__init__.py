"""The process group and what lives beside it: made here or adopted, torn down, the rendezvous
waited for, a failed rank stopping the others, the control plane's collectives, per-rank resources."""
from .failfast import announce
from .group import (FR_PREFIX, DistContext, check_layout, choose_backend, choose_device, client_store, distributed,
                    hosts_store, nccl_defaults, teardown)

__all__ = ["FR_PREFIX", "DistContext", "announce", "check_layout", "choose_backend", "choose_device", "client_store",
           "distributed", "hosts_store", "nccl_defaults", "teardown"]
