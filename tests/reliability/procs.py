"""Process-level probes for the reliability tests: /proc, psutil, bounded polling."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch
from torch.utils.data import DataLoader

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T | bool | None], what: str, timeout: float = 10.0, every: float = 0.02
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if last:
            return last  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        time.sleep(every)


def fd_targets(pid: int) -> list[str]:
    """Where each open fd of ``pid`` points (files, sockets, pipes, memfds)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # closed while we listed
    return sorted(out)


def memfds(pid: int) -> list[str]:
    return [t for t in fd_targets(pid) if t.startswith("/memfd:pinfeed-")]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def maps_ring(pid: int, loader: str) -> bool:
    """True if ``pid`` has loader ``loader``'s ring mapped."""
    needle = f"/memfd:pinfeed-{loader} (deleted)"
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(line.rstrip().endswith(needle) for line in f)
    except OSError:
        return False


def cache_holders(server_pid: int, key: str) -> list[str]:
    """Which of the server's processes (it and its descendants) hold the cache region
    ``key`` (a dataset's name, or a trainer's cache's ``~name``): by an fd, or mapped."""
    name = f"/memfd:pinfeed-cache-{key} (deleted)"
    out = []
    for pid in [server_pid, *(p.pid for p in descendants(server_pid))]:
        try:
            fds = [t for t in fd_targets(pid) if t == name]
            with open(f"/proc/{pid}/maps") as f:
                maps = [line for line in f if line.rstrip().endswith(name)]
        except OSError:
            continue  # gone while we looked
        if fds or maps:
            out.append(f"pid {pid}: {len(fds)} fds, {len(maps)} mappings")
    return out


def workers_of(server_pid: int, loader: str) -> list[psutil.Process]:
    """The server's worker processes that map ``loader``'s ring (children of its forkserver)."""
    return [p for p in descendants(server_pid) if maps_ring(p.pid, loader)]


def gone(pids: list[int]) -> bool:
    """True once none of ``pids`` runs (zombies count as gone: nothing left but an entry)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def reference(
    dataset: Any, epochs: int, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False
) -> list[list[Any]]:
    """DataLoader's batches for ``epochs`` epochs: ``[epoch][index]``."""
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, generator=gen, drop_last=drop_last
    )
    return [list(loader) for _ in range(epochs)]


def reference_indices(
    length: int, epochs: int, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False
) -> list[list[list[int]]]:
    """The sample indices of DataLoader's batches: ``[epoch][index] -> [i, ...]``."""
    batches = reference(
        range(length),
        epochs,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return [[b.tolist() for b in epoch] for epoch in batches]


def unix_socket_paths(pids: list[int]) -> set[str]:
    """Filesystem paths of the Unix sockets that ``pids`` hold open (via /proc/net/unix)."""
    inodes = set()
    for pid in pids:
        try:
            targets = fd_targets(pid)
        except OSError:
            continue
        inodes |= {t[len("socket:[") : -1] for t in targets if t.startswith("socket:[")}
    paths = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) >= 8 and cols[6] in inodes:
                paths.add(cols[7])
    return paths


def servers_on(socket: Path) -> list[psutil.Process]:
    """The server processes on ``socket``: ``python -m pinfeed_server serve`` with that
    PINFEED_SOCKET, not counting its own children (forkserver, zygotes, workers)."""
    found = {}
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        try:
            serve = (proc.info["cmdline"] or [])[-3:] == ["-m", "pinfeed_server", "serve"]
            if serve and proc.environ().get("PINFEED_SOCKET") == str(socket):
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return [p for p in found.values() if p.info["ppid"] not in found]
