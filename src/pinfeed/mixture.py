"""``Mixture(datasets, weights, samples=N)``: a map-style dataset whose position ``i``
of epoch ``e`` is the sample ``pinfeed.mixing``'s rule draws for it, for
``pinfeed.DataLoader`` as for torch's.

``set_epoch(e)`` picks the epoch (as ``DistributedSampler.set_epoch``; call it before
each epoch's loop: DataLoader hands its workers the dataset as it is at ``iter()``).
Its positions are already in a random order: load it with ``shuffle=False`` (or a
``DistributedSampler(shuffle=False)``, which shards positions; the mixture stays the
same at any world size). ``source(i)`` says which source position ``i`` draws from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from pinfeed import mixing


class Mixture(Dataset[Any]):
    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        *,
        samples: int | None = None,
        until: int | None = None,
        rule: mixing.Rule = "interleave",
        shuffle: bool | Sequence[bool] = True,
        seed: int = 0,
    ) -> None:
        """``samples``: positions an epoch; or ``until``: the index of the source an
        epoch takes whole, once (``rule="quota"``). ``shuffle``: each source's own
        order (one flag, or one per source). The rule: ``pinfeed.mixing``."""
        self.datasets = list(datasets)
        self.mixing = mixing.Mixing.of(
            [len(d) for d in self.datasets],
            weights,
            samples=samples,
            until=until,
            rule=rule,
            shuffle=shuffle,
        )
        self.seed = seed
        self.epoch = 0
        self._draws = mixing.EpochDraws(self.mixing, seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.mixing.samples

    def source(self, index: int) -> tuple[int, int]:
        """(source, that source's sample) of position ``index`` in the current epoch."""
        draws = self._draws(self.epoch)
        return int(draws.sources[index]), int(draws.samples[index])

    def __getitem__(self, index: int) -> Any:
        s, k = self.source(index)
        return self.datasets[s][k]

    def __repr__(self) -> str:
        return (
            f"Mixture({len(self.datasets)} sources, p={list(self.mixing.probabilities)}, "
            f"{self.mixing.samples} samples an epoch, rule {self.mixing.rule!r})"
        )
