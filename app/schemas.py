"""Request and response models: ``XCreate`` in, ``XPublic`` out."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
Name = Field(pattern=NAME_PATTERN, description="letters, digits, '.', '_' and '-'; 1-63 chars")

DatasetKind = Literal["synthetic", "tensors", "npy", "python"]


class DatasetCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "demo",
                    "kind": "synthetic",
                    "params": {
                        "length": 100,
                        "seed": 0,
                        "fields": [
                            {"shape": [3, 64, 64], "dtype": "int64", "low": 0, "high": 10},
                            {"shape": [], "dtype": "int64", "low": 0, "high": 2},
                        ],
                    },
                },
                {"name": "imagenet-val", "kind": "npy",
                 "params": {"paths": {"image": "val_x.npy", "label": "val_y.npy"}}},
            ]
        },
    )
    name: str = Name
    kind: DatasetKind
    params: dict[str, Any] = Field(default_factory=dict, description="kind-specific parameters")


class DatasetPublic(BaseModel):
    name: str
    kind: DatasetKind
    params: dict[str, Any]
    length: int | None = Field(None, description="samples (null if the dataset cannot open)")
    sample: Any = Field(None, description="one sample's structure with shapes and dtypes")
    error: str | None = Field(None, description="why the dataset cannot open, if it cannot")
    created_at: float


class LoaderCreate(BaseModel):
    """DataLoader's arguments, with DataLoader's defaults."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"name": "demo", "dataset": "demo", "batch_size": 10, "shuffle": True,
                 "seed": 0, "num_workers": 2, "pin_memory": True}
            ]
        },
    )
    name: str = Name
    dataset: str = Name
    batch_size: int = Field(1, ge=1, le=1 << 20)
    shuffle: bool = False
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="shuffle seed; the server picks one if null"
    )
    drop_last: bool = False
    num_workers: int = Field(0, ge=0, le=256)
    pin_memory: bool = False
    prefetch_factor: int = Field(2, ge=1, le=1024)


class SlotCounts(BaseModel):
    free: int
    filling: int
    ready: int
    leased: int
    total: int


class LoaderPublic(BaseModel):
    name: str
    dataset: str
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    num_workers: int
    pin_memory: bool
    prefetch_factor: int
    created_at: float
    state: Literal["starting", "ready", "failed", "draining", "closed"]
    failure: dict[str, Any] | None = None
    batches_per_epoch: int
    ring_bytes: int
    slot_bytes: int
    slots: SlotCounts
    page_locked: bool
    consumer_attached: bool
    consumer_cuda_registered: bool
    epoch: int
    position: int
    worker_restarts: int
    batch: Any = Field(None, description="one batch's structure with shapes and dtypes")


class LoaderStatsPublic(BaseModel):
    name: str
    batches_produced: int
    batches_consumed: int
    samples_consumed: int
    errors: int
    samples_per_s: float = Field(description="over the last 10 s")
    bytes_per_s: float = Field(description="over the last 10 s")
    samples_per_s_total: float
    bytes_per_s_total: float
    consumer_wait_p50_s: float | None
    consumer_wait_p99_s: float | None
    consumer_wait_share: float = Field(
        description="share of time the consumer waited for batches: near 1 = input-bound"
    )
    worker_busy_share: float
    uptime_s: float


class Health(BaseModel):
    status: Literal["ok"]
