"""The service's exception tree and the one problem+json (RFC 9457) handler.

Each class has a stable ``slug``; the problem ``type`` is ``urn:pinfeed:problem:<slug>``
and ``client._errors`` maps it back to the same-named client exception.

    AppError                      500 internal (never with a stack trace)
    ├── InvalidRequest            422 bad body, bad params, path outside the data root
    ├── Unauthorized              401 missing or wrong bearer token
    ├── NotFound                  404 no such dataset or loader
    ├── Conflict                  409 name exists, or resource still in use
    └── InsufficientMemory        507 ring larger than the free memory budget
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client._errors import PROBLEM_PREFIX

log = logging.getLogger("pinfeed")

PROBLEM_JSON = "application/problem+json"


class AppError(Exception):
    slug = "internal"
    status = 500
    title = "Internal error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class InvalidRequest(AppError):
    slug = "invalid-request"
    status = 422
    title = "Invalid request"


class Unauthorized(AppError):
    slug = "unauthorized"
    status = 401
    title = "Unauthorized"


class NotFound(AppError):
    slug = "not-found"
    status = 404
    title = "Not found"


class Conflict(AppError):
    slug = "conflict"
    status = 409
    title = "Conflict"


class InsufficientMemory(AppError):
    slug = "insufficient-memory"
    status = 507
    title = "Insufficient memory"


def problem(
    status: int, slug: str, title: str, detail: str, instance: str, **extra: Any
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_PREFIX + slug,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": instance,
    }
    body.update(extra)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


_HTTP_SLUGS = {
    400: ("invalid-request", "Bad request"),
    401: ("unauthorized", "Unauthorized"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    409: ("conflict", "Conflict"),
    422: ("invalid-request", "Invalid request"),
}


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the service as problem+json."""

    @app.exception_handler(AppError)
    async def _app_error(request: Request, exc: AppError) -> JSONResponse:
        return problem(exc.status, exc.slug, exc.title, exc.detail, request.url.path, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type")}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return problem(
            422, "invalid-request", "Invalid request", detail, request.url.path, errors=errors
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        slug, title = _HTTP_SLUGS.get(exc.status_code, ("http-error", "HTTP error"))
        return problem(exc.status_code, slug, title, str(exc.detail), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return problem(
            500, "internal", "Internal error", "internal error; see the server log",
            request.url.path,
        )
