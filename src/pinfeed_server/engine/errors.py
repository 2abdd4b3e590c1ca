"""The data plane's exception tree: what the engine raises for a consumer to hear.

Each class carries its wire slug (``pinfeed.protocol.ERROR_KINDS``, which says
whether it ends the connection) and builds its ERROR in one place, ``info()``. The
client raises the matching ``pinfeed`` exception (``pinfeed.errors.DATA_PLANE_ERRORS``).
HTTP errors are ``pinfeed_server.errors``; this module imports neither FastAPI nor
torch, so worker processes import it cheaply.

    DataPlaneError
    ├── ProtocolError       protocol-error      a malformed or unexpected message
    ├── LoaderNotFound      loader-not-found    ATTACH names no loader
    ├── LoaderBusy          loader-busy         every consumer slot is attached
    ├── LoaderFailed        loader-failed       the loader could not start
    ├── LoaderStopping      server-unavailable  the loader was deleted, or the server stops
    ├── InvalidPosition     invalid-position    SEEK or member index out of range
    ├── GroupMemberLost     group-member-lost   a group member stayed away too long
    └── SampleError         sample-error        the dataset raised for a batch
        └── BatchTooLarge   batch-too-large     a batch does not fit its slot
"""

from __future__ import annotations

import traceback
from typing import Any, ClassVar

from pinfeed.protocol import ErrorInfo


class DataPlaneError(Exception):
    slug: ClassVar[str]

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    def info(self) -> ErrorInfo:
        """This error as an ERROR message's payload."""
        return ErrorInfo.of(self.slug, self.detail, **self.extra)


class ProtocolError(DataPlaneError):
    slug = "protocol-error"


class LoaderNotFound(DataPlaneError):
    slug = "loader-not-found"

    def __init__(self, name: str) -> None:
        super().__init__(f"no loader named {name!r}; create it with POST /v1/loaders")


class LoaderBusy(DataPlaneError):
    slug = "loader-busy"


class LoaderFailed(DataPlaneError):
    slug = "loader-failed"


class LoaderStopping(DataPlaneError):
    slug = "server-unavailable"


class InvalidPosition(DataPlaneError):
    slug = "invalid-position"


class GroupMemberLost(DataPlaneError):
    slug = "group-member-lost"


class SampleError(DataPlaneError):
    """``index``: the sample that failed, if known; ``error_type``: the original
    exception's class name; ``where``: the end of its traceback."""

    slug = "sample-error"

    def __init__(
        self, detail: str, *, index: int | None, error_type: str, where: str | None = None
    ) -> None:
        extra: dict[str, Any] = {"index": index, "error_type": error_type}
        if where is not None:
            extra["where"] = where
        super().__init__(detail, **extra)


class BatchTooLarge(SampleError):
    slug = "batch-too-large"


def _tree(cls: type[DataPlaneError]) -> list[type[DataPlaneError]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_tree(sub))]


DATA_PLANE_ERRORS: tuple[type[DataPlaneError], ...] = tuple(_tree(DataPlaneError))


def error_info(exc: BaseException) -> ErrorInfo:
    """A batch's failure as the consumer will hear it: a typed error as it is; anything
    else a dataset raised as a sample-error naming its type and where it happened."""
    if isinstance(exc, DataPlaneError):
        return exc.info()
    return SampleError(
        f"{type(exc).__name__}: {exc}",
        index=None,
        error_type=type(exc).__name__,
        where=traceback.format_exc(limit=-3),
    ).info()
