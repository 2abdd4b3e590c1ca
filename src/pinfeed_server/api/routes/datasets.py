from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

from pinfeed_server.api.deps import ServiceDep
from pinfeed_server.api.openapi import problems
from pinfeed_server.schemas import DatasetCreate, DatasetPublic

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

DatasetName = Annotated[str, Path(description="the dataset's name", examples=["demo"])]


@router.post(
    "",
    response_model=DatasetPublic,
    status_code=status.HTTP_201_CREATED,
    responses=problems(
        409,
        422,
        507,
        d409="a dataset with this name exists",
        d422="invalid body, unknown kind, bad params, a file that is missing or outside "
        "the data root, or a cache over a dataset that is not map-style or not "
        "deterministic (the detail names what moved)",
        d507="its cache does not fit the free part of PINFEED_MAX_SHM_BYTES or "
        "PINFEED_CACHE_MAX_BYTES",
    ),
)
def create_dataset(body: DatasetCreate, service: ServiceDep, response: Response) -> Any:
    """Register a dataset; its files are opened now, so a bad path fails here. With
    ``cache``, a few samples are read twice to check the dataset is deterministic, and the
    cache's memory is reserved."""
    response.headers["Location"] = f"/v1/datasets/{body.name}"
    return service.create_dataset(body)


@router.get("", response_model=list[DatasetPublic])
def list_datasets(service: ServiceDep) -> Any:
    """Every dataset, by name, with its length and sample structure."""
    return service.list_datasets()


@router.get("/{name}", response_model=DatasetPublic, responses=problems(404))
def get_dataset(name: DatasetName, service: ServiceDep) -> Any:
    """A dataset's kind, params, length and one sample's structure (shapes, dtypes)."""
    return service.describe_dataset(name)


@router.delete(
    "/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=problems(404, 409, d409="a loader uses this dataset"),
)
def delete_dataset(name: DatasetName, service: ServiceDep) -> Response:
    """Forget a dataset; refused (409) while a loader uses it."""
    service.delete_dataset(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.delete(
    "/{name}/cache",
    response_model=DatasetPublic,
    responses=problems(
        404,
        409,
        d404="no such dataset, or it has no cache",
        d409="a loader reads the dataset (its workers may hold views of the cache)",
    ),
)
def drop_cache(name: DatasetName, service: ServiceDep) -> Any:
    """Empty the dataset's cache and give its memory back; the next reads fill it again."""
    return service.drop_cache(name)
