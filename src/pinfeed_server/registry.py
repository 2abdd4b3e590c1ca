"""SQLite persistence of datasets and loaders (the embedded default registry).

Every change is one transaction, so a server killed at any moment restarts with a
consistent registry. WAL mode lets readers run beside the one writer. Rows leave it
typed (``DatasetRow``, ``LoaderRow``); the JSON columns as the service wrote them.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pinfeed.errors import Conflict
from pinfeed_server.errors import DomainError

SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    name TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    created_at REAL NOT NULL,
    cache TEXT
);
CREATE TABLE IF NOT EXISTS loaders (
    name TEXT PRIMARY KEY,
    dataset TEXT NOT NULL REFERENCES datasets(name),
    config TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS elastic (
    loader TEXT PRIMARY KEY REFERENCES loaders(name) ON DELETE CASCADE,
    record TEXT NOT NULL
);
"""
# ``elastic``: a loader's epoch resumed at another world size (``pinfeed.elastic``'s
# record), so that its plan, and replays of its batches, survive a server restart.


@dataclass(frozen=True)
class DatasetRow:
    """A registered dataset: its kind and params as given, and its cache's spec (None:
    no cache)."""

    name: str
    kind: str
    params: dict[str, Any]
    created_at: float  # Unix time
    cache: dict[str, Any] | None


@dataclass(frozen=True)
class LoaderRow:
    """A loader registered over HTTP: its dataset's name and its fields as created
    (``LoaderFields`` less ``dataset``, the seed chosen), live changes applied."""

    name: str
    dataset: str
    config: dict[str, Any]
    created_at: float  # Unix time


class DuplicateName(DomainError):
    """A name the registry holds already (a 409, naming it)."""

    problem = Conflict


class Registry:
    def __init__(self, path: Path | None) -> None:
        """The registry in file ``path``; None: in memory, gone with this object."""
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            ":memory:" if path is None else path, check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(datasets)")}
        if "cache" not in columns:  # a registry made before datasets had caches
            self._db.execute("ALTER TABLE datasets ADD COLUMN cache TEXT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...], taken: str = "") -> int:
        """``sql`` in a transaction of its own; a name held already is a DuplicateName
        saying ``taken``."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                cur = self._db.execute(sql, args)
                self._db.execute("COMMIT")
                return cur.rowcount
            except sqlite3.IntegrityError as exc:
                self._db.execute("ROLLBACK")
                raise DuplicateName(taken or str(exc)) from None
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    # datasets
    def add_dataset(
        self, name: str, kind: str, params: dict[str, Any], cache: dict[str, Any] | None = None
    ) -> float:
        now = time.time()
        self._write(
            "INSERT INTO datasets (name, kind, params, created_at, cache) VALUES (?, ?, ?, ?, ?)",
            (name, kind, json.dumps(params), now, None if cache is None else json.dumps(cache)),
            f"dataset {name!r} exists",
        )
        return now

    def datasets(self) -> list[DatasetRow]:
        return self._datasets("")

    def dataset(self, name: str) -> DatasetRow | None:
        return next(iter(self._datasets("WHERE name = ?", name)), None)

    def _datasets(self, where: str, *args: Any) -> list[DatasetRow]:
        rows = self._read(
            f"SELECT name, kind, params, created_at, cache FROM datasets {where} ORDER BY name",
            args,
        )
        return [
            DatasetRow(n, k, json.loads(p), c, None if cache is None else json.loads(cache))
            for n, k, p, c, cache in rows
        ]

    def delete_dataset(self, name: str) -> bool:
        return self._write("DELETE FROM datasets WHERE name = ?", (name,)) > 0

    # loaders
    def add_loader(self, name: str, dataset: str, config: dict[str, Any]) -> float:
        now = time.time()
        self._write(
            "INSERT INTO loaders VALUES (?, ?, ?, ?)",
            (name, dataset, json.dumps(config), now),
            f"loader {name!r} exists",
        )
        return now

    def update_loader(self, name: str, config: dict[str, Any]) -> None:
        self._write("UPDATE loaders SET config = ? WHERE name = ?", (json.dumps(config), name))

    def loaders(self) -> list[LoaderRow]:
        return self._loaders("")

    def loader(self, name: str) -> LoaderRow | None:
        return next(iter(self._loaders("WHERE name = ?", name)), None)

    def _loaders(self, where: str, *args: Any) -> list[LoaderRow]:
        rows = self._read(
            f"SELECT name, dataset, config, created_at FROM loaders {where} ORDER BY name", args
        )
        return [LoaderRow(n, d, json.loads(c), t) for n, d, c, t in rows]

    def delete_loader(self, name: str) -> bool:
        return self._write("DELETE FROM loaders WHERE name = ?", (name,)) > 0

    def set_elastic(self, loader: str, record: dict[str, Any] | None) -> None:
        """Keep (or, None, forget) loader ``loader``'s elastic epoch."""
        if record is None:
            self._write("DELETE FROM elastic WHERE loader = ?", (loader,))
        else:
            self._write(
                "INSERT OR REPLACE INTO elastic VALUES (?, ?)", (loader, json.dumps(record))
            )

    def elastic(self, loader: str) -> dict[str, Any] | None:
        rows = self._read("SELECT record FROM elastic WHERE loader = ?", (loader,))
        return json.loads(rows[0][0]) if rows else None
