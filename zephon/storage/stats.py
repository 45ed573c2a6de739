"""This process's object-store counters (requests, bytes, retries, cache hits, misses, evictions, corrupt blocks)."""

from __future__ import annotations

import threading

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
