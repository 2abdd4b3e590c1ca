"""Comparison helpers shared by the tests."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def smaps_rollup(pid: int) -> dict[str, int]:
    """A process's ``/proc/PID/smaps_rollup`` in bytes: ``Pss``, ``Anonymous``, ..."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def assert_same(got: Any, want: Any, where: str = "batch") -> None:
    """Same nested structure, same container types, tensors equal with equal dtypes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)} is not a tensor"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
        return
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got)} is not a numpy array"
        assert got.dtype == want.dtype and np.array_equal(got, want), f"{where}: arrays differ"
        return
    assert type(got) is type(want), (
        f"{where}: {type(got).__qualname__} != {type(want).__qualname__}"
    )
    if isinstance(want, Mapping):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_epochs_same(got: list[list[Any]], want: list[list[Any]]) -> None:
    """Epochs of batches: the same number per epoch, each batch ``assert_same``."""
    assert [len(e) for e in got] == [len(e) for e in want]
    for e, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (gb, wb) in enumerate(zip(g, w, strict=True)):
            assert_same(gb, wb, f"epoch {e} batch {i}")


def epochs_with(
    loader: Any,
    epochs: int,
    copy: Callable[[Any], Any],
    at: Mapping[tuple[int, int], Callable[[], object]] | None = None,
) -> list[list[Any]]:
    """``epochs`` epochs of ``loader``'s batches (each ``copy``-ed out of its slot),
    running ``at[(epoch, index)]`` right after that batch arrived."""
    got: list[list[Any]] = []
    for epoch in range(epochs):
        got.append([])
        for index, batch in enumerate(loader):
            got[-1].append(copy(batch))
            if at and (epoch, index) in at:
                at[(epoch, index)]()
    return got


def across_restart(
    srv: Any, create: Callable[[Any], str], copy: Callable[[Any], Any], before: int = 5
) -> list[list[Any]]:
    """Two epochs of the loader ``create(admin)`` makes on the running ``srv``: ``before``
    batches, a checkpoint, a server restart (SIGTERM), then a new Loader resumes from the
    checkpoint. ``srv`` is left running (the ``restartable`` fixture's server)."""
    from pinfeed import Loader

    with srv.client() as admin:
        name = create(admin)
    with Loader(name, socket=srv.socket) as loader:
        it = iter(loader)
        got = [copy(next(it)) for _ in range(before)]
        state = loader.state_dict()
    assert srv.stop() == 0
    srv.start()
    with Loader(name, socket=srv.socket) as loader:
        loader.load_state_dict(state)
        got += [copy(b) for b in loader]
        return [got, [copy(b) for b in loader]]


def sigkill_worker(admin: Any, server: Any, name: str, workers: int, which: int) -> None:
    """SIGKILL worker ``which`` of loader ``name`` (``workers`` processes) and wait
    until the server has replaced it."""
    from tests.reliability.procs import gone, wait_for, workers_of

    pid = server.proc.pid
    procs = wait_for(lambda: len(w := workers_of(pid, name)) == workers and w, "the workers")
    restarts = admin.loader(name)["worker_restarts"]
    procs[which].send_signal(signal.SIGKILL)
    wait_for(lambda: gone([procs[which].pid]), "the killed worker to be reaped")
    wait_for(lambda: admin.loader(name)["worker_restarts"] == restarts + 1, "a restart")


def register_synthetic(server: Any, params: dict[str, Any], prefix: str = "syn") -> tuple[str, Any]:
    """Register a synthetic dataset on ``server``; (its name, the same dataset built here)."""
    from pinfeed_server.datasets import DatasetContext, build_dataset

    name = unique(prefix)
    with server.client() as c:
        c.create_dataset(name, "synthetic", params)
    return name, build_dataset("synthetic", params, DatasetContext(server.data_root))
