"""A pool worker process: take the dataset, map the ring, then make batches.

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
import struct
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

# numpy loads numpy.random on first use: in each worker's first seeding, where it
# costs ~11 MiB a worker. Imported here, it is in the forkserver's shared pages.
import numpy.random  # noqa: F401
import torch

from pinfeed_server.datasets import DatasetContext
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.errors import error_info
from pinfeed_server.engine.producers.base import Result
from pinfeed_server.engine.producers.codec import (
    STARTUP_SEQ,
    STOP,
    decode_task,
    encode_result,
)
from pinfeed_server.engine.producers.iterating import IterStreams, make_turn
from pinfeed_server.engine.producers.seeding import (
    RESEED_TAG,
    RESULT_TAG,
    WorkerRngs,
    decode_reseed,
    encode_snapshot,
)
from pinfeed_server.engine.producers.zygote import inherited
from pinfeed_server.engine.ring import SegmentInfo, SlotSpace, map_ring
from pinfeed_server.plugins import resolve

# The pool's pipe: a ring segment to map (its fd follows, ``reduction.send_handle``) or
# to unmap: id, first slot, slots.
SEGMENT_TAG, DROP_TAG = b"G", b"D"
SEGMENT = struct.Struct("<III")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled once, at spawn)."""

    loader: str
    kind: str
    params: dict[str, Any]
    context: DatasetContext
    layout: dict[str, Any]
    ring_size: int  # segment 0's bytes; later segments come over the pipe
    slot_bytes: int
    worker_init_fn: str | None = None
    num_workers: int = 1  # DataLoader's, as created: the RNG streams (seeding.py)
    snapshots: bool = False  # send the RNG state after each batch
    collate_fn: str | None = None
    iterable: LoaderConfig | None = None  # an IterableDataset's loader: turns (iterating.py)


def worker_main(worker_id: int, conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    torch.set_num_threads(1)  # as DataLoader's workers
    try:
        fd = reduction.recv_handle(conn)
        mm, base = map_ring(fd, spec.ring_size)
        os.close(fd)
        space = SlotSpace(spec.slot_bytes)
        space.add(SegmentInfo(0, 0, spec.ring_size // spec.slot_bytes), base)
        maps: dict[int, mmap.mmap] = {}
        layout = Layout.from_json(spec.layout)
        dataset = inherited(spec.kind, spec.params, spec.context)
        collate = None
        if spec.collate_fn is not None:
            collate = resolve(spec.collate_fn, spec.context.allowed_plugins, what="collate_fn")
        writer = SlotWriter(dataset, layout, space, spec.slot_bytes, collate)
        init_fn = None
        if spec.worker_init_fn is not None:
            init_fn = resolve(
                spec.worker_init_fn, spec.context.allowed_plugins, what="worker_init_fn"
            )
    except BaseException as exc:
        conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ, error=error_info(exc))))
        return
    conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ)))  # ready
    failed: Exception | None = None  # the last reseed's error, until the next one
    rngs = WorkerRngs(dataset, spec.num_workers, init_fn)
    turns = (
        None if spec.iterable is None else IterStreams(dataset, spec.iterable, init_fn, worker=True)
    )
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the server went away
        if message == STOP:
            break
        if message[:1] in (SEGMENT_TAG, DROP_TAG):
            # A new writer first: the old one's cached slot views would keep a closed
            # segment mapped.
            old = writer
            writer = SlotWriter(old.dataset, layout, space, spec.slot_bytes, old.collate_fn)
            old.close()
            del old
            _segment(message, conn, space, maps, spec.slot_bytes)
            continue
        if message[:1] == RESEED_TAG:
            # Seeding (and worker_init_fn) failing fails the batch it is for.
            try:
                rngs.reseed(decode_reseed(message))
                failed = None
            except Exception as exc:
                failed = exc
            continue
        task = decode_task(message[1:])
        if turns is not None:
            conn.send_bytes(RESULT_TAG + encode_result(make_turn(turns, writer, task)))
            continue
        assert task.indices is not None
        seeded = False  # the global RNGs are this batch's stream's
        try:
            if failed is not None:
                raise failed
            if spec.snapshots:  # built-in kinds draw no RNG: any process, any stream
                rngs.enter(task.index)
                writer.dataset = rngs.dataset
            seeded = True
            result = Result(task.seq, writer.write(task.slot, task.indices))
        except Exception as exc:
            result = Result(task.seq, error=error_info(exc))
        if spec.snapshots and seeded:
            conn.send_bytes(encode_snapshot(task.epoch, task.index))
        conn.send_bytes(RESULT_TAG + encode_result(result))
    writer.close()
    del base
    space.parts = ()
    for m in [mm, *maps.values()]:
        with contextlib.suppress(BufferError):
            m.close()


def _segment(
    message: bytes,
    conn: Connection,
    space: SlotSpace,
    maps: dict[int, mmap.mmap],
    slot_bytes: int,
) -> None:
    """Map a segment the ring gained (its fd follows on the pipe), or unmap a closed one."""
    info = SegmentInfo(*SEGMENT.unpack(message[1:]))
    if message[:1] == SEGMENT_TAG:
        fd = reduction.recv_handle(conn)
        try:
            maps[info.id], base = map_ring(fd, info.nslots * slot_bytes)
        finally:
            os.close(fd)
        space.add(info, base)
        return
    space.remove(info.id)
    gone = maps.pop(info.id, None)
    if gone is not None:
        with contextlib.suppress(BufferError):  # a cached view: it goes with the writer
            gone.close()
