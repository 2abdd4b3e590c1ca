"""Trainer subprocesses (``bench.trainer``) driven over stdin/stdout, with memory sampling."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench.memory import PeakSampler
from bench.results import REPO, ForeignCpu, tree_cpu_s


class BenchError(RuntimeError):
    pass


def child_env() -> dict[str, str]:
    """This process's environment, the repository first on PYTHONPATH (``-m bench.…``)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def spawn(args: list[str], stderr: Any = None) -> subprocess.Popen[str]:
    """``python -m *args`` in the repository, spoken to in lines over stdin/stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def end(
    proc: subprocess.Popen[str],
    timeout: float,
    ignore: tuple[type[BaseException], ...] = (BrokenPipeError,),
) -> None:
    """Close the child's stdin (its cue to finish), wait up to ``timeout`` s, else kill
    it. ``ignore``: what closing may raise that does not matter (the child gone)."""
    assert proc.stdin is not None
    with contextlib.suppress(*ignore):
        proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_points(proc: subprocess.Popen[str]) -> tuple[list[tuple[Any, ...]], threading.Event]:
    """A child's stdout read on a thread of its own: its one dict (its first batch came)
    sets the event, each list after it is a data point, kept as a tuple in the list."""
    points: list[tuple[Any, ...]] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            if isinstance(msg, dict):
                ready.set()
            else:
                points.append(tuple(msg))

    threading.Thread(target=read, daemon=True).start()
    return points, ready


class TrainerProc:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        # stderr to a file, not a pipe nobody drains; closed in finish() or kill().
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = spawn(["bench.trainer", json.dumps(spec)], self._err)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, chars: int = 4000) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-chars:]

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(
                    f"trainer {self.spec.get('system')}: no {event!r} within "
                    f"{timeout:.0f} s\n{self.stderr_tail()}"
                )
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(10)
                raise BenchError(
                    f"trainer {self.spec.get('system')} exited "
                    f"({self.proc.returncode}) before {event!r}\n"
                    f"{self.stderr_tail()}"
                )
            if not line.startswith("{"):
                continue  # something else printed to stdout
            msg: dict[str, Any] = json.loads(line)
            if msg.get("event") == "error":
                raise BenchError(
                    f"trainer {self.spec.get('system')} failed: {msg['error']}\n"
                    f"{msg.get('where', '')}\n{self.stderr_tail()}"
                )
            if msg.get("event") == event:
                return msg

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60.0) -> None:
        end(self.proc, timeout)
        self._err.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def run_trainers(
    specs: list[dict[str, Any]], *, server_pid: int | None, timeout: float = 600.0
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start one process per spec, release them together, return (results, memory).

    Memory is the peak of (server tree, if any) + (all trainer trees) while they run.
    Between "go" (or, for ``timed`` trainers, their ``window`` events: the end of their
    warm-up) and the last result (the timed window) it also measures CPU: each
    trainer tree's and the server tree's CPU seconds, and ``foreign``: what processes
    outside the benchmark used meanwhile (``bench.results.ForeignCpu``).
    """
    procs: list[TrainerProc] = []

    def groups() -> dict[str, list[int]]:
        g = {"trainer": [p.pid for p in procs]}
        if server_pid is not None:
            g["server"] = [server_pid]
        return g

    sampler = PeakSampler(groups).start()
    try:
        for spec in specs:
            procs.append(TrainerProc(spec))
        ready = [p.expect("ready", timeout) for p in procs]
        foreign = ForeignCpu().start()
        cpu0 = [tree_cpu_s(p.pid) for p in procs]
        server0 = tree_cpu_s(server_pid) if server_pid is not None else 0.0
        for p in procs:
            p.send("go\n")
        if all(spec.get("mode") == "timed" for spec in specs):
            # The window starts after each trainer's warm-up batches: CPU from there.
            for p in procs:
                p.expect("window", timeout)
            foreign = ForeignCpu().start()
            cpu0 = [tree_cpu_s(p.pid) for p in procs]
            server0 = tree_cpu_s(server_pid) if server_pid is not None else 0.0
        results = [p.expect("result", timeout) for p in procs]
        server_cpu = tree_cpu_s(server_pid) - server0 if server_pid is not None else 0.0
        for r, p, c0 in zip(results, procs, cpu0, strict=True):
            r["trainer_tree_cpu_s"] = tree_cpu_s(p.pid) - c0
        window = foreign.stop()
        memory = sampler.stop()
        for p in procs:
            p.finish()
    except BaseException:
        sampler.stop()
        for p in procs:
            p.kill()
        raise
    for r, rd in zip(results, ready, strict=True):
        r["ready_ttfb_s"] = rd["ttfb_s"]
    memory["server_tree_cpu_s"] = server_cpu
    memory["foreign"] = window
    return results, memory
