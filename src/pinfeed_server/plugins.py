"""``"module:callable"`` references in requests: the one resolver for every such field.

A dataset factory (``python`` kind), and the loader fields that name code
(``worker_init_fn``, ``collate_fn``, ``sampler``/``batch_sampler`` factories), name a
callable as ``"package.module:attr"``. Only modules under a prefix in
``PINFEED_ALLOWED_PLUGINS`` may be imported: importing code named in an HTTP request is
otherwise refused. A name that is not allowed, does not import, does not resolve or is
not callable is a ``PluginError`` at creation (a 422 naming it), never a failed worker
later.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from pinfeed_server.errors import DomainError

SPEC = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
# pinfeed's own collate of packed rows (``"collate_fn": "pinfeed.packing:collate"``): the
# library the server runs, not a plugin, so no PINFEED_ALLOWED_PLUGINS entry is needed
BUILT_IN = ("pinfeed.packing",)
_SPEC = re.compile(SPEC)


class PluginError(DomainError, ValueError):
    """A ``module:callable`` reference that cannot be used; the message says why."""


def allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def resolve(spec: str, prefixes: tuple[str, ...], *, what: str = "plugin") -> Callable[..., Any]:
    """The callable ``spec`` names, imported if its module is allowed."""
    if not _SPEC.match(spec):
        raise PluginError(f"{what} {spec!r} must look like 'package.module:callable'")
    module_name, attr = spec.split(":")
    if module_name not in BUILT_IN and not allowed(module_name, prefixes):
        raise PluginError(
            f"{what} {spec!r}: module {module_name!r} is not allowed; add its package to "
            "PINFEED_ALLOWED_PLUGINS"
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{what} {spec!r} cannot be imported: {exc}") from None
    if not callable(obj):
        raise PluginError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]
