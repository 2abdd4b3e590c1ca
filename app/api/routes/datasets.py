from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status

from app.api.deps import ServiceDep
from app.schemas import DatasetCreate, DatasetPublic

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

PROBLEMS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no such dataset", "content": {"application/problem+json": {}}},
    409: {"description": "exists, or in use", "content": {"application/problem+json": {}}},
    422: {"description": "invalid body or params", "content": {"application/problem+json": {}}},
}


@router.post("", response_model=DatasetPublic, status_code=status.HTTP_201_CREATED,
             responses=PROBLEMS)
def create_dataset(body: DatasetCreate, service: ServiceDep, response: Response) -> Any:
    """Register a dataset; its files are opened now, so a bad path fails here."""
    response.headers["Location"] = f"/v1/datasets/{body.name}"
    return service.create_dataset(body)


@router.get("", response_model=list[DatasetPublic])
def list_datasets(service: ServiceDep) -> Any:
    return service.list_datasets()


@router.get("/{name}", response_model=DatasetPublic, responses=PROBLEMS)
def get_dataset(name: str, service: ServiceDep) -> Any:
    return service.describe_dataset(name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
def delete_dataset(name: str, service: ServiceDep) -> Response:
    service.delete_dataset(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
