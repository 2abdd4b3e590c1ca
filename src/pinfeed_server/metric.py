"""How a field of a loader's status or statistics (or of a dataset's cache stats) is
exported to Prometheus, declared on the field itself (``Annotated[int, Metric(...)]``),
so that ``GET /metrics`` renders its per-loader (per-dataset) series by iterating the
models' fields and keeps no table of names of its own. Pydantic keeps the marker in
``FieldInfo.metadata`` and leaves it out of the JSON schema. A building block of the
bottom layer, below the engine and the cache, which both declare metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
