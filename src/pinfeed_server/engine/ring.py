"""The ring: memfd segments cut into fixed-size slots, and the slot table.

A ring starts as one memfd (segment 0) of ``nslots`` slots. A live PATCH that needs
more slots adds a segment (a further memfd; its slots are numbered on from the last
one); one that needs fewer retires the newest segments: their slots are no longer
filled and, once every one of them is free again, the segment is closed. Segment 0 is
never closed. Slot ``s`` is at global byte ``s * slot_bytes`` of the ring's *slot
space*; ``SlotSpace`` maps that to the segment holding it.

The server creates each memfd and frees it; workers and trainers receive the fds and
only map and unmap. Slots move free -> filling -> ready -> leased -> free; a slot is
never handed to a worker while a consumer holds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pinfeed.protocol import ALIGN, align

log = logging.getLogger("pinfeed.ring")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def map_ring(fd: int, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map a ring segment read-write and return (mapping, uint8 tensor over all of it)."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


@dataclass(frozen=True)
class SegmentInfo:
    """Where a segment's slots are: ``first`` .. ``first + nslots - 1``."""

    id: int
    first: int
    nslots: int

    @property
    def end(self) -> int:
        return self.first + self.nslots


class SlotSpace:
    """Global byte offsets (slot ``s`` at ``s * slot_bytes``) over a process's mapped
    segments: ``space[start:stop]`` is a view of the segment holding that slot. The
    parts are replaced whole (one tuple), so readers need no lock."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.parts: tuple[tuple[SegmentInfo, torch.Tensor], ...] = ()

    def add(self, info: SegmentInfo, base: torch.Tensor) -> None:
        self.parts = (*self.parts, (info, base))

    def remove(self, segment: int) -> None:
        self.parts = tuple(p for p in self.parts if p[0].id != segment)

    def __getitem__(self, key: slice) -> torch.Tensor:
        start = int(key.start or 0)
        slot = start // self.slot_bytes
        for info, base in self.parts:
            if info.first <= slot < info.end:
                offset = info.first * self.slot_bytes
                stop = info.end * self.slot_bytes if key.stop is None else int(key.stop)
                return base[start - offset : stop - offset]
        raise IndexError(f"slot {slot} is in no mapped ring segment")


class _Segment:
    def __init__(self, name: str, info: SegmentInfo, slot_bytes: int, lock: bool) -> None:
        self.info = info
        self.size = info.nslots * slot_bytes
        # Segment 0 is "pinfeed-<loader>" (tests and operators look for it in /proc);
        # '+' is in no loader name.
        suffix = f"+{info.id}" if info.id else ""
        self.fd = os.memfd_create(f"pinfeed-{name}{suffix}", os.MFD_CLOEXEC)
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

    def close(self) -> None:
        if self.page_locked:
            _libc.munlock(ctypes.c_void_p(self.base.data_ptr()), ctypes.c_size_t(self.size))
        del self.base
        try:
            self._mm.close()
        except BufferError:
            # A view is still alive somewhere in the server: the mapping goes when it
            # does (the fd below is closed now; trainers keep their own mappings).
            # (an in-server writer's cached views, replaced after the close).
            log.debug("ring segment %s: a view is still alive; unmapping when it goes", self.fd)
        os.close(self.fd)


class Ring:
    """Memfd segments of ``slot_bytes`` slots, page-locked when the process may."""

    def __init__(self, name: str, nslots: int, slot_bytes: int, *, lock: bool = True) -> None:
        if nslots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of at least one byte")
        self.name = name
        self.slot_bytes = align(slot_bytes, ALIGN)
        self._lock_pages = lock
        # Held while a segment's fd is sent (pool.py): it is not closed meanwhile.
        self.lock = threading.RLock()
        self._segments: list[_Segment] = []
        self._next_id = 0
        self.space = SlotSpace(self.slot_bytes)
        self.generation = 0  # bumped by every segment added or closed
        self._add(nslots)
        first = self._segments[0]
        self.fd, self.base = first.fd, first.base  # segment 0, mapped for the ring's life
        self._closed = False

    # -- segments --------------------------------------------------------------------
    def _add(self, nslots: int) -> _Segment:
        first = self._segments[-1].info.end if self._segments else 0
        seg = _Segment(
            self.name, SegmentInfo(self._next_id, first, nslots), self.slot_bytes, self._lock_pages
        )
        self._next_id += 1
        self._segments.append(seg)
        self.space.add(seg.info, seg.base)
        self.generation += 1
        return seg

    def grow(self, nslots: int) -> SegmentInfo:
        """Add a segment of ``nslots`` slots after the last one."""
        with self.lock:
            return self._add(nslots).info

    def close_last(self) -> SegmentInfo:
        """Close the newest segment (its slots must all be free); never segment 0."""
        with self.lock:
            if len(self._segments) < 2:
                raise ValueError("segment 0 lives as long as the ring")
            seg = self._segments.pop()
            self.space.remove(seg.info.id)
            self.generation += 1
        seg.close()
        return seg.info

    def segments(self) -> list[tuple[SegmentInfo, int]]:
        """(info, fd) of every segment, oldest first."""
        with self.lock:
            return [(s.info, s.fd) for s in self._segments]

    @property
    def nslots(self) -> int:
        segments = self._segments
        return segments[-1].info.end if segments else 0  # 0 once closed

    @property
    def size(self) -> int:
        return self.nslots * self.slot_bytes

    @property
    def page_locked(self) -> bool:
        return all(s.page_locked for s in self._segments)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self.base
        for seg in reversed(self._segments):
            seg.close()
        self._segments.clear()
        self.space.parts = ()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OwnBuffer:
    """A batch's memory of its own: one memfd the size of the batch, for a
    ``pinfeed.DataLoader``'s batch made before its ring is sized (from the first batches,
    in the workers) or larger than the ring's slots, as DataLoader never refuses a batch
    for its size. The process that makes the batch creates it (``make``), a worker sends
    its fd to the server, which sends it to the trainer with the BATCH (``FLAG_OWN``);
    each holder's fd closes when its ``OwnBuffer`` goes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def make(cls, nbytes: int, write: Callable[[torch.Tensor], bytes]) -> tuple[OwnBuffer, bytes]:
        """A new buffer of ``nbytes`` (> 0), filled by ``write(its uint8 view)``; the
        buffer, and what ``write`` returned (the BATCH body). Unmapped here before it
        returns: the receiver maps it again."""
        fd = os.memfd_create("pinfeed-batch", os.MFD_CLOEXEC)
        buffer = cls(fd)
        os.ftruncate(fd, nbytes)
        mm, view = map_ring(fd, nbytes)
        try:
            body = write(view)
        finally:
            del view  # the mapping's one view: it unmaps now (else when it goes)
            with contextlib.suppress(BufferError):
                mm.close()
        return buffer, body

    def close(self) -> None:
        """Close the fd now (once sent on); idempotent."""
        self._close()


class SlotState(enum.IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2
    LEASED = 3


_AHEAD = (SlotState.FILLING, SlotState.READY)  # the states the prefetch limit counts


class SlotTable:
    """Slot states behind one condition variable."""

    def __init__(self, nslots: int) -> None:
        self.states = [SlotState.FREE] * nslots
        self.cond = threading.Condition()
        # Most slots filling or ready at once (the prefetch depth); a live PATCH may
        # lower it below the ring's size.
        self.limit = nslots
        # Slots at and above ``usable`` belong to segments being retired: never filled.
        self.usable = nslots
        # Slots filling or ready (what ``limit`` bounds), kept as states move: the
        # producer reads it once a batch, not by a pass over the table.
        self.ahead = 0

    def acquire_free(self, stop: threading.Event, poll_s: float = 0.2) -> int | None:
        """Wait for a free slot and mark it filling; ``None`` once ``stop`` is set."""
        with self.cond:
            while not stop.is_set():
                slot = self._take_free()
                if slot is not None:
                    return slot
                self.cond.wait(poll_s)
        return None

    def try_acquire(self) -> int | None:
        """A free slot marked filling, or ``None`` at once where there is no room."""
        with self.cond:
            return self._take_free()

    def wait_for_room(self, stop: threading.Event, timeout: float) -> None:
        """Return once a slot could be acquired, ``stop`` is set or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not stop.is_set() and self._free() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(min(left, 0.2))

    def _free(self) -> int | None:
        """Under ``cond``: a free usable slot, within the limit, or None."""
        if self.ahead >= self.limit:
            return None
        try:
            return self.states.index(SlotState.FREE, 0, self.usable)
        except ValueError:
            return None

    def _take_free(self) -> int | None:
        """Under ``cond``: a free usable slot marked filling, within the limit, or None."""
        i = self._free()
        if i is not None:
            self.states[i] = SlotState.FILLING
            self.ahead += 1
        return i

    def set_limit(self, limit: int) -> None:
        with self.cond:
            self.limit = max(1, limit)
            self.cond.notify_all()

    def extend(self, nslots: int) -> None:
        """Slots of a new segment, free and usable."""
        with self.cond:
            self.states.extend([SlotState.FREE] * nslots)
            self.usable = len(self.states)
            self.cond.notify_all()

    def retire_from(self, first: int) -> None:
        """Fill no slot at or above ``first`` again (their segments are being retired)."""
        with self.cond:
            self.usable = min(first, len(self.states))
            self.cond.notify_all()

    def free_from(self, first: int) -> bool:
        """True if every slot at or above ``first`` is free."""
        with self.cond:
            return all(s is SlotState.FREE for s in self.states[first:])

    def truncate(self, nslots: int) -> None:
        with self.cond:
            del self.states[nslots:]
            self.usable = min(self.usable, nslots)
            self.ahead = sum(s in _AHEAD for s in self.states)

    def move(self, slot: int, expect: SlotState, to: SlotState) -> bool:
        with self.cond:
            if self.states[slot] is not expect:
                return False
            self.states[slot] = to
            self.ahead += (to in _AHEAD) - (expect in _AHEAD)
            # The producer waits for a free slot *and* for room under the prefetch limit
            # (filling + ready): a slot set free, or one that leaves filling or ready,
            # can be the change it waits for; a slot made ready (filling -> ready) or
            # leased to a trainer that never had it ready cannot.
            if to is SlotState.FREE or expect is not SlotState.FILLING:
                self.cond.notify_all()
            return True

    def starved(self) -> bool:
        """Whether nothing can be made: every usable slot is leased (a trainer holds
        them all), none is being filled and none is ready."""
        with self.cond:
            usable = self.states[: self.usable]
            busy = (SlotState.FILLING, SlotState.READY)
            return all(s is SlotState.LEASED for s in usable) and not any(
                s in busy for s in self.states
            )

    def leased(self) -> int:
        with self.cond:
            return self.states.count(SlotState.LEASED)

    def counts(self) -> dict[str, int]:
        """Read without the lock the per-batch path takes: one copy of the list (atomic
        under the GIL), so a scrape may see a slot one state early or late."""
        states = list(self.states)
        return {s.name.lower(): states.count(s) for s in SlotState}
