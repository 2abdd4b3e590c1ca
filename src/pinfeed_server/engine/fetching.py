"""A loader's reads of a dataset in an object store, from the engine's side.

The engine knows what the loader reads next; the node's object cache (``remote/``)
turns that into fetches. Before a batch goes to the producer it is gated: it waits until
every unit its samples read is in the cache, pinned until its result comes back, so a
worker never waits on the store mid-batch and no unit of a batch in the making is
evicted. The time a batch waits is the loader's ``wait_s``: a slow store shows as such,
not as slow workers. From the loader's position on, the plan's batches (across epochs)
are fetched ahead (``Reader.ahead``), and the order of this epoch and the next is handed
to the cache's eviction rule (``Schedule``).

A trainer-fed plan (``FedPlan``: the trainer's own sampler) is gated but not looked
ahead (its batches are known only as they come); an iterable's turns are not gated (its
workers ask for each shard as they reach it, ``remote/link.py``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from pinfeed_server.engine.fed_plan import FedPlan
from pinfeed_server.engine.sampler import BatchPlan, EpochSampler
from pinfeed_server.remote import Reader, Remote, RemoteReads, remote_reads

log = logging.getLogger("pinfeed.loader")


class Fetching:
    def __init__(
        self, name: str, dataset: RemoteReads, remote: Remote, plan: BatchPlan, batch_size: int
    ) -> None:
        self.reader: Reader = remote.reader(name, dataset)
        self._remote = remote
        self._plan = plan
        self._batch_size = batch_size
        self._holds: dict[int, list[str]] = {}
        self._lock = threading.Lock()
        self._epoch = -1

    def start(self, epoch: int, index: int) -> None:
        """Fetch ahead from batch ``index`` of ``epoch`` on (a start, a seek)."""
        if isinstance(self._plan, FedPlan):
            return
        self.reader.ahead(self._future(epoch, index))

    def _future(self, epoch: int, index: int) -> Iterator[list[int] | None]:
        plan = self._plan
        for e in itertools.count(epoch):
            yield from plan.batches(e, index if e == epoch else plan.span(e)[0])

    def _plan_epochs(self, epoch: int) -> None:
        plan = self._plan
        if not isinstance(plan, EpochSampler):
            return
        schedule = self.reader.schedule

        def plan_them() -> None:
            try:
                for e in (epoch, epoch + 1):
                    if not schedule.has(e):
                        order = np.asarray(plan.permutation(e), dtype=np.int64)
                        schedule.set_epoch(e, self.reader.epoch_units(order))
            except Exception:  # the rule falls back to LRU for what it cannot see
                log.exception("loader %s: its epoch order for the cache", self.reader.name)

        threading.Thread(target=plan_them, name="pinfeed-schedule", daemon=True).start()

    def gate(self, seq: int, epoch: int, index: int, indices: list[int] | None) -> None:
        """Wait until batch ``seq``'s units are in the cache (raises ``RemoteError``)."""
        if indices is None:
            return
        if epoch != self._epoch:
            self._epoch = epoch
            self._plan_epochs(epoch)
        digests = self.reader.gate(epoch, index * self._batch_size, indices)
        with self._lock:
            self._holds[seq] = digests

    def release(self, seq: int) -> None:
        with self._lock:
            digests = self._holds.pop(seq, None)
        if digests:
            self.reader.release(digests)

    def close(self) -> None:
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
        for digests in holds:
            self.reader.release(digests)
        self._remote.forget(self.reader)


def fetching_for(
    name: str, dataset: Any, remote: Any, plan: BatchPlan, batch_size: int
) -> Fetching | None:
    """The loader's ``Fetching``, if its dataset reads remote objects through ``remote``."""
    reads = remote_reads(dataset)
    if reads is None or not isinstance(remote, Remote):
        return None
    return Fetching(name, reads, remote, plan, batch_size)
