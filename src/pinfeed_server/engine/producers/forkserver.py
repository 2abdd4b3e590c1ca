"""The forkserver the pool's workers are forked from.

It is forked from the server at start-up, before any thread exists, and preloads the
worker module (torch and the dataset kinds): the forkserver and every worker then
share the server's pages of torch copy-on-write, and starting a worker costs
milliseconds.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from multiprocessing import forkserver
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

log = logging.getLogger("pinfeed.workers")

# What every worker needs imported; see worker.py.
PRELOAD = "pinfeed_server.engine.producers.worker"


def configure_forkserver(tmp_dir: Path) -> None:
    """Preload torch and the dataset kinds in the forkserver, and start it now, so the
    first loader with workers does not wait for it.

    multiprocessing keeps its listener in a ``pymp-*`` directory under the temp dir and
    removes it only at a clean exit; pointing the temp dir at ``tmp_dir`` (emptied at
    every start) keeps a SIGKILLed server from leaving those behind in /tmp.

    Called while the server has no other thread yet, the forkserver is forked from the
    server instead of started as a new interpreter: it (and every worker forked from
    it) then shares the server's pages of torch and the dataset kinds copy-on-write,
    instead of importing them again (about 170 MiB less per node). Later, with threads
    running, a fork would not be safe, so a forkserver that has to be restarted is a
    new interpreter, as multiprocessing does it.
    """
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True, mode=0o700)
    tempfile.tempdir = str(tmp_dir)
    try:
        mp.set_forkserver_preload([PRELOAD])
    except Exception:  # pragma: no cover - older Pythons raise if already started
        log.debug("forkserver preload not set", exc_info=True)
    if threading.active_count() == 1 and sys.platform == "linux":
        gc.collect()  # no garbage to inherit: nothing the children hold is finalized there
        spawnv_passfds = mp_util.spawnv_passfds
        mp_util.spawnv_passfds = _fork_passfds  # used by ensure_running, for this call only
        try:
            forkserver.ensure_running()
        finally:
            mp_util.spawnv_passfds = spawnv_passfds
        log.debug("forkserver forked from the server")
        return
    threading.Thread(
        target=forkserver.ensure_running, name="pinfeed-forkserver", daemon=True
    ).start()


def _fork_passfds(path: bytes, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds``, but forked instead of exec'd: the child
    keeps only stdio and ``passfds``, gets default signal handling back, and runs the
    ``-c`` program it would have been started with (the forkserver's or the resource
    tracker's main loop)."""
    program = str(args[list(args).index("-c") + 1])
    keep = {0, 1, 2, *passfds}
    pid = os.fork()
    if pid != 0:
        return pid
    status = 1
    try:
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(name))
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Everything inherited from the server (torch, the kinds) goes to the collector's
        # permanent generation: a collection in a worker then never walks it, which would
        # write to every object's header and so copy ~45 MiB of shared pages per worker.
        gc.freeze()
        exec(program, {"__name__": "__pinfeed_forked__"})  # multiprocessing's own program
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)
