"""Fetching a URI model.path into a node's model.download_dir, once per node.

Whatever loads the model (a Serve replica, `kestrel generate`) fetches a URI before it
loads: into download_dir/NAME-HASH (HASH: of the URI), which then holds the model folder
itself or the one .gguf file. Processes of one node that fetch the same URI take turns on
a file lock there, and the later ones find the first one's copy. A fetch writes beside
that folder, under a .partial name, and renames its result into place only when it is
whole and holds a model, so a folder under the final name is always complete; a fetch
that fails removes its partial folder, and one whose process was killed leaves it to the
next fetch of the URI, which removes it. A URI is fetched once: a changed model needs a
new URI (or its folder removed).
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os
import posixpath
import re
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from typing import IO, Protocol
from urllib.parse import urlsplit
from urllib.request import url2pathname

from configs.schema import MODEL_ARCHIVE_SUFFIXES

log = logging.getLogger("kestrel.download")

CHUNK_BYTES = 1 << 20
PROGRESS_EVERY_S = 5.0
# Seconds an HTTP transfer may go without a byte before it fails: a stalled server must
# fail the replica, not leave it starting for ever (and the node's other replicas waiting
# on the lock behind it).
STALL_TIMEOUT_S = 60.0


class ModelDownloadError(RuntimeError):
    pass


def cache_folder(uri: str, download_dir: str) -> str:
    """Where `uri`'s copy lives under download_dir: its last path part (for people) and a
    hash of the whole URI (two URIs never share a folder)."""
    tail = posixpath.basename(urlsplit(uri).path.rstrip("/"))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", tail)[:64] or "model"
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(download_dir), f"{name}-{digest}")


def fetch_model(uri: str, download_dir: str, stall_timeout_s: float = STALL_TIMEOUT_S) -> str:
    """The local path of the model at `uri` (a folder with config.json, or a .gguf file),
    fetched into download_dir unless it is there already. ModelDownloadError, naming the
    URI and the reason, if it cannot be fetched."""
    final = cache_folder(uri, download_dir)
    if os.path.isdir(final):
        return model_in(final, uri)
    root, key = os.path.split(final)
    try:
        os.makedirs(root, exist_ok=True)
        lock = open(final + ".lock", "a")
    except OSError as e:
        raise ModelDownloadError(f"model.path {uri!r}: cannot write model.download_dir {root!r}: "
                                 f"{e.strerror or e}") from None
    with lock:  # the lock goes with the file's closing, or with this process
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process of this node is fetching it; waiting for it", uri)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(final):
            return model_in(final, uri)
        for stale in glob.glob(os.path.join(root, f".{key}.partial-*")):  # a killed fetch's
            shutil.rmtree(stale, ignore_errors=True)
        staging = tempfile.mkdtemp(prefix=f".{key}.partial-", dir=root)
        try:
            model = _fetch_into(uri, staging, stall_timeout_s)
            os.rename(model, final)
        except ModelDownloadError:
            raise
        except Exception as e:
            raise ModelDownloadError(f"model.path {uri!r}: the download failed: {_reason(e, stall_timeout_s)}"
                                     ) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("%s: ready at %s", uri, final)
    return model_in(final, uri)


def model_in(folder: str, uri: str) -> str:
    """The model a fetched folder holds: the folder if it has config.json, else its one
    .gguf file."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    ggufs = [n for n in os.listdir(folder) if n.lower().endswith(".gguf")]
    if len(ggufs) == 1:
        return os.path.join(folder, ggufs[0])
    raise ModelDownloadError(f"model.path {uri!r}: what it holds is not a model: no config.json "
                             f"and {'no' if not ggufs else 'more than one'} .gguf file at its top")


def _reason(e: BaseException, stall_timeout_s: float) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):  # the connection's own error inside
        return _reason(e.reason, stall_timeout_s) if isinstance(e.reason, BaseException) else str(e.reason)
    if isinstance(e, TimeoutError):
        return f"no data for {stall_timeout_s:g} s"
    if isinstance(e, (tarfile.TarError, EOFError, zlib.error)):
        return f"the archive is cut short or not a tar archive ({type(e).__name__}: {e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}"


def _fetch_into(uri: str, staging: str, stall_timeout_s: float) -> str:
    """Fetch `uri` under `staging`; the folder to rename into place, checked to hold a model."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        source: _Source = _HttpSource(uri, stall_timeout_s)
    elif scheme == "file":
        source = _LocalSource(url2pathname(parts.path))
    else:
        source = _ArrowSource(uri)
    name = posixpath.basename(parts.path.rstrip("/"))
    tree = os.path.join(staging, "model")
    files, size = source.listing()
    log.info("%s: fetching%s into %s", uri, f" {_mib(size)}" if size is not None else "", staging)
    progress = _Progress(uri, size)
    os.makedirs(tree)
    if files is not None:  # a folder: its files as they are
        for rel, file_size in files:
            os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
            with source.open(rel) as src, open(os.path.join(tree, rel), "wb") as out:
                _copy(_Counted(src, progress, file_size), out)
    elif name.lower().endswith(".gguf"):
        with source.open() as src, open(os.path.join(tree, name), "wb") as out:
            _copy(_Counted(src, progress, size), out)
    elif name.lower().endswith(MODEL_ARCHIVE_SUFFIXES):
        with source.open() as src:
            counted = _Counted(src, progress, size)
            with tarfile.open(fileobj=counted, mode="r|*") as tar:
                tar.extractall(tree, filter="data")  # no paths outside tree, no devices
            while counted.read(CHUNK_BYTES):  # to the end: a cut after the last member fails too
                pass
        tree = _unwrapped(tree)
    else:
        raise ModelDownloadError(f"model.path {uri!r}: names neither a folder nor a "
                                 f"{', '.join(MODEL_ARCHIVE_SUFFIXES)} or .gguf file")
    model_in(tree, uri)
    progress.finish()
    return tree


def _unwrapped(tree: str) -> str:
    """An archive of the model folder usually holds the folder (tar -C parent model):
    its one top-level folder, unless the files are at the top themselves."""
    entries = os.listdir(tree)
    if len(entries) == 1 and os.path.isdir(os.path.join(tree, entries[0])):
        return os.path.join(tree, entries[0])
    return tree


def _copy(src: "_Counted", out: IO[bytes]) -> None:
    while chunk := src.read(CHUNK_BYTES):
        out.write(chunk)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class _Progress:
    """Bytes so far, logged every PROGRESS_EVERY_S with the rate since the start."""

    def __init__(self, uri: str, size: int | None):
        self.uri, self.size, self.done = uri, size, 0
        self.t0 = self.last = time.monotonic()

    def _rate(self, now: float) -> str:
        return f"{self.done / (1 << 20) / max(now - self.t0, 1e-9):.1f} MiB/s"

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            of = f" of {_mib(self.size)} ({100 * self.done / max(self.size, 1):.0f}%)" if self.size else ""
            log.info("%s: %s%s, %s", self.uri, _mib(self.done), of, self._rate(now))

    def finish(self) -> None:
        now = time.monotonic()
        log.info("%s: fetched %s in %.1f s, %s", self.uri, _mib(self.done), now - self.t0, self._rate(now))


class _Counted:
    """A stream read through to count its bytes (tarfile reads an archive from it), which
    fails if it ends before its size: a connection closed early reads as a plain end
    (http.client does not check Content-Length)."""

    def __init__(self, src: IO[bytes], progress: _Progress, size: int | None):
        self.src, self.progress, self.size, self.done = src, progress, size, 0

    def read(self, n: int = -1) -> bytes:
        chunk = self.src.read(n)
        self.done += len(chunk)
        self.progress.add(len(chunk))
        if not chunk and n and self.size is not None and self.done < self.size:
            raise ModelDownloadError(f"model.path {self.progress.uri!r}: the download failed: the "
                                     f"transfer ended after {self.done} of {self.size} bytes")
        return chunk


class _Source(Protocol):
    """Where a URI's bytes come from."""

    def listing(self) -> tuple[list[tuple[str, int]] | None, int | None]:
        """(a folder's files as (relative path, size), their total), or (None, a single
        file's size: None if unknown)."""

    def open(self, rel: str = "") -> IO[bytes]:
        """A folder's file `rel`, or the single file."""


class _LocalSource(_Source):
    def __init__(self, path: str):
        self.path = path

    def listing(self):
        if os.path.isdir(self.path):
            files = []
            for folder, _, names in os.walk(self.path):
                for n in sorted(names):
                    p = os.path.join(folder, n)
                    files.append((os.path.relpath(p, self.path), os.path.getsize(p)))
            return files, sum(s for _, s in files)
        return None, os.path.getsize(self.path)  # FileNotFoundError names the path

    def open(self, rel: str = "") -> IO[bytes]:
        return open(os.path.join(self.path, rel) if rel else self.path, "rb")


class _HttpSource(_Source):
    """One GET (redirects followed); each read fails after stall_timeout_s without data."""

    def __init__(self, url: str, stall_timeout_s: float):
        self.url, self.stall_timeout_s = url, stall_timeout_s
        self.response = None

    def listing(self):
        req = urllib.request.Request(self.url, headers={"User-Agent": "kestrel"})
        self.response = urllib.request.urlopen(req, timeout=self.stall_timeout_s)
        return None, self.response.length  # Content-Length; None when chunked

    def open(self, rel: str = "") -> IO[bytes]:
        return self.response


class _ArrowSource(_Source):
    """s3:// and gs:// through pyarrow's file systems (credentials as pyarrow finds them:
    the node's environment, its instance role)."""

    def __init__(self, uri: str):
        import pyarrow.fs as pafs
        self.pafs = pafs
        self.fs, self.path = pafs.FileSystem.from_uri(uri)

    def listing(self):
        info = self.fs.get_file_info(self.path)
        if info.type == self.pafs.FileType.NotFound:
            raise FileNotFoundError(2, "no such object or folder", self.path)
        if info.type == self.pafs.FileType.Directory:
            found = self.fs.get_file_info(self.pafs.FileSelector(self.path, recursive=True))
            files = sorted((posixpath.relpath(i.path, self.path), i.size)
                           for i in found if i.type == self.pafs.FileType.File)
            return files, sum(s for _, s in files)
        return None, info.size

    def open(self, rel: str = "") -> IO[bytes]:
        return self.fs.open_input_stream(posixpath.join(self.path, rel) if rel else self.path)
