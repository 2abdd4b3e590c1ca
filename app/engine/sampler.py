"""Index batches with DataLoader's semantics, epoch after epoch.

With ``shuffle`` and ``seed`` s, epoch e's batches equal those of
``DataLoader(ds, batch_size, shuffle=True, drop_last=..., generator=Generator().manual_seed(s))``
iterated for the (e+1)-th time with non-persistent workers. Per epoch, DataLoader's
iterator draws its base seed from the generator (``random_``), then RandomSampler
draws ``randperm(n)`` and, once exhausted, a second (empty-sliced) ``randperm(n)``.
We replay exactly those draws.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class EpochSampler:
    def __init__(
        self, length: int, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool
    ) -> None:
        if length <= 0 or batch_size <= 0:
            raise ValueError("length and batch_size must be positive")
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._gen = torch.Generator()
        self._next_epoch = 0
        self._gen.manual_seed(seed)

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.length // self.batch_size
        return (self.length + self.batch_size - 1) // self.batch_size

    def permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        if epoch < self._next_epoch:
            # Random access backwards (resume): replay from the seed.
            self._gen.manual_seed(self.seed)
            self._next_epoch = 0
        perm: list[int] = []
        while self._next_epoch <= epoch:
            torch.empty((), dtype=torch.int64).random_(generator=self._gen)
            perm = torch.randperm(self.length, generator=self._gen).tolist()
            torch.randperm(self.length, generator=self._gen)
            self._next_epoch += 1
        return perm

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """The index batches of ``epoch``, from batch ``start`` on."""
        perm = self.permutation(epoch)
        for b in range(start, len(self)):
            yield perm[b * self.batch_size : (b + 1) * self.batch_size]
