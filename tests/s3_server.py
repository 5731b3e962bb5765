"""An S3-protocol server for the tests: moto's standalone server (`python -m moto.server`, S3's REST
protocol over plain HTTP, state in memory) started as a real process on an address of ours, and the
environment that points a user's client stack (s3fs -> aiobotocore -> botocore) at it.

botocore reads the endpoint from AWS_ENDPOINT_URL (botocore >= 1.31, the "service-specific endpoints"
configuration), so a child process reaches the server with the same variables a user sets for any
S3-compatible store, and no ddp_kit option. The server is stopped by the PID we started, and only it.
A test module gets the fixtures `s3` (the server) and `bucket` (a fresh bucket on it) by importing
s3_fixture and bucket_fixture. One server per test process (per xdist worker): it starts in under a second (measured: 0.7 s to the
first answer on an idle machine), so sharing one between workers is not worth a lock.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ACCESS_KEY = SECRET_KEY = "testing"  # moto accepts any key until its IAM checks are switched on
REGION = "us-east-1"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://HOST:PORT
    pid: int

    def env(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
        """What a child process needs to reach this server, and nothing of the machine's own AWS setup
        (no config or credentials file, no instance metadata lookup, which would wait for a timeout)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": access_key,
                "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": REGION,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, service: str = "s3", access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        """A boto3 client for the test's own setup and inspection (creating buckets, listing objects,
        rewriting one); the runs under test reach the server through s3fs."""
        import boto3

        return boto3.session.Session().client(service, endpoint_url=self.endpoint, region_name=REGION,
                                              aws_access_key_id=access_key, aws_secret_access_key=secret_key)

    def new_bucket(self, tag: str = "run") -> str:
        """A bucket no other test uses (S3 names: 3-63 characters, lower case, digits, '-')."""
        name = f"ddpkit-{tag}-{uuid.uuid4().hex[:12]}".lower()[:63]
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix`: key -> size in bytes."""
        out: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def serve(host: str = "127.0.0.1", log: Path | None = None, extra_env: dict | None = None,
          start_timeout_s: float = 60) -> Iterator[S3Server]:
    """moto's server on `host` (an address of this network namespace) and a free port, until the block
    ends. `extra_env`: moto's own settings, e.g. INITIAL_NO_AUTH_ACTION_COUNT to turn IAM checks on."""
    for _attempt in range(3):  # the free port can be taken between our probe and the server's bind
        port = free_port(host)
        endpoint = f"http://{host}:{port}"
        out = open(log, "ab") if log else subprocess.DEVNULL
        p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **(extra_env or {})})
        end = time.monotonic() + start_timeout_s
        while p.poll() is None and time.monotonic() < end and not _answers(endpoint):
            time.sleep(0.05)
        if p.poll() is None and _answers(endpoint):
            break
        _stop(p)
    else:
        raise RuntimeError(f"moto's server did not answer on {host} after 3 tries (log: {log})")
    try:
        yield S3Server(endpoint, p.pid)
    finally:
        _stop(p)
        if log:
            out.close()


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)  # the process we started, by its PID
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="session", name="s3")
def s3_fixture(tmp_path_factory) -> Iterator[S3Server]:
    """A test module gets the fixtures `s3` (the server) and `bucket` (a fresh bucket on it) by importing
s3_fixture and bucket_fixture. One server per test process, on loopback."""
    with serve(log=tmp_path_factory.mktemp("s3") / "moto.log") as server:
        yield server


@pytest.fixture(name="bucket")
def bucket_fixture(s3: S3Server) -> str:
    """A fresh, empty bucket on the session's server."""
    return s3.new_bucket()
