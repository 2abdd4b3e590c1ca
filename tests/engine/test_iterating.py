"""The iterable path's pieces without a server: the END judgement and the streams'
fast-forward (``engine/iterable.py``, ``producers/iterating.py``)."""

from __future__ import annotations

import random

import torch

from pinfeed.rng import capture, restore
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.iterable import EndJudge, IterablePlan
from pinfeed_server.engine.producers.iterating import IterStreams
from tests.fixtures.iterables import Shards, Stateful, Unsized


def test_end_comes_after_every_streams_last_batch() -> None:
    """Stream 1 runs out at turn 9 and says so first; stream 0's "ran out" at turn 6
    then completes the set, but turn 7 (stream 1's) still has a batch: not the END.
    The first report after both, at a turn past 9, is."""
    judge = EndJudge(2)
    assert not judge.ran_out(0, 9)
    assert not judge.ran_out(0, 6)
    assert not judge.ran_out(0, 8)
    assert judge.ran_out(0, 10)
    assert judge.ran_out(0, 11)
    assert not judge.ran_out(1, 1)  # a new epoch starts from nothing


def _config(**kw: object) -> LoaderConfig:
    return LoaderConfig.model_validate({"name": "t", "dataset": "d", "batch_size": 3, **kw})


def _turns(streams: IterStreams, epoch: int, turns: range) -> list[object]:
    out: list[object] = []
    server = capture()
    try:
        for t in turns:
            batch = streams.fetch(epoch, t)
            out.append(None if batch is None else [s[1] for s in batch])
    finally:
        streams.park()
        restore(server)
    return out


def test_fast_forward_reaches_any_turn() -> None:
    """Random access (backwards, forwards, across epochs) gives what a sequential run
    gives, for plain and persistent streams."""
    for persistent in (False, True):
        cfg = _config(seed=3, num_workers=2, persistent_workers=persistent)
        sequential = [
            _turns(IterStreams(Shards(), cfg, cfg.num_workers, worker=False), e, range(14))
            for e in (0, 1)
        ]
        streams = IterStreams(Shards(), cfg, cfg.num_workers, worker=False)
        for epoch, t in [(1, 7), (0, 3), (0, 12), (1, 2), (0, 0), (1, 13)]:
            got = _turns(streams, epoch, range(t, t + 1))[0]
            want = sequential[epoch][t]
            assert (got is None) == (want is None), (persistent, epoch, t)
            if got is not None:
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert streams.fast_forwarded > 0


def test_a_stateful_dataset_goes_back_through_its_state() -> None:
    cfg = _config(seed=5)
    sequential = _turns(IterStreams(Stateful(), cfg, cfg.num_workers, worker=False), 0, range(10))
    streams = IterStreams(Stateful(), cfg, cfg.num_workers, worker=False)
    _turns(streams, 0, range(8))
    before = random.getstate()
    assert _turns(streams, 0, range(4, 10)) == sequential[4:]
    assert random.getstate() == before  # the caller's RNG is untouched
    assert streams.restored == 1 and streams.fast_forwarded == 0


def test_len_is_dataloaders_arithmetic() -> None:
    assert len(IterablePlan(Shards(), 3, drop_last=False)) == 10  # ceil(28 / 3)
    assert IterablePlan(Shards(), 3, drop_last=True).reported == 9
    assert IterablePlan(Unsized(), 3, drop_last=False).reported is None
