"""A kind's dataset over objects in a store (``s3://``): what the engine needs of it.

``RemoteDataset`` wraps the kind's own dataset (built over the objects, read through
the node's cache) and adds ``remote_manifest`` and ``remote_units`` (``RemoteReads``):
the units each sample reads, on which the engine gates its batches and with which it
ranks the cache's units. Everything else is the kind's dataset's (attribute lookups
fall through, ``fetch_into`` where it has one); ``RemoteIterable`` is the same for an
``IterableDataset`` (``webdataset``), which DataLoader tells by its type.

It pickles (to a worker's zygote, in a node cache's spec) as its kind's build with the
listing the server made pinned (``Kind`` stamps ``source``; ``DatasetContext.pinned``):
the zygote builds the same dataset over the objects the server listed, with the ETags
it listed, through its link to the server, and never lists again, so every process
reads the one version of every object.

``RemoteArray`` is an array stored in an object (C order, from a byte offset: a token
file, an ``.npy`` array), read by rows through the cache as a memory map would be.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data
from numpy.typing import NDArray

from pinfeed_server.remote import Manifest, RemoteObject

Spans = list[tuple[NDArray[np.int64], NDArray[np.int64]]]


class RemoteDataset:
    def __init__(
        self,
        inner: Any,
        manifest: Manifest,
        spans: Callable[[NDArray[np.int64]], Spans],
        listed: Manifest | None = None,
    ) -> None:
        """``manifest``: the objects the samples read (units numbered in it);
        ``listed``: what the store listed, which the build derived ``manifest`` from
        (its images, its shards), pinned when the dataset is built again elsewhere."""
        self.dataset = inner
        self.remote_manifest = manifest
        self._spans = spans
        self.listed = listed or manifest
        # (kind, params, context): set by ``Kind`` once built
        self.source: tuple[Any, dict[str, Any], Any] | None = None

    def remote_units(self, indices: NDArray[np.int64]) -> Spans:
        return self._spans(indices)

    def rebuilt_in_zygote(self) -> RemoteDataset:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        if self.source is None:
            raise TypeError("a remote dataset not built by its kind does not pickle")
        kind, params, context = self.source
        return (kind, (params, dataclasses.replace(context, pinned=self.listed)))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "source", "listed"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"Remote({self.dataset!r} from {self.remote_manifest.name})"


class RemoteIterable(RemoteDataset, torch.utils.data.IterableDataset[Any]):
    """A remote ``IterableDataset`` (DataLoader's ``isinstance`` test holds)."""

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)


class RemoteArray:
    """An array of ``shape`` (C order) from byte ``offset`` of an object: ``a[i]`` is a
    row, ``a[i:j]`` contiguous rows, ``take`` any rows, each read (through the cache)
    into a fresh array."""

    def __init__(
        self, obj: RemoteObject, dtype: np.dtype[Any], offset: int, shape: Sequence[int]
    ) -> None:
        self.obj, self.dtype, self.offset = obj, np.dtype(dtype), offset
        self.shape = tuple(int(d) for d in shape)
        self.ndim = len(self.shape)
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def row_spans(self, indices: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The byte ranges ``[start, stop)`` of rows ``indices`` in the object."""
        starts = self.offset + indices.astype(np.int64) * self.row_bytes
        return starts, starts + self.row_bytes

    def _row(self, index: int) -> int:
        i = int(index) + (self.shape[0] if int(index) < 0 else 0)
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"index {index} is out of bounds for axis 0 with size {len(self)}")
        return i

    def __getitem__(self, index: int | slice) -> NDArray[Any]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            assert step == 1, "a RemoteArray is sliced contiguously"
            n = max(0, stop - start)
            data = self.obj.pread(self.offset + start * self.row_bytes, n * self.row_bytes)
            return np.frombuffer(data, dtype=self.dtype).reshape(n, *self.shape[1:])
        i = self._row(index)
        data = self.obj.pread(self.offset + i * self.row_bytes, self.row_bytes)
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape[1:])

    def take_into(self, indices: Sequence[int], out: NDArray[Any]) -> None:
        """Rows ``indices`` into ``out`` (``[len(indices), *shape[1:]]``, this dtype)."""
        flat = out.reshape(len(indices), -1).view(np.uint8)
        for j, index in enumerate(indices):
            i = self._row(index)
            data = self.obj.pread(self.offset + i * self.row_bytes, self.row_bytes)
            flat[j] = np.frombuffer(data, dtype=np.uint8)
