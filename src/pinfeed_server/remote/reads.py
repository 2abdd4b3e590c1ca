"""What the engine asks of a dataset over remote objects: which units its samples read.

A kind's remote dataset has ``remote_manifest`` (its objects, cut into units) and
``remote_units(indices)``: for each object a sample reads (one, or one per field of an
``npy`` dataset), the first and last unit of the range it reads there. The engine
gates each batch on them (``reader.py``) and hands the cache every epoch's order of
them (``schedule.py``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from pinfeed_server.remote.objects import Manifest


@runtime_checkable
class RemoteReads(Protocol):
    remote_manifest: Manifest

    def remote_units(
        self, indices: NDArray[np.int64]
    ) -> list[tuple[NDArray[np.int64], NDArray[np.int64]]]: ...


def remote_reads(dataset: Any) -> RemoteReads | None:
    """The remote dataset under ``dataset`` (a ``Transformed``'s, a cache's base), if any."""
    seen = 0
    while dataset is not None and seen < 8:
        if isinstance(dataset, RemoteReads):
            return dataset
        dataset = getattr(dataset, "dataset", None) or getattr(dataset, "base", None)
        seen += 1
    return None
