"""W5's Dataset: W3's JPEGs with the usual training augmentation, as a ``python``
dataset (``bench.augment:w5``), so pinfeed and DataLoader run the very same object.

A sample is decoded and resized as the ``images`` kind does (shorter side to 256,
center crop 256x256), then cropped at a random 224x224 window and flipped
horizontally with probability 0.5: torchvision's ``RandomCrop(224)`` +
``RandomHorizontalFlip()`` after ``Resize(256)``, written with ``torch.randint`` and
``torch.rand`` (torchvision does not import beside the test torch). The randomness
draws from torch's global RNG, which DataLoader seeds per worker and pinfeed seeds
identically (``seed``, ``num_workers``), so both give the same pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pinfeed_server.datasets import DatasetContext, build_dataset

RESIZE = 256
CROP = 224


class RandomCropFlip(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, base: Any, crop: int = CROP) -> None:
        self.base = base
        self.crop = crop

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img, label = self.base[i]
        _, h, w = img.shape
        top = int(torch.randint(0, h - self.crop + 1, ()))
        left = int(torch.randint(0, w - self.crop + 1, ()))
        out = img[:, top : top + self.crop, left : left + self.crop]
        if float(torch.rand(())) < 0.5:
            out = out.flip(-1)
        return out.contiguous(), label


def w5(path: str, data_root: str) -> RandomCropFlip:
    """``{"factory": "bench.augment:w5", "kwargs": {"path": ..., "data_root": ...}}``."""
    base = build_dataset("images", {"path": path, "size": RESIZE}, DatasetContext(Path(data_root)))
    return RandomCropFlip(base)
