"""An in-process stand-in for the server's data plane, behind ``Loader(transport=...)``.

It speaks the real wire format (``pinfeed.protocol``) over a real memfd ring, and
answers each message when it is sent, as a server with every batch ready would:
NEXT with BATCH (or END after the epoch's last batch), SKIP with END, SEEK with
POSITION. Batch (epoch e, index i) holds labels ``1000 * e + 10 * i + row``, so a test
reads off which batch it got. It records every message kind the loader sent.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from pinfeed import protocol as p
from pinfeed._transport import lost
from pinfeed.errors import SampleError

ROWS = 2  # samples per batch
SLOT_BYTES = 64


class FakeServer:
    def __init__(
        self, batches: int = 3, nslots: int = 4, fail_at: set[tuple[int, int]] = frozenset()
    ):
        self.buf = bytearray(p.MAX_MESSAGE)
        self.batches = batches
        self.nslots = nslots
        self.fail_at = fail_at
        self.pos = (0, 0)
        self.sent: list[str] = []  # kinds of the loader's messages, in order
        self.leased: set[int] = set()
        self.late = False  # True: the next try_recv finds nothing (the batch is not ready)
        self.attaches = 0
        self.crash = False  # True: the next recv finds the connection gone
        self._replies: deque[bytes] = deque()
        self._fd = os.memfd_create("pinfeed-fake")
        os.ftruncate(self._fd, nslots * SLOT_BYTES)
        self._map = mmap.mmap(self._fd, nslots * SLOT_BYTES)
        self._labels = torch.frombuffer(self._map, dtype=torch.int64)
        self._next_slot = 0

    # -- Transport -------------------------------------------------------------------
    def attach(self, request: bytes, fds: Sequence[int] = ()) -> tuple[int, list[int]]:
        self.attaches += 1
        self.sent.append("ATTACH")
        leaf = p.Leaf("tensor", "int64", (), 0, SLOT_BYTES, 8)
        attached = p.Attached(
            loader=p.Attach.decode(request).loader,
            member=0,
            ring_bytes=self.nslots * SLOT_BYTES,
            nslots=self.nslots,
            slot_bytes=SLOT_BYTES,
            layout=p.Layout(["tuple", [["leaf", 0]]], (leaf,), ROWS, SLOT_BYTES),
            batches_per_epoch=self.batches,
            epoch=self.pos[0],
            position=self.pos[1],
            config=p.AttachedConfig(
                dataset="fake",
                batch_size=ROWS,
                shuffle=False,
                seed=0,
                drop_last=False,
                num_workers=0,
                prefetch_factor=2,
                pin_memory=False,
                persistent_workers=False,
                rank=0,
                world_size=None,
                group_size=1,
                group_mode="broadcast",
                collate_fn=None,
                sampler=None,
                batch_sampler=None,
            ),
            dataset_length=self.batches * ROWS,
            sampler_length=self.batches * ROWS,
            sample=[{"dtype": "int64", "shape": []}],
        )
        return self._put(attached.encode()), [os.dup(self._fd)]

    def send(self, message: bytes) -> None:
        kind = message[0]
        self.sent.append({v: k for k, v in _KINDS.items()}[kind])
        if kind in (p.NEXT, p.RELEASE, p.SKIP):
            slots, _ = p.decode_release(message)
            assert set(slots) <= self.leased, f"released {slots}, leased {self.leased}"
            self.leased.difference_update(slots)
        if kind == p.NEXT:
            self._replies.append(self._item())
        elif kind == p.SKIP:
            epoch = self.pos[0]
            self.pos = (epoch + 1, 0)
            self._replies.append(p.END_BODY.pack(p.END, epoch, 0))
        elif kind == p.SEEK:
            _, epoch, index = p.POSITION_BODY.unpack(message)
            self.pos = (epoch, index)
            self._replies.append(p.POSITION_BODY.pack(p.POSITION, epoch, index))

    def recv(self) -> int:
        if self.crash:
            self.crash = False
            self._replies.clear()
            self.leased.clear()  # a restarted server: nothing leased, position kept
            raise lost("it closed the connection")
        if not self._replies:
            raise TimeoutError("the loader waits for a reply the fake server never sends")
        return self._put(self._replies.popleft())

    def take_fds(self) -> list[int]:
        return []  # the fake ring never grows

    def try_recv(self) -> int | None:
        if self.crash:
            return self.recv()
        if self.late or not self._replies:
            self.late = False
            return None
        return self.recv()

    def close(self) -> None:
        self._replies.clear()
        self.leased.clear()

    # -- the fake engine -------------------------------------------------------------
    def _item(self) -> bytes:
        epoch, index = self.pos
        if index == self.batches:
            self.pos = (epoch + 1, 0)
            return p.END_BODY.pack(p.END, epoch, 0)
        self.pos = (epoch, index + 1)
        if (epoch, index) in self.fail_at:
            return SampleError("bad").info().at(epoch, index).encode()
        slot = self._free_slot()
        base = slot * SLOT_BYTES // 8
        for row in range(ROWS):
            self._labels[base + row] = 1000 * epoch + 10 * index + row
        head = p.BATCH_HEAD.pack(p.BATCH, slot, 0, epoch, index, 0)
        return head + ROWS.to_bytes(8, "little")

    def _free_slot(self) -> int:
        for _ in range(self.nslots):
            slot, self._next_slot = self._next_slot, (self._next_slot + 1) % self.nslots
            if slot not in self.leased:
                self.leased.add(slot)
                return slot
        raise AssertionError("every slot is leased: the loader holds too many")

    def _put(self, message: bytes) -> int:
        self.buf[: len(message)] = message
        return len(message)


_KINDS: dict[str, Any] = {
    name: getattr(p, name) for name in ("ATTACH", "NEXT", "RELEASE", "SKIP", "SEEK", "CUDA")
}


def labels(batch: Any) -> list[int]:
    return [int(v) for v in batch[0]]


def first(epoch: int, index: int) -> int:
    """The first label of batch (epoch, index)."""
    return 1000 * epoch + 10 * index
