"""When a failed request to the store is tried again: exponential backoff with full
jitter (a pause drawn from ``[0, min(cap, base * 2**n)]``, as AWS's SDKs do), for at most
``attempts`` tries and ``deadline_s`` seconds from the first, whichever ends first.

What is retried: throttling (503 SlowDown, 429), other 5xx, a connection refused or
reset, a body cut short (truncated, or its size or checksum wrong). What is not: a
missing object (404), refused credentials (403), a changed object (412), any other
4xx; those are the caller's to report, at once.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import obstore.exceptions as oe

from pinfeed_server.remote.errors import AccessDenied, ObjectChanged, ObjectMissing, RemoteError

_STATUS = re.compile(r"status code: (\d{3})")


@dataclass(frozen=True)
class Backoff:
    attempts: int = 10
    base_s: float = 0.1
    cap_s: float = 5.0
    deadline_s: float = 60.0

    def pauses(self) -> Iterator[float]:
        """The pause before each retry; stops when the budget is spent. A pause that
        would end past the deadline ends at it: the last try is made then (an outage
        shorter than the deadline is waited out, whatever the draws)."""
        start = time.monotonic()
        for n in range(self.attempts - 1):
            left = self.deadline_s - (time.monotonic() - start)
            if left <= 0:
                return
            yield min(left, random.uniform(0, min(self.cap_s, self.base_s * 2**n)))


def final(exc: BaseException, what: str, dataset: str) -> RemoteError | None:
    """The error to report at once for ``exc`` (None: try again). ``what``: the object
    (its URL), ``dataset``: the dataset that reads it, both named in the message."""
    if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
        return ObjectMissing(f"{what} (dataset {dataset}): no such object in the store")
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        return AccessDenied(
            f"{what} (dataset {dataset}): the store refused the server's credentials "
            "(403). The pinfeed server reads them from the standard AWS chain: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or "
            "AWS_PROFILE, in the server's environment, for an identity allowed "
            "s3:GetObject and s3:ListBucket on it"
        )
    if isinstance(exc, oe.PreconditionError):
        return ObjectChanged(
            f"{what} (dataset {dataset}) was replaced in the store since the dataset was "
            "registered (its ETag changed); the batches would mix two versions, so it is "
            "not read: register the dataset again to read the new version"
        )
    if isinstance(exc, oe.GenericError):
        m = _STATUS.search(str(exc))
        if m is not None:
            code = int(m.group(1))
            if 400 <= code < 500 and code not in (408, 429):
                return RemoteError(f"{what} (dataset {dataset}): the store answered {code}")
        return None
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return None
    if isinstance(exc, oe.BaseError):
        return RemoteError(f"{what} (dataset {dataset}): {type(exc).__name__}")
    return None
