"""A tiny LightningModule that records the batches it trains and validates on."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch


class Recorder(pl.LightningModule):
    """Trains a linear layer; keeps (epoch, batch) for every training and validation
    step, cloned (a pinfeed view is valid until the next batch is asked for)."""

    def __init__(self, loaders: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.loaders = loaders or {}
        self.train_seen: list[tuple[int, list[torch.Tensor]]] = []
        self.val_seen: list[tuple[int, list[torch.Tensor]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_seen.append((self.current_epoch, [t.clone() for t in batch]))
        x, y = batch
        return (self.layer(x).squeeze(1) - y.float()).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        # Made here, on each rank, so that under DDP every rank attaches to its shard.
        from pinfeed import Loader

        return Loader(f"{self.loaders['train']}-{self.global_rank}", socket=self.loaders["socket"])


class Validating(Recorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_seen.append((self.current_epoch, [t.clone() for t in batch]))


def trainer(**kw: Any) -> pl.Trainer:
    """A quiet CPU trainer."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
    }
    return pl.Trainer(**(defaults | kw))
