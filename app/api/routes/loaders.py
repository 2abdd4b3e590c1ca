from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status

from app.api.deps import ServiceDep
from app.api.routes.datasets import PROBLEMS
from app.schemas import LoaderCreate, LoaderPublic, LoaderStatsPublic

router = APIRouter(prefix="/v1/loaders", tags=["loaders"])

LOADER_PROBLEMS = PROBLEMS | {
    507: {"description": "ring exceeds the memory budget",
          "content": {"application/problem+json": {}}},
}


@router.post("", response_model=LoaderPublic, status_code=status.HTTP_201_CREATED,
             responses=LOADER_PROBLEMS)
def create_loader(body: LoaderCreate, service: ServiceDep, response: Response) -> Any:
    """Create a loader; its ring is allocated and prefetch starts at once."""
    response.headers["Location"] = f"/v1/loaders/{body.name}"
    return service.create_loader(body)


@router.get("", response_model=list[LoaderPublic])
def list_loaders(service: ServiceDep) -> Any:
    return service.list_loaders()


@router.get("/{name}", response_model=LoaderPublic, responses=PROBLEMS)
def get_loader(name: str, service: ServiceDep) -> Any:
    return service.describe_loader(name)


@router.get("/{name}/stats", response_model=LoaderStatsPublic, responses=PROBLEMS)
def get_loader_stats(name: str, service: ServiceDep) -> Any:
    return service.loader_stats(name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
def delete_loader(name: str, service: ServiceDep) -> Response:
    """Stop the loader and free its ring; an attached trainer gets a clear error."""
    service.delete_loader(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
