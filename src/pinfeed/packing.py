"""Sequence packing: documents of tokens into rows of ``seq_len``, and the batch of
packed rows that variable-length attention reads.

A packing is a table of *rows*, computed once from the documents' lengths (no token
read), each row a list of *segments*: a run of one document's tokens. Two packers:

- ``greedy`` (nanoGPT, Megatron's ``GPTDataset``): the documents in order, each
  followed by its EOS, as one stream, cut every ``seq_len`` tokens. Row ``r`` is the
  stream's tokens ``[r * seq_len, (r + 1) * seq_len)``: every token once, in order; a
  document may run on from one row into the next; the stream's last partial row
  (fewer than ``seq_len`` tokens) is left out.
- ``best_fit`` (Ding et al., "Fewer Truncations Improve Language Modeling", 2024):
  a document longer than ``seq_len`` is first cut into pieces of ``seq_len`` (its last
  piece shorter); the pieces are then placed largest first (ties in document order)
  into the row with the least room that holds them (a new row when none does). No
  document of at most ``seq_len`` tokens is split; a row's room left is padding.

Rows are made in the workers from the table (``assemble``); each row is
``input_ids``, ``labels`` and ``position_ids``, each ``[seq_len]`` int64, in Hugging
Face's ``DataCollatorWithFlattening`` convention: ``labels`` are the tokens (not
shifted: the model shifts), with ``-100`` at the first token of every segment, so no
position learns to predict across a boundary; ``position_ids`` count from 0 in every
segment. Padding (``best_fit``) is a segment of its own: ``pad`` tokens, labels
``-100``. ``collate`` stacks rows into a batch and adds ``cu_seqlens`` (int32, the
cumulative segment lengths of the flattened ``[batch * seq_len]`` tokens, from 0 to
``batch * seq_len``: flash-attention's ``cu_seqlens_q``/``_k``) and ``max_seqlen`` (a
0-d int32 tensor, the longest segment), both following from ``position_ids``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

Mode = Literal["greedy", "best_fit"]
MODES: tuple[Mode, ...] = ("greedy", "best_fit")
IGNORE = -100  # the label no loss counts (torch's cross_entropy ignore_index)

Array = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True)
class Rows:
    """A packing: row ``r``'s segments are ``[ptr[r], ptr[r + 1])``; segment ``j`` is
    tokens ``[start[j], start[j] + length[j])`` of document ``doc[j]`` (counting its
    EOS, where the packer appends one, as its last token)."""

    seq_len: int
    ptr: Array
    doc: Array
    start: Array
    length: Array

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def segments(self, row: int) -> range:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} of {len(self)}")
        return range(int(self.ptr[row]), int(self.ptr[row + 1]))

    def tokens(self, rows: Sequence[int] | Array) -> Array:
        """The documents' tokens in each of ``rows`` (the rest is padding)."""
        sums = np.concatenate([[0], np.cumsum(self.length)])
        r = np.asarray(rows, dtype=np.int64)
        return np.asarray(sums[self.ptr[r + 1]] - sums[self.ptr[r]], dtype=np.int64)


def pack(lengths: Sequence[int] | Array, seq_len: int, mode: Mode) -> Rows:
    """The rows of documents of ``lengths`` tokens (their EOS counted), by ``mode``."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n = np.asarray(lengths, dtype=np.int64)
    if n.ndim != 1 or (len(n) and n.min() < 0):
        raise ValueError("lengths: one non-negative count per document")
    if mode == "greedy":
        return greedy(n, seq_len)
    if mode == "best_fit":
        return best_fit(n, seq_len)
    raise ValueError(f"packing mode {mode!r}: one of {MODES}")


def greedy(lengths: Array, seq_len: int) -> Rows:
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if len(ends) else 0
    rows = total // seq_len
    limit = rows * seq_len
    # a segment begins at every document start and every row start within the rows
    cuts = np.union1d(starts[starts < limit], np.arange(0, limit, seq_len, dtype=np.int64))
    stops = np.append(cuts[1:], limit)
    doc = np.searchsorted(ends, cuts, side="right")  # an empty document holds no cut
    row = cuts // seq_len
    ptr = np.searchsorted(row, np.arange(rows + 1), side="left").astype(np.int64)
    return Rows(seq_len, ptr, doc.astype(np.int64), cuts - starts[doc], stops - cuts)


def best_fit(lengths: Array, seq_len: int) -> Rows:
    pieces = -(-lengths // seq_len)  # ceil: 0 for an empty document
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = (np.arange(len(doc), dtype=np.int64) - first) * seq_len
    length = np.minimum(lengths[doc] - start, seq_len)
    order = np.argsort(-length, kind="stable")  # largest first, ties in document order
    # Bins by the room they have left: ``rooms`` the sorted distinct rooms that some
    # bin has, ``by_room[c]`` those bins (the latest last). A piece goes to a bin of
    # the least room that holds it: bisect, O(log rooms) a piece plus the list moves.
    rooms: list[int] = []
    by_room: dict[int, list[int]] = {}
    bin_of = np.empty(len(doc), dtype=np.int64)
    bins = 0
    for piece, x in zip(order.tolist(), length[order].tolist(), strict=True):
        i = bisect.bisect_left(rooms, x)
        if i < len(rooms):
            room = rooms[i]
            stack = by_room[room]
            b = stack.pop()
            if not stack:
                del rooms[i], by_room[room]
        else:
            room, b = seq_len, bins
            bins += 1
        bin_of[piece] = b
        left = room - x
        if left > 0:
            if left not in by_room:
                bisect.insort(rooms, left)
                by_room[left] = []
            by_room[left].append(b)
    rank = np.empty(len(doc), dtype=np.int64)
    rank[order] = np.arange(len(doc))
    placed = np.lexsort((rank, bin_of))  # by row, then in the order placed
    ptr = np.searchsorted(bin_of[placed], np.arange(bins + 1), side="left").astype(np.int64)
    return Rows(seq_len, ptr, doc[placed], start[placed], length[placed])


Read = Callable[[int, int, int], np.ndarray[Any, Any]]


def assemble(rows: Rows, row: int, read: Read, pad: int = 0) -> dict[str, torch.Tensor]:
    """Row ``row``: its segments' tokens, read as ``read(doc, start, stop)``."""
    size = rows.seq_len
    input_ids = np.full(size, pad, dtype=np.int64)
    labels = np.full(size, IGNORE, dtype=np.int64)
    position_ids = np.empty(size, dtype=np.int64)
    at = 0
    for j in rows.segments(row):
        d, s, n = int(rows.doc[j]), int(rows.start[j]), int(rows.length[j])
        input_ids[at : at + n] = read(d, s, s + n)
        labels[at + 1 : at + n] = input_ids[at + 1 : at + n]
        position_ids[at : at + n] = np.arange(n)
        at += n
    position_ids[at:] = np.arange(size - at)  # padding: a segment of its own
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
    }


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """The cumulative segment lengths of ``position_ids`` flattened (int32): where each
    segment starts (its position 0), then the total."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    total = torch.tensor([flat.numel()], dtype=starts.dtype)
    return torch.cat([starts, total]).to(torch.int32)


def collate(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of packed rows: each field stacked ``[batch, seq_len]``, plus
    ``cu_seqlens`` and ``max_seqlen`` (the module docstring)."""
    batch = {
        key: torch.stack([r[key] for r in rows]) for key in ("input_ids", "labels", "position_ids")
    }
    cu = cu_seqlens(batch["position_ids"])
    batch["cu_seqlens"] = cu
    batch["max_seqlen"] = (cu[1:] - cu[:-1]).max().to(torch.int32)
    return batch
