"""One training job of a node's four (``test_jobs.py``): its own loader over a shared
remote dataset, made once every job is ready, read for some epochs.

    python -m tests.remote.job URL SOCKET DATASET --seed S --workers W --epochs E --go FILE

It writes FILE.ready-<seed> when it is ready, waits for FILE, makes its loader, reads,
deletes the loader and prints the batches it read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pinfeed import Client, Loader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("socket")
    p.add_argument("dataset")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--go", type=Path, required=True)
    a = p.parse_args()
    name = f"job-{a.seed}"
    a.go.with_name(f"{a.go.name}.ready-{a.seed}").touch()
    deadline = time.monotonic() + 60
    while not a.go.exists():  # the test makes it once every job is ready
        if time.monotonic() > deadline:
            raise SystemExit("never told to go")
        time.sleep(0.01)
    with Client(a.url) as admin:
        admin.create_loader(
            name, dataset=a.dataset, batch_size=16, shuffle=True, seed=a.seed, num_workers=a.workers
        )
        batches = 0
        try:
            with Loader(name, socket=a.socket) as loader:
                for _ in range(a.epochs):
                    batches += sum(1 for _ in loader)
        finally:
            admin.delete_loader(name)
    print(batches)


if __name__ == "__main__":
    main()
