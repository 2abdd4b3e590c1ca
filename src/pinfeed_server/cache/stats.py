"""``CacheStats``: one snapshot of a dataset's cache, for every view of it (the dataset's
JSON, ``/metrics``, ``pinfeed datasets ls``). The fields exported to Prometheus declare
their series (``pinfeed_server.metric``), labelled ``dataset``."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pinfeed_server.metric import Metric


class CacheStats(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "bytes": 786_432_000,
                    "max_bytes": 866_000_000,
                    "samples": 3000,
                    "hits": 6000,
                    "misses": 3000,
                    "waits": 12,
                    "corrupt": 0,
                    "hit_ratio": 0.667,
                    "persisted": True,
                    "rebuilt": 0,
                    "rebuilt_reason": None,
                }
            ]
        }
    )
    bytes: Annotated[
        int,
        Field(description="memory in use: the records stored and the index"),
        Metric("bytes", "gauge", "Memory the dataset's sample cache uses"),
    ]
    max_bytes: Annotated[
        int,
        Field(description="the cache's budget, reserved from registration on"),
        Metric("max_bytes", "gauge", "Memory the dataset's sample cache reserves"),
    ]
    samples: Annotated[
        int,
        Field(description="samples stored"),
        Metric("samples", "gauge", "Samples stored in the dataset's cache"),
    ]
    hits: Annotated[
        int,
        Field(description="reads served from the cache (this server's life)"),
        Metric("hits_total", "counter", "Reads served from the cache"),
    ]
    misses: Annotated[
        int,
        Field(description="reads from the dataset (a sample read once per node)"),
        Metric("misses_total", "counter", "Reads from the dataset itself"),
    ]
    waits: Annotated[
        int,
        Field(description="of the hits, reads that waited for another process storing it"),
        Metric("waits_total", "counter", "Hits that waited for another process to store"),
    ]
    corrupt: Annotated[
        int,
        Field(description="stored records whose checksum failed: dropped, read again"),
        Metric("corrupt_total", "counter", "Stored records that failed their checksum"),
    ]
    hit_ratio: float | None = Field(description="hits / (hits + misses); null before any read")
    persisted: Annotated[
        bool,
        Field(description="kept in a file under PINFEED_CACHE_DIR too"),
        Metric("persisted", "gauge", "1 if the cache is kept in a file too"),
    ]
    rebuilt: Annotated[
        int,
        Field(description="times its file was found unusable and made again"),
        Metric("rebuilt_total", "counter", "Times the cache's file was unusable and rebuilt"),
    ]
    rebuilt_reason: str | None = Field(
        description="why, the last time: stale, truncated, unreadable, resized"
    )
