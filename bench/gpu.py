"""Host-to-device copies and GPU idle share, on a machine with CUDA.

    python -m bench.gpu [--num-workers 4] [--samples 1024] [--steps 200]

1. H2D bandwidth of one batch (float32 [64, 3, 224, 224], 38.5 MB), timed with CUDA
   events on a side stream:
   - ``pageable``: an ordinary CPU tensor;
   - ``pinned``: the same tensor after ``pin_memory()`` (torch's best case);
   - ``ring``: a batch view yielded by ``pinfeed.Loader`` (the server's ring, registered
     with ``cudaHostRegister`` by the client) - the copy pinfeed's device path makes;
   - ``loader_device``: end to end through ``pinfeed.Loader(device="cuda")``: bursts of
     batches taken from a full ring (so the producer is not what is measured), wall
     time to the last copy's completion.
   The target: ``ring`` and ``loader_device`` >= 90% of ``pinned``.
2. GPU idle share of a small CNN training step fed by each: pinfeed
   ``Loader(device="cuda")``; DataLoader with ``pin_memory=True`` and ``.to(cuda,
   non_blocking=True)``; DataLoader with pageable memory. Busy time is the sum over steps
   of CUDA-event time from "batch on the device" to "optimizer step done" on the compute
   stream; idle share = 1 - busy / (first step start .. last step end). A copy on the
   compute stream (DataLoader's ``.to``) counts as idle: no compute runs during it.

Writes ``docs/results/gpu.json``. Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import results
from bench.server import BenchServer

BATCH = 64
SHAPE = (3, 224, 224)
DATASET_FILE = "gpu.pt"


def _check_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        print(
            "bench/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA runtime {built}). Run it on a GPU node; "
            "`python -m bench` covers the CPU-side benchmarks.",
            file=sys.stderr,
        )
        raise SystemExit(2)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def copy_gbps(src: Any, iters: int = 20) -> float:
    """H2D GB/s of ``src`` -> a device tensor, ``non_blocking`` on a side stream."""
    import torch

    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    stream = torch.cuda.Stream()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        start.record(stream)
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    return _gbps(src.numel() * src.element_size() * iters, seconds)


def _write_dataset(root: Path, samples: int) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.rand((samples, *SHAPE), generator=g, dtype=torch.float32)
    y = torch.randint(0, 10, (samples,), generator=g, dtype=torch.int64)
    torch.save((x, y), root / DATASET_FILE)


def _forever(epochs: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    while True:
        yield from epochs()


def _wait_full(admin: Any, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = admin.loader(name).get("slots", {})
        # Slots whose copy is still pending on the client count as leased.
        if slots.get("ready", 0) + slots.get("leased", 0) >= slots.get("total", 1):
            return
        time.sleep(0.02)


def h2d(srv: BenchServer, dataset: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pinfeed import Client, Loader

    out: dict[str, Any] = {"batch_bytes": BATCH * 4 * 3 * 224 * 224}
    pageable = torch.rand((BATCH, *SHAPE))
    out["pageable_gbps"] = copy_gbps(pageable)
    out["pinned_gbps"] = copy_gbps(pageable.pin_memory())

    admin = Client(srv.url)
    # Views of the ring: a pin_memory loader, so the client registers the ring with CUDA.
    admin.create_loader(
        "gpu-ring", dataset=dataset, batch_size=BATCH, num_workers=1, pin_memory=True
    )
    with Loader("gpu-ring", socket=srv.socket) as loader:
        out["ring_cuda_registered"] = loader.cuda_registered
        batch = next(iter(loader))
        x = batch[0]
        out["ring_view_is_pinned"] = bool(x.is_pinned())
        out["ring_gbps"] = copy_gbps(x)
        del x, batch  # no view may outlive the mapping
    admin.delete_loader("gpu-ring")

    # End to end through Loader(device="cuda"), in bursts from a full ring.
    nw, pf = args.num_workers, args.prefetch_factor
    admin.create_loader(
        "gpu-device",
        dataset=dataset,
        batch_size=BATCH,
        num_workers=nw,
        pin_memory=True,
        prefetch_factor=pf,
    )
    bursts = []
    with Loader("gpu-device", socket=srv.socket, device="cuda") as loader:
        batches = _forever(lambda: iter(loader))
        for _ in range(2):
            next(batches)
        burst = max(2, loader.nslots - 2)
        for _ in range(args.bursts):
            torch.cuda.synchronize()
            _wait_full(admin, "gpu-device")
            t0 = time.perf_counter()
            for _ in range(burst):
                batch = next(batches)
            torch.cuda.synchronize()
            bursts.append(_gbps(burst * out["batch_bytes"], time.perf_counter() - t0))
            del batch
        out["loader_device_cuda_registered"] = loader.cuda_registered
    admin.delete_loader("gpu-device")
    admin.close()
    out["loader_device_gbps"] = statistics.median(bursts)
    out["loader_device_bursts_gbps"] = bursts
    out["loader_device_burst_batches"] = burst
    out["ring_vs_pinned"] = out["ring_gbps"] / out["pinned_gbps"]
    out["loader_device_vs_pinned"] = out["loader_device_gbps"] / out["pinned_gbps"]
    return out


def _model() -> Any:
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt


def train(batches: Iterator[Any], steps: int, to_device: bool) -> dict[str, Any]:
    """Run ``steps`` training steps; return GPU idle share and samples/s."""
    import torch
    import torch.nn.functional as F

    model, opt = _model()
    stream = torch.cuda.current_stream()
    events: list[tuple[Any, Any]] = []
    warmup = 5
    t0 = 0.0
    for step in range(steps + warmup):
        if step == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = next(batches)
        if to_device:
            x = x.to("cuda", non_blocking=True)
            y = y.to("cuda", non_blocking=True)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        end.record(stream)
        if step >= warmup:
            events.append((start, end))
        del x, y
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy_ms = sum(s.elapsed_time(e) for s, e in events)
    span_ms = events[0][0].elapsed_time(events[-1][1])
    return {
        "steps": steps,
        "gpu_idle_share": max(0.0, 1.0 - busy_ms / span_ms),
        "gpu_busy_ms_per_step": busy_ms / steps,
        "samples_per_s": steps * BATCH / wall,
    }


def idle_share(
    srv: BenchServer, dataset: str, root: Path, args: argparse.Namespace
) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from pinfeed import Client, Loader
    from pinfeed_server.datasets import DatasetContext, build_dataset

    out: dict[str, Any] = {}
    nw = args.num_workers
    with Client(srv.url) as admin:
        admin.create_loader(
            "gpu-train",
            dataset=dataset,
            batch_size=BATCH,
            shuffle=True,
            seed=0,
            num_workers=nw,
            pin_memory=True,
            prefetch_factor=args.prefetch_factor,
        )
        with Loader("gpu-train", socket=srv.socket, device="cuda") as loader:
            out["pinfeed_device"] = train(_forever(lambda: iter(loader)), args.steps, False)
        admin.delete_loader("gpu-train")
    ds = build_dataset("tensors", {"path": DATASET_FILE}, DatasetContext(root))
    for label, pin in (("dataloader_pinned", True), ("dataloader_pageable", False)):
        dl = DataLoader(
            ds,
            batch_size=BATCH,
            shuffle=True,
            num_workers=nw,
            pin_memory=pin,
            persistent_workers=nw > 0,
            prefetch_factor=args.prefetch_factor if nw > 0 else None,
            generator=torch.Generator().manual_seed(0),
        )
        out[label] = train(_forever(lambda dl=dl: iter(dl)), args.steps, True)
        del dl
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument(
        "--prefetch-factor",
        type=int,
        default=8,
        help="ring slots = num_workers x this; bursts take nearly all",
    )
    ap.add_argument("--samples", type=int, default=1024, help="dataset length")
    ap.add_argument("--steps", type=int, default=200, help="training steps per feed")
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 40 steps, 2 bursts")
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.bursts = 40, 2
    _check_cuda()
    envelope = results.start("gpu", vars(args))
    foreign = results.ForeignCpu().start()
    import torch

    with tempfile.TemporaryDirectory(prefix="pinfeed-gpu-") as tmp:
        root = Path(tmp)
        _write_dataset(root, args.samples)
        with BenchServer(root) as srv:
            from pinfeed import Client

            with Client(srv.url, timeout=300) as admin:
                admin.create_dataset("gpu", "tensors", {"path": DATASET_FILE})
            result = envelope | {
                "kind": "gpu",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "num_workers": args.num_workers,
                "prefetch_factor": args.prefetch_factor,
                "batch": [BATCH, *SHAPE],
                "h2d": h2d(srv, "gpu", args),
                "training": idle_share(srv, "gpu", root, args),
            }
    result["foreign"] = foreign.stop()
    path = results.write(results.finish(result, [result]), args.out)
    h = result["h2d"]
    print(
        f"{result['device']}: H2D GB/s pageable {h['pageable_gbps']:.1f}, pinned "
        f"{h['pinned_gbps']:.1f}, pinfeed ring view {h['ring_gbps']:.1f} "
        f"({h['ring_vs_pinned']:.0%} of pinned), Loader(device='cuda') "
        f"{h['loader_device_gbps']:.1f} ({h['loader_device_vs_pinned']:.0%})"
    )
    for feed, r in result["training"].items():
        print(
            f"  {feed:<20} GPU idle {r['gpu_idle_share']:.0%}  "
            f"{r['samples_per_s']:,.0f} samples/s  busy {r['gpu_busy_ms_per_step']:.2f} ms/step"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
