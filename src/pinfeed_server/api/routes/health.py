from __future__ import annotations

from fastapi import APIRouter, Request

from pinfeed.errors import NotReady
from pinfeed_server.api.openapi import problems
from pinfeed_server.schemas import Health
from pinfeed_server.service import Service

router = APIRouter(tags=["health"])


# Both probes are ``async def`` and take no dependency: answered on the event loop,
# with no thread-pool hop, and cheap (readiness reads one dict).


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up and serving HTTP (liveness). Never needs the token."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses=problems(503))
async def readyz(request: Request) -> Health:
    """Every loader has left ``starting`` (readiness); 503 names those that have not."""
    service: Service = request.app.state.service
    starting = service.starting_loaders()
    if starting:
        raise NotReady(f"loaders still starting: {', '.join(starting)}", loaders=starting)
    return Health(status="ok")
