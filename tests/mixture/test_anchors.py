"""pinfeed's "interleave" rule against Hugging Face ``datasets``' own
``interleave_datasets(probabilities=..., seed=...)``, sample for sample; and why
torchdata's ``MultiNodeWeightedSampler`` is not the same rule (its streams are per
rank: the mixture of a job changes with its world size)."""

from __future__ import annotations

import numpy as np
import pytest

from pinfeed.mixing import Mixing

datasets = pytest.importorskip("datasets")

LENGTHS = (300, 120, 45)
WEIGHTS = (0.55, 0.3, 0.15)


def _sources(shuffle_with: list[np.random.Generator] | None = None) -> list[object]:
    """Source s holds ids s * 1000 + i: a sample says its source and its index."""
    out = []
    for s, n in enumerate(LENGTHS):
        ds = datasets.Dataset.from_dict({"id": [s * 1000 + i for i in range(n)]})
        if shuffle_with is not None:
            ds = ds.shuffle(generator=shuffle_with[s])
        out.append(ds)
    return out


def _pinfeed_ids(mixing: Mixing, seed: int, epoch: int) -> list[int]:
    draws = mixing.draws(seed, epoch)
    return (draws.sources * 1000 + draws.samples).tolist()


@pytest.mark.parametrize("epoch", [0, 3])
def test_interleave_equals_hf_sample_for_sample(epoch: int) -> None:
    seed = 17
    p = list(Mixing.of(LENGTHS, WEIGHTS, samples=1).probabilities)
    # all_exhausted: HF cycles a source that runs out from its start, as pinfeed repeats
    # an unshuffled one; its stream runs until every source ran out at least once
    hf = datasets.interleave_datasets(
        _sources(), probabilities=p, seed=seed + epoch, stopping_strategy="all_exhausted"
    )["id"]
    mixing = Mixing.of(LENGTHS, WEIGHTS, samples=len(hf), shuffle=False)
    assert _pinfeed_ids(mixing, seed, epoch) == hf
    # first_exhausted: HF stops where a source runs out; up to there, the same
    first = datasets.interleave_datasets(_sources(), probabilities=p, seed=seed + epoch)["id"]
    assert _pinfeed_ids(mixing, seed, epoch)[: len(first)] == first


def test_shuffled_sources_equal_hf_over_shuffled_datasets_in_their_first_pass() -> None:
    seed, epoch = 5, 2
    p = list(Mixing.of(LENGTHS, WEIGHTS, samples=1).probabilities)
    gens = [np.random.default_rng([seed, epoch, s, 0]) for s in range(len(LENGTHS))]
    hf = datasets.interleave_datasets(
        _sources(gens), probabilities=p, seed=seed + epoch, stopping_strategy="first_exhausted"
    )["id"]
    mixing = Mixing.of(LENGTHS, WEIGHTS, samples=len(hf), shuffle=True)
    assert _pinfeed_ids(mixing, seed, epoch) == hf


def test_torchdata_draws_per_rank_so_its_mixture_depends_on_the_world_size() -> None:
    nodes = pytest.importorskip("torchdata.nodes")
    from torchdata.nodes.samplers.multi_node_weighted_sampler import _WeightedSampler

    def sources(rank: int, world: int) -> list[str]:
        w = {"a": 0.55, "b": 0.3, "c": 0.15}
        sampler = _WeightedSampler(w, seed=1, rank=rank, world_size=world, epoch=0)
        return [next(sampler) for _ in range(12)]

    assert nodes is not None
    # The same global positions under 2 and 4 ranks: torchdata's rank 0 of 2 and rank 0
    # of 4 draw different streams; pinfeed's positions are one stream whatever the world.
    assert sources(0, 2) != sources(0, 4)
    mixing = Mixing.of(LENGTHS, WEIGHTS, samples=48)
    stream = mixing.choices(0, 0)
    assert np.array_equal(stream[0::2][::2], stream[0::4])  # position 4k: rank 0 of 4
