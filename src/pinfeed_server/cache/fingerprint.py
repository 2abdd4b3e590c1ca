"""What made a cache: a persisted file is served only to the same dataset.

The fingerprint is a SHA-256 over the kind and its params (canonical JSON), the record
format's version, and the sources the samples come from: every file or folder that a
string in the params names inside the data root (each file's path, size and mtime,
folders walked), and for a ``python`` kind its factory's module (the installed
distribution's version, else the module file's size and mtime). A file changed,
added or removed, a params change or a new version of the factory's package makes a
new fingerprint, and the file made under the old one is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pinfeed_server.cache import region
from pinfeed_server.datasets import DatasetContext


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _walk(top: Path) -> Iterator[tuple[str, int, int]]:
    """(path, size, mtime_ns) of every file under ``top``, links followed once."""
    seen: set[str] = set()
    stack = [str(top)]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir():
                    stack.append(entry.path)
                else:
                    st = entry.stat()
                    yield entry.path, st.st_size, st.st_mtime_ns
            except OSError:
                continue


def sources(kind: str, params: dict[str, Any], context: DatasetContext) -> list[list[Any]]:
    """The files and code a dataset's samples come from, as fingerprint lines."""
    root = context.data_root.resolve()
    lines: list[list[Any]] = []
    for text in sorted(set(_strings(params))):
        try:
            path = (root / text).resolve()
        except (OSError, ValueError):
            continue
        if not path.is_relative_to(root) or path == root or not path.exists():
            continue
        if path.is_dir():
            lines.extend([os.path.relpath(p, root), s, m] for p, s, m in _walk(path))
        else:
            st = path.stat()
            lines.append([os.path.relpath(path, root), st.st_size, st.st_mtime_ns])
    if kind == "python" and isinstance(params.get("factory"), str):
        lines.append(["factory", *_module_version(params["factory"].partition(":")[0])])
    return lines


def _module_version(module: str) -> list[Any]:
    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    versions = []
    for dist in sorted(dists):
        try:
            versions.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        file = getattr(importlib.import_module(module), "__file__", None)
    except Exception:
        file = None
    stat: list[Any] = []
    if file:
        st = os.stat(file)
        stat = [st.st_size, st.st_mtime_ns]
    return [module, versions, stat]


def fingerprint(kind: str, params: dict[str, Any], context: DatasetContext) -> bytes:
    head = {"kind": kind, "params": params, "format": region.VERSION}
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    for line in sources(kind, params, context):
        h.update(json.dumps(line).encode())
    return h.digest()
