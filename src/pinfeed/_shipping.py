"""Shipping a script's own objects (its Dataset, ``collate_fn``, ``worker_init_fn``) to the
node's server, by value: what DataLoader's workers get by ``fork``, pinfeed's server
gets as a payload (``pinfeed.payload``: a protocol-5 pickle and its buffers in a memfd).

cloudpickle pickles by value what lives in the script (classes and functions defined in
``__main__`` or a notebook, lambdas, closures, ``functools.partial``), and, registered
here, the script's own modules (files beside it, outside the Python installation), which
a server started elsewhere could not import. Installed packages go by reference: the
server imports them from its environment (the same one, when the trainer started it).
A memory-mapped array or tensor whose pages are still its file's (``np.memmap``,
``torch.load(mmap=True)``) goes as its file, which the server maps again (the node's
page cache: nothing is copied).

The objects follow the trainer (``Shipper``): DataLoader hands its workers the objects
as they are at each ``iter()`` (without persistent workers; always, without workers),
so the trainer pickles them again there and ships a payload only if the pickle changed
(``set_epoch``, an attribute set, a curriculum's step). CPU tensors and numpy arrays of
``payload.STORED_MIN`` bytes or more are *stored*: shipped once, out of band, and
referred to by id while they are the same one: the same memory, shape and dtype (the
``Shipper`` holds a reference, so their memory is not reused meanwhile), the same
tensor version (an in-place torch op bumps it), and the same bytes at 16 places spread
over them. So ``dataset.x = new_tensor`` and ``x.mul_(2)`` ship the new values; an
in-place write that no torch op made, to a few elements of a large array between two
``iter()`` calls, can go unseen: assign a new array instead. Smaller tensors and arrays
travel in the pickle (compared byte for byte).

What cannot be shipped (an open file or socket, a lock, a generator object, a CUDA
tensor) is an ``Unshippable`` error raised here, in the trainer, naming the attribute
path that failed and what to do.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any, Literal

import cloudpickle
import numpy as np
import torch

from pinfeed import payload
from pinfeed.errors import Unshippable

MAX_DEPTH = 8
MAX_CHILDREN = 64  # of a list or dict: where the first ones pickle, the rest likely do
SAMPLES = 16  # places a stored buffer's bytes are compared at
SAMPLE_BYTES = 4096

_HINTS = (
    ((io.IOBase,), "open files in __getitem__ or in worker_init_fn, not in __init__"),
    ((types.GeneratorType,), "a generator cannot be copied: create the iterator in __iter__"),
    ((types.ModuleType,), "import the module where it is used instead of keeping it"),
)

Key = tuple[Any, ...]


def _sampled(flat: Callable[[], Any], nbytes: int) -> bytes:
    """A digest of ``SAMPLES`` stretches of a buffer's bytes, spread over it (``flat()``:
    its bytes, a flat uint8 numpy view where it is contiguous)."""
    data = flat()
    h = hashlib.blake2b(digest_size=16)
    step = max(SAMPLE_BYTES, nbytes // SAMPLES)
    for at in range(0, nbytes, step):
        h.update(data[at : at + SAMPLE_BYTES].tobytes())
    return h.digest()


def _stored(obj: Any) -> bool:
    """Whether ``obj`` is a plain numpy array to store (large, of a plain dtype)."""
    return (
        type(obj) is np.ndarray
        and obj.dtype.fields is None
        and obj.dtype.kind not in "OV"
        and obj.nbytes >= payload.STORED_MIN
    )


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    """cloudpickle, with CUDA tensors refused, a memory-mapped numpy array or tensor sent
    as its file (the server is on this node and maps the same pages), large CPU tensors
    and arrays stored (``Shipper``) and small ones in the pickle."""

    def __init__(self, file: io.BytesIO, shipper: Shipper) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._out_of_band)
        self._shipper = shipper
        self.used: set[int] = set()  # stored buffers this pickle refers to
        self.own: list[pickle.PickleBuffer] = []  # its other out-of-band buffers
        self.shared: list[int] = []  # the shared memory it maps (fds of its own)
        self._shared_at: dict[int, int] = {}  # a shared storage's address -> its index

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        """A buffer another object pickles out of band: a small one in the pickle (true:
        in band), a large one beside it."""
        if buffer.raw().nbytes < payload.STORED_MIN:
            return True
        self.own.append(buffer)
        return False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.memmap) and (as_file := payload.memmap_file(obj)) is not None:
            return as_file
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
            if obj.device.type != "cpu":
                raise Unshippable(f"a {obj.device.type} tensor")
            if obj.layout == torch.strided and not obj.requires_grad:
                return self._tensor(obj)
        if _stored(obj):
            order: Literal["C", "F"] = (
                "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
            )
            address = obj.__array_interface__["data"][0]
            key = ("a", address, obj.nbytes, obj.dtype.str, obj.shape, obj.strides)
            ident = self._shipper.stored(
                self,
                key,
                obj,
                lambda: np.asarray(obj, order=order).reshape(-1, order=order).view(np.uint8),
            )
            return payload.stored_array, (ident, obj.dtype.str, obj.shape, order)
        return super().reducer_override(obj)

    def _tensor(self, obj: torch.Tensor) -> Any:
        storage = obj.untyped_storage()
        if storage.is_shared():  # share_memory_(): the server maps the same memory
            return self._shared(obj, storage)
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
        nbytes = obj.numel() * obj.element_size()

        def flat() -> Any:
            return obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()

        if nbytes < payload.STORED_MIN:
            return payload.tensor_from_bytes, (flat().tobytes(), str(obj.dtype), tuple(obj.shape))
        key = ("t", obj.data_ptr(), nbytes, str(obj.dtype), tuple(obj.shape), obj.stride())
        ident = self._shipper.stored(self, (*key, obj._version), obj, flat)
        return payload.stored_tensor, (ident, str(obj.dtype), tuple(obj.shape))

    def _shared(self, obj: torch.Tensor, storage: torch.UntypedStorage) -> Any:
        """A tensor in shared memory, as the shared memory (its fd goes along): what
        DataLoader's workers share with the trainer stays shared."""
        address = storage.data_ptr()
        index = self._shared_at.get(address)
        if index is None:
            try:
                fd, _ = storage._share_fd_cpu_()
            except RuntimeError:
                raise Unshippable(
                    "a tensor in shared memory by file name (torch.multiprocessing's "
                    "file_system strategy)"
                ) from None
            index = self._shared_at[address] = len(self.shared)
            self.shared.append(os.dup(fd))
        return payload.shared_tensor, (
            index,
            storage.nbytes(),
            str(obj.dtype),
            tuple(obj.shape),
            obj.stride(),
            obj.storage_offset(),
            address,
        )


class Shipper:
    """One loader's objects as shipped so far: the stored buffers by key (and a
    reference to each one's tensor or array, so that its memory holds nothing else
    meanwhile), the payloads that brought them, and the digest of the last pickle.
    ``ship`` makes the payload for the objects as they are now, or nothing where they
    have not changed; the payloads whose buffers the objects no longer use are closed."""

    def __init__(self) -> None:
        self._known: dict[Key, tuple[int, Any]] = {}  # key -> (id, the tensor or array)
        self._next_id = 0
        self._digest: bytes | None = None
        self._chain = payload.Chain()  # the payloads the objects as last shipped need
        self._new: list[tuple[int, memoryview]] = []  # stored by the pickle being made
        self._whole: int | None = None  # the last objects in one payload (``whole``)

    def stored(self, pickler: _Pickler, key: Key, obj: Any, flat: Callable[[], Any]) -> int:
        """The id of a large tensor or array (a new one: its bytes go in this payload)."""
        nbytes = key[2]
        key = (*key, _sampled(flat, nbytes))
        known = self._known.get(key)
        if known is None:
            ident = self._next_id
            self._next_id += 1
            known = self._known[key] = (ident, obj)
            self._new.append((ident, memoryview(flat())))
        pickler.used.add(known[0])
        return known[0]

    def ship(self, objects: dict[str, Any]) -> int | None:
        """A payload memfd for ``objects`` (name -> object), or None if they pickle as
        the last shipped ones did; the shipper owns the fd (``fds``). Raises
        ``Unshippable`` naming the attribute path (``dataset.fh``) that cannot go."""
        _register_local_modules()
        self._new = []
        try:
            data, used, own, shared = self._dumps(objects)
        except Exception as exc:
            self._forget_new()
            raise _unshippable(objects, exc) from None
        h = hashlib.blake2b(data, digest_size=32)
        for buffer in own:
            h.update(hashlib.blake2b(buffer.raw(), digest_size=32).digest())
        digest = h.digest()
        if digest == self._digest and not self._new:
            for fd in shared:
                os.close(fd)
            return None
        fd = payload.write(data, self._new, [b.raw() for b in own], used)
        self._digest = digest
        self._new = []
        # Forget the buffers the objects no longer use (and let go of their tensors).
        self._known = {k: v for k, v in self._known.items() if v[0] in used}
        self._chain.add(fd, shared)
        self._drop_whole()
        return fd

    @property
    def shared(self) -> list[int]:
        """The shared memory the objects as last shipped map: its fds go with the payload
        (the shipper owns them)."""
        return self._chain.shared

    def whole(self) -> int:
        """The objects as last shipped in one payload, all their stored buffers in it
        (read from the payloads that brought them): what a new server is sent (a
        reconnect). The shipper owns the fd."""
        fds = self._chain.fds
        if len(fds) == 1:
            return fds[0]
        if self._whole is None:
            self._whole = payload.consolidate(fds)
        return self._whole

    def _drop_whole(self) -> None:
        if self._whole is not None:
            os.close(self._whole)
            self._whole = None

    def _dumps(self, obj: Any) -> tuple[bytes, set[int], list[pickle.PickleBuffer], list[int]]:
        out = io.BytesIO()
        pickler = _Pickler(out, self)
        try:
            pickler.dump(obj)
        except BaseException:
            for fd in pickler.shared:
                os.close(fd)
            raise
        return out.getvalue(), pickler.used, pickler.own, pickler.shared

    def _forget_new(self) -> None:
        new = {i for i, _ in self._new}
        self._known = {k: v for k, v in self._known.items() if v[0] not in new}
        self._new = []

    def close(self) -> None:
        self._chain.close()
        self._drop_whole()
        self._known = {}


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


# The modules _register_local_modules has looked at: name -> id of the module object.
_LOOKED_AT: dict[str, int] = {}


def _register_local_modules() -> None:
    """Pickle the script's own modules by value: a server need not be able to import
    them. A module is the script's if its file is outside the Python installation. The
    path is resolved (symlinks) only where it does not already name the installation:
    a trainer has a thousand modules, and resolving each took 35-65 ms a loader. Each
    module is looked at once (``ship`` runs at every ``iter()``: reading ``__file__`` of
    a thousand modules, some lazy, took 20-40 ms an epoch); only those imported since."""
    new = [(n, m) for n, m in list(sys.modules.items()) if _LOOKED_AT.get(n) != id(m)]
    if not new:
        return
    roots = _installed_roots()
    for name, module in new:
        _LOOKED_AT[name] = id(module)
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


def _dumps(obj: Any) -> None:
    """Pickle ``obj`` as a payload would (to find what does not pickle)."""
    for fd in Shipper()._dumps(obj)[3]:
        os.close(fd)


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """What ``obj`` holds, by the path a user reads: the items of a container, and the
    attributes of an object of the script's own classes (not of an installed library's,
    whose insides are not the user's: ``dataset.reads``, a ``multiprocessing.Value``,
    is named, not its lock's buffer)."""
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
    if _library_class(type(obj)):
        return
    for name, value in getattr(obj, "__dict__", {}).items():
        yield f".{name}", value
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            yield f".{name}", getattr(obj, name)


def _library_class(cls: type) -> bool:
    """Whether ``cls`` is the Python installation's (the standard library, an installed
    package), not the script's."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if module is None or cls.__module__ == "__main__":
        return False
    if not path:
        return True  # a builtin module's
    roots = _installed_roots()
    return _installed(os.path.abspath(path), roots)


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


def _unshippable(objects: dict[str, Any], exc: Exception) -> Unshippable:
    """The error for ``objects`` that did not pickle (``exc``): the attribute path that
    fails, what it is, and what to do."""
    found = None
    for name, obj in objects.items():
        found = _culprit(obj, name)
        if found is not None:
            break
    path, culprit, error = found if found is not None else ("the objects", objects, exc)
    return Unshippable(
        f"pinfeed.DataLoader cannot ship {path} (a {type(culprit).__name__}) to the "
        f"pinfeed server: {error}. The dataset, collate_fn and worker_init_fn go to the "
        "node's server by value, as DataLoader hands them to its workers; "
        f"{_advice(culprit)}",
        path=path,
    )
