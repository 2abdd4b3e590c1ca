"""``Loader``: the trainer-side iterable over a pinfeed loader.

    loader = Loader("demo")                  # attach: ring fd + layout, mapped once
    for images, labels in loader:            # one epoch; iterate again for the next
        ...

Yields the same nested structure as DataLoader (tuple, list or dict of tensors).
Without ``copy`` or ``device`` the tensors are zero-copy views into the server's ring:
**a view stays valid until the next batch is requested**; keep data longer with
``copy=True`` (owned CPU tensors) or ``device="cuda"`` (a non_blocking copy on a
side stream; the slot is released once that copy's CUDA event has completed).

``Loader`` is the façade over two parts it holds: a ``Connection``
(``pinfeed._connection``: the attached link, the ring, views and delivery) and the
``Epochs`` over it (``pinfeed._epochs``: the epoch state machine). DataLoader's
attributes are its own properties, read from the ATTACHED reply's config; the
``dataset``, ``sampler`` and ``batch_sampler`` stand-ins are ``pinfeed._info``'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pinfeed import elastic
from pinfeed import protocol as p
from pinfeed._accelerate import PreparedAsIs
from pinfeed._connection import Connection
from pinfeed._epochs import Epoch, Epochs
from pinfeed._info import RemoteBatchSampler, RemoteDataset, RemoteSampler, server_side
from pinfeed._replay import replay
from pinfeed._transport import SocketTransport, Transport


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
    ``transport``: the data-plane connection (default: the Unix socket); tests pass
    an in-process fake.
    """

    # Accelerate: ``accelerator.prepare_data_loader(loader)`` hands back an object marked
    # prepared as it is and tracks it; ``save_state``/``load_state`` then store and
    # restore ``state_dict()`` of a tracked loader marked stateful (as StatefulDataLoader).
    # With several processes and a loader without ``world_size``: a warning.
    _is_accelerate_prepared = PreparedAsIs()
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
        self.socket_path = Path(socket) if socket is not None else p.default_socket_path()
        target = torch.device(device) if device is not None else None
        if target is not None and target.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} was asked for, but CUDA is not available")
        self._timeout = timeout
        transport = transport or SocketTransport(self.socket_path, timeout, name)
        self._conn = Connection(transport, name, member, target, copy)  # attaches
        self._epochs = Epochs(self._conn, reconnect, reconnect_timeout)
        # One sampler for the loader's life: tools keep it and call its set_epoch.
        self._sampler = RemoteSampler(self._conn.info, self.set_epoch)

    # -- what it was made with, and what the server said -----------------------------------
    @property
    def name(self) -> str:
        return self._conn.name

    @property
    def device(self) -> torch.device | None:
        return self._conn.device

    @property
    def copy(self) -> bool:
        return self._conn.copy

    @property
    def member(self) -> int | None:
        """This process's index in the loader's consumer group (the server's, once attached)."""
        return self._conn.member

    @property
    def reconnect(self) -> bool:
        return self._epochs.reconnect

    @property
    def reconnect_timeout(self) -> float:
        return self._epochs.reconnect_timeout

    @property
    def meta(self) -> p.Attached:
        """The server's ATTACHED reply (of the latest attach)."""
        return self._conn.info

    @property
    def nslots(self) -> int:
        return self._conn.info.nslots

    @property
    def slot_bytes(self) -> int:
        return self._conn.info.slot_bytes

    @property
    def state(self) -> str:
        """idle (between epochs), epoch / ahead (inside one), or closed."""
        return self._epochs.state

    @property
    def cuda_registered(self) -> bool:
        return self._conn.cuda_registered

    def ring_contains(self, t: torch.Tensor) -> bool:
        """True if ``t``'s memory lies inside this loader's ring (a zero-copy view)."""
        return self._conn.contains(t)

    # -- iteration, epochs and resume (``Epochs``) -----------------------------------------
    def __len__(self) -> int:
        """Batches per epoch: DataLoader's ``len()``, which raises TypeError for an
        IterableDataset without ``__len__``."""
        return len(self._epochs)

    def __iter__(self) -> Epoch:
        """An iterator over the next epoch, started at its first ``next()`` (see
        ``Epochs.__iter__``)."""
        return iter(self._epochs)

    def set_epoch(self, epoch: int) -> None:
        """The next epoch to start iterates ``epoch`` (as ``DistributedSampler.set_epoch``):
        called before or after ``iter(loader)``, it applies to that iterator if its first
        ``next()`` has not come yet. ``loader.sampler.set_epoch`` is the same call.

        Free when the loader is already there (the usual loop): prefetched batches stay.
        After ``load_state_dict`` into epoch e, ``set_epoch(e)`` keeps the loaded
        position (Lightning and Accelerate call it after restoring a checkpoint).
        """
        self._epochs.set_epoch(epoch)
        self._sampler.epoch = epoch

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """Where this loader is: a new Loader that loads it yields the next batch on.

        Same meaning as StatefulDataLoader's: after k batches of an epoch, the
        resumed loader's first batch is batch k (0-based) of that epoch. (An
        IterableDataset's ``index`` counts DataLoader's round-robin turns: k until a
        worker runs out, more after.) The format is ``pinfeed.elastic``'s.

        A sharded loader (``world_size``) under an initialized ``torch.distributed``
        also records every rank's position (``ranks``, an all-gather: **every rank calls
        ``state_dict()`` at the same point**, as Lightning, Accelerate and
        ``torch.distributed.checkpoint`` do; ``gather=False`` skips it). Such a state,
        or ``pinfeed.merge_states`` of every rank's, resumes every rank of the same
        world size where it was, and those of another world size with the rest of the
        epoch, each sample once (``load_state_dict``).
        """
        state = self._epochs.state_dict()
        return elastic.gather(state) if gather else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``for`` loop yields the rest of that epoch.

        A state with every rank's position (gathered, or ``pinfeed.merge_states``) of
        another world size or batch size gives this rank its share of the samples the
        old ranks had not consumed in that epoch (``pinfeed.elastic``); the following
        epochs are DistributedSampler's at this loader's world size. ``InvalidState``
        (a ValueError) if the state is of another plan, or another rank's alone.
        """
        self._epochs.load_state_dict(state)

    def replay(self, epoch: int, index: int) -> Any:
        """Batch ``index`` of ``epoch`` made again, as this loader made it (its samples,
        their augmentations on DataLoader's worker RNG streams, its ``collate_fn``),
        without disturbing the epoch being iterated: owned tensors (on ``device`` if
        the loader has one). Works for any epoch, and for a run before a server
        restart (from the loader's config, seed and elastic record). It costs about
        ``index / num_workers`` batches of a worker's time (the worker's earlier
        batches are made again to reach its RNG state). ``InvalidPosition`` for no
        such batch (or an IterableDataset's); the batch's own ``SampleError``."""
        batch, _ = replay(self.socket_path, self.name, epoch, index, self._timeout, self.device)
        return batch

    # -- DataLoader's attributes, read-only, from the config the server sent at attach ----
    @property
    def batch_size(self) -> int | None:
        """None under a ``batch_sampler``, as DataLoader's (it is the batch sampler's)."""
        config = self._conn.info.config
        return None if config.batch_sampler is not None else config.batch_size

    @property
    def drop_last(self) -> bool:
        return self._conn.info.config.drop_last

    @property
    def num_workers(self) -> int:
        """The server's worker processes for this loader (at attach)."""
        return self._conn.info.config.num_workers

    @property
    def prefetch_factor(self) -> int | None:
        """Batches ahead per worker; None without workers, as with DataLoader."""
        config = self._conn.info.config
        return config.prefetch_factor if config.num_workers else None

    @property
    def persistent_workers(self) -> bool:
        """The loader's ``persistent_workers``: one base seed, worker RNGs carried across
        epochs (the server's worker processes outlive every epoch either way)."""
        return self._conn.info.config.persistent_workers

    @property
    def pin_memory(self) -> bool:
        return self._conn.info.config.pin_memory

    @property
    def timeout(self) -> float:
        """Seconds to wait for a batch before TimeoutError (0: forever, as DataLoader)."""
        return 0.0 if self._timeout is None else float(self._timeout)

    @property
    def dataset(self) -> RemoteDataset:
        info = self._conn.info
        return RemoteDataset(info.config.dataset, info.dataset_length, info.sample)

    @property
    def sampler(self) -> RemoteSampler:
        return self._sampler

    @property
    def batch_sampler(self) -> RemoteBatchSampler:
        info = self._conn.info
        return RemoteBatchSampler(self._sampler, info.config.batch_size, info.batches_per_epoch)

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """What the server applies (collating straight into the slot): default_collate,
        or a stand-in for the loader's own ``collate_fn``, which runs in the server."""
        spec = self._conn.info.config.collate_fn
        if spec is None:
            return torch.utils.data.default_collate
        return lambda samples: server_side(f"collate_fn {spec!r}")

    @property
    def generator(self) -> torch.Generator | None:
        """A generator that makes DataLoader shuffle as this loader does (a new one each
        time: drawing from it changes nothing in the server); None where DataLoader
        would have none (no shuffle, or DistributedSampler's seed)."""
        config = self._conn.info.config
        if not config.shuffle or config.world_size is not None:
            return None
        return torch.Generator().manual_seed(config.seed)

    def _unsharded(self) -> str:
        """What to do where nothing shards this loader across processes ("": its
        ``world_size`` does, or a consumer group that splits its batches)."""
        config = self._conn.info.config
        if config.world_size is not None or (
            config.group_size > 1 and config.group_mode == "split"
        ):
            return ""
        return (
            "Create a named loader for each rank with world_size=accelerator.num_processes "
            "and rank=accelerator.process_index (POST /v1/loaders), as under DDP, or one "
            "loader with group_size=accelerator.num_processes and group_mode='split'."
        )

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Detach: hand back every slot, close the socket, unmap once no view is alive.
        (A Loader dropped unclosed detaches once neither it nor an iterator of it is
        left: ``Epochs.__del__``.)"""
        self._epochs.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
