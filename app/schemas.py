"""Request and response models: ``XCreate`` in, ``XPublic`` out, ``Problem`` for errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
Name = Field(
    pattern=NAME_PATTERN,
    description="letters, digits, '.', '_' and '-'; 1-63 chars",
    examples=["demo"],
)

DatasetKind = Literal["synthetic", "tensors", "npy", "python", "images"]
LoaderState = Literal["starting", "ready", "failed", "draining", "closed"]

DEMO_PARAMS: dict[str, Any] = {
    "length": 100,
    "seed": 0,
    "fields": [
        {"shape": [3, 64, 64], "dtype": "int64", "low": 0, "high": 10},
        {"shape": [], "dtype": "int64", "low": 0, "high": 2},
    ],
}
DEMO_BATCH: list[Any] = [{"dtype": "int64", "shape": [3, 64, 64]}, {"dtype": "int64", "shape": []}]


class DatasetCreate(BaseModel):
    """A dataset: a kind and its parameters. File paths are relative to the data root."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"name": "demo", "kind": "synthetic", "params": DEMO_PARAMS},
                {
                    "name": "imagenet-val",
                    "kind": "npy",
                    "params": {"paths": {"image": "val_x.npy", "label": "val_y.npy"}},
                },
                {"name": "mnist", "kind": "tensors", "params": {"path": "mnist.safetensors"}},
            ]
        },
    )
    name: str = Name
    kind: DatasetKind = Field(description="synthetic, tensors (.pt/.safetensors), npy, python")
    params: dict[str, Any] = Field(default_factory=dict, description="kind-specific parameters")


class DatasetPublic(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "demo",
                    "kind": "synthetic",
                    "params": DEMO_PARAMS,
                    "length": 100,
                    "sample": DEMO_BATCH,
                    "error": None,
                    "created_at": 1767225600.0,
                }
            ]
        }
    )
    name: str
    kind: DatasetKind
    params: dict[str, Any]
    length: int | None = Field(None, description="samples (null if the dataset cannot open)")
    sample: Any = Field(None, description="one sample's structure with shapes and dtypes")
    error: str | None = Field(None, description="why the dataset cannot open, if it cannot")
    created_at: float = Field(description="Unix time")


class LoaderCreate(BaseModel):
    """DataLoader's arguments, with DataLoader's defaults."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "demo",
                    "dataset": "demo",
                    "batch_size": 10,
                    "shuffle": True,
                    "seed": 0,
                    "num_workers": 2,
                    "pin_memory": True,
                }
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
    num_workers: int = Field(0, ge=0, le=256, description="0: batches are built in the server")
    pin_memory: bool = False
    prefetch_factor: int = Field(
        2,
        ge=1,
        le=1024,
        description="batches made ahead: num_workers * prefetch_factor (1 with no workers)",
    )
    rank: int = Field(0, ge=0, description="this loader's rank (DistributedSampler semantics)")
    world_size: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="shard like DistributedSampler(num_replicas=world_size, rank=rank); "
        "null: no sharding (RandomSampler/SequentialSampler semantics)",
    )
    group_size: int = Field(
        1, ge=1, le=1024, description="trainer processes that attach to this loader as a group"
    )
    group_mode: Literal["broadcast", "split"] = Field(
        "broadcast",
        description="broadcast: every member gets every batch from one shared slot; "
        "split: member i gets batches i, i+group_size, ... of each epoch",
    )
    group_timeout_s: float = Field(
        300.0, gt=0, le=86400, description="how long a group waits for a member that left"
    )
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="a sample that raises: raise in the trainer, or skip its batch"
    )

    @model_validator(mode="after")
    def _rank_in_world(self) -> LoaderCreate:
        if self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if self.world_size is None and self.rank != 0:
            raise ValueError("rank needs world_size")
        return self


class LoaderPatch(BaseModel):
    """The knobs that change live, without losing position or any batch."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"num_workers": 4, "prefetch_factor": 2}]}
    )
    num_workers: int | None = Field(None, ge=1, le=256)
    prefetch_factor: int | None = Field(None, ge=1, le=1024)


class SlotCounts(BaseModel):
    """Ring slots by state: free -> filling -> ready -> leased -> free."""

    free: int
    filling: int
    ready: int
    leased: int
    total: int


class MemberPublic(BaseModel):
    member: int
    attached: bool
    position: list[int] = Field(description="[epoch, index] of the member's next batch")
    cuda_registered: bool


class LoaderPublic(BaseModel):
    """A loader's config and live status."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "demo",
                    "dataset": "demo",
                    "batch_size": 10,
                    "shuffle": True,
                    "seed": 0,
                    "drop_last": False,
                    "num_workers": 2,
                    "pin_memory": True,
                    "prefetch_factor": 2,
                    "created_at": 1767225600.0,
                    "state": "ready",
                    "failure": None,
                    "batches_per_epoch": 10,
                    "ring_bytes": 3932672,
                    "slot_bytes": 983168,
                    "slots": {"free": 0, "filling": 1, "ready": 2, "leased": 1, "total": 4},
                    "page_locked": True,
                    "consumer_attached": True,
                    "consumer_cuda_registered": True,
                    "epoch": 3,
                    "position": 7,
                    "worker_restarts": 0,
                    "batch": DEMO_BATCH,
                }
            ]
        }
    )
    name: str
    dataset: str
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    num_workers: int
    pin_memory: bool
    prefetch_factor: int
    rank: int = 0
    world_size: int | None = None
    group_size: int = 1
    group_mode: Literal["broadcast", "split"] = "broadcast"
    group_timeout_s: float = 300.0
    on_error: Literal["raise", "skip"] = "raise"
    created_at: float = Field(description="Unix time")
    state: LoaderState
    failure: dict[str, Any] | None = Field(None, description="why the loader failed, if it did")
    batches_per_epoch: int
    ring_bytes: int
    slot_bytes: int
    slots: SlotCounts
    page_locked: bool = Field(description="the ring is mlock'ed (page-locked) in the server")
    consumer_attached: bool
    consumer_cuda_registered: bool = Field(description="the consumer registered the ring with CUDA")
    epoch: int = Field(description="epoch of the next batch handed to the consumer")
    position: int = Field(description="index in its epoch of the next batch")
    worker_restarts: int
    members: list[MemberPublic] = Field(
        default_factory=list, description="consumer group members (one for a plain loader)"
    )
    batch: Any = Field(None, description="one batch's structure with shapes and dtypes")


class LoaderStatsPublic(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "demo",
                    "batches_produced": 1204,
                    "batches_consumed": 1200,
                    "samples_consumed": 12000,
                    "errors": 0,
                    "samples_per_s": 2410.5,
                    "bytes_per_s": 236970000.0,
                    "samples_per_s_total": 2398.1,
                    "bytes_per_s_total": 235790000.0,
                    "consumer_wait_p50_s": 0.00004,
                    "consumer_wait_p99_s": 0.0021,
                    "consumer_wait_share": 0.02,
                    "worker_busy_share": 0.61,
                    "uptime_s": 5.0,
                }
            ]
        }
    )
    name: str
    batches_produced: int
    batches_consumed: int
    samples_consumed: int
    errors: int = Field(description="batches that failed (a sample raised)")
    skipped: int = Field(0, description="of those, batches skipped (on_error: skip)")
    samples_per_s: float = Field(description="consumed, over the last 10 s")
    bytes_per_s: float = Field(description="consumed, over the last 10 s")
    samples_per_s_total: float = Field(description="consumed, since the loader started")
    bytes_per_s_total: float = Field(description="consumed, since the loader started")
    consumer_wait_p50_s: float | None = Field(description="median wait for one batch")
    consumer_wait_p99_s: float | None
    consumer_wait_share: float = Field(
        description="share of the last 10 s the trainers spent blocked waiting for batches "
        "(measured in the trainers): near 1 = training is input-bound"
    )
    consumer_wait_share_total: float = Field(
        0.0, description="the same share since trainers started asking"
    )
    worker_busy_share: float = Field(description="share of worker time spent building batches")
    uptime_s: float


class Health(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})
    status: Literal["ok"]


class ValidationIssue(BaseModel):
    loc: list[str | int] = Field(description="where: 'body', then field names and indexes")
    msg: str
    type: str


class Problem(BaseModel):
    """An error (RFC 9457). ``type`` is stable: ``urn:pinfeed:problem:<slug>``."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "type": "urn:pinfeed:problem:not-found",
                    "title": "Not found",
                    "status": 404,
                    "detail": "no loader named 'demo'",
                    "instance": "/v1/loaders/demo",
                }
            ]
        },
    )
    type: str = Field(pattern=r"^urn:pinfeed:problem:[a-z-]+$")
    title: str
    status: int
    detail: str
    instance: str = Field(description="the request path")
    errors: list[ValidationIssue] | None = Field(None, description="invalid-request: each issue")
    need_bytes: int | None = Field(None, description="insufficient-memory: the ring's size")
    free_bytes: int | None = Field(None, description="insufficient-memory: budget left")
    loaders: list[str] | None = Field(None, description="not-ready: loaders still starting")
