"""One loader: sampler -> workers (or an in-process thread) -> in-order publisher.

Prefetch starts when the loader is created and runs on across epoch boundaries,
bounded only by free ring slots. Results may finish in any order; the publisher
hands them to the consumers in sampler order, with an END marker after each epoch.
``seek`` (set_epoch, resume) moves production to any (epoch, index): work for the
old position is discarded by sequence number, never published.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from pinfeed._protocol import ErrorInfo
from pinfeed_server.datasets import DatasetContext
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.consumers import BatchItem, Consumers, EndItem, ErrorItem, Item
from pinfeed_server.engine.errors import (
    GroupMemberLost,
    InvalidPosition,
    LoaderBusy,
    LoaderFailed,
    LoaderStopping,
    error_info,
)
from pinfeed_server.engine.ring import Ring, SlotState, SlotTable
from pinfeed_server.engine.sampler import EpochSampler
from pinfeed_server.engine.stats import LoaderStats
from pinfeed_server.engine.workers import Result, WorkerPool, WorkerSpec

log = logging.getLogger("pinfeed.loader")

__all__ = ["BatchItem", "EndItem", "ErrorItem", "Item", "LoaderConfig", "LoaderEngine"]


@dataclass(frozen=True)
class LoaderConfig:
    name: str
    dataset: str
    batch_size: int = 1
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    rank: int = 0
    world_size: int | None = None
    group_size: int = 1
    group_mode: str = "broadcast"
    group_timeout_s: float = 300.0
    on_error: str = "raise"


@dataclass(frozen=True)
class _Task:
    epoch: int
    index: int
    slot: int
    rows: int


def prefetch_depth(config: LoaderConfig) -> int:
    """Batches being made or ready ahead of the trainers, as DataLoader keeps
    ``num_workers * prefetch_factor`` in flight (one with ``num_workers=0``)."""
    return max(1, config.num_workers * config.prefetch_factor)


def ring_slots(config: LoaderConfig) -> int:
    """The prefetch depth, plus two slots per trainer: the batch it is using and the
    one announced ahead (the client keeps one NEXT in flight)."""
    return prefetch_depth(config) + 2 * config.group_size


def make_sampler(config: LoaderConfig, length: int) -> EpochSampler:
    return EpochSampler(
        length,
        config.batch_size,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=config.drop_last,
        rank=config.rank,
        world_size=config.world_size,
    )


class LoaderEngine:
    """States: starting -> ready | failed; draining -> closed when deleted."""

    def __init__(
        self,
        config: LoaderConfig,
        dataset: Any,
        kind: str,
        params: dict[str, Any],
        context: DatasetContext,
        layout: Layout,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.layout = layout
        self.sampler = make_sampler(config, len(dataset))
        self.batches_per_epoch = len(self.sampler)
        self.state = "starting"
        self.failure: ErrorInfo | None = None
        self.stats = LoaderStats()
        self._kind, self._params, self._context = kind, params, context
        self.nslots = ring_slots(config)
        self.ring: Ring | None = None
        self._writer: SlotWriter | None = None
        self.slots = SlotTable(self.nslots)
        self.slots.set_limit(prefetch_depth(config))
        self.consumers = Consumers(config.group_size, config.group_mode, self.slots)
        self.pool: WorkerPool | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._tasks: dict[int, _Task] = {}
        self._done: dict[int, Result] = {}
        self._seq = 0  # next sequence number the producer assigns
        self._next_publish = 0  # next sequence number to publish
        self._gen = 0  # bumped by seek: the producer restarts at _cursor
        self._cursor = (0, 0)  # (epoch, index) the producer makes next
        self.head = (0, 0)  # (epoch, index) the publisher publishes next
        self.cuda_registered: set[int] = set()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        t = threading.Thread(
            target=self._boot, name=f"pinfeed-boot-{self.config.name}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def _boot(self) -> None:
        try:
            self.ring = Ring(self.config.name, self.nslots, self.layout.slot_bytes)
            self._writer = SlotWriter(
                self.dataset, self.layout, self.ring.base, self.ring.slot_bytes
            )
            if self.config.num_workers > 0:
                spec = WorkerSpec(
                    self.config.name,
                    self._kind,
                    self._params,
                    self._context,
                    self.layout.to_json(),
                    self.ring.size,
                    self.ring.slot_bytes,
                    self.config.seed,
                )
                self.pool = WorkerPool(
                    spec, self.ring.fd, self.config.num_workers, self._on_result, self._fail
                )
        except Exception as exc:
            log.exception("loader %s failed to start", self.config.name)
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        producer = threading.Thread(
            target=self._produce, name=f"pinfeed-produce-{self.config.name}", daemon=True
        )
        self._threads.append(producer)
        with self._cond:
            if self.state == "starting":
                self.state = "ready"
            self._cond.notify_all()
        producer.start()

    def _fail(self, detail: str) -> None:
        with self._cond:
            self.state = "failed"
            self.failure = LoaderFailed(detail).info()
            self._cond.notify_all()
        self._stop.set()

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.state == "starting":
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"loader {self.config.name} still starting after {timeout}s")
                self._cond.wait(min(left, 0.5))

    def stop(self) -> None:
        """Stop producing (idempotent); consumers get 'stopping' once the queue is empty."""
        with self._cond:
            if self.state not in ("draining", "closed"):
                self.state = "draining"
            self._cond.notify_all()
        self._stop.set()
        with self.slots.cond:
            self.slots.cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self.state == "closed":
                return
        self.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(10)
        if self.pool is not None:
            self.pool.close()
        if self.ring is not None:
            if self._writer is not None:
                self._writer.close()
            self.ring.close()
        with self._cond:
            self.state = "closed"
            self._cond.notify_all()

    # -- producer ----------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    gen, (epoch, index) = self._gen, self._cursor
                self._produce_from(gen, epoch, index)
        except Exception as exc:  # a bug here must reach the consumer, not vanish
            log.exception("loader %s: producer failed", self.config.name)
            self._fail(f"producer failed: {type(exc).__name__}: {exc}")

    def _produce_from(self, gen: int, epoch: int, index: int) -> None:
        """Produce from (epoch, index) on until a seek (new generation) or stop."""
        while not self._stop.is_set():
            for i, indices in enumerate(self.sampler.batches(epoch, index), start=index):
                slot = self.slots.acquire_free(self._stop)
                if slot is None:
                    return
                with self._cond:
                    if self._gen != gen:
                        self.slots.move(slot, SlotState.FILLING, SlotState.FREE)
                        return
                    seq = self._seq
                    self._seq += 1
                    self._tasks[seq] = _Task(epoch, i, slot, len(indices))
                    self._cursor = (epoch, i + 1)
                if self.pool is not None:
                    self.pool.submit(seq, slot, indices)
                else:
                    self._on_result(self._run_inline(seq, slot, indices))
            epoch, index = epoch + 1, 0
            with self._cond:
                if self._gen != gen:
                    return
                self._cursor = (epoch, 0)

    def _run_inline(self, seq: int, slot: int, indices: list[int]) -> Result:
        assert self._writer is not None
        t0 = time.perf_counter()
        try:
            result: Result = (seq, self._writer.write(slot, indices), None)
        except Exception as exc:
            result = (seq, b"", error_info(exc))
        self.stats.add_busy(time.perf_counter() - t0)
        return result

    # -- publisher -----------------------------------------------------------------------
    def _on_result(self, result: Result) -> None:
        last = self.batches_per_epoch - 1
        with self._cond:
            seq = result[0]
            if seq < self._next_publish:  # produced for a position a seek abandoned
                task = self._tasks.pop(seq, None)
                if task is not None:
                    self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
                return
            self._done[seq] = result
            while self._next_publish in self._done:
                seq, strings, error = self._done.pop(self._next_publish)
                task = self._tasks.pop(seq)
                self._next_publish += 1
                self.head = (task.epoch, task.index + 1)
                if error is None:
                    self.slots.move(task.slot, SlotState.FILLING, SlotState.READY)
                    self.consumers.publish(
                        BatchItem(task.slot, seq, task.epoch, task.index, task.rows, strings)
                    )
                    self.stats.produced(task.rows, self.layout.slot_bytes)
                else:
                    self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
                    self._record_error(task, error)
                    if self.config.on_error == "raise":
                        self.consumers.publish(ErrorItem(seq, task.epoch, task.index, error))
                if task.index == last:
                    self.consumers.publish(EndItem(task.epoch, seq))
                    self.head = (task.epoch + 1, 0)
            self._cond.notify_all()

    def _record_error(self, task: _Task, error: ErrorInfo) -> None:
        self.stats.errors += 1
        if self.config.on_error == "skip":
            self.stats.skipped += 1
        log.warning(
            "loader %s: batch %d of epoch %d %s: %s",
            self.config.name,
            task.index,
            task.epoch,
            "skipped" if self.config.on_error == "skip" else "failed",
            error.detail,
        )

    def reconfigure(self, num_workers: int, prefetch_factor: int) -> None:
        """Apply new ``num_workers``/``prefetch_factor`` live, keeping position and batches.

        Raises ValueError when the change needs a different ring (more slots than it
        has) or moves between in-server (0) and worker-process production.
        """
        new = replace(self.config, num_workers=num_workers, prefetch_factor=prefetch_factor)
        need = ring_slots(new)
        if (num_workers == 0) != (self.config.num_workers == 0):
            raise ValueError(
                "switching between num_workers=0 (in-server) and worker processes needs the "
                "loader recreated; carry the position with Loader.state_dict()"
            )
        if need > self.nslots:
            raise ValueError(
                f"num_workers={num_workers} x prefetch_factor={prefetch_factor} needs {need} "
                f"ring slots; this loader's ring has {self.nslots}. Lower them, or recreate "
                "the loader (carry the position with Loader.state_dict())"
            )
        if self.pool is not None:
            self.pool.resize(num_workers)
        self.slots.set_limit(prefetch_depth(new))
        self.config = new
        log.info(
            "loader %s: num_workers=%d prefetch_factor=%d (%d of %d slots ahead)",
            new.name,
            num_workers,
            prefetch_factor,
            prefetch_depth(new),
            self.nslots,
        )

    def seek(self, member: int, epoch: int, index: int) -> None:
        """Make (epoch, index) the next batch; keep the warm queue if it already is."""
        if not (0 <= index < self.batches_per_epoch and 0 <= epoch < 2**31):
            raise InvalidPosition(
                f"position ({epoch}, {index}) is outside the loader's "
                f"{self.batches_per_epoch} batches per epoch"
            )
        with self._cond:
            if self.consumers.position(member, self.head) == (epoch, index):
                return
            self._seek_locked(epoch, index)
        log.info("loader %s: seek to epoch %d batch %d", self.config.name, epoch, index)

    def _seek_locked(self, epoch: int, index: int) -> None:
        """The body of ``seek``, under ``self._cond``."""
        self._gen += 1
        self._cursor = (epoch, index)
        self.head = (epoch, index)
        self._next_publish = self._seq
        for seq in [s for s in self._done if s < self._seq]:
            self._done.pop(seq)
            task = self._tasks.pop(seq)
            self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
        self.consumers.reset()
        self._cond.notify_all()

    def skip_epoch(self, member: int) -> EndItem | None:
        """Abandon the rest of the member's epoch (its trainer broke out of the loop):
        the next item is the next epoch's first batch, and what was produced or is in
        flight for this one is dropped, not waited for. Returns the epoch's END, or None
        where the rest must be drained instead: a group (the other members still want
        those batches), or a member already at the epoch's end."""
        with self._cond:
            if self.consumers.size != 1:
                return None
            epoch, index = self.consumers.position(member, self.head)
            if index == 0:
                return None
            self._seek_locked(epoch + 1, 0)
            return EndItem(epoch, max(0, self._next_publish - 1))

    # -- consumer side (called from the data-plane threads) ------------------------------
    def attach(self, member: int | None, wait_s: float = 2.0) -> int:
        """Join the consumer group. A trainer that restarts at once may arrive before the
        server has seen its old connection close, so a busy member is waited for briefly."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                try:
                    return self.consumers.join(member)
                except LookupError as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LoaderBusy(f"loader {self.config.name!r}: {exc}") from None
                    self._cond.wait(min(left, 0.1))

    def detach(self, member: int, leased: set[int]) -> None:
        with self._cond:
            self.consumers.leave(member, leased)
            self.cuda_registered.discard(member)
            self._cond.notify_all()

    def release(self, member: int, slots: set[int] | list[int]) -> None:
        with self._cond:
            self.consumers.release(member, slots)

    def position(self, member: int) -> tuple[int, int]:
        with self._cond:
            return self.consumers.position(member, self.head)

    def next_item(self, member: int, stop: threading.Event, timeout: float = 0.5) -> Item | None:
        """The member's next item in sampler order, or None if none came within
        ``timeout`` (the data plane then looks at its socket and asks again)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (item := self.consumers.take(member)) is None:
                if self.state == "failed" and self.failure is not None:
                    return ErrorItem(-1, -1, -1, self.failure)
                if stop.is_set() or self.state in ("draining", "closed"):
                    stopping = LoaderStopping(
                        f"loader {self.config.name!r} was deleted or is stopping"
                    )
                    return ErrorItem(-1, -1, -1, stopping.info())
                lost = self.consumers.lost(self.config.group_timeout_s)
                if lost:
                    gone = GroupMemberLost(
                        f"group members {lost} of loader {self.config.name!r} have "
                        f"been gone for over {self.config.group_timeout_s} s; the "
                        "group waits for them: restart them, or recreate the loader"
                    )
                    return ErrorItem(-1, -1, -1, gone.info())
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
        if isinstance(item, BatchItem):
            self.stats.consumed(item.rows)
        return item

    def stats_snapshot(self) -> dict[str, Any]:
        busy = self.pool.busy_seconds() if self.pool else 0.0
        with self._cond:
            members = max(1, self.consumers.attached)
        return self.stats.snapshot(busy, self.config.num_workers, members)

    def public_status(self) -> dict[str, Any]:
        ring = self.ring
        with self._cond:
            head = self.head
            members = [
                {
                    "member": m.index,
                    "attached": m.connected,
                    "position": list(self.consumers.position(m.index, head)),
                    "cuda_registered": m.index in self.cuda_registered,
                }
                for m in self.consumers.members
            ]
        first = self.consumers.position(0, head)
        return {
            "state": self.state,
            "failure": self.failure.to_json() if self.failure else None,
            "ring_bytes": self.nslots * self.layout.slot_bytes,
            "slot_bytes": self.layout.slot_bytes,
            "slots": self.slots.counts() | {"total": self.nslots},
            "page_locked": bool(ring and ring.page_locked),
            "consumer_attached": any(m["attached"] for m in members),
            "consumer_cuda_registered": bool(self.cuda_registered),
            "members": members,
            "epoch": first[0],
            "position": first[1],
            "batches_per_epoch": self.batches_per_epoch,
            "worker_restarts": self.pool.restarts if self.pool else 0,
        }
