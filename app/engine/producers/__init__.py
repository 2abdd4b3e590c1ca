"""Producers: what makes a loader's batches, behind one interface (``base.py``).

    base.py        the seam: Task, Result, Producer, ProducerContext
    inline.py      num_workers=0: in the server's producer thread
    pool.py        local worker processes (worker.py: their side; codec.py: the pipe)
    ray.py         executor "ray": Ray actors (ray_bridge.py: the driver; ray_actor.py)
    forkserver.py  the process the workers are forked from

A new way of making batches is one module here and one line in ``producer_kind`` /
``make_producer``; the engine does not change.
"""

from __future__ import annotations

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
from pinfeed_server.engine.producers.ray import RayProducer, configure_ray


def producer_kind(config: LoaderConfig) -> str:
    """Which producer makes ``config``'s batches; fixed for a loader's life."""
    if config.executor == "ray":
        return "ray"
    return "pool" if config.num_workers > 0 else "inline"


def make_producer(ctx: ProducerContext) -> Producer:
    """The producer for ``ctx.config``; it starts its workers before returning."""
    kind = producer_kind(ctx.config)
    if kind == "ray":
        return RayProducer(ctx)
    if kind == "pool":
        return WorkerPool(ctx)
    return InlineProducer(ctx)


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
    "make_producer",
    "producer_kind",
]
