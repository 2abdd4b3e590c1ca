"""pinfeed's one exception tree, raised by the server and by the trainer library alike.

The server imports these very classes and raises them; the client rebuilds the same
class from what arrives: a problem+json ``type`` (``error_from_slug``) or a data-plane
ERROR (``error_from_info``). So a script can ``except pinfeed.NotFound`` whether the
error came over HTTP or over the Unix socket, and the two sides cannot disagree.

Each class declares its ``slug`` (the problem ``type`` is ``urn:pinfeed:problem:<slug>``,
the ERROR's ``type`` the bare slug); an HTTP problem its ``status`` and ``title``; an
error the data plane sends whether the server closes the connection after it
(``fatal``; ``None``: never sent there). Every class is built as ``Cls(detail, **extra)``:
``extra`` travels as the problem's extra members or the ERROR's extra keys, and typed
accessors read it::

    class                        slug                    HTTP  fatal
    PinfeedError                 error                               the base of all
    ├── ProblemError             http-error              (any)       a problem of no other type
    │   ├── InvalidRequest       invalid-request         422   yes   a bad body or parameter (on
    │   │                                                              the socket: a bad CREATE)
    │   ├── Unauthorized         unauthorized            401         no or a wrong bearer token
    │   ├── NotFound             not-found               404         no such dataset, loader, route
    │   ├── MethodNotAllowed     method-not-allowed      405         the route has no such method
    │   ├── Conflict             conflict                409   yes   exists, or still in use
    │   │   └── WorkerLimit      worker-limit            409   yes   over PINFEED_MAX_WORKERS
    │   ├── PayloadTooLarge      payload-too-large       413         over PINFEED_MAX_BODY_BYTES
    │   ├── UnsupportedMediaType unsupported-media-type  415         not application/json
    │   ├── InternalError        internal                500         a bug (see the server's log)
    │   ├── NotReady             not-ready               503         /readyz: a loader is starting
    │   ├── Overloaded           overloaded              503         at PINFEED_HTTP_MAX_RPS
    │   └── InsufficientMemory   insufficient-memory     507   yes   over PINFEED_MAX_SHM_BYTES
    ├── Unshippable              unshippable                         pinfeed.DataLoader cannot
    │                                                                  send an object (trainer only)
    ├── ServerUnavailable        server-unavailable            yes   unreachable or gone; the
    │                                                                  loader deleted or stopping
    └── DataPlaneError           data-plane                          an error on the Unix socket
        ├── ProtocolError        protocol-error                yes   an unexpected message (a bug,
        │                                                              or another protocol version)
        ├── LoaderNotFound       loader-not-found        404   yes   ATTACH: no such loader
        │                                                              (also a NotFound)
        ├── InvalidPosition      invalid-position        422   no    SEEK or member out of range
        │                                                              (also an InvalidRequest)
        ├── InvalidState         invalid-state           422   no    a state that does not fit
        │                                                              the loader (a ValueError)
        ├── LoaderBusy           loader-busy                   yes   every consumer is attached
        ├── LoaderFailed         loader-failed                 yes   the loader could not start
        ├── GroupMemberLost      group-member-lost             no    a member away past
        │                                                              group_timeout_s
        └── SampleError          sample-error                  no    the dataset raised for a batch
            └── BatchTooLarge    batch-too-large               no    a batch does not fit its slot

``BatchTooLarge`` is a ``SampleError``: like a sample that raised, it is one batch's
failure, the loader's ``on_error`` applies to it and the loader goes on with the next
batch, so ``except SampleError`` is the one clause a trainer needs for bad batches.

A data-plane error that stands in for a batch carries ``epoch`` and ``batch_index`` in
``extra``. This module imports only ``pinfeed.protocol`` (no torch, no FastAPI), so the
server's worker processes and its HTTP layer import it alike.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
from typing import Any, ClassVar

from pinfeed.protocol import ErrorInfo

PROBLEM_PREFIX = "urn:pinfeed:problem:"


class PinfeedError(Exception):
    """Base class of every pinfeed error."""

    slug: ClassVar[str] = "error"
    # Whether the server closes the data-plane connection after sending this error;
    # None: the data plane never sends it.
    fatal: ClassVar[bool | None] = None

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    @property
    def type(self) -> str:
        return PROBLEM_PREFIX + self.slug

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by slug (a SampleError joined with the dataset's own exception class
        is made anew where it is loaded): it crosses processes as DataLoader's errors do
        (a test's child process sends its exception to its parent)."""
        return _rebuilt, (self.slug, self.detail, self.extra)

    def info(self) -> ErrorInfo:
        """This error as a data-plane ERROR's payload (``epoch``/``batch_index`` of
        ``extra``, if any, in their own fields)."""
        if self.fatal is None:
            raise TypeError(
                f"{type(self).__name__} is never sent on the data plane: send a class that "
                "declares fatal (a DataPlaneError, or ServerUnavailable)"
            )
        extra = dict(self.extra)
        if extra.get("batch_index") is None:
            return ErrorInfo(self.slug, self.detail, self.fatal, extra=extra)
        epoch, index = int(extra.pop("epoch", 0)), int(extra.pop("batch_index"))
        return ErrorInfo(self.slug, self.detail, self.fatal, epoch, index, extra)

    def _int(self, key: str) -> int | None:
        value = self.extra.get(key)
        return int(value) if value is not None else None


# -- HTTP problems (RFC 9457) -----------------------------------------------------------
class ProblemError(PinfeedError):
    """An HTTP problem+json response of a status no other class names; the base of
    every problem, ``status`` is the response's."""

    slug = "http-error"
    status: int = 500  # the client sets the status it received
    title: ClassVar[str] = "HTTP error"


class InvalidRequest(ProblemError):
    """The body or a parameter is invalid, the JSON is malformed, a dataset's params are
    wrong, a file is missing or outside the data root (``extra["errors"]``: the schema's
    complaints, each ``loc``, ``msg``, ``type``); on the data plane, a
    ``pinfeed.DataLoader``'s loader refused."""

    slug = "invalid-request"
    status = 422
    title = "Invalid request"
    fatal = True  # on the data plane: a CREATE refused (pinfeed.DataLoader)


class Unauthorized(ProblemError):
    """``PINFEED_TOKEN`` is set and a mutating request lacks ``Authorization: Bearer
    <token>`` (the response says ``WWW-Authenticate: Bearer``)."""

    slug = "unauthorized"
    status = 401
    title = "Unauthorized"


class NotFound(ProblemError):
    """No such dataset, loader or route."""

    slug = "not-found"
    status = 404
    title = "Not found"


class MethodNotAllowed(ProblemError):
    """The route does not take this method (``Allow`` lists those it takes)."""

    slug = "method-not-allowed"
    status = 405
    title = "Method not allowed"


class Conflict(ProblemError):
    """The name exists; the dataset is used by a loader; an IterableDataset's loader asked
    to switch live between 0 and more workers; on the data plane, a named loader that
    already runs another configuration."""

    slug = "conflict"
    status = 409
    title = "Conflict"
    fatal = True  # on the data plane: a named loader already runs another config


class WorkerLimit(Conflict):
    """The loader's workers, with the other loaders' workers, would exceed
    ``PINFEED_MAX_WORKERS`` (at creation or a PATCH): ``max_workers`` is that setting,
    ``free_workers`` what the other loaders leave of it."""

    slug = "worker-limit"
    title = "Worker limit reached"

    @property
    def max_workers(self) -> int | None:
        return self._int("max_workers")

    @property
    def free_workers(self) -> int | None:
        return self._int("free_workers")


class PayloadTooLarge(ProblemError):
    """The body exceeds ``PINFEED_MAX_BODY_BYTES``."""

    slug = "payload-too-large"
    status = 413
    title = "Payload too large"


class UnsupportedMediaType(ProblemError):
    """The body is not ``application/json``."""

    slug = "unsupported-media-type"
    status = 415
    title = "Unsupported media type"


class InternalError(ProblemError):
    """A bug: the server's log has the details (no stack trace leaves the server)."""

    slug = "internal"
    status = 500
    title = "Internal error"


class NotReady(ProblemError):
    """``/readyz`` while a loader is still starting (``extra["loaders"]`` names them)."""

    slug = "not-ready"
    status = 503
    title = "Not ready"


class Overloaded(ProblemError):
    """The control plane serves this client ``PINFEED_HTTP_MAX_RPS`` requests a second
    and this one would wait over 5 s for its turn (``Retry-After: 1``)."""

    slug = "overloaded"
    status = 503
    title = "Overloaded"


class InsufficientMemory(ProblemError):
    """The loader's ring (or a dataset's cache) would exceed the free part of
    ``PINFEED_MAX_SHM_BYTES``: ``need_bytes`` is what it asked for, ``free_bytes`` what
    the budget has left."""

    slug = "insufficient-memory"
    status = 507
    title = "Insufficient memory"
    fatal = True  # on the data plane: a CREATE over the node's budget

    @property
    def need_bytes(self) -> int | None:
        return self._int("need_bytes")

    @property
    def free_bytes(self) -> int | None:
        return self._int("free_bytes")


# -- the trainer alone ---------------------------------------------------------------------
class Unshippable(PinfeedError, TypeError):
    """``pinfeed.DataLoader`` cannot send one of the script's objects to the server (an
    open file, a socket, a generator, a CUDA tensor); ``path`` names it (``dataset.fh``).
    Raised in the trainer, never sent."""

    slug = "unshippable"

    @property
    def path(self) -> str:
        return str(self.extra.get("path", ""))


# -- either plane ------------------------------------------------------------------------
class ServerUnavailable(PinfeedError):
    """The server cannot be reached (HTTP or socket), it closed the connection, or (sent
    on the data plane) the loader was deleted or the server is stopping."""

    slug = "server-unavailable"
    fatal = True


# -- the data plane ----------------------------------------------------------------------
class DataPlaneError(PinfeedError):
    """An error on the data-plane Unix socket (the base: an unknown slug arrives as one)."""

    slug = "data-plane"


class ProtocolError(DataPlaneError):
    """An unexpected message on the data plane: a bug, or a trainer and a server of
    different protocol versions."""

    slug = "protocol-error"
    fatal = True


class LoaderNotFound(DataPlaneError, NotFound):
    """No loader of that name on the socket's server; ``except NotFound`` catches it too."""

    slug = "loader-not-found"
    fatal = True


class InvalidPosition(DataPlaneError, InvalidRequest):
    """A seek (set_epoch, load_state_dict) or group member index outside the loader's
    range; ``except InvalidRequest`` catches it too. The connection goes on."""

    slug = "invalid-position"
    fatal = False


class InvalidState(DataPlaneError, InvalidRequest, ValueError):
    """A ``load_state_dict`` (or ``merge_states``) state that does not fit: another plan
    (dataset length, shuffle, seed, drop_last), another rank's, or the ranks of no one
    run; ``except ValueError`` catches it too. The connection goes on."""

    slug = "invalid-state"
    fatal = False


class LoaderBusy(DataPlaneError):
    """Every consumer the loader has is attached already (one trainer, or
    ``group_size`` members)."""

    slug = "loader-busy"
    fatal = True


class LoaderFailed(DataPlaneError):
    """The loader could not start (its file is gone, the budget shrank before a
    restart): ``GET /v1/loaders/{name}`` says why."""

    slug = "loader-failed"
    fatal = True


class GroupMemberLost(DataPlaneError):
    """A consumer-group member has been gone longer than the loader's group_timeout_s."""

    slug = "group-member-lost"
    fatal = False


class SampleError(DataPlaneError):
    """The dataset raised for a batch, which the error stands in for: ``index`` names the
    sample (None: not known), ``error_type`` the original exception's class, ``where``
    the end of its traceback, ``epoch``/``batch_index`` the batch."""

    slug = "sample-error"
    fatal = False

    @property
    def index(self) -> int | None:
        return self._int("index")

    @property
    def error_type(self) -> str:
        return str(self.extra.get("error_type", ""))

    @property
    def where(self) -> str | None:
        value = self.extra.get("where")
        return str(value) if value is not None else None

    @property
    def epoch(self) -> int | None:
        return self._int("epoch")

    @property
    def batch_index(self) -> int | None:
        return self._int("batch_index")


class BatchTooLarge(SampleError):
    """A batch does not fit its ring slot (the detail names the setting to raise)."""

    slug = "batch-too-large"


# -- slug -> class -------------------------------------------------------------------------
def _tree(cls: type[PinfeedError]) -> list[type[PinfeedError]]:
    """``cls`` and its subclasses in the docstring's order: each under its first base
    (``LoaderNotFound`` under ``DataPlaneError``, not ``NotFound``), so each once."""
    subs = (c for c in cls.__subclasses__() if c.__bases__[0] is cls)
    return [cls, *(c for sub in subs for c in _tree(sub))]


ERRORS: tuple[type[PinfeedError], ...] = tuple(_tree(PinfeedError))
"""Every class of the tree, as the module docstring lists them: a base before its
subclasses (tests/test_error_tree.py holds it to that)."""

_BY_SLUG: dict[str, type[PinfeedError]] = {c.slug: c for c in ERRORS}

DATA_PLANE_ERRORS: dict[str, type[PinfeedError]] = {
    c.slug: c for c in ERRORS if c.fatal is not None
}
"""Every slug the server sends on the data plane, and its class."""


def error_from_info(info: ErrorInfo) -> PinfeedError:
    """The typed exception for a data-plane ERROR (unknown slugs: DataPlaneError). A
    sample error is also an instance of the exception the dataset raised, where the
    trainer has that class (``except ValueError`` catches it, as it catches DataLoader's
    re-raise), besides ``SampleError``."""
    extra = dict(info.extra)
    if info.batch_index is not None:
        extra |= {"epoch": info.epoch, "batch_index": info.batch_index}
    cls = DATA_PLANE_ERRORS.get(info.slug, DataPlaneError)
    if cls is SampleError:
        cls = _as_raised(extra.get("error_module"), extra.get("error_type"))
    return cls(info.detail, **extra)


_RAISED: dict[tuple[str, str], type[PinfeedError]] = {}


def _as_raised(module: Any, name: Any) -> type[PinfeedError]:
    """``SampleError`` joined with the dataset's own exception class ``module.name``, if
    this process has it and it can be joined (an Exception subclass); else SampleError."""
    if not isinstance(module, str) or not isinstance(name, str):
        return SampleError
    key = (module, name)
    if key not in _RAISED:
        joined: type[PinfeedError] = SampleError
        original = getattr(sys.modules.get(module), name, None)
        if (
            isinstance(original, type)
            and issubclass(original, Exception)
            and not issubclass(original, PinfeedError)
        ):
            # Found by pickle where its qualified name says (this module's __getattr__),
            # so the class itself crosses processes as the dataset's own would: e.g.
            # multiprocessing's ExceptionWrapper, which pickles an exception's type.
            where = {"__module__": __name__, "__qualname__": f"SampleError[{module}:{name}]"}
            try:
                joined = type(f"SampleError[{name}]", (SampleError, original), where)
            except TypeError:  # a layout conflict (some builtins): SampleError alone
                joined = SampleError
        _RAISED[key] = joined
    return _RAISED[key]


_JOINED_NAME = re.compile(r"SampleError\[([\w.]+):(\w+)\]")


def __getattr__(attr: str) -> Any:
    """A joined ``SampleError`` class by its qualified name, made in this process if it
    was not (a class pickled by reference in another process)."""
    m = _JOINED_NAME.fullmatch(attr)
    if m is None:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    module, name = m.groups()
    with contextlib.suppress(ImportError):
        importlib.import_module(module)
    return _as_raised(module, name)


def _rebuilt(slug: str, detail: str, extra: dict[str, Any]) -> PinfeedError:
    """An unpickled pinfeed error (``PinfeedError.__reduce__``)."""
    cls = _BY_SLUG.get(slug, PinfeedError)
    if cls is SampleError:
        cls = _as_raised(extra.get("error_module"), extra.get("error_type"))
    return cls(detail, **extra)


def error_from_slug(slug: str, detail: str, **extra: Any) -> PinfeedError:
    """Rebuild the typed exception for a problem ``type`` (or a bare slug)."""
    if slug.startswith(PROBLEM_PREFIX):
        slug = slug[len(PROBLEM_PREFIX) :]
    cls = _BY_SLUG.get(slug, PinfeedError)
    return cls(detail, **extra)
