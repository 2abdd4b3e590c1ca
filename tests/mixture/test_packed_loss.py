"""Packed batches fed to a tiny causal model give the loss of the same documents
unpacked: the packed rows with a block-diagonal causal mask built from
``cu_seqlens`` (and positions from ``position_ids``) against the documents one per
row, padded, with attention masks. Best fit: the documents themselves; greedy: the
pieces its rows cut them into (a document that runs into the next row restarts its
positions there, as Megatron's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pinfeed import Packed, packing

VOCAB, DIM, SEQ = 50, 16, 24


class TinyCausal(torch.nn.Module):
    """Embeddings by token and by position, one attention layer, an LM head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(SEQ, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed[b, i, j]``: query i of row b may attend to key j."""
        x = self.tok(ids) + self.pos(pos)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / DIM**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        return self.head(x + torch.softmax(scores, dim=-1) @ v)  # type: ignore[no-any-return]


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Hugging Face's causal LM loss: logits at t predict labels at t + 1."""
    shift_logits, shift_labels = logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
    total = F.cross_entropy(
        shift_logits, shift_labels, ignore_index=packing.IGNORE, reduction="sum"
    )
    return total, int((shift_labels != packing.IGNORE).sum())


def _packed_loss(model: TinyCausal, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    # the whole batch as one flattened sequence, as flash-attention's varlen kernels
    # see it: attention within each cu_seqlens segment, causal
    ids, pos = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
    cu = batch["cu_seqlens"].long()
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = (segment[:, None] == segment[None, :]) & causal
    return _loss_sum(model(ids, pos, allowed[None]), batch["labels"].reshape(1, -1))


def _unpacked_loss(model: TinyCausal, seqs: list[np.ndarray]) -> tuple[torch.Tensor, int]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    labels = torch.full((len(seqs), width), packing.IGNORE, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)  # the attention mask
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.from_numpy(s)
        labels[i, 1 : len(s)] = torch.from_numpy(s[1:])
        mask[i, : len(s)] = True
    pos = torch.arange(width).expand(len(seqs), width)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal[None] & mask[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool)[None]  # padding queries: any one key
    return _loss_sum(model(ids, pos, allowed), labels)


@pytest.mark.parametrize("mode", ["best_fit", "greedy"])
def test_packed_loss_equals_unpacked_loss(mode: packing.Mode) -> None:
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, VOCAB - 1, size=int(n)) for n in rng.integers(1, SEQ, size=40)]
    eos = VOCAB - 1
    ds = Packed(docs, SEQ, mode=mode, eos=eos, pad=0)
    model = TinyCausal()
    batch = packing.collate([ds[r] for r in range(len(ds))])
    packed, count = _packed_loss(model, batch)
    with_eos = [np.append(d, eos) for d in docs]
    if mode == "best_fit":  # the documents, whole (none is longer than SEQ)
        units = with_eos
    else:  # the pieces of the stream each row holds
        rows = ds.rows
        units = [
            with_eos[int(rows.doc[j])][int(rows.start[j]) : int(rows.start[j] + rows.length[j])]
            for j in range(len(rows.doc))
        ]
    reference, ref_count = _unpacked_loss(model, units)
    assert count == ref_count > 0
    torch.testing.assert_close(packed / count, reference / ref_count)
    # and the mask matters: attending across segments gives another loss
    wrong = torch.ones(
        1, batch["input_ids"].numel(), batch["input_ids"].numel(), dtype=torch.bool
    ).tril()
    ids, pos = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
    across, _ = _loss_sum(model(ids, pos, wrong), batch["labels"].reshape(1, -1))
    assert not torch.isclose(across / count, reference / ref_count)
