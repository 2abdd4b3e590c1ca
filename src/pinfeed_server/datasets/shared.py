"""Dataset metadata in shared memory: named numpy arrays in one sealed, read-only memfd.

A kind that scans or parses (``images``: every path and label) keeps the result here
instead of in Python lists: the server builds it once, and every process that uses the
dataset maps the same pages. Numpy's data buffers carry no reference counts, so reading
them never copies a page (a forked list of ``str`` is copied page by page as workers
touch its refcounts, pytorch issue 13246).

An instance pickles as its file descriptor (``multiprocessing.reduction.DupFd``), so
only while multiprocessing starts a process (the dataset's zygote): the child maps the
same memfd. ``StringTable`` is a column of strings over two arrays (bytes + offsets).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")
_ALIGN = 64


def _seal(fd: int) -> None:
    import fcntl

    flags = 0
    for name in _SEALS:
        flags |= getattr(fcntl, name, 0)
    if flags and hasattr(fcntl, "F_ADD_SEALS"):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, flags)


class SharedArrays(Mapping[str, NDArray[Any]]):
    """Read-only numpy arrays by name, all in one memfd; ``arrays[name]`` is a view."""

    def __init__(self, name: str, arrays: Mapping[str, NDArray[Any]]) -> None:
        layout: list[tuple[str, str, tuple[int, ...], int]] = []
        offset = 0
        for key, a in arrays.items():
            layout.append((key, a.dtype.str, tuple(a.shape), offset))
            offset += -(-a.nbytes // _ALIGN) * _ALIGN
        fd = os.memfd_create(f"pinfeed-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = max(offset, 1)
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mm:
                for (_, _, _, at), a in zip(layout, arrays.values(), strict=True):
                    mm[at : at + a.nbytes] = np.ascontiguousarray(a).tobytes()
            _seal(fd)
        except BaseException:
            os.close(fd)
            raise
        self._attach(fd, size, layout)

    def _attach(
        self, fd: int, size: int, layout: list[tuple[str, str, tuple[int, ...], int]]
    ) -> None:
        self._fd, self._size, self._layout = fd, size, layout
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._arrays: dict[str, NDArray[Any]] = {}
        for key, dtype, shape, at in layout:
            count = int(np.prod(shape, dtype=np.int64))
            flat = np.frombuffer(self._mm, dtype=np.dtype(dtype), count=count, offset=at)
            self._arrays[key] = flat.reshape(shape)
        # The fd stays open (a zygote started later needs it); both go with the object.
        weakref.finalize(self, os.close, fd)

    @property
    def nbytes(self) -> int:
        return self._size

    def __getitem__(self, key: str) -> NDArray[Any]:
        return self._arrays[key]

    def __iter__(self) -> Any:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction
        from multiprocessing.context import get_spawning_popen

        if get_spawning_popen() is None:
            # Anywhere else the bytes would be copied; refuse instead.
            raise TypeError("SharedArrays pickle only to a process multiprocessing starts")
        return (_attached, (reduction.DupFd(self._fd), self._size, self._layout))

    def __repr__(self) -> str:
        return f"SharedArrays({list(self._arrays)}, {self._size} bytes)"


def _attached(
    dupfd: Any, size: int, layout: list[tuple[str, str, tuple[int, ...], int]]
) -> SharedArrays:
    shared = SharedArrays.__new__(SharedArrays)
    shared._attach(dupfd.detach(), size, layout)
    return shared


def string_arrays(strings: Iterable[bytes]) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """(bytes, offsets) of a column of byte strings: string ``i`` is
    ``bytes[offsets[i]:offsets[i + 1]]``."""
    items = list(strings)
    lengths = np.fromiter((len(s) for s in items), dtype=np.int64, count=len(items))
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blob = np.frombuffer(b"".join(items), dtype=np.uint8)
    return blob, offsets


class StringTable:
    """Read-only strings ``i`` over (bytes, offsets) arrays, decoded as file names are."""

    def __init__(self, blob: NDArray[np.uint8], offsets: NDArray[np.int64]) -> None:
        self._blob, self._offsets = blob, offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:
        start, stop = self._offsets[i], self._offsets[i + 1]
        return os.fsdecode(self._blob[start:stop].tobytes())
