"""The node's autotune thread: every loader with ``autotune`` gets a decision from its
``Tuner`` (``engine/autotune.py``: one loader's rules) once per interval, applied
through the one live-change path (``LoaderEngine.reconfigure``, admitted by the node
budget) that a PATCH takes. The ceiling it is given: the node's CPUs (this process's
affinity) and PINFEED_MAX_WORKERS less the other loaders' workers; a decision the
memory budget or the worker cap refuses becomes a ceiling too."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from pinfeed.errors import NotFound, PinfeedError
from pinfeed_server.engine.config import LiveChange
from pinfeed_server.engine.loader import LoaderEngine

log = logging.getLogger("pinfeed.autotune")


class TuningLoop:
    def __init__(
        self,
        loaders: Callable[[], list[tuple[str, LoaderEngine]]],
        free_workers: Callable[[str], int],
        reconfigure: Callable[[str, LiveChange], object],
        poll_s: float = 0.1,
    ) -> None:
        """``free_workers(name)``: the node workers the other loaders leave;
        ``reconfigure(name, change)``: the service's live change (it also records it)."""
        self._loaders = loaders
        self._free_workers = free_workers
        self._reconfigure = reconfigure
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pinfeed-autotune", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            for name, engine in self._loaders():
                try:
                    self._tick(name, engine)
                except Exception:  # one loader's trouble must not stop the others' tuning
                    log.exception("loader %s: autotune failed", name)

    def _tick(self, name: str, engine: LoaderEngine) -> None:
        tuner = engine.tuner
        if tuner is None or engine.state != "ready":
            return
        if not tuner.due(time.monotonic(), engine.stats.batches_consumed):
            return
        limit = min(len(os.sched_getaffinity(0)), self._free_workers(name))
        decision = tuner.tick(engine.tune_sample(), max(1, limit))
        if decision is None:
            return
        workers, prefetch, reason = decision
        try:
            self._reconfigure(name, LiveChange(num_workers=workers, prefetch_factor=prefetch))
        except NotFound:
            return  # deleted meanwhile
        except PinfeedError as exc:
            detail = exc.detail
            tuner.refused(workers)
            tuner.applied(tuner.num_workers, tuner.prefetch_factor, f"{reason}: {detail}")
            log.info("loader %s: autotune refused: %s", name, detail)
            return
        if engine.tuner is tuner:  # not turned off meanwhile
            tuner.applied(workers, prefetch, reason)
        log.info(
            "loader %s: autotune num_workers=%d prefetch_factor=%d: %s",
            name,
            workers,
            prefetch,
            reason,
        )
