"""A live loader's ring moved to the slots its configuration wants (a PATCH, autotune or
the node arbiter changing num_workers/prefetch_factor).

Growth adds a segment (a further memfd) with the slots the new config lacks; its slots
become fillable at once, and every process that maps the ring (workers, trainers) is
sent the segment's fd before the first batch in it (``producers/pool.py``,
``session.py``).

Shrinking retires the newest segments the config no longer needs in full: their slots
are filled no more, the batches already in them are consumed as usual, and once every
slot of a retired segment is free it is closed (the server's mapping and fd; workers
and trainers are told, and unmap once none of their views uses it). Where the slots
kept fall short of the target (a partly needed segment was retired), a smaller one is
added once the retired ones are closed. Segment 0 (the ring as created) is never
closed: below its size, a change only lowers the prefetch depth.

Not thread-safe by itself: the engine serializes ``retarget`` and ``upkeep`` (its
reconfigure lock); the slot table has its own lock.
"""

from __future__ import annotations

from pinfeed_server.engine.ring import Ring, SlotTable


class RingResizer:
    def __init__(self, ring: Ring, slots: SlotTable) -> None:
        self.ring = ring
        self.slots = slots
        self.target = ring.nslots  # the slots the current config wants

    def retarget(self, target: int) -> None:
        """Start moving the ring to ``target`` slots."""
        ring, slots = self.ring, self.slots
        self.target = target
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

    @property
    def pending(self) -> bool:
        """Segments retiring, or slots still to add (read without locks: a hint)."""
        ring, usable = self.ring, self.slots.usable
        return usable < ring.nslots or (ring.nslots < self.target and usable == ring.nslots)

    def upkeep(self) -> bool:
        """Close retired segments whose slots are all free, newest first; then, when none
        retires any more, add the slots still short of the target. True if a segment
        closed (the producer's processes must unmap it)."""
        ring, slots = self.ring, self.slots
        closed = False
        while ring.nslots > slots.usable:
            last = ring.segments()[-1][0]
            if last.id == 0 or last.first < slots.usable or not slots.free_from(last.first):
                break
            ring.close_last()
            slots.truncate(last.first)
            closed = True
        if ring.nslots == slots.usable and ring.nslots < self.target:
            slots.extend(ring.grow(self.target - ring.nslots).nslots)
        return closed

    def reserved_bytes(self) -> int:
        """Ring memory the loader holds or is about to (the node budget's view of it)."""
        return max(self.ring.size, self.target * self.ring.slot_bytes)
