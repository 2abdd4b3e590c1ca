"""Dependencies shared by the routers: settings, the service, the bearer-token check."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from app.errors import Unauthorized
from app.service import Service
from app.settings import Settings, get_settings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def require_token(
    request: Request, settings: Annotated[Settings, Depends(get_settings)]
) -> None:
    """With PINFEED_TOKEN set, every mutating request needs ``Authorization: Bearer``."""
    if settings.token is None or request.method in SAFE_METHODS:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given, settings.token):
        raise Unauthorized("this request needs 'Authorization: Bearer <PINFEED_TOKEN>'")


ServiceDep = Annotated[Service, Depends(get_service)]
