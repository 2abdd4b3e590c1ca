"""Autotune: a loader's num_workers and prefetch_factor set from what the server
measures, as tf.data's AUTOTUNE sizes its parallelism from the pipeline's own timings.

Every ``interval_s`` (and at least ``MIN_BATCHES`` consumed) the tuner reads, over
the interval just ended, the trainers' *wait share* (time blocked in ``next()``, as
they report it) and the workers' *busy share* (time making batches over workers x
time), and the consumed samples/s. Each
change is followed by one interval it ignores (workers start, the ring grows), then
one it measures. Its rules, first match:

1. The last change added a worker and samples/s did not rise by ``GAIN`` (5%): go
   back, and never try that many again (the node's cores are spent: on a 2-core box
   the third worker only competes with the other two).
2. The trainers wait less than ``WAIT_OK`` (5%): input keeps up; settled. Workers
   busy less than ``IDLE`` (30%) of the time while more than one runs: one fewer
   (and if that makes the trainers wait, back up, and never that low again).
3. The trainers wait and the workers are busy (>= ``BUSY``, 80%): one more worker,
   up to the ceiling (``max_workers``, PINFEED_MAX_WORKERS less the other loaders'
   workers, the node's CPUs, and the memory budget: a refused ring is a ceiling).
4. The trainers wait while the workers are not busy: batches come in bursts the queue
   cannot absorb; double prefetch_factor, up to ``max_prefetch_factor``.
5. Otherwise (at the ceiling): settled.

A decision is applied through the same admission and live reconfigure as a PATCH,
logged with its reason, kept in the loader's last ``KEPT`` decisions and shown by
``GET /v1/loaders/{name}/stats`` and ``pinfeed status``. A PATCH with explicit
num_workers/prefetch_factor turns autotune off.
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

GAIN = 1.05
WAIT_OK = 0.05
BUSY = 0.8
IDLE = 0.3
KEPT = 20
MIN_BATCHES = 4


class AutotuneSpec(BaseModel):
    """``"autotune": {"max_workers": K}`` on a loader."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_workers: int = Field(ge=1, le=256, description="the most worker processes to try")
    max_prefetch_factor: int = Field(8, ge=1, le=1024, description="the deepest prefetch")
    interval_s: float = Field(
        2.0, ge=0.2, le=600, description="seconds per measurement (one more after a change)"
    )


@dataclass(frozen=True)
class Sample:
    """Cumulative counters of a loader at one time."""

    t: float
    batches: int
    samples: int
    wait_s: float
    busy_s: float
    trainers: int
    # NEXTs the server holds unanswered now, summed over trainers: a trainer blocked for
    # a whole interval has reported no wait yet (a wait comes with the NEXT after it)
    pending_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    t: float  # seconds since autotune started
    num_workers: int
    prefetch_factor: int
    reason: str
    samples_per_s: float
    wait_share: float
    busy_share: float


class Tuner:
    """The rules above for one loader; ``tick`` is called by the service's tuner thread."""

    def __init__(self, spec: AutotuneSpec, num_workers: int, prefetch_factor: int) -> None:
        self.spec = spec
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.started = time.monotonic()
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=KEPT)
        self.settled_at: float | None = None  # seconds since start, once settled
        self.ceiling = spec.max_workers
        self._last: Sample | None = None
        self._skip = True  # the first interval warms up
        self._before: tuple[int, float] | None = None  # (workers, samples/s) before +1
        self._measured = (0.0, 0.0, 0.0)  # samples/s, wait share, busy share
        self._reduced = False  # the last change was one worker fewer
        self.floor = 1  # one fewer made the trainers wait: never below this again

    def due(self, now: float, batches: int) -> bool:
        """Time for a tick: ``interval_s`` passed and, unless the interval is the one
        ignored after a change, ``MIN_BATCHES`` consumed (a trainer's waits arrive per
        batch: fewer batches measure nothing)."""
        last = self._last
        if last is None:
            return True
        if now - last.t < self.spec.interval_s:
            return False
        return self._skip or batches - last.batches >= MIN_BATCHES

    def tick(self, sample: Sample, limit: int) -> tuple[int, int, str] | None:
        """The next (num_workers, prefetch_factor, reason), or None to stay. ``limit``:
        the most workers the node allows this loader now."""
        last, self._last = self._last, sample
        if last is None:
            return None
        if self._skip:  # the interval right after a start or a change
            self._skip = False
            return None
        dt = max(sample.t - last.t, 1e-9)
        rate = max(0, sample.samples - last.samples) / dt
        if rate == 0:
            return None  # no trainer reading: nothing to tune for
        # Shares are capped at 1: a wait is reported with the batch after it, and a
        # worker's busy time counts its queued tasks too.
        wait = min(1.0, max(0.0, sample.wait_s - last.wait_s) / dt / max(1, sample.trainers))
        busy = min(1.0, max(0.0, sample.busy_s - last.busy_s) / dt / max(1, self.num_workers))
        self._measured = (rate, wait, busy)
        ceiling = min(self.ceiling, limit)
        workers, prefetch = self.num_workers, self.prefetch_factor
        before, self._before = self._before, None
        if before is not None and rate < before[1] * GAIN:
            self.ceiling = before[0]
            why = f"{workers} workers gave {rate:.0f} samples/s, not more than {before[1]:.0f}"
            return self._to(before[0], prefetch, f"{why} with {before[0]}: back to {before[0]}")
        shares = f"trainers wait {wait:.0%}, workers busy {busy:.0%}"
        reduced, self._reduced = self._reduced, False
        if wait < WAIT_OK:
            if busy < IDLE and workers > self.floor:
                self._reduced = True
                return self._to(workers - 1, prefetch, f"{shares}: one fewer worker")
            self._settle(f"{shares}: input keeps up")
            return None
        if reduced:
            self.floor = workers + 1
        if busy >= BUSY and workers < ceiling:
            self._before = None if reduced else (workers, rate)
            return self._to(workers + 1, prefetch, f"{shares}: one more worker")
        if busy < BUSY and prefetch < self.spec.max_prefetch_factor:
            deeper = min(self.spec.max_prefetch_factor, prefetch * 2)
            return self._to(workers, deeper, f"{shares}: prefetch_factor {deeper}")
        self._settle(f"{shares}, at the ceiling of {ceiling} workers")
        return None

    def _to(self, workers: int, prefetch: int, reason: str) -> tuple[int, int, str]:
        self._skip = True
        self.settled_at = None
        return workers, prefetch, reason

    def _settle(self, reason: str) -> None:
        if self.settled_at is None:
            self.settled_at = self._record(self.num_workers, self.prefetch_factor, reason).t

    def applied(self, workers: int, prefetch: int, reason: str) -> Decision:
        """The service applied a decision (or its own version of it)."""
        self.num_workers, self.prefetch_factor = workers, prefetch
        return self._record(workers, prefetch, reason)

    def refused(self, workers: int) -> None:
        """The budget or the node refused ``workers``: never try that many again."""
        self.ceiling = min(self.ceiling, max(1, workers - 1))
        self._before = None
        self._skip = False

    def _record(self, workers: int, prefetch: int, reason: str) -> Decision:
        rate, wait, busy = self._measured
        decision = Decision(
            round(time.monotonic() - self.started, 2), workers, prefetch, reason, rate, wait, busy
        )
        self.decisions.append(decision)
        return decision

    def report(self) -> dict[str, Any]:
        return {
            "enabled": True,
            **self.spec.model_dump(),
            "settled": self.settled_at is not None,
            "settled_after_s": self.settled_at,
            "decisions": [asdict(d) for d in self.decisions],
        }
