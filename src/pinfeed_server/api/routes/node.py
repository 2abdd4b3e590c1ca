"""``GET /v1/node``: the node as the arbiter divides it."""

from __future__ import annotations

from fastapi import APIRouter

from pinfeed_server.api.deps import ServiceDep
from pinfeed_server.schemas import NodePublic

router = APIRouter(prefix="/v1/node", tags=["node"])


@router.get("", response_model=NodePublic)
async def get_node(service: ServiceDep) -> NodePublic:
    """CPUs, PINFEED_MAX_WORKERS and the memory budget; every loader's workers, priority,
    min_workers and trainers' wait share over the arbiter's last round; its last
    decisions with their reasons. Read on the event loop (no lock is taken)."""
    return service.node()
