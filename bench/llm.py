"""A language model's input: three token corpora mixed 0.6/0.3/0.1 and packed to 2,048.

    python -m bench llm [--quick] [--steps 0,40] [--workers 0,2] [--runs 1]

The data: three flat uint16 token files (``tokens`` kind, GPT-2's EOS 50256 after each
document), "web" (documents of a few hundred tokens), "code" (about a thousand) and
"books" (tens of thousands), 6M, 3M and 1M tokens at full size. Each source is packed
greedily (its documents and their EOS one stream, cut every 2,048 tokens; a row's
``position_ids`` restart at each document, its ``labels`` are ``-100`` at each
document's first token: ``DataCollatorWithFlattening``'s convention) and the packed
rows of the three are mixed by weight, batch 8 (16,384 tokens). Systems:

- ``pinfeed``: a named loader over HTTP with ``"mixture"`` over the three files
  registered as ``tokens`` datasets with ``"pack": "greedy"``, ``collate_fn``
  ``pinfeed.packing:collate``; the trainer reads it with ``pinfeed.Loader``.
- ``pinfeed-dataloader``: ``pinfeed.DataLoader(pinfeed.Mixture([pinfeed.Packed(...)]))``
  with ``collate_fn=pinfeed.packing.collate``, over ``Documents`` of the same files.
- ``dataloader``: torch's DataLoader over those very objects.
- ``hf``: Hugging Face's way: each source a ``datasets.Dataset`` of packed rows (the
  datasets-side greedy pack: ``.map(batched=True)`` over its documents, each row kept as
  its 2,048 tokens and its segments' lengths; made once and saved, not timed), mixed by
  ``datasets.interleave_datasets(probabilities=[0.6, 0.3, 0.1])``, read by torch's
  DataLoader (``shuffle=True``) whose ``collate_fn`` is transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` over the batch's
  segments (its ``[1, 16384]`` output viewed as ``[8, 2048]``).
- ``hf-whole``: the same with all of that done ahead: each row's ``labels`` and
  ``position_ids`` made by the collator in a second ``.map`` and saved, read
  ``.with_format("torch")`` and stacked (``pinfeed.packing.collate``: a stack and the
  cumulative lengths, what any collate_fn of packed rows does); the most work moved
  out of the loop, at three times the rows' storage.

All four give the trainer the same batch: ``input_ids``, ``labels``, ``position_ids``
(int64, ``[8, 2048]``) and the flattened batch's ``cu_seqlens`` and ``max_seqlen``.
Each (step, system, ``num_workers``) runs in a fresh trainer process
(``bench.trainer``'s training loop, ``--step-kind`` sleep: the trainer's CPU idle
while the GPU would compute): samples/s (packed rows), the stall share (time blocked
in ``next()``), the trainer's own CPU per batch, its children's (DataLoader's
workers) and the server tree's. Step 0 is the loader flat out. Writes
``docs/results/llm.json``; its table is in docs/benchmarks/details.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import data, results

SEQ_LEN = 2048
BATCH = 8
EOS = 50256
VOCAB = 50257
SYSTEMS_MEASURED = ("pinfeed", "pinfeed-dataloader", "dataloader", "hf", "hf-whole")


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    tokens: int  # at scale 1
    log_mean: float  # documents' lengths: lognormal(log_mean, log_sd), at least 8
    log_sd: float


SOURCES = (
    Source("web", 0.6, 6_000_000, 5.8, 1.0),
    Source("code", 0.3, 3_000_000, 6.8, 1.0),
    Source("books", 0.1, 1_000_000, 10.3, 0.4),
)
WEIGHTS = [s.weight for s in SOURCES]


def generate(root: Path, scale: float) -> list[Path]:
    """The three token files (cached under ``root/llm``): documents of random tokens,
    each ended by EOS, to at least the source's token count."""
    folder = root / "llm"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, s in enumerate(SOURCES):
        want = max(4 * SEQ_LEN, int(s.tokens * scale))
        path = folder / f"{s.name}-{want}.bin"
        if not path.exists():
            rng = np.random.default_rng(100 + k)
            docs, n = [], 0
            while n < want:
                length = max(8, int(rng.lognormal(s.log_mean, s.log_sd)))
                doc = rng.integers(0, EOS, length + 1, dtype=np.uint16)
                doc[-1] = EOS
                docs.append(doc)
                n += len(doc)
            tmp = path.with_suffix(".tmp")
            np.concatenate(docs).tofile(tmp)
            tmp.rename(path)
        paths.append(path)
    return paths


class Documents:
    """A token file's documents (each with its EOS), ``lengths`` for ``pinfeed.Packed``;
    pickles as its path (``pinfeed.DataLoader`` ships it to the server)."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._open()

    def _open(self) -> None:
        self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        ends = np.flatnonzero(np.asarray(self.tokens) == EOS) + 1
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.lengths = (ends - self.starts).astype(np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._open()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        start = int(self.starts[i])
        return np.asarray(self.tokens[start : start + int(self.lengths[i])])


def mixture(paths: list[str], samples: int) -> Any:
    """``pinfeed.Mixture`` of the sources packed greedily: what the named loader reads."""
    from pinfeed import Mixture, Packed

    packed = [Packed(Documents(p), SEQ_LEN, mode="greedy") for p in paths]
    return Mixture(packed, WEIGHTS, samples=samples, seed=0)


# --- Hugging Face's side -----------------------------------------------------------------


def _pack_rows(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The datasets-side greedy pack of a ``.map(batched=True)`` batch of documents
    (``run_clm``'s ``group_texts``: the batch's last partial row dropped): rows of
    ``SEQ_LEN`` tokens and the lengths of their segments (a document cut at a row's
    edge is two segments)."""
    docs = [np.asarray(d, dtype=np.int64) for d in batch["input_ids"]]
    stream = np.concatenate(docs)
    rows = len(stream) // SEQ_LEN
    edges = np.cumsum([len(d) for d in docs])
    out_ids, out_lengths = [], []
    for r in range(rows):
        lo, hi = r * SEQ_LEN, (r + 1) * SEQ_LEN
        cuts = edges[(edges > lo) & (edges < hi)]
        bounds = np.concatenate([[lo], cuts, [hi]])
        out_ids.append(stream[lo:hi].tolist())
        out_lengths.append(np.diff(bounds).tolist())
    return {"input_ids": out_ids, "lengths": out_lengths}


def _flatten_each(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Rows of ``_pack_rows`` made whole ahead: each row's ``input_ids``, ``labels`` and
    ``position_ids`` by ``DataCollatorWithFlattening`` over its segments."""
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ids, lengths in zip(batch["input_ids"], batch["lengths"], strict=True):
        row = flatten_rows([{"input_ids": ids, "lengths": lengths}])
        for k in out:
            out[k].append(row[k][0].numpy())
    return out


def hf_rows_whole(folder: Path) -> Path:
    """``hf_rows``' rows with their labels and position ids made and saved ahead."""
    whole = folder.with_name(folder.name + "-whole")
    if whole.exists():
        return whole
    import datasets

    rows = datasets.load_from_disk(str(folder))
    made = rows.map(_flatten_each, batched=True, batch_size=100, remove_columns=["lengths"])
    tmp = whole.with_name(whole.name + ".tmp")
    made.save_to_disk(str(tmp))
    tmp.rename(whole)
    return whole


def hf_rows(path: Path) -> Path:
    """Source ``path`` as a saved ``datasets.Dataset`` of packed rows (made once)."""
    folder = path.with_name(f"hf-{path.stem}-{SEQ_LEN}")
    if folder.exists():
        return folder
    import datasets

    docs = Documents(str(path))
    ds = datasets.Dataset.from_dict({"input_ids": [docs[i].tolist() for i in range(len(docs))]})
    packed = ds.map(_pack_rows, batched=True, batch_size=1000, remove_columns=["input_ids"])
    tmp = folder.with_name(folder.name + ".tmp")
    packed.save_to_disk(str(tmp))
    tmp.rename(folder)
    return folder


_FLATTEN: Any = None


def flatten_rows(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The HF side's ``collate_fn``: transformers' ``DataCollatorWithFlattening`` over
    every segment of the batch's rows, its ``[1, batch * SEQ_LEN]`` viewed as rows."""
    global _FLATTEN
    if _FLATTEN is None:
        from transformers import DataCollatorWithFlattening

        _FLATTEN = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)
    features = []
    for row in rows:
        ids, at = row["input_ids"], 0
        for n in row["lengths"]:
            features.append({"input_ids": ids[at : at + n]})
            at += n
    out = _FLATTEN(features)
    b = len(rows)
    return {
        "input_ids": out["input_ids"].view(b, SEQ_LEN),
        "labels": out["labels"].view(b, SEQ_LEN),
        "position_ids": out["position_ids"].view(b, SEQ_LEN),
        "cu_seqlens": out["cu_seq_lens_q"],
        "max_seqlen": torch.tensor(out["max_length_q"], dtype=torch.int32),
    }


# --- the systems, in the trainer process (bench.trainer runs them by spec["module"]) ------


def _pinfeed(spec: dict[str, Any]) -> tuple[Any, float]:
    from bench.trainer import attach
    from pinfeed import Client

    admin = Client(spec["url"])
    name = spec["loader"]
    t0 = time.perf_counter()
    nw = spec["num_workers"]
    admin.create_loader(
        name,
        dataset=None,
        mixture={
            "sources": [
                {"dataset": d, "weight": w} for d, w in zip(spec["datasets"], WEIGHTS, strict=True)
            ],
            "samples": spec["samples"],
        },
        batch_size=BATCH,
        shuffle=True,
        seed=0,
        num_workers=nw,
        persistent_workers=nw > 0,
        prefetch_factor=2,
        collate_fn="pinfeed.packing:collate",
    )
    return attach(admin, name, spec["socket"], t0)


def _mixture_loader(spec: dict[str, Any], switched: bool) -> tuple[Any, float]:
    """torch's DataLoader (or, ``switched``, ``pinfeed.DataLoader``) over
    ``pinfeed.Mixture`` of ``pinfeed.Packed`` sources; the mixture's positions are
    already random (``shuffle=False``), ``set_epoch`` before each epoch."""
    from torch.utils.data import DataLoader

    import pinfeed
    from bench.trainer import Run, _dataloader_args
    from pinfeed import packing

    ds = mixture(spec["paths"], spec["samples"])
    extra: dict[str, Any] = {"socket": spec["socket"]} if switched else {}
    cls: Any = pinfeed.DataLoader if switched else DataLoader
    t0 = time.perf_counter()
    dl = cls(
        ds,
        batch_size=BATCH,
        shuffle=False,
        collate_fn=packing.collate,
        **_dataloader_args(spec),
        **extra,
    )
    epoch = iter(range(1 << 30))

    def new_epoch() -> Any:
        ds.set_epoch(next(epoch))
        return iter(dl)

    run = Run(new_epoch, dl.close if switched else lambda: None)
    run.start()
    return run, time.perf_counter() - t0


def _hf(spec: dict[str, Any]) -> tuple[Any, float]:
    import datasets
    from torch.utils.data import DataLoader

    from bench.trainer import Run, _dataloader_args

    t0 = time.perf_counter()
    parts = [datasets.load_from_disk(p) for p in spec["hf_paths"]]
    mixed = datasets.interleave_datasets(
        parts, probabilities=WEIGHTS, seed=0, stopping_strategy="first_exhausted"
    )
    dl = DataLoader(
        mixed, batch_size=BATCH, shuffle=True, collate_fn=flatten_rows, **_dataloader_args(spec)
    )
    run = Run(lambda: iter(dl), lambda: None)
    run.start()
    return run, time.perf_counter() - t0


def _hf_whole(spec: dict[str, Any]) -> tuple[Any, float]:
    import datasets
    from torch.utils.data import DataLoader

    from bench.trainer import Run, _dataloader_args
    from pinfeed import packing

    t0 = time.perf_counter()
    parts = [datasets.load_from_disk(p).with_format("torch") for p in spec["hf_whole_paths"]]
    mixed = datasets.interleave_datasets(
        parts, probabilities=WEIGHTS, seed=0, stopping_strategy="first_exhausted"
    )
    dl = DataLoader(
        mixed,
        batch_size=BATCH,
        shuffle=True,
        collate_fn=packing.collate,
        **_dataloader_args(spec),
    )
    run = Run(lambda: iter(dl), lambda: None)
    run.start()
    return run, time.perf_counter() - t0


SYSTEMS = {
    "pinfeed": _pinfeed,
    "pinfeed-dataloader": lambda spec: _mixture_loader(spec, switched=True),
    "dataloader": lambda spec: _mixture_loader(spec, switched=False),
    "hf": _hf,
    "hf-whole": _hf_whole,
}


# --- the driver ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench llm", description=__doc__)
    ap.add_argument("--systems", default=",".join(SYSTEMS_MEASURED))
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--steps", default="0,40", help="training-step stand-ins, ms (0: flat out)")
    ap.add_argument("--batches", type=int, default=250, help="timed batches a run")
    ap.add_argument("--runs", type=int, default=1, help="runs a cell (ABC, then CBA order)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies each source's tokens")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1/10 the data, nw 2")
    ap.add_argument("--data-dir", type=Path, default=data.DATA_DIR)
    ap.add_argument("--out", type=Path, default=results.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.batches, args.workers = min(args.scale, 0.1), 30, "2"
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {sorted(SYSTEMS)}")
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    args.step_list = [float(x) for x in args.steps.split(",") if x.strip()]
    return args


def _rows_of(path: Path) -> int:
    from pinfeed import Packed

    return len(Packed(Documents(str(path)), SEQ_LEN, mode="greedy"))


def _measure(srv: Any, spec: dict[str, Any], run: int) -> dict[str, Any]:
    """One fresh trainer process of ``spec``: its record, the load before and after."""
    from bench.procs import run_trainers

    load = os.getloadavg()
    served = spec["system"].startswith("pinfeed")
    (res,), mem = run_trainers([spec], server_pid=srv.pid if served else None)
    n = res["batches"]
    server_ms = mem["server_tree_cpu_s"] / n * 1e3
    rec = {
        "system": spec["system"],
        "num_workers": spec["num_workers"],
        "step_ms": spec["step_ms"],
        "run": run,
        **res,
        **mem,
        "loadavg_before": list(load),
        "loadavg_after": list(os.getloadavg()),
        "server_cpu_ms_per_batch": server_ms,
        "total_cpu_ms_per_batch": res["trainer_tree_cpu_s"] / n * 1e3 + server_ms,
    }
    print(
        f"  step {spec['step_ms']:g} ms nw={spec['num_workers']} {spec['system']:<18} "
        f"{res['samples_per_s']:7.1f} samples/s  stall {res['stall_share']:6.1%}  trainer "
        f"{res['trainer_cpu_ms_per_batch']:6.2f} ms/batch  children "
        f"{res['trainer_children_cpu_ms_per_batch']:6.2f}  server {server_ms:6.2f}  "
        f"load {load[0]:.2f}",
        flush=True,
    )
    return rec


def main(argv: list[str] | None = None) -> int:
    from bench import tables
    from bench.procs import BenchError
    from bench.server import BenchServer
    from bench.suite import cell, loader_name, order
    from bench.training import METRICS

    args = parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    result = results.start("llm", vars(args))
    t = time.perf_counter()
    paths = generate(args.data_dir, args.scale)
    rows = [_rows_of(p) for p in paths]
    samples = sum(rows)  # an epoch: as many positions as the sources have rows
    prepare: dict[str, float] = {"generate_s": time.perf_counter() - t}
    hf_paths: list[Path] = []
    whole_paths: list[Path] = []
    if {"hf", "hf-whole"} & set(args.system_list):
        t = time.perf_counter()
        hf_paths = [hf_rows(p) for p in paths]
        prepare["hf_pack_s"] = time.perf_counter() - t
    if "hf-whole" in args.system_list:
        t = time.perf_counter()
        whole_paths = [hf_rows_whole(p) for p in hf_paths]
        prepare["hf_whole_s"] = time.perf_counter() - t
    result |= {
        "kind": "llm",
        "seq_len": SEQ_LEN,
        "batch_size": BATCH,
        "sources": [
            {"name": s.name, "weight": s.weight, "tokens": int(p.stat().st_size // 2), "rows": r}
            for s, p, r in zip(SOURCES, paths, rows, strict=True)
        ],
        "epoch_samples": samples,
        "prepare": prepare,
        "runs": [],
        "cells": {},
    }
    systems = tuple(args.system_list)
    try:
        with BenchServer(args.data_dir) as srv:
            names = []
            with srv.client() as admin:
                for s, p in zip(SOURCES, paths, strict=True):
                    name = loader_name(f"llm-{s.name}")
                    params = {
                        "path": str(p.relative_to(args.data_dir)),
                        "seq_len": SEQ_LEN,
                        "eos": EOS,
                        "pack": "greedy",
                    }
                    admin.create_dataset(name, "tokens", params)
                    names.append(name)
            for step in args.step_list:
                for nw in args.worker_counts:
                    for run in range(args.runs):
                        for system in order(systems, run):
                            spec = {
                                "module": "bench.llm",
                                "system": system,
                                "mode": "training",
                                "num_workers": nw,
                                "train_batches": args.batches,
                                "step_ms": step,
                                "step_kind": "sleep",
                                "url": srv.url,
                                "socket": str(srv.socket),
                                "loader": loader_name("llm"),
                                "datasets": names,
                                "paths": [str(p) for p in paths],
                                "hf_paths": [str(p) for p in hf_paths],
                                "hf_whole_paths": [str(p) for p in whole_paths],
                                "samples": samples,
                            }
                            rec = _measure(srv, spec, run)
                            result["runs"].append(rec)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    for step in args.step_list:
        by: dict[str, Any] = {}
        for system in systems:
            for nw in args.worker_counts:
                rs = [
                    r
                    for r in result["runs"]
                    if r["system"] == system and r["num_workers"] == nw and r["step_ms"] == step
                ]
                by.setdefault(system, {})[str(nw)] = cell(rs, METRICS)
        result["cells"][f"{step:g}"] = by
    path = results.write(results.finish(result, result["runs"]), args.out)
    print(f"wrote {path}")
    print(tables.llm_table(results.load("llm", args.out)))
    return 0
