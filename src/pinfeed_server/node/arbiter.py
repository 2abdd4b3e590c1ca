"""The node arbiter: the one owner of "who changes a loader's workers" after creation.

Every ``interval_s`` it reads each loader over the round just ended (``Reading``: its
trainers' *wait share*, its workers' *busy share*, samples/s, trainers attached) and
makes at most one change, through the one live-change path (``Service.reconfigure``:
the node budget admits it, the engine applies it keeping every batch). Its objective
is the trainers' total stall weighted by each loader's ``priority``::

    S = sum(priority * wait_share)  over loaders with an attached trainer

Moves, first match (only loaders with ``autotune`` move; the others' ``num_workers``
is fixed demand that counts against PINFEED_MAX_WORKERS):

1. A trainer waits and its workers are busy (the workers are the bottleneck): the
   loader with the largest ``priority * wait`` gets more workers. From the free budget
   (``grow``) it gets as many as its wait says it lacks (busy workers supply ``1 -
   wait`` of what its trainers ask, so it needs about ``workers / (1 - wait)``), at
   most doubling its workers in one move, so a loader far short of its need gets there
   in a few judged moves, not one worker a round. Without free workers it gets one
   from a donor (``move``): first a loader with
   no trainer attached, then one whose trainer does not wait (its idlest), and only
   then a stalled one whose estimated loss (``priority * progress / workers``) is
   smaller than the receiver's estimated gain.
2. A trainer waits while its workers are idle: batches come in bursts; double its
   ``prefetch_factor`` (up to autotune's ``max_prefetch_factor``).
3. A loader whose trainer does not wait (or has none) and whose workers are idle
   gives one back (``shrink``): CPU for the others.

Measurement: a reading spans the time since the last change settled: the round after
a change is never measured (workers start, rings grow), then at least one round and at
most ``WINDOW`` rounds of it (PINFEED_ARBITER_INTERVAL_S each).

Hysteresis: each worker change is a trial, judged on the first reading after it: kept
only if it lowered ``S`` by ``max(MARGIN_ABS, MARGIN_REL * S)`` and raised the
receiver's samples/s by ``GAIN`` (a shrink: if it did not raise ``S`` by the margin);
otherwise it is undone and that move is not tried again for ``BLOCK_S`` seconds (twice
that after each further undo of it) or until the node's scene changes (a loader or a
trainer comes or goes, a priority changes). So a split is left only for one measured to
be better: no oscillation.

Guarantees: a loader never goes below ``min_workers``; a loader with a trainer
attached never goes to 0 workers unless its ``min_workers`` is 0 and its priority is
lower than another attached loader's; a new loader (or a PATCH) that does not fit is
given room (``make_room``) from loaders above their floors before it is refused.

With PINFEED_ARBITER=false each autotuned loader tunes itself alone (its ``Tuner``,
``engine/autotune.py``), bounded by the node's CPUs and the workers the others leave:
the behaviour the benchmark (``python -m bench node``) compares against.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pinfeed.errors import NotFound, PinfeedError
from pinfeed_server.engine.autotune import BUSY, IDLE, MIN_BATCHES, WAIT_OK, Sample
from pinfeed_server.engine.config import LiveChange
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.node.budget import NodeBudget

log = logging.getLogger("pinfeed.arbiter")

MARGIN_ABS = 0.05  # a kept move lowers S by at least this (priority-weighted share)...
MARGIN_REL = 0.01  # ... or by this share of S, whichever is larger, and
GAIN = 1.05  # the receiver's samples/s rose by this factor: both, since either alone
# is often met by the noise of one measured round on a loaded machine
WINDOW = 3  # a reading spans at most this many rounds
BLOCK_S = 30.0  # an undone move is not tried again for this long (or a scene change)
KEPT = 50  # decisions kept for GET /v1/node
MIN_SUPPLY = 0.05  # a grow's estimate of need takes a wait share as at most 95%

Kind = Literal["grow", "move", "shrink", "prefetch", "keep", "undo", "room", "refused"]


@dataclass(frozen=True)
class Reading:
    """One loader over the last round."""

    name: str
    priority: int
    min_workers: int
    workers: int
    prefetch_factor: int
    movable: bool  # autotune on and its processes take the node's CPUs
    ceiling: int  # autotune's max_workers (fixed loaders: their num_workers)
    max_prefetch: int
    trainers: int  # attached
    batches: int  # consumed in the round
    samples_per_s: float
    wait_share: float  # per trainer, 0-1
    busy_share: float  # per worker, 0-1
    floor: int = 0  # the fewest workers the arbiter may leave it (set by the round)

    @property
    def measured(self) -> bool:
        return self.batches >= MIN_BATCHES

    @property
    def waiting(self) -> bool:
        return self.trainers > 0 and self.measured and self.wait_share >= WAIT_OK

    @property
    def quiet(self) -> bool:
        """Its trainers do not wait: they got batches and waited under ``WAIT_OK`` (a
        slow trainer needs no ``MIN_BATCHES`` for that; a blocked one got none)."""
        return self.trainers > 0 and self.batches > 0 and self.wait_share < WAIT_OK

    @property
    def stall(self) -> float:
        return self.priority * self.wait_share if self.trainers else 0.0


def weighted_stall(readings: dict[str, Reading]) -> float:
    return sum(r.stall for r in readings.values())


def grow_step(r: Reading, free: int) -> int:
    """Free workers a bottlenecked loader gets in one move: those its wait says it
    lacks (its busy workers supply ``1 - wait`` of its trainers' demand), at most as
    many as it has (a doubling), within ``free`` and its ceiling; at least one."""
    lacking = math.ceil(r.workers / max(1.0 - r.wait_share, MIN_SUPPLY)) - r.workers
    return max(1, min(lacking, max(1, r.workers), free, r.ceiling - r.workers))


@dataclass(frozen=True)
class Decision:
    t: float  # seconds since the server started
    kind: Kind
    loader: str
    donor: str | None
    workers: dict[str, int]  # of the loaders it changed, after it
    weighted_stall: float  # S measured before it (keep/undo: after the trial)
    reason: str


@dataclass
class Trial:
    kind: Kind
    loader: str
    donor: str | None
    undo: list[tuple[str, LiveChange]]
    before: float  # S before the change
    key: tuple[str, ...]
    rate_before: float = 0.0  # the receiver's samples/s before


@dataclass
class _Seen:
    sample: Sample
    workers: int


@dataclass
class NodeState:
    """What GET /v1/node shows of the arbiter."""

    enabled: bool
    interval_s: float
    settled: bool
    settled_after_s: float | None
    weighted_stall: float | None
    trial: dict[str, Any] | None
    readings: dict[str, Reading] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)


class NodeArbiter:
    def __init__(
        self,
        loaders: Callable[[], list[tuple[str, LoaderEngine]]],
        budget: NodeBudget,
        reconfigure: Callable[[str, LiveChange], object],
        lock: AbstractContextManager[Any],
        *,
        enabled: bool = True,
        interval_s: float = 2.0,
        poll_s: float = 0.1,
    ) -> None:
        """``reconfigure(name, change)``: the service's live change (it also records
        it); ``lock``: the service's, held for a round (a loader created meanwhile
        waits, so ``make_room`` and a round never interleave)."""
        self._loaders = loaders
        self._budget = budget
        self._reconfigure = reconfigure
        self._lock = lock
        self.enabled = enabled
        self.interval_s = interval_s
        self._poll_s = poll_s
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pinfeed-arbiter", daemon=True)
        # snapshots since the last change settled: (monotonic, every loader's counters)
        self._history: collections.deque[tuple[float, dict[str, _Seen]]] = collections.deque()
        self._settle_until = 0.0
        self.settle_s = interval_s  # after a change, not measured
        self.measure_s = interval_s  # a reading spans at least this ...
        self.window_s = WINDOW * interval_s  # ... and at most this
        self.readings: dict[str, Reading] = {}
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=KEPT)
        self._trial: Trial | None = None
        self._blocked: dict[tuple[str, ...], float] = {}  # key -> until (monotonic)
        self._strikes: dict[tuple[str, ...], int] = {}  # key -> times undone
        self._scene: frozenset[tuple[Any, ...]] = frozenset()
        self._next_round = 0.0
        self._changed_at = 0.0  # the last kept change (seconds since start)
        self.settled_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                if self.enabled:
                    if time.monotonic() >= self._next_round:
                        self._next_round = time.monotonic() + self.interval_s
                        with self._lock:
                            self.round()
                else:
                    for name, engine in self._loaders():
                        self._tune_alone(name, engine)
            except Exception:  # the arbiter must outlive one round's trouble
                log.exception("node arbiter round failed")

    # -- the round ---------------------------------------------------------------------
    def _snapshot(self) -> dict[str, _Seen]:
        return {
            name: _Seen(engine.tune_sample(), engine.config.num_workers)
            for name, engine in self._loaders()
            if engine.state == "ready"
        }

    def _read(self, base: dict[str, _Seen], now: dict[str, _Seen]) -> dict[str, Reading]:
        """Every loader in both snapshots, over the time between them."""
        out: dict[str, Reading] = {}
        engines = dict(self._loaders())
        for name, seen in now.items():
            last, engine = base.get(name), engines.get(name)
            if last is None or engine is None:
                continue
            sample = seen.sample
            dt = max(sample.t - last.sample.t, 1e-9)
            out[name] = _reading(
                name,
                engine,
                batches=sample.batches - last.sample.batches,
                samples_per_s=max(0, sample.samples - last.sample.samples) / dt,
                # as autotune measures them, capped at 1 (busy time counts queued
                # tasks); a wait is reported with the batch after it, so a trainer blocked
                # now has waited at least its NEXT's time unanswered (up to the span)
                wait_share=min(
                    1.0,
                    max(sample.wait_s - last.sample.wait_s, min(sample.pending_s, dt))
                    / dt
                    / sample.trainers,
                ),
                busy_share=min(
                    1.0,
                    max(0.0, sample.busy_s - last.sample.busy_s) / dt / max(1, last.workers),
                ),
            )
        return _with_floors(out)

    def round(self) -> Decision | None:
        """One round: measure, judge a trial in flight, else make at most one change.
        Returns the decision made, if any (tests drive rounds directly).

        Readings span the time since the last change settled (``settle_s`` after it:
        workers start, rings grow), at least ``measure_s`` and at most ``window_s``;
        a round with less measured time waits."""
        now = time.monotonic()
        snap = self._snapshot()
        scene = frozenset(
            (n, e.consumers.attached > 0, e.config.priority, e.config.min_workers)
            for n, e in self._loaders()
            if n in snap
        )
        if scene != self._scene:  # what was measured no longer holds
            self._scene, self._blocked, self._strikes = scene, {}, {}
            self._history.clear()
        self._blocked = {k: u for k, u in self._blocked.items() if u > now}
        if now < self._settle_until:
            return None
        self._history.append((now, snap))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        t0, base = self._history[0]
        if now - t0 < self.measure_s - 0.01:
            return None
        readings = self._read(base, snap)
        self.readings = readings
        s = weighted_stall(readings)
        trial = self._trial
        if trial is not None:
            self._trial = None
            if trial.loader not in readings or (trial.donor and trial.donor not in readings):
                return None  # a loader went (or stopped): nothing left to judge
            return self._judge(trial, s, readings)
        decision = self._decide(readings, s)
        if decision is None and self.settled_at is None:
            self.settled_at = self._changed_at
        return decision

    def _changed(self) -> None:
        """A loader's workers or prefetch changed: measure afresh once it settled."""
        self._history.clear()
        self._settle_until = time.monotonic() + self.settle_s

    def _judge(self, trial: Trial, s: float, readings: dict[str, Reading]) -> Decision:
        margin = max(MARGIN_ABS, MARGIN_REL * trial.before)
        # a shrink is kept unless it raised S; a worker more only if it lowered S by the
        # margin and the receiver's throughput rose by GAIN
        rate = readings[trial.loader].samples_per_s
        if trial.kind == "shrink":
            kept = s <= trial.before + margin
        else:
            gained = rate >= GAIN * trial.rate_before if trial.rate_before > 0 else rate > 0
            kept = s <= trial.before - margin and gained
        how = f"weighted stall {trial.before:.2f} -> {s:.2f}"
        if trial.kind != "shrink":
            how += f", {trial.loader} {trial.rate_before:.0f} -> {rate:.0f} samples/s"
        if kept:
            self._changed_at = self._t()
            self.settled_at = None
            return self._record("keep", trial.loader, trial.donor, readings, s, f"{how}: kept")
        for name, change in trial.undo:
            self._apply(name, change, "undo", f"{how}: undone")
        # the same move undone again waits twice as long (until the scene changes)
        strikes = self._strikes[trial.key] = self._strikes.get(trial.key, 0) + 1
        self._blocked[trial.key] = time.monotonic() + BLOCK_S * 2 ** min(strikes - 1, 5)
        return self._record("undo", trial.loader, trial.donor, readings, s, f"{how}: undone")

    def _decide(self, readings: dict[str, Reading], s: float) -> Decision | None:
        movable = [r for r in readings.values() if r.movable]
        free = self._budget.max_workers - self._budget.workers_used()
        for r in sorted((r for r in movable if r.waiting), key=lambda r: -r.stall):
            shares = f"trainers wait {r.wait_share:.0%}, workers busy {r.busy_share:.0%}"
            if r.workers > 0 and r.busy_share < BUSY:
                if r.prefetch_factor < r.max_prefetch and not self._is_blocked("prefetch", r.name):
                    deeper = min(r.max_prefetch, r.prefetch_factor * 2)
                    back = LiveChange(prefetch_factor=r.prefetch_factor)
                    return self._change(
                        "prefetch",
                        r,
                        None,
                        [(r.name, LiveChange(prefetch_factor=deeper), back)],
                        s,
                        f"{shares}: prefetch_factor {deeper}",
                        readings,
                    )
                continue
            if r.workers >= r.ceiling:
                continue
            back = LiveChange(num_workers=r.workers)
            if free > 0 and not self._is_blocked("grow", r.name):
                step = grow_step(r, free)
                more = (
                    "one more worker (a free one)" if step == 1 else f"{step} more workers (free)"
                )
                return self._change(
                    "grow",
                    r,
                    None,
                    [(r.name, LiveChange(num_workers=r.workers + step), back)],
                    s,
                    f"{shares}: {more}",
                    readings,
                )
            grow = LiveChange(num_workers=r.workers + 1)
            donor = self._donor(r, movable)
            if donor is not None:
                d, why = donor
                give_back = LiveChange(num_workers=d.workers)
                return self._change(
                    "move",
                    r,
                    d.name,
                    [
                        (d.name, LiveChange(num_workers=d.workers - 1), give_back),
                        (r.name, grow, back),
                    ],
                    s,
                    f"{shares}: one worker from {d.name} ({why})",
                    readings,
                )
        for r in sorted(movable, key=lambda r: r.busy_share):
            if (
                (r.trainers == 0 or r.quiet)
                and r.busy_share < IDLE
                and r.workers > max(r.floor, 1)
                and not self._is_blocked("shrink", r.name)
            ):
                who = "no trainer attached" if r.trainers == 0 else "its trainers do not wait"
                return self._change(
                    "shrink",
                    r,
                    None,
                    [
                        (
                            r.name,
                            LiveChange(num_workers=r.workers - 1),
                            LiveChange(num_workers=r.workers),
                        )
                    ],
                    s,
                    f"{who}, workers busy {r.busy_share:.0%}: one fewer worker",
                    readings,
                )
        return None

    def _donor(self, r: Reading, movable: list[Reading]) -> tuple[Reading, str] | None:
        """Who gives ``r`` a worker, and why them; None when nobody should."""
        cands = [
            d
            for d in movable
            if d.name != r.name
            and d.workers > d.floor
            and not self._is_blocked("move", d.name, r.name)
        ]
        idle = [d for d in cands if d.trainers == 0]
        if idle:
            return max(idle, key=lambda d: d.workers), "no trainer attached"
        quiet = [d for d in cands if d.quiet]
        if quiet:
            d = min(quiet, key=lambda d: d.busy_share)
            return d, f"its trainers wait {d.wait_share:.0%}"
        # Both stall: one worker's share of the donor's progress against what one more
        # adds to the receiver's (its supply grows by 1/workers of itself).
        gain = r.priority * min(r.wait_share, (1 - r.wait_share) / max(1, r.workers))
        stalled = [(d.priority * (1 - d.wait_share) / d.workers, d) for d in cands if d.measured]
        if stalled:
            loss, d = min(stalled, key=lambda x: x[0])
            if loss < gain:
                return d, f"it loses ~{loss:.2f} weighted progress, {r.name} gains ~{gain:.2f}"
        return None

    def _is_blocked(self, *key: str) -> bool:
        return key in self._blocked

    def _change(
        self,
        kind: Kind,
        r: Reading,
        donor: str | None,
        steps: list[tuple[str, LiveChange, LiveChange]],
        s: float,
        reason: str,
        readings: dict[str, Reading],
    ) -> Decision:
        """Apply ``steps`` (loader, change, its undo) in order; one refused undoes the
        steps before it, blocks the move, and is recorded as refused."""
        key = (kind, *([donor] if donor else []), r.name)
        for i, (name, change, _) in enumerate(steps):
            if not self._apply(name, change, kind, reason):
                for n, _, back in reversed(steps[:i]):
                    self._apply(n, back, "undo", "the rest of the move was refused")
                self._blocked[key] = time.monotonic() + BLOCK_S
                return self._record("refused", r.name, donor, readings, s, reason)
        self.settled_at = None
        if kind == "prefetch":  # more slots: nothing to judge, only memory (admitted)
            self._changed_at = self._t()
        else:
            undo = [(n, back) for n, _, back in reversed(steps)]
            self._trial = Trial(kind, r.name, donor, undo, s, key, r.samples_per_s)
        return self._record(kind, r.name, donor, readings, s, reason)

    def _apply(self, name: str, change: LiveChange, kind: Kind, reason: str) -> bool:
        try:
            self._reconfigure(name, change)
        except NotFound:
            return False
        except PinfeedError as exc:
            log.info("loader %s: node arbiter %s refused: %s", name, kind, exc.detail)
            return False
        self._changed()
        for n, engine in self._loaders():
            if n == name and engine.tuner is not None:  # the loader's own decision list
                cfg = engine.config
                engine.tuner.applied(cfg.num_workers, cfg.prefetch_factor, f"node: {reason}")
        return True

    def _record(
        self,
        kind: Kind,
        loader: str,
        donor: str | None,
        readings: dict[str, Reading],
        s: float,
        reason: str,
    ) -> Decision:
        workers = {n: e.config.num_workers for n, e in self._loaders() if n in (loader, donor)}
        decision = Decision(self._t(), kind, loader, donor, workers, round(s, 4), reason)
        self.decisions.append(decision)
        log.info(
            "node arbiter %s %s%s %s: %s",
            kind,
            loader,
            f" (from {donor})" if donor else "",
            workers,
            reason,
        )
        return decision

    def _t(self) -> float:
        return round(time.monotonic() - self.started, 2)

    # -- admission ---------------------------------------------------------------------
    def make_room(self, need: int, for_name: str, priority: int) -> int:
        """Free up to ``need`` node workers for loader ``for_name`` (being created or
        changed) from autotuned loaders above their floors: those with no trainer first,
        then those whose trainers do not wait, then lower priorities than ``priority``.
        Called with the service's lock held. Returns the workers freed."""
        if not self.enabled or need <= 0:
            return 0
        freed = 0
        for d in self._room_donors(for_name, priority):
            while freed < need and d.workers > d.floor:
                change = LiveChange(num_workers=d.workers - 1)
                why = f"room for loader {for_name!r} (priority {priority})"
                if not self._apply(d.name, change, "room", why):
                    break
                d = replace(d, workers=d.workers - 1)
                freed += 1
                self._record("room", d.name, None, self.readings, 0.0, why)
            if freed >= need:
                break
        if freed:
            self._trial = None  # the node changed under it: nothing fair to judge
        return freed

    def _room_donors(self, for_name: str, priority: int) -> Iterator[Reading]:
        readings = _with_floors(
            {
                n: self.readings.get(n) or _unmeasured(n, e)
                for n, e in self._loaders()
                if n != for_name and e.state in ("ready", "starting")
            }
        )
        movable = [r for r in readings.values() if r.movable and r.workers > r.floor]
        yield from sorted((r for r in movable if r.trainers == 0), key=lambda r: -r.workers)
        yield from sorted(
            (r for r in movable if r.quiet),
            key=lambda r: r.busy_share,
        )
        yield from sorted(
            (r for r in movable if r.trainers and r.waiting and r.priority < priority),
            key=lambda r: (r.priority, -r.workers),
        )

    # -- each loader alone (PINFEED_ARBITER=false) ---------------------------------------
    def _tune_alone(self, name: str, engine: LoaderEngine) -> None:
        tuner = engine.tuner
        if tuner is None or engine.state != "ready":
            return
        if not tuner.due(time.monotonic(), engine.stats.batches_consumed):
            return
        others = self._budget.max_workers - self._budget.workers_used(name)
        limit = min(len(os.sched_getaffinity(0)), others)
        decision = tuner.tick(engine.tune_sample(), max(1, limit))
        if decision is None:
            return
        workers, prefetch, reason = decision
        try:
            self._reconfigure(name, LiveChange(num_workers=workers, prefetch_factor=prefetch))
        except NotFound:
            return  # deleted meanwhile
        except PinfeedError as exc:
            detail = exc.detail
            tuner.refused(workers)
            tuner.applied(tuner.num_workers, tuner.prefetch_factor, f"{reason}: {detail}")
            log.info("loader %s: autotune refused: %s", name, detail)
            return
        if engine.tuner is tuner:  # not turned off meanwhile
            tuner.applied(workers, prefetch, reason)
        log.info(
            "loader %s: autotune num_workers=%d prefetch_factor=%d: %s",
            name,
            workers,
            prefetch,
            reason,
        )

    # -- the view ----------------------------------------------------------------------
    def state(self) -> NodeState:
        trial = self._trial
        readings = dict(self.readings)
        return NodeState(
            enabled=self.enabled,
            interval_s=self.interval_s,
            settled=self.settled_at is not None and trial is None,
            settled_after_s=self.settled_at,
            weighted_stall=round(weighted_stall(readings), 4) if readings else None,
            trial=None
            if trial is None
            else {"kind": trial.kind, "loader": trial.loader, "donor": trial.donor},
            readings=readings,
            decisions=list(self.decisions),
        )


def _reading(
    name: str,
    engine: LoaderEngine,
    *,
    batches: int,
    samples_per_s: float,
    wait_share: float,
    busy_share: float,
) -> Reading:
    """A loader's reading: its config and trainers now, with what was measured."""
    cfg = engine.config
    spec = cfg.autotune
    return Reading(
        name=name,
        priority=cfg.priority,
        min_workers=cfg.min_workers,
        workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        movable=spec is not None and engine.producer.executor.counts_workers,
        ceiling=spec.max_workers if spec else cfg.num_workers,
        max_prefetch=spec.max_prefetch_factor if spec else cfg.prefetch_factor,
        trainers=engine.consumers.attached,
        batches=batches,
        samples_per_s=samples_per_s,
        wait_share=wait_share,
        busy_share=busy_share,
    )


def _unmeasured(name: str, engine: LoaderEngine) -> Reading:
    return _reading(name, engine, batches=0, samples_per_s=0.0, wait_share=0.0, busy_share=0.0)


def _with_floors(readings: dict[str, Reading]) -> dict[str, Reading]:
    """Each reading's floor: its ``min_workers``, and 1 for a loader with a trainer
    attached unless its ``min_workers`` is 0 and it has the lowest priority of the
    attached loaders, below another's (it may be left to the server's own thread)."""
    attached = [r.priority for r in readings.values() if r.trainers]
    lowest, top = min(attached, default=0), max(attached, default=0)
    out = {}
    for name, r in readings.items():
        floor = r.min_workers
        if r.trainers and not (r.min_workers == 0 and r.priority == lowest < top):
            floor = max(floor, 1)
        out[name] = replace(r, floor=min(floor, r.workers) if not r.movable else floor)
    return out
