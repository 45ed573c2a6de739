"""Retries that cannot change the output: exponential backoff with jitter around a pure request."""

from __future__ import annotations

import random
import time
from typing import Any, Callable

from ..errors import SourceError
from .errors import DENIED, MISSING, PERMANENT, StoreError, _describe, classify
from .stats import _count

_MAX_BACKOFF_S = 30.0
_JITTER = random.Random()  # timing only: never used for anything that reaches a batch


# -- retries -----------------------------------------------------------------------------------------
def backoff_delay(attempt: int, base_s: float) -> float:
    """Exponential backoff with jitter: ``base * 2**attempt`` times a factor in [0.5, 1.5), capped."""
    return min(_MAX_BACKOFF_S, base_s * (2 ** attempt)) * (0.5 + _JITTER.random())


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
