"""``docs/bench.json``, ``docs/bench.png`` and the console tables."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MiB = 2**20


def write_json(result: dict[str, Any], path: Path) -> Path:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(result), indent=1) + "\n")
    return path


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    rows = summary["throughput"]
    workloads = sorted({r["workload"] for r in rows})
    colors = {"pinfeed": "#1f77b4", "dataloader": "#ff7f0e"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    meta = result["meta"]
    fig.suptitle(
        f"pinfeed vs torch DataLoader — {meta['cpus']} CPUs, torch {meta['torch']}, "
        f"CUDA {'yes' if meta['cuda'] else 'no'}, median of {meta['runs']} runs, "
        f"scale {meta['scale']}",
        fontsize=12,
    )
    for ax, wl in zip(axes[0], workloads + [None] * (3 - len(workloads)), strict=False):
        if wl is None:
            ax.axis("off")
            continue
        rs = [r for r in rows if r["workload"] == wl]
        xs = range(len(rs))
        width = 0.38
        for k, system in enumerate(("pinfeed", "dataloader")):
            vals = [r[system]["samples_per_s"] for r in rs]
            bars = ax.bar(
                [x + (k - 0.5) * width for x in xs],
                vals,
                width,
                label="pinfeed" if system == "pinfeed" else "DataLoader",
                color=colors[system],
            )
            if system == "pinfeed":
                for b, r in zip(bars, rs, strict=True):
                    ax.annotate(
                        f"{r['ratio']:.2f}x",
                        (b.get_x() + b.get_width(), b.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=9,
                    )
        roof = summary["roofline_samples_per_s"].get(wl)
        if roof:
            ax.axhline(roof, color="gray", ls="--", lw=1, label="roofline (1 process)")
        ax.set_xticks(list(xs), [f"nw={r['num_workers']}" for r in rs])
        w = result["workloads"].get(wl, {})
        ax.set_title(f"{wl}: {w.get('title', '')}\n{w.get('samples', '?')} samples", fontsize=10)
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=8, loc="upper left")

    # Time to first batch and peak memory, at the largest num_workers measured.
    nw_max = max((r["num_workers"] for r in rows), default=0)
    at = [r for r in rows if r["num_workers"] == nw_max]
    ax = axes[1][0]
    xs = range(len(at))
    for k, system in enumerate(("pinfeed", "dataloader")):
        ax.bar(
            [x + (k - 0.5) * 0.38 for x in xs],
            [r[system]["ttfb_s"] * 1e3 for r in at],
            0.38,
            color=colors[system],
            label=system,
        )
    ax.set_xticks(list(xs), [r["workload"] for r in at])
    ax.set_ylabel("ms")
    ax.set_title(f"time to first batch (cold, num_workers={nw_max})", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for k, system in enumerate(("pinfeed", "dataloader")):
        ax.bar(
            [x + (k - 0.5) * 0.38 for x in xs],
            [r[system]["peak_pss_bytes"] / MiB for r in at],
            0.38,
            color=colors[system],
            label=system,
        )
    ax.set_xticks(list(xs), [r["workload"] for r in at])
    ax.set_ylabel("MiB")
    h = summary.get("handoff", {})
    hp, hd = h.get("pinfeed"), h.get("dataloader")
    sub = ""
    if hp and hd:
        sub = (
            f"\nhandoff of a ready batch p50/p99: pinfeed {hp['p50_us']:.0f}/"
            f"{hp['p99_us']:.0f} us, DataLoader {hd['p50_us']:.0f}/{hd['p99_us']:.0f} us"
        )
    ax.set_title(f"peak PSS, all processes (num_workers={nw_max}){sub}", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][2]
    scaling = summary.get("scaling", [])
    if scaling:
        ns = [s["trainers"] for s in scaling]
        for system in ("pinfeed", "dataloader"):
            ax.plot(
                ns,
                [s[system]["aggregate_samples_per_s"] for s in scaling],
                "o-",
                color=colors[system],
                label=system,
            )
        ax.set_xticks(ns)
        ax.set_xlabel("trainers (one loader each)")
        ax.set_ylabel("aggregate samples/s")
        nw = result["scaling_runs"][0]["num_workers"] if result["scaling_runs"] else "?"
        ax.set_title(f"scaling on one server: W1, num_workers={nw} per loader", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    summary = result["summary"]
    t = Table(
        "workload",
        "nw",
        "pinfeed /s",
        "DataLoader /s",
        "ratio",
        "roofline share",
        "TTFB pf / DL ms",
        "peak PSS pf / DL MiB",
        title="throughput (median)",
    )
    for r in summary["throughput"]:
        p, d = r["pinfeed"], r["dataloader"]
        share = r.get("pinfeed_roofline_share")
        t.add_row(
            r["workload"],
            str(r["num_workers"]),
            f"{p['samples_per_s']:,.0f}",
            f"{d['samples_per_s']:,.0f}",
            f"{r['ratio']:.2f}x",
            "-" if share is None else f"{share:.0%}",
            f"{p['ttfb_s'] * 1e3:,.0f} / {d['ttfb_s'] * 1e3:,.0f}",
            f"{p['peak_pss_bytes'] / MiB:,.0f} / {d['peak_pss_bytes'] / MiB:,.0f}",
        )
    console.print(t)
    h = summary.get("handoff", {})
    if h:
        t = Table(
            "system",
            "p50 us",
            "p90 us",
            "p99 us",
            "mean us",
            "n",
            "floor p50 (same ops, no IPC)",
            title="handoff of a ready batch (W1, num_workers 2)",
        )
        for system, v in h.items():
            t.add_row(
                system,
                f"{v['p50_us']:.1f}",
                f"{v['p90_us']:.1f}",
                f"{v['p99_us']:.1f}",
                f"{v['mean_us']:.1f}",
                str(v["n"]),
                f"{v['floor_after_step_p50_us']:.1f}",
            )
        console.print(t)
    if summary.get("scaling"):
        t = Table(
            "trainers",
            "pinfeed /s",
            "DataLoader /s",
            "ratio",
            title="scaling (aggregate samples/s, median)",
        )
        for s in summary["scaling"]:
            t.add_row(
                str(s["trainers"]),
                f"{s['pinfeed']['aggregate_samples_per_s']:,.0f}",
                f"{s['dataloader']['aggregate_samples_per_s']:,.0f}",
                f"{s['ratio']:.2f}x",
            )
        console.print(t)
    t = Table("target", "value", "goal", "met", title="issue targets")
    for x in summary["targets"]:
        v = x["value"]
        t.add_row(
            x["target"],
            "-" if v is None else f"{v:.3g}",
            x["goal"],
            {True: "[green]yes", False: "[red]no", None: "-"}[x["met"]],
        )
    console.print(t)
