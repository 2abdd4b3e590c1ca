"""Accelerate's ``prepare`` of a pinfeed loader: handed back as it is, and a warning
where that leaves every process the whole epoch.

Accelerate's ``prepare_data_loader`` hands back as it is a loader whose
``_is_accelerate_prepared`` is true, and tracks it (with ``use_stateful_dataloader``,
its ``state_dict`` goes into ``save_state``). What Accelerate's own prepared loader
(``DataLoaderShard``) does each epoch, the pinfeed loader then does itself: it calls
``set_epoch(iteration)`` as each epoch begins and counts ``iteration`` on after each
whole one, so a Hugging Face ``IterableDataset`` reshuffles per epoch as under
Accelerate. Any other DataLoader it makes anew, as a torch DataLoader of its own over
the loader's dataset and batch sampler: the batches would no longer be pinfeed's. A
DataLoader it prepares for several processes it also shards (``BatchSamplerShard``:
each process every n-th batch); a pinfeed loader handed back is sharded only by its own
sampler (``DistributedSampler``) or, a named loader, by its ``world_size``. Where
neither is, every process would iterate the whole dataset, silently: so the moment
Accelerate reads the mark, the one moment that shows a loader is being prepared, warns,
once a loader, naming the fix.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any


def processes() -> int:
    """The number of processes of the running Accelerate job (1: none, or Accelerate's
    state not set up; this never sets it up)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    if not shared:
        return 1
    return int(state.PartialState().num_processes)  # type: ignore[union-attr]


class PreparedAsIs:
    """The ``_is_accelerate_prepared`` of a pinfeed loader class: always true. Read on a
    loader (by Accelerate's ``prepare_data_loader``) under several processes, it warns
    if ``loader._unsharded()`` returns what to do about a loader nothing shards."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._warned = f"_{name}_warned"

    def __get__(self, loader: Any, owner: type | None = None) -> bool:
        if loader is None or loader.__dict__.get(self._warned):
            return True
        n = processes()
        if n > 1:
            loader.__dict__[self._warned] = True
            fix = loader._unsharded()
            if fix:
                warnings.warn(
                    f"Accelerate hands a {type(loader).__name__} back as it is and does "
                    f"not shard it: each of the {n} processes would iterate the whole "
                    f"dataset. {fix}",
                    UserWarning,
                    stacklevel=2,
                )
        return True

    def __set__(self, loader: Any, value: Any) -> None:
        """Accelerate marks what ``prepare()`` returned: a pinfeed loader already is; from
        now on it moves its epochs on as Accelerate's own prepared loader does
        (``DataLoader.__iter__``)."""
        if value:
            loader.__dict__["_prepared"] = True
