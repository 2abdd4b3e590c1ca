"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from pinfeed_server.service import Service


async def get_service(request: Request) -> Service:
    # async: resolved on the event loop, so an ``async def`` route needs no thread hop.
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]
