"""Peak memory of process trees, sampled from a background thread.

RSS counts a shared page once in every process that maps it (the ring, the dataset
file's page cache, pages shared after fork), so its sum over processes overstates
what the machine spends; PSS (``/proc/PID/smaps_rollup``) splits each shared page
between its users and sums to the real footprint. Both are reported; PSS is the one
to compare.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import psutil

Groups = Callable[[], dict[str, list[int]]]


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


class PeakSampler:
    """Samples the summed RSS and PSS of named groups of process trees until stopped;
    the peaks per group and depth are of their own sums (not at the same instant).

    ``groups()`` names root pids per group (e.g. ``{"server": [..], "trainer": [..]}``).
    Sampling must not slow down what it measures: RSS comes from ``/proc/PID/statm``
    every ``interval_s``; the process trees are listed every ``tree_every`` ticks and PSS
    (``smaps_rollup``, which walks the page tables under the process's mmap lock and so
    stalls its mmap/munmap calls) is read every ``pss_every`` ticks and once at the end.
    """

    def __init__(
        self,
        groups: Groups,
        interval_s: float = 0.1,
        pss_every: int = 10,
        tree_every: int = 5,
    ) -> None:
        self._groups = groups
        self._interval = interval_s
        self._pss_every = pss_every
        self._tree_every = tree_every
        self._stop = threading.Event()
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_by_group_pss: dict[str, int] = {}
        self.peak_by_group_rss: dict[str, int] = {}
        self.samples = 0
        self._procs: list[tuple[str, int]] = []
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def _list(self) -> None:
        # Per group, per depth below its root: "server" (the server process),
        # "server/1" (its children: the forkserver), "server/2+" (the workers forked from
        # it); "trainer", "trainer/1" (DataLoader's workers).
        procs: list[tuple[str, int]] = []
        seen: set[int] = set()
        for name, roots in self._groups().items():
            for root in roots:
                try:
                    level = [psutil.Process(root)]
                except psutil.NoSuchProcess:
                    continue
                depth = 0
                while level:
                    label = name if depth == 0 else f"{name}/{1 if depth == 1 else '2+'}"
                    children: list[psutil.Process] = []
                    for proc in level:
                        if proc.pid in seen:
                            continue
                        seen.add(proc.pid)
                        procs.append((label, proc.pid))
                        with contextlib.suppress(psutil.NoSuchProcess):
                            children.extend(proc.children())
                    level = children
                    depth += 1
        self._procs = procs

    def _rss_bytes(self, pid: int) -> int:
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return 0

    def _tick(self, with_pss: bool) -> None:
        rss: dict[str, int] = {}
        pss: dict[str, int] = {}
        for label, pid in self._procs:
            rss[label] = rss.get(label, 0) + self._rss_bytes(pid)
            if with_pss:
                pss[label] = pss.get(label, 0) + _pss_bytes(pid)
        for label, v in rss.items():
            self.peak_by_group_rss[label] = max(self.peak_by_group_rss.get(label, 0), v)
        for label, v in pss.items():
            self.peak_by_group_pss[label] = max(self.peak_by_group_pss.get(label, 0), v)
        self.peak_rss = max(self.peak_rss, sum(rss.values()))
        if with_pss:
            self.peak_pss = max(self.peak_pss, sum(pss.values()))
        self.samples += 1

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if n % self._tree_every == 0:
                self._list()
            self._tick(with_pss=n % self._pss_every == self._pss_every - 1)
            n += 1
            self._stop.wait(self._interval)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, object]:
        self._stop.set()
        self._thread.join(5)
        self._list()
        self._tick(with_pss=True)  # one last full sample, while the trainers still live
        return {
            "peak_rss_bytes": self.peak_rss,
            "peak_pss_bytes": self.peak_pss,
            "peak_rss_by_group": dict(self.peak_by_group_rss),
            "peak_pss_by_group": dict(self.peak_by_group_pss),
        }
