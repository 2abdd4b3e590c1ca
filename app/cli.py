"""``pinfeed``: serve, and the admin commands (datasets, loaders, status)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="pinfeed: DataLoader batches served from page-locked shared memory.",
                  no_args_is_help=True)
datasets_app = typer.Typer(help="Register and inspect datasets.", no_args_is_help=True)
loaders_app = typer.Typer(help="Create, inspect and delete loaders.", no_args_is_help=True)
app.add_typer(datasets_app, name="datasets")
app.add_typer(loaders_app, name="loaders")
console = Console()

UrlOpt = Annotated[str | None, typer.Option("--url", envvar="PINFEED_URL", help="server URL")]


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
    import uvicorn

    from app.main import create_app
    from app.settings import Settings

    overrides: dict[str, Any] = {
        k: v for k, v in {"host": host, "port": port, "socket": socket, "state_dir": state_dir,
                          "data_root": data_root}.items() if v is not None
    }
    if demo:
        overrides["demo"] = True
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings.check_safe()
    except ValueError as exc:
        console.print(f"[red]refusing to start:[/red] {exc}")
        raise typer.Exit(2) from None
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=8)


def _client(url: str | None) -> Any:
    from client import Client

    return Client(url)


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(1) from None


@datasets_app.command("ls")
def datasets_ls(url: UrlOpt = None) -> None:
    """List datasets."""
    from client import PinfeedError

    try:
        rows = _client(url).datasets()
    except PinfeedError as exc:
        _fail(exc)
    table = Table("name", "kind", "length", "sample")
    for r in rows:
        table.add_row(r["name"], r["kind"], str(r.get("length")), json.dumps(r.get("sample")))
    console.print(table)


@datasets_app.command("add")
def datasets_add(
    name: str,
    kind: str,
    params: Annotated[str, typer.Option(help="kind params as JSON")] = "{}",
    url: UrlOpt = None,
) -> None:
    """Register a dataset: pinfeed datasets add NAME KIND --params '{...}'."""
    from client import PinfeedError

    try:
        _client(url).create_dataset(name, kind, json.loads(params))
    except (PinfeedError, ValueError) as exc:
        _fail(exc)
    console.print(f"dataset {name} added")


@datasets_app.command("rm")
def datasets_rm(name: str, url: UrlOpt = None) -> None:
    """Delete a dataset (refused while a loader uses it)."""
    from client import PinfeedError

    try:
        _client(url).delete_dataset(name)
    except PinfeedError as exc:
        _fail(exc)
    console.print(f"dataset {name} deleted")


@loaders_app.command("ls")
def loaders_ls(url: UrlOpt = None) -> None:
    """List loaders."""
    status(url)


@loaders_app.command("add")
def loaders_add(
    name: str,
    dataset: str,
    batch_size: int = 1,
    shuffle: bool = False,
    seed: int | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int = 2,
    url: UrlOpt = None,
) -> None:
    """Create a loader over DATASET (DataLoader's arguments and defaults)."""
    from client import PinfeedError

    try:
        _client(url).create_loader(
            name, dataset=dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
            drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
        )
    except PinfeedError as exc:
        _fail(exc)
    console.print(f"loader {name} created")


@loaders_app.command("rm")
def loaders_rm(name: str, url: UrlOpt = None) -> None:
    """Delete a loader and free its ring."""
    from client import PinfeedError

    try:
        _client(url).delete_loader(name)
    except PinfeedError as exc:
        _fail(exc)
    console.print(f"loader {name} deleted")


@loaders_app.command("show")
def loaders_show(name: str, url: UrlOpt = None) -> None:
    """A loader's config, live status and stats as JSON."""
    from client import PinfeedError

    try:
        c = _client(url)
        console.print_json(json.dumps({"loader": c.loader(name), "stats": c.loader_stats(name)}))
    except PinfeedError as exc:
        _fail(exc)


@app.command()
def status(url: UrlOpt = None) -> None:
    """A table of loaders: state, queue fill, throughput, consumer wait share."""
    from client import PinfeedError

    try:
        c = _client(url)
        rows = [(lo, c.loader_stats(lo["name"])) for lo in c.loaders()]
    except PinfeedError as exc:
        _fail(exc)
    table = Table("loader", "dataset", "state", "ready/slots", "epoch.pos", "samples/s",
                  "MB/s", "wait share", "consumer")
    for lo, st in rows:
        table.add_row(
            lo["name"], lo["dataset"], lo["state"],
            f"{lo['slots']['ready']}/{lo['slots']['total']}",
            f"{lo['epoch']}.{lo['position']}/{lo['batches_per_epoch']}",
            f"{st['samples_per_s']:.0f}", f"{st['bytes_per_s'] / 1e6:.1f}",
            f"{st['consumer_wait_share']:.0%}",
            "attached" if lo["consumer_attached"] else "-",
        )
    console.print(table)


def main() -> None:
    app()
