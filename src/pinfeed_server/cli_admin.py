"""The admin commands of ``pinfeed``: datasets, loaders and status, over HTTP.

Each command is one ``client.Client`` call; a problem from the server is printed as
one line and exits 1. ``--json`` prints what the API returned, for scripts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from pinfeed import Client
    from pinfeed_server.schemas import NodeLifetime


def console() -> Console:
    """A console for one command's output, made when it prints: ``pinfeed serve`` never
    imports rich (~0.1 s of an autostarted server's start), and each command reads the
    terminal's width (``COLUMNS``) as it is then, not as it was at some earlier call."""
    from rich.console import Console

    return Console()


datasets_app = typer.Typer(help="Register and inspect datasets.", no_args_is_help=True)
loaders_app = typer.Typer(help="Create, inspect, tune and delete loaders.", no_args_is_help=True)

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", envvar="PINFEED_URL", help="server URL [default: http://127.0.0.1:8321]"),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="PINFEED_TOKEN", help="bearer token", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON")]


@contextmanager
def _client(url: str | None, token: str | None) -> Iterator[Client]:
    from pinfeed import Client, PinfeedError

    try:
        with Client(url, token=token) as c:
            yield c
    except PinfeedError as exc:
        console().print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


def _json(data: Any) -> None:
    # print_json would re-indent and colour; scripts want the plain document.
    typer.echo(json.dumps(data, indent=2))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


@datasets_app.command("ls")
def datasets_ls(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List datasets: kind, length, one sample's structure, its cache's fill."""
    with _client(url, token) as c:
        rows = c.datasets()
    if as_json:
        return _json(rows)
    from rich.table import Table

    table = Table("name", "kind", "length", "sample", "cache", "error")
    for r in rows:
        table.add_row(
            r["name"],
            r["kind"],
            str(r["length"]),
            json.dumps(r["sample"]),
            _cache(r.get("cache"), r["length"]),
            r["error"] or "",
        )
    console().print(table)


def _cache(stats: dict[str, Any] | None, length: int | None) -> str:
    """A cache's fill: samples and memory stored, hit ratio, persisted."""
    if stats is None:
        return ""
    ratio = stats["hit_ratio"]
    parts = [
        f"{stats['samples']}/{length if length is not None else '?'} samples",
        f"{_mb(stats['bytes'])}/{_mb(stats['max_bytes'])} MB",
        "hits " + ("-" if ratio is None else f"{100 * ratio:.0f}%"),
    ]
    if stats["persisted"]:
        parts.append("persisted")
    if stats["rebuilt"]:
        parts.append(f"rebuilt {stats['rebuilt']}x ({stats['rebuilt_reason']})")
    return ", ".join(parts)


@datasets_app.command("add")
def datasets_add(
    name: str,
    kind: Annotated[str, typer.Argument(help="synthetic, tensors, npy, python, ...")],
    params: Annotated[str, typer.Option(help="the kind's params as JSON")] = "{}",
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Register a dataset: pinfeed datasets add NAME KIND --params '{...}'."""
    try:
        parsed = json.loads(params)
    except ValueError as exc:
        console().print(f"[red]error:[/red] --params is not JSON: {exc}")
        raise typer.Exit(2) from None
    with _client(url, token) as c:
        ds = c.create_dataset(name, kind, parsed)
    console().print(f"dataset {name} added: {ds['length']} samples")


@datasets_app.command("rm")
def datasets_rm(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete a dataset (refused while a loader uses it)."""
    with _client(url, token) as c:
        c.delete_dataset(name)
    console().print(f"dataset {name} deleted")


@loaders_app.command("ls")
def loaders_ls(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List loaders: config, state, ring size."""
    with _client(url, token) as c:
        rows = c.loaders()
    if as_json:
        return _json(rows)
    from rich.table import Table

    table = Table(
        "name",
        "dataset",
        "state",
        "batch",
        "shuffle",
        "seed",
        "workers",
        "prefetch",
        "ring MB",
        "page-locked",
    )
    for lo in rows:
        table.add_row(
            lo["name"],
            lo["dataset"],
            lo["state"],
            str(lo["batch_size"]),
            str(lo["shuffle"]),
            str(lo["seed"]),
            str(lo["num_workers"]),
            str(lo["prefetch_factor"]),
            _mb(lo["ring_bytes"]),
            str(lo["page_locked"]),
        )
    console().print(table)


def _option(pair: str) -> tuple[str, Any]:
    key, sep, value = pair.partition("=")
    if not sep:
        raise typer.BadParameter(f"{pair!r} is not KEY=VALUE")
    try:
        return key.replace("-", "_"), json.loads(value)
    except ValueError:
        return key.replace("-", "_"), value  # a bare string


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
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="any other LoaderCreate field, KEY=VALUE (JSON)"),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Create a loader over DATASET (DataLoader's arguments and defaults)."""
    config: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": shuffle,
        "seed": seed,
        "drop_last": drop_last,
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "prefetch_factor": prefetch_factor,
    }
    config.update(_option(o) for o in option or [])  # -o wins over the flags
    with _client(url, token) as c:
        lo = c.create_loader(name, dataset=dataset, **config)
    console().print(f"loader {name} created: {lo['state']}, ring {_mb(lo['ring_bytes'])} MB")


@loaders_app.command("set")
def loaders_set(
    name: str,
    num_workers: Annotated[int | None, typer.Option()] = None,
    prefetch_factor: Annotated[int | None, typer.Option()] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Change num_workers or prefetch_factor live (position and batches are kept)."""
    changes = {
        k: v
        for k, v in {"num_workers": num_workers, "prefetch_factor": prefetch_factor}.items()
        if v is not None
    }
    with _client(url, token) as c:
        lo = c.patch_loader(name, **changes)
    console().print(
        f"loader {name}: num_workers={lo['num_workers']} prefetch_factor={lo['prefetch_factor']}"
    )


@loaders_app.command("rm")
def loaders_rm(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete a loader and free its ring."""
    with _client(url, token) as c:
        c.delete_loader(name)
    console().print(f"loader {name} deleted")


@loaders_app.command("show")
def loaders_show(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """A loader's config, live status and stats as JSON."""
    with _client(url, token) as c:
        _json({"loader": c.loader(name), "stats": c.loader_stats(name)})


def _remote(remote: dict[str, Any] | None) -> list[str]:
    """The object store's counts (GET /v1/node's ``remote``): the node's requests,
    bytes, retries and stall, its object cache, and each loader's reads."""
    if remote is None:
        return []
    st, cache = remote["store"], remote["cache"]

    def ratio(c: dict[str, Any]) -> str:
        seen = c["hits"] + c["misses"]
        return f"{c['hits'] / seen:.0%}" if seen else "-"

    lines = [
        f"store: {st['requests']:.0f} requests, {_mb(st['bytes'])} MB, {st['retries']:.0f} "
        f"retries ({st['throttled']:.0f} throttled), {st['errors']:.0f} errors; waited "
        f"{st['wait_s']:.1f} s",
        f"object cache: {_mb(cache['held_bytes'])}/{_mb(cache['max_bytes'])} MB, "
        f"{cache['entries']} units ({cache['pinned']} pinned), hits {ratio(st)}, "
        f"{cache['evictions']} evicted ({cache['eviction']}; "
        f"{cache.get('wasted', 0)} fetched ahead, unread)",
    ]
    for name, c in sorted(remote["loaders"].items()):
        lines.append(
            f"  {name}: hits {ratio(c)} of {c['hits'] + c['misses']:.0f}, "
            f"{c['prefetched']:.0f} ahead, waited {c['wait_s']:.1f} s for the store"
        )
    return lines


def _ms(seconds: float | None) -> str:
    """A wait from the histogram's buckets (interpolated), in milliseconds."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def status(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The node and its loaders: state, queue fill, samples/s, the trainers' wait share
    and p99, workers; the object store's counts where a dataset reads one; then the node
    arbiter's last decisions. Fits 80 columns."""
    # The same types the server renders: the JSON parsed back, read by attribute.
    from pinfeed_server.engine.stats import StatsSnapshot
    from pinfeed_server.engine.status import LoaderStatus
    from pinfeed_server.schemas import NodePublic

    with _client(url, token) as c:
        rows = [(lo, c.loader_stats(lo["name"])) for lo in c.loaders()]
        node = NodePublic.model_validate(c.node())
    if as_json:
        return _json(
            {
                "loaders": [{"loader": lo, "stats": st} for lo, st in rows],
                "node": node.model_dump(mode="json"),
            }
        )
    arb = node.arbiter
    if not arb.enabled:
        mode = "each loader tunes itself (PINFEED_ARBITER=false)"
    elif arb.trial:
        mode = f"arbiter trying a {arb.trial['kind']} for {arb.trial['loader']}"
    elif arb.settled:
        mode = f"arbiter settled (last change at {arb.settled_after_s or 0:.0f} s)"
    else:
        mode = "arbiter measuring"
    stall = "-" if arb.weighted_stall is None else f"{arb.weighted_stall:.2f}"
    console().print(
        f"node: {node.cpus} CPUs, workers {node.workers_used}/{node.max_workers}, "
        f"ring memory {_mb(node.shm_used_bytes)}/{_mb(node.shm_budget_bytes)} MB; "
        f"{mode}; weighted stall {stall}",
        soft_wrap=False,
    )
    console().print(_lifetime(node.lifetime), markup=False)
    for line in _remote(node.remote):
        console().print(line, markup=False, overflow="fold")
    prio = {lo.name: lo for lo in node.loaders}
    # Short, whole headers, no box, the box's one space between columns and no padding:
    # every column readable in 80 columns (rich cuts headers to their column's width, so
    # they are chosen to fit); a long loader name folds instead of squeezing the numbers.
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for head, justify in (
        ("loader", "left"),
        ("state", "left"),
        ("ready", "right"),
        ("epoch.pos", "right"),
        ("samples/s", "right"),
        ("wait", "right"),
        ("wait p99", "right"),
        ("trainers", "right"),
        ("workers", "right"),
        ("prio", "right"),
    ):
        if head == "loader":
            table.add_column(head, overflow="fold", min_width=12, ratio=1)
        else:
            table.add_column(head, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for lo, body in rows:
        live, st = LoaderStatus.model_validate(lo), StatsSnapshot.model_validate(body)
        mine = prio.get(lo["name"])
        workers = f"{lo['num_workers']}x{lo['prefetch_factor']}"
        if mine is not None and not mine.fixed:
            workers += "*"  # the arbiter (or autotune) moves it
        table.add_row(
            lo["name"],
            live.state,
            f"{live.slots.ready}/{live.slots.total}",
            f"{live.epoch}.{live.position}",
            f"{st.samples_per_s:.0f}",
            f"{st.consumer_wait_share:.0%}",
            _ms(st.consumer_wait_p99_s),
            _trainers(lo, mine.trainers if mine else int(live.consumer_attached)),
            workers,
            str(lo.get("priority", 1)),
        )
    console().print(table)
    console().print("workers: processes x prefetch_factor; *: autotuned (moved by the arbiter)")
    if node.decisions:
        console().print("last decisions:")
        for d in node.decisions[-5:]:
            donor = f" from {d.donor}" if d.donor else ""
            line = f"  {d.t:7.1f}s {d.kind} {d.loader}{donor}: {d.reason}"
            console().print(line, overflow="ellipsis", no_wrap=True, crop=True, markup=False)


def _lifetime(life: NodeLifetime) -> str:
    """How the server was started, and when it exits by itself."""
    by = "`pinfeed serve`" if life.started_by == "serve" else "a script's pinfeed.DataLoader"
    if life.idle_exit_s is None:
        return f"started by {by}; runs until stopped"
    if life.exits_in_s is None:  # a trainer is connected
        return f"started by {by}; exits {life.idle_exit_s:g} s after its last trainer"
    return f"started by {by}; no trainer: exits in {life.exits_in_s:.0f} s"


def _trainers(loader: dict[str, Any], count: int) -> str:
    """Who reads the loader: a pinfeed.DataLoader's owner pid, or how many trainers."""
    owner = loader.get("owner")
    if owner:
        return f"pid {owner['pid']}" + ("" if owner["attached"] else " gone")
    return str(count)
