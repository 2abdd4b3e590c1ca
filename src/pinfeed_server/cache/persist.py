"""A persisted cache: its region in a file under PINFEED_CACHE_DIR, reopened by the next server.

The file has the region's layout (``region.py``) and is mapped as it is (its pages are
the page cache: shared by every process as a memfd's are, written back by the kernel,
so a server SIGKILLed while filling loses only the entries it had not published). When
a server opens it, the file is served only if it is the one this dataset made:

- its header reads (magic, version), or the file is *unreadable*;
- its fingerprint (``fingerprint.py``) and sample count are this dataset's, or it is
  *stale*;
- its size is what its header says, or it is *truncated* (a shorter file would fault
  on the pages it lacks);
- the records it holds fit the budget it now has, or it is *resized*.

A file that fails any of these is emptied and made again (counted in ``rebuilt``, the
reason kept); one that passes keeps its records, each marked unverified until its
checksum has been read (``store.py``). One server owns a file at a time (a lock on it);
a second server finds it busy and keeps its cache in memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pinfeed_server.cache import region as r
from pinfeed_server.cache.locks import OWNER_LOCK, SLOT_LOCKS, try_lock, unlock

QUIET_S = 10.0  # how long a rebuild waits for a dead server's workers to let go


def _wait_quiet(fd: int, timeout: float = QUIET_S) -> None:
    """Wait (bounded) until no process holds a counter slot of the file: a SIGKILLed
    server's workers finish the batch they were making before they notice, and one must
    not store a sample of the old dataset into the rebuilt file."""
    deadline = time.monotonic() + timeout
    for k in range(r.COUNTER_SLOTS):
        while not try_lock(fd, SLOT_LOCKS + k):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        unlock(fd, SLOT_LOCKS + k)


class CacheBusy(RuntimeError):
    """Another live server owns the file."""


def _problem(fd: int, layout: r.Layout, fingerprint: bytes) -> str | None:
    """Why the file cannot be served as it is (None: it can); "new" for an empty file."""
    size = os.fstat(fd).st_size
    if size == 0:
        return "new"
    head = os.pread(fd, r.HEADER_BYTES, 0)
    if len(head) < r.HEADER_BYTES or head[:8] != r.MAGIC:
        return "unreadable"

    def u64(at: int) -> int:
        return int.from_bytes(head[at : at + 8], "little")

    if u64(r.F_VERSION) != r.VERSION:
        return "unreadable"
    stored = head[r.F_FINGERPRINT : r.F_FINGERPRINT + r.FINGERPRINT_BYTES]
    if stored != fingerprint.ljust(r.FINGERPRINT_BYTES, b"\0") or u64(r.F_LENGTH) != layout.length:
        return "stale"
    capacity, bump = u64(r.F_CAPACITY), u64(r.F_BUMP)
    if size != r.Layout(layout.length, capacity).total or bump > capacity:
        return "truncated"
    if bump > layout.capacity:
        return "resized"
    return None


def open_file(path: Path, layout: r.Layout, fingerprint: bytes) -> tuple[r.Region, str | None]:
    """The region in ``path``, kept or made again: (region, why it was made again, or
    None if kept or new). CacheBusy if another server owns it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        if not try_lock(fd, OWNER_LOCK):
            raise CacheBusy(f"{path} is in use by another pinfeed server")
        problem = _problem(fd, layout, fingerprint)
        if problem is not None:
            if problem != "new":
                _wait_quiet(fd)
            os.ftruncate(fd, 0)  # nothing of it is kept: the pages go
        os.ftruncate(fd, layout.total)
        region = r.Region(fd, layout, owner=True)
    except BaseException:
        os.close(fd)
        raise
    region.counters[:] = 0  # counts are per server life
    if problem is not None:
        region.format(fingerprint)
        return region, None if problem == "new" else problem
    region.header[r.F_CAPACITY // 8] = layout.capacity
    states = region.states
    states[states == r.READY] = r.UNVERIFIED
    states[states == r.REFUSED] = r.EMPTY  # the budget may be larger now
    return region, None
