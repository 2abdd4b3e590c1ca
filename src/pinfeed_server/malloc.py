"""glibc's malloc in the server: freed memory of a loader's threads goes back to the
system when the loader goes.

glibc serves an allocation at or above its mmap threshold with a mapping of its own,
unmapped on free; but the threshold adapts upwards (to 32 MiB on 64-bit) each time such
a chunk is freed, and from then on buffers of that size come from the per-thread heaps
(arenas), which keep them after ``free``. Every loader's producer thread is a new
thread, often with an arena of its own, so each loader created and deleted left its
epoch orders behind (``torch.randperm`` of the dataset's length: 10 MiB each at 1.28 M
samples, several per loader): the server grew by ~59 MiB a loader at that size.

The adaptation is what a producer in the server needs, though: a batch-sized buffer
made anew every batch (a batched ``__getitem__``'s gather, a ``collate_fn``'s output)
is then reused from the heap. A fixed threshold, as this module set before, mapped and
faulted every such buffer afresh: 768 page faults a 3 MiB batch, a tuned DataLoader's
batched read through pinfeed.DataLoader at 52k samples/s where DataLoader makes 480k.
So the threshold keeps adapting, and ``give_back_freed`` (``malloc_trim(0)``: every
arena's free pages, not only the main heap's top) runs once a deleted loader's engine
is freed (``service.py``, ``_collect_until_gone``). Only the server does this; its
workers, fresh processes from the forkserver, end with their loader.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None  # not glibc (musl, macOS): nothing to trim
    fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
    return fn


def give_back_freed() -> bool:
    """Return the free pages of every malloc arena to the system; whether any went
    (False where it is not glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
