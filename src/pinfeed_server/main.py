"""create_app(): the FastAPI app; its lifespan starts and stops the service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from pinfeed import __version__
from pinfeed_server.api.guards import RequestGuard
from pinfeed_server.api.openapi import install_openapi
from pinfeed_server.api.problems import install_handlers
from pinfeed_server.api.routes import datasets, health, loaders, metrics, node, page
from pinfeed_server.api.throttle import Throttle
from pinfeed_server.datasets import KINDS
from pinfeed_server.service import Service
from pinfeed_server.settings import Settings, get_settings

TAGS = [
    {"name": "health", "description": "Liveness and readiness probes."},
    {
        "name": "datasets",
        "description": f"Datasets: a kind ({', '.join(KINDS)}) and its params; files "
        "resolve inside PINFEED_DATA_ROOT.",
    },
    {
        "name": "loaders",
        "description": "Loaders: DataLoader's arguments over a dataset; each "
        "keeps a prefetch ring of ready batches in page-locked shared memory.",
    },
    {
        "name": "node",
        "description": "The node: CPUs, budgets, and the arbiter's division of the workers.",
    },
    {"name": "metrics", "description": "Prometheus metrics, labelled per loader."},
]


def create_app(settings: Settings | None = None, service: Service | None = None) -> FastAPI:
    """The app; its lifespan starts a ``Service`` of ``settings``, or takes ``service``,
    already started (``pinfeed serve``: its data plane answers before the HTTP stack is
    imported), and stops it."""
    settings = settings or get_settings()
    started = service

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = started
        if service is None:
            settings.check_safe()
            service = Service(settings)
            service.start()  # fixes the server's mmap threshold (malloc.py says why)
        app.state.service = service
        try:
            yield
        finally:
            service.close()

    # /docs and /redoc from the Swagger UI and ReDoc assets fastapi-offline ships (no
    # CDN: a GPU node often has no internet).
    app = FastAPIOffline(
        title="pinfeed",
        version=__version__,
        description="Node-local batch server: DataLoader-identical batches in page-locked "
        "shared memory. Control plane only; batches travel over the data-plane Unix socket. "
        "Errors are application/problem+json (RFC 9457) with a stable `type`.",
        lifespan=lifespan,
        openapi_tags=TAGS,
    )
    app.state.settings = settings
    app.state.metrics = metrics.MetricsCache(lambda: app.state.service, settings.metrics_max_age_s)
    app.add_middleware(RequestGuard, settings=settings)
    # Outermost: every request is paced, before the token check reads its headers.
    app.add_middleware(Throttle, rps=settings.http_max_rps)
    install_handlers(app)
    install_openapi(app, token=settings.token is not None)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(datasets.router)
    app.include_router(loaders.router)
    app.include_router(node.router)
    app.include_router(page.router)
    logging.getLogger("pinfeed").setLevel(settings.log_level.upper())
    return app
