"""Shipping a script's own objects (its Dataset, ``collate_fn``, ``worker_init_fn``) to the
node's server, by value: what DataLoader's workers get by ``fork``, pinfeed's server
gets as a payload (``pinfeed.payload``: a protocol-5 pickle and its buffers in a memfd).

cloudpickle pickles by value what lives in the script (classes and functions defined in
``__main__`` or a notebook, lambdas, closures, ``functools.partial``), and, registered
here, the script's own modules (files beside it, outside the Python installation), which
a server started elsewhere could not import. Installed packages go by reference: the
server imports them from its environment (the same one, when the trainer started it).
numpy arrays and CPU tensors go out of band: written once into the payload and mapped,
not copied, by the server and every worker; a memory-mapped array or tensor whose pages
are still its file's (``np.memmap``, ``torch.load(mmap=True)``) goes as its file, which
the server maps again (the node's page cache: nothing is copied).

What cannot be shipped (an open file or socket, a lock, a generator object, a CUDA
tensor) is an ``Unshippable`` error raised here, in the trainer, naming the attribute
path that failed and what to do.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import torch

from pinfeed import payload
from pinfeed.errors import Unshippable

MAX_DEPTH = 8
MAX_CHILDREN = 64  # of a list or dict: where the first ones pickle, the rest likely do

_HINTS = (
    ((io.IOBase,), "open files in __getitem__ or in worker_init_fn, not in __init__"),
    ((types.GeneratorType,), "a generator cannot be copied: create the iterator in __iter__"),
    ((types.ModuleType,), "import the module where it is used instead of keeping it"),
)


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    """cloudpickle, with CPU tensors sent as out-of-band buffers, CUDA tensors refused,
    and a memory-mapped numpy array or tensor sent as its file (the server is on this
    node and maps the same pages) instead of its contents."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.memmap) and (as_file := payload.memmap_file(obj)) is not None:
            return as_file
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
            if obj.device.type != "cpu":
                raise Unshippable(f"a {obj.device.type} tensor")
            if obj.layout == torch.strided and not obj.requires_grad:
                storage = obj.untyped_storage()
                where = payload.file_backing(storage.data_ptr(), storage.nbytes())
                if where is not None:  # a file's pages (torch.load(mmap=True)): the file
                    path, offset, stamp = where
                    return payload.tensor_from_file, (
                        path,
                        offset,
                        storage.nbytes(),
                        stamp,
                        str(obj.dtype),
                        tuple(obj.shape),
                        obj.stride(),
                        obj.storage_offset(),
                    )
                flat = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                return payload.tensor_from_buffer, (flat, str(obj.dtype), tuple(obj.shape))
        return super().reducer_override(obj)


def _installed_roots() -> tuple[str, ...]:
    """The Python installation's folders, as named and as resolved (each ending in ``/``)."""
    paths = sysconfig.get_paths()
    named = [p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := paths.get(key))]
    named += [sys.prefix, sys.base_prefix]
    roots = {os.path.abspath(p) for p in named} | {os.path.realpath(p) for p in named}
    return tuple(root.rstrip(os.sep) + os.sep for root in roots)


def _installed(path: str, roots: tuple[str, ...]) -> bool:
    parts = path.split(os.sep)
    return path.startswith(roots) or "site-packages" in parts or "dist-packages" in parts


def _register_local_modules() -> None:
    """Pickle the script's own modules by value: a server need not be able to import
    them. A module is the script's if its file is outside the Python installation. The
    path is resolved (symlinks) only where it does not already name the installation:
    a trainer has a thousand modules, and resolving each took 35-65 ms a loader."""
    roots = _installed_roots()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or name.split(".")[0] in ("pinfeed", "pinfeed_server"):
            continue
        if not os.path.isabs(path):
            continue  # no file of its own (torch.ops' "_ops.py"): its package's import makes it
        if _installed(os.path.abspath(path), roots) or _installed(os.path.realpath(path), roots):
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:
            continue  # a submodule of one already registered


def _dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    out = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return out.getvalue(), buffers


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for i, (key, value) in enumerate(obj.items()):
            if i >= MAX_CHILDREN:
                return
            yield f"[{key!r}]", value
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj[:MAX_CHILDREN]):
            yield f"[{i}]", value
        return
    for name, value in getattr(obj, "__dict__", {}).items():
        yield f".{name}", value
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            yield f".{name}", getattr(obj, name)


def _culprit(obj: Any, path: str, depth: int = 0) -> tuple[str, Any, BaseException] | None:
    """The deepest attribute path under ``obj`` that does not pickle, or None."""
    try:
        _dumps(obj)
        return None
    except Exception as exc:
        error: BaseException = exc
    if depth < MAX_DEPTH:
        for name, child in _children(obj):
            found = _culprit(child, path + name, depth + 1)
            if found is not None:
                return found
    return path, obj, error


def _advice(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return (
            "keep the dataset's tensors on the CPU (pinfeed.DataLoader(device=...) moves batches)"
        )
    for types_, hint in _HINTS:
        if isinstance(obj, types_):
            return hint
    return "create it in __getitem__ or in worker_init_fn instead of holding it"


def ship(objects: dict[str, Any]) -> int:
    """A payload memfd holding ``objects`` (name -> object); the caller owns the fd.
    Raises ``Unshippable`` naming the attribute path (``dataset.fh``) that cannot go."""
    _register_local_modules()
    try:
        data, buffers = _dumps(objects)
    except Exception as exc:
        found = None
        for name, obj in objects.items():
            found = _culprit(obj, name)
            if found is not None:
                break
        path, culprit, error = found if found is not None else ("the objects", objects, exc)
        raise Unshippable(
            f"pinfeed.DataLoader cannot ship {path} (a {type(culprit).__name__}) to the "
            f"pinfeed server: {error}. The dataset, collate_fn and worker_init_fn go to the "
            "node's server by value, as DataLoader hands them to its workers; "
            f"{_advice(culprit)}",
            path=path,
        ) from None
    return payload.write(data, [b.raw() for b in buffers])
