"""The service: registry + running loader engines + the data-plane socket.

Routers call this; it enforces the rules (names unique, datasets in use stay,
memory budget) and raises ``pinfeed.errors`` exceptions that become problem+json.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import logging
import os
import re
import secrets
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from pinfeed import errors, payload, protocol, served
from pinfeed.payload import Chain
from pinfeed_server import cache
from pinfeed_server.cache import CachedDataset, CacheSpec, NotCacheable
from pinfeed_server.cache.region import Region
from pinfeed_server.cache.shipped import ShippedCaches
from pinfeed_server.datasets import KINDS, DatasetContext, DatasetError, build_dataset, shipped
from pinfeed_server.engine.collate import (
    LayoutError,
    describe,
    probe,
)
from pinfeed_server.engine.config import (
    KEEP,
    MAX_WORKERS,
    NAME_PATTERN,
    LiveChange,
    LoaderCode,
    LoaderConfig,
    ring_slots,
)
from pinfeed_server.engine.dataplane import DataPlaneServer, Peer
from pinfeed_server.engine.fed_plan import FedPlan
from pinfeed_server.engine.iterable import (
    dataset_len,
    first_samples,
    is_iterable,
)
from pinfeed_server.engine.loader import LoaderEngine, Sizing
from pinfeed_server.engine.prepare import ConfigError, prepare
from pinfeed_server.engine.producers import Zygotes, configure_forkserver, executors
from pinfeed_server.engine.producers.inline import GLOBAL_RNG
from pinfeed_server.engine.producers.zygote import Zygote
from pinfeed_server.engine.stats import StatsSnapshot
from pinfeed_server.engine.status import LoaderStatus
from pinfeed_server.malloc import return_big_buffers
from pinfeed_server.node.arbiter import NodeArbiter
from pinfeed_server.node.budget import NodeBudget
from pinfeed_server.registry import DuplicateName, Registry
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
from pinfeed_server.settings import Settings

log = logging.getLogger("pinfeed")

DEMO_DATASET = DatasetCreate.model_validate(
    {"name": "demo", "kind": "synthetic", "params": DEMO_PARAMS}
)
DEMO_LOADER = LoaderCreate(name="demo", dataset="demo", batch_size=10)
# What a live change may change, recorded in the registry's row.
LIVE_FIELDS = {"num_workers", "prefetch_factor", "autotune", "priority", "min_workers"}
# A trainer-made loader's zygote, apart from the registered datasets' ('~' is in no name).
OWNED_ZYGOTE = "~"


COLLECT_RETRY_S = (0.05, 10.0)  # a closed loader's objects: first retry, give up after


def _weak(objs: list[Any]) -> list[weakref.ref[Any]]:
    refs = []
    for obj in objs:
        with contextlib.suppress(TypeError):  # an object that takes no weak reference
            refs.append(weakref.ref(obj))
    return refs


def _collect_until_gone(name: str, gone: list[weakref.ref[Any]], waited: float = 0.0) -> None:
    """Collect until what ``gone`` refers to (a closed loader, its dataset) is freed: the
    trainer's objects and their pages are in reference cycles, which only a collection
    frees, and one of the loader's threads may still be ending. At once, and again from
    a timer, backing off, for ``COLLECT_RETRY_S[1]`` at most."""
    gc.collect()
    if all(ref() is None for ref in gone):
        return
    if waited >= COLLECT_RETRY_S[1]:
        log.warning("loader %s: its objects still referenced %.0f s after it closed", name, waited)
        return
    pause = max(COLLECT_RETRY_S[0], waited)
    timer = threading.Timer(pause, _collect_until_gone, (name, gone, waited + pause))
    timer.daemon = True
    timer.start()


@dataclass
class Owned:
    """A loader a trainer made with ``pinfeed.DataLoader`` over its own objects. It is
    not in the registry (its objects live with it): it goes when its trainer's
    connection does, or, named (``keep``), when it is deleted or the server stops."""

    owner: Peer
    digest: str  # the trainer's config and payload: a later trainer must send the same
    keep: bool
    created_at: float
    cache: str | None  # the key of the node cache its dataset reads through (cache=)
    attached: bool = True


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.context = DatasetContext(
            settings.data_root, tuple(settings.allowed_plugins), Remote(settings.remote)
        )
        self.registry = Registry(settings.registry_path)
        self.loaders: dict[str, LoaderEngine] = {}
        # Registered loaders that could not start after a restart (dataset file gone,
        # budget lowered): listed as failed so they can be seen and deleted.
        self._unstarted: dict[str, dict[str, Any]] = {}
        self._datasets: dict[str, Any] = {}  # name -> built dataset, shared by its loaders
        # the processes the workers of each dataset's loaders are forked from (started
        # with its first loader with workers, stopped with the dataset)
        self.zygotes = Zygotes(self.context)
        self._lock = threading.RLock()
        self.executors = executors(settings.ray_address)
        self.budget = NodeBudget(
            settings.max_workers,
            settings.max_shm_bytes,
            lambda: self.loaders,
            self._cache_reservations,
            settings.cache_budget,
        )
        # the caches of trainers' shipped datasets (pinfeed.DataLoader's cache=)
        self.shipped_caches = ShippedCaches(self.context, self.budget.admit_cache)
        self.arbiter = NodeArbiter(
            lambda: list(self.loaders.items()),
            self.budget,
            self.reconfigure,
            self._lock,
            enabled=settings.arbiter,
            interval_s=settings.arbiter_interval_s,
        )
        self._owned: dict[str, Owned] = {}  # loaders made by trainers (pinfeed.DataLoader)
        self._closed = threading.Event()
        self._owned_ids = itertools.count()
        self.dataplane = DataPlaneServer(
            settings.socket_path,
            self.loaders.get,
            settings.attach_timeout_s,
            group=settings.socket_gid,
            create=self.create_owned if settings.accept_objects else None,
            owner_gone=self.owner_gone,
            describe=self.describe_spec,
        )

    # -- lifecycle -------------------------------------------------------------------
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
                self._start_loader(
                    row["dataset"], row["config"], self.registry.elastic(row["name"])
                )
            except Exception as exc:  # one bad row must not keep the others from starting
                detail = (
                    exc.detail
                    if isinstance(exc, errors.ProblemError)
                    else (f"{type(exc).__name__}: {exc}")
                )
                log.error("loader %s from the registry cannot start: %s", row["name"], detail)
                self._unstarted[row["name"]] = row | {"detail": detail}

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
            engines = list(self.loaders.values())
            self.loaders.clear()
        # Stop producing first: once the data plane closes, trainers' leases come back,
        # and a running producer could refill a slot a trainer still reads.
        for engine in engines:
            engine.stop()
        self.dataplane.close()
        for engine in engines:
            engine.close()
        self.zygotes.close()
        with self._lock:
            for ds in self._datasets.values():
                if isinstance(ds, CachedDataset):
                    ds.cache.close()
            self._datasets.clear()
        self.shipped_caches.close()
        self.registry.close()
        if isinstance(self.context.remote, Remote):
            self.context.remote.close()

    def _ensure_demo(self) -> None:
        names = {d["name"] for d in self.registry.datasets()}
        if DEMO_DATASET.name not in names:
            self.create_dataset(DEMO_DATASET)
        if DEMO_LOADER.name not in self.loaders and DEMO_LOADER.name not in self._unstarted:
            try:
                self.create_loader(DEMO_LOADER)
            except errors.ProblemError as exc:  # e.g. a budget too small: serve anyway
                log.error("the demo loader cannot start: %s", exc.detail)

    # -- datasets ----------------------------------------------------------------------
    def _open(
        self, name: str, kind: str, params: dict[str, Any], spec: dict[str, Any] | None = None
    ) -> Any:
        """Dataset ``name``, built once (behind its cache, if ``spec`` asks for one) and
        shared by its loaders."""
        with self._lock:
            if name not in self._datasets:
                try:
                    ds = build_dataset(kind, params, self.context)
                except DatasetError as exc:
                    raise errors.InvalidRequest(str(exc)) from None
                except Exception as exc:  # a corrupt file is the caller's problem, not a 500
                    log.warning("dataset %s cannot open", name, exc_info=True)
                    raise errors.InvalidRequest(
                        f"dataset {name!r} cannot open: {type(exc).__name__}: {exc}"
                    ) from None
                if spec is not None:
                    ds = self._cached(name, kind, params, ds, CacheSpec.model_validate(spec))
                self._datasets[name] = ds
            return self._datasets[name]

    def _cached(
        self, name: str, kind: str, params: dict[str, Any], ds: Any, spec: CacheSpec
    ) -> CachedDataset:
        """``ds`` behind a cache: checked (a 422 naming what moved), admitted by the
        node's budget (507), mapped (a persisted file reopened or rebuilt)."""
        try:
            with GLOBAL_RNG:  # the check watches the process's RNGs
                probe = cache.check(f"dataset {name!r}", ds)
        except NotCacheable as exc:
            raise errors.InvalidRequest(str(exc)) from None
        nbytes = cache.reservation(spec, probe, len(ds))
        self.budget.admit_cache(name, nbytes)
        return cache.build(
            name,
            ds,
            spec,
            (kind, params, self.context),
            nbytes,
            self.settings.cache_path,
            ship_base=KINDS[kind].ship_build,
        )

    def _cache_reservations(self) -> dict[str, int]:
        """Each cache's reserved bytes (the node budget's view of the caches): the
        registered datasets', and the trainers' (``ShippedCaches``, keys ``~name``)."""
        return {
            name: ds.cache.region.layout.total
            for name, ds in list(self._datasets.items())
            if isinstance(ds, CachedDataset)
        } | self.shipped_caches.reservations()

    def _dataset_row(self, name: str) -> dict[str, Any]:
        for row in self.registry.datasets():
            if row["name"] == name:
                return row
        raise errors.NotFound(f"no dataset named {name!r}")

    def create_dataset(self, body: DatasetCreate) -> dict[str, Any]:
        with self._lock:
            if any(d["name"] == body.name for d in self.registry.datasets()):
                raise errors.Conflict(f"dataset {body.name!r} exists; delete it first")
            self._forget(body.name)
            params = body.params
            spec = None if body.cache is None else body.cache.model_dump()
            self._open(body.name, body.kind, params, spec)
            try:
                self.registry.add_dataset(body.name, body.kind, params, spec)
            except DuplicateName:
                raise errors.Conflict(f"dataset {body.name!r} exists") from None
            return self.describe_dataset(body.name)

    def describe_spec(self, kind: str, params: dict[str, Any]) -> protocol.Described:
        """A DESCRIBE (``pinfeed.ServerDataset``): what ``kind`` builds from ``params``
        here (its length, whether it is iterable), registering nothing."""
        try:
            ds = build_dataset(kind, params, self.context)
        except DatasetError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        return protocol.Described(dataset_len(ds), is_iterable(ds))

    def list_datasets(self) -> list[dict[str, Any]]:
        return [self.describe_dataset(row["name"]) for row in self.registry.datasets()]

    def describe_dataset(self, name: str) -> dict[str, Any]:
        row = self._dataset_row(name)
        spec = row.pop("cache")
        try:
            ds = self._open(name, row["kind"], row["params"], spec)
            if isinstance(ds, CachedDataset):
                row["cache"] = ds.cache.stats()
                ds = ds.base  # sample 0 as the dataset reads it: no hit or miss counted
            with GLOBAL_RNG:  # not while an inline loader has its RNGs swapped in
                sample = first_samples(ds)[0] if is_iterable(ds) else ds[0]
                row |= {"length": dataset_len(ds), "sample": describe(probe(sample, 1))}
        except (errors.ProblemError, LayoutError, Exception) as exc:
            row |= {"error": f"{type(exc).__name__}: {exc}"}
        return row

    def cache_stats(self) -> dict[str, cache.CacheStats]:
        """The stats of every open dataset's cache, by dataset name (``GET /metrics``),
        and of every trainer's cache (``pinfeed.DataLoader``'s ``cache=``), as ``~name``."""
        with self._lock:
            cached = [(n, d) for n, d in self._datasets.items() if isinstance(d, CachedDataset)]
        out = {name: ds.cache.stats() for name, ds in sorted(cached)}
        return out | self.shipped_caches.stats()

    def drop_cache(self, name: str) -> dict[str, Any]:
        """Empty dataset ``name``'s cache and give its memory back; 409 while a loader
        uses the dataset (its workers may hold views of the cache)."""
        with self._lock:
            row = self._dataset_row(name)
            if row["cache"] is None:
                raise errors.NotFound(f"dataset {name!r} has no cache")
            users = sorted(n for n, e in self.loaders.items() if e.config.dataset == name)
            if users:
                raise errors.Conflict(
                    f"the cache of dataset {name!r} is read by loaders {users}; delete them first"
                )
            ds = self._open(name, row["kind"], row["params"], row["cache"])
            assert isinstance(ds, CachedDataset)
            ds.cache.clear()
        return self.describe_dataset(name)

    def _forget(self, name: str) -> None:
        """Drop dataset ``name``'s build (and close its cache); under the lock."""
        ds = self._datasets.pop(name, None)
        if isinstance(ds, CachedDataset):
            ds.cache.close()

    def delete_dataset(self, name: str) -> None:
        with self._lock:
            row = self._dataset_row(name)
            users = [n for n, e in self.loaders.items() if e.config.dataset == name]
            users += [r["name"] for r in self.registry.loaders() if r["dataset"] == name]
            if users:
                raise errors.Conflict(
                    f"dataset {name!r} is used by loaders {sorted(set(users))}; delete them first"
                )
            self.registry.delete_dataset(name)
            self._forget(name)  # the cache's memory goes once its zygote has unmapped it too
        self.zygotes.discard(name)
        if row["cache"] is not None and row["cache"].get("persist"):
            cache.cache_path(self.settings.cache_path, name).unlink(missing_ok=True)

    # -- loaders -----------------------------------------------------------------------
    def create_loader(self, body: LoaderCreate) -> dict[str, Any]:
        with self._lock:
            if body.name in self.loaders or any(
                r["name"] == body.name for r in self.registry.loaders()
            ):
                raise errors.Conflict(f"loader {body.name!r} exists; delete it first")
            config = body.model_dump(exclude={"dataset"})
            if config["seed"] is None:
                config["seed"] = secrets.randbelow(2**31)
            engine = self._start_loader(body.dataset, config)
            try:
                self.registry.add_loader(body.name, body.dataset, config)
            except DuplicateName:
                self.loaders.pop(body.name)
                engine.close()
                raise errors.Conflict(f"loader {body.name!r} exists") from None
            return self.describe_loader(body.name)

    def _start_loader(
        self, dataset_name: str, config: dict[str, Any], resumed: dict[str, Any] | None = None
    ) -> LoaderEngine:
        row = self._dataset_row(dataset_name)
        kind, params = KINDS[row["kind"]], row["params"]
        ds = self._open(dataset_name, kind.name, params, row["cache"])
        cfg = LoaderConfig.model_validate({**config, "dataset": dataset_name})
        # Without max_batch_bytes, a collate_fn loader's ring takes at most a quarter of
        # the budget left (collate.loader_layout).
        cap = max(0, self.settings.max_shm_bytes - self.shm_used()) // (4 * ring_slots(cfg))
        try:
            ready = prepare(cfg, ds, kind, self.executors, self.context.allowed_plugins, cap)
        except ConfigError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        workers = cfg.num_workers if ready.executor.counts_workers else 0
        assert ready.layout is not None  # a plan of its own: sized from its first batch
        self._admit(cfg, ring_slots(cfg) * ready.layout.slot_bytes, workers)
        # The dataset's zygote starts with the first local worker process, in the
        # loader's boot thread (state "starting"); one that cannot start fails the
        # loader with the reason.
        zygote = functools.partial(self.zygotes.get, dataset_name, ds, kind.name, params)
        engine = LoaderEngine(
            cfg,
            ready.dataset,  # its transform over the shared dataset (and its cache)
            kind,
            params,
            self.context,
            ready.layout,
            ready.plan,
            ready.code,
            ready.executor,
            spawn=lambda: zygote().process_factory,
            resumed=resumed,
            keep=functools.partial(self._keep_elastic, cfg.name),
        )
        self.loaders[cfg.name] = engine
        engine.start()
        return engine

    def batch(self, name: str, epoch: int, index: int) -> dict[str, Any]:
        """Batch ``index`` of ``epoch`` of loader ``name``: its sample indices, and the
        rank and DataLoader worker that make it (from the loader's config, seed and
        elastic record: the same for a past epoch, or after a server restart)."""
        if name in self._unstarted:
            raise errors.Conflict(f"loader {name!r} failed to start; delete and recreate it")
        engine = self._engine(name)
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

    def _keep_elastic(self, name: str, record: dict[str, Any] | None) -> None:
        """A loader's new elastic epoch, into the registry (a failure is logged: the
        loader runs on it, and only a server restart would forget it)."""
        try:
            self.registry.set_elastic(name, record)
        except Exception:
            log.exception("loader %s: its elastic epoch could not be recorded", name)

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
            if request.name is not None:
                kept = self._reattach(request, payload_fd, shared, peer)
                if kept is not None:
                    return kept
            name = request.name or f"trainer-{peer.pid}-{next(self._owned_ids)}"
            chain = Chain()  # the payloads of its objects, as they change (OBJECTS)
            chain.add(os.dup(payload_fd), [os.dup(fd) for fd in shared])
            try:
                engine = self._start_owned(name, request, chain)
            except BaseException:
                chain.close()
                raise
            cache_key = ShippedCaches.key(request.cache_name, name) if request.cache else None
            self._owned[name] = Owned(
                peer, request.digest, request.name is not None, time.time(), cache_key
            )
            log.info("loader %s made by the trainer pid %d (uid %d)", name, peer.pid, peer.uid)
            return engine

    def _reattach(
        self, request: protocol.Create, fd: int, shared: list[int], peer: Peer
    ) -> LoaderEngine | None:
        """The named trainer-made loader ``request`` asks for, restarted for this trainer
        with its objects (payload ``fd``, the ``shared`` memory they map); None if there
        is none of that name."""
        name = request.name
        assert name is not None
        owned = self._owned.get(name)
        if owned is None:
            if name in self.loaders or name in self._unstarted:
                raise errors.Conflict(
                    f"a loader named {name!r} exists, made over HTTP: attach to it with "
                    "pinfeed.Loader(name), or give pinfeed.DataLoader another name"
                )
            return None
        if owned.digest != request.digest:
            raise errors.Conflict(
                f"loader {name!r} runs another configuration or other objects than this "
                "pinfeed.DataLoader's; give it another name, or delete the loader "
                f"(DELETE /v1/loaders/{name}) to make it anew"
            )
        if owned.attached:
            raise errors.Conflict(
                f"loader {name!r} is in use by the trainer pid {owned.owner.pid}; a named "
                "pinfeed.DataLoader serves one trainer at a time"
            )
        engine = self._engine(name)
        engine.restart_fed(os.dup(fd), [os.dup(f) for f in shared])
        owned.owner, owned.attached = peer, True
        return engine

    def _start_owned(self, name: str, request: protocol.Create, chain: Chain) -> LoaderEngine:
        """A trainer's loader over the objects in payload ``chain`` (the loader owns it).
        This process loads them only where it runs them (no workers: it makes the
        batches, as DataLoader's main process does) or checks them for the node's cache
        (``cache=``); with workers they are loaded in the dataset's zygote and its
        workers alone."""
        objects = None
        if request.num_workers == 0 or request.cache:
            try:
                with GLOBAL_RNG:  # the trainer's code runs here: not on a loader's RNGs
                    objects = shipped.load(chain.fds, chain.shared)
            except DatasetError as exc:
                raise errors.InvalidRequest(str(exc)) from None
        if not request.cache:
            return self._start_shipped(name, request, chain, objects, None)
        assert objects is not None
        name_ok = request.cache_name is None or re.fullmatch(NAME_PATTERN, request.cache_name)
        if not name_ok:
            raise errors.InvalidRequest(
                f"pinfeed.DataLoader: cache={request.cache_name!r}: a cache's name is "
                "letters, digits, '.', '_' and '-', 1-63 characters"
            )
        try:
            with GLOBAL_RNG:  # the check reads the trainer's dataset
                objects.dataset, region = self.shipped_caches.attach(
                    request.cache_name, name, objects.dataset, request.cache_max_bytes
                )
        except NotCacheable as exc:
            raise errors.InvalidRequest(str(exc)) from None
        try:
            return self._start_shipped(name, request, chain, objects, region)
        except BaseException:
            self.shipped_caches.release(name)
            raise

    def _start_shipped(
        self,
        name: str,
        request: protocol.Create,
        chain: Chain,
        objects: shipped.Shipped | None,
        cache_region: Region | None,
    ) -> LoaderEngine:
        """Loader ``name`` over a trainer's ``objects`` (None: not loaded here; its
        dataset behind the node's cache, whose region is ``cache_region``, where it
        asked for one). No sample is read: its ring is sized from the first batches its
        producer makes (``engine.loader.Sizing``), when the trainer's loop asks."""
        # DataLoader's num_workers are its RNG streams; its processes are as many as the
        # node has room for (one serves several streams where it has less), never none.
        processes = request.num_workers
        if processes:
            free = self.budget.max_workers - self.budget.workers_used()
            processes = max(1, min(processes, free, MAX_WORKERS))
        try:
            cfg = LoaderConfig(
                name=name,
                dataset=name,  # a label: its dataset is its own, never registered
                batch_size=request.max_rows or 1,
                seed=0,  # its trainer draws the seeds
                drop_last=request.drop_last,
                num_workers=processes,
                prefetch_factor=request.prefetch_factor,
                pin_memory=request.pin_memory,
                persistent_workers=request.persistent_workers,
                executor=request.executor,
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise errors.InvalidRequest(f"pinfeed.DataLoader: {problems}") from None
        plan = FedPlan(
            request.length or 0,
            request.max_rows or 1,
            iterable=request.iterable,
            reported=request.batches_per_epoch,
            samples=request.samples,
            fed_turns=request.num_workers == 0,
        )
        dataset = None if objects is None else objects.dataset
        code = (
            LoaderCode(None, None)
            if objects is None
            else LoaderCode(objects.collate_fn, objects.worker_init_fn)
        )
        params = shipped.params(request.draws)
        try:
            ready = prepare(
                cfg,
                dataset,
                shipped.KIND,
                self.executors,
                self.context.allowed_plugins,
                0,
                code=code,
                plan=plan,
                iterable=request.iterable,
            )
        except ConfigError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        workers = cfg.num_workers if ready.executor.counts_workers else 0
        self._admit(cfg, 0, workers)  # its ring once sized (Sizing.admit)

        def admit_ring(config: LoaderConfig, ring_bytes: int, workers: int) -> None:
            with self._lock:
                self.budget.admit(config, ring_bytes, workers, replaces=name)

        def cap() -> int:  # a per-batch layout's slot: a share of what the node has free
            return max(0, self.settings.max_shm_bytes - self.shm_used()) // (4 * ring_slots(cfg))

        def zygote() -> Zygote:  # its objects as last shipped (a zygote started again)
            payload = (chain.fds, chain.shared)
            return self.zygotes.get(
                OWNED_ZYGOTE + name, objects, shipped.KIND.name, params, payload, cache_region
            )

        engine = LoaderEngine(
            cfg,
            dataset,
            shipped.KIND,
            params,
            self.context,
            None,
            plan,
            code,
            ready.executor,
            spawn=lambda: zygote().process_factory,
            sizing=Sizing(admit_ring, cap),
            iterable=request.iterable,
            objects=chain,
            streams=request.num_workers,
        )
        self.loaders[name] = engine
        engine.start()
        if objects is not None and cfg.num_workers == 0:
            # This process reads the shipped objects' pages itself: map them in now,
            # beside the trainer's start, not by faults in its first epoch.
            threading.Thread(
                target=payload.populate, args=(objects.mapping,), name=f"populate-{name}"
            ).start()
        return engine

    def owner_gone(self, name: str) -> None:
        """The trainer of loader ``name`` left (exit, crash, SIGKILL: its connection
        closed): the loader goes with it, or, named, waits warm for the next one."""
        with self._lock:
            owned = self._owned.get(name)
            if owned is None:
                return
            if owned.keep:
                owned.attached = False
                return
        self.delete_loader(name)

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

    def _engine(self, name: str) -> LoaderEngine:
        engine = self.loaders.get(name)
        if engine is None:
            raise errors.NotFound(f"no loader named {name!r}")
        return engine

    def starting_loaders(self) -> list[str]:
        return sorted(n for n, e in list(self.loaders.items()) if e.state == "starting")

    def workers_used(self) -> int:
        return self.budget.workers_used()

    def shm_used(self) -> int:
        return self.budget.shm_used()

    def _describe_unstarted(self, row: dict[str, Any]) -> dict[str, Any]:
        return {
            **row["config"],
            "dataset": row["dataset"],
            "created_at": row["created_at"],
            "batch": None,
            **LoaderStatus.unstarted(row["detail"]).model_dump(),
        }

    def describe_loader(self, name: str) -> dict[str, Any]:
        if name in self._unstarted:
            return self._describe_unstarted(self._unstarted[name])
        engine = self._engine(name)
        owned = self._owned.get(name)
        if owned is not None:
            created = owned.created_at
            owner: dict[str, Any] | None = {
                "pid": owned.owner.pid,
                "uid": owned.owner.uid,
                "attached": owned.attached,
                "keep": owned.keep,
                "cache": owned.cache,
            }
        else:
            rows = self.registry.loaders()
            created = next((r["created_at"] for r in rows if r["name"] == name), 0.0)
            owner = None
        return {
            **engine.config.model_dump(),
            "created_at": created,
            "batch": None if engine.layout is None else describe(engine.layout),
            "owner": owner,
            **engine.status().model_dump(),
        }

    def list_loaders(self) -> list[dict[str, Any]]:
        names = sorted({*self.loaders, *self._unstarted})
        out = []
        for name in names:
            try:
                out.append(self.describe_loader(name))
            except errors.NotFound:
                continue  # deleted while we listed
        return out

    def node(self) -> NodePublic:
        """The node as GET /v1/node shows it."""
        state = self.arbiter.state()
        loaders = []
        for name, engine in sorted(list(self.loaders.items())):
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

    def loader_stats(self, name: str) -> StatsSnapshot:
        if name in self._unstarted:
            return StatsSnapshot.zeros(name, self._unstarted[name]["config"]["num_workers"])
        return self._engine(name).stats_snapshot()

    def unstarted(self) -> list[tuple[dict[str, Any], LoaderStatus, StatsSnapshot]]:
        """The loaders that could not start (``GET /metrics`` lists them): each one's
        config with its dataset, its status (failed) and its stats (zeros)."""
        return [
            (
                {**row["config"], "name": name, "dataset": row["dataset"]},
                LoaderStatus.unstarted(row["detail"]),
                StatsSnapshot.zeros(name, row["config"]["num_workers"]),
            )
            for name, row in sorted(self._unstarted.items())
        ]

    def patch_loader(self, name: str, body: LoaderPatch) -> dict[str, Any]:
        """Change num_workers/prefetch_factor live: position and batches are kept; the
        ring grows or shrinks to fit (only the node's limits refuse). Explicit values
        turn autotune off; ``autotune`` turns it on (or, null, off)."""
        if "autotune" in body.model_fields_set:
            autotune = body.autotune
        elif body.num_workers is not None or body.prefetch_factor is not None:
            autotune = None
        else:
            autotune = KEEP
        change = LiveChange(
            body.num_workers, body.prefetch_factor, autotune, body.priority, body.min_workers
        )
        self.reconfigure(name, change, make_room=True)
        return self.describe_loader(name)

    def reconfigure(self, name: str, change: LiveChange, make_room: bool = False) -> LoaderConfig:
        """A live change of loader ``name`` (a PATCH, or the arbiter's), admitted by the
        node budget and applied by the engine, then recorded in the registry.
        ``make_room``: a PATCH, which the arbiter makes room for as for a new loader (its
        own changes never take from others this way)."""
        with self._lock:
            if name in self._unstarted:
                raise errors.Conflict(f"loader {name!r} failed to start; delete and recreate it")
            engine = self._engine(name)
            if make_room:
                admit = functools.partial(self._admit, replaces=name)
            else:
                admit = functools.partial(self.budget.admit, replaces=name)
            config = engine.reconfigure(change, admit)
            row = next((r for r in self.registry.loaders() if r["name"] == name), None)
            if row is not None:  # a trainer's own loader is not in the registry
                live = config.model_dump(include=LIVE_FIELDS)
                self.registry.update_loader(name, row["config"] | live)
            return config

    def delete_loader(self, name: str) -> None:
        with self._lock:
            if self._unstarted.pop(name, None) is not None:
                self.registry.delete_loader(name)
                return
            engine = self._engine(name)
            owned = self._owned.pop(name, None)
            if owned is None:
                self.registry.delete_loader(name)
            del self.loaders[name]
        engine.close()
        if owned is not None:  # its objects: the zygote that holds them (the engine
            # closed their memfds), and the cache it read through
            self.zygotes.discard(OWNED_ZYGOTE + name)
            self.shipped_caches.release(name)  # a cache no other loader reads goes
            gone = _weak([engine, engine.dataset])
            del engine
            _collect_until_gone(name, gone)
