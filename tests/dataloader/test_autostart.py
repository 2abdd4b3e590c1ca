"""The embedded default: where no server answers, ``pinfeed.DataLoader`` starts one for
this user from the trainer's Python, which exits by itself once idle; two trainers
starting at once start one server; ``PINFEED_AUTOSTART=0`` turns it off with an error
naming ``pinfeed serve``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from pinfeed import ServerUnavailable
from pinfeed._autostart import answers
from tests.launcher import REPO
from tests.reliability.procs import servers_on, wait_for

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


def _run(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_a_server_starts_for_the_trainer_and_exits_when_idle(tmp_path: Path) -> None:
    socket = tmp_path / "pinfeed.sock"
    assert not answers(socket)
    trainer = _run(_env(tmp_path))
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err[-3000:]
    assert (
        out.startswith("first-batch ")
        and out.split(" ", 2)[2].strip() == "[0, 1, 2, 3, 4, 5, 6, 7]"
    )
    (server,) = servers_on(socket)
    assert answers(socket)
    # Idle (no loader, no trainer) for PINFEED_IDLE_EXIT_S: it exits by itself, cleanly.
    wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, "exit", 30)
    assert not answers(socket)


def test_two_trainers_at_once_start_one_server(tmp_path: Path) -> None:
    env = _env(tmp_path, PINFEED_IDLE_EXIT_S="5")
    trainers = [_run(env) for _ in range(2)]
    try:
        for t in trainers:
            _, err = t.communicate(timeout=120)
            assert t.returncode == 0, err[-3000:]
        assert len(servers_on(tmp_path / "pinfeed.sock")) == 1
        log = (tmp_path / "autostart.log").read_text()
        # One server opened a data plane; the trainers may be done before its HTTP stack is up.
        assert log.count("INFO pinfeed: data plane on ") == 1, log[-2000:]
    finally:
        for server in servers_on(tmp_path / "pinfeed.sock"):
            server.terminate()


def test_autostart_off_is_an_error_naming_pinfeed_serve(tmp_path: Path) -> None:
    env = _env(tmp_path, PINFEED_AUTOSTART="0")
    trainer = _run(env)
    _, err = trainer.communicate(timeout=120)
    assert trainer.returncode != 0
    assert "ServerUnavailable" in err and "start one with `pinfeed serve`" in err
    assert not servers_on(tmp_path / "pinfeed.sock")


def test_autostart_off_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pinfeed

    monkeypatch.setenv("PINFEED_AUTOSTART", "0")
    with pytest.raises(ServerUnavailable, match="pinfeed serve"):
        pinfeed.DataLoader(list(range(4)), socket=tmp_path / "none.sock")
