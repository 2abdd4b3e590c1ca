"""A training script as a user writes it, for the tests that run one as a process: its
Dataset class lives in ``__main__`` (shipped by value), its collate_fn is a lambda.

    python tests/dataloader/script.py SOCKET [--workers N] [--name NAME] [--batches K]
        [--hang] [--epochs E]

It prints one JSON line per batch ({"epoch", "index", "first"}), then "done"; with
``--hang`` it stops after ``--batches`` batches, prints "holding" and waits (for a test
to SIGKILL it mid-epoch, holding a batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

import pinfeed


class Noisy(Dataset[Any]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.table = torch.arange(n, dtype=torch.float32) * 2  # a tensor the dataset holds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.table[i] + torch.rand(()), i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--name", default=None)
    ap.add_argument("--batches", type=int, default=1 << 30)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--hang", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    loader = pinfeed.DataLoader(
        Noisy(64),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=lambda samples: default_collate(samples),
        name=args.name,
        socket=args.socket,
    )
    print(json.dumps({"loader": loader.pinfeed_name}), flush=True)
    seen = 0
    for epoch in range(args.epochs):
        for index, (values, _) in enumerate(loader):
            line = {"epoch": epoch, "index": index, "first": float(values[0])}
            print(json.dumps(line), flush=True)
            seen += 1
            if seen >= args.batches:
                if args.hang:
                    print("holding", flush=True)
                    time.sleep(3600)
                break
        if seen >= args.batches:
            break
    loader.close()
    print("done", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
