"""A loader's live status, declared once: what ``LoaderEngine.status()`` reports for a
running loader and ``LoaderStatus.unstarted()`` for one that could not start (the
response model ``schemas.LoaderPublic`` is the config plus these fields; the fields
with a ``Metric`` are ``/metrics`` series, ``LoaderState`` and ``SlotCounts`` the values
of their ``state`` label)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from pinfeed.errors import LoaderFailed
from pinfeed_server.engine.mixture import SourceServed
from pinfeed_server.metric import Metric

LoaderState = Literal["starting", "ready", "failed", "draining", "closed"]


class SlotCounts(BaseModel):
    """Ring slots by state: free -> filling -> ready -> leased -> free; total: their sum."""

    free: int = 0
    filling: int = 0
    ready: int = 0
    leased: int = 0
    total: int = 0


class MemberStatus(BaseModel):
    member: int
    attached: bool
    position: list[int] = Field(description="[epoch, index] of the member's next batch")
    cuda_registered: bool


class LoaderStatus(BaseModel):
    state: Annotated[LoaderState, Metric("state", "gauge", "1 for the loader's current state")]
    failure: dict[str, Any] | None = Field(None, description="why the loader failed, if it did")
    batches_per_epoch: Annotated[
        int | None, Metric("batches_per_epoch", "gauge", "Batches in one epoch")
    ] = Field(
        description="len(DataLoader): batches per epoch; null for an IterableDataset "
        "without __len__"
    )
    ring_bytes: Annotated[
        int, Metric("ring_bytes", "gauge", "Size of the loader's shared-memory ring")
    ] = Field(description="bytes of all the ring's segments")
    ring_segments: int = Field(
        1, description="memfd segments of the ring: 1 as created, more after a PATCH grew it"
    )
    slot_bytes: int
    slots: Annotated[SlotCounts, Metric("slots", "gauge", "Ring slots by state")]
    page_locked: Annotated[
        bool, Metric("page_locked", "gauge", "1 if the ring is page-locked (mlock)")
    ] = Field(description="the ring is mlock'ed (page-locked) in the server")
    consumer_attached: Annotated[
        bool, Metric("consumer_attached", "gauge", "1 if a trainer is attached")
    ]
    consumer_cuda_registered: Annotated[
        bool,
        Metric(
            "consumer_cuda_registered", "gauge", "1 if the trainer registered the ring with CUDA"
        ),
    ] = Field(description="the consumer registered the ring with CUDA")
    epoch: Annotated[
        int, Metric("epoch", "gauge", "Epoch of the next batch handed to the consumer")
    ] = Field(description="epoch of the next batch handed to the consumer")
    position: Annotated[
        int, Metric("position", "gauge", "Index in its epoch of the next batch")
    ] = Field(description="index in its epoch of the next batch")
    worker_restarts: Annotated[
        int, Metric("worker_restarts_total", "counter", "Worker processes replaced after dying")
    ]
    members: list[MemberStatus] = Field(
        default_factory=list, description="consumer group members (one for a plain loader)"
    )
    sources: list[SourceServed] | None = Field(
        None, description="a mixture loader's sources: taken, tokens, share against weight"
    )

    @classmethod
    def unstarted(cls, detail: str) -> LoaderStatus:
        """A registered loader that could not start (after a restart: its dataset file
        gone, the budget lowered): failed, with nothing allocated."""
        return cls(
            state="failed",
            failure=LoaderFailed(detail).info().to_json(),
            batches_per_epoch=0,
            ring_bytes=0,
            ring_segments=0,
            slot_bytes=0,
            slots=SlotCounts(),
            page_locked=False,
            consumer_attached=False,
            consumer_cuda_registered=False,
            epoch=0,
            position=0,
            worker_restarts=0,
        )
