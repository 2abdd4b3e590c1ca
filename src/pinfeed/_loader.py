"""``Loader``: the trainer-side iterable over a pinfeed loader.

    loader = Loader("demo")                  # attach: ring fd + layout, mapped once
    for images, labels in loader:            # one epoch; iterate again for the next
        ...

Yields the same nested structure as DataLoader (tuple, list or dict of tensors).
Without ``copy`` or ``device`` the tensors are zero-copy views into the server's ring:
**a view stays valid until the next batch is requested**; keep data longer with
``copy=True`` (owned CPU tensors) or ``device="cuda"`` (a non_blocking copy on a
side stream; the slot is released once that copy's CUDA event has completed).

Its epochs are a small state machine (``pinfeed._epochs``) over a ``Transport``
(``pinfeed._transport``); ``pinfeed._views`` turns BATCH messages into batches and
``pinfeed._info`` reads the ATTACHED reply and stands in for DataLoader's attributes.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import torch

from pinfeed import protocol as p
from pinfeed._epochs import Epochs, State
from pinfeed._info import DataLoaderAttributes, RemoteSampler
from pinfeed._ring import RingMapping, RingSegments
from pinfeed._transport import SocketTransport, Transport, close_fds
from pinfeed._views import BatchViews, Delivery
from pinfeed.errors import (
    LoaderBusy,
    LoaderFailed,
    NotFound,
    ServerUnavailable,
)

PIN_WARNING = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)


class Loader(Epochs, DataLoaderAttributes):
    """Attach to loader ``name`` on the node's pinfeed server.

    ``socket`` defaults to ``PINFEED_SOCKET``, then the server's default path.
    ``device``: copy each batch there (``non_blocking`` on a copy stream).
    ``copy``: yield owned CPU tensors instead of views into the ring.
    ``timeout``: seconds to wait for one batch before raising ``TimeoutError``.
    ``member``: this process's index in the loader's consumer group (default: the
    lowest free one); a member that reconnects with its index resumes where it was.
    ``reconnect``: if the server restarts, re-attach (retrying for up to
    ``reconnect_timeout`` seconds) and continue from this loader's ``state_dict()``.
    ``transport``: the data-plane connection (default: the Unix socket); tests pass
    an in-process fake.
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
        transport: Transport | None = None,
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
        self._state = State.IDLE
        self._pos = (0, 0)  # (epoch, index) of the next batch this loader will yield
        self._want_epoch: int | None = None  # set_epoch's, applied at an epoch's first next()
        self._loaded_epoch: int | None = None  # load_state_dict placed us inside this epoch
        self._epoch_id = 0  # which Epoch iterator is current; older ones are exhausted
        self._epoch_batches = 0  # batches received in the epoch being iterated
        self._wait_us = 0  # how long the last batch kept the trainer waiting
        self._t = transport or SocketTransport(self.socket_path, timeout, name)
        self._buf = self._t.buf
        self._ring: RingMapping | None = None
        try:
            self._attach()
        except BaseException:
            self._state = State.CLOSED
            self._t.close()
            raise

    @property
    def state(self) -> str:
        """idle (between epochs), epoch / ahead (inside one), or closed."""
        return self._state.value

    # -- attach ----------------------------------------------------------------------
    def _attach(self) -> None:
        n, fds = self._t.attach(p.Attach(self.name, self.member).encode())
        if self._buf[0] != p.ATTACHED or len(fds) != 1:
            close_fds(fds)
            self._t.close()
            self._raise(n)
        info = self.meta = self._info = p.Attached.decode(memoryview(self._buf)[:n])
        self.member = info.member
        self._pos = (info.epoch, info.position)
        self._ring = RingMapping(fds[0], info.ring_bytes)
        self._segments = RingSegments(self._ring, info.nslots, info.slot_bytes)
        self.nslots = info.nslots
        self.slot_bytes = info.slot_bytes
        self._sampler = RemoteSampler(info, self.set_epoch)
        self._views = BatchViews(self._segments, info.layout, info.nslots, info.slot_bytes)
        self._delivery = Delivery(self.device, self.copy, info.nslots)
        if self.pin_memory:
            if torch.cuda.is_available():
                self._ring.register_cuda()
                self._segments.cuda = True
                self._t.send(bytes([p.CUDA]))
            else:
                warnings.warn(PIN_WARNING, stacklevel=3)

    def _segment(self, n: int) -> None:
        _, segment, first, nslots = p.SEGMENT_BODY.unpack_from(self._buf)
        self._views.clear()  # cached views of a closed segment's slots must go
        self._segments.update(segment, first, nslots, self._t.take_fds())

    def _reconnect(self) -> None:
        """Re-attach after a server restart and seek to where this loader was."""
        self._delivery.finish_copies()
        self._drop_connection()
        position, in_epoch = self._pos, self._state is not State.IDLE
        self._state = State.IDLE  # the NEXT in flight, if any, went with the connection
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                self._attach()
                break
            except (ServerUnavailable, NotFound, LoaderFailed, LoaderBusy) as exc:
                if time.monotonic() + delay > deadline:
                    raise ServerUnavailable(
                        f"the pinfeed server restarted and loader {self.name!r} could not be "
                        f"re-attached within {self.reconnect_timeout} s: {exc}"
                    ) from None
                time.sleep(delay)  # the server is restarting: nothing to wait on but time
                delay = min(delay * 2, 1.0)
        self._seek(*position)
        if in_epoch:
            self._state = State.EPOCH

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def cuda_registered(self) -> bool:
        return bool(self._ring and self._ring.cuda_registered)

    def ring_contains(self, t: torch.Tensor) -> bool:
        """True if ``t``'s memory lies inside this loader's ring (a zero-copy view)."""
        return bool(self._ring and self._segments.contains(t))

    def close(self) -> None:
        """Detach: hand back every slot, close the socket, unmap once no view is alive."""
        if self._state is State.CLOSED:
            return
        self._state = State.CLOSED
        self._delivery.finish_copies()
        with contextlib.suppress(ServerUnavailable):
            if self._delivery.release:
                self._t.send(p.encode_release(p.RELEASE, self._delivery.release))
        self._drop_connection()

    def _drop_connection(self) -> None:
        """Forget unsent releases, close the socket, and unmap the ring (parked until
        the trainer's last view of it is gone)."""
        self._delivery.release.clear()
        self._t.close()
        if self._ring is not None:
            self._views.clear()
            self._segments.close_extra()
            self._ring.close()
            self._ring = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", State.CLOSED) is not State.CLOSED:
            with contextlib.suppress(Exception):
                self.close()
