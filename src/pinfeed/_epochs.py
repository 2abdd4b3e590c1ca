"""The epoch state machine of a ``Loader``: which epoch its iterators walk, the one
NEXT kept in flight, skipping an abandoned epoch, seeking for ``set_epoch`` and
``load_state_dict``. It talks through a ``Transport`` and leaves connecting, views
and delivery to others, so it runs in tests against an in-process fake server.

States (``State``): IDLE between epochs; EPOCH inside one with nothing in flight;
AHEAD inside one with a NEXT in flight; CLOSED. An iterator (``Epoch``) starts its
epoch at its first ``next()``: from IDLE at the position, or after skipping the rest
of an unfinished epoch, or after a SEEK when ``set_epoch`` asked for another epoch.
"""

from __future__ import annotations

import enum
import time
from typing import Any, NoReturn

from pinfeed import protocol as p
from pinfeed._info import RemoteSampler
from pinfeed._transport import Transport
from pinfeed._views import BatchViews, Delivery
from pinfeed.errors import DataPlaneError, ServerUnavailable, error_from_info


class State(enum.Enum):
    IDLE = "idle"  # between epochs: the next epoch to start begins at the position
    EPOCH = "epoch"  # an iterator is inside an epoch; no NEXT in flight
    AHEAD = "ahead"  # inside an epoch, one NEXT in flight (sent as a batch arrived)
    CLOSED = "closed"


class Epochs:
    """The iteration half of ``Loader`` (its base class)."""

    name: str
    reconnect: bool
    _t: Transport
    _buf: bytearray
    _info: p.Attached
    _sampler: RemoteSampler
    _views: BatchViews
    _delivery: Delivery
    _state: State
    _pos: tuple[int, int]  # (epoch, index) of the next batch this loader will yield
    _want_epoch: int | None  # set_epoch's, applied at an epoch's first next()
    _loaded_epoch: int | None  # load_state_dict placed us inside this epoch
    _epoch_id: int  # which Epoch iterator is current; older ones are exhausted
    _epoch_batches: int  # batches received in the epoch being iterated
    _wait_us: int  # how long the last batch kept the trainer waiting

    def _reconnect(self) -> None:
        raise NotImplementedError

    def _segment(self, n: int) -> None:
        """A SEGMENT: the ring grew or shrank (``Loader`` maps or unmaps it)."""
        raise NotImplementedError

    # -- receiving: SEGMENT messages come ahead of the item that may use them -----------
    def _recv(self) -> int:
        n = self._t.recv()
        while self._buf[0] == p.SEGMENT:
            self._segment(n)
            n = self._t.recv()
        return n

    def _try_recv(self) -> int | None:
        n = self._t.try_recv()
        if n is not None and self._buf[0] == p.SEGMENT:
            self._segment(n)
            return self._recv()  # the item it came ahead of is right behind it
        return n

    # -- replies that are errors --------------------------------------------------------
    def _is_batch_error(self, n: int) -> bool:
        """An ERROR about one batch (the connection goes on), not a fatal one."""
        if self._buf[0] != p.ERROR:
            return False
        return p.ErrorInfo.decode(memoryview(self._buf)[:n]).batch_index is not None

    def _raise(self, n: int) -> NoReturn:
        if self._buf[0] == p.ERROR:
            info = p.ErrorInfo.decode(memoryview(self._buf)[:n])
            if info.epoch is not None and info.batch_index is not None:
                # A failed batch counts as consumed, as in DataLoader.
                self._advance(info.epoch, info.batch_index)
            raise error_from_info(info)
        raise DataPlaneError(f"unexpected message kind {self._buf[0]} from the server")

    def _advance(self, epoch: int, index: int) -> None:
        """Batch ``index`` of ``epoch`` was consumed (an iterable's epoch ends at its END)."""
        n = self._info.batches_per_epoch
        last = self._info.sampler_length is not None and n is not None and index + 1 >= n
        self._pos = (epoch + 1, 0) if last else (epoch, index + 1)

    # -- iteration ---------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch: DataLoader's ``len()``, which raises TypeError for an
        IterableDataset without ``__len__``."""
        n = self._info.batches_per_epoch
        if n is None:
            raise TypeError(f"loader {self.name!r} iterates an IterableDataset that has no len()")
        return n

    def __iter__(self) -> Epoch:
        """An iterator over the next epoch; it costs nothing until its first ``next()``,
        which starts the epoch. An iterator that is never consumed (Lightning's
        ``iter()`` probe) starts nothing and skips nothing.

        Every ``for`` loop is a fresh epoch, as with DataLoader: a newer ``iter()`` ends
        the older iterators, and if the last epoch was left unfinished, its rest is
        skipped when the new one starts. The iterator is an iterator: ``it =
        iter(loader); next(it); for batch in it:`` continues the same epoch."""
        if self._state is State.CLOSED:
            raise RuntimeError("this Loader is closed")
        self._epoch_id += 1
        return Epoch(self, self._epoch_id)

    def _begin_epoch(self, epoch_id: int) -> None:
        """An iterator's first ``next()``: move to the epoch it iterates."""
        if self._state is State.CLOSED:
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
        self._state = State.EPOCH
        self._epoch_batches = 0

    def _start_epoch(self) -> None:
        if self._want_epoch is not None:
            epoch = self._want_epoch
            if self._state is not State.IDLE or self._pos != (epoch, 0):
                self._seek(epoch, 0)
            self._want_epoch = None
        elif self._state is not State.IDLE:
            self._skip_epoch()

    def _next_in_epoch(self, epoch_id: int) -> Any:
        if self._state not in (State.EPOCH, State.AHEAD) or epoch_id != self._epoch_id:
            raise StopIteration
        batch = self._next()
        if batch is None:
            self._state = State.IDLE
            raise StopIteration
        return batch

    def _next(self) -> Any:
        """The next batch, or None at the end of the epoch.

        One NEXT is kept in flight (state AHEAD): it is sent as soon as a batch
        arrives, so while the trainer works on batch k the server already announces
        k+1, and a ready batch is in this socket's buffer when the trainer asks (no
        server wake-up on the critical path). Still one send and one recv per batch.
        """
        asked = time.perf_counter_ns()
        try:
            if self._state is State.AHEAD:
                # Fast path: the batch asked for last time is already here. Otherwise we
                # are about to wait: hand back the last view's slot first, so the server
                # can produce into it (a group member must never hold and wait).
                n = self._try_recv()
                if n is None:
                    if self._delivery.release or self._delivery.pending:
                        self._send(p.RELEASE)
                    n = self._recv()
            else:
                self._send(p.NEXT)
                n = self._recv()
            self._wait_us = (time.perf_counter_ns() - asked) // 1000
            self._state = State.EPOCH
            kind = self._buf[0]
            if kind == p.BATCH or self._is_batch_error(n):
                # Ask for the following item now; this releases the previous view's slot.
                self._send(p.NEXT)
                self._state = State.AHEAD
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
        self._advance(epoch, index)
        return self._delivery.deliver(slot, self._views.batch(self._buf, slot, nstr))

    def _send(self, kind: int, message: bytes | None = None) -> None:
        """Send ``message`` (or a ``kind`` release message); the slots waiting to go
        back, and the trainer's last wait, ride along."""
        delivery = self._delivery
        if delivery.pending:
            delivery.collect_copies()
        release = delivery.release
        if message is None:
            message = p.encode_release(kind, release, self._wait_us)
            self._wait_us = 0
        elif release:
            self._t.send(p.encode_release(p.RELEASE, release))
        self._t.send(message)
        release.clear()

    def _drain(self) -> bool:
        """Read the reply to the NEXT in flight; True if it ended the epoch."""
        if self._state is not State.AHEAD:
            return False
        self._state = State.EPOCH
        self._recv()
        kind = self._buf[0]
        if kind == p.BATCH:
            self._delivery.release.append(p.BATCH_HEAD.unpack_from(self._buf)[1])  # unseen
        elif kind == p.END:
            self._pos = (p.END_BODY.unpack_from(self._buf)[1] + 1, 0)
            return True
        return False

    def _skip_epoch(self) -> None:
        if not self._drain():
            self._send(p.SKIP)
            n = self._recv()
            if self._buf[0] != p.END:
                self._raise(n)
            self._pos = (p.END_BODY.unpack_from(self._buf)[1] + 1, 0)
        self._state = State.IDLE

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
        self._sampler.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a new Loader that loads it yields the next batch on.

        Same meaning as StatefulDataLoader's: after k batches of an epoch, the
        resumed loader's first batch is batch k (0-based) of that epoch. (An
        IterableDataset's ``index`` counts DataLoader's round-robin turns: k until a
        worker runs out, more after.)
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
        config = self._info.config
        if config.group_mode == "split" and config.group_size > 1:
            raise RuntimeError(
                "state_dict/load_state_dict need a plain or broadcast loader; split groups "
                "resume at epoch boundaries with set_epoch"
            )

    def _seek(self, epoch: int, index: int) -> None:
        self._drain()
        self._send(p.SEEK, p.POSITION_BODY.pack(p.SEEK, epoch, index))
        n = self._recv()
        if self._buf[0] != p.POSITION:
            self._raise(n)
        _, e, i = p.POSITION_BODY.unpack_from(self._buf)
        self._pos = (e, i)
        self._state = State.IDLE


class Epoch:
    """One epoch of a ``Loader``: what ``iter(loader)`` returns. Its ``__iter__`` is
    itself (the iterator protocol); it starts its epoch at its first ``next()`` and ends
    at the epoch's end, or once a newer ``iter(loader)`` exists."""

    __slots__ = ("_id", "_loader", "_started")

    def __init__(self, loader: Epochs, epoch_id: int) -> None:
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
