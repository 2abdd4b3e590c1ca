"""Property-based run of schemathesis against a live server, from its OpenAPI document.

No 5xx, every response conforms to the documented status codes, content types and
schemas, invalid input is rejected. Bounded by ``max_examples`` per operation.

The schema is built from ``create_app().openapi()`` at import (schemathesis's lazy
fixture loader does not run under this pytest); a test checks that the live server
serves the same document, and every case is sent to the live server.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from pinfeed_server.main import create_app
from pinfeed_server.settings import Settings
from tests.api.conftest import TOKEN
from tests.conftest import Server

AUTH = {"Authorization": f"Bearer {TOKEN}"}

# Schema-valid requests may still be refused for what the schema cannot say: a missing
# file (422), a name taken (409), an unknown dataset (404), a full budget (507).
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "401", "404", "409", "422", "507"]
            }
        },
    }
)

with tempfile.TemporaryDirectory() as _tmp:
    _doc = create_app(Settings(state_dir=Path(_tmp), data_root=Path(_tmp))).openapi()
schema = schemathesis.openapi.from_dict(_doc, config=CONFIG)


def test_the_live_server_serves_this_document(token_server: Server) -> None:
    assert httpx.get(f"{token_server.url}/openapi.json").json() == _doc


@schema.parametrize()
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case: schemathesis.Case[Any], token_server: Server) -> None:
    case.call_and_validate(base_url=token_server.url, headers=AUTH)
