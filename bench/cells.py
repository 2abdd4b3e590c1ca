"""What a table shows of a result file (``bench.results``): its cells formatted (samples/s,
ms, shares, MiB, ranges of runs), verdicts between two systems, and where each
measurement comes from (commit, machine, software, load); ``Results``, one folder's
result files, loaded once.

Verdicts compare medians: pinfeed **wins** when its best is at least ``TIE`` times the
other's best, **loses** when at most ``1 / TIE``, and **ties** between; a verdict whose two
cells' run ranges overlap is marked "(runs overlap)". A cell measured while other
processes took :data:`bench.results.LOADED_SHARE` or more of the machine is marked †.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import data, results

TIE = 1.05  # the tie band: within 5% either way is a tie
MiB = 2**20
SYSTEM_NAMES = {
    "pinfeed": "pinfeed",
    "dataloader": "DataLoader",
    "dataloader-tuned": "tuned DataLoader",
    "dataloader-cached": "DataLoader caching decoded samples",
    "pinfeed-dataloader": "pinfeed.DataLoader",
    "pinfeed-dataloader-tuned": "pinfeed.DataLoader, tuned",
    "pinfeed-python": "pinfeed, named loader on the script's Dataset",
    "pinfeed-dataloader-getitems": "pinfeed.DataLoader, __getitems__",
    "floor": "floor (same messages and views, one process)",
    "floor-ipc": "floor between two processes (same messages, another process answers)",
}
LOADED = "†"
ORDER = (
    "pinfeed",
    "pinfeed-dataloader",
    "pinfeed-dataloader-tuned",
    "pinfeed-python",
    "dataloader",
    "dataloader-tuned",
    "dataloader-cached",
)


# One colour per system, the same in every panel of the figure (matplotlib's tab10, by
# the system's place in ORDER; a system outside ORDER takes the next colour).
PALETTE = ("#1f77b4", "#17becf", "#9467bd", "#8c564b", "#ff7f0e", "#2ca02c", "#bcbd22", "#e377c2")


def color(system: str) -> str:
    return PALETTE[ORDER.index(system) if system in ORDER else len(ORDER)]


# The tuned DataLoader of a workload, the first its result has: one batched read a batch,
# or where a sample is read file by file (W9), a DataLoader keeping its decoded samples.
TUNED = ("dataloader-tuned", "dataloader-cached")


def tuned_system(cells: dict[str, Any]) -> str | None:
    """The system that stands for the tuned DataLoader in a result's ``cells``."""
    return next((s for s in TUNED if s in cells), None)


def ordered(cells: dict[str, Any]) -> list[str]:
    """A result's systems, pinfeed first, then DataLoader, tuned, then any other."""
    return sorted(cells, key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s))


# --- small formatters ------------------------------------------------------------------


def num(x: float | None) -> str:
    """Samples/s and the like: 393k, 31.7k, 595, 4.2."""
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    if x >= 10:
        return f"{x:.0f}"
    return f"{x:.2g}"


def ranged(c: dict[str, Any] | None, f: Callable[[float | None], str] = num) -> str:
    """A cell's median, and its min-max when it has more than one run."""
    if not c or c.get("median") is None:
        return "-"
    if c["n"] > 1 and c["min"] != c["max"]:
        return f"{f(c['median'])} [{f(c['min'])}-{f(c['max'])}]"
    return f(c["median"])


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:,.0f}"


def flag(c: dict[str, Any] | None) -> str:
    return LOADED if c and c.get("under_load") else ""


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def missing(name: str, what: str = "") -> str:
    return (
        f"*Not yet measured: no `docs/results/{name}.json`"
        + (f" ({what})" if what else "")
        + ". Run the command above to make it.*"
    )


def verdict(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """pinfeed's cell ``a`` against ``b`` (each a spread of samples/s)."""
    if not a or not b or not a.get("median") or not b.get("median"):
        return "-"
    r = a["median"] / b["median"]
    word = "wins" if r >= TIE else "loses" if r <= 1 / TIE else "ties"
    text = f"**{word} {r:.2f}x**" if word != "ties" else f"ties {r:.2f}x"
    overlap = a["min"] <= b["max"] and b["min"] <= a["max"] and (a["n"] > 1 or b["n"] > 1)
    if word != "ties" and overlap:
        text += " (runs overlap)"
    return text


# --- where a measurement comes from ------------------------------------------------------


def _origin(res: dict[str, Any]) -> tuple[str, ...]:
    c, m, s = res.get("commit") or {}, res.get("machine") or {}, res.get("software") or {}
    commit = f"`{c.get('short') or '?'}`" + (" (uncommitted changes)" if c.get("dirty") else "")
    cpu = f"{m.get('cpus')} x {m.get('cpu_model')}, {m.get('memory_gib')} GiB"
    sw = f"torch {s.get('torch')}, Python {s.get('python')}" + (
        f", {s['gpu']}" if s.get("gpu") else ", no GPU"
    )
    return commit, cpu, sw


def provenance(files: list[dict[str, Any]]) -> str:
    """One line per distinct (commit, machine, software): what measured which files."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for res in files:
        groups.setdefault(_origin(res), []).append(res)
    lines = []
    for (commit, cpu, sw), rs in groups.items():
        names = ", ".join(f"`{r['name']}.json`" for r in rs)
        loads = [_loads(r.get("load") or {}) for r in rs]
        inter = [r.get("interference") or {} for r in rs]
        runs = sum(i.get("runs") or 0 for i in inter)
        loaded = sum(i.get("runs_under_load") or 0 for i in inter)
        dates = sorted(r.get("started", "")[:10] for r in rs)
        notes = "".join(f" {r['note']}" for r in rs if r.get("note"))
        lines.append(
            f"Measured at commit {commit} on {cpu}; {sw}; {dates[0]}; results {names}; "
            f"load average (1 min) before-after {', '.join(loads)}; "
            f"{loaded} of {runs} runs under load{'' if not loaded else f' ({LOADED})'}.{notes}"
        )
    return "\n".join(lines)


def _loads(load: dict[str, Any]) -> str:
    def first(x: list[float] | None) -> str:
        return "?" if not x else f"{x[0]:.1f}"

    return f"{first(load.get('before'))}-{first(load.get('after'))}"


class Results:
    """The result files of one folder, loaded once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cache: dict[str, dict[str, Any] | None] = {}

    def get(self, name: str) -> dict[str, Any] | None:
        if name not in self._cache:
            self._cache[name] = results.load(name, self.folder)
        return self._cache[name]


def workloads(args: list[str]) -> list[str]:
    return [a.upper() for a in args] or [*data.MAKERS, *data.PLANNED]


def measured(
    r: Results, args: list[str], rows: list[list[Any]], files: list[dict[str, Any]], columns: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The workloads named (all by default) that have a result, in order, each added to
    ``files``; one without gets its row in ``rows`` saying so (``columns`` cells)."""
    for key in workloads(args):
        res = r.get(key)
        if res is None:
            rows.append([workload_title(key, None), "*not yet measured*", *[""] * (columns - 2)])
            continue
        files.append(res)
        yield key, res


def with_provenance(out: list[str], files: list[dict[str, Any]]) -> str:
    """The tables, then (when any result was found) where their numbers come from."""
    if files:
        out += ["", provenance(files)]
    return "\n".join(out)


def section_from(
    section: Callable[[Results, list[str]], str], name: str, res: Any, args: list[str]
) -> str:
    """A section's text from one result's contents, as read (the console's tables)."""
    r = Results(Path("/nonexistent"))
    r._cache[name] = res
    return section(r, args)


def workload_title(key: str, res: dict[str, Any] | None) -> str:
    if res is not None:
        return f"{key} {res['workload']['title']}"
    return f"{key} {data.PLANNED.get(key, '')}".strip()


def best(cells: dict[str, Any], system: str, nws: list[str] | None = None) -> tuple[str, Any]:
    """(num_workers, cell) of a system's best median samples/s, over ``nws``."""
    by = cells.get(system) or {}
    options = [(nw, c) for nw, c in by.items() if (nws is None or nw in nws)]
    options = [(nw, c) for nw, c in options if c["samples_per_s"]["median"] is not None]
    if not options:
        return "-", None
    return max(options, key=lambda x: x[1]["samples_per_s"]["median"])


def best_text(nw: str, c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    return f"{num(c['samples_per_s']['median'])}{flag(c)} (nw {nw})"
