"""The client's exception tree.

Every HTTP problem+json ``type`` and every data-plane error maps back to one class
here, so a script can ``except pinfeed.NotFound`` whether the error came over HTTP
or over the Unix socket.

    PinfeedError
    ├── ProblemError            an HTTP problem+json response (status, type, detail)
    │   ├── InvalidRequest      422: the request body or a parameter is wrong
    │   ├── Unauthorized        401: a bearer token is required or wrong
    │   ├── NotFound            404: no such dataset, loader or route
    │   ├── MethodNotAllowed    405: the route does not take this method
    │   ├── Conflict            409: exists already, or still in use
    │   │   └── WorkerLimit     409: more worker processes than the server's PINFEED_MAX_WORKERS
    │   ├── PayloadTooLarge     413: the body exceeds the server's PINFEED_MAX_BODY_BYTES
    │   ├── UnsupportedMediaType 415: the body is not application/json
    │   ├── InternalError       500: a bug in the server (details in its log)
    │   ├── NotReady            503: /readyz while a loader is still starting
    │   ├── Overloaded          503: the server's control plane is at PINFEED_HTTP_MAX_RPS
    │   └── InsufficientMemory  507: the ring would exceed the memory budget
    ├── ServerUnavailable       cannot reach the server, or it went away (HTTP or socket)
    └── DataPlaneError          errors on the Unix socket (``pinfeed.protocol.ERROR_KINDS``)
        ├── ProtocolError       a message the other side did not expect (a bug, or
        │                       client and server of different versions)
        ├── LoaderNotFound      no loader of that name (also a NotFound)
        ├── InvalidPosition     a seek or member index out of range (also an InvalidRequest)
        ├── LoaderBusy          another consumer is attached to this loader
        ├── LoaderFailed        the loader could not start (bad dataset, layout)
        ├── SampleError         a sample raised in the dataset (carries the index)
        ├── BatchTooLarge       a batch does not fit its ring slot
        └── GroupMemberLost     a consumer-group member stayed away past group_timeout_s

A data-plane error that stands in for a batch carries ``epoch`` and ``batch_index``
in ``extra``; ``DATA_PLANE_ERRORS`` maps every slug the server sends to its class.
"""

from __future__ import annotations

from typing import Any

from pinfeed.protocol import ErrorInfo

PROBLEM_PREFIX = "urn:pinfeed:problem:"


class PinfeedError(Exception):
    """Base class of every pinfeed error."""

    slug = "error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    @property
    def type(self) -> str:
        return PROBLEM_PREFIX + self.slug


class ProblemError(PinfeedError):
    """An HTTP problem+json response."""

    slug = "error"
    status = 500


class InvalidRequest(ProblemError):
    slug = "invalid-request"
    status = 422


class Unauthorized(ProblemError):
    slug = "unauthorized"
    status = 401


class NotFound(ProblemError):
    slug = "not-found"
    status = 404


class MethodNotAllowed(ProblemError):
    slug = "method-not-allowed"
    status = 405


class Conflict(ProblemError):
    slug = "conflict"
    status = 409


class WorkerLimit(Conflict):
    slug = "worker-limit"


class PayloadTooLarge(ProblemError):
    slug = "payload-too-large"
    status = 413


class UnsupportedMediaType(ProblemError):
    slug = "unsupported-media-type"
    status = 415


class InternalError(ProblemError):
    slug = "internal"
    status = 500


class NotReady(ProblemError):
    slug = "not-ready"
    status = 503


class Overloaded(ProblemError):
    slug = "overloaded"
    status = 503


class InsufficientMemory(ProblemError):
    """``need_bytes``: the ring the loader asked for; ``free_bytes``: what the budget has left."""

    slug = "insufficient-memory"
    status = 507

    @property
    def need_bytes(self) -> int | None:
        value = self.extra.get("need_bytes")
        return int(value) if value is not None else None

    @property
    def free_bytes(self) -> int | None:
        value = self.extra.get("free_bytes")
        return int(value) if value is not None else None


class DataPlaneError(PinfeedError):
    """An error on the data-plane Unix socket."""

    slug = "data-plane"


class ServerUnavailable(PinfeedError):
    """The server cannot be reached (HTTP or socket), or it closed the connection."""

    slug = "server-unavailable"


class ProtocolError(DataPlaneError):
    slug = "protocol-error"


class LoaderNotFound(DataPlaneError, NotFound):
    """No loader of that name on the socket's server; ``except NotFound`` catches it too."""

    slug = "loader-not-found"


class InvalidPosition(DataPlaneError, InvalidRequest):
    """A seek (set_epoch, load_state_dict) or group member index outside the loader's range."""

    slug = "invalid-position"


class LoaderBusy(DataPlaneError):
    slug = "loader-busy"


class LoaderFailed(DataPlaneError):
    slug = "loader-failed"


class SampleError(DataPlaneError):
    """A sample raised in the dataset; ``index`` names it, ``error_type`` the original."""

    slug = "sample-error"

    @property
    def index(self) -> int | None:
        value = self.extra.get("index")
        return int(value) if value is not None else None

    @property
    def error_type(self) -> str:
        return str(self.extra.get("error_type", ""))


class BatchTooLarge(DataPlaneError):
    slug = "batch-too-large"


class GroupMemberLost(DataPlaneError):
    """A consumer-group member has been gone longer than the loader's group_timeout_s."""

    slug = "group-member-lost"


def _all_subclasses(cls: type[PinfeedError]) -> list[type[PinfeedError]]:
    out: list[type[PinfeedError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_BY_SLUG: dict[str, type[PinfeedError]] = {c.slug: c for c in _all_subclasses(PinfeedError)}


DATA_PLANE_ERRORS: dict[str, type[PinfeedError]] = {
    c.slug: c
    for c in (
        ProtocolError,
        LoaderNotFound,
        LoaderBusy,
        LoaderFailed,
        ServerUnavailable,
        InvalidPosition,
        SampleError,
        BatchTooLarge,
        GroupMemberLost,
    )
}


def error_from_info(info: ErrorInfo) -> PinfeedError:
    """The typed exception for a data-plane ERROR (unknown slugs: DataPlaneError)."""
    extra = dict(info.extra)
    if info.batch_index is not None:
        extra |= {"epoch": info.epoch, "batch_index": info.batch_index}
    return DATA_PLANE_ERRORS.get(info.slug, DataPlaneError)(info.detail, **extra)


def error_from_slug(slug: str, detail: str, **extra: Any) -> PinfeedError:
    """Rebuild the typed exception for a problem ``type`` (or a bare slug)."""
    if slug.startswith(PROBLEM_PREFIX):
        slug = slug[len(PROBLEM_PREFIX) :]
    cls = _BY_SLUG.get(slug, PinfeedError)
    return cls(detail, **extra)
