"""``tokens``: a flat binary token file, as nanoGPT's ``train.bin`` and Megatron train from.

``{"path": "train.bin", "dtype": "uint16", "seq_len": 1024}``. The file is the raw
tokens, no header, in native byte order (``uint16``, nanoGPT's, or ``uint32`` for
vocabularies over 65,536). Sample ``i`` starts at token ``i * stride`` (``stride``
defaults to ``seq_len``: non-overlapping windows) and is ``(x, y)``: tokens
``[start, start + seq_len)`` and ``[start + 1, start + seq_len + 1)``, both int64, so
``y`` is ``x`` shifted by one (the next-token targets). There are
``(tokens - seq_len - 1) // stride + 1`` samples: the last window needs its one extra
target token. The file is memory-mapped read-only, never read whole; an ``s3://`` path
is read by blocks through the node's object cache, each window from the blocks it spans.

Packed (``"pack": "greedy"`` or ``"best_fit"``, with ``"eos"``): the file is documents,
each ending with the ``eos`` token (a last one without it ends at the file's end), and
a sample is a packed row of ``seq_len`` tokens (``pinfeed.packing``):
``{"input_ids", "labels", "position_ids"}``. Greedy rows are the file's windows
``[r * seq_len, (r + 1) * seq_len)`` with the documents' boundaries marked; best-fit
rows hold whole documents (one over ``seq_len`` cut into pieces). The packing is
computed once where the dataset is built (one pass over the file for the EOS tokens);
the rows are assembled in the workers. A loader gets ``cu_seqlens`` with
``"collate_fn": "pinfeed.packing:collate"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from pinfeed import packing
from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params
from pinfeed_server.datasets.remote import RemoteArray, RemoteDataset, Spans
from pinfeed_server.remote import Manifest, RemoteObject, is_remote


class TokensParams(Params):
    path: str = Field(description="the token file, relative to the data root")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="the file's token type")
    seq_len: int = Field(gt=0, le=1 << 24, description="tokens in x (and in y)")
    stride: int | None = Field(
        None, gt=0, description="tokens between sample starts (default: seq_len)"
    )
    eos: int | None = Field(
        None, ge=0, description="the token that ends each document (packing needs it)"
    )
    pack: Literal["greedy", "best_fit"] | None = Field(
        None,
        description="samples are packed rows of seq_len tokens (input_ids, labels, "
        "position_ids) from the documents: greedy (the file cut every seq_len tokens) or "
        "best_fit (whole documents, the tightest row first); null: windows (x, y)",
    )

    @model_validator(mode="after")
    def _packing(self) -> TokensParams:
        if self.pack is not None and (self.eos is None or self.stride is not None):
            raise ValueError("pack needs eos (the documents' end) and no stride")
        return self


def samples(tokens: int, seq_len: int, stride: int) -> int:
    """How many windows of ``seq_len + 1`` tokens start at multiples of ``stride``."""
    return 0 if tokens < seq_len + 1 else (tokens - seq_len - 1) // stride + 1


class TokensDataset:
    def __init__(
        self,
        path: Path | RemoteObject,
        shown: str,
        dtype: str,
        seq_len: int,
        stride: int,
        eos: int | None = None,
        pack: packing.Mode | None = None,
    ) -> None:
        itemsize = np.dtype(dtype).itemsize
        size = path.size if isinstance(path, RemoteObject) else path.stat().st_size
        if size % itemsize:
            raise DatasetError(
                f"{shown}: size {size} bytes is not a multiple of {dtype}'s {itemsize} bytes "
                "(a truncated file, or the wrong dtype)"
            )
        count = size // itemsize
        n = samples(count, seq_len, stride)
        if n == 0:
            raise DatasetError(
                f"{shown}: {count} tokens, fewer than seq_len + 1 = {seq_len + 1} (one sample)"
            )
        self.tokens: Any = (
            RemoteArray(path, np.dtype(dtype), 0, (count,))
            if isinstance(path, RemoteObject)
            else np.memmap(path, dtype=dtype, mode="r")
        )
        self.seq_len = seq_len
        self.stride = stride
        self._length = n
        self.eos = eos
        self.rows: packing.Rows | None = None
        if pack is not None:
            assert eos is not None
            ends = _document_ends(self.tokens, eos)
            self._starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            self.rows = packing.pack(ends - self._starts, seq_len, pack)
            if len(self.rows) == 0:
                raise DatasetError(f"{shown}: {count} tokens make no packed row of {seq_len}")
            self._length = len(self.rows)
        self._window: np.ndarray[Any, np.dtype[np.int64]] | None = None  # 0..seq_len

    def __len__(self) -> int:
        return self._length

    def _start(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"index {index} out of range for {self._length} samples")
        return i * self.stride

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray[Any, Any]:
        first = int(self._starts[doc])
        return np.asarray(self.tokens[first + start : first + stop])

    def _row(self, index: int) -> dict[str, torch.Tensor]:
        assert self.rows is not None
        i = int(index) + (self._length if int(index) < 0 else 0)
        return packing.assemble(self.rows, i, self._read, self.eos or 0)

    def tokens_in(self, indices: Sequence[int]) -> int:
        """The documents' tokens in samples ``indices`` (a packed row's padding left out)."""
        if self.rows is None:
            return len(indices) * self.seq_len
        return int(self.rows.tokens(indices).sum())

    def __getitem__(self, index: int) -> Any:
        if self.rows is not None:
            return self._row(index)
        start, s = self._start(index), self.seq_len
        window = self.tokens[start : start + s + 1].astype(np.int64)
        return torch.from_numpy(window[:-1]), torch.from_numpy(window[1:])

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        # Each window is read once from the mapping and widened to int64 straight into
        # the slot's x and y rows: no per-sample tensors, no stack.
        if self.rows is not None:  # input_ids, labels, position_ids (the dict's order)
            for row, index in enumerate(indices):
                for view, value in zip(out, self._row(index).values(), strict=True):
                    view[row].copy_(value)
            return
        xs, ys = out[0].numpy(), out[1].numpy()
        s = self.seq_len
        if isinstance(self.tokens, np.memmap):
            # One 2-D gather of every window with its one extra target token (the read
            # a tuned DataLoader makes), then x and y widened to int64 straight into
            # the slot's views: no per-sample tensors, no stack, no loop a window.
            idx = np.asarray(indices, dtype=np.int64)
            idx = np.where(idx < 0, idx + self._length, idx)
            bad = (idx < 0) | (idx >= self._length)
            if bad.any():
                self._start(indices[int(np.argmax(bad))])  # IndexError, as __getitem__'s
            if self._window is None:
                self._window = np.arange(s + 1, dtype=np.int64)
            rows = self.tokens[(idx * self.stride)[:, None] + self._window]
            np.copyto(xs, rows[:, :-1], casting="safe")
            np.copyto(ys, rows[:, 1:], casting="safe")
            return
        # From an object store (RemoteArray): each window read on its own, through the
        # node's object cache, widened into the slot's x and y rows.
        for row, index in enumerate(indices):
            start = self._start(index)
            window = self.tokens[start : start + s + 1]
            np.copyto(xs[row], window[:-1], casting="safe")
            np.copyto(ys[row], window[1:], casting="safe")

    def __repr__(self) -> str:
        if self.rows is not None:
            return f"TokensDataset({self._length} packed rows of {self.seq_len} tokens)"
        return (
            f"TokensDataset({self._length} samples of {self.seq_len} tokens, "
            f"stride {self.stride}, {self.tokens.dtype})"
        )


class WindowSpans:
    """The blocks each sample's window of ``seq_len + 1`` tokens lies in."""

    def __init__(self, manifest: Manifest, itemsize: int, seq_len: int, stride: int) -> None:
        self.manifest, self.itemsize, self.seq_len, self.stride = (
            manifest,
            itemsize,
            seq_len,
            stride,
        )

    def __call__(self, indices: np.ndarray[Any, Any]) -> Spans:
        starts = indices * (self.stride * self.itemsize)
        stops = starts + (self.seq_len + 1) * self.itemsize
        return [self.manifest.spans(0, starts, stops)]


def _document_ends(tokens: Any, eos: int, chunk: int = 1 << 26) -> np.ndarray[Any, Any]:
    """The index after each document's last token: each EOS's, and the file's end where
    it does not end with one (a pass over the file, ``chunk`` tokens at a time)."""
    found = [
        np.flatnonzero(np.asarray(tokens[at : at + chunk]) == eos) + at + 1
        for at in range(0, len(tokens), chunk)
    ]
    ends = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    return ends.astype(np.int64)


def build(p: TokensParams, ctx: DatasetContext) -> Any:
    stride = p.stride or p.seq_len
    if is_remote(p.path):
        if p.pack is not None:
            raise DatasetError(
                f"{p.path}: pack reads a local token file (copy it under the data root)"
            )
        manifest = ctx.manifest([p.path], blocks=True, single=True)
        obj = RemoteObject(ctx.remote, manifest, 0)  # type: ignore[arg-type]
        inner = TokensDataset(obj, p.path, p.dtype, p.seq_len, stride)
        spans = WindowSpans(manifest, np.dtype(p.dtype).itemsize, p.seq_len, stride)
        return RemoteDataset(inner, manifest, spans)
    path = ctx.resolve(p.path)
    return TokensDataset(path, p.path, p.dtype, p.seq_len, stride, p.eos, p.pack)


KIND = Kind("tokens", TokensParams, build, __doc__)
