"""Small ImageNet-like JPEG folders for the cache's tests (W9's data, shrunk)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.data import _jpeg

SIZE = 32  # the images kind's shorter side (W9: 256)
PARAMS = {"size": SIZE, "crop": False}


def make_jpegs(root: Path, name: str, n: int = 40, classes: int = 4) -> dict[str, object]:
    """``n`` JPEGs of 80x60 (every fourth portrait, as in real data) in ``classes``
    folders under ``root / name``; the ``images`` params that read them uncropped."""
    folder = root / name
    rng = np.random.default_rng(len(name) + n)
    for i in range(n):
        cls = folder / f"class{i % classes}"
        cls.mkdir(parents=True, exist_ok=True)
        size = (80, 60) if i % 4 else (60, 80)
        _jpeg(rng, *size).save(cls / f"img{i:04d}.jpg", format="JPEG", quality=90)
    return {"path": name, **PARAMS}
