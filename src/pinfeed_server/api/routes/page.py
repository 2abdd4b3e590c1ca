"""``GET /``: the operator's page of the node, one HTML file the package ships (inline
style and script, no font or script from anywhere else), which polls ``/v1/node`` and
``/v1/loaders`` every 2 s. ``/docs`` (Swagger UI) and ``/redoc`` are served from the
assets that ``fastapi-offline`` bundles (``main.py``): both work on a node without
internet."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@cache
def page() -> str:
    return (resources.files("pinfeed_server.api") / "static" / "index.html").read_text()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    return HTMLResponse(page())
