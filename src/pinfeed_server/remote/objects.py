"""A remote dataset's objects, as listed when it was registered, cut into cache units.

An object is read whole (a JPEG, a tar shard, a ``.pt``) or in fixed blocks of
``block`` bytes (a token file, an ``.npy`` array, a Parquet file: formats read by range),
as its manifest says. A unit is one whole object or one block: what the node's cache
stores as one file, fetched with one GET. Its identity is the store's (endpoint,
bucket, key), the ETag the object had when the dataset was registered, and its byte
range: a unit of another version of the object is another unit, so an object replaced
in the store is never mixed with the version the dataset was built from (every GET
names the ETag, ``If-Match``). Units are numbered within the manifest (``uid``): an
object's blocks are consecutive, objects in manifest order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pinfeed_server.remote.url import S3Url


@dataclass(frozen=True)
class ObjectInfo:
    bucket: str
    key: str
    size: int
    etag: str

    @property
    def url(self) -> str:
        return str(S3Url(self.bucket, self.key))


class Unit(NamedTuple):
    """Bytes ``[start, start + length)`` of ``obj``; ``digest`` names its cache file."""

    uid: int
    obj: ObjectInfo
    start: int
    length: int
    digest: str

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.length == self.obj.size

    def __str__(self) -> str:
        if self.whole:
            return self.obj.url
        return f"{self.obj.url} bytes {self.start}-{self.start + self.length - 1}"


def digest(endpoint: str, obj: ObjectInfo, start: int, length: int) -> str:
    ident = "\0".join((endpoint, obj.bucket, obj.key, obj.etag, str(start), str(length)))
    return hashlib.sha256(ident.encode()).hexdigest()[:40]


class Manifest:
    """``objects`` (in the dataset's order) as units: whole, or blocks of ``block``."""

    def __init__(
        self, name: str, endpoint: str, objects: list[ObjectInfo], block: int | None
    ) -> None:
        self.name = name  # what errors call the dataset (its URL)
        self.endpoint = endpoint
        self.objects = objects
        self.block = block
        sizes = np.fromiter((o.size for o in objects), dtype=np.int64, count=len(objects))
        per = np.ones_like(sizes) if block is None else np.maximum(1, -(-sizes // block))
        self.first = np.zeros(len(objects) + 1, dtype=np.int64)
        np.cumsum(per, out=self.first[1:])
        self.nbytes = int(sizes.sum())

    def __len__(self) -> int:
        """Units."""
        return int(self.first[-1])

    def unit(self, uid: int) -> Unit:
        k = int(np.searchsorted(self.first, uid, side="right")) - 1
        obj = self.objects[k]
        if self.block is None:
            start, length = 0, obj.size
        else:
            start = (uid - int(self.first[k])) * self.block
            length = min(self.block, obj.size - start)
        return Unit(uid, obj, start, length, digest(self.endpoint, obj, start, length))

    def select(self, keep: list[int]) -> Manifest:
        """The objects ``keep`` (indices into ``objects``), in that order: a kind's
        samples over part of a listing (its images, its shards)."""
        return Manifest(self.name, self.endpoint, [self.objects[k] for k in keep], self.block)

    def span(self, k: int, start: int, stop: int) -> tuple[int, int]:
        """The units ``[first, last]`` holding bytes ``[start, stop)`` of object ``k``."""
        if self.block is None:
            return int(self.first[k]), int(self.first[k])
        base = int(self.first[k])
        return base + start // self.block, base + max(start, stop - 1) // self.block

    def spans(
        self, k: int | NDArray[np.int64], starts: NDArray[np.int64], stops: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """``span`` of many byte ranges at once (numpy): of object ``k``, or of object
        ``k[j]`` for range ``j``."""
        base = np.broadcast_to(self.first[k], np.shape(starts)).astype(np.int64)
        if self.block is None:
            return base, base.copy()
        first = base + starts // self.block
        last = base + np.maximum(starts, stops - 1) // self.block
        return first.astype(np.int64), last.astype(np.int64)

    def objects_units(self, k: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Whole objects ``k`` (a manifest of whole objects) as ``spans`` gives them."""
        assert self.block is None, "a manifest of blocks"
        uid = self.first[k].astype(np.int64)
        return uid, uid.copy()
