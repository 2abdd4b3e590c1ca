"""Datasets the API tests' servers import through the ``python`` kind."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import torch


class Gated:
    """Worker processes block getting this dataset until ``gate`` exists (bounded): the
    zygote its workers fork from unpickles the server's copy (``__setstate__``), a
    worker without one builds it (``__init__``). A loader over it stays ``starting``
    for exactly as long as a test needs."""

    def __init__(self, gate: str, length: int = 8) -> None:
        self.gate, self.length = gate, length
        self.built_in = os.getpid()
        if multiprocessing.parent_process() is not None:
            self._wait()  # a worker process (the server has no parent process)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.built_in:
            self._wait()  # unpickled away from the server that built it

    def _wait(self) -> None:
        deadline = time.monotonic() + 60
        while not Path(self.gate).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.gate} never opened")
            time.sleep(0.02)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), i)
