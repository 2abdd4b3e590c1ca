"""Both producers behind the one interface, with a fake consumer of their results:
the batch lands in its slot, errors come back as results, resize and restarts."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from pinfeed_server.engine.producers import Producer, ProducerContext, Task
from pinfeed_server.engine.producers.inline import InlineProducer
from pinfeed_server.engine.producers.local import LocalExecutor
from pinfeed_server.engine.producers.pool import WorkerPool
from pinfeed_server.engine.ring import Ring
from tests.engine._fakes import (
    Sink,
    assert_batch,
    context,
    dataset,
    expected,
    layout_of,
    slot_batch,
)

BATCHES = [[0, 1, 2], [9, 3, 5], [4, 8, 7], [6]]


def make_producer(ctx: ProducerContext) -> Producer:
    return LocalExecutor().producer(ctx, None)


def _submit_all(producer: Producer, first_seq: int = 0) -> None:
    for i, indices in enumerate(BATCHES):
        producer.submit(Task(first_seq + i, 0, i, i, indices))


def _check_slots(ring: Ring, ds: Any, sink: Sink, first_seq: int = 0) -> None:
    layout = layout_of(ds)
    for i, indices in enumerate(BATCHES):
        result = sink.results[first_seq + i]
        assert result.error is None and not result.end
        assert_batch(slot_batch(ring, layout, i, len(indices)), expected(ds, indices))


def test_inline_makes_each_batch_before_submit_returns(tmp_path: Path) -> None:
    ds, sink = dataset(tmp_path), Sink()
    layout = layout_of(ds)
    with Ring("t", 4, layout.slot_bytes, lock=False) as ring:
        producer = make_producer(context(tmp_path, ring, sink, ds, layout))
        assert isinstance(producer, InlineProducer)
        for i, indices in enumerate(BATCHES):
            producer.submit(Task(i, 0, i, i, indices))
            assert set(sink.results) == set(range(i + 1))
        _check_slots(ring, ds, sink)
        assert producer.busy_seconds() > 0 and producer.restarts == 0
        producer.close()
        producer.close()


class _Raises:
    """A dataset whose sample 2 raises."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> Any:
        if index == 2:
            raise KeyError("no sample 2")
        return self.ds[index]


def test_inline_reports_a_failing_sample_as_that_batchs_error(tmp_path: Path) -> None:
    ds, sink = _Raises(dataset(tmp_path)), Sink()
    layout = layout_of(ds)
    with Ring("t", 1, layout.slot_bytes, lock=False) as ring:
        producer = InlineProducer(context(tmp_path, ring, sink, ds, layout))
        producer.submit(Task(0, 0, 0, 0, [1, 2]))
        producer.close()
    error = sink.results[0].error
    assert error is not None
    assert error.slug == "sample-error" and error.extra["index"] == 2
    assert "no sample 2" in error.detail and error.extra["error_type"] == "KeyError"


def test_inline_cannot_grow_workers(tmp_path: Path) -> None:
    ds, sink = dataset(tmp_path), Sink()
    layout = layout_of(ds)
    with Ring("t", 1, layout.slot_bytes, lock=False) as ring:
        producer = InlineProducer(context(tmp_path, ring, sink, ds, layout))
        producer.resize(0)
        with pytest.raises(ValueError, match="the engine swaps it"):
            producer.resize(2)
        producer.close()


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    ds, sink = dataset(tmp_path), Sink()
    layout = layout_of(ds)
    with Ring("t", 4, layout.slot_bytes, lock=False) as ring:
        producer = make_producer(context(tmp_path, ring, sink, ds, layout, num_workers=2))
        assert isinstance(producer, WorkerPool)
        try:
            yield producer, ring, ds, sink
        finally:
            producer.close()
    assert not sink.fatal


def test_pool_workers_write_into_the_slots(pool: Any) -> None:
    producer, ring, ds, sink = pool
    _submit_all(producer)
    sink.wait(len(BATCHES))
    _check_slots(ring, ds, sink)
    assert producer.busy_seconds() > 0 and producer.restarts == 0


def test_pool_replaces_a_killed_worker_and_loses_no_task(pool: Any) -> None:
    producer, ring, ds, sink = pool
    os.kill(producer._workers[0].process.pid, signal.SIGKILL)
    _submit_all(producer)  # some go to the dead worker: they are re-sent
    sink.wait(len(BATCHES))
    _check_slots(ring, ds, sink)
    assert producer.restarts == 1 and producer.size == 2


def test_pool_resizes_live(pool: Any) -> None:
    producer, ring, ds, sink = pool
    producer.resize(3)
    assert producer.size == 3
    _submit_all(producer)
    producer.resize(1)  # the retiring workers finish what they hold first
    assert producer.size == 1
    sink.wait(len(BATCHES))
    _submit_all(producer, first_seq=len(BATCHES))
    sink.wait(2 * len(BATCHES))
    _check_slots(ring, ds, sink, first_seq=len(BATCHES))
    with pytest.raises(ValueError, match="the engine swaps it for 0"):
        producer.resize(0)
