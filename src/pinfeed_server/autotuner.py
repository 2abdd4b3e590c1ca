"""The service's autotune thread: every loader with ``autotune`` gets a decision from its
``Tuner`` (``engine/autotune.py``) once per interval, applied through the same
admission and live reconfigure as a PATCH. The ceiling it is given: the node's CPUs
(this process's affinity) and PINFEED_MAX_WORKERS less the other loaders' workers;
a decision the memory budget or the worker cap refuses becomes a ceiling too."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from pinfeed import errors

if TYPE_CHECKING:
    from pinfeed_server.engine.loader import LoaderEngine
    from pinfeed_server.service import Service

log = logging.getLogger("pinfeed.autotune")


class Autotuner:
    def __init__(self, service: Service, poll_s: float = 0.1) -> None:
        self._service = service
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
            for name, engine in list(self._service.loaders.items()):
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
        service = self._service
        cores = len(os.sched_getaffinity(0))
        limit = min(cores, service.settings.max_workers - service.workers_used(name))
        decision = tuner.tick(engine.tune_sample(), max(1, limit))
        if decision is None:
            return
        workers, prefetch, reason = decision
        try:
            service.reconfigure(name, workers, prefetch, tuner.spec)
        except errors.NotFound:
            return  # deleted meanwhile
        except errors.ProblemError as exc:
            tuner.refused(workers)
            tuner.applied(tuner.num_workers, tuner.prefetch_factor, f"{reason}: {exc.detail}")
            log.info("loader %s: autotune refused: %s", name, exc.detail)
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
