"""The service: the rules of a node's datasets and loaders, over the parts that keep them.

Routers call this (and the data plane, for a trainer's ``pinfeed.DataLoader``); it keeps
the rules: names are unique (a dataset's, a loader's, whatever made it), a dataset in
use stays, a loader is admitted by the node (the arbiter makes room, then the budget
decides) before it holds anything, and a loader lives as long as its origin says (a
registered one across restarts, a trainer's with its trainer). The rest it delegates:

    datasets.py   the registered datasets, built once and shared (and their caches)
    trainers.py   the loaders trainers make, over the objects they send
    build.py      the one way a loader is built: a prepared spec -> a started engine
    table.py      every loader, one record each, whatever its origin

What it refuses it raises as ``pinfeed.errors`` problems or domain errors
(``pinfeed_server/errors.py``), which become problem+json.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pinfeed import errors, protocol, served
from pinfeed_server.cache.shipped import ShippedCaches
from pinfeed_server.datasets import BUILT_FOR_LOADERS, KINDS, DatasetContext, Kind, build_dataset
from pinfeed_server.engine import (
    LIVE,
    DataPlaneServer,
    LiveChange,
    LoaderConfig,
    LoaderEngine,
    LoaderStatus,
    Peer,
    StatsSnapshot,
    Zygotes,
    configure_forkserver,
    executors,
    nullable,
)
from pinfeed_server.errors import DomainError, problem_of
from pinfeed_server.malloc import return_big_buffers
from pinfeed_server.node.arbiter import NodeArbiter
from pinfeed_server.node.budget import NodeBudget
from pinfeed_server.registry import Registry
from pinfeed_server.remote import Remote, RemoteStats
from pinfeed_server.schemas import (
    DEMO_PARAMS,
    ArbiterPublic,
    DatasetCreate,
    LoaderCreate,
    LoaderPatch,
    NodeDecision,
    NodeLifetime,
    NodeLoader,
    NodePublic,
)
from pinfeed_server.service.build import Builder, LoaderSpec
from pinfeed_server.service.datasets import Datasets
from pinfeed_server.service.table import LoaderRecord, LoaderTable, Unstarted
from pinfeed_server.service.trainers import TrainerLoaders
from pinfeed_server.settings import Settings

log = logging.getLogger("pinfeed")

DEMO_DATASET = DatasetCreate.model_validate(
    {"name": "demo", "kind": "synthetic", "params": DEMO_PARAMS}
)
DEMO_LOADER = LoaderCreate(name="demo", dataset="demo", batch_size=10)


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.context = DatasetContext(
            settings.data_root, tuple(settings.allowed_plugins), Remote(settings.remote)
        )
        self.registry = Registry(settings.registry_path)
        self.table = LoaderTable()
        self._lock = threading.RLock()
        # the processes the workers of each dataset's loaders are forked from (started
        # with its first loader with workers, stopped with the dataset)
        self.zygotes = Zygotes(self.context)
        self.budget = NodeBudget(
            settings.max_workers,
            settings.max_shm_bytes,
            self.table.engines,
            lambda: self.datasets.reservations() | self.shipped_caches.reservations(),
            settings.cache_budget,
        )
        self.datasets = Datasets(
            self.registry, self.context, self.budget, self.zygotes, settings.cache_path, self._lock
        )
        # the caches of trainers' shipped datasets (pinfeed.DataLoader's cache=)
        self.shipped_caches = ShippedCaches(self.context, self.budget.admit_cache)
        self.arbiter = NodeArbiter(
            lambda: list(self.table.engines().items()),
            self.budget,
            self.reconfigure,
            self._lock,
            enabled=settings.arbiter,
            interval_s=settings.arbiter_interval_s,
        )
        self.builder = Builder(
            self.context,
            executors(settings.ray_address),
            self._admit,
            self._admit_ring,
            lambda: max(0, settings.max_shm_bytes - self.shm_used()),
        )
        self.trainers = TrainerLoaders(self.zygotes, self.shipped_caches, self.builder, self.budget)
        self._closed = threading.Event()
        self.dataplane = DataPlaneServer(
            settings.socket_path,
            self.table.engine,
            settings.attach_timeout_s,
            group=settings.socket_gid,
            create=self.create_owned if settings.accept_objects else None,
            owner_gone=self.owner_gone,
            describe=self.datasets.describe_spec,
        )

    @property
    def loaders(self) -> dict[str, LoaderEngine]:
        """The started loaders' engines, by name."""
        return self.table.engines()

    # -- lifetime --------------------------------------------------------------------
    def start(self) -> None:
        # Batches are built by worker processes (one torch thread each, as DataLoader's
        # workers) or, with num_workers=0, by one producer thread per loader: more
        # intra-op threads only fight the trainers for the node's cores.
        torch.set_num_threads(self.settings.torch_threads)
        # Short GIL slices: a data-plane thread waking for a NEXT should not wait 5 ms
        # behind a thread running Python.
        sys.setswitchinterval(0.001)
        # One short directory per socket path (AF_UNIX paths are capped at 107 bytes).
        key = hashlib.sha1(str(self.settings.socket_path.resolve()).encode()).hexdigest()[:10]
        configure_forkserver(Path(tempfile.gettempdir()) / f"pinfeed-{os.getuid()}-{key}")
        # Once the forkserver is forked from this process (it and the workers forked
        # from it keep glibc's adaptive threshold), before any loader allocates.
        return_big_buffers()
        # a trainer's pinfeed.ServerDataset reads what the kind builds here
        served.install(lambda kind, params: build_dataset(kind, params, self.context))
        self.dataplane.start()
        self.restore()
        if self.settings.demo:
            self._ensure_demo()
        self.arbiter.start()
        if self.settings.idle_exit_s is not None:
            threading.Thread(target=self._exit_when_idle, name="pinfeed-idle", daemon=True).start()
        log.info("data plane on %s", self.settings.socket_path)

    def restore(self) -> None:
        """Start every loader the registry holds (``start`` calls it; apart from the
        process-wide setup there, so the rules can be tested in-process). One that
        cannot start is listed failed with the reason, and the others start."""
        for row in self.registry.loaders():
            try:
                resumed = self.registry.elastic(row.name)
                engine = self._start_registered(row.dataset, row.config, resumed)
                self.table.add(LoaderRecord(row.name, row.dataset, row.created_at, engine))
            except Exception as exc:  # one bad row must not keep the others from starting
                problem = problem_of(exc)
                detail = f"{type(exc).__name__}: {exc}" if problem is None else problem.detail
                log.error("loader %s from the registry cannot start: %s", row.name, detail)
                failed = Unstarted(row.config, detail)
                self.table.add(
                    LoaderRecord(row.name, row.dataset, row.created_at, None, None, failed)
                )

    def _exit_when_idle(self) -> None:
        """PINFEED_IDLE_EXIT_S (a server pinfeed.DataLoader started): stop that long after
        the last trainer left, as a graceful SIGTERM does. Only trainers keep it: the
        loaders it holds with none attached (a named one waiting warm) go with it."""
        while True:
            left = self.exits_in_s()
            if left is not None and left <= 0:
                break
            if self._closed.wait(0.5 if left is None else min(left, 0.5)):
                return
        log.info("no trainer for %.0f s: exiting (PINFEED_IDLE_EXIT_S)", self.settings.idle_exit_s)
        os.kill(os.getpid(), signal.SIGTERM)

    def exits_in_s(self) -> float | None:
        """Seconds before PINFEED_IDLE_EXIT_S stops this server if no trainer connects;
        None while one is connected, or without it."""
        limit, idle = self.settings.idle_exit_s, self.dataplane.idle_s()
        return None if limit is None or idle is None else max(0.0, limit - idle)

    def close(self) -> None:
        self._closed.set()
        served.install(None)
        self.arbiter.close()
        with self._lock:
            engines = [r.engine for r in self.table.clear() if r.engine is not None]
        # Stop producing first: once the data plane closes, trainers' leases come back,
        # and a running producer could refill a slot a trainer still reads.
        for engine in engines:
            engine.stop()
        self.dataplane.close()
        for engine in engines:
            engine.close()
        self.zygotes.close()
        self.datasets.close()
        self.shipped_caches.close()
        self.registry.close()
        if isinstance(self.context.remote, Remote):
            self.context.remote.close()

    def _ensure_demo(self) -> None:
        if self.registry.dataset(DEMO_DATASET.name) is None:
            self.create_dataset(DEMO_DATASET)
        if DEMO_LOADER.name not in self.table:
            try:
                self.create_loader(DEMO_LOADER)
            except (errors.ProblemError, DomainError) as exc:  # a budget too small: serve anyway
                log.error("the demo loader cannot start: %s", exc)

    # -- datasets ----------------------------------------------------------------------
    def create_dataset(self, body: DatasetCreate) -> dict[str, Any]:
        with self._lock:
            if self.registry.dataset(body.name) is not None:
                raise errors.Conflict(f"dataset {body.name!r} exists; delete it first")
            self.datasets.create(body)
            return self.datasets.describe(body.name)

    def list_datasets(self) -> list[dict[str, Any]]:
        return [self.datasets.describe(row.name) for row in self.registry.datasets()]

    def describe_dataset(self, name: str) -> dict[str, Any]:
        return self.datasets.describe(name)

    def cache_stats(self) -> dict[str, Any]:
        """The stats of every open dataset's cache, by dataset name (``GET /metrics``),
        and of every trainer's cache (``pinfeed.DataLoader``'s ``cache=``), as ``~name``."""
        return self.datasets.cache_stats() | self.shipped_caches.stats()

    def drop_cache(self, name: str) -> dict[str, Any]:
        """Empty dataset ``name``'s cache and give its memory back; 409 while a loader
        uses the dataset (its workers may hold views of the cache)."""
        with self._lock:
            self.datasets.row(name)  # NotFound first
            users = [r.name for r in self.table.readers_of(name) if r.engine is not None]
            if users:
                raise errors.Conflict(
                    f"the cache of dataset {name!r} is read by loaders {users}; delete them first"
                )
            self.datasets.clear_cache(name)
        return self.datasets.describe(name)

    def delete_dataset(self, name: str) -> None:
        with self._lock:
            self.datasets.row(name)  # NotFound first
            users = [r.name for r in self.table.readers_of(name)]
            if users:
                raise errors.Conflict(
                    f"dataset {name!r} is used by loaders {users}; delete them first"
                )
            self.datasets.delete(name)

    # -- loaders -----------------------------------------------------------------------
    def create_loader(self, body: LoaderCreate) -> dict[str, Any]:
        with self._lock:
            if body.name in self.table or self.registry.loader(body.name) is not None:
                raise errors.Conflict(f"loader {body.name!r} exists; delete it first")
            config = body.model_dump(exclude={"dataset"})
            if config["seed"] is None:
                config["seed"] = secrets.randbelow(2**31)
            engine = self._start_registered(body.dataset, config)
            try:
                created = self.registry.add_loader(body.name, body.dataset, config)
            except BaseException:
                engine.close()
                raise
            self.table.add(LoaderRecord(body.name, body.dataset, created, engine))
            return self.describe_loader(body.name)

    def _start_registered(
        self, dataset_name: str, fields: dict[str, Any], resumed: dict[str, Any] | None = None
    ) -> LoaderEngine:
        """A registered loader (its ``fields`` as the registry keeps them) over dataset
        ``dataset_name``, built and started; ``resumed``: the elastic epoch the registry
        kept for it."""
        config = LoaderConfig.model_validate({**fields, "dataset": dataset_name})
        if config.mixture is not None:
            dataset, kind, params, spawn = self._sources(config)
        else:
            found = self.datasets.row(dataset_name)
            kind = KINDS[found.kind]
            params = found.params
            dataset = self.datasets.open(dataset_name, kind.name, params, found.cache)
            # The dataset's zygote starts with the first local worker process, in the
            # loader's boot thread (state "starting"); one that cannot start fails the
            # loader with the reason.
            zygote = functools.partial(self.zygotes.get, dataset_name, dataset, kind.name, params)
            spawn = lambda: zygote().process_factory  # noqa: E731
        spec = LoaderSpec(
            config,
            dataset,
            kind,
            params,
            spawn=spawn,
            resumed=resumed,
            keep=functools.partial(self._keep_elastic, config.name),
        )
        return self.builder.build(spec)

    def _sources(self, config: LoaderConfig) -> tuple[Any, Kind[Any], dict[str, Any], Any]:
        """A mixture loader's sources as one dataset (``datasets/mixture.py``): built
        here from the sources' kinds, and again by its workers (forked from the plain
        forkserver: a loader's sources have no zygote of their own)."""
        assert config.mixture is not None
        rows = [self.datasets.row(name) for name in config.mixture.names]  # NotFound first
        params = {
            "sources": [
                {"name": name, "kind": row.kind, "params": row.params}
                for name, row in zip(config.mixture.names, rows, strict=True)
            ]
        }
        kind = BUILT_FOR_LOADERS["mixture"]
        try:
            dataset = build_dataset(kind.name, params, self.context)
        except DomainError:
            raise
        except Exception as exc:  # a source's corrupt file: the caller's problem
            raise errors.InvalidRequest(
                f"loader {config.name!r}: its mixture cannot open: {type(exc).__name__}: {exc}"
            ) from None
        return dataset, kind, params, lambda: multiprocessing.get_context("forkserver").Process

    def _keep_elastic(self, name: str, record: dict[str, Any] | None) -> None:
        """A loader's new elastic epoch, into the registry (a failure is logged: the
        loader runs on it, and only a server restart would forget it)."""
        try:
            self.registry.set_elastic(name, record)
        except Exception:
            log.exception("loader %s: its elastic epoch could not be recorded", name)

    def _admit(
        self, config: LoaderConfig, ring_bytes: int, workers: int, replaces: str | None = None
    ) -> None:
        """The node budget's admission, after the arbiter made what room it can: workers
        of autotuned loaders above their floors go to a loader that would not fit."""
        short = self.budget.workers_used(replaces or config.name) + workers
        short -= self.budget.max_workers
        if short > 0:
            self.arbiter.make_room(short, config.name, config.priority)
        self.budget.admit(config, ring_bytes, workers, replaces)

    def _admit_ring(self, config: LoaderConfig, ring_bytes: int, workers: int) -> None:
        """The budget's admission of the ring a loader's first batches sized (its
        workers were admitted when it was made): a refusal fails the loader."""
        with self._lock:
            self.budget.admit(config, ring_bytes, workers, replaces=config.name)

    def _started(self, name: str) -> LoaderEngine:
        """Loader ``name``'s engine: NotFound, or Conflict if it could not start."""
        engine = self.table[name].engine
        if engine is None:
            raise errors.Conflict(f"loader {name!r} failed to start; delete and recreate it")
        return engine

    def describe_loader(self, name: str) -> dict[str, Any]:
        return self.table[name].describe()

    def list_loaders(self) -> list[dict[str, Any]]:
        return [record.describe() for record in self.table.records()]

    def loader_stats(self, name: str) -> StatsSnapshot:
        return self.table[name].stats()

    def unstarted(self) -> list[tuple[dict[str, Any], LoaderStatus, StatsSnapshot]]:
        """The loaders that could not start (``GET /metrics`` lists them): each one's
        config with its dataset, its status (failed) and its stats (zeros)."""
        return [
            (
                {**r.unstarted.fields, "name": r.name, "dataset": r.dataset},
                LoaderStatus.unstarted(r.unstarted.detail),
                r.stats(),
            )
            for r in self.table.unstarted()
            if r.unstarted is not None
        ]

    def starting_loaders(self) -> list[str]:
        return sorted(n for n, e in self.table.engines().items() if e.state == "starting")

    def workers_used(self) -> int:
        return self.budget.workers_used()

    def shm_used(self) -> int:
        return self.budget.shm_used()

    def batch(self, name: str, epoch: int, index: int) -> dict[str, Any]:
        """Batch ``index`` of ``epoch`` of loader ``name``: its sample indices, and the
        rank and DataLoader worker that make it (from the loader's config, seed and
        elastic record: the same for a past epoch, or after a server restart)."""
        engine = self._started(name)
        indices = engine.batch_indices(epoch, index)
        resumed = engine.elastic_epoch()
        return {
            "loader": name,
            "epoch": epoch,
            "index": index,
            "indices": indices,
            "rank": engine.config.rank,
            "world_size": engine.config.world_size,
            "worker": engine.worker_of(index),
            "elastic": resumed is not None and resumed["epoch"] == epoch,
        }

    def patch_loader(self, name: str, body: LoaderPatch) -> dict[str, Any]:
        """Change num_workers/prefetch_factor live: position and batches are kept; the
        ring grows or shrinks to fit (only the node's limits refuse). Explicit values
        turn autotune off; ``autotune`` turns it on (or, null, off). A field given as
        null, or not at all, stays (but ``autotune``: null is off)."""
        given = {k: getattr(body, k) for k in body.model_fields_set}
        values = {k: v for k, v in given.items() if v is not None or nullable(k)}
        if "autotune" not in values and values.keys() & {"num_workers", "prefetch_factor"}:
            values["autotune"] = None  # what autotune sets, set by hand: autotune is off
        self.reconfigure(name, LiveChange(**values), make_room=True)
        return self.describe_loader(name)

    def reconfigure(self, name: str, change: LiveChange, make_room: bool = False) -> LoaderConfig:
        """A live change of loader ``name`` (a PATCH, or the arbiter's), admitted by the
        node budget and applied by the engine, then recorded in the registry.
        ``make_room``: a PATCH, which the arbiter makes room for as for a new loader (its
        own changes never take from others this way)."""
        with self._lock:
            record = self.table[name]
            engine = self._started(name)
            if make_room:
                admit = functools.partial(self._admit, replaces=name)
            else:
                admit = functools.partial(self.budget.admit, replaces=name)
            config = engine.reconfigure(change, admit)
            row = None if record.owner is not None else self.registry.loader(name)
            if row is not None:  # a trainer's own loader is not in the registry
                live = config.model_dump(include=set(LIVE))
                self.registry.update_loader(name, row.config | live)
            return config

    def delete_loader(self, name: str) -> None:
        with self._lock:
            record = self.table.pop(name)
            if record.owner is None:
                self.registry.delete_loader(name)
        if record.owner is not None:  # its objects go with it
            self.trainers.close(record)
        elif record.engine is not None:
            record.engine.close()

    def node(self) -> NodePublic:
        """The node as GET /v1/node shows it."""
        state = self.arbiter.state()
        loaders = []
        for name, engine in sorted(self.table.engines().items()):
            cfg, r = engine.config, state.readings.get(name)
            counts = engine.producer.executor.counts_workers
            loaders.append(
                NodeLoader(
                    name=name,
                    priority=cfg.priority,
                    min_workers=cfg.min_workers,
                    workers=cfg.num_workers,
                    max_workers=cfg.autotune.max_workers if cfg.autotune else cfg.num_workers,
                    fixed=cfg.autotune is None or not counts,
                    counts_workers=counts,
                    trainers=engine.consumers.attached,
                    wait_share=None if r is None else r.wait_share,
                    busy_share=None if r is None else r.busy_share,
                    samples_per_s=None if r is None else r.samples_per_s,
                    weighted_stall=None if r is None else r.stall,
                )
            )
        left = self.exits_in_s()
        return NodePublic(
            uptime_s=round(time.monotonic() - self.arbiter.started, 2),
            lifetime=NodeLifetime(
                started_by=self.settings.started_by,
                idle_exit_s=self.settings.idle_exit_s,
                exits_in_s=None if left is None else round(left, 1),
            ),
            cpus=len(os.sched_getaffinity(0)),
            max_workers=self.budget.max_workers,
            workers_used=self.workers_used(),
            shm_budget_bytes=self.budget.max_shm_bytes,
            shm_used_bytes=self.shm_used(),
            arbiter=ArbiterPublic(
                enabled=state.enabled,
                interval_s=state.interval_s,
                settled=state.settled,
                settled_after_s=state.settled_after_s,
                weighted_stall=state.weighted_stall,
                trial=state.trial,
            ),
            loaders=loaders,
            decisions=[NodeDecision.model_validate(asdict(d)) for d in state.decisions],
            remote=None if (remote := self.remote_stats()) is None else remote.to_json(),
        )

    def remote_stats(self) -> RemoteStats | None:
        """The object store's and the node's object cache's counts (None: none read)."""
        remote = self.context.remote
        return remote.stats() if isinstance(remote, Remote) else None

    # -- loaders a trainer makes (pinfeed.DataLoader) ----------------------------------------
    def create_owned(
        self, request: protocol.Create, payload_fd: int, shared: list[int], peer: Peer
    ) -> LoaderEngine:
        """A loader of its own for the trainer at ``peer``, over the objects in its payload
        (and the shared memory they map), fed by its sampler (``engine/fed_plan.py``); a
        named one that exists with the same config and payload is handed over, warm.
        Raises the pinfeed error that says why not (the data plane sends it). The fds
        stay the caller's: the loader keeps duplicates."""
        with self._lock:
            kept = None if request.name is None else self.table.get(request.name)
            if kept is not None:
                return self.trainers.reattach(kept, request, payload_fd, shared, peer)
            name = self.trainers.name_for(request, peer)
            record = self.trainers.start(name, request, payload_fd, shared, peer)
            self.table.add(record)
            assert record.engine is not None
            return record.engine

    def owner_gone(self, name: str) -> None:
        """The trainer of loader ``name`` left (exit, crash, SIGKILL: its connection
        closed): the loader goes with it, or, named, waits warm for the next one."""
        with self._lock:
            record = self.table.get(name)
            if record is None or record.owner is None:
                return
            if record.owner.keep:
                record.owner.attached = False
                return
        self.delete_loader(name)
