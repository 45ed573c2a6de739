"""Sources in object stores (S3, GCS, Azure Blob): filesystems, retries and a node-local cache.

A source path with a URL scheme (``s3://``, ``gs://``, ``az://``, ``abfs://``, or any other fsspec
protocol) is read through fsspec (s3fs, gcsfs, adlfs). This module builds that filesystem from the
source's ``storage_options`` (passed to fsspec as they are; ``${VAR}`` values are read from the
environment where the filesystem is built, so secrets need not be written into recipes; absent
options fall back to each library's standard environment variables and credential chains) and wraps
it in a :class:`RetryingFileSystem`:

- **Byte ranges, not downloads.** Files open as :class:`RemoteFile`, a seekable file that issues one
  ranged GET per read it cannot serve from its small read-ahead buffer. pyarrow reading a Parquet file
  through it fetches the footer and the requested row group's column chunks, not the file.
- **Retries that cannot change the output.** Every request is a pure function of (object, byte range);
  a transient failure (connection reset or refused, timeout, truncated body, HTTP 408/429/5xx,
  throttling) is retried with exponential backoff and jitter up to ``[storage] retries`` times, and a
  response shorter than the range asked for counts as a transient failure, so a retry re-reads exactly
  the same bytes. After the last attempt, and at once for permanent errors (missing object, access
  denied, anything not known to be transient), a :class:`StoreError` names the URL and the fix.
  Jitter comes from a private random source: timing never reaches the data.
- **Node-local cache (optional).** With ``[storage] cache_dir``, reads go through fixed-size aligned
  blocks cached as files keyed by (URL, size, ETag/generation, block size). Blocks are written to a
  temporary file and renamed into place, so ranks and workers sharing the directory never read a
  half-written block; the least recently used blocks are evicted beyond ``cache_max_bytes``. The cache
  is not trusted: every block carries a checksum verified on each read (a bad block is fetched again),
  and links under the cache folder are never followed, when reading or when evicting.

Local paths are untouched (no wrapper, no cache): the plain fsspec local filesystem, as before.
Nothing here enters the recipe fingerprint: where the bytes come from, the credentials, retry and
cache settings only change speed. Each process (lane worker processes included) rebuilds its
filesystems from the recipe, so nothing here is pickled.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import io
import os
import random
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import fsspec

from .readers.base import SourceError
from .recipe import SourceSpec, StorageSpec

LOCAL_PROTOCOLS = {"file", "local"}
DEFAULT_READAHEAD = 64 << 10  # bytes a RemoteFile fetches at least per request (a small sequential read-ahead)
_MAX_BACKOFF_S = 30.0
_JITTER = random.Random()  # timing only: never used for anything that reaches a batch


class StoreError(SourceError):
    """An object-store request that failed for good; the message names the URL and the fix."""


# -- statistics ------------------------------------------------------------------------------------
_STATS_KEYS = ("requests", "bytes_fetched", "retries", "cache_hits", "cache_misses", "cache_evictions",
               "cache_corrupt")
_stats = {k: 0 for k in _STATS_KEYS}
_stats_lock = threading.Lock()


def _count(**deltas: int) -> None:
    with _stats_lock:
        for k, v in deltas.items():
            _stats[k] += v


def stats(reset: bool = False) -> dict[str, int]:
    """This process's object-store counters: data requests, bytes fetched, retries, cache hits/misses/evictions,
    and ``cache_corrupt``: cached blocks that failed their checksum (refetched, never used)."""
    with _stats_lock:
        out = dict(_stats)
        if reset:
            for k in _stats:
                _stats[k] = 0
    return out


# -- error classification --------------------------------------------------------------------------
TRANSIENT, MISSING, DENIED, PERMANENT = "transient", "missing", "denied", "permanent"

# Exception classes (matched by name along the MRO, so that no client library has to be imported) that
# s3fs/botocore, gcsfs/requests/google-auth, adlfs/azure-core and aiohttp raise for a connection that was
# reset, refused, timed out or cut short.
_TRANSIENT_NAMES = {
    "ConnectionError", "TimeoutError", "IncompleteRead", "RemoteDisconnected",  # builtins, http.client
    "FSTimeoutError",  # fsspec
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",  # botocore
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "ResponseParserError",
    "ClientConnectionError", "ClientPayloadError", "ServerTimeoutError", "ServerDisconnectedError",  # aiohttp
    "ClientOSError",
    "ChunkedEncodingError", "ReadTimeout", "ConnectTimeout", "ProxyError", "ContentDecodingError",  # requests
    "ChecksumError", "TransportError",  # gcsfs (body corrupted in transit), google-auth
    "ServiceRequestError", "ServiceResponseError",  # azure-core (request not sent / response cut)
}
_MISSING_NAMES = {"FileNotFoundError", "ResourceNotFoundError", "NoSuchKey", "NoSuchBucket"}
_DENIED_NAMES = {"PermissionError", "ClientAuthenticationError", "NoCredentialsError", "PartialCredentialsError",
                 "DefaultCredentialsError", "RefreshError"}
_TRANSIENT_CODES = {  # service error codes for throttling and server-side trouble
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ServerBusy", "OperationTimedOut",
    "InternalServerError", "BandwidthLimitExceeded",
}
_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "BlobNotFound", "ContainerNotFound", "ResourceNotFound"}
_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                 "AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
                 "InvalidToken", "ExpiredToken", "AccountProblem", "InsufficientAccountPermissions"}
_TRANSIENT_ERRNOS = {getattr(errno, n) for n in (
    "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "ETIMEDOUT", "EPIPE", "EBUSY", "EAGAIN", "EHOSTUNREACH",
    "ENETUNREACH", "ENETDOWN", "ENETRESET", "EREMOTEIO") if hasattr(errno, n)}


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """HTTP status and service error code of a client exception (botocore, gcsfs, azure, aiohttp)."""
    status, code = None, None
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):  # botocore ClientError
        err = response.get("Error", {}) or {}
        code = err.get("Code")
        status = (response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
        if status is None and str(code).isdigit():
            status = int(code)
    for attr in ("status_code", "status"):  # azure HttpResponseError, aiohttp ClientResponseError
        value = getattr(exc, attr, None)
        if status is None and isinstance(value, int):
            status = value
    gcs_code = getattr(exc, "code", None)  # gcsfs HttpError
    if status is None and isinstance(gcs_code, int) and type(exc).__name__ == "HttpError":
        status = gcs_code
    code = code or getattr(exc, "error_code", None)  # azure
    return status, (str(code) if code is not None else None)


def classify(exc: BaseException) -> str:
    """``transient`` (retry), ``missing``, ``denied`` or ``permanent`` (stop): the first decisive
    exception along the chain of causes wins (s3fs re-raises botocore errors as OSError from them)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        names = {c.__name__ for c in type(e).__mro__}
        if names & _MISSING_NAMES:
            return MISSING
        if names & _DENIED_NAMES:
            return DENIED
        status, code = _status_and_code(e)
        if code in _MISSING_CODES or status == 404:
            return MISSING
        if code in _DENIED_CODES or status in (401, 403):
            return DENIED
        if code in _TRANSIENT_CODES or status in (408, 429) or (status is not None and 500 <= status < 600):
            return TRANSIENT
        if status is not None and 400 <= status < 500:
            return PERMANENT
        if names & _TRANSIENT_NAMES:
            return TRANSIENT
        if isinstance(e, OSError):
            if e.errno in _TRANSIENT_ERRNOS:
                return TRANSIENT
            if str(e).startswith("Forbidden"):  # gcsfs raises OSError("Forbidden: ...") for 403
                return DENIED
        e = e.__cause__ or e.__context__
    return PERMANENT


class _ShortRead(ConnectionError):
    """A response body shorter than the byte range asked for: a connection cut mid-body."""


# -- retries -----------------------------------------------------------------------------------------
def backoff_delay(attempt: int, base_s: float) -> float:
    """Exponential backoff with jitter: ``base * 2**attempt`` times a factor in [0.5, 1.5), capped."""
    return min(_MAX_BACKOFF_S, base_s * (2 ** attempt)) * (0.5 + _JITTER.random())


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def call_with_retries(fn: Callable[[], Any], url: str, what: str, source: str, retries: int,
                      backoff_s: float, missing_ok: bool = False) -> Any:
    """``fn()``, retried on transient errors; a :class:`StoreError` naming ``url`` when it cannot succeed.

    ``missing_ok``: return None for a missing object instead of raising.
    """
    for attempt in range(retries + 1):
        try:
            return fn()
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - every client error is classified below
            kind = classify(exc)
            if kind == MISSING:
                if missing_ok:
                    return None
                raise StoreError(f"source '{source}': {url} does not exist ({what}: {_describe(exc)}). It was "
                                 f"listed when the run was planned, or is named in the recipe: restore the "
                                 f"object, or fix sources.path.") from exc
            if kind == DENIED:
                raise StoreError(f"source '{source}': access to {url} was denied ({what}: {_describe(exc)}). "
                                 f"Check the credentials in this source's storage_options or the "
                                 f"store's standard environment variables, and the object's permissions.") from exc
            if kind == PERMANENT:
                raise StoreError(f"source '{source}': {what} {url} failed ({_describe(exc)}); this error is "
                                 f"not one that a retry can fix. Check the URL and the source's "
                                 f"storage_options.") from exc
            if attempt == retries:
                raise StoreError(f"source '{source}': {what} {url} failed {retries + 1} times with transient "
                                 f"errors (last: {_describe(exc)}). The store is unreachable or overloaded; "
                                 f"check its endpoint and health, or raise [storage] retries / "
                                 f"retry_backoff_s.") from exc
            _count(retries=1)
            time.sleep(backoff_delay(attempt, backoff_s))
    raise AssertionError("unreachable")


# -- filesystem construction ---------------------------------------------------------------------------
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: Any, source: str) -> Any:
    """``${VAR}`` in string values (at any depth) replaced by the environment variable ``VAR``."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            if m.group(1) not in os.environ:
                raise SourceError(f"source '{source}': storage_options refers to ${{{m.group(1)}}}, but the "
                                  f"environment variable {m.group(1)} is not set in this process. Set it "
                                  f"(on every node) or write the value into the recipe.")
            return os.environ[m.group(1)]
        return _ENV_REF.sub(sub, value)
    if isinstance(value, Mapping):
        return {k: expand_env(v, source) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [expand_env(v, source) for v in value]
    return value


def scheme_of(url: str) -> str | None:
    """The URL scheme of a source path (``s3``, ``gs``, ``az``…), or None for a local path."""
    if "::" in url or "://" not in url:
        return None
    return url.split("://", 1)[0].lower()


def _gcs_emulator(options: Mapping[str, Any]) -> bool:
    endpoint = options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST", "")
    return bool(endpoint) and endpoint != "default" and not str(endpoint).startswith("https://")


def _make_fs(url: str, scheme: str, options: dict[str, Any], source: str) -> fsspec.AbstractFileSystem:
    try:
        if scheme in ("gs", "gcs") and _gcs_emulator(options):
            # gcsfs's default class probes the bucket type over gRPC, which an emulator (plain HTTP)
            # does not serve: each probe waits for a timeout. The core class speaks the JSON API only.
            from gcsfs.core import GCSFileSystem

            return GCSFileSystem(**{"token": "anon", **options})
        cls = fsspec.get_filesystem_class(scheme)
        return cls(**{**cls._get_kwargs_from_urls(url), **options})
    except ImportError as exc:
        pkg = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
               "abfss": "adlfs"}.get(scheme, f"the fsspec implementation of '{scheme}'")
        raise SourceError(f"source '{source}': reading {url} needs {pkg}, which is not installed "
                          f"(pip install {pkg}).") from exc
    except ValueError as exc:
        if f"'{scheme}'" in str(exc) or "protocol" in str(exc).lower():
            raise SourceError(f"source '{source}': {url}: unknown storage protocol '{scheme}' "
                              f"(use s3://, gs://, az:// or abfs://, or a local path).") from exc
        raise SourceError(f"source '{source}': cannot connect to the store of {url} ({_describe(exc)}). "
                          f"Check this source's storage_options.") from exc
    except TypeError as exc:
        raise SourceError(f"source '{source}': storage_options not accepted by the {scheme}:// filesystem "
                          f"({exc}). Fix the source's storage_options.") from exc


def url_to_fs(url: str, source: SourceSpec, storage: StorageSpec | None = None) -> tuple[Any, str]:
    """The filesystem for one source path and the path to hand it.

    Local paths (and chained fsspec URLs ``a::b``): ``fsspec.core.url_to_fs`` exactly as before, with
    the source's storage_options. Object-store URLs: a :class:`RetryingFileSystem` and the URL itself
    (its listings and file names are URLs too, so every message names the object in full).
    """
    options = expand_env(dict(source.storage_options or {}), source.name)
    scheme = scheme_of(url)
    if scheme is None or scheme in LOCAL_PROTOCOLS:
        return fsspec.core.url_to_fs(url, **options)
    fs = _make_fs(url, scheme, options, source.name)
    return RetryingFileSystem(fs, scheme, source.name, storage or StorageSpec()), url


# -- the node-local block cache -----------------------------------------------------------------------
_BLOCK_MAGIC = b"ZPHBLK2\n"  # a block file: magic | blake2b-256 of (key, block, length, data) | data
_BLOCK_HEADER = len(_BLOCK_MAGIC) + 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
_STALE_TMP_S = 3600  # a temporary file older than this was left by a crashed writer


def _block_digest(key: str, block: int, data: bytes) -> bytes:
    """Checksum of a cached block, bound to its key and number: a block copied under another name fails."""
    h = hashlib.blake2b(digest_size=32, person=b"zephon-block")
    h.update(f"{key}\n{block}\n{len(data)}\n".encode())
    h.update(data)
    return h.digest()


class BlockCache:
    """Aligned blocks of remote objects as files under ``root``, shared by every process on a node.

    A block file is written under a temporary name in the same folder and renamed into place
    (``os.replace`` is atomic), so a reader sees a complete block or none; two writers of the same
    block write the same bytes. A hit refreshes the file's mtime; when this process has written more
    than 1/16 of ``max_bytes`` since its last sweep, it deletes the least recently used blocks until
    the folder holds at most ``max_bytes`` (the limit is therefore exceeded by at most 1/16 of it per
    writing process between sweeps). A block deleted under a reader is simply fetched again.

    The folder may be shared and writable by others, so nothing in it is trusted: each block carries a
    checksum over its key, number and bytes, verified on every read (a bad block is counted as
    ``cache_corrupt``, deleted and fetched again, never used); folders and files are opened relative
    to the cache's own folder without following symbolic links, and eviction deletes only regular
    files directly inside the cache's own block folders (a link is neither followed nor counted).
    """

    def __init__(self, root: str, max_bytes: int) -> None:
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        self.root = base / "zephon-blocks-v2"
        try:
            self.root.mkdir()
        except FileExistsError:
            pass
        if self.root.is_symlink() or not self.root.is_dir():
            raise SourceError(f"[storage] cache_dir: {self.root} is a symbolic link or not a folder; the block "
                              f"cache only uses a real folder of its own (eviction deletes files in it). Remove "
                              f"it, or set cache_dir to another folder.")
        self.max_bytes = max_bytes
        self._written = 0
        self._lock = threading.Lock()

    def _open_dir(self, sub: str | None = None, create: bool = False) -> int | None:
        """A descriptor of the cache folder (``sub`` None) or of its block folder ``sub``, opened without
        following a link; None when it is missing or is not a real folder."""
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
        except OSError:
            return None
        if sub is None:
            return root_fd
        try:
            if create:
                try:
                    os.mkdir(sub, dir_fd=root_fd)
                except FileExistsError:
                    pass
            return os.open(sub, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:  # ELOOP / ENOTDIR: something else sits there; it is left alone
            return None
        finally:
            os.close(root_fd)

    def get(self, key: str, block: int, length: int) -> bytes | None:
        """Block ``block`` of ``key`` (``length`` bytes) if a verified copy is cached, else None."""
        sub_fd = self._open_dir(key[:2])
        if sub_fd is None:
            return None
        name = f"{key}.{block}"
        try:
            try:  # O_NONBLOCK: a FIFO planted under a block's name must not hang the reader
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=sub_fd)
            except OSError:  # missing, or a link (ELOOP): never followed
                return None
            with open(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                raw = f.read(_BLOCK_HEADER + length + 1)
                payload, digest = raw[_BLOCK_HEADER:], raw[len(_BLOCK_MAGIC):_BLOCK_HEADER]
                if len(payload) != length or not raw.startswith(_BLOCK_MAGIC) or \
                        not hmac.compare_digest(digest, _block_digest(key, block, payload)):
                    _count(cache_corrupt=1)
                    _unlink_at(sub_fd, name, st)
                    return None
                try:
                    os.utime(fd)
                except OSError:
                    pass
                return payload
        finally:
            os.close(sub_fd)

    def put(self, key: str, block: int, data: bytes) -> None:
        """Store a block (with its checksum). A failure to write only means it is not cached."""
        if len(data) + _BLOCK_HEADER > self.max_bytes:
            return
        sub_fd = self._open_dir(key[:2], create=True)
        if sub_fd is None:
            return
        tmp = f".tmp-{os.urandom(8).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=sub_fd)
            try:
                with open(fd, "wb") as f:
                    f.write(_BLOCK_MAGIC + _block_digest(key, block, data))
                    f.write(data)
                os.replace(tmp, f"{key}.{block}", src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            except BaseException:
                _unlink_at(sub_fd, tmp)
                raise
        except OSError:  # full disk, a folder where the block should go...: the read goes on uncached
            return
        finally:
            os.close(sub_fd)
        with self._lock:
            self._written += len(data) + _BLOCK_HEADER
            sweep = self._written > self.max_bytes // 16
            if sweep:
                self._written = 0
        if sweep:
            self.evict()

    def evict(self) -> int:
        """Delete least recently used blocks until at most ``max_bytes`` remain; returns bytes kept.

        Only regular files directly inside the cache's block folders are counted or deleted, through
        descriptors of those folders opened without following links: a link (to a folder or a file)
        under the cache is never followed, so nothing outside the cache is ever deleted."""
        root_fd = self._open_dir()
        if root_fd is None:
            return 0
        subs: dict[str, int] = {}
        entries, total, evicted, now = [], 0, 0, time.time()
        try:
            with os.scandir(root_fd) as it:
                names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
            for sub in names:
                try:
                    subs[sub] = sub_fd = os.open(sub, _DIR_FLAGS, dir_fd=root_fd)
                except OSError:  # replaced by a link meanwhile, or gone
                    continue
                with os.scandir(sub_fd) as it:
                    for e in it:
                        try:
                            if not e.is_file(follow_symlinks=False):
                                continue
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if e.name.startswith(".tmp-"):
                            if now - st.st_mtime > _STALE_TMP_S:
                                _unlink_at(sub_fd, e.name)
                            continue
                        entries.append((st.st_mtime, sub, e.name, st.st_size))
                        total += st.st_size
            entries.sort()
            for _, sub, name, size in entries:
                if total <= self.max_bytes:
                    break
                if _unlink_at(subs[sub], name):
                    evicted += 1
                total -= size
        finally:
            for fd in subs.values():
                os.close(fd)
            os.close(root_fd)
        if evicted:
            _count(cache_evictions=evicted)
        return total


def _unlink_at(dir_fd: int, name: str, expect: os.stat_result | None = None) -> bool:
    """Delete the entry ``name`` of the folder ``dir_fd`` (a link itself, never its target); with
    ``expect``, only if it is still that file (not a good block another process just put there)."""
    try:
        if expect is not None:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (now.st_ino, now.st_dev) != (expect.st_ino, expect.st_dev):
                return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _version(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "generation", "version_id", "VersionId", "LastModified", "last_modified",
                "mtime", "updated"):
        if info.get(key):
            return str(info[key])
    return ""


# -- the wrapper -----------------------------------------------------------------------------------------
class RetryingFileSystem:
    """An object-store filesystem whose reads are ranged, retried, verified and optionally cached.

    Provides what the work plan and the readers use (``glob``, ``find``, ``isdir``, ``isfile``, ``exists``,
    ``info``, ``size``, ``open``, ``cat_file``); paths in and out are URLs. Anything else is
    forwarded to the underlying fsspec filesystem as it is (without retries).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, scheme: str, source: str, storage: StorageSpec) -> None:
        self.fs = fs
        self.scheme = scheme
        self.source = source
        self.storage = storage
        self.cache = BlockCache(storage.cache_dir, storage.cache_max_bytes) if storage.cache_dir else None
        self._infos: dict[str, dict] = {}
        self._lock = threading.Lock()

    @property
    def protocol(self) -> Any:
        return self.fs.protocol

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("fs", "_lock", "_infos"):  # not forwarded (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.fs, name)

    def url(self, path: str) -> str:
        """The URL of a path returned by the underlying filesystem (which drops the scheme)."""
        return path if "://" in path else f"{self.scheme}://{path.lstrip('/')}"

    def _retry(self, fn: Callable[[], Any], url: str, what: str, missing_ok: bool = False) -> Any:
        return call_with_retries(fn, url, what, self.source, self.storage.retries, self.storage.retry_backoff_s,
                                 missing_ok)

    # -- metadata --------------------------------------------------------------------------------------
    def _remember(self, found: Mapping[str, Mapping[str, Any]]) -> list[str]:
        urls = []
        with self._lock:
            for path, info in found.items():
                url = self.url(path)
                self._infos[url] = dict(info)
                urls.append(url)
        return sorted(urls)

    def info(self, path: str) -> dict:
        url = self.url(path)
        with self._lock:
            if url in self._infos:
                return self._infos[url]
        info = self._retry(lambda: self.fs.info(url), url, "stat")
        with self._lock:
            self._infos[url] = info
        return info

    def _kind(self, path: str) -> str | None:
        url = self.url(path)
        with self._lock:
            if url in self._infos:
                return self._infos[url].get("type")
        info = self._retry(lambda: self.fs.info(url), url, "stat", missing_ok=True)
        if info is None:
            return None
        with self._lock:
            self._infos[url] = info
        return info.get("type")

    def isfile(self, path: str) -> bool:
        return self._kind(path) == "file"

    def isdir(self, path: str) -> bool:
        return self._kind(path) == "directory"

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._kind(path) is not None

    def size(self, path: str) -> int:
        return int(self.info(path)["size"])

    def glob(self, pattern: str, **kwargs: Any) -> list[str]:
        url = self.url(pattern)
        found = self._retry(lambda: self.fs.glob(url, detail=True, **kwargs), url, "list")
        return self._remember(found)

    def find(self, path: str, **kwargs: Any) -> list[str]:
        url = self.url(path)
        found = self._retry(lambda: self.fs.find(url, detail=True, **kwargs), url, "list")
        return self._remember({p: i for p, i in found.items() if i.get("type", "file") == "file"})

    # -- data --------------------------------------------------------------------------------------------
    def _fetch(self, url: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object, in one ranged request, retried until complete."""
        def get() -> bytes:
            data = self.fs.cat_file(url, start=start, end=end)
            _count(requests=1, bytes_fetched=len(data))
            if len(data) != end - start:
                raise _ShortRead(f"asked for bytes [{start}, {end}), got {len(data)}")
            return data
        return self._retry(get, url, f"reading bytes [{start}, {end}) of")

    def read_range(self, url: str, start: int, end: int, size: int, version: str) -> bytes:
        """Bytes [start, end) of an object of ``size`` bytes, through the cache when there is one (a cached
        block is used only once its checksum verifies; any other block is fetched and cached again)."""
        if end <= start:
            return b""
        if self.cache is None:
            return self._fetch(url, start, end)
        bsz = self.storage.cache_block_bytes
        key = hashlib.sha256(f"{url}\n{size}\n{version}\n{bsz}".encode()).hexdigest()[:40]
        first, last = start // bsz, (end - 1) // bsz
        blocks: dict[int, bytes] = {}
        missing: list[int] = []
        for b in range(first, last + 1):
            data = self.cache.get(key, b, min(size, (b + 1) * bsz) - b * bsz)
            if data is None:
                missing.append(b)
            else:
                blocks[b] = data
        _count(cache_hits=len(blocks), cache_misses=len(missing))
        runs: list[list[int]] = []
        for b in missing:  # consecutive missing blocks: one request
            if runs and runs[-1][-1] == b - 1:
                runs[-1].append(b)
            else:
                runs.append([b])
        for run in runs:
            lo, hi = run[0] * bsz, min(size, (run[-1] + 1) * bsz)
            data = self._fetch(url, lo, hi)
            for b in run:
                piece = data[b * bsz - lo: min(size, (b + 1) * bsz) - lo]
                self.cache.put(key, b, piece)
                blocks[b] = piece
        joined = b"".join(blocks[b] for b in range(first, last + 1))
        offset = start - first * bsz
        return joined[offset: offset + end - start]

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        info = self.info(path)
        size = int(info["size"])
        lo = 0 if start is None else (start + size if start < 0 else start)
        hi = size if end is None else (end + size if end < 0 else min(end, size))
        return self.read_range(self.url(path), max(0, lo), hi, size, _version(info))

    def open(self, path: str, mode: str = "rb", block_size: int | None = None, compression: str | None = None,
             **kwargs: Any) -> Any:
        if mode != "rb":
            return self.fs.open(self.url(path), mode, **kwargs)  # writes are not Zephon's business
        info = self.info(path)
        if info.get("type", "file") != "file":
            raise StoreError(f"source '{self.source}': {self.url(path)} is a directory, not an object.")
        f = RemoteFile(self, self.url(path), int(info["size"]), _version(info),
                       DEFAULT_READAHEAD if block_size is None else block_size)
        if compression == "infer":
            compression = fsspec.utils.infer_compression(path)
        if compression:  # a compressed stream is read whole: one request, then decompressed in memory
            from fsspec.compression import compr

            return compr[compression](io.BytesIO(f.read()), mode="rb")
        return f

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class RemoteFile(io.RawIOBase):
    """A read-only, seekable view of one object: each read that its buffer cannot serve is one ranged
    request of at least ``readahead`` bytes (pyarrow's Parquet reads map onto footer and column-chunk
    ranges). Not shared between threads (the readers keep one per thread)."""

    def __init__(self, store: RetryingFileSystem, url: str, size: int, version: str, readahead: int) -> None:
        super().__init__()
        self._store, self.url, self._size, self._version = store, url, size, version
        self._readahead = max(0, readahead)
        self._pos = 0
        self._buf_start, self._buf = 0, b""

    @property
    def name(self) -> str:
        return self.url

    @property
    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset} in {self.url}")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.url}")
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        b0, b1 = self._buf_start, self._buf_start + len(self._buf)
        if not (b0 <= self._pos and end <= b1):
            hi = min(self._size, max(end, self._pos + self._readahead))
            self._buf = self._store.read_range(self.url, self._pos, hi, self._size, self._version)
            self._buf_start = b0 = self._pos
        data = self._buf[self._pos - b0: end - b0]
        self._pos = end
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._buf = b""
        super().close()


__all__ = ["BlockCache", "RemoteFile", "RetryingFileSystem", "StoreError", "call_with_retries", "classify",
           "expand_env", "scheme_of", "stats", "url_to_fs"]

