"""glibc's malloc in pinfeed's processes: the server returns freed big buffers to the
system; a worker keeps a batch's worth of its freed heap for the next batch.

The server (``return_big_buffers``). glibc serves an allocation at or above its mmap
threshold with a mapping of its own, unmapped on free; but the threshold adapts upwards
(to 32 MiB on 64-bit) each time such a chunk is freed, and from then on buffers of that
size come from the per-thread heaps (arenas), which keep them after ``free``. Every
loader's producer thread is a new thread, often with an arena of its own, so each
loader created and deleted left its epoch orders behind (``torch.randperm`` of the
dataset's length: 10 MiB each at 1.28 M samples, several per loader): the server grew
by ~59 MiB a loader at that size. A fixed threshold turns the adaptation off: such
buffers are always mapped, and always returned. Only the server is set, and only once
its forkserver has been forked from it (``Service.start``), so the forkserver and each
dataset's zygote keep glibc's defaults. But a loader without workers makes its batches
in the server, and a dataset that allocates a buffer of 1 MiB or more per batch (a
batched read's ``index_select``: 3 MiB a W1 batch) then had it mapped and faulted in
each batch: ~770 page faults, 1.8 ms of a 3.3 ms batch. And a fixed mmap threshold
turns the adaptive *trim* threshold off too, leaving it at glibc's 128 KiB: a loader
without workers whose samples are buffers below 1 MiB (W2's 588 KiB rows through a
per-sample Dataset, 37 MiB a batch) had its heap trimmed after each batch and faulted
in again, in some threads' arenas (the third loader on a fresh server). So while such a
loader lives, the server serves buffers up to a slot (at most glibc's 32 MiB ceiling)
from its heap and keeps a batch of freed heap for the next batch, as a worker does
(``keep_inline_batches``); a bigger buffer (an epoch order of millions of samples) is
still mapped and returned. When the last such loader goes, the mmap threshold is the
server's 1 MiB again, the trim threshold glibc's 128 KiB, and ``malloc_trim`` gives
the heap's free memory back (``release_inline_batches``), so loaders created and
deleted leave nothing behind.

A worker (``keep_batch_buffers``). A worker allocates much the same buffers for every
batch, and frees them once the batch is in its slot. glibc's adaptive thresholds fit
that badly either way: a buffer at or above the mmap threshold is mapped and faulted in
anew each time (a fixed 1 MiB threshold: ~770 page faults a 3 MiB batched read), and a
heap whose free top exceeds the trim threshold (adaptively twice the largest buffer
freed so far) is shrunk, so a batch of many samples below the threshold (64 rows of
588 KiB: 37 MiB) is given back and faulted in again at every batch: W2's rows through a
per-sample Dataset, named loader, 2 workers: ~100 ``brk`` calls and 9,000 page faults a
batch in each worker, 2.4k samples/s; with this setting 4.8k, as many page faults as
its pages are read. So a worker serves everything below glibc's own ceiling (32 MiB)
from its heap and keeps up to two slots' worth of freed heap, plus 32 MiB, for the next
batch: its resident memory stays at what a batch needs instead of going up and down
with each one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Any

log = logging.getLogger("pinfeed")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 1 << 20  # the server's
MMAP_CEILING = 32 << 20  # glibc's ceiling for its mmap threshold (64-bit): a worker's, and a cap
WORKER_TRIM_SLACK = 32 << 20
DEFAULT_TRIM_THRESHOLD = 128 << 10  # glibc's
PAGE = 4096

_inline: dict[int, int] = {}  # the server's loaders without workers: id -> slot bytes
_inline_lock = threading.Lock()


def _glibc(name: str) -> Any:
    """glibc's function ``name``, or None where the C library is not glibc (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def _mallopt() -> Any:
    return _glibc("mallopt")


def return_big_buffers() -> bool:
    """Fix glibc's mmap threshold at 1 MiB in this process; False where it is not glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False  # nothing to set
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD) refused: freed buffers may stay in the heap")
    return ok


def keep_batch_buffers(slot_bytes: int) -> bool:
    """Set a worker's malloc (see the module docstring) for batches of up to
    ``slot_bytes``; False where it is not glibc or glibc refused."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # The mmap threshold first: setting either turns glibc's adaptation off.
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_CEILING))
    ok = bool(mallopt(M_TRIM_THRESHOLD, 2 * slot_bytes + WORKER_TRIM_SLACK)) and ok
    if not ok:
        log.warning("mallopt refused: a worker may fault its batch buffers in anew each batch")
    return ok


def keep_inline_batches(owner: object, slot_bytes: int) -> bool:
    """A loader without workers (``owner``) makes batches of up to ``slot_bytes`` in this
    process: serve its buffers from the heap and keep a batch of freed heap for the next
    one while it lives (see the module docstring); False where it is not glibc or glibc
    refused."""
    with _inline_lock:
        _inline[id(owner)] = slot_bytes
        return _set_thresholds()


def release_inline_batches(owner: object) -> None:
    """``owner`` is gone: the thresholds for those left (the server's own where none
    is), and the heap's free memory back to the system (``malloc_trim``)."""
    with _inline_lock:
        if _inline.pop(id(owner), None) is None:
            return
        _set_thresholds()
        trim = _glibc("malloc_trim")
        if trim is not None:
            trim(0)


def _set_thresholds() -> bool:
    mallopt = _mallopt()
    if mallopt is None:
        return False
    most = max(_inline.values(), default=None)
    if most is None:
        mapped, threshold = MMAP_THRESHOLD, DEFAULT_TRIM_THRESHOLD
    else:  # a batch's buffers (each at most a slot) from the heap; bigger ones mapped
        mapped = min(MMAP_CEILING, max(MMAP_THRESHOLD, most + PAGE))
        threshold = 2 * most + WORKER_TRIM_SLACK
    ok = bool(mallopt(M_MMAP_THRESHOLD, mapped))
    ok = bool(mallopt(M_TRIM_THRESHOLD, threshold)) and ok
    if not ok:
        log.warning(
            "mallopt refused: a loader without workers may fault its batch buffers in "
            "anew each batch"
        )
    return ok
