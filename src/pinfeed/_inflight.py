"""Where a trainer-side loader stands with its server, and its one wait for a reply.

Both ways in keep a NEXT in flight inside an epoch where they can, so that a ready
batch is in the socket when the trainer asks for it: a named ``Loader``
(``pinfeed._epochs``) sends it as a batch arrives, and where it knows the epoch's length
keeps ``protocol.NEXTS_IN_FLIGHT`` (the batch after the next announced as soon as it is
made); a ``pinfeed.DataLoader``
(``pinfeed._dataloader``) where its way of feeding has it, after the index batches
fed ahead or in one message with the last of them. ``State`` says
which of that holds; ``reply`` is the wait for the next item, which both make the same
way.
"""

from __future__ import annotations

import enum
import time

from pinfeed import protocol as p
from pinfeed._connection import Connection


class State(enum.Enum):
    IDLE = "idle"  # between epochs: the next epoch to start begins at the position
    EPOCH = "epoch"  # an iterator is inside an epoch; no NEXT in flight
    AHEAD = "ahead"  # inside an epoch, NEXTs in flight (sent as a batch arrived)
    CLOSED = "closed"


_NEXT, _RELEASE = p.NEXT, p.RELEASE
_now_ns = time.perf_counter_ns


def reply(conn: Connection, ahead: bool) -> int:
    """Wait for the next item's reply (its length; it is in ``conn.buf``): that of the
    first NEXT in flight (``ahead``), else of a NEXT sent now. Usually the NEXT in flight has
    its reply here already (no server wake-up on the trainer's path); if not, the last
    batch's slot goes back before the wait, so that the server can make a batch into it
    (a group member must never hold and wait). ``conn.wait_us`` is this wait. Where the
    transport's TimeoutError comes, a NEXT is in flight (that one, or the one sent now)."""
    asked = _now_ns()
    if ahead:
        n = conn.try_recv()
        if n is None:
            if conn.holds_slots():
                conn.send(_RELEASE)
            n = conn.recv()
    else:
        conn.send(_NEXT)
        n = conn.recv()
    conn.wait_us = (_now_ns() - asked) // 1000
    return n
