"""The pipe between the server and a worker process (a pool worker, the Ray bridge):
every message kind, its one-byte tag and its layout, in one place. Per-batch messages
are fixed ``struct`` layouts over ``send_bytes``/``recv_bytes``, so nothing is pickled
per batch; the rare ones (a reseed, an RNG snapshot) are pickled.

    server -> worker                         worker -> server
    T  TASK     a task (below)               r  RESULT    a result (below)
    R  RESEED   a pickled ``Reseed``         s  SNAPSHOT  (epoch, index, RNG state, seq)
    G  SEGMENT  a ring segment to map; its   x  RESTART   an actor was replaced (bridge)
                fd follows (send_handle)     F  FATAL     the cluster is lost (bridge)
    D  DROP     a ring segment to unmap
    W  RING     the ring of a loader sized from its first batches: its layout (JSON),
                segment 0's fd follows
    J  OBJECTS  a trainer's objects from an epoch on: the epoch, the number of
                payloads (a chain) and of shared memory fds, which follow, in order
    N  RESIZE   actors to run (bridge)
    (empty)     STOP: exit

A task: ``seq, epoch, index, slot``, whether indices follow (an iterable's turn has
none) and whether a base seed does (one the trainer drew), then the seed and the
indices as int64. A result: ``seq, status, flags, rows`` (-1: one per index), with
``PROPOSED`` the ring layout the batch proposes (its JSON's length as uint32, then it),
then the batch's body (status ``OK``) or its ``ErrorInfo`` as JSON (``ERROR``); ``END``
has no payload. With ``OWN`` the batch is in a buffer of its own, whose fd follows the
result on the pipe (send_handle). A result with ``seq`` -1 is a worker's start-up report.
"""

from __future__ import annotations

import json
import pickle
import struct
from array import array
from typing import Any

from pinfeed.protocol import ErrorInfo, Layout
from pinfeed_server.engine.producers.base import Result, Task

TASK_TAG, RESEED_TAG, SEGMENT_TAG, DROP_TAG, RESIZE_TAG = b"T", b"R", b"G", b"D", b"N"
RING_TAG, OBJECTS_TAG = b"W", b"J"
RESULT_TAG, SNAPSHOT_TAG, RESTART_TAG, FATAL_TAG = b"r", b"s", b"x", b"F"
STOP = b""
STARTUP_SEQ = -1

# seq, epoch, index, slot, 1: indices follow (0: an iterable's turn), seeds that follow
# (SEEDED: the base seed, then SHARED: the shared seed)
_TASK = struct.Struct("<qqqIbb")
SEEDED, SHARED = 1, 2
_SEED = struct.Struct("<q")
_RESULT = struct.Struct("<qBBq")
OK, ERROR, END = 0, 1, 2
OWN, PROPOSED = 1, 2  # result flags
_LENGTH = struct.Struct("<I")
_SEGMENT = struct.Struct("<III")  # id, first slot, slots
_COUNT = struct.Struct("<q")


def encode_task(task: Task) -> bytes:
    """A TASK's body (``TASK_TAG`` goes before it on the pipe)."""
    listed, seeds = task.indices is not None, 0
    seed = b""
    if task.seed is not None:
        seeds, seed = SEEDED, _SEED.pack(task.seed)
    if task.shared is not None:
        seeds, seed = seeds | SHARED, seed + _SEED.pack(task.shared)
    head = _TASK.pack(task.seq, task.epoch, task.index, task.slot, listed, seeds)
    if task.indices is None:
        return head + seed
    return head + seed + array("q", task.indices).tobytes()


def decode_task(buf: bytes) -> Task:
    seq, epoch, index, slot, listed, seeds = _TASK.unpack_from(buf)
    at = _TASK.size
    seed = shared = None
    if seeds & SEEDED:
        (seed,) = _SEED.unpack_from(buf, at)
        at += _SEED.size
    if seeds & SHARED:
        (shared,) = _SEED.unpack_from(buf, at)
        at += _SEED.size
    indices = memoryview(buf)[at:].cast("q").tolist() if listed else None
    return Task(seq, epoch, index, slot, indices, seed, shared)


def encode_result(result: Result) -> bytes:
    """A RESULT's body (a Ray actor returns it through the object store as it is); the
    sender sends ``result.own``'s fd after it."""
    rows = -1 if result.rows is None else result.rows
    if result.error is not None:
        return (
            _RESULT.pack(result.seq, ERROR, 0, rows)
            + json.dumps(result.error.to_json(), default=str).encode()
        )
    if result.end:
        return _RESULT.pack(result.seq, END, 0, rows)
    flags = (OWN if result.own is not None else 0) | (PROPOSED if result.proposal else 0)
    head = _RESULT.pack(result.seq, OK, flags, rows)
    if result.proposal is None:
        return head + result.strings
    proposal = json.dumps(result.proposal.to_json()).encode()
    return head + _LENGTH.pack(len(proposal)) + proposal + result.strings


def decode_result(buf: bytes) -> tuple[Result, bool]:
    """The result, and whether its buffer's fd follows on the pipe (``OWN``)."""
    seq, status, flags, rows = _RESULT.unpack_from(buf)
    payload = buf[_RESULT.size :]
    n = None if rows < 0 else rows
    if status == ERROR:
        return Result(seq, error=ErrorInfo.from_json(json.loads(payload)), rows=n), False
    if status == END:
        return Result(seq, end=True, rows=n), False
    proposal = None
    if flags & PROPOSED:
        (size,) = _LENGTH.unpack_from(payload)
        start = _LENGTH.size
        proposal = Layout.from_json(json.loads(payload[start : start + size]))
        payload = payload[start + size :]
    return Result(seq, payload, rows=n, proposal=proposal), bool(flags & OWN)


_OBJECTS = struct.Struct("<qII")  # epoch, payloads, shared memory fds


def encode_objects(epoch: int, payloads: int, shared: int) -> bytes:
    """An OBJECTS: the epoch the objects apply from, and how many payload fds and shared
    memory fds follow."""
    return OBJECTS_TAG + _OBJECTS.pack(epoch, payloads, shared)


def decode_objects(message: bytes) -> tuple[int, int, int]:
    epoch, payloads, shared = _OBJECTS.unpack(message[1:])
    return int(epoch), int(payloads), int(shared)


def encode_ring(layout: Layout, nslots: int) -> bytes:
    """A RING: the ring's layout and segment 0's slots (its fd follows)."""
    return RING_TAG + json.dumps({"layout": layout.to_json(), "nslots": nslots}).encode()


def decode_ring(message: bytes) -> tuple[Layout, int]:
    obj = json.loads(message[1:])
    return Layout.from_json(obj["layout"]), int(obj["nslots"])


def encode_pickled(tag: bytes, obj: Any) -> bytes:
    """A RESEED (a ``seeding.Reseed``) or a SNAPSHOT (``(epoch, index, state, seq)``)."""
    return tag + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode_pickled(message: bytes) -> Any:
    return pickle.loads(message[1:])


def encode_segment(tag: bytes, sid: int, first: int, nslots: int) -> bytes:
    """A SEGMENT (its fd follows) or a DROP."""
    return tag + _SEGMENT.pack(sid, first, nslots)


def decode_segment(message: bytes) -> tuple[int, int, int]:
    sid, first, nslots = _SEGMENT.unpack(message[1:])
    return int(sid), int(first), int(nslots)


def encode_count(n: int) -> bytes:
    """A RESIZE: the number of actors the bridge runs from now on."""
    return RESIZE_TAG + _COUNT.pack(n)


def decode_count(message: bytes) -> int:
    return int(_COUNT.unpack(message[1:])[0])
