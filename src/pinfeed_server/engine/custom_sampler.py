"""A user's ``sampler`` or ``batch_sampler`` as a batch plan (``sampler.BatchPlan``).

The loader fields are ``{"factory": "module:callable", "kwargs": {...}}``
(``SamplerSpec``, ``BatchSamplerSpec``); the factory is resolved by
``pinfeed_server.plugins.resolve`` and called in the server as ``factory(dataset,
**kwargs)``. ``CustomPlan`` iterates what it returns once per epoch, as DataLoader
iterates it; ``oversize`` is the per-batch error for a batch larger than the slots.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from torch.utils.data import BatchSampler, Sampler

from pinfeed.errors import BatchTooLarge
from pinfeed.protocol import ErrorInfo
from pinfeed_server.errors import DomainError
from pinfeed_server.plugins import SPEC, PluginError, resolve


class SamplerSpec(BaseModel):
    """DataLoader's ``sampler``: ``factory(dataset, **kwargs)``, called in the server,
    returns a ``torch.utils.data.Sampler`` of indices."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factory: str = Field(
        pattern=SPEC,
        description="'package.module:callable' under PINFEED_ALLOWED_PLUGINS, called as "
        "factory(dataset, **kwargs); the same call must give the same order (seed it)",
        examples=["mylab.data.samplers:weighted"],
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments (JSON)")


class BatchSamplerSpec(SamplerSpec):
    """DataLoader's ``batch_sampler``: the factory returns a ``Sampler`` of index lists."""

    max_batch_size: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="the largest batch it yields, which sizes the ring's slots; null: "
        "the largest batch of its first epoch. A larger batch is a batch-too-large error",
    )


class SamplerError(DomainError, ValueError):
    """A ``sampler`` or ``batch_sampler`` that cannot be used; the message names it."""


KEEP_EPOCHS = 2  # epochs whose batches a custom plan keeps (seek, resume without replay)


class _Recorded:
    """One epoch's batches as the sampler gave them, compactly (int64 arrays)."""

    __slots__ = ("complete", "ends", "flat")

    def __init__(self) -> None:
        self.flat = array("q")
        self.ends = array("q")
        self.complete = False

    def __len__(self) -> int:
        return len(self.ends)

    def add(self, batch: list[int]) -> None:
        self.flat.extend(batch)
        self.ends.append(len(self.flat))

    def __getitem__(self, i: int) -> list[int]:
        return self.flat[self.ends[i - 1] if i else 0 : self.ends[i]].tolist()


class CustomPlan:
    """A user's ``sampler`` (batched as DataLoader batches it: ``BatchSampler(sampler,
    batch_size, drop_last)``) or ``batch_sampler`` (its index lists as they come),
    iterated once per epoch, each epoch to its end, as DataLoader iterates it: a sampler
    with its own RNG advances it epoch after epoch. ``set_epoch(e)`` is called on the
    sampler, where it has one, before epoch e is iterated (as Lightning and Accelerate
    call it).

    Random access (seek, resume, set_epoch, skipping an epoch): the batches of the
    latest ``KEEP_EPOCHS`` epochs are kept, so a position in them is served from memory;
    an older epoch is replayed from a fresh instance (the factory called again, its
    epochs iterated from the first), exactly what a new DataLoader process would do.

    The first epoch is iterated at creation: it checks what the sampler yields (index
    lists inside the dataset), counts batches where the sampler has no ``__len__``, and
    gives a ``batch_sampler``'s largest batch, which sizes the ring's slots.
    """

    def __init__(
        self,
        field: str,
        make: Callable[[], Any],
        length: int,
        *,
        batch_size: int,
        drop_last: bool,
        batched: bool,
        max_batch_size: int | None = None,
    ) -> None:
        self.field = field
        self.length = length
        self._make = make
        self._batch_size, self._drop_last, self._batched = batch_size, drop_last, batched
        self._source: Any = None  # the user's sampler: set_epoch is called on it
        self._order: Any = None  # what is iterated: the batch sampler
        self._it: Iterator[Any] | None = None  # the live epoch's iterator
        self._epoch = -1  # the epoch the instance iterates (or iterated last)
        self._epochs: dict[int, _Recorded] = {}
        self._fresh()
        try:
            first = self._recorded(0)
            while not first.complete:
                self._pull(first, check=True)
        except SamplerError:
            raise
        except Exception as exc:
            raise SamplerError(
                f"{field}: iterating its first epoch raised {type(exc).__name__}: {exc}"
            ) from None
        if not len(first):
            raise SamplerError(f"{field}: its first epoch yielded no batch")
        self._len = _length(self._order, len(first))  # no __len__: what epoch 0 gave
        # DataLoader's loader.sampler: the user's sampler, or SequentialSampler(dataset)
        # under a batch_sampler.
        self.samples = length if batched else _length(self._source, len(first.flat))
        biggest = max((len(first[i]) for i in range(len(first))), default=1)
        self.max_rows = (max_batch_size or biggest) if batched else batch_size
        if max_batch_size is not None and biggest > max_batch_size:
            raise SamplerError(
                f"{field}: its first epoch has a batch of {biggest} samples, over "
                f"max_batch_size {max_batch_size}"
            )

    def __len__(self) -> int:
        """Batches per epoch: ``len(batch_sampler)``, as DataLoader's ``len()``."""
        return self._len

    def _fresh(self) -> None:
        try:
            source = self._make()
        except Exception as exc:
            raise SamplerError(
                f"{self.field}: its factory(dataset, **kwargs) raised {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(source, Sampler):
            raise SamplerError(
                f"{self.field}: its factory returned a {type(source).__name__}, not a "
                "torch.utils.data.Sampler"
            )
        self._source = source
        self._order = (
            source if self._batched else BatchSampler(source, self._batch_size, self._drop_last)
        )
        self._it, self._epoch = None, -1
        self._epochs.clear()

    def _begin(self, epoch: int) -> _Recorded:
        """Start iterating ``epoch`` (the instance's next one)."""
        set_epoch = getattr(self._source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._it, self._epoch = iter(self._order), epoch
        rec = self._epochs[epoch] = _Recorded()
        for old in [e for e in self._epochs if e <= epoch - KEEP_EPOCHS]:
            del self._epochs[old]
        return rec

    def _pull(self, rec: _Recorded, check: bool = False) -> None:
        """One more batch of the live epoch into its record."""
        assert self._it is not None
        try:
            raw = next(self._it)
        except StopIteration:
            rec.complete, self._it = True, None
            return
        try:
            batch = [int(i) for i in raw]
        except (TypeError, ValueError):
            raise SamplerError(
                f"{self.field} yielded {type(raw).__name__} {str(raw)[:60]}, not a list of indices"
            ) from None
        if check and not batch:
            raise SamplerError(f"{self.field} yielded an empty batch")
        if check and not all(0 <= i < self.length for i in batch):
            raise SamplerError(
                f"{self.field} yielded indices {batch[:8]}... outside the dataset's "
                f"{self.length} samples"
            )
        rec.add(batch)

    def _recorded(self, epoch: int) -> _Recorded:
        """``epoch``'s record, the instance moved there if it is not kept."""
        rec = self._epochs.get(epoch)
        if rec is not None:
            return rec
        if epoch <= self._epoch:  # an epoch no longer kept: replay from a fresh instance
            self._fresh()
        while True:
            live = self._epochs.get(self._epoch)
            while live is not None and not live.complete:  # finish it, as DataLoader would
                self._pull(live)
            rec = self._begin(self._epoch + 1)
            if self._epoch == epoch:
                return rec

    def span(self, epoch: int) -> tuple[int, int]:
        return 0, self._len

    def walk(self, epoch: int) -> int:
        if epoch in self._epochs:
            return 0
        return epoch + 1 if epoch <= self._epoch else epoch - self._epoch

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        for i in itertools.count(start):
            rec = self._recorded(epoch)
            while len(rec) <= i and not rec.complete:
                self._pull(rec)
            if i >= len(rec):
                return
            yield rec[i]


def _length(sampler: Any, counted: int) -> int:
    try:
        return len(sampler)
    except (TypeError, NotImplementedError):  # no __len__ (Sampler's base has none)
        return counted


def custom_plan(
    field: str,
    spec: SamplerSpec,
    dataset: Any,
    allowed: tuple[str, ...],
    *,
    batch_size: int,
    drop_last: bool,
) -> CustomPlan:
    """The plan of a loader's ``sampler`` or ``batch_sampler`` field (``SamplerError``
    naming it when its factory cannot be used)."""
    try:
        factory = resolve(spec.factory, allowed, what=f"{field} factory")
    except PluginError as exc:
        raise SamplerError(str(exc)) from None
    except Exception as exc:  # a module that raises on import
        raise SamplerError(
            f"{field} factory {spec.factory!r}: importing it raised {type(exc).__name__}: {exc}"
        ) from None
    kwargs = dict(spec.kwargs)
    batched = isinstance(spec, BatchSamplerSpec)
    return CustomPlan(
        field,
        lambda: factory(dataset, **kwargs),
        len(dataset),
        batch_size=batch_size,
        drop_last=drop_last,
        batched=batched,
        max_batch_size=spec.max_batch_size if isinstance(spec, BatchSamplerSpec) else None,
    )


def oversize(indices: list[int] | None, capacity: int) -> ErrorInfo | None:
    """The error that stands for a batch larger than its slot (a ``batch_sampler``'s
    batch over the largest one the ring was sized for), else None."""
    if indices is None or len(indices) <= capacity:
        return None
    return BatchTooLarge(
        f"the batch_sampler gave a batch of {len(indices)} samples; the ring's slots hold "
        f"{capacity} (its largest batch in the first epoch): set batch_sampler."
        f"max_batch_size to at least {len(indices)}",
        index=None,
        error_type="BatchTooLarge",
    ).info()
