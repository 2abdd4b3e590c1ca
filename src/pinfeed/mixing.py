"""The mixing rule: which source each position of an epoch draws from, and which of that
source's samples it gets, as a pure function of (seed, epoch, position).

A mixture has S sources of ``n_s`` samples and weights ``w_s`` (normalised to
probabilities ``p_s = w_s / sum(w)``). Epoch ``e`` has ``N`` positions; position ``i``
draws from source ``c_e[i]``, and its ``k``-th draw from source ``s`` in the epoch
(``k`` counted from 0, over positions ``< i``) is that source's sample
``order_{s,e,k // n_s}[k % n_s]``: a source is read in its own order, pass after pass,
each sample once per pass. Nothing depends on a rank, a world size, a worker or a
position reached: every process that knows the rule computes the same arrays.

Source choice (``c_e``), by ``rule``:

- ``"interleave"`` (the default): independent draws, Hugging Face ``datasets``'
  ``interleave_datasets(probabilities=p, seed=seed + e)`` exactly: blocks of 1,000
  from ``np.random.default_rng(seed + e).choice(S, size=1000, p=p)``, concatenated,
  cut to ``N``. Realised proportions are binomial: over ``N`` positions a source's
  share is within ``4 * sqrt(p (1 - p) / N)`` of ``p`` (at 1 M positions, 0.2
  percentage points) but for odds of about 1 in 15,000.
- ``"quota"``: exact counts, random order (Mosaic Streaming's ``proportion``
  semantics): source ``s`` gets ``floor(N p_s)`` positions plus one for the
  ``N - sum floor(N p_s)`` largest remainders (ties to the lower source), and the
  positions are ``np.random.default_rng(seed + e).permutation`` of that multiset. Every
  epoch realises the weights to within one sample per source.

Epoch length: ``samples=N``; or ``until=s`` (``"quota"`` only): the epoch takes every
sample of source ``s`` exactly once (``c_s = n_s``) and ``round(n_s p_t / p_s)`` of
each other source ``t``, so its length is the same every epoch. (HF's
``first_exhausted`` ends where a source runs out under independent draws: a length that
changes with the seed and the epoch, which a batch plan of fixed length cannot give.)
A source needed more than once in an epoch repeats, each pass in a new order.

Each source's own order (``shuffle``): ``arange(n_s)`` unshuffled, else
``np.random.default_rng([seed, e, s, q]).permutation(n_s)`` for pass ``q``: what HF's
``Dataset.shuffle(generator=np.random.default_rng([seed, e, s, 0]))`` gives for the
first pass.

How this compares with the anchors: HF ``interleave_datasets`` with probabilities is
the same choice stream (``tests/features/test_mixture_anchors.py`` checks it sample for
sample, with HF's ``all_exhausted`` cycling an unshuffled source as pinfeed repeats
it). torchdata's ``MultiNodeWeightedSampler`` draws a separate stream per rank
(``torch.multinomial`` on a generator seeded from ``seed * world_size + rank`` and the
epoch), so the mixture a job sees depends on its world size and a rank's draws cannot
be recomputed by another world: pinfeed draws one stream per epoch and shards its
positions as ``DistributedSampler`` shards a dataset, which keeps the mixture the same
at any world size and makes an elastic resume exact.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Rule = Literal["interleave", "quota"]
RULES: tuple[Rule, ...] = ("interleave", "quota")
BLOCK = 1000  # HF's draws per rng.choice call: part of the stream's definition


@dataclass(frozen=True)
class Draws:
    """One epoch of a mixture: per position, its source and that source's sample."""

    sources: np.ndarray[Any, np.dtype[np.int64]]
    samples: np.ndarray[Any, np.dtype[np.int64]]

    def counts(self, n_sources: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return np.bincount(self.sources, minlength=n_sources)


@dataclass(frozen=True)
class Mixing:
    """A mixture's definition: what every rank, worker and run must agree on."""

    lengths: tuple[int, ...]  # samples per source
    probabilities: tuple[float, ...]  # the weights, normalised
    samples: int  # positions per epoch
    rule: Rule = "interleave"
    shuffle: tuple[bool, ...] = ()  # per source
    until: int | None = None  # the source an epoch takes whole (then samples follows)

    @classmethod
    def of(
        cls,
        lengths: Sequence[int],
        weights: Sequence[float],
        *,
        samples: int | None = None,
        until: int | None = None,
        rule: Rule = "interleave",
        shuffle: bool | Sequence[bool] = True,
    ) -> Mixing:
        """The rule for sources of ``lengths`` and ``weights``; ``samples`` positions an
        epoch, or ``until`` (a source's index) to take that source whole once.
        ``ValueError`` says what is wrong."""
        n = len(lengths)
        if n == 0 or len(weights) != n:
            raise ValueError(
                f"a mixture needs one weight per source ({n} sources, {len(weights)} weights)"
            )
        if rule not in RULES:
            raise ValueError(f"rule {rule!r}: one of {RULES}")
        if any(int(x) <= 0 for x in lengths):
            raise ValueError(f"every source needs samples (lengths {list(lengths)})")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"weights must be positive and finite: {list(weights)}")
        p = tuple(float(x) for x in w / w.sum())
        flags = (bool(shuffle),) * n if isinstance(shuffle, bool) else tuple(map(bool, shuffle))
        if len(flags) != n:
            raise ValueError(f"shuffle: one flag per source ({n}), got {len(flags)}")
        if (samples is None) == (until is None):
            raise ValueError("give the epoch's length: samples=N, or until=<a source>")
        if until is not None:
            if rule != "quota":
                raise ValueError(
                    "until (an epoch that takes one source whole) needs rule 'quota': with "
                    "independent draws ('interleave') its length would change every epoch"
                )
            if not 0 <= until < n:
                raise ValueError(f"until: source {until} of {n}")
            samples = sum(_until_counts(tuple(map(int, lengths)), p, until))
        assert samples is not None
        if samples <= 0:
            raise ValueError(f"samples must be positive, got {samples}")
        return cls(tuple(map(int, lengths)), p, int(samples), rule, flags, until)

    def to_json(self) -> dict[str, Any]:
        return {
            "lengths": list(self.lengths),
            "probabilities": list(self.probabilities),
            "samples": self.samples,
            "rule": self.rule,
            "shuffle": list(self.shuffle),
            "until": self.until,
        }

    def digest(self) -> str:
        """What identifies the rule (not its seed) in a loader's state."""
        text = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def counts(self) -> np.ndarray[Any, np.dtype[np.int64]] | None:
        """Positions per source in every epoch (``"quota"``), or None (``"interleave"``)."""
        if self.rule != "quota":
            return None
        if self.until is not None:
            return np.asarray(_until_counts(self.lengths, self.probabilities, self.until))
        return _largest_remainder(self.samples, self.probabilities)

    def choices(self, seed: int, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The source of every position of ``epoch``."""
        rng = np.random.default_rng(seed + epoch)
        n = len(self.lengths)
        counts = self.counts()
        if counts is not None:
            return np.asarray(rng.permutation(np.repeat(np.arange(n), counts)), dtype=np.int64)
        blocks = math.ceil(self.samples / BLOCK)
        p = list(self.probabilities)
        drawn = [rng.choice(n, size=BLOCK, p=p) for _ in range(blocks)]
        return np.concatenate(drawn)[: self.samples].astype(np.int64)

    def order(self, seed: int, epoch: int, source: int, rounds: int) -> np.ndarray[Any, Any]:
        """Source ``source``'s samples over its first ``rounds`` passes of ``epoch``."""
        n = self.lengths[source]
        if not self.shuffle[source]:
            return np.tile(np.arange(n, dtype=np.int64), rounds)
        return np.concatenate(
            [np.random.default_rng([seed, epoch, source, q]).permutation(n) for q in range(rounds)]
        ).astype(np.int64)

    def draws(self, seed: int, epoch: int) -> Draws:
        """Every position of ``epoch``: its source and that source's sample."""
        sources = self.choices(seed, epoch)
        samples = np.empty(len(sources), dtype=np.int64)
        for s in range(len(self.lengths)):
            where = np.flatnonzero(sources == s)
            if len(where):
                rounds = math.ceil(len(where) / self.lengths[s])
                samples[where] = self.order(seed, epoch, s, rounds)[: len(where)]
        return Draws(sources, samples)


def _largest_remainder(total: int, p: Sequence[float]) -> np.ndarray[Any, np.dtype[np.int64]]:
    exact = np.asarray(p, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    # the largest remainders first, ties to the lower source (a stable sort)
    counts[np.argsort(-(exact - counts), kind="stable")[:left]] += 1
    return counts


def _until_counts(lengths: tuple[int, ...], p: Sequence[float], until: int) -> list[int]:
    return [
        lengths[until] if t == until else max(1, round(lengths[until] * p[t] / p[until]))
        for t in range(len(lengths))
    ]


class EpochDraws:
    """A process's cache of a mixture's draws: the latest two epochs (a running epoch and
    the next, made ahead), computed once each."""

    def __init__(self, mixing: Mixing, seed: int) -> None:
        self.mixing = mixing
        self.seed = seed
        self._epochs: dict[int, Draws] = {}
        self._lock = threading.Lock()  # the engine's producer and a replay may both ask

    def __call__(self, epoch: int) -> Draws:
        with self._lock:
            draws = self._epochs.get(epoch)
            if draws is None:
                draws = self.mixing.draws(self.seed, epoch)
                if len(self._epochs) >= 2:  # keep the one nearer to this epoch
                    self._epochs.pop(max(self._epochs, key=lambda e: abs(e - epoch)))
                self._epochs[epoch] = draws
            return draws

    def __getstate__(self) -> dict[str, Any]:
        return {"mixing": self.mixing, "seed": self.seed}  # each process draws its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["mixing"], state["seed"])  # type: ignore[misc]
