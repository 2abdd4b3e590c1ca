"""W9's random augmentation: torchvision's ``RandomResizedCrop(224)`` then
``RandomHorizontalFlip()``, written with torch alone.

torchvision from PyPI does not import beside the CPU build of torch these benchmarks
and tests run on, so this stands in for it: the same parameter draws in the same order
as ``RandomResizedCrop.get_params`` (``scale=(0.08, 1.0)``, ``ratio=(3/4, 4/3)``, ten
tries, then the centre crop that fits the ratio) and the flip's ``torch.rand(1) < 0.5``,
all from torch's global RNG, so DataLoader's worker seeding gives each sample its
draws; the crop is resized to ``size`` x ``size`` bilinearly with antialiasing on the
uint8 image (``F.interpolate(..., antialias=True)``, the kernel torchvision's tensor
``resize`` uses for uint8). It is called on a ``[3, H, W]`` uint8 tensor and returns
a new ``[3, size, size]`` tensor, never writing into its input (a cached sample is a
read-only view).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)


def crop_params(height: int, width: int) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params``: (top, left, h, w)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(RATIO))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(SCALE[0], SCALE[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            left = int(torch.randint(0, width - w + 1, size=(1,)).item())
            return top, left, h, w
    ratio = width / height  # the fallback: a centre crop
    if ratio < min(RATIO):
        w, h = width, round(width / min(RATIO))
    elif ratio > max(RATIO):
        h, w = height, round(height * max(RATIO))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class RandomResizedCropFlip:
    """``Compose([RandomResizedCrop(size), RandomHorizontalFlip()])`` on a CHW uint8
    tensor (or the image of an ``(image, label)`` sample, the label kept)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def image(self, img: torch.Tensor) -> torch.Tensor:
        _, height, width = img.shape
        top, left, h, w = crop_params(height, width)
        crop = img[:, top : top + h, left : left + w].unsqueeze(0)
        out = F.interpolate(
            crop, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True
        )[0]
        if torch.rand(1) < 0.5:
            out = out.flip(-1)
        return out

    def __call__(self, sample: Any) -> Any:
        if isinstance(sample, tuple | list):
            return (self.image(sample[0]), *sample[1:])
        return self.image(sample)

    def __repr__(self) -> str:
        return f"RandomResizedCropFlip({self.size})"


w9 = RandomResizedCropFlip(224)  # "transform": "bench.transforms:w9"
