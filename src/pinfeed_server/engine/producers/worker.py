"""A pool worker process: take the dataset, map the ring, then make batches.

``BatchMaker`` is how a worker makes a batch (dataset, collate, RNG streams, an
iterable's iterators); a Ray actor (``ray_actor.py``) makes its batches with it too.

Each worker is forked from its dataset's zygote (``zygote.py``) and uses the dataset
it inherited from there (nothing is built or pickled per worker; started without a
zygote, it builds the dataset from its spec), maps the ring once, then serves tasks
from its pipe until it is told to stop or the server goes away. This module is
preloaded in the forkserver, so what it imports (torch, the dataset kinds) is already
in every worker.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import dataclass, replace
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

# numpy loads numpy.random on first use: in each worker's first seeding, where it
# costs ~11 MiB a worker. Imported here, it is in the forkserver's shared pages.
import numpy.random  # noqa: F401
import torch

from pinfeed.errors import LoaderFailed
from pinfeed.protocol import ErrorInfo
from pinfeed.rng import dump_state
from pinfeed.transformed import Transformed
from pinfeed_server.datasets import DatasetContext, shipped
from pinfeed_server.datasets.shipped import Shipped
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.config import LoaderCode, LoaderConfig
from pinfeed_server.engine.iterable import is_iterable
from pinfeed_server.engine.producers.base import (
    ProducerContext,
    Result,
    Task,
    batch_result,
    error_info,
)
from pinfeed_server.engine.producers.codec import (
    DROP_TAG,
    OBJECTS_TAG,
    RESEED_TAG,
    RESULT_TAG,
    RING_TAG,
    SEGMENT_TAG,
    SNAPSHOT_TAG,
    STARTUP_SEQ,
    STOP,
    decode_objects,
    decode_pickled,
    decode_ring,
    decode_segment,
    decode_task,
    encode_pickled,
    encode_result,
    encode_segment,
)
from pinfeed_server.engine.producers.iterating import IterStreams, make_turn
from pinfeed_server.engine.producers.seeding import Reseed, SnapshotCadence, WorkerRngs
from pinfeed_server.engine.producers.zygote import inherited
from pinfeed_server.engine.ring import Ring, SegmentInfo, SlotSpace, map_ring
from pinfeed_server.malloc import keep_batch_buffers


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled once, at spawn)."""

    loader: str
    kind: str
    params: dict[str, Any]
    context: DatasetContext
    # None: a loader sized from its first batches, whose ring comes later (RING)
    layout: dict[str, Any] | None
    ring_size: int  # segment 0's bytes; later segments come over the pipe
    slot_bytes: int
    worker_init_fn: str | None = None
    streams: int = 1  # DataLoader's num_workers as created: the RNG streams (seeding.py)
    snapshots: bool = False  # send the RNG state after batches (seeding.SnapshotCadence)
    collate_fn: str | None = None
    iterable: LoaderConfig | None = None  # an IterableDataset's loader: turns (iterating.py)
    transform: str | None = None  # applied over the dataset the worker inherits
    own: bool = False  # DataLoader's rule on sizes: buffers of their own (collate.SlotWriter)
    rows: int = 0  # the loader's batch size, where known (a ring proposal's rows)

    @classmethod
    def of(cls, ctx: ProducerContext) -> WorkerSpec:
        """What the workers (or Ray actors) of ``ctx``'s loader start with."""
        iterable = ctx.iterable or is_iterable(ctx.dataset)
        ring, layout = ctx.ring, ctx.layout
        return cls(
            ctx.config.name,
            ctx.kind.name,
            ctx.params,
            ctx.datasets,
            None if layout is None else layout.to_json(),
            0 if ring is None else ring.segments()[0][0].nslots * ring.slot_bytes,  # segment 0
            0 if ring is None else ring.slot_bytes,
            ctx.config.worker_init_fn,
            max(1, ctx.streams),
            # A dataset that draws nothing from the global RNGs needs no replay and no
            # snapshots; an iterable's workers keep their streams' states themselves.
            snapshots=ctx.draws_rng and not iterable,
            collate_fn=ctx.config.collate_fn,
            iterable=ctx.config if iterable else None,
            transform=ctx.config.transform,
            own=ctx.own,
            rows=ctx.plan.max_rows,
        )

    def with_ring(self, layout: Layout, ring_size: int) -> WorkerSpec:
        """This spec for workers started once the ring is sized (they map it at start)."""
        return replace(
            self, layout=layout.to_json(), ring_size=ring_size, slot_bytes=layout.slot_bytes
        )


class BatchMaker:
    """A worker's batch making: its dataset (the loader's ``transform`` over the one it
    got, as the server's producers read ``Transformed``), a writer into ``slots`` (the
    ring's slot space, or a Ray actor's one-slot buffer), its RNG streams and an
    iterable's iterators. ``make`` is the one place a worker (or actor) makes a batch."""

    def __init__(self, spec: WorkerSpec, held: Any, slots: torch.Tensor | SlotSpace | None) -> None:
        """``held``: the dataset the worker got (its zygote's, or built), or a trainer's
        shipped objects, which bring their own collate_fn and worker_init_fn; ``slots``
        None: the ring comes later (``ring_ready``)."""
        if isinstance(held, Shipped):
            dataset, collate, init_fn = held.dataset, held.collate_fn, held.worker_init_fn
        else:
            code = LoaderCode.resolve(spec, spec.context.allowed_plugins)
            dataset, collate, init_fn = held, code.collate_fn, code.worker_init_fn
            if code.transform is not None:
                dataset = Transformed(dataset, code.transform)
        self._spec, self._slots = spec, slots
        self._layout = None if spec.layout is None else Layout.from_json(spec.layout)
        self._slot_bytes = spec.slot_bytes
        self._use(dataset, collate, init_fn)
        self._failed: Exception | None = None  # the last reseed's error, until the next one
        # A trainer's objects from an epoch on (or why they could not be loaded here),
        # till a reseed or batch of that epoch; and objects that could not be loaded.
        self._pending: tuple[int, Shipped | Exception] | None = None
        self._unloaded: Exception | None = None

    def _use(self, dataset: Any, collate: Any, init_fn: Any) -> None:
        """Make batches with these objects (a trainer's, as they changed: a worker's new
        start, as DataLoader's new worker processes each epoch)."""
        spec = self._spec
        self.writer = self._writer(dataset, collate)
        self._rngs = WorkerRngs(dataset, spec.streams, init_fn, collate)
        self._turns = (
            None
            if spec.iterable is None
            else IterStreams(dataset, spec.iterable, spec.streams, init_fn, worker=True)
        )

    def objects(self, epoch: int, held: Shipped | Exception) -> None:
        """A trainer's objects, used from ``epoch``'s first reseed or batch on (an
        Exception: they could not be loaded here; that epoch's batches fail with it)."""
        self._pending = (epoch, held)

    def _catch_up(self, epoch: int) -> None:
        pending = self._pending
        if pending is None or epoch < pending[0]:
            return
        self._pending = None
        held = pending[1]
        if isinstance(held, Exception):
            self._unloaded = held
            return
        self._unloaded = None
        self.writer.close()
        self._use(held.dataset, held.collate_fn, held.worker_init_fn)

    def reseed(self, reseed: Reseed) -> None:
        self._catch_up(reseed.epoch)
        # Seeding (and worker_init_fn) failing fails the batch it is for.
        try:
            self._rngs.reseed(reseed)
            self._failed = None
        except Exception as exc:
            self._failed = exc

    def make(self, task: Task) -> tuple[Result, bool]:
        """Make ``task``'s batch into its slot: the result, and whether the global RNGs
        are now that batch's stream's (then a snapshot of them means something)."""
        self._catch_up(task.epoch)
        if self._unloaded is not None:
            return Result(task.seq, error=_unloaded(self._unloaded)), False
        if self._turns is not None:
            return make_turn(self._turns, self.writer, task), False
        assert task.indices is not None
        seeded = False
        try:
            if self._failed is not None:
                raise self._failed
            if self._spec.snapshots:  # built-in kinds draw no RNG: any process, any stream
                self._rngs.enter(task.index)
            # the dataset its (last) worker_init_fn set up: a copy for each (re)start
            writer = self.writer
            writer.dataset = self._rngs.dataset
            seeded = True
            return batch_result(task.seq, writer.write(task.slot, task.indices), writer), seeded
        except Exception as exc:
            return Result(task.seq, error=error_info(exc)), seeded

    def _writer(self, dataset: Any, collate: Any) -> SlotWriter:
        spec = self._spec
        return SlotWriter(
            dataset,
            self._layout,
            self._slots,
            self._slot_bytes,
            collate,
            own=spec.own,
            rows=spec.rows,
        )

    def ring_ready(self, layout: Layout, slots: SlotSpace) -> None:
        """The ring of a loader sized from its first batches: later batches go into it."""
        self._layout, self._slots, self._slot_bytes = layout, slots, layout.slot_bytes
        self.renew_writer()

    def renew_writer(self) -> None:
        """A new writer, before the slot space changes: the old one's cached slot views
        would keep a closed segment mapped."""
        old = self.writer
        self.writer = self._writer(old.dataset, old.collate_fn)
        old.close()

    def close(self) -> None:
        self.writer.close()


def worker_main(worker_id: int, conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    torch.set_num_threads(1)  # as DataLoader's workers
    keep_batch_buffers(spec.slot_bytes)
    maps: dict[int, mmap.mmap] = {}  # segment -> its mapping
    space: SlotSpace | None = None
    try:
        if spec.layout is not None:
            space = map_segment0(conn, spec.ring_size, spec.slot_bytes, maps)
        maker = BatchMaker(spec, inherited(spec.kind, spec.params, spec.context), space)
    except BaseException as exc:
        conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ, error=error_info(exc))))
        return
    conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ)))  # ready
    cadence = SnapshotCadence(spec.snapshots)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the server went away
        if message == STOP:
            break
        if message[:1] == RING_TAG:
            layout, nslots = decode_ring(message)
            keep_batch_buffers(layout.slot_bytes)
            space = map_segment0(conn, nslots * layout.slot_bytes, layout.slot_bytes, maps)
            maker.ring_ready(layout, space)
            continue
        if message[:1] in (SEGMENT_TAG, DROP_TAG):
            assert space is not None
            maker.renew_writer()
            receive_segment(message, conn, space, maps)
            continue
        if message[:1] == RESEED_TAG:
            maker.reseed(decode_pickled(message))
            cadence.reset()
            continue
        if message[:1] == OBJECTS_TAG:
            maker.objects(*receive_objects(message, conn))
            continue
        task = decode_task(message[1:])
        t0 = time.perf_counter()
        result, seeded = maker.make(task)
        if cadence.due(task.epoch, seeded, time.perf_counter() - t0):
            snapshot = (task.epoch, task.index, dump_state(), task.seq)  # its RNG state now
            conn.send_bytes(encode_pickled(SNAPSHOT_TAG, snapshot))
        conn.send_bytes(RESULT_TAG + encode_result(result))
        if result.own is not None:  # the batch's buffer of its own goes with it
            reduction.send_handle(conn, result.own.fd, os.getppid())
            result.own.close()
    maker.close()
    if space is not None:
        space.parts = ()
    for m in maps.values():
        with contextlib.suppress(BufferError):
            m.close()


def receive_objects(message: bytes, conn: Connection) -> tuple[int, Shipped | Exception]:
    """A trainer's objects (OBJECTS: their payloads' fds follow on the pipe), loaded here:
    the epoch they apply from, and them (or why they cannot be loaded)."""
    epoch, payloads, shared = decode_objects(message)
    fds = [reduction.recv_handle(conn) for _ in range(payloads + shared)]
    try:
        return epoch, shipped.load(fds[:payloads], fds[payloads:])
    except Exception as exc:
        return epoch, exc
    finally:
        for fd in fds:
            os.close(fd)


def _unloaded(exc: Exception) -> ErrorInfo:
    """A batch's error where the trainer's objects could not be loaded in its worker."""
    return LoaderFailed(f"the trainer's objects could not be loaded in a worker: {exc}").info()


def map_segment0(
    conn: Connection, size: int, slot_bytes: int, maps: dict[int, mmap.mmap]
) -> SlotSpace:
    """Map ring segment 0, whose fd comes next on the pipe: the slot space over it."""
    fd = reduction.recv_handle(conn)
    try:
        maps[0], base = map_ring(fd, size)
    finally:
        os.close(fd)
    space = SlotSpace(slot_bytes)
    space.add(SegmentInfo(0, 0, size // slot_bytes), base)
    return space


def send_segments(ring: Ring, conn: Connection, pid: int, known: set[int]) -> set[int]:
    """Tell the process at the other end of ``conn`` (a worker, the Ray bridge) of the
    ring's new segments (their fds follow) and of its closed ones, before a task that
    may use them; the segments it now has. Errors of a dead peer are its reaper's."""
    with ring.lock:  # no segment closes while its fd is on the way
        now = {info.id: (info, fd) for info, fd in ring.segments()}
        with contextlib.suppress(OSError):
            for sid in sorted(set(now) - known):
                info, fd = now[sid]
                conn.send_bytes(encode_segment(SEGMENT_TAG, info.id, info.first, info.nslots))
                reduction.send_handle(conn, fd, pid)
            for sid in sorted(known - set(now)):
                conn.send_bytes(encode_segment(DROP_TAG, sid, 0, 0))
    return set(now)


def receive_segment(
    message: bytes, conn: Connection, space: SlotSpace, maps: dict[int, mmap.mmap]
) -> None:
    """Map a segment the ring gained (its fd follows on the pipe), or unmap a closed one."""
    info = SegmentInfo(*decode_segment(message))
    if message[:1] == SEGMENT_TAG:
        fd = reduction.recv_handle(conn)
        try:
            maps[info.id], base = map_ring(fd, info.nslots * space.slot_bytes)
        finally:
            os.close(fd)
        space.add(info, base)
        return
    space.remove(info.id)
    gone = maps.pop(info.id, None)
    if gone is not None:
        with contextlib.suppress(BufferError):  # a cached view: it goes with the writer
            gone.close()
