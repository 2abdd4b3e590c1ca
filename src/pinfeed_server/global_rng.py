"""The process's global RNGs (``torch``, ``random``, numpy): one lock, and its rule.

THE RULE: this process holds ``GLOBAL_RNG`` whenever it runs code that may draw from
the global RNGs: the user's code (a dataset's ``__getitem__``, a transform, a
``collate_fn``, a trainer's objects being unpickled) and the checks that watch those
RNGs. An inline loader (``num_workers=0``) makes its batches on RNG states of its own
that stay in the globals after its batch (``lent_to``: the loader is their holder, so a
loader alone in its server swaps nothing per batch); whoever takes the lock next puts
them back into their holder and the server's own states into the globals
(``with GLOBAL_RNG:``). So a draw made without the lock moves some loader's states, and
its batches are no longer DataLoader's.

Held today by: the inline producer, for each batch whose code may draw
(``producers/inline.py``: ``lent_to``; ``with`` for a loader made with workers and
served inline, or an IterableDataset's turn; a built-in kind, or a trainer's objects
that draw nothing, go without); a loader's ``prepare`` reading its first samples; the
service's first sample of a dataset (``GET /v1/datasets``), a cache's determinism
check, and a trainer's objects loaded (by the service, or by an inline producer when
they change) and checked for its cache. Not held, and so
drawing on whatever states the globals have: a ``python`` dataset's factory, a
plugin's import and a custom sampler's first epoch at creation, and the threads of
executor ``thread`` (whose datasets must draw none). Worker processes, zygotes and Ray
actors have globals of their own.

The holder is held weakly: a loader closed while it holds them leaves its states
behind, and the next to enter puts the server's back.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

from pinfeed.rng import RngState, capture, restore


class Holder(Protocol):
    """A loader whose RNG states the globals may hold between its batches."""

    rng_state: RngState | None  # its states while the globals hold another's


class GlobalRngs:
    """The global RNGs and whose states they hold (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: weakref.ref[Holder] | None = None
        self._server: RngState | None = None  # the server's states while a loader's are in

    def __enter__(self) -> None:
        """Take the global RNGs as the server: with its own states in them."""
        self._lock.acquire()
        try:
            self._evict()
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def lent_to(self, holder: Holder) -> Iterator[bool]:
        """Take the global RNGs for ``holder``'s batch; yields whether they already hold
        its states (else the caller puts them in), which they keep after it."""
        with self._lock:
            current = self._holder() if self._holder is not None else None
            if current is not holder:
                self._evict()
                self._server = capture()
                self._holder = weakref.ref(holder)
            yield current is holder

    def _evict(self) -> None:
        """Under the lock: the holder's states back into it, the server's into the globals."""
        if self._holder is None:
            return
        holder = self._holder()
        if holder is not None:
            holder.rng_state = capture()
        assert self._server is not None
        restore(self._server)
        self._holder = self._server = None


GLOBAL_RNG = GlobalRngs()
