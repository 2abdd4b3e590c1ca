"""The node arbiter's rules (``node/arbiter.py``) on a simulated node: loaders whose
throughput is ``min(demand, workers x per-worker rate)``, on a fake clock. It reaches
the split with the least weighted stall and stays there (every move judged, the undone
ones not retried), honours ``min_workers`` and the floor of 1 for an attached trainer,
makes room for a priority-4 newcomer, and leaves fixed loaders alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pinfeed.errors import WorkerLimit
from pinfeed_server.engine.autotune import AutotuneSpec, Sample
from pinfeed_server.engine.config import LiveChange, LoaderConfig
from pinfeed_server.node import arbiter as arbiter_module
from pinfeed_server.node.arbiter import NodeArbiter, weighted_stall
from pinfeed_server.node.budget import NodeBudget


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeExecutor:
    counts_workers: bool = True


@dataclass
class FakeProducer:
    executor: FakeExecutor = field(default_factory=FakeExecutor)


@dataclass
class FakeConsumers:
    attached: int = 1


class FakeEngine:
    """A loader whose trainer asks ``demand`` batches/s and whose workers make
    ``per_worker`` batches/s each (0 workers: the server's thread, ``per_worker / 2``)."""

    def __init__(
        self, clock: Clock, name: str, demand: float, per_worker: float, **config: Any
    ) -> None:
        autotune = config.pop("autotune", {"max_workers": 8})
        self.config = LoaderConfig(
            name=name,
            dataset=name,
            seed=0,
            num_workers=config.pop("num_workers", 1),
            autotune=AutotuneSpec(**autotune) if autotune else None,
            **config,
        )
        self.clock, self.demand, self.per_worker = clock, demand, per_worker
        self.state = "ready"
        self.producer = FakeProducer()
        self.consumers = FakeConsumers()
        self.tuner = None
        self._t = clock()
        self._counters = (0.0, 0.0, 0.0)  # batches, wait_s, busy_s

    @property
    def node_workers(self) -> int:
        return self.config.num_workers

    def advance(self) -> None:
        dt = self.clock() - self._t
        self._t = self.clock()
        w = self.config.num_workers
        supply = w * self.per_worker if w else self.per_worker / 2
        demand = self.demand if self.consumers.attached else 0.0
        rate = min(demand, supply)
        wait = (1 - rate / demand) if demand else 0.0
        busy = (rate / supply if supply else 0.0) * max(1, w)
        b, ws, bs = self._counters
        self._counters = (b + rate * dt, ws + wait * dt, bs + busy * dt)

    def tune_sample(self) -> Sample:
        b, ws, bs = self._counters
        return Sample(self.clock(), int(b), int(b) * 8, ws, bs, max(1, self.consumers.attached))


class Node:
    def __init__(self, max_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = Clock()
        monkeypatch.setattr(arbiter_module.time, "monotonic", self.clock)
        self.engines: dict[str, FakeEngine] = {}
        self.budget = NodeBudget(max_workers, 1 << 40, lambda: self.engines)  # type: ignore[arg-type,return-value]
        self.arbiter = NodeArbiter(
            lambda: list(self.engines.items()),  # type: ignore[arg-type]
            self.budget,
            self.reconfigure,
            _NoLock(),
            interval_s=1.0,
        )
        self.changes: list[tuple[str, LiveChange]] = []

    def add(self, name: str, demand: float, per_worker: float, **config: Any) -> FakeEngine:
        engine = FakeEngine(self.clock, name, demand, per_worker, **config)
        self.engines[name] = engine
        return engine

    def reconfigure(self, name: str, change: LiveChange) -> LoaderConfig:
        engine = self.engines[name]
        new = change.applied_to(engine.config)
        used = self.budget.workers_used(name)
        if used + new.num_workers > self.budget.max_workers:
            raise WorkerLimit("full", max_workers=self.budget.max_workers, free_workers=0)
        engine.config = new
        self.changes.append((name, change))
        return new

    def run(self, seconds: float) -> list[Any]:
        decisions = []
        for _ in range(int(seconds)):
            self.clock.t += 1.0
            for e in self.engines.values():
                e.advance()
            d = self.arbiter.round()
            if d is not None:
                decisions.append(d)
        return decisions

    def settle(self) -> None:
        """Rounds until no trial is in flight, then until a reading after it."""
        for _ in range(10):
            if self.arbiter.state().trial is None:
                break
            self.run(1)
        self.run(3)

    def split(self) -> dict[str, int]:
        return {n: e.config.num_workers for n, e in self.engines.items()}


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _three(node: Node) -> None:
    # the benchmark's shape: fast is insatiable (needs 20 workers), medium needs 7,
    # slow is fed by one
    node.add("fast", demand=250, per_worker=12, min_workers=1)
    node.add("medium", demand=25, per_worker=3.6, priority=2, min_workers=1)
    node.add("slow", demand=10, per_worker=12, min_workers=1)


def test_reaches_the_least_weighted_stall_and_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(9, monkeypatch)
    _three(node)
    node.run(120)
    node.settle()
    assert node.split() == {"fast": 1, "medium": 7, "slow": 1}
    assert weighted_stall(node.arbiter.readings) < 0.96  # fast waits, alone
    # no oscillation: once settled, the only changes are trials undone at once, ever
    # rarer (each undo of the same move doubles its wait)
    late = node.run(240)
    node.settle()
    assert not [d for d in late if d.kind == "keep"]
    assert len([d for d in late if d.kind == "undo"]) <= 3
    assert node.split() == {"fast": 1, "medium": 7, "slow": 1}
    assert node.arbiter.state().settled


def test_a_loader_far_short_of_its_need_gets_there_in_few_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # medium needs 7 workers and has 1: grown by what its wait says it lacks (at most
    # doubling: 1 -> 2 -> 4 -> 7), not one worker a round (6 judged moves, 21 rounds)
    node = Node(9, monkeypatch)
    _three(node)
    rounds = 0
    while rounds < 40 and node.split() != {"fast": 1, "medium": 7, "slow": 1}:
        node.run(1)
        rounds += 1
    grown = [
        d.workers["medium"]
        for d in node.arbiter.decisions
        if d.kind == "grow" and d.loader == "medium"
    ]
    assert grown == [2, 4, 7]
    assert rounds <= 14


def test_every_move_is_logged_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(9, monkeypatch)
    _three(node)
    decisions = node.run(60)
    assert decisions and all(d.reason for d in decisions)
    grown = [d for d in decisions if d.kind == "grow" and d.loader == "medium"]
    assert grown and "one more worker" in grown[0].reason
    judged = [d for d in decisions if d.kind in ("keep", "undo")]
    assert all("weighted stall" in d.reason for d in judged)


def test_min_workers_and_the_attached_floor_are_never_broken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = Node(6, monkeypatch)
    node.add("greedy", demand=500, per_worker=10, priority=4, num_workers=1)
    node.add("kept", demand=100, per_worker=10, min_workers=2, num_workers=2)
    # attached, does not wait, not the lowest priority: never below 1
    node.add("quiet", demand=1, per_worker=10, priority=2, num_workers=3)
    seen = []
    for _ in range(200):
        node.run(1)
        seen.append(node.split())
    assert all(s["kept"] >= 2 for s in seen)
    assert all(s["quiet"] >= 1 for s in seen)
    assert node.split()["quiet"] == 1  # its spare workers went to those who wait


def test_the_lowest_priority_with_min_0_may_go_to_the_servers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = Node(2, monkeypatch)
    node.add("urgent", demand=100, per_worker=10, priority=4, num_workers=1)
    node.add("low", demand=100, per_worker=10, priority=1, num_workers=1)
    node.run(30)
    assert node.split() == {"urgent": 2, "low": 0}


def test_a_priority_4_newcomer_gets_room_and_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(9, monkeypatch)
    _three(node)
    node.run(120)
    node.settle()
    assert node.budget.workers_used() == 9
    freed = node.arbiter.make_room(1, "urgent", 4)
    assert freed == 1
    node.add("urgent", demand=33, per_worker=14, priority=4, min_workers=1)
    node.run(60)
    node.settle()
    split = node.split()
    assert split["urgent"] >= 3, split  # what it needs alone
    assert split["fast"] >= 1 and split["medium"] >= 1 and split["slow"] >= 1
    room = [d for d in node.arbiter.decisions if d.kind == "room"]
    assert room and "urgent" in room[0].reason


def test_fixed_loaders_are_fixed_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(4, monkeypatch)
    node.add("fixed", demand=1000, per_worker=10, num_workers=3, autotune=None)
    node.add("tuned", demand=1000, per_worker=10, num_workers=1)
    node.run(60)
    assert node.split() == {"fixed": 3, "tuned": 1}
    assert all(n != "fixed" for n, _ in node.changes)


def test_a_loader_without_trainer_gives_first(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(4, monkeypatch)
    node.add("busy", demand=100, per_worker=10, num_workers=1)
    idle = node.add("idle", demand=100, per_worker=10, num_workers=3)
    idle.consumers.attached = 0
    node.run(60)
    assert node.split() == {"busy": 4, "idle": 0}
