"""Request and response models: ``XCreate`` in, ``XPublic`` out, ``Problem`` for errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, create_model

from pinfeed._autostart import StartedBy
from pinfeed_server.cache import CacheSpec, CacheStats
from pinfeed_server.datasets import KINDS, Kind
from pinfeed_server.datasets.base import Params
from pinfeed_server.engine.config import LIVE, LoaderConfig, LoaderFields, Name
from pinfeed_server.engine.stats import StatsSnapshot
from pinfeed_server.engine.status import LoaderStatus

DEMO_PARAMS: dict[str, Any] = {
    "length": 100,
    "seed": 0,
    "fields": [
        {"shape": [3, 64, 64], "dtype": "int64", "low": 0, "high": 10},
        {"shape": [], "dtype": "int64", "low": 0, "high": 2},
    ],
}
DEMO_BATCH: list[Any] = [{"dtype": "int64", "shape": [3, 64, 64]}, {"dtype": "int64", "shape": []}]


class _DatasetCreateBase(BaseModel):
    """A dataset: a kind and its parameters. File paths are relative to the data root."""

    model_config = ConfigDict(extra="forbid")
    name: str = Name
    kind: str
    params: Params
    cache: CacheSpec | None = Field(
        None,
        description="keep the samples once per node, shared by every loader of the "
        "dataset (map-style kinds; the dataset must return the same sample on every "
        "read): null, no cache",
    )


def _literal(*values: str) -> Any:
    """``Literal[values]`` for values known only at run time (the registered kinds)."""
    return Literal.__getitem__(values)


def _create_model(kind: Kind[Any]) -> type[_DatasetCreateBase]:
    """``{name, kind: <kind>, params: <the kind's params model>}``."""
    optional = not any(f.is_required() for f in kind.params.model_fields.values())
    params = Field(default_factory=kind.params) if optional else Field()
    model: type[_DatasetCreateBase] = create_model(
        "DatasetCreate" + kind.name.title().replace("_", ""),
        __base__=_DatasetCreateBase,
        __doc__=kind.summary,
        kind=(_literal(kind.name), Field(description=kind.summary)),
        params=(kind.params, params),
    )
    return model


if TYPE_CHECKING:
    DatasetCreateBody = _DatasetCreateBase
    DatasetKind = str
else:
    DatasetKind = _literal(*KINDS)
    DatasetCreateBody = Annotated[
        Union[tuple(_create_model(k) for k in KINDS.values())],  # noqa: UP007
        Field(discriminator="kind"),
    ]


class DatasetCreate(RootModel[DatasetCreateBody]):
    """A dataset: a kind and its parameters (one schema per kind, chosen by ``kind``).
    File paths are relative to the data root."""

    model_config = ConfigDict(
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

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def kind(self) -> str:
        return self.root.kind

    @property
    def params(self) -> dict[str, Any]:
        """The params as given (defaults not filled in), for the registry."""
        params: dict[str, Any] = self.root.params.model_dump(mode="json", exclude_unset=True)
        return params

    @property
    def cache(self) -> CacheSpec | None:
        return self.root.cache


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
    cache: CacheStats | None = Field(None, description="its sample cache, if it has one")


class LoaderCreate(LoaderFields):
    """DataLoader's arguments, with DataLoader's defaults."""

    model_config = ConfigDict(
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


def live_patch() -> type[BaseModel]:
    """The PATCH body: each field of ``LIVE`` as ``LoaderFields`` bounds it, optional
    (null or left out: unchanged; ``autotune`` null: off) and strict where it is a
    number or a flag (JSON false is not 0 workers), described as ``LIVE`` says."""
    fields: dict[str, Any] = {}
    for name, description in LIVE.items():
        field = LoaderFields.model_fields[name]
        scalar = field.annotation in (int, float, bool, str)
        bounded: Any = field.annotation
        if field.metadata:  # its bounds (ge, le)
            bounded = Annotated[bounded, *field.metadata]
        fields[name] = (bounded | None, Field(None, strict=scalar or None, description=description))
    model: type[BaseModel] = create_model(
        "LoaderPatch",
        __config__=ConfigDict(
            extra="forbid",
            json_schema_extra={"examples": [{"num_workers": 4, "prefetch_factor": 2}]},
        ),
        __doc__="The knobs that change live, without losing position or any batch.",
        **fields,
    )
    return model


if TYPE_CHECKING:
    LoaderPatch = BaseModel
else:
    LoaderPatch = live_patch()


class LoaderOwner(BaseModel):
    """The trainer process a ``pinfeed.DataLoader`` loader belongs to."""

    pid: int
    uid: int
    attached: bool = Field(description="its trainer is connected")
    keep: bool = Field(description="named: stays warm for the next trainer asking for it")
    cache: str | None = Field(
        None,
        description="the node cache its dataset is read through (pinfeed.DataLoader's "
        "cache=), as /metrics names it: ~name (shared by every loader naming it) or "
        "~own-<loader>; null: none",
    )


class LoaderPublic(LoaderStatus, LoaderConfig):
    """A loader's config and live status."""

    model_config = ConfigDict(
        json_schema_serialization_defaults_required=True,
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
        },
    )
    created_at: float = Field(description="Unix time")
    batch: Any = Field(None, description="one batch's structure with shapes and dtypes")
    owner: LoaderOwner | None = Field(
        None,
        description="the trainer whose pinfeed.DataLoader made this loader (its objects, "
        "its sampler); null: a loader made over HTTP",
    )


class BatchPublic(BaseModel):
    """One batch of a loader: the samples it is made of, and who makes it."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "loader": "train-0",
                    "epoch": 3,
                    "index": 7,
                    "indices": [4511, 80, 2093, 7],
                    "rank": 0,
                    "world_size": 4,
                    "worker": 1,
                    "elastic": False,
                }
            ]
        }
    )
    loader: str
    epoch: int
    index: int = Field(description="the batch's index in its epoch (0-based)")
    indices: list[int] = Field(description="its samples' dataset indices, in batch order")
    rank: int = Field(description="the loader's rank (DistributedSampler semantics)")
    world_size: int | None
    worker: int | None = Field(
        description="DataLoader's worker id that makes it (index % num_workers as the "
        "loader was created); null: the main process (num_workers=0)"
    )
    elastic: bool = Field(description="the epoch is the rest of one resumed at another world size")


# The engine's StatsSnapshot as it is, named for the API and given its examples here:
# it declares no field of its own (no docstring either: it would become the schema's
# description).
class LoaderStatsPublic(StatsSnapshot):
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


class NodeLoader(BaseModel):
    """One loader as the node arbiter sees it (its last round: ``null`` before one)."""

    name: str
    priority: int
    min_workers: int
    workers: int = Field(description="worker processes now")
    max_workers: int = Field(description="autotune's max_workers; a fixed loader: its own")
    fixed: bool = Field(
        description="no autotune (or an executor off this node): its workers are fixed demand"
    )
    counts_workers: bool = Field(description="its processes take this node's CPUs")
    trainers: int = Field(description="trainers attached")
    wait_share: float | None = Field(description="its trainers' wait share over the last round")
    busy_share: float | None = Field(description="its workers' busy share over the last round")
    samples_per_s: float | None = Field(description="consumed over the last round")
    weighted_stall: float | None = Field(description="priority x wait share (0 without trainer)")


class NodeDecision(BaseModel):
    """One decision of the arbiter (``t``: seconds since the server started)."""

    t: float
    kind: Literal["grow", "move", "shrink", "prefetch", "keep", "undo", "room", "refused"]
    loader: str
    donor: str | None
    workers: dict[str, int] = Field(description="the workers of the loaders it changed, after")
    weighted_stall: float = Field(description="the node's weighted stall it was judged on")
    reason: str


class ArbiterPublic(BaseModel):
    enabled: bool = Field(description="PINFEED_ARBITER")
    interval_s: float = Field(description="PINFEED_ARBITER_INTERVAL_S")
    settled: bool = Field(description="its last round changed nothing and no trial is running")
    settled_after_s: float | None = Field(
        description="when its last kept change was (seconds since the server started)"
    )
    weighted_stall: float | None = Field(
        description="sum of priority x wait share over loaders with a trainer, last round"
    )
    trial: dict[str, Any] | None = Field(
        description="a change being measured ({kind, loader, donor})"
    )


class NodeLifetime(BaseModel):
    """How this server was started, and when it goes by itself."""

    started_by: StartedBy = Field(
        description="'serve': `pinfeed serve`; 'script': a script's pinfeed.DataLoader, which "
        "found no server on its socket (its registry is its own, in memory)"
    )
    idle_exit_s: float | None = Field(
        description="PINFEED_IDLE_EXIT_S: it exits this long after its last trainer left, "
        "and its loaders with it; null: it runs until stopped"
    )
    exits_in_s: float | None = Field(
        description="seconds left before it exits if no trainer connects; null while a "
        "trainer is connected, or without PINFEED_IDLE_EXIT_S"
    )


class NodePublic(BaseModel):
    """The node: its CPUs and budgets, every loader's workers and trainers' wait share,
    and the arbiter's last decisions (newest last)."""

    uptime_s: float = Field(description="seconds since the server started (decisions' clock)")
    lifetime: NodeLifetime
    cpus: int = Field(description="CPUs this server may use (its affinity)")
    max_workers: int = Field(description="PINFEED_MAX_WORKERS")
    workers_used: int = Field(description="worker processes of all loaders on this node")
    shm_budget_bytes: int
    shm_used_bytes: int
    arbiter: ArbiterPublic
    loaders: list[NodeLoader]
    decisions: list[NodeDecision]
    remote: dict[str, Any] | None = Field(
        None,
        description="datasets in an object store: the node's requests, bytes, retries and "
        "cache hits ('store'), its object cache ('cache'), each loader's ('loaders'); "
        "null until a remote dataset is read",
    )


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
