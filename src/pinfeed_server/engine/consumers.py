"""Consumers of one loader: a group of ``size`` members reading the published stream.

The publisher appends items (batches, errors, end-of-epoch markers) in sampler order.
Each member has a cursor into that stream and receives:

- ``broadcast``: every item; a batch's slot is shared, one copy in memory, and is
  freed when every member has released it;
- ``split``: batch ``i`` of each epoch goes to member ``i % size`` (round-robin, in
  order); end-of-epoch markers go to every member. An iterable's indices are turns,
  with gaps once a worker has run out: its ``k``-th published item of an epoch goes to
  member ``k % size`` (``by_arrival``).

A single trainer is a broadcast group of size 1. A member that disconnects keeps its
cursor; the group waits for it to come back (bounded by the loader's
``group_timeout_s``) rather than skipping or reordering anything.

Not thread-safe by itself: the loader calls it under its condition variable.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from pinfeed.errors import InvalidPosition
from pinfeed.protocol import ErrorInfo
from pinfeed_server.engine.ring import OwnBuffer, SlotState, SlotTable


@dataclass(frozen=True)
class BatchItem:
    slot: int
    seq: int
    epoch: int
    index: int
    rows: int
    strings: bytes
    rng: bytes = b""  # the trainer's RNG states after the batch (an RNG message first)
    # Not in its slot but in a buffer of its own (a pinfeed.DataLoader's: FLAG_OWN),
    # whose fd closes when the item goes, sent or dropped.
    own: OwnBuffer | None = None


@dataclass(frozen=True)
class EndItem:
    epoch: int
    seq: int
    rng: bytes = b""  # the trainer's RNG states after the epoch's last turn (inline.py)


@dataclass(frozen=True)
class ErrorItem:
    """A failed batch, published in its place; or (seq, epoch and index -1) an error of
    the loader itself, handed to a waiting consumer. ``info.fatal``: it ends the
    connection."""

    seq: int
    epoch: int
    index: int
    info: ErrorInfo


Item = BatchItem | EndItem | ErrorItem


@dataclass
class _Entry:
    pos: int
    item: Item
    recipients: set[int]  # members that have not taken it yet


@dataclass
class Member:
    index: int
    connected: bool = False
    cursor: int = 0  # absolute stream position of the next entry to look at
    since: float = field(default_factory=time.monotonic)  # connected/disconnected since
    waited_s: float = 0.0


class Consumers:
    def __init__(self, size: int, mode: str, slots: SlotTable) -> None:
        self.size = size
        self.mode = mode
        self.members = [Member(i) for i in range(size)]
        self.slots = slots
        self._log: collections.deque[_Entry] = collections.deque()
        self._next_pos = 0
        self._holders: dict[int, set[int]] = {}  # slot -> members holding it
        self._pending: dict[int, set[int]] = {}  # slot -> members yet to take it
        self.by_arrival = False  # split by arrival order in the epoch, not by index
        self._arrived = 0  # items published in the epoch so far

    # -- membership ------------------------------------------------------------------
    def join(self, member: int | None) -> int:
        if member is None:
            free = [m.index for m in self.members if not m.connected]
            if not free:
                if self.size == 1:
                    raise LookupError(
                        "already has a consumer: one trainer per loader, unless the loader "
                        "is created with group_size for several"
                    )
                raise LookupError(f"all {self.size} members of its consumer group are attached")
            member = free[0]
        if not 0 <= member < self.size:
            raise InvalidPosition(f"member {member} is outside [0, {self.size - 1}]")
        m = self.members[member]
        if m.connected:
            raise LookupError(f"member {member} is already attached")
        m.connected = True
        m.since = time.monotonic()
        return member

    def leave(self, member: int, leased: set[int]) -> None:
        self.release(member, leased)
        m = self.members[member]
        m.connected = False
        m.since = time.monotonic()

    @property
    def attached(self) -> int:
        return sum(m.connected for m in self.members)

    def lost(self, timeout_s: float) -> list[int]:
        """Members disconnected for longer than ``timeout_s`` while others are attached."""
        now = time.monotonic()
        if not self.attached:
            return []
        return [m.index for m in self.members if not m.connected and now - m.since > timeout_s]

    # -- publishing ------------------------------------------------------------------
    def _recipients(self, item: Item) -> set[int]:
        if isinstance(item, EndItem):
            self._arrived = 0
        elif self.mode == "split":
            self._arrived += 1
            return {(self._arrived - 1 if self.by_arrival else item.index) % self.size}
        return set(range(self.size))

    def publish(self, item: Item) -> None:
        recipients = self._recipients(item)
        if isinstance(item, BatchItem):
            self._pending[item.slot] = set(recipients)
            self._holders[item.slot] = set()
        self._log.append(_Entry(self._next_pos, item, recipients))
        self._next_pos += 1

    def _find(self, member: int) -> _Entry | None:
        cursor = self.members[member].cursor
        for entry in self._log:
            if entry.pos >= cursor and member in entry.recipients:
                return entry
        return None

    def take(self, member: int) -> Item | None:
        entry = self._find(member)
        if entry is None:
            return None
        entry.recipients.discard(member)
        self.members[member].cursor = entry.pos + 1
        item = entry.item
        if isinstance(item, BatchItem):
            self._pending[item.slot].discard(member)
            self._holders[item.slot].add(member)
            self.slots.move(item.slot, SlotState.READY, SlotState.LEASED)
        self._trim()
        return item

    def _trim(self) -> None:
        while self._log and not self._log[0].recipients:
            self._log.popleft()

    def release(self, member: int, slots: set[int] | list[int]) -> None:
        for slot in slots:
            holders = self._holders.get(slot)
            if holders is None or member not in holders:
                continue
            holders.discard(member)
            self._maybe_free(slot)

    def _maybe_free(self, slot: int) -> None:
        if not self._holders.get(slot) and not self._pending.get(slot):
            self._holders.pop(slot, None)
            self._pending.pop(slot, None)
            if not self.slots.move(slot, SlotState.LEASED, SlotState.FREE):
                self.slots.move(slot, SlotState.READY, SlotState.FREE)

    def position(self, member: int, head: tuple[int, int]) -> tuple[int, int]:
        """(epoch, index) of the next batch ``member`` would receive."""
        entry = self._find(member)
        if entry is None:
            return head
        item = entry.item
        if isinstance(item, EndItem):
            return (item.epoch + 1, 0)
        return (item.epoch, item.index)

    def reset(self) -> None:
        """Drop every published item not yet taken (a seek); held slots stay leased."""
        for entry in self._log:
            if isinstance(entry.item, BatchItem):
                self._pending[entry.item.slot] = set()
                self._maybe_free(entry.item.slot)
        self._log.clear()
        self._arrived = 0
        for m in self.members:
            m.cursor = self._next_pos
