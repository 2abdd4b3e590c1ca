"""glibc's malloc in the server, set so that freed big buffers go back to the system.

glibc serves an allocation at or above its mmap threshold with a mapping of its own,
unmapped on free; but the threshold adapts upwards (to 32 MiB on 64-bit) each time such
a chunk is freed, and from then on buffers of that size come from the per-thread heaps
(arenas), which keep them after ``free``. Every loader's producer thread is a new
thread, often with an arena of its own, so each loader created and deleted left its
epoch orders behind (``torch.randperm`` of the dataset's length: 10 MiB each at 1.28 M
samples, several per loader): the server grew by ~59 MiB a loader at that size. A
fixed threshold turns the adaptation off: such buffers are always mapped, and always
returned. Only the server is set, and only once its forkserver has been forked from
it (``Service.start``): the forkserver, each dataset's zygote and every worker forked
from them keep glibc's adaptive threshold, so a worker's batch-sized buffers are reused
from its heap, not mapped and faulted in anew each batch (set before the fork, as it
once was, a batched read's 3 MiB batch cost a worker ~770 page faults a batch).

The cost the server keeps: a loader without workers makes its batches in the server,
so a dataset that allocates a buffer of 1 MiB or more per batch (a batched read's
``index_select``) has it mapped and faulted in each batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("pinfeed")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


def return_big_buffers() -> bool:
    """Fix glibc's mmap threshold at 1 MiB in this process; False where it is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc (musl, macOS): nothing to set
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD) refused: freed buffers may stay in the heap")
    return ok
