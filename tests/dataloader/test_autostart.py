"""The embedded default: where no server answers, ``pinfeed.DataLoader`` starts one for
this user from the trainer's Python, which exits by itself once idle, whatever the
registry of ``pinfeed serve`` holds (it keeps a registry of its own); two trainers
starting at once start one server; ``PINFEED_AUTOSTART=0`` turns it off with an error
naming ``pinfeed serve``; ``pinfeed serve`` started while a script's server runs takes
the socket over."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from pinfeed import Client, ServerUnavailable
from pinfeed._autostart import answers
from pinfeed_server.cli import app
from pinfeed_server.registry import LoaderRow, Registry
from tests.api.conftest import synthetic
from tests.dataloader.test_example import _example
from tests.helpers import unique
from tests.launcher import REPO, Server, free_port
from tests.reliability.procs import descendants, fd_targets, gone, servers_on, wait_for

TRAINER = textwrap.dedent(
    """
    import sys, time, torch, pinfeed
    class Rows(torch.utils.data.Dataset):
        def __len__(self): return 32
        def __getitem__(self, i): return torch.tensor([i])
    t0 = time.perf_counter()
    loader = pinfeed.DataLoader(Rows(), batch_size=8, num_workers=1)
    first = next(iter(loader))
    print(f"first-batch {time.perf_counter() - t0:.3f} {first.flatten().tolist()}", flush=True)
    assert sum(1 for _ in loader) == 4
    loader.close()
    """
)


def _env(run: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINFEED_")}
    return env | {
        "PINFEED_SOCKET": str(run / "pinfeed.sock"),
        "PINFEED_STATE_DIR": str(run / "state"),
        "PINFEED_IDLE_EXIT_S": "2",
        "PYTHONPATH": str(REPO),
        **extra,
    }


@dataclass
class Watched:
    """What ``_watch`` saw of the servers on a socket while trainers ran."""

    servers: set[int]  # the servers' pids
    pids: set[int]  # theirs and their descendants' (forkserver, zygotes, workers)
    ended: float  # when the last trainer was seen done (monotonic)


def _watch(trainers: list[subprocess.Popen[str]], socket: Path) -> Watched:
    """The servers on ``socket`` while ``trainers`` run, until they are done. Looked for
    during the run: a server exits PINFEED_IDLE_EXIT_S after its last trainer's
    connection closed, which may come well before that trainer's process is done
    (torch's teardown, on a loaded machine)."""
    seen = Watched(set(), set(), math.nan)
    while True:
        running = any(t.poll() is None for t in trainers)
        seen.ended = time.monotonic()
        for server in servers_on(socket):
            seen.servers.add(server.pid)
            seen.pids.update(_tree(server))
        if not running:
            return seen
        time.sleep(0.05)


def _tree(server: psutil.Process) -> list[int]:
    """The server's pid and its descendants' (forkserver, zygotes, workers)."""
    return [server.pid, *(p.pid for p in descendants(server.pid))]


def _run(env: dict[str, str], code: str = TRAINER, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


@pytest.mark.slow
def test_a_server_starts_for_the_trainer_and_exits_when_idle(tmp_path: Path) -> None:
    socket = tmp_path / "pinfeed.sock"
    assert not answers(socket)
    trainer = _run(_env(tmp_path))
    seen = _watch([trainer], socket)
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err[-3000:]
    assert (
        out.startswith("first-batch ")
        and out.split(" ", 2)[2].strip() == "[0, 1, 2, 3, 4, 5, 6, 7]"
    )
    assert len(seen.servers) == 1
    # No trainer for PINFEED_IDLE_EXIT_S: it exits by itself, cleanly.
    wait_for(lambda: gone(list(seen.pids)), "exit", 30)
    assert not answers(socket)


@pytest.mark.slow
def test_two_trainers_at_once_start_one_server(tmp_path: Path) -> None:
    env = _env(tmp_path, PINFEED_IDLE_EXIT_S="5")
    trainers = [_run(env) for _ in range(2)]
    try:
        seen = _watch(trainers, tmp_path / "pinfeed.sock")
        for t in trainers:
            _, err = t.communicate(timeout=120)
            assert t.returncode == 0, err[-3000:]
        assert len(seen.servers) == 1
        log = (tmp_path / "autostart.log").read_text()
        # One server opened a data plane; the trainers may be done before its HTTP stack is up.
        assert log.count("INFO pinfeed: data plane on ") == 1, log[-2000:]
    finally:
        for server in servers_on(tmp_path / "pinfeed.sock"):
            server.terminate()


def test_autostart_off_is_an_error_naming_pinfeed_serve(tmp_path: Path) -> None:
    """With no server and none to start, a strict loader is an error naming ``pinfeed
    serve`` (and a loader that is not strict runs torch's own: test_fallback.py)."""
    env = _env(tmp_path, PINFEED_AUTOSTART="0", PINFEED_STRICT="1")
    trainer = _run(env)
    _, err = trainer.communicate(timeout=120)
    assert trainer.returncode != 0
    assert "ServerUnavailable" in err and "start one with `pinfeed serve`" in err
    assert not servers_on(tmp_path / "pinfeed.sock")


def test_autostart_off_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pinfeed

    monkeypatch.setenv("PINFEED_AUTOSTART", "0")
    with pytest.raises(ServerUnavailable, match="pinfeed serve"):
        pinfeed.DataLoader(list(range(4)), socket=tmp_path / "none.sock", strict=True)
    with pytest.warns(pinfeed.FallbackWarning, match="pinfeed serve"):
        loader = pinfeed.DataLoader(list(range(4)), socket=tmp_path / "none.sock")
    assert [b.tolist() for b in loader] == [[0], [1], [2], [3]]


IDLE_EXIT_S = 3


def _memfd_holders(names: list[str]) -> list[str]:
    """This user's processes that hold or map a memfd ``pinfeed-<name>`` (a ring, a
    shipped payload) of one of ``names``."""
    wanted = {f"/memfd:pinfeed-{n}" for n in names}
    held = []
    for proc in psutil.process_iter(["uids"]):
        if proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
            continue
        try:
            with open(f"/proc/{proc.pid}/maps") as f:
                maps = [line.split(maxsplit=5)[-1] for line in f]
            targets = fd_targets(proc.pid) + [m.strip().removesuffix(" (deleted)") for m in maps]
        except (OSError, psutil.NoSuchProcess):
            continue  # gone while we looked
        if any(t.removesuffix(" (deleted)") in wanted for t in targets):
            held.append(f"pid {proc.pid}")
    return held


def _exits_after_the_script(seen: Watched, socket: Path) -> None:
    """The server on ``socket`` that a script started (``seen`` while it ran) exits with
    all its processes within PINFEED_IDLE_EXIT_S plus a second of the script's end, and
    takes its socket with it; killed, if it does not, so that nothing outlives the
    test."""
    assert len(seen.servers) == 1
    for pid in seen.servers:  # its workers, if any started after the script was done
        with contextlib.suppress(psutil.NoSuchProcess):
            seen.pids.update(_tree(psutil.Process(pid)))
    pids = list(seen.pids)
    try:
        wait_for(lambda: gone(pids), "the script's server to exit", IDLE_EXIT_S + 10, every=0.05)
        took = time.monotonic() - seen.ended
    finally:
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
    assert took <= IDLE_EXIT_S + 1, f"exited {took:.2f} s after the script"
    assert not socket.exists() and not answers(socket)


@pytest.mark.serial  # a wall-clock bound: the exit within a second of its idle limit
@pytest.mark.slow
def test_a_scripts_server_leaves_the_registry_alone_and_exits_when_the_script_ends(
    tmp_path: Path,
) -> None:
    """``pinfeed serve`` registered a named loader with workers; a script then starts a
    server of its own (none runs), which neither restores that loader nor stays for it:
    it exits within PINFEED_IDLE_EXIT_S plus a second of the script's end, leaving no
    process, memfd or socket, and the registry as it was."""
    name = unique("theirs")
    with Server(tmp_path) as serve, serve.client() as c:  # state tmp_path/state
        c.create_dataset(name, "synthetic", synthetic(64))
        c.create_loader(name, dataset=name, batch_size=4, num_workers=2)
    registry = tmp_path / "state" / "registry.sqlite3"
    env = _env(
        tmp_path / "run",  # serve's socket
        PINFEED_STATE_DIR=str(tmp_path / "state"),
        PINFEED_IDLE_EXIT_S=str(IDLE_EXIT_S),
    )
    code = TRAINER + "print('loader', loader.pinfeed_name, flush=True)\n"
    trainer = _run(env, code)
    seen = _watch([trainer], serve.socket)
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err[-3000:]
    mine = out.split()[-1]
    _exits_after_the_script(seen, serve.socket)
    assert _memfd_holders([name, mine]) == []
    rows = _registered(registry)
    assert [(r.name, r.config["num_workers"]) for r in rows] == [(name, 2)]


@pytest.mark.serial  # a wall-clock bound: the exit within a second of its idle limit
@pytest.mark.slow
def test_make_run_then_the_one_line_script(tmp_path: Path) -> None:
    """A new user's first steps from a clean home: ``make run`` (``pinfeed serve --demo``,
    which registers ``demo`` in the default registry), stopped; then the README's
    one-line script, which starts a server on the default socket: the script ends, and
    its server exits."""
    home, runtime = tmp_path / "home", tmp_path / "xdg-runtime"
    home.mkdir()
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PINFEED_", "XDG_"))}
    env |= {"HOME": str(home), "XDG_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(REPO)}
    port = free_port()  # make run's 8321 may be another test's
    with (tmp_path / "serve.log").open("wb") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pinfeed_server", "serve", "--demo"],
            env=env | {"PINFEED_PORT": str(port)},
            cwd=tmp_path,
            stdout=log,
            stderr=log,
        )
    try:
        with Client(f"http://127.0.0.1:{port}") as c:
            loaders = wait_for(lambda: _loaders(c), "make run's demo loader", 60, every=0.1)
        assert [lo["name"] for lo in loaders] == ["demo"]
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
    script = tmp_path / "train.py"
    script.write_text(_example())
    trainer = subprocess.Popen(
        [sys.executable, str(script)],
        env=env | {"PINFEED_IDLE_EXIT_S": str(IDLE_EXIT_S)},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    socket = runtime / "pinfeed" / "pinfeed.sock"
    seen = _watch([trainer], socket)
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err[-3000:]
    assert [line.split()[0] for line in out.splitlines()] == ["0", "1"]
    _exits_after_the_script(seen, socket)
    registry = home / ".local" / "state" / "pinfeed" / "registry.sqlite3"
    assert [r.name for r in _registered(registry)] == ["demo"]


def _loaders(c: Client) -> list[dict[str, Any]] | None:
    try:
        return c.loaders() or None
    except ServerUnavailable:
        return None


def _registered(path: Path) -> list[LoaderRow]:
    """The loaders the registry file ``path`` holds."""
    registry = Registry(path)
    try:
        return registry.loaders()
    finally:
        registry.close()


@pytest.mark.slow
def test_a_scripts_server_says_so_and_when_it_exits(tmp_path: Path) -> None:
    """GET /v1/node and ``pinfeed status`` of the server a script started: started by
    a script, exits PINFEED_IDLE_EXIT_S after its last trainer, and how long is left."""
    port = free_port()
    env = _env(tmp_path, PINFEED_IDLE_EXIT_S="60", PINFEED_PORT=str(port))
    trainer = _run(env)
    _, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err[-3000:]
    (server,) = servers_on(tmp_path / "pinfeed.sock")
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url) as c:
            node = wait_for(lambda: _node(c), "its HTTP control plane", 60, every=0.1)
        life = node["lifetime"]
        assert (life["started_by"], life["idle_exit_s"]) == ("script", 60)
        assert 0 < life["exits_in_s"] <= 60
        env_cli: dict[str, str | None] = {"COLUMNS": "80", "PINFEED_URL": None}
        status = CliRunner().invoke(app, ["status", "--url", url], env=env_cli)
        assert status.exit_code == 0, status.output
        assert "started by a script's pinfeed.DataLoader; no trainer: exits in " in status.output
        assert httpx.get(url + "/v1/loaders").json() == []
    finally:
        pids = _tree(server)
        server.terminate()
        wait_for(lambda: gone(pids), "the server to stop", 30)


def _node(c: Client) -> dict[str, Any] | None:
    try:
        return c.node()
    except ServerUnavailable:
        return None


TAKEN_OVER = textwrap.dedent(
    """
    import sys, time, pathlib, torch, pinfeed
    class Rows(torch.utils.data.Dataset):
        def __len__(self): return 16
        def __getitem__(self, i): return torch.tensor([i])
    loader = pinfeed.DataLoader(Rows(), batch_size=4, num_workers=1)
    assert sum(1 for _ in loader) == 4
    print("first epoch", flush=True)
    go = pathlib.Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.05)
    for _ in range(2):  # new workers each epoch (no persistent_workers)
        assert [b.flatten().tolist() for b in loader][-1] == [12, 13, 14, 15]
    loader.close()
    """
)


@pytest.mark.slow
def test_pinfeed_serve_takes_the_socket_over_from_a_scripts_server(tmp_path: Path) -> None:
    """``pinfeed serve`` started while a script's server runs on the same socket: new
    trainers connect to the service; the script's trainer goes on with its own server
    (new epochs, new workers); that server exits once its trainer is done, and leaves
    the service's socket where it is."""
    env = _env(tmp_path / "run", PINFEED_IDLE_EXIT_S=str(IDLE_EXIT_S))
    go = tmp_path / "go"
    trainer = _run(env, TAKEN_OVER, str(go))
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline() == "first epoch\n", trainer.stderr
        (script_server,) = servers_on(tmp_path / "run" / "pinfeed.sock")
        pids = _tree(script_server)
        with Server(tmp_path) as serve:  # the same socket: tmp_path/run/pinfeed.sock
            go.touch()
            _, err = trainer.communicate(timeout=120)
            assert trainer.returncode == 0, err[-3000:]
            wait_for(lambda: gone(pids), "the script's server to exit", IDLE_EXIT_S + 30)
            assert answers(serve.socket)
            assert "this one takes the path over" in serve.tail()
    finally:
        trainer.kill()
        trainer.wait()
