"""The trainer's mapping of a ring: mmap once, register with CUDA once.

Each slot's memory is a storage of its own (``SlotMemory``, over the same mapping):
the views of a batch are of that storage alone, so how many tensors hold it says
whether the trainer still uses the batch in that slot (``pinfeed._views.Delivery``).

Never unmaps while views are alive: ``close()`` checks that no tensor still uses
the mapping; if one does, the mapping (and its CUDA registration) is parked and
reclaimed by a later ``close()`` or attach once those views are gone.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

import torch

log = logging.getLogger("pinfeed.client")

_parked: list[RingMapping] = []
_parked_lock = threading.Lock()


def _storage_users(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class SlotMemory:
    """One slot of a ring mapping as a storage of its own, its views by dtype, and the
    leaf views of its batches by their dims (``pinfeed._views.BatchViews``' cache)."""

    MAX_CACHED = 4  # batch shapes whose leaf views are kept (many lengths: bounded)

    def __init__(self, mm: mmap.mmap, offset: int, nbytes: int) -> None:
        self.base = torch.frombuffer(memoryview(mm)[offset : offset + nbytes], dtype=torch.uint8)
        # what holds the storage besides the views (frombuffer's own reference)
        self._held_within = _storage_users(self.base) - 1
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.base}
        self.cached: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def cache(self, dims: tuple[int, ...], views: list[torch.Tensor]) -> None:
        if len(self.cached) >= self.MAX_CACHED:
            self.cached.clear()
        self.cached[dims] = views

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The slot viewed as ``dtype`` (a batch's views are built from these)."""
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self.base.view(dtype)
        return t

    def alive(self) -> bool:
        """Whether a tensor other than its own views (by dtype, and cached) holds it:
        the trainer still holds a batch of this slot."""
        own = self._held_within + len(self._typed) + sum(len(v) for v in self.cached.values())
        return _storage_users(self.base) > own


class RingMapping:
    def __init__(self, fd: int, size: int) -> None:
        try:
            self._mm = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)  # the mapping keeps the memfd alive
        self.size = size
        self.base = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.ptr = self.base.data_ptr()
        self._own_users = _storage_users(self.base)
        self._slots: dict[int, SlotMemory] = {}  # by offset
        self.cuda_registered = False
        self._closed = False
        self._unmapping = False  # no view was alive: unmapped once the last export goes
        reclaim_parked()

    def slot(self, offset: int, nbytes: int) -> SlotMemory:
        """The slot at ``offset`` as a storage of its own."""
        memory = self._slots.get(offset)
        if memory is None:
            memory = self._slots[offset] = SlotMemory(self._mm, offset, nbytes)
        return memory

    def register_cuda(self) -> None:
        """Page-lock the whole ring for CUDA once, so every view is ``is_pinned()``."""
        if self.cuda_registered:
            return
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        torch.cuda.check_error(cudart.cudaHostRegister(self.ptr, self.size, 0))
        self.cuda_registered = True

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr()
        return self.ptr <= start and start + t.numel() * t.element_size() <= self.ptr + self.size

    def _views_alive(self) -> bool:
        # The whole mapping's base holds no view; each slot's memory holds its own.
        return _storage_users(self.base) > self._own_users or any(
            s.alive() for s in self._slots.values()
        )

    def close(self) -> bool:
        """Unmap if no view is alive; else park until they are gone. True if unmapped."""
        if self._closed:
            return True
        if self._unmapping or not self._views_alive():
            self._unmapping = True
            if self.cuda_registered:
                # Unregister before unmapping; never after.
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                torch.cuda.check_error(cudart.cudaHostUnregister(self.ptr))
                self.cuda_registered = False
            self._slots.clear()
            self.base = torch.empty(0, dtype=torch.uint8)
            try:
                self._mm.close()
                self._closed = True
                return True
            except BufferError:
                pass  # a slot's memory still on its way out (a reference not yet dropped)
        with _parked_lock:
            if self not in _parked:
                _parked.append(self)
        return False

    def clear_cached(self) -> None:
        """Drop the cached leaf views of every slot (they keep the mapping)."""
        for memory in self._slots.values():
            memory.cached.clear()


def reclaim_parked() -> None:
    with _parked_lock:
        parked = list(_parked)
        _parked.clear()
    for ring in parked:
        ring.close()


class RingSegments:
    """A ring's segments as the trainer maps them: segment 0 from ATTACHED, further ones
    from SEGMENT messages (a live PATCH grew the ring). Slot ``s`` lives in the segment
    whose slots cover it, at ``(s - first) * slot_bytes``. A closed segment is unmapped
    once no view uses it (``RingMapping.close`` parks it until then)."""

    def __init__(self, first: RingMapping, nslots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.cuda = False  # register new segments with CUDA, as segment 0 was
        self._maps: dict[int, tuple[int, int, RingMapping]] = {0: (0, nslots, first)}
        self._by_slot: list[tuple[RingMapping, int]] = []
        self._index()

    def _index(self) -> None:
        end = max(first + n for first, n, _ in self._maps.values())
        by_slot: list[tuple[RingMapping, int]] = [(self._maps[0][2], 0)] * end
        for first, n, ring in self._maps.values():
            by_slot[first : first + n] = [(ring, first)] * n
        self._by_slot = by_slot

    def of(self, slot: int) -> tuple[RingMapping, int]:
        """(the mapping holding ``slot``, the first slot of that mapping)."""
        return self._by_slot[slot]

    def slot(self, slot: int) -> SlotMemory:
        """Slot ``slot``'s memory (a storage of its own)."""
        ring, first = self._by_slot[slot]
        return ring.slot((slot - first) * self.slot_bytes, self.slot_bytes)

    def update(self, segment: int, first: int, nslots: int, fds: list[int]) -> None:
        """Apply a SEGMENT message: map segment ``segment`` (its memfd in ``fds``), or,
        with 0 slots, let it go."""
        if nslots:
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise ValueError("a SEGMENT that adds slots carries one memfd")
            ring = RingMapping(fds[0], nslots * self.slot_bytes)
            if self.cuda:
                ring.register_cuda()
            self._maps[segment] = (first, nslots, ring)
        elif segment in self._maps and segment != 0:
            self._maps.pop(segment)[2].close()
        self._index()

    def contains(self, t: torch.Tensor) -> bool:
        return any(ring.contains(t) for _, _, ring in self._maps.values())

    def clear_cached(self) -> None:
        for _, _, ring in self._maps.values():
            ring.clear_cached()

    def close_extra(self) -> None:
        """Unmap (or park) every segment but 0, which the loader closes itself."""
        for sid in [s for s in self._maps if s != 0]:
            self._maps.pop(sid)[2].close()
        self._index()
