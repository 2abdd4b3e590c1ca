"""The ways a ``pinfeed.DataLoader`` feeds its server the sampler's index batches.

The sampler stays in the trainer, where DataLoader iterates it; how far ahead its index
batches may go, and whether one NEXT is kept in flight, depends on what can see when the
sampler is iterated and on what draws from the trainer's RNGs. Each way is one object,
chosen once for the loader (``pinfeed._dataloader``'s ``_feeding``) and asked at three
moments of an epoch: ``start`` (at ``iter()``, after a resume's SEEK), ``before`` (in
``next()``, before the wait for the batch) and ``after`` (once the batch, or its failure,
arrived). It drives a ``Feeder``, the epoch's iterator over the sampler, which sends;
the wait itself is ``pinfeed._inflight.reply``, a named ``Loader``'s too, whose way is
``NextOnly``'s (the server iterates its own sampler).

- ``OnStates``: without workers, where something may draw: each batch's FEED, sent in
  ``next()``, carries the trainer's RNG states (the batch is made on them) and the NEXT.
- ``AheadOfStates``: the same, and once the trainer drew nothing between batches a few
  times in a row, the next batch is made before the trainer asks for it, one of two
  ways. A trainer that steps longer than it waits has it fed as the batch before
  arrives, on the states it has then, with the NEXT kept in flight (the server makes it
  during the step); if the trainer drew meanwhile, it makes that batch itself on its
  states, as DataLoader does, and drops the server's. A loop that only iterates has it
  fed with the batch before, ahead of its states; if the states the trainer sends when
  it asks differ, the server makes it again on them. After the first such draw, it
  feeds on states for the loader's life.
- ``PerBatch``: with workers: ``prefetch`` index batches at ``iter()``, then one more with
  the NEXT as each batch arrives, as DataLoader puts indices to its workers.
- ``Ahead``: where nothing can see when the sampler is iterated: ``depth`` index batches
  beyond those handed out, a ``chunk`` at a time (0: one at a time), the NEXT kept in
  flight; ``Prefetched`` the same with workers, fed from ``iter()`` on.
- ``Turns``: an IterableDataset without workers: each ``next()`` is a turn of its one
  iterator, on the trainer's RNG states, with the NEXT.
- ``NextOnly``: an IterableDataset with workers: nothing to feed; the NEXT kept in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# Whether the trainer drew from its RNGs since the last batch (None: the first batch of
# an epoch, nothing to compare), whether the batch asked for was made ahead of its states.
AheadOfStatesRule = Callable[[bool | None, bool], bool]
# AheadOfStates: batches in a row whose step and wait agree before the way changes.
WAY_AFTER = 2


class Feeder(Protocol):
    """One epoch's iterator over the trainer's sampler (``pinfeed._dataloader._Iter``)."""

    @property
    def yielded(self) -> int:
        """The batches handed out (or raised) in the epoch."""
        ...

    def feed_to(self, fed: int, chunk: int) -> None:
        """Feed index batches, without RNG states, until ``fed`` are (or the sampler ran
        out): ``chunk`` at a time in one message (0: one at a time)."""

    def feed(self, ask: bool) -> bool:
        """Feed the next index batch without RNG states (``ask``: with the NEXT); False once
        the sampler ran out."""
        ...

    def feed_on_states(self, ahead: AheadOfStatesRule) -> None:
        """Feed the next index batch with the RNG states it is made on, and the NEXT;
        where ``ahead`` says so, the batch after it too, ahead of its states."""

    @property
    def fed_ahead(self) -> bool:
        """Whether the next batch went ahead of its states (``feed_on_states``)."""
        ...

    @property
    def stepping(self) -> bool:
        """Whether the trainer's last step took longer than its last wait for a batch."""
        ...

    def feed_on_arrival(self) -> None:
        """As a batch arrived: feed the next index batch on the RNG states the trainer
        has now, and the NEXT, kept in flight (``speculating``)."""

    @property
    def speculating(self) -> bool:
        """Whether the batch the trainer asks for next was fed on arrival of the one
        before."""
        ...

    def speculation_stands(self) -> bool:
        """Whether the trainer drew nothing since the batch it asks for was fed on
        arrival (it stands); if it drew, that batch is made in the trainer, on its
        states, as DataLoader makes it, and the server's is dropped."""
        ...

    def feed_turn(self) -> None:
        """An iterable's next turn, with the RNG states it is made on, and the NEXT."""

    def ask_ahead(self) -> None:
        """Send the NEXT for the item after the one just received."""


class Feeding:
    """A way of feeding (the base: nothing fed, no NEXT kept in flight)."""

    chunk = 0  # index batches a message, where a resume replays the ones before it

    def start(self, it: Feeder, index: int) -> None:
        """At ``iter()``: the epoch begins at batch ``index``."""

    def before(self, it: Feeder) -> None:
        """In ``next()``, before the wait for the batch."""

    def after(self, it: Feeder, goes_on: bool) -> None:
        """The batch arrived (``goes_on``), or failed: the loader's failure where not."""


class OnStates(Feeding):
    def before(self, it: Feeder) -> None:
        it.feed_on_states(self.ahead_of_states)

    def ahead_of_states(self, drew: bool | None, made_ahead: bool) -> bool:
        """Whether the next batch goes ahead of its states: never."""
        return False


class AheadOfStates(OnStates):
    """``OnStates``, and, once the trainer drew nothing between ``quiet_before`` batches
    in a row, the next batch made before the trainer asks for it, one of two ways:

    - where the trainer steps longer than it waits for a batch (a training loop), fed as
      the batch before arrives, on the states the trainer has then, with the NEXT kept
      in flight: the server makes it while the trainer steps and sends it at once, and
      the trainer finds it in the socket. It stands if the trainer's states are still
      those when it asks; else the trainer makes that batch itself, on its states, as
      DataLoader does, and drops the server's;
    - else (a loop that waits more than it steps), fed ahead of its states when the
      batch before is asked for, and made at once on the states that batch leaves; it
      stands if the states the trainer sends when it asks for it are those, else the
      server makes it again on them.

    The first time the trainer drew before asking for such a batch, this stops for the
    loader's life."""

    def __init__(self, quiet_before: int) -> None:
        self.quiet_before = quiet_before
        self.quiet = 0  # batches in a row the trainer drew nothing between
        self.armed = True
        self.on_arrival = False  # the way: chosen by the trainer's last batches
        self.steps = 0  # batches in a row the trainer stepped longer than it waited (<0: not)

    def before(self, it: Feeder) -> None:
        speculating = it.speculating
        if speculating and not it.speculation_stands():
            self.armed = False
        self._choose(it.stepping)
        if not speculating:
            it.feed_on_states(self.ahead_of_states)

    def ahead_of_states(self, drew: bool | None, made_ahead: bool) -> bool:
        if drew is not None:
            if not drew:
                self.quiet += 1
            else:
                self.quiet = 0
                if made_ahead:
                    self.armed = False
        return self._ready() and not self.on_arrival

    def after(self, it: Feeder, goes_on: bool) -> None:
        if goes_on and self.on_arrival and self._ready() and not it.fed_ahead:
            it.feed_on_arrival()

    def _choose(self, stepping: bool) -> None:
        """The way changes once the trainer's last ``WAY_AFTER`` batches agree (a
        hiccup of one does not change it)."""
        if stepping:
            self.steps = max(1, self.steps + 1)
        else:
            self.steps = min(-1, self.steps - 1)
        if abs(self.steps) >= WAY_AFTER:
            self.on_arrival = self.steps > 0

    def _ready(self) -> bool:
        return self.armed and self.quiet >= self.quiet_before


class PerBatch(Feeding):
    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch

    def start(self, it: Feeder, index: int) -> None:
        it.feed_to(index + self.prefetch, 0)  # DataLoader's _reset puts these ahead

    def after(self, it: Feeder, goes_on: bool) -> None:
        it.feed(ask=goes_on)  # one more for each batch handed out, as DataLoader


class Ahead(Feeding):
    def __init__(self, depth: int, chunk: int) -> None:
        self.depth = depth
        self.chunk = chunk

    def before(self, it: Feeder) -> None:
        it.feed_to(it.yielded + self.depth, self.chunk)

    def after(self, it: Feeder, goes_on: bool) -> None:
        it.feed_to(it.yielded + self.depth, self.chunk)
        if goes_on:
            it.ask_ahead()


class Prefetched(Ahead):
    def start(self, it: Feeder, index: int) -> None:
        it.feed_to(index + self.depth, self.chunk)


class Turns(Feeding):
    def before(self, it: Feeder) -> None:
        it.feed_turn()


class NextOnly(Feeding):
    def after(self, it: Feeder, goes_on: bool) -> None:
        if goes_on:
            it.ask_ahead()
