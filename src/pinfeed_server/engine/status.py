"""A loader's live status, declared once: what ``LoaderEngine.status()`` reports for a
running loader and ``LoaderStatus.unstarted()`` for one that could not start (the
response model ``schemas.LoaderPublic`` is the config plus these fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pinfeed.errors import LoaderFailed

LoaderState = Literal["starting", "ready", "failed", "draining", "closed"]


class SlotCounts(BaseModel):
    """Ring slots by state: free -> filling -> ready -> leased -> free."""

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
    state: LoaderState
    failure: dict[str, Any] | None = Field(None, description="why the loader failed, if it did")
    batches_per_epoch: int | None = Field(
        description="len(DataLoader): batches per epoch; null for an IterableDataset "
        "without __len__"
    )
    ring_bytes: int = Field(description="bytes of all the ring's segments")
    ring_segments: int = Field(
        1, description="memfd segments of the ring: 1 as created, more after a PATCH grew it"
    )
    slot_bytes: int
    slots: SlotCounts
    page_locked: bool = Field(description="the ring is mlock'ed (page-locked) in the server")
    consumer_attached: bool
    consumer_cuda_registered: bool = Field(description="the consumer registered the ring with CUDA")
    epoch: int = Field(description="epoch of the next batch handed to the consumer")
    position: int = Field(description="index in its epoch of the next batch")
    worker_restarts: int
    members: list[MemberStatus] = Field(
        default_factory=list, description="consumer group members (one for a plain loader)"
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
