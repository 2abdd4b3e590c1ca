"""pinfeed's trainer library. Entry points: ``DataLoader`` (torch's DataLoader, its very
signature over the script's own objects, with the batches made by a pinfeed server:
the one-line switch), ``ServerDataset`` (a dataset the server builds from one of its
kinds: data in a store, read with the server's credentials), ``Loader`` (a loader
registered by name: batches over shared memory), ``Client`` (the HTTP admin),
``Transformed`` (a dataset and its per-loader transform, the reference of a cached
dataset's loader), ``Mixture`` and ``Packed`` (datasets by weight, and token documents
packed into rows: ``mixing``, ``packing``); the errors of ``errors``, the tree both sides raise."""

from pinfeed._admin import Client
from pinfeed._dataloader import DataLoader, FallbackWarning
from pinfeed._loader import Loader
from pinfeed.elastic import merge_states
from pinfeed.errors import (
    BatchTooLarge,
    Conflict,
    DataPlaneError,
    GroupMemberLost,
    InsufficientMemory,
    InternalError,
    InvalidPosition,
    InvalidRequest,
    InvalidState,
    LoaderBusy,
    LoaderFailed,
    LoaderNotFound,
    MethodNotAllowed,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    PinfeedError,
    ProblemError,
    ProtocolError,
    SampleError,
    ServerUnavailable,
    Unauthorized,
    Unshippable,
    UnsupportedMediaType,
    WorkerLimit,
)
from pinfeed.mixture import Mixture
from pinfeed.packed import Packed
from pinfeed.served import ServerDataset
from pinfeed.transformed import Transformed

__version__ = "0.1.0"  # the distribution's version (pyproject reads it from here)

__all__ = [
    "BatchTooLarge",
    "Client",
    "Conflict",
    "DataLoader",
    "DataPlaneError",
    "FallbackWarning",
    "GroupMemberLost",
    "InsufficientMemory",
    "InternalError",
    "InvalidPosition",
    "InvalidRequest",
    "InvalidState",
    "Loader",
    "LoaderBusy",
    "LoaderFailed",
    "LoaderNotFound",
    "MethodNotAllowed",
    "Mixture",
    "NotFound",
    "NotReady",
    "Overloaded",
    "Packed",
    "PayloadTooLarge",
    "PinfeedError",
    "ProblemError",
    "ProtocolError",
    "SampleError",
    "ServerDataset",
    "ServerUnavailable",
    "Transformed",
    "Unauthorized",
    "Unshippable",
    "UnsupportedMediaType",
    "WorkerLimit",
    "merge_states",
]
