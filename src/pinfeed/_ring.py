"""The trainer's mapping of a ring: mmap once, register with CUDA once.

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
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.base}
        self.cuda_registered = False
        self._closed = False
        reclaim_parked()

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole ring viewed as ``dtype`` (views are built from these)."""
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self.base.view(dtype)
        return t

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
        # Our own references: base, and the typed views (each holds the storage too).
        own = self._own_users + len(self._typed) - 1
        return _storage_users(self.base) > own

    def close(self) -> bool:
        """Unmap if no view is alive; else park until they are gone. True if unmapped."""
        if self._closed:
            return True
        if self._views_alive():
            with _parked_lock:
                if self not in _parked:
                    _parked.append(self)
            return False
        self._closed = True
        if self.cuda_registered:
            # Unregister before unmapping; never after.
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            torch.cuda.check_error(cudart.cudaHostUnregister(self.ptr))
            self.cuda_registered = False
        self._typed.clear()
        del self.base
        self._mm.close()
        return True


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

    def close_extra(self) -> None:
        """Unmap (or park) every segment but 0, which the loader closes itself."""
        for sid in [s for s in self._maps if s != 0]:
            self._maps.pop(sid)[2].close()
        self._index()
