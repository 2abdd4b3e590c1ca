"""The service: registry + running loader engines + the data-plane socket.

Routers call this; it enforces the rules (names unique, datasets in use stay,
memory budget) and raises ``pinfeed.errors`` exceptions that become problem+json.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import secrets
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from pinfeed import errors
from pinfeed_server.datasets import KINDS, DatasetContext, DatasetError, build_dataset
from pinfeed_server.engine.collate import (
    LayoutError,
    describe,
    probe,
)
from pinfeed_server.engine.config import KEEP, LiveChange, LoaderConfig, ring_slots
from pinfeed_server.engine.dataplane import DataPlaneServer
from pinfeed_server.engine.iterable import (
    dataset_len,
    first_samples,
    is_iterable,
)
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.engine.prepare import ConfigError, prepare
from pinfeed_server.engine.producers import Zygotes, configure_forkserver, executors
from pinfeed_server.engine.producers.inline import GLOBAL_RNG
from pinfeed_server.engine.stats import StatsSnapshot
from pinfeed_server.engine.status import LoaderStatus
from pinfeed_server.node.budget import NodeBudget
from pinfeed_server.node.tuning import TuningLoop
from pinfeed_server.registry import DuplicateName, Registry
from pinfeed_server.schemas import DEMO_PARAMS, DatasetCreate, LoaderCreate, LoaderPatch
from pinfeed_server.settings import Settings

log = logging.getLogger("pinfeed")

DEMO_DATASET = DatasetCreate.model_validate(
    {"name": "demo", "kind": "synthetic", "params": DEMO_PARAMS}
)
DEMO_LOADER = LoaderCreate(name="demo", dataset="demo", batch_size=10)


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.context = DatasetContext(settings.data_root, tuple(settings.allowed_plugins))
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
        self.budget = NodeBudget(settings.max_workers, settings.max_shm_bytes, lambda: self.loaders)
        self.tuning = TuningLoop(
            lambda: list(self.loaders.items()),
            lambda name: settings.max_workers - self.budget.workers_used(name),
            self.reconfigure,
        )
        self.dataplane = DataPlaneServer(
            settings.socket_path,
            self.loaders.get,
            settings.attach_timeout_s,
            group=settings.socket_gid,
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
        self.dataplane.start()
        self.restore()
        if self.settings.demo:
            self._ensure_demo()
        self.tuning.start()
        log.info("data plane on %s", self.settings.socket_path)

    def restore(self) -> None:
        """Start every loader the registry holds (``start`` calls it; apart from the
        process-wide setup there, so the rules can be tested in-process). One that
        cannot start is listed failed with the reason, and the others start."""
        for row in self.registry.loaders():
            try:
                self._start_loader(row["dataset"], row["config"])
            except Exception as exc:  # one bad row must not keep the others from starting
                detail = (
                    exc.detail
                    if isinstance(exc, errors.ProblemError)
                    else (f"{type(exc).__name__}: {exc}")
                )
                log.error("loader %s from the registry cannot start: %s", row["name"], detail)
                self._unstarted[row["name"]] = row | {"detail": detail}

    def close(self) -> None:
        self.tuning.close()
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
        self.registry.close()

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
    def _open(self, name: str, kind: str, params: dict[str, Any]) -> Any:
        with self._lock:
            if name not in self._datasets:
                try:
                    self._datasets[name] = build_dataset(kind, params, self.context)
                except DatasetError as exc:
                    raise errors.InvalidRequest(str(exc)) from None
                except Exception as exc:  # a corrupt file is the caller's problem, not a 500
                    log.warning("dataset %s cannot open", name, exc_info=True)
                    raise errors.InvalidRequest(
                        f"dataset {name!r} cannot open: {type(exc).__name__}: {exc}"
                    ) from None
            return self._datasets[name]

    def _dataset_row(self, name: str) -> dict[str, Any]:
        for row in self.registry.datasets():
            if row["name"] == name:
                return row
        raise errors.NotFound(f"no dataset named {name!r}")

    def create_dataset(self, body: DatasetCreate) -> dict[str, Any]:
        with self._lock:
            if any(d["name"] == body.name for d in self.registry.datasets()):
                raise errors.Conflict(f"dataset {body.name!r} exists; delete it first")
            self._datasets.pop(body.name, None)
            params = body.params
            self._open(body.name, body.kind, params)
            try:
                self.registry.add_dataset(body.name, body.kind, params)
            except DuplicateName:
                raise errors.Conflict(f"dataset {body.name!r} exists") from None
            return self.describe_dataset(body.name)

    def list_datasets(self) -> list[dict[str, Any]]:
        return [self.describe_dataset(row["name"]) for row in self.registry.datasets()]

    def describe_dataset(self, name: str) -> dict[str, Any]:
        row = self._dataset_row(name)
        try:
            ds = self._open(name, row["kind"], row["params"])
            with GLOBAL_RNG:  # not while an inline loader has its RNGs swapped in
                sample = first_samples(ds)[0] if is_iterable(ds) else ds[0]
                row |= {"length": dataset_len(ds), "sample": describe(probe(sample, 1))}
        except (errors.ProblemError, LayoutError, Exception) as exc:
            row |= {"error": f"{type(exc).__name__}: {exc}"}
        return row

    def delete_dataset(self, name: str) -> None:
        with self._lock:
            self._dataset_row(name)
            users = [n for n, e in self.loaders.items() if e.config.dataset == name]
            users += [r["name"] for r in self.registry.loaders() if r["dataset"] == name]
            if users:
                raise errors.Conflict(
                    f"dataset {name!r} is used by loaders {sorted(set(users))}; delete them first"
                )
            self.registry.delete_dataset(name)
            self._datasets.pop(name, None)
        self.zygotes.discard(name)

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

    def _start_loader(self, dataset_name: str, config: dict[str, Any]) -> LoaderEngine:
        row = self._dataset_row(dataset_name)
        kind, params = KINDS[row["kind"]], row["params"]
        ds = self._open(dataset_name, kind.name, params)
        cfg = LoaderConfig.model_validate({**config, "dataset": dataset_name})
        # Without max_batch_bytes, a collate_fn loader's ring takes at most a quarter of
        # the budget left (collate.loader_layout).
        cap = max(0, self.settings.max_shm_bytes - self.shm_used()) // (4 * ring_slots(cfg))
        try:
            ready = prepare(cfg, ds, kind, self.executors, self.context.allowed_plugins, cap)
        except ConfigError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        workers = cfg.num_workers if ready.executor.counts_workers else 0
        self.budget.admit(cfg, ring_slots(cfg) * ready.layout.slot_bytes, workers)
        # The dataset's zygote starts with the first local worker process, in the
        # loader's boot thread (state "starting"); one that cannot start fails the
        # loader with the reason.
        zygote = functools.partial(self.zygotes.get, dataset_name, ds, kind.name, params)
        engine = LoaderEngine(
            cfg,
            ds,
            kind,
            params,
            self.context,
            ready.layout,
            ready.plan,
            ready.code,
            ready.executor,
            spawn=lambda: zygote().process_factory,
        )
        self.loaders[cfg.name] = engine
        engine.start()
        return engine

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
        created = next((r["created_at"] for r in self.registry.loaders() if r["name"] == name), 0.0)
        return {
            **engine.config.model_dump(),
            "created_at": created,
            "batch": describe(engine.layout),
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
        self.reconfigure(name, LiveChange(body.num_workers, body.prefetch_factor, autotune))
        return self.describe_loader(name)

    def reconfigure(self, name: str, change: LiveChange) -> LoaderConfig:
        """A live change of loader ``name`` (a PATCH, or autotune's), admitted by the node
        budget and applied by the engine, then recorded in the registry."""
        with self._lock:
            if name in self._unstarted:
                raise errors.Conflict(f"loader {name!r} failed to start; delete and recreate it")
            engine = self._engine(name)
            admit = functools.partial(self.budget.admit, replaces=name)
            config = engine.reconfigure(change, admit)
            row = next(r for r in self.registry.loaders() if r["name"] == name)
            live = config.model_dump(include={"num_workers", "prefetch_factor", "autotune"})
            self.registry.update_loader(name, row["config"] | live)
            return config

    def delete_loader(self, name: str) -> None:
        with self._lock:
            if self._unstarted.pop(name, None) is not None:
                self.registry.delete_loader(name)
                return
            engine = self._engine(name)
            self.registry.delete_loader(name)
            del self.loaders[name]
        engine.close()
