"""The engine drives any producer behind the seam, in-process (no server, no socket):
results finishing out of order are published in sampler order, a producer may copy
bytes made elsewhere into the slot (a remote backend), and one that runs out of
batches early (an iterator) ends the epoch there."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pinfeed_server.datasets import KINDS, DatasetContext
from pinfeed_server.engine.collate import SlotWriter
from pinfeed_server.engine.config import LoaderCode, make_sampler
from pinfeed_server.engine.consumers import BatchItem, EndItem, Item
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.engine.producers import ProducerContext, Result, Task
from pinfeed_server.engine.ring import Ring
from pinfeed_server.engine.sampler import EpochSampler
from tests.engine._fakes import (
    PARAMS,
    assert_batch,
    config,
    dataset,
    expected,
    layout_of,
    slot_batch,
)


class RemoteLike:
    """Makes each batch in a buffer of its own (as a remote actor would) and copies its
    bytes into the ring slot; answers tasks in pairs, the second first."""

    restarts = 0

    def __init__(self, ctx: ProducerContext) -> None:
        self.ctx = ctx
        self._scratch = Ring("scratch", 1, ctx.ring.slot_bytes, lock=False)
        self._writer = SlotWriter(ctx.dataset, ctx.layout, self._scratch.base, ctx.ring.slot_bytes)
        self._held: Task | None = None
        self.submitted: list[Task] = []

    def _finish(self, task: Task) -> None:
        assert task.indices is not None
        strings = self._writer.write(0, task.indices)
        size = self.ctx.ring.slot_bytes
        self.ctx.ring.base[task.slot * size : (task.slot + 1) * size].copy_(
            self._scratch.base[:size]
        )
        self.ctx.on_result(Result(task.seq, strings))

    def submit(self, task: Task) -> None:
        self.submitted.append(task)
        if self._held is None:
            self._held = task
            return
        held, self._held = self._held, None
        self._finish(task)
        self._finish(held)

    def resize(self, num_workers: int) -> None:
        pass

    def busy_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        self._writer.close()
        self._scratch.close()


class RunsOut(RemoteLike):
    """An iterator-like producer: its stream holds two batches per epoch."""

    def submit(self, task: Task) -> None:
        self.submitted.append(task)
        if task.index >= 2:
            self.ctx.on_result(Result(task.seq, end=True))
        else:
            self._finish(task)


class Remote:
    """An executor of the test's own (what a new executor module declares): the engine
    runs it with no change of its own."""

    name = "remote"
    forks_local = False
    counts_workers = False

    def __init__(self, producer: type[RemoteLike]) -> None:
        self._producer = producer
        self.made: list[RemoteLike] = []

    def refusal(self, config: Any, kind: Any, iterable: bool) -> str | None:
        return None

    def live_refusal(self, old: Any, new: Any, iterable: bool) -> str | None:
        return None

    def resizes_live(self, old: int, new: int) -> bool:
        return True

    def producer(self, ctx: ProducerContext, spawn: Any) -> RemoteLike:
        self.made.append(self._producer(ctx))
        return self.made[-1]


def _engine(tmp_path: Path, producer: type[RemoteLike]) -> tuple[LoaderEngine, list[Any]]:
    ds = dataset(tmp_path)
    executor = Remote(producer)
    cfg = config(shuffle=True, num_workers=2)
    engine = LoaderEngine(
        cfg,
        ds,
        KINDS["synthetic"],
        PARAMS,
        DatasetContext(tmp_path),
        layout_of(ds),
        make_sampler(cfg, ds, streams=2),
        LoaderCode(),
        executor,
    )
    engine.start()
    engine.wait_started(30)
    assert engine.state == "ready", engine.failure
    return engine, executor.made


def _items(engine: LoaderEngine, ends: int) -> Iterator[Item]:
    """The stream of one consumer up to its ``ends``-th END, each slot released."""
    member = engine.attach(None)
    stop = threading.Event()
    while ends:
        item = engine.next_item(member, stop, timeout=30)
        assert item is not None, "no item within 30 s"
        yield item
        if isinstance(item, BatchItem):
            engine.release(member, [item.slot])
        ends -= isinstance(item, EndItem)


def _check(engine: LoaderEngine, item: BatchItem, indices: list[int]) -> None:
    assert engine.ring is not None
    got = slot_batch(engine.ring, engine.layout, item.slot, item.rows)
    assert_batch(got, expected(engine.dataset, indices))


@pytest.fixture
def sampler() -> EpochSampler:
    return EpochSampler(10, 3, shuffle=True, seed=0, drop_last=False)


def test_out_of_order_results_are_published_in_sampler_order(
    tmp_path: Path, sampler: EpochSampler
) -> None:
    engine, made = _engine(tmp_path, RemoteLike)
    try:
        stream = list(_items(engine, ends=2))
    finally:
        engine.close()
    want = [(e, i) for e in range(2) for i in range(4)]
    batches = [x for x in stream if isinstance(x, BatchItem)]
    assert [(b.epoch, b.index) for b in batches] == want
    assert [x for x in stream if isinstance(x, EndItem)] == [
        EndItem(0, batches[3].seq),
        EndItem(1, batches[7].seq),
    ]
    assert made[0].submitted[0].indices == next(sampler.batches(0))


def test_bytes_copied_into_the_slot_are_the_batch(tmp_path: Path, sampler: EpochSampler) -> None:
    engine, _ = _engine(tmp_path, RemoteLike)
    checked = 0
    try:
        for item in _items(engine, ends=2):
            if isinstance(item, BatchItem):
                _check(engine, item, list(sampler.batches(item.epoch))[item.index])
                checked += 1
    finally:
        engine.close()
    assert checked == 2 * 4  # two epochs of 4 batches: an empty stream fails here


def test_a_producer_that_runs_out_ends_the_epoch(tmp_path: Path, sampler: EpochSampler) -> None:
    engine, made = _engine(tmp_path, RunsOut)
    try:
        stream = []
        for item in _items(engine, ends=3):
            if isinstance(item, BatchItem):
                _check(engine, item, list(sampler.batches(item.epoch))[item.index])
            stream.append((type(item).__name__, item.epoch))
    finally:
        engine.close()
    per_epoch = [("BatchItem", 0), ("BatchItem", 0), ("EndItem", 0)]
    assert stream == [(kind, epoch + e) for e in range(3) for kind, epoch in per_epoch]
    # Production moved to the next epoch at each END: batch 3 of an epoch, which the
    # plan has but the producer's stream does not, was never asked for.
    assert {t.index for t in made[0].submitted} == {0, 1, 2}
