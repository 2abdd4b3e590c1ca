"""``pinfeed``: serve, bench, and the admin commands (datasets, loaders, status)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from pinfeed_server.cli_admin import console, datasets_app, loaders_app, status

HTTP_MAX_CONCURRENCY = 512

app = typer.Typer(
    help="pinfeed: DataLoader batches served from page-locked shared memory.", no_args_is_help=True
)
app.add_typer(datasets_app, name="datasets")
app.add_typer(loaders_app, name="loaders")
app.command()(status)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address [PINFEED_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [PINFEED_PORT]")] = None,
    socket: Annotated[Path | None, typer.Option(help="data-plane socket [PINFEED_SOCKET]")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="[PINFEED_STATE_DIR]")] = None,
    data_root: Annotated[Path | None, typer.Option(help="[PINFEED_DATA_ROOT]")] = None,
    demo: Annotated[bool, typer.Option(help="register the demo dataset and loader")] = False,
) -> None:
    """Run the service: HTTP control plane and the data-plane socket."""
    from pydantic import ValidationError

    from pinfeed_server.service import Service
    from pinfeed_server.settings import Settings

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "host": host,
            "port": port,
            "socket": socket,
            "state_dir": state_dir,
            "data_root": data_root,
        }.items()
        if v is not None
    }
    if demo:
        overrides["demo"] = True
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"PINFEED_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        console().print(f"[red]refusing to start:[/red] {problems}")
        raise typer.Exit(2) from None
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings.check_safe()
    except ValueError as exc:
        console().print(f"[red]refusing to start:[/red] {exc}")
        raise typer.Exit(2) from None
    # The data plane first: a trainer that started this server (pinfeed.DataLoader's
    # autostart) waits for the socket alone, not for the HTTP stack's imports too.
    service = Service(settings)
    # A SIGTERM (PINFEED_IDLE_EXIT_S's too) or SIGINT from now on stops the service and
    # exits 0. The handler only records it: an exception raised from a signal handler
    # lands wherever the main thread is, and inside an import's lock callback Python
    # ignores it ("Exception ignored in ... _get_module_lock"): the stop was lost.
    stopping = threading.Event()
    http: list[Any] = []  # uvicorn's server, once made

    def stop(*_: object) -> None:
        stopping.set()
        for server in http:
            server.should_exit = True  # uvicorn drains, then its lifespan closes the service

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        service.start()
        import uvicorn

        from pinfeed_server.main import create_app

        app = create_app(settings, service)  # its lifespan stops the service
    except BaseException:
        service.close()
        raise
    if stopping.is_set():  # stopped while it started: the HTTP stack never serves
        service.close()
        _exit_stopped()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            timeout_graceful_shutdown=8,
            # A backstop behind PINFEED_HTTP_MAX_RPS: past this many connections and
            # requests in flight uvicorn answers 503 at once instead of queueing more.
            limit_concurrency=HTTP_MAX_CONCURRENCY,
        )
    )
    http.append(server)
    if stopping.is_set():  # a signal between the check above and the line before
        server.should_exit = True
    # uvicorn takes SIGTERM/SIGINT over while it serves, drains on them, then raises the
    # signal again under the handler it found (stop: nothing more to do), so a graceful
    # stop exits 0, as supervisors expect.
    server.run()
    _exit_stopped()


def _exit_stopped() -> NoReturn:
    """Exit 0 once the service has stopped (its lifespan closed every loader, worker,
    socket and file): what Python's exit does (non-daemon threads joined, atexit
    handlers run, stdio flushed), without tearing down the interpreter's modules, which
    with torch loaded takes 0.6-0.9 s of a stop that is otherwise 0.25 s."""
    current = threading.current_thread()
    for t in threading.enumerate():
        if t is not current and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],
    },
)
def bench(ctx: typer.Context) -> None:
    """Benchmarks against torch DataLoader, from a source checkout (--help: its options);
    ``bench control``: a trainer's throughput under HTTP load on the same server."""
    import importlib

    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "bench" / "suite.py").is_file():
        console().print(
            "[red]error:[/red] the benchmarks live in bench/ of a source checkout; "
            "run `python -m bench` there"
        )
        raise typer.Exit(2)
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    args = list(ctx.args)
    if args[:1] == ["control"]:  # the control plane against the data plane (issue 19)
        control = importlib.import_module("bench.control")
        raise typer.Exit(control.main(args[1:]))
    suite = importlib.import_module("bench.suite")
    raise typer.Exit(suite.main(args))


def main() -> None:
    app()
