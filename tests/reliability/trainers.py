"""Trainer processes for the reliability tests, forked from a forkserver that has
already imported torch and the client (so starting one costs milliseconds, not the
seconds of a fresh interpreter importing torch).

Each reports over a pipe: ("attached", epoch, position), then ("batch", labels,
state_dict) per batch. Samples are ``(features, index)``, so labels are the sample
indices of the batch.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from typing import Any

from pinfeed import Loader

PRELOAD = ["tests.reliability.trainers"]


def context() -> ForkServerContext:
    mp.set_forkserver_preload(PRELOAD)
    return mp.get_context("forkserver")


def run(socket: str, loader: str, conn: Connection, batches: int, then: str) -> None:
    """Take ``batches`` batches, then ``hold`` the last one (block with its slot leased
    until the test says go) or ask for the ``next`` one (block inside NEXT while the
    server produces it). Any exception is reported as ("error", type, message)."""
    try:
        lo = Loader(loader, socket=socket)
        conn.send(("attached", lo.meta.epoch, lo.meta.position))
        got = 0
        while True:
            for _x, y in lo:
                conn.send(("batch", y.tolist(), lo.state_dict()))
                got += 1
                if got == batches:
                    conn.send((then,))
                    if then == "hold":
                        conn.recv()  # the batch's view stays alive meanwhile
                        conn.send(("still", y.tolist()))
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc)))


def start(
    ctx: ForkServerContext, socket: str, loader: str, batches: int, then: str = "hold"
) -> tuple[Any, Connection]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=run, args=(socket, loader, child, batches, then), daemon=True, name="trainer"
    )
    proc.start()
    child.close()
    return proc, parent


def expect(conn: Connection, timeout: float = 30.0) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise AssertionError(f"the trainer said nothing for {timeout} s")
    msg: tuple[Any, ...] = conn.recv()
    return msg
