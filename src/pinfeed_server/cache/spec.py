"""What a dataset's registration asks of its cache (``POST /v1/datasets``' ``cache``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CacheSpec(BaseModel):
    """Keep the dataset's samples, as ``dataset[i]`` returns them, once per node."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"max_bytes": 8 << 30, "persist": True}]}
    )
    max_bytes: int | None = Field(
        None,
        ge=0,
        le=1 << 50,
        description="the most memory the cache takes, its index included (counted against "
        "PINFEED_MAX_SHM_BYTES and PINFEED_CACHE_MAX_BYTES from registration on); smaller "
        "than the dataset, a fixed subset is kept. null: the whole dataset, as estimated "
        "from a few samples",
    )
    persist: bool = Field(
        False,
        description="also keep it in a file under PINFEED_CACHE_DIR (memory-mapped, "
        "checksummed) that the next server serves from, if the dataset is unchanged",
    )
