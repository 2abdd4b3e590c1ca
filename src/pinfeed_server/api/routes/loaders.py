from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

from pinfeed_server.api.deps import ServiceDep
from pinfeed_server.api.openapi import problems
from pinfeed_server.schemas import (
    BatchPublic,
    LoaderCreate,
    LoaderPatch,
    LoaderPublic,
    LoaderStatsPublic,
)

router = APIRouter(prefix="/v1/loaders", tags=["loaders"])

LoaderName = Annotated[str, Path(description="the loader's name", examples=["demo"])]


@router.post(
    "",
    response_model=LoaderPublic,
    status_code=status.HTTP_201_CREATED,
    responses=problems(
        404,
        409,
        422,
        507,
        d404="no such dataset",
        d409="a loader with this name exists, or its num_workers would take the server "
        "past PINFEED_MAX_WORKERS (worker-limit)",
        d422="invalid body, or the dataset's samples cannot be batched",
    ),
)
def create_loader(body: LoaderCreate, service: ServiceDep, response: Response) -> Any:
    """Create a loader; its ring is allocated and prefetch starts at once."""
    response.headers["Location"] = f"/v1/loaders/{body.name}"
    return service.create_loader(body)


@router.get("", response_model=list[LoaderPublic])
def list_loaders(service: ServiceDep) -> Any:
    """Every loader, by name, with its config and live status."""
    return service.list_loaders()


@router.get("/{name}", response_model=LoaderPublic, responses=problems(404))
def get_loader(name: LoaderName, service: ServiceDep) -> Any:
    """Config and live status: state, ring and slot counts, consumer, epoch and position."""
    return service.describe_loader(name)


@router.get("/{name}/stats", response_model=LoaderStatsPublic, responses=problems(404))
async def get_loader_stats(name: LoaderName, service: ServiceDep) -> Any:
    """Throughput, consumer wait (p50, p99 from the wait histogram's buckets, share: is
    training input-bound?), errors. Lock-free O(1) statistics, read on the event loop."""
    return service.loader_stats(name)


@router.get(
    "/{name}/batches/{epoch}/{index}",
    response_model=BatchPublic,
    responses=problems(
        404,
        409,
        d404="no such loader, or no such batch: outside the epoch, an IterableDataset's "
        "(no sample indices), a trainer-fed epoch no longer kept, or a shuffled epoch "
        "further from the one looked up last than a lookup draws",
        d409="the loader failed to start",
    ),
)
def get_batch(
    name: LoaderName,
    epoch: Annotated[int, Path(ge=0, lt=2**31, description="the epoch")],
    index: Annotated[int, Path(ge=0, description="the batch's index in its epoch")],
    service: ServiceDep,
) -> Any:
    """Which samples batch ``index`` of ``epoch`` holds (for a loss spike at step k),
    and the rank and DataLoader worker that make it; from the loader's config, seed and
    elastic record, so a past epoch, or one of a run before a server restart, answers
    the same. ``Loader.replay(epoch, index)`` in the trainer makes that very batch again.
    """
    return service.batch(name, epoch, index)


@router.patch(
    "/{name}",
    response_model=LoaderPublic,
    responses=problems(
        404,
        409,
        422,
        507,
        d409="more workers than PINFEED_MAX_WORKERS has free (worker-limit), or the "
        "loader failed to start",
        d507="the grown ring would exceed PINFEED_MAX_SHM_BYTES (need and free bytes)",
    ),
)
def patch_loader(name: LoaderName, body: LoaderPatch, service: ServiceDep) -> Any:
    """Change ``num_workers`` or ``prefetch_factor`` live (0 and >0 alike): position and
    batches are kept; the ring grows or shrinks to fit. ``autotune`` turns autotune on
    (null: off); explicit values alone turn it off.
    """
    return service.patch_loader(name, body)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=problems(404))
def delete_loader(name: LoaderName, service: ServiceDep) -> Response:
    """Stop the loader and free its ring; an attached trainer gets a clear error."""
    service.delete_loader(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
