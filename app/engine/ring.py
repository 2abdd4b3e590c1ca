"""The ring: one memfd region cut into fixed-size slots, and the slot table.

The server creates the memfd and frees it; workers and trainers receive the fd and
only map and unmap. Slots move free -> filling -> ready -> leased -> free; a slot is
never handed to a worker while a consumer holds it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import mmap
import os
import threading

import torch

from pinfeed._protocol import ALIGN, align

log = logging.getLogger("pinfeed.ring")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def map_ring(fd: int, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map a ring read-write and return (mapping, uint8 tensor over all of it)."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


class Ring:
    """A memfd of ``nslots * slot_bytes`` bytes, page-locked when the process may."""

    def __init__(self, name: str, nslots: int, slot_bytes: int, *, lock: bool = True) -> None:
        if nslots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of at least one byte")
        self.nslots = nslots
        self.slot_bytes = align(slot_bytes, ALIGN)
        self.size = self.nslots * self.slot_bytes
        self.fd = os.memfd_create(f"pinfeed-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._mm, self.base = map_ring(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.page_locked = False
        if lock:
            # mlock also faults every page in, so the first batches pay no page faults.
            rc = _libc.mlock(ctypes.c_void_p(self.base.data_ptr()), ctypes.c_size_t(self.size))
            self.page_locked = rc == 0
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.page_locked:
            _libc.munlock(ctypes.c_void_p(self.base.data_ptr()), ctypes.c_size_t(self.size))
        del self.base
        try:
            self._mm.close()
        except BufferError:
            # A view is still alive somewhere in the server: the mapping goes when it
            # does (the fd below is closed now; trainers keep their own mappings).
            log.warning("ring %s: a view is still alive; unmapping when it goes", self.fd)
        os.close(self.fd)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlotState(enum.IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2
    LEASED = 3


class SlotTable:
    """Slot states behind one condition variable."""

    def __init__(self, nslots: int) -> None:
        self.states = [SlotState.FREE] * nslots
        self.cond = threading.Condition()
        # Most slots filling or ready at once (the prefetch depth); a live PATCH may
        # lower it below the ring's size.
        self.limit = nslots

    def acquire_free(self, stop: threading.Event, poll_s: float = 0.2) -> int | None:
        """Wait for a free slot and mark it filling; ``None`` once ``stop`` is set."""
        with self.cond:
            while not stop.is_set():
                ahead = sum(s in (SlotState.FILLING, SlotState.READY) for s in self.states)
                if ahead < self.limit:
                    for i, state in enumerate(self.states):
                        if state is SlotState.FREE:
                            self.states[i] = SlotState.FILLING
                            return i
                self.cond.wait(poll_s)
        return None

    def set_limit(self, limit: int) -> None:
        with self.cond:
            self.limit = max(1, min(limit, len(self.states)))
            self.cond.notify_all()

    def move(self, slot: int, expect: SlotState, to: SlotState) -> bool:
        with self.cond:
            if self.states[slot] is not expect:
                return False
            self.states[slot] = to
            # The producer waits for a free slot *and* for room under the prefetch limit
            # (filling + ready): every change can be the one it waits for.
            self.cond.notify_all()
            return True

    def counts(self) -> dict[str, int]:
        """Read without the lock the per-batch path takes: one copy of the list (atomic
        under the GIL), so a scrape may see a slot one state early or late."""
        states = list(self.states)
        return {s.name.lower(): states.count(s) for s in SlotState}
