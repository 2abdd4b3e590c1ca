"""``pinfeed.DataLoader``: torch's ``DataLoader``, one import away, whose batches the node's
pinfeed server makes.

    from pinfeed import DataLoader          # was: from torch.utils.data import DataLoader
    loader = DataLoader(MyDataset(), batch_size=32, shuffle=True, num_workers=4)

It *is* a ``torch.utils.data.DataLoader`` (a subclass): the same signature, defaults,
argument errors and attributes, ``len()``, the samplers DataLoader builds, and what
tools do with one (Lightning puts a ``DistributedSampler`` in by making it anew).
What changes is where the batches are made. At construction the script's objects (the
dataset, ``collate_fn``, ``worker_init_fn``) are shipped to the node's server by value
(``pinfeed._shipping``), over the Unix socket only, and a loader of this trainer's own
starts there with ``num_workers`` worker processes forked from one copy of them; a
server is started for the user if none runs (``pinfeed._autostart``).

The sampler stays here, where DataLoader iterates it: each ``iter()`` draws the base
seed and iterates the batch sampler exactly as DataLoader's iterator does
(``_BaseDataLoaderIter`` itself), and sends the index batches to the server
``num_workers * prefetch_factor`` ahead, one more per batch it yields, as DataLoader
puts them to its workers, and, as a ``Loader`` does, asks for the next batch as one
arrives, so a ready batch waits in the socket. So the script's own sampler object
behaves as under DataLoader (``set_epoch`` on its ``DistributedSampler``, a stateful
sampler's position, a ``RandomSampler`` drawing from the generator or the global RNG),
and the workers, seeded from that base seed as DataLoader seeds them, make DataLoader's
batches. Under torch's own ``BatchSampler`` over one of torch's samplers, which draw at
most at their first index, when the indices are taken cannot be seen: there they go
ahead a chunk at a time (``FEEDS_INDICES`` indices, one message, sliced from the list
the sampler yields from), so a batch costs the trainer one NEXT, as a named loader's
does. (What such a sampler reads lazily, a ``SubsetRandomSampler``'s ``indices``, is
read up to a chunk ahead: change it between epochs, not inside one.)
Without workers DataLoader makes batches in the trainer on its global RNGs: then the
trainer's RNG states travel with each index batch and come back with the batch. Where
nothing can draw (torch's ``TensorDataset`` and ``default_collate`` under one of torch's
samplers) the next index batches are sent ahead instead, without RNG states, and made
while the trainer steps. Where something may draw, under one of torch's samplers: once
the trainer drew nothing between two batches in a row, the next batch is made before
the trainer asks for it (``pinfeed._feeding.AheadOfStates``). Where the trainer steps
longer than it waits for a batch (a training loop), it is fed as the batch before
arrives, on the RNG states the trainer has then, with the NEXT in flight: the server
makes it during the step and sends it at once; when the trainer asks, it compares its
states with those, and if it drew meanwhile it makes that batch itself, on its states,
as DataLoader does, and drops the server's. Else (a loop that only iterates) each
batch's FEED is followed by the next batch's indices, ahead of their RNG states, which
the server makes right after it, on the states it left; the trainer's states go when it
asks for that batch, and the batch stands only if they are those (else it is made again
on them). After the first batch made again, this loader makes none ahead. So the
batches are DataLoader's either way. What a batch made ahead can change is how often
the dataset was called: once, in the batch made again, and in the one made ahead of a
loop left early (as DataLoader's workers make batches ahead): a ``__getitem__`` whose
result depends on how often it ran before sees more calls than under DataLoader
without workers.

The batches arrive as zero-copy views into the server's ring (page-locked and
registered with CUDA once when ``pin_memory=True`` and a GPU is present), as a
``pinfeed.Loader``'s: ``device=`` copies them there (``non_blocking``), ``copy=True``
hands out owned tensors. The loader goes when this object does (or ``close()``), and
with the trainer, however it ends; ``name=`` keeps it warm for the next trainer.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import operator
import os
import struct
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    IterDataPipe,
    MapDataPipe,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import _utils as torch_utils
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _get_distributed_settings,
    _sharding_worker_init_fn,
)

from pinfeed import protocol as p
from pinfeed import rng
from pinfeed._accelerate import PreparedAsIs
from pinfeed._autostart import ensure_server
from pinfeed._connection import Connection
from pinfeed._feeding import (
    Ahead,
    AheadOfStates,
    AheadOfStatesRule,
    Feeding,
    NextOnly,
    OnStates,
    PerBatch,
    Prefetched,
    Turns,
)
from pinfeed._inflight import State, reply
from pinfeed._shipping import Shipper
from pinfeed._transport import SocketTransport
from pinfeed._views import _map_tensors
from pinfeed.errors import (
    InsufficientMemory,
    InvalidRequest,
    LoaderFailed,
    PinfeedError,
    ProtocolError,
    ServerUnavailable,
    Unshippable,
    WorkerLimit,
    error_from_info,
)
from pinfeed.served import served
from pinfeed.unbatched import Unbatched

_NEXT, _BATCH, _END, _ERROR = p.NEXT, p.BATCH, p.END, p.ERROR
RECONNECT_TIMEOUT_S = 60.0
NO_DRAW_AHEAD = 2  # index batches fed ahead without workers, where nothing draws
# Where when the sampler is iterated cannot be seen, its batches go this many indices at
# a time (one FEEDS message, 64 KiB of them), not one FEED a batch.
FEEDS_INDICES = 8192
# Without workers, where something may draw: the batches in a row the trainer must draw
# nothing between before the next one is fed ahead of its RNG states.
QUIET_BEFORE_AHEAD = 2
# torch's samplers, which draw from the global RNG at most at their first index
_QUIET_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
)
_BATCH_HEAD = p.BATCH_HEAD
_RAN_OUT = object()  # the sampler ran out (``_Iter._next_or_end``)


_T_co = TypeVar("_T_co", covariant=True)
# What a loader falls back to torch's own DataLoader for (where not ``strict``): what
# pinfeed cannot serve with DataLoader's semantics, or cannot serve here and now.
_FALLBACK = (
    Unshippable,
    ServerUnavailable,
    InvalidRequest,
    LoaderFailed,
    WorkerLimit,
    InsufficientMemory,
    ProtocolError,
)


class FallbackWarning(UserWarning):
    """A ``pinfeed.DataLoader`` runs torch's own DataLoader in the trainer (``fell_back``
    says why); ``strict=True`` (or ``PINFEED_STRICT=1``) makes that an error."""


class DataLoader(TorchDataLoader[_T_co]):
    """torch's ``DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler,
    num_workers, collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
    multiprocessing_context, generator, *, prefetch_factor, persistent_workers,
    pin_memory_device, in_order)``, with pinfeed's own options, keyword-only:

    ``name``: a named loader on the server, kept warm after this trainer for the next
    one that asks for it with an equal configuration and objects (another: an error).
    ``device``: copy each batch there (``non_blocking``). ``copy``: yield owned CPU
    tensors, not views into the ring. A view is the trainer's for as long as it holds
    it, as DataLoader's batches are: its slot goes back to the server once no tensor
    holds it (where the trainer holds every slot, the ring grows, within the node's
    budget).
    ``reconnect``: if the server restarts, ship again and go on from where the epoch
    was. ``socket``: the server's data-plane socket (default ``PINFEED_SOCKET``, then
    the default path). ``max_batch_size``: a hint, the largest batch a ``batch_sampler``
    without a ``batch_size`` makes (the ring's slots are sized for it; a larger batch
    is served from memory of its own, as the first batches are).
    ``cache``: keep the dataset's samples in the node's cache after their first read, so
    later epochs (and other jobs) do not read and decode them again: ``"a-name"``, one
    cache shared by every ``pinfeed.DataLoader`` on the node that names it, in any job;
    ``True``, this loader's own. The dataset must return the same sample on every read:
    put the random augmentation in ``pinfeed.Transformed(dataset, transform)``, whose
    ``dataset`` part is cached and whose ``transform`` runs per sample after the cache,
    giving DataLoader's batches. ``cache_max_bytes``: its memory (default: the whole
    dataset; smaller, a fixed subset is kept).

    Where pinfeed cannot serve the loader with DataLoader's semantics (an object that
    cannot leave the trainer's process, a module the server cannot import, no server,
    the node's budget), it runs torch's own DataLoader in the trainer instead, with one
    ``FallbackWarning`` that names the reason and what to do; ``fell_back`` is that
    reason (None: the server makes the batches). ``strict=True`` (default: the
    ``PINFEED_STRICT`` environment variable) makes it the error instead; so do
    ``device=``, ``copy=`` and ``cache=``, pinfeed's own options.
    """

    # Accelerate hands a prepared loader back as it is (it shards nothing: the sampler
    # is the script's, as with DataLoader; with several processes and no sampler that
    # shards, a warning), and tracks it as stateful.
    _is_accelerate_prepared = PreparedAsIs()
    use_stateful_dataloader = True

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        name: str | None = None,
        device: str | torch.device | None = None,
        copy: bool = False,
        reconnect: bool = False,
        socket: str | os.PathLike[str] | None = None,
        max_batch_size: int | None = None,
        cache: bool | str | None = None,
        cache_max_bytes: int | None = None,
        strict: bool | None = None,
    ) -> None:
        # By keyword: tools that record and replay a DataLoader's init arguments
        # (Lightning) see one call's arguments, each once.
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        # pinfeed's options as attributes of their own names: what tools that make a
        # DataLoader anew from its attributes read (Lightning, to put a sampler in).
        self.name, self.device, self.copy, self.reconnect = name, device, copy, reconnect
        self.socket, self.max_batch_size = socket, max_batch_size
        self.cache, self.cache_max_bytes = cache, cache_max_bytes
        self.strict = _strict() if strict is None else strict
        self.fell_back: str | None = None
        self.iteration = 0  # the epochs done, as Accelerate's prepared loader counts them
        _check_cache(dataset, cache, cache_max_bytes)
        target = torch.device(device) if device is not None else None
        if target is not None and target.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} was asked for, but CUDA is not available")
        # Without automatic batching (batch_size=None) each item is one sample's, or one
        # index list's (a BatchSampler as sampler=: DataLoader's batched reads).
        batches = self.batch_sampler if self._auto_collation else self.sampler
        rows = max_batch_size or self.batch_size or getattr(batches, "batch_size", None)
        if _one_index_a_batch(self):
            rows = 1
        self._owned: _Owned | None = None
        try:
            self._owned = _Owned(
                self,
                name=name,
                device=target,
                copy=copy,
                reconnect=reconnect,
                socket=Path(socket) if socket is not None else p.default_socket_path(),
                max_rows=int(rows) if isinstance(rows, int) and rows > 0 else None,
                cache=cache,
                cache_max_bytes=cache_max_bytes,
            )
        except _FALLBACK as exc:
            self._fall_back(exc)

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers > 0:
            self.check_worker_number_rationality()  # as DataLoader warns at each iter()
        if self._owned is not None:
            try:
                return _Iter(self)
            except Unshippable as exc:  # the objects changed into what cannot be shipped
                self._fall_back(exc)
        return super()._get_iterator()

    def _fall_back(self, exc: PinfeedError) -> None:
        """Run torch's own DataLoader in this process from now on, with one warning that
        says why and what to do (``strict``: raise ``exc`` instead). Over a
        ``pinfeed.ServerDataset`` it raises ``exc`` too: only the server can read it."""
        if self.strict or self.device is not None or self.copy or self.cache not in (None, False):
            raise exc
        if served(self.dataset):
            raise exc
        if self._owned is not None:
            self._owned.close()
            self._owned = None
        self.fell_back = f"{type(exc).__name__}: {exc}"
        self.use_stateful_dataloader = False  # Accelerate: no pinfeed state to save
        warnings.warn(
            f"pinfeed.DataLoader runs torch's own DataLoader in this process for this "
            f"loader (the same batches, made here, not by the node's server), because "
            f"{self.fell_back}. {_REMEDY.get(type(exc), '')}Give strict=True (or set "
            "PINFEED_STRICT=1) to make this an error.",
            FallbackWarning,
            stacklevel=3,
        )

    # -- pinfeed's side --------------------------------------------------------------------
    @property
    def pinfeed_name(self) -> str | None:
        """The loader's name on the server (GET /v1/loaders/{name}, pinfeed status);
        None where it fell back to torch's DataLoader."""
        return None if self._owned is None else self._owned.conn.name

    def _served(self) -> _Owned:
        if self._owned is None:
            raise RuntimeError(
                f"this pinfeed.DataLoader runs torch's own DataLoader ({self.fell_back}): it "
                "has no pinfeed state"
            )
        return self._owned

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as StatefulDataLoader's means it: a loader (in a new
        process too) that loads it yields the rest of that epoch, batch for batch, from
        the next ``iter()`` on. It holds the epoch's base seed and what its sampler drew
        from (the generator's state, or the global RNG's where it has none, and a
        stateful sampler's ``state_dict``) as the epoch began."""
        owned = self._served()
        if owned.state is State.IDLE:
            return {"version": 1, "epoch": owned.epoch + 1, "index": 0}
        return {
            "version": 1,
            "epoch": owned.epoch,
            "index": owned.yielded,
            "base_seed": owned.base_seed,
            "start": owned.epoch_start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (``state_dict``'s) at the next ``iter()``."""
        if state.get("version") != 1:
            raise ValueError(f"not a pinfeed.DataLoader state: {sorted(state)}")
        self._served().resume = dict(state)

    def __iter__(self) -> Any:  # an iterator; under Accelerate a generator, as its own
        if not self.__dict__.get("_prepared"):
            return super().__iter__()
        return self._prepared_epoch()

    def _prepared_epoch(self) -> Iterator[Any]:
        """An epoch as Accelerate's prepared loader (``DataLoaderShard``) iterates one:
        ``set_epoch(iteration)`` first, ``iteration`` counted on once it is whole."""
        self.set_epoch(self.iteration)
        yield from super().__iter__()
        self.iteration += 1

    def set_epoch(self, epoch: int) -> None:
        """What Accelerate's prepared loader (``DataLoaderShard``) does, which Hugging
        Face's Trainer calls each epoch: the batch sampler's ``set_epoch`` and its
        sampler's (a ``DistributedSampler``'s), or, where the sampler has none, the
        dataset's (a Hugging Face ``IterableDataset``'s)."""
        self.iteration = epoch
        batches: Any = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if hasattr(batches, "set_epoch"):
            batches.set_epoch(epoch)
        if hasattr(batches, "sampler") and hasattr(batches.sampler, "set_epoch"):
            batches.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _unsharded(self) -> str:
        """What to do where nothing shards this loader across processes ("": a
        ``DistributedSampler`` does, or an ``IterableDataset``, which may itself)."""
        if isinstance(self.dataset, IterableDataset):
            return ""
        held = (self.sampler, self.batch_sampler)  # a BatchSampler's own, as sampler= too
        if any(isinstance(getattr(s, "sampler", s), DistributedSampler) for s in held):
            return ""
        return (
            "Give it a sampler that shards, as a DDP script does: sampler="
            "DistributedSampler(dataset, num_replicas=accelerator.num_processes, "
            "rank=accelerator.process_index, shuffle=...), and call its "
            "set_epoch(epoch) each epoch."
        )

    def close(self) -> None:
        """Let the server's loader go (it goes anyway when this object does)."""
        if self._owned is not None:
            self._owned.close()

    def __enter__(self) -> DataLoader[_T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Owned:
    """The trainer's loader on the server: its connection (a CREATE with the payload,
    then ATTACHED), the epochs it has fed, and the payload kept for a reconnect."""

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        name: str | None,
        device: torch.device | None,
        copy: bool,
        reconnect: bool,
        socket: Path,
        max_rows: int | None,
        cache: bool | str | None = None,
        cache_max_bytes: int | None = None,
    ) -> None:
        dataset = loader.dataset
        iterable = isinstance(dataset, IterableDataset)
        self.one_index = _one_index_a_batch(loader)  # each index fed as a batch of one
        # The objects as shipped, and as they change (follow): the shipper holds the
        # payloads a server needs for them (a reconnect sends them again, in order).
        self.shipper = Shipper()
        objects = _objects(loader)
        collate = objects["collate_fn"]
        first = self.shipper.ship(objects)
        assert first is not None
        self.payload = first
        self._finalize = weakref.finalize(self, self.shipper.close)
        self.cache = cache
        self.iterable = iterable
        self.feeding = _feeding(loader, collate)  # how its index batches go ahead
        # IDLE between epochs, EPOCH inside one, AHEAD with a NEXT in flight
        self.state = State.IDLE
        self.reconnect = reconnect
        self.epoch = -1  # the last epoch begun
        self.yielded = 0  # batches handed out (or raised) in it
        self.base_seed = 0
        self.epoch_start: dict[str, Any] = {}  # what its sampler drew from (state_dict)
        self.resume: dict[str, Any] | None = None  # a load_state_dict for the next iter()
        request = p.Create(
            name=name,
            digest="",
            max_rows=max_rows,
            num_workers=loader.num_workers,
            prefetch_factor=loader.prefetch_factor or 2,
            pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers,
            iterable=iterable,
            length=_length(dataset),
            batches_per_epoch=_batches(loader),
            samples=None if iterable else _length(loader.sampler),
            drop_last=loader.drop_last,
            cache=cache is not None and cache is not False,
            cache_name=cache if isinstance(cache, str) else None,
            cache_max_bytes=cache_max_bytes,
            draws=not rng.draws_nothing(dataset, collate, loader.worker_init_fn),
        )
        # A named loader's "equal configuration and objects": unnamed, nothing to compare.
        digest = "" if name is None else _digest(self.payload, request.encode())
        message = p.Create(**{**request.__dict__, "digest": digest}).encode()
        shipper = self.shipper
        ensure_server(socket)
        # DataLoader's timeout bounds the wait for a batch from its workers (none without
        # workers), not the loader's making
        self.timeout = loader.timeout if loader.timeout and loader.num_workers else None
        transport = SocketTransport(
            socket, self.timeout, name or "pinfeed.DataLoader", attach_timeout=False
        )
        # The CREATE (sent again by a reconnect, with the objects as last shipped in one
        # payload) refers to nothing of this object's, so the connection, which the
        # finalizer below holds, does not keep it alive.
        self.conn = Connection(
            transport,
            name or "",
            None,
            device,
            copy,
            request=lambda: (message, (shipper.whole(), *shipper.shared)),
            keep=True,  # DataLoader's batches are the trainer's as long as it holds them
        )
        # The connection (and so the server's loader) goes with this object.
        self._closing = weakref.finalize(self, self.conn.close)

    # -- the objects ----------------------------------------------------------------------
    def follow(self, loader: DataLoader[Any]) -> int | None:
        """The loader's objects as they are now, where they changed since last shipped:
        the payload to send (the shipper owns it); None: unchanged."""
        fd = self.shipper.ship(_objects(loader))
        if fd is not None and self.cache not in (None, False):
            raise InvalidRequest(
                "pinfeed.DataLoader(cache=...): the dataset, collate_fn or worker_init_fn "
                "changed since the loader was made (set_epoch, an attribute); a cached "
                "loader serves its objects as shipped: keep what changes out of it, or "
                "make a new loader"
            )
        return fd

    # -- an epoch -----------------------------------------------------------------------
    def begin(
        self, base_seed: int, objects: int | None = None, shared_seed: int | None = None
    ) -> int:
        """A new epoch of this loader (the last one, unfinished, is dropped first), with
        the trainer's objects as they are now where they changed (``objects``: their
        payload, ``follow``'s) and a datapipe's shared seed (DataLoader's iterator's)."""
        conn = self.conn
        if self.state is not State.IDLE:
            self.skip()
        self.epoch += 1
        if objects is not None:
            conn.send_objects(self.epoch, [objects, *self.shipper.shared])
        conn.send_message(p.encode_epoch(self.epoch, base_seed, shared_seed))
        self.state, self.yielded, self.base_seed = State.EPOCH, 0, base_seed
        return self.epoch

    def seek(self, index: int) -> None:
        """Make batch ``index`` of the current epoch the next one (a resume: the
        batches before it were fed, for the workers' RNG streams, and are not made)."""
        conn = self.conn
        conn.send_message(p.encode_position(p.SEEK, self.epoch, index))
        n = conn.recv()
        if conn.buf[0] != p.POSITION:
            raise conn.failure(n)
        self.yielded = index

    def skip(self) -> None:
        """Drop the rest of the current epoch (an iterator left unfinished)."""
        conn = self.conn
        conn.send_plain(p.encode_feed(self.epoch, 0, None))  # its sampler: no more
        # The reply to a NEXT in flight first (SKIP is no message for a waiting NEXT).
        drain, self.state = self.state is State.AHEAD, State.EPOCH
        ended = drain and self._drop_reply()
        if not ended:
            conn.send(p.SKIP)
            while not self._drop_reply():
                pass
        self.state = State.IDLE

    def _drop_reply(self) -> bool:
        """Read one reply of an epoch being dropped: True at its END; a batch goes back
        unseen, a failed batch is passed over; a fatal error raises."""
        conn = self.conn
        n = conn.recv()
        kind = conn.buf[0]
        if kind == _BATCH:
            conn.hand_back(_BATCH_HEAD.unpack_from(conn.buf)[1])
        elif kind != _END:
            info = conn.error(n)
            if info is None or info.fatal:
                raise conn.failure(n)
        return kind == _END

    def feed(
        self,
        index: int,
        indices: list[int] | None,
        rng_state: bytes = b"",
        ask: bool = False,
        ahead: bool = False,
    ) -> None:
        """Send batch ``index``'s indices (``struct.error``, nothing sent, if one is no
        integer); ``ask``: with the NEXT in the same message (it hands back the slots),
        then in flight. Else a NEXT, SKIP or SEEK follows and hands them back.
        ``ahead``: ahead of the RNG states it is to be made on (a FEED of it with them
        follows)."""
        if indices is not None and len(indices) > p.MAX_FEED_INDICES:
            parts, indices = p.feed_parts(self.epoch, index, indices)
            for part in parts:
                self.conn.send_plain(part)
        if ahead:
            assert indices is not None and not rng_state
            message = p.encode_feed_ahead(self.epoch, index, indices)
        else:
            message = p.encode_feed(self.epoch, index, indices, rng_state)
            if rng_state:  # what the batch leaves, unless an RNG message says otherwise
                self.conn.rng_after = rng_state
        if ask:
            message = p.feed_then_next(message, self.conn.release_message(_NEXT))
            self.state = State.AHEAD
        try:
            self.conn.send_plain(message)
        except ServerUnavailable:
            self._lost()

    def feed_many(self, index: int, batches: list[list[int]], ended: bool) -> None:
        """Send batches ``index``, ``index + 1``, .. (``ended``: and then the sampler's
        end) in one message (``struct.error``, nothing sent, if an index is no integer)."""
        try:
            self.conn.send_plain(p.encode_feeds(self.epoch, index, batches, ended))
        except ServerUnavailable:
            self._lost()

    def next_batch(self) -> bool:
        """Wait for the next item (``reply``): True for a BATCH (``deliver`` it), False
        at the epoch's END; raises what failed, and DataLoader's RuntimeError where its
        timeout passed first (the NEXT stays in flight: the next call waits for its
        reply)."""
        conn = self.conn
        ahead, self.state = self.state is State.AHEAD, State.EPOCH
        try:
            n = reply(conn, ahead)
        except TimeoutError:
            self.state = State.AHEAD  # the next call waits for this reply
            raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds") from None
        kind = conn.buf[0]
        if kind == _BATCH:
            return True
        if kind == _END:
            self.state = State.IDLE
            return False
        info = conn.error(n)
        if info is None:
            raise conn.failure(n)
        raise error_from_info(info)

    def ask_ahead(self) -> None:
        """Send the NEXT for the item after the one just received (its FEED sent first);
        it hands back the slot of the batch before."""
        self.state = State.AHEAD
        try:
            self.conn.send(_NEXT)
        except ServerUnavailable:
            self._lost()

    def _lost(self) -> None:
        """The server went while what goes ahead of the next item was sent (it may have
        answered the NEXT in flight before it died: that batch is in hand). With
        ``reconnect``, the next item's wait meets it, reconnects and feeds the epoch
        again; else it is the trainer's error."""
        if not self.reconnect:
            raise
        self.state = State.EPOCH

    def deliver(self) -> Any:
        """The BATCH just received, as views (or copies, or on the device). Its slot goes
        back with the next message sent: send FEEDs before, not after."""
        conn = self.conn
        _, slot, _seq, _epoch, _index, nstr = _BATCH_HEAD.unpack_from(conn.buf)
        return conn.deliver(slot, nstr)

    def close(self) -> None:
        self._closing()
        self._finalize()


_REMEDY: dict[type[PinfeedError], str] = {
    Unshippable: "Make it an object that pickles (the error names it) to have the node's "
    "server make the batches. ",
    ServerUnavailable: "Start one (`pinfeed serve`), or let pinfeed.DataLoader start one "
    "(unset PINFEED_AUTOSTART=0). ",
}


def _strict() -> bool:
    """``PINFEED_STRICT``: a loader pinfeed cannot serve is an error, not torch's."""
    return os.environ.get("PINFEED_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _objects(loader: DataLoader[Any]) -> dict[str, Any]:
    """What DataLoader hands its workers (by fork), as the server gets it: the dataset,
    the collate_fn (None: default_collate, which the server writes itself; without
    automatic batching, ``Unbatched``) and the worker_init_fn, as they are now."""
    collate: Any = loader.collate_fn
    if not loader._auto_collation:  # batch_size=None
        collate = Unbatched(collate, by_list=not _one_index_a_batch(loader))
    elif collate is torch.utils.data.default_collate:
        collate = None
    init = loader.worker_init_fn
    if loader.num_workers > 0 and isinstance(loader.dataset, IterDataPipe | MapDataPipe):
        # DataLoader's workers shard a datapipe graph (its sharding_filter) among them, by
        # the worker_init_fn its multiprocessing iterator wraps the script's in
        world, rank = _get_distributed_settings()  # type: ignore[no-untyped-call]
        init = functools.partial(_sharding_worker_init_fn, init, world, rank)
    return {"dataset": loader.dataset, "collate_fn": collate, "worker_init_fn": init}


def _feeding(loader: DataLoader[Any], collate: Any) -> Feeding:
    """How the loader's index batches go to its server (``pinfeed._feeding``).

    With workers DataLoader puts ``num_workers * prefetch_factor`` indices ahead, one more
    per batch it yields; where when they are taken cannot be seen (torch's samplers),
    as deep as the ring and its two slots of the trainer's, so no worker waits for an
    index, and a chunk at a time. Without workers DataLoader makes each batch in
    ``next()`` on the trainer's RNGs; where nothing draws (a TensorDataset,
    default_collate, one of torch's samplers, which draw at most at their first index)
    the next batches are fed ahead, with no RNG states, and made while the trainer
    steps: the same batches, no wait; where something may draw but the sampler's moments
    cannot be seen, before the trainer asks for them once it draws nothing between
    batches (``AheadOfStates``). Wherever the next batch does not wait for an index fed
    in ``next()`` on the trainer's RNGs, one NEXT is kept in flight (sent as a batch
    arrives, after that batch's FEED), so a ready batch is in the socket when the
    trainer asks, as a named Loader's."""
    if isinstance(loader.dataset, IterableDataset):
        return NextOnly() if loader.num_workers else Turns()
    batches = _quiet_batches(loader)
    # Where nothing can see when the batch sampler is iterated, the batches fed ahead
    # go a chunk at a time: one message for many batches, so a batch costs the trainer a
    # NEXT, as a named loader's does (0: one FEED a batch).
    quiet = batches and _whole_epoch_quiet(loader)
    chunk = FEEDS_INDICES // max(1, _index_batches(loader).batch_size) if quiet else 0
    chunk = chunk if chunk > 1 else 0
    if loader.num_workers > 0:
        prefetch = (loader.prefetch_factor or 2) * loader.num_workers
        if batches:
            prefetch += 2
        return Prefetched(prefetch, chunk) if chunk else PerBatch(prefetch)
    if _draws_nothing(loader, collate):
        return Ahead(NO_DRAW_AHEAD + 1, chunk)
    return AheadOfStates(QUIET_BEFORE_AHEAD) if quiet else OnStates()


def _draws_nothing(loader: DataLoader[Any], collate: Any) -> bool:
    """Whether a batch made without workers draws nothing from the trainer's RNGs and
    its indices may be taken ahead: objects that draw nothing (``rng.draws_nothing``)
    under torch's ``BatchSampler`` over one of its samplers, which draw at most at their
    first index (in the first ``next()``, as under DataLoader)."""
    return rng.draws_nothing(loader.dataset, collate) and _quiet_batches(loader)


def _index_batches(loader: DataLoader[Any]) -> Any:
    """What yields the loader's fed index batches: its batch sampler, or, without
    automatic batching, its sampler (a ``BatchSampler`` there, DataLoader's tuned read:
    each index list is read as ``dataset[indices]``)."""
    return loader.batch_sampler if loader._auto_collation else loader.sampler


def _quiet_batches(loader: DataLoader[Any]) -> bool:
    """Whether the moments the batch sampler's indices are taken cannot be seen: torch's
    own ``BatchSampler`` (its exact type, as each class here: a subclass may do more),
    as ``batch_sampler`` or, with ``batch_size=None``, as ``sampler``, over one of
    torch's samplers that draw at most at their first index (not a
    ``RandomSampler(replacement=True)`` on a generator: it draws 32 at a time)."""
    batches = _index_batches(loader)
    if type(batches) is not BatchSampler or type(batches.sampler) not in _QUIET_SAMPLERS:
        return False
    sampler = batches.sampler
    return not (
        type(sampler) is RandomSampler and sampler.replacement and sampler.generator is not None
    )


_SLICEABLE: tuple[type, ...] = (type(iter([])), type(iter(range(0))))  # list, range iterators


def _take(it: Iterator[Any], n: int) -> list[Any]:
    """``list(islice(it, n))``, the same items from the same iterator, taken a slice at a
    time where ``it`` is, or is a generator now delegating (``yield from``) to, a list
    or range iterator (torch's samplers: ``yield from torch.randperm(n).tolist()``,
    ``iter(range(n))``, ``iter(indices)``): the slice, then the iterator moved past it,
    in place of a generator step per index (30-80 us a batch of 256)."""
    out: list[Any] = []
    while len(out) < n:
        sub: Any = it.gi_yieldfrom if type(it) is types.GeneratorType else it
        if type(sub) in _SLICEABLE:
            # (iter, (the list itself, or the range,), position); at its end: no position
            state: Any = sub.__reduce__()
            if len(state) == 3:
                seq: Any = state[1][0]
                at: int = state[2]
                got = seq[at : at + n - len(out)]
                if len(got):
                    sub.__setstate__(at + len(got))
                    out += got
                    continue
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's samplers' draws on one intra-op thread (this thread's setting, restored):
    the same values (torch's random ops do not depend on the thread count), without a
    parallel region waiting on a core the loader's own workers hold. On 2 busy cores
    ``randperm(50_000)`` takes 0.35 ms on one thread and up to 7 ms on two."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _whole_epoch_quiet(loader: DataLoader[Any]) -> bool:
    """Whether the sampler draws at its first index only, however far ahead of the
    batches it is iterated: not a ``RandomSampler`` on a generator with more samples
    than the dataset, which draws its next permutation from that generator mid-epoch."""
    sampler = getattr(_index_batches(loader), "sampler", loader.sampler)
    return not (
        type(sampler) is RandomSampler
        and sampler.generator is not None
        and sampler.num_samples > len(sampler.data_source)
    )


def _check_cache(dataset: Any, cache: Any, max_bytes: Any) -> None:
    """ValueError (TypeError) naming what to change in ``cache=`` and ``cache_max_bytes=``."""
    if cache is None or cache is False:
        if max_bytes is not None:
            raise ValueError("pinfeed.DataLoader: cache_max_bytes= without cache=; give cache=")
        return
    if not isinstance(cache, bool | str):
        raise TypeError(
            f"pinfeed.DataLoader: cache= is True or a cache's name, not {type(cache).__name__}"
        )
    if cache == "":
        raise ValueError("pinfeed.DataLoader: cache= needs a name (or True: a cache of its own)")
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
        raise ValueError(
            f"pinfeed.DataLoader: cache_max_bytes must be an int >= 0, not {max_bytes!r}"
        )
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "pinfeed.DataLoader: cache= keeps a map-style dataset's samples by index; an "
            "IterableDataset has none: leave cache= out"
        )


def _one_index_a_batch(loader: TorchDataLoader) -> bool:  # type: ignore[type-arg]
    """Whether the loader's sampler yields single indices, each read as one item (no
    automatic batching, and no BatchSampler as ``sampler=``, whose index lists are read
    as ``dataset[indices]``)."""
    return not loader._auto_collation and not isinstance(loader.sampler, BatchSampler)


def _index(i: Any) -> int:
    """A sampler's index as the int the server reads ``dataset[index]`` with."""
    try:
        return operator.index(i)
    except TypeError:
        pass
    shown = repr(i) if len(repr(i)) < 60 else f"{repr(i)[:57]}..."
    raise TypeError(
        f"pinfeed.DataLoader: the sampler yielded {shown} ({type(i).__name__}); the server "
        "reads a map-style dataset by integer index: make the sampler yield ints, and map "
        "them to keys in __getitem__"
    )


def _failed_batch(exc: Exception) -> bool:
    """Whether ``exc`` is one batch's failure (the loader goes on), not the loader's."""
    return (
        isinstance(exc, PinfeedError)
        and exc.fatal is False
        and exc.extra.get("batch_index") is not None
    )


def _digest(fd: int, config: bytes) -> str:
    """sha256 of payload ``fd`` (read in place) and the loader's configuration."""
    h = hashlib.sha256()
    with mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ) as mm:
        h.update(mm)
    h.update(config)
    return h.hexdigest()


def _batches(loader: DataLoader[Any]) -> int | None:
    """``len(loader)`` where it has one, taken as if it had not been: DataLoader remembers
    that an IterableDataset's length was asked for, and warns if an epoch outgrows it."""
    asked = loader._IterableDataset_len_called
    try:
        return _length(loader)
    finally:
        loader._IterableDataset_len_called = asked


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


class _Iter(_BaseDataLoaderIter):
    """One epoch (DataLoader's iterator: its base seed and sampler iteration are
    ``_BaseDataLoaderIter``'s own), its batches made by the server."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        owned = self._owned = loader._served()
        resume, owned.resume = owned.resume, None
        if resume is not None and resume.get("start"):
            _restore(loader, resume["start"])  # the sampler draws what it drew then
        owned.epoch_start = _taken(loader)
        super().__init__(loader)  # DataLoader's own: the base seed, the sampler's iterator
        # DataLoader hands its (new) workers the objects as they are now (a datapipe
        # graph with the shuffle seed its iterator just set), or, without workers, uses
        # them as they are (persistent workers come here once: later epochs are
        # _reset's, whose workers keep what they have).
        try:
            objects = owned.follow(loader)
        except Unshippable:
            # torch's iterator takes over (DataLoader._get_iterator): it draws what this
            # one drew, from where it drew it
            _restore(loader, owned.epoch_start)
            raise
        shared = self._shared_seed  # the one DataLoader's new workers apply
        if loader.num_workers > 0:
            # DataLoader's multiprocessing iterator resets once more after starting its
            # workers: the sampler iterated again, a datapipe's next shared seed drawn
            _BaseDataLoaderIter._reset(self, loader, first_iter=True)
        self._start(resume, objects, shared)

    def __next__(self) -> Any:
        if self._owned.iterable or torch._C._autograd._profiler_enabled():
            return super().__next__()  # DataLoader's own, its profiler label and warning
        # The same steps for a map-style dataset without the label, which costs tens of
        # microseconds a batch where no profiler records it.
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _start(
        self, resume: dict[str, Any] | None, objects: int | None, shared: int | None
    ) -> None:
        """The epoch begins (``objects``: the objects' payload, where they changed;
        ``shared``: a datapipe's shared seed, which the workers apply)."""
        owned = self._owned
        index = 0
        seed = int(self._base_seed)
        if resume is not None:
            owned.epoch = int(resume["epoch"]) - 1
            index = int(resume["index"])
            seed = int(resume.get("base_seed", seed))
            self._base_seed = seed
        self._epoch = owned.begin(seed, objects, shared)
        self._fed = 0
        self._indices: Iterator[Any] | None = None  # the sampler's, for _feed_chunk
        self._exhausted = False
        self._spec: list[int] | None = None  # the batch fed ahead of its RNG states
        # The batch fed on arrival of the one before (AheadOfStates): the sampler's
        # indices, and the RNG states it is made on.
        self._speculated: tuple[Any, bytes] | None = None
        # Such a batch to make here, on these states: the trainer drew since it was fed.
        self._redo: tuple[Any, bytes] | None = None
        # The trainer's last step and its last wait for a batch (AheadOfStates chooses
        # by them), and when the last batch was handed out.
        self._step_s = self._wait_s = self._out_at = 0.0
        # What was fed this epoch: sent again to a restarted server (reconnect).
        self._history: list[tuple[list[int], bytes]] = []
        feeding = owned.feeding
        if index:
            # the batches before: the workers' streams replay them
            self.feed_to(index, feeding.chunk)
            owned.seek(index)
        feeding.start(self, index)

    # -- what a way of feeding (pinfeed._feeding) drives ------------------------------
    @property
    def yielded(self) -> int:
        return self._owned.yielded

    def feed_to(self, fed: int, chunk: int) -> None:
        """Feed the sampler's index batches until ``fed`` are (or it ran out): one at a
        time, or ``chunk`` at a time (0: one at a time)."""
        if chunk:
            while self._fed < fed and self._feed_chunk(chunk):
                pass
        else:
            while self._fed < fed and self.feed():
                pass

    def _feed_chunk(self, chunk: int) -> bool:
        """Send the sampler's next ``chunk`` index batches in one message (and its end,
        if it ran out); False once it had run out. The batches are torch's
        ``BatchSampler``'s (its exact type: ``_quiet_batches``): its sampler's indices in
        ``batch_size`` runs, a short last one dropped with ``drop_last``; its sampler's
        iterator is made at the first index, as ``BatchSampler.__iter__`` makes it."""
        if self._exhausted:
            return False
        owned = self._owned
        batch_sampler = self._index_sampler
        size = batch_sampler.batch_size
        with _one_thread():
            if self._indices is None:
                self._indices = iter(batch_sampler.sampler)
            flat = _take(self._indices, chunk * size)
        batches = [flat[i : i + size] for i in range(0, len(flat), size)]
        if batches and batch_sampler.drop_last and len(batches[-1]) < size:
            batches.pop()
        ended = len(flat) < chunk * size
        try:
            owned.feed_many(self._fed, batches, ended)
        except struct.error:
            batches = [[int(i) for i in b] for b in batches]
            owned.feed_many(self._fed, batches, ended)
        self._history.extend((b, b"") for b in batches)
        self._fed += len(batches)
        self._exhausted = ended
        return True

    def feed(self, ask: bool = False) -> bool:
        """Send the sampler's next index batch, without RNG states (``ask``: and the NEXT
        kept in flight); False (after telling the server) once the sampler ran out."""
        owned = self._owned
        if self._exhausted:
            if ask:
                owned.ask_ahead()
            return False
        try:
            indices = self._next_index()  # type: ignore[no-untyped-call]
        except StopIteration:
            self._exhausted = True
            owned.feed(self._fed, None, ask=ask)
            return False
        batch = self._send(indices, lambda b: owned.feed(self._fed, b, ask=ask))
        self._history.append((batch, b""))
        self._fed += 1
        return True

    def feed_on_states(self, ahead: AheadOfStatesRule) -> None:
        """Without workers: send the sampler's next index batch (or the one fed ahead of
        its states) with this process's RNG states, taken after the sampler drew (the
        batch is made on them), and the NEXT; where ``ahead`` (told whether the trainer
        drew since the last batch) says so, the next batch goes after it, ahead of its
        states, with the NEXT, so the server makes it right after this one."""
        owned = self._owned
        if self._exhausted:
            return
        spec, self._spec = self._spec, None
        if spec is None:
            indices = self._next_or_end()
            if indices is _RAN_OUT:
                return
        state = rng.dump_state()
        # (the first batch: the iterator drew its base seed; nothing to compare)
        drew = state != owned.conn.rng_after if self._fed else None
        go_ahead = ahead(drew, spec is not None)
        if spec is not None:  # its states now, and the same indices again
            owned.feed(self._fed, spec, state, ask=not go_ahead)
            batch = spec
        else:
            batch = self._send(indices, lambda b: owned.feed(self._fed, b, state, ask=not go_ahead))
        self._history.append((batch, state))
        self._fed += 1
        if go_ahead:
            self._feed_ahead_of_states()

    def feed_on_arrival(self) -> None:
        """Without workers, as a batch arrived (its RNG states applied): the sampler's
        next index batch, on the states this process has now, and the NEXT, kept in
        flight: the server makes it while the trainer steps. Where the sampler ran out,
        its end, with the NEXT."""
        owned = self._owned
        if self._exhausted:
            return
        indices = self._next_or_end()
        if indices is _RAN_OUT:
            return
        state = rng.dump_state()
        batch = self._send(indices, lambda b: owned.feed(self._fed, b, state, ask=True))
        self._speculated = (indices, state)
        self._history.append((batch, state))
        self._fed += 1

    @property
    def speculating(self) -> bool:
        return self._speculated is not None

    @property
    def fed_ahead(self) -> bool:
        return self._spec is not None

    @property
    def stepping(self) -> bool:
        """Whether the trainer's last step (from a batch handed out to the next
        ``next()``) took longer than its last wait for a batch."""
        return self._step_s > self._wait_s

    def speculation_stands(self) -> bool:
        """The batch fed on arrival of the one before: True if this process's RNG states
        are still those it was fed on (the trainer drew nothing since). Else it is made
        here in ``next()`` (``_made_here``), on the states now."""
        assert self._speculated is not None
        (indices, fed_on), self._speculated = self._speculated, None
        now = rng.dump_state()
        if now == fed_on:
            return True
        self._history[-1] = (self._history[-1][0], now)
        self._redo = (indices, now)
        return False

    def _next_or_end(self) -> Any:
        """The sampler's next index batch; ``_RAN_OUT`` once it ran out (its end fed to
        the server, with the NEXT)."""
        try:
            return self._next_index()  # type: ignore[no-untyped-call]
        except StopIteration:
            self._exhausted = True
            self._owned.feed(self._fed, None, ask=True)
            return _RAN_OUT

    def feed_turn(self) -> None:
        """An iterable without workers: the next turn of its one iterator, made on this
        process's RNG states, with the NEXT."""
        self._owned.feed(self._fed, [], rng.dump_state(), ask=True)
        self._fed += 1

    def ask_ahead(self) -> None:
        self._owned.ask_ahead()

    def _send(self, indices: Any, send: Callable[[list[int]], None]) -> list[int]:
        """``send`` the sampler's ``indices`` as the index batch the server reads: torch's
        batch samplers yield lists of ints, sent as they are (anything else DataLoader
        indexes with, numpy or tensor integers, as ints); without automatic batching the
        sampler's one index is a batch of one, an index list it yields the batch after
        ``ITEM_LIST`` (``dataset[indices]``, as DataLoader reads it). Returns the batch sent."""
        if self._owned.one_index:
            indices = [p.ITEM_LIST, *indices] if isinstance(indices, list | tuple) else [indices]
        batch = indices if type(indices) is list else list(indices)
        try:
            send(batch)
        except struct.error:
            batch = [_index(i) for i in indices]
            send(batch)
        return batch

    def _feed_ahead_of_states(self) -> None:
        """Without workers, after the batch about to be made on the trainer's RNG
        states: the next one, ahead of its states (made while the trainer steps), or, if
        the sampler ran out, its end; with the NEXT."""
        owned = self._owned
        indices = self._next_or_end()
        if indices is _RAN_OUT:
            return
        self._spec = self._send(indices, lambda b: owned.feed(self._fed, b, ask=True, ahead=True))

    def _next_data(self) -> Any:
        owned = self._owned
        if owned.epoch != self._epoch or owned.state is State.IDLE:
            raise StopIteration  # a newer iterator took over this loader
        # Without workers, as DataLoader: the next index (an iterable: the next turn of
        # its one iterator), then the batch, made on this process's RNGs.
        feeding = owned.feeding
        asked = time.perf_counter()
        # (the epoch's first batch: no step before it)
        self._step_s = asked - self._out_at if self._out_at else 0.0
        feeding.before(self)
        if self._redo is not None:
            return self._made_here()
        try:
            got = self._next_batch()
        except Exception as exc:
            owned.yielded += 1  # a failed batch counts as consumed, as in DataLoader
            # not the loader's failure: the NEXT stays in flight
            self._waited(asked)
            feeding.after(self, _failed_batch(exc))
            raise
        if not got:
            raise StopIteration
        owned.yielded += 1
        self._waited(asked)
        feeding.after(self, True)
        return owned.deliver()

    def _waited(self, asked: float) -> None:
        """The batch asked for at ``asked`` came (or failed): the wait's length."""
        self._out_at = time.perf_counter()
        self._wait_s = self._out_at - asked

    def _made_here(self) -> Any:
        """The batch fed on arrival of the one before, which the trainer drew before
        asking for: the server made it on the states it had then, so this process makes
        it, on its states now, as DataLoader makes a batch without workers (its own
        fetcher over the script's objects, then ``pin_memory``), and drops the server's
        (its slot goes back with the next message). A failure of it is the dataset's
        own exception, as DataLoader's; the loader goes on."""
        assert self._redo is not None
        (indices, state), self._redo = self._redo, None
        owned = self._owned
        try:
            if self._next_batch():
                owned.deliver()  # the server's, made on other states: dropped
        except PinfeedError as exc:
            if not _failed_batch(exc):
                raise  # the loader's failure, not that batch's
        rng.load_state(state)  # the RNG message ahead of the server's batch moved them
        owned.yielded += 1
        fetcher = _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
            self._dataset_kind,
            self._dataset,
            self._auto_collation,
            self._collate_fn,
            self._drop_last,
        )
        try:
            data = fetcher.fetch(indices)
        finally:
            owned.conn.rng_after = rng.dump_state()
            owned.feeding.after(self, True)
        if self._pin_memory:
            data = torch_utils.pin_memory.pin_memory(data, self._pin_memory_device)  # type: ignore[no-untyped-call]
        device = owned.conn.delivery.device
        if device is not None:
            data = _map_tensors(data, lambda t: t.to(device, non_blocking=True))
        return data

    def _next_batch(self) -> bool:
        """The owned loader's next item; after a server restart (``reconnect=True``),
        on a new loader made from the same objects and this epoch's feed again."""
        owned = self._owned
        try:
            return owned.next_batch()
        except ServerUnavailable:
            if not owned.reconnect:
                raise
        owned.conn.reconnect(RECONNECT_TIMEOUT_S)  # ships the objects again (CREATE)
        owned.epoch, owned.state = self._epoch - 1, State.IDLE
        yielded = owned.yielded
        owned.begin(int(self._base_seed))
        for index, (batch, state) in enumerate(self._history):
            owned.feed(index, batch, state)
        if self._exhausted:
            owned.feed(len(self._history), None)
        if yielded:
            owned.seek(yielded)
        return owned.next_batch()

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        resume, self._owned.resume = self._owned.resume, None
        if resume is not None and resume.get("start"):
            _restore(loader, resume["start"])
        self._owned.epoch_start = _taken(loader)
        super()._reset(loader, first_iter)
        if not first_iter:  # persistent workers' next epoch: the same base seed, and a
            # datapipe's new shared seed (DataLoader's _ResumeIteration carries it)
            self._start(resume, None, self._shared_seed)


def _samplers(loader: Any) -> list[Any]:
    return [s for s in (loader.sampler, loader.batch_sampler) if s is not None]


def _taken(loader: Any) -> dict[str, Any]:
    """What an epoch's sampler (and base seed) will draw from, as it begins."""
    state: dict[str, Any] = {}
    if loader.generator is not None:
        state["generator"] = loader.generator.get_state()
    else:
        state["torch"] = torch.get_rng_state()
    for i, s in enumerate(_samplers(loader)):
        if callable(getattr(s, "state_dict", None)):
            state[f"sampler{i}"] = s.state_dict()
    return state


def _restore(loader: Any, state: dict[str, Any]) -> None:
    if "generator" in state and loader.generator is not None:
        loader.generator.set_state(state["generator"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    for i, s in enumerate(_samplers(loader)):
        if f"sampler{i}" in state and callable(getattr(s, "load_state_dict", None)):
            s.load_state_dict(state[f"sampler{i}"])
