"""Write a tiny, valid MNIST in torchvision's layout (ROOT/MNIST/raw/*-ubyte): 256 train and 64 test
random images, so tests can read "MNIST files" from a folder that exists on one node only."""
import struct
import sys
from pathlib import Path

import numpy as np


def write(root: str, n_train: int = 256, n_test: int = 64) -> None:
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())


if __name__ == "__main__":
    write(sys.argv[1])
