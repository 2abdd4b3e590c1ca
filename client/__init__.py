"""pinfeed's trainer library: ``Loader`` (batches over shared memory) and ``Client`` (HTTP)."""

from pinfeed._admin import Client
from pinfeed._errors import (
    BatchTooLarge,
    Conflict,
    DataPlaneError,
    GroupMemberLost,
    InsufficientMemory,
    InternalError,
    InvalidRequest,
    LoaderBusy,
    LoaderFailed,
    MethodNotAllowed,
    NotFound,
    NotReady,
    PayloadTooLarge,
    PinfeedError,
    ProblemError,
    SampleError,
    ServerUnavailable,
    Unauthorized,
    UnsupportedMediaType,
)
from pinfeed._loader import Loader

__all__ = [
    "BatchTooLarge",
    "Client",
    "Conflict",
    "DataPlaneError",
    "GroupMemberLost",
    "InsufficientMemory",
    "InternalError",
    "InvalidRequest",
    "Loader",
    "LoaderBusy",
    "LoaderFailed",
    "MethodNotAllowed",
    "NotFound",
    "NotReady",
    "PayloadTooLarge",
    "PinfeedError",
    "ProblemError",
    "SampleError",
    "ServerUnavailable",
    "Unauthorized",
    "UnsupportedMediaType",
]
