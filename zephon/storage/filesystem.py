"""Object-store filesystems: built from a source's storage_options, ranged, retried, verified, cached."""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
from typing import Any, Callable, Mapping

import fsspec

from ..errors import SourceError
from ..specs import SourceSpec, StorageSpec
from .cache import BlockCache
from .errors import StoreError, _describe, _ShortRead
from .retry import call_with_retries
from .stats import _count

LOCAL_PROTOCOLS = {"file", "local"}
DEFAULT_READAHEAD = 64 << 10  # bytes a RemoteFile fetches at least per request (a small sequential read-ahead)


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
        return self._info(path)

    def _info(self, path: str, missing_ok: bool = False) -> dict | None:
        url = self.url(path)
        with self._lock:
            if url in self._infos:
                return self._infos[url]
        info = self._retry(lambda: self.fs.info(url), url, "stat", missing_ok)
        if info is not None:
            with self._lock:
                self._infos[url] = info
        return info

    def _kind(self, path: str) -> str | None:
        info = self._info(path, missing_ok=True)
        return None if info is None else info.get("type")

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
