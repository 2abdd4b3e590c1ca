"""One trainer attached to a loader over the data-plane socket (``dataplane.py``
accepts and attaches it): NEXT -> BATCH | END | ERROR, RELEASE, SKIP, SEEK and RESUME
-> POSITION and RESUMED, and the ring segments it is told about ahead of a batch in one.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

from pinfeed import protocol as p
from pinfeed.errors import DataPlaneError, InvalidRequest, ProtocolError
from pinfeed_server.datasets import DatasetError
from pinfeed_server.engine.consumers import BatchItem, EndItem, ErrorItem, Item
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.engine.ring import Ring

# a pinfeed.DataLoader's objects, epoch and index batches
_FED = (p.EPOCH, p.FEED, p.FEEDS, p.OBJECTS)
MAX_BATCH_INDICES = 1 << 26  # a batch's indices, across FEED parts (512 MiB of them)


class Session:
    """One attached consumer: its socket, its loader and member index, and the slots it
    holds. ``run`` serves its messages until it leaves; the leases are returned by the
    caller whatever ends the session."""

    def __init__(
        self,
        conn: socket.socket,
        engine: LoaderEngine,
        member: int,
        stop: threading.Event,
        has_ring: bool = True,
    ) -> None:
        """``has_ring``: ATTACHED carried the ring (else a RING brings it, once sized)."""
        self.conn = conn
        self.engine = engine
        self.member = member
        self.stop = stop
        self.leased: set[int] = set()
        self.buf = bytearray(p.MAX_MESSAGE)
        self.view = memoryview(self.buf)
        self.dims: dict[int, bytes] = {}  # packed leaf dims by batch length
        self.segments = {0} if has_ring else set()  # ring segments the trainer has
        self.generation = -1  # the ring's generation they are of
        self.poller = select.poll()
        self.poller.register(conn, select.POLLIN | select.POLLRDHUP)
        self.fds: list[int] = []  # what the last message brought (an OBJECTS' payload)
        # (epoch, index) -> the first indices of a batch too large for one FEED
        self.parts: dict[tuple[int, int], list[int]] = {}
        # NEXTs that came while another waited for its item (a trainer that keeps
        # several in flight): each is answered, in order, once the one before is
        self.owed = 0

    def error(self, exc: DataPlaneError | InvalidRequest) -> None:
        self.conn.send(exc.info().encode())

    def run(self) -> None:
        self.conn.settimeout(None)
        engine = self.engine
        while not self.stop.is_set():
            if not self.poller.poll(0):  # nothing to answer: make batches ahead first
                engine.drive()
            n = self.recv()
            if n == 0:
                return  # the trainer closed (or died)
            kind = self.buf[0]
            message = self.view[:n]
            item: Item | None
            if kind in _FED:
                ok, then = self.feed(kind, message)
                if not ok:
                    return
                if then is None:
                    continue
                message, kind = then, p.NEXT  # the NEXT that came with the FEED
            if kind in (p.NEXT, p.RELEASE, p.SKIP):
                slots, wait_us = p.decode_release(message)
                if wait_us is not None and kind == p.NEXT:
                    self.engine.stats.consumer_wait(wait_us / 1e6)
                if not self.release_ok(slots):
                    return
                if kind == p.NEXT:
                    # A ready batch goes out before the releases are applied: handing
                    # slots back wakes the producer, which should not delay this send.
                    item = self.engine.next_item(self.member, self.stop, timeout=0)
                    self.release(slots)
                    if item is None:
                        item = self.wait()
                    # NEXTs that came while this one waited: each an item, as they come
                    while item is not None and self.owed:
                        if not self.send(item):
                            return
                        self.owed -= 1
                        item = self.engine.next_item(self.member, self.stop, timeout=0)
                        if item is None:
                            item = self.wait()
                else:
                    self.release(slots)
                    if kind == p.RELEASE:
                        continue
                    item = self.skip_epoch()
                if item is None:
                    return  # hung up, or broke the protocol, while waiting
            elif kind == p.SEEK and n == p.POSITION_BODY.size:
                epoch, index = p.decode_position(self.view[:n])
                try:
                    self.engine.seek(self.member, epoch, index)
                except DataPlaneError as exc:  # InvalidPosition: the connection goes on
                    self.error(exc)
                    continue
                epoch, index = self.engine.position(self.member)
                self.conn.send(p.encode_position(p.POSITION, epoch, index))
                continue
            elif kind == p.RESUME:
                try:
                    state = p.decode_resume(self.view[:n])
                except ValueError as exc:
                    self.error(ProtocolError(str(exc)))
                    return
                try:  # InvalidState, InvalidPosition: the connection goes on
                    reply = self.engine.resume(self.member, state)
                except DataPlaneError as exc:
                    self.error(exc)
                    continue
                self.conn.send(p.Resumed(**reply).encode())
                continue
            elif kind == p.CUDA and n == 1:
                self.engine.cuda_registered.add(self.member)
                continue
            else:
                name = p.KIND_NAMES.get(kind, "unknown")
                self.error(ProtocolError(f"unexpected message kind {kind} {name} ({n} bytes)"))
                return
            if not self.send(item):
                return

    def send(self, item: Item) -> bool:
        """Send one item; False once the loader itself failed or closed."""
        ring = self.engine.ring
        if ring is not None and self.generation != ring.generation:  # before a batch in them
            self.announce_segments(ring)
        if isinstance(item, (BatchItem, EndItem)) and item.rng:
            # The trainer's RNG states after this batch, or after the turn that ended the
            # epoch (a trainer-fed loader without workers: inline.py).
            self.conn.send(p.RNG_HEAD.pack(p.RNG, len(item.rng)) + item.rng)
        if isinstance(item, BatchItem):
            self.leased.add(item.slot)
            body = item.strings
            if item.own is not None:  # in a buffer of its own, which goes with it
                head = p.BATCH_HEAD.pack(
                    p.BATCH | (p.FLAG_LAYOUT | p.FLAG_OWN) << 8,
                    item.slot,
                    item.seq,
                    item.epoch,
                    item.index,
                    len(body),
                )
                rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", item.own.fd))
                self.conn.sendmsg([head, body], [rights])
                return True
            kind, dims = p.BATCH | p.FLAG_LAYOUT << 8, b""
            if body[:1] != b"\0":  # else a layout of its own (BATCH_LAYOUT_HEAD's mark)
                kind = p.BATCH
                dims = self.dims.get(item.rows) or b""
                if not dims:
                    layout = self.engine.layout
                    assert layout is not None  # a batch in a slot: the ring is sized
                    dims = self.dims[item.rows] = p.pack_dims(layout, item.rows)
            # BATCH, as p.batch_parts builds it, without the call on the per-batch path.
            head = p.BATCH_HEAD.pack(kind, item.slot, item.seq, item.epoch, item.index, len(body))
            self.conn.sendmsg([head, dims, body])
        elif isinstance(item, EndItem):
            self.conn.send(p.encode_end(item.epoch, item.seq))
        else:
            info = item.info if item.epoch < 0 else item.info.at(item.epoch, item.index)
            self.conn.send(info.encode())
            if info.fatal:
                return False
        return True

    def recv(self) -> int:
        """The next message into ``buf``: its length (0: the peer closed). The fds that
        came with it are kept for an OBJECTS (``fds``); with any other message they are
        closed: only an OBJECTS brings one."""
        for fd in self.fds:
            os.close(fd)
        n, self.fds = p.recv_message(self.conn, self.buf)
        if self.fds and self.buf[0] != p.OBJECTS:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
        return n

    def feed(self, kind: int, message: memoryview) -> tuple[bool, memoryview | None]:
        """A ``pinfeed.DataLoader``'s OBJECTS (its objects, which changed), EPOCH (the base
        seed its iterator drew), FEED (an index batch its sampler made, and maybe the
        NEXT after it) or FEEDS (several, and maybe the sampler's end); (False, None),
        after a ProtocolError, if it makes no sense, else (True, the NEXT or None)."""
        try:
            if kind == p.OBJECTS:
                epoch = p.decode_objects(message)
                if not self.fds:
                    raise ValueError("an OBJECTS brings its payload's memfd")
                fds, self.fds = self.fds, []
                try:
                    self.engine.objects_changed(epoch, fds[0], fds[1:])
                except DatasetError as exc:  # they cannot be loaded here (without workers)
                    self.error(InvalidRequest(str(exc)))
                    return False, None
                return True, None
            if kind == p.EPOCH:
                self.engine.begin_fed_epoch(*p.decode_epoch(message))
                return True, None
            if kind == p.FEEDS:
                epoch, index, batches, ended = p.decode_feeds(message)
                for i, batch in enumerate(batches, index):
                    self.engine.feed(epoch, i, batch, None)
                if ended:
                    self.engine.feed(epoch, index + len(batches), None, None)
                return True, None
            part = p.decode_feed_part(message)
            if part is not None:  # a batch too large for one message: its first indices
                first = self.parts.setdefault(part[:2], [])
                first.extend(part[2])
                if len(first) > MAX_BATCH_INDICES:
                    raise ValueError(f"a batch of more than {MAX_BATCH_INDICES} indices")
                return True, None
            epoch, index, indices, rng, ahead, then = p.decode_feed(message)
            first = self.parts.pop((epoch, index), [])
            if first and indices is not None:
                indices = first + indices
            self.engine.feed(epoch, index, indices, rng or None, ahead)
        except ValueError as exc:
            self.error(ProtocolError(str(exc)))
            return False, None
        return True, then

    def announce_segments(self, ring: Ring) -> None:
        """Tell the trainer of the ring's new segments (SEGMENT + memfd; the ring itself,
        where ATTACHED did not carry it, as a RING with segment 0's) and of the closed
        ones (SEGMENT with 0 slots), before an item that may use them."""
        with ring.lock:  # no segment closes while its fd is on the way
            now = {info.id: (info, fd) for info, fd in ring.segments()}
            for sid in sorted(set(now) - self.segments):
                info, fd = now[sid]
                if sid == 0:
                    layout = self.engine.layout
                    assert layout is not None  # the ring is made with its layout
                    body = p.RingInfo(info.nslots, ring.slot_bytes, layout).encode()
                else:
                    body = p.SEGMENT_BODY.pack(p.SEGMENT, sid, info.first, info.nslots)
                rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))
                self.conn.sendmsg([body], [rights])
            for sid in sorted(self.segments - set(now)):
                self.conn.send(p.SEGMENT_BODY.pack(p.SEGMENT, sid, 0, 0))
            self.generation, self.segments = ring.generation, set(now)

    def release_ok(self, slots: list[int]) -> bool:
        bad = [s for s in slots if s not in self.leased]
        if bad:
            self.error(ProtocolError(f"release of slots {bad} not leased"))
        return not bad

    def release(self, slots: list[int]) -> None:
        self.leased.difference_update(slots)
        self.engine.release(self.member, slots)

    def wait(self) -> Item | None:
        """Wait for the member's next item while watching its socket: a trainer hands
        slots back (RELEASE) while its NEXT waits, and one that hangs up is let go at
        once instead of wedging the loader. None: the connection is over."""
        while True:
            self.engine.drive()  # where this session makes the batches (LoaderEngine.drive)
            item = self.engine.next_item(self.member, self.stop, timeout=0.02)
            if item is None:
                item = self.engine.relieve()  # a trainer that holds every slot
            if item is not None:
                return item
            if not self.poller.poll(0):
                continue
            n = self.recv()
            if n == 0:
                return None
            kind = self.buf[0]
            if kind in _FED:  # the index batch the item may be waiting for
                ok, then = self.feed(kind, self.view[:n])
                if not ok:
                    return None
                if then is not None:
                    self.error(ProtocolError("a FEED with a NEXT while a NEXT waits"))
                    return None
                continue
            if kind not in (p.RELEASE, p.NEXT):
                self.error(ProtocolError("only RELEASE, NEXT, EPOCH or FEED while a NEXT waits"))
                return None
            slots, wait_us = p.decode_release(self.view[:n])
            if not self.release_ok(slots):
                return None
            self.release(slots)
            if kind == p.NEXT:  # a trainer that keeps several NEXTs in flight
                if wait_us is not None:
                    self.engine.stats.consumer_wait(wait_us / 1e6)
                self.owed += 1

    def skip_epoch(self) -> Item | None:
        """Drop the rest of the member's current epoch (a trainer broke out of its loop)."""
        end = self.engine.skip_epoch(self.member)
        if end is not None:
            return end
        while True:
            item = self.wait()
            if isinstance(item, BatchItem):
                self.engine.release(self.member, [item.slot])
                continue
            if isinstance(item, ErrorItem) and item.epoch >= 0:
                continue  # a failed batch of the epoch being dropped
            return item
