"""``Packed(documents, seq_len, mode=...)``: a map-style dataset of packed rows over a
dataset of token documents (``pinfeed.packing``), for ``pinfeed.DataLoader`` as for
torch's.

Row ``r`` is ``{"input_ids", "labels", "position_ids"}``, each ``[seq_len]`` int64;
``collate_fn=pinfeed.packing.collate`` adds ``cu_seqlens`` and ``max_seqlen`` to a
batch. The packing (which document tokens go in which row) is computed once per
process from the documents' lengths, at the first ``len()`` or row asked for: give
``lengths`` (or a ``documents.lengths``), else each document is read once for its
length. The rows are the same every epoch; shuffle them with the loader's sampler
(``shuffle=True``, ``DistributedSampler``), whose every DataLoader semantics (resume,
elastic resume, replay) then hold for packed rows as for any sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from pinfeed import packing


class Packed(Dataset[dict[str, torch.Tensor]]):
    def __init__(
        self,
        documents: Any,
        seq_len: int,
        *,
        mode: packing.Mode = "greedy",
        eos: int | None = None,
        pad: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> None:
        """``documents[i]``: document ``i``'s tokens (a 1-D tensor, array or list);
        ``eos``: a token appended after each document (None: the documents end with
        their own, or have none); ``pad``: the token of a row's padding (``best_fit``;
        default ``eos``, else 0)."""
        if mode not in packing.MODES:
            raise ValueError(f"packing mode {mode!r}: one of {packing.MODES}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.documents = documents
        self.seq_len = seq_len
        self.mode = mode
        self.eos = eos
        self.pad = pad if pad is not None else (eos if eos is not None else 0)
        self.lengths = lengths
        self._rows: packing.Rows | None = None

    @property
    def rows(self) -> packing.Rows:
        if self._rows is None:
            lengths = self.lengths
            if lengths is None:
                lengths = getattr(self.documents, "lengths", None)
            if lengths is None:
                lengths = [len(self.documents[i]) for i in range(len(self.documents))]
            n = np.asarray(lengths, dtype=np.int64) + (self.eos is not None)
            self._rows = packing.pack(n, self.seq_len, self.mode)
        return self._rows

    def __len__(self) -> int:
        return len(self.rows)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray[Any, Any]:
        tokens = np.asarray(self.documents[doc], dtype=np.int64)
        if self.eos is not None:
            tokens = np.append(tokens, self.eos)
        return tokens[start:stop]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = int(index) + (len(self) if int(index) < 0 else 0)
        return packing.assemble(self.rows, i, self._read, self.pad)

    def tokens(self, indices: Sequence[int]) -> np.ndarray[Any, Any]:
        """The documents' tokens in each of rows ``indices`` (the rest is padding)."""
        return self.rows.tokens(indices)

    def __repr__(self) -> str:
        return f"Packed({self.documents!r}, seq_len={self.seq_len}, mode={self.mode!r})"
