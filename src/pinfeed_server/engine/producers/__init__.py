"""Producers: what makes a loader's batches, behind one seam, chosen by its executor.

    base.py        the producer seam: Task, Result, Producer, ProducerContext
    executor.py    the executor seam: an executor's rules and its producer
    local.py       executor "local": inline.py (0 workers: in the server's producer
                   thread) or pool.py (worker processes; processes.py starts and reaps
                   them, worker.py is their side, codec.py the pipe, seeding.py
                   DataLoader's RNG streams, iterating.py an IterableDataset's turns)
    threads.py     executor "thread": threads of the server
    ray.py         executor "ray": Ray actors (ray_bridge.py: the driver; ray_actor.py)
    forkserver.py  the process the zygotes (and workers without one) are forked from
    zygote.py      a dataset's process, holding its one build; its workers fork from it

A new executor is one module and one line in ``executors()``; the engine and the
service do not change.
"""

from __future__ import annotations

from pinfeed_server.engine.producers.base import (
    Producer,
    ProducerContext,
    Result,
    Task,
)
from pinfeed_server.engine.producers.executor import Executor
from pinfeed_server.engine.producers.forkserver import configure_forkserver
from pinfeed_server.engine.producers.local import LocalExecutor
from pinfeed_server.engine.producers.processes import ProcessFactory
from pinfeed_server.engine.producers.ray import RayExecutor
from pinfeed_server.engine.producers.threads import ThreadExecutor
from pinfeed_server.engine.producers.zygote import Zygotes


def executors(ray_address: str | None = None) -> dict[str, Executor]:
    """Every executor a loader may name, configured for this server."""
    return {e.name: e for e in (LocalExecutor(), ThreadExecutor(), RayExecutor(ray_address))}


__all__ = [
    "Executor",
    "ProcessFactory",
    "Producer",
    "ProducerContext",
    "Result",
    "Task",
    "Zygotes",
    "configure_forkserver",
    "executors",
]
