"""Config, kinds and status are declared once: the served schema follows the engine's
models and the registry of dataset kinds (no server; the app's OpenAPI document)."""

from __future__ import annotations

from typing import Any

import pytest

from pinfeed_server.datasets import KINDS
from pinfeed_server.engine.config import LoaderConfig, LoaderFields
from pinfeed_server.engine.status import LoaderStatus
from pinfeed_server.main import create_app
from pinfeed_server.schemas import DatasetCreate, LoaderCreate, LoaderPatch, LoaderPublic
from pinfeed_server.settings import Settings


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("schemas")
    doc = create_app(Settings(state_dir=root, data_root=root)).openapi()
    return dict(doc["components"]["schemas"])


def _ref(schema: dict[str, Any]) -> str:
    return str(schema["$ref"]).rsplit("/", 1)[-1]


def test_dataset_params_are_one_schema_per_registered_kind(schemas: dict[str, Any]) -> None:
    body = schemas["DatasetCreate"]
    assert body["discriminator"]["propertyName"] == "kind"
    mapping = body["discriminator"]["mapping"]
    assert set(mapping) == set(KINDS)
    for kind, ref in mapping.items():
        variant = schemas[ref.rsplit("/", 1)[-1]]
        assert variant["properties"]["kind"]["const"] == kind
        assert _ref(variant["properties"]["params"]) == KINDS[kind].params.__name__
        assert "params" in variant["required"] and variant["additionalProperties"] is False
    # What issue 12 asked for: a client can see that npy needs paths.
    assert schemas["NpyParams"]["required"] == ["paths"]
    assert set(schemas["DatasetPublic"]["properties"]["kind"]["enum"]) == set(KINDS)


def test_dataset_create_keeps_params_as_given() -> None:
    body = DatasetCreate.model_validate(
        {"name": "d", "kind": "synthetic", "params": {"length": 3, "fields": [{"shape": [2]}]}}
    )
    assert (body.name, body.kind) == ("d", "synthetic")
    assert body.params == {"length": 3, "fields": [{"shape": [2]}]}  # no defaults filled in


def test_loader_models_derive_from_one_declaration(schemas: dict[str, Any]) -> None:
    fields = set(LoaderFields.model_fields)
    assert set(LoaderCreate.model_fields) == fields
    assert set(LoaderConfig.model_fields) == fields
    assert set(LoaderPublic.model_fields) == (
        fields | set(LoaderStatus.model_fields) | {"created_at", "batch", "owner"}
    )
    assert set(LoaderPatch.model_fields) <= fields
    assert set(schemas["LoaderCreate"]["properties"]) == fields
    assert set(schemas["LoaderPublic"]["required"]) == set(LoaderPublic.model_fields)
    for name in ("num_workers", "prefetch_factor"):
        create = schemas["LoaderCreate"]["properties"][name]
        create = create.get("anyOf", [create])[0]  # prefetch_factor: null is the default
        patch = schemas["LoaderPatch"]["properties"][name]["anyOf"][0]
        assert patch["maximum"] == create["maximum"]


def test_a_loader_that_could_not_start_has_the_same_status_fields() -> None:
    config = LoaderConfig(name="l", dataset="d", seed=1)
    public = LoaderPublic.model_validate(
        {
            **config.model_dump(),
            **LoaderStatus.unstarted("gone").model_dump(),
            "created_at": 0.0,
            "batch": None,
        }
    )
    # The same failure shape as a running loader that failed (fatal for its consumers).
    assert public.state == "failed" and public.failure == {
        "type": "loader-failed",
        "detail": "gone",
        "fatal": True,
    }


def test_the_engine_config_refuses_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank 2 must be < world_size 2"):
        LoaderConfig(name="l", dataset="d", seed=1, rank=2, world_size=2)
