"""``executor: "local"`` (the default): DataLoader's model on this node. With
``num_workers=0`` the batches are made in the server (``inline.py``), in the loader's
producer thread or its one trainer's session thread, as DataLoader's main process makes
them; with N > 0 by N worker
processes forked from the dataset's zygote (``pool.py``)."""

from __future__ import annotations

from typing import Any

from pinfeed_server.datasets import Kind
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import Producer, ProducerContext
from pinfeed_server.engine.producers.inline import InlineProducer
from pinfeed_server.engine.producers.pool import WorkerPool
from pinfeed_server.engine.producers.processes import ProcessFactory


class LocalExecutor:
    name = "local"
    forks_local = True
    counts_workers = True

    def refusal(self, config: LoaderConfig, kind: Kind[Any], iterable: bool) -> str | None:
        return None

    def live_refusal(self, old: LoaderConfig, new: LoaderConfig, iterable: bool) -> str | None:
        if iterable and (old.num_workers == 0) != (new.num_workers == 0):
            # One iterator in the server, or one per worker (each its own shard of the
            # stream): DataLoader's batch sequences differ, so no live switch.
            return (
                f"loader {new.name!r} reads an IterableDataset: it cannot switch live "
                "between num_workers=0 and worker processes (their streams differ, as "
                "under DataLoader); change num_workers within >0, or recreate it"
            )
        return None

    def resizes_live(self, old: int, new: int) -> bool:
        return (old == 0) == (new == 0)  # the pool grows and shrinks; 0 <-> N swaps

    def producer(self, ctx: ProducerContext, spawn: ProcessFactory | None) -> Producer:
        if ctx.processes > 0:
            return WorkerPool(ctx, spawn)
        return InlineProducer(ctx)
