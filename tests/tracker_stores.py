"""The experiment trackers' stores for the tests, and reading back what a run left in them.

- MLflow: a real tracking server (`python -m mlflow server`, its sqlite backend) started as a process
  of ours on loopback and stopped by its PID (and its process group, which is its own: the server
  runs uvicorn as a child). Its job runner is off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false): seven
  consumer processes that import MLflow, not needed to track runs. `Proxy` puts a TCP relay of the
  test's own in front of it, to take the server away from a run mid-way.
- W&B: offline mode writes run_dir/wandb/offline-run-*/run-<id>.wandb, a record log in LevelDB's log
  framing (32 KiB blocks, 7-byte record headers) after a 7-byte W&B header; each record is a
  `wandb.proto.wandb_internal_pb2.Record`. wandb 0.31 reads these in its Go core only, so the framing
  is read here and the records with the wandb package's own protobuf classes.
- TensorBoard: run_dir/tb read with tensorboard's EventAccumulator, which applies the purges.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from s3_server import free_port


def _answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass(frozen=True)
class MlflowServer:
    uri: str
    pid: int

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)

    def runs(self, experiment: str) -> list:
        client = self.client()
        found = client.get_experiment_by_name(experiment)
        return [] if found is None else client.search_runs([found.experiment_id])

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every point logged to `key`, in the order the server holds them."""
        return [(m.step, m.value) for m in self.client().get_metric_history(run_id, key)]


@contextmanager
def mlflow_server(folder: Path, start_timeout_s: float = 150) -> Iterator[MlflowServer]:
    """A tracking server with its sqlite store in `folder`, until the block ends. Its start takes
    5 to 40 s (creating the tables, importing the app), so a test module shares one."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    for _attempt in range(3):  # the free port can be taken between our probe and the server's bind
        port = free_port()
        uri = f"http://127.0.0.1:{port}"
        log = open(folder / "server.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                              f"sqlite:///{folder}/mlflow.db", "--default-artifact-root", f"file://{folder}/artifacts",
                              "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                             stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        end = time.monotonic() + start_timeout_s
        while p.poll() is None and time.monotonic() < end and not _answers(uri):
            time.sleep(0.2)
        if p.poll() is None and _answers(uri):
            break
        stop(p)
        log.close()
    else:
        raise RuntimeError(f"the MLflow server did not answer after 3 tries (log: {folder / 'server.log'})")
    try:
        yield MlflowServer(uri, p.pid)
    finally:
        stop(p)
        log.close()


def stop(p: subprocess.Popen) -> None:
    """SIGTERM to the server we started (it passes it on to its uvicorn child), then SIGKILL to the
    process group it leads, which holds only the processes it started."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


class Proxy:
    """A TCP relay on a free loopback port to `target` (host, port); `close()` takes it away: the
    listening socket and every relayed connection, as when a server goes down."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """shutdown() before close(): a socket another thread waits on (accept, recv) stays open after
        a bare close() on Linux, and would go on accepting."""
        self.closed = True
        for s in (self.sock, *self.conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def wandb_records(path: str | Path) -> Iterator:
    """The records of one .wandb file, as wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    pos, parts, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block (or a record being written)
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # FULL
            parts = chunk
        elif kind == 2:  # FIRST
            parts = chunk
            continue
        elif kind == 3:  # MIDDLE
            parts += chunk
            continue
        else:  # LAST
            parts += chunk
        rec = pb.Record()
        rec.ParseFromString(parts)
        yield rec


@dataclass
class WandbRun:
    run_id: str
    files: list[str]
    history: list[dict]  # every history row of every file, in file order (the attempts' order)


def wandb_runs(wandb_dir: Path) -> dict[str, WandbRun]:
    """{run id: its files and history} of every offline run under `wandb_dir`."""
    runs: dict[str, WandbRun] = {}
    for path in sorted(glob.glob(str(wandb_dir / "offline-run-*" / "run-*.wandb"))):  # names start with the time
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run = runs.setdefault(rec.run.run_id, WandbRun(rec.run.run_id, [], []))
                run.files.append(path)
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                run.history.append(row)
    return runs


def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (purged steps left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
