"""A Ray actor's side: one DataLoader worker, made remote.

The actor makes its batches with the local worker's ``BatchMaker`` (``worker.py``), so
a batch made here is the batch a local worker makes: the same dataset built from
``(kind, params)``, the same collate (``collate_fn``, per-batch layouts), the same seeds
and augmentation streams. It collates into a buffer of one slot (slot 0 of its own
slot space) and returns the buffer's bytes through Ray's object store; the server's
bridge copies them into the task's ring slot (``ray_bridge.py``). Nothing here imports
Ray: the bridge wraps the class with ``ray.remote``; a Ray worker imports this module
by name, so pinfeed must be installed where the actors run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from pinfeed.rng import dump_state
from pinfeed_server.datasets import build_dataset
from pinfeed_server.engine.producers.base import Task
from pinfeed_server.engine.producers.codec import encode_result
from pinfeed_server.engine.producers.seeding import Reseed, SnapshotCadence
from pinfeed_server.engine.producers.worker import BatchMaker, WorkerSpec
from pinfeed_server.malloc import keep_batch_buffers

# (the result as the pool's pipe encodes it, the slot's bytes or None, an RNG snapshot)
Made = tuple[bytes, np.ndarray[Any, Any] | None, bytes | None]


class BatchActor:
    """One worker: its dataset, its slot-sized buffer and its RNG streams."""

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(1)  # as DataLoader's workers
        keep_batch_buffers(spec.slot_bytes)
        self._buf = torch.zeros(spec.slot_bytes, dtype=torch.uint8)
        dataset = build_dataset(spec.kind, spec.params, spec.context)
        self._maker = BatchMaker(spec, dataset, self._buf)
        self._cadence = SnapshotCadence(spec.snapshots)

    def ready(self) -> int:
        """The actor's process id, once its dataset is built."""
        return os.getpid()

    def make(self, seq: int, epoch: int, index: int, indices: list[int], reseed: Any) -> Made:
        """Make batch ``(epoch, index)``; ``reseed`` (a ``Reseed``) first if given.
        Ray runs one caller's calls of an actor in order, as a worker takes its pipe's."""
        if isinstance(reseed, Reseed):
            self._maker.reseed(reseed)
            self._cadence.reset()
        t0 = time.perf_counter()
        result, seeded = self._maker.make(Task(seq, epoch, index, 0, indices))
        due = self._cadence.due(epoch, seeded, time.perf_counter() - t0)
        snapshot = dump_state() if due else None
        # Ray serializes the return value before the next call runs: reusing the buffer
        # for the next batch is safe.
        data = self._buf.numpy() if result.error is None else None
        return encode_result(result), data, snapshot
