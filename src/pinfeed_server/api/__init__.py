"""The HTTP control plane: ``main.create_app`` mounts it. ``routes/`` holds one router
module per resource (health, datasets, loaders, node, metrics, the operator's page),
each calling the ``Service`` it gets from ``deps.ServiceDep``; ``problems`` is the one
exception handler (every error leaves as problem+json); ``guards`` and ``throttle`` the
middleware (token, body size, pace); ``openapi`` the document; ``prometheus`` the text
``GET /metrics`` serves. HTTP is never on the per-batch path.
"""
