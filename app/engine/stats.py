"""Per-loader counters: throughput, consumer wait, worker busy share."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any


class LoaderStats:
    WINDOW_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.batches_produced = 0
        self.batches_consumed = 0
        self.samples_consumed = 0
        self.bytes_consumed = 0
        self.errors = 0
        self.skipped = 0
        self.busy_s = 0.0
        self.wait_s = 0.0
        self._waits: collections.deque[float] = collections.deque(maxlen=4096)
        self._recent_waits: collections.deque[tuple[float, float]] = collections.deque()
        self.first_wait: float | None = None  # when trainers started asking
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()
        self._slot_bytes = 0

    def produced(self, rows: int, slot_bytes: int) -> None:
        with self._lock:
            self.batches_produced += 1
            self._slot_bytes = slot_bytes

    def consumed(self, rows: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.batches_consumed += 1
            self.samples_consumed += rows
            self.bytes_consumed += self._slot_bytes
            self._recent.append((now, rows, self._slot_bytes))
            while self._recent and self._recent[0][0] < now - self.WINDOW_S:
                self._recent.popleft()

    def consumer_wait(self, waited_s: float) -> None:
        """What a trainer reported: how long its last ``next()`` blocked."""
        now = time.monotonic()
        with self._lock:
            if self.first_wait is None:
                self.first_wait = now - waited_s
            self.wait_s += waited_s
            self._waits.append(waited_s)
            self._recent_waits.append((now, waited_s))
            while self._recent_waits and self._recent_waits[0][0] < now - self.WINDOW_S:
                self._recent_waits.popleft()

    def add_busy(self, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds

    def snapshot(
        self, worker_busy_s: float, num_workers: int, consumers: int = 1
    ) -> dict[str, Any]:
        """``consumers``: trainers sharing the loader (a group), to average their wait."""
        now = time.monotonic()
        with self._lock:
            elapsed = max(now - self.started, 1e-9)
            asking = max(now - self.first_wait, 1e-9) if self.first_wait is not None else None
            recent_wait = sum(w for t, w in self._recent_waits if t >= now - self.WINDOW_S)
            per = max(1, consumers)
            waits = sorted(self._waits)
            recent = [r for r in self._recent if r[0] >= now - self.WINDOW_S]
            window = min(self.WINDOW_S, elapsed)

            def pct(p: float) -> float | None:
                if not waits:
                    return None
                return waits[min(len(waits) - 1, int(p * len(waits)))]

            busy = worker_busy_s + self.busy_s
            return {
                "batches_produced": self.batches_produced,
                "batches_consumed": self.batches_consumed,
                "samples_consumed": self.samples_consumed,
                "errors": self.errors,
                "skipped": self.skipped,
                "samples_per_s": sum(r[1] for r in recent) / window,
                "bytes_per_s": sum(r[2] for r in recent) / window,
                "samples_per_s_total": self.samples_consumed / elapsed,
                "bytes_per_s_total": self.bytes_consumed / elapsed,
                "consumer_wait_p50_s": pct(0.5),
                "consumer_wait_p99_s": pct(0.99),
                # Share of the trainers' time spent blocked in next(): near 1 means
                # training is input-bound. Measured by the trainers themselves.
                "consumer_wait_share": (
                    min(1.0, recent_wait / min(self.WINDOW_S, asking) / per) if asking else 0.0
                ),
                "consumer_wait_share_total": (
                    min(1.0, self.wait_s / asking / per) if asking else 0.0
                ),
                "worker_busy_share": busy / (elapsed * max(1, num_workers)),
                "uptime_s": elapsed,
            }
