"""Lightning, DDP on two CPU processes, over a DataLoader the LightningModule makes:
torch's or pinfeed's (the one-line switch). Lightning puts a DistributedSampler in by
making the loader anew; each rank saves the batches it trained on.

    python tests/integrations/lightning_dataloader.py torch|pinfeed OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `tests`

import torch
from torch.utils.data import Dataset

from tests.integrations.lightning_module import Recorder, trainer


class Pairs(Dataset[Any]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([float(i), float(i % 7)]) + torch.rand(2), i % 5


class Model(Recorder):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def train_dataloader(self) -> Any:
        if self.kind == "pinfeed":
            from pinfeed import DataLoader
        else:
            from torch.utils.data import DataLoader
        return DataLoader(Pairs(), batch_size=4, shuffle=True, num_workers=1)


def main() -> None:
    kind, out = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    model = Model(kind)
    fit = trainer(max_epochs=2, devices=2, strategy="ddp")
    fit.fit(model)
    torch.save(model.train_seen, out / f"{kind}-rank{fit.global_rank}.pt")


if __name__ == "__main__":
    main()
