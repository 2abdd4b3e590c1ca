"""A pool worker process: take the dataset, map the ring, then make batches.

Each worker is forked from its dataset's zygote (``zygote.py``) and uses the dataset
it inherited from there (nothing is built or pickled per worker; started without a
zygote, it builds the dataset from its spec), maps the ring once, then serves tasks
from its pipe until it is told to stop or the server goes away. This module is
preloaded in the forkserver, so what it imports (torch, the dataset kinds) is already
in every worker.
"""

from __future__ import annotations

import os
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
from pinfeed_server.engine.errors import error_info
from pinfeed_server.engine.producers.base import Result
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
from pinfeed_server.engine.producers.zygote import inherited
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


def worker_main(worker_id: int, conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    torch.set_num_threads(1)  # as DataLoader's workers
    try:
        fd = reduction.recv_handle(conn)
        mm, base = map_ring(fd, spec.ring_size)
        os.close(fd)
        dataset = inherited(spec.kind, spec.params, spec.context)
        writer = SlotWriter(dataset, Layout.from_json(spec.layout), base, spec.slot_bytes)
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
        assert task.indices is not None
        seeded = False  # the global RNGs are this batch's stream's
        try:
            if failed is not None:
                raise failed
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
    mm.close()
