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

from .cache import BlockCache
from .errors import DENIED, MISSING, PERMANENT, TRANSIENT, StoreError, _ShortRead, classify  # noqa: F401 (_ShortRead: tests)
from .filesystem import (DEFAULT_READAHEAD, LOCAL_PROTOCOLS, RemoteFile, RetryingFileSystem, expand_env, scheme_of,
                         url_to_fs)
from .retry import backoff_delay, call_with_retries
from .stats import stats

__all__ = ["BlockCache", "DEFAULT_READAHEAD", "DENIED", "LOCAL_PROTOCOLS", "MISSING", "PERMANENT", "RemoteFile",
           "RetryingFileSystem", "StoreError", "TRANSIENT", "backoff_delay", "call_with_retries", "classify", "expand_env",
           "scheme_of", "stats", "url_to_fs"]
