"""A pool worker process: build the dataset, map the ring, then make batches.

Each worker builds the dataset from its spec (memory-mapped kinds share pages; nothing
is pickled per worker), maps the ring once, then serves tasks from its pipe until it
is told to stop or the server goes away. This module is preloaded in the forkserver,
so what it imports (torch, the dataset kinds) is already in every worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch

from pinfeed_server.datasets import DatasetContext, build_dataset
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.errors import error_info
from pinfeed_server.engine.producers.base import Result, Task
from pinfeed_server.engine.producers.codec import (
    STARTUP_SEQ,
    STOP,
    decode_task,
    encode_result,
)
from pinfeed_server.engine.producers.seeding import (
    RESEED_TAG,
    RESULT_TAG,
    WorkerRngs,
    decode_reseed,
    encode_snapshot,
)
from pinfeed_server.engine.ring import map_ring
from pinfeed_server.plugins import resolve


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled once, at spawn)."""

    loader: str
    kind: str
    params: dict[str, Any]
    context: DatasetContext
    layout: dict[str, Any]
    ring_size: int
    slot_bytes: int
    worker_init_fn: str | None = None
    num_workers: int = 1  # DataLoader's, as created: the RNG streams (seeding.py)
    snapshots: bool = False  # send the RNG state after each batch


def open_writer(spec: WorkerSpec, base: torch.Tensor) -> tuple[SlotWriter, Any]:
    """The dataset built from the spec, a writer into ``base`` and ``worker_init_fn``:
    what a worker starts with, here or as a remote actor (``ray_actor.py``)."""
    dataset = build_dataset(spec.kind, spec.params, spec.context)
    writer = SlotWriter(dataset, Layout.from_json(spec.layout), base, spec.slot_bytes)
    init_fn = None
    if spec.worker_init_fn is not None:
        init_fn = resolve(spec.worker_init_fn, spec.context.allowed_plugins, what="worker_init_fn")
    return writer, init_fn


def make_batch(
    writer: SlotWriter, rngs: WorkerRngs, task: Task, failed: Exception | None
) -> tuple[Result, bool]:
    """Make one batch into its slot with the RNGs of its stream: the result, and whether
    the global RNGs were that stream's (then a snapshot of them means something)."""
    assert task.indices is not None
    seeded = False
    try:
        if failed is not None:
            raise failed
        rngs.enter(task.index)
        writer.dataset = rngs.dataset
        seeded = True
        return Result(task.seq, writer.write(task.slot, task.indices)), seeded
    except Exception as exc:
        return Result(task.seq, error=error_info(exc)), seeded


def worker_main(worker_id: int, conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    torch.set_num_threads(1)  # as DataLoader's workers
    try:
        fd = reduction.recv_handle(conn)
        mm, base = map_ring(fd, spec.ring_size)
        os.close(fd)
        writer, init_fn = open_writer(spec, base)
    except BaseException as exc:
        conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ, error=error_info(exc))))
        return
    conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ)))  # ready
    failed: Exception | None = None  # the last reseed's error, until the next one
    rngs = WorkerRngs(writer.dataset, spec.num_workers, init_fn)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the server went away
        if message == STOP:
            break
        if message[:1] == RESEED_TAG:
            # Seeding (and worker_init_fn) failing fails the batch it is for.
            try:
                rngs.reseed(decode_reseed(message))
                failed = None
            except Exception as exc:
                failed = exc
            continue
        task = decode_task(message[1:])
        result, seeded = make_batch(writer, rngs, task, failed)
        if spec.snapshots and seeded:
            conn.send_bytes(encode_snapshot(task.epoch, task.index))
        conn.send_bytes(RESULT_TAG + encode_result(result))
    writer.close()
    del base
    mm.close()
