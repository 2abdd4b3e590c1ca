"""Lightning DDP on CPU processes over pinfeed loaders, one per rank, for
test_lightning's elastic test.

    python tests/integrations/lightning_elastic.py PREFIX SOCKET OUT PHASE DEVICES K

PHASE ``first``: train epoch 0 on DEVICES ranks, save a checkpoint after batch K-1
(``OUT/mid.ckpt``; Lightning's ``save_checkpoint`` runs on every rank, so the loaders'
``state_dict()`` gathers every rank's position, and rank 0 writes it), then stop; each
rank saves the samples it trained on to ``OUT/first-rank{r}.pt``. PHASE ``resume``:
``fit(ckpt_path=OUT/mid.ckpt)`` on DEVICES ranks for 2 epochs; each rank saves its
(epoch, batch) pairs to ``OUT/resume-rank{r}.pt``.

The module loads the loader's state itself in ``train_dataloader()`` (from the
checkpoint ``on_load_checkpoint`` sees), the recipe of
docs/how-to/lightning-accelerate.md: Lightning sizes the epoch with ``len(loader)``
before it loads the loader's state, and a resumed epoch at a larger world size may
number its batches past the plain ``len()``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `tests`

import pytorch_lightning as pl
import torch

from tests.integrations.lightning_module import Recorder, trainer


class Augmented(Recorder):
    """Trains on ``tests.fixtures.datasets.Augmented``'s batches (crop, noise, rand, index)."""

    loader_state: dict[str, Any] | None = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader", [])
        self.loader_state = states[0] if states else None

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        if self.loader_state is not None:  # before Lightning asks len(loader)
            loader.load_state_dict(self.loader_state)
        return loader

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_seen.append((self.current_epoch, [t.clone() for t in batch]))
        return self.layer(batch[2]).pow(2).mean()


class SaveAndStop(pl.Callback):
    def __init__(self, path: Path, index: int) -> None:
        self.path, self.index = path, index

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        if i == self.index:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def main() -> None:
    prefix, socket, out, phase = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    devices, k = int(sys.argv[5]), int(sys.argv[6])
    model = Augmented({"train": prefix, "socket": socket})
    if phase == "first":
        fit = trainer(
            max_epochs=1,
            devices=devices,
            strategy="ddp",
            callbacks=[SaveAndStop(out / "mid.ckpt", k - 1)],
        )
        fit.fit(model)
        seen = [i for _, b in model.train_seen[:k] for i in b[3].tolist()]
        torch.save(seen, out / f"first-rank{fit.global_rank}.pt")
    else:
        fit = trainer(max_epochs=2, devices=devices, strategy="ddp")
        fit.fit(model, ckpt_path=out / "mid.ckpt")
        torch.save(model.train_seen, out / f"resume-rank{fit.global_rank}.pt")


if __name__ == "__main__":
    main()
