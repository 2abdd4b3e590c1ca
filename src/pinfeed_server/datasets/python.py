"""``python``: a map-style or iterable Dataset built by a factory the operator allowed.

``{"factory": "package.module:callable", "kwargs": {...}}``. Only modules under a
prefix in ``PINFEED_ALLOWED_PLUGINS`` may be imported: importing code named in an
HTTP request is otherwise refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from torch.utils.data import IterableDataset

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params
from pinfeed_server.plugins import SPEC, PluginError, resolve


class PythonParams(Params):
    factory: str = Field(pattern=SPEC)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    draws_rng: bool = Field(
        True,
        description="its __getitem__ may draw from the global random/torch/numpy RNGs, "
        "which DataLoader seeds per worker (pinfeed keeps those streams); false: it draws "
        "none, so any worker process may make any batch and a live change of num_workers "
        "(PATCH, the node arbiter) costs no RNG replay",
    )


def build(p: PythonParams, ctx: DatasetContext) -> Any:
    try:
        factory = resolve(p.factory, ctx.allowed_plugins, what="factory")
    except PluginError as exc:
        raise DatasetError(str(exc)) from None
    try:
        dataset = factory(**p.kwargs)
    except Exception as exc:
        raise DatasetError(f"{p.factory}(**kwargs) raised {type(exc).__name__}: {exc}") from None
    if isinstance(dataset, IterableDataset):  # DataLoader's test (engine/iterable.py)
        return dataset
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DatasetError(
            f"{p.factory} did not return a map-style dataset (__len__, __getitem__) or an "
            "IterableDataset"
        )
    return dataset


KIND = Kind("python", PythonParams, build, __doc__, ship_build=True, draws_rng=True)
