"""DataLoader's side of ``bench scale``, in a process of its own (its tree is measured).

Argument: a JSON spec ``{folder, workers, batch_size, epoch, paths}``; prints one JSON
line: the ImageFolder-like Dataset's scan time, per worker count the ``iter()`` +
``next()`` time (median of ``runs``, each a fresh ``iter()``: new workers) and the
tree's PSS (after one epoch too with ``epoch``), and with
``paths`` one 4-worker epoch over ``PathList(paths)``: PSS at the first batch and after.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from bench import results
from bench.references import PilImageFolder
from bench.scale import epoch_pss, tree_pss
from tests.fixtures.datasets import PathList


def main(spec: dict[str, Any]) -> dict[str, Any]:
    import os

    pid = os.getpid()
    t0 = time.perf_counter()
    ds = PilImageFolder(Path(spec["folder"]), 16)
    out: dict[str, Any] = {"scan_s": time.perf_counter() - t0, "pss_idle": tree_pss(pid)}
    for nw in spec["workers"]:
        dl = DataLoader(ds, batch_size=spec["batch_size"], shuffle=True, num_workers=nw)
        times = []
        for run in range(spec.get("runs", 1)):
            t0 = time.perf_counter()
            it = iter(dl)
            next(it)
            times.append(time.perf_counter() - t0)
            if run == 0:
                row: dict[str, Any] = {"pss": tree_pss(pid)}
                if spec["epoch"]:
                    row["pss_epoch"] = epoch_pss(it, len(dl) - 1, pid)
            del it
        row["first_batch_s"] = results.spread(times)["median"]
        row["first_batch_spread"] = results.spread(times)
        out[f"w{nw}"] = row
    if spec["paths"]:
        paths = PathList(spec["paths"])
        dl = DataLoader(paths, batch_size=256, num_workers=4)
        it = iter(dl)
        next(it)
        start = tree_pss(pid)
        end = epoch_pss(it, len(dl) - 1, pid)
        out["paths"] = {"pss_start": start, "pss_epoch": end, "growth": end - start}
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
