"""The reference Datasets the format workloads are measured against under DataLoader:
what a trainer uses today for the same files (``Workload.reference`` names one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


class MemmapTokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """nanoGPT's ``get_batch`` windows over ``np.memmap`` as a map-style Dataset."""

    def __init__(self, path: Path, dtype: str, seq_len: int, stride: int | None = None) -> None:
        self.data = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.stride = seq_len, stride or seq_len

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        x = torch.from_numpy(self.data[s : s + self.seq_len].astype(np.int64))
        y = torch.from_numpy(self.data[s + 1 : s + 1 + self.seq_len].astype(np.int64))
        return x, y


def tokens(root: Path, params: dict[str, Any]) -> Any:
    return MemmapTokens(
        root / params["path"],
        params.get("dtype", "uint16"),
        params["seq_len"],
        params.get("stride"),
    )


def hf(root: Path, params: dict[str, Any]) -> Any:
    import datasets as hd

    return hd.load_from_disk(str(root / params["path"])).with_format("torch")


def webdataset(root: Path, params: dict[str, Any]) -> Any:
    import webdataset as wds

    ds = wds.WebDataset(str(root / params["shards"]), shardshuffle=False, empty_check=False)
    return ds.decode("torchrgb8").to_tuple(*params["fields"])


REFERENCES = {"tokens": tokens, "hf": hf, "webdataset": webdataset}


def build(name: str, root: Path, params: dict[str, Any]) -> Any:
    return REFERENCES[name](root, params)
