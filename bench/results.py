"""Result files: one JSON file per measurement under ``docs/results/``, each saying where
it comes from (commit, machine, software, load) and holding every run's raw numbers.

Every ``python -m bench`` subcommand writes its file through :func:`write`; ``python -m
bench report`` (``bench.report``) makes every table in README.md and ``docs/**/*.md`` from
these files alone, so a figure in the docs is always one of these numbers.

The envelope, the same in every file::

    {
      "schema": 1,
      "name": "W1",                        # the file's stem: docs/results/W1.json
      "command": "python -m bench W1 ...",
      "commit": {"sha": "...", "short": "...", "dirty": false, "dirty_paths": []},
      "machine": {"cpus": 2, "affinity": 2, "cpu_model": "...", "memory_gib": 23.5, ...},
      "software": {"python": "3.11.7", "torch": "...", "numpy": "...", ...},
      "load": {"before": [1m, 5m, 15m], "after": [...]},
      "interference": {...},               # see ForeignCpu: other processes' CPU share
      "started": "2026-...", "wall_s": 123.4,
      "params": {...},                     # the subcommand's arguments
      ...                                  # the subcommand's own body: runs, cells
    }

A cell (one configuration measured ``n`` times) keeps its raw runs and :func:`spread`
of them: ``{"n", "median", "min", "max", "q1", "q3"}``.

Load: the 1-minute load average counts the benchmark's own processes (and decays over a
minute), so it cannot tell other work from ours. Each run therefore also measures the
CPU time that processes *outside* the benchmark's process tree used during its timed
window (``/proc/stat`` busy time minus the tree's own CPU time), as a share of the
machine: :data:`LOADED_SHARE` or more and the run is marked "under load". 5% of the
machine's cores is the tie band of the verdicts (``bench.cells``): other work below it
cannot move a result across the band.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
SCHEMA = 1
# A run is "under load" when other processes took this share of the machine's cores or
# more during its timed window (0.05 of 2 cores: 0.1 of a core).
LOADED_SHARE = 0.05
# What a clean tree means: the code that made the figures. docs/ is left out (a run
# writes its results there before they are committed).
CODE_PATHS = ("src", "bench", "tests", "pyproject.toml")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def commit() -> dict[str, Any]:
    """The commit the code was at, and whether the code differed from it (dirty)."""
    if os.environ.get("PINFEED_BENCH_COMMIT"):  # a tree exported without .git
        sha = os.environ["PINFEED_BENCH_COMMIT"]
        return {"sha": sha, "short": sha[:7], "dirty": None, "dirty_paths": []}
    sha = (_git("rev-parse", "HEAD") or "").strip()
    status = _git("status", "--porcelain", "--", *CODE_PATHS) or ""
    paths = [line[3:] for line in status.splitlines() if line.strip()]
    return {
        "sha": sha or None,
        "short": sha[:7] or None,
        "dirty": bool(paths),
        "dirty_paths": paths[:20],
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "arch": platform.machine(),
        "kernel": platform.release(),
    }


def software() -> dict[str, Any]:
    import numpy
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(ImportError):
        import pinfeed

        out["pinfeed"] = pinfeed.__version__
    with contextlib.suppress(ImportError):
        import PIL

        out["pillow"] = PIL.__version__
    return out


def start(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The envelope of a measurement about to start (``finish`` completes it)."""
    return {
        "schema": SCHEMA,
        "name": name,
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "commit": commit(),
        "machine": machine(),
        "software": software(),
        "load": {"before": list(os.getloadavg()), "after": None},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "params": {
            k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()
        },
        "_t0": time.monotonic(),
    }


def finish(result: dict[str, Any], runs: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """Completes the envelope: load after, wall time, the interference over ``runs``
    (each a dict with a ``foreign`` entry from :class:`ForeignCpu`)."""
    t0 = result.pop("_t0", None)
    result["load"]["after"] = list(os.getloadavg())
    result["wall_s"] = round(time.monotonic() - t0, 1) if t0 is not None else None
    shares = [r["foreign"]["share"] for r in runs if r.get("foreign")]
    result["interference"] = {
        "rule": f"a run is under load when processes outside the benchmark took >= "
        f"{LOADED_SHARE:.0%} of the machine's cores during its timed window",
        "loaded_share": LOADED_SHARE,
        "runs": len(shares),
        "runs_under_load": sum(s >= LOADED_SHARE for s in shares),
        "max_share": max(shares) if shares else None,
        "median_share": statistics.median(shares) if shares else None,
    }
    return result


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write(result: dict[str, Any], out: Path | None = None) -> Path:
    """``docs/results/<name>.json`` (or under ``out``)."""
    folder = out if out is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result['name']}.json"
    path.write_text(json.dumps(_clean(result), indent=1) + "\n")
    return path


def load(name: str, folder: Path | None = None) -> dict[str, Any] | None:
    path = (folder if folder is not None else RESULTS) / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def spread(xs: Sequence[float | None]) -> dict[str, Any]:
    """Median and spread of a cell's runs (``None`` entries, failed runs, left out)."""
    vals = sorted(float(x) for x in xs if x is not None and math.isfinite(float(x)))
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": vals[0],
        "max": vals[-1],
        "q1": q1,
        "q3": q3,
    }


def under_load(runs: Iterable[dict[str, Any]]) -> bool:
    return any((r.get("foreign") or {}).get("share", 0.0) >= LOADED_SHARE for r in runs)


# --- other processes' CPU during a timed window --------------------------------------

_CLK = os.sysconf("SC_CLK_TCK")


def _proc_stat() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return (user + nice + system + irq + softirq) / _CLK, steal / _CLK


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds (user + system) of a process and every descendant, including the
    children they have already reaped."""
    try:
        top = psutil.Process(root if root is not None else os.getpid())
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


class ForeignCpu:
    """CPU time used outside this process's tree between ``start()`` and ``stop()``.

    The benchmark's process tree is this process (the driver) and its descendants: the
    servers, trainers, their workers. ``stop()`` returns ``{"wall_s", "busy_s",
    "ours_s", "foreign_s", "steal_s", "share"}``, ``share`` being foreign CPU over the
    machine's capacity in the window (wall x cores)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._busy0 = self._steal0 = self._ours0 = 0.0

    def start(self) -> ForeignCpu:
        self._t0 = time.monotonic()
        self._busy0, self._steal0 = _proc_stat()
        self._ours0 = tree_cpu_s()
        return self

    def stop(self) -> dict[str, float]:
        busy, steal = _proc_stat()
        ours = tree_cpu_s() - self._ours0
        wall = time.monotonic() - self._t0
        foreign = max(0.0, busy - self._busy0 - ours)
        cores = os.cpu_count() or 1
        return {
            "wall_s": wall,
            "busy_s": busy - self._busy0,
            "ours_s": ours,
            "foreign_s": foreign,
            "steal_s": steal - self._steal0,
            "share": foreign / (wall * cores) if wall > 0 else 0.0,
        }
