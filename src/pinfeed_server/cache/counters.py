"""A cache's hit and miss counts, summed over every process that reads it.

Each process counts in a slot of its own in the region (``region.py``: a row of
u64s), claimed with the slot's byte lock the first time it counts and held for its
life, so a slot has one writer and no count is ever lost to a race between processes
(threads of one process share its slot under a thread lock). A slot's counts outlive
the process: a later process that claims it adds to them. The totals are the sums of
the column over all slots, read without a lock (each u64 is written whole).

The table is read through the region each time, never kept: the region holds the only
views of its mapping, so its ``close`` unmaps it (a view kept here would keep the
mapping, and a memfd's memory, until this object was collected).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from pinfeed_server.cache.locks import SLOT_LOCKS, RangeLocks, try_lock

if TYPE_CHECKING:
    from pinfeed_server.cache.region import Region

HITS, MISSES, CORRUPT, WAITS = range(4)


class Counters:
    def __init__(self, locks: RangeLocks, region: Region) -> None:
        self._locks = locks
        self._fd = locks.fd
        self._region = region
        self._pid = -1
        self._slot = -1
        self._lock = threading.Lock()

    def _claim(self) -> int:
        for k in range(len(self._region.counters) - 1):
            if try_lock(self._fd, SLOT_LOCKS + k):
                return k
        return -1  # every slot held by a live process: the last one, shared under a lock

    def add(self, column: int, n: int = 1) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._slot = os.getpid(), self._claim()
            if self._slot >= 0:
                self._region.counters[self._slot, column] += n
                return
            with self._locks.alloc():  # the shared overflow slot: rare and slow
                self._region.counters[-1, column] += n

    def totals(self) -> list[int]:
        return [int(x) for x in self._region.counters.sum(axis=0, dtype=np.uint64)]
