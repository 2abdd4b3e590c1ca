"""The HTTP mapping of domain errors: every error leaves the service as problem+json
(RFC 9457) with a stable ``type``, never with a stack trace.

The errors are ``pinfeed.errors``' classes, the one tree both sides share: each
``ProblemError`` declares its slug, status and title, so this module only renders them
(``error_response``), renders the server's own domain errors as the problem each
declares (``pinfeed_server.errors``), and maps what FastAPI and Starlette raise
(validation errors, HTTP exceptions, anything unexpected) onto the same classes. The
client maps the ``type`` back to the same class (``pinfeed.errors.error_from_slug``).
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

from pinfeed.errors import (
    ERRORS,
    PROBLEM_PREFIX,
    DataPlaneError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    ProblemError,
    UnsupportedMediaType,
)
from pinfeed_server.errors import DomainError

log = logging.getLogger("pinfeed")

PROBLEM_JSON = "application/problem+json"

# The problems the HTTP API answers, a base before its subclasses: not the base
# ProblemError (a status with no class of its own), nor the data-plane errors that are
# also problems (a NotFound or InvalidRequest on the socket).
PROBLEM_TYPES: tuple[type[ProblemError], ...] = tuple(
    c
    for c in ERRORS
    if issubclass(c, ProblemError) and c is not ProblemError and not issubclass(c, DataPlaneError)
)
# A status's class: the base before its subclasses (409 is Conflict, not WorkerLimit).
BY_STATUS: dict[int, type[ProblemError]] = {c.status: c for c in reversed(PROBLEM_TYPES)}


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
    exc: ProblemError, instance: str, headers: Mapping[str, str] | None = None
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

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(DomainError)
    async def _domain(request: Request, exc: DomainError) -> JSONResponse:
        return error_response(exc.as_problem(), request.url.path)

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
        invalid = InvalidRequest(detail or "invalid request", errors=errors)
        return error_response(invalid, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers 400 to a body it cannot decode (not UTF-8): an invalid request,
        # like malformed JSON, so it gets the same 422 and type.
        status = 422 if exc.status_code == 400 else exc.status_code
        cls = BY_STATUS.get(status, ProblemError)
        path = request.url.path
        if cls is NotFound:
            detail = f"no route {request.method} {path}; the API is described at /openapi.json"
        elif cls is MethodNotAllowed:
            allow = _allowed_methods(request, (exc.headers or {}).get("Allow", ""))
            detail = f"{request.method} is not allowed on {path}; allowed: {allow}"
            return problem(cls.status, cls.slug, cls.title, detail, path, {"Allow": allow})
        else:
            detail = str(exc.detail)
        # A status that no class names has the base's slug and title: an "http-error".
        return problem(status, cls.slug, cls.title, detail, path, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the server log only; the caller gets a stable problem.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(InternalError("internal error; see the server log"), request.url.path)
