"""Producers: what makes a loader's batches, behind one interface (``base.py``).

    base.py        the seam: Task, Result, Producer, ProducerContext
    inline.py      num_workers=0: in the server's producer thread
    pool.py        local worker processes (processes.py: start and reap them; worker.py:
                   their side; codec.py: the pipe)
    ray.py         executor "ray": Ray actors (ray_bridge.py: the driver; ray_actor.py)
    forkserver.py  the process the zygotes (and workers without one) are forked from
    zygote.py      a dataset's process, holding its one build; its workers fork from it

A new way of making batches is one module here and one line in ``producer_kind`` /
``make_producer``; the engine does not change.
"""

from __future__ import annotations

from typing import Any

from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import (
    Producer,
    ProducerContext,
    ProducerFactory,
    Result,
    Task,
)
from pinfeed_server.engine.producers.forkserver import configure_forkserver
from pinfeed_server.engine.producers.inline import InlineProducer
from pinfeed_server.engine.producers.pool import WorkerPool
from pinfeed_server.engine.producers.processes import ProcessFactory
from pinfeed_server.engine.producers.ray import RayProducer, configure_ray
from pinfeed_server.engine.producers.zygote import Zygotes


def producer_kind(config: LoaderConfig) -> str:
    """Which producer makes ``config``'s batches (a PATCH across 0 swaps it live; a Ray
    loader never goes to 0)."""
    if config.executor == "ray":
        return "ray"
    return "pool" if config.num_workers > 0 else "inline"


def make_producer(ctx: ProducerContext, spawn: ProcessFactory | None = None) -> Producer:
    """The producer for ``ctx.num_processes``; it starts its workers before returning
    (made by ``spawn``, the dataset's zygote's, when given)."""
    if ctx.config.executor == "ray":
        return RayProducer(ctx)
    if ctx.num_processes > 0:
        return WorkerPool(ctx, spawn)
    return InlineProducer(ctx)


def forked_producers(
    zygotes: Zygotes, name: str, dataset: Any, kind: str, params: dict[str, Any]
) -> ProducerFactory:
    """``make_producer`` whose workers fork from dataset ``name``'s zygote, started
    with the first pool that needs it (at creation, or a live PATCH from 0 workers)."""

    def make(ctx: ProducerContext) -> Producer:
        if ctx.num_processes == 0 or ctx.config.executor == "ray":
            return make_producer(ctx)  # no worker forks here
        return make_producer(ctx, zygotes.get(name, dataset, kind, params).process_factory)

    return make


__all__ = [
    "InlineProducer",
    "Producer",
    "ProducerContext",
    "ProducerFactory",
    "RayProducer",
    "Result",
    "Task",
    "WorkerPool",
    "configure_forkserver",
    "configure_ray",
    "forked_producers",
    "make_producer",
    "producer_kind",
]
