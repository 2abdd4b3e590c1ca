"""A failed loader made ready again, once the producer that failed it can make batches
again (the Ray executor, when its cluster is back: ``producers/ray.py``).

The producer keeps the tasks it had in flight and re-sends them itself; the engine only
leaves ``failed``, clears its stop event and starts a new producer thread, which goes
on from the plan's cursor, where the old one stopped. Kept out of ``loader.py`` (its
size), it works on the engine's own state, under the engine's condition.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pinfeed_server.engine.loader import LoaderEngine

PRODUCER_THREAD = "pinfeed-produce-"


def resume_producing(engine: LoaderEngine) -> None:
    """``failed`` -> ``ready``, producing from where the engine stopped."""
    old = [t for t in engine._threads if t.name.startswith(PRODUCER_THREAD)]
    for t in old:
        t.join(10)  # it saw the stop event and ends (it may need the condition to)
    with engine._cond:
        if engine.state != "failed":
            return  # deleted meanwhile, or never failed
        engine.state, engine.failure = "ready", None
        engine._stop.clear()
        thread = threading.Thread(
            target=engine._produce, name=PRODUCER_THREAD + engine.config.name, daemon=True
        )
        engine._threads.append(thread)
        engine._cond.notify_all()
    thread.start()
