"""A pinfeed server for this user when none answers (``pinfeed.DataLoader``'s embedded
default): started in the background from the trainer's own Python environment, it
exits by itself ``PINFEED_IDLE_EXIT_S`` (default 600) after its last trainer left.

It is the script's plumbing, not the node's service: it says so
(``PINFEED_STARTED_BY=script``), and so keeps a registry of its own, in memory, instead
of restoring the named loaders (their workers, their rings) that a ``pinfeed serve`` of
this user registered under ``PINFEED_STATE_DIR``.

Two trainers starting at once start one server: a lock file beside the socket is held
while one is started (``flock``), and the second finds it answering. With
``PINFEED_AUTOSTART=0`` nothing is started: a missing server is an error naming
``pinfeed serve``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from pinfeed import protocol as p
from pinfeed.errors import ServerUnavailable

START_TIMEOUT_S = 60.0
IDLE_EXIT_S = "600"
# How a server came to run (PINFEED_STARTED_BY; GET /v1/node's ``lifetime``): by
# ``pinfeed serve``, or by a script's pinfeed.DataLoader, here.
StartedBy = Literal["serve", "script"]
SCRIPT: StartedBy = "script"


def answers(path: Path) -> bool:
    """True if a server accepts connections on data-plane socket ``path``."""
    with contextlib.closing(p.new_socket()) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def ensure_server(path: Path) -> None:
    """A server on ``path``: the one there, or one started now (see the module)."""
    if answers(path):
        return
    if os.environ.get("PINFEED_AUTOSTART", "1").strip().lower() in ("0", "false", "no", "off"):
        raise ServerUnavailable(
            f"no pinfeed server at {path}: start one with `pinfeed serve` (or unset "
            "PINFEED_AUTOSTART=0 to let pinfeed.DataLoader start one for you)"
        )
    if importlib.util.find_spec("pinfeed_server") is None:  # not imported: the server's
        raise ServerUnavailable(
            f"no pinfeed server at {path}, and this environment cannot start one: "
            "pip install 'pinfeed[server]', or start one elsewhere with `pinfeed serve` "
            "and set PINFEED_SOCKET"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.parent / "autostart.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another trainer may be starting it: wait
        try:
            if not answers(path):
                _start(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start(path: Path) -> None:
    log = path.parent / "autostart.log"
    env = dict(os.environ)
    env.update(
        PINFEED_SOCKET=str(path),
        PINFEED_STARTED_BY=SCRIPT,
        PINFEED_IDLE_EXIT_S=env.get("PINFEED_IDLE_EXIT_S", IDLE_EXIT_S),
        # Any free port: a node's users each have a server of their own.
        PINFEED_PORT=env.get("PINFEED_PORT", "0"),
        # The trainer's import path: the server imports what the trainer's objects are
        # pickled against (its installed packages, the script's folder).
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pinfeed_server", "serve"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # it outlives this trainer, and its signals
            cwd=str(path.parent),
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers(path):
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise ServerUnavailable(
                f"the pinfeed server started for this trainer exited (code "
                f"{proc.returncode}); its log, {log}:\n{tail}"
            )
        if time.monotonic() > deadline:
            raise ServerUnavailable(
                f"the pinfeed server started for this trainer did not answer on {path} "
                f"within {START_TIMEOUT_S:.0f} s; see {log}"
            )
        time.sleep(0.02)  # it offers nothing to wait on before its socket listens
