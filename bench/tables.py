"""Every benchmark table of the docs, one function ``(Results, args) -> markdown`` each,
by the name its marker gives (``RENDERERS``): the suite's (headline, throughput, costs,
roofline, hand-off, scaling), what a trainer gets (training, first batch, the one-line
switch), autotune and W4's profile, scale, the control plane, Ray, GPU, soak, W9 (the
node's sample cache), the node arbiter and the metrics render.

A new table is a function here, in ``RENDERERS``, and a marker in a doc; a new workload
(W9) needs none: the suite's tables list ``bench.data.MAKERS`` and ``bench.data.PLANNED``,
and a system a workload adds (``Workload.extra_systems``) gets its own column in the
per-``num_workers`` tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import data, results
from bench.cells import (
    LOADED,
    SYSTEM_NAMES,
    TUNED,
    MiB,
    Results,
    best,
    best_text,
    flag,
    measured,
    mib,
    missing,
    ms,
    num,
    ordered,
    pct,
    provenance,
    ranged,
    section_from,
    table,
    tuned_system,
    verdict,
    with_provenance,
    workload_title,
    workloads,
)

# --- the suite's tables ------------------------------------------------------------------


def headline(r: Results, args: list[str]) -> str:
    rows: list[list[Any]] = []
    files: list[dict[str, Any]] = []
    for key, res in measured(r, args, rows, files, 7):
        cells = res["cells"]
        # the same CPU budget: the num_workers both systems were measured at
        nws = sorted(set(cells.get("pinfeed", {})) & set(cells.get("dataloader", {})), key=int)
        pn, pc = best(cells, "pinfeed", nws)
        dn, dc = best(cells, "dataloader", nws)
        if tuned_sys := tuned_system(cells):
            tn, tc = best(cells, tuned_sys, nws)
            tuned = best_text(tn, tc)
            if tuned_sys != "dataloader-tuned":
                tuned = f"{SYSTEM_NAMES[tuned_sys]}: {tuned}"
        else:
            tn, tc = dn, dc
            tuned = f"= DataLoader (no batched read): {best_text(dn, dc)}"
        pick = pc["samples_per_s"] if pc else None
        rows.append(
            [
                workload_title(key, res),
                best_text(pn, pc),
                best_text(dn, dc),
                verdict(pick, dc["samples_per_s"] if dc else None),
                tuned,
                verdict(pick, tc["samples_per_s"] if tc else None),
                " / ".join(_cpu(c) for c in (pc, dc, tc)),
                data.WHY.get(key, ""),
            ]
        )
    head = [
        "workload",
        "pinfeed, best",
        "DataLoader, best",
        "pinfeed vs DataLoader",
        "tuned DataLoader, best",
        "pinfeed vs tuned",
        "CPU ms a 1k samples, all processes: pinfeed / DataLoader / tuned",
        "why",
    ]
    return with_provenance([table(head, rows)], files)


def _cpu(c: dict[str, Any] | None) -> str:
    """CPU milliseconds per 1,000 samples of every process of a system in its timed
    window (the trainer's tree, and for pinfeed the server's), at its best."""
    m = (c or {}).get("cpu_ms_per_ksample")
    return f"{m['median']:,.1f}" if m and m.get("median") is not None else "-"


BASE = ("pinfeed", "dataloader", "dataloader-tuned")


# Systems with a table of their own, or shown in the tuned DataLoader's column
# (``tuned_system``), left out of the throughput table's columns.
OWN_TABLE = ("pinfeed-python", *TUNED[1:])


def _shown(cells: dict[str, Any], system: str) -> str:
    """The system whose cells a column shows: the tuned DataLoader's is the result's
    ``tuned_system``."""
    return (tuned_system(cells) or system) if system == "dataloader-tuned" else system


def _systems(found: list[dict[str, Any]]) -> list[str]:
    """The columns: pinfeed, DataLoader, tuned, and any other system a result has."""
    names = {s for res in found for s in res["cells"] if s not in OWN_TABLE} | set(BASE)
    return ordered(dict.fromkeys(names))


def one_line(r: Results, args: list[str]) -> str:
    """pinfeed.DataLoader (the script's objects, shipped) against a named loader on the
    very same Dataset object (a ``python`` dataset whose factory builds it) and against
    a named loader on pinfeed's own kind for the same files, per num_workers."""
    rows: list[list[Any]] = []
    files: list[dict[str, Any]] = []
    for key, res in measured(r, args, rows, files, 7):
        cells = res["cells"]
        nws = sorted(cells.get("pinfeed-dataloader", {}), key=int)
        for i, nw in enumerate(nws):
            one = cells["pinfeed-dataloader"][nw]
            same = cells.get("pinfeed-python", {}).get(nw)
            kind = cells.get("pinfeed", {}).get(nw)
            rows.append(
                [
                    workload_title(key, res) if i == 0 else "",
                    nw,
                    ranged(one["samples_per_s"]) + flag(one),
                    ranged(same["samples_per_s"]) + flag(same) if same else "-",
                    verdict(one["samples_per_s"], same["samples_per_s"]) if same else "-",
                    ranged(kind["samples_per_s"]) + flag(kind) if kind else "-",
                    verdict(one["samples_per_s"], kind["samples_per_s"]) if kind else "-",
                ]
            )
    head = [
        "workload",
        "num_workers",
        "pinfeed.DataLoader samples/s",
        "named loader, the same Dataset object",
        "pinfeed.DataLoader vs it",
        "named loader, pinfeed's kind",
        "pinfeed.DataLoader vs it",
    ]
    return with_provenance([table(head, rows)], files)


def throughput_rows(
    key: str, res: dict[str, Any] | None, systems: list[str] | None = None
) -> list[list[str]]:
    systems = systems or _systems([res] if res else [])
    others = [s for s in systems if s != "pinfeed"]
    width = 2 + len(systems) + len(others)
    if res is None:
        return [[workload_title(key, None), "", "*not yet measured*", *[""] * (width - 3)]]
    cells = res["cells"]
    rows = []
    nws = sorted({nw for by in cells.values() for nw in by}, key=int)
    for i, nw in enumerate(nws):
        row = [workload_title(key, res) if i == 0 else "", nw]
        for system in systems:
            shown = _shown(cells, system)
            c = cells.get(shown, {}).get(nw)
            if shown not in cells:
                row.append("(none)" if system == "dataloader-tuned" else "-")
            else:
                label = f"{SYSTEM_NAMES[shown]}: " if shown != system else ""
                row.append(label + ranged(c["samples_per_s"]) + flag(c) if c else "-")
        p = cells.get("pinfeed", {}).get(nw)
        for other in others:
            c = cells.get(_shown(cells, other), {}).get(nw)
            row.append(verdict(p["samples_per_s"], c["samples_per_s"]) if p and c else "-")
        rows.append(row)
    return rows


def _throughput_head(systems: list[str]) -> list[str]:
    names = [SYSTEM_NAMES.get(s, s) for s in systems]
    head = ["workload", "num_workers", *[f"{n} samples/s" for n in names]]
    return head + [f"pinfeed vs {n}" for s, n in zip(systems, names, strict=True) if s != "pinfeed"]


def throughput(r: Results, args: list[str]) -> str:
    keys = workloads(args)
    found = [res for k in keys if (res := r.get(k)) is not None]
    systems = _systems(found)
    rows = []
    for key in keys:
        rows += throughput_rows(key, r.get(key), systems)
    return with_provenance([table(_throughput_head(systems), rows)], found)


def throughput_table(res: dict[str, Any] | None) -> str:
    """One workload's table, for the console."""
    if res is None:
        return "(no result)"
    systems = _systems([res])
    return table(_throughput_head(systems), throughput_rows(res["name"], res, systems))


def costs(r: Results, args: list[str]) -> str:
    """Each system at its best num_workers: what it spends for its samples/s."""
    rows: list[list[Any]] = []
    files: list[dict[str, Any]] = []
    for key, res in measured(r, args, rows, files, 7):
        for i, system in enumerate(ordered(res["cells"])):
            nw, c = best(res["cells"], system)
            if c is None:
                continue
            rows.append(
                [
                    workload_title(key, res) if i == 0 else "",
                    SYSTEM_NAMES.get(system, system),
                    nw,
                    num(c["samples_per_s"]["median"]) + flag(c),
                    ranged(c["cpu_ms_per_ksample"], lambda x: "-" if x is None else f"{x:.1f}"),
                    mib(c["peak_pss_bytes"]["median"]),
                    ms(c["ttfb_s"]["median"]),
                ]
            )
    head = [
        "workload",
        "system",
        "best num_workers",
        "samples/s",
        "CPU ms per 1k samples (all processes)",
        "peak PSS MiB",
        "time to first batch ms",
    ]
    return with_provenance([table(head, rows)], files)


def roofline(r: Results, args: list[str]) -> str:
    rows: list[list[Any]] = []
    files: list[dict[str, Any]] = []
    for key, res in measured(r, args, rows, files, 5):
        roof = res["roofline"]["cell"]["samples_per_s"]
        share = []
        for system in ("pinfeed", "dataloader", "dataloader-tuned"):
            nw, c = best(res["cells"], _shown(res["cells"], system))
            if c is None or not roof["median"]:
                share.append("-")
            else:
                share.append(f"{c['samples_per_s']['median'] / roof['median']:.0%} (nw {nw})")
        rows.append(
            [workload_title(key, res), ranged(roof) + flag(res["roofline"]["cell"]), *share]
        )
    head = [
        "workload",
        "roofline samples/s (1 process)",
        "pinfeed best, share",
        "DataLoader best",
        "tuned DataLoader best",
    ]
    return with_provenance([table(head, rows)], files)


def handoff(r: Results, args: list[str]) -> str:
    res = r.get("W1")
    if res is None or "handoff" not in res:
        return missing("W1", "python -m bench W1")
    h = res["handoff"]
    rows = []
    for system in ordered(h["cells"]):
        c = h["cells"][system]

        def us(x: float | None) -> str:
            return "-" if x is None else f"{x:,.0f}"

        rows.append(
            [
                SYSTEM_NAMES.get(system, system) + flag(c),
                ranged(c["p50_us"], us),
                ranged(c["p90_us"], us),
                ranged(c["p99_us"], us),
                ranged(c["floor_after_step_p50_us"], us),
            ]
        )
    warm = results.spread(
        [x["ttfb_s"] for x in h["runs"] if x["system"] == "pinfeed" and x.get("ttfb_s")]
    )
    head = ["system", "p50 µs", "p90 µs", "p99 µs", "floor p50 µs (same ops, no IPC)"]
    return "\n".join(
        [
            table(head, rows),
            "",
            f"W1, num_workers {h['num_workers']}, a {h['step_s'] * 1e3:.0f} ms busy step before "
            f"each `next()`. pinfeed attaching to a loader created ahead (its ring full) and "
            f"taking its first batch: {ranged(warm, ms)} ms.",
            provenance([res]),
        ]
    )


def null(r: Results, args: list[str]) -> str:
    """``python -m bench null``: each path's cost per batch against the floors': one
    process, and two (where the result file has it)."""
    res = r.get("null")
    if res is None:
        return missing("null", "python -m bench null")
    cells = res["cells"]
    floors = [f for f in ("floor", "floor-ipc") if f in cells]
    systems = [s for s in ordered(cells) if s not in floors]
    nws = sorted({nw for by in cells.values() for nw in by}, key=int)

    def us(x: float | None) -> str:
        return "-" if not x else f"{1e6 / x:,.1f}"

    def rate(c: dict[str, Any] | None) -> float | None:
        return c["batches_per_s"]["median"] if c else None

    rows = []
    for nw in nws:
        row: list[Any] = [nw]
        floor_rates = [rate(cells[f].get(nw)) for f in floors]
        for f, fr in zip(floors, floor_rates, strict=True):
            c = cells[f].get(nw)
            row.append(f"{ranged(c['batches_per_s'])}{flag(c)}: {us(fr)} µs" if c else "-")
        for system in systems:
            c = cells[system].get(nw)
            got = rate(c)
            if not got or c is None:
                row.append("-")
                continue
            times = ", ".join(f"{fr / got:.1f}x" for fr in floor_rates if fr)
            times = f" ({times})" if times else ""
            row.append(f"{ranged(c['batches_per_s'])}{flag(c)}: {us(got)} µs{times}")
        rows.append(row)
    head = ["num_workers"]
    head += [f"{SYSTEM_NAMES.get(f, f)}: batches/s, µs a batch" for f in floors]
    against = " and ".join(SYSTEM_NAMES.get(f, f).split(" (")[0] for f in floors)
    head += [f"{SYSTEM_NAMES.get(s, s)}: batches/s, µs a batch (x {against})" for s in systems]
    w = res["workload"]
    return "\n".join(
        [
            table(head, rows),
            "",
            f"Batches of {w['batch_size']} sample of {w['sample_shape']} {w['dtype']}; "
            f"each run a window of {res['params']['seconds']} s after its warm-up.",
            provenance([res]),
        ]
    )


def null_table(res: dict[str, Any] | None) -> str:
    return section_from(null, "null", res, [])


def scaling(r: Results, args: list[str]) -> str:
    res = r.get("scaling")
    if res is None:
        return missing("scaling", "python -m bench scaling")
    cells = res["cells"]
    systems = ordered(cells)
    counts = sorted({n for by in cells.values() for n in by}, key=int)
    rows = []
    for n in counts:
        c = {s: cells[s].get(n) for s in systems}
        row = [n]
        row += [
            ranged(c[s]["aggregate_samples_per_s"]) + flag(c[s]) if c[s] else "-" for s in systems
        ]
        for other in systems[1:]:
            row.append(
                verdict(
                    c["pinfeed"]["aggregate_samples_per_s"], c[other]["aggregate_samples_per_s"]
                )
                if c.get("pinfeed") and c.get(other)
                else "-"
            )
        row.append(
            " / ".join(mib(c[s]["peak_pss_bytes"]["median"]) if c[s] else "-" for s in systems)
        )
        rows.append(row)
    names = [SYSTEM_NAMES.get(s, s) for s in systems]
    head = ["trainers", *[f"{n} aggregate samples/s" for n in names]]
    head += [f"pinfeed vs {n}" for n in names[1:]]
    head.append("peak PSS MiB (" + " / ".join(names) + ")")
    return "\n".join(
        [
            table(head, rows),
            "",
            f"W1, one loader per trainer, one epoch each; num_workers {_workers(res)}.",
            provenance([res]),
        ]
    )


def _workers(res: dict[str, Any]) -> str:
    """The num_workers each system ran at (one for all in older result files)."""
    nw = res["num_workers"]
    if not isinstance(nw, dict):
        return f"{nw} for every system"
    each = ", ".join(f"{SYSTEM_NAMES.get(s, s)} {n}" for s, n in nw.items())
    return f"each system at its best in W1's result file: {each}"


def scaling_table(res: dict[str, Any] | None) -> str:
    return section_from(scaling, "scaling", res, [])


# --- what a trainer gets -----------------------------------------------------------------


def _training_rows(res: dict[str, Any], key: str, all_nw: bool) -> list[list[str]]:
    sec = res["workloads"][key]
    rows = []
    first = True
    for system in ordered(sec["cells"]):
        picks = list(sec["cells"][system].items())
        if not all_nw:
            # the setting a user would pick: least stall, then least trainer CPU
            picks = [
                min(
                    picks,
                    key=lambda x: (
                        round(x[1]["stall_share"]["median"] or 0, 3),
                        x[1]["trainer_cpu_ms_per_batch"]["median"] or 0,
                    ),
                )
            ]
        for nw, c in picks:

            def f2(x: float | None) -> str:
                return "-" if x is None else f"{x:.2f}"

            rows.append(
                [
                    f"{key} (step {sec['step_ms']:.0f} ms, {sec['step_kind']})" if first else "",
                    SYSTEM_NAMES.get(system, system) + flag(c),
                    nw,
                    ranged(c["stall_share"], pct),
                    num(c["samples_per_s"]["median"]),
                    ranged(c["trainer_cpu_ms_per_batch"], f2),
                    f2(c["trainer_children_cpu_ms_per_batch"]["median"]),
                    f2(c["server_cpu_ms_per_batch"]["median"]),
                    f2(c["total_cpu_ms_per_batch"]["median"]),
                ]
            )
            first = False
    return rows


def training(r: Results, args: list[str]) -> str:
    """``training`` (each system at its least-stall setting) or ``training all``."""
    res = r.get("training")
    all_nw = "all" in args
    keys = [a.upper() for a in args if a != "all"] or list(data.STEP_MS)
    if res is None:
        return missing("training", "python -m bench training")
    rows = []
    for key in keys:
        if key not in res["workloads"]:
            rows.append([key, "*not yet measured*", "", "", "", "", "", "", ""])
            continue
        rows += _training_rows(res, key, all_nw)
    head = [
        "workload",
        "system",
        "num_workers",
        "stall share",
        "samples/s",
        "trainer CPU ms/batch (own process)",
        "its children (DataLoader workers)",
        "server tree",
        "all",
    ]
    return "\n".join([table(head, rows), "", provenance([res])])


def training_table(res: dict[str, Any] | None) -> str:
    return section_from(training, "training", res, ["all", *(res or {}).get("workloads", {})])


# --- autotune, W4's profile, scale, control, ray, soak, gpu -----------------------------


def autotune(r: Results, args: list[str]) -> str:
    res = r.get("autotune")
    if res is None:
        return missing("autotune", "python -m bench autotune")
    rows = []
    for w in res["workloads"]:
        key = w["workload"]["key"]
        settings = [(f"num_workers={n}", f) for n, f in w["fixed"].items()]
        a = w["autotune"]
        settings.append((f"autotune from 1 (max {a['max_workers']})", a))
        for i, (label, s) in enumerate(settings):
            is_tune = s is a
            rows.append(
                [
                    key if i == 0 else "",
                    label + (LOADED if s.get("under_load") else ""),
                    ranged(s["steady"]),
                    ranged(s["whole_run"]),
                    (ranged(s["settled_after_s"], lambda x: "-" if x is None else f"{x:.1f} s"))
                    if is_tune
                    else "",
                    ", ".join(s["final"]) if is_tune else "",
                    f"{w['autotune_vs_best']:.0%} of the best fixed (num_workers="
                    f"{w['best_fixed']['num_workers']})"
                    if is_tune and w.get("autotune_vs_best")
                    else "",
                ]
            )
    p = res["params"]
    head = [
        "workload",
        "setting",
        f"samples/s from {float(p['warmup']):.0f} s to {float(p['seconds']):.0f} s",
        "whole run",
        "autotune settled after",
        "final workers x prefetch",
        "",
    ]
    return "\n".join(
        [
            table(head, rows),
            "",
            f"Batch {p['batch_size']}, a {float(p['step_ms']):.0f} ms sleep per batch, "
            f"{p['rounds']} rounds (median [min-max]).",
            provenance([res]),
        ]
    )


def autotune_table(res: dict[str, Any] | None) -> str:
    return section_from(autotune, "autotune", res, [])


def w4_profile(r: Results, args: list[str]) -> str:
    res = r.get("w4-profile")
    if res is None:
        return missing("w4-profile", "python -m bench w4-profile")
    rows = [[k, f"{v:,.0f}"] for k, v in res["cpu_us_per_batch"].items()]
    rows.append(["pinfeed, CPU per batch", f"{res['pinfeed_cpu_us']:,.0f}"])
    rows.append(["DataLoader, CPU per batch", f"{res['dataloader_cpu_us']:,.0f}"])
    return "\n".join(
        [
            table(["W4, one process, one thread", "CPU µs per batch"], rows),
            "",
            f"With CPU-bound workers pinfeed's ratio over DataLoader is at most "
            f"{res['bound']:.2f}x ({res['batches']} batches).",
            provenance([res]),
        ]
    )


FOLLOWED = {
    "W1": "a TensorDataset",
    "W3": "an image folder (Pillow)",
    "W9": "Transformed(image folder, W9's transform)",
}


def follow(r: Results, args: list[str]) -> str:
    """What following the trainer's objects costs each epoch (``bench.follow``)."""
    res = r.get("follow")
    if res is None:
        return missing("follow", "python -m bench follow")
    rows = []
    for key, c in res["cells"].items():
        epoch = c["epoch_s"]
        share = c["unchanged_s"]["median"] / epoch if epoch else None
        rows.append(
            [
                f"{key}: {FOLLOWED.get(key, '')}",
                f"{c['samples']:,}",
                f"{epoch:.2f} s",
                ranged(c["unchanged_s"], ms) + " ms",
                pct(share),
                ranged(c["changed_s"], ms) + " ms",
                f"{c['payload_bytes']:,} B",
            ]
        )
    head = [
        "dataset",
        "samples",
        "one epoch",
        "nothing changed",
        "of the epoch",
        "an attribute changed",
        "shipped",
    ]
    return "\n".join(
        [
            table(head, rows),
            "",
            f"`pinfeed.DataLoader` at num_workers={res['params']['num_workers']}, "
            f"{res['params']['repeats']} calls each way, median [min-max]; the epoch is "
            "the first (objects shipped, workers started).",
            provenance([res]),
        ]
    )


def first_batch(r: Results, args: list[str]) -> str:
    res = r.get("first-batch")
    if res is None:
        return missing("first-batch", "python -m bench first-batch")
    names = {
        "dataloader": "torch DataLoader: iter() + next()",
        "pinfeed-dataloader": "pinfeed.DataLoader, server running",
        "pinfeed-dataloader-autostart": "pinfeed.DataLoader, no server (one is started)",
    }
    base = (res["cells"]["dataloader"]["first_batch_s"] or {}).get("median")
    rows = []
    for system, name in names.items():
        c = res["cells"][system]["first_batch_s"]
        extra = "" if base is None or c["median"] is None else f"{c['median'] - base:+.2f} s"
        rows.append([name, ranged(c, lambda x: "-" if x is None else f"{x:.2f} s"), extra])
    imp = res["cells"]["pinfeed-dataloader"]["import_s"]["median"]
    workers = res["params"]["workers"]
    return "\n".join(
        [
            table(
                ["from DataLoader(...) to the first batch", "seconds", "against DataLoader"], rows
            ),
            "",
            f"num_workers={workers}, a fresh trainer process per run; `import pinfeed` "
            f"itself takes {imp:.2f} s more (median), not counted above.",
            provenance([res]),
        ]
    )


def scale(r: Results, args: list[str]) -> str:
    res = r.get("scale")
    if res is None:
        return missing("scale", "python -m bench scale")
    workers = res["workers"]
    hi = max(workers)
    rows = []
    for s in res["sizes"]:
        ours, theirs = s["pinfeed"], s["dataloader"]
        o, t = ours.get(f"w{hi}", {}), theirs.get(f"w{hi}")
        warm = ours.get(f"warm{hi}", {})
        sl, pw = ours["second_loader"], s["per_worker_mib"]
        spread_o = o.get("first_batch_spread")
        rows.append(
            [
                f"{s['files']:,}",
                f"{ours['register_s']:.2f} s",
                f"{ranged(spread_o, lambda x: '-' if x is None else f'{x:.2f}')} s",
                f"{warm.get('first_batch_s', 0):.2f} s",
                f"{t['first_batch_s']:.2f} s" if t else "-",
                f"{pw['pinfeed']:.1f} MiB ({pw['dataloader']:.1f})",
                f"{sl['pss_added'] / MiB:.1f} MiB ({sl['ring_bytes'] / MiB:.1f})",
            ]
        )
    head = [
        "files",
        "register",
        f"{hi} workers: create -> 1st batch, cold (a new dataset's first loader)",
        "warm (its next loader)",
        "DataLoader `iter`+`next`",
        "PSS per extra worker (DataLoader)",
        "a second loader adds (its ring)",
    ]
    return "\n".join([table(head, rows), "", provenance([res])])


def scale_detail(r: Results, args: list[str]) -> str:
    res = r.get("scale")
    if res is None:
        return missing("scale", "python -m bench scale")

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def pss(row: dict[str, Any] | None) -> str:
        if not row:
            return "-"
        text = f"{row['pss'] / MiB:.0f} MiB"
        if row.get("pss_epoch"):
            text += f" ({row['pss_epoch'] / MiB:.0f} after an epoch)"
        return text

    rows = []
    for s in res["sizes"]:
        ours, theirs = s["pinfeed"], s["dataloader"]
        for i, nw in enumerate(res["workers"]):
            o, t, w = ours.get(f"w{nw}"), theirs.get(f"w{nw}"), ours.get(f"warm{nw}")
            if o is None:
                continue
            rows.append(
                [
                    f"{s['files']:,}" if i == 0 else "",
                    str(nw),
                    f"{sec(ours['register_s'])} s" if i == 0 else "",
                    ranged(o.get("first_batch_spread"), sec) + " s",
                    ranged((w or {}).get("first_batch_spread"), sec) + " s",
                    f"{sec(theirs['scan_s'])} s" if i == 0 else "",
                    (ranged(t.get("first_batch_spread"), sec) + " s") if t else "-",
                    pss(o),
                    pss(t),
                ]
            )
    head = [
        "files",
        "workers",
        "pinfeed register",
        "create -> 1st batch, cold",
        "warm",
        "DataLoader scan",
        "DataLoader iter+next",
        "pinfeed server tree PSS",
        "DataLoader tree PSS",
    ]
    rows2 = []
    for s in res["sizes"]:
        pw, sl = s["per_worker_mib"], s["pinfeed"]["second_loader"]
        p, tp = s.get("pinfeed_paths"), s["dataloader"].get("paths")
        rows2.append(
            [
                f"{s['files']:,}",
                f"{pw['pinfeed']:.1f} MiB",
                f"{pw['dataloader']:.1f} MiB",
                f"{sl['pss_added'] / MiB:.1f} MiB ({sl['ring_bytes'] / MiB:.1f}), created in "
                f"{sl['create_s']:.2f} s",
                f"{p['growth'] / MiB:.1f} MiB" if p else "-",
                f"{tp['growth'] / MiB:.1f} MiB" if tp else "-",
            ]
        )
    head2 = [
        "files",
        "PSS per extra worker: pinfeed",
        "DataLoader",
        "a second loader adds (its ring)",
        "a Python list of paths, 4 workers, PSS growth over an epoch: pinfeed",
        "DataLoader",
    ]
    return "\n".join([table(head, rows), "", table(head2, rows2), "", provenance([res])])


def scale_table(res: dict[str, Any] | None) -> str:
    return section_from(scale, "scale", res, [])


CONTROL_GROUPS = [
    ("`/metrics` 1 / 10 / 50 per s", ["/metrics 1/s", "/metrics 10/s", "/metrics 50/s"]),
    (
        "16 connections flooding `/healthz`, `/stats`, `/metrics`",
        ["flood 16 /healthz", "flood 16 /v1/loaders/train/stats", "flood 16 /metrics"],
    ),
]


def _control_summary(res: dict[str, Any], loaders: int) -> list[str]:
    rows = {r["traffic"]: r for r in res["rows"] if r["loaders"] == loaders}
    out = []
    for _, traffic in CONTROL_GROUPS:
        shares = [rows[t].get("share") for t in traffic if t in rows]
        out.append(" / ".join("-" if s is None else f"{s:.2f}" for s in shares) + "x")
    probes = rows.get("probes /healthz /readyz /metrics", {}).get("http", {})

    def p(path: str, k: str) -> str:
        v = (probes.get(path) or {}).get(k)
        return "-" if v is None else f"{v:.1f}"

    out.append(f"{p('/healthz', 'p99_ms')} / {p('/readyz', 'p99_ms')} ms")
    out.append(f"{p('/metrics', 'p50_ms')} ms (p99 {p('/metrics', 'p99_ms')})")
    return out


def control(r: Results, args: list[str]) -> str:
    now, before = r.get("control"), r.get("control-before")
    if now is None and before is None:
        return missing("control", "python -m bench control")
    labels = [g for g, _ in CONTROL_GROUPS] + [
        "`/healthz`, `/readyz` p99 under full load",
        "one `/metrics` scrape, p50 under full load",
    ]
    counts = sorted({r["loaders"] for x in (now, before) if x for r in x["rows"]})
    rows = []
    for n in counts:
        b = _control_summary(before, n) if before else ["-"] * len(labels)
        a = _control_summary(now, n) if now else ["*not yet measured*"] + [""] * (len(labels) - 1)
        for i, label in enumerate(labels):
            rows.append([str(n) if i == 0 else "", label, b[i], a[i]])
    head = ["loaders", "HTTP traffic (trainer's share of its samples/s alone)", "before", "now"]
    files = [x for x in (before, now) if x]
    return "\n".join([table(head, rows), "", provenance(files)])


def control_detail(r: Results, args: list[str]) -> str:
    now, before = r.get("control"), r.get("control-before")
    if now is None:
        return missing("control", "python -m bench control")
    bef = {(x["loaders"], x["traffic"]): x for x in (before or {}).get("rows", [])}

    def share(row: dict[str, Any]) -> str:
        if not row:
            return ""
        if "share" not in row:
            return f"{row['samples_per_s']:,.0f} samples/s (alone)"
        return f"{row['share']:.2f}x"

    def http(h: dict[str, Any] | None) -> str:
        return "" if not h else f"{h['p50_ms']:.1f} / {h['p99_ms']:.1f}"

    rows = []
    for x in now["rows"]:
        b = bef.get((x["loaders"], x["traffic"]), {})
        paths = list(x.get("http", {})) or [""]
        for i, path in enumerate(paths):
            h, hb = x.get("http", {}).get(path), b.get("http", {}).get(path)
            bad = "" if not h else str(h["errors_5xx"] + h["hangs"] + h["conn_errors"])
            label = x["traffic"] + (f": {path}" if len(paths) > 1 else "")
            rows.append(
                [
                    str(x["loaders"]) if i == 0 else "",
                    label if i == 0 else path,
                    share(b) if i == 0 else "",
                    http(hb),
                    share(x) if i == 0 else "",
                    "" if not h else f"{h['per_s']:.0f}",
                    http(h),
                    bad,
                ]
            )
    head = [
        "loaders",
        "HTTP traffic on the same server",
        "before: share",
        "before: HTTP p50 / p99 ms",
        "now: share",
        "now: req/s served",
        "now: HTTP p50 / p99 ms",
        "now: 5xx + hangs",
    ]
    return "\n".join([table(head, rows), "", provenance([y for y in (before, now) if y])])


def control_targets(r: Results, args: list[str]) -> str:
    now = r.get("control")
    if now is None:
        return missing("control", "python -m bench control")
    rows = [
        [
            t["target"],
            "-" if t["value"] is None else f"{t['value']:.2f}",
            t["goal"],
            "met" if t["ok"] else "**missed**",
        ]
        for t in now.get("targets", [])
    ]
    return table(["target", "value", "goal", ""], rows)


def ray(r: Results, args: list[str]) -> str:
    res = r.get("ray")
    if res is None:
        return missing("ray", "python -m bench ray: needs root and network namespaces")
    local, remote = res["runs"]

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f} ms"

    keys = [
        ("wall time", "wall_ms_per_batch"),
        ("server process CPU", "server_cpu_ms_per_batch"),
        ("bridge CPU (object store -> ring slot)", "bridge_cpu_ms_per_batch"),
        ("decode CPU (workers / actors)", "decode_cpu_ms_per_batch"),
    ]
    rows = [[label, f(local.get(k)), f(remote.get(k))] for label, k in keys]
    s = res["summary"]
    return "\n".join(
        [
            table(["per batch", "local workers", "ray actors"], rows),
            "",
            f"Intake: a bare copy into a ring slot {s['intake_copy_bytes_per_s'] / 1e9:.2f} GB/s "
            f"on one core ({s['decode_cores_per_copy_core']:.0f} decode cores' output); the "
            f"bridge's measured CPU {s['intake_bridge_bytes_per_cpu_s'] / 1e9:.2f} GB per CPU "
            f"second ({s['decode_cores_per_bridge_core']:.0f} decode cores).",
            provenance([res]),
        ]
    )


def gpu(r: Results, args: list[str]) -> str:
    res = r.get("gpu")
    if res is None:
        return missing("gpu", "python -m bench gpu, on a CUDA machine")
    h = res["h2d"]
    rows = [
        ["pageable tensor", f"{h['pageable_gbps']:.1f}"],
        ["pinned tensor", f"{h['pinned_gbps']:.1f}"],
        ["pinfeed ring view", f"{h['ring_gbps']:.1f} ({h['ring_vs_pinned']:.0%} of pinned)"],
        [
            "`Loader(device='cuda')`",
            f"{h['loader_device_gbps']:.1f} ({h['loader_device_vs_pinned']:.0%} of pinned)",
        ],
    ]
    out = [table(["H2D copy of one batch", "GB/s"], rows), ""]
    trows = [
        [feed, f"{t['gpu_idle_share']:.0%}", num(t["samples_per_s"])]
        for feed, t in res["training"].items()
    ]
    out += [table(["feed", "GPU idle share", "samples/s"], trows), "", provenance([res])]
    return "\n".join(out)


def soak(r: Results, args: list[str]) -> str:
    res = r.get("soak")
    if res is None:
        return missing("soak", "python -m bench soak")
    loaders = res["loaders"]
    verified = sum(lo["batches_verified"] for lo in loaders)
    wrong = sum(lo["mismatches"] for lo in loaders)
    gaps = sum(lo["discontinuities"] for lo in loaders)
    tkills = sum(lo["trainer_kills"] for lo in loaders)
    wkills = sum(lo["worker_kills"] for lo in loaders)
    restarts = sum(lo["worker_restarts"] for lo in loaders)
    g, b, q = res["growth"], res["baseline"], res["quiesced"]
    fds = [s["fds"] for s in res["samples"]]
    rows = [
        ["seconds; loaders", f"{res['config']['seconds']:.0f}; {res['config']['loaders']}"],
        ["batches verified", f"{verified:,}; {wrong} wrong, {gaps} out of sequence"],
        ["trainer SIGKILLs", f"{tkills}"],
        ["worker SIGKILLs = `worker_restarts`", f"{wkills} = {restarts}"],
        [
            "server fds: no trainer, running, after",
            f"{b['fds']}, {min(fds)}-{max(fds)}, {q['fds']}",
        ],
        ["memfds; server processes, growth", f"{g['memfds']}; {g['processes']}"],
        [
            "server RSS, warm to end",
            f"{b['rss_server'] / MiB:.1f} to {q['rss_server'] / MiB:.1f} MiB "
            f"({g['rss_server'] / MiB:+.1f} MiB)",
        ],
        ["bounds held", "yes" if res["ok"] else f"no: {res['problems']}"],
    ]
    return "\n".join([table(["", "result"], rows), "", provenance([res])])


def plot_ref(r: Results, args: list[str]) -> str:
    """The figure, by its path from the page (``args[0]``; the README's by default)."""
    if not any(r.get(k) for k in data.MAKERS):
        return missing("W1", "python -m bench")
    return f"![benchmark]({args[0] if args else 'docs/bench.png'})"


def torch_suite(r: Results, args: list[str]) -> str:
    """PyTorch's own DataLoader tests with torch's DataLoader and with pinfeed's
    (``tests/torch_suite``): the outcomes of each run, the tests excluded (each with its
    reason in the result file) and those that pass with torch only."""
    res = r.get("torch-suite")
    if res is None:
        return missing("torch-suite", "make test-heavy (tests/torch_suite)")
    head = ["DataLoader", "passed", "failed", "skipped", "excluded", "regressions"]
    n_excluded = str(res["excluded"]["count"])
    rows = [
        [name, *(str(res[key][k]) for k in ("passed", "failed", "skipped")), *extra]
        for name, key, extra in (
            ("torch's", "torch", ["", ""]),
            ("pinfeed.DataLoader", "pinfeed", [n_excluded, str(len(res["regressions"]))]),
        )
    ]
    source = res["test_file"]["source"].split(",")[0]
    lines = [table(head, rows), "", f"Test file: `test/test_dataloader.py` of {source}."]
    if res["regressions"]:
        lines += ["", "Passing with torch's only:", ""]
        lines += [f"- `{name}`: {why}" for name, why in res["regressions"].items()]
    return "\n".join([*lines, "", provenance([res])])


def training_plot_ref(r: Results, args: list[str]) -> str:
    """The training benchmark's stall-share figure, by its path from the page."""
    if r.get("training") is None:
        return missing("training", "python -m bench training")
    path = args[0] if args else "docs/training-stall.png"
    return f"![stall share by system and num_workers]({path})"


# --- W9: the node's sample cache (bench.w9) ------------------------------------------------


def _epoch_cells(p: dict[str, Any], d: dict[str, Any]) -> list[str]:
    return [
        f"{verdict(pe, de)} ({num(pe['median'])}{flag(p)} vs {num(de['median'])}{flag(d)})"
        for pe, de in zip(p["epochs"], d["epochs"], strict=True)
    ]


def _costs(p: dict[str, Any], d: dict[str, Any]) -> list[str]:
    return [
        f"{p['cpu_s']['median']:.0f} vs {d['cpu_s']['median']:.0f}",
        f"{mib(p['peak_pss_bytes']['median'])} vs {mib(d['peak_pss_bytes']['median'])}",
    ]


def w9_table(res: dict[str, Any]) -> str:
    """W9's tables, from its result file: per epoch, pinfeed against DataLoader."""
    head = [
        "W9, pinfeed vs DataLoader (samples/s)",
        "epoch 1: fills the cache",
        "epoch 2",
        "epoch 3",
        "CPU s, all processes",
        "peak PSS MiB",
    ]
    rows = []
    single = (res.get("single") or {}).get("cells", {})
    for nw, by in single.items():
        p, d = by["pinfeed"], by["dataloader"]
        rows.append([f"num_workers={nw}", *_epoch_cells(p, d), *_costs(p, d)])
    for nw, by in single.items():  # the one-line switch, where the result has it
        if "pinfeed-dataloader" in by:
            p, d = by["pinfeed-dataloader"], by["dataloader"]
            title = f"`pinfeed.DataLoader(..., cache=)`, num_workers={nw}"
            rows.append([title, *_epoch_cells(p, d), *_costs(p, d)])
    cached = SYSTEM_NAMES["dataloader-cached"]
    for nw, by in single.items():  # the tuned DataLoader, where the result has it
        if "dataloader-cached" in by:
            p, d = by["pinfeed"], by["dataloader-cached"]
            title = f"pinfeed vs {cached} (its own, in shared memory), num_workers={nw}"
            rows.append([title, *_epoch_cells(p, d), *_costs(p, d)])
    jobs = (res.get("jobs") or {}).get("cells")
    if jobs:
        p, d = jobs["pinfeed"], jobs["dataloader"]
        n = res["params"]["jobs"]
        rows.append(
            [f"{n} jobs at once (1 worker each), aggregate", *_epoch_cells(p, d), *_costs(p, d)]
        )
        if "dataloader-cached" in jobs:
            d = jobs["dataloader-cached"]
            title = f"{n} jobs at once, pinfeed vs {cached} (a cache per job), aggregate"
            rows.append([title, *_epoch_cells(p, d), *_costs(p, d)])
    restart = (res.get("restart") or {}).get("cells")
    if restart:
        p, d = restart["pinfeed"], restart["dataloader"]
        rows.append(
            [
                "first epoch after a server restart (persisted cache), num_workers=2",
                *_epoch_cells(p, d),
                "",
                "",
                *_costs(p, d),
            ]
        )
    out = [table(head, rows)] if rows else []
    notes = []
    if jobs:
        misses = jobs["pinfeed"]["misses"]
        notes.append(
            f"Cache misses over the {res['params']['jobs']} loaders, each run: "
            f"{', '.join(map(str, misses))} (the dataset has {res['workload']['samples']} samples)."
        )
    sub = res.get("subset")
    if sub:
        notes.append(
            f"A cache of half the dataset (`max_bytes` {sub['max_bytes'] / MiB:,.0f} of "
            f"{sub['whole_bytes'] / MiB:,.0f} MiB): hit ratio {sub['hit_ratio_epochs_2_3']:.3f} "
            f"over epochs 2-3, `max_bytes / size` = {sub['expected']:.3f}."
        )
    prof = res.get("profile")
    if prof:
        st = prof["stage_ms"]
        roof = res["roofline"]["cell"]["samples_per_s"]["median"]
        notes.append(
            f"One process, one core, per sample: decode {st['decode']:.2f} ms, resize "
            f"{st['resize']:.2f} ms, to a CHW tensor {st['to_tensor']:.2f} ms, transform "
            f"{st['transform']:.2f} ms ({prof['transform_share']:.0%} of it); {num(roof)} "
            f"samples/s cold, {num(prof['cached_roofline_samples_per_s'])} samples/s "
            "transforming decoded samples (the cached epochs' roofline)."
        )
    if notes:
        out += ["", *notes]
    draft = res.get("draft")
    if draft:
        rows = [
            [
                size,
                f"{d['full_ms']:.1f}",
                f"{d['draft_ms']:.1f}",
                f"{d['speedup']:.2f}x",
                "yes"
                if d["bit_identical"]
                else f"no: mean {d['mean_abs_diff']:.2f}, max {d['max_abs_diff']}",
            ]
            for size, d in draft.items()
        ]
        head = [
            "JPEG, to shorter side 256",
            "full decode ms",
            '`"decode": "draft"` ms',
            "speed-up",
            "bit-identical (pixel difference, 0-255)",
        ]
        out += ["", table(head, rows)]
    out += ["", provenance([res])]
    return "\n".join(out)


def w9(r: Results, args: list[str]) -> str:
    res = r.get("W9")
    if res is None:
        return missing("W9", "python -m bench W9")
    return w9_table(res)


NODE_SYSTEMS = {
    "arbiter": "node arbiter",
    "autotune": "each loader's autotune",
    "equal": "equal static split",
    "best-static": "best static split",
}


def metrics_render(r: Results, args: list[str]) -> str:
    res = r.get("metrics-render")
    if res is None:
        return missing("metrics-render", "python -m bench metrics-render")
    cpu, wall = res["cpu_ms"], res["wall_ms"]
    loaded = (res.get("interference") or {}).get("runs_under_load")
    return (
        f"One fresh render of `/metrics` with {res['params']['loaders']} loaders, in the "
        f"server's code without HTTP ({res['params']['renders']} renders): CPU p50 "
        f"**{cpu['median']:.2f} ms** (min {cpu['min']:.2f}), wall p50 {wall['median']:.2f} ms "
        f"(min {wall['min']:.2f}){' ' + LOADED + ' under load' if loaded else ''}.\n\n"
        + provenance([res])
    )


def node(r: Results, args: list[str]) -> str:
    """Issue 26's benchmark: the arbiter against each loader's autotune, an equal split
    and the best static split; then the priority-4 trainer."""
    res = r.get("node")
    if res is None:
        return missing("node", "python -m bench node")
    cells, jobs = res["cells"], [j for j in res["jobs"] if j["name"] != "urgent"]

    def f2(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    arb = cells["arbiter"]["weighted_total"]["median"]
    head = ["system", "workers (end of run)"]
    head += [f"{j['name']} (p{j['priority']}): samples/s, stall" for j in jobs]
    head += ["weighted total", "unweighted", "arbiter's / this"]
    rows = []
    for system, label in NODE_SYSTEMS.items():
        c = cells.get(system)
        if c is None:
            continue
        split = " / ".join(str(c["split"].get(j["name"], "-")) for j in jobs)
        row = [label + flag(c), split]
        for j in jobs:
            t = c["trainers"][j["name"]]
            row.append(f"{num(t['samples_per_s']['median'])}, {pct(t['stall_share']['median'])}")
        w = c["weighted_total"]
        row.append(f"{f2(w['median'])} ({f2(w['min'])}-{f2(w['max'])})")
        row.append(f2(c["total"]["median"]))
        row.append("-" if system == "arbiter" or not w["median"] else f"{arb / w['median']:.2f}x")
        rows.append(row)
    p2 = res["phase2"]
    settle = cells["arbiter"].get("settle_s") or {}
    lines = [
        table(head, rows),
        "",
        f"Weighted total: sum of priority x (1 - stall share) over the three trainers (a "
        f"trainer never waiting counts its priority); medians of {res['params']['rounds']} "
        f"rounds, min-max in brackets. Best static split found by trying all "
        f"{len(res['sweep'])} splits of {res['params']['max_workers']} workers: "
        + " / ".join(str(res["best_split"][j["name"]]) for j in jobs)
        + f". The arbiter settled (its last kept change) {f2(settle.get('median'))} s "
        f"after the trainers started (min-max {f2(settle.get('min'))}-"
        f"{f2(settle.get('max'))}).",
        "",
        f"Phase 2: the priority-4 trainer alone made "
        f"{num((p2['alone'] or {}).get('samples_per_s'))} samples/s; started beside the "
        f"three others, {num((p2['with_others'] or {}).get('samples_per_s'))} samples/s "
        f"(**{f2(p2['share_of_alone'])}x** of alone), the arbiter's last kept change "
        f"{f2(p2['settle_s'])} s after it started; workers then "
        + ", ".join(f"{k} {v}" for k, v in p2["workers_at_end"].items())
        + f". Floors (min_workers; no waiting trainer at 0 workers) checked on "
        f"{p2['floor_checks']} polls of GET /v1/node: {len(p2['floors_broken'])} broken.",
        "",
        table(
            ["target", "value", "goal", ""],
            [
                [
                    t["target"],
                    f2(t["value"]),
                    t["goal"],
                    "met" if t["ok"] else "**missed**",
                ]
                for t in res.get("targets", [])
            ],
        ),
        "",
        provenance([res]),
    ]
    return "\n".join(lines)


S3_LAYOUTS = {
    "images": "JPEG objects, 110 KB (one a sample)",
    "tokens": "token file, 8 MiB blocks",
    "tokens-64k": "token file, 64 KiB blocks",
    "shards": "tar shards, 256 MB",
}


def s3_model(r: Results, args: list[str]) -> str:
    """docs/how-to/object-storage.md: a node's bytes, the store's, its GETs and prefixes,
    by layout and order (``bench.s3_model``)."""
    res = r.get("s3-model")
    if res is None:
        return missing("s3-model", "python -m bench s3-model")
    rows = []
    for key, shown in S3_LAYOUTS.items():
        m = res["layouts"][key]
        for order in ("global", "shard-aware"):
            o = m[order]
            rows.append(
                [
                    shown,
                    order,
                    f"{o['node_bytes_epoch'] / 1e12:.2f} TB",
                    f"{o['amplification']:.1f}",
                    f"{o['gets_per_s']:,.0f}",
                    f"{o['prefixes']:,}",
                ]
            )
    p = res["params"]
    head = ["layout (unit)", "order", "a node fetches an epoch", "the store sends (x dataset)"]
    head += ["GET/s, all nodes", f"prefixes at {res['get_per_prefix']:,} GET/s"]
    checks = "; ".join(
        f"{c['nodes']} nodes x {c['gpus']}, {c['k']} samples a unit: {c['simulated']:.4f} "
        f"simulated, {c['formula']:.4f} computed"
        for c in res.get("checks", [])
    )
    return "\n".join(
        [
            f"{p['nodes']:,} nodes x {p['gpus']} GPUs, {p['tb']:g} TB.",
            "",
            table(head, rows),
            "",
            f"The formula against the simulation: {checks}.",
            "",
            provenance([res]),
        ]
    )


ANCHOR_NAMES = {
    "pinfeed": "pinfeed (one object cache for the node)",
    "mosaic": "Mosaic Streaming (MDS, a local cache per job)",
    "litdata": "LitData (its default cache, one per dataset URL)",
    "webdataset": "WebDataset (tar shards, `pipe:curl`, no cache)",
}


def remote_anchors(r: Results, args: list[str]) -> str:
    """docs/how-to/object-storage.md: four jobs over one dataset in the store, the bytes
    and requests it served, by system and link (``bench.remote_anchors``; a result
    without links ran unthrottled)."""
    res = r.get("remote-anchors")
    if res is None:
        return missing("remote-anchors", "python -m bench remote-anchors")
    p = res["params"]
    rows = []
    for run in res["runs"]:
        rows.append(
            [
                ANCHOR_NAMES.get(run["system"], run["system"]),
                run.get("link", "unthrottled"),
                f"{run['store_bytes'] / run['dataset_bytes']:.3f}",
                f"{run['dataset_bytes'] / 1e6:.1f} MB",
                f"{run['store_requests']:,}",
                *(num(x) for x in run["epochs"]),
            ]
        )
    head = ["system", "link", "bytes fetched / dataset", "dataset (its format)", "requests"]
    head += [f"epoch {i + 1} samples/s (median job)" for i in range(p["epochs"])]
    return "\n".join(
        [
            f"{p['jobs']} jobs x {p['epochs']} epochs over W3's {p['samples']:,} JPEGs, "
            f"{p['workers']} loader worker(s) a job. "
            f"Links: {links_shown(res.get('links', {'unthrottled': (0.0, 0.0)}))}.",
            "",
            table(head, rows),
            "",
            provenance([res]),
        ]
    )


def links_shown(links: dict[str, Any]) -> str:
    """``bench.remote``'s links as a result file records them: name, bandwidth, latency."""
    return "; ".join(
        f"`{name}`: " + (f"{bw / 1e6:.0f} MB/s, {lat * 1e3:.0f} ms a request" if bw else "loopback")
        for name, (bw, lat) in links.items()
    )


REMOTE_NAMES = {
    "pinfeed": "pinfeed (the node's object cache)",
    "dataloader-s3": "DataLoader, a GET a sample in its workers",
    "pinfeed-local": "pinfeed over the same files on local disk",
}


def remote(r: Results, args: list[str]) -> str:
    """docs/how-to/object-storage.md: one loader over W3's JPEGs in the store, by link
    and system (``bench.remote``), and the object cache's eviction rules."""
    res = r.get("remote")
    if res is None:
        return missing("remote", "python -m bench remote")
    p = res["params"]
    rows = []
    for key, c in res["cells"].items():
        link, system = key.split("/")
        local = system == "pinfeed-local"
        mb = c["store_bytes"]["median"]
        rows.append(
            [
                "-" if local else link,
                REMOTE_NAMES.get(system, system),
                *(ranged(e) for e in c["epochs"]),
                ranged(c["first_batch_s"], lambda x: "-" if x is None else f"{x:.2f} s"),
                "-" if local or mb is None else f"{mb / 1e6:.1f} MB",
                "-" if local else num(c["store_requests"]["median"]),
            ]
        )
    head = ["link", "system"]
    head += [f"epoch {i + 1} samples/s" for i in range(p["epochs"])]
    head += ["first batch", "from the store", "requests"]
    links = links_shown(res["links"])
    lines = [
        f"{p['samples']:,} JPEGs ({res['dataset_bytes'] / 1e6:.1f} MB), batch 64, "
        f"{p['workers']} workers, {p['runs']} runs a cell (median [min-max]). Links: {links}.",
        "",
        table(head, rows),
    ]
    cache = res.get("cache")
    if cache:
        # a result from before the cache counted them has no ``wasted``
        counted = all("wasted" in c for c in cache["rules"].values())
        crow = [
            [
                rule,
                ", ".join(f"{g:,}" for g in c["gets"]),
                ", ".join(f"{h:.2f}" for h in c["hit_ratio"]),
                *([", ".join(f"{w:,}" for w in c["wasted"])] if counted else []),
            ]
            for rule, c in cache["rules"].items()
        ]
        chead = ["eviction rule", "GETs by epoch", "hit ratio by epoch"]
        chead += ["fetched ahead, evicted unread (by epoch's end)"] if counted else []
        lines += [
            "",
            f"A dataset twice the object cache's size ({cache['samples']:,} objects, "
            f"{cache['dataset_bytes'] / 1e6:.1f} MB, cache {cache['cache_bytes'] / 1e6:.1f} MB), "
            "three epochs; GETs counted while the trainer reads each epoch (the look-ahead "
            "fetches the next epoch's first objects before it ends); hit ratio 1 - GETs / "
            "samples (below zero: more GETs than objects, the next epoch's or objects fetched "
            "ahead, evicted before their use and fetched again):",
            "",
            table(chead, crow),
        ]
    return "\n".join([*lines, "", provenance([res])])


LLM_NAMES = {
    "pinfeed": "pinfeed, named loader (`mixture` over packed `tokens`)",
    "pinfeed-dataloader": "pinfeed.DataLoader(Mixture of Packed)",
    "dataloader": "DataLoader(Mixture of Packed)",
    "hf": "HF interleave_datasets + DataCollatorWithFlattening, DataLoader",
    "hf-whole": "HF interleave_datasets, rows made whole ahead, DataLoader",
}


def _against(c: dict[str, Any], base: dict[str, Any] | None, metric: str) -> str:
    a, b = c[metric]["median"], (base or {}).get(metric, {}).get("median")
    return "-" if not a or not b else f"{a / b:.2f}x"


def llm(r: Results, args: list[str]) -> str:
    """``bench.llm``: a three-source mixture packed to 2,048, per training step,
    system and num_workers, each against HF's pipeline at the same step and workers."""
    res = r.get("llm")
    if res is None:
        return missing("llm", "python -m bench llm")
    rows = []
    for step, by in res["cells"].items():
        first = True
        for system in [s for s in LLM_NAMES if s in by]:
            for nw, c in by[system].items():

                def f2(x: float | None) -> str:
                    return "-" if x is None else f"{x:.2f}"

                base = (by.get("hf") or {}).get(nw)
                rows.append(
                    [
                        ("flat out" if float(step) == 0 else f"{step} ms (sleep)") if first else "",
                        LLM_NAMES[system] + flag(c),
                        nw,
                        ranged(c["samples_per_s"]),
                        _against(c, base, "samples_per_s"),
                        ranged(c["stall_share"], pct),
                        ranged(c["trainer_cpu_ms_per_batch"], f2),
                        _against(c, base, "trainer_cpu_ms_per_batch"),
                        f2(c["trainer_children_cpu_ms_per_batch"]["median"]),
                        f2(c["server_cpu_ms_per_batch"]["median"]),
                        f2(c["total_cpu_ms_per_batch"]["median"]),
                    ]
                )
                first = False
    head = [
        "training step",
        "system",
        "num_workers",
        "samples/s (rows of 2,048)",
        "against HF (higher: faster)",
        "stall share",
        "trainer CPU ms/batch (own process)",
        "against HF (lower: less)",
        "its children (DataLoader workers)",
        "server tree",
        "all",
    ]
    src = ", ".join(
        f"{s['name']} {s['weight']:g} ({s['tokens'] / 1e6:.1f}M tokens, {s['rows']:,} rows)"
        for s in res["sources"]
    )
    p = res["params"]
    return "\n".join(
        [
            f"Sources: {src}; batch {res['batch_size']} rows of {res['seq_len']:,} tokens; "
            f"{p['batches']} timed batches a run, {p['runs']} run(s) a cell (median "
            f"[min-max]); against HF: against `hf` at the same step and num_workers. Made "
            f"ahead, not timed: HF's packed rows in {res['prepare'].get('hf_pack_s', 0):.1f} s, "
            f"made whole in {res['prepare'].get('hf_whole_s', 0):.1f} s more.",
            "",
            table(head, rows),
            "",
            provenance([res]),
        ]
    )


def llm_table(res: dict[str, Any] | None) -> str:
    return section_from(llm, "llm", res, [])


RENDERERS: dict[str, Callable[[Results, list[str]], str]] = {
    "headline": headline,
    "throughput": throughput,
    "costs": costs,
    "roofline": roofline,
    "handoff": handoff,
    "null": null,
    "scaling": scaling,
    "training": training,
    "autotune": autotune,
    "w4-profile": w4_profile,
    "first-batch": first_batch,
    "follow": follow,
    "one-line": one_line,
    "scale": scale,
    "scale-detail": scale_detail,
    "control": control,
    "node": node,
    "metrics-render": metrics_render,
    "control-detail": control_detail,
    "control-targets": control_targets,
    "ray": ray,
    "gpu": gpu,
    "soak": soak,
    "w9": w9,
    "s3-model": s3_model,
    "remote-anchors": remote_anchors,
    "remote": remote,
    "llm": llm,
    "plot": plot_ref,
    "training-plot": training_plot_ref,
    "torch-suite": torch_suite,
}
