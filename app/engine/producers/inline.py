"""``num_workers=0``: batches made in the engine's producer thread, in the server
process, as DataLoader's main process makes them."""

from __future__ import annotations

import time

from pinfeed_server.engine.collate import SlotWriter
from pinfeed_server.engine.errors import error_info
from pinfeed_server.engine.producers.base import ProducerContext, Result, Task

SWITCH = (
    "switching between num_workers=0 (in-server) and worker processes needs the "
    "loader recreated; carry the position with Loader.state_dict()"
)


class InlineProducer:
    restarts = 0

    def __init__(self, ctx: ProducerContext) -> None:
        self._on_result = ctx.on_result
        self._writer = SlotWriter(ctx.dataset, ctx.layout, ctx.ring.base, ctx.ring.slot_bytes)
        self._busy_s = 0.0
        self._closed = False

    def submit(self, task: Task) -> None:
        """Make the batch now, in the caller's thread, and report it before returning."""
        if task.indices is None:
            raise ValueError("the in-process producer makes batches from index lists")
        t0 = time.perf_counter()
        try:
            result = Result(task.seq, self._writer.write(task.slot, task.indices))
        except Exception as exc:
            result = Result(task.seq, error=error_info(exc))
        self._busy_s += time.perf_counter() - t0
        self._on_result(result)

    def resize(self, num_workers: int) -> None:
        if num_workers != 0:
            raise ValueError(SWITCH)

    def busy_seconds(self) -> float:
        return self._busy_s

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
