"""A trainer for the cache's two-process test: ``python tests/dataloader/cache_script.py
SOCKET FOLDER CACHE SEED``. Reads one epoch of ``Transformed(Jpegs(FOLDER), crop_flip)``
through a ``pinfeed.DataLoader`` with ``cache=CACHE`` (two workers, shuffled by SEED),
prints "read", and holds its loader until stdin closes, then reads another epoch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import pinfeed
from tests.dataloader.test_cache import Jpegs
from tests.fixtures.transforms import crop_flip


def main() -> None:
    socket, folder, cache, seed = sys.argv[1:5]
    loader = pinfeed.DataLoader(
        pinfeed.Transformed(Jpegs(Path(folder)), crop_flip),
        batch_size=5,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(int(seed)),
        cache=cache,
        socket=socket,
    )
    assert sum(len(b[1]) for b in loader) == 40
    print("read", flush=True)
    sys.stdin.read()
    assert sum(len(b[1]) for b in loader) == 40
    loader.close()


if __name__ == "__main__":
    main()
