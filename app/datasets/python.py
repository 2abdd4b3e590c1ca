"""``python``: a map-style Dataset built by a factory the operator allowed.

``{"factory": "package.module:callable", "kwargs": {...}}``. Only modules under a
prefix in ``PINFEED_ALLOWED_PLUGINS`` may be imported: importing code named in an
HTTP request is otherwise refused.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import Field

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params


class PythonParams(Params):
    factory: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    kwargs: dict[str, Any] = Field(default_factory=dict)


def _allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def build(p: PythonParams, ctx: DatasetContext) -> Any:
    module_name, attr = p.factory.split(":")
    if not _allowed(module_name, ctx.allowed_plugins):
        raise DatasetError(
            f"module {module_name!r} is not allowed; add its package to PINFEED_ALLOWED_PLUGINS"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise DatasetError(f"cannot import {p.factory}: {exc}") from None
    try:
        dataset = factory(**p.kwargs)
    except Exception as exc:
        raise DatasetError(f"{p.factory}(**kwargs) raised {type(exc).__name__}: {exc}") from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DatasetError(f"{p.factory} did not return a map-style dataset (__len__, __getitem__)")
    return dataset


KIND = Kind("python", PythonParams, build, __doc__)
