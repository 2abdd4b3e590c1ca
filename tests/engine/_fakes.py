"""In-process helpers for the engine unit tests: a small dataset, a result sink, the
expected batch (DataLoader's default_collate) and a reader of ring slots."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from pinfeed_server.datasets import KINDS, DatasetContext, build_dataset
from pinfeed_server.engine.collate import Layout, leaf_views, probe
from pinfeed_server.engine.config import LoaderCode, LoaderConfig, make_sampler
from pinfeed_server.engine.producers import ProducerContext, Result
from pinfeed_server.engine.ring import Ring

PARAMS: dict[str, Any] = {
    "length": 10,
    "seed": 1,
    "fields": [{"shape": [3], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 9}],
}


def dataset(tmp_path: Path) -> Any:
    return build_dataset("synthetic", PARAMS, DatasetContext(tmp_path))


def config(**fields: Any) -> LoaderConfig:
    return LoaderConfig(**{"name": "t", "dataset": "d", "batch_size": 3, "seed": 0, **fields})


class Sink:
    """A fake consumer of a producer's results."""

    def __init__(self) -> None:
        self.results: dict[int, Result] = {}
        self.fatal: list[str] = []
        self._cond = threading.Condition()

    def on_result(self, result: Result) -> None:
        with self._cond:
            self.results[result.seq] = result
            self._cond.notify_all()

    def on_fatal(self, detail: str) -> None:
        self.fatal.append(detail)

    def wait(self, count: int, timeout: float = 90.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.results) >= count, timeout), (
                f"{len(self.results)} of {count} results"
            )


def context(
    tmp_path: Path, ring: Ring, sink: Sink, ds: Any, layout: Layout, **fields: Any
) -> ProducerContext:
    cfg = config(**fields)
    return ProducerContext(
        cfg,
        cfg.num_workers,
        cfg.num_workers,
        KINDS["synthetic"],
        PARAMS,
        DatasetContext(tmp_path),
        ds,
        make_sampler(cfg, ds, streams=cfg.num_workers),
        LoaderCode.resolve(cfg, ("tests.fixtures",)),
        layout,
        ring,
        sink.on_result,
        sink.on_fatal,
        lambda: None,
    )


def layout_of(ds: Any, batch_size: int = 3) -> Layout:
    return probe(ds[0], batch_size)


def slot_batch(ring: Ring, layout: Layout, slot: int, rows: int) -> list[torch.Tensor]:
    start = slot * ring.slot_bytes
    views = leaf_views(layout, ring.base[start : start + ring.slot_bytes], rows)
    return [v.clone() for v in views if v is not None]


def expected(ds: Any, indices: list[int]) -> list[torch.Tensor]:
    return list(default_collate([ds[i] for i in indices]))


def assert_batch(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
