"""A dataset in S3 at internet scale, on paper but computed: ``python -m bench s3-model``.

1,000 nodes x 8 GPUs reading a 100 TB dataset from one S3 bucket through pinfeed's node
object cache, four layouts as the cache cuts them into units (``remote/objects.py``):
``images`` (a JPEG an object, ImageNet's mean 110 KB: a sample is its unit),
``tokens`` (a token file in ``PINFEED_REMOTE_BLOCK_BYTES`` blocks, 8 MiB, windows of
1,024 uint16 tokens; ``tokens-64k``: the smallest blocks the setting allows) and
``shards`` (WebDataset tars of 256 MB, whole-object units).

Per node and epoch, the bytes the store sends are the units its samples touch. Under
DataLoader's global order (``DistributedSampler`` over the whole dataset, pinfeed's
default: each of the ``nodes x gpus`` ranks a random slice of one permutation), a unit
of ``k`` samples is touched by a node with probability ``1 - (1 - 1/nodes)^k``, so a
node fetches ``D * (1 - (1 - 1/nodes)^k)`` bytes an epoch. Under a shard-aware order
(each node reads a stated subset of the units, WebDataset's or Mosaic's), ``D / nodes``.
The node's cache needs those bytes to serve epoch 2 without the store. Epoch 1's GETs
a second: every node's units over the epoch's length (``D / sample / (nodes x gpus x
rate)``); against S3's documented 5,500 GET/s per prefix (partitioned prefix), the
prefixes the keys must be spread over.

The closed form is checked against a simulation at a scale that runs here, with
torch's ``DistributedSampler`` (the order a loader's plan is) and pinfeed's own
``Manifest`` (the units a sample's bytes fall in): ``--check`` (on by default).
Writes ``docs/results/s3-model.json``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from bench import results
from pinfeed_server.remote.objects import Manifest, ObjectInfo

GET_PER_PREFIX = 5_500  # S3: GET/HEAD requests a second per partitioned prefix
TB = 10**12

# layout: (sample bytes, unit bytes, samples a GPU reads a second)
LAYOUTS = {
    "images": (110_000, 110_000, 2_000.0),  # ResNet-50-class step on a current GPU
    "tokens": (2 * 1_025, 8 << 20, 50.0),  # ~50k tokens/s a GPU, windows of 1,024 + 1
    "tokens-64k": (2 * 1_025, 64 << 10, 50.0),  # the same in the smallest blocks allowed
    "shards": (110_000, 256_000_000, 2_000.0),
}


def model(
    nodes: int, gpus: int, dataset: float, sample: int, unit: int, rate: float
) -> dict[str, Any]:
    k = max(1, unit // sample)  # samples a unit holds
    units = dataset / unit
    touched = 1 - (1 - 1 / nodes) ** k  # share of the units a node touches
    epoch_s = dataset / sample / (nodes * gpus * rate)
    out: dict[str, Any] = {"samples_per_unit": k, "epoch_s": epoch_s}
    for order, share in (("global", touched), ("shard-aware", 1 / nodes)):
        per_node = dataset * share  # bytes a node fetches in epoch 1 (its cache's need)
        gets = nodes * units * share / epoch_s
        out[order] = {
            "node_bytes_epoch": per_node,
            "store_bytes_epoch": per_node * nodes,
            "amplification": per_node * nodes / dataset,
            "cache_bytes_node": per_node,
            "gets_per_s": gets,
            "prefixes": math.ceil(gets / GET_PER_PREFIX),
            "node_gbit_s": per_node * 8 / epoch_s / 1e9,
        }
    return out


def simulate(nodes: int, gpus: int, samples: int, k: int, seed: int = 0) -> float:
    """The share of a dataset's units one node touches in an epoch of DataLoader's
    global order: its ranks' ``DistributedSampler`` slices, the units each sample's
    bytes fall in by pinfeed's ``Manifest`` (one object, blocks of ``k`` samples)."""
    size = 1_000  # bytes a sample
    obj = ObjectInfo("b", "k", samples * size, "e")
    manifest = Manifest("s3://b/k", "http://s", [obj], k * size)
    shares = []
    for node in range(min(nodes, 4)):
        idx = np.concatenate(
            [
                np.fromiter(
                    DistributedSampler(
                        range(samples),  # type: ignore[arg-type]
                        num_replicas=nodes * gpus,
                        rank=node * gpus + g,
                        seed=seed,
                    ),
                    dtype=np.int64,
                )
                for g in range(gpus)
            ]
        )
        first, _ = manifest.spans(0, idx * size, idx * size + size)
        shares.append(len(np.unique(first)) / len(manifest))
    return float(np.mean(shares))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench s3-model", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--nodes", type=int, default=1_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--tb", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="(the same: it runs in seconds)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = results.start("s3-model", {"nodes": args.nodes, "gpus": args.gpus, "tb": args.tb})
    result |= {"kind": "s3-model", "method": __doc__, "get_per_prefix": GET_PER_PREFIX}
    result["layouts"] = {}
    print(f"{args.nodes} nodes x {args.gpus} GPUs, {args.tb:g} TB")
    for name, (sample, unit, rate) in LAYOUTS.items():
        m = model(args.nodes, args.gpus, args.tb * TB, sample, unit, rate)
        m |= {"sample_bytes": sample, "unit_bytes": unit, "samples_per_gpu_s": rate}
        result["layouts"][name] = m
        for order in ("global", "shard-aware"):
            o = m[order]
            print(
                f"{name:<7} {order:<12} node {o['node_bytes_epoch'] / TB:8.2f} TB/epoch "
                f"(x{o['amplification']:7.1f} the dataset from the store), cache "
                f"{o['cache_bytes_node'] / TB:8.2f} TB, {o['gets_per_s']:12,.0f} GET/s = "
                f"{o['prefixes']:7,} prefixes, {o['node_gbit_s']:7.1f} Gbit/s a node; "
                f"epoch {m['epoch_s']:,.0f} s"
            )
    if args.check:
        checks = []
        for nodes, gpus, samples, k in (
            (16, 8, 200_000, 8),
            (16, 8, 200_000, 64),
            (64, 2, 100_000, 16),
        ):
            sim = simulate(nodes, gpus, samples, k)
            formula = 1 - (1 - 1 / nodes) ** k
            checks.append(
                {
                    "nodes": nodes,
                    "gpus": gpus,
                    "samples": samples,
                    "k": k,
                    "simulated": sim,
                    "formula": formula,
                }
            )
            print(
                f"check: {nodes} nodes x {gpus}, {k} samples a unit: simulated {sim:.4f}, "
                f"formula {formula:.4f}"
            )
        result["checks"] = checks
    results.finish(result)
    print(f"wrote {results.write(result, args.out)}")
    return 0
