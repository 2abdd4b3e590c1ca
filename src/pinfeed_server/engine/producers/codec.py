"""The pool's pipe format: tasks and results as fixed ``struct`` layouts over
``send_bytes``/``recv_bytes``, so nothing is pickled per batch.

A task: ``seq, epoch, index, slot`` and whether indices follow (an iterable's turn
has none), then the indices as int64. An empty message tells
the worker to exit. A result: ``seq, status, rows`` (-1: one per index), then the
batch's strings JSON (status ``OK``) or its ``ErrorInfo`` as JSON (``ERROR``); ``END`` has no
payload. ``seq`` -1 is a worker's start-up report.
"""

from __future__ import annotations

import json
import struct
from array import array

from pinfeed.protocol import ErrorInfo
from pinfeed_server.engine.producers.base import Result, Task

_TASK = struct.Struct("<qqqIb")  # ..., slot, 1: indices follow (0: an iterable's turn)
_RESULT = struct.Struct("<qBq")
OK, ERROR, END = 0, 1, 2
STOP = b""
STARTUP_SEQ = -1


def encode_task(task: Task) -> bytes:
    if task.indices is None:
        return _TASK.pack(task.seq, task.epoch, task.index, task.slot, 0)
    head = _TASK.pack(task.seq, task.epoch, task.index, task.slot, 1)
    return head + array("q", task.indices).tobytes()


def decode_task(buf: bytes) -> Task:
    seq, epoch, index, slot, listed = _TASK.unpack_from(buf)
    if not listed:
        return Task(seq, epoch, index, slot, None)
    return Task(seq, epoch, index, slot, memoryview(buf)[_TASK.size :].cast("q").tolist())


def encode_result(result: Result) -> bytes:
    rows = -1 if result.rows is None else result.rows
    if result.error is not None:
        return (
            _RESULT.pack(result.seq, ERROR, rows)
            + json.dumps(result.error.to_json(), default=str).encode()
        )
    if result.end:
        return _RESULT.pack(result.seq, END, rows)
    return _RESULT.pack(result.seq, OK, rows) + result.strings


def decode_result(buf: bytes) -> Result:
    seq, status, rows = _RESULT.unpack_from(buf)
    payload = buf[_RESULT.size :]
    n = None if rows < 0 else rows
    if status == ERROR:
        return Result(seq, error=ErrorInfo.from_json(json.loads(payload)), rows=n)
    if status == END:
        return Result(seq, end=True, rows=n)
    return Result(seq, payload, rows=n)
