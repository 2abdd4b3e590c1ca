"""The epoch state machine of a ``Loader``: which epoch its iterators walk, the
NEXTs kept in flight, skipping an abandoned epoch, seeking for ``set_epoch`` and
``load_state_dict``, and coming back after a server restart. It decides what to send
when; its ``Connection`` (``pinfeed._connection``) sends, receives and builds the
batches, over a ``Transport`` that tests replace with an in-process fake server.

States (``pinfeed._inflight.State``, a ``pinfeed.DataLoader``'s too): IDLE between
epochs; EPOCH inside one with nothing in flight; AHEAD inside one with NEXTs in flight;
CLOSED. An iterator (``Epoch``) starts its epoch at its first ``next()``: from IDLE at
the position, or after skipping the rest of an unfinished epoch, or after a SEEK when
``set_epoch`` asked for another epoch.

An elastic epoch (the rest of one resumed at another world size, ``pinfeed.elastic``)
numbers its batches from its record's ``start`` to its ``end``: the server says which
in ATTACHED and in the RESUMED reply to a ``load_state_dict``.
"""

from __future__ import annotations

import contextlib
from typing import Any, NoReturn

from pinfeed import elastic
from pinfeed import protocol as p
from pinfeed._connection import Connection
from pinfeed._inflight import State, reply
from pinfeed.elastic import NO_ELASTIC, STATE_VERSION
from pinfeed.errors import ServerUnavailable, error_from_info

# NEXTs kept in flight inside an epoch whose length the trainer knows (its batches then
# the END: never an item of the next epoch). With one, every batch waits for its NEXT to
# reach the server and the server's answer to reach the trainer (a wake-up each way);
# with two, the batch after the next is asked for while the trainer uses this one, so a
# ready batch is in the socket when it asks, and the server answers the NEXT it holds
# as soon as a batch is ready (``engine/session.py``). One where the length is not
# known (an iterable, a sampler of the script's) or a group shares the stream.
IN_FLIGHT = p.NEXTS_IN_FLIGHT

# What the per-batch path uses, bound once: a global each, not a global and an attribute.
_IDLE, _EPOCH, _AHEAD = State.IDLE, State.EPOCH, State.AHEAD
_NEXT, _BATCH, _END = p.NEXT, p.BATCH, p.END
_BATCH_HEAD, _END_BODY = p.BATCH_HEAD, p.END_BODY


class Epochs:
    """The epochs of a loader attached through ``conn``. ``reconnect``: if the server
    restarts, re-attach (retrying for up to ``reconnect_timeout`` seconds) and go on
    from where this loader was; else a lost server is a ``ServerUnavailable``."""

    def __init__(self, conn: Connection, reconnect: bool, reconnect_timeout: float) -> None:
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self._conn = conn
        self._state = State.IDLE
        self._pos = (0, 0)  # (epoch, index) of the next batch this loader will yield
        self._ends_at: int | None = None  # an epoch's batches (None: its END says)
        self._want_epoch: int | None = None  # set_epoch's, applied at an epoch's first next()
        self._loaded_epoch: int | None = None  # load_state_dict placed us inside this epoch
        self._epoch_id = 0  # which Epoch iterator is current; older ones are exhausted
        self._epoch_batches = 0  # batches received in the epoch being iterated
        self._inflight = 0  # NEXTs sent whose reply has not been read (state AHEAD)
        self._most = 1  # NEXTs it may keep in flight (IN_FLIGHT where the length is known)
        self._elastic: dict[str, Any] | None = None  # the elastic epoch's record (with end)
        self._elastic_epoch = -1  # its epoch, and the index after its last batch
        self._elastic_end = 0
        self._attached()

    def _attached(self) -> None:
        """Take the position and the epoch length from the connection's ATTACHED."""
        info = self._conn.info
        self._pos = (info.epoch, info.position)
        # A map-style epoch ends after its last batch; an iterable's only at its END.
        self._ends_at = info.batches_per_epoch if info.sampler_length is not None else None
        self._set_elastic(info.elastic)
        config = info.config
        own_plan = config.sampler is None and config.batch_sampler is None
        exact = self._ends_at is not None and own_plan and config.group_size == 1
        self._most = IN_FLIGHT if exact else 1

    def _set_elastic(self, record: dict[str, Any] | None) -> None:
        self._elastic = record
        self._elastic_epoch = -1 if record is None else int(record["epoch"])
        self._elastic_end = 0 if record is None else int(record["end"])

    @property
    def state(self) -> str:
        """idle (between epochs), epoch / ahead (inside one), or closed."""
        return self._state.value

    # -- iteration ---------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch: DataLoader's ``len()``, which raises TypeError for an
        IterableDataset without ``__len__``."""
        n = self._conn.info.batches_per_epoch
        if n is None:
            raise TypeError(
                f"loader {self._conn.name!r} iterates an IterableDataset that has no len()"
            )
        if self._pos[0] == self._elastic_epoch:
            # An elastic epoch's batches may be numbered past len(): a loop that counts
            # from the checkpoint's batch to len() (Lightning's) must not stop short.
            return max(n, self._elastic_end)
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

    def _begin(self, epoch_id: int) -> None:
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
            self._recover()
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

    def _next(self, epoch_id: int) -> Any:
        """The next batch of iterator ``epoch_id``; StopIteration at the end of its
        epoch, or once a newer iterator exists.

        NEXTs are kept in flight (state AHEAD, ``IN_FLIGHT``): sent as soon as a batch
        arrives, so while the trainer works on batch k the server already announces
        k+1 (and k+2), and a ready batch is in this socket's buffer when the trainer
        asks (no server wake-up on the critical path). Still one send and one recv per
        batch.
        """
        state = self._state
        if (state is not _AHEAD and state is not _EPOCH) or epoch_id != self._epoch_id:
            raise StopIteration
        conn = self._conn
        buf = conn.buf
        try:
            n = reply(conn, state is _AHEAD)
            self._inflight = self._inflight - 1 if state is _AHEAD else 0
            self._state = _EPOCH
            kind = buf[0]
            if kind == _BATCH:
                # Ask for the following items now; this releases the previous view's slot.
                _, _, _, epoch, index, _ = _BATCH_HEAD.unpack_from(buf)
                self._ask(epoch, index)
            elif self._is_batch_error(n):
                info = conn.error(n)
                assert info is not None and info.batch_index is not None
                self._ask(info.epoch if info.epoch is not None else self._pos[0], info.batch_index)
            elif self._inflight:  # an END or a fatal error with NEXTs still out: none
                self._inflight = 0
        except ServerUnavailable:
            if not self.reconnect:
                raise
            self._recover()
            if self._epoch_batches and self._pos[1] == 0:
                # The epoch's last batch came before the crash; its END did not.
                self._state = _IDLE
                raise StopIteration from None
            return self._next(epoch_id)
        if kind == _END:
            self._pos = (_END_BODY.unpack_from(buf)[1] + 1, 0)
            self._state = _IDLE
            raise StopIteration
        if kind != _BATCH:
            self._raise(n)
        _, slot, _seq, epoch, index, nstr = _BATCH_HEAD.unpack_from(buf)
        self._epoch_batches += 1
        self._advance(epoch, index)
        return conn.deliver(slot, nstr)

    def _ask(self, epoch: int, index: int) -> None:
        """After item ``index`` of ``epoch``: NEXTs in flight for as many of the items
        after it, up to the END, as this loader keeps (the first hands back the last
        view's slot)."""
        most = self._most
        if most > 1:
            ends_at = self._elastic_end if epoch == self._elastic_epoch else self._ends_at
            assert ends_at is not None
            most = max(1, min(most, ends_at - index))
        conn = self._conn
        while self._inflight < most:
            conn.send(_NEXT)
            self._inflight += 1
        self._state = _AHEAD

    def _advance(self, epoch: int, index: int) -> None:
        """Batch ``index`` of ``epoch`` was consumed."""
        ends_at = self._elastic_end if epoch == self._elastic_epoch else self._ends_at
        last = ends_at is not None and index + 1 >= ends_at
        self._pos = (epoch + 1, 0) if last else (epoch, index + 1)

    # -- replies that are errors --------------------------------------------------------
    def _is_batch_error(self, n: int) -> bool:
        """An ERROR about one batch (the connection goes on), not a fatal one."""
        info = self._conn.error(n)
        return info is not None and info.batch_index is not None

    def _raise(self, n: int) -> NoReturn:
        info = self._conn.error(n)
        if info is None:
            raise self._conn.failure(n)
        if info.epoch is not None and info.batch_index is not None:
            # A failed batch counts as consumed, as in DataLoader.
            self._advance(info.epoch, info.batch_index)
        raise error_from_info(info)

    # -- leaving an epoch ----------------------------------------------------------------
    def _drain(self) -> bool:
        """Read the replies to the NEXTs in flight; True if they ended the epoch."""
        if self._state is not State.AHEAD:
            return False
        self._state = State.EPOCH
        conn = self._conn
        ended = False
        while self._inflight:
            self._inflight -= 1
            conn.recv()
            kind = conn.buf[0]
            if kind == p.BATCH:
                conn.hand_back(p.BATCH_HEAD.unpack_from(conn.buf)[1])  # a batch never seen
            elif kind == p.END:
                self._pos = (p.END_BODY.unpack_from(conn.buf)[1] + 1, 0)
                ended = True
        return ended

    def _skip_epoch(self) -> None:
        if not self._drain():
            conn = self._conn
            conn.send(p.SKIP)
            n = conn.recv()
            if conn.buf[0] != p.END:
                self._raise(n)
            self._pos = (p.END_BODY.unpack_from(conn.buf)[1] + 1, 0)
        self._state = State.IDLE

    def _recover(self) -> None:
        """Re-attach after a server restart and seek to where this loader was."""
        position, in_epoch = self._pos, self._state is not State.IDLE
        self._state = State.IDLE  # the NEXTs in flight, if any, went with the connection
        self._inflight = 0
        self._conn.reconnect(self.reconnect_timeout)
        self._attached()
        self._seek(*position)
        if in_epoch:
            self._state = State.EPOCH

    # -- epochs and resume ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next epoch to start iterates ``epoch`` (as ``DistributedSampler.set_epoch``):
        called before or after ``iter(loader)``, it applies to that iterator if its first
        ``next()`` has not come yet.

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
        resumed loader's first batch is batch k (0-based) of that epoch. (An
        IterableDataset's ``index`` counts DataLoader's round-robin turns: k until a
        worker runs out, more after.) The format is ``pinfeed.elastic``'s, this rank's
        own (``Loader.state_dict`` adds every rank's position under torch.distributed).
        """
        self._check_resumable()
        epoch, index = self._pos
        info = self._conn.info
        config = info.config
        elastic = self._elastic if epoch == self._elastic_epoch else None
        return {
            "version": STATE_VERSION,
            "loader": self._conn.name,
            "epoch": epoch,
            "index": index,
            "rank": config.rank,
            "world_size": config.world_size,
            "batch_size": config.batch_size,
            "plan": self._plan(),
            "elastic": NO_ELASTIC if elastic is None else {k: elastic[k] for k in NO_ELASTIC},
        }

    def _plan(self) -> dict[str, Any] | None:
        """What an elastic resume must agree on (``pinfeed.elastic.Plan``): None unless
        the loader shards a map-style dataset with its own shuffle (DistributedSampler's)."""
        info = self._conn.info
        config = info.config
        own = config.sampler is None and config.batch_sampler is None
        if config.world_size is None or not own or info.dataset_length is None:
            return None
        if info.sampler_length is None:
            return None
        mixture = info.mixture
        plan = elastic.Plan(
            info.dataset_length,
            config.shuffle and mixture is None,  # a mixture's: positions
            config.seed,
            config.drop_last,
            config.shard_size,
            mixture,
        )
        return plan.to_json()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``for`` loop yields the rest of that epoch,
        or, for a state of every rank of another world size, this rank's share of what
        they left of it (``pinfeed.elastic``); ``InvalidState`` if it does not fit."""
        self._check_resumable()
        if state.get("version", 1) == 1:
            name = self._conn.name
            if state.get("loader") not in (None, name):
                raise ValueError(f"state is for loader {state.get('loader')!r}, not {name!r}")
            self._seek(int(state["epoch"]), int(state["index"]))
        else:
            self._resume(state)
        self._loaded_epoch = self._pos[0]
        self._want_epoch = None

    def _check_resumable(self) -> None:
        config = self._conn.info.config
        if config.group_mode == "split" and config.group_size > 1:
            raise RuntimeError(
                "state_dict/load_state_dict need a plain or broadcast loader; split groups "
                "resume at epoch boundaries with set_epoch"
            )

    def _resume(self, state: dict[str, Any]) -> None:
        self._drain()
        conn = self._conn
        message = p.encode_resume(state)
        if len(message) > p.MAX_MESSAGE:
            raise ValueError(
                f"the state is {len(message)} bytes of JSON, over the data plane's "
                f"{p.MAX_MESSAGE}: too many ranks or resizes in one epoch"
            )
        conn.send_message(message)
        n = conn.recv()
        if conn.buf[0] != p.RESUMED:
            self._state = State.IDLE
            self._raise(n)
        reply = p.Resumed.decode(memoryview(conn.buf)[:n])
        self._pos = (reply.epoch, reply.index)
        self._set_elastic(reply.elastic)
        self._state = State.IDLE

    def _seek(self, epoch: int, index: int) -> None:
        self._drain()
        conn = self._conn
        conn.send_message(p.encode_position(p.SEEK, epoch, index))
        n = conn.recv()
        if conn.buf[0] != p.POSITION:
            self._raise(n)
        _, e, i = p.POSITION_BODY.unpack_from(conn.buf)
        self._pos = (e, i)
        self._state = State.IDLE

    def close(self) -> None:
        """Detach (idempotent): the connection hands back every slot and closes."""
        if self._state is State.CLOSED:
            return
        self._state = State.CLOSED
        self._conn.close()

    def __del__(self) -> None:
        # Here, not in Loader: an iterator holds these epochs and not its Loader, so a
        # loop over a Loader that is gone (``for b in Loader(name)``) goes on to the end.
        if getattr(self, "_state", State.CLOSED) is not State.CLOSED:
            with contextlib.suppress(Exception):
                self.close()


class Epoch:
    """One epoch of a ``Loader``: what ``iter(loader)`` returns. Its ``__iter__`` is
    itself (the iterator protocol); it starts its epoch at its first ``next()`` and ends
    at the epoch's end, or once a newer ``iter(loader)`` exists."""

    __slots__ = ("_epochs", "_id", "_next", "_started")

    def __init__(self, epochs: Epochs, epoch_id: int) -> None:
        self._epochs = epochs
        self._id = epoch_id
        self._next = epochs._next  # bound once: no bound method made per batch
        self._started = False

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> Any:
        if not self._started:
            self._epochs._begin(self._id)
            self._started = True
        return self._next(self._id)

    def __len__(self) -> int:
        return len(self._epochs)
