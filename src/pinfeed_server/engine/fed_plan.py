"""The batch plan of a loader whose sampler runs in the trainer (``pinfeed.DataLoader``).

DataLoader iterates its sampler in the trainer's process, so the script's own sampler
object behaves as the script expects: ``set_epoch`` on its ``DistributedSampler``, a
stateful sampler's position, a ``RandomSampler`` drawing from the trainer's generator
or global RNG. ``pinfeed.DataLoader`` keeps that: its iterator draws the epoch's base
seed and iterates the batch sampler in the trainer, at the moments DataLoader's own
iterator would (``num_workers * prefetch_factor`` index batches ahead of the batch it
yields; one at a time with no workers), and sends them here: ``begin(epoch, seed)``,
``feed(epoch, index, indices)`` in order, ``end(epoch)`` once the sampler ran out.
Without workers each batch comes with the trainer's RNG states, which it is made on; a
batch fed *ahead* of them (``ahead=True``: the trainer drew nothing between its batches
so far) is made at once on the states the batch before left, and its states, fed after
it, say whether that batch stands or is made again on them (``producers/inline.py``).

The engine's production steps iterate ``arrivals(epoch)``, which yields each index list
as it arrives (``None`` turns for an IterableDataset, from ``begin`` on, until its
streams run out), or a ``Pending`` while the next has not (a step must not block: the
trainer's session may run it, and the FEED comes on that session's socket), and ends
after ``end`` or at an ``interrupt`` (a seek or stop); ``batches`` waits instead.
A batch fed ahead of its states waits for them the same way (``states_pending``). The plan
keeps the epoch's batches and seeds (and the previous epoch's), for the replay that puts
a replaced worker's RNG back where it was (``producers/seeding.py``).

Thread-safe: fed from the data-plane thread, read by the producer and the pool's threads.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

KEPT_EPOCHS = 2  # the current one and the one before (a persistent worker's replay)
_CAME, _WAIT, _GONE = object(), object(), object()  # a fed batch's state (_batch_state)


@dataclass
class _Epoch:
    seed: int
    shared: int | None = None  # a datapipe's shared seed (DataLoader's _shared_seed)
    batches: list[list[int]] = field(default_factory=list)
    rng: dict[int, bytes] = field(default_factory=dict)  # index -> the trainer's RNG state
    ahead: set[int] = field(default_factory=set)  # fed ahead of their states, which follow
    ended: bool = False


class FedPlan:
    def __init__(
        self,
        length: int,
        max_rows: int,
        *,
        iterable: bool,
        reported: int | None,
        samples: int | None,
        fed_turns: bool = False,
    ) -> None:
        """``length``: the dataset's samples (0 for an iterable without ``__len__``);
        ``max_rows``: a slot's capacity in samples; ``reported``: ``len(DataLoader)`` as
        the trainer computed it (None where it has none); ``samples``: the sampler's;
        ``fed_turns``: an IterableDataset's turns come one by one from the trainer too
        (no workers: each is made when the trainer asks, on its RNGs)."""
        self.length = length
        self.max_rows = max_rows
        self.largest = max_rows  # the most indices a batch was fed with (or max_rows)
        self.iterable = iterable
        self.fed_turns = fed_turns
        self.reported = reported
        self.samples = samples or 0
        self.dataset_length: int | None = length if length or not iterable else None
        self._epochs: dict[int, _Epoch] = {}
        self._cond = threading.Condition()
        self._interrupts = 0

    def __len__(self) -> int:
        return self.reported or 0

    # -- the trainer's side (the data-plane thread) ----------------------------------
    def begin(self, epoch: int, seed: int, shared: int | None = None) -> None:
        with self._cond:
            self._epochs[epoch] = _Epoch(seed, shared)
            for old in [e for e in self._epochs if e <= epoch - KEPT_EPOCHS]:
                del self._epochs[old]
            self._cond.notify_all()

    def feed(
        self,
        epoch: int,
        index: int,
        indices: list[int],
        rng: bytes | None = None,
        *,
        ahead: bool = False,
    ) -> None:
        """Batch ``index`` of ``epoch`` (``ahead``: before the trainer's RNG states), or
        the states of the batch fed ahead last, with its indices again; ValueError if it
        is neither."""
        with self._cond:
            e = self._epochs.get(epoch)
            if e is not None and index in e.ahead:
                if ahead or rng is None or e.batches[index] != indices:
                    raise ValueError(
                        f"batch {index} of epoch {epoch} was fed ahead: what follows is its "
                        "RNG states, with the same indices"
                    )
                e.ahead.discard(index)
                e.rng[index] = rng
                self._cond.notify_all()
                return
            if e is None or e.ended or index != len(e.batches):
                raise ValueError(
                    f"fed batch {index} of epoch {epoch} out of order (the plan has "
                    f"{'no such epoch' if e is None else f'{len(e.batches)} batches'})"
                )
            e.batches.append(indices)
            if len(indices) > self.largest:
                self.largest = len(indices)
            if ahead:
                e.ahead.add(index)
            elif rng is not None:
                e.rng[index] = rng
            self._cond.notify_all()

    def end(self, epoch: int) -> None:
        with self._cond:
            e = self._epochs.get(epoch)
            if e is not None:
                e.ended = True
            self._cond.notify_all()

    # -- the engine's side -------------------------------------------------------------
    def reset(self) -> None:
        """Forget every epoch (a new trainer's start from epoch 0)."""
        with self._cond:
            self._epochs.clear()
            self._interrupts += 1
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Wake ``batches`` iterators: they return (a seek moved production, or a stop)."""
        with self._cond:
            self._interrupts += 1
            self._cond.notify_all()

    def span(self, epoch: int) -> tuple[int, None]:
        return 0, None  # the trainer's sampler says, when it runs out

    def walk(self, epoch: int) -> int:
        return 0  # kept as the trainer fed it

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int] | None]:
        """``epoch``'s index batches from ``start`` as the trainer feeds them (``None``
        turns for an IterableDataset), each once it came; ends after the epoch's
        ``end``, or at an ``interrupt``."""
        for got in self._arrivals(epoch, start, waits=True):
            assert not isinstance(got, Pending)
            yield got

    def arrivals(self, epoch: int, start: int = 0) -> Iterator[list[int] | Pending | None]:
        """``batches``, but where the next batch has not come, a ``Pending`` (what to wait
        for) in place of a wait here: for the engine's production steps, which a
        trainer's session may run (the FEED they wait for comes on its own socket)."""
        return self._arrivals(epoch, start, waits=False)

    def _arrivals(
        self, epoch: int, start: int, *, waits: bool
    ) -> Iterator[list[int] | Pending | None]:
        with self._cond:
            interrupts = self._interrupts
        index = start
        while True:
            with self._cond:
                state = self._batch_state(epoch, index, interrupts)
                while state is _WAIT and waits:
                    self._cond.wait(0.5)
                    state = self._batch_state(epoch, index, interrupts)
                if state is _GONE:
                    return
                got: list[int] | Pending | None
                if state is _WAIT:
                    still = functools.partial(self._batch_waits, epoch, index, interrupts)
                    got = Pending(self._cond, still)
                else:
                    got = None if self.iterable else self._epochs[epoch].batches[index]
                    index += 1
            yield got

    def _batch_waits(self, epoch: int, index: int, interrupts: int) -> bool:
        return self._batch_state(epoch, index, interrupts) is _WAIT

    def _batch_state(self, epoch: int, index: int, interrupts: int) -> object:
        """Under ``_cond``: whether batch ``index`` of ``epoch`` came (``_CAME``), is still
        to come (``_WAIT``) or never will (``_GONE``: the epoch ended before it, or an
        interrupt since ``interrupts``)."""
        if self._interrupts != interrupts:
            return _GONE
        e = self._epochs.get(epoch)
        if e is None:
            return _WAIT
        if (self.iterable and not self.fed_turns) or index < len(e.batches):
            return _CAME
        return _GONE if e.ended else _WAIT

    def states_pending(self, epoch: int, index: int) -> Pending | None:
        """What batch ``index`` of ``epoch``, fed ahead of the trainer's RNG states, waits
        for while they are still to come (they come, its epoch ends or goes, or an
        interrupt); None where it waits for nothing."""
        with self._cond:
            due = functools.partial(self._states_due, epoch, index, self._interrupts)
            return Pending(self._cond, due) if due() else None

    def _states_due(self, epoch: int, index: int, interrupts: int) -> bool:
        """Under ``_cond``: whether batch ``index``'s states are still to come."""
        e = self._epochs.get(epoch)
        return (
            self._interrupts == interrupts
            and e is not None
            and not e.ended
            and index in e.ahead
            and index not in e.rng
        )

    def base_seed(self, epoch: int) -> int:
        """The base seed the trainer's iterator drew for ``epoch``."""
        return self._epoch(epoch).seed

    def shared_seed(self, epoch: int) -> int | None:
        """The shared seed the trainer's iterator drew for ``epoch`` (a datapipe's)."""
        return self._epoch(epoch).shared

    def _epoch(self, epoch: int) -> _Epoch:
        with self._cond:
            e = self._epochs.get(epoch)
            if e is None:
                raise KeyError(f"epoch {epoch} has not begun (or is long gone)")
            return e

    def fed(self, epoch: int) -> tuple[list[list[int]], bool]:
        """What ``epoch`` has been fed so far, and whether it ended (a replay's history)."""
        with self._cond:
            e = self._epochs.get(epoch)
            return ([], False) if e is None else (list(e.batches), e.ended)

    def trainer_rng(self, epoch: int, index: int) -> tuple[bytes | None, bool]:
        """The trainer's global RNG state that batch ``index`` is to be made on (a loader
        without workers: DataLoader makes its batches in the trainer, on its RNGs), if it
        came, and whether the batch came ahead of it (the state still to come), read
        together: a state arriving between two calls would be seen by neither."""
        with self._cond:
            e = self._epochs.get(epoch)
            if e is None:
                return None, False
            return e.rng.pop(index, None), index in e.ahead

    def wait_rng(self, epoch: int, index: int) -> bytes | None:
        """The trainer's RNG states for batch ``index``, fed ahead of them, once they
        come; None if they never will (its epoch ended or went, a seek, a stop)."""
        with self._cond:
            interrupts = self._interrupts
            self._cond.wait_for(lambda: not self._states_due(epoch, index, interrupts))
            e = self._epochs.get(epoch)
            if e is None or self._interrupts != interrupts:
                return None
            return e.rng.pop(index, None)


class Pending:
    """What a production step that must not block waits for (``FedPlan.arrivals``,
    ``FedPlan.states_pending``): ``wait`` returns once it came or never
    will, or after ``timeout``; ``done``, whether it has."""

    def __init__(self, cond: threading.Condition, still: Callable[[], bool]) -> None:
        self._cond = cond
        self._still = still  # whether it is still to come (called under cond)

    def done(self) -> bool:
        with self._cond:
            return not self._still()

    def wait(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._still(), timeout)
