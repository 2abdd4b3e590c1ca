"""``python -m bench``: every benchmark, then the report.

    python -m bench                 # everything that runs on this machine, then the report
    python -m bench --quick         # the same as a smoke run (minutes)
    python -m bench --only suite,training
    python -m bench <section> ...   # one section: its own options (--help)
    python -m bench W4 ...          # one workload of the suite (W9: the w9 section)
    python -m bench report [--check]

Each section writes ``docs/results/<name>.json`` (``bench.results``); ``report`` makes
every table in README.md and ``docs/**/*.md`` from those files (``bench.report``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Section:
    name: str
    module: str
    function: str = "main"
    what: str = ""
    quick: list[str] = field(default_factory=lambda: ["--quick"])
    # minutes at full size on the 2-core development machine (from its quick runs)
    minutes: float = 0.0
    available: Callable[[], str | None] = lambda: None  # a reason it cannot run here
    data_dir: bool = True  # takes --data-dir (the generated workload files' cache)

    def run(self, argv: list[str]) -> int:
        fn = getattr(importlib.import_module(self.module), self.function)
        saved = sys.argv
        sys.argv = [saved[0], self.name, *argv]  # what its result file records as command
        try:
            return int(fn(argv) or 0)
        finally:
            sys.argv = saved


def _cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs CUDA"


def _anchors() -> str | None:
    missing = [m for m in ("streaming", "litdata", "webdataset") if not importlib.util.find_spec(m)]
    if missing:
        return f"needs {', '.join(missing)}: pip install -e '.[anchors]'"
    return None


def _hf() -> str | None:
    missing = [m for m in ("datasets", "transformers") if not importlib.util.find_spec(m)]
    if missing:
        return f"needs {', '.join(missing)}: pip install -e '.[bench]'"
    return None


def _ray() -> str | None:
    if os.environ.get("PINFEED_BENCH_RAY") != "1":
        return "needs root and network namespaces: set PINFEED_BENCH_RAY=1 to include it"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and `ip` (network namespaces)"
    return None


SECTIONS = [
    Section("suite", "bench.suite", what="W1-W8: throughput, roofline, handoff", minutes=27),
    Section("null", "bench.null", what="the fixed cost per batch, beside its floor", minutes=4),
    Section("scaling", "bench.suite", "scaling_main", "1, 2, 4 trainers on one server", minutes=3),
    Section("training", "bench.training", what="a training step: stall, trainer CPU", minutes=6),
    Section("w9", "bench.w9", what="W9: the node's sample cache and transforms", minutes=40),
    Section("autotune", "bench.autotune", what="autotune against fixed settings", minutes=9),
    Section("scale", "bench.scale", what="datasets at real size", minutes=5, data_dir=False),
    Section("w4-profile", "bench.profile_w4", what="where W4's CPU goes", minutes=0.5),
    Section("node", "bench.node", what="one node, several trainers: the arbiter", minutes=14),
    Section(
        "metrics-render",
        "bench.metrics_render",
        what="one fresh /metrics render, 50 loaders",
        quick=["--renders", "50"],
        minutes=0.3,
        data_dir=False,
    ),
    Section("control", "bench.control", what="the control plane under load", minutes=5),
    Section(
        "first-batch",
        "bench.first_batch",
        what="DataLoader(...) to its first batch",
        minutes=2,
        data_dir=False,
    ),
    Section("follow", "bench.follow", what="following the trainer's objects, per epoch", minutes=3),
    Section("remote", "bench.remote", what="a dataset in S3: epochs 1-2, Belady vs LRU", minutes=6),
    Section(
        "remote-anchors",
        "bench.remote_anchors",
        what="4 jobs on one S3 dataset: pinfeed, Mosaic, LitData, WebDataset",
        minutes=8,
        available=_anchors,
    ),
    Section(
        "s3-model",
        "bench.s3_model",
        what="1,000 nodes x 8 GPUs on 100 TB in S3",
        minutes=0.3,
        data_dir=False,
    ),
    Section(
        "llm",
        "bench.llm",
        what="3 token sources mixed 0.6/0.3/0.1, packed to 2,048: against HF's way",
        minutes=5,
        available=_hf,
    ),
    Section("soak", "bench.soak", what="SIGKILLs, every batch checked", minutes=2, data_dir=False),
    Section("ray", "bench.ray", "main", "executor ray against local", [], 4, _ray, False),
    Section("gpu", "bench.gpu", "main", "H2D copies, GPU idle share", ["--quick"], 3, _cuda, False),
]
BY_NAME = {s.name: s for s in SECTIONS}
DEFAULT_ARGS = {"soak": ["--seconds", "90"]}


def run_all(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="every section as a smoke run")
    ap.add_argument("--only", default="", help="comma-separated sections")
    ap.add_argument("--skip", default="", help="comma-separated sections")
    ap.add_argument("--list", action="store_true", help="list the sections and exit")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of result files (default docs/results/; elsewhere, the docs are left "
        "alone: check them with python -m bench report --results DIR --check)",
    )
    ap.add_argument("--data-dir", type=Path, default=None, help="generated workload files")
    args = ap.parse_args(argv)
    if args.list:
        for s in SECTIONS:
            why = s.available()
            print(f"{s.name:<11} ~{s.minutes:4.1f} min  {s.what}" + (f"  ({why})" if why else ""))
        print(f"{'total':<11} ~{sum(s.minutes for s in SECTIONS if not s.available()):4.1f} min")
        return 0
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    unknown = (only | skip) - set(BY_NAME)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {sorted(BY_NAME)}")
    failed: list[str] = []
    t0 = time.monotonic()
    for s in SECTIONS:
        if (only and s.name not in only) or s.name in skip:
            continue
        why = s.available()
        if why:
            print(f"== {s.name}: skipped ({why})")
            continue
        sub = list(s.quick if args.quick else DEFAULT_ARGS.get(s.name, []))
        if args.out is not None:
            sub += ["--out", str(args.out)]
        if args.data_dir is not None and s.data_dir:
            sub += ["--data-dir", str(args.data_dir)]
        print(f"== {s.name}: {s.what} (python -m bench {' '.join([s.name, *sub])})", flush=True)
        t = time.monotonic()
        try:
            rc = s.run(sub)
        except Exception as exc:  # one section's failure must not lose the others
            print(f"== {s.name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            rc = 1
        print(f"== {s.name}: {'ok' if rc == 0 else f'exit {rc}'} in {time.monotonic() - t:.0f} s")
        if rc:
            failed.append(s.name)
    from bench import report

    if args.out is None:
        report.main([])
    else:
        print(f"results in {args.out}; the docs are left as they are")
    print(
        f"all sections in {time.monotonic() - t0:.0f} s" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    head = argv[0] if argv else ""
    if head == "report":
        from bench import report

        return report.main(argv[1:])
    if head in BY_NAME:
        return BY_NAME[head].run(argv[1:])
    if head.upper() == "W9":  # its own driver (per epoch, four jobs, a restart)
        return BY_NAME["w9"].run(argv[1:])
    if head.upper() in ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8"):
        from bench import suite

        return suite.main(["--workloads", head, *argv[1:]])
    return run_all(argv)


raise SystemExit(main(sys.argv[1:]))
