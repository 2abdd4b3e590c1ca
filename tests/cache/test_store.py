"""The store's rules, with real processes mapping one region: two processes missing the
same sample read it from the dataset once and store it once; a process killed while
storing leaves that entry empty and its lock free; counts add up over processes; a
cache smaller than the dataset keeps a fixed subset, hit on from the second epoch."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pinfeed_server.cache import CacheSpec, build, check, reservation
from pinfeed_server.cache.dataset import CachedDataset
from pinfeed_server.cache.region import Layout
from pinfeed_server.datasets import DatasetContext
from tests.fixtures.datasets import CountedReads, Pairs, Stuck
from tests.reliability.procs import wait_for


def _cached(tmp_path: Path, ds: Any, max_bytes: int | None = None) -> CachedDataset:
    spec = CacheSpec(max_bytes=max_bytes)
    nbytes = reservation(spec, check("t", ds), len(ds))
    source = ("python", {"factory": "x:y"}, DatasetContext(tmp_path))
    return build("t", ds, spec, source, nbytes, tmp_path / "cache", ship_base=True)


def _read_all(dataset: CachedDataset, out: Any, start: Any = None) -> None:
    if start is not None:
        start.wait(60)  # every process reads sample 0 at once (spawn's start-up varies)
    for i in range(len(dataset)):
        x, label = dataset[i]
        assert label == i and torch.equal(x, torch.full((64,), i, dtype=torch.int32))
    out.put("ok")


def _reads(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


@pytest.mark.slow
def test_two_processes_missing_a_sample_store_it_once(tmp_path: Path) -> None:
    log = tmp_path / "reads"
    cached = _cached(tmp_path, CountedReads(str(log), 16))
    log.unlink()  # the check's reads
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(3)
    procs = [ctx.Process(target=_read_all, args=(cached, out, start)) for _ in range(3)]
    for p in procs:
        p.start()
    assert [out.get(timeout=120) for _ in procs] == ["ok"] * 3
    for p in procs:
        p.join(30)
    assert sorted(_reads(log)) == list(range(16))  # each sample read from the dataset once
    totals = cached.cache.stats()
    assert (totals.misses, totals.hits, totals.samples) == (16, 32, 16)
    assert totals.waits > 0  # they did collide: someone waited for another's store
    cached.cache.close()


def _read_zero(dataset: CachedDataset) -> None:
    dataset[0]


def test_a_process_killed_while_storing_leaves_the_entry_empty(tmp_path: Path) -> None:
    log = tmp_path / "reads"
    cached = _cached(tmp_path, Stuck(str(log), 4, 0.0))
    log.unlink()
    Path(str(log) + ".arm").touch()
    proc = mp.get_context("spawn").Process(target=_read_zero, args=(cached,))
    proc.start()
    wait_for(lambda: 0 in _reads(log), "the child to hold sample 0's lock", timeout=60)
    proc.kill()
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert cached.cache.samples() == 0
    Path(str(log) + ".go").touch()
    t0 = time.monotonic()
    _, label = cached[0]  # the killed holder's lock went with it: no wait
    assert time.monotonic() - t0 < 5 and label == 0
    assert cached.cache.samples() == 1
    cached.cache.close()


def test_a_small_cache_keeps_a_fixed_subset(tmp_path: Path) -> None:
    ds = Pairs(400, 1024)  # 4 KiB records
    record = check("t", ds).sizes[0]
    size = Layout(len(ds), len(ds) * record).total  # the whole dataset in a cache
    cached = _cached(tmp_path, ds, max_bytes=size * 3 // 10)
    gen = torch.Generator().manual_seed(0)
    kept: list[int] = []
    for epoch in range(3):
        before = cached.cache.stats()
        for i in torch.randperm(len(ds), generator=gen).tolist():
            x, label = cached[i]
            assert label == i and torch.equal(x, ds[i][0])
        after = cached.cache.stats()
        kept.append(after.samples)
        ratio = (after.hits - before.hits) / len(ds)
        if epoch:
            assert abs(ratio - 0.3) < 0.05, (epoch, ratio)
    assert kept[0] == kept[1] == kept[2]  # nothing evicted, nothing added after epoch 1
    assert cached.cache.used_bytes() <= size * 3 // 10
    cached.cache.close()
