"""Mixtures and packing over HTTP on a real server: a loader with ``"mixture"`` over
registered datasets (``npy`` ids, packed ``tokens`` files) yields DataLoader's batches
over ``pinfeed.Mixture`` (and ``pinfeed.Packed``) at ``num_workers`` 0 and 2; it resumes
mid-epoch; 4 ranks checkpointed mid-epoch resume on 3 with every position of the epoch
(every sample of every source) delivered once; a replay gives the batch again; a state
loads into a mixture of other weights only between epochs; and what each source served
shows in ``GET /v1/loaders/{name}`` and ``/metrics``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, DistributedSampler

from pinfeed import Client, InvalidState, Loader, Mixture, Packed, merge_states, packing
from tests.api.test_datasets import _problem
from tests.conftest import Server
from tests.helpers import assert_same, unique
from tests.reliability.procs import wait_for

SIZES = (120, 60, 30)
WEIGHTS = (0.5, 0.3, 0.2)
SEED = 5
EOS = 0


class Ids(Dataset[Any]):
    """What the ``npy`` source s holds: row i is (s, i)."""

    def __init__(self, source: int, n: int) -> None:
        self.rows = torch.tensor([[source, i] for i in range(n)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return [self.rows[i]]  # the npy kind's sample: a list of its arrays' rows


@pytest.fixture(scope="module")
def ids(server: Server) -> list[str]:
    names = []
    with server.client() as admin:
        for s, n in enumerate(SIZES):
            name = unique(f"ids{s}")
            path = Path(server.data_root) / f"{name}.npy"
            np.save(path, np.array([[s, i] for i in range(n)], dtype=np.int64))
            admin.create_dataset(name, "npy", {"paths": [path.name]})
            names.append(name)
    return names


def _docs(seed: int, count: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [
        np.append(rng.integers(1, 500, size=int(n)), EOS) for n in rng.integers(1, 60, size=count)
    ]


@pytest.fixture(scope="module")
def token_files(server: Server) -> list[tuple[str, list[np.ndarray[Any, Any]], str]]:
    out = []
    with server.client() as admin:
        for s, mode in enumerate(("greedy", "best_fit", "best_fit")):
            docs = _docs(s, 80 + 40 * s)
            name = unique(f"tok{s}")
            np.concatenate(docs).astype(np.uint16).tofile(Path(server.data_root) / f"{name}.bin")
            params = {"path": f"{name}.bin", "seq_len": 32, "eos": EOS, "pack": mode}
            admin.create_dataset(name, "tokens", params)
            out.append((name, docs, mode))
    return out


def _mixture(names: list[str], **epoch: Any) -> dict[str, Any]:
    return {
        "sources": [{"dataset": n, "weight": w} for n, w in zip(names, WEIGHTS, strict=True)],
        **epoch,
    }


def _read(server: Server, name: str, epochs: int) -> list[list[Any]]:
    out = []
    with Loader(name, socket=server.socket) as loader:
        for _ in range(epochs):
            out.append([_clone(b) for b in loader])
    return out


def _clone(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: v.clone() for k, v in batch.items()}
    return [t.clone() for t in batch]


def _reference(sources: list[Any], epochs: int, batch: int, **kwargs: Any) -> list[list[Any]]:
    mixture = Mixture(sources, WEIGHTS, seed=SEED, **kwargs.pop("mixture"))
    loader = TorchDataLoader(mixture, batch_size=batch, **kwargs)
    out = []
    for e in range(epochs):
        mixture.set_epoch(e)
        out.append(list(loader))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_loader_is_dataloader_over_pinfeed_mixture(
    admin: Client, server: Server, ids: list[str], workers: int
) -> None:
    name = unique("mix")
    admin.create_loader(
        name,
        dataset=None,
        mixture=_mixture(ids, samples=100),
        batch_size=8,
        shuffle=True,
        seed=SEED,
        num_workers=workers,
    )
    got = _read(server, name, 2)
    sources = [Ids(s, n) for s, n in enumerate(SIZES)]
    assert_same(got, _reference(sources, 2, 8, mixture={"samples": 100}))
    # the sources drawn are the rule's: the same at every num_workers
    rule = Mixture(sources, WEIGHTS, samples=100).mixing
    for e, batches in enumerate(got):
        drawn = torch.cat([b[0] for b in batches])[:, 0].numpy()
        assert np.array_equal(drawn, rule.choices(SEED, e))
    shown = admin.loader(name)["sources"]
    assert [s["dataset"] for s in shown] == ids
    assert sum(s["samples"] for s in shown) == 200
    assert [s["samples"] for s in shown] == np.bincount(
        np.concatenate([rule.choices(SEED, 0), rule.choices(SEED, 1)]), minlength=3
    ).tolist()
    line = (
        f'pinfeed_mixture_samples_total{{loader="{name}",dataset="{ids[0]}"}} {shown[0]["samples"]}'
    )
    # the metrics cache's body may be a render from before this loader's last batch
    wait_for(lambda: line in httpx.get(f"{server.url}/metrics").text, "the mixture's series")
    admin.delete_loader(name)


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_token_files_mixed_by_quota(
    admin: Client, server: Server, token_files: list[Any], workers: int
) -> None:
    names = [n for n, _, _ in token_files]
    name = unique("packed")
    admin.create_loader(
        name,
        dataset=None,
        mixture=_mixture(names, samples=40, rule="quota"),
        batch_size=4,
        shuffle=True,
        seed=SEED,
        num_workers=workers,
        collate_fn="pinfeed.packing:collate",
    )
    got = _read(server, name, 2)
    sources = [Packed(docs, 32, mode=mode, pad=EOS) for _, docs, mode in token_files]
    want = _reference(
        sources, 2, 4, mixture={"samples": 40, "rule": "quota"}, collate_fn=packing.collate
    )
    assert_same(got, want)
    shown = admin.loader(name)["sources"]
    assert [s["samples"] for s in shown] == [40, 24, 16]  # quota: exact, two epochs
    tokens = sum(int((b["labels"] != -100).sum()) for e in got for b in e)
    assert sum(s["tokens"] for s in shown) >= tokens  # real tokens (not padding)
    admin.delete_loader(name)


def test_resume_replay_and_a_new_weight_only_between_epochs(
    admin: Client, server: Server, ids: list[str]
) -> None:
    name = unique("mixr")
    fields: dict[str, Any] = {"batch_size": 6, "shuffle": True, "seed": SEED, "num_workers": 2}
    admin.create_loader(name, dataset=None, mixture=_mixture(ids, samples=90), **fields)
    whole = _read(server, name, 1)[0]
    with Loader(name, socket=server.socket) as loader:
        loader.set_epoch(0)
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
        assert_same(loader.replay(0, 2), whole[2])
    with Loader(name, socket=server.socket) as loader:
        loader.load_state_dict(state)
        assert_same([_clone(b) for b in loader], whole[4:])
    # other weights: refused inside an epoch, taken between two
    other = unique("mixw")
    mixture = _mixture(ids, samples=90)
    mixture["sources"][0]["weight"] = 0.9
    admin.create_loader(other, dataset=None, mixture=mixture, world_size=1, **fields)
    with Loader(other, socket=server.socket) as loader:
        sharded = loader.state_dict()
    admin.delete_loader(name)
    admin.create_loader(
        name, dataset=None, mixture=_mixture(ids, samples=90), world_size=1, **fields
    )
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        next(it)
        inside = loader.state_dict()
    with (
        Loader(other, socket=server.socket) as loader,
        pytest.raises(InvalidState, match="mixture"),
    ):
        loader.load_state_dict(inside)
    between = {**inside, "epoch": 1, "index": 0}
    with Loader(other, socket=server.socket) as loader:
        loader.load_state_dict(between)
        assert loader.state_dict()["epoch"] == 1
    assert sharded["plan"]["mixture"] != inside["plan"]["mixture"]
    admin.delete_loader(name)
    admin.delete_loader(other)


def test_elastic_resume_4_to_3_gives_each_position_once(
    admin: Client, server: Server, ids: list[str]
) -> None:
    batch, samples, epoch = 4, 96, 1
    mixture = _mixture(ids, samples=samples, rule="quota")  # 48/29/19: each sample once
    prefix = unique("mixe")

    def loaders(world: int) -> list[str]:
        names = [f"{prefix}-{world}-{r}" for r in range(world)]
        for r, n in enumerate(names):
            admin.create_loader(
                n,
                dataset=None,
                mixture=mixture,
                batch_size=batch,
                shuffle=True,
                seed=SEED,
                rank=r,
                world_size=world,
                num_workers=r % 2 * 2,
            )
        return names

    def samples_of(batches: list[Any]) -> list[tuple[int, int]]:
        return [tuple(row) for b in batches for row in b[0].tolist()]  # type: ignore[misc]

    before, states = [], []
    for name in loaders(4):
        with Loader(name, socket=server.socket) as loader:
            loader.set_epoch(epoch)
            it = iter(loader)
            before += samples_of([_clone(next(it)) for _ in range(2)])
            states.append(loader.state_dict())
            next(it)  # made and lost with the trainer
    merged = merge_states(states)
    after = []
    for name in loaders(3):
        with Loader(name, socket=server.socket) as loader:
            loader.load_state_dict(merged)
            loader.set_epoch(epoch)
            after += samples_of([_clone(b) for b in loader])
    sources = [Ids(s, n) for s, n in enumerate(SIZES)]
    ref = Mixture(sources, WEIGHTS, samples=samples, rule="quota", seed=SEED)
    ref.set_epoch(epoch)
    epoch_samples = Counter(ref.source(p) for p in range(samples))
    assert max(epoch_samples.values()) == 1  # every drawn sample distinct
    got = Counter(before + after)
    assert set(got) == set(epoch_samples)  # every sample of every source in the epoch
    assert sum(got.values()) - samples < 3  # once, but for DistributedSampler's padding
    # the 4 ranks' share was DistributedSampler's over the positions
    first = DistributedSampler(range(samples), 4, 0, shuffle=False)
    assert list(first)[:batch] == [0, 4, 8, 12]


def _post(server: Server, **fields: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/loaders", json={"name": unique("bad"), **fields})


def test_a_bad_mixture_is_a_problem(admin: Client, server: Server, ids: list[str]) -> None:
    src = [{"dataset": ids[0], "weight": 1}, {"dataset": ids[1], "weight": 1}]
    said = {
        "greater than 0": {"mixture": [{"dataset": ids[0], "weight": 0}]},
        "at least 1 item": {"mixture": []},
        "names each dataset once": {"mixture": [*src, src[0]]},
        "not one of the sources": {"mixture": {"sources": src, "until": ids[2]}},
        "colour": {"mixture": {"sources": src, "samples": 10, "colour": 1}},
        "not one of the mixture's": {"mixture": src, "dataset": ids[2]},
        "its own sampler": {"mixture": src, "sampler": {"factory": "m.o:d"}},
        # the rule: an epoch is samples or until, never neither
        "the epoch's length": {"mixture": src},
    }
    for words, fields in said.items():
        body = _problem(_post(server, **fields), 422, "invalid-request")
        assert words in str(body["detail"]), (fields, body)
    ghost = unique("ghost")
    body = _problem(
        _post(server, mixture=[*src, {"dataset": ghost, "weight": 1}]), 404, "not-found"
    )
    assert ghost in str(body["detail"])
    assert not any(ghost in str(row) for row in admin.loaders())  # nothing half-made
    # a packed token file needs its documents' end token
    params = {"path": "t.bin", "seq_len": 32, "pack": "greedy"}
    r = httpx.post(
        f"{server.url}/v1/datasets",
        json={"name": unique("tok"), "kind": "tokens", "params": params},
    )
    assert "eos" in str(_problem(r, 422, "invalid-request")["detail"])
    # a source a loader reads (not only its first) is not deleted under it
    name = unique("mixd")
    admin.create_loader(name, dataset=None, mixture={"sources": src[::-1], "samples": 10})
    body = _problem(httpx.delete(f"{server.url}/v1/datasets/{ids[0]}"), 409, "conflict")
    assert name in str(body["detail"])
    admin.delete_loader(name)
