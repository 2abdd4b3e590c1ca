"""``CacheStats``: one snapshot of a dataset's cache, for every view of it (the dataset's
JSON, ``/metrics``, ``pinfeed datasets ls``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
    bytes: int = Field(description="memory in use: the records stored and the index")
    max_bytes: int = Field(description="the cache's budget, reserved from registration on")
    samples: int = Field(description="samples stored")
    hits: int = Field(description="reads served from the cache (this server's life)")
    misses: int = Field(description="reads from the dataset (a sample read once per node)")
    waits: int = Field(description="of the hits, reads that waited for another process storing it")
    corrupt: int = Field(description="stored records whose checksum failed: dropped, read again")
    hit_ratio: float | None = Field(description="hits / (hits + misses); null before any read")
    persisted: bool = Field(description="kept in a file under PINFEED_CACHE_DIR too")
    rebuilt: int = Field(description="times its file was found unusable and made again")
    rebuilt_reason: str | None = Field(
        description="why, the last time: stale, truncated, unreadable, resized"
    )
