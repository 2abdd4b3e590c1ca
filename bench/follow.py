"""``python -m bench follow``: what following the trainer's objects costs a
``pinfeed.DataLoader`` each epoch (``pinfeed._dataloader._Owned.follow``: at each
``iter()`` where DataLoader hands its workers the objects as they are, pinfeed pickles
them again and ships them only if the pickle changed).

For the datasets a trainer writes for W1 (a ``TensorDataset`` over the ``.pt``'s
tensors), W3 (a Pillow image folder) and W9 (``Transformed(image folder, the W9
transform)``): a ``pinfeed.DataLoader`` at ``num_workers=2`` runs one epoch (its objects
shipped at its first ``iter()``), then ``follow`` is timed where nothing changed (the
cost every epoch pays) and where an attribute of the dataset changed (an attribute set,
as ``set_epoch`` does: the pickle and the payload shipped), in the trainer's process,
beside the epoch's own time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import data, references, results
from bench.server import BenchServer

WORKLOADS = ("W1", "W3", "W9")


def _dataset(key: str, root: Path, workload: data.Workload) -> Any:
    import pinfeed
    from pinfeed_server.plugins import resolve

    if key == "W9":
        base = references.imagefolder(root, workload.params)
        assert workload.transform is not None
        return pinfeed.Transformed(base, resolve(workload.transform, ("bench",)))
    assert workload.reference is not None
    return references.build(workload.reference, root, workload.params)


def _measure(key: str, root: Path, socket: Path, repeats: int, scale: float) -> dict[str, Any]:
    import pinfeed

    workload = data.MAKERS[key](root, scale)
    dataset = _dataset(key, root, workload)
    loader = pinfeed.DataLoader(
        dataset,
        batch_size=workload.batch_size,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(1),
        socket=str(socket),
    )
    try:
        t0 = time.perf_counter()
        batches = sum(1 for _ in loader)
        epoch_s = time.perf_counter() - t0
        owned = loader._owned
        assert owned is not None, loader.fell_back
        unchanged, changed, payload = [], [], []
        for i in range(repeats):
            t = time.perf_counter()
            fd = owned.follow(loader)
            unchanged.append(time.perf_counter() - t)
            assert fd is None, "follow shipped objects that did not change"
            dataset.follow_marker = i  # an attribute set, as set_epoch sets one
            t = time.perf_counter()
            fd = owned.follow(loader)
            changed.append(time.perf_counter() - t)
            assert fd is not None, "follow missed a changed attribute"
            payload.append(os.fstat(fd).st_size)
    finally:
        loader.close()
    return {
        "samples": workload.samples,
        "batches": batches,
        "epoch_s": epoch_s,
        "unchanged_s": results.spread(unchanged),
        "changed_s": results.spread(changed),
        "payload_bytes": max(payload),
        "unchanged_runs": unchanged,
        "changed_runs": changed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench follow", description=__doc__)
    ap.add_argument("--repeats", type=int, default=30, help="follow calls timed each way")
    ap.add_argument("--scale", type=float, default=1.0, help="workload size")
    ap.add_argument("--quick", action="store_true", help="small workloads, 5 repeats")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    repeats, scale = (5, 0.05) if args.quick else (args.repeats, args.scale)
    res = results.start("follow", {"repeats": repeats, "scale": scale, "num_workers": 2})
    cells: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_dir or Path(tmp) / "data"
        root.mkdir(parents=True, exist_ok=True)
        with BenchServer(root) as server:
            for key in WORKLOADS:
                foreign = results.ForeignCpu().start()
                cell = _measure(key, root, server.socket, repeats, scale)
                cell["foreign"] = foreign.stop()
                cells[key] = cell
                u, c = cell["unchanged_s"]["median"], cell["changed_s"]["median"]
                print(
                    f"{key}: unchanged {u * 1e3:.2f} ms, changed {c * 1e3:.2f} ms "
                    f"({cell['payload_bytes']} B), epoch {cell['epoch_s']:.2f} s",
                    flush=True,
                )
    res["cells"] = cells
    results.finish(res, [c["foreign"] for c in cells.values()])
    print("->", results.write(res, args.out))
    return 0
