"""The pool's pipe codec: every task and result kind round-trips."""

from __future__ import annotations

import pytest

from pinfeed.errors import SampleError
from pinfeed_server.engine.producers.base import Result, Task
from pinfeed_server.engine.producers.codec import (
    decode_result,
    decode_task,
    encode_result,
    encode_task,
)


@pytest.mark.parametrize(
    "task",
    [
        Task(0, 0, 0, 0, [1, 2, 3]),
        Task(2**40, 7, 12, 5, [2**40, -1, 0]),
        Task(3, 1, 0, 2, []),
        Task(4, 2, 9, 1, None),  # an iterable's turn
    ],
)
def test_tasks_round_trip(task: Task) -> None:
    assert decode_task(encode_task(task)) == task


@pytest.mark.parametrize(
    "result",
    [
        Result(5),
        Result(6, b'[["a", "b"]]'),
        Result(-1),
        Result(7, error=SampleError("boom", index=3).info()),
        Result(8, end=True),
        Result(9, b"", rows=3),
    ],
)
def test_results_round_trip(result: Result) -> None:
    assert decode_result(encode_result(result)) == (result, False)


def test_an_error_payload_that_is_not_json_is_stringified() -> None:
    error = SampleError("boom", cause=ValueError("x")).info()
    out, _ = decode_result(encode_result(Result(1, error=error)))
    assert out.error == SampleError("boom", cause="x").info()
