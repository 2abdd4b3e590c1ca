"""The node's object cache: units of remote objects (``objects.py``) as files on local
disk, one directory per node, bounded in bytes, shared by every loader, job and epoch.

A unit's file is ``<root>/<digest[:2]>/<digest>``, its name a hash of the store, the
object, its ETag and the byte range. It appears there only complete: the bytes are
written to a ``.part`` file, their size checked (and a whole object's MD5, where its
ETag is one), then renamed into place. So a reader that finds the file has the unit,
whole; a server killed mid-download leaves a ``.part`` file, removed at the next start.
The files persist: a server started on the same directory finds them (their sizes
counted, a file whose size is not its unit's refetched), and every dataset that reads
those units hits.

Single flight: a unit being fetched is fetched once; every other reader of it, in this
process, waits for that download (workers ask the server, ``link.py``). Concurrency
toward the store is bounded (``concurrency`` GETs at once, the node's).

Bounded: before a unit is written, room is made for it. Units pinned (by a batch being
made from them, ``reader.py``) are never evicted; of the rest, the rule ``next-use``
evicts the unit the loaders need furthest in the future (``schedule.py``), units no
loader will need in sight first, least recently used among those; ``lru`` evicts the
least recently used (kept to compare). Evicting unlinks the file: a process that has it
open or mapped keeps reading the same bytes.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pinfeed_server.remote.client import S3Client
from pinfeed_server.remote.errors import RemoteError
from pinfeed_server.remote.objects import Unit
from pinfeed_server.remote.schedule import INF, Schedule
from pinfeed_server.remote.stats import CacheState, Counts

log = logging.getLogger("pinfeed.remote")

WAIT_S = 600.0  # a reader waits this long at most for another's download of a unit
# making room evicts down to 1/LOW_WATER of the cache below its size (a round of ranking
# serves many inserts); what is fetched ahead fits below that mark
LOW_WATER = 50


@dataclass
class Entry:
    size: int
    used: int  # the cache's clock when last read
    owner: str | None = None  # the manifest whose schedules rank it
    uid: int = -1
    pins: int = 0
    ahead: bool = False  # fetched ahead, not read since


class ObjectCache:
    def __init__(
        self,
        root: Path,
        max_bytes: int,
        client: S3Client,
        *,
        eviction: str = "next-use",
        concurrency: int = 32,
        verify: bool = True,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.client = client
        self.eviction = eviction
        self.verify = verify
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._inflight: dict[str, Future[None]] = {}
        self._held = 0
        self._reserved = 0
        self.evictions = 0
        self.wasted = 0  # units fetched ahead, evicted before a read
        self._clock = itertools.count()
        self._slots = threading.BoundedSemaphore(concurrency)
        self._schedules: dict[str, list[Schedule]] = {}
        self._parts = itertools.count()
        root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # -- files ---------------------------------------------------------------------------
    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def _scan(self) -> None:
        """The units an earlier server left: counted; ``.part`` files removed."""
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.startswith("."):
                    f.unlink(missing_ok=True)
                    continue
                st = f.stat()
                self._entries[f.name] = Entry(st.st_size, next(self._clock))
                self._held += st.st_size
        if self._entries:
            log.info(
                "object cache %s: %d units, %d bytes kept",
                self.root,
                len(self._entries),
                self._held,
            )
        with self._lock:
            self._make_room(0)

    # -- reads ---------------------------------------------------------------------------
    def get(
        self,
        unit: Unit,
        dataset: str,
        counts: Counts | None = None,
        *,
        pin: bool = False,
        owner: str | None = None,
        ahead: bool = False,
    ) -> Path:
        """The unit's file, fetched if it is not here (once, whoever else asks);
        ``pin``: kept until ``unpin``; ``counts``: the loader's, a hit or a miss."""
        d = unit.digest
        t0 = time.monotonic()
        missed = False
        while True:
            with self._lock:
                e = self._entries.get(d)
                if e is not None and e.size == unit.length:
                    e.used = next(self._clock)
                    e.ahead = e.ahead and ahead
                    e.pins += int(pin)
                    if owner is not None and e.owner is None:
                        e.owner, e.uid = owner, unit.uid
                    if counts is not None and not ahead:
                        if missed:
                            counts.add(wait_s=time.monotonic() - t0)
                        else:
                            counts.add(hits=1)
                    return self.path(d)
                if e is not None:  # a persisted file of the wrong size: fetch again
                    self._drop(d, e)
                fut = self._inflight.get(d)
                leader = fut is None
                if fut is None:
                    fut = self._inflight[d] = Future()
            if counts is not None and not missed:
                counts.add(**({"prefetched": 1} if ahead else {"misses": 1}))
            missed = True  # a miss once, however long the wait
            if leader:
                self._download(unit, dataset, fut, owner, ahead)
            try:
                fut.result(WAIT_S)
            except TimeoutError:
                raise RemoteError(f"{unit}: its download took over {WAIT_S:g} s") from None
            if time.monotonic() - t0 > WAIT_S:
                raise RemoteError(f"{unit}: evicted again before it could be read")

    def _download(
        self, unit: Unit, dataset: str, fut: Future[None], owner: str | None, ahead: bool
    ) -> None:
        d = unit.digest
        final = self.path(d)
        part = final.with_name(f".{d}.{os.getpid()}.{next(self._parts)}.part")
        try:
            with self._lock:
                self._reserved += unit.length
                self._make_room(0)
            final.parent.mkdir(exist_ok=True)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                with self._slots:
                    self.client.fetch(unit, fd, dataset, self.verify, lambda n: None)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size != unit.length:
                raise RemoteError(f"{unit}: {size} bytes written, {unit.length} expected")
            os.rename(part, final)
            with self._lock:
                self._reserved -= unit.length
                self._held += unit.length
                self._entries[d] = Entry(unit.length, next(self._clock), owner, unit.uid, 0, ahead)
            fut.set_result(None)
        except BaseException as exc:
            part.unlink(missing_ok=True)
            with self._lock:
                self._reserved -= unit.length
            fut.set_exception(exc)
        finally:
            with self._lock:
                self._inflight.pop(d, None)

    def unpin(self, digests: list[str]) -> None:
        with self._lock:
            for d in digests:
                e = self._entries.get(d)
                if e is not None and e.pins > 0:
                    e.pins -= 1

    def has(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def room_for(self, nbytes: int, next_use: int, queued: int = 0) -> bool:
        """Whether units of ``nbytes`` needed ``next_use`` reads from now (their batch's
        last read) may be fetched ahead and still be here then: under ``next-use``, what
        the cache must keep until then fits with them below its low-water mark (the
        pinned units, the downloads under way, ``queued`` bytes a loader asked for and
        not yet had, and every unit some loader needs by then), so that fetching them
        evicts only units needed later than they are (Belady's rule, for the bytes they
        displace, not for one unit) and no eviction after them needs to take one of
        them. Under ``lru``, always (its look-ahead is bounded by bytes, ``node.py``)."""
        if self.eviction != "next-use":
            return True
        limit = self.max_bytes - self.max_bytes // LOW_WATER
        with self._lock:
            base = self._reserved + queued + nbytes
            if self._held + base <= limit:
                return True
            return self._kept_until(next_use) + base <= limit

    # -- eviction ------------------------------------------------------------------------
    def schedule(self, owner: str, schedule: Schedule) -> Callable[[], None]:
        """Rank ``owner``'s units by ``schedule`` too; the returned call stops it."""
        with self._lock:
            self._schedules.setdefault(owner, []).append(schedule)

        def remove() -> None:
            with self._lock:
                found = self._schedules.get(owner, [])
                if schedule in found:
                    found.remove(schedule)

        return remove

    def _next_uses(self, entries: list[Entry]) -> np.ndarray:
        """Reads until each entry's unit is needed, the soonest of its owner's loaders
        (INF: no loader needs it in sight)."""
        nxt = np.full(len(entries), INF, dtype=np.int64)
        by_owner: dict[str, list[int]] = {}
        for j, e in enumerate(entries):
            if e.owner is not None and self._schedules.get(e.owner):
                by_owner.setdefault(e.owner, []).append(j)
        for owner, js in by_owner.items():
            uids = np.array([entries[j].uid for j in js], dtype=np.int64)
            best = np.full(len(js), INF, dtype=np.int64)
            for s in self._schedules[owner]:
                best = np.minimum(best, s.next_use(uids))
            nxt[js] = best
        return nxt

    def _ranks(self, digests: list[str]) -> np.ndarray:
        """The order to evict ``digests`` in, last first out: by next use, then age."""
        entries = [self._entries[d] for d in digests]
        age = np.array([-e.used for e in entries], dtype=np.int64)
        if self.eviction == "lru":
            return np.argsort(age, kind="stable")
        # next use first; age breaks ties (those not in sight: least recently used)
        return np.lexsort((age, self._next_uses(entries)))

    def _kept_until(self, reads: int) -> int:
        """Bytes the cache must keep for the next ``reads`` reads: units pinned, and
        units some loader needs within them."""
        entries = list(self._entries.values())
        pinned = sum(e.size for e in entries if e.pins)
        free = [e for e in entries if not e.pins]
        if not free:
            return pinned
        sizes = np.array([e.size for e in free], dtype=np.int64)
        return pinned + int(sizes[self._next_uses(free) <= reads].sum())

    def _make_room(self, nbytes: int) -> None:
        """Evict (under the lock) until ``nbytes`` more fit, down to a low-water mark
        so that a round of ranking serves many inserts."""
        over = self._held + self._reserved + nbytes - self.max_bytes
        if over <= 0:
            return
        target = over + self.max_bytes // LOW_WATER
        free = [d for d, e in self._entries.items() if e.pins == 0]
        if not free:
            return
        order = self._ranks(free)
        freed = 0
        for j in order[::-1]:
            if freed >= target:
                break
            d = free[int(j)]
            freed += self._entries[d].size
            self.evictions += 1
            self.wasted += int(self._entries[d].ahead)
            self._drop(d, self._entries[d])

    def _drop(self, d: str, e: Entry) -> None:
        self._entries.pop(d, None)
        self._held -= e.size
        self.path(d).unlink(missing_ok=True)

    def state(self) -> CacheState:
        with self._lock:
            return CacheState(
                self.max_bytes,
                self._held,
                len(self._entries),
                sum(1 for e in self._entries.values() if e.pins),
                self.evictions,
                self.eviction,
                self.wasted,
            )
