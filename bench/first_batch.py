"""``python -m bench first-batch``: from a training script's ``DataLoader(...)`` to its
first batch, for torch's ``DataLoader`` (``iter()`` + ``next()``: its workers start),
``pinfeed.DataLoader`` with the node's server running (its objects shipped, a loader of
its own started, its workers forked from a zygote), and ``pinfeed.DataLoader`` with no
server (one is started for the user: the embedded default).

Each run is a fresh trainer process (a script, its Dataset class in ``__main__``); the
time is measured in it from the constructor to the first batch, after its imports
(``import pinfeed``'s own time is reported apart). Rounds alternate the three systems.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench import results
from bench.server import BenchServer

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    t_import = time.perf_counter()
    {imports}
    t_import = time.perf_counter() - t_import

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.table = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)
        def __len__(self): return 4096
        def __getitem__(self, i): return self.table[i], i % 10

    t0 = time.perf_counter()
    loader = DataLoader(Rows(), batch_size=64, shuffle=True, num_workers={workers}{extra})
    first = next(iter(loader))
    t1 = time.perf_counter()
    print(json.dumps({{"first_batch_s": t1 - t0, "import_s": t_import}}), flush=True)
    """
)
SYSTEMS = ("dataloader", "pinfeed-dataloader", "pinfeed-dataloader-autostart")


def _script(system: str, workers: int, socket: Path) -> str:
    if system == "dataloader":
        return SCRIPT.format(
            imports="from torch.utils.data import DataLoader", workers=workers, extra=""
        )
    return SCRIPT.format(
        imports="from pinfeed import DataLoader", workers=workers, extra=f", socket={str(socket)!r}"
    )


def _once(system: str, workers: int, socket: Path, tmp: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(results.REPO / "src"))
    if system == "pinfeed-dataloader-autostart":
        # A socket no server listens on: the first DataLoader(...) starts one.
        run = Path(tempfile.mkdtemp(prefix="pf-autostart-", dir=tmp))
        socket = run / "pinfeed.sock"
        env |= {"PINFEED_STATE_DIR": str(run / "state"), "PINFEED_IDLE_EXIT_S": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _script(system, workers, socket)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{system}: {out.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if system == "pinfeed-dataloader-autostart":
        deadline = time.monotonic() + 30  # the started server exits once idle
        while socket.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench first-batch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    res = results.start("first-batch", {"rounds": rounds, "workers": args.workers})
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, BenchServer(Path(tmp)) as server:
        for r in range(rounds):
            order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
            for system in order:
                foreign = results.ForeignCpu().start()
                row = _once(system, args.workers, server.socket, Path(tmp))
                runs.append({"system": system, "round": r, **row, "foreign": foreign.stop()})
                print(f"{system:<30} {row['first_batch_s']:.3f} s", flush=True)
    res["runs"] = runs
    res["cells"] = {
        s: {
            "first_batch_s": results.spread([x["first_batch_s"] for x in runs if x["system"] == s]),
            "import_s": results.spread([x["import_s"] for x in runs if x["system"] == s]),
        }
        for s in SYSTEMS
    }
    results.finish(res, runs)
    path = results.write(res, args.out)
    medians = {s: res["cells"][s]["first_batch_s"]["median"] for s in SYSTEMS}
    print(json.dumps(medians), "->", path)
    return 0 if all(m is not None for m in medians.values()) else 1
