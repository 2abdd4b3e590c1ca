"""One router module per resource (``APIRouter``), included by ``main.create_app``."""
