from __future__ import annotations

from fastapi import APIRouter

from pinfeed_server.api.deps import ServiceDep
from pinfeed_server.api.openapi import problems
from pinfeed_server.errors import NotReady
from pinfeed_server.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up and serving HTTP (liveness). Never needs the token."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses=problems(503))
def readyz(service: ServiceDep) -> Health:
    """Every loader has left ``starting`` (readiness); 503 names those that have not."""
    starting = service.starting_loaders()
    if starting:
        raise NotReady(f"loaders still starting: {', '.join(starting)}", loaders=starting)
    return Health(status="ok")
