"""Dataset kinds: one module each, registered here once (``KINDS``).

A kind module declares ``KIND = Kind(name, ParamsModel, build, __doc__)``; the HTTP
schema of ``POST /v1/datasets`` (one ``params`` schema per kind) and
``build_dataset`` both read ``KINDS``. A new kind is a module and one line below.
"""

from __future__ import annotations

from typing import Any

from pinfeed_server.datasets import (
    hf,
    images,
    mixture,
    npy,
    parquet,
    python,
    synthetic,
    tensors,
    tokens,
    webdataset,
)
from pinfeed_server.datasets.base import (
    BatchFetcher,
    DatasetContext,
    DatasetError,
    Kind,
    MapDataset,
)

KINDS: dict[str, Kind[Any]] = {
    k.name: k
    for k in (
        synthetic.KIND,
        tensors.KIND,
        npy.KIND,
        python.KIND,
        images.KIND,
        tokens.KIND,
        parquet.KIND,
        hf.KIND,
        webdataset.KIND,
    )
}


def build_dataset(kind: str, params: dict[str, Any], ctx: DatasetContext) -> Any:
    try:
        spec = KINDS.get(kind) or BUILT_FOR_LOADERS[kind]
    except KeyError:
        raise DatasetError(f"unknown dataset kind {kind!r}; one of {sorted(KINDS)}") from None
    return spec(params, ctx)


# Kinds the service builds for a loader, never registered as a dataset: a mixture's
# sources (built again from their own kinds in a worker or a zygote).
MIXTURE = mixture.kind(build_dataset)
BUILT_FOR_LOADERS: dict[str, Kind[Any]] = {MIXTURE.name: MIXTURE}


__all__ = [
    "BUILT_FOR_LOADERS",
    "KINDS",
    "BatchFetcher",
    "DatasetContext",
    "DatasetError",
    "Kind",
    "MapDataset",
    "build_dataset",
]
