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

    def whole(self, k: int) -> Unit:
        """Object ``k`` as its one unit (a manifest of whole objects)."""
        assert self.block is None, "a manifest of blocks"
        return self.unit(k)

    def span(self, k: int, start: int, stop: int) -> tuple[int, int]:
        """The units ``[first, last]`` holding bytes ``[start, stop)`` of object ``k``."""
        if self.block is None:
            return int(self.first[k]), int(self.first[k])
        base = int(self.first[k])
        return base + start // self.block, base + max(start, stop - 1) // self.block

    def spans(self, k: int, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``span`` of many byte ranges of object ``k`` at once (numpy)."""
        base = int(self.first[k])
        if self.block is None:
            at = np.full(len(starts), base, dtype=np.int64)
            return at, at.copy()
        first = base + starts // self.block
        last = base + np.maximum(starts, stops - 1) // self.block
        return first.astype(np.int64), last.astype(np.int64)
