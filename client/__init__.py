"""pinfeed's trainer library: ``Loader`` (batches over shared memory) and ``Client`` (HTTP)."""

from client._admin import Client
from client._errors import (
    BatchTooLarge,
    Conflict,
    DataPlaneError,
    InsufficientMemory,
    InvalidRequest,
    LoaderBusy,
    LoaderFailed,
    NotFound,
    PinfeedError,
    ProblemError,
    SampleError,
    ServerUnavailable,
    Unauthorized,
)
from client._loader import Loader

__all__ = [
    "BatchTooLarge",
    "Client",
    "Conflict",
    "DataPlaneError",
    "InsufficientMemory",
    "InvalidRequest",
    "Loader",
    "LoaderBusy",
    "LoaderFailed",
    "NotFound",
    "PinfeedError",
    "ProblemError",
    "SampleError",
    "ServerUnavailable",
    "Unauthorized",
]
