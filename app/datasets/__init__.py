"""Dataset kinds: one module each, built from ``{kind, params}``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pinfeed_server.datasets import images, npy, python, synthetic, tensors
from pinfeed_server.datasets.base import BatchFetcher, DatasetContext, DatasetError, MapDataset

KINDS: dict[str, Callable[[dict[str, Any], DatasetContext], Any]] = {
    "synthetic": synthetic.build,
    "tensors": tensors.build,
    "npy": npy.build,
    "python": python.build,
    "images": images.build,
}


def build_dataset(kind: str, params: dict[str, Any], ctx: DatasetContext) -> Any:
    try:
        builder = KINDS[kind]
    except KeyError:
        raise DatasetError(f"unknown dataset kind {kind!r}; one of {sorted(KINDS)}") from None
    return builder(params, ctx)


__all__ = ["KINDS", "BatchFetcher", "DatasetContext", "DatasetError", "MapDataset", "build_dataset"]
