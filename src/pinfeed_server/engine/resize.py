"""Growing and shrinking a live loader's ring (a PATCH of num_workers/prefetch_factor).

Growth adds a segment (a further memfd) with the slots the new config lacks; its slots
become fillable at once, and every process that maps the ring (workers, trainers) is
sent the segment's fd before the first batch in it (``pool.py``, ``dataplane.py``).

Shrinking retires the newest segments the config no longer needs in full: their slots
are filled no more, the batches already in them are consumed as usual, and once every
slot of a retired segment is free it is closed (the server's mapping and fd; workers
and trainers are told, and unmap once none of their views uses it). Where the slots
kept fall short of the target (a partly needed segment was retired), a smaller one is
added once the retired ones are closed. Segment 0 (the ring as created) is never
closed: below its size, a PATCH only lowers the prefetch depth.

Called under the engine's resize lock; the slot table has its own.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading

from pinfeed import protocol as p
from pinfeed.protocol import Layout
from pinfeed_server.engine.config import LoaderConfig, prefetch_depth, ring_slots
from pinfeed_server.engine.producers import Producer, producer_kind
from pinfeed_server.engine.ring import Ring, SlotTable

log = logging.getLogger("pinfeed.loader")


def resize_ring(ring: Ring, slots: SlotTable, target: int) -> None:
    """Start moving the ring to ``target`` slots."""
    with slots.cond:
        slots.usable = len(slots.states)  # a new target: nothing retires any more
        slots.cond.notify_all()
    if target > ring.nslots:
        slots.extend(ring.grow(target - ring.nslots).nslots)
        return
    # Keep segment 0 and every later segment the target needs in full.
    keep = 0
    for info, _ in ring.segments():
        if info.id == 0 or info.end <= target:
            keep = info.end
    if keep < ring.nslots:
        slots.retire_from(keep)


def pending(ring: Ring, slots: SlotTable, target: int) -> bool:
    """Segments retiring, or slots still to add (read without locks: a hint)."""
    return slots.usable < ring.nslots or (ring.nslots < target and slots.usable == ring.nslots)


def close_retired(ring: Ring, slots: SlotTable, target: int) -> bool:
    """Close retired segments whose slots are all free, newest first; then, when none
    retires any more, add the slots still short of ``target``. True if a segment closed."""
    closed = False
    while ring.nslots > slots.usable:
        last = ring.segments()[-1][0]
        if last.id == 0 or last.first < slots.usable or not slots.free_from(last.first):
            break
        ring.close_last()
        slots.truncate(last.first)
        closed = True
    if ring.nslots == slots.usable and ring.nslots < target:
        slots.extend(ring.grow(target - ring.nslots).nslots)
    return closed


def announce_segments(conn: socket.socket, ring: Ring, known: set[int]) -> tuple[int, set[int]]:
    """Tell a trainer of the ring's new segments (SEGMENT + memfd) and of the closed ones
    (SEGMENT with 0 slots), before an item that may use them; the generation and the
    segments it now has."""
    with ring.lock:  # no segment closes while its fd is on the way
        now = {info.id: (info, fd) for info, fd in ring.segments()}
        for sid in sorted(set(now) - known):
            info, fd = now[sid]
            body = p.SEGMENT_BODY.pack(p.SEGMENT, sid, info.first, info.nslots)
            rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))
            conn.sendmsg([body], [rights])
        for sid in sorted(known - set(now)):
            conn.send(p.SEGMENT_BODY.pack(p.SEGMENT, sid, 0, 0))
        return ring.generation, set(now)


class LiveResize:
    """The live-PATCH half of ``LoaderEngine`` (its base class)."""

    config: LoaderConfig
    ring: Ring | None
    slots: SlotTable
    producer: Producer | None
    target_slots: int
    layout: Layout
    _submit: threading.Lock
    _resize: threading.Lock
    _stop: threading.Event

    def _new_producer(self, processes: int) -> Producer:
        raise NotImplementedError

    def reconfigure(self, num_workers: int, prefetch_factor: int) -> None:
        """Apply new ``num_workers``/``prefetch_factor`` live, keeping position and batches:
        the ring grows (a new segment) or retires segments to fit (above), and
        a change between 0 and >0 workers swaps the producer between two batches."""
        new = self.config.model_copy(
            update={"num_workers": num_workers, "prefetch_factor": prefetch_factor}
        )
        with self._resize:
            if self.ring is not None:
                resize_ring(self.ring, self.slots, ring_slots(new))
                self.target_slots = ring_slots(new)
            self.slots.set_limit(prefetch_depth(new))
            if self.producer is not None:
                if producer_kind(new) != producer_kind(self.config):
                    self._swap_producer(num_workers)
                else:
                    self.producer.resize(num_workers)
            self.config = new
        self.upkeep()
        log.info(
            "loader %s: num_workers=%d prefetch_factor=%d (%d slots ahead; ring %d slots, "
            "%d wanted)",
            new.name,
            num_workers,
            prefetch_factor,
            prefetch_depth(new),
            self.ring.nslots if self.ring else 0,
            self.target_slots,
        )

    def _swap_producer(self, processes: int) -> None:
        """Between 0 and >0 workers: the new producer starts while the old one runs on;
        then, between two submits, the new one takes over, and the old one finishes
        what it holds (results still publish in order) before it closes."""
        fresh = self._new_producer(processes)
        with self._submit:
            old, self.producer = self.producer, fresh
        assert old is not None
        old.close(drain=True)

    def upkeep(self) -> None:
        """Close retired segments whose slots are all free, then add what the config
        still lacks (above); cheap when nothing is pending."""
        ring = self.ring
        if ring is None or self._stop.is_set() or not pending(ring, self.slots, self.target_slots):
            return
        # Never wait here (a data-plane thread, releasing a slot): a reconfigure in
        # progress runs this itself when it is done.
        if not self._resize.acquire(blocking=False):
            return
        try:
            if close_retired(ring, self.slots, self.target_slots) and self.producer is not None:
                self.producer.segments_changed()
        finally:
            self._resize.release()

    def reserved_bytes(self) -> int:
        """Ring memory this loader holds or is about to (the budget's view of it)."""
        now = self.ring.size if self.ring is not None else 0
        return max(now, self.target_slots * self.layout.slot_bytes)
