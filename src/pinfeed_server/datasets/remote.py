"""A kind's dataset over objects in a store (``s3://``): what the engine needs of it.

``RemoteDataset`` wraps the kind's own dataset (built over the objects, read through
the node's cache) and adds ``remote_manifest`` and ``remote_units`` (``RemoteReads``):
the units each sample reads, on which the engine gates its batches and with which it
ranks the cache's units. Everything else is the kind's dataset's (attribute lookups
fall through, ``fetch_into`` where it has one). It goes to a worker's zygote as it is
(``rebuilt_in_zygote``): the zygote reads the objects the server listed, with the ETags
it listed, and never lists again. ``RemoteArray`` is a 1-D array in an object
(a token file), sliced as a memory map is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pinfeed_server.remote import Manifest, RemoteObject

Spans = list[tuple[NDArray[np.int64], NDArray[np.int64]]]


class RemoteDataset:
    def __init__(
        self, inner: Any, manifest: Manifest, spans: Callable[[NDArray[np.int64]], Spans]
    ) -> None:
        self.dataset = inner
        self.remote_manifest = manifest
        self._spans = spans

    def remote_units(self, indices: NDArray[np.int64]) -> Spans:
        return self._spans(indices)

    def rebuilt_in_zygote(self) -> RemoteDataset:
        return self

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"Remote({self.dataset!r} from {self.remote_manifest.name})"


class RemoteArray:
    """``count`` items of ``dtype`` from byte ``offset`` of an object: ``a[i:j]`` reads
    that range (through the cache) into a fresh array."""

    def __init__(self, obj: RemoteObject, dtype: np.dtype[Any], offset: int, count: int) -> None:
        self.obj, self.dtype, self.offset, self.count = obj, np.dtype(dtype), offset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, s: slice) -> NDArray[Any]:
        start, stop, step = s.indices(self.count)
        assert step == 1, "a RemoteArray is read by contiguous slices"
        size = self.dtype.itemsize
        data = self.obj.pread(self.offset + start * size, max(0, stop - start) * size)
        return np.frombuffer(data, dtype=self.dtype)


def byte_spans(
    manifest: Manifest, k: int, starts: NDArray[np.int64], stops: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    return manifest.spans(k, starts, stops)
