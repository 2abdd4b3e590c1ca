"""The service's exception tree and the problem+json (RFC 9457) handlers.

Each class has a stable ``slug``; the problem ``type`` is ``urn:pinfeed:problem:<slug>``
and ``pinfeed.errors`` maps it back to the same-named client exception.

    AppError                      500 internal (never with a stack trace)
    ├── InvalidRequest            422 bad body, bad params, path outside the data root
    ├── Unauthorized              401 missing or wrong bearer token
    ├── NotFound                  404 no such dataset, loader or route
    ├── MethodNotAllowed          405 the route exists, the method does not
    ├── Conflict                  409 name exists, or resource still in use
    │   └── WorkerLimit           409 more worker processes than PINFEED_MAX_WORKERS
    ├── PayloadTooLarge           413 body larger than PINFEED_MAX_BODY_BYTES
    ├── UnsupportedMediaType      415 a body that is not application/json
    ├── NotReady                  503 /readyz while a loader is still starting
    ├── Overloaded                503 more requests than PINFEED_HTTP_MAX_RPS can pace
    └── InsufficientMemory        507 ring larger than the free memory budget

Errors on the data-plane socket are a tree of their own, ``pinfeed_server.engine.errors``
(no FastAPI there: worker processes raise them), with the slugs of ``pinfeed.protocol``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pinfeed.errors import PROBLEM_PREFIX

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


class MethodNotAllowed(AppError):
    slug = "method-not-allowed"
    status = 405
    title = "Method not allowed"


class Conflict(AppError):
    slug = "conflict"
    status = 409
    title = "Conflict"


class WorkerLimit(Conflict):
    slug = "worker-limit"
    title = "Worker limit reached"


class PayloadTooLarge(AppError):
    slug = "payload-too-large"
    status = 413
    title = "Payload too large"


class UnsupportedMediaType(AppError):
    slug = "unsupported-media-type"
    status = 415
    title = "Unsupported media type"


class NotReady(AppError):
    slug = "not-ready"
    status = 503
    title = "Not ready"


class Overloaded(AppError):
    slug = "overloaded"
    status = 503
    title = "Overloaded"


class InsufficientMemory(AppError):
    slug = "insufficient-memory"
    status = 507
    title = "Insufficient memory"


def _tree(cls: type[AppError]) -> list[type[AppError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _tree(sub))]


PROBLEM_TYPES: tuple[type[AppError], ...] = tuple(_tree(AppError))
_BY_STATUS = {cls.status: cls for cls in reversed(PROBLEM_TYPES)}  # a base before its subclass


def problem(
    status: int,
    slug: str,
    title: str,
    detail: str,
    instance: str,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_PREFIX + slug,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": instance,
    }
    body.update(extra)
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="pinfeed"'
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def error_response(
    exc: AppError, instance: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return problem(exc.status, exc.slug, exc.title, exc.detail, instance, headers, **exc.extra)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _allowed_methods(request: Request, fallback: str) -> str:
    # Starlette's Allow names only the first route that matched the path, and FastAPI
    # has one route per method: take the methods the OpenAPI document lists instead.
    methods: set[str] = set()
    for template, item in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\{[^/]+\}", "[^/]+", template), request.url.path):
            methods |= {m.upper() for m in item}
    return ", ".join(sorted(methods)) or fallback


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the service as problem+json with a stable ``type``."""

    @app.exception_handler(AppError)
    async def _app_error(request: Request, exc: AppError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        body_error = any(tuple(e.get("loc", ()))[:1] == ("body",) for e in exc.errors())
        if body_error and content_type and not _is_json(content_type):
            return error_response(
                UnsupportedMediaType(f"the body must be application/json, not {content_type!r}"),
                request.url.path,
            )
        # Only loc/msg/type: pydantic's "input" and "ctx" may echo large or odd values back.
        errors = [
            {
                "loc": list(e.get("loc", ())),
                "msg": str(e.get("msg", "")),
                "type": str(e.get("type", "")),
            }
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return problem(
            422,
            "invalid-request",
            "Invalid request",
            detail or "invalid request",
            request.url.path,
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers 400 to a body it cannot decode (not UTF-8): an invalid request,
        # like malformed JSON, so it gets the same 422 and type.
        status = 422 if exc.status_code == 400 else exc.status_code
        cls = _BY_STATUS.get(status)
        path = request.url.path
        if cls is NotFound:
            detail = f"no route {request.method} {path}; the API is described at /openapi.json"
        elif cls is MethodNotAllowed:
            allow = _allowed_methods(request, (exc.headers or {}).get("Allow", ""))
            detail = f"{request.method} is not allowed on {path}; allowed: {allow}"
            return problem(cls.status, cls.slug, cls.title, detail, path, {"Allow": allow})
        else:
            detail = str(exc.detail)
        if cls is None:
            return problem(exc.status_code, "http-error", "HTTP error", detail, path, exc.headers)
        return problem(cls.status, cls.slug, cls.title, detail, path, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the server log only; the caller gets a stable problem.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem(
            500,
            "internal",
            "Internal error",
            "internal error; see the server log",
            request.url.path,
        )
