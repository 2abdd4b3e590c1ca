"""Every loader of the server, one record each, whatever its origin.

A loader comes from a ``POST /v1/loaders`` (registered: the registry keeps it across
restarts), from a trainer's ``pinfeed.DataLoader`` (``owner``: its objects live with
it, not in the registry), or from the registry at a restart, where it may fail to start
(``unstarted``: its fields and why, listed so it can be seen and deleted). Each is one
``LoaderRecord`` in the ``LoaderTable``, and shows itself the one way
(``describe``, ``stats``), so no view asks where a loader came from.

The table is written under the service's lock; its readers (the data plane's lookup,
the node budget and arbiter, ``/metrics``) take a snapshot without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pinfeed import errors
from pinfeed_server.engine import LoaderEngine, LoaderStatus, Peer, StatsSnapshot, describe


@dataclass
class Owner:
    """The trainer whose ``pinfeed.DataLoader`` made a loader over its own objects. Such
    a loader goes when its trainer's connection does, or, named (``keep``), when it is
    deleted or the server stops."""

    peer: Peer
    digest: str  # the trainer's config and payload: a later trainer must send the same
    keep: bool
    cache: str | None  # the key of the node cache its dataset reads through (cache=)
    attached: bool = True

    def public(self) -> dict[str, Any]:
        """As ``LoaderOwner`` shows it."""
        return {
            "pid": self.peer.pid,
            "uid": self.peer.uid,
            "attached": self.attached,
            "keep": self.keep,
            "cache": self.cache,
        }


@dataclass(frozen=True)
class Unstarted:
    """A registered loader that could not start after a restart (its dataset's file
    gone, the budget lowered): the fields it was registered with, and why."""

    fields: dict[str, Any]
    detail: str


@dataclass
class LoaderRecord:
    """One loader: its engine, or why it has none."""

    name: str
    dataset: str  # the registered dataset it reads; a trainer's loader: its own name
    created_at: float  # Unix time
    engine: LoaderEngine | None  # None: ``unstarted`` (or closed, once deleted)
    owner: Owner | None = None  # made by a trainer; None: registered over HTTP
    unstarted: Unstarted | None = None

    def reads(self) -> list[str]:
        """The registered datasets it reads: its dataset, or its mixture's sources."""
        if self.engine is not None:
            mixture = self.engine.config.mixture
            return [self.dataset] if mixture is None else mixture.names
        fields = self.unstarted.fields if self.unstarted is not None else {}
        sources = (fields.get("mixture") or {}).get("sources") or []
        return [self.dataset, *(s["dataset"] for s in sources)]

    def describe(self) -> dict[str, Any]:
        """The loader as ``GET /v1/loaders/{name}`` shows it (``LoaderPublic``)."""
        if self.engine is None:
            assert self.unstarted is not None
            return {
                **self.unstarted.fields,
                "dataset": self.dataset,
                "created_at": self.created_at,
                "batch": None,
                **LoaderStatus.unstarted(self.unstarted.detail).model_dump(),
            }
        engine = self.engine
        return {
            **engine.config.model_dump(),
            "created_at": self.created_at,
            "batch": None if engine.layout is None else describe(engine.layout),
            "owner": None if self.owner is None else self.owner.public(),
            **engine.status().model_dump(),
        }

    def stats(self) -> StatsSnapshot:
        if self.engine is None:
            assert self.unstarted is not None
            return StatsSnapshot.zeros(self.name, self.unstarted.fields["num_workers"])
        return self.engine.stats_snapshot()


class LoaderTable:
    """The loaders by name."""

    def __init__(self) -> None:
        self._records: dict[str, LoaderRecord] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: LoaderRecord) -> None:
        self._records[record.name] = record

    def get(self, name: str) -> LoaderRecord | None:
        return self._records.get(name)

    def __getitem__(self, name: str) -> LoaderRecord:
        """Loader ``name``'s record; NotFound if there is none."""
        record = self._records.get(name)
        if record is None:
            raise errors.NotFound(f"no loader named {name!r}")
        return record

    def pop(self, name: str) -> LoaderRecord:
        self[name]  # NotFound
        return self._records.pop(name)

    def clear(self) -> list[LoaderRecord]:
        """Every record, taken out (the server stops)."""
        records = self.records()
        self._records.clear()
        return records

    def records(self) -> list[LoaderRecord]:
        """Every loader, by name."""
        return sorted(list(self._records.values()), key=lambda r: r.name)

    def engine(self, name: str) -> LoaderEngine | None:
        """Loader ``name``'s engine (the data plane's lookup); None: no such started loader."""
        record = self._records.get(name)
        return None if record is None else record.engine

    def engines(self) -> dict[str, LoaderEngine]:
        """The started loaders' engines, by name."""
        records = list(self._records.values())
        return {r.name: r.engine for r in records if r.engine is not None}

    def unstarted(self) -> list[LoaderRecord]:
        """The loaders that could not start, by name."""
        return [r for r in self.records() if r.unstarted is not None]

    def readers_of(self, dataset: str) -> list[LoaderRecord]:
        """The loaders of registered dataset ``dataset`` (started or not), by name."""
        return [r for r in self.records() if dataset in r.reads()]
