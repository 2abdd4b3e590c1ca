"""create_app(): the FastAPI app; its lifespan starts and stops the service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from app import __version__
from app.api.deps import require_token
from app.api.routes import datasets, health, loaders
from app.errors import install_handlers
from app.service import Service
from app.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.check_safe()
        service = Service(settings)
        service.start()
        app.state.service = service
        try:
            yield
        finally:
            service.close()

    app = FastAPI(
        title="pinfeed",
        version=__version__,
        description="Node-local batch server: DataLoader-identical batches in page-locked "
        "shared memory. Control plane only; batches travel over the data-plane Unix socket.",
        lifespan=lifespan,
        dependencies=[Depends(require_token)],
    )
    app.dependency_overrides[get_settings] = lambda: settings
    install_handlers(app)
    app.include_router(health.router)
    app.include_router(datasets.router)
    app.include_router(loaders.router)
    logging.getLogger("pinfeed").setLevel(settings.log_level.upper())
    return app
