"""A dataset's zygote: the one process that holds a dataset for the pool's workers,
which are forked from it and so inherit the dataset instead of building it.

The service starts one per dataset, when the first loader with workers needs it, and
stops it when the dataset is deleted. It is forked from the forkserver (torch and the
kinds already imported), gets the dataset, moves everything it holds to the
collector's permanent generation (``gc.freeze``: a collection in a worker never writes
to the inherited objects' headers) and then serves fork requests with
multiprocessing's own forkserver loop, so a worker is a ``multiprocessing`` process
like any other (pid, sentinel, exit code, kill) and starting one costs milliseconds.

How the zygote gets the dataset, by ``Kind.ship_build``:

- shipped: the server's build, pickled once (``images``: its shared arrays go as file
  descriptors, nothing is copied; ``python``: the user's object, one copy in the
  zygote, but for its memory-mapped arrays, which go as their files and are mapped
  again; an object that will not pickle is built by the zygote instead);
- built: the zygote builds it from (kind, params), once (kinds whose build only opens
  memory maps, whose pages are the same page cache for every process). A cached
  dataset (``pinfeed_server.cache``) is shipped either way: its cache's region as a file
  descriptor, its base by value or by build spec (``rebuilt_in_zygote``).

A worker started any other way (no zygote) builds the dataset from (kind, params)
itself: ``inherited`` falls back to that.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
from multiprocessing import connection, forkserver, popen_forkserver, reduction, resource_tracker
from multiprocessing import util as mp_util
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from pinfeed import payload as payload_format
from pinfeed import served
from pinfeed_server.cache import shipped as shipped_cache
from pinfeed_server.cache.region import Region
from pinfeed_server.datasets import KINDS, DatasetContext, build_dataset, shipped
from pinfeed_server.engine.producers.seeding import seed_rngs

log = logging.getLogger("pinfeed.workers")


def _reduce_memmap(obj: np.memmap[Any, Any]) -> Any:
    """A memory-mapped array in a dataset shipped to its zygote: as its file, as a
    trainer ships one (``pinfeed.payload.memmap_file``), not as its contents, which
    multiprocessing would copy into the zygote's heap (a nanoGPT-style token file of
    GBs: seconds of start and the file's size in memory); a view of one as data."""
    return payload_format.memmap_file(obj) or obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


# multiprocessing pickles what a process starts with (the zygote's dataset) with this
# pickler; the registration is by exact type, as np.memmap and np.load make them.
reduction.ForkingPickler.register(np.memmap, _reduce_memmap)

START_TIMEOUT_S = 120

# In a zygote and every worker forked from it: the dataset it holds.
HELD: Any = None
_HOLDING = False

_ZYGOTES: dict[str, Zygote] = {}  # key -> zygote, for ZygoteProcess._Popen


def inherited(kind: str, params: dict[str, Any], context: DatasetContext) -> Any:
    """The dataset a worker uses: its zygote's, or one built now (no zygote)."""
    if _HOLDING:
        return HELD
    return build_dataset(kind, params, context)


class _Fd:
    """A file descriptor that pickles (while a process starts) as a duplicate of itself."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_fd_of, (reduction.DupFd(self.fd),))


def _fd_of(dup: Any) -> int:
    return int(dup.detach())


def _main(listener: int, alive: int, payload: tuple[Any, ...], ready: Any) -> None:
    """The zygote process: get the dataset, say so, then fork workers on request."""
    global HELD, _HOLDING
    try:
        if payload[0] == "build":
            HELD = build_dataset(*payload[1:])
        elif payload[0] == "payload":  # a trainer's objects: load them from their memfds
            fds, shared, context = payload[1], payload[2], payload[4]
            served.install(lambda kind, params: build_dataset(kind, params, context))
            HELD = shipped.load(fds, shared)
            for fd in (*fds, *shared):
                os.close(fd)
            if served.served(HELD.dataset):  # built here, once, for every worker
                served.build(HELD.dataset)
            if payload[3] is not None:  # and the node's cache of their dataset, mapped
                HELD.dataset = shipped_cache.attached(HELD.dataset, payload[3], payload[4])
        else:
            HELD = payload[1]
        _HOLDING = True
    except BaseException as exc:
        ready.send_bytes(f"{type(exc).__name__}: {exc}".encode())
        return
    ready.send_bytes(b"")
    ready.close()
    del payload
    # What every worker does first, done once here so that what it creates lazily is
    # in the pages the workers share.
    seed_rngs(0, 0)
    gc.collect()
    gc.freeze()
    forkserver.main(listener, alive, [])


class _Server(forkserver.ForkServer):
    """multiprocessing's client side of a forkserver, pointed at a zygote."""

    def __init__(self, address: Any, alive_w: int, process: BaseProcess) -> None:
        super().__init__()
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w
        self._process = process

    def ensure_running(self) -> None:
        resource_tracker.ensure_running()
        if not self._process.is_alive():
            raise RuntimeError("the dataset's zygote is gone")


class _Popen(popen_forkserver.Popen):
    def __init__(self, process_obj: BaseProcess, server: _Server) -> None:
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: BaseProcess) -> None:
        # popen_forkserver.Popen._launch, with this zygote in place of the forkserver.
        prep_data = mp.spawn.get_preparation_data(process_obj._name)  # type: ignore[attr-defined]
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)
        close_fds = mp_util.close_fds  # type: ignore[attr-defined]
        self.finalizer = mp_util.Finalize(self, close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class ZygoteProcess(ForkServerProcess):
    """A process forked from the zygote named by ``_zygote_key``."""

    _zygote_key = ""

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _Popen:
        key = getattr(process_obj, "_zygote_key", "")
        return _Popen(process_obj, _ZYGOTES[key]._server)


class Zygote:
    """The process a dataset's workers are forked from (see the module docstring)."""

    def __init__(
        self,
        name: str,
        dataset: Any,
        kind: str,
        params: dict[str, Any],
        context: DatasetContext,
        payload: tuple[list[int], list[int]] | None = None,
        cache: Region | None = None,
    ) -> None:
        """``payload``: a trainer's objects (``datasets/shipped.py``: the fds of their
        payloads, and of the shared memory they map), which the zygote loads from their
        memfds itself, sharing their pages; ``cache``: the region of their dataset's cache
        (``cache/shipped.py``), mapped there too."""
        self.name = name
        self.key = f"{name}-{os.getpid()}-{id(self)}"
        build: tuple[Any, ...] = ("build", kind, params, context)
        rebuilt = getattr(dataset, "rebuilt_in_zygote", None)
        if callable(rebuilt):
            # A cached dataset: its base is built there, its cache goes along (mapped).
            build = ("ship", rebuilt())
        spec = KINDS.get(kind)
        ship = spec is not None and spec.ship_build
        self.shipped = False
        if payload is not None:
            fds, shared = ([_Fd(fd) for fd in fds] for fds in payload)
            self._start(("payload", fds, shared, cache, context))
            self.shipped = True
        elif ship:
            try:
                self._start(("ship", dataset))
                self.shipped = True
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                log.warning("dataset %s does not pickle (%s): its zygote builds its own", name, exc)
        if not self.shipped:
            self._start(build)
        _ZYGOTES[self.key] = self
        self._closed = False
        self._lock = threading.Lock()

    def _start(self, payload: tuple[Any, ...]) -> None:
        ctx = mp.get_context("forkserver")
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        alive_r, alive_w = os.pipe()
        ready_r, ready_w = ctx.Pipe(duplex=False)
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            process = ctx.Process(
                target=_main,
                args=(_Fd(listener.fileno()), _Fd(alive_r), payload, ready_w),
                name=f"pinfeed-zygote-{self.name}",
                daemon=True,
            )
            try:
                process.start()
            except BaseException:
                os.close(alive_w)
                os.unlink(address)
                raise
            finally:
                os.close(alive_r)
                ready_w.close()
        try:
            if not ready_r.poll(START_TIMEOUT_S):
                raise RuntimeError(f"did not start within {START_TIMEOUT_S} s")
            error = ready_r.recv_bytes().decode()
            if error:
                raise RuntimeError(error)
        except BaseException as exc:
            os.close(alive_w)
            process.kill()
            process.join(5)
            os.unlink(address)
            if isinstance(exc, EOFError):
                raise RuntimeError(f"exited (code {process.exitcode}) while starting") from None
            raise
        finally:
            ready_r.close()
        self.process = process
        self._address = address
        self._server = _Server(address, alive_w, process)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return not self._closed and self.process.is_alive()

    def process_factory(self, **kwargs: Any) -> BaseProcess:
        """``multiprocessing.Process(**kwargs)``, forked from this zygote (from the
        plain forkserver, building its own dataset, if the zygote is gone)."""
        if not self.alive():
            log.warning("dataset %s: its zygote is gone; a worker builds its own", self.name)
            return mp.get_context("forkserver").Process(**kwargs)
        proc = ZygoteProcess(**kwargs)
        proc._zygote_key = self.key
        return proc

    def close(self, timeout: float = 5.0) -> None:
        """Stop the zygote (it exits once the server and its workers let go); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _ZYGOTES.pop(self.key, None)
        os.close(self._server._forkserver_alive_fd)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1)
        with contextlib.suppress(OSError):
            os.unlink(self._address)


class Zygotes:
    """The service's zygotes, one per dataset (by name). Starting one (a dataset's
    unpickling or build) holds only that dataset's lock."""

    def __init__(self, context: DatasetContext) -> None:
        self._context = context
        self._lock = threading.Lock()  # the two dicts
        self._by_name: dict[str, Zygote] = {}
        self._starting: dict[str, threading.Lock] = {}

    def get(
        self,
        name: str,
        dataset: Any,
        kind: str,
        params: dict[str, Any],
        payload: tuple[list[int], list[int]] | None = None,
        cache: Region | None = None,
    ) -> Zygote:
        """``name``'s zygote, started now if it has none (or it died); RuntimeError if
        it cannot start. ``payload``, ``cache``: as ``Zygote``'s."""
        with self._lock:
            start = self._starting.setdefault(name, threading.Lock())
        with start:
            with self._lock:
                zygote = self._by_name.get(name)
            if zygote is not None and zygote.alive():
                return zygote
            if zygote is not None:
                zygote.close()
            try:
                zygote = Zygote(name, dataset, kind, params, self._context, payload, cache)
            except Exception as exc:
                raise RuntimeError(
                    f"dataset {name!r}: the process its workers fork from cannot start: {exc}"
                ) from None
            with self._lock:
                self._by_name[name] = zygote
            return zygote

    def discard(self, name: str) -> None:
        with self._lock:
            zygote = self._by_name.pop(name, None)
            self._starting.pop(name, None)
        if zygote is not None:
            zygote.close()

    def close(self) -> None:
        with self._lock:
            zygotes = list(self._by_name.values())
            self._by_name.clear()
        for zygote in zygotes:
            zygote.close()
