"""A pool worker process: build the dataset, map the ring, then make batches.

Each worker builds the dataset from its spec (memory-mapped kinds share pages; nothing
is pickled per worker), maps the ring once, then serves tasks from its pipe until it
is told to stop or the server goes away. This module is preloaded in the forkserver,
so what it imports (torch, the dataset kinds) is already in every worker.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pinfeed_server.datasets import DatasetContext, build_dataset
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.errors import error_info
from pinfeed_server.engine.producers.base import Result
from pinfeed_server.engine.producers.codec import (
    STARTUP_SEQ,
    STOP,
    decode_task,
    encode_result,
)
from pinfeed_server.engine.ring import map_ring


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
    seed: int


def worker_main(worker_id: int, conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    torch.set_num_threads(1)
    seed = spec.seed + worker_id
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        fd = reduction.recv_handle(conn)
        mm, base = map_ring(fd, spec.ring_size)
        os.close(fd)
        dataset = build_dataset(spec.kind, spec.params, spec.context)
        writer = SlotWriter(dataset, Layout.from_json(spec.layout), base, spec.slot_bytes)
    except BaseException as exc:
        conn.send_bytes(encode_result(Result(STARTUP_SEQ, error=error_info(exc))))
        return
    conn.send_bytes(encode_result(Result(STARTUP_SEQ)))  # ready
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the server went away
        if message == STOP:
            break
        task = decode_task(message)
        assert task.indices is not None
        try:
            result = Result(task.seq, writer.write(task.slot, task.indices))
        except Exception as exc:
            result = Result(task.seq, error=error_info(exc))
        conn.send_bytes(encode_result(result))
    writer.close()
    del base
    mm.close()
