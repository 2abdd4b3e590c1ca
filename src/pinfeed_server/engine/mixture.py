"""A loader over several datasets by weight (``"mixture"`` on a loader): its
declaration, the positions its plan maps to the sources' samples, and what it has
served of each source.

The rule is ``pinfeed.mixing``'s (any rank, worker and run computes it). A mixture
loader's plan is DataLoader's over the epoch's positions, unshuffled (the positions are
already drawn at random), sharded by ``world_size`` as DistributedSampler shards them;
position ``i`` of epoch ``e`` is then the sample the rule draws for it. So the batches
are those of ``DataLoader(pinfeed.Mixture(sources, weights, seed=seed, ...),
batch_size, sampler=DistributedSampler(..., shuffle=False))`` after ``set_epoch(e)``,
and every guarantee of a plan over positions holds for the mixture: resume, elastic
resume (each position of the interrupted epoch once over the new world), replay. The
loader's ``shuffle`` is each source's own (a source may say otherwise).

Weights changed between runs: a loader's state names its mixture (``pinfeed.elastic``'s
``Plan.mixture``, a digest of the rule without the seed); a state saved at an epoch's
end (or start) loads into a loader of another mixture, which makes the following
epochs by its own rule; a state saved inside an epoch loads only into the same
mixture (an ``InvalidState`` says so): that epoch's positions were drawn by the old
rule, and the new one would repeat or skip samples of it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pinfeed import mixing
from pinfeed.mixing import Rule
from pinfeed_server.metric import built

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class SourceServed(BaseModel):
    """A mixture's source: what its trainers took of it, against its weight."""

    dataset: str
    weight: float = Field(description="its weight, normalised")
    samples: int = Field(description="samples its trainers took (batches taken, not made)")
    tokens: int = Field(description="their tokens, where the source counts them (tokens)")
    proportion: float | None = Field(description="its share of the samples taken so far")


class MixtureSource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = Field(pattern=NAME, description="a registered map-style dataset")
    weight: float = Field(gt=0, description="its share of the positions (normalised)")
    shuffle: bool | None = Field(
        None, description="its own order shuffled, each pass anew (null: the loader's shuffle)"
    )


class MixtureSpec(BaseModel):
    """``"mixture"`` on a loader: its sources and its epoch. A list of sources alone is
    accepted as ``{"sources": [...]}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: list[MixtureSource] = Field(min_length=1, max_length=256)
    samples: int | None = Field(
        None, ge=1, le=1 << 40, description="positions an epoch (or give until)"
    )
    until: str | None = Field(
        None,
        pattern=NAME,
        description="an epoch takes this source whole, once, and the others by weight "
        "(rule 'quota')",
    )
    rule: Rule = Field(
        "interleave",
        description="interleave: independent draws, HF interleave_datasets' stream; quota: "
        "exact counts each epoch in a random order",
    )

    @model_validator(mode="before")
    @classmethod
    def _a_list(cls, data: Any) -> Any:
        return {"sources": data} if isinstance(data, list) else data

    @model_validator(mode="after")
    def _names(self) -> MixtureSpec:
        names = [s.dataset for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"a mixture names each dataset once: {names}")
        if self.until is not None and self.until not in names:
            raise ValueError(f"until {self.until!r} is not one of the sources {names}")
        return self

    @property
    def names(self) -> list[str]:
        return [s.dataset for s in self.sources]

    def rule_for(self, lengths: Sequence[int], shuffle: bool) -> mixing.Mixing:
        """The rule over sources of ``lengths``; ``ValueError`` says why not."""
        return mixing.Mixing.of(
            lengths,
            [s.weight for s in self.sources],
            samples=self.samples if self.until is None else None,
            until=None if self.until is None else self.names.index(self.until),
            rule=self.rule,
            shuffle=[shuffle if s.shuffle is None else s.shuffle for s in self.sources],
        )


class Positions:
    """A mixture loader's positions -> the concatenated sources' samples (``Sources``
    numbering), epoch by epoch."""

    def __init__(self, rule: mixing.Mixing, seed: int) -> None:
        self.rule = rule
        self.draws = mixing.EpochDraws(rule, seed)
        self.offsets = np.concatenate([[0], np.cumsum(rule.lengths)]).astype(np.int64)

    @property
    def digest(self) -> str:
        return self.rule.digest()

    def samples(self, epoch: int, positions: Any) -> Any:
        """The samples at ``positions`` (a tensor of positions) of ``epoch``."""
        draws = self.draws(epoch)
        p = np.asarray(positions, dtype=np.int64)
        return self.offsets[draws.sources[p]] + draws.samples[p]


class Served:
    """What a mixture loader's trainers have taken of each source: samples and tokens.
    The engine notes each batch's per-source counts when it plans the batch and adds
    them when a trainer takes it (O(sources) a batch; the notes of batches not taken
    are dropped at a seek)."""

    def __init__(self, names: Sequence[str], weights: Sequence[float], sources: Any) -> None:
        self.names = list(names)
        self.sources = sources
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self._lock = threading.Lock()
        self._notes: dict[tuple[int, int], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        self.samples = np.zeros(len(names), dtype=np.int64)
        self.tokens = np.zeros(len(names), dtype=np.int64)

    def planned(self, epoch: int, index: int, indices: Sequence[int]) -> None:
        counts = np.bincount(self.sources.sources_of(indices), minlength=len(self.names))
        tokens = self.sources.tokens_in(indices)
        with self._lock:
            self._notes[(epoch, index)] = (counts, tokens)

    def taken(self, epoch: int, index: int) -> None:
        with self._lock:
            note = self._notes.pop((epoch, index), None)
            if note is not None:
                self.samples += note[0]
                self.tokens += note[1]

    def forget(self) -> None:
        with self._lock:
            self._notes.clear()

    def report(self) -> list[SourceServed]:
        """Per source: samples and tokens served, the share realised and the weight."""
        with self._lock:
            samples, tokens = self.samples.copy(), self.tokens.copy()
        total = int(samples.sum())
        return [
            built(
                SourceServed,
                {
                    "dataset": name,
                    "weight": weight,
                    "samples": int(n),
                    "tokens": int(t),
                    "proportion": (int(n) / total) if total else None,
                },
            )
            for name, weight, n, t in zip(self.names, self.weights, samples, tokens, strict=True)
        ]


def served_by(spec: MixtureSpec, dataset: Any) -> Served:
    """The counts of a mixture loader over ``dataset`` (its sources, or their
    ``Transformed``)."""
    sources = getattr(dataset, "dataset", dataset)
    return Served(spec.names, [s.weight for s in spec.sources], sources)


def mixture_of(plan: Any) -> str | None:
    """A mixture loader's rule digest (its plan's positions), or None."""
    positions = getattr(plan, "positions", None)
    return positions.digest if isinstance(positions, Positions) else None
