"""A checkpoint storage on any fsspec URL (storage.Storage: no rename, not local), opening one, and
saying what went wrong with one in a few words.

    s3://bucket/prefix   s3fs (pip install 'ddp_kit[s3]'); credentials and endpoint as boto reads them:
                         AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and
                         ~/.aws/{credentials,config}, an instance or pod role, AWS_ENDPOINT_URL(_S3)
    gs:// gcs://         gcsfs (pip install gcsfs); GOOGLE_APPLICATION_CREDENTIALS, gcloud's login
    az:// abfs:// abfss://  adlfs (pip install adlfs); AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_* ...
    file:///abs/path     fsspec's own local file system: the object store code path on a folder
    memory://name        fsspec's in-process store (tests)

DDP_KIT_STORAGE_OPTIONS, a JSON object, is passed to the file system as keyword arguments (e.g.
{"endpoint_url": "http://127.0.0.1:9000"} for s3fs, or {"anon": true}): for what the environment
cannot say. Neither it nor any credential is ever printed.
"""
from __future__ import annotations

import errno
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar
from urllib.parse import urlsplit

from ..errors import Unavailable, UserError
from .storage import Storage
from .storage_registry import scheme_of

STORAGE_OPTIONS_ENV = "DDP_KIT_STORAGE_OPTIONS"

# scheme -> (the fsspec implementation's package, how to install it)
_PACKAGES = {
    "s3": ("s3fs", "pip install 'ddp_kit[s3]'"),
    "gs": ("gcsfs", "pip install gcsfs"), "gcs": ("gcsfs", "pip install gcsfs"),
    "az": ("adlfs", "pip install adlfs"), "abfs": ("adlfs", "pip install adlfs"), "abfss": ("adlfs", "pip install adlfs"),
    "file": ("fsspec", "pip install 'ddp_kit[s3]' (or just fsspec)"),
    "memory": ("fsspec", "pip install 'ddp_kit[s3]' (or just fsspec)"),
}


@dataclass(frozen=True)
class Store:
    """One checkpoint location on an fsspec file system: `root` is the file system's path of `url`.
    A Storage with no rename: every object is written under its final name (one PUT each)."""
    fs: Any
    root: str
    url: str

    can_rename: ClassVar[bool] = False
    local_root: ClassVar[Path | None] = None
    object_word: ClassVar[str] = "object"

    @property
    def location(self) -> str:
        return self.url

    def locate(self, rel: str) -> str:
        return self.url_of(rel) if rel else self.url

    @contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """Buffered here and sent in one PUT at the end: the object appears whole or not at all."""
        buf = io.BytesIO()
        yield buf
        self.fs.pipe_file(self.path(rel), buf.getvalue())

    def write_bytes(self, rel: str, data: bytes) -> None:
        """One PUT: a reader sees the old object or the new one, never half of one."""
        self.fs.pipe_file(self.path(rel), data)

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(rel)))

    def put(self, local: Path, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel))

    def get(self, rel: str, local: Path) -> None:
        self.fs.get_file(self.path(rel), str(local))

    def listing(self, prefix: str = "") -> dict[str, int]:
        top = self.path(prefix) if prefix else self.root
        self.fs.invalidate_cache(top)
        try:
            found = self.fs.find(top, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            rel = self.rel(path)
            if rel is None or rel.endswith("/") or info.get("type") == "directory":
                continue
            out[rel] = int(info.get("size") or 0)
        return out

    def remove(self, rels: list[str]) -> None:
        there = [p for p in (self.path(r) for r in rels) if self.fs.exists(p)]
        if there:
            self.fs.rm(there, recursive=True)

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{self.url}: an object store has no rename")

    def sync(self, rel: str = "") -> None:
        return None  # an upload is durable once it returns

    def move_to(self, rel: str, other: Storage, dst: str) -> None:
        if not isinstance(other, Store):
            raise ValueError(f"cannot move {self.url_of(rel)} to {other.location}: another storage")
        objects = self.listing(rel)
        for r in objects:
            self.fs.copy(self.path(r), other.path(dst + r[len(rel):]))
        self.remove([rel])

    def sibling(self, location: str) -> Storage | None:
        if "://" not in location:
            return None
        return Store(self.fs, self.fs._strip_protocol(location).rstrip("/"), location.rstrip("/"))

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if parts else self.root

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *parts]) if parts else self.url

    def rel(self, path: str) -> str | None:
        """`path` (as the file system lists it) relative to root; None when outside."""
        head = self.root.rstrip("/") + "/"
        return path[len(head):] if path.startswith(head) else None

    def under(self, url: str) -> str | None:
        """The part of `url` below this store's url ("step_3" of <url>/step_3); None when not below it."""
        head = self.url + "/"
        return url[len(head):].strip("/") if url.startswith(head) else None


def storage_options(environ: dict[str, Any] | None = None) -> dict[str, Any]:
    """DDP_KIT_STORAGE_OPTIONS as keyword arguments of the file system; refused in one line if not a JSON object."""
    raw = (os.environ if environ is None else environ).get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or a number too long to convert (int's digit limit)
        why = f"{exc.msg} at character {exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise UserError(f"{STORAGE_OPTIONS_ENV} is not valid JSON ({why})",
                        f'set it to a JSON object, e.g. {STORAGE_OPTIONS_ENV}=\'{{"endpoint_url": "http://host:9000"}}\'') from None
    if not isinstance(options, dict):
        raise UserError(f"{STORAGE_OPTIONS_ENV} must be a JSON object (keyword arguments of the file system), "
                        f"not a {type(options).__name__}", f'e.g. {STORAGE_OPTIONS_ENV}=\'{{"endpoint_url": "http://host:9000"}}\'')
    return options


def open_store(url: str, environ: dict[str, Any] | None = None) -> Store:
    """The Store of checkpoint location `url`. Refused in one line: a scheme whose fsspec implementation
    is not installed, a file:// URL naming another host, a URL with no bucket, bad storage options."""
    scheme = scheme_of(url)
    url = scheme + url[len(scheme):].rstrip("/")  # FILE://x is file://x
    options = storage_options(environ)
    parts = urlsplit(url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UserError(f"checkpoint location {url!r} names the host {parts.netloc!r}; file:// URLs name "
                            f"a folder on this machine", "write file:///absolute/path (three slashes), or a plain path")
        url = f"file://{parts.path}"
        options.setdefault("auto_mkdir", True)  # an object store has no folders to make first
    elif not parts.netloc:
        raise UserError(f"checkpoint location {url!r} names no bucket", f"write {scheme}://BUCKET/PREFIX")
    package, install = _PACKAGES.get(scheme, (scheme, f"install the fsspec implementation of {scheme}://"))
    try:
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError:
        raise UserError(f"checkpoint location {url!r} needs {package}, which is not installed here",
                        install) from None
    except (TypeError, ValueError) as exc:  # an option this file system does not take
        raise UserError(f"cannot open checkpoint location {url!r}: {describe(exc)}",
                        f"check {STORAGE_OPTIONS_ENV}" if options else "check the URL") from None
    return Store(fs, root.rstrip("/") or root, url)


def describe(exc: BaseException) -> str:
    """An error from a store in a few words: its type and the first line of its message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def no_credentials(exc: BaseException | None) -> bool:
    """botocore's NoCredentialsError / PartialCredentialsError, google-auth's DefaultCredentialsError,
    azure's ClientAuthenticationError, anywhere in the chain (by name: their packages are optional)."""
    seen = 0
    while exc is not None and seen < 8:
        if any("Credential" in c.__name__ or "Authentication" in c.__name__ for c in type(exc).__mro__):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def refusal(url: str, exc: BaseException, doing: str) -> UserError:
    """The one line for a store that cannot be used at startup: missing bucket, no credentials, no
    permission (a read-only bucket), or anything else (endpoint, network)."""
    why = describe(exc)
    if no_credentials(exc):
        return UserError(f"no credentials for checkpoint location {url!r} ({why})",
                         "set them where the client looks: for s3:// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                         "AWS_PROFILE or ~/.aws/credentials, or a node/pod role")
    if isinstance(exc, FileNotFoundError):
        return UserError(f"the bucket of checkpoint location {url!r} does not exist ({why})",
                         "create it first (e.g. aws s3 mb s3://BUCKET), or fix the URL")
    if isinstance(exc, PermissionError):
        return UserError(f"checkpoint location {url!r} cannot be {doing}: access denied ({why})",
                         "use credentials (or a bucket policy) that may read, write, list and delete objects under "
                         "this prefix; a read-only bucket cannot hold checkpoints")
    if unreachable(exc):  # a restart may cure it: retryable (exit 1), not a user error
        return Unavailable(f"checkpoint location {url!r} cannot be {doing}: {endpoint_of(url)} did not answer ({why})",
                           "a restart retries it (the job exits 1); if it persists, check that endpoint, the network "
                           "and the store's status")
    return UserError(f"checkpoint location {url!r} cannot be {doing} ({why})",
                     f"check the URL, the endpoint (AWS_ENDPOINT_URL, or endpoint_url in {STORAGE_OPTIONS_ENV}), "
                     f"the network and the credentials")


# Errors of a store that is down, unreachable or throttling: by class name anywhere in the chain (the
# clients are optional), errno, or the service's own code (s3fs turns 503 SlowDown into OSError EBUSY).
_UNREACHABLE_CLASSES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                        "ClientConnectorError", "ServerDisconnectedError", "ServerTimeoutError", "ServiceUnavailable",
                        "TooManyRequests", "ServiceRequestError", "ServiceResponseError", "TransportError")
_UNREACHABLE_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                       errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EBUSY, errno.EAGAIN}
_UNREACHABLE_WORDS = ("SlowDown", "Service Unavailable", "ServiceUnavailable", "Throttl", "RequestTimeout",
                      "reduce your request rate", "Connection refused", "timed out", "Timeout")


def unreachable(exc: BaseException | None) -> bool:
    """Whether `exc` (or an error in its chain) says the store did not answer: connection refused or
    reset, a timeout, 503 SlowDown / ServiceUnavailable, throttling. A restart may cure these."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS:
            return True
        if any(c.__name__ in _UNREACHABLE_CLASSES for c in type(exc).__mro__):
            return True
        if any(w in str(exc) for w in _UNREACHABLE_WORDS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def endpoint_of(url: str, environ: dict[str, Any] | None = None) -> str:
    """The host a URL's client talks to, for a message: the endpoint set in the environment or in
    DDP_KIT_STORAGE_OPTIONS, else the scheme's own service (credentials are never part of it)."""
    env = dict(os.environ) if environ is None else environ
    scheme = scheme_of(url)
    try:
        options = storage_options(env)
    except UserError:
        options = {}
    set_ = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    if not set_ and scheme == "s3":
        set_ = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if set_:
        parts = urlsplit(str(set_))
        return f"endpoint {parts.hostname or set_}" + (f":{parts.port}" if parts.port else "")
    default = {"s3": "Amazon S3", "gs": "Google Cloud Storage", "gcs": "Google Cloud Storage"}.get(scheme)
    return f"{default} (bucket {urlsplit(url).netloc})" if default else f"the store of {url}"
