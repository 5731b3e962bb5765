"""The reference job's config: dataclass defaults < YAML file < command-line flags, strictly checked.

Only the reference job (command.py) reads this; library modules take plain arguments. The keys are
the job's own (`JobKeys`) and, after `strategy`, each strategy's options that have a config key, as
the strategy declares them in its file (parallel/<name>.py): importing this module imports those
files, and with them torch. The last check is the chosen strategy's own rules.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..api import AUTO, every_or_auto, service_options
from ..errors import UserError
from ..parallel import STRATEGY_NAMES, find_strategy, strategy_config_options
from ..reliability import config_hash, not_recipe


def _f(default: Any, help: str, choices: tuple | None = None, auto: bool = False):
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, "choices": choices, "auto": auto})
    return field(default=default, metadata={"help": help, "choices": choices, "auto": auto})


@dataclass(frozen=True)
class JobKeys:
    """The job's own keys; TrainConfig adds the strategies' (see the module docstring)."""

    model: str = _f("mlp", "A built-in model (listed below) or pkg.module:function, called as function(**model_args), returning an nn.Module.")
    model_args: dict = _f({}, "Keyword arguments of the model function (a mapping in YAML, or JSON on the command line).")
    dataset: str = _f("digits", "A built-in dataset (listed below) or pkg.module:function, called as function(**dataset_args), returning (train_dataset, test_dataset).")
    dataset_args: dict = _f({}, "Keyword arguments of the dataset function (a mapping in YAML, or JSON on the command line).")
    loss: str = _f("cross_entropy", "A built-in loss (listed below) or pkg.module:function, called as function(model, batch), returning a scalar loss or (loss, {name: value}) whose values are averaged over ranks in training and eval.")
    data_root: str = _f("./data", "Folder holding MNIST/CIFAR-10 files (torchvision layout).")
    download: bool = _f(False, "Download MNIST/CIFAR-10 into data_root when missing. Off by default: jobs never touch the network unasked.")
    epochs: int = _f(20, "Passes over the training set.")
    max_steps: int | None = _f(None, "Stop after this many optimizer steps in total (None: run all epochs).")
    batch_size: int = _f(64, "GLOBAL batch per optimizer step, over all ranks and micro-steps. Per-rank micro-batch = batch_size / (world_size * grad_accum). auto: the largest per-rank micro-batch that fits in every rank's memory, found by trial steps at the start (the ranks agree), times world_size * grad_accum; lr stays as given; kept in run_dir/batch_size.json for resumes (docs/gpus.md).", auto=True)
    grad_accum: int = _f(1, "Micro-steps per optimizer step; the all-reduce runs on the last one only.")
    lr: float = _f(3e-3, "Peak learning rate.")
    lr_schedule: str = _f("cosine", "Learning-rate schedule over the whole run.", ("constant", "cosine"))
    optimizer: str = _f("adamw", "Optimizer.", ("adamw", "sgd"))
    weight_decay: float = _f(0.0, "Weight decay.")
    momentum: float = _f(0.9, "SGD momentum (sgd only).")
    seed: int = _f(0, "Seed for the model init, the data order and the RNGs. Same seed and global batch give the same recipe on any world size.")
    run_dir: str = _f("runs/default", "Where rank 0 writes config.yaml, metrics.jsonl, summary.json (and checkpoints).")
    amp: str = _f("off", "Mixed precision: off, bf16 (autocast), fp16 (autocast + GradScaler, CUDA only).", ("off", "bf16", "fp16"))
    num_workers: int = _f(-1, "DataLoader worker processes per rank (-1: 0 on CPU; on CUDA this rank's share of the node's CPUs less one, at most 8; none for in-memory data, never more than one epoch's batches).")
    log_every: int = _f(50, "Optimizer steps between log lines and metrics.jsonl records.")
    eval_every_epoch: bool = _f(True, "Evaluate on the test split after every epoch (always at the end).")
    device: str = _f("auto", "auto (cuda:<local_rank> when CUDA is available, else cpu), cpu or cuda.", ("auto", "cpu", "cuda"))
    backend: str = _f("auto", "Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo.", ("auto", "nccl", "gloo"))
    strategy: str = _f(STRATEGY_NAMES[0], "How the model is spread over ranks: ddp (a full copy per rank, gradients all-reduced) , fsdp (FSDP2: parameters, gradients and optimizer state sharded, 1/N per rank; sharded DCP checkpoints), hsdp (FSDP2 sharded within a node and replicated across nodes: --hsdp_shard, --hsdp_replicate) or ft (fault-tolerant DDP on torchft: replica groups that survive a lost group; launch with python -m ddp_kit.launch ft). See docs/strategies.md.", STRATEGY_NAMES)
    compile: bool = _f(False, "Wrap the model in torch.compile.")
    channels_last: bool = _f(False, "Use channels_last memory format for image models.")
    tf32: bool = _f(True, "CUDA: TF32 tensor cores for float32 matmuls and convolutions (about 10 mantissa bits).")
    cudnn_benchmark: bool = _f(True, "CUDA: let cuDNN time its algorithms on the first batches of each shape and keep the fastest.")
    deterministic: bool = _f(False, "Deterministic kernels (cuDNN deterministic, torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG); bit-identical resume on a GPU needs it.")
    device_data: bool = _f(False, "Keep an in-memory TensorDataset (digits, synthetic, your own) on the device: the same batches, indexed there, no per-step collate or copy (num_workers 0). A CPU run indexes a plain TensorDataset so without it.")
    synthetic_size: int = _f(4096, "Number of training samples of the synthetic dataset (test split: a quarter of it).")
    init_timeout_s: float = _f(600.0, "Timeout of the first rendezvous and collectives (data preparation included).")
    progress: bool = _f(True, "Show a progress bar on rank 0.")
    ckpt_every: int = _f(100, "Optimizer steps between checkpoints (0: only the final one; auto: the interval from the save's measured cost and the failure rate, docs/cadence.md). Checkpoints go to run_dir/checkpoints.", auto=True)
    keep_last: int = _f(3, "Checkpoints kept; older ones are deleted after a newer one is committed (0: keep all).")
    resume: str = _f("auto", "auto: continue from the newest valid checkpoint in run_dir; never: start fresh; or a checkpoint folder path.")
    async_ckpt: bool = _f(False, "Copy the state to CPU memory and write the checkpoint in a background thread.")
    ckpt_dir: str | None = _f(None, "Where checkpoints go instead of run_dir/checkpoints: a folder every node mounts, or a URL (s3://bucket/prefix, gs://, az://, file:///path; pip install 'ddp_kit[s3]'). With a URL, run_dir (metrics, summary, hang reports) may be each node's local disk.")
    ckpt_upload_timeout_s: float = _f(1800.0, "ckpt_dir a URL: a failed upload is retried and training goes on; stop the run when no checkpoint has committed for this long (0: never).")
    sync_check_every: int = _f(100, "Optimizer steps between cross-rank parameter/buffer checksum comparisons (0: off).")
    sdc_check_every: int = _f(0, "Optimizer steps between replay checks: the step's forward and backward computed again on the same batch and compared on each rank before the optimizer step; a transient fault is named and the step recomputed (0: off; docs/sdc.md).")
    sync_fix: str = _f("rollback", "On divergence: rollback (3+ ranks: a majority vote names the rank that differs, and every rank rolls back to the newest checkpoint at or before the last sync check the ranks agreed on, docs/sdc.md; 2 ranks: as error), error (stop every rank, naming tensors and ranks) or broadcast (copy rank 0's values, warn).", ("rollback", "error", "broadcast"))
    collective_timeout_s: float = _f(300.0, "Timeout of every collective after the first step (set behind a barrier).")
    hang_timeout_s: float = _f(180.0, "No progress on a rank for this long: dump stacks to run_dir/hang, report the lagging rank, exit (0: off).")
    peer_timeout_s: float = _f(30.0, "A rank whose heartbeat is silent this long (process killed or frozen) is named and every rank exits (0: off; needs the watchdog).")
    preempt_check_every: int = _f(10, "Steps between the ranks' agreement on a preemption signal (SIGUSR2 under SLURM, SIGTERM): all stop after the same step.")
    rank_metrics: bool = _f(True, "Gather every rank's step-time split, samples/s and peak memory into metrics.jsonl at each log event.")
    rank_records_max: int = _f(64, "Up to this world size each metrics record keeps every rank's entry; above it, the median, max and argmax rank per field.")
    straggler_margin: float = _f(0.2, "Warn when a rank's own work per step exceeds the median rank's by this fraction for 2 log windows (0: off).")
    inject: str = _f("", "Test hook: faults to inject, e.g. kill:rank=1:step=8 (see ddp_kit/train/inject.py).")
    debug_ckpt_delay_s: float = _f(0.0, "Test hook: sleep this long inside each checkpoint file write.")


class _Methods:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """A short, stable hash of the recipe: ranks and checkpoints compare it. Keys that do not
        change the computation (logging, resume mode, test hooks) are left out."""
        return config_hash(self.to_dict(), leave_out=not_recipe())


def _config_class() -> type:
    """JobKeys with every strategy's config keys after `strategy` (strategy.Option: key, default, help)."""
    hints = typing.get_type_hints(JobKeys)
    keys: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(JobKeys):
        keys.append((f.name, hints[f.name], _f(f.default if f.default is not dataclasses.MISSING else f.default_factory(),
                                                f.metadata["help"], f.metadata["choices"], f.metadata["auto"])))
        if f.name == "strategy":
            keys += [(o.key, o.config_type, _f(o.default, o.help, o.choices)) for o in strategy_config_options()]
    # every service's settings that have a config key, as each service declares them (services/)
    keys += [(o.key, o.config_type, _f(o.default, o.help, o.choices, o.auto)) for o in service_options() if o.key]
    cls = dataclasses.make_dataclass("TrainConfig", keys, bases=(_Methods,), frozen=True)
    cls.__module__, cls.__doc__ = __name__, "The reference job's resolved config: JobKeys and the strategies' keys."
    return cls


TrainConfig = _config_class()
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

def _resolved_type(name: str) -> Any:
    return typing.get_type_hints(TrainConfig)[name]


def coerce(name: str, value: Any) -> Any:
    """Convert `value` to the annotated type of `name`, or refuse it by name."""
    tp = _resolved_type(name)
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise UserError(f"config key '{name}' cannot be empty", f"give a {tp.__name__}")
    choices = FIELDS[name].metadata.get("choices")
    if FIELDS[name].metadata.get("auto") and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO  # a count that ddp_kit may choose (ckpt_every, mem_ckpt_every)
    if tp is str and isinstance(value, bool) and choices and {"off", "on"} & set(choices):
        value = "on" if value else "off"  # YAML 1.1 reads an unquoted `amp: off` as False
    try:
        out = _convert(tp, value)
    except (TypeError, ValueError):
        raise UserError(f"config key '{name}' expects {tp.__name__}, got {value!r} ({type(value).__name__})",
                        f"e.g. --{name} {choices[0] if choices else _example(tp)}") from None
    if choices and out not in choices:
        raise UserError(f"config key '{name}' must be one of {', '.join(choices)}; got {out!r}", f"e.g. --{name} {choices[0]}")
    return out


def _convert(tp: type, value: Any) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ValueError(value)
    if tp is int:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(float(value)) if isinstance(value, (str, float)) else int(value)
    if tp is float:
        if isinstance(value, bool):
            raise TypeError(value)
        return float(value)  # PyYAML reads 3e-4 as the string '3e-4'
    if tp is dict:
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if not isinstance(value, dict):
            raise TypeError(value)
        return dict(value)
    if tp is str:
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
            return ",".join(str(v) for v in value)  # fire splits `--key a,b` into ('a', 'b'); a comma list is meant
        if isinstance(value, (dict, list, tuple, bool)):  # a bool here is YAML's unquoted yes/no/on/off
            raise TypeError(value)
        return str(value)
    raise TypeError(tp)


def _example(tp: type) -> str:
    return {int: "3", float: "0.001", bool: "true", str: "name", dict: "'{\"hidden\": 128}'"}.get(tp, "value")


def _check_keys(keys, source: str) -> None:
    for key in keys:
        if key not in FIELDS:
            key = str(key)  # YAML keys can be numbers or null
            near = [k for k in FIELDS if k.startswith(key[:3])] if len(key) >= 3 else []
            hint = f"did you mean {' or '.join(near)}?" if near else "run with --help_config to list the keys"
            raise UserError(f"unknown config key '{key}' in {source}", hint)


class _StrictLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice is refused: PyYAML would keep the last one silently."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` keys may be overridden, as YAML intends
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise UserError(f"config key {str(key)!r} is given twice in {self.name!r} (lines {first} and {line})",
                                    "keep one of them")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_text(p: Path) -> str:
    if p.is_dir():
        raise UserError(f"config file {str(p)!r} is a folder", "pass a YAML file, e.g. configs/default.yaml")
    if not p.is_file():
        # local: a file missing on one node only is that node's ranks' to report (the others may see it)
        raise UserError(f"config file {str(p)!r} not found", "pass an existing YAML file (on every node), e.g. "
                        "configs/default.yaml", local=True)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise UserError(f"config file {str(p)!r} cannot be read ({exc.strerror or exc})",
                        "check its permissions, or pass another file", local=True) from None
    try:
        return raw.decode("utf-8-sig")  # -sig: editors on Windows start UTF-8 files with a BOM
    except UnicodeDecodeError as exc:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")  # the BOM Windows tools write
        raise UserError(f"config file {str(p)!r} is not UTF-8 text{' (it looks like UTF-16)' if utf16 else ''}: "
                        f"byte {raw[exc.start]:#04x} at offset {exc.start}",
                        f"save it as UTF-8, e.g. iconv -f UTF-16 -t UTF-8 {p} > {p.stem}.utf8{p.suffix}" if utf16
                        else "save it as UTF-8 in your editor") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    text = _read_text(p)
    try:
        loader = _StrictLoader(text)
        loader.name = str(p)  # named in the duplicate-key error; PyYAML would say '<unicode string>'
        try:
            data = loader.get_single_data() or {}
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {str(p)!r} is not valid YAML{where}", "fix the syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {str(p)!r} must hold a mapping of key: value", "see configs/default.yaml")
    return data


def resolve(config_file: str | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults < YAML file < overrides. Keys may use '-' or '_'."""
    values: dict[str, Any] = {}
    if config_file:
        data = load_yaml(config_file)
        _check_keys(data, config_file)
        values.update(data)
    flags = {k.replace("-", "_"): v for k, v in (overrides or {}).items()}
    _check_keys(flags, "the command line")
    values.update(flags)
    cfg = TrainConfig(**{k: coerce(k, v) for k, v in values.items()})
    _validate(cfg)
    return cfg


def _validate(cfg: TrainConfig) -> None:
    for key in ("epochs", "batch_size", "grad_accum", "log_every", "preempt_check_every"):
        if getattr(cfg, key) != AUTO and getattr(cfg, key) < 1:
            raise UserError(f"config key '{key}' must be at least 1; got {getattr(cfg, key)}", f"e.g. --{key} 1")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise UserError(f"max_steps must be at least 1 or None; got {cfg.max_steps}", "drop --max_steps to run all epochs")
    if cfg.lr <= 0:
        raise UserError(f"lr must be positive; got {cfg.lr}", "e.g. --lr 1e-3")
    every_or_auto("ckpt_every")(cfg.ckpt_every)
    for key in ("keep_last", "sync_check_every", "sdc_check_every"):
        if getattr(cfg, key) < 0:
            raise UserError(f"config key '{key}' must be >= 0; got {getattr(cfg, key)}", f"e.g. --{key} 0")
    for option in service_options():  # each service's own rules (>= 0, a tracker installed, ...)
        if option.key:
            option.value(getattr(cfg, option.key))
    if cfg.inject:
        from .inject import parse

        parse(cfg.inject)
    if cfg.num_workers < -1:
        raise UserError(f"num_workers must be >= 0, or -1 for automatic; got {cfg.num_workers}", "e.g. --num_workers 2")
    # The strategy owns its rules (parallel/ddp.py, parallel/fsdp.py); this imports torch, so it runs last.
    if cfg.batch_size == AUTO and find_strategy(cfg.strategy).sharded:
        raise UserError(f"batch_size auto cannot search under --strategy {cfg.strategy}: a trial runs each rank's "
                        "model on its own, and a sharded model's forward gathers weights from every rank",
                        f"give --batch_size a number with --strategy {cfg.strategy}")
    find_strategy(cfg.strategy).check_config({k: getattr(cfg, k) for k in FIELDS}, {k: f.default for k, f in FIELDS.items()})


def help_text() -> str:
    lines = ["Config keys (defaults < YAML file < --flags):"]
    builtins = _builtins()
    for name, f in FIELDS.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {name:<18} = {default!r:<14} {f.metadata['help']}")
        lines += [f"{'':<38}{choice:<14} {about}" for choice, about in builtins.get(name, {}).items()]
    return "\n".join(lines)


def _builtins() -> dict[str, dict[str, str]]:
    """The built-in names of model, dataset and loss with their one-line descriptions, from the
    registries (imported here, not at the top: they load torch, which a config check does without)."""
    from .. import datasets, losses, models

    return {"model": models.DESCRIPTIONS, "dataset": datasets.DESCRIPTIONS, "loss": losses.DESCRIPTIONS}
