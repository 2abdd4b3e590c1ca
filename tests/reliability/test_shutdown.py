"""SIGTERM with trainers attached, one holding a leased batch and one waiting inside
NEXT: the server stops producing, tells the trainers, and exits within 10 s."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext

import pytest

from pinfeed import Client
from tests.conftest import Server
from tests.reliability import trainers
from tests.reliability.procs import descendants, gone, wait_for

# The shutdown's wall-clock time against a bound; the module's tests share one stop (a
# server with trainers attached: slow to set up).
pytestmark = [pytest.mark.serial, pytest.mark.slow]


@dataclass
class Stopped:
    server: Server
    seconds: float
    code: int
    old_pids: list[int]
    held: list[int]  # labels of the batch the holding trainer held at SIGTERM
    still: list[int]  # what that batch's view read after the server had gone
    holding_error: tuple[str, ...]
    waiting_error: tuple[str, ...]


@pytest.fixture(scope="module")
def stopped(
    make_server: Callable[..., Server], trainer_ctx: ForkServerContext
) -> Iterator[Stopped]:
    srv = make_server()
    srv.start()
    with Client(srv.url) as admin:
        for name, delay in (("fast", 0.0), ("slow", 0.25)):
            admin.create_dataset(
                name,
                "python",
                {
                    "factory": "tests.reliability.datasets:Slow",
                    "kwargs": {"length": 64, "delay_s": delay},
                },
            )
            admin.create_loader(name, dataset=name, batch_size=4, num_workers=2)
        hold, holding = trainers.start(trainer_ctx, str(srv.socket), "fast", 3, then="hold")
        wait, waiting = trainers.start(trainer_ctx, str(srv.socket), "slow", 1, then="next")
        held: list[int] = []
        for conn, then in ((holding, "hold"), (waiting, "next")):
            while (msg := trainers.expect(conn))[0] != then:
                assert msg[0] in ("attached", "batch"), msg
                held = msg[1] if msg[0] == "batch" and conn is holding else held
        assert admin.loader("fast")["slots"]["leased"] >= 1
        # The slow loader's workers are mid-batch (a second a batch) when the signal comes.
        assert admin.loader("slow")["consumer_attached"]
    old_pids = [srv.proc.pid, *(p.pid for p in descendants(srv.proc.pid))]  # type: ignore[union-attr]
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    try:
        code = srv.proc.wait(30)  # type: ignore[union-attr]
    finally:
        seconds = time.monotonic() - t0
    # The trainer inside NEXT hears first (after any batch already on its way) ...
    while (waiting_error := trainers.expect(waiting, 10))[0] == "batch":
        pass
    # ... the holding one reads its batch again, then asks for the next.
    holding.send("go")
    kind, still = trainers.expect(holding, 10)
    assert kind == "still"
    # ... and, like the waiting one, gets the batches already on their way first.
    while (holding_error := trainers.expect(holding, 10))[0] == "batch":
        pass
    yield Stopped(srv, seconds, code, old_pids, held, still, holding_error, waiting_error)
    for proc in (hold, wait):
        proc.kill()
        proc.join(5)


def test_exits_within_10s(stopped: Stopped) -> None:
    assert stopped.seconds < 10, f"took {stopped.seconds:.1f} s"


def test_exit_code_is_0(stopped: Stopped) -> None:
    assert stopped.code == 0


def test_trainers_are_told(stopped: Stopped) -> None:
    for error in (stopped.waiting_error, stopped.holding_error):
        assert error[:2] == ("error", "ServerUnavailable"), error


def test_a_held_batch_is_never_overwritten(stopped: Stopped) -> None:
    assert stopped.still == stopped.held


def test_nothing_left_behind(stopped: Stopped) -> None:
    wait_for(lambda: gone(stopped.old_pids), "the server's processes to exit", 10)
    assert not os.path.exists(stopped.server.socket)
