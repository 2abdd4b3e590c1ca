"""``python -m bench report``: every benchmark table in README.md and the site's pages
(``docs/**/*.md``), made from the result files in ``docs/results/`` (``bench.results``)
and nothing else.

A table lives between two marker comments (``docs.blocks``), which name the table and
its arguments::

    <!-- bench:throughput W6 W7 W8 -->
    ... (generated: edits here are overwritten) ...
    <!-- /bench:throughput -->

``python -m bench report`` rewrites every marker's body (and the figures
``docs/bench.png``, ``docs/training-stall.png``);
``--check`` changes nothing and exits 1 when a body differs from what the result files
make, or when prose carries a measured figure (tests/test_bench_report.py runs that
check). A measured figure is a ratio (``1.08x``) or a throughput (``552 samples/s``):
outside a generated block, a table, a code span or fence, prose says what a table
shows and points at it, so that no figure in the docs outlives the run that made it.
A table whose result file does not exist says so ("not yet measured") instead of
showing a number. The output depends on the result files alone (not on the clock, the
checkout or the machine), so a committed README either matches its committed result
files or the test fails.

The tables are ``bench.tables``' (one function each, named by the marker), their cells
``bench.cells``' (formats, verdicts, where a measurement comes from).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from bench import data, results
from bench.cells import SYSTEM_NAMES, Results, color, ordered, workload_title
from bench.tables import RENDERERS
from docs import blocks

REPO = results.REPO
PLOT = REPO / "docs" / "bench.png"
STALL_PLOT = REPO / "docs" / "training-stall.png"


MARKER = blocks.marker("bench")

# A measured figure in prose: a ratio to two decimals or a number of samples a second.
FIGURE = re.compile(r"(?<![\w.])(?:\d+\.\d+x\b|\d[\d,.]*\s?[kM]?\s?samples/s)")
_NOT_PROSE = (
    re.compile(r"<!-- (?P<p>\w+):(?P<name>[\w-]+)[^>]*? -->\n.*?<!-- /(?P=p):(?P=name) -->", re.S),
    re.compile(r"^```.*?^```", re.S | re.M),
    re.compile(r"^\|.*$", re.M),
    re.compile(r"`[^`\n]*`"),
)


def prose_figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) for each measured figure in ``text``'s prose."""
    for pattern in _NOT_PROSE:  # blanked, not removed: line numbers stay
        text = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [
        (text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split()))
        for m in FIGURE.finditer(text)
    ]


def render(text: str, r: Results) -> str:
    def one(name: str, args: list[str]) -> str:
        if name not in RENDERERS:
            raise KeyError(f"unknown bench table {name!r}")
        return RENDERERS[name](r, args)

    return blocks.fill(text, MARKER, one)


def check(folder: Path | None = None) -> list[str]:
    """What differs between the docs and what the result files make, and result files
    that do not name their commit: one line per problem."""
    r = Results(folder if folder is not None else results.RESULTS)
    problems = []
    for path in blocks.pages():
        text = path.read_text()
        if render(text, r) != text:
            problems.append(f"{path.relative_to(REPO)}: tables differ from the result files")
        for line, figure in prose_figures(text):
            problems.append(
                f"{path.relative_to(REPO)}:{line}: {figure!r} in prose (a figure comes from "
                "a result file: point at its table)"
            )
    for path in sorted(r.folder.glob("*.json")):
        res = results.load(path.stem, r.folder) or {}
        if not (res.get("commit") or {}).get("sha"):
            problems.append(f"{_rel(path)}: names no commit")
    return problems


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def plot(r: Results, path: Path) -> Path | None:
    """Samples/s per workload, system and num_workers (median, min-max whiskers)."""
    keys = [k for k in [*data.MAKERS, *data.PLANNED] if r.get(k)]
    if not keys:
        return None

    def panel(ax: Any, key: str, legend: dict[str, Any]) -> None:
        res = r.get(key)
        assert res is not None
        _bars(ax, res["cells"], "samples_per_s", legend)
        roof = res["roofline"]["cell"]["samples_per_s"]["median"]
        if roof:
            line = ax.axhline(roof, color="gray", ls="--", lw=1)
            legend.setdefault("roofline (1 process)", line)
        ax.set_title(textwrap.fill(workload_title(key, res), 48), fontsize=9)
        ax.set_ylabel("samples/s")

    return _panels(keys, panel, path)


def plot_stall(r: Results, path: Path) -> Path | None:
    """The training benchmark's stall share per workload, system and num_workers (median,
    min-max whiskers): the share of the loop's time spent waiting in ``next()``."""
    res = r.get("training")
    if res is None:
        return None
    workloads = res["workloads"]

    def panel(ax: Any, key: str, legend: dict[str, Any]) -> None:
        sec = workloads[key]
        _bars(ax, sec["cells"], "stall_share", legend, scale=100)
        ax.set_ylim(0, 100)
        title = f"{key}: {sec['workload']['title']} (step {sec['step_ms']:.0f} ms)"
        ax.set_title(textwrap.fill(title, 48), fontsize=9)
        ax.set_ylabel("stall share, % of loop time (lower: better)")

    return _panels(list(workloads), panel, path)


def _bars(
    ax: Any, cells: dict[str, Any], field: str, legend: dict[str, Any], scale: float = 1
) -> None:
    """One bar per system and num_workers of ``cells[system][nw][field]`` (median,
    min-max whiskers), each system in its colour (``cells.color``) in every panel."""
    systems = ordered(cells)
    nws = sorted({nw for by in cells.values() for nw in by}, key=int)
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for j, nw in enumerate(nws):
            c = cells[system].get(nw)
            if not c or c[field]["median"] is None:
                continue
            s = c[field]
            xs.append(j + (k - (len(systems) - 1) / 2) * width)
            ys.append(s["median"] * scale)
            lo.append((s["median"] - s["min"]) * scale)
            hi.append((s["max"] - s["median"]) * scale)
        label = SYSTEM_NAMES.get(system, system)
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], label=label, color=color(system))
        legend.setdefault(label, bars)
    ax.set_xticks(range(len(nws)), [f"nw={nw}" for nw in nws])


def _panels(keys: list[str], panel: Any, path: Path) -> Path:
    """A figure of one panel per key, three to a row, and one legend below them all (no
    legend over a panel's bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 4.2 * rows), squeeze=False)
    legend: dict[str, Any] = {}  # label -> handle, one entry per system over all panels
    for ax, key in zip(axes.flat, keys + [None] * (rows * cols - len(keys)), strict=True):
        if key is None:
            ax.axis("off")
        else:
            panel(ax, key, legend)
    fig.legend(
        legend.values(), legend.keys(), loc="lower center", ncol=min(4, len(legend)), fontsize=9
    )
    fig.tight_layout(rect=(0, 0.5 / (4.2 * rows) + 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench report", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    ap.add_argument("--results", type=Path, default=results.RESULTS, help="folder of result files")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.results)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    r = Results(args.results)
    for path in blocks.pages():
        text = path.read_text()
        new = render(text, r)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(REPO)}")
    for draw, where in ((plot, PLOT), (plot_stall, STALL_PLOT)):
        if args.no_plot:
            break
        try:
            made = draw(r, where)
        except ImportError as exc:  # the tables need nothing beyond the standard library
            print(
                f"warning: {where.relative_to(REPO)} not remade ({exc.name} is missing: "
                "pip install -e '.[bench]')",
                file=sys.stderr,
            )
        else:
            if made:
                print(f"wrote {made.relative_to(REPO)}")
    _stale(r)
    return 0


def _stale(r: Results) -> None:
    """Say (on the console, never in the docs) which result files were made before the
    code last changed."""
    head = results.commit()
    for path in sorted(r.folder.glob("*.json")):
        res = results.load(path.stem, r.folder) or {}
        sha = (res.get("commit") or {}).get("sha")
        if not sha or sha == head["sha"]:
            continue
        changed = results._git("diff", "--name-only", sha, "HEAD", "--", "src", "bench")
        if changed is None:
            print(f"note: {path.name} is from {sha[:7]}, not in this checkout's history")
        elif changed.strip():
            n = len(changed.split())
            print(
                f"note: {path.name} is from {sha[:7]}; {n} files of src/ and bench/ changed since"
            )
