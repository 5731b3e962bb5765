"""The reference job's workload: the model + dataset + loss triple it trains, each a built-in name
or an import path.

    --model pkg.module:function      function(**model_args) -> nn.Module
    --dataset pkg.module:function    function(**dataset_args) -> (train_dataset, test_dataset)
    --loss pkg.module:function       function(model, batch) -> loss, or (loss, {"name": value, ...})

Modules are imported from the working directory first, as `python -m` does, on every rank. Each
kind has one registry of built-in names (ddp_kit.models.REGISTRY, ddp_kit.datasets.REGISTRY,
ddp_kit.losses.LOSSES). Anything wrong at startup is one line and exit 2: not importable, no such
function, an argument the function does not take, a wrong return type.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..datasets import REGISTRY as DATASETS
from ..datasets import DataSpec
from ..errors import UserError
from ..losses import LOSSES
from ..models import REGISTRY as MODELS


def is_path(name: str) -> bool:
    return ":" in name


def load(kind: str, spec: str) -> Callable:
    """The function `pkg.module:function` names, imported from the working directory first."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"--{kind} {spec!r} is not an import path", "write it as pkg.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # what `python -m` does; torchrun starts workers without it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.split(".")[0] == exc.name.split(".")[0]:
            raise UserError(f"--{kind} {spec}: no module named {exc.name!r} in {cwd} or on sys.path",
                            f"run from the folder that holds {module_name.split('.')[0]}, or add its parent to "
                            f"PYTHONPATH") from None
        raise UserError(f"--{kind} {spec}: importing {module_name} failed: {exc}",
                        "install what that module imports") from None
    except Exception as exc:
        raise UserError(f"--{kind} {spec}: importing {module_name} failed: {type(exc).__name__}: {exc}",
                        f"`python -c 'import {module_name}'` shows the traceback") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "has no" if fn is None else "has a non-callable"
        raise UserError(f"--{kind} {spec}: module {module_name} {what} {attr!r}",
                        f"name a function defined in {getattr(module, '__file__', module_name)}")
    return fn


def call(kind: str, spec: str, fn: Callable, args: dict[str, Any], *extra: Any) -> Any:
    """fn(*extra, **args), with an argument it does not take refused in one line before the call."""
    try:
        inspect.signature(fn).bind(*extra, **args)
    except TypeError as exc:
        raise UserError(f"--{kind} {spec} cannot be called with {kind}_args {args or '{}'}: {exc}",
                        f"give --{kind}_args only arguments {getattr(fn, '__name__', spec)} takes") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call says
    return fn(*extra, **args)


@dataclass(frozen=True)
class Workload:
    """The triple, built: what `build` returns."""

    model: nn.Module
    train: Dataset
    test: Dataset
    loss: Callable  # (model, batch) -> loss | (loss, metrics)
    loss_name: str


def build(model: str, model_args: dict, dataset: str, dataset_args: dict, loss: str, *, seed: int,
          data_root: str, download: bool, synthetic_size: int) -> Workload:
    """The three parts, resolved and checked; the model's weights are drawn from `seed` on every rank."""
    if is_path(dataset):
        out = call("dataset", dataset, load("dataset", dataset), dataset_args)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(hasattr(d, "__getitem__") for d in out)):
            raise UserError(f"--dataset {dataset} returned {type(out).__name__}; expected (train_dataset, test_dataset)",
                            "return two map-style datasets (with __len__ and __getitem__)")
        spec = None
        train, test = out
    else:
        if dataset not in DATASETS:
            raise UserError(f"unknown dataset {dataset!r}", f"choose one of {', '.join(DATASETS)}, or pkg.module:function")
        spec = call("dataset", dataset, DATASETS[dataset], dataset_args, data_root, download, seed, synthetic_size)
        train, test = spec.train, spec.test
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if is_path(model):
            net = call("model", model, load("model", model), model_args)
        elif model in MODELS:
            shape, classes = _shape_and_classes(spec, train)
            net = call("model", model, MODELS[model], model_args, shape, classes)
        else:
            raise UserError(f"unknown model {model!r}", f"choose one of {', '.join(MODELS)}, or pkg.module:function")
    if not isinstance(net, nn.Module):
        raise UserError(f"--model {model} returned {type(net).__name__}; expected a torch.nn.Module",
                        "return the model instance (not its class or its state_dict)")
    if is_path(loss):
        loss_fn = load("loss", loss)
    elif loss in LOSSES:
        loss_fn = LOSSES[loss]
    else:
        raise UserError(f"unknown loss {loss!r}", f"choose one of {', '.join(LOSSES)}, or pkg.module:function")
    return Workload(net, train, test, loss_fn, loss)


def _shape_and_classes(spec: DataSpec | None, train: Dataset) -> tuple[tuple[int, ...], int]:
    """A built-in model on a user's dataset: input shape from the first sample, classes from the labels."""
    if spec is not None:
        return spec.input_shape, spec.num_classes
    first = train[0]
    if not (isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], torch.Tensor)):
        raise UserError("built-in models need (input tensor, label) samples; this dataset's samples are "
                        f"{type(first).__name__}", "use --model pkg.module:function with your own model")
    classes = getattr(train, "num_classes", None) or len(getattr(train, "classes", ()))
    if not classes:
        classes = 1 + max(int(train[i][1]) for i in range(min(len(train), 10_000)))
    return tuple(first[0].shape), int(classes)


def split_loss(kind_spec: str, out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss function's result as (scalar loss, metrics), or a one-line refusal."""
    loss, metrics = (out if isinstance(out, tuple) and len(out) == 2 else (out, {}))
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1) or not isinstance(metrics, dict):
        raise UserError(f"--loss {kind_spec} returned {type(out).__name__}; expected a scalar loss tensor or "
                        f"(loss, {{'name': value, ...}})", "return loss, or loss and a dict of metrics")
    return (loss if loss.dim() == 0 else loss.reshape(())), metrics


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (tuple, list, dict or tensor)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_size(item)
        if n:
            return n
    return 0

