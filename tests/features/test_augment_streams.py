"""``seeding.Streams`` and ``apply``, in-process: which batches come with a reseed,
what a reseed replays (or restores from a snapshot), and that replaying reaches the
RNG state DataLoader's worker has, compared with a real DataLoader worker's draws."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from pinfeed.rng import capture, dump_state, restore
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.seeding import (
    BaseSeeds,
    PlannedHistory,
    Reseed,
    Streams,
    apply,
)
from tests.fixtures.datasets import Augmented

LENGTH, BATCH = 22, 3  # 8 batches per epoch


def _config(**kw: Any) -> LoaderConfig:
    base = {"name": "s", "dataset": "d", "batch_size": BATCH, "shuffle": True, "seed": 11}
    return LoaderConfig.model_validate({**base, **kw})


def _planned(config: LoaderConfig) -> Streams:
    return Streams(config, 2, PlannedHistory(config, 2, range(LENGTH)), replay=True)


def test_base_seeds_are_dataloaders() -> None:
    seeds = BaseSeeds(_config(num_workers=1), 1, LENGTH)
    gen = torch.Generator().manual_seed(11)
    dl = DataLoader(range(LENGTH), batch_size=BATCH, shuffle=True, generator=gen)
    for epoch in range(3):
        it = iter(dl)
        list(it)
        assert seeds(epoch) == it._base_seed, epoch  # DataLoader's own draw
    # Persistent workers: one draw, kept by the one iterator DataLoader keeps.
    seeds = BaseSeeds(_config(num_workers=1, persistent_workers=True), 1, LENGTH)
    gen = torch.Generator().manual_seed(11)
    dl = DataLoader(
        range(LENGTH), batch_size=BATCH, shuffle=True, generator=gen, num_workers=1,
        persistent_workers=True,
    )  # fmt: skip
    for epoch in range(2):
        list(dl)
        assert seeds(epoch) == dl._iterator._base_seed, epoch  # type: ignore[union-attr]


def test_in_sequence_tasks_need_no_reseed() -> None:
    streams = _planned(_config(num_workers=2))
    reseeds = [streams.prepare(0, i, i) for i in range(8)]
    assert [r is not None for r in reseeds] == [True, True] + [False] * 6
    assert reseeds[1] is not None and reseeds[1].worker_id == 1 and reseeds[1].replay == []
    # A non-persistent epoch starts afresh; a persistent one carries on.
    assert streams.prepare(1, 0, 0) is not None
    persistent = _planned(_config(num_workers=2, persistent_workers=True))
    for i in range(8):
        persistent.prepare(0, i, i)
    assert persistent.prepare(1, 0, 0) is None


def test_a_new_worker_replays_or_restores_its_snapshot() -> None:
    streams = _planned(_config(num_workers=2))
    for i in range(6):
        streams.prepare(0, i, i)
    streams.forget(1)  # worker 1 replaced before batch 5 came back
    reseed = streams.prepare(0, 5, 5)
    assert reseed is not None and len(reseed.replay) == 2 and reseed.state is None  # 1, 3
    streams.snapshot(0, 5, b"state-before-7", 5)
    streams.forget(1)
    reseed = streams.prepare(0, 7, 7)
    assert reseed is not None and reseed.replay == [] and reseed.state == b"state-before-7"
    # Persistent: a resume at epoch 1 on a new server replays epoch 0 too.
    persistent = _planned(_config(num_workers=2, persistent_workers=True))
    reseed = persistent.prepare(1, 3, 3)
    assert reseed is not None and len(reseed.replay) == 4 + 1  # 1, 3, 5, 7; then 1


def test_replay_reaches_dataloaders_worker_state() -> None:
    """Worker 1 of 2 after replaying batches 1 and 3 draws what DataLoader's worker 1
    draws for batch 5, and a snapshot restored gives the same."""
    config = _config(num_workers=2)
    gen = torch.Generator().manual_seed(11)
    dl = DataLoader(Augmented(), batch_size=BATCH, shuffle=True, generator=gen, num_workers=2)
    want = list(dl)[5]
    streams = _planned(config)
    batches = list(streams.history.batches(0))
    saved = capture()
    try:
        reseed = Reseed(1, 2, streams.base_seed(0), [batches[1], batches[3]])
        ds = Augmented()
        apply(reseed, ds)
        snapshot = dump_state()
        got = torch.utils.data.default_collate([ds[i] for i in batches[5]])
        apply(Reseed(1, 2, streams.base_seed(0), [], snapshot), ds)
        again = torch.utils.data.default_collate([ds[i] for i in batches[5]])
    finally:
        restore(saved)
        torch.utils.data._utils.worker._worker_info = None
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)
