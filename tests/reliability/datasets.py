"""Datasets the reliability tests' servers import through the ``python`` kind
(``PINFEED_ALLOWED_PLUGINS`` includes ``tests.reliability``).

Sample ``i`` is ``(features_i, i)``: the label is the index, so a consumer can tell
exactly which samples a batch holds and compare with DataLoader's order.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

import torch


def features(i: int, width: int = 8) -> torch.Tensor:
    return torch.arange(width, dtype=torch.float32) + 1000.0 * i


class Slow:
    """``delay_s`` per sample, so workers are mid-batch when something kills them."""

    def __init__(self, length: int = 96, delay_s: float = 0.002, width: int = 8) -> None:
        self.length = length
        self.delay_s = delay_s
        self.width = width

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay_s)
        return features(i, self.width), i


def _segfault() -> None:
    # A real crash in native code: read address 0.
    ctypes.string_at(0)


class CrashOnce(Slow):
    """Segfaults once, in whichever worker first reads ``at`` (``marker`` records it).

    Only reached in worker processes: the server reads sample 0 (and the first sample
    of epoch 0) to size the ring, so ``at`` must be neither.
    """

    def __init__(self, marker: str, at: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.marker = Path(marker)
        self.at = at

    def __getitem__(self, i: int) -> Any:
        if i == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                _segfault()
        return super().__getitem__(i)


class Poison(Slow):
    """Sample ``at`` segfaults every time it is read."""

    def __init__(self, at: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.at = at

    def __getitem__(self, i: int) -> Any:
        if i == self.at:
            _segfault()
        return super().__getitem__(i)


class SlowStart(Slow):
    """Takes ``init_s`` to build: a replacement worker is a while coming."""

    def __init__(self, init_s: float = 0.5, **kw: Any) -> None:
        super().__init__(**kw)
        time.sleep(init_s)
