"""Storage that does not answer when an attempt starts is infrastructure, exit 1 (retryable), naming the
endpoint; not a user error, exit 2 (issue 44 item 7). Real processes: the reference job, its real client
stack (s3fs -> aiobotocore), and on loopback either nothing listening (connection refused) or a real
HTTP server that answers every request as S3 does when it throttles (503 SlowDown). A bucket that does
not exist (moto's S3 server) stays a user error: the user must fix that."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, proc_env
from procs import outcome
from s3_server import S3Server, bucket_fixture, free_port, s3_fixture  # noqa: F401  (fixtures s3, bucket)

pytestmark = [pytest.mark.integration]

SLOWDOWN_SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
        b'<Message>Please reduce your request rate.</Message></Error>')


class SlowDown(BaseHTTPRequestHandler):
    def answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(BODY)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = answer

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), SlowDown)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def _client_env(endpoint: str) -> dict[str, str]:
    # few client retries, so that the test takes seconds (the classification is the same after more)
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}


def _train(run: Path, url: str, env: dict[str, str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "ddp_kit.train", "--progress", "false", "--run_dir", str(run), "--ckpt_dir", url,
           "--max_steps", "3"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    return outcome(p, 240)


def _end(run: Path) -> dict:
    (end,) = [r for r in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if r["event"] == "end"]
    return end


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("ddp_kit: error:")]


def test_a_store_that_refuses_connections_at_startup_is_retryable_and_named(tmp_path):
    port = free_port()  # nothing listens there
    rc, out = _train(tmp_path / "r", "s3://bucket/run", _client_env(f"http://127.0.0.1:{port}"))
    assert rc == 1, out[-3000:]
    end = _end(tmp_path / "r")
    assert (end["verdict"], end["retryable"], end["exit"]) == ("infrastructure", True, 1), end
    (line,) = _errors(out)
    assert f"127.0.0.1:{port} did not answer" in line and "s3://bucket/run" in line and "(hint: a restart" in line


def test_503_slowdown_at_startup_is_retryable_not_a_user_error(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", SLOWDOWN_SERVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        port = int(server.stdout.readline())
        rc, out = _train(tmp_path / "r", "s3://bucket/run", _client_env(f"http://127.0.0.1:{port}"))
    finally:
        server.kill()  # the process we started, by its PID
        server.wait()
    assert rc == 1, out[-3000:]
    end = _end(tmp_path / "r")
    assert (end["verdict"], end["retryable"]) == ("infrastructure", True), end
    (line,) = _errors(out)
    assert f"127.0.0.1:{port} did not answer" in line and ("SlowDown" in line or "reduce your request rate" in line), line


def test_a_bucket_that_does_not_exist_stays_a_user_error(tmp_path, s3: S3Server):
    rc, out = _train(tmp_path / "r", "s3://no-such-bucket-ddpkit/run", {**s3.env(), "AWS_MAX_ATTEMPTS": "1"})
    assert rc == 2, out[-3000:]
    end = _end(tmp_path / "r")
    assert (end["verdict"], end["retryable"]) == ("user_error", False), end
