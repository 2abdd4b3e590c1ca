from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import ServiceDep
from app.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up and serving HTTP."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"description": "not ready"}})
def readyz(service: ServiceDep) -> Health | JSONResponse:
    """The data-plane socket is listening and every loader has left ``starting``."""
    starting = [n for n, e in service.loaders.items() if e.state == "starting"]
    if starting:
        return JSONResponse({"status": "starting", "loaders": starting}, status_code=503)
    return Health(status="ok")
