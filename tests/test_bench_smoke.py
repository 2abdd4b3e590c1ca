"""``python -m bench W1 --quick``, ``python -m bench w4-profile --quick`` and ``python -m
bench llm --quick`` run end to end and write result files the report can read
(benchmarks that nothing runs rot); the llm benchmark's systems give the same batch.

It checks the files' shape, never how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import cells, results, tables
from tests.conftest import REPO


def _bench(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--out", str(tmp_path / "results")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.heavy  # the W1 benchmark, every system
# About a minute alone on 2 cores; the machine's other work can triple that.
@pytest.mark.timeout(900)
def test_suite_w1_quick(tmp_path: Path) -> None:
    _bench("W1", "--quick", "--data-dir", str(tmp_path / "data"), tmp_path=tmp_path)
    res = json.loads((tmp_path / "results" / "W1.json").read_text())
    assert res["name"] == "W1" and res["commit"]["sha"] and res["machine"]["cpus"]
    assert set(res["cells"]) == {
        "pinfeed",
        "pinfeed-dataloader",
        "pinfeed-dataloader-tuned",
        "pinfeed-python",
        "dataloader",
        "dataloader-tuned",
    }
    for system, by in res["cells"].items():
        assert set(by) == {"0", "2"}, system
        for nw, c in by.items():
            assert c["samples_per_s"]["n"] == 1 and c["samples_per_s"]["median"] > 0
            assert c["cpu_ms_per_ksample"]["median"] > 0, (system, nw)
    assert {r["system"] for r in res["handoff"]["runs"]} == set(res["cells"])
    assert all("share" in r["foreign"] for r in res["runs"])
    r = cells.Results(tmp_path / "results")
    assert "not yet measured" not in tables.headline(r, ["W1"])


@pytest.mark.timeout(300)
def test_w4_profile_quick(tmp_path: Path) -> None:
    _bench("w4-profile", "--quick", "--data-dir", str(tmp_path / "data"), tmp_path=tmp_path)
    res = results.load("w4-profile", tmp_path / "results")
    assert res is not None and res["pinfeed_cpu_us"] > 0 and res["dataloader_cpu_us"] > 0
    assert "CPU µs per batch" in tables.w4_profile(cells.Results(tmp_path / "results"), [])


@pytest.mark.heavy  # a store, a proxy and servers: two minutes on 2 cores
@pytest.mark.timeout(900)
def test_remote_quick(tmp_path: Path) -> None:
    """``python -m bench remote --quick``: every system and link measured, every object
    read once in the first epoch by pinfeed (the store counted by the proxy), the cache
    section under both rules, and the table the object-storage page shows."""
    _bench("remote", "--quick", "--data-dir", str(tmp_path / "data"), tmp_path=tmp_path)
    res = results.load("remote", tmp_path / "results")
    assert res is not None
    links = ("cloud", "unthrottled")
    systems = ("pinfeed", "dataloader-s3", "pinfeed-local")
    assert set(res["cells"]) == {f"{lk}/{s}" for lk in links for s in systems}
    for run in res["throughput"]["runs"]:
        assert all(x > 0 for x in run["epochs"]), run
        if run["system"] == "pinfeed-local":
            assert run["store_requests"] == 0
        elif run["system"] == "pinfeed":  # each object once, for both epochs
            assert res["dataset_bytes"] <= run["store_bytes"] < 1.05 * res["dataset_bytes"]
    assert set(res["cache"]["rules"]) == {"next-use", "lru"}
    shown = tables.remote(cells.Results(tmp_path / "results"), [])
    assert "pinfeed over the same files on local disk" in shown and "eviction rule" in shown


@pytest.mark.timeout(300)
def test_llm_systems_make_the_same_batches(tmp_path: Path) -> None:
    """What ``bench llm`` compares is like with like: a source's packed rows by HF's way
    (the datasets-side pack, then ``DataCollatorWithFlattening``; or made whole ahead)
    are pinfeed's (``Packed`` greedy, ``packing.collate``), batch for batch."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    from bench import llm
    from pinfeed import Packed, packing

    path = llm.generate(tmp_path, 0.01)[1]
    rows = llm.hf_rows(path)
    ours = Packed(llm.Documents(str(path)), llm.SEQ_LEN, mode="greedy")
    hf = datasets.load_from_disk(str(rows))
    whole = datasets.load_from_disk(str(llm.hf_rows_whole(rows))).with_format("torch")
    assert len(hf) == len(whole) == len(ours) >= 8
    for start in range(0, len(ours) - 3, 4):
        batch = packing.collate([ours[i] for i in range(start, start + 4)])
        for got in (
            llm.flatten_rows([hf[i] for i in range(start, start + 4)]),
            packing.collate([whole[i] for i in range(start, start + 4)]),
        ):
            assert got.keys() == batch.keys()
            for k, v in batch.items():
                assert torch.equal(got[k].to(v.dtype), v), k


@pytest.mark.heavy  # a server and ten trainer processes one after another
# About 80 s on 2 cores under a load of 12.
@pytest.mark.timeout(900)
def test_llm_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from bench import llm

    _bench("llm", "--quick", "--data-dir", str(tmp_path / "data"), tmp_path=tmp_path)
    res = results.load("llm", tmp_path / "results")
    assert res is not None and res["commit"]["sha"]
    assert set(res["cells"]) == {"0", "40"}
    assert [s["name"] for s in res["sources"]] == ["web", "code", "books"]
    assert sum(s["rows"] for s in res["sources"]) == res["epoch_samples"]
    for step, by in res["cells"].items():
        assert set(by) == set(llm.SYSTEMS), step
        for system, c in by.items():
            assert c["2"]["samples_per_s"]["n"] == 1 and c["2"]["samples_per_s"]["median"] > 0
            assert 0 <= c["2"]["stall_share"]["median"] <= 1, (step, system)
            assert c["2"]["trainer_cpu_ms_per_batch"]["median"] > 0, (step, system)
    text = tables.llm(cells.Results(tmp_path / "results"), [])
    assert "not yet measured" not in text and text.count("| 2 |") == 2 * len(llm.SYSTEMS)
