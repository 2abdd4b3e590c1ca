"""``pinfeed datasets|loaders|status`` against a real server (typer's CliRunner)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from pinfeed._autostart import answers
from pinfeed_server.cli import app
from tests.conftest import Server, free_port
from tests.helpers import unique
from tests.reliability.procs import descendants, gone, wait_for

SYNTHETIC = json.dumps({"length": 24, "fields": [{"shape": [4]}, {"shape": [], "dtype": "int64"}]})


def run(server: Server | str, *args: str) -> Result:
    url = server if isinstance(server, str) else server.url
    # Wide columns so rich does not truncate names in tables: each command's console
    # reads COLUMNS when it prints.
    env: dict[str, str | None] = {"COLUMNS": "250", "PINFEED_TOKEN": None, "PINFEED_URL": None}
    return CliRunner().invoke(app, [*args, "--url", url], env=env)


def ok(server: Server, *args: str) -> str:
    result = run(server, *args)
    assert result.exit_code == 0, result.output
    return result.output


def test_datasets_add_ls_rm(server: Server) -> None:
    name = unique("cli-ds")
    assert "24 samples" in ok(server, "datasets", "add", name, "synthetic", "--params", SYNTHETIC)
    table = ok(server, "datasets", "ls")
    assert name in table and "synthetic" in table and "float32" in table
    [row] = [d for d in json.loads(ok(server, "datasets", "ls", "--json")) if d["name"] == name]
    assert row["length"] == 24
    assert "deleted" in ok(server, "datasets", "rm", name)
    assert name not in ok(server, "datasets", "ls")


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("datasets", "add", "x", "synthetic", "--params", "{nope"), 2, "not JSON"),
        (("datasets", "add", "x", "zarr"), 1, "kind"),
        (("datasets", "rm", "no-such-dataset"), 1, "no dataset"),
        (("loaders", "rm", "no-such-loader"), 1, "no loader"),
        (("loaders", "show", "no-such-loader"), 1, "no loader"),
        (("loaders", "add", "x", "no-such-dataset"), 1, "no dataset"),
        (("loaders", "add", "x", "y", "-o", "novalue"), 2, "KEY=VALUE"),
    ],
)
def test_errors_are_one_line_and_exit_nonzero(
    server: Server, args: tuple[str, ...], code: int, needle: str
) -> None:
    result = run(server, *args)
    assert result.exit_code == code, result.output
    assert needle in result.output and "Traceback" not in result.output


def test_loaders_add_ls_show_set_rm_and_status(server: Server) -> None:
    ds, name = unique("cli-lds"), unique("cli-lo")
    ok(server, "datasets", "add", ds, "synthetic", "--params", SYNTHETIC)
    out = ok(
        server,
        "loaders",
        "add",
        name,
        ds,
        "--batch-size",
        "4",
        "--shuffle",
        "--seed",
        "5",
        "--num-workers",
        "2",
        "-o",
        "drop_last=true",
    )
    assert f"loader {name} created" in out
    table = ok(server, "loaders", "ls")
    assert name in table and ds in table
    [lo] = [x for x in json.loads(ok(server, "loaders", "ls", "--json")) if x["name"] == name]
    assert (lo["batch_size"], lo["shuffle"], lo["seed"], lo["drop_last"]) == (4, True, 5, True)
    shown = json.loads(ok(server, "loaders", "show", name))
    assert shown["loader"]["name"] == name and shown["stats"]["batches_consumed"] == 0

    assert "num_workers=1" in ok(server, "loaders", "set", name, "--num-workers", "1")
    assert json.loads(ok(server, "loaders", "show", name))["loader"]["num_workers"] == 1

    status = ok(server, "status")
    assert name in status and "wait p99" in status and "node:" in status
    shown = json.loads(ok(server, "status", "--json"))
    [row] = [r for r in shown["loaders"] if r["loader"]["name"] == name]
    assert "consumer_wait_share" in row["stats"]
    assert shown["node"]["max_workers"] >= 1

    assert "deleted" in ok(server, "loaders", "rm", name)
    assert name not in ok(server, "loaders", "ls")
    ok(server, "datasets", "rm", ds)


def test_status_fits_80_columns(server: Server) -> None:
    """Every header whole, no line over 80 (rich used to cut each header to "loa…")."""
    ds, name = unique("cli-ds"), unique("a-longer-loader-name")
    ok(server, "datasets", "add", ds, "synthetic", "--params", SYNTHETIC)
    ok(server, "loaders", "add", name, ds, "--batch-size", "4")
    env: dict[str, str | None] = {"COLUMNS": "80", "PINFEED_TOKEN": None, "PINFEED_URL": None}
    result = CliRunner().invoke(app, ["status", "--url", server.url], env=env)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), result.output
    [head] = [line for line in lines if line.lstrip().startswith("loader")]
    for word in ("loader", "state", "ready", "epoch.pos", "samples/s", "wait", "wait p99"):
        assert word in head, head
    for word in ("trainers", "workers", "prio"):
        assert word in head, head
    assert "…" not in head
    ok(server, "loaders", "rm", name)
    ok(server, "datasets", "rm", ds)


def test_status_says_how_the_server_was_started(server: Server) -> None:
    """``pinfeed serve`` without PINFEED_IDLE_EXIT_S (a script's server: the autostart
    tests)."""
    assert "started by `pinfeed serve`; runs until stopped\n" in ok(server, "status")
    with server.client() as c:
        assert c.node()["lifetime"] == {
            "started_by": "serve",
            "idle_exit_s": None,
            "exits_in_s": None,
        }


def test_unreachable_server_exits_1() -> None:
    result = run(f"http://127.0.0.1:{free_port()}", "status")
    assert result.exit_code == 1
    assert "cannot reach the pinfeed server" in result.output


def test_status_names_a_pinfeed_dataloaders_owner(server: Server) -> None:
    import os

    import pinfeed
    from tests.dataloader.test_parity import Squares

    loader = pinfeed.DataLoader(Squares(), batch_size=5, socket=server.socket)
    try:
        status = ok(server, "status")
        (line,) = [row for row in status.splitlines() if loader.pinfeed_name in row]
        assert f"pid {os.getpid()}" in line
    finally:
        loader.close()


@pytest.mark.parametrize("after_s", [0.0, 0.1, 0.25, 0.5])
def test_serve_opens_its_data_plane_first_and_a_sigterm_then_stops_it(
    tmp_path: Path, after_s: float
) -> None:
    """``pinfeed serve`` opens its data-plane socket before it imports the HTTP stack (a
    trainer that started it waits for the socket alone); a SIGTERM from that moment on,
    as PINFEED_IDLE_EXIT_S's, stops it: exit 0, no process and no socket left. Sent at
    several moments of the HTTP stack's imports and start (``after_s`` after the socket
    answers): an exception raised from the handler was once lost inside an import."""
    sock = tmp_path / "s.sock"
    env = dict(
        os.environ,
        PINFEED_SOCKET=str(sock),
        PINFEED_PORT=str(free_port()),
        PINFEED_STATE_DIR=str(tmp_path / "state"),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pinfeed_server", "serve"], env=env, cwd=tmp_path
    )
    try:
        wait_for(lambda: answers(sock), "the data plane to answer", 60, every=0.01)
        time.sleep(after_s)  # a moment of the start to stop it at, not a wait for one
        pids = [proc.pid, *(p.pid for p in descendants(proc.pid))]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: gone(pids), "the server's processes to exit", 10)
    assert not sock.exists()
