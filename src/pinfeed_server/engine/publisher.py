"""The in-order publisher: results arrive in any order, consumers get sampler order.

The engine registers every task it submits (``add``: a sequence number, the batch's
place, its slot); producers' results come back through ``accept`` in any order and
are published strictly by sequence number: a batch, or an error (``on_error``), then
an END after an epoch's last batch. A seek (``restart``) abandons everything in
flight: results for it are dropped when they come, never published.

Not thread-safe by itself: the engine calls it under its condition variable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pinfeed.protocol import ErrorInfo
from pinfeed_server.engine.consumers import BatchItem, Consumers, EndItem, ErrorItem
from pinfeed_server.engine.producers import Result
from pinfeed_server.engine.ring import SlotState, SlotTable
from pinfeed_server.engine.stats import LoaderStats

log = logging.getLogger("pinfeed.loader")


@dataclass(slots=True)
class InFlight:
    """A submitted task, as the publisher needs it."""

    epoch: int
    index: int
    slot: int
    rows: int
    last: bool  # the plan's last batch of its epoch: END follows it


class Publisher:
    def __init__(
        self,
        name: str,
        consumers: Consumers,
        slots: SlotTable,
        stats: LoaderStats,
        slot_bytes: int,
        on_error: str,
    ) -> None:
        self.name = name
        self.consumers = consumers
        self.slots = slots
        self.stats = stats
        self.slot_bytes = slot_bytes
        self.on_error = on_error
        self._tasks: dict[int, InFlight] = {}
        self._done: dict[int, Result] = {}
        self.next_seq = 0  # the next task's sequence number
        self.next_publish = 0  # the sequence number published next
        self.head = (0, 0)  # (epoch, index) published next
        self.ended = -1  # the last epoch whose END was published

    def add(self, epoch: int, index: int, slot: int, rows: int, last: bool) -> int:
        """Register a task about to be submitted; returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        self._tasks[seq] = InFlight(epoch, index, slot, rows, last)
        return seq

    def accept(self, result: Result) -> int | None:
        """Take a result and publish what is now in order. Returns the epoch a producer
        ended early (its iterator ran out), whose production must stop, else None."""
        if result.seq < self.next_publish:  # produced for a position a seek abandoned
            task = self._tasks.pop(result.seq, None)
            if task is not None:
                self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
            return None
        self._done[result.seq] = result
        ended = None
        while self.next_publish in self._done:
            epoch = self._publish(self._done.pop(self.next_publish))
            ended = epoch if epoch is not None else ended
        return ended

    def _publish(self, result: Result) -> int | None:
        task = self._tasks.pop(result.seq)
        self.next_publish += 1
        if result.end or task.epoch <= self.ended:
            # The producer's stream for this epoch ran out: END now; the epoch's tasks
            # still in flight come back after it and are dropped here, in order.
            self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
            if task.epoch <= self.ended:
                return None
            self._end_epoch(task.epoch, result.seq, result.rng)
            return task.epoch
        self.head = (task.epoch, task.index + 1)
        if result.rows == 0 and result.error is None:
            # An iterable's turn whose worker has run out, or a batch fed ahead that its
            # trainer never asked for (producers/inline.py): nothing to publish.
            self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
            return None
        rows = task.rows if result.rows is None else result.rows
        if result.error is None:
            self.slots.move(task.slot, SlotState.FILLING, SlotState.READY)
            self.consumers.publish(
                BatchItem(
                    task.slot,
                    result.seq,
                    task.epoch,
                    task.index,
                    rows,
                    result.strings,
                    result.rng,
                    result.own,
                )
            )
            self.stats.produced(rows, self.slot_bytes)
        else:
            self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
            self._record_error(task, result.error)
            if self.on_error == "raise":
                self.consumers.publish(ErrorItem(result.seq, task.epoch, task.index, result.error))
        if task.last:
            self._end_epoch(task.epoch, result.seq)
        return None

    def _end_epoch(self, epoch: int, seq: int, rng: bytes = b"") -> None:
        self.consumers.publish(EndItem(epoch, seq, rng))
        self.head = (epoch + 1, 0)
        self.ended = epoch

    def _record_error(self, task: InFlight, error: ErrorInfo) -> None:
        self.stats.errors += 1
        if self.on_error == "skip":
            self.stats.skipped += 1
        log.warning(
            "loader %s: batch %d of epoch %d %s: %s",
            self.name,
            task.index,
            task.epoch,
            "skipped" if self.on_error == "skip" else "failed",
            error.detail,
        )

    def restart(self, epoch: int, index: int) -> None:
        """A seek: abandon every task in flight and publish from (epoch, index) on."""
        self.head = (epoch, index)
        self.next_publish = self.next_seq
        self.ended = epoch - 1
        for seq in list(self._done):
            self._done.pop(seq)
            self.slots.move(self._tasks.pop(seq).slot, SlotState.FILLING, SlotState.FREE)
        self.consumers.reset()
