"""``Loader.replay``: one batch made again by the server, over a connection of its own.

The REPLAY opens a new data-plane connection (the loader's own, with its NEXT in
flight and its leased slots, is left as it is); the server makes the batch into a ring
of one slot and sends REPLAYED with that ring's memfd, then the BATCH (or the ERROR
the batch raised). The batch is copied out of the mapping, which goes with the
connection: what the caller gets is its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pinfeed import protocol as p
from pinfeed._ring import RingMapping, RingSegments
from pinfeed._transport import SocketTransport, close_fds
from pinfeed._views import BatchViews, _map_tensors
from pinfeed.errors import DataPlaneError, error_from_info


def replay(
    path: Path,
    loader: str,
    epoch: int,
    index: int,
    timeout: float | None,
    device: torch.device | None = None,
) -> tuple[Any, p.Replayed]:
    """Batch ``index`` of ``epoch`` of ``loader`` made again (owned tensors, on
    ``device`` if given), and the server's account of it (its indices, worker, rank)."""
    transport = SocketTransport(path, timeout, loader)
    try:
        n, fds = transport.attach(p.Replay(loader, epoch, index).encode())
        buf = transport.buf
        if buf[0] != p.REPLAYED or len(fds) != 1:
            close_fds(fds)
            raise _failure(buf, n)
        info = p.Replayed.decode(memoryview(buf)[:n])
        ring = RingMapping(fds[0], info.ring_bytes)
        try:
            n = transport.recv()
            if buf[0] != p.BATCH:
                raise _failure(buf, n)
            slot_bytes = info.ring_bytes
            views = BatchViews(RingSegments(ring, 1, slot_bytes), info.layout, slot_bytes)
            _, slot, _, _, _, nstr = p.BATCH_HEAD.unpack_from(buf)
            batch = views.batch(buf, slot, nstr)
            owned = _map_tensors(batch, lambda t: t.to(device, copy=True) if device else t.clone())
            del batch
            views.clear()
        finally:
            ring.close()
        return owned, info
    finally:
        transport.close()


def _failure(buf: bytearray, n: int) -> Exception:
    if buf[0] == p.ERROR:
        return error_from_info(p.ErrorInfo.decode(memoryview(buf)[:n]))
    return DataPlaneError(f"unexpected message kind {buf[0]} in reply to REPLAY")
