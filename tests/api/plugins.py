"""Datasets the API tests' servers import through the ``python`` kind."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import torch


class Gated:
    """Worker processes block building this dataset until ``gate`` exists (bounded), so
    a loader over it stays ``starting`` for exactly as long as a test needs."""

    def __init__(self, gate: str, length: int = 8) -> None:
        self.length = length
        if multiprocessing.parent_process() is None:
            return  # the server itself: open at once
        deadline = time.monotonic() + 60
        while not Path(gate).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} never opened")
            time.sleep(0.02)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), i)
