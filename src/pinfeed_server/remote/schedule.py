"""A loader's future reads, for the eviction rule: when will it next need a unit?

The engine knows a loader's order: this epoch's index batches and the next epoch's
(DataLoader's samplers are a pure function of the seed and the epoch). ``Schedule``
holds them as the units they read, in order (``epochs``), and the loader's position in
the current one (``at``). ``next_use(uids)`` is, for each unit, how many reads from now
the loader needs it: its first use at or after the position in this epoch, else what is
left of this epoch plus its first use in the next one, else infinity (not in sight).
The cache evicts the unit whose next use is furthest (Belady's rule, from the known
order, not from a guess), and LRU only among those not in sight.

A unit read by many samples (a block of a token file) has many uses an epoch: they are
kept sorted per unit (one argsort an epoch), and the first at or after the position is
a binary search.
"""

from __future__ import annotations

import threading

import numpy as np
from numpy.typing import NDArray

INF = np.iinfo(np.int64).max


class _Epoch:
    """Units by read position, and per unit its sorted positions."""

    def __init__(self, uids: NDArray[np.int64]) -> None:
        self.length = len(uids)
        order = np.argsort(uids, kind="stable")
        self.sorted_uids = uids[order]
        self.positions = order.astype(np.int64)  # positions grouped by unit, ascending

    def first_at_or_after(self, uids: NDArray[np.int64], t: int) -> NDArray[np.int64]:
        lo = np.searchsorted(self.sorted_uids, uids, side="left")
        hi = np.searchsorted(self.sorted_uids, uids, side="right")
        out = np.full(len(uids), INF, dtype=np.int64)
        for j in np.nonzero(hi > lo)[0]:  # units in this epoch
            pos = self.positions[lo[j] : hi[j]]
            k = int(np.searchsorted(pos, t, side="left"))
            if k < len(pos):
                out[j] = pos[k]
        return out


class Schedule:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epochs: dict[int, _Epoch] = {}
        self._epoch = 0
        self._at = 0

    def set_epoch(self, epoch: int, uids: NDArray[np.int64]) -> None:
        """The units epoch ``epoch`` reads, in order (one entry per sample)."""
        e = _Epoch(uids)
        with self._lock:
            self._epochs[epoch] = e
            for old in [k for k in self._epochs if k < self._epoch]:
                del self._epochs[old]

    def has(self, epoch: int) -> bool:
        with self._lock:
            return epoch in self._epochs

    def advance(self, epoch: int, position: int) -> None:
        with self._lock:
            self._epoch, self._at = epoch, position

    def next_use(self, uids: NDArray[np.int64]) -> NDArray[np.int64]:
        """Reads from now until each unit is needed (INF: not in this epoch or the next)."""
        with self._lock:
            e, t = self._epoch, self._at
            cur, nxt = self._epochs.get(e), self._epochs.get(e + 1)
        out = np.full(len(uids), INF, dtype=np.int64)
        if cur is not None:
            first = cur.first_at_or_after(uids, t)
            here = first != INF
            out[here] = first[here] - t
            left = cur.length - t
        else:
            left = 0
        if nxt is not None:
            later = nxt.first_at_or_after(uids, 0)
            fill = (out == INF) & (later != INF)
            out[fill] = left + later[fill]
        return out
