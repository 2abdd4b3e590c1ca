"""``Loader``: the trainer-side iterable over a pinfeed loader.

    loader = Loader("demo")                  # attach: ring fd + layout, mapped once
    for images, labels in loader:            # one epoch; iterate again for the next
        ...

Yields the same nested structure as DataLoader (tuple, list or dict of tensors).
Without ``copy`` or ``device`` the tensors are zero-copy views into the server's ring:
**a view stays valid until the next batch is requested**; keep data longer with
``copy=True`` (owned CPU tensors) or ``device="cuda"`` (a non_blocking copy on a
side stream; the slot is released once that copy's CUDA event has completed).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import select
import socket
import struct
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pinfeed import _protocol as p
from pinfeed._errors import (
    DataPlaneError,
    LoaderBusy,
    LoaderFailed,
    NotFound,
    ServerUnavailable,
    error_from_slug,
)
from pinfeed._info import (
    RemoteBatchSampler,
    RemoteDataset,
    RemoteSampler,
    read_attached,
    seeded_generator,
)
from pinfeed._ring import RingMapping

PIN_WARNING = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)

Builder = Callable[[list[Any]], Any]


def _lost(reason: str | None) -> ServerUnavailable:
    """The one error for a data-plane connection that broke, however it broke."""
    return ServerUnavailable(
        f"lost the pinfeed server ({reason or 'connection lost'}): it restarted or "
        "stopped; create a new Loader, or use Loader(reconnect=True)"
    )


def _builder(node: list[Any]) -> Builder:
    """Turn a treedef into a function from flat leaves to the nested batch."""
    tag, body = node
    if tag == "leaf":
        j = int(body)
        return lambda leaves: leaves[j]
    if tag == "dict":
        keys = [k for k, _ in body]
        subs = [_builder(c) for _, c in body]
        return lambda leaves: {k: f(leaves) for k, f in zip(keys, subs, strict=True)}
    if tag == "namedtuple":
        typename, fields, children = body
        cls = collections.namedtuple(typename, fields)  # type: ignore[misc]
        nsubs = [_builder(c) for c in children]
        return lambda leaves: cls(*(f(leaves) for f in nsubs))
    subs = [_builder(c) for c in body]
    if tag == "list":
        return lambda leaves: [f(leaves) for f in subs]
    return lambda leaves: tuple(f(leaves) for f in subs)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, list):
        return [_map_tensors(v, fn) for v in batch]
    if isinstance(batch, tuple):
        return tuple(_map_tensors(v, fn) for v in batch)
    return batch


class Loader:
    """Attach to loader ``name`` on the node's pinfeed server.

    ``socket`` defaults to ``PINFEED_SOCKET``, then the server's default path.
    ``device``: copy each batch there (``non_blocking`` on a copy stream).
    ``copy``: yield owned CPU tensors instead of views into the ring.
    ``timeout``: seconds to wait for one batch before raising ``TimeoutError``.
    ``member``: this process's index in the loader's consumer group (default: the
    lowest free one); a member that reconnects with its index resumes where it was.
    ``reconnect``: if the server restarts, re-attach (retrying for up to
    ``reconnect_timeout`` seconds) and continue from this loader's ``state_dict()``.
    """

    # Accelerate: ``accelerator.prepare_data_loader(loader)`` hands back an object marked
    # prepared as it is and tracks it; ``save_state``/``load_state`` then store and
    # restore ``state_dict()`` of a tracked loader marked stateful (as StatefulDataLoader).
    _is_accelerate_prepared = True
    use_stateful_dataloader = True

    def __init__(
        self,
        name: str,
        *,
        socket: str | os.PathLike[str] | None = None,
        device: str | torch.device | None = None,
        copy: bool = False,
        timeout: float | None = 600.0,
        member: int | None = None,
        reconnect: bool = False,
        reconnect_timeout: float = 60.0,
    ) -> None:
        self.name = name
        self.socket_path = Path(socket) if socket is not None else p.default_socket_path()
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} was asked for, but CUDA is not available")
        self.copy = copy
        self.member = member
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self._timeout = timeout
        self._timeout_ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
        self._pos = (0, 0)  # (epoch, index) of the next batch this loader will yield
        self._want_epoch: int | None = None  # set_epoch's, applied at an epoch's first next()
        self._loaded_epoch: int | None = None  # load_state_dict placed us inside this epoch
        self._epoch_batches = 0  # batches received in the epoch being iterated
        self._ahead = False  # a NEXT is in flight (see _next)
        self._wait_us = 0  # how long the last batch kept the trainer waiting
        self._buf = bytearray(p.MAX_MESSAGE)
        self._view = memoryview(self._buf)
        self._release: list[int] = []  # slots to hand back with the next message
        self._pending: list[tuple[int, torch.cuda.Event]] = []  # (slot, copy done)
        self._in_epoch = False
        self._epoch_id = 0  # which Epoch iterator is current; older ones are exhausted
        self._closed = False
        self._ring: RingMapping | None = None
        self._fds: list[int] = []
        self._sock = p.new_socket()
        try:
            self._attach()
        except BaseException:
            self._sock.close()
            raise

    # -- attach ----------------------------------------------------------------------
    def _attach(self) -> None:
        try:
            self._sock.connect(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ServerUnavailable(
                f"no pinfeed server at {self.socket_path} ({exc.strerror}); start one with "
                "`pinfeed serve` or set PINFEED_SOCKET"
            ) from None
        self._sock.settimeout(None)  # see _recv
        self._readable = select.poll()
        self._readable.register(self._sock, select.POLLIN)
        self._sock.send(
            p.encode_json(
                p.ATTACH,
                {"loader": self.name, "version": p.PROTOCOL_VERSION, "member": self.member},
            )
        )
        n = self._recv(with_fds=True)
        fds = self._fds
        if self._buf[0] != p.ATTACHED or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self._raise(n)
        self.meta = p.decode_json(self._view[:n])
        info = self._info = read_attached(self.meta)
        self.member = info.member
        self._pos = (info.epoch, info.position)
        self._ring = RingMapping(fds[0], info.ring_bytes)
        self.nslots = info.nslots
        self.slot_bytes = info.slot_bytes
        self._sampler = RemoteSampler(info, self.set_epoch)
        layout = info.layout
        self._leaves = [
            (
                leaf["offset"],
                getattr(torch, leaf["dtype"]) if leaf["kind"] == "tensor" else None,
                len(leaf["shape"]) + 1,
            )
            for leaf in layout["leaves"]
        ]
        self._ndims = sum(nd for _, dt, nd in self._leaves if dt is not None)
        self._dims = struct.Struct(f"<{self._ndims}q")
        self._build = _builder(layout["treedef"])
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        # Per (slot, dims): the batch's leaf views, built once. Each batch hands out
        # detach()ed aliases of them: new tensor objects (a trainer may reshape its own
        # in place), for a quarter of the cost of as_strided, and far less when the
        # trainer's step has left the caches cold.
        self._views: dict[tuple[int, tuple[int, ...]], list[torch.Tensor]] = {}
        if self.pin_memory:
            if torch.cuda.is_available():
                self._ring.register_cuda()
                self._sock.send(bytes([p.CUDA]))
            else:
                warnings.warn(PIN_WARNING, stacklevel=3)
        if self.device is not None and self.device.type == "cuda":
            self._stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        else:
            self._stream = None

    def _recv(self, *, with_fds: bool = False) -> int:
        """Receive one reply into the buffer; its length. Only ATTACHED carries fds
        (kept in ``self._fds``); every other reply takes a plain ``recv_into``.

        The socket is blocking without a Python timeout (which would add a poll before
        every recv and send): a reply already here takes one non-blocking recv; else
        ``_wait_recv`` polls with the loader's timeout, then receives."""
        if not with_fds:
            n = self._try_recv()
            if n is not None:
                return n
        return self._wait_recv(with_fds=with_fds)

    def _wait_recv(self, *, with_fds: bool = False) -> int:
        try:
            ready = self._readable.poll(self._timeout_ms)
            if ready and with_fds:
                n, self._fds = p.recv_message(self._sock, self._buf)
            elif ready:
                n = self._sock.recv_into(self._buf)
        except OSError as exc:
            raise _lost(exc.strerror) from None
        if not ready:
            raise TimeoutError(
                f"no batch from loader {self.name!r} within {self._timeout} s; check "
                "its stats (GET /v1/loaders/{name}/stats) or raise Loader(timeout=...)"
            )
        return self._check_eof(n)

    def _try_recv(self) -> int | None:
        """A reply if one is already here (one syscall), else None."""
        try:
            n = self._sock.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise _lost(exc.strerror) from None
        return self._check_eof(n)

    @staticmethod
    def _check_eof(n: int) -> int:
        if n == 0:
            raise _lost("it closed the connection")
        return n

    def _raise(self, n: int) -> None:
        if self._buf[0] == p.ERROR:
            info = p.decode_json(self._view[:n])
            if "batch_index" in info:  # a failed batch counts as consumed, as in DataLoader
                epoch, index = int(info["epoch"]), int(info["batch_index"])
                self._pos = (epoch, index + 1) if index + 1 < len(self) else (epoch + 1, 0)
            slug = str(info.pop("type", "data-plane"))
            detail = str(info.pop("detail", "error"))
            raise error_from_slug(slug, detail, **info)
        raise DataPlaneError(f"unexpected message kind {self._buf[0]} from the server")

    # -- iteration ---------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        return self._info.batches_per_epoch

    def __iter__(self) -> Epoch:
        """An iterator over the next epoch; it costs nothing until its first ``next()``,
        which starts the epoch. An iterator that is never consumed (Lightning's
        ``iter()`` probe) starts nothing and skips nothing.

        Every ``for`` loop is a fresh epoch, as with DataLoader: a newer ``iter()`` ends
        the older iterators, and if the last epoch was left unfinished, its rest is
        skipped when the new one starts. The iterator is an iterator: ``it =
        iter(loader); next(it); for batch in it:`` continues the same epoch."""
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._epoch_id += 1
        return Epoch(self, self._epoch_id)

    def _begin_epoch(self, epoch_id: int) -> None:
        """An iterator's first ``next()``: move to the epoch it iterates."""
        if self._closed:
            raise RuntimeError("this Loader is closed")
        if epoch_id != self._epoch_id:
            raise StopIteration  # a newer iter(loader) exists
        try:
            self._start_epoch()
        except ServerUnavailable:
            if not self.reconnect:
                raise
            self._reconnect()
            self._start_epoch()
        self._loaded_epoch = None
        self._in_epoch = True
        self._epoch_batches = 0

    def _start_epoch(self) -> None:
        if self._want_epoch is not None:
            epoch = self._want_epoch
            if self._in_epoch or self._pos != (epoch, 0):
                self._seek(epoch, 0)
            self._want_epoch = None
        elif self._in_epoch:
            self._skip_epoch()

    # -- epochs and resume ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next epoch to start iterates ``epoch`` (as ``DistributedSampler.set_epoch``):
        called before or after ``iter(loader)``, it applies to that iterator if its first
        ``next()`` has not come yet. ``loader.sampler.set_epoch`` is the same call.

        Free when the loader is already there (the usual loop): prefetched batches stay.
        After ``load_state_dict`` into epoch e, ``set_epoch(e)`` keeps the loaded
        position (Lightning and Accelerate call it after restoring a checkpoint).
        """
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        self._want_epoch = None if epoch == self._loaded_epoch else epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a new Loader that loads it yields the next batch on.

        Same meaning as StatefulDataLoader's: after k batches of an epoch, the
        resumed loader's first batch is batch k (0-based) of that epoch.
        """
        self._check_resumable()
        epoch, index = self._pos
        return {"version": 1, "loader": self.name, "epoch": epoch, "index": index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``for`` loop yields the rest of that epoch."""
        self._check_resumable()
        if state.get("loader") not in (None, self.name):
            raise ValueError(f"state is for loader {state.get('loader')!r}, not {self.name!r}")
        self._seek(int(state["epoch"]), int(state["index"]))
        self._loaded_epoch = self._pos[0]
        self._want_epoch = None

    def _check_resumable(self) -> None:
        if self._info.group_mode == "split" and self._info.group_size > 1:
            raise RuntimeError(
                "state_dict/load_state_dict need a plain or broadcast loader; split groups "
                "resume at epoch boundaries with set_epoch"
            )

    def _seek(self, epoch: int, index: int) -> None:
        self._drain()
        self._send_next(p.SEEK, p.POSITION_BODY.pack(p.SEEK, epoch, index))
        n = self._recv()
        if self._buf[0] != p.POSITION:
            self._raise(n)
        _, e, i = p.POSITION_BODY.unpack_from(self._buf)
        self._pos = (e, i)
        self._in_epoch = False

    def _next_in_epoch(self, epoch_id: int) -> Any:
        if not self._in_epoch or epoch_id != self._epoch_id:
            raise StopIteration
        batch = self._next()
        if batch is None:
            self._in_epoch = False
            raise StopIteration
        return batch

    def _send_next(self, kind: int, message: bytes | None = None) -> None:
        if self._pending:
            self._collect_copies()
        release_first = message is not None and bool(self._release)
        if message is None:
            # Releases and the trainer's last wait ride along.
            message = p.encode_release(kind, self._release, self._wait_us)
            self._wait_us = 0
        try:
            if release_first:
                self._sock.send(p.encode_release(p.RELEASE, self._release))
            self._sock.send(message)
        except OSError as exc:
            raise _lost(exc.strerror) from None
        self._release.clear()

    def _collect_copies(self) -> None:
        # Release slots whose device copy has finished; block on the oldest only when
        # we would otherwise hold so many slots that the server could not prefetch.
        hold = max(1, self.nslots - 1)
        while self._pending:
            done = self._pending[0][1].query()  # type: ignore[no-untyped-call]
            if not done and len(self._pending) < hold:
                break
            slot, event = self._pending.pop(0)
            event.synchronize()
            self._release.append(slot)

    def _next(self) -> Any:
        """The next batch, or None at the end of the epoch.

        One NEXT is kept in flight: it is sent as soon as a batch arrives, so while the
        trainer works on batch k the server already announces k+1, and a ready batch
        is in this socket's buffer when the trainer asks (no server wake-up on the
        critical path). Still one send and one recv per batch.
        """
        asked = time.perf_counter_ns()
        try:
            if not self._ahead:
                self._send_next(p.NEXT)
                n = self._recv()
            else:
                # Fast path: the batch asked for last time is already here. Otherwise we
                # are about to wait: hand back the last view's slot first, so the server
                # can produce into it (a group member must never hold and wait).
                ready = self._try_recv()
                if ready is None:
                    if self._release or self._pending:
                        self._send_next(p.RELEASE)
                    ready = self._wait_recv()
                n = ready
            self._wait_us = (time.perf_counter_ns() - asked) // 1000
            self._ahead = False
            kind = self._buf[0]
            if kind == p.BATCH or (kind == p.ERROR and self._buf.find(b'"batch_index"', 0, n) > 0):
                # Ask for the following item now; this releases the previous view's slot.
                self._send_next(p.NEXT)
                self._ahead = True
        except ServerUnavailable:
            if not self.reconnect:
                raise
            self._reconnect()
            if self._epoch_batches and self._pos[1] == 0:
                return None  # the epoch's last batch came before the crash; its END did not
            return self._next()
        if kind == p.END:
            self._pos = (p.END_BODY.unpack_from(self._buf)[1] + 1, 0)
            return None
        if kind != p.BATCH:
            self._raise(n)
        _, slot, _seq, epoch, index, nstr = p.BATCH_HEAD.unpack_from(self._buf)
        self._epoch_batches += 1
        self._pos = (epoch, index + 1) if index + 1 < len(self) else (epoch + 1, 0)
        dims = self._dims.unpack_from(self._buf, p.BATCH_HEAD.size)
        strings = None
        if nstr:
            start = p.BATCH_HEAD.size + self._dims.size
            strings = iter(json.loads(bytes(self._view[start : start + nstr])))
        batch = self._build(self._leaves_for(slot, dims, strings))
        return self._deliver(slot, batch)

    def _leaves_for(self, slot: int, dims: tuple[int, ...], strings: Any) -> list[Any]:
        if strings is None:
            key = (slot, dims)
            views = self._views.get(key)
            if views is None:
                if len(self._views) >= 4 * self.nslots:
                    self._views.clear()  # many batch lengths: keep the cache bounded
                views = self._views[key] = self._make_leaves(slot, dims, None)
            return [v.detach() for v in views]
        return self._make_leaves(slot, dims, strings)

    def _make_leaves(self, slot: int, dims: tuple[int, ...], strings: Any) -> list[Any]:
        assert self._ring is not None
        out: list[Any] = []
        base = slot * self.slot_bytes
        d = 0
        for offset, dtype, ndim in self._leaves:
            if dtype is None:
                out.append(next(strings))
                continue
            shape = dims[d : d + ndim]
            d += ndim
            stride = self._strides.get(shape)
            if stride is None:
                stride = self._strides[shape] = tuple(
                    math.prod(shape[i + 1 :]) for i in range(len(shape))
                )
            typed = self._ring.typed(dtype)
            out.append(torch.as_strided(typed, shape, stride, (base + offset) // dtype.itemsize))
        return out

    def _deliver(self, slot: int, batch: Any) -> Any:
        if self._stream is not None:
            assert self.device is not None
            current = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                out = _map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            current.wait_event(event)
            for t in _tensors(out):
                # The trainer uses these on its own stream: keep the allocator from
                # recycling them until that stream is done with them.
                t.record_stream(current)
            self._pending.append((slot, event))
            return out
        if self.copy:
            out = _map_tensors(batch, torch.Tensor.clone)
            self._release.append(slot)
            return out
        self._release.append(slot)  # handed back with the next NEXT: the view lives until then
        return batch

    def _drain(self) -> bool:
        """Read the reply to the NEXT in flight; True if it ended the epoch."""
        if not self._ahead:
            return False
        self._ahead = False
        self._recv()
        kind = self._buf[0]
        if kind == p.BATCH:
            self._release.append(p.BATCH_HEAD.unpack_from(self._buf)[1])  # never yielded
        elif kind == p.END:
            self._pos = (p.END_BODY.unpack_from(self._buf)[1] + 1, 0)
            return True
        return False

    def _skip_epoch(self) -> None:
        if self._drain():
            self._in_epoch = False
            return
        self._send_next(p.SKIP)
        n = self._recv()
        if self._buf[0] != p.END:
            self._raise(n)
        self._pos = (p.END_BODY.unpack_from(self._buf)[1] + 1, 0)
        self._in_epoch = False

    def _reconnect(self) -> None:
        """Re-attach after a server restart and seek to where this loader was."""
        for _, event in self._pending:
            event.synchronize()
        self._pending.clear()
        self._drop_connection()
        position, in_epoch = self._pos, self._in_epoch
        self._ahead = False
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            self._sock = p.new_socket()
            try:
                self._attach()
                break
            except (ServerUnavailable, NotFound, LoaderFailed, LoaderBusy) as exc:
                self._sock.close()
                if time.monotonic() + delay > deadline:
                    raise ServerUnavailable(
                        f"the pinfeed server restarted and loader {self.name!r} could not be "
                        f"re-attached within {self.reconnect_timeout} s: {exc}"
                    ) from None
                time.sleep(delay)  # the server is restarting: nothing to wait on but time
                delay = min(delay * 2, 1.0)
        self._seek(*position)
        self._in_epoch = in_epoch

    # -- DataLoader's attributes (read-only, from the config the server sent at attach) --
    @property
    def batch_size(self) -> int:
        return int(self._info.config["batch_size"])

    @property
    def drop_last(self) -> bool:
        return bool(self._info.config["drop_last"])

    @property
    def num_workers(self) -> int:
        """The server's worker processes for this loader (at attach)."""
        return int(self._info.config["num_workers"])

    @property
    def prefetch_factor(self) -> int | None:
        """Batches ahead per worker; None without workers, as with DataLoader."""
        return int(self._info.config["prefetch_factor"]) if self.num_workers else None

    @property
    def persistent_workers(self) -> bool:
        """The server's workers outlive every epoch."""
        return self.num_workers > 0

    @property
    def pin_memory(self) -> bool:
        return bool(self._info.config["pin_memory"])

    @property
    def timeout(self) -> float:
        """Seconds to wait for a batch before TimeoutError (0: forever, as DataLoader)."""
        return 0.0 if self._timeout is None else float(self._timeout)

    @property
    def dataset(self) -> RemoteDataset:
        info = self._info
        return RemoteDataset(str(info.config["dataset"]), info.dataset_length, info.sample)

    @property
    def sampler(self) -> RemoteSampler:
        return self._sampler

    @property
    def batch_sampler(self) -> RemoteBatchSampler:
        return RemoteBatchSampler(self._sampler, self.batch_size, len(self))

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """What the server applies (collating straight into the slot)."""
        return torch.utils.data.default_collate

    @property
    def generator(self) -> torch.Generator | None:
        """A generator that makes DataLoader shuffle as this loader does (a new one each
        time); None where DataLoader's would not matter."""
        return seeded_generator(self._info.config)

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def cuda_registered(self) -> bool:
        return bool(self._ring and self._ring.cuda_registered)

    def ring_contains(self, t: torch.Tensor) -> bool:
        """True if ``t``'s memory lies inside this loader's ring (a zero-copy view)."""
        return bool(self._ring and self._ring.contains(t))

    def close(self) -> None:
        """Detach: hand back every slot, close the socket, unmap once no view is alive."""
        if self._closed:
            return
        self._closed = True
        for slot, event in self._pending:
            event.synchronize()
            self._release.append(slot)
        self._pending.clear()
        try:
            if self._release:
                self._sock.send(p.encode_release(p.RELEASE, self._release))
        except OSError:
            pass
        self._drop_connection()

    def _drop_connection(self) -> None:
        """Forget unsent releases, close the socket, and unmap the ring (parked until
        the trainer's last view of it is gone)."""
        self._release.clear()
        self._sock.close()
        if self._ring is not None:
            self._views.clear()
            self._ring.close()
            self._ring = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()


class Epoch:
    """One epoch of a ``Loader``: what ``iter(loader)`` returns. Its ``__iter__`` is
    itself (the iterator protocol); it starts its epoch at its first ``next()`` and ends
    at the epoch's end, or once a newer ``iter(loader)`` exists."""

    __slots__ = ("_id", "_loader", "_started")

    def __init__(self, loader: Loader, epoch_id: int) -> None:
        self._loader = loader
        self._id = epoch_id
        self._started = False

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> Any:
        if not self._started:
            self._loader._begin_epoch(self._id)
            self._started = True
        return self._loader._next_in_epoch(self._id)

    def __len__(self) -> int:
        return len(self._loader)
