"""One loader: sampler -> workers (or an in-process thread) -> in-order publisher.

Prefetch starts when the loader is created and runs on across epoch boundaries,
bounded only by free ring slots. Results may finish in any order; the publisher
hands them to the consumer in sampler order, with an END marker after each epoch.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from app.datasets import DatasetContext
from app.engine.collate import Layout, fill_slot
from app.engine.ring import Ring, SlotState, SlotTable
from app.engine.sampler import EpochSampler
from app.engine.stats import LoaderStats
from app.engine.workers import Result, WorkerPool, WorkerSpec, _error_info

log = logging.getLogger("pinfeed.loader")


@dataclass(frozen=True)
class LoaderConfig:
    name: str
    dataset: str
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    num_workers: int
    pin_memory: bool
    prefetch_factor: int


@dataclass(frozen=True)
class BatchItem:
    slot: int
    seq: int
    epoch: int
    index: int
    rows: int
    strings: bytes


@dataclass(frozen=True)
class EndItem:
    epoch: int
    seq: int


@dataclass(frozen=True)
class ErrorItem:
    seq: int
    epoch: int
    index: int
    info: dict[str, Any]


Item = BatchItem | EndItem | ErrorItem


@dataclass(frozen=True)
class _Task:
    epoch: int
    index: int
    slot: int
    rows: int


class LoaderBusyError(RuntimeError):
    pass


def ring_slots(config: LoaderConfig) -> int:
    return max(2, config.num_workers * config.prefetch_factor)


class LoaderEngine:
    """States: starting -> ready | failed; draining while closing."""

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
        self.sampler = EpochSampler(
            len(dataset),
            config.batch_size,
            shuffle=config.shuffle,
            seed=config.seed,
            drop_last=config.drop_last,
        )
        self.state = "starting"
        self.failure: dict[str, Any] | None = None
        self.stats = LoaderStats()
        self._kind, self._params, self._context = kind, params, context
        self.nslots = ring_slots(config)
        self.ring: Ring | None = None
        self.slots = SlotTable(self.nslots)
        self.pool: WorkerPool | None = None
        self._stop = threading.Event()
        self._ready_cond = threading.Condition()
        self._queue: collections.deque[Item] = collections.deque()
        self._tasks: dict[int, _Task] = {}
        self._done: dict[int, Result] = {}
        self._next_publish = 0
        self._consumer = False
        self.position = (0, 0)  # (epoch, index) of the next batch to hand out
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        t = threading.Thread(
            target=self._boot, name=f"pinfeed-boot-{self.config.name}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def _boot(self) -> None:
        try:
            self.ring = Ring(self.config.name, self.nslots, self.layout.slot_bytes)
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
        with self._ready_cond:
            if self.state == "starting":
                self.state = "ready"
            self._ready_cond.notify_all()
        producer.start()

    def _fail(self, detail: str) -> None:
        with self._ready_cond:
            self.state = "failed"
            self.failure = {"type": "loader-failed", "detail": detail}
            self._ready_cond.notify_all()
        self._stop.set()

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._ready_cond:
            while self.state == "starting":
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"loader {self.config.name} still starting after {timeout}s")
                self._ready_cond.wait(min(left, 0.5))

    def close(self) -> None:
        with self._ready_cond:
            if self.state == "closed":
                return
            self.state = "draining"
            self._ready_cond.notify_all()
        self._stop.set()
        with self.slots.cond:
            self.slots.cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(10)
        if self.pool is not None:
            self.pool.close()
        if self.ring is not None:
            self.ring.close()
        with self._ready_cond:
            self.state = "closed"
            self._ready_cond.notify_all()

    # -- producer ------------------------------------------------------------------
    def _produce(self) -> None:
        assert self.ring is not None
        seq = 0
        epoch = 0
        try:
            while not self._stop.is_set():
                for index, indices in enumerate(self.sampler.batches(epoch)):
                    slot = self.slots.acquire_free(self._stop)
                    if slot is None:
                        return
                    with self._ready_cond:
                        self._tasks[seq] = _Task(epoch, index, slot, len(indices))
                    if self.pool is not None:
                        self.pool.submit(seq, slot, indices)
                    else:
                        self._on_result(self._run_inline(seq, slot, indices))
                    seq += 1
                epoch += 1
        except Exception as exc:  # a bug here must reach the consumer, not vanish
            log.exception("loader %s: producer failed", self.config.name)
            self._fail(f"producer failed: {type(exc).__name__}: {exc}")

    def _run_inline(self, seq: int, slot: int, indices: list[int]) -> Result:
        assert self.ring is not None
        t0 = time.perf_counter()
        try:
            strings = fill_slot(self.dataset, self.layout, self.ring.slot(slot), indices)
            result: Result = (seq, strings, None)
        except Exception as exc:
            result = (seq, b"", _error_info(exc))
        self.stats.add_busy(time.perf_counter() - t0)
        return result

    # -- publisher -----------------------------------------------------------------
    def _on_result(self, result: Result) -> None:
        last = len(self.sampler) - 1
        with self._ready_cond:
            self._done[result[0]] = result
            while self._next_publish in self._done:
                seq, strings, error = self._done.pop(self._next_publish)
                task = self._tasks.pop(seq)
                self._next_publish += 1
                if error is None:
                    self.slots.move(task.slot, SlotState.FILLING, SlotState.READY)
                    self._queue.append(
                        BatchItem(task.slot, seq, task.epoch, task.index, task.rows, strings)
                    )
                    self.stats.produced(task.rows, self.layout.slot_bytes)
                else:
                    self.slots.move(task.slot, SlotState.FILLING, SlotState.FREE)
                    self.stats.errors += 1
                    log.warning(
                        "loader %s: batch %d of epoch %d: %s",
                        self.config.name,
                        task.index,
                        task.epoch,
                        error.get("detail"),
                    )
                    self._queue.append(ErrorItem(seq, task.epoch, task.index, error))
                if task.index == last:
                    self._queue.append(EndItem(task.epoch, seq))
            self._ready_cond.notify_all()

    # -- consumer side (called from the data-plane thread) --------------------------
    def attach(self) -> None:
        with self._ready_cond:
            if self._consumer:
                raise LoaderBusyError(
                    f"loader {self.config.name!r} already has a consumer; one trainer per loader"
                )
            self._consumer = True
            self.stats.consumer_attached = True

    def detach(self, leased: set[int]) -> None:
        self.release(leased)
        with self._ready_cond:
            self._consumer = False
            self.stats.consumer_attached = False
            self.stats.consumer_registered = False

    def release(self, slots: set[int] | list[int]) -> None:
        for slot in slots:
            self.slots.move(slot, SlotState.LEASED, SlotState.FREE)

    def next_item(self, stop: threading.Event) -> Item:
        """The next item in sampler order; waits (bounded polls) while none is ready."""
        t0 = time.perf_counter()
        with self._ready_cond:
            while not self._queue:
                if self.state == "failed" and self.failure is not None:
                    return ErrorItem(-1, -1, -1, self.failure)
                if stop.is_set() or self.state in ("draining", "closed"):
                    return ErrorItem(
                        -1,
                        -1,
                        -1,
                        {
                            "type": "server-unavailable",
                            "detail": f"loader {self.config.name!r} was deleted or is stopping",
                        },
                    )
                self._ready_cond.wait(0.5)
            item = self._queue.popleft()
            if isinstance(item, BatchItem):
                self.slots.move(item.slot, SlotState.READY, SlotState.LEASED)
                self.position = (item.epoch, item.index + 1)
            elif isinstance(item, EndItem):
                self.position = (item.epoch + 1, 0)
        if isinstance(item, BatchItem):
            self.stats.consumed(item.rows, time.perf_counter() - t0)
        return item

    def public_status(self) -> dict[str, Any]:
        ring = self.ring
        return {
            "state": self.state,
            "failure": self.failure,
            "ring_bytes": self.nslots * self.layout.slot_bytes,
            "slot_bytes": self.layout.slot_bytes,
            "slots": self.slots.counts() | {"total": self.nslots},
            "page_locked": bool(ring and ring.page_locked),
            "consumer_attached": self.stats.consumer_attached,
            "consumer_cuda_registered": self.stats.consumer_registered,
            "epoch": self.position[0],
            "position": self.position[1],
            "batches_per_epoch": len(self.sampler),
            "worker_restarts": self.pool.restarts if self.pool else 0,
        }


def dims_message(layout: Layout, rows: int) -> bytes:
    """The per-batch leaf dims, packed once per distinct batch length."""
    dims: list[int] = []
    for leaf in layout.leaves:
        if leaf.kind == "tensor":
            dims.append(rows)
            dims.extend(leaf.shape)
    return struct.pack(f"<{len(dims)}q", *dims)
