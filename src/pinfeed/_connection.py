"""A ``Loader``'s link to its loader on the server: one attach, and the attaches after a
restart.

``Connection`` owns the ``Transport``, the ATTACHED reply (``info``), the ring as this
process maps it (segment 0 from ATTACHED, further segments from SEGMENT messages),
the views over its slots and the delivery of batches (``pinfeed._views``), and the
slots on their way back. It sends and receives; what to send when is the epoch state
machine's (``pinfeed._epochs``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pinfeed import protocol as p
from pinfeed import rng
from pinfeed._ring import RingMapping, RingSegments
from pinfeed._transport import Transport, close_fds
from pinfeed._views import BatchViews, Delivery
from pinfeed.errors import (
    DataPlaneError,
    LoaderBusy,
    LoaderFailed,
    NotFound,
    PinfeedError,
    ServerUnavailable,
    error_from_info,
)

PIN_WARNING = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)

_SEGMENT = p.SEGMENT
_AHEAD = (p.SEGMENT, p.RNG, p.RING)  # messages that come ahead of the item they are about


class Connection:
    """Attached to loader ``name`` as group ``member`` (None: the lowest free one, then
    the one the server gave) over ``transport``; batches delivered to ``device`` or as
    ``copy`` (``Delivery``). Constructing it attaches; ``reconnect`` attaches again."""

    # Set by each attach; one attach's ring, views and delivery go together.
    info: p.Attached
    # segment 0; None once the connection is dropped, or until a RING brings it (a
    # pinfeed.DataLoader's loader is attached before its ring is sized)
    ring: RingMapping | None
    segments: RingSegments
    views: BatchViews
    delivery: Delivery

    def __init__(
        self,
        transport: Transport,
        name: str,
        member: int | None,
        device: torch.device | None,
        copy: bool,
        request: Callable[[], tuple[bytes, Sequence[int]]] | None = None,
        keep: bool = False,
    ) -> None:
        """``request()``: the first message and the fds that go with it (default: an
        ATTACH of ``name`` as ``member``; ``pinfeed.DataLoader``'s is a CREATE).
        ``keep``: a batch's slot goes back once the trainer no longer holds the batch
        (``pinfeed.DataLoader``'s: DataLoader's batches live as long as they are held),
        not with the next message (``pinfeed.Loader``'s views)."""
        self.name = name
        self.member = member
        self._request = request or (lambda: (p.Attach(self.name, self.member).encode(), ()))
        self.device = device
        self.copy = copy
        self.buf = transport.buf  # every reply lands here
        self.wait_us = 0  # the trainer's last wait for a batch, not yet reported
        self.keep = keep
        # The RNG states the last batch made on the trainer's left: those sent with its
        # FEED, or those an RNG message brought (only where the batch moved them).
        self.rng_after = b""
        self._t = transport
        self.ring = None
        try:
            self._attach(stacklevel=4)  # a warning names the Loader(...) call
        except BaseException:
            transport.close()
            raise

    def _attach(self, stacklevel: int) -> None:
        """Send ATTACH and map what ATTACHED gives; ``stacklevel``: where a warning
        points, counted from here."""
        t, buf = self._t, self.buf
        n, fds = t.attach(*self._request())
        info = None
        if buf[0] == p.ATTACHED:
            info = p.Attached.decode(memoryview(buf)[:n])
        if info is None or len(fds) != (1 if info.ring_bytes else 0):
            close_fds(fds)
            t.close()
            raise self.failure(n)
        self.info = info
        self.name, self.member = info.loader, info.member
        self.views = BatchViews(None, None, 0, t.take_fds)
        self.delivery = Delivery(self.device, self.copy, info.nslots, self.keep)
        self.ring = None
        if info.layout is not None:  # else a RING brings the ring, once it is sized
            self._map_ring(fds[0], info.nslots, info.slot_bytes, info.layout)
        if info.config.pin_memory and not torch.cuda.is_available():
            warnings.warn(PIN_WARNING, stacklevel=stacklevel)

    def _map_ring(self, fd: int, nslots: int, slot_bytes: int, layout: p.Layout) -> None:
        """Map the ring (segment 0's memfd ``fd``), page-locked for CUDA where the loader
        pins memory and a GPU is here."""
        ring = self.ring = RingMapping(fd, nslots * slot_bytes)
        self.segments = RingSegments(ring, nslots, slot_bytes)
        self.views.set_ring(self.segments, layout, slot_bytes)
        if self.info.config.pin_memory and torch.cuda.is_available():
            ring.register_cuda()
            self.segments.cuda = True
            self._t.send(bytes([p.CUDA]))

    def reconnect(self, timeout: float) -> None:
        """Attach again after the server restarted, retrying for up to ``timeout`` s;
        the slots and views of the old attach are let go."""
        self.delivery.finish_copies()
        self._drop()
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                self._attach(stacklevel=2)
                return
            except (ServerUnavailable, NotFound, LoaderFailed, LoaderBusy) as exc:
                if time.monotonic() + delay > deadline:
                    raise ServerUnavailable(
                        f"the pinfeed server restarted and loader {self.name!r} could not be "
                        f"re-attached within {timeout} s: {exc}"
                    ) from None
                time.sleep(delay)  # the server is restarting: nothing to wait on but time
                delay = min(delay * 2, 1.0)

    # -- receiving: SEGMENT messages come ahead of the item that may use them -----------
    def recv(self) -> int:
        """Wait for the next reply (not a SEGMENT, RING or RNG: those are applied on the
        way)."""
        n = self._t.recv()
        while self.buf[0] in _AHEAD:
            self._ahead(n)
            n = self._t.recv()
        return n

    def try_recv(self) -> int | None:
        """The next reply if one is here already, else None (never waits)."""
        n = self._t.try_recv()
        if n is not None and self.buf[0] in _AHEAD:
            self._ahead(n)
            return self.recv()  # the item it came ahead of is right behind it
        return n

    def _ahead(self, n: int) -> None:
        if self.buf[0] == _SEGMENT:
            self._segment()
            return
        if self.buf[0] == p.RING:  # the ring, sized from the first batches
            info = p.RingInfo.decode(memoryview(self.buf)[:n])
            fds = self._t.take_fds()
            if len(fds) != 1 or self.ring is not None:
                close_fds(fds)
                raise DataPlaneError("a RING carries one memfd, to a loader without a ring")
            self._map_ring(fds[0], info.nslots, info.slot_bytes, info.layout)
            return
        # RNG: the trainer's RNG states after the batch that follows, made on them in
        # the server (a pinfeed.DataLoader without workers: DataLoader makes its batches
        # in the trainer, on its RNGs).
        (_, size) = p.RNG_HEAD.unpack_from(self.buf)
        self.rng_after = bytes(self.buf[p.RNG_HEAD.size : p.RNG_HEAD.size + size])
        rng.load_state(self.rng_after)

    def _segment(self) -> None:
        """The ring grew or shrank: map the new segment, or let a closed one go."""
        _, segment, first, nslots = p.SEGMENT_BODY.unpack_from(self.buf)
        self.views.clear()  # cached views of a closed segment's slots must go
        self.segments.update(segment, first, nslots, self._t.take_fds())

    def error(self, n: int) -> p.ErrorInfo | None:
        """The ERROR of length ``n`` in ``buf``; None if the reply is no ERROR."""
        if self.buf[0] != p.ERROR:
            return None
        return p.ErrorInfo.decode(memoryview(self.buf)[:n])

    def failure(self, n: int) -> PinfeedError:
        """The exception for a reply of length ``n`` that is not the one expected."""
        info = self.error(n)
        if info is None:
            return DataPlaneError(f"unexpected message kind {self.buf[0]} from the server")
        return error_from_info(info)

    # -- sending: the slots waiting to go back ride along --------------------------------
    def send(self, kind: int) -> None:
        """A NEXT, RELEASE or SKIP, handing back the slots the trainer is done with and
        reporting its last wait."""
        self._t.send(self.release_message(kind))

    def release_message(self, kind: int) -> bytes:
        """The NEXT, RELEASE or SKIP ``send`` sends (the slots it hands back are taken):
        to send now, or inside another message (a FEED's NEXT)."""
        delivery = self.delivery
        if delivery.pending:
            delivery.collect_copies()
        if delivery.held:
            delivery.collect_held()
        release = delivery.release
        message = p.encode_release(kind, release, self.wait_us)
        self.wait_us = 0
        release.clear()
        return message

    def send_message(self, message: bytes) -> None:
        """Any other message (a SEEK); the slots to hand back go first, in a RELEASE."""
        delivery = self.delivery
        if delivery.pending:
            delivery.collect_copies()
        if delivery.held:
            delivery.collect_held()
        release = delivery.release
        if release:
            self._t.send(p.encode_release(p.RELEASE, release))
        self._t.send(message)
        release.clear()

    def send_objects(self, epoch: int, fds: list[int]) -> None:
        """The objects from ``epoch`` on (an OBJECTS): the payload's memfd, then the
        shared memory its objects map."""
        self._t.send_fds(p.encode_objects(epoch), fds)

    def send_plain(self, message: bytes) -> None:
        """A message that hands nothing back (a FEED: the slots wait for the NEXT, SKIP
        or SEEK that follows it)."""
        self._t.send(message)

    def hand_back(self, slot: int) -> None:
        """A slot whose batch the trainer never saw goes back with the next message."""
        self.delivery.release.append(slot)

    def holds_slots(self) -> bool:
        """True if slots wait to go back (or for their device copy to finish, or for the
        trainer to let go of a kept batch it no longer holds)."""
        delivery = self.delivery
        if delivery.held:
            delivery.collect_held()
        return bool(delivery.release or delivery.pending)

    def deliver(self, slot: int, nstr: int) -> Any:
        """The BATCH just received (its head read: ``slot``, ``nstr``), as the trainer
        gets it (views, copies, or on the device)."""
        views = self.views
        batch = views.batch(self.buf, slot, nstr)
        held, views.held = views.held, None
        return self.delivery.deliver(slot, batch, held)

    # -- the ring --------------------------------------------------------------------------
    @property
    def cuda_registered(self) -> bool:
        return bool(self.ring and self.ring.cuda_registered)

    def contains(self, t: torch.Tensor) -> bool:
        """True if ``t``'s memory lies inside the ring (a zero-copy view)."""
        return bool(self.ring and self.segments.contains(t))

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Hand back every slot, close the socket, unmap once no view is alive."""
        self.delivery.finish_copies()
        with contextlib.suppress(ServerUnavailable):
            if self.delivery.release:
                self._t.send(p.encode_release(p.RELEASE, self.delivery.release))
        self._drop()

    def _drop(self) -> None:
        """Forget unsent releases, close the socket, and unmap the ring (parked until
        the trainer's last view of it is gone)."""
        self.delivery.release.clear()
        self._t.close()
        if self.ring is not None:
            self.views.clear()
            self.segments.close_extra()
            self.ring.close()
            self.ring = None
