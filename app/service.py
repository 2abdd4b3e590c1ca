"""The service: registry + running loader engines + the data-plane socket.

Routers call this; it enforces the rules (names unique, datasets in use stay,
memory budget) and raises ``app.errors`` exceptions that become problem+json.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

from app import errors
from app.datasets import DatasetContext, DatasetError, build_dataset
from app.engine.collate import LayoutError, probe
from app.engine.dataplane import DataPlaneServer
from app.engine.loader import LoaderConfig, LoaderEngine, ring_slots
from app.engine.sampler import EpochSampler
from app.engine.workers import configure_forkserver
from app.registry import DuplicateName, Registry
from app.schemas import DatasetCreate, LoaderCreate
from app.settings import Settings

log = logging.getLogger("pinfeed")

DEMO_DATASET = DatasetCreate(
    name="demo",
    kind="synthetic",
    params={
        "length": 100,
        "seed": 0,
        "fields": [
            {"shape": [3, 64, 64], "dtype": "int64", "low": 0, "high": 10},
            {"shape": [], "dtype": "int64", "low": 0, "high": 2},
        ],
    },
)
DEMO_LOADER = LoaderCreate(name="demo", dataset="demo", batch_size=10)


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.context = DatasetContext(settings.data_root, tuple(settings.allowed_plugins))
        self.registry = Registry(settings.registry_path)
        self.loaders: dict[str, LoaderEngine] = {}
        self._datasets: dict[str, Any] = {}  # name -> built dataset, shared by its loaders
        self._lock = threading.RLock()
        self.dataplane = DataPlaneServer(
            settings.socket_path, self.loaders.get, settings.attach_timeout_s
        )

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        configure_forkserver()
        self.dataplane.start()
        for row in self.registry.loaders():
            try:
                self._start_loader(row["dataset"], row["config"])
            except errors.AppError as exc:
                log.error("loader %s from the registry cannot start: %s", row["name"], exc)
        if self.settings.demo:
            self._ensure_demo()
        log.info("data plane on %s", self.settings.socket_path)

    def close(self) -> None:
        with self._lock:
            engines = list(self.loaders.values())
            self.loaders.clear()
        self.dataplane.close()
        for engine in engines:
            engine.close()
        self.registry.close()

    def _ensure_demo(self) -> None:
        names = {d["name"] for d in self.registry.datasets()}
        if DEMO_DATASET.name not in names:
            self.create_dataset(DEMO_DATASET)
        if DEMO_LOADER.name not in self.loaders:
            self.create_loader(DEMO_LOADER)

    # -- datasets ----------------------------------------------------------------------
    def _open(self, name: str, kind: str, params: dict[str, Any]) -> Any:
        with self._lock:
            if name not in self._datasets:
                try:
                    self._datasets[name] = build_dataset(kind, params, self.context)
                except DatasetError as exc:
                    raise errors.InvalidRequest(str(exc)) from None
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
            self._open(body.name, body.kind, body.params)
            try:
                self.registry.add_dataset(body.name, body.kind, body.params)
            except DuplicateName:
                raise errors.Conflict(f"dataset {body.name!r} exists") from None
            return self.describe_dataset(body.name)

    def list_datasets(self) -> list[dict[str, Any]]:
        return [self.describe_dataset(row["name"]) for row in self.registry.datasets()]

    def describe_dataset(self, name: str) -> dict[str, Any]:
        row = self._dataset_row(name)
        try:
            ds = self._open(name, row["kind"], row["params"])
            row |= {"length": len(ds), "sample": probe(ds[0], 1).describe()}
        except (errors.AppError, LayoutError, Exception) as exc:
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
        ds = self._open(dataset_name, row["kind"], row["params"])
        cfg = LoaderConfig(dataset=dataset_name, **config)
        sampler = EpochSampler(len(ds), cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed,
                               drop_last=cfg.drop_last)
        if len(sampler) == 0:
            raise errors.InvalidRequest(
                f"dataset {dataset_name!r} has {len(ds)} samples: batch_size {cfg.batch_size} "
                "with drop_last yields no batch"
            )
        first = next(sampler.batches(0))[0]
        try:
            layout = probe(ds[first], cfg.batch_size)
        except LayoutError as exc:
            raise errors.InvalidRequest(f"sample {first}: {exc}") from None
        except Exception as exc:
            raise errors.InvalidRequest(
                f"reading sample {first} to size the ring raised {type(exc).__name__}: {exc}"
            ) from None
        need = ring_slots(cfg) * layout.slot_bytes
        used = sum(e.nslots * e.layout.slot_bytes for e in self.loaders.values())
        free = self.settings.max_shm_bytes - used
        if need > free:
            raise errors.InsufficientMemory(
                f"loader {cfg.name!r} needs a ring of {need} bytes "
                f"({ring_slots(cfg)} slots x {layout.slot_bytes}); {free} bytes of "
                f"PINFEED_MAX_SHM_BYTES={self.settings.max_shm_bytes} are free. Lower "
                "batch_size, num_workers or prefetch_factor, or raise the budget",
                need_bytes=need, free_bytes=free,
            )
        engine = LoaderEngine(cfg, ds, row["kind"], row["params"], self.context, layout)
        self.loaders[cfg.name] = engine
        engine.start()
        return engine

    def _engine(self, name: str) -> LoaderEngine:
        engine = self.loaders.get(name)
        if engine is None:
            raise errors.NotFound(f"no loader named {name!r}")
        return engine

    def describe_loader(self, name: str) -> dict[str, Any]:
        engine = self._engine(name)
        created = next(
            (r["created_at"] for r in self.registry.loaders() if r["name"] == name), 0.0
        )
        cfg = engine.config
        return {
            **cfg.__dict__,
            "created_at": created,
            "batch": engine.layout.describe(),
            **engine.public_status(),
        }

    def list_loaders(self) -> list[dict[str, Any]]:
        return [self.describe_loader(n) for n in sorted(self.loaders)]

    def loader_stats(self, name: str) -> dict[str, Any]:
        engine = self._engine(name)
        busy = engine.pool.busy_seconds() if engine.pool else 0.0
        return {"name": name, **engine.stats.snapshot(busy, engine.config.num_workers)}

    def delete_loader(self, name: str) -> None:
        with self._lock:
            engine = self._engine(name)
            self.registry.delete_loader(name)
            del self.loaders[name]
        engine.close()
