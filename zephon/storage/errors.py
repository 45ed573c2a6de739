"""Object-store errors: which are transient (retried) and which stop at once, with a message that says why."""

from __future__ import annotations

import errno
from typing import Mapping

from ..errors import SourceError


class StoreError(SourceError):
    """An object-store request that failed for good; the message names the URL and the fix."""


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


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
