"""Per-loader statistics: O(1) per batch, O(1) per read, read without the writers' lock.

The per-batch path (publisher, data-plane threads) records into counters, fixed one-
second buckets for the rates over the last ``WINDOW_S`` seconds, and a histogram of
the trainers' waits with fixed bounds (``WAIT_BUCKETS_S``, served to Prometheus as a
histogram so dashboards compute quantiles). Writers serialize on a small lock of
their own; readers (``snapshot()``, ``GET /metrics``) never take it: every value they
read is one object that a writer replaces whole (a tuple) or one list they copy in
one step, so a scrape never makes a batch wait and never walks per-batch history.
A read is consistent per value group (batches and samples agree), not across groups.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

# Upper bounds of the wait histogram's buckets, in seconds (+Inf is implied).
WAIT_BUCKETS_S = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def bucket_quantile(q: float, bounds: tuple[float, ...], counts: list[int]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket that holds rank
    ``q``; the last finite bound for the +Inf bucket. ``counts`` are per bucket."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / n
        seen += n
    return bounds[-1]


class RateWindow:
    """Sums of (samples, bytes, wait seconds) over the last ``window_s`` seconds in
    one-second buckets: a ring of ``window_s + 1`` tuples ``(second, samples, bytes,
    wait_s)``; a bucket whose second has passed is reused, so memory is fixed."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._buckets: list[tuple[int, int, int, float]] = [(-1, 0, 0, 0.0)] * (window_s + 1)

    def add(self, now: float, samples: int = 0, nbytes: int = 0, wait_s: float = 0.0) -> None:
        """Callers serialize (the stats' write lock)."""
        second = int(now)
        i = second % len(self._buckets)
        t, s, b, w = self._buckets[i]
        if t != second:
            s, b, w = 0, 0, 0.0
        self._buckets[i] = (second, s + samples, b + nbytes, w + wait_s)

    def sums(self, now: float) -> tuple[int, int, float, float]:
        """(samples, bytes, wait_s, seconds covered): the buckets of the last
        ``window_s`` whole seconds plus the current one, and how long that is."""
        second = int(now)
        first = second - self.window_s
        s_sum, b_sum, w_sum = 0, 0, 0.0
        for t, s, b, w in list(self._buckets):  # one copy: a writer may replace a bucket
            if first <= t <= second:
                s_sum, b_sum, w_sum = s_sum + s, b_sum + b, w_sum + w
        return s_sum, b_sum, w_sum, self.window_s + (now - second)


class LoaderStats:
    WINDOW_S = 10

    def __init__(self) -> None:
        self._write = threading.Lock()  # writers only; readers never take it
        self.started = time.monotonic()
        self.batches_produced = 0
        self._consumed: tuple[int, int, int] = (0, 0, 0)  # batches, samples, bytes
        self._waited: tuple[float, float] = (0.0, 0.0)  # total wait_s, first wait time
        self.errors = 0
        self.skipped = 0
        self.busy_s = 0.0
        self._wait_counts = [0] * (len(WAIT_BUCKETS_S) + 1)
        self._window = RateWindow(self.WINDOW_S)
        self._slot_bytes = 0

    # -- the per-batch path: O(1) each --------------------------------------------------
    def produced(self, rows: int, slot_bytes: int) -> None:
        with self._write:
            self.batches_produced += 1
            self._slot_bytes = slot_bytes

    def consumed(self, rows: int) -> None:
        now = time.monotonic()
        with self._write:
            batches, samples, nbytes = self._consumed
            self._consumed = (batches + 1, samples + rows, nbytes + self._slot_bytes)
            self._window.add(now, samples=rows, nbytes=self._slot_bytes)

    def consumer_wait(self, waited_s: float) -> None:
        """What a trainer reported: how long its last ``next()`` blocked."""
        now = time.monotonic()
        with self._write:
            total, first = self._waited
            self._waited = (total + waited_s, first or (now - waited_s))
            self._wait_counts[bisect.bisect_left(WAIT_BUCKETS_S, waited_s)] += 1
            self._window.add(now, wait_s=waited_s)

    def add_busy(self, seconds: float) -> None:
        with self._write:
            self.busy_s += seconds

    # -- reads: lock-free, O(1) -----------------------------------------------------------
    @property
    def batches_consumed(self) -> int:
        return self._consumed[0]

    @property
    def samples_consumed(self) -> int:
        return self._consumed[1]

    @property
    def bytes_consumed(self) -> int:
        return self._consumed[2]

    @property
    def wait_s(self) -> float:
        return self._waited[0]

    @property
    def first_wait(self) -> float | None:
        """When trainers started asking (monotonic), or None."""
        return self._waited[1] or None

    def wait_histogram(self) -> tuple[list[int], float]:
        """Per-bucket counts (``WAIT_BUCKETS_S`` then +Inf) and the sum of waits."""
        return list(self._wait_counts), self._waited[0]

    def snapshot(
        self, worker_busy_s: float, num_workers: int, consumers: int = 1
    ) -> dict[str, Any]:
        """``consumers``: trainers sharing the loader (a group), to average their wait.
        Percentiles come from the histogram's buckets (interpolated, since start)."""
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        batches, samples, nbytes = self._consumed
        wait_total, first = self._waited
        counts = list(self._wait_counts)
        recent_samples, recent_bytes, recent_wait, covered = self._window.sums(now)
        window = min(covered, elapsed)
        asking = max(now - first, 1e-9) if first else None
        per = max(1, consumers)
        busy = worker_busy_s + self.busy_s
        return {
            "batches_produced": self.batches_produced,
            "batches_consumed": batches,
            "samples_consumed": samples,
            "errors": self.errors,
            "skipped": self.skipped,
            "samples_per_s": recent_samples / window,
            "bytes_per_s": recent_bytes / window,
            "samples_per_s_total": samples / elapsed,
            "bytes_per_s_total": nbytes / elapsed,
            "consumer_wait_p50_s": bucket_quantile(0.5, WAIT_BUCKETS_S, counts),
            "consumer_wait_p99_s": bucket_quantile(0.99, WAIT_BUCKETS_S, counts),
            # Share of the trainers' time spent blocked in next(): near 1 means
            # training is input-bound. Measured by the trainers themselves.
            "consumer_wait_share": (
                min(1.0, recent_wait / min(window, asking) / per) if asking else 0.0
            ),
            "consumer_wait_share_total": (min(1.0, wait_total / asking / per) if asking else 0.0),
            "worker_busy_share": busy / (elapsed * max(1, num_workers)),
            "worker_busy_s": busy,
            "uptime_s": elapsed,
            "wait_histogram": (counts, wait_total),  # for /metrics; not in the stats body
        }
