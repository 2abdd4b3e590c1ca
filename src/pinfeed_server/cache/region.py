"""A cache's memory: one region, mapped by the server and every worker of its dataset.

The region is a memfd (or, for a persisted cache, a file under PINFEED_CACHE_DIR:
the same layout, page cache instead of shmem), sized once to the cache's whole budget
and sparse: a page takes memory only once an entry is written into it::

    0         header: magic, version, samples, data capacity, bump pointer, fingerprint
    4 KiB     counter slots: per process (hits, misses, corrupt, waits), u64 each
    ...       the index, one row per sample, in columns: state u32, crc32c u32,
              record offset u64, record length u64
    data_at   records (``record.py``), appended at the bump pointer, never moved

An entry's state says what its row holds: ``EMPTY``; ``READY`` (a record written in
this server's life, trusted); ``UNVERIFIED`` (a record found in a persisted file: its
checksum is checked on its first read); ``REFUSED`` (it did not fit: the fixed subset
is full). A writer stores the row's offset, length and checksum before its state, so
a reader that sees a state sees the row; a reader also checks that the record names
the sample it was looked up for.

The server maps it writable and is its only owner (it created it; ``close`` frees it).
A worker's zygote attaches by file descriptor (a ``DupFd`` while multiprocessing
starts it) and maps it twice: writable, to store the samples it misses, and read-only,
for the views it hands out, so a transform that writes into a cached sample cannot
change the cache.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

MAGIC = b"PFCACHE1"
VERSION = 1
HEADER_BYTES = 4096
PAGE = 4096
COUNTER_SLOTS = 1024
COUNTERS = 4  # hits, misses, corrupt, waits
# header fields: (offset, numpy dtype)
F_VERSION, F_LENGTH, F_CAPACITY, F_BUMP = 8, 16, 24, 32
F_FINGERPRINT, FINGERPRINT_BYTES = 40, 32

EMPTY, READY, UNVERIFIED, REFUSED = 0, 1, 2, 3
# Records are written with pwritev, not through the mapping: a fresh page faulted in
# through a mapping costs the kernel about ten times the copy into it, and even pages
# taken a chunk at a time (fallocate + MADV_POPULATE_WRITE) are mapped one by one;
# pwrite takes and fills them with no page table of the writer's (measured, 262 KB
# into a new memfd: through the mapping 260 us, through pages taken by fallocate and
# MADV_POPULATE_WRITE 215 us, pwrite 125 us). A reader maps a page at its first read.
IOV_MAX = 1024


def _page(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass(frozen=True)
class Layout:
    """Where everything lies in a region of ``length`` samples and ``capacity`` data bytes."""

    length: int
    capacity: int

    @functools.cached_property
    def counters_at(self) -> int:
        return HEADER_BYTES

    @functools.cached_property
    def states_at(self) -> int:
        return _page(self.counters_at + COUNTER_SLOTS * COUNTERS * 8)

    @functools.cached_property
    def crcs_at(self) -> int:
        return self.states_at + 4 * self.length

    @functools.cached_property
    def offsets_at(self) -> int:
        return -(-(self.crcs_at + 4 * self.length) // 8) * 8

    @functools.cached_property
    def lengths_at(self) -> int:
        return self.offsets_at + 8 * self.length

    @functools.cached_property
    def data_at(self) -> int:
        return _page(self.lengths_at + 8 * self.length)

    @functools.cached_property
    def total(self) -> int:
        return self.data_at + self.capacity

    @classmethod
    def within(cls, length: int, max_bytes: int) -> Layout:
        """The layout of a region of at most ``max_bytes`` in all."""
        overhead = cls(length, 0).data_at
        return cls(length, max(0, max_bytes - overhead))


class Region:
    """One mapped cache region (see the module docstring). ``owner``: this process
    created it and frees it; others only unmap."""

    def __init__(self, fd: int, layout: Layout, *, owner: bool) -> None:
        self.fd = fd
        self.layout = layout
        self.owner = owner
        self._pid = os.getpid()
        size = max(layout.total, PAGE)
        self.rw = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        # The owner hands out copies (user code in the server must not reach the cache);
        # an attached process views the read-only mapping.
        self.ro: mmap.mmap | None = None
        if not owner:
            self.ro = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with warnings.catch_warnings():
                # torch warns once per process that it cannot mark a tensor read-only:
                # here, where that is known and wanted, rather than in a worker's log.
                warnings.simplefilter("ignore")
                torch.frombuffer(self.ro, dtype=torch.uint8, count=1)
        n = layout.length
        self.header = np.frombuffer(self.rw, dtype=np.uint64, count=HEADER_BYTES // 8)
        self.counters = np.frombuffer(
            self.rw, dtype=np.uint64, count=COUNTER_SLOTS * COUNTERS, offset=layout.counters_at
        ).reshape(COUNTER_SLOTS, COUNTERS)
        self.states: NDArray[np.uint32] = np.frombuffer(
            self.rw, dtype=np.uint32, count=n, offset=layout.states_at
        )
        self.crcs: NDArray[np.uint32] = np.frombuffer(
            self.rw, dtype=np.uint32, count=n, offset=layout.crcs_at
        )
        self.offsets: NDArray[np.uint64] = np.frombuffer(
            self.rw, dtype=np.uint64, count=n, offset=layout.offsets_at
        )
        self.lengths: NDArray[np.uint64] = np.frombuffer(
            self.rw, dtype=np.uint64, count=n, offset=layout.lengths_at
        )
        self._closed = False

    def write(self, at: int, parts: list[Any]) -> None:
        """Write the buffers ``parts`` one after another from byte ``at`` of the region."""
        views = [memoryview(b).cast("B") for b in parts]
        while views:
            n = os.pwritev(self.fd, views[:IOV_MAX], at)
            if n <= 0:
                raise OSError(f"cache region: pwritev wrote nothing at byte {at}")
            at += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    @classmethod
    def memfd(cls, name: str, layout: Layout, fingerprint: bytes = b"") -> Region:
        """A new, empty region in a memfd of its own (sparse: no page taken yet)."""
        fd = os.memfd_create(f"pinfeed-cache-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(layout.total, PAGE))
            region = cls(fd, layout, owner=True)
        except BaseException:
            os.close(fd)
            raise
        region.format(fingerprint)
        return region

    def format(self, fingerprint: bytes) -> None:
        """Write a fresh header (every entry empty, the data area unused)."""
        self.rw[:8] = MAGIC
        self.header[F_VERSION // 8] = VERSION
        self.header[F_LENGTH // 8] = self.layout.length
        self.header[F_CAPACITY // 8] = self.layout.capacity
        self.header[F_BUMP // 8] = 0
        fp = fingerprint.ljust(FINGERPRINT_BYTES, b"\0")[:FINGERPRINT_BYTES]
        self.rw[F_FINGERPRINT : F_FINGERPRINT + FINGERPRINT_BYTES] = fp

    @property
    def bump(self) -> int:
        """Data bytes allocated (records written, or being written)."""
        return int(self.header[F_BUMP // 8])

    @bump.setter
    def bump(self, value: int) -> None:
        self.header[F_BUMP // 8] = value

    @property
    def reader(self) -> Any:
        """The mapping records are read from: read-only where this process attached."""
        return self.ro if self.ro is not None else self.rw

    def release(self, start: int, length: int) -> None:
        """Give the pages of ``[start, start + length)`` back (their bytes read as 0)."""
        start, end = _page(start), (start + length) // PAGE * PAGE
        if end > start:
            self.rw.madvise(mmap.MADV_REMOVE, start, end - start)

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction
        from multiprocessing.context import get_spawning_popen

        if get_spawning_popen() is None:
            raise TypeError("a cache region pickles only to a process multiprocessing starts")
        return (_attached, (reduction.DupFd(self.fd), self.layout))

    def close(self) -> None:
        """Unmap (and, the owner, close the fd: the memory goes with the last mapping)."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        for name in ("header", "counters", "states", "crcs", "offsets", "lengths"):
            setattr(self, name, None)
        for m in (self.ro, self.rw):
            if m is not None:
                with contextlib.suppress(BufferError):  # a view still alive: it goes with it
                    m.close()
        os.close(self.fd)


def _attached(dupfd: Any, layout: Layout) -> Region:
    return Region(dupfd.detach(), layout, owner=False)
