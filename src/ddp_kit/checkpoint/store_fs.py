"""Opening a checkpoint URL through fsspec, and saying what went wrong with one in a few words.

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

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import UserError
from .backend import scheme_of

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
    """One checkpoint location on an fsspec file system: `root` is the file system's path of `url`."""
    fs: Any
    root: str
    url: str

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


def storage_options(environ: dict | None = None) -> dict[str, Any]:
    """DDP_KIT_STORAGE_OPTIONS as keyword arguments of the file system; refused in one line if not a JSON object."""
    raw = (os.environ if environ is None else environ).get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise UserError(f"{STORAGE_OPTIONS_ENV} is not valid JSON ({exc.msg} at character {exc.pos})",
                        f'set it to a JSON object, e.g. {STORAGE_OPTIONS_ENV}=\'{{"endpoint_url": "http://host:9000"}}\'') from None
    if not isinstance(options, dict):
        raise UserError(f"{STORAGE_OPTIONS_ENV} must be a JSON object (keyword arguments of the file system), "
                        f"not a {type(options).__name__}", f'e.g. {STORAGE_OPTIONS_ENV}=\'{{"endpoint_url": "http://host:9000"}}\'')
    return options


def open_store(url: str, environ: dict | None = None) -> Store:
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


def no_credentials(exc: BaseException) -> bool:
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
    return UserError(f"checkpoint location {url!r} cannot be {doing} ({why})",
                     f"check the URL, the endpoint (AWS_ENDPOINT_URL, or endpoint_url in {STORAGE_OPTIONS_ENV}), "
                     f"the network and the credentials")
