"""The service: a node's datasets and loaders, their rules, and the data plane.

Entry points: ``Service`` (``service.py``), made and started by ``main.create_app``'s
lifespan (or by ``pinfeed serve`` before the HTTP stack), whose methods the routers and
the data plane call; ``DEMO_DATASET`` and ``DEMO_LOADER``, what ``pinfeed serve --demo``
registers.
"""

from pinfeed_server.service.service import DEMO_DATASET, DEMO_LOADER, Service

__all__ = ["DEMO_DATASET", "DEMO_LOADER", "Service"]
