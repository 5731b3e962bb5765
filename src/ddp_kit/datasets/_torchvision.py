"""MNIST and CIFAR-10 through torchvision, read from a local folder; torchvision is imported on use."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ._spec import DataSpec

_FILES = {
    "mnist": ("MNIST/raw", "train-images-idx3-ubyte (and the other three MNIST files)"),
    "cifar10": ("cifar-10-batches-py", "data_batch_1..5 and test_batch (the python version of CIFAR-10)"),
}


def load(name: str, root: str, download: bool) -> DataSpec:
    import torchvision
    from torchvision import transforms as T

    sub, what = _FILES[name]
    expected = Path(root) / sub
    if not Path(root).exists() and not download:
        raise UserError(f"data_root {root!r} does not exist; {name} expects {what} in {str(expected)!r}",
                        "copy the files there, point --data_root at them, or add --download true",
                        local=True)  # data may be node-local: the rank that misses it says so
    if name == "mnist":
        tf = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])
        cls, shape = torchvision.datasets.MNIST, (1, 28, 28)
        make = lambda train: cls(root, train=train, download=download, transform=tf)
    else:
        norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        test_tf = T.Compose([T.ToTensor(), norm])
        cls, shape = torchvision.datasets.CIFAR10, (3, 32, 32)
        make = lambda train: cls(root, train=train, download=download, transform=train_tf if train else test_tf)
    try:
        return DataSpec(make(True), make(False), shape, 10)
    except RuntimeError as exc:
        raise UserError(f"{name} files not found under {str(expected)!r} ({exc})",
                        f"put {what} there, or add --download true to fetch them", local=True) from None
