"""OpenAPI: every error documented as ``application/problem+json`` with the Problem schema.

Routers declare which problems they return with ``problems(404, 409, ...)``. The
generator then adds what applies to every route of a kind (401 and 413 on mutating
requests, 415 where there is a body, the bearer security scheme) and moves error
bodies from ``application/json`` (FastAPI's default) to ``application/problem+json``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pinfeed.errors import Overloaded
from pinfeed_server.api.problems import BY_STATUS, PROBLEM_JSON
from pinfeed_server.schemas import Problem

MUTATING = frozenset({"post", "put", "patch", "delete"})
WHEN = {
    401: "PINFEED_TOKEN is set and the request lacks 'Authorization: Bearer <token>'",
    404: "no such dataset or loader",
    409: "the name exists, or the resource is in use",
    413: "the body exceeds PINFEED_MAX_BODY_BYTES",
    415: "the body is not application/json",
    422: "the body or a parameter is invalid",
    503: "a loader is still starting",
    507: "the ring (or cache) would exceed the free part of PINFEED_MAX_SHM_BYTES",
}
OVERLOADED = (
    "overloaded: the control plane is at PINFEED_HTTP_MAX_RPS and the request would "
    "wait too long (Retry-After)"
)


def _example(status: int, description: str) -> dict[str, Any]:
    cls = Overloaded if description.startswith(OVERLOADED[:10]) else BY_STATUS[status]
    return {
        "type": f"urn:pinfeed:problem:{cls.slug}",
        "title": cls.title,
        "status": status,
        "detail": OVERLOADED if cls is Overloaded else WHEN.get(status, cls.title),
        "instance": "/v1/...",
    }


def problems(*statuses: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: these problem statuses, with the Problem schema."""
    return {
        status: {"model": Problem, "description": descriptions.get(f"d{status}", WHEN[status])}
        for status in statuses
    }


def _problem_response(status: int, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {
            PROBLEM_JSON: {
                "schema": {"$ref": "#/components/schemas/Problem"},
                "example": _example(status, description),
            }
        },
    }


def _fix_operation(method: str, op: dict[str, Any], token: bool) -> None:
    responses: dict[str, Any] = op["responses"]
    if method in MUTATING:
        if token:
            op["security"] = [{"bearer": []}]
            responses.setdefault("401", _problem_response(401, WHEN[401]))
        responses.setdefault("413", _problem_response(413, WHEN[413]))
    if "503" in responses:
        responses["503"]["description"] += "; or " + OVERLOADED
    else:
        responses["503"] = {"description": OVERLOADED}
    if "requestBody" in op:
        responses.setdefault("415", _problem_response(415, WHEN[415]))
    for code, response in list(responses.items()):
        if code.isdigit() and int(code) >= 400:
            description = response.get("description") or WHEN.get(int(code), "error")
            responses[code] = _problem_response(int(code), description)


def install_openapi(app: FastAPI, token: bool) -> None:
    """``token``: PINFEED_TOKEN is set, so mutating routes need the bearer token."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
            tags=app.openapi_tags,
        )
        for path_item in schema.get("paths", {}).values():
            for method, op in path_item.items():
                _fix_operation(method, op, token)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        schemas.setdefault(
            "Problem", Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        )
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        if token:
            components["securitySchemes"] = {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "PINFEED_TOKEN, needed on mutating requests",
                }
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
