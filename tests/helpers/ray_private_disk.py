"""examples/ray/train_ray.py with each Ray worker's run_dir on storage of its own, as on nodes where
run_dir is a node-local path: the same absolute path, different disks.

One machine has one file system, so each worker's training thread (and every thread it starts:
ddp_kit's) enters a mount namespace of its own with an empty tmpfs over run_dir. Needs
CAP_SYS_ADMIN; without it this exits 77 before starting anything (the test skips).
"""
import ctypes
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "ray"))

import ray.cloudpickle  # noqa: E402
import train_ray  # noqa: E402

# The workers cannot import the example (it is not on their sys.path): it travels with the function.
ray.cloudpickle.register_pickle_by_value(train_ray)

CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def own_disk(path: str) -> str | None:
    """This thread alone gets an empty tmpfs at `path`; None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.makedirs(path, exist_ok=True)
    # MS_PRIVATE first: on a shared root mount the tmpfs would otherwise propagate back to the host.
    for call in (lambda: libc.unshare(CLONE_NEWNS), lambda: libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None),
                 lambda: libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, b"size=64m")):
        if call() != 0:
            return os.strerror(ctypes.get_errno())
    return None


def train_on_own_disk(config: dict) -> None:
    why = own_disk(config["run_dir"])
    if why:
        raise RuntimeError(f"could not give this worker its own disk: {why}")
    train_ray.train_fn(config)


def can_unshare() -> str | None:
    out: list = []
    probe = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ddp_kit-ns-probe-{os.getpid()}")
    t = threading.Thread(target=lambda: out.append(own_disk(probe)))  # a thread: the namespace ends with it
    t.start()
    t.join()
    os.rmdir(probe)
    return out[0]


if __name__ == "__main__":
    why = can_unshare()
    if why:
        print(f"ray_private_disk: cannot make a private mount namespace here: {why}", flush=True)
        sys.exit(77)
    sys.exit(train_ray.main(sys.argv[1:], train=train_on_own_disk))
