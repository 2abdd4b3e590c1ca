"""W4's objects, the same for pinfeed and DataLoader: a tokenized corpus (one flat
memory-mapped int64 ``.npy`` of token ids plus the sequences' offsets, as token files
are kept) read one variable-length sequence per sample, and the padding ``collate_fn``
text pipelines use (pad to the batch's longest sequence, with an attention mask).

The bench server imports them through the ``python`` kind (``bench`` is in its
``PINFEED_ALLOWED_PLUGINS``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

LO, HI = 16, 512  # sequence lengths, uniform
VOCAB = 50_257


def generate(tokens_path: Path, offsets_path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(LO, HI + 1, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.lib.format.open_memmap(
        tokens_path, mode="w+", dtype=np.int64, shape=(int(offsets[-1]),)
    )
    step = 1 << 22
    for start in range(0, len(out), step):
        stop = min(len(out), start + step)
        out[start:stop] = rng.integers(0, VOCAB, stop - start, dtype=np.int64)
    out.flush()
    del out
    np.save(offsets_path, offsets)


class TokenSequences:
    """Sample ``i``: the int64 token ids of sequence ``i`` (16-512 of them)."""

    def __init__(self, tokens: str, offsets: str) -> None:
        self.tokens = np.load(tokens, mmap_mode="r")
        self.offsets = np.load(offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        start, stop = self.offsets[i], self.offsets[i + 1]
        return torch.from_numpy(np.array(self.tokens[start:stop]))


def pad_collate(samples: list[torch.Tensor]) -> dict[str, Any]:
    """Pad to the longest sequence of the batch (zeros), with an attention mask."""
    lengths = torch.tensor([len(s) for s in samples])
    ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return {"input_ids": ids, "attention_mask": mask, "lengths": lengths}
