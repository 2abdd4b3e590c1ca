"""PyTorch's own DataLoader tests, run with ``DataLoader`` replaced by ``pinfeed.DataLoader``:
every test of torch's ``test/test_dataloader.py`` that passes with torch's DataLoader on
this machine passes with pinfeed's, but those in ``EXCLUDED`` (each with its reason).

The file is PyTorch's (BSD-licensed, not shipped in its wheel), so it is not in this
repository: it is read from ``PINFEED_TORCH_TEST_DATALOADER``, else from the git-ignored
``.cache/torch/test_dataloader.py``; without it the test skips, saying where to get the
file of the torch installed here (the Makefile's ``TORCH_SPEC``).

It runs twice, each a pytest process of its own with a neutral configuration (not this
repository's: torch's tests are not written for ``filterwarnings = error``), each test
under ``pytest-timeout``: once as it is (torch's DataLoader: the baseline on this
machine), once with ``tests/torch_suite/site`` first on ``PYTHONPATH``, whose
``sitecustomize`` replaces the class in every process of that run. That run's trainers
start their server as a user's do (``pinfeed._autostart``), on a socket and state folder
of its own: a server that a test's dataset takes down (a segfault in a sample read) is
started again by the next test's loader, so one test cannot fail the rest; the servers
left are stopped at the end. The two runs' outcomes (JUnit XML) are compared test by
test, and the counts go to ``docs/results/torch-suite.json`` (or the folder
``PINFEED_TORCH_SUITE_RESULT``), written before the comparison is asserted.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import results
from tests.launcher import REPO
from tests.reliability.procs import servers_on

# Two pytest processes, one after another; neither may take more than RUN_TIMEOUT_S,
# and no test in them more than TEST_TIMEOUT_S (the suite's own waits are up to 60 s,
# JOIN_TIMEOUT; its slowest test starts 15 loaders of spawned workers, over 150 s on
# this 2-core machine under load). The torch run took 22 minutes under a load of 9-17.
TEST_TIMEOUT_S = 300
RUN_TIMEOUT_S = 2400
# Heavy: two runs of a suite that starts hundreds of worker processes. Serial: its
# timeouts (a 1 s DataLoader timeout against a 3 s sleep, 5 s in TestIndividualWorker-
# Queue) are the suite's own, set for a machine that is not running other tests.
pytestmark = [pytest.mark.heavy, pytest.mark.serial, pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)]

SITE = Path(__file__).resolve().parent / "site"
DEFAULT_FILE = REPO / ".cache" / "torch" / "test_dataloader.py"
RESULT = "torch-suite"
# The copies of the file this harness was run against, by git blob id (``git hash-object``).
KNOWN_FILES = {
    "cd8600a573f42ea179e59f8c165c80edcedef2c0": (
        "pytorch/pytorch 74436f9025609987bbc69c617564f98635b67807, older than v2.13.0 (no "
        "in_order tests; with torch 2.13.0 its test_get_worker_info fails, WorkerInfo being "
        "a frozen dataclass, and test_multiprocessing_iterdatapipe_with_dill passes where "
        "it expects a failure)"
    ),
}

# Tests that cannot pass with pinfeed.DataLoader by design, each with why. A test here
# that passes with torch and fails with pinfeed is not a failure of this harness; every
# other one is.
_TRAINERS_WORKERS = (
    "its subject is DataLoader's worker processes in the trainer (the iterator's private "
    "_workers, joined and checked to have exited): pinfeed's trainer has none, its workers "
    "are the server's"
)
_ENDS_ON_TRAINERS_WORKERS = (
    "its last part joins the iterator's private _workers (DataLoader's worker processes in "
    "the trainer) and checks they exited: pinfeed's trainer has none, its workers are the "
    "server's; the parts before it (unbatched and batched iterables at 0 and 3 workers, "
    "prefetch_factor 2-4, the length warnings) pass, the parts after it are not reached"
)
_ENDS_ON_SHUTDOWN_WORKERS = (
    "after its last assertion it calls the iterator's private _shutdown_workers() (torch's "
    "multiprocessing iterator's, which stops its worker processes in the trainer): "
    "pinfeed's trainer has none, its workers are the server's; without that call (and "
    "with _iterator reset as it does) the whole test passes on pinfeed.DataLoader: the "
    "same order per seed, another per other seed, at 0-2 workers, persistent or not "
    "(tests/dataloader/test_parity.py's test_a_datapipe_reshuffled_each_epoch holds it)"
)
EXCLUDED: dict[str, str] = {
    "TestDataLoader::test_partial_workers": _TRAINERS_WORKERS,
    "TestDataLoaderPersistentWorkers::test_partial_workers": _TRAINERS_WORKERS,
    "TestDataLoader::test_iterable_style_dataset": _ENDS_ON_TRAINERS_WORKERS,
    "TestDataLoaderPersistentWorkers::test_iterable_style_dataset": _ENDS_ON_TRAINERS_WORKERS,
    "IntegrationTestDataLoaderDataPipe::test_shuffler_iterdatapipe": _ENDS_ON_SHUTDOWN_WORKERS,
}


def _torch_tag() -> str:
    return "v" + torch.__version__.split("+")[0]


def _test_file() -> Path:
    path = Path(os.environ.get("PINFEED_TORCH_TEST_DATALOADER") or DEFAULT_FILE)
    if not path.is_file():
        url = (
            f"https://raw.githubusercontent.com/pytorch/pytorch/{_torch_tag()}/test/"
            "test_dataloader.py"
        )
        pytest.skip(
            f"PyTorch's test_dataloader.py is not at {path}: get the one of the torch "
            f"installed here ({torch.__version__}) with `mkdir -p {DEFAULT_FILE.parent} && "
            f"curl -fsSL {url} -o {DEFAULT_FILE}`, or name a copy in "
            "PINFEED_TORCH_TEST_DATALOADER"
        )
    return path


@dataclass(frozen=True)
class Outcome:
    kind: str  # passed, failed, skipped, xfailed
    message: str = ""


# What counts as passing: an expected failure (unittest.expectedFailure) that failed.
OK = ("passed", "xfailed")


def outcomes(junit: Path) -> dict[str, Outcome]:
    """Each test's outcome in a pytest JUnit XML report, by ``Class::test``."""
    found: dict[str, Outcome] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{(case.get('classname') or '').rsplit('.', 1)[-1]}::{case.get('name')}"
        children = {child.tag: child for child in case}
        bad = children.get("failure", children.get("error"))
        if bad is not None:
            found[name] = Outcome("failed", bad.get("message") or "")
        elif "skipped" in children:
            skip = children["skipped"]
            kind = "xfailed" if skip.get("type") == "pytest.xfail" else "skipped"
            found[name] = Outcome(kind, skip.get("message") or "")
        else:
            found[name] = Outcome("passed")
    return found


def _counts(found: dict[str, Outcome]) -> dict[str, int]:
    kinds = [o.kind for o in found.values()]
    return {kind: kinds.count(kind) for kind in ("passed", "failed", "skipped", "xfailed")}


def _environment(**extra: str) -> dict[str, str]:
    """This environment without what would change the suite's behaviour between here and
    CI (``CI`` makes torch's test utilities strict, ``PYTORCH_*`` select tests) or point
    pinfeed elsewhere (``PINFEED_*``)."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CI", "PYTHONPATH") and not k.startswith(("PINFEED_", "PYTORCH_"))
    }
    return keep | extra


def _run(test_file: Path, out: Path, label: str, env: dict[str, str]) -> tuple[Path, float]:
    """One pytest run of ``test_file``: its JUnit XML and wall time. Its own neutral
    configuration file; nothing cached beside the test file."""
    ini = out / f"{label}.ini"
    ini.write_text(f"[pytest]\ntimeout = {TEST_TIMEOUT_S}\n")
    junit, log = out / f"{label}.xml", out / f"{label}.log"
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(test_file),
        "-c",
        str(ini),
        "--rootdir",
        str(test_file.parent),
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-q",
    ]
    t0 = time.monotonic()
    with log.open("wb") as sink:
        # A session of its own: what its tests start (spawned processes, DataLoader
        # workers) goes with it if it has to be stopped. Failing tests are the data.
        proc = subprocess.Popen(
            command,
            env=env,
            cwd=test_file.parent,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.monotonic() - t0
    assert junit.is_file(), f"the {label} run wrote no report; its log:\n{log.read_text()[-3000:]}"
    return junit, wall


def _file_id(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return {
        "path": str(path),
        "sha256": hashlib.sha256(data).hexdigest(),
        "git_blob": blob,
        "source": KNOWN_FILES.get(blob, "unknown: compare git_blob with the file at the tag"),
        "expected_tag": _torch_tag(),
    }


def _first_line(message: str, width: int = 240) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def test_torchs_dataloader_tests_pass_with_pinfeed(tmp_path: Path) -> None:
    test_file = _test_file()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = list(os.getloadavg())
    t0 = time.monotonic()

    junit, torch_wall = _run(test_file, tmp_path, "torch", _environment())
    base = outcomes(junit)
    run = tmp_path / "run"
    socket = run / "pinfeed.sock"
    env = _environment(
        PYTHONPATH=str(SITE),
        PINFEED_TORCH_SUITE="pinfeed",
        PINFEED_SOCKET=str(socket),
        PINFEED_STATE_DIR=str(run / "state"),
        # The suite's loaders have up to 6 workers, several alive at once (the default
        # cap is 4 a core); the server is not to exit between two tests.
        PINFEED_MAX_WORKERS="1024",
        PINFEED_IDLE_EXIT_S="60",
    )
    try:
        junit, pinfeed_wall = _run(test_file, tmp_path, "pinfeed", env)
    finally:
        for server in servers_on(socket):
            server.terminate()
            server.wait(20)
    swapped = outcomes(junit)
    log = run / "autostart.log"
    servers_started = log.read_text(errors="replace").count("data plane on ") if log.exists() else 0

    base_ok = {name for name, o in base.items() if o.kind in OK}
    swapped_ok = {name for name, o in swapped.items() if o.kind in OK}
    lost = base_ok - swapped_ok
    regressions = sorted(lost - EXCLUDED.keys())
    excluded = sorted(EXCLUDED.keys() & base.keys())  # those this file has
    result = {
        "schema": results.SCHEMA,
        "name": RESULT,
        "command": "pytest tests/torch_suite (make test-heavy)",
        "commit": results.commit(),
        "machine": results.machine(),
        "software": results.software(),
        "started": started,
        "load": {"before": load_before, "after": list(os.getloadavg())},
        "wall_s": round(time.monotonic() - t0, 1),
        "test_file": _file_id(test_file),
        "method": (
            "torch's test_dataloader.py run twice by pytest (each test under pytest-timeout "
            f"{TEST_TIMEOUT_S} s): as it is, and with torch.utils.data.DataLoader and "
            "torch.utils.data.dataloader.DataLoader replaced by pinfeed.DataLoader in every "
            "process of the run (tests/torch_suite/site/sitecustomize.py), whose trainers "
            "start their pinfeed server (again, when a test's dataset took it down). A "
            "test that passes with torch and not with pinfeed is a regression unless "
            "excluded (tests/torch_suite, EXCLUDED)."
        ),
        "torch": {**_counts(base), "wall_s": round(torch_wall, 1)},
        "pinfeed": {
            **_counts(swapped),
            "wall_s": round(pinfeed_wall, 1),
            "servers_started": servers_started,
        },
        "excluded": {
            "count": len(excluded),
            "tests": {name: EXCLUDED[name] for name in excluded},
        },
        "regressions": {name: _first_line(swapped[name].message) for name in regressions},
        "passing_only_with_pinfeed": sorted(swapped_ok - base_ok),
    }
    written = results.write(result, _result_folder())
    assert not regressions, (
        f"{len(regressions)} of torch's {len(base_ok)} passing DataLoader tests fail with "
        f"pinfeed.DataLoader (see {written}):\n"
        + "\n".join(f"  {n}: {result['regressions'][n]}" for n in regressions)
    )


def _result_folder() -> Path | None:
    named = os.environ.get("PINFEED_TORCH_SUITE_RESULT")
    return Path(named) if named else None
