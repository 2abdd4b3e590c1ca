"""Packing (``pinfeed.packing``), property-tested with Hypothesis: greedy gives every
document's tokens once and in order; best fit splits no document of at most
``seq_len`` tokens; ``position_ids``, ``labels`` and ``cu_seqlens`` agree with the
segments of the packed ``input_ids``."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pinfeed import Packed, packing

EOS = 9999

documents = st.lists(
    st.lists(st.integers(0, 5000), min_size=0, max_size=40), min_size=1, max_size=30
)
seq_lens = st.integers(1, 48)


def _docs(raw: list[list[int]]) -> list[np.ndarray[Any, Any]]:
    return [np.asarray(d, dtype=np.int64) for d in raw]


def _check_segments(row: dict[str, torch.Tensor], seq_len: int) -> list[tuple[int, int]]:
    """The segments (start, stop) ``position_ids`` marks, checked against ``labels``."""
    pos, labels, ids = row["position_ids"], row["labels"], row["input_ids"]
    assert pos.shape == labels.shape == ids.shape == (seq_len,)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist()
    assert starts[0] == 0
    bounds = [*starts, seq_len]
    segments = list(itertools.pairwise(bounds))
    for a, b in segments:
        assert pos[a:b].tolist() == list(range(b - a))  # restarts at each segment
        assert labels[a] == packing.IGNORE  # no prediction across a boundary
        inside = labels[a + 1 : b]
        assert bool(((inside == ids[a + 1 : b]) | (inside == packing.IGNORE)).all())
    return segments


@settings(max_examples=150, deadline=None)
@given(documents, seq_lens)
def test_greedy_gives_every_token_once_and_in_order(raw: list[list[int]], seq_len: int) -> None:
    docs = _docs(raw)
    ds = Packed(docs, seq_len, mode="greedy", eos=EOS)
    stream = np.concatenate([np.append(d, EOS) for d in docs])
    rows = [ds[r] for r in range(len(ds))]
    assert len(ds) == len(stream) // seq_len
    got = torch.cat([r["input_ids"] for r in rows]).numpy() if rows else np.empty(0)
    assert np.array_equal(got, stream[: len(ds) * seq_len])  # once, in order; the tail left
    for r in rows:
        for a, b in _check_segments(r, seq_len):
            assert (r["labels"][a + 1 : b] == r["input_ids"][a + 1 : b]).all()  # no padding
    assert ds.tokens(list(range(len(ds)))).tolist() == [seq_len] * len(ds)


@settings(max_examples=150, deadline=None)
@given(documents, seq_lens)
def test_best_fit_splits_no_document_that_fits(raw: list[list[int]], seq_len: int) -> None:
    # documents of distinct tokens, so that a row's segment says which document it is
    docs = [np.arange(len(d), dtype=np.int64) + 100 * i for i, d in enumerate(raw)]
    ds = Packed(docs, seq_len, mode="best_fit", eos=None, pad=-1)
    rows = ds.rows
    pieces: dict[int, list[tuple[int, int]]] = {}
    for r in range(len(ds)):
        row = ds[r]
        segments = _check_segments(row, seq_len)
        used = 0
        for j in rows.segments(r):
            d, s, n = int(rows.doc[j]), int(rows.start[j]), int(rows.length[j])
            a, b = segments[j - rows.segments(r).start]
            assert b - a == n
            assert row["input_ids"][a:b].tolist() == docs[d][s : s + n].tolist()
            pieces.setdefault(d, []).append((s, n))
            used += n
        assert used <= seq_len
        assert (row["input_ids"][used:] == -1).all() and (
            row["labels"][used:] == packing.IGNORE
        ).all()
    for d, doc in enumerate(docs):
        n = len(doc)
        got = sorted(pieces.get(d, []))
        if n == 0:
            assert not got
        elif n <= seq_len:
            assert got == [(0, n)]  # whole, in one row
        else:  # cut into pieces of seq_len, the last shorter, each placed whole
            assert got == [(s, min(seq_len, n - s)) for s in range(0, n, seq_len)]
    assert sum(int(x) for x in rows.length) == sum(len(d) for d in docs)
    # best fit, largest first: a row is opened for a piece no earlier row had room for
    # (its first, and largest, piece), and rows only lose room
    room = seq_len - rows.tokens(list(range(len(ds))))
    for j in range(1, len(ds)):
        assert room[:j].max() < rows.length[rows.ptr[j]]


@settings(max_examples=100, deadline=None)
@given(documents, seq_lens, st.sampled_from(packing.MODES), st.integers(1, 5))
def test_cu_seqlens_follow_the_segments(
    raw: list[list[int]], seq_len: int, mode: packing.Mode, batch: int
) -> None:
    ds = Packed(_docs(raw), seq_len, mode=mode, eos=EOS)
    rows = [ds[r] for r in range(min(batch, len(ds)))]
    if not rows:
        return
    out = packing.collate(rows)
    assert out["input_ids"].shape == (len(rows), seq_len)
    cu = out["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == len(rows) * seq_len
    lens = (cu[1:] - cu[:-1]).tolist()
    assert all(n > 0 for n in lens)
    flat = out["position_ids"].reshape(-1).tolist()
    rebuilt = [p for n in lens for p in range(n)]
    assert rebuilt == flat  # each segment a run 0..n-1, nothing else
    assert int(out["max_seqlen"]) == max(lens)
    # no segment crosses a row
    assert set(range(0, len(rows) * seq_len, seq_len)) <= set(cu.tolist())


def test_refusals() -> None:
    import pytest

    with pytest.raises(ValueError, match="one of"):
        Packed([[1]], 4, mode="first_fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        packing.pack([1, 2], 0, "greedy")
