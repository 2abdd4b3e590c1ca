"""The loader engine: one ``LoaderEngine`` per loader (``loader.py``), composed of the
parts it owns, and the data plane that serves it to trainers.

Its front door is this module: the names below are what the service uses of it (a
config checked against its dataset, ``prepare``; the engine built from it,
``LoaderEngine``; the data plane; the dataset processes, ``Zygotes``), and the service
imports nothing else from inside the engine (pyproject's import-linter contract).

    loader.py           the engine: plan -> producer -> in-order publisher -> consumers
    producer_handle.py  its current producer (producers/), resized or swapped live
    resizer.py          its ring moved to what a live change wants
    publisher.py        results in any order, published in plan order
    consumers.py        the trainers attached, a group's shared or split batches
    dataplane.py        the Unix socket: attach; session.py: one trainer's messages
    prepare.py          a config checked against its dataset: plugins, plan, layout
    config.py           a loader's configuration, declared once; what changes live
    sampler.py, custom_sampler.py, iterable.py   batch plans (DataLoader's samplers)
    fed_plan.py         the plan a trainer's own sampler feeds (pinfeed.DataLoader)
    collate.py, batchlayout.py                   batches written into ring slots
    ring.py             memfd segments and the slot table
    autotune.py         one loader's tuning rules; stats.py, status.py: what it reports
"""

from pinfeed_server.engine.collate import describe, probe
from pinfeed_server.engine.config import (
    LIVE,
    MAX_WORKERS,
    NAME_PATTERN,
    LiveChange,
    LoaderCode,
    LoaderConfig,
    nullable,
    ring_slots,
)
from pinfeed_server.engine.dataplane import DataPlaneServer, Peer
from pinfeed_server.engine.fed_plan import FedPlan
from pinfeed_server.engine.iterable import dataset_len, first_samples, is_iterable
from pinfeed_server.engine.loader import LoaderEngine, Sizing
from pinfeed_server.engine.prepare import prepare
from pinfeed_server.engine.producers import (
    Executor,
    ProcessFactory,
    Zygotes,
    configure_forkserver,
    executors,
)
from pinfeed_server.engine.producers.zygote import Zygote
from pinfeed_server.engine.sampler import BatchPlan
from pinfeed_server.engine.stats import StatsSnapshot
from pinfeed_server.engine.status import LoaderStatus

__all__ = [
    "LIVE",
    "MAX_WORKERS",
    "NAME_PATTERN",
    "BatchPlan",
    "DataPlaneServer",
    "Executor",
    "FedPlan",
    "LiveChange",
    "LoaderCode",
    "LoaderConfig",
    "LoaderEngine",
    "LoaderStatus",
    "Peer",
    "ProcessFactory",
    "Sizing",
    "StatsSnapshot",
    "Zygote",
    "Zygotes",
    "configure_forkserver",
    "dataset_len",
    "describe",
    "executors",
    "first_samples",
    "is_iterable",
    "nullable",
    "prepare",
    "probe",
    "ring_slots",
]
