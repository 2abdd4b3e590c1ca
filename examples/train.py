"""Train a toy classifier on batches served by pinfeed.

    python examples/train.py --device cpu --epochs 3
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 ... examples/train.py --device cuda

The script is what a trainer beside a pinfeed server looks like:

1. over HTTP (``client.Client``, ``PINFEED_URL``/``PINFEED_TOKEN``) it registers its
   dataset and loader if they are missing, so the first run sets them up and every
   later run (a restart, the next job) attaches to the warm queue that is already
   there;
2. over the node's Unix socket (``pinfeed.Loader``, ``PINFEED_SOCKET``) it pulls
   batches; ``for x, y in loader:`` is one epoch, exactly as with DataLoader.

Any loader whose batches are ``(inputs, integer labels)`` works: the model's input
width is read from the first batch, so ``--loader demo`` (``pinfeed serve --demo``)
works as well as the script's own ``toy`` dataset.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank uses its own loader
``<loader>-rank<r>`` with ``rank`` and ``world_size`` set: each node's server, given
the same ``--seed``, hands each rank a disjoint shard (DistributedSampler semantics),
with no coordination between the servers. The model is wrapped in DDP.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from pinfeed import Client, Conflict, InvalidRequest, Loader, NotFound


def toy_dataset(length: int, seed: int) -> dict[str, Any]:
    """Seeded synthetic images (3x32x32 float32) with 10 integer classes."""
    return {
        "length": length,
        "seed": seed,
        "fields": [
            {"shape": [3, 32, 32], "dtype": "float32", "low": 0, "high": 1},
            {"shape": [], "dtype": "int64", "low": 0, "high": 10},
        ],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loader", default="toy", help="loader name on the server")
    ap.add_argument("--dataset", default="toy", help="dataset the loader reads")
    ap.add_argument("--length", type=int, default=256, help="samples in the toy dataset")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-workers", type=int, default=2, help="server-side workers")
    ap.add_argument("--seed", type=int, default=0, help="shuffle and init seed (same on all ranks)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--classes", type=int, default=10, help="labels must be below this")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--save", default=None, help="write the trained weights here")
    return ap.parse_args(argv)


def pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda was asked for, but this process sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def ensure_loader(args: argparse.Namespace, name: str, rank: int, world: int, pin: bool) -> None:
    """Create the dataset and the loader unless they exist (first run on this node)."""
    with Client() as admin:
        try:
            admin.dataset(args.dataset)
        except NotFound:
            try:
                admin.create_dataset(args.dataset, "synthetic", toy_dataset(args.length, args.seed))
                print(f"created dataset {args.dataset!r}", flush=True)
            except Conflict:
                pass  # another rank on this node created it first
        try:
            admin.loader(name)
            return
        except NotFound:
            pass
        config: dict[str, Any] = {
            "batch_size": args.batch_size,
            "shuffle": True,
            "seed": args.seed,  # the shared seed: every rank's shard comes from one permutation
            "drop_last": True,
            "num_workers": args.num_workers,
            "pin_memory": pin,
        }
        if world > 1:
            config |= {"rank": rank, "world_size": world}
        try:
            admin.create_loader(name, dataset=args.dataset, **config)
            print(f"created loader {name!r}", flush=True)
        except Conflict:
            pass
        except InvalidRequest as exc:
            if world > 1:
                sys.exit(f"the server refused a sharded loader (rank/world_size): {exc}")
            raise


def build_model(in_features: int, classes: int) -> nn.Module:
    # LayerNorm first: the demo dataset's int64 pixels and the toy's floats both train.
    return nn.Sequential(
        nn.LayerNorm(in_features),
        nn.Linear(in_features, 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(args.device, local_rank)
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    name = args.loader if world == 1 else f"{args.loader}-rank{rank}"
    ensure_loader(args, name, rank, world, pin=device.type == "cuda")

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    loss_fn = nn.CrossEntropyLoss()
    # On CUDA the loader copies each batch to the device with non_blocking=True from the
    # pinned ring; on CPU the batch is a zero-copy view, valid until the next batch.
    with Loader(name, device=device if device.type == "cuda" else None) as loader:
        print(
            f"rank {rank}/{world}: loader {name!r}, {len(loader)} batches per epoch, "
            f"device {device}",
            flush=True,
        )
        for epoch in range(args.epochs):
            start, total, correct, seen, steps = time.perf_counter(), 0.0, 0, 0, 0
            for x, y in loader:
                x = x.flatten(1).to(torch.float32)
                y = y.to(torch.long)
                if model is None:
                    model = build_model(x.shape[1], args.classes).to(device)
                    if world > 1:
                        model = nn.parallel.DistributedDataParallel(model)
                    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
                assert opt is not None
                logits = model(x)
                loss = loss_fn(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item() * len(y)
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
                steps += 1
            if seen == 0:
                sys.exit(f"loader {name!r} yielded no batch in epoch {epoch}")
            print(
                f"epoch {epoch + 1}/{args.epochs} loss {total / seen:.4f} "
                f"acc {correct / seen:.3f} ({steps} batches, "
                f"{seen / (time.perf_counter() - start):.0f} samples/s)",
                flush=True,
            )

    assert model is not None
    if args.save and rank == 0:
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        torch.save(module.state_dict(), args.save)
        print(f"saved {args.save}", flush=True)
    if world > 1:
        # Every rank gets here before any tears the group down: a rank that destroys
        # its group while a peer is still saving or talking to it can hang or fail.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
