"""What can go wrong reading a store, as exceptions that say what to do.

They are domain errors (``pinfeed_server.errors``): at registration the datasets layer
says them as a ``DatasetError`` (a 422 naming the object and what to set); one that
leaves elsewhere (a DESCRIBE) is its problem, a store that does not answer a 503; in a
batch they are the batch's error, with the same words.
No message carries a credential: ``redact`` scrubs the values of the AWS variables from
any text that came from the client library before it goes into one.
"""

from __future__ import annotations

import os

from pinfeed.errors import NotReady
from pinfeed_server.errors import DomainError

SECRET_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)


class RemoteError(DomainError):
    """A read from the object store failed; the message says which object and why."""


class NotAllowed(RemoteError):
    """The URL is outside PINFEED_REMOTE_ALLOW."""


class ObjectMissing(RemoteError):
    """No such object (or no object under a prefix)."""


class AccessDenied(RemoteError):
    """The store refused the server's credentials (403)."""


class ObjectChanged(RemoteError):
    """The object's ETag is not the one the dataset was registered with."""


class StoreUnavailable(RemoteError):
    """The store did not answer, or kept failing, past the retry budget."""

    problem = NotReady


class Corrupt(RemoteError):
    """An object's bytes did not match its size or checksum (after every retry)."""


def redact(text: str) -> str:
    """``text`` without the value of any credential variable of this process."""
    for name in SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "<redacted>")
    return text


def first_line(exc: BaseException) -> str:
    """An exception of the client library as one redacted line (obstore's messages
    carry a multi-line debug dump after the first)."""
    return redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
