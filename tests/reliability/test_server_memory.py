"""Loaders come and go on a long-lived server: what a deleted loader held goes back to
the system. Each loader's producer thread is a new thread; under glibc's default
(adaptive) mmap threshold its epoch orders (``torch.randperm`` of the dataset's length)
stayed in that thread's heap after the loader was deleted, and the server grew by
tens of MiB a loader on a large dataset (``src/pinfeed_server/malloc.py``). The
server's fixed threshold is its own: its workers keep what a batch needs in their heap
(a batch-sized buffer, or a batch's many sample-sized ones) instead of faulting it in
anew each batch."""

from __future__ import annotations

import itertools
import resource
import statistics
from collections.abc import Callable

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, RandomSampler

import pinfeed
from pinfeed import Loader
from tests.conftest import Server

SAMPLES = 2_000_000  # one epoch order: 16 MB of int64
MiB = 1 << 20


def _private_dirty(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Private_Dirty:"))


@pytest.mark.slow
@pytest.mark.serial  # the server's private memory over six loaders
def test_deleted_loaders_give_their_memory_back(make_server: Callable[..., Server]) -> None:
    server = make_server()
    server.start()
    assert server.proc is not None
    with server.client() as admin:
        admin.create_dataset(
            "big", "synthetic", {"length": SAMPLES, "fields": [{"shape": [1], "dtype": "uint8"}]}
        )

        def cycle(k: int, workers: int) -> None:
            admin.create_loader(
                f"l{k}", dataset="big", batch_size=64, shuffle=True, num_workers=workers
            )
            with Loader(f"l{k}", socket=server.socket) as loader:
                next(iter(loader))
            admin.delete_loader(f"l{k}")

        cycle(0, 0)
        cycle(1, 1)
        before = _private_dirty(server.proc.pid)
        for k in range(2, 8):
            cycle(k, k % 2)
        grown = _private_dirty(server.proc.pid) - before
    # six loaders, each with several 16 MB epoch orders: ~100 MiB and more if kept
    assert grown < 24 * MiB, f"the server grew by {grown / MiB:.1f} MiB over 6 deleted loaders"
    server.stop()


class Allocates(Dataset[int]):
    """Each sample allocates, fills and frees a 3 MiB buffer, as a batched read's
    ``index_select`` does a batch, and is the page faults its process has taken."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        torch.empty(3 * MiB, dtype=torch.uint8).fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_workers_reuse_their_buffers_instead_of_faulting_them_in(server: Server) -> None:
    """A worker's 3 MiB buffer comes back from its heap from the second sample on (a few
    faults a sample), not mapped anew (768 faults a sample at a fixed 1 MiB threshold)."""
    with pinfeed.DataLoader(
        Allocates(), batch_size=None, num_workers=1, socket=server.socket
    ) as loader:
        faults = [int(n) for n in loader]
    per_sample = [b - a for a, b in itertools.pairwise(faults[5:])]
    assert statistics.median(per_sample) < 100, f"page faults a sample: {per_sample}"


class Rows(Dataset[tuple[torch.Tensor, int]]):
    """Each sample a new 512 KiB tensor (a row copied out of a file, as a per-sample
    Dataset reads), with the page faults its process has taken."""

    def __len__(self) -> int:
        return 32 * 24

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = torch.full((128 * 1024,), float(index))
        return row, resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_workers_keep_a_batch_of_sample_buffers_for_the_next_batch(server: Server) -> None:
    """A batch of 32 samples of 512 KiB (16 MiB, freed once collated into the slot) is
    served from the worker's heap batch after batch. Under glibc's adaptive thresholds
    the heap was trimmed after each batch and its 4,096 pages faulted in again. The first
    batches fault their memory in anyway: those made before the ring is sized (a memfd
    each) and the first batch into each slot; the second half of the epoch has none."""
    with pinfeed.DataLoader(Rows(), batch_size=32, num_workers=1, socket=server.socket) as loader:
        faults = [int(faults[0]) for _, faults in loader]
    per_batch = [b - a for a, b in itertools.pairwise(faults[len(faults) // 2 :])]
    assert statistics.median(per_batch) < 512, f"page faults a batch: {per_batch}"


@pytest.mark.slow
def test_a_loader_without_workers_keeps_a_batch_of_sample_buffers(
    make_server: Callable[..., Server],
) -> None:
    """The same batch of sample buffers made by the server itself (no workers), for
    loader after loader on a fresh server: each producer thread is a new one, whose
    arena may be trimmed under the 128 KiB trim threshold that the server's fixed mmap
    threshold left in place (without ``keep_inline_batches``: 770 page faults a batch
    for the first loader here; W2's third loader on a fresh server took 9,000)."""
    server = make_server()
    server.start()
    for k in range(4):
        with pinfeed.DataLoader(
            Rows(), batch_size=32, num_workers=0, socket=server.socket
        ) as loader:
            faults = [int(faults[0]) for _, faults in loader]
        per_batch = [b - a for a, b in itertools.pairwise(faults[2:])]
        assert statistics.median(per_batch) < 512, f"loader {k}: page faults a batch: {per_batch}"
    server.stop()


class BatchedRead(Dataset[tuple[torch.Tensor, int]]):
    """A tuned Dataset read a batch at a time (``batch_size=None`` over a
    ``BatchSampler``): one ``index_select`` a batch, a new 1.5 MiB tensor, with the page
    faults its process has taken once it is made."""

    def __init__(self) -> None:
        self.rows = (torch.arange(2048 * 3 * 64 * 64) % 251).to(torch.uint8).view(2048, -1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, int]:
        rows = torch.index_select(self.rows, 0, torch.as_tensor(indices))
        return rows, resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_loader_without_workers_keeps_a_batched_reads_buffer(server: Server) -> None:
    """A batched read of 1.5 MiB a batch made by the server itself (no workers) comes
    from its heap batch after batch; under the server's own 1 MiB mmap threshold it was
    mapped and its 384 pages faulted in anew each batch (W1's 3 MiB batches: 1.8 ms of
    3.3 ms a batch)."""
    dataset = BatchedRead()
    sampler = BatchSampler(RandomSampler(dataset), batch_size=128, drop_last=False)
    with pinfeed.DataLoader(
        dataset, batch_size=None, sampler=sampler, num_workers=0, socket=server.socket
    ) as loader:
        for _ in range(2):  # the second epoch's: the ring is sized, its slots faulted in
            faults = [int(n) for _, n in loader]
    per_batch = [b - a for a, b in itertools.pairwise(faults[4:])]
    assert statistics.median(per_batch) < 128, f"page faults a batch: {per_batch}"
