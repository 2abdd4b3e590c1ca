"""Locks that every process mapping a cache shares: POSIX byte-range locks on its file.

A cache's workers are separate processes forked from one zygote, and the server's
own threads (``num_workers=0`` loaders) use it too, so a lock here is two: a
``threading`` lock for the threads of one process (POSIX locks belong to a process,
which may take its own lock twice) and ``fcntl.lockf`` on one byte of the region's
file descriptor for the processes. The kernel drops a process's POSIX locks when it
dies, so a worker SIGKILLed while holding one never blocks the others; and no lock is
inherited across ``fork``. The bytes locked need not exist (locks may lie past the
end of the file): each sample, the allocator and each counter slot has its own.

A wait is bounded: a lock that stays held (a ``__getitem__`` that hangs) is given up
after ``timeout`` (``LockTimeout``), and the caller goes on without the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator

# Where the locks lie, as byte offsets of the region's file.
OWNER_LOCK = 1 << 44  # the server that owns a persisted file
ALLOC_LOCK = (1 << 44) + 1  # the data area's bump allocator
SLOT_LOCKS = 1 << 45  # + k: counter slot k is claimed by a live process
SAMPLE_LOCKS = 1 << 46  # + i: sample i is being read and stored

STRIPES = 64  # thread locks per process, shared by samples modulo this
POLL_S = (0.0002, 0.005)  # a busy lock is retried from the first to the second, doubling


class LockTimeout(TimeoutError):
    """A lock stayed held past the caller's bound."""


def try_lock(fd: int, at: int) -> bool:
    """Take byte ``at`` of ``fd`` if no other process holds it; whether it was taken."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, at)
    except OSError:
        return False
    return True


def unlock(fd: int, at: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, at)


class RangeLocks:
    """The locks of one region, in one process (see the module docstring)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pid = -1
        self._stripes: list[threading.Lock] = []
        self._alloc = threading.Lock()

    def _threads(self) -> list[threading.Lock]:
        # Thread locks made in another process (before a fork) may have been held there.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._stripes = [threading.Lock() for _ in range(STRIPES)]
            self._alloc = threading.Lock()
        return self._stripes

    def _take(self, thread: threading.Lock, at: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not thread.acquire(timeout=timeout):
            raise LockTimeout(f"lock {at} held by another thread past {timeout} s")
        pause = POLL_S[0]
        while not try_lock(self.fd, at):
            if time.monotonic() > deadline:
                thread.release()
                raise LockTimeout(f"lock {at} held by another process past {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])

    @contextlib.contextmanager
    def sample(self, index: int, timeout: float) -> Iterator[None]:
        """Sample ``index``'s lock: who holds it reads and stores that sample."""
        thread = self._threads()[index % STRIPES]
        at = SAMPLE_LOCKS + index
        self._take(thread, at, timeout)
        try:
            yield
        finally:
            unlock(self.fd, at)
            thread.release()

    @contextlib.contextmanager
    def alloc(self, timeout: float = 10.0) -> Iterator[None]:
        """The allocator's lock (held for a few loads and stores)."""
        self._threads()
        self._take(self._alloc, ALLOC_LOCK, timeout)
        try:
            yield
        finally:
            unlock(self.fd, ALLOC_LOCK)
            self._alloc.release()
