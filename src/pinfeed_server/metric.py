"""How a field of a loader's status or statistics (or of a dataset's cache stats) is
exported to Prometheus, declared on the field itself (``Annotated[int, Metric(...)]``),
so that ``GET /metrics`` renders its per-loader (per-dataset) series by iterating the
models' fields and keeps no table of names of its own. Pydantic keeps the marker in
``FieldInfo.metadata`` and leaves it out of the JSON schema. A building block of the
bottom layer, below the engine and the cache, which both declare metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Metric:
    """``name`` follows ``pinfeed_loader_`` (a cache's: ``pinfeed_dataset_cache_``);
    ``help`` is what ``# HELP`` prints. Both are
    what dashboards query (``deploy/grafana``): change them as a breaking change.

    A field whose value is a state (a ``Literal``) or counts by state (``SlotCounts``)
    is exported as one series per state, labelled ``state``."""

    name: str
    kind: MetricKind
    help: str


def metric_fields(model: type[BaseModel]) -> tuple[tuple[str, Metric], ...]:
    """``(field, metric)`` for each field of ``model`` exported to Prometheus, in the
    order the model declares them."""
    return tuple(
        (name, m)
        for name, info in model.model_fields.items()
        for m in info.metadata
        if isinstance(m, Metric)
    )


M = TypeVar("M", bound=BaseModel)
_FIELDS: dict[type[BaseModel], set[str]] = {}


def built(cls: type[M], values: dict[str, Any]) -> M:
    """``cls.model_construct(**values)`` for ``values`` that name every field, without
    its Python loop over the fields (aliases, defaults) or validation: the same four
    attributes set, and one fields-set per class shared by its instances (every field is
    given, so none is ever added). A scrape builds a status and a snapshot per loader:
    for ~20 fields that loop takes ~10 us, this ~1 us (tests/api/test_stats.py checks
    it against model_construct)."""
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _FIELDS.setdefault(cls, set(cls.model_fields))
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", fields)
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj
